//! `host-cost`: the per-operation cost the backend adds to NCCL on one GPU,
//! measured as issue #17's table is: a one-rank communicator, `--ops`
//! back-to-back all-reduces on a caller stream, timed with CUDA events on
//! that stream, the median of `--trials`, in one process against raw
//! `nccl_safe::Comm::all_reduce_raw` on the same device. Columns: raw NCCL,
//! raw plus one event record per operation, the backend's
//! `all_reduce_async` on blocking and on non-blocking communicators. A
//! second table times, on the host, each driver or NCCL call a submission
//! makes besides the operation itself (the floor the backend cannot go
//! under).
//!
//! Run on a GPU box: `host-cost [--trials 9] [--ops 2000] [--out FILE]`.
//! Without a driver it prints one line and exits 2.
//!
//! `host-cost --profile N [--nonblocking]` instead submits `N` 8-byte
//! `all_reduce_async` calls on one backend, 10 000 in flight at a time, and
//! prints the host time per call: the loop to run under `perf record` to
//! see where a submission's time goes (the submitting thread and the
//! watchdog).
//!
//! Invariant: every configuration is measured in the same process, on the
//! same device and stream kind, interleaved by trial, so machine drift
//! affects all columns alike.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use half::bf16;
use metrale_comm::{BackendConfig, CommBackend, EnqueueMode, FastPathPolicy, NcclBackend};
use nccl_safe::{
    Comm, Context, DataType, DeviceBuffer, DeviceViewMut, Event, ReduceOp, Stream, UniqueId,
};

const SIZES: [usize; 3] = [8, 64 << 10, 2 << 20];

fn main() -> anyhow::Result<()> {
    let mut trials = 9usize;
    let mut ops = 2000usize;
    let mut out: Option<String> = None;
    let mut profile: Option<usize> = None;
    let mut mode = EnqueueMode::Blocking;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--trials" => trials = args.next().context("--trials N")?.parse()?,
            "--ops" => ops = args.next().context("--ops N")?.parse()?,
            "--out" => out = Some(args.next().context("--out FILE")?),
            "--profile" => profile = Some(args.next().context("--profile N")?.parse()?),
            "--nonblocking" => mode = EnqueueMode::NonBlocking,
            other => anyhow::bail!("unknown argument {other}; see the module docs"),
        }
    }
    if let Err(e) = nccl_safe::device_count() {
        eprintln!("host-cost: no CUDA driver ({e})");
        std::process::exit(2);
    }
    let ctx = Context::new(0)?;
    if let Some(n) = profile {
        return profile_loop(&ctx, mode, n);
    }
    let report = run(&ctx, trials, ops)?;
    print!("{report}");
    if let Some(path) = out {
        std::fs::write(&path, &report).with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}

/// One measured configuration.
#[derive(Clone, Copy, PartialEq)]
enum Col {
    Raw,
    RawEvent,
    RawNonBlocking,
    Blocking,
    NonBlocking,
}

const COLS: [Col; 5] = [
    Col::Raw,
    Col::RawEvent,
    Col::RawNonBlocking,
    Col::Blocking,
    Col::NonBlocking,
];

fn backend(mode: EnqueueMode) -> anyhow::Result<NcclBackend> {
    let id = UniqueId::new()?;
    let cfg = BackendConfig::new(0)
        .with_enqueue(mode)
        .with_fast_path(FastPathPolicy::Never);
    Ok(NcclBackend::with_unique_id(cfg, &id, 0, 1)?)
}

