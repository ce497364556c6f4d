//! Scenarios of the fused all-reduce + residual add + RMSNorm
//! (`CommBackend::all_reduce_add_rms_norm`): every type, rows of 1 to the
//! kernels' limit (odd sizes), 1 to 512 tokens (a sampled set), on every
//! path (the one-shot's fused kernel, one block a row and, at even ranks,
//! over thread block clusters, NCCL's all-reduce then the add +
//! norm kernel, the 2-rank fast path then the kernel, and `LocalBackend`),
//! eager on a compute stream and captured into a graph replayed twice;
//! each bad input with its typed error and a healthy backend after.
//!
//! Invariants: every output element and every residual element is
//! checked against the host reference (`metrale_comm::norm::
//! add_rms_norm_reference` of the path's all-reduce reference), bit for bit
//! where the all-reduce is (the emulator, or at most 2 ranks), and every
//! output against an exact f64 evaluation within `norm::within_bound`; all
//! ranks' outputs are bit-identical (hash through the store).

use std::time::Duration;

use anyhow::{Context as _, ensure};
use half::{bf16, f16};
use metrale_comm::kernels::OneShotElement;
use metrale_comm::norm::{MAX_HIDDEN, add_rms_norm_reference, exact_row, within_bound};
use metrale_comm::{
    AllReducePath, CommBackend, CommError, FastPathPolicy, LocalBackend, OneShotPolicy,
};
use nccl_safe::{DataType, DeviceBuffer, DeviceView, DeviceViewMut, Stream};

use crate::RankCtx;
use crate::data::{SuiteElem, all_reduce_reference, check, hash, random_vec};

const WAIT: Duration = Duration::from_secs(60);
const EPS: f32 = 1e-5;

/// (hidden, tokens) of bf16: 1 to the limit, odd sizes, 1 to 512 tokens.
const SHAPES: &[(usize, usize)] = &[
    (1, 1),
    (7, 3),
    (8, 512),
    (100, 32),
    (1000, 5),
    (4096, 8),
    (8191, 2),
    (8192, 1),
    (MAX_HIDDEN, 1),
];

/// (hidden, tokens) of f16 and f32.
const TYPED_SHAPES: &[(usize, usize)] = &[(3, 7), (64, 128), (4096, 4), (5003, 1)];

/// The paths, by name: (one-shot policy, fast-path policy, whether this
/// rank's fused kernel spreads a row over a thread block cluster).
/// "one-shot-clusters" turns the cluster entries on at even ranks only:
/// the backend's cluster launch where the device can (the emulator, and
/// GPUs of compute capability 9.0 and newer), and ranks that differ in
/// it, whose outputs must still be bit-identical.
fn paths(ctx: &RankCtx) -> Vec<(&'static str, OneShotPolicy, FastPathPolicy, bool)> {
    let mut p = vec![
        (
            "one-shot",
            OneShotPolicy::Always,
            FastPathPolicy::Never,
            false,
        ),
        (
            "one-shot-clusters",
            OneShotPolicy::Always,
            FastPathPolicy::Never,
            ctx.rank.is_multiple_of(2),
        ),
        ("nccl", OneShotPolicy::Never, FastPathPolicy::Never, false),
    ];
    if ctx.world_size == 2 {
        p.push((
            "fast path",
            OneShotPolicy::Never,
            FastPathPolicy::Always,
            false,
        ));
    }
    p
}

