//! `cargo bench -p metrale-benches --bench collectives`: every
//! `CommBackend` operation that moves data next to the raw NCCL call
//! beside it (nccl-safe's `Comm`), as criterion groups, eager and under
//! CUDA graph replay, and the 2-rank all-reduce paths for the crossover.
//!
//! Ranks are threads of this process, one GPU each (world = the number of
//! GPUs, or `METRALE_BENCH_GPUS`); rank 0 drives criterion and the others
//! run exactly the iterations it asks for ([`team`]). Each iteration count
//! is timed with CUDA events on the stream the work runs on
//! (`iter_custom`, [`rank`]). The groups and sizes are in [`plan`]; the
//! tables come from criterion's estimates afterwards (`bench-tables`,
//! [`crate::tables`]).
//!
//! Environment:
//! - `METRALE_BENCH_QUICK=1`: smoke-test sizes (8 B to 128 KiB) and
//!   criterion times of a few hundred milliseconds per benchmark; the CPU
//!   emulator runs the whole bench this way.
//! - `METRALE_BENCH_GPUS=N`: use the first N GPUs.
//! - `METRALE_BENCH_ENQUEUE=blocking|nonblocking`: the backends' enqueue
//!   mode (default: the backend's default).
//!
//! Invariants:
//! - Without a CUDA driver, with fewer GPUs than asked for, or without a
//!   usable NCCL, it prints one line on stdout and exits 0, before
//!   criterion starts, so `cargo bench --workspace` passes on any machine.
//! - Criterion's defaults here (1 s warm-up, 2 s measurement, 50 samples;
//!   20 flat samples for sizes from 2 MiB) are set before its command line
//!   is read, so `--warm-up-time`, `--measurement-time`, `--sample-size`,
//!   `--save-baseline`, `--baseline` and a filter apply as usual.
//! - Rank 0 writes [`crate::tables::RUN_INFO`] into criterion's directory
//!   before the first benchmark, and criterion writes there too (the same
//!   directory, chosen once).
//! - A failed run is fatal: the communicators are aborted and the process
//!   exits 1 (criterion keeps what it already wrote).

pub mod plan;
pub mod rank;
pub mod team;

use std::time::Duration;

use anyhow::Context as _;
use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use metrale_comm::EnqueueMode;
use nccl_safe::UniqueId;

use crate::tables::{RunInfo, criterion_dir};
use plan::{Caps, Group, Range, Sizes};
use rank::{Rank, Setup};
use team::{Team, WAIT};

/// The bench's name, the prefix of every line it prints.
pub const NAME: &str = "collectives";

/// The environment's settings.
#[derive(Debug, Clone)]
struct Knobs {
    quick: bool,
    gpus: Option<usize>,
    enqueue: EnqueueMode,
}

fn knobs() -> anyhow::Result<Knobs> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    Ok(Knobs {
        quick: var("METRALE_BENCH_QUICK").is_some_and(|v| v != "0"),
        gpus: var("METRALE_BENCH_GPUS")
            .map(|v| v.parse::<usize>().context("METRALE_BENCH_GPUS"))
            .transpose()?,
        enqueue: match var("METRALE_BENCH_ENQUEUE") {
            Some(v) => {
                EnqueueMode::parse(&v).map_err(|e| anyhow::anyhow!("METRALE_BENCH_ENQUEUE: {e}"))?
            }
            None => EnqueueMode::default(),
        },
    })
}

/// Runs the bench; the process's exit code.
pub fn main() -> i32 {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    match run() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{NAME}: {e:#}");
            1
        }
    }
}

/// A loopback address whose port was free a moment ago (rank 0 binds it for
/// the one-shot backend's store).
fn free_loopback_port() -> std::io::Result<std::net::SocketAddr> {
    std::net::TcpListener::bind(("127.0.0.1", 0))?.local_addr()
}

