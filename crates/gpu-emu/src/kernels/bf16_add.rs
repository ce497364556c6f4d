//! The host implementation of metrale-comm's add kernel,
//! `bf16_add_inplace(bf16* dst, const bf16* src, u64 n)` (`dst[i] =
//! bf16(f32(dst[i]) + f32(src[i]))`, round to nearest even, as
//! `crates/metrale-comm/kernels/bf16_add.cu` computes it).
//!
//! Invariant: both ranges are checked at launch and again when the kernel
//! runs, atomically with the run (`memory::access`): a range not
//! allocated then is the device's sticky `CUDA_ERROR_ILLEGAL_ADDRESS`,
//! and nothing is read or written.

use std::sync::Arc;

use cuda_sys::CUresult;
use half::bf16;

use crate::cuda::driver;
use crate::cuda::memory::{self, Span, range_ok};
use crate::cuda::stream::Launcher;

/// `dst[i] = bf16(f32(dst[i]) + f32(src[i]))`, round to nearest even.
///
/// # Safety
/// `dst` and `src` are valid for `n` bf16 values.
unsafe fn bf16_add(dst: u64, src: u64, n: usize) {
    let d = dst as usize as *mut bf16;
    let s = src as usize as *const bf16;
    for i in 0..n {
        // SAFETY: `i < n` and both ranges hold `n` values (this function's
        // contract); unaligned access keeps odd addresses sound.
        unsafe {
            let a = d.add(i).read_unaligned();
            let b = s.add(i).read_unaligned();
            d.add(i)
                .write_unaligned(bf16::from_f32(a.to_f32() + b.to_f32()));
        }
    }
}

/// The launch of `bf16_add_inplace(dst, src, n)` on a stream of device
/// `dev`: the ranges are checked now, and again when it runs.
pub(super) fn launcher((dst, src, n): (u64, u64, u64), dev: i32) -> Result<Launcher, CUresult> {
    let n = usize::try_from(n).map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let bytes = n.checked_mul(2).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if !range_ok(dst, bytes, true) || !range_ok(src, bytes, true) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let spans = [Span::device(dst, bytes), Span::device(src, bytes)];
    let l: Launcher = Arc::new(move || {
        Box::new(move || {
            if driver::sticky(dev).is_err() {
                return;
            }
            // SAFETY: both ranges hold `n` bf16 values for the
            // whole run (checked under the registry lock that
            // `access` holds until the closure returns).
            let ran = memory::access(&spans, || unsafe { bf16_add(dst, src, n) });
            if ran.is_none() {
                memory::illegal_address(dev, "bf16_add_inplace", dst, bytes);
            }
        })
    });
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_add_rounds_like_the_gpu() {
        let mut d = [bf16::from_f32(1.0), bf16::from_bits(0x3f81)];
        let s = [bf16::from_bits(0x3b80), bf16::from_bits(0x3f81)];
        // SAFETY: both arrays hold two values.
        unsafe {
            bf16_add(
                d.as_mut_ptr() as usize as u64,
                s.as_ptr() as usize as u64,
                2,
            )
        };
        for (i, x) in d.iter().enumerate() {
            let want = if i == 0 {
                bf16::from_f32(1.0 + bf16::from_bits(0x3b80).to_f32())
            } else {
                bf16::from_f32(2.0 * bf16::from_bits(0x3f81).to_f32())
            };
            assert_eq!(x.to_bits(), want.to_bits());
        }
    }
}
