//! Scenarios on the `nccl-safe` layer: every collective on random data
//! against a host reference, non-blocking init with a missing rank,
//! resource create/drop cycles, argument checks and abort.
//!
//! Invariants: outputs are poisoned before every run and every element is
//! checked; ranks agree on the order of collectives (no rank skips one
//! except where the scenario is about it).

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use half::bf16;
use nccl_safe::{Comm, DeviceBuffer, Error, ReduceOp, Stream};

use crate::RankCtx;
use crate::data::{POISON_BYTE, SuiteElem, check, random_vec, size_name};
use crate::emu::Fault;

const WAIT: Duration = Duration::from_secs(60);

fn comm(
    ctx: &RankCtx,
    key: &str,
) -> anyhow::Result<(std::sync::Arc<nccl_safe::Context>, Comm, Stream)> {
    let c = ctx.context()?;
    let id = ctx.unique_id(key)?;
    ctx.step(format!("Comm::init_rank `{key}`"));
    let comm = Comm::init_rank(&c, &id, ctx.world_size, ctx.rank).context("Comm::init_rank")?;
    let stream = Stream::new(&c)?;
    Ok((c, comm, stream))
}

fn poisoned<T: SuiteElem>(
    c: &std::sync::Arc<nccl_safe::Context>,
    n: usize,
) -> anyhow::Result<DeviceBuffer<T>> {
    let mut b = DeviceBuffer::<T>::alloc(c, n)?;
    b.fill_bytes(POISON_BYTE)?;
    Ok(b)
}

