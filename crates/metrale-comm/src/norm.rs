//! The fused all-reduce + residual add + RMSNorm of a tensor-parallel
//! layer: `residual <- all_reduce(x) + residual`, then `x <-
//! rms_norm(residual) * weight`, row by row over `hidden`, in f32
//! ([`crate::CommBackend::all_reduce_add_rms_norm`]).
//!
//! Its kernels: [`ADD_RMS_NORM_PTX`] (`kernels/add_rms_norm.cu`, the add +
//! norm after any all-reduce, one block a row) and the fused one-shot
//! entries in [`crate::kernels::ONE_SHOT_PTX`] ([`fused_one_shot_name`]),
//! which do the one-shot all-reduce and the norm in one launch, one block a
//! row; on compute capability 9.0 and newer, the same kernels built to
//! spread a row over a thread block cluster
//! ([`crate::kernels::ONE_SHOT_SM90_PTX`], [`fused_cluster_name`],
//! [`fused_cluster_launch_config`]). All compute
//! [`metrale_kernel_abi::norm::row`], bit for bit;
//! [`add_rms_norm_reference`] is that arithmetic over whole tensors, and
//! [`within_bound`] the documented distance from an exact evaluation.
//!
//! Invariants: `hidden` is 1 to [`MAX_HIDDEN`]; a launch uses
//! [`metrale_kernel_abi::norm::threads`] threads a block (the reduction
//! order the reference follows); [`all_reduce_then_norm`] checks every
//! argument and loads the kernel before it enqueues anything.

use std::sync::Arc;

use nccl_safe::{Context, DataType, DeviceView, DeviceViewMut, Function, Module, StreamRef};

use crate::backend::{CommBackend, Result};
use crate::error::CommError;
use crate::kernels::{OneShotElement, abi, check_ptx_abi};
use crate::validate::{self, Span};

/// PTX of `{bf16,f16,f32}_add_rms_norm(T* x, T* residual, const T* weight,
/// u64 hidden, u64 rows, f32 eps)`.
pub const ADD_RMS_NORM_PTX: &str = include_str!("../kernels/add_rms_norm.ptx");

/// The largest row (`hidden`) the kernels take: 65,536 values.
pub const MAX_HIDDEN: usize = abi::norm::MAX_HIDDEN;

/// The most blocks a fused one-shot launch uses (as the plain one-shot's).
pub const FUSED_MAX_GRID: u32 = crate::kernels::ONE_SHOT_MAX_GRID;

const TYPES: [DataType; 3] = [DataType::Bfloat16, DataType::Float16, DataType::Float32];

fn index(dtype: DataType) -> Option<usize> {
    TYPES.iter().position(|&t| t == dtype)
}

/// The separate add + norm kernel's entry for `dtype` (bf16, f16, f32).
pub fn add_rms_norm_name(dtype: DataType) -> Option<&'static str> {
    index(dtype).map(|i| abi::norm::ENTRIES[i].0)
}

/// The fused one-shot entry for `dtype`, in [`crate::kernels::ONE_SHOT_PTX`].
pub fn fused_one_shot_name(dtype: DataType) -> Option<&'static str> {
    index(dtype).map(|i| abi::norm::FUSED_ENTRIES[i].0)
}

/// The fused one-shot entry for `dtype` that spreads a row over a thread
/// block cluster, in [`crate::kernels::ONE_SHOT_SM90_PTX`].
pub fn fused_cluster_name(dtype: DataType) -> Option<&'static str> {
    index(dtype).map(|i| abi::norm::FUSED_CLUSTER_ENTRIES[i].0)
}

/// Blocks a cluster of a fused launch over `rows` rows of `hidden` values:
/// the most (at most [`abi::norm::MAX_CLUSTER`], a power of two dividing
/// the row's warps) that keep the launch at [`FUSED_MAX_GRID`] blocks in
/// all, one cluster a row up to that many rows. 1 means a cluster would
/// not help (from 32 rows, the plain grid already has 32 blocks): the
/// plain fused entry serves.
pub fn fused_cluster_size(hidden: usize, rows: usize, dtype: DataType) -> u32 {
    let warps = abi::norm::threads(hidden, dtype.size()) / abi::norm::WARP;
    let clusters = rows.clamp(1, FUSED_MAX_GRID as usize) as u32;
    let mut c = abi::norm::MAX_CLUSTER;
    while c > 1 && (!warps.is_multiple_of(c) || clusters * c > FUSED_MAX_GRID) {
        c /= 2;
    }
    c
}

