//! The add kernel's launch contract: `bf16_add_inplace(bf16* dst, const
//! bf16* src, u64 n)`, `dst[i] = bf16(float(dst[i]) + float(src[i]))`
//! rounded to nearest even (the fast path's second half).
//!
//! Invariants: at most [`BLOCK`] threads a block (the kernel's
//! `__launch_bounds__`); any grid is correct (grid-stride loops); `dst`
//! and `src` are equal or do not overlap; `n` may be 0.

/// The entry point's name.
pub const NAME: &str = "bf16_add_inplace";

/// The most threads a block, and the block the host launches.
pub const BLOCK: u32 = 256;

/// Values one thread moves per 16-byte load when both buffers are 16-byte
/// aligned.
pub const PER_LOAD: u32 = 8;

pub(crate) fn write_header(h: &mut String) {
    h.push_str("// The add kernel (bf16_add.cu).\n");
    crate::define(
        h,
        "Threads a block: the most the kernel accepts (__launch_bounds__).",
        "BF16_ADD_BLOCK",
        BLOCK,
    );
    crate::define(
        h,
        "Values a thread moves per 16-byte load on aligned buffers.",
        "BF16_ADD_PER_LOAD",
        PER_LOAD,
    );
    h.push('\n');
}
