//! Buffer registration, windows and NCCL's allocator: `ncclCommRegister`,
//! `ncclCommDeregister`, `ncclCommWindowRegister`,
//! `ncclCommWindowDeregister`, `ncclMemAlloc`, `ncclMemFree`.
//!
//! Invariants: a registration or window is a unique handle for a range
//! inside one live allocation, known to its communicator until it is
//! deregistered; `ncclMemFree` frees as `cuMemFree` does, after the work
//! queued on the pointer's device.

use std::ffi::{c_int, c_void};

use nccl_sys::{ncclComm_t, ncclResult_t, ncclWindow_t, ncclWindow_vidmem};

use super::R;
use super::comm::lookup;
use super::errors::{entry, err, fail};
use crate::cuda::driver;
use crate::cuda::memory::{self, range_ok};
use crate::{id_to_ptr, new_id, ptr_to_id, put};

pub(super) fn register(comm: ncclComm_t, buff: u64, size: usize, window: bool) -> R<u64> {
    let c = lookup(comm)?;
    c.ready()?;
    c.idle()?;
    if size == 0 || !range_ok(buff, size, true) {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("buffer {buff:#x} of {size} bytes is not inside a live device allocation"),
        );
    }
    let id = new_id();
    let mut st = c.st.lock();
    if window {
        st.wins.insert(id);
    } else {
        st.regs.insert(id);
    }
    Ok(id)
}

pub(super) fn deregister(comm: ncclComm_t, id: u64, window: bool) -> R<ncclResult_t> {
    let c = lookup(comm)?;
    let mut st = c.st.lock();
    let removed = if window {
        st.wins.remove(&id)
    } else {
        st.regs.remove(&id)
    };
    if removed {
        Ok(ncclResult_t::ncclSuccess)
    } else {
        fail(
            ncclResult_t::ncclInvalidArgument,
            format!("handle {id:#x} is not registered with this communicator"),
        )
    }
}

/// `ncclCommRegister`: a unique handle for a live device buffer.
///
/// # Safety
/// `handle` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    entry(|| {
        if handle.is_null() {
            return fail(ncclResult_t::ncclInvalidArgument, "handle is NULL");
        }
        let id = register(comm, buff as usize as u64, size, false)?;
        // SAFETY: `handle` is non-null and valid (this function's contract).
        unsafe { put(handle, id_to_ptr::<c_void>(id)) };
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommDeregister`: an unknown or already deregistered handle is
/// `ncclInvalidArgument`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    entry(|| deregister(comm, ptr_to_id(handle), false))
}

/// `ncclCommWindowRegister`.
///
/// # Safety
/// `win` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommWindowRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    _flags: c_int,
) -> ncclResult_t {
    entry(|| {
        if win.is_null() {
            return fail(ncclResult_t::ncclInvalidArgument, "win is NULL");
        }
        let id = register(comm, buff as usize as u64, size, true)?;
        // SAFETY: `win` is non-null and valid (this function's contract).
        unsafe { put(win, id_to_ptr::<ncclWindow_vidmem>(id)) };
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommWindowDeregister`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) -> ncclResult_t {
    entry(|| deregister(comm, ptr_to_id(win), true))
}

/// `ncclMemAlloc`: device memory on the current device.
///
/// # Safety
/// `ptr` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    entry(|| {
        if ptr.is_null() {
            return fail(ncclResult_t::ncclInvalidArgument, "ptr is NULL");
        }
        if size == 0 {
            return fail(ncclResult_t::ncclInvalidArgument, "size is 0");
        }
        let dev = driver::current_device().unwrap_or(0);
        let p = memory::alloc(Some(dev), size).map_err(|e| {
            err(
                ncclResult_t::ncclUnhandledCudaError,
                format!("allocation of {size} bytes failed (CUDA error {})", e.0),
            )
        })?;
        // SAFETY: `ptr` is non-null and valid (this function's contract).
        unsafe { put(ptr, p as usize as *mut c_void) };
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclMemFree`: frees as `cuMemFree` does (NCCL's `cudaFree` or cuMem
/// unmap on the pointer's device), once the work queued on that device
/// before the call has run; an unknown pointer is `ncclInvalidArgument`, a
/// device with a sticky CUDA error `ncclUnhandledCudaError`.
///
/// # Safety
/// None: `ptr` is only compared with the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    entry(|| {
        if ptr.is_null() {
            return Ok(ncclResult_t::ncclSuccess);
        }
        memory::free(ptr as usize as u64, true).map_err(|e| {
            if e == cuda_sys::CUresult::CUDA_ERROR_INVALID_VALUE {
                err(
                    ncclResult_t::ncclInvalidArgument,
                    format!("{ptr:p} was not allocated by ncclMemAlloc"),
                )
            } else {
                err(
                    ncclResult_t::ncclUnhandledCudaError,
                    format!("freeing {ptr:p} failed (CUDA error {})", e.0),
                )
            }
        })?;
        Ok(ncclResult_t::ncclSuccess)
    })
}
