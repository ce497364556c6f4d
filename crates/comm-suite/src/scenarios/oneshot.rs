//! Scenarios of the one-shot all-reduce over peer memory (2 to 8 ranks):
//! every size from 1 element to 64 MiB (chunked past the slot), odd counts,
//! eager, on compute streams and captured into graphs, in bf16 (and in
//! f16 and f32 to past the slot); eager work and graph
//! replays overlapping on several streams; a healthy reconnect in between;
//! a rank that never arrives (eagerly: the watchdog's abort ends the
//! kernels; captured: the kernels' own bound does), with reconnects after;
//! graphs replayed at once on two streams, against the replay rule (every
//! rank ends poisoned, never healthy); and the path's choice (by type and
//! size, with the default policy and with a range smaller than the
//! smallest slot) and its reasons when off.
//!
//! Invariants: every output element is checked against the path's host
//! reference (`data::one_shot_reference`, the arithmetic of
//! `metrale_comm::kernels::one_shot_sum`: f32 sum in rank order, rounded
//! once to the type), on rank 0 and, up to 64 Ki elements, on every rank; and every
//! rank's output is bit-identical to rank 0's (hash through the store). On
//! GPUs where the path is off (no peer access) the scenarios skip with the
//! backend's reason; on the emulator (ranks as threads or as processes,
//! whose CUDA IPC maps the exporter's pages) the path must be on. On the
//! emulator they end with no CUDA IPC mapping open and no free of memory
//! still mapped, in every rank's process.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use half::{bf16, f16};
use metrale_comm::kernels::OneShotElement;
use metrale_comm::{
    AllReducePath, BackendConfig, CommBackend, CommError, FastPathPolicy, NcclBackend,
    OneShotPolicy,
};
use nccl_safe::{DataType, DeviceBuffer, Stream};

use crate::RankCtx;
use crate::data::{SuiteElem, check, hash, one_shot_reference, random_vec, size_name};

const WAIT: Duration = Duration::from_secs(60);
const TIMEOUT: Duration = Duration::from_secs(2);
const SLACK: Duration = Duration::from_secs(1);

/// Element counts of the sweep: 1 to 64 MiB, odd counts, both sides of the
/// 1 MiB slot.
const SIZES: &[usize] = &[
    1,
    2,
    3,
    7,
    8,
    9,
    255,
    4097,
    65_535,
    1 << 19,
    (1 << 19) + 3,
    (2 << 20) + 5,
    (32 << 20) - 1,
];

/// Element counts of the f16 and f32 sweeps: odd counts, both sides of the
/// slot for both types (262 144 f32 or 524 288 f16 values fill it).
const TYPED_SIZES: &[usize] = &[1, 2, 3, 9, 255, 4097, 65_535, (1 << 18) + 3, (1 << 19) + 3];

pub(super) fn one_shot_config(ctx: &RankCtx, policy: OneShotPolicy) -> BackendConfig {
    ctx.config()
        .with_one_shot(policy)
        .with_fast_path(FastPathPolicy::Never)
}

/// The backend, or a skip when the path is off on this machine (GPUs
/// without peer access); on the emulator the path must be on.
pub(super) fn one_shot_backend(
    ctx: &RankCtx,
    name: &str,
    cfg: BackendConfig,
) -> anyhow::Result<NcclBackend> {
    let b = ctx.backend(name, cfg)?;
    if let Some(why) = b.one_shot_unavailable() {
        if ctx.on_gpu() {
            b.shutdown().ok();
            return Err(RankCtx::skip(format!("the one-shot path is off: {why}")));
        }
        bail!("the one-shot path is off on the emulator: {why}");
    }
    ensure!(
        b.all_reduce_path(2) == AllReducePath::OneShot,
        "all_reduce_path(2) = {:?}",
        b.all_reduce_path(2)
    );
    Ok(b)
}

/// Checks `got` on this rank: every element against the reference of the
/// `w` ranks' inputs (on rank 0, or on every rank for small counts), and
/// bit-identity with every other rank.
fn check_sum<T: OneShotElement + SuiteElem>(
    ctx: &RankCtx,
    what: &str,
    got: &[T],
    inputs: impl Fn(usize) -> Vec<T>,
) -> anyhow::Result<()> {
    check_in(ctx, None, what, got, inputs)
}

