//! Safe RAII types over the CUDA driver API and NCCL, opened at run time
//! through `cuda-sys` and `nccl-sys`.
//!
//! Invariants:
//! - One owning type per raw handle, with a private field; `Drop` releases
//!   the handle once, logs any error through `tracing`, and never panics.
//! - Every driver return code goes through [`cuda_check`], every NCCL return
//!   code through [`nccl_check`]; a missing library or symbol becomes
//!   [`Error::Load`].
//! - Every length, count, root and peer is checked before NCCL sees it.
//! - Every host wait this crate performs on its own has a deadline.
//! - The owning context is made current on the calling thread before every
//!   driver or NCCL call that needs one.

/// Calls a driver function through `cuda_sys::call!` and maps its return code
/// with [`cuda_check`]; evaluates to `Result<()>` after `?` on a load error.
/// Expands to a raw function-pointer call: use it inside `unsafe`.
macro_rules! cu {
    ($name:ident ( $($arg:expr),* $(,)? )) => {
        $crate::error::cuda_check(
            ::cuda_sys::call!($crate::error::cuda_lib()?, $name($($arg),*))?,
            ::std::stringify!($name),
        )
    };
}

/// Calls an NCCL function through `nccl_sys::call!`, evaluating to its raw
/// `ncclResult_t` (a missing library or symbol returns early with
/// [`Error::Load`]). Expands to a raw function-pointer call: use it inside
/// `unsafe`.
macro_rules! nccl_raw {
    ($name:ident ( $($arg:expr),* $(,)? )) => {
        ::nccl_sys::call!($crate::error::nccl_lib()?, $name($($arg),*))?
    };
}

pub mod comm;
#[cfg(feature = "cudarc")]
pub mod cudarc_interop;
pub mod driver;
pub mod error;
pub mod group;
pub mod memory;
pub mod module;
pub mod registration;
pub mod stream;
pub mod view;

pub use comm::{
    ASYNC_ERROR_CALL, AbortHandle, Comm, DROP_DEADLINE, ENQUEUE_DEADLINE, ReduceOp, UniqueId,
    default_config,
};
pub use driver::{
    Context, DeviceInfo, can_access_peer, device_count, device_info, driver_version, init,
};
pub use error::{
    CudaError, Error, NcclCode, NcclError, Result, cuda_check, nccl_async_check, nccl_check,
};
pub use group::{Group, group};
pub use memory::{COPY_DEADLINE, DataType, DeviceBuffer, Element, copy_device_async};
pub use module::{Function, Module, launch_raw};
pub use registration::{RegisteredBuffer, SymmetricBuffer, Window, nccl_version};
pub use stream::{Event, Graph, GraphExec, Stream};
pub use view::{DeviceView, DeviceViewMut, StreamRef};