/// Every path, type and shape, eager and captured, then the bad inputs.
pub fn fused_norm(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("norm-fused")?;
    for (name, one_shot, fast, cluster) in paths(ctx) {
        let cfg = ctx
            .config()
            .with_one_shot(one_shot)
            .with_fast_path(fast)
            .with_fused_cluster(cluster);
        let b = ctx.backend(&format!("norm-{name}"), cfg)?;
        let want = match name {
            "one-shot" | "one-shot-clusters" => AllReducePath::OneShot,
            "fast path" => AllReducePath::FastPath,
            _ => AllReducePath::Nccl,
        };
        let got = b.all_reduce_path(64);
        if got != want {
            if ctx.on_gpu() && want != AllReducePath::Nccl {
                ctx.step(format!("{name}: skipped, the backend takes {got:?}"));
                b.shutdown()?;
                continue;
            }
            anyhow::bail!("{name}: the backend takes {got:?}");
        }
        let compute = Stream::new(b.context())?;
        let on = (&b as &dyn CommBackend, &compute);
        // The fast path serves bf16 only; the others fall to NCCL's.
        shapes::<bf16>(ctx, name, on, seed, SHAPES, &b)?;
        shapes::<f16>(ctx, name, on, seed, TYPED_SHAPES, &b)?;
        shapes::<f32>(ctx, name, on, seed, TYPED_SHAPES, &b)?;
        bad_inputs(ctx, &b, &compute)?;
        b.shutdown()?;
    }
    local(ctx, seed)
}

/// One backend, every shape of `T`, eager and captured.
fn shapes<T: OneShotElement + SuiteElem>(
    ctx: &RankCtx,
    path: &str,
    (b, compute): (&dyn CommBackend, &Stream),
    seed: u64,
    shapes: &[(usize, usize)],
    nccl: &metrale_comm::NcclBackend,
) -> anyhow::Result<()> {
    let dtype = T::DATA_TYPE;
    let world = b.world_size();
    for (si, &(hidden, tokens)) in shapes.iter().enumerate() {
        let n = hidden * tokens;
        for mode in ["eager", "captured"] {
            let salt = (si as u64) << 8 | mode.len() as u64 | (dtype.size() as u64) << 48;
            let what = format!("{path}: {mode} {dtype} add+norm, {tokens} x {hidden}");
            ctx.step(what.clone());
            let x_of = |k: usize, salt: u64| random_vec::<T>(seed, k, salt, n);
            // The residual and weight are replicated: the same on every rank.
            let res_of = |salt: u64| random_vec::<T>(seed, 1 << 20, salt, n);
            let weight = random_vec::<T>(seed, 1 << 21, salt, hidden);
            let mut x = DeviceBuffer::from_host(b_ctx(nccl), &x_of(ctx.rank, salt))?;
            let mut r = DeviceBuffer::from_host(b_ctx(nccl), &res_of(salt))?;
            let w = DeviceBuffer::from_host(b_ctx(nccl), &weight)?;
            let runs: Vec<u64> = match mode {
                "eager" => {
                    b.all_reduce_add_rms_norm(
                        x.view_mut(),
                        r.view_mut(),
                        w.view(),
                        EPS,
                        compute.as_ref(),
                    )
                    .with_context(|| what.clone())?;
                    compute
                        .wait_until_idle(WAIT)
                        .with_context(|| what.clone())?;
                    vec![salt]
                }
                _ => {
                    compute.begin_capture()?;
                    let res = b.all_reduce_add_rms_norm(
                        x.view_mut(),
                        r.view_mut(),
                        w.view(),
                        EPS,
                        compute.as_ref(),
                    );
                    let graph = compute.end_capture()?;
                    res.with_context(|| what.clone())?;
                    let exec = graph.instantiate()?;
                    let mut salts = Vec::new();
                    for replay in 0..2u64 {
                        let s = salt ^ (replay + 1) << 32;
                        x.copy_from_host(&x_of(ctx.rank, s))?;
                        r.copy_from_host(&res_of(s))?;
                        exec.launch(compute)?;
                        compute
                            .wait_until_idle(WAIT)
                            .with_context(|| what.clone())?;
                        if replay == 0 {
                            // The first replay's results are checked too.
                            let what = format!("{what}, replay 0");
                            verify::<T>(ctx, nccl, &what, (&x, &r), (&x_of, &res_of, s), &weight)?;
                        } else {
                            salts.push(s);
                        }
                    }
                    salts
                }
            };
            ensure!(b.is_healthy(), "{what}: unhealthy");
            for s in runs {
                verify::<T>(ctx, nccl, &what, (&x, &r), (&x_of, &res_of, s), &weight)?;
            }
            let _ = world;
        }
    }
    Ok(())
}