/// Every collective, both element types, in place and out of place.
pub fn collectives(ctx: &RankCtx) -> anyhow::Result<()> {
    let (c, comm, stream) = comm(ctx, "collectives")?;
    let seed = ctx.shared_seed("collectives")?;
    // Element counts; the large ones only for all_reduce and broadcast.
    let small: &[usize] = &[1, 3, 17, 1000, 4097, 65537, (1 << 20) + 7];
    let large: &[usize] = &[16 << 20];
    for (i, &n) in small.iter().chain(large).enumerate() {
        let all = i < small.len();
        run_all::<bf16>(ctx, &c, &comm, &stream, seed, n, all, "bf16")?;
        run_all::<f32>(ctx, &c, &comm, &stream, seed, n, all, "f32")?;
    }
    ctx.barrier("collectives done")?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn run_all<T: SuiteElem>(
    ctx: &RankCtx,
    c: &std::sync::Arc<nccl_safe::Context>,
    comm: &Comm,
    stream: &Stream,
    seed: u64,
    n: usize,
    all: bool,
    ty: &str,
) -> anyhow::Result<()> {
    let w = ctx.world_size;
    let r = ctx.rank;
    let exact = w <= 2 || !ctx.on_gpu();
    let salt = n as u64 * 31 + T::DATA_TYPE.size() as u64;
    let inputs: Vec<Vec<T>> = (0..w).map(|k| random_vec(seed, k, salt, n)).collect();
    let sum = crate::data::sum_in_rank_order(&inputs);
    let label = |op: &str| format!("{op} {ty} x{n} ({})", size_name(n * T::DATA_TYPE.size()));
    let sync = |what: &str| -> anyhow::Result<()> {
        stream
            .wait_until_idle(WAIT)
            .with_context(|| what.to_string())
    };

    // all_reduce, out of place and in place.
    ctx.step(label("all_reduce"));
    let send = DeviceBuffer::from_host(c, &inputs[r])?;
    let mut recv = poisoned::<T>(c, n)?;
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, stream)?;
    sync("all_reduce")?;
    check(&label("all_reduce"), &recv.to_host_vec()?, &sum, exact, w)?;
    let mut buf = DeviceBuffer::from_host(c, &inputs[r])?;
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, stream)?;
    sync("all_reduce in place")?;
    check(
        &label("all_reduce in place"),
        &buf.to_host_vec()?,
        &sum,
        exact,
        w,
    )?;

    // broadcast from the last rank, out of place and in place.
    let root = w - 1;
    ctx.step(label("broadcast"));
    let mut recv = poisoned::<T>(c, n)?;
    comm.broadcast(&send, &mut recv, root, stream)?;
    sync("broadcast")?;
    check(
        &label("broadcast"),
        &recv.to_host_vec()?,
        &inputs[root],
        true,
        w,
    )?;
    let mut buf = if r == root {
        DeviceBuffer::from_host(c, &inputs[r])?
    } else {
        poisoned::<T>(c, n)?
    };
    comm.broadcast_in_place(&mut buf, root, stream)?;
    sync("broadcast in place")?;
    check(
        &label("broadcast in place"),
        &buf.to_host_vec()?,
        &inputs[root],
        true,
        w,
    )?;
    if !all {
        return Ok(());
    }

    // reduce to rank 0.
    ctx.step(label("reduce"));
    let mut recv = poisoned::<T>(c, n)?;
    comm.reduce(&send, &mut recv, ReduceOp::Sum, 0, stream)?;
    sync("reduce")?;
    if r == 0 {
        check(&label("reduce"), &recv.to_host_vec()?, &sum, exact, w)?;
    }

    // all_gather, out of place and in place (send inside recv).
    ctx.step(label("all_gather"));
    let gathered: Vec<T> = inputs.concat();
    let mut recv = poisoned::<T>(c, n * w)?;
    comm.all_gather(&send, &mut recv, stream)?;
    sync("all_gather")?;
    check(
        &label("all_gather"),
        &recv.to_host_vec()?,
        &gathered,
        true,
        w,
    )?;
    let mut host = recv.to_host_vec()?;
    let poison: T = {
        let mut p = poisoned::<T>(c, 1)?.to_host_vec()?;
        p.pop().context("poison element")?
    };
    host.iter_mut().for_each(|x| *x = poison);
    host[r * n..(r + 1) * n].copy_from_slice(&inputs[r]);
    let buf = DeviceBuffer::from_host(c, &host)?;
    let base = buf.device_ptr();
    let esz = T::DATA_TYPE.size() as u64;
    // SAFETY: both addresses lie inside `buf` (n*w elements, the send block
    // is block r of it), which lives until the stream is idle below; the
    // stream belongs to the comm's context.
    unsafe {
        comm.all_gather_raw(
            base + (r * n) as u64 * esz,
            base,
            n,
            T::DATA_TYPE,
            stream.raw(),
        )?
    };
    sync("all_gather in place")?;
    check(
        &label("all_gather in place"),
        &buf.to_host_vec()?,
        &gathered,
        true,
        w,
    )?;
    drop(buf);

    // reduce_scatter, out of place and in place; each rank sends w blocks.
    ctx.step(label("reduce_scatter"));
    let big: Vec<Vec<T>> = (0..w)
        .map(|k| random_vec(seed, k, salt ^ 0x5ca7, n * w))
        .collect();
    let big_sum = crate::data::sum_in_rank_order(&big);
    let want = &big_sum[r * n..(r + 1) * n];
    let bsend = DeviceBuffer::from_host(c, &big[r])?;
    let mut recv = poisoned::<T>(c, n)?;
    comm.reduce_scatter(&bsend, &mut recv, ReduceOp::Sum, stream)?;
    sync("reduce_scatter")?;
    check(
        &label("reduce_scatter"),
        &recv.to_host_vec()?,
        want,
        exact,
        w,
    )?;
    let buf = DeviceBuffer::from_host(c, &big[r])?;
    let base = buf.device_ptr();
    // SAFETY: recv is block r of `buf` (n*w elements), alive until the
    // stream is idle below; the stream belongs to the comm's context.
    unsafe {
        comm.reduce_scatter_raw(
            base,
            base + (r * n) as u64 * esz,
            n,
            T::DATA_TYPE,
            ReduceOp::Sum,
            stream.raw(),
        )?
    };
    sync("reduce_scatter in place")?;
    check(
        &label("reduce_scatter in place"),
        &buf.to_host_vec()?[r * n..(r + 1) * n],
        want,
        exact,
        w,
    )?;

    // all_to_all: block j of rank r's output is block r of rank j's input.
    ctx.step(label("all_to_all"));
    let mut recv = poisoned::<T>(c, n * w)?;
    match comm.all_to_all(&bsend, &mut recv, stream) {
        Ok(()) => {
            sync("all_to_all")?;
            let want: Vec<T> = (0..w)
                .flat_map(|j| big[j][r * n..(r + 1) * n].to_vec())
                .collect();
            check(&label("all_to_all"), &recv.to_host_vec()?, &want, true, w)?;
        }
        Err(Error::Load(e)) => tracing::warn!("all_to_all unavailable: {e}"),
        Err(e) => return Err(e).context("all_to_all"),
    }

    // Grouped ring send/recv: send to r+1, receive from r-1.
    ctx.step(label("send/recv ring"));
    let mut recv = poisoned::<T>(c, n)?;
    let to = (r + 1) % w;
    let from = (r + w - 1) % w;
    nccl_safe::group(|| {
        comm.send(&send, to, stream)?;
        comm.recv(&mut recv, from, stream)
    })?;
    sync("send/recv")?;
    check(
        &label("send/recv ring"),
        &recv.to_host_vec()?,
        &inputs[from],
        true,
        w,
    )?;
    Ok(())
}