fn run(ctx: &Arc<Context>, trials: usize, ops: usize) -> anyhow::Result<String> {
    let id = UniqueId::new()?;
    let raw = Comm::init_rank(ctx, &id, 1, 0)?;
    let id_nb = UniqueId::new()?;
    let raw_nb = Comm::init_rank_with_deadline(ctx, &id_nb, 1, 0, Duration::from_secs(60))?;
    let blocking = backend(EnqueueMode::Blocking)?;
    let nonblocking = backend(EnqueueMode::NonBlocking)?;
    let stream = Stream::new(ctx)?;
    let (start, stop) = (Event::new(ctx, true)?, Event::new(ctx, true)?);
    let marker = Event::new(ctx, false)?;
    let mut buf = DeviceBuffer::<bf16>::alloc(ctx, SIZES[2] / 2)?;
    let mut table = String::new();
    writeln!(
        table,
        "| payload | raw NCCL | raw + one event record per op | raw, non-blocking communicator | backend, blocking | backend, non-blocking | blocking - raw | non-blocking - raw non-blocking |"
    )?;
    writeln!(table, "|---|---:|---:|---:|---:|---:|---:|---:|")?;
    for bytes in SIZES {
        let n = bytes / 2;
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); COLS.len()];
        for _ in 0..trials {
            for (ci, col) in COLS.iter().enumerate() {
                stream.wait_until_idle(Duration::from_secs(60))?;
                start.record(&stream)?;
                for _ in 0..ops {
                    let view = buf.view_mut();
                    let view = view_prefix(view, n);
                    match col {
                        Col::Raw | Col::RawEvent | Col::RawNonBlocking => {
                            let comm = if *col == Col::RawNonBlocking {
                                &raw_nb
                            } else {
                                &raw
                            };
                            // SAFETY: `view` lies inside `buf`, device memory of
                            // `ctx`; the stream is live.
                            unsafe {
                                comm.all_reduce_raw(
                                    view.ptr(),
                                    view.ptr(),
                                    n,
                                    DataType::Bfloat16,
                                    ReduceOp::Sum,
                                    stream.raw(),
                                )?
                            };
                            if *col == Col::RawEvent {
                                marker.record(&stream)?;
                            }
                        }
                        Col::Blocking => blocking.all_reduce_async(view, stream.as_ref())?,
                        Col::NonBlocking => nonblocking.all_reduce_async(view, stream.as_ref())?,
                    }
                }
                stop.record(&stream)?;
                stop.wait_with_deadline(Duration::from_secs(60))?;
                let us = stop.elapsed_ms(&start)? as f64 * 1000.0 / ops as f64;
                samples[ci].push(us);
            }
        }
        let med: Vec<f64> = samples.iter_mut().map(|s| median(s)).collect();
        writeln!(
            table,
            "| {} | {:.2} µs | {:.2} µs | {:.2} µs | {:.2} µs | {:.2} µs | {:+.2} µs | {:+.2} µs |",
            size_name(bytes),
            med[0],
            med[1],
            med[2],
            med[3],
            med[4],
            med[3] - med[0],
            med[4] - med[2]
        )?;
    }
    blocking.synchronize()?;
    nonblocking.synchronize()?;
    writeln!(table)?;
    writeln!(table, "{}", floor(ctx, &raw, &stream, &marker)?)?;
    blocking.shutdown()?;
    nonblocking.shutdown()?;
    Ok(table)
}

/// `n` submissions of 8 bytes on one backend, 10 000 in flight at a time.
fn profile_loop(ctx: &Arc<Context>, mode: EnqueueMode, n: usize) -> anyhow::Result<()> {
    const IN_FLIGHT: usize = 10_000;
    let backend = backend(mode)?;
    let stream = Stream::new(ctx)?;
    let mut buf = DeviceBuffer::<bf16>::alloc(ctx, 4)?;
    let mut host = Duration::ZERO;
    let mut done = 0;
    while done < n {
        let batch = IN_FLIGHT.min(n - done);
        let t = Instant::now();
        for _ in 0..batch {
            backend.all_reduce_async(buf.view_mut(), stream.as_ref())?;
        }
        host += t.elapsed();
        done += batch;
        stream.wait_until_idle(Duration::from_secs(600))?;
    }
    backend.synchronize()?;
    backend.shutdown()?;
    println!(
        "{n} submissions, {:.3} µs of host time each",
        host.as_secs_f64() * 1e6 / n as f64
    );
    Ok(())
}

/// Host time of each call a submission makes besides the operation.
fn floor(ctx: &Arc<Context>, raw: &Comm, stream: &Stream, ev: &Event) -> anyhow::Result<String> {
    const N: usize = 20_000;
    let time = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..N {
                f()?;
            }
            best = best.min(t.elapsed().as_secs_f64() * 1e6 / N as f64);
        }
        Ok(best)
    };
    let handle = raw.abort_handle();
    let record = time(&mut || Ok(ev.record(stream)?))?;
    stream.wait_until_idle(Duration::from_secs(60))?;
    let capturing = time(&mut || {
        stream.is_capturing()?;
        Ok(())
    })?;
    let async_err = time(&mut || Ok(handle.async_error()?))?;
    let query = time(&mut || {
        ev.query()?;
        Ok(())
    })?;
    let _ = ctx;
    let mut s = String::new();
    writeln!(s, "| call a submission makes | host µs per call |")?;
    writeln!(s, "|---|---:|")?;
    writeln!(
        s,
        "| `cuEventRecord` (the completion event) | {record:.3} |"
    )?;
    writeln!(
        s,
        "| `cuStreamIsCapturing` (caller streams: graph capture?) | {capturing:.3} |"
    )?;
    writeln!(
        s,
        "| `ncclCommGetAsyncError` (the watchdog, per tick, and each wait) | {async_err:.3} |"
    )?;
    writeln!(
        s,
        "| `cuEventQuery` (the watchdog, off the submitting thread) | {query:.3} |"
    )?;
    writeln!(
        s,
        "\nfloor per submission (record + capture query): {:.3} µs",
        record + capturing
    )?;
    Ok(s)
}

fn view_prefix(v: DeviceViewMut<'_>, n: usize) -> DeviceViewMut<'_> {
    // SAFETY: the first `n` elements of a view lie inside it.
    unsafe { DeviceViewMut::from_raw(v.ptr(), n.min(v.len()), v.dtype()) }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn size_name(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}
