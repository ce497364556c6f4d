//! Buffer registration with a communicator, symmetric memory, and windows.
//!
//! Invariants:
//! - A [`RegisteredBuffer`] or [`Window`] borrows its communicator, so it
//!   cannot outlive it, and is deregistered exactly once on drop (skipped when
//!   the communicator was aborted: NCCL freed everything).
//! - A [`SymmetricBuffer`] owns its `ncclMemAlloc` allocation and frees it
//!   exactly once on drop; zero bytes allocate nothing.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use nccl_sys::ncclWindow_t;

use crate::comm::Comm;
use crate::driver::Context;
use crate::error::{Error, Result, nccl_check};
use crate::memory::{DeviceBuffer, Element};

/// The loaded NCCL's version, `"2.28.3"`.
pub fn nccl_version() -> Result<String> {
    let lib = crate::error::nccl_lib()?;
    Ok(nccl_sys::version_string(lib.version()))
}

/// A device buffer registered with a communicator (`ncclCommRegister`).
#[derive(Debug)]
pub struct RegisteredBuffer<'a> {
    comm: &'a Comm,
    handle: *mut c_void,
    ptr: u64,
    bytes: usize,
    _buf: PhantomData<&'a ()>,
}

impl RegisteredBuffer<'_> {
    /// The registration handle (owned by this value).
    pub fn handle(&self) -> *mut c_void {
        self.handle
    }

    /// The registered device address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The registered size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for RegisteredBuffer<'_> {
    fn drop(&mut self) {
        if self.comm.is_aborted() {
            return;
        }
        // SAFETY: the handle came from ncclCommRegister on this communicator,
        // which the borrow keeps alive, and is deregistered once, here.
        if let Err(e) = unsafe { self.comm.deregister_raw(self.handle) } {
            tracing::error!(error = %e, "deregistering a buffer failed");
        }
    }
}

/// A window registered with a communicator (`ncclCommWindowRegister`).
#[derive(Debug)]
pub struct Window<'a> {
    comm: &'a Comm,
    raw: ncclWindow_t,
}

impl Window<'_> {
    /// The raw window (owned by this value).
    pub fn raw(&self) -> ncclWindow_t {
        self.raw
    }
}

impl Drop for Window<'_> {
    fn drop(&mut self) {
        if self.comm.is_aborted() {
            return;
        }
        let (comm, raw) = (self.comm, self.raw);
        let result = comm.enqueue("ncclCommWindowDeregister", |lib, c| {
            // SAFETY: the window came from ncclCommWindowRegister on this live
            // communicator and is deregistered once, here.
            unsafe { nccl_sys::call!(lib, ncclCommWindowDeregister(c, raw)) }
        });
        if let Err(e) = result {
            tracing::error!(error = %e, "deregistering a window failed");
        }
    }
}

