//! Loaded PTX modules and their kernels.
//!
//! Invariants:
//! - A module is unloaded exactly once, when the last [`Module`] or
//!   [`Function`] referring to it is dropped; a [`Function`] keeps its module
//!   alive.
//! - Loading makes the module's context current first; so does a launch.
//! - A cluster launch's dimensions ([`Function::launch_cluster`]) are
//!   checked before any driver call: a bad one is
//!   [`Error::InvalidArgument`], a driver without `cuLaunchKernelEx`
//!   [`Error::Load`] (as for a programmatic launch,
//!   [`Function::launch_programmatic`]).

use std::ffi::{CString, c_void};
use std::sync::Arc;

use cuda_sys::{
    CUfunction, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchConfig, CUmodule, CUstream,
};

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

/// The most blocks a cluster of [`Function::launch_cluster`] may have: the
/// portable cluster size of compute capability 9.0 (a larger one needs a
/// function attribute this crate does not set).
pub const MAX_CLUSTER: u32 = 8;

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

    /// Launches the kernel with thread block cluster dimensions `(cluster,
    /// 1, 1)` (`cuLaunchKernelEx` with one attribute,
    /// `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`). `cluster` is 1 to
    /// [`MAX_CLUSTER`] and divides `grid.0`, else the call is
    /// [`Error::InvalidArgument`] before any driver call; a driver without
    /// `cuLaunchKernelEx` (older than CUDA 11.8) gives [`Error::Load`]. A
    /// device that cannot launch clusters (see
    /// [`supports_cluster_launch`](crate::driver::supports_cluster_launch))
    /// refuses it with the driver's error.
    ///
    /// # Safety
    /// As for [`Function::launch`]: `params` holds one pointer per kernel
    /// parameter, in order, each pointing to a value of the parameter's type
    /// that stays valid for the call; device pointers among them are valid
    /// for what the kernel does until the work completes; `stream` is a live
    /// stream of the module's context (or null).
    pub unsafe fn launch_cluster(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        cluster: u32,
        shared_mem: u32,
        stream: CUstream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        check_cluster(grid, cluster)?;
        let mut attr = CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
            ..Default::default()
        };
        attr.value.clusterDim.x = cluster;
        attr.value.clusterDim.y = 1;
        attr.value.clusterDim.z = 1;
        // SAFETY: this function's contract is `launch_ex`'s.
        unsafe { self.launch_ex(grid, block, shared_mem, stream, params, attr) }
    }

    /// Launches the kernel as a programmatic dependent launch's secondary
    /// (`cuLaunchKernelEx` with one attribute,
    /// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` = 1): on
    /// compute capability 9.0 and newer, where the kernel before it in the
    /// stream lets its dependents launch early
    /// (`griddepcontrol.launch_dependents`, else at its end), this kernel
    /// may start before that one has finished, overlapping its launch with
    /// that kernel's tail. The emulator orders it as [`Function::launch`]
    /// does. A driver without `cuLaunchKernelEx` (older than CUDA 11.8)
    /// gives [`Error::Load`].
    ///
    /// # Safety
    /// As for [`Function::launch`], and the kernel waits for the previous
    /// work (`griddepcontrol.wait`, `cudaGridDependencySynchronize`) before
    /// it touches any memory that work reads or writes: the launch orders
    /// nothing before that wait.
    pub unsafe fn launch_programmatic(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem: u32,
        stream: CUstream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let mut attr = CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            ..Default::default()
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        // SAFETY: this function's contract is `launch_ex`'s, and the kernel
        // waits as the attribute needs (this function's contract).
        unsafe { self.launch_ex(grid, block, shared_mem, stream, params, attr) }
    }

    /// `cuLaunchKernelEx` with the one attribute `attr`, the module's
    /// context made current first.
    ///
    /// # Safety
    /// As for [`Function::launch`]; `attr` is one the launch may take.
    unsafe fn launch_ex(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem: u32,
        stream: CUstream,
        params: &mut [*mut c_void],
        mut attr: CUlaunchAttribute,
    ) -> Result<()> {
        self.module.ctx.make_current()?;
        let config = CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: shared_mem,
            hStream: stream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: `config` and its one attribute live across the call; the
        // function is live (the module is held) and of the current context;
        // the parameters and stream satisfy this function's contract.
        unsafe {
            cu!(cuLaunchKernelEx(
                &config,
                self.raw,
                param_array(params),
                std::ptr::null_mut(),
            ))
        }
    }
}

/// Checks a cluster launch's dimensions: `cluster` in 1 to [`MAX_CLUSTER`],
/// a divisor of `grid.0`.
fn check_cluster(grid: (u32, u32, u32), cluster: u32) -> Result<()> {
    const CALL: &str = "Function::launch_cluster";
    if !(1..=MAX_CLUSTER).contains(&cluster) {
        return Err(Error::invalid(
            CALL,
            format!("cluster size {cluster} is not 1 to {MAX_CLUSTER}"),
        ));
    }
    if !grid.0.is_multiple_of(cluster) {
        return Err(Error::invalid(
            CALL,
            format!(
                "grid x dimension {} is not a multiple of the cluster size {cluster}",
                grid.0
            ),
        ));
    }
    Ok(())
}

/// The driver's form of a parameter array: null when there are none.
fn param_array(params: &mut [*mut c_void]) -> *mut *mut c_void {
    if params.is_empty() {
        std::ptr::null_mut()
    } else {
        params.as_mut_ptr()
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
    let args = param_array(params);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(grid: (u32, u32, u32), cluster: u32) -> bool {
        matches!(
            check_cluster(grid, cluster),
            Err(Error::InvalidArgument {
                call: "Function::launch_cluster",
                ..
            })
        )
    }

    #[test]
    fn cluster_sizes_outside_one_to_eight_are_refused() {
        assert!(refused((8, 1, 1), 0));
        assert!(refused((72, 1, 1), 9));
        assert!(refused((64, 1, 1), u32::MAX));
        for c in 1..=MAX_CLUSTER {
            assert!(check_cluster((c * 3, 2, 1), c).is_ok(), "cluster {c}");
        }
    }

    #[test]
    fn a_grid_not_a_multiple_of_the_cluster_is_refused() {
        assert!(refused((6, 1, 1), 4));
        assert!(refused((1, 8, 1), 2));
        assert!(refused((9, 1, 1), 8));
        assert!(check_cluster((7, 1, 1), 1).is_ok());
        assert!(check_cluster((16, 1, 1), 8).is_ok());
    }
}
