//! Safe RAII types over the CUDA driver API and NCCL, opened at run time
//! through `cuda-sys` and `nccl-sys`.
//!
//! A one-rank communicator on device 0: a buffer, an all-reduce on a stream,
//! and the result back on the host (this runs under `cargo test` on the CPU
//! emulator, and on any GPU):
//!
//! ```
//! # if let Ok(p) = std::env::var("METRALE_DOCTEST_EMULATOR") {
//! #     if std::path::Path::new(&p).exists() && std::env::var_os("METRALE_CUDA_LIBRARY").is_none() {
//! #         // SAFETY: set before any thread starts or a library is opened.
//! #         unsafe { std::env::set_var("METRALE_CUDA_LIBRARY", &p); std::env::set_var("METRALE_NCCL_LIBRARY", &p) };
//! #     }
//! # }
//! # fn main() -> Result<(), nccl_safe::Error> {
//! # if nccl_safe::device_count().is_err() { eprintln!("skipped: no CUDA driver"); return Ok(()); }
//! use nccl_safe::{Comm, Context, DeviceBuffer, ReduceOp, Stream, UniqueId};
//!
//! let ctx = Context::new(0)?;
//! let stream = Stream::new(&ctx)?;
//! let id = UniqueId::new()?; // rank 0 makes it; every rank gets the same bytes
//! let comm = Comm::init_rank(&ctx, &id, 1, 0)?;
//! let mut x = DeviceBuffer::from_host(&ctx, &[1.0f32, 2.0, 3.0])?;
//! comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &stream)?;
//! stream.synchronize()?;
//! assert_eq!(x.to_host_vec()?, [1.0, 2.0, 3.0]); // a sum over one rank
//! # Ok(()) }
//! ```
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
pub mod peer;
pub mod registration;
pub mod stream;
pub mod view;

pub use comm::{
    ASYNC_ERROR_CALL, AbortHandle, Comm, DROP_DEADLINE, ENQUEUE_DEADLINE, ReduceOp, UniqueId,
    default_config,
};
pub use driver::{
    Context, DeviceInfo, can_access_peer, device_count, device_info, driver_version, init,
    pci_bus_id, supports_cluster_launch,
};
pub use error::{
    CudaError, Error, NcclCode, NcclError, Result, cuda_check, nccl_async_check, nccl_check,
};
pub use group::{Group, group};
pub use memory::{COPY_DEADLINE, DataType, DeviceBuffer, Element, copy_device_async};
pub use module::{Function, MAX_CLUSTER, Module, launch_raw};
pub use peer::{
    HostWords, IpcHandle, IpcMapping, enable_peer_access, fill_words, ipc_handle,
    unified_addressing,
};
pub use registration::{RegisteredBuffer, SymmetricBuffer, Window, nccl_version};
pub use stream::{Event, Graph, GraphExec, Stream};
pub use view::{DeviceView, DeviceViewMut, StreamRef};