fn run() -> anyhow::Result<()> {
    let knobs = knobs()?;
    let count = match nccl_safe::device_count() {
        Ok(n) => n,
        Err(e) => {
            println!("{NAME}: no CUDA driver ({e}); nothing to measure");
            return Ok(());
        }
    };
    let world = knobs.gpus.unwrap_or(count).max(1);
    if count < world {
        println!("{NAME}: needs {world} GPU(s), {count} visible; nothing to measure");
        return Ok(());
    }
    // The raw communicator and `Never` backend, and on 2 ranks the path
    // sweep's `Always` and default backends.
    let n_ids = if world == 2 { 4 } else { 2 };
    let ids = match (0..n_ids)
        .map(|_| UniqueId::new())
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(ids) => ids,
        Err(e) => {
            println!("{NAME}: NCCL is not usable ({e}); nothing to measure");
            return Ok(());
        }
    };
    let nccl = nccl_safe::nccl_version().unwrap_or_else(|e| format!("(unknown: {e})"));
    let caps = Caps {
        world,
        nccl_all_to_all: nccl_sys::nccl().is_ok_and(|l| l.version() >= 22800),
    };
    let sizes = if knobs.quick {
        Sizes::quick()
    } else {
        Sizes::full()
    };
    let groups = plan::groups(caps, &sizes);
    let max_bytes = groups
        .iter()
        .flat_map(|g| g.shapes.iter().map(|s| s.bytes))
        .max()
        .unwrap_or(8);
    let gpus: Vec<String> = (0..world)
        .map(|d| nccl_safe::device_info(d).map_or_else(|e| format!("({e})"), |i| i.name))
        .collect();
    println!(
        "{NAME}: {world} rank(s) on {} of {count} GPU(s), NCCL {nccl}, backends {:?}{}",
        gpus.join(", "),
        knobs.enqueue,
        if knobs.quick { ", quick" } else { "" }
    );
    let store = |which: &str| match free_loopback_port() {
        Ok(addr) => Ok(Some(addr)),
        Err(e) => {
            println!("{NAME}: no loopback port for the {which} backend's store ({e})");
            Err(())
        }
    };
    let (one_shot_store, default_store) = match (world >= 2, world == 2) {
        (false, _) => (None, None),
        (true, two) => {
            let Ok(one_shot) = store("one-shot") else {
                return Ok(());
            };
            let default = if two {
                let Ok(d) = store("default") else {
                    return Ok(());
                };
                d
            } else {
                None
            };
            (one_shot, default)
        }
    };
    let setup = Setup {
        world,
        ids,
        enqueue: knobs.enqueue,
        max_bytes,
        one_shot_store,
        default_store,
    };
    // Joining up to five communicators, each within WAIT, and the checks.
    let mut team = Team::start(world, 5 * WAIT, move |r| Rank::new(r, &setup))?;
    let dir = criterion_dir();
    let info = RunInfo {
        world,
        gpus,
        nccl,
        enqueue: format!("{:?}", knobs.enqueue),
        quick: knobs.quick,
        started_unix: RunInfo::now_unix(),
        tuned: team.rank0().map(Rank::tuned).unwrap_or_default(),
    };
    if let Err(e) = info.write(&dir) {
        team.abort();
        return Err(e);
    }
    let mut c = criterion(&dir, knobs.quick).configure_from_args();
    let sample_size_given = std::env::args().any(|a| a.starts_with("--sample-size"));
    for g in &groups {
        bench_group(&mut c, &mut team, g, knobs.quick, sample_size_given);
    }
    c.final_summary();
    team.stop(WAIT)?;
    Ok(())
}

/// Criterion with this bench's defaults, writing to `dir`.
fn criterion(dir: &std::path::Path, quick: bool) -> Criterion {
    let c = Criterion::default().output_directory(dir);
    if quick {
        c.warm_up_time(Duration::from_millis(20))
            .measurement_time(Duration::from_millis(100))
            .sample_size(10)
            .nresamples(2000)
    } else {
        c.warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(2))
            .sample_size(50)
    }
}

/// Runs one group: every size, every function.
fn bench_group(
    c: &mut Criterion,
    team: &mut Team<Rank>,
    g: &Group,
    quick: bool,
    sample_size_given: bool,
) {
    let mut cg = c.benchmark_group(&g.name);
    if g.range == Range::Large {
        cg.sampling_mode(SamplingMode::Flat);
        if !quick && !sample_size_given {
            cg.sample_size(20);
        }
    }
    for &shape in &g.shapes {
        if g.range != Range::Fixed {
            cg.throughput(Throughput::BytesDecimal(shape.bytes as u64));
        }
        for &(function, imp) in &g.functions {
            let case = g.case(imp, shape);
            let mut routine = |b: &mut criterion::Bencher<'_>| {
                b.iter_custom(|iters| match team.time(&case, iters) {
                    Ok(d) => d,
                    Err(e) => {
                        eprintln!("{NAME}: {}/{function}: {e:#}", g.name);
                        team.abort();
                        std::process::exit(1);
                    }
                })
            };
            if g.range == Range::Fixed {
                cg.bench_function(function, &mut routine);
            } else {
                cg.bench_function(BenchmarkId::new(function, shape.bytes), &mut routine);
            }
        }
    }
    cg.finish();
}
