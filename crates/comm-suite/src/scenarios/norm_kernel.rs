//! The add + norm kernels themselves, without the backend (through
//! [`LocalOneShot`]): `k` = 2, 3 and 8 ranks simulated on this rank's one
//! device, every type, rows of 16-byte multiples from one chunk to 8192
//! values and 1 to 64 rows:
//! - the fused one-shot entry (`*_one_shot_add_rms_norm`), eager, twice
//!   per shape (both halves), and at 2 ranks captured and replayed;
//! - where the device launches clusters, the same for the cluster entry
//!   (`*_one_shot_add_rms_norm_cluster`, `one_shot_sm90.ptx`, cluster sizes
//!   1 to 8 by `norm::fused_cluster_size`), and once per shape with the
//!   ranks mixed (even ranks the cluster entry, odd ranks the plain one):
//!   the two share the protocol and the bits;
//! - the plain one-shot then the separate kernel (`*_add_rms_norm`), whose
//!   results must be the fused kernel's, bit for bit;
//! - the separate kernel alone on rows of odd sizes (1 to 65,536 values)
//!   and on data that is not 16-byte aligned;
//! - the fused kernel's refusal of rows that are not 16-byte multiples (the
//!   bad-launch status, nothing written).
//!
//! `METRALE_ONE_SHOT_PTX`, `METRALE_ONE_SHOT_SM90_PTX` and `METRALE_NORM_PTX`
//! name builds to check instead of the committed PTX (`cargo xtask ptx
//! --variants`); `METRALE_NORM_PDL=1` launches the separate kernel
//! programmatically (`norm::launch_add_rms_norm_programmatic`), only with a
//! build that waits for the kernel before it (`add_rms_norm_sm90-pdl.ptx`).
//!
//! Invariants: every element of x and of the residual on every rank equals
//! the host reference (`metrale_comm::norm::add_rms_norm_reference` of the
//! one-shot sum) bit for bit; every wait is bounded. This is the scenario
//! the sanitizer command runs beside `oneshot_kernel_one_device`.

use std::time::Duration;

use anyhow::ensure;
use half::{bf16, f16};
use metrale_comm::kernels::{self, OneShotElement};
use metrale_comm::norm::{self, NormArgs};
use nccl_safe::{Context, DeviceBuffer, Function, Module};

use crate::RankCtx;
use crate::data::{SuiteElem, random_vec};
use crate::one_shot_local::{LANE_EAGER, LANE_GRAPH, LocalOneShot, launch_separate_norm, norm_pdl};

const SLOT_BYTES: usize = 1 << 20;
const EPS: f32 = 1e-6;
const WAIT: Duration = Duration::from_secs(60);

/// See the module docs.
pub fn kernel_one_device(ctx: &RankCtx) -> anyhow::Result<()> {
    let c = ctx.context()?;
    let one_shot = Module::load_ptx(
        &c,
        &crate::one_shot_local::ptx_or("METRALE_ONE_SHOT_PTX", kernels::ONE_SHOT_PTX)?,
    )?;
    let separate = Module::load_ptx(
        &c,
        &crate::one_shot_local::ptx_or("METRALE_NORM_PTX", norm::ADD_RMS_NORM_PTX)?,
    )?;
    let cluster = if nccl_safe::driver::supports_cluster_launch(c.ordinal())? {
        Some(Module::load_ptx(
            &c,
            &crate::one_shot_local::ptx_or(
                "METRALE_ONE_SHOT_SM90_PTX",
                kernels::ONE_SHOT_SM90_PTX,
            )?,
        )?)
    } else {
        ctx.step("no cluster launch on this device: the cluster entries are not run".to_string());
        None
    };
    if norm_pdl() {
        ctx.step("METRALE_NORM_PDL=1: the separate kernel launches programmatically".to_string());
    }
    let m = (&one_shot, &separate, cluster.as_ref());
    of::<bf16>(ctx, &c, m)?;
    of::<f16>(ctx, &c, m)?;
    of::<f32>(ctx, &c, m)?;
    separate_alone::<bf16>(ctx, &c, &separate)?;
    separate_alone::<f32>(ctx, &c, &separate)
}