fn b_ctx(b: &metrale_comm::NcclBackend) -> &std::sync::Arc<nccl_safe::Context> {
    b.context()
}

type Inputs<'a, T> = (
    &'a dyn Fn(usize, u64) -> Vec<T>,
    &'a dyn Fn(u64) -> Vec<T>,
    u64,
);

/// Checks the outputs against the reference of the inputs salted `salt`.
fn verify<T: OneShotElement + SuiteElem>(
    ctx: &RankCtx,
    b: &metrale_comm::NcclBackend,
    what: &str,
    (x, r): (&DeviceBuffer<T>, &DeviceBuffer<T>),
    (x_of, res_of, salt): Inputs<'_, T>,
    weight: &[T],
) -> anyhow::Result<()> {
    let got_x = x.to_host_vec()?;
    let got_r = r.to_host_vec()?;
    let inputs: Vec<Vec<T>> = (0..ctx.world_size).map(|k| x_of(k, salt)).collect();
    let sum = all_reduce_reference(b, &inputs);
    let mut want_r = res_of(salt);
    let want_x = add_rms_norm_reference(&sum, &mut want_r, weight, EPS);
    let exact = super::exact(ctx);
    check(
        &format!("{what}: residual"),
        &got_r,
        &want_r,
        exact,
        ctx.world_size,
    )?;
    check(
        &format!("{what}: x"),
        &got_x,
        &want_x,
        exact,
        ctx.world_size,
    )?;
    bound(what, &got_x, &got_r, weight)?;
    ctx.all_equal(&format!("{what}: x"), hash(&got_x))?;
    ctx.all_equal(&format!("{what}: residual"), hash(&got_r))
}

/// Every output within the documented bound of the exact (f64) norm of
/// the residual the kernel wrote.
fn bound<T: OneShotElement + SuiteElem>(
    what: &str,
    x: &[T],
    r: &[T],
    weight: &[T],
) -> anyhow::Result<()> {
    let hidden = weight.len();
    let w: Vec<f64> = weight.iter().map(|v| f64::from(v.to_f32())).collect();
    for (row, (xr, rr)) in x.chunks(hidden).zip(r.chunks(hidden)).enumerate() {
        let rf: Vec<f64> = rr.iter().map(|v| f64::from(v.to_f32())).collect();
        for (i, (g, e)) in xr
            .iter()
            .zip(exact_row(&rf, &w, f64::from(EPS)))
            .enumerate()
        {
            ensure!(
                within_bound(*g, e, hidden),
                "{what}: row {row} element {i}: {g:?} is outside the bound of {e}"
            );
        }
    }
    Ok(())
}

