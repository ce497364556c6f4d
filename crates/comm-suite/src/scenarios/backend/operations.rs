//! Every operation besides the all-reduce sweep: all-gather,
//! reduce-scatter (bf16 and f32), broadcast, grouped send/recv, an
//! all-reduce on registered symmetric memory, the engine's own add kernel,
//! and barriers (one that waits for a late rank).
//!
//! Invariants: receive buffers are poisoned before every operation and
//! every element is checked against a host reference.

use std::time::{Duration, Instant};

use anyhow::ensure;
use half::bf16;
use metrale_comm::AddKernel;
use metrale_comm::{CommBackend, EnqueueMode, NcclBackend};
use nccl_safe::{DataType, DeviceBuffer, Stream};

use super::WAIT;
use crate::RankCtx;
use crate::data::{
    POISON_BYTE, SuiteElem, all_reduce_reference, check, random_vec, size_name, sum_in_rank_order,
};
use crate::scenarios::exact;

/// Element counts for the every-operation scenario: 20 on the emulator
/// (1 element to 16 MiB of bf16, odd counts included; 14, to 4 MiB, for
/// more than 2 ranks, to keep CI's 2 cores under its time), 23 on GPUs (to
/// 256 MiB).
fn op_counts(on_gpu: bool, world_size: usize) -> Vec<usize> {
    let mut v = vec![
        1,
        2,
        3,
        17,
        255,
        1000,
        4097,
        8191,
        65_537,
        100_003,
        262_147,
        (1 << 19) + 1,
        (1 << 20) + 7,
        (2 << 20) + 1,
        3 << 20,
        (4 << 20) + 3,
        5 << 20,
        6 << 20,
        (7 << 20) + 5,
        8 << 20,
    ];
    if on_gpu {
        v.extend([32 << 20, 64 << 20, 128 << 20]);
    } else if world_size > 2 {
        v.truncate(14);
    }
    v
}

/// all_gather, reduce_scatter (bf16, f32), broadcast, grouped send/recv,
/// registration and symmetric memory, a custom add kernel, barrier.
pub fn every_operation(ctx: &RankCtx) -> anyhow::Result<()> {
    every_operation_with(ctx, EnqueueMode::NonBlocking)
}

pub(super) fn every_operation_with(ctx: &RankCtx, mode: EnqueueMode) -> anyhow::Result<()> {
    let seed = ctx.shared_seed(&format!("ops-{mode:?}"))?;
    let (w, r) = (ctx.world_size, ctx.rank);
    let b = ctx.backend(
        &format!("ops-{mode:?}"),
        ctx.config()
            .with_fast_path(crate::FAST_PATH_WINDOW)
            .with_enqueue(mode),
    )?;
    let c = b.context().clone();
    let stream = Stream::new(&c)?;
    for (si, n) in op_counts(ctx.on_gpu(), w).into_iter().enumerate() {
        let salt = si as u64 * 101;
        let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, salt, n)).collect();
        let bytes = n * 2;
        let send = DeviceBuffer::from_host(&c, &inputs[r])?;

        ctx.step(format!("all_gather {}", size_name(bytes)));
        let mut recv = DeviceBuffer::<bf16>::alloc(&c, n * w)?;
        recv.fill_bytes(POISON_BYTE)?;
        b.all_gather(send.view(), recv.view_mut())?;
        b.synchronize()?;
        check(
            "backend all_gather",
            &recv.to_host_vec()?,
            &inputs.concat(),
            true,
            w,
        )?;

        ctx.step(format!("reduce_scatter {}", size_name(bytes)));
        reduce_scatter::<bf16>(ctx, &b, seed, salt, n)?;
        reduce_scatter::<f32>(ctx, &b, seed, salt, n)?;

        ctx.step(format!("broadcast {}", size_name(bytes)));
        let root = w - 1;
        let mut buf = DeviceBuffer::<bf16>::alloc(&c, n)?;
        if r == root {
            buf.copy_from_host(&inputs[r])?;
        } else {
            buf.fill_bytes(POISON_BYTE)?;
        }
        b.broadcast(buf.view_mut(), root)?;
        check(
            "backend broadcast",
            &buf.to_host_vec()?,
            &inputs[root],
            true,
            w,
        )?;

        ctx.step(format!("send_to/recv_from {}", size_name(bytes)));
        let mut recv = DeviceBuffer::<bf16>::alloc(&c, n)?;
        recv.fill_bytes(POISON_BYTE)?;
        let (to, from) = ((r + 1) % w, (r + w - 1) % w);
        let group = metrale_comm::Group::start(&b)?;
        let sr = b
            .send_to(send.view(), to, stream.as_ref())
            .and_then(|()| b.recv_from(recv.view_mut(), from, stream.as_ref()));
        group.end()?;
        sr?;
        stream.wait_until_idle(WAIT)?;
        check(
            "backend send/recv ring",
            &recv.to_host_vec()?,
            &inputs[from],
            true,
            w,
        )?;

        ctx.step(format!(
            "registered + symmetric all_reduce {}",
            size_name(bytes)
        ));
        let mut sym = b.symmetric_alloc(bytes)?;
        let mut staging = DeviceBuffer::<bf16>::alloc(&c, n)?;
        // SAFETY: `sym` stays allocated until symmetric_free below, after
        // the deregistration.
        let handle = unsafe { b.register_buffer(sym.view(DataType::Bfloat16))? };
        staging.copy_from_host(&inputs[r])?;
        copy_d2d(&staging, sym.ptr(), bytes)?;
        b.all_reduce(sym.view_mut(DataType::Bfloat16))?;
        b.synchronize()?;
        staging.fill_bytes(POISON_BYTE)?;
        copy_d2d_back(sym.ptr(), &mut staging, bytes)?;
        check(
            "all_reduce on symmetric registered memory",
            &staging.to_host_vec()?,
            &sum_in_rank_order(&inputs),
            exact(ctx),
            w,
        )?;
        b.deregister_buffer(handle)?;
        b.symmetric_free(sym)?;
    }

    ctx.step("custom add kernel");
    let module = nccl_safe::Module::load_ptx(
        &c,
        include_str!("../../../../metrale-comm/kernels/bf16_add.ptx"),
    )?;
    let f = module.function("bf16_add_inplace")?;
    // SAFETY: `f` is the project's add kernel with the required signature,
    // loaded in this backend's context; `module` outlives the backend's use.
    b.set_add_kernel(unsafe { AddKernel::from_raw(f.raw()) })?;
    let n = 65537;
    let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, 0xadd, n)).collect();
    let mut buf = DeviceBuffer::from_host(&c, &inputs[r])?;
    b.all_reduce(buf.view_mut())?;
    b.synchronize()?;
    check(
        "all_reduce with the engine's add kernel",
        &buf.to_host_vec()?,
        &all_reduce_reference(&b, &inputs),
        exact(ctx),
        w,
    )?;

    ctx.step("barrier");
    b.barrier()?;
    ensure!(b.is_healthy(), "backend unhealthy after every operation");
    b.shutdown()?;
    drop(module);
    Ok(())
}