/// Per rank: its residual and the shared weight.
struct Tensors<T: nccl_safe::Element> {
    residual: Vec<DeviceBuffer<T>>,
    weight: DeviceBuffer<T>,
}

fn of<T: OneShotElement + SuiteElem>(
    ctx: &RankCtx,
    c: &std::sync::Arc<Context>,
    (one_shot, separate, cluster): (&Module, &Module, Option<&Module>),
) -> anyhow::Result<()> {
    let dtype = T::DATA_TYPE;
    let fused = one_shot.function(norm::fused_one_shot_name(dtype).unwrap_or_default())?;
    let spread = cluster
        .map(|m| m.function(norm::fused_cluster_name(dtype).unwrap_or_default()))
        .transpose()?;
    // Per rank: the plain entry, the cluster entry, or (mixed) even ranks
    // the cluster entry and odd ranks the plain one.
    let mut kinds = vec![("fused", Kind::Plain)];
    if spread.is_some() {
        kinds.push(("fused cluster", Kind::Cluster));
        kinds.push(("fused mixed", Kind::Mixed));
    }
    let fns = Fused {
        plain: &fused,
        cluster: spread.as_ref(),
    };
    let plain = one_shot.function(kernels::one_shot_name(dtype).unwrap_or_default())?;
    let sep = separate.function(norm::add_rms_norm_name(dtype).unwrap_or_default())?;
    let per = 16 / dtype.size();
    let shapes = [
        (per, 1),
        (per * 3, 7),
        (4096, 1),
        (4096, 32),
        (8192, 8),
        (1024, 64),
        (2048, 3),
        (per * 64, 2),
    ];
    for k in [2usize, 3, 8] {
        let mut ranks = LocalOneShot::<T>::new(c, k, SLOT_BYTES, Duration::from_secs(30))?;
        for (si, &(hidden, rows)) in shapes.iter().enumerate() {
            let n = hidden * rows;
            let seed = 0x4e0 + si as u64;
            let mut t = Tensors {
                residual: (0..k)
                    .map(|_| DeviceBuffer::<T>::alloc(c, n))
                    .collect::<Result<_, _>>()?,
                weight: DeviceBuffer::from_host(c, &random_vec::<T>(seed, 99, 1, hidden))?,
            };
            for &(what, kind) in &kinds {
                let calls = if kind == Kind::Mixed { 1 } else { 2 };
                for call in 0..calls {
                    ctx.step(format!(
                        "{k} ranks, {dtype}: {what}, {rows} x {hidden}, call {call}"
                    ));
                    let inputs = ranks.fill(seed + call, n)?;
                    let res0 = random_vec::<T>(seed + call, 77, 2, n);
                    for r in &mut t.residual {
                        r.copy_from_host(&res0)?;
                    }
                    for r in 0..k {
                        launch_fused(&ranks, &t, fns.of(kind, r), r, (hidden, rows), LANE_EAGER)?;
                    }
                    ranks.wait()?;
                    check(&ranks, &t, &inputs, &res0, hidden, what)?;
                }
            }
            ctx.step(format!(
                "{k} ranks, {dtype}: one-shot then the separate kernel, {rows} x {hidden}"
            ));
            let inputs = ranks.fill(seed + 7, n)?;
            let res0 = random_vec::<T>(seed + 7, 77, 2, n);
            for r in &mut t.residual {
                r.copy_from_host(&res0)?;
            }
            ranks.launch_all(&plain, n, LANE_EAGER)?;
            for r in 0..k {
                launch_separate(&ranks, &t, &sep, r, (hidden, rows))?;
            }
            ranks.wait()?;
            check(&ranks, &t, &inputs, &res0, hidden, "one-shot + separate")?;
            for &(what, kind) in kinds.iter().filter(|_| k == 2 && (si == 3 || si == 6)) {
                ctx.step(format!(
                    "{k} ranks, {dtype}: {what} captured, {rows} x {hidden}, replayed twice"
                ));
                let execs = (0..k)
                    .map(|r| {
                        let s = ranks.stream(r);
                        s.begin_capture()?;
                        let f = fns.of(kind, r);
                        let l = launch_fused(&ranks, &t, f, r, (hidden, rows), LANE_GRAPH);
                        let g = s.end_capture()?;
                        l?;
                        anyhow::Ok(g.instantiate()?)
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                for replay in 0..2u64 {
                    let inputs = ranks.fill(seed + 100 + replay, n)?;
                    let res0 = random_vec::<T>(seed + 100 + replay, 77, 2, n);
                    for r in &mut t.residual {
                        r.copy_from_host(&res0)?;
                    }
                    for (r, e) in execs.iter().enumerate() {
                        e.launch(ranks.stream(r))?;
                    }
                    ranks.wait()?;
                    check(&ranks, &t, &inputs, &res0, hidden, what)?;
                }
            }
        }
        if k == 2 {
            ctx.step(format!(
                "{k} ranks, {dtype}: the fused kernel refuses rows of odd bytes"
            ));
            let hidden = per + 1;
            let t = Tensors {
                residual: (0..k)
                    .map(|_| DeviceBuffer::<T>::alloc(c, hidden))
                    .collect::<Result<_, _>>()?,
                weight: DeviceBuffer::<T>::alloc(c, hidden)?,
            };
            let inputs = ranks.fill(5, hidden)?;
            for (r, input) in inputs.iter().enumerate() {
                launch_fused(&ranks, &t, (&fused, false), r, (hidden, 1), LANE_EAGER)?;
                ranks.stream(r).wait_until_idle(WAIT)?;
                let st = ranks.flags(r).load(1);
                ensure!(st == 4, "rank {r}: status {st}, want 4 (bad launch)");
                ensure!(
                    ranks.output(r)?[..hidden]
                        .iter()
                        .zip(input)
                        .all(|(a, b)| a.to_bits32() == b.to_bits32()),
                    "rank {r}: a refused launch wrote x"
                );
            }
        }
    }
    Ok(())
}

/// Which fused entry each rank launches.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Plain,
    Cluster,
    Mixed,
}

/// The fused entries of one type.
struct Fused<'a> {
    plain: &'a Function,
    cluster: Option<&'a Function>,
}

