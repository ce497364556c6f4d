//! The all-reduce sweep: every size from 1 element to 256 MiB (64 MiB on
//! the emulator), the fast path always and never, synchronous and on a
//! caller stream; and the blocking-communicator scenario, which runs the
//! sweep, a graph replay and every operation on `EnqueueMode::Blocking`.
//!
//! Invariants: every input is fresh random data, every element is checked
//! against the rank-order sum, and fast-path results are bit-identical
//! across ranks.

use anyhow::{Context as _, ensure};
use half::bf16;
use metrale_comm::{AllReducePath, CommBackend, EnqueueMode, FastPathPolicy, OneShotPolicy};
use nccl_safe::{DeviceBuffer, Stream};

use super::WAIT;
use super::graph::graph_replay_with;
use super::operations::every_operation_with;
use crate::RankCtx;
use crate::data::{check, hash, random_vec, size_name, sum_in_rank_order};
use crate::scenarios::exact;

/// Byte sizes of the all-reduce sweep: 1 element to 256 MiB, odd counts.
/// The emulator stops at 64 MiB to keep `cargo test` short.
fn sweep(on_gpu: bool) -> Vec<usize> {
    let mut v: Vec<usize> = [
        1usize,
        3,
        17,
        255,
        1000,
        4097,
        8191,
        65537,
        131_071,
        (1 << 20) + 7,
        3 << 19,
    ]
    .iter()
    .map(|n| n * 2)
    .collect();
    v.extend([
        1 << 10,
        64 << 10,
        1 << 20,
        2 << 20,
        4 << 20,
        8 << 20,
        16 << 20,
        32 << 20,
        64 << 20,
    ]);
    if on_gpu {
        v.extend([128 << 20, 256 << 20]);
    }
    v.sort_unstable();
    v
}

/// all_reduce at every sweep size, with the fast path always and never,
/// synchronous and on a compute stream; fast-path results bit-identical
/// across ranks.
pub fn all_reduce_sweep(ctx: &RankCtx) -> anyhow::Result<()> {
    sweep_with(ctx, EnqueueMode::NonBlocking, &sweep(ctx.on_gpu()))
}

/// On backends whose communicator is blocking (`EnqueueMode::Blocking`): a
/// captured all-reduce as a fresh backend's first operation, replayed, then
/// the all-reduce sweep (every other size, and the largest) and every
/// operation.
pub fn blocking_enqueue(ctx: &RankCtx) -> anyhow::Result<()> {
    let all = sweep(ctx.on_gpu());
    let mut sizes: Vec<usize> = all.iter().copied().step_by(2).collect();
    if let Some(&last) = all.last()
        && sizes.last() != Some(&last)
    {
        sizes.push(last);
    }
    let blocking = ctx.config().with_enqueue(EnqueueMode::Blocking);
    graph_replay_with(ctx, blocking, "graph-blocking", 10)?;
    sweep_with(ctx, EnqueueMode::Blocking, &sizes)?;
    every_operation_with(ctx, EnqueueMode::Blocking)
}

fn sweep_with(ctx: &RankCtx, mode: EnqueueMode, sizes: &[usize]) -> anyhow::Result<()> {
    let seed = ctx.shared_seed(&format!("sweep-{mode:?}"))?;
    let w = ctx.world_size;
    for (pi, policy) in [FastPathPolicy::Always, FastPathPolicy::Never]
        .into_iter()
        .enumerate()
    {
        let b = ctx.backend(
            &format!("sweep-{mode:?}-{pi}"),
            // The fast path against NCCL's: the one-shot path has its own
            // sweep (`oneshot_sizes`).
            ctx.config()
                .with_fast_path(policy)
                .with_one_shot(OneShotPolicy::Never)
                .with_enqueue(mode),
        )?;
        let compute = Stream::new(b.context())?;
        for (si, &bytes) in sizes.iter().enumerate() {
            let n = bytes / 2;
            let want_fast = w == 2 && policy == FastPathPolicy::Always;
            let path = b.all_reduce_path(bytes);
            ensure!(
                (path == AllReducePath::FastPath) == want_fast,
                "{policy:?}: all_reduce_path({bytes}) = {path:?}"
            );
            for asynchronous in [false, true] {
                let salt = (pi as u64) << 40 | (si as u64) << 8 | asynchronous as u64;
                let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, salt, n)).collect();
                let want = sum_in_rank_order(&inputs);
                let what = format!(
                    "all_reduce{} {} bf16 ({policy:?})",
                    if asynchronous { "_async" } else { "" },
                    size_name(bytes)
                );
                ctx.step(what.clone());
                let mut buf = DeviceBuffer::from_host(b.context(), &inputs[ctx.rank])?;
                if asynchronous {
                    b.all_reduce_async(buf.view_mut(), compute.as_ref())
                        .with_context(|| what.clone())?;
                    compute
                        .wait_until_idle(WAIT)
                        .with_context(|| what.clone())?;
                } else {
                    b.all_reduce(buf.view_mut()).with_context(|| what.clone())?;
                    b.synchronize().with_context(|| what.clone())?;
                }
                let got = buf.to_host_vec()?;
                check(&what, &got, &want, exact(ctx), w)?;
                if want_fast {
                    ctx.all_equal(
                        &format!("fast-{mode:?}-{pi}-{si}-{asynchronous}"),
                        hash(&got),
                    )?;
                }
            }
        }
        b.shutdown()?;
    }
    Ok(())
}
