//! The fused one-shot + add + norm entries
//! (`{bf16,f16,f32}_one_shot_add_rms_norm` in
//! `crates/metrale-comm/kernels/one_shot.cu`): the one-shot all-reduce of
//! `x` as `one_shot` runs it, then, once it completed, the add + norm as
//! `norm` runs it, in one launch.
//!
//! Invariant: a launch the GPU kernel refuses records the bad-launch status
//! and touches no buffer; every range is checked at launch and again when
//! it runs (`memory::access`).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cuda_sys::CUresult;

use super::norm;
use super::one_shot::{
    CTRL_BYTES, Elem, LAUNCHES, OFF_FLAGS, STATUS_BAD_LAUNCH, fail, run, tag, word64,
};
use crate::cuda::driver;
use crate::cuda::memory::{self, Span, range_ok};
use crate::cuda::stream::Launcher;

/// The launch of the fused one-shot + add + norm kernel of `e`, `(ctrl,
/// x, residual, weight, hidden, rows, eps, lane)`: the one-shot all-reduce
/// of `x` (this file's), then, once it completed, the add + norm
/// (`norm::rows`). A shape the GPU kernel refuses (hidden outside 1 to the
/// limit, rows not 16-byte multiples, addresses not 16-byte aligned)
/// records the bad-launch status and touches nothing.
pub(crate) fn launcher(
    e: Elem,
    ctrl: u64,
    a: norm::Args,
    lane: u32,
    dev: i32,
) -> Result<Launcher, CUresult> {
    let spans = a.spans(e).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if !ctrl.is_multiple_of(8)
        || !range_ok(ctrl, CTRL_BYTES, true)
        || spans.iter().any(|s| !range_ok(s.ptr, s.len, true))
    {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let n = a.hidden * a.rows;
    let shape_ok = (1..=metrale_kernel_abi::norm::MAX_HIDDEN).contains(&a.hidden)
        && a.rows > 0
        && (a.hidden * e.size()).is_multiple_of(16)
        && (a.x | a.res | a.w).is_multiple_of(16);
    Ok(Arc::new(move || {
        let tag = tag(LAUNCHES.fetch_add(1, Ordering::Relaxed));
        Box::new(move || {
            if driver::sticky(dev).is_err() {
                return;
            }
            if !shape_ok {
                let flags = memory::access(&[Span::device(ctrl, CTRL_BYTES)], || {
                    // SAFETY: the span holds the control block; aligned.
                    unsafe { word64(ctrl + OFF_FLAGS) }.load(Ordering::Acquire)
                });
                if let Some(flags) = flags {
                    let _ = fail(ctrl, flags, STATUS_BAD_LAUNCH);
                }
                return;
            }
            let done = run(e, (ctrl, a.x, n, lane), tag);
            let ran = match done {
                // SAFETY: the spans hold the rows and the weight for the
                // whole run (checked under the registry lock).
                Some(true) => memory::access(&spans, || unsafe { norm::rows(e, a) }),
                Some(false) => Some(()),
                None => None,
            };
            if ran.is_none() {
                memory::illegal_address(dev, "one_shot_add_rms_norm", a.x, spans[0].len);
            }
        })
    }))
}
