//! `store-bench`: how a rendezvous of N ranks fares through one store:
//! the time from the ranks' start to the last one past its first barrier,
//! and the serving process's peak RSS, threads and file descriptors.
//!
//! ```text
//! store-bench run --ranks N [--store ADDR] [--ranks-per-process K]
//!     one measurement; prints one JSON line. Without --store, rank 0 serves
//!     metrale's store (a child process, measured); with --store HOST:PORT,
//!     every rank (rank 0 too) is a client of that store (PyTorch's, say:
//!     benches/torch_store_bench.py starts one and measures it).
//! store-bench table --sizes 1024,4096,16384
//!     `run` at each size, then a markdown table.
//! ```
//!
//! Each rank is a real `TcpRendezvous` (as the `env://` path makes), one
//! thread each, in child processes of at most K ranks (4096): it connects,
//! takes rank 0's unique id (`exchange_id`) and passes a barrier, then a
//! second one; rank 0 serves until every child has said its ranks are
//! through ("exit" on its stdin: rank 0 passes its last barrier before
//! the others have heard it). The children start
//! their threads, then all are released at once ("go" on their stdin),
//! and each reports its ranks' latest time past the first barrier from
//! its release. The serving process samples its threads and descriptors
//! every 50 ms and reads its peak RSS (`VmHWM`) at the end.
//!
//! Build: `cargo build --release -p metrale-rendezvous --example store_bench`
//! (the store bundle of `cargo xtask store-bundle` carries it as
//! `store-bench`).

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use metrale_rendezvous::{ID_LEN, Rendezvous, TcpRendezvous};

const T: Duration = Duration::from_secs(300);
const USAGE: &str = "usage: store-bench run --ranks N [--store HOST:PORT] [--ranks-per-process K]
       store-bench table [--sizes 1024,4096,16384] [--store HOST:PORT]";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = real_main(&args) {
        eprintln!("store-bench: {e:#}");
        std::process::exit(1);
    }
}

fn value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn real_main(args: &[String]) -> Result<()> {
    let num = |flag: &str, default: usize| -> Result<usize> {
        value(args, flag).map_or(Ok(default), |v| {
            v.parse().with_context(|| format!("{flag} {v}"))
        })
    };
    let store = value(args, "--store")
        .map(|s| {
            s.parse::<SocketAddr>()
                .with_context(|| format!("--store {s}"))
        })
        .transpose()?;
    match args.first().map(String::as_str) {
        Some("run") => {
            let out = run(
                num("--ranks", 1024)?,
                store,
                num("--ranks-per-process", 4096)?,
            )?;
            println!("{out}");
        }
        Some("table") => {
            let sizes = value(args, "--sizes").unwrap_or("1024,4096,16384");
            let mut rows = Vec::new();
            for n in sizes.split(',') {
                let n: usize = n.trim().parse().with_context(|| format!("size {n}"))?;
                let r = run(n, store, 4096)?;
                eprintln!("{r}");
                rows.push(r);
            }
            print!("{}", table(&rows));
        }
        Some("serve") => serve(num("--ranks", 0)?, num("--port", 0)?)?,
        Some("ranks") => ranks(
            num("--ranks", 0)?,
            num("--from", 0)?,
            num("--to", 0)?,
            value(args, "--addr")
                .context("--addr")?
                .parse()
                .context("--addr")?,
            args.iter().any(|a| a == "--client-of-ours"),
        )?,
        _ => bail!("{USAGE}"),
    }
    Ok(())
}

/// One line of /proc/self/status, in its unit (kB for sizes).
fn status_field(name: &str) -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

fn fds_open() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// A child process speaking lines on stdin and stdout.
struct Kid {
    child: Child,
    stdin: ChildStdin,
    lines: std::io::Lines<BufReader<ChildStdout>>,
}

impl Kid {
    fn spawn(args: &[String]) -> Result<Kid> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("spawning a child")?;
        let stdin = child.stdin.take().context("stdin")?;
        let lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
        Ok(Kid {
            child,
            stdin,
            lines,
        })
    }

    fn line(&mut self) -> Result<String> {
        self.lines
            .next()
            .context("the child ended early")?
            .context("reading the child")
    }
}