/// [`check_sum`] on a sub-communicator whose rank `c` is the suite's rank
/// `members[c]` (`None`: the whole world; `inputs` takes the suite's
/// ranks): every element against the reference on every rank, which makes
/// the group's outputs bit-identical.
pub(super) fn check_in<T: OneShotElement + SuiteElem>(
    ctx: &RankCtx,
    members: Option<&[usize]>,
    what: &str,
    got: &[T],
    inputs: impl Fn(usize) -> Vec<T>,
) -> anyhow::Result<()> {
    if let Some(m) = members {
        let want = one_shot_reference(m.len(), |c| inputs(m[c]));
        return check(what, got, &want, true, m.len());
    }
    if ctx.rank == 0 || got.len() <= 1 << 16 {
        let want = one_shot_reference(ctx.world_size, inputs);
        check(what, got, &want, true, ctx.world_size)?;
    }
    ctx.all_equal(what, hash(got))
}

/// Every size, eager on the backend's stream, asynchronous on a compute
/// stream, and captured into a graph replayed twice (fresh inputs each
/// time), bf16 from 1 element to 64 MiB and f16 and f32 to past the slot;
/// the reduction goes in chunks past the slot. Then signed zeros in every
/// type.
pub fn sizes(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("oneshot-sizes")?;
    let b = one_shot_backend(
        ctx,
        "oneshot-sizes",
        one_shot_config(ctx, OneShotPolicy::Always),
    )?;
    let compute = Stream::new(b.context())?;
    sweep::<bf16>(ctx, (&b, None), &compute, seed, SIZES)?;
    sweep::<f16>(ctx, (&b, None), &compute, seed, TYPED_SIZES)?;
    sweep::<f32>(ctx, (&b, None), &compute, seed, TYPED_SIZES)?;
    signed_zeros::<bf16>(ctx, &b)?;
    signed_zeros::<f16>(ctx, &b)?;
    signed_zeros::<f32>(ctx, &b)?;
    b.shutdown()?;
    no_mapping_left(ctx, "oneshot-sizes")
}

/// The sweep of `sizes` in `T` (see [`sizes`]) on `b`, the whole world's
/// backend or a sub-communicator's (with its members, as in [`check_in`]).
pub(super) fn sweep<T: OneShotElement + SuiteElem>(
    ctx: &RankCtx,
    (b, members): (&NcclBackend, Option<&[usize]>),
    compute: &Stream,
    seed: u64,
    sizes: &[usize],
) -> anyhow::Result<()> {
    let dtype = T::DATA_TYPE;
    let ranks = members.map_or(ctx.world_size, <[usize]>::len);
    for (si, &n) in sizes.iter().enumerate() {
        let big = n * dtype.size() > 2 << 20;
        for mode in ["eager", "async", "captured"] {
            if big && mode == "async" && ranks > 2 {
                continue;
            }
            let salt = (si as u64) << 8 | mode.len() as u64 | (dtype.size() as u64) << 48;
            let what = format!(
                "{mode} one-shot of {} {dtype} ({n} elements)",
                size_name(dtype.size() * n)
            );
            ctx.step(what.clone());
            let input = |k: usize, salt: u64| random_vec::<T>(seed, k, salt, n);
            let mut buf = DeviceBuffer::from_host(b.context(), &input(ctx.rank, salt))?;
            match mode {
                "eager" => {
                    b.all_reduce(buf.view_mut()).with_context(|| what.clone())?;
                    b.synchronize().with_context(|| what.clone())?;
                }
                "async" => {
                    b.all_reduce_async(buf.view_mut(), compute.as_ref())
                        .with_context(|| what.clone())?;
                    compute
                        .wait_until_idle(WAIT)
                        .with_context(|| what.clone())?;
                }
                _ => {
                    compute.begin_capture()?;
                    let r = b.all_reduce_async(buf.view_mut(), compute.as_ref());
                    let graph = compute.end_capture()?;
                    r.with_context(|| what.clone())?;
                    let exec = graph.instantiate()?;
                    let replays = if big { 1 } else { 2 };
                    for replay in 0..replays {
                        let salt = salt ^ (replay + 1) << 32;
                        buf.copy_from_host(&input(ctx.rank, salt))?;
                        exec.launch(compute)?;
                        compute
                            .wait_until_idle(WAIT)
                            .with_context(|| what.clone())?;
                        ensure!(b.is_healthy(), "{what}: unhealthy after replay {replay}");
                        let got = buf.to_host_vec()?;
                        let what = format!("{what}, replay {replay}");
                        check_in(ctx, members, &what, &got, |k| input(k, salt))?;
                    }
                    continue;
                }
            }
            let got = buf.to_host_vec()?;
            check_in(ctx, members, &what, &got, |k| input(k, salt))?;
        }
    }
    Ok(())
}