impl<'a> Fused<'a> {
    /// Rank `r`'s entry for `kind`, and whether it is the cluster entry.
    fn of(&self, kind: Kind, r: usize) -> (&'a Function, bool) {
        match (kind, self.cluster) {
            (Kind::Cluster, Some(f)) => (f, true),
            (Kind::Mixed, Some(f)) if r.is_multiple_of(2) => (f, true),
            _ => (self.plain, false),
        }
    }
}

fn args<T: OneShotElement + SuiteElem>(
    ranks: &LocalOneShot<T>,
    t: &Tensors<T>,
    r: usize,
    (hidden, rows): (usize, usize),
) -> NormArgs {
    NormArgs {
        x: ranks.data_ptr(r),
        residual: t.residual[r].device_ptr(),
        weight: t.weight.device_ptr(),
        hidden,
        rows,
        eps: EPS,
        dtype: T::DATA_TYPE,
    }
}

/// Launches `f` on rank `r`: the fused entry of `T`, or with `cluster` its
/// cluster entry (on [`norm::fused_cluster_launch_config`]'s grid, cluster
/// size 1 included).
fn launch_fused<T: OneShotElement + SuiteElem>(
    ranks: &LocalOneShot<T>,
    t: &Tensors<T>,
    (f, cluster): (&Function, bool),
    r: usize,
    shape: (usize, usize),
    lane: u32,
) -> anyhow::Result<()> {
    ensure!(shape.0 * shape.1 <= ranks.max_elems(), "one slot");
    let (ctrl, a, s) = (
        ranks.ctrl_ptr(r),
        args(ranks, t, r, shape),
        ranks.stream(r).raw(),
    );
    // SAFETY: `f` is the fused (with `cluster`, the fused cluster) entry of
    // `T` in this context, the cluster entry loaded only where the device
    // launches clusters; the control block is rank `r`'s with live receive
    // buffers; x holds a slot of values, the residual and weight `rows *
    // hidden` and `hidden`; all outlive the work (the caller waits before
    // dropping them).
    unsafe {
        if cluster {
            norm::launch_fused_cluster(f, ctrl, a, lane, s)?
        } else {
            norm::launch_fused(f, ctrl, a, lane, s)?
        }
    };
    Ok(())
}