/// One measurement of `n` ranks; a JSON line.
fn run(n: usize, store: Option<SocketAddr>, per_process: usize) -> Result<serde_json::Value> {
    ensure!(n >= 2, "--ranks must be at least 2");
    let per_process = per_process.max(1);
    let mut server = None;
    let (addr, first_client) = match store {
        Some(addr) => (addr, 0),
        None => {
            let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let mut kid = Kid::spawn(&[
                "serve".into(),
                "--ranks".into(),
                n.to_string(),
                "--port".into(),
                port.to_string(),
            ])?;
            ensure!(kid.line()? == "ready", "the serving rank did not start");
            server = Some(kid);
            (SocketAddr::from(([127, 0, 0, 1], port)), 1)
        }
    };
    let mut kids = Vec::new();
    let mut from = first_client;
    while from < n {
        let to = (from + per_process).min(n);
        let mut args: Vec<String> = [
            "ranks",
            "--ranks",
            &n.to_string(),
            "--from",
            &from.to_string(),
            "--to",
            &to.to_string(),
            "--addr",
            &addr.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if store.is_none() {
            args.push("--client-of-ours".into());
        }
        kids.push(Kid::spawn(&args)?);
        from = to;
    }
    for k in &mut kids {
        ensure!(k.line()? == "ready", "a child's ranks did not start");
    }
    let overflows_before = listen_overflows();
    for k in server.iter_mut().chain(kids.iter_mut()) {
        writeln!(k.stdin, "go")?;
        k.stdin.flush()?;
    }
    let mut slowest = 0f64;
    for k in &mut kids {
        let line = k.line()?;
        let secs: f64 = line
            .strip_prefix("done ")
            .with_context(|| format!("a child said {line:?}"))?
            .parse()?;
        slowest = slowest.max(secs);
    }
    let overflows = listen_overflows()
        .zip(overflows_before)
        .map(|(after, before)| after.saturating_sub(before));
    let mut out = serde_json::json!({
        "server": if store.is_some() { "external" } else { "metrale" },
        "ranks": n,
        "time_to_barrier_s": slowest,
        "listen_overflows": overflows,
        "somaxconn": std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok()),
    });
    if let Some(k) = &mut server {
        let line = k.line()?;
        // Every rank is through its last barrier (each child said so):
        // rank 0 may stop serving now, not before (a rank that set its key
        // may not yet have sent the wait rank 0's last set answers).
        writeln!(k.stdin, "exit")?;
        k.stdin.flush()?;
        let v: serde_json::Value =
            serde_json::from_str(line.trim()).context("the server's stats")?;
        if let (Some(o), Some(s)) = (out.as_object_mut(), v.as_object()) {
            o.extend(s.clone());
        }
        slowest = slowest.max(v["rank0_s"].as_f64().unwrap_or(0.0));
        out["time_to_barrier_s"] = serde_json::json!(slowest);
    }
    for k in server.iter_mut().chain(kids.iter_mut()) {
        let status = k.child.wait()?;
        ensure!(status.success(), "a child failed ({status})");
    }
    Ok(out)
}

/// The kernel's count of connections dropped at a full accept queue
/// (`TcpExt: ListenOverflows` in `/proc/net/netstat`, this network
/// namespace's): each costs its client a SYN sent again after 1 s, then
/// 3 s, whatever the server does.
fn listen_overflows() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/net/netstat").ok()?;
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (lines.next()?, lines.next()?);
    let at = names
        .split_whitespace()
        .position(|n| n == "ListenOverflows")?;
    values.split_whitespace().nth(at)?.parse().ok()
}