/// Non-blocking init with a rank that never joins times out by its deadline.
pub fn init_timeout(ctx: &RankCtx) -> anyhow::Result<()> {
    let c = ctx.context()?;
    let id = ctx.unique_id("init-timeout")?;
    let deadline = Duration::from_secs(2);
    if ctx.rank == 1 {
        if let Some(emu) = ctx.emu() {
            // On the emulator rank 1 calls init but never registers; its
            // half-made comm must abort and drop cleanly.
            emu.inject(1, Fault::NeverJoins, 1)?;
            ctx.step("init that never joins");
            let r = Comm::init_rank_with_deadline(&c, &id, ctx.world_size, 1, deadline);
            emu.reset();
            if let Ok(comm) = r {
                comm.abort()?;
                ensure!(comm.is_aborted(), "abort did not mark the comm aborted");
                drop(comm);
            }
        }
        ctx.barrier("init-timeout done")?;
        return Ok(());
    }
    if ctx.rank > 1 {
        // Ranks beyond 1 join and must time out like rank 0.
    }
    ctx.step("init_rank_with_deadline 2 s, rank 1 absent");
    let t = Instant::now();
    let r = Comm::init_rank_with_deadline(&c, &id, ctx.world_size, ctx.rank, deadline);
    let took = t.elapsed();
    match r {
        Err(Error::Timeout { after, .. }) => {
            ensure!(
                after == deadline,
                "Timeout reports {after:?}, deadline was {deadline:?}"
            );
        }
        Err(e) => bail!("expected Error::Timeout, got {e}"),
        Ok(_) => bail!("init completed although rank 1 never joined"),
    }
    ensure!(
        took <= deadline + Duration::from_secs(1),
        "init returned after {took:?}, deadline {deadline:?}"
    );
    ctx.barrier("init-timeout done")?;
    Ok(())
}

/// 1000 create/drop cycles of streams, events and buffers leave device
/// memory where it started.
pub fn resource_cycles(ctx: &RankCtx) -> anyhow::Result<()> {
    let c = ctx.context()?;
    let cycle = || -> anyhow::Result<()> {
        let s = Stream::new(&c)?;
        let e = nccl_safe::Event::new(&c, false)?;
        let b = DeviceBuffer::<f32>::alloc(&c, 4097)?;
        let b2 = DeviceBuffer::<bf16>::alloc(&c, 1 << 16)?;
        e.record(&s)?;
        e.wait_with_deadline(WAIT)?;
        drop((b, b2, e, s));
        Ok(())
    };
    cycle()?;
    let (free0, _) = c.mem_info()?;
    ctx.step("1000 create/drop cycles");
    for _ in 0..1000 {
        cycle()?;
    }
    let (free1, _) = c.mem_info()?;
    ensure!(
        free1 == free0,
        "device memory free went from {free0} to {free1} over 1000 cycles"
    );
    Ok(())
}

