//! The driver's allocation entry points: `cuMemAlloc_v2`, `cuMemFree_v2`,
//! `cuMemAllocHost_v2`, `cuMemFreeHost`, `cuMemGetInfo_v2`, and
//! `cuPointerGetAttribute`, which looks a pointer up in the registry.
//!
//! Invariants: allocation and free go through the registry (`alloc`,
//! `free`); a device with a sticky error refuses both.

use std::ffi::{c_int, c_uint, c_void};

use cuda_sys::{CUcontext, CUdeviceptr, CUmemorytype_enum, CUpointer_attribute, CUresult};

use super::registry::{alloc, find, free, used};
use crate::cuda::driver::{self, TOTAL_MEM, check_init, code, ctx_handle, out};
use crate::{guard, put};

/// `cuMemGetInfo_v2`: free and total bytes of the current device.
///
/// # Safety
/// `free` and `total` are null or valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let dev = driver::current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            if free.is_null() || total.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: both pointers are non-null and valid (this function's
            // contract).
            unsafe {
                put(free, TOTAL_MEM - used(dev).min(TOTAL_MEM));
                put(total, TOTAL_MEM);
            }
            Ok(())
        })())
    })
}

/// `cuMemAlloc_v2`: device memory on the current context's device.
///
/// # Safety
/// `dptr` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let dev = driver::current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            if dptr.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            driver::sticky(dev)?;
            let p = alloc(Some(dev), bytesize)?;
            // SAFETY: `dptr` is non-null and valid (this function's contract).
            unsafe { put(dptr, p) };
            Ok(())
        })())
    })
}

/// `cuMemFree_v2`: frees device memory once the work queued on its device
/// before the call has run (the driver's implicit synchronisation); an
/// unknown pointer is `CUDA_ERROR_INVALID_VALUE`, a device with a sticky
/// error returns it.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code(check_init().and_then(|_| free(dptr, true)))
    })
}

/// `cuMemAllocHost_v2`: pinned host memory (plain host memory here).
///
/// # Safety
/// `pp` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            driver::current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            if pp.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            let p = alloc(None, bytesize)?;
            // SAFETY: `pp` is non-null and valid (this function's contract).
            unsafe { put(pp, p as usize as *mut c_void) };
            Ok(())
        })())
    })
}

/// `cuMemFreeHost`: frees pinned host memory at once (queued copies that
/// still use it find it gone when they run: a sticky illegal address).
///
/// # Safety
/// None beyond the C API's: `p` is only compared with the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code(check_init().and_then(|_| free(p as usize as u64, false)))
    })
}

/// `cuPointerGetAttribute`: memory type, device ordinal, range start and
/// size, context.
///
/// # Safety
/// `data` is null or valid for a write of the attribute's type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: CUpointer_attribute,
    ptr: CUdeviceptr,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let (start, len, dev) = find(ptr).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
            type P = CUpointer_attribute;
            // SAFETY (all arms): `data` is null or valid for the attribute's
            // type (this function's contract).
            match attribute {
                P::CU_POINTER_ATTRIBUTE_MEMORY_TYPE => {
                    let t = if dev.is_some() {
                        CUmemorytype_enum::CU_MEMORYTYPE_DEVICE
                    } else {
                        CUmemorytype_enum::CU_MEMORYTYPE_HOST
                    };
                    // SAFETY: see above.
                    unsafe { out(data.cast::<c_uint>(), t.0) }
                }
                P::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL => {
                    // SAFETY: see above.
                    unsafe { out(data.cast::<c_int>(), dev.unwrap_or(-1)) }
                }
                P::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR => {
                    // SAFETY: see above.
                    unsafe { out(data.cast::<CUdeviceptr>(), start) }
                }
                P::CU_POINTER_ATTRIBUTE_RANGE_SIZE => {
                    // SAFETY: see above.
                    unsafe { out(data.cast::<usize>(), len) }
                }
                P::CU_POINTER_ATTRIBUTE_DEVICE_POINTER => {
                    // SAFETY: see above.
                    unsafe { out(data.cast::<CUdeviceptr>(), ptr) }
                }
                P::CU_POINTER_ATTRIBUTE_CONTEXT => {
                    let c = dev.map_or(std::ptr::null_mut(), ctx_handle);
                    // SAFETY: see above.
                    unsafe { out(data.cast::<CUcontext>(), c) }
                }
                _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
            }
        })())
    })
}