/// Grid, block and cluster size of a cluster launch of the fused entries
/// over `rows` rows: one cluster a row (at most [`FUSED_MAX_GRID`] blocks
/// in all), [`fused_cluster_size`] blocks a cluster, each of
/// [`abi::norm::threads`] / that many threads.
pub fn fused_cluster_launch_config(
    hidden: usize,
    rows: usize,
    dtype: DataType,
) -> ((u32, u32, u32), (u32, u32, u32), u32) {
    let c = fused_cluster_size(hidden, rows, dtype);
    let clusters = rows.clamp(1, FUSED_MAX_GRID as usize) as u32;
    (
        (clusters * c, 1, 1),
        (abi::norm::threads(hidden, dtype.size()) / c, 1, 1),
        c,
    )
}

/// The add + norm kernels of one context, loaded once.
pub struct NormKernels {
    functions: Vec<(DataType, Function)>,
}

impl std::fmt::Debug for NormKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NormKernels").finish_non_exhaustive()
    }
}

impl NormKernels {
    /// Loads [`ADD_RMS_NORM_PTX`] into `ctx`.
    pub fn load(ctx: &Arc<Context>) -> nccl_safe::Result<NormKernels> {
        check_ptx_abi(ADD_RMS_NORM_PTX)
            .map_err(|e| nccl_safe::Error::invalid("add_rms_norm kernels", e))?;
        let module = Module::load_ptx(ctx, ADD_RMS_NORM_PTX)?;
        let functions = TYPES
            .iter()
            .map(|&t| {
                let name = add_rms_norm_name(t).unwrap_or_default();
                Ok((t, module.function(name)?))
            })
            .collect::<nccl_safe::Result<_>>()?;
        Ok(NormKernels { functions })
    }

    /// The kernel of `dtype`.
    pub fn of(&self, dtype: DataType) -> Option<&Function> {
        self.functions
            .iter()
            .find(|(t, _)| *t == dtype)
            .map(|(_, f)| f)
    }
}

/// The kernels in `cell`, loaded into `ctx` on first use (a load that
/// loses a race is dropped).
pub(crate) fn kernels_in<'a>(
    cell: &'a std::sync::OnceLock<NormKernels>,
    ctx: &Arc<Context>,
) -> Result<&'a NormKernels> {
    if let Some(k) = cell.get() {
        return Ok(k);
    }
    let k = NormKernels::load(ctx).map_err(|source| CommError::Refused {
        op: "all_reduce_add_rms_norm",
        source,
    })?;
    Ok(cell.get_or_init(|| k))
}

/// Grid and block of a separate add + norm launch over `rows` rows: one
/// block a row (at most 2^20; the kernel strides), [`abi::norm::threads`]
/// threads.
pub fn launch_config(
    hidden: usize,
    rows: usize,
    dtype: DataType,
) -> ((u32, u32, u32), (u32, u32, u32)) {
    let grid = rows.clamp(1, 1 << 20) as u32;
    (
        (grid, 1, 1),
        (abi::norm::threads(hidden, dtype.size()), 1, 1),
    )
}

/// Grid and block of a fused one-shot launch over `rows` rows: at most
/// [`FUSED_MAX_GRID`] blocks (a call spins while it waits).
pub fn fused_launch_config(
    hidden: usize,
    rows: usize,
    dtype: DataType,
) -> ((u32, u32, u32), (u32, u32, u32)) {
    let grid = rows.clamp(1, FUSED_MAX_GRID as usize) as u32;
    (
        (grid, 1, 1),
        (abi::norm::threads(hidden, dtype.size()), 1, 1),
    )
}

