//! The residual add + RMSNorm's ABI and arithmetic: the launch contract of
//! `{bf16,f16,f32}_add_rms_norm` (`crates/metrale-comm/kernels/add_rms_norm.cu`)
//! and of the fused one-shot entries `{bf16,f16,f32}_one_shot_add_rms_norm`
//! (`one_shot.cu`), and [`row`], the arithmetic both compute, on the host,
//! so the emulator and the tests compute it bit for bit.
//!
//! Arithmetic of one row of `hidden` values, in f32 (every add, multiply,
//! divide and square root rounded to nearest even, none contracted into an
//! FMA; `round` rounds to the element type, nearest even):
//! 1. `r[i] = round(s[i] + res[i])`: `s` the all-reduced input (in the
//!    type), `res` the residual; `r` is the new residual.
//! 2. Thread `t` of [`threads`]`(hidden, size)` threads sums `r[i] * r[i]`
//!    over its chunks `t, t + T, t + 2T, ...` (chunk `j`: elements
//!    `j * P .. j * P + P` of the row, `P` = 16 / size), in element order,
//!    from +0.0.
//! 3. The partial sums are reduced by a fixed tree: in each warp of 32
//!    threads, five butterfly steps `v[l] = v[l] + v[l ^ o]` for `o` = 16,
//!    8, 4, 2, 1; then lane 0's value of each warp, padded with +0.0 to 32,
//!    by the same five steps; lane 0 holds the sum `ss`.
//! 4. `inv = 1 / sqrt(ss / hidden + eps)`.
//! 5. `out[i] = round((r[i] * inv) * w[i])`.
//!
//! A NaN anywhere is the GPU's canonical NaN (f32 bits `0x7FFF_FFFF`).
//! Bound against an exact (f64) evaluation of `rms_norm(s + res) * w` with
//! the same rounded residual: the f32 steps add a relative error of at most
//! about `(hidden / 32 + 10) * 2^-24` to `ss` and a few ulps of f32 to
//! `inv`, far below the output's rounding to bf16 (2^-9) or f16 (2^-11), so
//! each output is within one unit in the last place of the type plus
//! `2^-16 |out|` (f32: `(hidden / 16 + 16) * 2^-24 |out|`).
//!
//! Invariants: [`threads`] depends on `hidden` and the element size only,
//! so the separate kernel, the fused one and the host split a row alike;
//! `1 <= hidden <= MAX_HIDDEN`.

use std::fmt::Write as _;

/// The largest row the kernels take.
pub const MAX_HIDDEN: usize = 1 << 16;
/// The most threads a block (both kernels' `__launch_bounds__`).
pub const BLOCK: u32 = 512;
/// Threads of a warp (the tree's first level).
pub const WARP: u32 = 32;

/// The separate kernels' entry points, by element type (their C type).
pub const ENTRIES: [(&str, &str); 3] = [
    ("bf16_add_rms_norm", "__nv_bfloat16"),
    ("f16_add_rms_norm", "__half"),
    ("f32_add_rms_norm", "float"),
];

/// The fused one-shot entry points (in `one_shot.cu`), by element type.
pub const FUSED_ENTRIES: [(&str, &str); 3] = [
    ("bf16_one_shot_add_rms_norm", "__nv_bfloat16"),
    ("f16_one_shot_add_rms_norm", "__half"),
    ("f32_one_shot_add_rms_norm", "float"),
];

/// The fused one-shot entries that split a row over the blocks of a thread
/// block cluster (compute capability 9.0 and newer; in `one_shot_sm90.ptx`,
/// built from `one_shot.cu` with `OS_CLUSTER`), by element type. Their
/// parameters and arithmetic are [`FUSED_ENTRIES`]'; a launch has cluster
/// dimensions `(c, 1, 1)`, `c` 1 to [`MAX_CLUSTER`], `gridDim.x` a multiple
/// of `c`, and `blockDim.x * c` threads split each row, block `b` of a
/// cluster taking the row's threads `b * blockDim.x ..`: the block of
/// [`threads`] threads of the other entries, spread over `c` blocks.
pub const FUSED_CLUSTER_ENTRIES: [(&str, &str); 3] = [
    ("bf16_one_shot_add_rms_norm_cluster", "__nv_bfloat16"),
    ("f16_one_shot_add_rms_norm_cluster", "__half"),
    ("f32_one_shot_add_rms_norm_cluster", "float"),
];

/// The most blocks a cluster of the fused cluster entries (the portable
/// cluster size of compute capability 9.0).
pub const MAX_CLUSTER: u32 = 8;