impl Comm {
    /// Registers `bytes` of device memory at `ptr` (`ncclCommRegister`),
    /// returning NCCL's handle.
    ///
    /// # Safety
    /// `ptr` is device memory of this communicator's device, valid for
    /// `bytes` bytes until the handle is passed to [`Comm::deregister_raw`].
    pub unsafe fn register_raw(&self, ptr: u64, bytes: usize) -> Result<*mut c_void> {
        if ptr == 0 || bytes == 0 {
            return Err(Error::invalid(
                "ncclCommRegister",
                format!("nothing to register (ptr {ptr:#x}, {bytes} bytes)"),
            ));
        }
        let mut handle: *mut c_void = std::ptr::null_mut();
        self.enqueue("ncclCommRegister", |lib, c| {
            // SAFETY: the memory satisfies this function's contract; writes
            // one handle through a valid pointer; `c` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclCommRegister(c, ptr as *mut c_void, bytes, &mut handle)
                )
            }
        })?;
        Ok(handle)
    }

    /// Deregisters a handle from [`Comm::register_raw`] (`ncclCommDeregister`).
    ///
    /// # Safety
    /// `handle` came from `register_raw` on this communicator and was not
    /// deregistered yet.
    pub unsafe fn deregister_raw(&self, handle: *mut c_void) -> Result<()> {
        self.enqueue("ncclCommDeregister", |lib, c| {
            // SAFETY: the handle satisfies this function's contract; `c` is live.
            unsafe { nccl_sys::call!(lib, ncclCommDeregister(c, handle)) }
        })
    }

    /// Registers a device buffer for the communicator's lifetime or until
    /// the returned value drops.
    pub fn register<'a, T: Element>(
        &'a self,
        buf: &'a DeviceBuffer<T>,
    ) -> Result<RegisteredBuffer<'a>> {
        self.check_ctx("ncclCommRegister", "the buffer", buf.context())?;
        // SAFETY: the buffer is device memory of this communicator's context,
        // borrowed for as long as the registration lives.
        let handle = unsafe { self.register_raw(buf.device_ptr(), buf.bytes()) }?;
        Ok(RegisteredBuffer {
            comm: self,
            handle,
            ptr: buf.device_ptr(),
            bytes: buf.bytes(),
            _buf: PhantomData,
        })
    }

    /// Registers a window (`ncclCommWindowRegister`, NCCL 2.27+; every rank
    /// calls it).
    ///
    /// # Safety
    /// `ptr` is device memory of this communicator's device (for symmetric
    /// windows, from [`SymmetricBuffer`]) valid for `bytes` bytes until the
    /// window drops.
    pub unsafe fn window_register(&self, ptr: u64, bytes: usize, flags: i32) -> Result<Window<'_>> {
        if ptr == 0 || bytes == 0 {
            return Err(Error::invalid(
                "ncclCommWindowRegister",
                format!("nothing to register (ptr {ptr:#x}, {bytes} bytes)"),
            ));
        }
        let mut raw: ncclWindow_t = std::ptr::null_mut();
        self.enqueue("ncclCommWindowRegister", |lib, c| {
            // SAFETY: the memory satisfies this function's contract; writes
            // one window through a valid pointer; `c` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclCommWindowRegister(c, ptr as *mut c_void, bytes, &mut raw, flags)
                )
            }
        })?;
        Ok(Window { comm: self, raw })
    }
}

/// Device memory from `ncclMemAlloc`, suitable for registration and
/// symmetric windows.
#[derive(Debug)]
pub struct SymmetricBuffer {
    ptr: *mut c_void,
    bytes: usize,
    ctx: Arc<Context>,
}

// SAFETY: the allocation is a device address owned by this value; the driver
// and NCCL let any thread use or free it.
unsafe impl Send for SymmetricBuffer {}
// SAFETY: shared references only read the address and size.
unsafe impl Sync for SymmetricBuffer {}

impl SymmetricBuffer {
    /// Allocates `bytes` with `ncclMemAlloc` on `ctx`'s device (nothing for
    /// zero bytes).
    pub fn alloc(ctx: &Arc<Context>, bytes: usize) -> Result<SymmetricBuffer> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        if bytes > 0 {
            ctx.make_current()?;
            // SAFETY: writes one pointer through a valid pointer; the
            // context is current.
            let rc = unsafe { nccl_raw!(ncclMemAlloc(&mut ptr, bytes)) };
            nccl_check(rc, "ncclMemAlloc", std::ptr::null_mut())?;
        }
        Ok(SymmetricBuffer {
            ptr,
            bytes,
            ctx: Arc::clone(ctx),
        })
    }

    /// The device address (0 when empty).
    pub fn device_ptr(&self) -> u64 {
        self.ptr as u64
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The context the memory belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for SymmetricBuffer {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        let free = || -> Result<()> {
            self.ctx.make_current()?;
            // SAFETY: this value owns the allocation and frees it once, here.
            let rc = unsafe { nccl_raw!(ncclMemFree(self.ptr)) };
            nccl_check(rc, "ncclMemFree", std::ptr::null_mut())
        };
        if let Err(e) = free() {
            tracing::error!(bytes = self.bytes, error = %e, "freeing symmetric memory failed");
        }
    }
}
