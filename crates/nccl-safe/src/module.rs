//! Loaded PTX modules and their kernels.
//!
//! Invariants:
//! - A module is unloaded exactly once, when the last [`Module`] or
//!   [`Function`] referring to it is dropped; a [`Function`] keeps its module
//!   alive.
//! - Loading makes the module's context current first; so does a launch.

use std::ffi::{CString, c_void};
use std::sync::Arc;

use cuda_sys::{CUfunction, CUmodule, CUstream};

use crate::driver::Context;
use crate::error::{Error, Result};

#[derive(Debug)]
struct ModuleInner {
    raw: CUmodule,
    ctx: Arc<Context>,
}

// SAFETY: a CUmodule is a handle the driver lets any thread use; this type
// only reads the handle.
unsafe impl Send for ModuleInner {}
// SAFETY: as for Send; no method mutates the value.
unsafe impl Sync for ModuleInner {}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        let unload = || -> Result<()> {
            self.ctx.make_current()?;
            // SAFETY: this value owns the module and unloads it once, here;
            // no Function outlives it (each holds an Arc to it).
            unsafe { cu!(cuModuleUnload(self.raw)) }
        };
        if let Err(e) = unload() {
            tracing::error!(error = %e, "unloading a module failed");
        }
    }
}

/// A loaded module.
#[derive(Debug, Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
}

impl Module {
    /// Loads PTX text into `ctx` (`cuModuleLoadData`).
    pub fn load_ptx(ctx: &Arc<Context>, ptx: &str) -> Result<Module> {
        let image = CString::new(ptx)
            .map_err(|_| Error::invalid("Module::load_ptx", "the PTX contains a NUL byte"))?;
        ctx.make_current()?;
        let mut raw: CUmodule = std::ptr::null_mut();
        // SAFETY: `image` is NUL-terminated PTX that outlives the call; writes
        // one module handle through a valid pointer; the context is current.
        unsafe { cu!(cuModuleLoadData(&mut raw, image.as_ptr().cast())) }?;
        Ok(Module {
            inner: Arc::new(ModuleInner {
                raw,
                ctx: Arc::clone(ctx),
            }),
        })
    }

    /// The raw handle (still owned by this value).
    pub fn raw(&self) -> CUmodule {
        self.inner.raw
    }

    /// Looks up the kernel `name`.
    pub fn function(&self, name: &str) -> Result<Function> {
        let cname = CString::new(name)
            .map_err(|_| Error::invalid("Module::function", "the name contains a NUL byte"))?;
        self.inner.ctx.make_current()?;
        let mut raw: CUfunction = std::ptr::null_mut();
        // SAFETY: `cname` is NUL-terminated; the module is live; writes one
        // function handle through a valid pointer.
        unsafe {
            cu!(cuModuleGetFunction(
                &mut raw,
                self.inner.raw,
                cname.as_ptr()
            ))
        }?;
        Ok(Function {
            raw,
            module: Arc::clone(&self.inner),
        })
    }
}

/// A kernel of a loaded module; keeps the module loaded.
#[derive(Debug, Clone)]
pub struct Function {
    raw: CUfunction,
    module: Arc<ModuleInner>,
}

// SAFETY: a CUfunction is a handle the driver lets any thread launch; the
// module it belongs to is kept alive by the Arc.
unsafe impl Send for Function {}
// SAFETY: as for Send; no method mutates the value.
unsafe impl Sync for Function {}

impl Function {
    /// The raw handle (valid while this value lives).
    pub fn raw(&self) -> CUfunction {
        self.raw
    }

    /// The module's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.module.ctx
    }

    /// Launches the kernel (`cuLaunchKernel`).
    ///
    /// # Safety
    /// `params` holds one pointer per kernel parameter, in order, each
    /// pointing to a value of the parameter's type that stays valid for the
    /// call; device pointers among them are valid for what the kernel does
    /// until the work completes; `stream` is a live stream of the module's
    /// context (or null).
    pub unsafe fn launch(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem: u32,
        stream: CUstream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the function is live (the module is held) and of this
        // context; the rest is this function's contract.
        unsafe {
            launch_raw(
                &self.module.ctx,
                self.raw,
                grid,
                block,
                shared_mem,
                stream,
                params,
            )
        }
    }
}

/// Launches a kernel given as a raw `CUfunction` (one the caller loaded
/// itself), with `ctx` made current first.
///
/// # Safety
/// `function` is a live `CUfunction` of `ctx`; `params` holds one pointer
/// per kernel parameter, in order, each pointing to a value of the
/// parameter's type that stays valid for the call; device pointers among them
/// are valid for what the kernel does until the work completes; `stream` is a
/// live stream of `ctx` (or null).
pub unsafe fn launch_raw(
    ctx: &Context,
    function: CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_mem: u32,
    stream: CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    ctx.make_current()?;
    let args = if params.is_empty() {
        std::ptr::null_mut()
    } else {
        params.as_mut_ptr()
    };
    // SAFETY: the function, parameters and stream satisfy this function's
    // contract, and the context is current.
    unsafe {
        cu!(cuLaunchKernel(
            function,
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            shared_mem,
            stream,
            args,
            std::ptr::null_mut(),
        ))
    }
}