/// Rank 0 serving the store, measuring this process.
fn serve(n: usize, port: usize) -> Result<()> {
    let port = u16::try_from(port).context("--port")?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let rv = TcpRendezvous::new(0, n, addr, None, T)?;
    let base_rss = status_field("VmRSS:") << 10;
    let threads = Arc::new(AtomicUsize::new(0));
    let fds = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (threads, fds, stop) = (Arc::clone(&threads), Arc::clone(&fds), Arc::clone(&stop));
        std::thread::spawn(move || {
            while stop.load(Ordering::Acquire) == 0 {
                threads.fetch_max(status_field("Threads:"), Ordering::AcqRel);
                fds.fetch_max(fds_open(), Ordering::AcqRel);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    println!("ready");
    std::io::stdout().flush()?;
    let mut go = String::new();
    std::io::stdin().read_line(&mut go)?;
    let start = Instant::now();
    let mut make = || Ok([7u8; ID_LEN]);
    rv.exchange_id(0, &mut make, T)?;
    rv.barrier("first", T)?;
    let rank0_s = start.elapsed().as_secs_f64();
    let at_barrier = rv.store_stats().context("rank 0 serves")?;
    rv.barrier("last", T)?;
    stop.store(1, Ordering::Release);
    let _ = sampler.join();
    let peak_rss = status_field("VmHWM:") << 10;
    println!(
        "{}",
        serde_json::json!({
            "rank0_s": rank0_s,
            "base_rss_bytes": base_rss,
            "peak_rss_bytes": peak_rss,
            "threads_peak": threads.load(Ordering::Acquire),
            "fds_peak": fds.load(Ordering::Acquire),
            "connections_at_barrier": at_barrier.connections,
            "store_memory_at_barrier_bytes": at_barrier.memory_bytes,
        })
    );
    std::io::stdout().flush()?;
    // The store lives until the parent has heard every rank finish.
    let mut exit = String::new();
    std::io::stdin().read_line(&mut exit)?;
    drop(rv);
    Ok(())
}

/// Ranks `from..to`, one thread each, released by "go" on stdin.
fn ranks(n: usize, from: usize, to: usize, addr: SocketAddr, ours: bool) -> Result<()> {
    let gate = Arc::new(Barrier::new(to - from + 1));
    let threads: Vec<_> = (from..to)
        .map(|rank| {
            let gate = Arc::clone(&gate);
            std::thread::Builder::new()
                .stack_size(256 << 10)
                .spawn(move || -> Result<Instant> {
                    gate.wait();
                    let rv = if ours {
                        TcpRendezvous::new(rank, n, addr, None, T)?
                    } else {
                        TcpRendezvous::connect(rank, n, addr, None, "metrale/", T)?
                    };
                    let mut make = || Ok([7u8; ID_LEN]);
                    rv.exchange_id(0, &mut make, T)?;
                    rv.barrier("first", T)?;
                    let passed = Instant::now();
                    rv.barrier("last", T)?;
                    Ok(passed)
                })
                .context("spawning a rank")
        })
        .collect::<Result<_>>()?;
    println!("ready");
    std::io::stdout().flush()?;
    let mut go = String::new();
    std::io::stdin().read_line(&mut go)?;
    let start = Instant::now();
    gate.wait();
    let mut latest = start;
    let mut failed = Vec::new();
    for t in threads {
        match t.join().map_err(|_| anyhow::anyhow!("a rank panicked"))? {
            Ok(at) => latest = latest.max(at),
            Err(e) => failed.push(format!("{e:#}")),
        }
    }
    if let Some(first) = failed.first() {
        bail!(
            "{} of {} ranks failed; first: {first}",
            failed.len(),
            to - from
        );
    }
    println!("done {}", latest.duration_since(start).as_secs_f64());
    Ok(())
}

/// A markdown table of `run`'s lines.
fn table(rows: &[serde_json::Value]) -> String {
    let mut s = String::from(
        "| ranks | time to barrier | peak RSS (before the ranks) | threads | fds |\n|---|---|---|---|---|\n",
    );
    for r in rows {
        let mib = |k: &str| r[k].as_f64().unwrap_or(0.0) / f64::from(1u32 << 20);
        s.push_str(&format!(
            "| {} | {:.2} s | {:.0} MiB ({:.0} MiB) | {} | {} |\n",
            r["ranks"],
            r["time_to_barrier_s"].as_f64().unwrap_or(0.0),
            mib("peak_rss_bytes"),
            mib("base_rss_bytes"),
            r["threads_peak"],
            r["fds_peak"],
        ));
    }
    s
}
