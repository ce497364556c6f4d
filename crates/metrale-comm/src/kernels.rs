//! The project's GPU kernels, as committed PTX, and their launch contracts.
//!
//! The PTX is built from `kernels/*.cu` by `cargo xtask ptx` (nvcc
//! `--ptx -arch=compute_80`) and loaded at run time with `cuModuleLoadData`,
//! so the driver JIT-compiles it for whatever GPU it finds.
//!
//! Requirements, decided by the PTX's `.target` and `.version` lines:
//! - GPU: compute capability 8.0 or newer (A100, A10, L4, L40, H100, H200,
//!   B200, ...): sm_80 is the first architecture with native bf16.
//! - Driver: PTX ISA 7.0, which CUDA 11.0 introduced, so driver r450
//!   (450.36.06 on Linux) or newer. nvcc 13.0 writes ISA 9.0 (driver r580);
//!   `cargo xtask ptx` relabels it 7.0 and has `ptxas` confirm that every
//!   instruction exists in ISA 7.0 for sm_80.
//!
//! Invariants: [`BF16_ADD_PTX`] defines the entry [`BF16_ADD_NAME`] with the
//! parameters `(bf16* dst, const bf16* src, u64 n)`, and accepts at most
//! [`BF16_ADD_BLOCK`] threads per block; [`launch_config`] never exceeds
//! that, and never returns an empty grid.

/// PTX of `bf16_add_inplace`, `dst[i] = bf16(float(dst[i]) + float(src[i]))`
/// rounded to nearest even: the arithmetic NCCL uses for a two-rank bf16
/// sum.
///
/// Parameters, in order: `dst` (device address of `n` bf16 values, read and
/// written), `src` (device address of `n` bf16 values, read; equal to `dst`
/// or not overlapping it), `n` (`u64` element count, may be 0). When both
/// addresses are 16-byte aligned it moves 8 values per load; otherwise one.
pub const BF16_ADD_PTX: &str = include_str!("../kernels/bf16_add.ptx");

/// The entry point's name in [`BF16_ADD_PTX`] (`extern "C"`, unmangled).
pub const BF16_ADD_NAME: &str = "bf16_add_inplace";

/// Threads per block for `bf16_add_inplace`; also the most it accepts
/// (`__launch_bounds__`).
pub const BF16_ADD_BLOCK: u32 = 256;

/// The largest grid [`launch_config`] returns: 8 blocks for each of the 132
/// SMs of an H100/H200, enough to keep any current GPU's memory busy; the
/// kernel's loops are grid-stride, so a smaller grid still covers every
/// element.
pub const BF16_ADD_MAX_GRID: u32 = 132 * 8;

/// bf16 values per vectorised (16-byte) load.
const VALUES_PER_LOAD: u64 = 8;

/// Grid and block dimensions, `((gx, gy, gz), (bx, by, bz))`, for adding `n`
/// values with `bf16_add_inplace`: one thread per 8 values, 256 threads per
/// block, at most [`BF16_ADD_MAX_GRID`] blocks and at least one.
pub(crate) fn launch_config(n: u64) -> ((u32, u32, u32), (u32, u32, u32)) {
    let threads = n.div_ceil(VALUES_PER_LOAD);
    let blocks = threads
        .div_ceil(u64::from(BF16_ADD_BLOCK))
        .clamp(1, u64::from(BF16_ADD_MAX_GRID));
    // The clamp keeps `blocks` within u32.
    let blocks = u32::try_from(blocks).unwrap_or(BF16_ADD_MAX_GRID);
    ((blocks, 1, 1), (BF16_ADD_BLOCK, 1, 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_defines_the_entry_for_sm80_at_isa_7_0() {
        let lines: Vec<&str> = BF16_ADD_PTX.lines().map(str::trim).collect();
        assert!(
            lines.contains(&".version 7.0"),
            "PTX ISA changed: update the driver docs"
        );
        assert!(lines.contains(&".target sm_80"));
        assert!(lines.contains(&".address_size 64"));
        let entry = format!(".visible .entry {BF16_ADD_NAME}(");
        assert!(lines.contains(&entry.as_str()), "no entry {BF16_ADD_NAME}");
        let params = lines
            .iter()
            .filter(|l| l.starts_with(&format!(".param .u64 {BF16_ADD_NAME}_param_")))
            .count();
        assert_eq!(params, 3, "expected (dst, src, n)");
        assert!(lines.contains(&format!(".maxntid {BF16_ADD_BLOCK}, 1, 1").as_str()));
    }

    #[test]
    fn ptx_rounds_to_nearest_even() {
        assert!(BF16_ADD_PTX.contains("cvt.rn.bf16x2.f32"));
        assert!(BF16_ADD_PTX.contains("cvt.rn.bf16.f32"));
        assert!(!BF16_ADD_PTX.contains("cvt.rz."));
    }

    #[test]
    fn launch_config_covers_every_element() {
        for n in [
            0u64,
            1,
            7,
            8,
            9,
            2047,
            2048,
            2049,
            1 << 20,
            (1 << 20) + 3,
            u64::from(u32::MAX) * 8 + 5,
            u64::MAX,
        ] {
            let ((gx, gy, gz), (bx, by, bz)) = launch_config(n);
            assert_eq!((gy, gz, by, bz), (1, 1, 1, 1), "n = {n}");
            assert_eq!(bx, BF16_ADD_BLOCK, "n = {n}");
            assert!((1..=BF16_ADD_MAX_GRID).contains(&gx), "n = {n}: grid {gx}");
            let threads = u64::from(gx) * u64::from(bx);
            // Either one thread per 8 values, or the capped grid strides.
            assert!(
                threads * 8 >= n || gx == BF16_ADD_MAX_GRID,
                "n = {n}: grid {gx} leaves elements to no thread"
            );
            // No wholly idle block below the cap.
            if gx > 1 && gx < BF16_ADD_MAX_GRID {
                assert!(
                    (threads - u64::from(bx)) * 8 < n,
                    "n = {n}: grid {gx} too big"
                );
            }
        }
    }

    #[test]
    fn launch_config_examples() {
        assert_eq!(launch_config(0), ((1, 1, 1), (256, 1, 1)));
        assert_eq!(launch_config(2048), ((1, 1, 1), (256, 1, 1)));
        assert_eq!(launch_config(2049), ((2, 1, 1), (256, 1, 1)));
        assert_eq!(launch_config(1 << 30), ((1056, 1, 1), (256, 1, 1)));
    }
}