/// Zeros in `T`: the "not arrived" word the kernel reads as zeros (the
/// (+0.0, -0.0) pair of bf16 and f16, read as (+0.0, +0.0); the f32 -0.0,
/// read as +0.0), and lone signed zeros of the 16-bit types, which it
/// keeps.
fn signed_zeros<T: OneShotElement + SuiteElem>(
    ctx: &RankCtx,
    b: &NcclBackend,
) -> anyhow::Result<()> {
    let n = 1001;
    let zeros = |k: usize| -> Vec<T> {
        (0..n)
            .map(|i| match i % 4 {
                0 => T::from_f32(0.0),
                1 => T::from_f32(-0.0),
                2 => T::from_f32(if k.is_multiple_of(2) { -0.0 } else { 0.0 }),
                _ => T::from_f32(k as f32 + 0.5),
            })
            .collect()
    };
    let mut buf = DeviceBuffer::from_host(b.context(), &zeros(ctx.rank))?;
    b.all_reduce(buf.view_mut())?;
    b.synchronize()?;
    let what = format!("signed zeros in {}", T::DATA_TYPE);
    check_sum(ctx, &what, &buf.to_host_vec()?, zeros)
}

/// On the emulator: once every rank shut down, no CUDA IPC mapping is open
/// and no memory was freed while mapped.
pub(super) fn no_mapping_left(ctx: &RankCtx, name: &str) -> anyhow::Result<()> {
    ctx.barrier(&format!("{name}: shut down"))?;
    if let Some(emu) = ctx.emu() {
        ensure!(
            emu.ipc_open_mappings() == 0,
            "{} IPC mappings are still open after every rank shut down",
            emu.ipc_open_mappings()
        );
        ensure!(
            emu.ipc_violations() == 0,
            "{} frees of device memory still mapped by a peer",
            emu.ipc_violations()
        );
    }
    Ok(())
}

/// One all-reduce of `n` values on `b` and `stream` with a fresh random
/// input, checked.
fn one_ok(ctx: &RankCtx, b: &NcclBackend, seed: u64, salt: u64, n: usize) -> anyhow::Result<()> {
    let mut buf =
        DeviceBuffer::from_host(b.context(), &random_vec::<bf16>(seed, ctx.rank, salt, n))?;
    b.all_reduce(buf.view_mut())?;
    b.synchronize()?;
    check_sum(ctx, &format!("one-shot {salt}"), &buf.to_host_vec()?, |k| {
        random_vec(seed, k, salt, n)
    })
}

/// The seed of scenario `name` and a backend with the default one-shot
/// range and the short [`TIMEOUT`], after one checked all-reduce of 1000
/// values.
fn short_timeout_backend(ctx: &RankCtx, name: &str) -> anyhow::Result<(u64, NcclBackend)> {
    let seed = ctx.shared_seed(name)?;
    let cfg = ctx
        .config()
        .with_collective_timeout(TIMEOUT)
        .with_one_shot(crate::ONE_SHOT_TO_1M);
    let b = one_shot_backend(ctx, name, cfg)?;
    one_ok(ctx, &b, seed, 1, 1000)?;
    Ok((seed, b))
}

