//! Ranks whose path settings differ, and a rank that never comes to the
//! set-up: what a launcher that gives one node other environment variables
//! (`METRALE_COMM_ONE_SHOT`, `METRALE_COMM_FAST_PATH`,
//! `METRALE_COMM_SCRATCH_BYTES`), or a rank that dies right after NCCL's
//! init, does to the others' construction.
//!
//! Invariants checked: construction never waits past the init deadline;
//! ranks that choose paths by other settings all end on NCCL's all-reduce
//! (never one rank on a peer-memory path and another on NCCL), with a
//! reason naming the ranks; every output is poisoned before the run and
//! every element checked against the rank-order sum.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use half::bf16;
use metrale_comm::{AllReducePath, CommBackend, FastPathPolicy, NcclBackend, OneShotPolicy};
use nccl_safe::DeviceBuffer;

use super::exact;
use crate::RankCtx;
use crate::data::{POISON_BYTE, check, random_vec, sum_in_rank_order};

/// The init deadline of the scenario's backends.
const INIT: Duration = Duration::from_secs(5);
/// How long past the deadline construction may take (scheduling on a
/// loaded CI box).
const SLACK: Duration = Duration::from_secs(10);

/// A configuration by rank.
type ConfigOf<'a> = Box<dyn Fn(usize) -> metrale_comm::BackendConfig + 'a>;

/// `backend_settings_differ`.
pub fn settings_differ(ctx: &RankCtx) -> anyhow::Result<()> {
    let (w, r) = (ctx.world_size, ctx.rank);
    let seed = ctx.shared_seed("settings")?;
    let base = ctx.config().with_init_timeout(INIT);
    // Each case: this rank's configuration and whether it differs from
    // rank 0's.
    let cases: [(&str, ConfigOf); 3] = [
        (
            "odd ranks without the one-shot and fast paths",
            Box::new(|k| {
                if k % 2 == 0 {
                    base.clone()
                        .with_one_shot(OneShotPolicy::Always)
                        .with_fast_path(FastPathPolicy::Always)
                } else {
                    base.clone()
                        .with_one_shot(OneShotPolicy::Never)
                        .with_fast_path(FastPathPolicy::Never)
                }
            }),
        ),
        (
            "the last rank without the fast path",
            Box::new(|k| {
                let c = base.clone().with_one_shot(OneShotPolicy::Never);
                if k + 1 == w {
                    c.with_fast_path(FastPathPolicy::Never)
                } else {
                    c.with_fast_path(FastPathPolicy::Always)
                }
            }),
        ),
        (
            "the last rank with another scratch size",
            Box::new(|k| {
                let c = base
                    .clone()
                    .with_one_shot(OneShotPolicy::Always)
                    .with_fast_path(FastPathPolicy::Always);
                if k + 1 == w {
                    c.with_scratch_bytes(64 << 10)
                } else {
                    c.with_scratch_bytes(128 << 10)
                }
            }),
        ),
    ];
    for (i, (what, config)) in cases.iter().enumerate() {
        let started = Instant::now();
        let b = ctx
            .backend(&format!("settings-{i}"), config(r))
            .with_context(|| what.to_string())?;
        let took = started.elapsed();
        ensure!(
            took < INIT + SLACK,
            "{what}: construction took {took:?} (init deadline {INIT:?})"
        );
        for bytes in [2, 8 << 10, 256 << 10] {
            let path = b.all_reduce_path(bytes);
            ensure!(
                path == AllReducePath::Nccl,
                "{what}: {bytes} bytes take {path:?} on rank {r}, though the ranks' settings differ"
            );
        }
        let why = b.one_shot_unavailable().unwrap_or_default();
        let never = config(r).one_shot == OneShotPolicy::Never;
        ensure!(
            why.contains("choose paths by other settings") || never,
            "{what}: the one-shot path's reason is `{why}`"
        );
        for (salt, n) in (0..).zip([1usize, 7, 4097, 65_536, 300_000]) {
            let salt = 100 * i as u64 + salt;
            let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, salt, n)).collect();
            let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), n)?;
            buf.fill_bytes(POISON_BYTE)?;
            buf.copy_from_host(&inputs[r])?;
            b.all_reduce(buf.view_mut())
                .with_context(|| format!("{what}: all_reduce of {n}"))?;
            b.synchronize()
                .with_context(|| format!("{what}: synchronize"))?;
            check(
                &format!("{what}: all_reduce of {n}"),
                &buf.to_host_vec()?,
                &sum_in_rank_order(&inputs),
                exact(ctx),
                w,
            )?;
        }
        ctx.barrier(&format!("settings-{i}: checked"))?;
        b.shutdown().with_context(|| format!("{what}: shutdown"))?;
    }
    missing_rank(ctx)
}

/// The last rank joins NCCL's communicator raw and never comes to the
/// backend's set-up: every other rank's construction fails by the init
/// deadline with an error naming the set-up step, and never hangs.
fn missing_rank(ctx: &RankCtx) -> anyhow::Result<()> {
    let (w, r) = (ctx.world_size, ctx.rank);
    let id = ctx.unique_id("settings-missing")?;
    ctx.step("a rank that never comes to the set-up");
    if r + 1 == w {
        // NCCL's init as the backend makes it, and nothing after.
        let c = ctx.context()?;
        let mut comm = nccl_safe::Comm::init_rank_with_deadline(&c, &id, w, r, INIT + SLACK)
            .context("the raw rank's init")?;
        if ctx.config().enqueue == metrale_comm::EnqueueMode::Blocking {
            comm = comm
                .into_blocking(INIT + SLACK)
                .context("the raw rank's blocking init")?;
        }
        ctx.barrier("settings-missing: the others failed")?;
        comm.abort().context("the raw rank's abort")?;
        return Ok(());
    }
    let config = ctx
        .config()
        .with_init_timeout(INIT)
        .with_one_shot(OneShotPolicy::Always);
    let started = Instant::now();
    let got = NcclBackend::with_unique_id(config, &id, r, w);
    let took = started.elapsed();
    match got {
        Ok(_) => bail!("construction succeeded though rank {} never came", w - 1),
        Err(e) => {
            let text = e.to_string();
            ensure!(
                text.contains("host census"),
                "construction failed, but not naming the set-up step: {text}"
            );
        }
    }
    ensure!(
        took < INIT + SLACK,
        "construction took {took:?} to fail (init deadline {INIT:?})"
    );
    ctx.barrier("settings-missing: the others failed")?;
    Ok(())
}