fn launch_separate<T: OneShotElement + SuiteElem>(
    ranks: &LocalOneShot<T>,
    t: &Tensors<T>,
    f: &Function,
    r: usize,
    shape: (usize, usize),
) -> anyhow::Result<()> {
    // SAFETY: as in `launch_fused`, `f` the separate entry of `T`.
    unsafe { launch_separate_norm(f, args(ranks, t, r, shape), ranks.stream(r).raw())? };
    Ok(())
}

/// Every rank's x and residual against the reference, bit for bit.
fn check<T: OneShotElement + SuiteElem>(
    ranks: &LocalOneShot<T>,
    t: &Tensors<T>,
    inputs: &[Vec<T>],
    res0: &[T],
    hidden: usize,
    what: &str,
) -> anyhow::Result<()> {
    let sum = kernels::one_shot_sum(inputs).map_err(anyhow::Error::msg)?;
    let mut want_r = res0.to_vec();
    let w = t.weight.to_host_vec()?;
    let want_x = norm::add_rms_norm_reference(&sum, &mut want_r, &w[..hidden], EPS);
    let n = sum.len();
    for r in 0..ranks.ranks() {
        let x = ranks.output(r)?;
        let res = t.residual[r].to_host_vec()?;
        for (name, got, want) in [
            ("x", &x[..n], &want_x[..]),
            ("residual", &res[..n], &want_r[..]),
        ] {
            if let Some(i) = (0..n).find(|&i| got[i].to_bits32() != want[i].to_bits32()) {
                anyhow::bail!(
                    "{what}, {} {} ranks, rank {r}: {name}[{i}] of {n} is {:?}, want {:?}",
                    ranks.ranks(),
                    T::DATA_TYPE,
                    got[i],
                    want[i]
                );
            }
        }
    }
    Ok(())
}

/// The separate kernel on one "rank": odd rows, misaligned data.
fn separate_alone<T: OneShotElement + SuiteElem>(
    ctx: &RankCtx,
    c: &std::sync::Arc<Context>,
    module: &Module,
) -> anyhow::Result<()> {
    let dtype = T::DATA_TYPE;
    let f = module.function(norm::add_rms_norm_name(dtype).unwrap_or_default())?;
    let s = nccl_safe::Stream::new(c)?;
    for (hidden, rows, offset) in [
        (1, 1, 0),
        (3, 5, 1),
        (4097, 3, 1),
        (norm::MAX_HIDDEN, 2, 0),
        (5000, 17, 3),
    ] {
        ctx.step(format!(
            "{dtype}: the separate kernel, {rows} x {hidden}, offset {offset}"
        ));
        let n = hidden * rows;
        let x0 = random_vec::<T>(3, 0, hidden as u64, n + offset);
        let r0 = random_vec::<T>(3, 1, hidden as u64, n + offset);
        let w0 = random_vec::<T>(3, 2, hidden as u64, hidden);
        let x = DeviceBuffer::from_host(c, &x0)?;
        let r = DeviceBuffer::from_host(c, &r0)?;
        let w = DeviceBuffer::from_host(c, &w0)?;
        let size = dtype.size() as u64;
        let a = NormArgs {
            x: x.device_ptr() + offset as u64 * size,
            residual: r.device_ptr() + offset as u64 * size,
            weight: w.device_ptr(),
            hidden,
            rows,
            eps: EPS,
            dtype,
        };
        // SAFETY: `f` is the separate entry of `T`; the buffers hold the
        // rows after the offset and the weight, and outlive the wait below.
        unsafe { launch_separate_norm(&f, a, s.raw())? };
        s.wait_until_idle(WAIT)?;
        let mut want_r = r0[offset..].to_vec();
        let want_x = norm::add_rms_norm_reference(&x0[offset..], &mut want_r, &w0, EPS);
        let (gx, gr) = (x.to_host_vec()?, r.to_host_vec()?);
        crate::data::check("separate kernel: x", &gx[offset..], &want_x, true, 1)?;
        crate::data::check("separate kernel: residual", &gr[offset..], &want_r, true, 1)?;
        ensure!(
            gx[..offset]
                .iter()
                .zip(&x0)
                .all(|(a, b)| a.to_bits32() == b.to_bits32()),
            "written before x"
        );
    }
    Ok(())
}