/// The arguments of one add + norm launch.
#[derive(Debug, Clone, Copy)]
pub struct NormArgs {
    /// Device address of `rows * hidden` values: the all-reduced input
    /// (the fused kernel: this rank's contribution), then the output.
    pub x: u64,
    /// Device address of `rows * hidden` values, read and written.
    pub residual: u64,
    /// Device address of `hidden` values.
    pub weight: u64,
    /// Values a row, 1 to [`MAX_HIDDEN`].
    pub hidden: usize,
    /// Rows.
    pub rows: usize,
    /// Added to the mean square; finite and positive.
    pub eps: f32,
    /// The element type (bf16, f16, f32).
    pub dtype: DataType,
}

impl NormArgs {
    /// The same rows from `first` on, `rows` of them.
    pub fn rows(self, first: usize, rows: usize) -> NormArgs {
        let off = (first * self.hidden * self.dtype.size()) as u64;
        NormArgs {
            x: self.x + off,
            residual: self.residual + off,
            rows,
            ..self
        }
    }

    /// The fused one-shot kernel takes it: 16-byte rows and addresses.
    pub fn fusable(&self) -> bool {
        (self.hidden * self.dtype.size()).is_multiple_of(16)
            && (self.x | self.residual | self.weight).is_multiple_of(16)
    }
}

/// Launches the separate add + norm kernel.
///
/// # Safety
/// `kernel` is [`NormKernels::of`]`(args.dtype)`; `x` and `residual` are
/// device memory of its context valid for `rows * hidden` values, `weight`
/// for `hidden`, until the work completes; `stream` a live stream of that
/// context.
pub unsafe fn launch_add_rms_norm(
    kernel: &Function,
    args: NormArgs,
    stream: cuda_sys::CUstream,
) -> nccl_safe::Result<()> {
    // SAFETY: this function's contract.
    unsafe { launch_norm(kernel, args, stream, false) }
}

/// Launches the separate add + norm kernel as a programmatic dependent
/// launch ([`Function::launch_programmatic`]): on compute capability 9.0
/// and newer its blocks may start while the kernel before it in the stream
/// finishes. Only a build that waits for that kernel first takes it: the
/// sm_90 variant `add_rms_norm_sm90-pdl.ptx` of `cargo xtask ptx
/// --variants` (`NORM_PDL`), which the benchmarks time; the committed
/// [`ADD_RMS_NORM_PTX`] does not wait.
///
/// # Safety
/// As [`launch_add_rms_norm`], and `kernel` is of a build that waits for
/// the previous kernel (`griddepcontrol.wait`) before touching memory.
pub unsafe fn launch_add_rms_norm_programmatic(
    kernel: &Function,
    args: NormArgs,
    stream: cuda_sys::CUstream,
) -> nccl_safe::Result<()> {
    // SAFETY: this function's contract.
    unsafe { launch_norm(kernel, args, stream, true) }
}

/// The separate kernel's launch, plain or programmatic.
///
/// # Safety
/// As [`launch_add_rms_norm`]; `programmatic` only for a kernel that waits
/// as [`launch_add_rms_norm_programmatic`] says.
unsafe fn launch_norm(
    kernel: &Function,
    args: NormArgs,
    stream: cuda_sys::CUstream,
    programmatic: bool,
) -> nccl_safe::Result<()> {
    let (grid, block) = launch_config(args.hidden, args.rows, args.dtype);
    let (mut x, mut r, mut w) = (args.x, args.residual, args.weight);
    let (mut h, mut n, mut eps) = (args.hidden as u64, args.rows as u64, args.eps);
    let mut params = [
        (&mut x as *mut u64).cast::<std::ffi::c_void>(),
        (&mut r as *mut u64).cast(),
        (&mut w as *mut u64).cast(),
        (&mut h as *mut u64).cast(),
        (&mut n as *mut u64).cast(),
        (&mut eps as *mut f32).cast(),
    ];
    // SAFETY: the parameters match the kernel's signature and live through
    // the call, which copies them; the rest (a programmatic launch's kernel
    // among it) is this function's contract.
    unsafe {
        if programmatic {
            kernel.launch_programmatic(grid, block, 0, stream, &mut params)
        } else {
            kernel.launch(grid, block, 0, stream, &mut params)
        }
    }
}

