//! How an engine builds and drives a backend: `LocalBackend` on one rank,
//! the command flow through `dyn CommBackend` (the root broadcasts, the
//! others idle in `recv_command_u32`), and a backend over a unique id the
//! engine distributed itself (no reconnect, no one-shot path).
//!
//! Invariants: every result is checked against a host reference; a call
//! after shutdown or a failed reconnect must be refused with its cause.

use std::sync::Arc;

use anyhow::{Context as _, bail, ensure};
use half::bf16;
use metrale_comm::{AllReducePath, CommBackend, CommError, LocalBackend, NcclBackend};
use nccl_safe::DeviceBuffer;

use crate::RankCtx;
use crate::data::{POISON_BYTE, all_reduce_reference, check, random_vec, sum_in_rank_order};
use crate::scenarios::exact;
use crate::scenarios::reliability::all_reduce_ok;

/// LocalBackend on one rank: identity reductions, copies, unsupported
/// point-to-point.
pub fn local_backend(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("local")?;
    let b = LocalBackend::new(ctx.device)?;
    let c = b.context().clone();
    ensure!(
        b.world_size() == 1 && b.rank() == 0,
        "LocalBackend is not rank 0 of 1"
    );
    let n = 4097;
    let x: Vec<bf16> = random_vec(seed, 0, 1, n);
    let mut buf = DeviceBuffer::from_host(&c, &x)?;
    ctx.step("LocalBackend all_reduce");
    b.all_reduce(buf.view_mut())?;
    b.synchronize()?;
    check("local all_reduce", &buf.to_host_vec()?, &x, true, 1)?;
    let mut out = DeviceBuffer::<bf16>::alloc(&c, n)?;
    out.fill_bytes(POISON_BYTE)?;
    b.all_gather(buf.view(), out.view_mut())?;
    b.synchronize()?;
    check("local all_gather", &out.to_host_vec()?, &x, true, 1)?;
    out.fill_bytes(POISON_BYTE)?;
    b.reduce_scatter(buf.view(), out.view_mut())?;
    b.synchronize()?;
    check("local reduce_scatter", &out.to_host_vec()?, &x, true, 1)?;
    b.broadcast(buf.view_mut(), 0)?;
    check("local broadcast", &buf.to_host_vec()?, &x, true, 1)?;
    b.barrier()?;
    match b.send_to(buf.view(), 0, b.stream()) {
        Err(CommError::Unsupported { .. } | CommError::InvalidArgument { .. }) => {}
        other => bail!("LocalBackend send_to: expected Unsupported, got {other:?}"),
    }
    ensure!(b.is_healthy(), "LocalBackend unhealthy");
    b.shutdown()?;
    ensure!(!b.is_healthy(), "LocalBackend healthy after shutdown");
    Ok(())
}

/// The engine's flow: the root broadcasts commands, the others idle in
/// recv_command_u32; then an all_reduce, a barrier and shutdown.
pub fn engine_flow(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("flow")?;
    let (w, r) = (ctx.world_size, ctx.rank);
    let b: Arc<NcclBackend> = Arc::new(ctx.backend("flow", ctx.config())?);
    let dynb: Arc<dyn CommBackend> = b.clone();
    let c = b.context().clone();
    let mut cmd = DeviceBuffer::<u32>::alloc(&c, 1)?;
    for (i, value) in [7u32, 0xdead_beef, 1].into_iter().enumerate() {
        ctx.step(format!("command {i}"));
        if r == 0 {
            cmd.copy_from_host(&[value])?;
            dynb.broadcast(cmd.view_mut(), 0)?;
        } else {
            cmd.fill_bytes(POISON_BYTE)?;
            dynb.recv_command_u32(cmd.view_mut(), 0)?;
            let got = cmd.to_host_vec()?[0];
            ensure!(
                got == value,
                "command {i}: got {got:#x}, expected {value:#x}"
            );
        }
    }
    ctx.step("flow all_reduce");
    let n = 1 << 16;
    let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, 3, n)).collect();
    let mut buf = DeviceBuffer::from_host(&c, &inputs[r])?;
    dynb.all_reduce(buf.view_mut())?;
    dynb.synchronize()?;
    check(
        "flow all_reduce",
        &buf.to_host_vec()?,
        &all_reduce_reference(&b, &inputs),
        exact(ctx),
        w,
    )?;
    dynb.barrier()?;
    dynb.shutdown()?;
    dynb.shutdown()?;
    match dynb.all_reduce(buf.view_mut()) {
        Err(CommError::Shutdown { .. }) => {}
        other => bail!("all_reduce after shutdown: expected Shutdown, got {other:?}"),
    }
    Ok(())
}