/// Eager work on three streams and two graphs replayed on a fourth, all in
/// flight at once (no host wait in between), in the same order on every
/// rank; a healthy reconnect; the same again. Then the path's choice, an
/// f32 all-reduce beside it, and a backend with the path off.
pub fn streams(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("oneshot-streams")?;
    let w = ctx.world_size;
    let b = one_shot_backend(
        ctx,
        "oneshot-streams",
        ctx.config().with_one_shot(crate::ONE_SHOT_TO_1M),
    )?;
    let (s1, s2, s3) = (
        Stream::new(b.context())?,
        Stream::new(b.context())?,
        Stream::new(b.context())?,
    );
    let n = 3001;
    let input = |k: usize, salt: u64| random_vec::<bf16>(seed, k, salt, n);
    fn typed_input<T: SuiteElem>(seed: u64, k: usize, salt: u64) -> Vec<T> {
        random_vec(seed, k, salt, 2001)
    }
    for round in 0..2u64 {
        let salt = |i: u64| round << 16 | i;
        let mut bufs: Vec<DeviceBuffer<bf16>> = (0..8)
            .map(|i| DeviceBuffer::from_host(b.context(), &input(ctx.rank, salt(i))))
            .collect::<Result<_, _>>()?;
        // Other types on the same lanes, in between: f32 (eager, and in
        // the second graph) and f16 (on a compute stream).
        let mut fbufs: Vec<DeviceBuffer<f32>> = (0..2)
            .map(|i| {
                DeviceBuffer::from_host(
                    b.context(),
                    &typed_input::<f32>(seed, ctx.rank, salt(10 + i)),
                )
            })
            .collect::<Result<_, _>>()?;
        let mut hbuf =
            DeviceBuffer::from_host(b.context(), &typed_input::<f16>(seed, ctx.rank, salt(12)))?;
        // Graphs: bufs[5] and bufs[6] in one capture, bufs[7] and fbufs[1]
        // in another.
        let (ga, gb) = {
            let (head, tail) = bufs.split_at_mut(7);
            s3.begin_capture()?;
            let r = b
                .all_reduce_async(head[5].view_mut(), s3.as_ref())
                .and_then(|()| b.all_reduce_async(head[6].view_mut(), s3.as_ref()));
            let ga = s3.end_capture()?;
            r?;
            s3.begin_capture()?;
            let r = b
                .all_reduce_async(tail[0].view_mut(), s3.as_ref())
                .and_then(|()| b.all_reduce_async(fbufs[1].view_mut(), s3.as_ref()));
            let gb = s3.end_capture()?;
            r?;
            (ga.instantiate()?, gb.instantiate()?)
        };
        ctx.step(format!("round {round}: eager work and replays in flight"));
        let [b0, b1, b2, b3, b4, ..] = &mut bufs[..] else {
            bail!("eight buffers");
        };
        b.all_reduce(b0.view_mut())?;
        b.all_reduce_async(b1.view_mut(), s1.as_ref())?;
        ga.launch(&s3)?;
        b.all_reduce_async(b2.view_mut(), s2.as_ref())?;
        b.all_reduce_async(hbuf.view_mut(), s2.as_ref())?;
        b.all_reduce(b3.view_mut())?;
        b.all_reduce(fbufs[0].view_mut())?;
        gb.launch(&s3)?;
        b.all_reduce_async(b4.view_mut(), s1.as_ref())?;
        for s in [&s1, &s2, &s3] {
            s.wait_until_idle(WAIT)?;
        }
        b.synchronize()?;
        ensure!(b.is_healthy(), "round {round}: unhealthy");
        for (i, buf) in bufs.iter().enumerate() {
            let got = buf.to_host_vec()?;
            check_sum(ctx, &format!("round {round} buffer {i}"), &got, |k| {
                input(k, salt(i as u64))
            })?;
        }
        for (i, buf) in fbufs.iter().enumerate() {
            let got = buf.to_host_vec()?;
            check_sum(ctx, &format!("round {round} f32 buffer {i}"), &got, |k| {
                typed_input::<f32>(seed, k, salt(10 + i as u64))
            })?;
        }
        check_sum(
            ctx,
            &format!("round {round} f16"),
            &hbuf.to_host_vec()?,
            |k| typed_input::<f16>(seed, k, salt(12)),
        )?;
        drop((ga, gb));
        if round == 0 {
            ctx.step("healthy attempt_reconnect");
            ctx.barrier("oneshot-streams: reconnect")?;
            b.attempt_reconnect().context("healthy reconnect")?;
            ensure!(
                b.one_shot_unavailable().is_none(),
                "the one-shot path is off after a reconnect: {:?}",
                b.one_shot_unavailable()
            );
        }
    }
    // The choice: bf16 up to 1 MiB takes the one-shot path, larger NCCL's
    // (or the fast path's range on 2 ranks).
    ensure!(b.all_reduce_path(1 << 20) == AllReducePath::OneShot);
    let above = b.all_reduce_path((1 << 20) + 2);
    ensure!(
        above == AllReducePath::Nccl || (w == 2 && above == AllReducePath::FastPath),
        "all_reduce_path(1 MiB + 2) = {above:?}"
    );
    ensure!(b.all_reduce_path(8 << 20) == AllReducePath::Nccl);
    for dtype in [DataType::Float16, DataType::Float32] {
        let path = b.all_reduce_path_of(dtype, 1 << 20);
        ensure!(path == AllReducePath::OneShot, "{dtype}, 1 MiB: {path:?}");
    }
    for dtype in [DataType::Float64, DataType::Int32] {
        let path = b.all_reduce_path_of(dtype, 4096);
        ensure!(path == AllReducePath::Nccl, "{dtype}, 4 KiB: {path:?}");
    }
    let f: Vec<f64> = random_vec::<f32>(seed, ctx.rank, 98, 999)
        .into_iter()
        .map(f64::from)
        .collect();
    let mut fb = DeviceBuffer::from_host(b.context(), &f)?;
    b.all_reduce(fb.view_mut())?;
    b.synchronize()?;
    let sum: Vec<f64> = (0..999)
        .map(|i| {
            (0..w)
                .map(|k| f64::from(random_vec::<f32>(seed, k, 98, 999)[i]))
                .sum::<f64>()
        })
        .collect();
    let got = fb.to_host_vec()?;
    if let Some(i) = (0..999).find(|&i| (got[i] - sum[i]).abs() > 1e-12 * sum[i].abs().max(1.0)) {
        bail!(
            "f64 beside the one-shot path: element {i} is {}, want {}",
            got[i],
            sum[i]
        );
    }
    let f: Vec<f32> = random_vec(seed, ctx.rank, 99, 1000);
    let mut fb = DeviceBuffer::from_host(b.context(), &f)?;
    b.all_reduce(fb.view_mut())?;
    b.synchronize()?;
    let fs: Vec<Vec<f32>> = (0..w).map(|k| random_vec(seed, k, 99, 1000)).collect();
    check(
        "f32 down the one-shot path",
        &fb.to_host_vec()?,
        &one_shot_reference(w, |k| fs[k].clone()),
        true,
        w,
    )?;
    b.shutdown()?;
    // A range below the smallest slot: the set-up's probe still fits, and
    // the path takes exactly the range.
    let small = OneShotPolicy::Range {
        min_bytes: 0,
        max_bytes: 1000,
    };
    let sb = one_shot_backend(ctx, "oneshot-small", ctx.config().with_one_shot(small))?;
    for (dtype, bytes, want) in [
        (DataType::Bfloat16, 1000, AllReducePath::OneShot),
        (DataType::Float32, 1000, AllReducePath::OneShot),
        (DataType::Float16, 1002, AllReducePath::Nccl),
        (DataType::Bfloat16, 1 << 20, AllReducePath::Nccl),
    ] {
        let path = sb.all_reduce_path_of(dtype, bytes);
        ensure!(
            path == want || (w == 2 && path == AllReducePath::FastPath && bytes > 1000),
            "range 0-1000: {dtype}, {bytes} bytes: {path:?}, want {want:?}"
        );
    }
    one_ok(ctx, &sb, seed, 97, 500)?;
    sb.shutdown()?;
    let off = ctx.backend(
        "oneshot-off",
        ctx.config().with_one_shot(OneShotPolicy::Never),
    )?;
    ensure!(off.all_reduce_path(2) != AllReducePath::OneShot);
    let why = off.one_shot_unavailable().unwrap_or_default();
    ensure!(why.contains("never"), "the reason it is off: `{why}`");
    off.shutdown()?;
    no_mapping_left(ctx, "oneshot-streams")
}