/// Wrong lengths, roots and peers are `InvalidArgument`; after abort every
/// call is `Aborted`; an abort from another thread releases a rank blocked
/// waiting for a collective its peer never joins.
pub fn bad_arguments_and_abort(ctx: &RankCtx) -> anyhow::Result<()> {
    let (c, comm, stream) = comm(ctx, "bad-args")?;
    let w = ctx.world_size;
    let a = DeviceBuffer::<f32>::alloc(&c, 16)?;
    let mut b = DeviceBuffer::<f32>::alloc(&c, 15)?;
    let mut big = DeviceBuffer::<f32>::alloc(&c, 16 * w + 1)?;
    let inv = |what: &str, r: nccl_safe::Result<()>| -> anyhow::Result<()> {
        match r {
            Err(Error::InvalidArgument { .. }) => Ok(()),
            Err(e) => bail!("{what}: expected InvalidArgument, got {e}"),
            Ok(()) => bail!("{what}: accepted"),
        }
    };
    ctx.step("bad arguments");
    inv(
        "all_reduce wrong length",
        comm.all_reduce(&a, &mut b, ReduceOp::Sum, &stream),
    )?;
    inv(
        "broadcast root out of range",
        comm.broadcast(&a, &mut b, w, &stream),
    )?;
    inv(
        "reduce root out of range",
        comm.reduce(&a, &mut b, ReduceOp::Sum, w + 3, &stream),
    )?;
    inv(
        "all_gather wrong length",
        comm.all_gather(&a, &mut big, &stream),
    )?;
    inv(
        "reduce_scatter wrong length",
        comm.reduce_scatter(&big, &mut b, ReduceOp::Sum, &stream),
    )?;
    inv("send peer out of range", comm.send(&a, w, &stream))?;
    inv("recv peer out of range", comm.recv(&mut b, w + 1, &stream))?;
    // SAFETY: a null pointer with a non-zero count must be refused before
    // NCCL sees it; nothing is dereferenced.
    inv("all_reduce_raw null", unsafe {
        comm.all_reduce_raw(
            0,
            0,
            8,
            nccl_safe::DataType::Float32,
            ReduceOp::Sum,
            stream.raw(),
        )
    })?;

    // A correct all_reduce still works after the refused calls.
    let seed = ctx.shared_seed("bad-args")?;
    let inputs: Vec<Vec<f32>> = (0..w).map(|k| random_vec(seed, k, 1, 16)).collect();
    let send = DeviceBuffer::from_host(&c, &inputs[ctx.rank])?;
    let mut recv = poisoned::<f32>(&c, 16)?;
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream)?;
    stream.wait_until_idle(WAIT)?;
    check(
        "all_reduce after bad arguments",
        &recv.to_host_vec()?,
        &crate::data::sum_in_rank_order(&inputs),
        w <= 2 || !ctx.on_gpu(),
        w,
    )?;

    // Rank 0 starts an all_reduce that rank 1 never joins; another thread
    // aborts the comm; the wait returns promptly.
    ctx.barrier("before abort")?;
    if ctx.rank == 0 {
        ctx.step("blocked all_reduce, abort from another thread");
        let handle = comm.abort_handle();
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            handle.abort()
        });
        let mut recv = poisoned::<f32>(&c, 16)?;
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream)?;
        let t = Instant::now();
        let waited = stream.wait_until_idle(Duration::from_secs(10));
        let took = t.elapsed();
        aborter
            .join()
            .map_err(|_| anyhow::anyhow!("aborter panicked"))??;
        ensure!(
            took < Duration::from_secs(5),
            "the blocked rank was released {took:?} after the abort started (wait result {waited:?})"
        );
    } else {
        comm.abort()?;
    }
    ensure!(comm.is_aborted(), "comm not aborted");
    ctx.step("calls after abort");
    let aborted = |what: &str, r: nccl_safe::Result<()>| -> anyhow::Result<()> {
        match r {
            Err(Error::Aborted { .. }) => Ok(()),
            Err(e) => bail!("{what} after abort: expected Aborted, got {e}"),
            Ok(()) => bail!("{what} after abort: accepted"),
        }
    };
    let mut recv = poisoned::<f32>(&c, 16)?;
    aborted(
        "all_reduce",
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream),
    )?;
    aborted("broadcast", comm.broadcast(&send, &mut recv, 0, &stream))?;
    aborted("send", comm.send(&send, (ctx.rank + 1) % w, &stream))?;
    aborted("async_error", comm.async_error())?;
    comm.abort()?;
    drop(comm);
    ctx.barrier("abort done")?;
    Ok(())
}
