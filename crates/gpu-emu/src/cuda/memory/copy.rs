//! Copies and memsets: `cuMemcpy*` and `cuMemset*`, synchronous or
//! enqueued on a stream.
//!
//! Invariants: device ranges are checked at the call, and every registered
//! range (device memory and pinned host memory) again when the work runs,
//! through `access`, atomically with the copy; driver work that finds its
//! memory gone then is the device's sticky `CUDA_ERROR_ILLEGAL_ADDRESS`; a
//! pageable host source is staged at launch, and a copy to pageable memory
//! returns once done, as in CUDA.

use std::ffi::c_void;
use std::sync::Arc;

use cuda_sys::{CUdeviceptr, CUresult, CUstream};

use super::registry::{Span, access, illegal_address, range_ok};
use crate::cuda::driver::{self, check_init, code};
use crate::cuda::stream::{self, Launcher};
use crate::guard;

/// Copies `len` bytes (ranges may overlap).
///
/// # Safety
/// Both ranges are valid for `len` bytes.
pub(crate) unsafe fn copy(dst: u64, src: u64, len: usize) {
    if len == 0 {
        return;
    }
    // SAFETY: both ranges are valid (this function's contract); `copy` allows
    // overlap.
    unsafe { std::ptr::copy(src as usize as *const u8, dst as usize as *mut u8, len) };
}

/// A copy between host and device: validates device ranges now, and
/// enqueues the copy on `stream` (or copies now when `stream` is `None`).
/// Registered ranges (device memory, and pinned host memory) are checked
/// again when the copy runs, atomically with the copy.
fn memcpy(
    dst: u64,
    src: u64,
    len: usize,
    dst_dev: bool,
    src_dev: bool,
    stream: Option<CUstream>,
) -> CUresult {
    code((|| {
        check_init()?;
        if len == 0 {
            return Ok(());
        }
        if (dst_dev && !range_ok(dst, len, false)) || (src_dev && !range_ok(src, len, false)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        if dst == 0 || src == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // Device memory, or pinned host memory: in the registry, checked
        // when touched. Pageable host memory is the caller's.
        let dst_reg = dst_dev || range_ok(dst, len, false);
        let src_reg = src_dev || range_ok(src, len, false);
        let spans = move |from_staged: bool| {
            let mut v = Vec::with_capacity(2);
            if dst_reg {
                v.push(Span::any(dst, len));
            }
            if src_reg && !from_staged {
                v.push(Span::any(src, len));
            }
            v
        };
        let Some(stream) = stream else {
            driver::current_sticky()?;
            // SAFETY: registered ranges are live for the whole copy (checked
            // under the registry lock `access` holds); pageable host ranges
            // are the caller's (the C function's contract).
            return access(&spans(false), || unsafe { copy(dst, src, len) })
                .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE);
        };
        let target = stream::resolve(stream, None)?;
        let dev = target.stream.device();
        driver::sticky(dev)?;
        // A pageable host source is staged at launch, as CUDA does; a pinned
        // one is read when the copy runs.
        let staged = !src_reg;
        let l: Launcher = Arc::new(move || {
            let data: Option<Vec<u8>> = staged.then(|| {
                let mut v = vec![0u8; len];
                // SAFETY: the caller keeps the host source valid until the
                // call that launches the copy returns (CUDA's contract).
                unsafe { copy(v.as_mut_ptr() as usize as u64, src, len) };
                v
            });
            Box::new(move || {
                if driver::sticky(dev).is_err() {
                    return;
                }
                let from = data.as_ref().map_or(src, |v| v.as_ptr() as usize as u64);
                // SAFETY: registered ranges are live for the whole copy
                // (checked under the lock `access` holds); a staged source
                // is `data`; pageable host ranges are kept valid by the
                // caller until the stream reaches the copy (CUDA's contract
                // for asynchronous copies).
                let done = access(&spans(staged), || unsafe { copy(dst, from, len) });
                if done.is_none() {
                    illegal_address(dev, "copy", dst, len);
                }
            })
        });
        let pageable_dst = !dst_reg;
        stream::submit(&target, l)?;
        if pageable_dst && !target.stream.capturing() {
            // A copy to pageable memory returns once done, as in CUDA.
            target.stream.wait_idle()?;
            driver::sticky(dev)?;
        }
        Ok(())
    })())
}