/// Each bad input: `InvalidArgument`, nothing enqueued, healthy after.
fn bad_inputs(
    ctx: &RankCtx,
    b: &metrale_comm::NcclBackend,
    compute: &Stream,
) -> anyhow::Result<()> {
    ctx.step("add+norm: bad inputs");
    let c = b.context();
    let mut x = DeviceBuffer::<bf16>::alloc(c, 64)?;
    let mut r = DeviceBuffer::<bf16>::alloc(c, 64)?;
    let mut r_short = DeviceBuffer::<bf16>::alloc(c, 32)?;
    let w = DeviceBuffer::<bf16>::alloc(c, 16)?;
    let w_odd = DeviceBuffer::<bf16>::alloc(c, 5)?;
    let w_f16 = DeviceBuffer::<f16>::alloc(c, 16)?;
    // SAFETY: an empty view of a live allocation.
    let w_empty = unsafe { DeviceView::from_raw(w.view().ptr(), 0, DataType::Bfloat16) };
    let big = DeviceBuffer::<bf16>::alloc(c, MAX_HIDDEN + 1)?;
    let s = compute.as_ref();
    let cases: Vec<(&str, metrale_comm::Result<()>)> = vec![
        (
            "residual length",
            b.all_reduce_add_rms_norm(x.view_mut(), r_short.view_mut(), w.view(), EPS, s),
        ),
        (
            "x not whole rows",
            b.all_reduce_add_rms_norm(x.view_mut(), r.view_mut(), w_odd.view(), EPS, s),
        ),
        (
            "mixed types",
            b.all_reduce_add_rms_norm(x.view_mut(), r.view_mut(), w_f16.view(), EPS, s),
        ),
        (
            "hidden zero",
            b.all_reduce_add_rms_norm(x.view_mut(), r.view_mut(), w_empty, EPS, s),
        ),
        (
            "hidden above the limit",
            b.all_reduce_add_rms_norm(x.view_mut(), r.view_mut(), big.view(), EPS, s),
        ),
        (
            "eps NaN",
            b.all_reduce_add_rms_norm(x.view_mut(), r.view_mut(), w.view(), f32::NAN, s),
        ),
        (
            "eps infinite",
            b.all_reduce_add_rms_norm(x.view_mut(), r.view_mut(), w.view(), f32::INFINITY, s),
        ),
        (
            "eps zero",
            b.all_reduce_add_rms_norm(x.view_mut(), r.view_mut(), w.view(), 0.0, s),
        ),
        (
            "eps negative",
            b.all_reduce_add_rms_norm(x.view_mut(), r.view_mut(), w.view(), -1e-5, s),
        ),
        ("misaligned x", {
            // SAFETY: views inside live allocations of 128 bytes; refused
            // before anything touches them.
            let (v, rv) = unsafe {
                (
                    DeviceViewMut::from_raw(x.view_mut().ptr() + 1, 16, DataType::Bfloat16),
                    DeviceViewMut::from_raw(r.view_mut().ptr(), 16, DataType::Bfloat16),
                )
            };
            b.all_reduce_add_rms_norm(v, rv, w.view(), EPS, s)
        }),
    ];
    for (what, r) in cases {
        ensure!(
            matches!(r, Err(CommError::InvalidArgument { .. })),
            "bad input `{what}`: {r:?}, expected InvalidArgument"
        );
    }
    ensure!(b.is_healthy(), "unhealthy after bad inputs");
    b.barrier().context("a barrier after bad inputs")
}

/// `LocalBackend`: a world of one (the all-reduce is the identity).
fn local(ctx: &RankCtx, seed: u64) -> anyhow::Result<()> {
    ctx.step("LocalBackend add+norm");
    let b = LocalBackend::new(ctx.device)?;
    let (hidden, tokens) = (1000, 9);
    let x0 = random_vec::<bf16>(seed, ctx.rank, 7, hidden * tokens);
    let r0 = random_vec::<bf16>(seed, 1 << 20, 7, hidden * tokens);
    let w0 = random_vec::<bf16>(seed, 1 << 21, 7, hidden);
    let mut x = DeviceBuffer::from_host(b.context(), &x0)?;
    let mut r = DeviceBuffer::from_host(b.context(), &r0)?;
    let w = DeviceBuffer::from_host(b.context(), &w0)?;
    let s = b.stream();
    b.all_reduce_add_rms_norm(x.view_mut(), r.view_mut(), w.view(), EPS, s)?;
    let bad = b.all_reduce_add_rms_norm(x.view_mut(), r.view_mut(), w.view(), f32::NAN, s);
    ensure!(
        matches!(bad, Err(CommError::InvalidArgument { .. })),
        "LocalBackend eps NaN: {bad:?}"
    );
    b.synchronize()?;
    let mut want_r = r0;
    let want_x = add_rms_norm_reference(&x0, &mut want_r, &w0, EPS);
    check(
        "LocalBackend: residual",
        &r.to_host_vec()?,
        &want_r,
        true,
        1,
    )?;
    check("LocalBackend: x", &x.to_host_vec()?, &want_x, true, 1)?;
    b.shutdown()?;
    Ok(())
}