/// The threads that split a row of `hidden` values of `size` bytes: one
/// per 16-byte chunk, rounded up to a warp, at most [`BLOCK`].
pub const fn threads(hidden: usize, size: usize) -> u32 {
    let chunks = hidden.div_ceil(16 / size);
    let t = chunks.div_ceil(WARP as usize) * WARP as usize;
    if t > BLOCK as usize {
        BLOCK
    } else if t == 0 {
        WARP
    } else {
        t as u32
    }
}

const CANONICAL_NAN: f32 = f32::from_bits(0x7FFF_FFFF);

fn canon(x: f32) -> f32 {
    if x.is_nan() { CANONICAL_NAN } else { x }
}

/// The five butterfly steps over 32 lanes; lane 0's value.
fn warp_sum(mut v: [f32; 32]) -> f32 {
    for o in [16, 8, 4, 2, 1] {
        let before = v;
        for (l, x) in v.iter_mut().enumerate() {
            *x = canon(before[l] + before[l ^ o]);
        }
    }
    v[0]
}

/// The sum of squares of a row of residuals `r` (f32 values of the type)
/// as the kernels reduce it with `threads` threads (steps 2 and 3).
pub fn sum_of_squares(r: &[f32], threads: u32, size: usize) -> f32 {
    let per = 16 / size;
    let t = threads as usize;
    let mut part = vec![0f32; t.next_multiple_of(WARP as usize)];
    for (j, chunk) in r.chunks(per).enumerate() {
        let p = &mut part[j % t];
        for &x in chunk {
            *p = canon(*p + canon(x * x));
        }
    }
    let mut warps = [0f32; 32];
    for (w, lanes) in part.chunks(WARP as usize).enumerate() {
        let mut v = [0f32; 32];
        v.copy_from_slice(lanes);
        warps[w] = warp_sum(v);
    }
    warp_sum(warps)
}

/// One row: `s` the all-reduced input, `res` the residual, `w` the weight,
/// all as f32 values of the element type of `size` bytes; `round` rounds
/// an f32 to the type (nearest even) and back. Writes the new residual
/// into `res` and the output into `out`, both rounded. `s`, `res`, `w` and
/// `out` have one length, 1 to [`MAX_HIDDEN`].
pub fn row(
    s: &[f32],
    res: &mut [f32],
    w: &[f32],
    eps: f32,
    size: usize,
    round: impl Fn(f32) -> f32,
    out: &mut [f32],
) {
    let hidden = s.len();
    let round = |x: f32| round(canon(x));
    for (r, &x) in res.iter_mut().zip(s) {
        *r = round(x + *r);
    }
    let ss = sum_of_squares(res, threads(hidden, size), size);
    let mean = canon(ss / hidden as f32);
    let inv = canon(1.0 / canon(canon(mean + eps).sqrt()));
    for ((o, &r), &w) in out.iter_mut().zip(res.iter()).zip(w) {
        *o = round(canon(canon(r * inv) * w));
    }
}

pub(crate) fn write_header(h: &mut String) {
    use crate::define;
    h.push_str("// The residual add + RMSNorm (add_rms_norm.cu; fused: one_shot.cu).\n");
    define(
        h,
        "The largest row (hidden) the kernels take.",
        "NORM_MAX_HIDDEN",
        format!("{MAX_HIDDEN}u"),
    );
    define(
        h,
        "Most threads a block (__launch_bounds__).",
        "NORM_BLOCK",
        BLOCK,
    );
    define(
        h,
        "Most blocks a cluster of the fused cluster entries.",
        "NORM_MAX_CLUSTER",
        format!("{MAX_CLUSTER}u"),
    );
    let _ = writeln!(h);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_cover_a_row_by_chunks() {
        assert_eq!(threads(1, 2), 32);
        assert_eq!(threads(4096, 2), 512);
        assert_eq!(threads(8192, 2), 512);
        assert_eq!(threads(1000, 4), 256);
        assert_eq!(threads(MAX_HIDDEN, 4), 512);
    }

    #[test]
    fn a_constant_row_normalises_to_the_weight() {
        let s = vec![1.0f32; 100];
        let mut res = vec![1.0f32; 100];
        let w: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let mut out = vec![0f32; 100];
        row(&s, &mut res, &w, 0.0, 4, |x| x, &mut out);
        assert!(res.iter().all(|&r| r == 2.0));
        assert_eq!(out, w);
    }

    #[test]
    fn the_tree_matches_a_plain_sum_on_exact_values() {
        let r: Vec<f32> = (0..3000).map(|i| (i % 7) as f32).collect();
        let exact: f32 = r.iter().map(|x| x * x).sum();
        assert_eq!(sum_of_squares(&r, threads(3000, 2), 2), exact);
    }
}
