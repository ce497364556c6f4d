#!/usr/bin/env python3
"""A Rust process and a PyTorch process sharing one c10d store, both ways
round: the driver of the `torch_interop` example.

    torch_interop.py TOOL [OUT_FILE]

TOOL is the built example (cargo build --release -p metrale-rendezvous
--example torch_interop; the store bundle of `cargo xtask store-bundle`
carries it). Two directions, each its own store:
1. rust-serves: `TOOL serve` serves metrale's store and prints its port;
   a torch.distributed.TCPStore client (is_master=False) connects to it.
2. torch-serves: torch.distributed.TCPStore(is_master=True, libuv) serves;
   `TOOL connect 127.0.0.1:PORT` is its client.
In each, the two sides run the same exchange at once (the Rust half is
in torch_interop.rs): greetings set and read across, a barrier of two
(add + wait), a compare_set race for "leader" that exactly one side wins
and both read alike, and a message each way through the store's queues.
Every answer is checked on both sides. Writes the report to OUT_FILE (and
stdout); exits 1 if a check failed. Needs torch with queue_push (2.11).
"""

import subprocess
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=30)


def torch_side(s, result):
    """The torch half of the exchange on store client `s`; fills `result`."""
    try:
        s.set("torch/greeting", "hello from torch")
        result["greeting"] = bytes(s.get("rust/greeting"))
        if s.add("arrived", 1) == 2:
            s.set("all_arrived", "1")
        s.wait(["all_arrived"])
        result["barrier"] = True
        s.compare_set("leader", "", "torch")
        result["leader"] = bytes(s.get("leader"))
        s.queue_push("to_rust", "job from torch")
        result["queue"] = bytes(s.queue_pop("to_torch", True))
    except Exception as e:  # reported, not raised: the driver checks result
        result["error"] = f"{type(e).__name__}: {e}"


def rust_lines(text):
    """The Rust side's `name value` lines as a dict."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        out[name] = value
    return out


def check(direction, torch_result, rust_out, rust_code, lines):
    """Appends PASS/FAIL lines; returns the number of failures."""
    rust = rust_lines(rust_out)
    checks = [
        ("rust exited 0", rust_code == 0, f"exit {rust_code}"),
        ("torch side raised nothing", "error" not in torch_result, torch_result.get("error")),
        ("torch read rust's greeting", torch_result.get("greeting") == b"hello from rust",
         torch_result.get("greeting")),
        ("rust read torch's greeting", rust.get("greeting") == "hello from torch",
         rust.get("greeting")),
        ("both passed the barrier", torch_result.get("barrier") and "barrier" in rust, rust_out),
        ("one leader, the same on both sides",
         torch_result.get("leader") in (b"rust", b"torch")
         and rust.get("leader") == (torch_result.get("leader") or b"").decode(),
         f"torch read {torch_result.get('leader')!r}, rust {rust.get('leader')!r}"),
        ("torch popped rust's message", torch_result.get("queue") == b"job from rust",
         torch_result.get("queue")),
        ("rust popped torch's message", rust.get("queue") == "job from torch", rust.get("queue")),
        ("rust finished", "ok" in rust, rust_out),
    ]
    failed = 0
    for name, ok, got in checks:
        if ok:
            lines.append(f"PASS {direction}: {name}")
        else:
            failed += 1
            lines.append(f"FAIL {direction}: {name} (got {got!r})")
    return failed


def rust_serves(tool, lines):
    rust = subprocess.Popen([tool, "serve", "--bind", HOST], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = rust.stdout.readline()
    if not first.startswith("listening "):
        rust.kill()
        lines.append(f"FAIL rust-serves: no port from `{tool} serve` (got {first!r})")
        return 1
    port = int(first.split()[1])
    lines.append(f"INFO rust-serves: metrale's store on {HOST}:{port}")
    s = dist.TCPStore(HOST, port, is_master=False, timeout=TIMEOUT)
    result = {}
    torch_side(s, result)
    s.set("torch/bye", "1")
    try:
        out, err = rust.communicate(timeout=TIMEOUT.total_seconds())
    except subprocess.TimeoutExpired:
        rust.kill()
        out, err = rust.communicate()
    if err.strip():
        lines.append(f"INFO rust-serves: rust's stderr: {err.strip()[:500]}")
    return check("rust-serves", result, first + out, rust.returncode, lines)


def torch_serves(tool, lines):
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                           timeout=TIMEOUT, use_libuv=True)
    lines.append(f"INFO torch-serves: torch's libuv store on {HOST}:{server.port}")
    rust = subprocess.Popen([tool, "connect", f"{HOST}:{server.port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    result = {}
    t = threading.Thread(target=torch_side,
                         args=(dist.TCPStore(HOST, server.port, is_master=False,
                                             timeout=TIMEOUT), result))
    t.start()
    try:
        out, err = rust.communicate(timeout=TIMEOUT.total_seconds() * 2)
    except subprocess.TimeoutExpired:
        rust.kill()
        out, err = rust.communicate()
    t.join(timeout=TIMEOUT.total_seconds())
    if err.strip():
        lines.append(f"INFO torch-serves: rust's stderr: {err.strip()[:500]}")
    failed = check("torch-serves", result, out, rust.returncode, lines)
    # The Rust side's last word, set on torch's store.
    try:
        server.wait(["rust/bye"], timedelta(seconds=5))
        lines.append("PASS torch-serves: rust/bye set on torch's store")
    except Exception as e:
        failed += 1
        lines.append(f"FAIL torch-serves: rust/bye ({type(e).__name__}: {e})")
    return failed


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    tool = sys.argv[1]
    out_path = sys.argv[2] if len(sys.argv) > 2 else None
    lines = [f"torch {torch.__version__}; the Rust side: {tool}"]
    failed = rust_serves(tool, lines) + torch_serves(tool, lines)
    lines.append(f"{sum(l.startswith('PASS') for l in lines)} passed, {failed} failed")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
