//! `comm-suite tune` (and `cargo xtask tune`): the path tuner's table on
//! this machine's GPUs (or the emulator's), one rank per GPU as threads of
//! this process, in nccl-tests-like columns, with what the tuner costs a
//! set-up: the same world built with the tuner timing (no cache), with its
//! cached table, and with the same paths set up by fixed ranges (no
//! tuner), three rounds interleaved, each timed
//! from the constructor's call to its return on the slowest rank.
//!
//! Invariant: every backend is shut down before the next configuration is
//! built; every wait is the backend's own (bounded by its init deadline).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use metrale_comm::rendezvous::FileRendezvous;
use metrale_comm::{BackendConfig, CommBackend, NcclBackend, PathTable, TuneCache};

/// One world built with `config`: the slowest rank's set-up time and rank
/// 0's table.
fn build(
    world: usize,
    dir: &std::path::Path,
    config: impl Fn(usize) -> BackendConfig + Send + Sync,
) -> anyhow::Result<(Duration, Option<PathTable>)> {
    std::fs::create_dir_all(dir)?;
    let config = Arc::new(config);
    let out: Vec<anyhow::Result<(Duration, Option<PathTable>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let config = Arc::clone(&config);
                s.spawn(move || -> anyhow::Result<(Duration, Option<PathTable>)> {
                    let rdzv = FileRendezvous::new(rank, world, dir.to_path_buf())?;
                    let t = Instant::now();
                    let b = NcclBackend::new(config(rank), Box::new(rdzv))
                        .with_context(|| format!("rank {rank}'s backend"))?;
                    let took = t.elapsed();
                    let table = b.path_table();
                    b.shutdown()?;
                    Ok((took, table))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))
            })
            .collect()
    });
    let mut slowest = Duration::ZERO;
    let mut table = None;
    for (rank, r) in out.into_iter().enumerate() {
        let (took, t) = r?;
        slowest = slowest.max(took);
        if rank == 0 {
            table = t;
        }
    }
    Ok((slowest, table))
}

/// Prints the table and the set-up times for `gpus` ranks (all GPUs when
/// `None`).
pub fn run(gpus: Option<usize>, emulator: bool) -> anyhow::Result<i32> {
    if emulator {
        crate::emu::EmuControl::install().map_err(anyhow::Error::msg)?;
    }
    let count = nccl_safe::device_count().context("the CUDA driver")?;
    let world = gpus.unwrap_or(count).min(count).max(1);
    let root: PathBuf =
        std::env::temp_dir().join(format!("comm-suite-tune-{}", std::process::id()));
    let cache = root.join("cache");
    let base = |tune: bool, cache: TuneCache| {
        move |rank: usize| {
            let c = BackendConfig::new(rank)
                .with_tune_cache(cache.clone())
                .without_env_overrides();
            if tune {
                c
            } else {
                // The same paths set up, by fixed ranges: no tuner.
                c.with_one_shot(crate::ONE_SHOT_TO_1M)
                    .with_fast_path(crate::FAST_PATH_WINDOW)
            }
        }
    };
    let device = nccl_safe::device_info(0).map_or_else(|e| format!("? ({e})"), |d| d.name);
    println!("# comm-suite tune: {world} rank(s) on {device}");
    // The cache is written once; then three rounds, interleaved, of each
    // configuration (the machine's noise moves them alike).
    let (_, table) = build(
        world,
        &root.join("seed"),
        base(true, TuneCache::Dir(cache.clone())),
    )?;
    let mut times: [Vec<Duration>; 3] = Default::default();
    for round in 0..3 {
        let at = |what: &str| root.join(format!("{what}-{round}"));
        times[0].push(build(world, &at("timed"), base(true, TuneCache::Off))?.0);
        times[1].push(
            build(
                world,
                &at("cached"),
                base(true, TuneCache::Dir(cache.clone())),
            )?
            .0,
        );
        times[2].push(build(world, &at("off"), base(false, TuneCache::Off))?.0);
    }
    let [timed, cached, off] = times.map(|mut t| {
        t.sort();
        t
    });
    match &table {
        Some(t) => print!("{t}"),
        None => println!(
            "# no table: nothing to tune at {world} rank(s) (the tuner serves 2-8 ranks of one \
             host with a path besides NCCL's)"
        ),
    }
    let ms = |t: &[Duration]| {
        t.iter()
            .map(|d| format!("{:.1}", d.as_secs_f64() * 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "# set-up of the slowest rank, ms, three rounds (sorted): tuner timing {}; \
         cached table {}; the same paths by fixed ranges, no tuner {}",
        ms(&timed),
        ms(&cached),
        ms(&off)
    );
    let _ = std::fs::remove_dir_all(&root);
    Ok(0)
}
