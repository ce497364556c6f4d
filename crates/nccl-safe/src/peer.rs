//! Memory shared between the GPUs of one node: pinned host words a kernel
//! and the host both read and write, interprocess handles of device
//! allocations (CUDA IPC) and their mappings, and peer access between two
//! contexts of one process.
//!
//! Invariants:
//! - A [`HostWords`] owns its `cuMemAllocHost` allocation, zeroed at
//!   allocation and freed once on drop; the host touches it only through
//!   atomic loads and stores of whole `u32` words, so a kernel writing the
//!   same words is never a data race on the host side.
//! - An [`IpcMapping`] holds one `cuIpcOpenMemHandle` reference and closes
//!   it once, on drop, with its context current. The exporter's allocation
//!   must outlive every mapping of it (freeing it first is undefined in the
//!   driver): whoever holds mappings orders that, across processes.
//! - [`enable_peer_access`] treats "already enabled" as success.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use cuda_sys::ipc::{CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, CUipcMemHandle};
use cuda_sys::{CUdevice_attribute, CUdeviceptr, CUresult};

use crate::driver::{Context, device_handle};
use crate::error::{Error, Result, cuda_check};
use crate::memory::{COPY_DEADLINE, DeviceBuffer, Element};
use crate::stream::Stream;

/// Pinned host memory of `len` `u32` words, zeroed, that kernels on every
/// device of the process reach at the same address (unified addressing).
#[derive(Debug)]
pub struct HostWords {
    ptr: NonNull<AtomicU32>,
    len: usize,
    ctx: Arc<Context>,
}

// SAFETY: the words are plain pinned memory owned by this value and only
// touched through atomics; the driver lets any thread free it.
unsafe impl Send for HostWords {}
// SAFETY: shared access goes through `AtomicU32` loads and stores only.
unsafe impl Sync for HostWords {}

impl HostWords {
    /// Allocates `len` (at least 1) zeroed words of pinned host memory.
    pub fn alloc(ctx: &Arc<Context>, len: usize) -> Result<HostWords> {
        let bytes = len
            .checked_mul(4)
            .filter(|b| *b > 0)
            .ok_or_else(|| Error::invalid("HostWords::alloc", format!("{len} words")))?;
        ctx.make_current()?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: writes one host pointer through a valid out pointer; the
        // context is current.
        unsafe { cu!(cuMemAllocHost_v2(&mut p, bytes)) }?;
        let ptr = NonNull::new(p.cast::<AtomicU32>())
            .ok_or_else(|| Error::invalid("cuMemAllocHost_v2", "returned a null pointer"))?;
        let words = HostWords {
            ptr,
            len,
            ctx: Arc::clone(ctx),
        };
        for i in 0..len {
            words.store(i, 0);
        }
        Ok(words)
    }

    fn word(&self, i: usize) -> Option<&AtomicU32> {
        // SAFETY: `i < len` words of the live allocation, 4-byte aligned
        // (the driver aligns pinned allocations to pages), touched only
        // atomically.
        (i < self.len).then(|| unsafe { &*self.ptr.as_ptr().add(i) })
    }

    /// Word `i` (0 past the end).
    pub fn load(&self, i: usize) -> u32 {
        self.word(i).map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// Sets word `i` (nothing past the end).
    pub fn store(&self, i: usize, v: u32) {
        if let Some(w) = self.word(i) {
            w.store(v, Ordering::Release);
        }
    }

    /// The address kernels use (the host address, under unified
    /// addressing).
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr.as_ptr() as usize as CUdeviceptr
    }
}

impl Drop for HostWords {
    fn drop(&mut self) {
        let free = || -> Result<()> {
            self.ctx.make_current()?;
            // SAFETY: this value owns the allocation and frees it once, here.
            unsafe { cu!(cuMemFreeHost(self.ptr.as_ptr().cast())) }
        };
        if let Err(e) = free() {
            tracing::error!(error = %e, "freeing pinned host memory failed");
        }
    }
}

/// The interprocess handle of a device allocation (`cuIpcGetMemHandle`):
/// 64 bytes another process opens with [`IpcMapping::open`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

fn ipc_lib() -> Result<&'static cuda_sys::ipc::IpcLib> {
    Ok(cuda_sys::ipc::ipc()?)
}

