//! The fused one-shot + add + norm entries
//! (`{bf16,f16,f32}_one_shot_add_rms_norm` in
//! `crates/metrale-comm/kernels/one_shot.cu`, and the entries that split a
//! row over a thread block cluster, `*_one_shot_add_rms_norm_cluster` in
//! `one_shot_sm90.ptx`): the one-shot all-reduce of `x` as `one_shot` runs
//! it, then, once it completed, the add + norm as `norm` runs it, in one
//! launch. The cluster entries compute what the others do, bit for bit
//! (`metrale_kernel_abi::norm::FUSED_CLUSTER_ENTRIES`), so both run this
//! one implementation; only their launch contract ([`cluster_ok`]) adds to
//! the shape's.
//!
//! Invariant: a launch the GPU kernel refuses records the bad-launch status
//! and touches no buffer; every range is checked at launch and again when
//! it runs (`memory::access`).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cuda_sys::CUresult;
use metrale_kernel_abi::norm as norm_abi;

use super::norm;
use super::one_shot::{
    CTRL_BYTES, Elem, LAUNCHES, OFF_FLAGS, STATUS_BAD_LAUNCH, fail, run, tag, word64,
};
use crate::cuda::driver;
use crate::cuda::memory::{self, Span, range_ok};
use crate::cuda::stream::Launcher;

/// Whether a launch of a cluster entry keeps its contract: cluster
/// dimensions `(c, 1, 1)` (a launch without them, `cuLaunchKernel`'s, has
/// `c` = 1), `c` 1 to [`norm_abi::MAX_CLUSTER`], `grid_x` a multiple of
/// `c`, `block_x` a multiple of a warp and `block_x * c` at most
/// [`norm_abi::BLOCK`].
pub(crate) fn cluster_ok(grid_x: u32, block_x: u32, cluster: [u32; 3]) -> bool {
    let [c, cy, cz] = cluster;
    (1..=norm_abi::MAX_CLUSTER).contains(&c)
        && cy == 1
        && cz == 1
        && grid_x.is_multiple_of(c)
        && block_x.is_multiple_of(norm_abi::WARP)
        && u64::from(block_x) * u64::from(c) <= u64::from(norm_abi::BLOCK)
}

/// The launch of the fused one-shot + add + norm kernel of `e`, `(ctrl,
/// x, residual, weight, hidden, rows, eps, lane)`: the one-shot all-reduce
/// of `x` (this file's), then, once it completed, the add + norm
/// (`norm::rows`). A launch the GPU kernel refuses (`launch_ok` false: a
/// cluster entry's broken launch contract; hidden outside 1 to the limit,
/// rows not 16-byte multiples, addresses not 16-byte aligned) records the
/// bad-launch status and touches nothing.
pub(crate) fn launcher(
    e: Elem,
    ctrl: u64,
    a: norm::Args,
    lane: u32,
    launch_ok: bool,
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
    let shape_ok = launch_ok
        && (1..=norm_abi::MAX_HIDDEN).contains(&a.hidden)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cluster_contract() {
        assert!(cluster_ok(1, 512, [1, 1, 1]));
        assert!(cluster_ok(32, 64, [8, 1, 1]));
        assert!(cluster_ok(12, 128, [4, 1, 1]));
        // The cluster size.
        assert!(!cluster_ok(8, 32, [0, 1, 1]));
        assert!(!cluster_ok(9, 32, [9, 1, 1]));
        assert!(!cluster_ok(8, 32, [2, 2, 1]));
        assert!(!cluster_ok(8, 32, [2, 1, 0]));
        // The grid.
        assert!(!cluster_ok(6, 64, [4, 1, 1]));
        // The block: whole warps, at most 512 threads a cluster.
        assert!(!cluster_ok(4, 48, [2, 1, 1]));
        assert!(!cluster_ok(4, 512, [2, 1, 1]));
        assert!(!cluster_ok(1, 1024, [1, 1, 1]));
        assert!(!cluster_ok(8, u32::MAX - 31, [8, 1, 1]));
    }
}
