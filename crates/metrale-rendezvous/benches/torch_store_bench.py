#!/usr/bin/env python3
"""The rendezvous store at 1,024, 4,096 and 16,384 ranks: metrale's server
beside PyTorch's TCPStore server (libuv; --legacy adds the legacy one).

    torch_store_bench.py STORE_BENCH [--sizes 1024,4096,16384] [--repeat N] [--legacy] [--out FILE]

STORE_BENCH is the `store_bench` example (cargo build --release -p
metrale-rendezvous --example store_bench; the store bundle of `cargo xtask
store-bundle` carries it as `store-bench`). For each size it runs, in turn:
- metrale: `store-bench run --ranks N` (rank 0 serves metrale's store in
  a process that measures itself);
- torch-libuv: a child Python process serving
  `torch.distributed.TCPStore(is_master=True, use_libuv=True)` (its soft
  file-descriptor limit raised to the hard one, as metrale's server raises
  its own), measuring itself every 50 ms, while `store-bench run --ranks N
  --store HOST:PORT` runs the same ranks as its clients (rank 0 too, as
  under torchrun).
Each rank is metrale's TcpRendezvous: it connects, takes rank 0's unique id
and passes a barrier (rank 0 waits for every rank's key, then sets one key
every other rank waits for). Time to barrier: from the ranks' release to
the last one past the barrier. RSS, threads and descriptors are the
serving process's: peak RSS (VmHWM) and the RSS before the ranks came.
Accept-queue drops: the kernel's ListenOverflows over the run (connections
dropped at a full accept queue, each retried by its client's kernel after
1 s, then 3 s), with net.core.somaxconn, the queue's bound. Without torch,
only metrale's rows are run. Prints a markdown table.

--repeat N (default 1) runs each size N times, the servers interleaved
and their order alternated from one round to the next (the box's drift
and the order's cost fall on both alike); the table then gives each
server's median time to barrier with the range of its N runs, and the
other columns of its median run. Every run's JSON line follows the table.
"""

import json
import os
import resource
import subprocess
import sys
import threading
import time


def server_child():
    """Serves a torch store and measures this process until stdin closes."""
    from datetime import timedelta

    import torch.distributed as dist

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    libuv = sys.argv[2] == "libuv"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=300), use_libuv=libuv)
    peak = {"threads": 0, "fds": 0}
    stop = threading.Event()

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
        return 0

    def sample():
        while not stop.is_set():
            peak["threads"] = max(peak["threads"], status("Threads:"))
            peak["fds"] = max(peak["fds"], len(os.listdir("/proc/self/fd")))
            time.sleep(0.05)

    base = status("VmRSS:") * 1024
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    print(store.port, flush=True)
    sys.stdin.read()
    stop.set()
    t.join()
    print(json.dumps({
        "base_rss_bytes": base,
        "peak_rss_bytes": status("VmHWM:") * 1024,
        "threads_peak": peak["threads"],
        "fds_peak": peak["fds"],
        "fd_limit": [soft, hard],
    }), flush=True)


def run_metrale(bench, n):
    out = subprocess.run([bench, "run", "--ranks", str(n)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_torch(bench, n, backend):
    child = subprocess.Popen([sys.executable, __file__, "--serve", backend],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(child.stdout.readline())
    try:
        out = subprocess.run([bench, "run", "--ranks", str(n), "--store", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=900)
    finally:
        child.stdin.close()
    stats = json.loads(child.stdout.readline())
    child.wait(timeout=60)
    if out.returncode != 0:
        return dict(stats, error=out.stderr.strip().splitlines()[-1:] or ["failed"])
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row.update(stats)
    return row


def medians(rows):
    """One row per (ranks, server): its median run by time to barrier, with
    `runs` (how many) and `range_s` (the fastest and slowest run) added; a
    failed run keeps its own row."""
    groups = {}
    for r in rows:
        groups.setdefault((r["ranks"], r["server"]), []).append(r)
    out = []
    for (_, _), runs in groups.items():
        ok = sorted((r for r in runs if "time_to_barrier_s" in r),
                    key=lambda r: r["time_to_barrier_s"])
        out.extend(r for r in runs if "time_to_barrier_s" not in r)
        if ok:
            mid = dict(ok[(len(ok) - 1) // 2])
            mid["runs"] = len(ok)
            mid["range_s"] = [ok[0]["time_to_barrier_s"], ok[-1]["time_to_barrier_s"]]
            out.append(mid)
    return out


def table(rows):
    lines = ["| ranks | server | time to barrier | peak RSS (before the ranks) | threads | fds "
             "| accept-queue drops (somaxconn) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        mib = lambda k: r.get(k, 0) / (1 << 20)
        t = f"{r['time_to_barrier_s']:.2f} s" if "time_to_barrier_s" in r else f"failed: {r.get('error')}"
        if r.get("runs", 1) > 1:
            lo, hi = r["range_s"]
            t += f" (median of {r['runs']}: {lo:.2f}-{hi:.2f})"
        lines.append(f"| {r['ranks']} | {r['server']} | {t} | {mib('peak_rss_bytes'):.0f} MiB "
                     f"({mib('base_rss_bytes'):.0f} MiB) | {r.get('threads_peak')} | {r.get('fds_peak')} "
                     f"| {r.get('listen_overflows')} ({r.get('somaxconn')}) |")
    return "\n".join(lines) + "\n"


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--serve":
        server_child()
        return 0
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print(__doc__)
        return 2
    bench = os.path.abspath(sys.argv[1])
    args = sys.argv[2:]
    sizes = [1024, 4096, 16384]
    out = None
    if "--sizes" in args:
        sizes = [int(x) for x in args[args.index("--sizes") + 1].split(",")]
    if "--out" in args:
        out = args[args.index("--out") + 1]
    repeat = int(args[args.index("--repeat") + 1]) if "--repeat" in args else 1
    if repeat < 1:
        print("--repeat takes a count of at least 1", file=sys.stderr)
        return 2
    backends = ["libuv"] + (["legacy"] if "--legacy" in args else [])
    try:
        import torch
        version = torch.__version__
    except ImportError:
        version = None
        print("torch is not installed here: only metrale's rows", file=sys.stderr)
    rows = []
    for n in sizes:
        for i in range(repeat):
            servers = ["metrale"] + (backends if version else [])
            if i % 2 == 1:
                servers.reverse()
            for b in servers:
                if b == "metrale":
                    row = run_metrale(bench, n)
                else:
                    row = run_torch(bench, n, b)
                    row["server"] = f"torch {version} {b}"
                    row["ranks"] = n
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    text = table(medians(rows) if repeat > 1 else rows)
    print(text, end="")
    if out:
        with open(out, "w") as f:
            f.write(text)
            f.write("\n" + "\n".join(json.dumps(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