/// Launches a fused one-shot kernel on lane `lane`.
///
/// # Safety
/// As [`launch_add_rms_norm`], `kernel` the fused entry of `args.dtype`,
/// and `ctrl` as for [`crate::kernels::launch_one_shot`], its slot holding
/// `rows * hidden` values.
pub unsafe fn launch_fused(
    kernel: &Function,
    ctrl: u64,
    args: NormArgs,
    lane: u32,
    stream: cuda_sys::CUstream,
) -> nccl_safe::Result<()> {
    let (grid, block) = fused_launch_config(args.hidden, args.rows, args.dtype);
    let mut p = FusedParams::new(ctrl, args, lane);
    // SAFETY: as in `launch_add_rms_norm`; `p` outlives the launch.
    unsafe { kernel.launch(grid, block, 0, stream, &mut p.pointers()) }
}

/// The fused entries' parameters (`ctrl, x, residual, weight, hidden,
/// rows, eps, lane`), held where a launch's parameter pointers can point.
struct FusedParams {
    ptrs: [u64; 6],
    eps: f32,
    lane: u32,
}

impl FusedParams {
    fn new(ctrl: u64, args: NormArgs, lane: u32) -> Self {
        Self {
            ptrs: [
                ctrl,
                args.x,
                args.residual,
                args.weight,
                args.hidden as u64,
                args.rows as u64,
            ],
            eps: args.eps,
            lane,
        }
    }

    /// One pointer a parameter, in the entries' order; valid while `self`
    /// is neither moved nor dropped.
    fn pointers(&mut self) -> [*mut std::ffi::c_void; 8] {
        let [c, x, r, w, h, n] = &mut self.ptrs;
        [
            (c as *mut u64).cast(),
            (x as *mut u64).cast(),
            (r as *mut u64).cast(),
            (w as *mut u64).cast(),
            (h as *mut u64).cast(),
            (n as *mut u64).cast(),
            (&mut self.eps as *mut f32).cast(),
            (&mut self.lane as *mut u32).cast(),
        ]
    }
}

/// Launches a fused one-shot cluster kernel on lane `lane`, on
/// [`fused_cluster_launch_config`]'s grid.
///
/// # Safety
/// As [`launch_fused`], `kernel` the cluster entry of `args.dtype`
/// ([`fused_cluster_name`]) on a device of compute capability 9.0 or newer.
pub unsafe fn launch_fused_cluster(
    kernel: &Function,
    ctrl: u64,
    args: NormArgs,
    lane: u32,
    stream: cuda_sys::CUstream,
) -> nccl_safe::Result<()> {
    let (grid, block, cluster) = fused_cluster_launch_config(args.hidden, args.rows, args.dtype);
    let mut p = FusedParams::new(ctrl, args, lane);
    // SAFETY: as in `launch_add_rms_norm`; `p` outlives the launch, and the
    // cluster size divides the grid (`fused_cluster_launch_config`).
    unsafe { kernel.launch_cluster(grid, block, cluster, 0, stream, &mut p.pointers()) }
}

/// The provided implementation of
/// [`CommBackend::all_reduce_add_rms_norm`]: checks, the backend's
/// kernels, `all_reduce_async(x)` on `stream`, then the add + norm kernel
/// on `stream`.
pub fn all_reduce_then_norm<B: CommBackend + ?Sized>(
    backend: &B,
    x: DeviceViewMut<'_>,
    residual: DeviceViewMut<'_>,
    weight: DeviceView<'_>,
    eps: f32,
    stream: StreamRef<'_>,
) -> Result<()> {
    const OP: &str = "all_reduce_add_rms_norm";
    let args = validate::add_rms_norm(
        OP,
        Span::from(&x),
        Span::from(&residual),
        Span::from(&weight),
        eps,
    )?;
    if args.rows == 0 {
        return backend.all_reduce_async(x, stream);
    }
    let kernels = backend.add_rms_norm_kernels()?;
    let kernel = kernels
        .of(args.dtype)
        .ok_or_else(|| CommError::InvalidArgument {
            op: OP,
            reason: format!("no add + norm kernel for {}", args.dtype),
        })?;
    backend.all_reduce_async(x, stream)?;
    // SAFETY: the views are valid for their lengths (their contracts),
    // checked to hold `rows * hidden` and `hidden` values; the kernel is
    // the backend's, of the stream's context.
    unsafe { launch_add_rms_norm(kernel, args, stream.as_raw()) }
        .map_err(|source| CommError::Refused { op: OP, source })
}