/// The last rank never arrives at a one-shot all-reduce: eagerly, the
/// others' watchdogs time it out and their abort ends the kernels;
/// captured, the kernels' own bound ends them and the watchdog poisons on
/// their status. After each, every rank reconnects and the path works
/// again; device memory stays flat.
pub fn stuck_rank(ctx: &RankCtx) -> anyhow::Result<()> {
    let (seed, b) = short_timeout_backend(ctx, "oneshot-stuck")?;
    let last = ctx.world_size - 1;
    let n = 1000;
    let compute = Stream::new(b.context())?;
    let mut buf = DeviceBuffer::<bf16>::from_host(b.context(), &random_vec(seed, ctx.rank, 2, n))?;
    let free_before = b.context().mem_info()?.0;
    for (cycle, captured) in [(0u64, false), (1, true)] {
        let key = format!("oneshot-stuck/{cycle}");
        // A graph captured in this generation (a reconnect invalidates it).
        let exec = if captured {
            compute.begin_capture()?;
            let r = b.all_reduce_async(buf.view_mut(), compute.as_ref());
            let graph = compute.end_capture()?;
            r?;
            Some(graph.instantiate()?)
        } else {
            None
        };
        if ctx.rank == last {
            ctx.step(format!("cycle {cycle}: never arriving"));
            for r in 0..last {
                ctx.get(&format!("{key}/seen/{r}"))?;
            }
        } else {
            ctx.step(format!("cycle {cycle}: one-shot without rank {last}"));
            let t = Instant::now();
            if let Some(exec) = &exec {
                exec.launch(&compute)?;
                compute
                    .wait_until_idle(TIMEOUT + SLACK)
                    .context("the captured one-shot did not end by its bound")?;
                let until = Instant::now() + SLACK;
                while b.is_healthy() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
                let r = match b.failure() {
                    Some(f) => Err(CommError::Failed(f)),
                    None => Ok(()),
                };
                super::reliability::expect_timeout("captured stuck one-shot", r, t.elapsed())?;
            } else {
                let r = b.all_reduce(buf.view_mut()).and_then(|()| b.synchronize());
                super::reliability::expect_timeout("eager stuck one-shot", r, t.elapsed())?;
            }
            ensure!(!b.is_healthy(), "healthy after a rank never arrived");
            ctx.set(&format!("{key}/seen/{}", ctx.rank), b"1")?;
        }
        drop(exec);
        ctx.barrier(&format!("{key}: before reconnect"))?;
        ctx.step(format!("cycle {cycle}: attempt_reconnect"));
        b.attempt_reconnect()
            .with_context(|| format!("cycle {cycle}: attempt_reconnect"))?;
        ensure!(b.is_healthy(), "cycle {cycle}: unhealthy after reconnect");
        ensure!(
            b.one_shot_unavailable().is_none(),
            "cycle {cycle}: the one-shot path is off after reconnect: {:?}",
            b.one_shot_unavailable()
        );
        one_ok(ctx, &b, seed, 10 + cycle, n).with_context(|| format!("cycle {cycle}"))?;
    }
    let free_after = b.context().mem_info()?.0;
    let slack = if ctx.on_gpu() { 64 << 20 } else { 0 };
    ensure!(
        free_after + slack >= free_before,
        "device memory free went from {free_before} to {free_after} over two reconnects"
    );
    b.shutdown()?;
    no_mapping_left(ctx, "oneshot-stuck")
}