fn memset(dst: u64, pattern: Vec<u8>, n: usize, stream: Option<CUstream>) -> CUresult {
    code((|| {
        check_init()?;
        let w = pattern.len();
        let len = n.checked_mul(w).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        if len == 0 {
            return Ok(());
        }
        if !range_ok(dst, len, false) || !dst.is_multiple_of(w as u64) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let fill = move || {
            if let [b] = pattern[..] {
                // SAFETY: `[dst, dst + n)` is a live allocation for the whole
                // call (the caller holds it through `access`).
                unsafe { std::ptr::write_bytes(dst as usize as *mut u8, b, n) };
                return;
            }
            // SAFETY: `[dst, dst + n * w)` is a live allocation for the whole
            // call (the caller holds it through `access`) and nothing else
            // holds a reference into it.
            let out = unsafe { std::slice::from_raw_parts_mut(dst as usize as *mut u8, len) };
            for chunk in out.chunks_exact_mut(w) {
                chunk.copy_from_slice(&pattern);
            }
        };
        let span = [Span::any(dst, len)];
        match stream {
            None => {
                driver::current_sticky()?;
                access(&span, fill).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
            }
            Some(s) => {
                let target = stream::resolve(s, None)?;
                let dev = target.stream.device();
                driver::sticky(dev)?;
                let fill = Arc::new(fill);
                stream::submit(
                    &target,
                    Arc::new(move || {
                        let fill = fill.clone();
                        Box::new(move || {
                            if driver::sticky(dev).is_err() {
                                return;
                            }
                            if access(&span, || fill()).is_none() {
                                illegal_address(dev, "memset", dst, len);
                            }
                        })
                    }),
                )
            }
        }
    })())
}

/// `cuMemcpyHtoD_v2`: synchronous copy.
///
/// # Safety
/// `src` is valid for `n` bytes of reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memcpy(dst, src as usize as u64, n, true, false, None)
    })
}

/// `cuMemcpyDtoH_v2`: synchronous copy.
///
/// # Safety
/// `dst` is valid for `n` bytes of writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memcpy(dst as usize as u64, src, n, false, true, None)
    })
}

/// `cuMemcpyDtoD_v2`: synchronous copy.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memcpy(dst, src, n, true, true, None)
    })
}

/// `cuMemcpyHtoDAsync_v2`: copy enqueued on `stream`.
///
/// # Safety
/// `src` is valid for `n` bytes of reads until the copy runs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    stream: CUstream,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memcpy(dst, src as usize as u64, n, true, false, Some(stream))
    })
}

/// `cuMemcpyDtoHAsync_v2`: copy enqueued on `stream`.
///
/// # Safety
/// `dst` is valid for `n` bytes of writes until the copy runs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    stream: CUstream,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memcpy(dst as usize as u64, src, n, false, true, Some(stream))
    })
}

/// `cuMemcpyDtoDAsync_v2`: copy enqueued on `stream`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    stream: CUstream,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memcpy(dst, src, n, true, true, Some(stream))
    })
}

/// `cuMemsetD8_v2`: synchronous memset of bytes.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, uc: u8, n: usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memset(dst, vec![uc], n, None)
    })
}

/// `cuMemsetD32_v2`: synchronous memset of 32-bit words.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD32_v2(dst: CUdeviceptr, ui: u32, n: usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memset(dst, ui.to_ne_bytes().to_vec(), n, None)
    })
}

/// `cuMemsetD8Async`: memset of bytes enqueued on `stream`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8Async(
    dst: CUdeviceptr,
    uc: u8,
    n: usize,
    stream: CUstream,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memset(dst, vec![uc], n, Some(stream))
    })
}

/// `cuMemsetD32Async`: memset of 32-bit words enqueued on `stream`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD32Async(
    dst: CUdeviceptr,
    ui: u32,
    n: usize,
    stream: CUstream,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memset(dst, ui.to_ne_bytes().to_vec(), n, Some(stream))
    })
}
