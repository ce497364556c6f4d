//! Graph replay: an all-reduce captured on a caller stream as a fresh
//! backend's first operation, replayed on fresh data.
//!
//! Invariants: the captured buffer outlives every replay and is written
//! only between them; every replay's result is checked, every element.

use half::bf16;
use metrale_comm::CommBackend;
use nccl_safe::{DeviceBuffer, Stream};

use super::WAIT;
use crate::RankCtx;
use crate::data::{all_reduce_reference, check, random_vec};
use crate::scenarios::exact;

/// A captured all_reduce_async replays correctly 100 times with fresh data.
pub fn graph_replay(ctx: &RankCtx) -> anyhow::Result<()> {
    graph_replay_with(ctx, ctx.config(), "graph", 100)
}

/// Captures an all_reduce_async as the first operation of a fresh backend
/// built from `config`, then replays it `replays` times on fresh data.
pub(super) fn graph_replay_with(
    ctx: &RankCtx,
    config: metrale_comm::BackendConfig,
    name: &str,
    replays: u64,
) -> anyhow::Result<()> {
    let seed = ctx.shared_seed(name)?;
    let w = ctx.world_size;
    let b = ctx.backend(name, config)?;
    let compute = Stream::new(b.context())?;
    let n = 4097;
    let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), n)?;
    ctx.step(format!("{name}: capture all_reduce_async"));
    compute.begin_capture()?;
    // The graph keeps the buffer's address: `buf` outlives every replay and
    // is written only between them.
    let r = b.all_reduce_async(buf.view_mut(), compute.as_ref());
    let graph = compute.end_capture()?;
    r?;
    let exec = graph.instantiate()?;
    for i in 0..replays {
        ctx.step(format!("graph replay {i}"));
        let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, i, n)).collect();
        buf.copy_from_host(&inputs[ctx.rank])?;
        exec.launch(&compute)?;
        compute.wait_until_idle(WAIT)?;
        check(
            &format!("graph replay {i}"),
            &buf.to_host_vec()?,
            &all_reduce_reference(&b, &inputs),
            exact(ctx),
            w,
        )?;
    }
    drop(exec);
    drop(graph);
    b.shutdown()?;
    Ok(())
}
