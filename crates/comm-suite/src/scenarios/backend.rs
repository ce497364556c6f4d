//! Scenarios on the `CommBackend` layer: every operation on random data
//! against a host reference, both all-reduce paths, sync and async, graph
//! capture replay, barriers, bad inputs, `LocalBackend`, the engine flow.
//!
//! Invariants: device buffers are poisoned (or overwritten with fresh
//! random data) before every operation and every element is checked.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use half::bf16;
use metrale_comm::AddKernel;
use metrale_comm::{
    AllReducePath, CommBackend, CommError, EnqueueMode, FastPathPolicy, LocalBackend, NcclBackend,
    OneShotPolicy,
};
use nccl_safe::{DataType, DeviceBuffer, DeviceView, DeviceViewMut, Stream};

use super::exact;
use super::reliability::all_reduce_ok;
use crate::RankCtx;
use crate::data::{
    POISON_BYTE, SuiteElem, all_reduce_reference, check, hash, random_vec, size_name,
    sum_in_rank_order,
};

const WAIT: Duration = Duration::from_secs(60);

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

/// all_gather, reduce_scatter (bf16, f32), broadcast, grouped send/recv,
/// registration and symmetric memory, a custom add kernel, barrier.
pub fn every_operation(ctx: &RankCtx) -> anyhow::Result<()> {
    every_operation_with(ctx, EnqueueMode::NonBlocking)
}