/// The host reference: for every row of `hidden` values, `residual <-
/// round(sum + residual)` and the output `round(rms_norm(residual) *
/// weight)`, exactly as the kernels compute it
/// ([`metrale_kernel_abi::norm::row`]); `sum` is the all-reduced input.
/// Returns the output; lengths are the caller's to match.
pub fn add_rms_norm_reference<T: OneShotElement>(
    sum: &[T],
    residual: &mut [T],
    weight: &[T],
    eps: f32,
) -> Vec<T> {
    let hidden = weight.len().max(1);
    let size = T::DATA_TYPE.size();
    let w: Vec<f32> = weight.iter().map(|v| v.to_f32()).collect();
    let round = |v: f32| T::from_f32(v).to_f32();
    let mut out = Vec::with_capacity(sum.len());
    let mut o = vec![0f32; hidden];
    for (s, r) in sum.chunks(hidden).zip(residual.chunks_mut(hidden)) {
        let s: Vec<f32> = s.iter().map(|v| v.to_f32()).collect();
        let mut rf: Vec<f32> = r.iter().map(|v| v.to_f32()).collect();
        abi::norm::row(&s, &mut rf, &w, eps, size, round, &mut o[..s.len()]);
        for (dst, v) in r.iter_mut().zip(&rf) {
            *dst = T::from_f32(*v);
        }
        out.extend(o[..s.len()].iter().map(|&v| T::from_f32(v)));
    }
    out
}

/// Whether `got` lies within the documented bound of `exact` (the output
/// evaluated in f64 from the same residual): one unit in the last place of
/// the type plus `2^-16 |exact|` for bf16 and f16, `(hidden / 16 + 16) *
/// 2^-24 |exact|` (and a denormal's worth) for f32.
pub fn within_bound<T: OneShotElement>(got: T, exact: f64, hidden: usize) -> bool {
    let g = f64::from(got.to_f32());
    if exact.is_nan() || g.is_nan() {
        return exact.is_nan() && g.is_nan();
    }
    let a = exact.abs();
    let tol = match T::DATA_TYPE {
        DataType::Float32 => (hidden as f64 / 16.0 + 16.0) * a * 2f64.powi(-24) + 1e-37,
        DataType::Float16 => ulp(a, 10, -14) + a * 2f64.powi(-16),
        _ => ulp(a, 7, -126) + a * 2f64.powi(-16),
    };
    (g - exact).abs() <= tol
}

/// One unit in the last place at `a` of a type with `mantissa` bits and
/// smallest normal exponent `min_exp`.
fn ulp(a: f64, mantissa: i32, min_exp: i32) -> f64 {
    let e = if a > 0.0 {
        (a.log2().floor() as i32).max(min_exp)
    } else {
        min_exp
    };
    2f64.powi(e - mantissa)
}

