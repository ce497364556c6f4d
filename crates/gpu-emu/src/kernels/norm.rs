//! The host implementation of metrale-comm's residual add + RMSNorm
//! kernels (`{bf16,f16,f32}_add_rms_norm` in
//! `crates/metrale-comm/kernels/add_rms_norm.cu`) and the norm half of the
//! fused one-shot entries (`{bf16,f16,f32}_one_shot_add_rms_norm` and
//! their `_cluster` variants, run by `fused`): the arithmetic is
//! `metrale_kernel_abi::norm::row`, the one the GPU kernels compute, so
//! results match bit for bit.
//!
//! Invariant: every range is checked at launch and again when the kernel
//! runs, atomically with the run (`memory::access`).

use std::sync::Arc;

use cuda_sys::CUresult;
use half::{bf16, f16};
use metrale_kernel_abi::norm as abi;

use super::one_shot::Elem;
use crate::cuda::driver;
use crate::cuda::memory::{self, Span, range_ok};
use crate::cuda::stream::Launcher;

/// The element type of a separate kernel's entry `name`.
pub(crate) fn by_name(name: &str) -> Option<Elem> {
    let i = abi::ENTRIES.iter().position(|(n, _)| *n == name)?;
    Some([Elem::Bf16, Elem::F16, Elem::F32][i])
}

/// The element type of a fused entry `name`.
pub(crate) fn fused_by_name(name: &str) -> Option<Elem> {
    let i = abi::FUSED_ENTRIES.iter().position(|(n, _)| *n == name)?;
    Some([Elem::Bf16, Elem::F16, Elem::F32][i])
}

/// The element type of a fused cluster entry `name`.
pub(crate) fn fused_cluster_by_name(name: &str) -> Option<Elem> {
    let i = abi::FUSED_CLUSTER_ENTRIES
        .iter()
        .position(|(n, _)| *n == name)?;
    Some([Elem::Bf16, Elem::F16, Elem::F32][i])
}

/// The add + norm's arguments: `x`, `residual`, `weight`, `hidden`,
/// `rows`, `eps`.
#[derive(Clone, Copy)]
pub(crate) struct Args {
    pub x: u64,
    pub res: u64,
    pub w: u64,
    pub hidden: usize,
    pub rows: usize,
    pub eps: f32,
}

impl Args {
    /// The spans it touches, `None` when a size overflows.
    pub(crate) fn spans(&self, e: Elem) -> Option<[Span; 3]> {
        let bytes = self.hidden.checked_mul(self.rows)?.checked_mul(e.size())?;
        Some([
            Span::device(self.x, bytes),
            Span::device(self.res, bytes),
            Span::device(self.w, self.hidden * e.size()),
        ])
    }
}

/// `x` rounded to `e` (nearest even; a NaN is the canonical one) and back.
fn round(e: Elem, x: f32) -> f32 {
    match e {
        Elem::Bf16 => bf16::from_f32(x).to_f32(),
        Elem::F16 => f16::from_f32(x).to_f32(),
        Elem::F32 => x,
    }
}

/// Value `i` of `e` at `at`.
///
/// # Safety
/// `at` holds more than `i` values of `e`.
unsafe fn get(e: Elem, at: u64, i: usize) -> f32 {
    let p = (at + (i * e.size()) as u64) as usize;
    // SAFETY: this function's contract; unaligned reads are sound anywhere.
    unsafe {
        match e {
            Elem::Bf16 => bf16::from_bits((p as *const u16).read_unaligned()).to_f32(),
            Elem::F16 => f16::from_bits((p as *const u16).read_unaligned()).to_f32(),
            Elem::F32 => (p as *const f32).read_unaligned(),
        }
    }
}

/// Stores `v` (a value of `e`, as f32) as value `i` at `at`.
///
/// # Safety
/// As [`get`].
unsafe fn put(e: Elem, at: u64, i: usize, v: f32) {
    let p = (at + (i * e.size()) as u64) as usize;
    // SAFETY: this function's contract.
    unsafe {
        match e {
            Elem::Bf16 => (p as *mut u16).write_unaligned(bf16::from_f32(v).to_bits()),
            Elem::F16 => (p as *mut u16).write_unaligned(f16::from_f32(v).to_bits()),
            Elem::F32 => (p as *mut f32).write_unaligned(v),
        }
    }
}

/// Every row: `residual <- round(x + residual)`, `x <- round(rms_norm *
/// weight)`.
///
/// # Safety
/// `a.x` and `a.res` hold `rows * hidden` values of `e`, `a.w` `hidden`;
/// `1 <= hidden <= MAX_HIDDEN`.
pub(crate) unsafe fn rows(e: Elem, a: Args) {
    let h = a.hidden;
    // SAFETY: the weight holds `hidden` values (this function's contract).
    let w: Vec<f32> = (0..h).map(|i| unsafe { get(e, a.w, i) }).collect();
    let (mut s, mut r, mut o) = (vec![0f32; h], vec![0f32; h], vec![0f32; h]);
    for row in 0..a.rows {
        let base = row * h;
        for i in 0..h {
            // SAFETY: `base + i < rows * hidden` (the contract).
            unsafe {
                s[i] = get(e, a.x, base + i);
                r[i] = get(e, a.res, base + i);
            }
        }
        abi::row(&s, &mut r, &w, a.eps, e.size(), |v| round(e, v), &mut o);
        for i in 0..h {
            // SAFETY: as above.
            unsafe {
                put(e, a.res, base + i, r[i]);
                put(e, a.x, base + i, o[i]);
            }
        }
    }
}

/// The launch of the separate kernel of `e` on a stream of device `dev`.
pub(crate) fn launcher(e: Elem, a: Args, dev: i32) -> Result<Launcher, CUresult> {
    let spans = a.spans(e).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if spans.iter().any(|s| !range_ok(s.ptr, s.len, true)) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let name = abi::ENTRIES[[Elem::Bf16, Elem::F16, Elem::F32]
        .iter()
        .position(|&x| x == e)
        .unwrap_or(0)]
    .0;
    Ok(Arc::new(move || {
        Box::new(move || {
            if driver::sticky(dev).is_err() {
                return;
            }
            // The kernel does nothing outside its contract (a block of
            // whole warps, 1 <= hidden <= the limit).
            if a.hidden == 0 || a.hidden > abi::MAX_HIDDEN {
                return;
            }
            // SAFETY: the spans hold the rows and the weight for the whole
            // run (checked under the registry lock `access` holds).
            let ran = memory::access(&spans, || unsafe { rows(e, a) });
            if ran.is_none() {
                memory::illegal_address(dev, name, a.x, spans[0].len);
            }
        })
    }))
}