fn every_operation_with(ctx: &RankCtx, mode: EnqueueMode) -> anyhow::Result<()> {
    let seed = ctx.shared_seed(&format!("ops-{mode:?}"))?;
    let (w, r) = (ctx.world_size, ctx.rank);
    let b = ctx.backend(
        &format!("ops-{mode:?}"),
        ctx.config()
            .with_fast_path(FastPathPolicy::DEFAULT)
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
        include_str!("../../../metrale-comm/kernels/bf16_add.ptx"),
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

/// A captured all_reduce_async replays correctly 100 times with fresh data.
pub fn graph_replay(ctx: &RankCtx) -> anyhow::Result<()> {
    graph_replay_with(ctx, ctx.config(), "graph", 100)
}

/// Captures an all_reduce_async as the first operation of a fresh backend
/// built from `config`, then replays it `replays` times on fresh data.
fn graph_replay_with(
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

/// At least 15 bad inputs, each with its typed error; the backend stays
/// healthy and a correct all_reduce follows.
pub fn bad_inputs(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("bad")?;
    let (w, r) = (ctx.world_size, ctx.rank);
    let b = ctx.backend("bad", ctx.config())?;
    let c = b.context().clone();
    let stream = Stream::new(&c)?;
    let buf = DeviceBuffer::<bf16>::alloc(&c, 64)?;
    let p = buf.device_ptr();
    let s = stream.as_ref();
    type Kind = fn(&CommError) -> bool;
    let invalid: Kind = |e| matches!(e, CommError::InvalidArgument { .. });
    let unknown: Kind = |e| matches!(e, CommError::UnknownHandle { .. });
    let in_group: Kind = |e| matches!(e, CommError::InGroup { .. });
    let input: Kind = |e| e.is_invalid_input();
    let bf = DataType::Bfloat16;
    // Views of `buf` (128 bytes of this device) and of bad addresses; every
    // call below is refused before anything is submitted.
    // SAFETY: `p..p+128` is `buf`, alive to the end of this function; the
    // null and misaligned views are refused by the argument checks.
    let m = |ptr: u64, len: usize, dt: DataType| unsafe { DeviceViewMut::from_raw(ptr, len, dt) };
    // SAFETY: as above.
    let v = |ptr: u64, len: usize, dt: DataType| unsafe { DeviceView::from_raw(ptr, len, dt) };
    let mut table: Vec<(&str, Kind, metrale_comm::Result<()>)> = vec![
        (
            "all_reduce null address",
            invalid,
            b.all_reduce(m(0, 32, bf)),
        ),
        (
            "all_reduce misaligned address",
            invalid,
            b.all_reduce(m(p + 1, 32, bf)),
        ),
        (
            "all_reduce of fp8",
            invalid,
            b.all_reduce(m(p, 64, DataType::Float8E4M3)),
        ),
        (
            "all_reduce_async misaligned f32",
            invalid,
            b.all_reduce_async(m(p + 2, 8, DataType::Float32), s),
        ),
        (
            "all_gather null send address",
            invalid,
            b.all_gather(v(0, 16, bf), m(p, 16 * w, bf)),
        ),
        (
            "all_gather null receive address",
            invalid,
            b.all_gather(v(p, 16, bf), m(0, 16 * w, bf)),
        ),
        (
            "all_gather types differ",
            invalid,
            b.all_gather(v(p, 8, bf), m(p, 8 * w, DataType::Float16)),
        ),
        (
            "all_gather receive too short",
            invalid,
            b.all_gather(v(p, 8, bf), m(p, 8 * w - 1, bf)),
        ),
        (
            "reduce_scatter send too short",
            invalid,
            b.reduce_scatter(
                v(p, 8 * w + 1, DataType::Float32),
                m(p, 8, DataType::Float32),
            ),
        ),
        (
            "reduce_scatter null",
            invalid,
            b.reduce_scatter(v(0, 4 * w, bf), m(p, 4, bf)),
        ),
        (
            "broadcast root out of range",
            invalid,
            b.broadcast(m(p, 32, bf), w),
        ),
        ("broadcast null", invalid, b.broadcast(m(0, 32, bf), 0)),
        ("send_to self", invalid, b.send_to(v(p, 32, bf), r, s)),
        (
            "send_to rank out of range",
            invalid,
            b.send_to(v(p, 32, bf), w + 2, s),
        ),
        ("recv_from self", invalid, b.recv_from(m(p, 32, bf), r, s)),
        (
            "recv_from rank out of range",
            invalid,
            b.recv_from(m(p, 32, bf), w, s),
        ),
        (
            "recv_command_u32 root out of range",
            invalid,
            b.recv_command_u32(m(p, 1, DataType::Uint32), w),
        ),
        (
            "recv_command_u32 of 8 bytes",
            invalid,
            b.recv_command_u32(m(p, 2, DataType::Uint32), (r + 1) % w),
        ),
        (
            "all_to_all_v with too few counts",
            invalid,
            b.all_to_all_v(v(p, 8, bf), &[8], m(p, 8, bf), &vec![0; w + 1]),
        ),
        (
            "all_to_all_v counts past the buffer",
            invalid,
            b.all_to_all_v(v(p, 8, bf), &vec![9; w], m(p, 64, bf), &vec![9; w]),
        ),
        (
            "set_add_kernel null",
            invalid,
            // SAFETY: refused (null) before it is ever launched.
            b.set_add_kernel(unsafe { AddKernel::from_raw(std::ptr::null_mut()) }),
        ),
    ];
    if w > 1 {
        table.push((
            "all_to_all of unequal blocks",
            invalid,
            b.all_to_all(v(p, 8 * w + 1, bf), m(p, 8 * w + 1, bf)),
        ));
    }
    // SAFETY: refused (null) before NCCL sees it.
    let null_registration = unsafe { b.register_buffer(v(0, 32, bf)) }.map(|_| ());
    table.push(("register_buffer null", invalid, null_registration));
    // SAFETY: a handle value this backend never handed out.
    let never = unsafe { metrale_comm::Registration::from_raw(0xdead_beef) };
    table.push((
        "deregister_buffer unknown",
        unknown,
        b.deregister_buffer(never),
    ));
    // SAFETY: an address this backend never handed out.
    let stranger = unsafe { metrale_comm::SymmetricAlloc::from_raw(0x1234_5000, 256) };
    table.push((
        "symmetric_free unknown",
        unknown,
        b.symmetric_free(stranger),
    ));
    let sym = b.symmetric_alloc(256)?;
    let (sp, sn) = (sym.ptr(), sym.bytes());
    b.symmetric_free(sym)?;
    // SAFETY: a copy of a freed handle, which the backend must refuse.
    let again = unsafe { metrale_comm::SymmetricAlloc::from_raw(sp, sn) };
    table.push(("symmetric_free twice", unknown, b.symmetric_free(again)));
    // SAFETY: buf is 128 bytes of this device, alive past the deregistration.
    let h = unsafe { b.register_buffer(buf.view())? };
    let raw = h.as_raw();
    b.deregister_buffer(h)?;
    // SAFETY: a copy of a released handle, which the backend must refuse.
    let again = unsafe { metrale_comm::Registration::from_raw(raw) };
    table.push((
        "deregister_buffer twice",
        unknown,
        b.deregister_buffer(again),
    ));
    b.group_start()?;
    table.push(("synchronize inside a group", in_group, b.synchronize()));
    table.push(("barrier inside a group", in_group, b.barrier()));
    table.push((
        "broadcast inside a group",
        in_group,
        b.broadcast(m(p, 32, bf), 0),
    ));
    b.group_end()?;
    table.push(("group_end without group_start", input, b.group_end()));
    let mut failures = Vec::new();
    for (what, kind, res) in &table {
        match res {
            Err(e) if kind(e) => tracing::debug!("{what}: {e}"),
            Err(e) => failures.push(format!("{what}: wrong error: {e:?}")),
            Ok(()) => failures.push(format!("{what}: accepted")),
        }
    }
    ensure!(table.len() >= 15, "only {} bad inputs", table.len());
    ensure!(
        failures.is_empty(),
        "bad inputs:\n  {}",
        failures.join("\n  ")
    );
    ensure!(
        b.is_healthy(),
        "backend unhealthy after bad inputs: {:?}",
        b.failure()
    );
    ctx.step("all_reduce after bad inputs");
    let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, 9, 1000)).collect();
    let mut buf = DeviceBuffer::from_host(&c, &inputs[r])?;
    b.all_reduce(buf.view_mut())?;
    b.synchronize()?;
    check(
        "all_reduce after bad inputs",
        &buf.to_host_vec()?,
        &sum_in_rank_order(&inputs),
        exact(ctx),
        w,
    )?;
    ctx.barrier("bad inputs reduced")?;
    b.shutdown()?;
    ctx.step("calls after shutdown");
    ensure!(!b.is_healthy(), "healthy after shutdown");
    let reduced = b.all_reduce(buf.view_mut());
    let after = [
        ("all_reduce", reduced),
        ("barrier", b.barrier()),
        ("synchronize", b.synchronize()),
        ("attempt_reconnect", b.attempt_reconnect()),
        ("symmetric_alloc", b.symmetric_alloc(64).map(|_| ())),
    ];
    for (what, res) in after {
        ensure!(
            matches!(res, Err(CommError::Shutdown { .. })),
            "{what} after shutdown: expected Shutdown, got {res:?}"
        );
    }
    b.shutdown().context("a second shutdown")?;
    Ok(())
}

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
    let cfg = ctx.config().with_one_shot(OneShotPolicy::DEFAULT);
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