/// The exact (f64) output of one row from the new residual `r` and weight
/// `w`: `r[i] / sqrt(mean(r^2) + eps) * w[i]`.
pub fn exact_row(r: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ss: f64 = r.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / r.len() as f64 + eps).sqrt();
    r.iter().zip(w).map(|(v, w)| v * inv * w).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn the_ptx_defines_every_entry() {
        for t in TYPES {
            let name = add_rms_norm_name(t).unwrap();
            assert!(ADD_RMS_NORM_PTX.contains(&format!(".visible .entry {name}(")));
            let fused = fused_one_shot_name(t).unwrap();
            assert!(crate::kernels::ONE_SHOT_PTX.contains(&format!(".visible .entry {fused}(")));
        }
        assert!(check_ptx_abi(ADD_RMS_NORM_PTX).is_ok());
        // No contraction into an FMA: the host computes the same bits.
        assert!(!ADD_RMS_NORM_PTX.contains("fma."));
        assert!(ADD_RMS_NORM_PTX.contains("sqrt.rn.f32"));
        assert_eq!(add_rms_norm_name(DataType::Float64), None);
    }

    #[test]
    fn the_reference_is_within_its_bound() {
        let hidden = 1000;
        let sum: Vec<bf16> = (0..2 * hidden)
            .map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 7.0))
            .collect();
        let mut res: Vec<bf16> = (0..2 * hidden)
            .map(|i| bf16::from_f32(((i * 13 % 29) as f32 - 14.0) / 3.0))
            .collect();
        let w: Vec<bf16> = (0..hidden)
            .map(|i| bf16::from_f32(0.5 + (i % 7) as f32 / 8.0))
            .collect();
        let out = add_rms_norm_reference(&sum, &mut res, &w, 1e-6);
        let wf: Vec<f64> = w.iter().map(|v| f64::from(v.to_f32())).collect();
        for (row, o) in res.chunks(hidden).zip(out.chunks(hidden)) {
            let r: Vec<f64> = row.iter().map(|v| f64::from(v.to_f32())).collect();
            for (got, want) in o.iter().zip(exact_row(&r, &wf, 1e-6)) {
                assert!(within_bound(*got, want, hidden), "{got} vs {want}");
            }
        }
    }

    #[test]
    fn launch_configs_are_bounded() {
        assert_eq!(
            launch_config(4096, 128, DataType::Bfloat16),
            ((128, 1, 1), (512, 1, 1))
        );
        assert_eq!(
            fused_launch_config(4096, 128, DataType::Bfloat16),
            ((32, 1, 1), (512, 1, 1))
        );
        assert_eq!(
            launch_config(1, 0, DataType::Float32),
            ((1, 1, 1), (32, 1, 1))
        );
    }

    #[test]
    fn cluster_launches_split_a_row_and_keep_the_grid() {
        let bf = DataType::Bfloat16;
        // One token of 8192: 8 blocks of 64 threads, the block of 512
        // threads spread over 8 SMs.
        assert_eq!(
            fused_cluster_launch_config(8192, 1, bf),
            ((8, 1, 1), (64, 1, 1), 8)
        );
        assert_eq!(fused_cluster_size(4096, 4, bf), 8);
        assert_eq!(fused_cluster_size(4096, 8, bf), 4);
        assert_eq!(fused_cluster_size(4096, 16, bf), 2);
        assert_eq!(fused_cluster_size(4096, 32, bf), 1);
        assert_eq!(fused_cluster_size(4096, 512, bf), 1);
        // Warps a row bound it: 3 warps do not split.
        assert_eq!(fused_cluster_size(96 * 8, 1, bf), 1);
        assert_eq!(fused_cluster_size(64 * 8, 1, bf), 2);
        for hidden in [8, 64, 1000, 4096, 8192, 65536] {
            for rows in [1, 2, 3, 5, 8, 31, 32, 33, 1000] {
                for dt in TYPES {
                    let h = hidden / dt.size() * 2;
                    let ((g, ..), (b, ..), c) = fused_cluster_launch_config(h, rows, dt);
                    assert!(g <= FUSED_MAX_GRID && g.is_multiple_of(c), "{h} {rows}");
                    assert!(b.is_multiple_of(32) && b * c == abi::norm::threads(h, dt.size()));
                    assert!((1..=abi::norm::MAX_CLUSTER).contains(&c));
                }
            }
        }
        for t in TYPES {
            let name = fused_cluster_name(t).unwrap();
            assert!(
                crate::kernels::ONE_SHOT_SM90_PTX.contains(&format!(".visible .entry {name}("))
            );
        }
        assert!(check_ptx_abi(crate::kernels::ONE_SHOT_SM90_PTX).is_ok());
    }
}