fn copy_d2d(src: &DeviceBuffer<bf16>, dst: u64, bytes: usize) -> anyhow::Result<()> {
    let host = src.to_host_vec()?;
    let lib = cuda_sys::cuda()?;
    src.context().make_current()?;
    // SAFETY: `dst` is device memory of at least `bytes` bytes and `host`
    // holds `bytes` bytes for the duration of the synchronous copy.
    let rc = unsafe { cuda_sys::call!(lib, cuMemcpyHtoD_v2(dst, host.as_ptr().cast(), bytes))? };
    nccl_safe::cuda_check(rc, "cuMemcpyHtoD_v2")?;
    Ok(())
}

fn copy_d2d_back(src: u64, dst: &mut DeviceBuffer<bf16>, bytes: usize) -> anyhow::Result<()> {
    let mut host = vec![bf16::ZERO; bytes / 2];
    let lib = cuda_sys::cuda()?;
    dst.context().make_current()?;
    // SAFETY: `src` is device memory of at least `bytes` bytes and `host`
    // has room for `bytes` bytes for the duration of the synchronous copy.
    let rc =
        unsafe { cuda_sys::call!(lib, cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), src, bytes))? };
    nccl_safe::cuda_check(rc, "cuMemcpyDtoH_v2")?;
    dst.copy_from_host(&host)?;
    Ok(())
}

fn reduce_scatter<T: SuiteElem>(
    ctx: &RankCtx,
    b: &NcclBackend,
    seed: u64,
    salt: u64,
    n: usize,
) -> anyhow::Result<()> {
    let (w, r) = (ctx.world_size, ctx.rank);
    let inputs: Vec<Vec<T>> = (0..w)
        .map(|k| random_vec(seed, k, salt ^ 0x75, n * w))
        .collect();
    let sum = sum_in_rank_order(&inputs);
    let send = DeviceBuffer::from_host(b.context(), &inputs[r])?;
    let mut recv = DeviceBuffer::<T>::alloc(b.context(), n)?;
    recv.fill_bytes(POISON_BYTE)?;
    b.reduce_scatter(send.view(), recv.view_mut())?;
    b.synchronize()?;
    check(
        &format!("backend reduce_scatter {} x{n}", T::DATA_TYPE.name()),
        &recv.to_host_vec()?,
        &sum[r * n..(r + 1) * n],
        exact(ctx),
        w,
    )
}

/// A barrier returns only after the last rank, which slept 2 s, arrives.
pub fn barrier_waits(ctx: &RankCtx) -> anyhow::Result<()> {
    let b = ctx.backend("barrier", ctx.config())?;
    b.barrier()?;
    ctx.barrier("before sleep")?;
    let t = Instant::now();
    if ctx.rank == ctx.world_size - 1 {
        ctx.step("sleeping 2 s before the barrier");
        std::thread::sleep(Duration::from_secs(2));
    }
    ctx.step("barrier");
    b.barrier()?;
    let took = t.elapsed();
    ensure!(
        took >= Duration::from_millis(1900),
        "barrier returned after {took:?}, before the late rank arrived"
    );
    b.shutdown()?;
    Ok(())
}