/// Graphs holding one-shots replayed at once on several streams of each
/// rank, with rank 0 ahead of the others, so that on rank 0 a replay is
/// launched while an earlier one still waits for its peers (decision
/// 0017): every replay's sum is right, bit for bit, every round, and the
/// backend stays healthy. Then the same beside eager one-shots on two
/// more streams, all in flight at once, and a graph of two one-shots.
pub fn concurrent_graphs(ctx: &RankCtx) -> anyhow::Result<()> {
    let (seed, b) = short_timeout_backend(ctx, "oneshot-concurrent")?;
    let n = 1000;
    let streams: Vec<Stream> = (0..5)
        .map(|_| Stream::new(b.context()))
        .collect::<Result<_, _>>()?;
    // Graphs 0-2 hold one one-shot each; graph 3 holds two, on two buffers.
    let mut bufs: Vec<DeviceBuffer<bf16>> = (0..5)
        .map(|i| DeviceBuffer::<bf16>::alloc(b.context(), n + 7 * i))
        .collect::<Result<_, _>>()?;
    let mut execs = Vec::with_capacity(4);
    for g in 0..4 {
        let s = &streams[g.min(2)];
        s.begin_capture()?;
        let r = if g < 3 {
            b.all_reduce_async(bufs[g].view_mut(), s.as_ref())
        } else {
            let (x, y) = bufs.split_at_mut(4);
            b.all_reduce_async(x[3].view_mut(), s.as_ref())
                .and_then(|()| b.all_reduce_async(y[0].view_mut(), s.as_ref()))
        };
        let graph = s.end_capture()?;
        r.with_context(|| format!("capturing graph {g}"))?;
        execs.push(graph.instantiate()?);
    }
    // Which buffers graph `g` reduces, and on which stream it replays.
    let of = |g: usize| if g < 3 { vec![g] } else { vec![3, 4] };
    let on = |g: usize| g.min(2);
    ensure!(
        b.all_reduce_path(n * 2) == AllReducePath::OneShot,
        "the one-shot path is not taken at {n} values"
    );
    for round in 0..3u64 {
        ctx.step(format!("round {round}: every graph replayed at once"));
        let salt = |i: usize| 100 + round * 10 + i as u64;
        for (i, buf) in bufs.iter_mut().enumerate() {
            let len = buf.len();
            buf.copy_from_host(&random_vec(seed, ctx.rank, salt(i), len))?;
        }
        ctx.barrier(&format!("oneshot-concurrent: round {round}"))?;
        if ctx.rank != 0 {
            std::thread::sleep(Duration::from_millis(300));
        }
        // Graph 3 twice: its second replay is ordered behind its first by
        // its stream, and behind the others' by the backend.
        for g in [0, 1, 2, 3] {
            execs[g].launch(&streams[on(g)])?;
        }
        if round == 2 {
            // Eager one-shots beside the replays, on two more streams.
            for (k, i) in [(3usize, 0usize), (4, 1)] {
                let mut extra = DeviceBuffer::from_host(
                    b.context(),
                    &random_vec::<bf16>(seed, ctx.rank, 900 + k as u64, n),
                )?;
                b.all_reduce_async(extra.view_mut(), streams[k].as_ref())?;
                streams[k].wait_until_idle(WAIT)?;
                check_sum(
                    ctx,
                    &format!("eager one-shot {i} beside replays"),
                    &extra.to_host_vec()?,
                    |r| random_vec(seed, r, 900 + k as u64, n),
                )?;
            }
        }
        for s in &streams {
            s.wait_until_idle(WAIT)
                .context("a replay did not end in time")?;
        }
        ensure!(
            b.is_healthy(),
            "round {round}: poisoned by concurrent replays: {:?}",
            b.failure()
        );
        for g in 0..4 {
            for i in of(g) {
                let len = bufs[i].len();
                check_sum(
                    ctx,
                    &format!("round {round}: graph {g} (buffer {i}, stream {})", on(g)),
                    &bufs[i].to_host_vec()?,
                    |r| random_vec(seed, r, salt(i), len),
                )?;
            }
        }
    }
    drop(execs);
    interleaved_captures(ctx, &b, seed, n)?;
    ctx.barrier("oneshot-concurrent: done")?;
    b.shutdown()?;
    no_mapping_left(ctx, "oneshot-concurrent")
}