/// The interprocess handle of `buf`'s allocation.
pub fn ipc_handle<T: Element>(buf: &DeviceBuffer<T>) -> Result<IpcHandle> {
    if buf.is_empty() {
        return Err(Error::invalid(
            "ipc_handle",
            "an empty buffer has no memory",
        ));
    }
    buf.context().make_current()?;
    let mut h = CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: writes one handle through a valid pointer; the address is the
    // base of a live `cuMemAlloc` allocation of the current context.
    let rc = unsafe { cuda_sys::call!(ipc_lib()?, cuIpcGetMemHandle(&mut h, buf.device_ptr())) }?;
    cuda_check(rc, "cuIpcGetMemHandle")?;
    Ok(IpcHandle(h.reserved.map(|b| b as u8)))
}

/// Another allocation mapped into this context from its IPC handle.
#[derive(Debug)]
pub struct IpcMapping {
    ptr: CUdeviceptr,
    ctx: Arc<Context>,
}

// SAFETY: the mapping is a device address this value owns; the driver lets
// any thread close it.
unsafe impl Send for IpcMapping {}
// SAFETY: no method mutates the value.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Maps the allocation behind `handle` into `ctx`, enabling peer access
    /// to its device (`CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`). Fails for a
    /// handle of this very process on GPUs (the driver refuses it); the
    /// caller uses the exporter's address with [`enable_peer_access`]
    /// there.
    pub fn open(ctx: &Arc<Context>, handle: &IpcHandle) -> Result<IpcMapping> {
        ctx.make_current()?;
        let raw = CUipcMemHandle {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: writes one device address through a valid pointer; the
        // handle is passed by value; the context is current.
        let rc = unsafe {
            cuda_sys::call!(
                ipc_lib()?,
                cuIpcOpenMemHandle_v2(&mut ptr, raw, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            )
        }?;
        cuda_check(rc, "cuIpcOpenMemHandle_v2")?;
        Ok(IpcMapping {
            ptr,
            ctx: Arc::clone(ctx),
        })
    }

    /// The mapped address in this context.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let close = || -> Result<()> {
            self.ctx.make_current()?;
            // SAFETY: this value holds one reference from
            // `cuIpcOpenMemHandle` and releases it once, here.
            let rc = unsafe { cuda_sys::call!(ipc_lib()?, cuIpcCloseMemHandle(self.ptr)) }?;
            cuda_check(rc, "cuIpcCloseMemHandle")
        };
        if let Err(e) = close() {
            tracing::error!(error = %e, "closing an IPC mapping failed");
        }
    }
}

/// Lets kernels of `ctx` reach `peer`'s memory (`cuCtxEnablePeerAccess`);
/// success when it already can.
pub fn enable_peer_access(ctx: &Context, peer: &Context) -> Result<()> {
    ctx.make_current()?;
    let lib = crate::error::cuda_lib()?;
    // SAFETY: both contexts are live retained primary contexts; the flags
    // must be 0.
    let rc = unsafe { cuda_sys::call!(lib, cuCtxEnablePeerAccess(peer.raw(), 0)) }?;
    if rc == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    cuda_check(rc, "cuCtxEnablePeerAccess")
}

/// Whether device `ordinal` shares one address space with the host and the
/// other devices (`CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING`).
pub fn unified_addressing(ordinal: usize) -> Result<bool> {
    let dev = device_handle(ordinal, "unified_addressing")?;
    let mut v = 0;
    // SAFETY: writes one int through a valid pointer; `dev` is a device handle.
    unsafe {
        cu!(cuDeviceGetAttribute(
            &mut v,
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
            dev
        ))
    }?;
    Ok(v != 0)
}

/// Sets every word of `buf` to `value` and waits (at most
/// [`COPY_DEADLINE`]) until the fill has landed, so work on non-blocking
/// streams may rely on it at once.
pub fn fill_words(buf: &mut DeviceBuffer<u32>, value: u32) -> Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    buf.context().make_current()?;
    let (dst, n) = (buf.device_ptr(), buf.len());
    // SAFETY: `dst` is the buffer's allocation of `n` words; the context is
    // current.
    unsafe { cu!(cuMemsetD32_v2(dst, value, n)) }?;
    // SAFETY: the null handle is the legacy default stream of the buffer's
    // context, where the memset ran.
    let legacy = unsafe { Stream::borrowed(buf.context(), std::ptr::null_mut()) };
    legacy.wait_until_idle(COPY_DEADLINE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_compare_by_bytes() {
        let a = IpcHandle([1; 64]);
        assert_eq!(a, IpcHandle([1; 64]));
        assert_ne!(a, IpcHandle([2; 64]));
    }
}
