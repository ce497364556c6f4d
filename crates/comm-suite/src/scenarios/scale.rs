//! Scenarios at the world sizes engines split models over (4 and 8 ranks
//! of one node): a rank that stalls among eight is noticed by the others,
//! named by op and sequence number, and all eight reconnect and reduce
//! correctly again.
//!
//! Invariants: emulator faults are reset when the scenario ends; every
//! rank checks every element of the reduction after the reconnect.

use std::time::Instant;

use anyhow::ensure;
use half::bf16;
use metrale_comm::CommBackend;
use nccl_safe::DeviceBuffer;

use super::reliability::{all_reduce_ok, expect_timeout, fault_injection, short};
use crate::RankCtx;
use crate::emu::Fault;

/// A middle rank hangs in an all-reduce: every rank's wait fails with a
/// timeout by the deadline, each naming its own all-reduce; then every rank
/// reconnects (generation + 1) and an all-reduce of fresh data is correct.
pub fn stall_and_reconnect(ctx: &RankCtx) -> anyhow::Result<()> {
    let (emu, _reset) = fault_injection(ctx)?;
    let w = ctx.world_size;
    let b = ctx.backend("stall-n", short(ctx))?;
    all_reduce_ok(ctx, &b, 11)?;
    let stalled = w / 2;
    if ctx.rank == stalled {
        emu.inject(stalled, Fault::Hang, 1)?;
    }
    ctx.barrier("stall injected")?;
    let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), 4096)?;
    ctx.step(format!("all_reduce with rank {stalled} of {w} stalled"));
    let seq = b.recorder().last_seq() + 1;
    let t = Instant::now();
    let r = b.all_reduce(buf.view_mut()).and_then(|()| b.synchronize());
    let f = expect_timeout("stalled all_reduce", r, t.elapsed())?;
    ensure!(
        f.op == "all_reduce" && f.seq == seq,
        "rank {}: the failure names {} #{} instead of all_reduce #{seq}",
        ctx.rank,
        f.op,
        f.seq
    );
    ensure!(!b.is_healthy(), "healthy after a stalled all_reduce");
    ctx.barrier("stall seen")?;
    emu.reset();
    ctx.step("every rank reconnects");
    let generation = b.generation();
    b.attempt_reconnect()?;
    ensure!(
        b.is_healthy() && b.generation() == generation + 1,
        "rank {}: after the reconnect healthy={} generation {} (was {generation})",
        ctx.rank,
        b.is_healthy(),
        b.generation()
    );
    all_reduce_ok(ctx, &b, 12)?;
    ctx.barrier("reduced after the reconnect")?;
    b.shutdown()?;
    Ok(())
}