/// Two graphs captured at once on two threads, their one-shots
/// interleaved: graph 1's first on stream A, graph 2's on stream B, then
/// graph 1's second on A', forked from A before the first (on GPUs; on
/// the emulator, on A). Graph 1's two
/// one-shots are ordered by its own capture's edge, whatever graph 2's
/// capture did in between; both graphs replayed, every sum checked.
fn interleaved_captures(
    ctx: &RankCtx,
    b: &metrale_comm::NcclBackend,
    seed: u64,
    n: usize,
) -> anyhow::Result<()> {
    ctx.step("two graphs captured at once on two threads, one-shots interleaved");
    let turn = std::sync::Barrier::new(2);
    let streams: Vec<Stream> = (0..3)
        .map(|_| Stream::new(b.context()))
        .collect::<Result<_, _>>()?;
    let mut bufs: Vec<DeviceBuffer<bf16>> = (0..3)
        .map(|i| DeviceBuffer::<bf16>::alloc(b.context(), n + 3 * i))
        .collect::<Result<_, _>>()?;
    let salt = |i: usize| 700 + i as u64;
    for (i, buf) in bufs.iter_mut().enumerate() {
        let len = buf.len();
        buf.copy_from_host(&random_vec(seed, ctx.rank, salt(i), len))?;
    }
    let (first, rest) = bufs.split_at_mut(1);
    let (second, third) = rest.split_at_mut(1);
    // The emulator joins no stream into a capture through an event: there
    // graph 1's second one-shot stays on A (the captures still interleave).
    let forked = ctx.on_gpu();
    let (a, bs) = (&streams[0], &streams[2]);
    let a2 = if forked { &streams[1] } else { a };
    let (g1, g2) = std::thread::scope(|scope| {
        let one = scope.spawn(|| -> anyhow::Result<nccl_safe::GraphExec> {
            // Both turns are taken whatever fails, so neither thread waits
            // for ever.
            let waited = std::cell::Cell::new(0);
            let take_turn = || {
                turn.wait();
                waited.set(waited.get() + 1);
            };
            let r = (|| -> anyhow::Result<()> {
                a.begin_capture()?;
                let fork = nccl_safe::Event::new(b.context(), false)?;
                if forked {
                    fork.record(a)?;
                    a2.wait_event(&fork)?;
                }
                b.all_reduce_async(first[0].view_mut(), a.as_ref())?;
                take_turn();
                take_turn();
                b.all_reduce_async(second[0].view_mut(), a2.as_ref())?;
                if forked {
                    fork.record(a2)?;
                    a.wait_event(&fork)?;
                }
                Ok(())
            })();
            while waited.get() < 2 {
                take_turn();
            }
            let graph = a.end_capture();
            r.context("capturing graph 1")?;
            Ok(graph?.instantiate()?)
        });
        let two = scope.spawn(|| -> anyhow::Result<nccl_safe::GraphExec> {
            turn.wait();
            let graph = bs.begin_capture().and_then(|()| {
                let r = b.all_reduce_async(third[0].view_mut(), bs.as_ref());
                let graph = bs.end_capture();
                r.map_err(|e| nccl_safe::Error::invalid("capturing graph 2", e.to_string()))
                    .and(graph)
            });
            turn.wait();
            Ok(graph.context("capturing graph 2")?.instantiate()?)
        });
        (one.join(), two.join())
    });
    let g1 = g1.map_err(|_| anyhow::anyhow!("graph 1's thread panicked"))??;
    let g2 = g2.map_err(|_| anyhow::anyhow!("graph 2's thread panicked"))??;
    ctx.barrier("oneshot-concurrent: interleaved captures")?;
    g1.launch(a)?;
    g2.launch(bs)?;
    for s in &streams {
        s.wait_until_idle(WAIT)
            .context("an interleaved capture's replay did not end in time")?;
    }
    ensure!(
        b.is_healthy(),
        "poisoned by interleaved captures: {:?}",
        b.failure()
    );
    for (i, buf) in bufs.iter().enumerate() {
        let len = buf.len();
        check_sum(
            ctx,
            &format!("interleaved captures: buffer {i}"),
            &buf.to_host_vec()?,
            |r| random_vec(seed, r, salt(i), len),
        )?;
    }
    Ok(())
}
