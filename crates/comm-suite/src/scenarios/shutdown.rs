//! A healthy shutdown releases everything (`int_shutdown_healthy`), the
//! counterpart of `rel_dead_peer`: on NCCL's path, with the one-shot path
//! on (`Always`) and with the tuned defaults (`Auto`, which may take
//! either path per size), each on a fresh backend and again after a
//! healthy reconnect, every rank runs a checked all-reduce, meets the
//! others, and shuts down. `shutdown` must return `Ok` (no
//! `CommError::Leaked`), well within its timeout; afterwards the device
//! memory free is what it was before the backend was built and, on the
//! emulator, no CUDA IPC mapping is open and nothing was freed while a
//! peer mapped it. Rank 0 prints each case's shutdown times (every rank's,
//! from the barrier before it to its return): the suite-reported figure
//! that docs/benchmarks.md records.
//!
//! Invariants: every rank runs the same cases in the same order; the
//! inputs are small non-zero integers, so every sum is exact whichever
//! path reduces it, and every element is checked; a rank that fails a
//! check still shuts its backend down (the backend's `Drop` would too).

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use metrale_comm::{CommBackend, FastPathPolicy, NcclBackend, OneShotPolicy, TuneCache};
use nccl_safe::DeviceBuffer;

use crate::RankCtx;
use crate::data::{ints_to_bf16, small_ints};

/// Elements per all-reduce (8 KiB of bf16: inside the one-shot range).
const N: usize = 4097;
/// A healthy shutdown that takes longer than this waited for something
/// it should not have (its timeout is ten times as long).
const HEALTHY_BOUND: Duration = Duration::from_secs(1);

/// The paths of the cases: a name and the one-shot and fast-path policies.
const PATHS: &[(&str, OneShotPolicy, FastPathPolicy)] = &[
    ("nccl", OneShotPolicy::Never, FastPathPolicy::Never),
    ("oneshot", OneShotPolicy::Always, FastPathPolicy::Never),
    ("auto", OneShotPolicy::Auto, FastPathPolicy::Auto),
];

/// One checked all-reduce of fresh inputs (`salt`) on `b`.
fn reduce_checked(ctx: &RankCtx, b: &NcclBackend, seed: u64, salt: u64) -> anyhow::Result<()> {
    let mine = small_ints(seed, ctx.rank, salt, N);
    let want: Vec<i32> = (0..ctx.world_size)
        .map(|r| small_ints(seed, r, salt, N))
        .fold(vec![0; N], |acc, v| {
            acc.iter().zip(&v).map(|(a, b)| a + b).collect()
        });
    let mut buf = DeviceBuffer::from_host(b.context(), &ints_to_bf16(&mine))?;
    b.all_reduce(buf.view_mut())
        .and_then(|()| b.synchronize())
        .with_context(|| format!("all_reduce {salt}"))?;
    let got = buf.to_host_vec()?;
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        ensure!(
            g.to_f32() == *w as f32,
            "all_reduce {salt}: element {k} is {g}, not {w}"
        );
    }
    Ok(())
}

/// The work before the shutdown: a checked all-reduce, and where asked a
/// healthy reconnect and another.
fn exercise(
    ctx: &RankCtx,
    b: &NcclBackend,
    key: &str,
    seed: u64,
    one_shot: OneShotPolicy,
    reconnect: bool,
) -> anyhow::Result<()> {
    if one_shot == OneShotPolicy::Always {
        ensure!(
            b.one_shot_unavailable().is_none() || ctx.on_gpu(),
            "the one-shot path is off on the emulator: {:?}",
            b.one_shot_unavailable()
        );
    }
    reduce_checked(ctx, b, seed, 1)?;
    if reconnect {
        ctx.barrier(&format!("{key}: reconnect"))?;
        ctx.step(format!("{key}: attempt_reconnect"));
        b.attempt_reconnect().context("a healthy reconnect")?;
        reduce_checked(ctx, b, seed, 2).context("after the reconnect")?;
    }
    Ok(())
}

/// One case: build, reduce, maybe reconnect and reduce again, shut down;
/// returns the shutdown's duration.
fn case(
    ctx: &RankCtx,
    key: &str,
    one_shot: OneShotPolicy,
    fast: FastPathPolicy,
    reconnect: bool,
) -> anyhow::Result<Duration> {
    let seed = ctx.shared_seed(key)?;
    let c = ctx.context()?;
    let free_before = c.mem_info()?.0;
    let cfg = ctx
        .config()
        .with_one_shot(one_shot)
        .with_fast_path(fast)
        .with_tune_cache(TuneCache::Off);
    let b = ctx.backend(key, cfg)?;
    let checked = exercise(ctx, &b, key, seed, one_shot, reconnect);
    ctx.barrier(&format!("{key}: shutdown"))?;
    ctx.step(format!("{key}: shutdown"));
    let t = Instant::now();
    let shut = b.shutdown();
    let took = t.elapsed();
    checked?;
    shut.with_context(|| format!("{key}: a healthy shutdown after {took:?}"))?;
    ensure!(
        took <= HEALTHY_BOUND,
        "{key}: a healthy shutdown took {took:?}, more than {HEALTHY_BOUND:?}"
    );
    drop(b);
    super::oneshot::no_mapping_left(ctx, key)?;
    let free_after = c.mem_info()?.0;
    // NCCL on GPUs may keep memory past a communicator's destruction.
    let slack = if ctx.on_gpu() { 64 << 20 } else { 0 };
    ensure!(
        free_after + slack >= free_before,
        "{key}: device memory free went from {free_before} to {free_after} across the \
         backend's life"
    );
    Ok(took)
}

/// The scenario body: see the module docs.
pub fn healthy(ctx: &RankCtx) -> anyhow::Result<()> {
    let mut worst = Duration::ZERO;
    for &(name, one_shot, fast) in PATHS {
        for reconnect in [false, true] {
            let when = if reconnect {
                "after a reconnect"
            } else {
                "fresh"
            };
            let key = format!("shutdown-{name}-{}", if reconnect { "rc" } else { "fresh" });
            let took = case(ctx, &key, one_shot, fast, reconnect)
                .with_context(|| format!("{name}, {when}"))?;
            worst = worst.max(took);
            ctx.set(
                &format!("{key}/took/{}", ctx.rank),
                &(took.as_nanos() as u64).to_le_bytes(),
            )?;
            if ctx.rank == 0 {
                let mut ms = Vec::new();
                for r in 0..ctx.world_size {
                    let v = ctx.get(&format!("{key}/took/{r}"))?;
                    let ns = u64::from_le_bytes(v[..8].try_into().context("a duration")?);
                    ms.push(ns as f64 / 1e6);
                }
                let max = ms.iter().copied().fold(0.0, f64::max);
                let each: Vec<String> = ms.iter().map(|m| format!("{m:.2}")).collect();
                println!(
                    "int_shutdown_healthy: {name:7} {when:17} {} ranks ({}): shutdown max {max:.2} ms (ranks: {})",
                    ctx.world_size,
                    ctx.mode.name(),
                    each.join(" ")
                );
            }
        }
    }
    ctx.step(format!("done; slowest shutdown {worst:?}"));
    Ok(())
}