/// A backend over a fixed unique id, and its split, asked for the one-shot
/// path: off on every rank with the reason (no store to meet in at its
/// release), and their all-reduces still sum right.
fn fixed_id_one_shot_off(ctx: &RankCtx) -> anyhow::Result<()> {
    let (w, r) = (ctx.world_size, ctx.rank);
    ctx.step("the one-shot path over a fixed unique id");
    let id = ctx.unique_id("fixed-id one-shot")?;
    let cfg = ctx.config().with_one_shot(crate::ONE_SHOT_TO_1M);
    let b = NcclBackend::with_unique_id(cfg, &id, r, w)?;
    let child = b
        .split_backend(Some(0), r)?
        .context("a split with a color got no sub-communicator")?;
    for (salt, (what, x)) in (60..).zip([("a fixed id", &b), ("its split", &child)]) {
        let why = x.one_shot_unavailable().unwrap_or_default();
        ensure!(
            why.contains("no rendezvous store"),
            "{what}: the one-shot path's reason is `{why}`"
        );
        ensure!(x.all_reduce_path(2) != AllReducePath::OneShot);
        all_reduce_ok(ctx, x, salt)
            .with_context(|| format!("all_reduce over {what} without the one-shot path"))?;
    }
    ctx.barrier("fixed-id one-shot: before shutdown")?;
    child.shutdown()?;
    b.shutdown()?;
    Ok(())
}

/// A backend built from a unique id the engine distributed itself works,
/// and refuses to reconnect with an error naming why (then stays poisoned
/// with that cause); asked for the one-shot path, it and its split go
/// without it.
pub fn fixed_unique_id(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("fixed-id")?;
    let (w, r) = (ctx.world_size, ctx.rank);
    let id = ctx.unique_id("fixed-id")?;
    ctx.step("NcclBackend::with_unique_id");
    let b = metrale_comm::NcclBackend::with_unique_id(ctx.config(), &id, r, w)?;
    ensure!(
        b.rank() == r && b.world_size() == w,
        "rank or world size wrong"
    );
    let n = 4097;
    let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, 5, n)).collect();
    let mut buf = DeviceBuffer::from_host(b.context(), &inputs[r])?;
    b.all_reduce(buf.view_mut())?;
    b.synchronize()?;
    check(
        "all_reduce over a fixed unique id",
        &buf.to_host_vec()?,
        &sum_in_rank_order(&inputs),
        exact(ctx),
        w,
    )?;
    if (2..=8).contains(&w) {
        fixed_id_one_shot_off(ctx)?;
    }
    ctx.barrier("fixed-id reduced")?;
    ctx.step("attempt_reconnect without a rendezvous");
    let err = match b.attempt_reconnect() {
        Ok(()) => bail!("attempt_reconnect succeeded without a way to agree on a new id"),
        Err(e) => e,
    };
    ensure!(
        matches!(err, CommError::Rendezvous(_)),
        "expected a rendezvous error, got {err}"
    );
    ensure!(!b.is_healthy(), "healthy without a communicator");
    match b.all_reduce(buf.view_mut()) {
        Err(CommError::Poisoned { cause, .. })
            if matches!(cause.kind, metrale_comm::FailureKind::Reconnect(_)) => {}
        other => bail!("after a failed reconnect: expected Poisoned by it, got {other:?}"),
    }
    b.shutdown()?;
    Ok(())
}
