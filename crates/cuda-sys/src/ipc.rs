//! The driver's interprocess memory calls (`cuIpcGetMemHandle`,
//! `cuIpcOpenMemHandle_v2`, `cuIpcCloseMemHandle`), declared by hand from
//! `cuda.h` (CUDA 13.0): the generated `bindings.rs` covers a fixed list of
//! functions, and these are resolved beside it, from the same library.
//!
//! Invariants:
//! - The declarations match `cuda.h`: `CUipcMemHandle` is 64 bytes
//!   ([`CU_IPC_HANDLE_SIZE`]) passed by value to `cuIpcOpenMemHandle_v2`
//!   (the symbol the header's `cuIpcOpenMemHandle` names).
//! - [`ipc`] opens the library [`crate::cuda`] opened (the same path, so the
//!   same loaded library) once per process; a symbol the library lacks is
//!   kept as an error and reported by [`crate::call!`] as
//!   [`LoadError::MissingSymbol`].

use std::ffi::{c_char, c_uint};

use crate::{CU_IPC_HANDLE_SIZE, CUdeviceptr, CUresult, LoadError};

/// An interprocess handle of a device allocation (`CUipcMemHandle`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUipcMemHandle {
    /// The driver's opaque bytes.
    pub reserved: [c_char; CU_IPC_HANDLE_SIZE as usize],
}

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: the only flag of
/// `cuIpcOpenMemHandle`, which enables peer access to the exporting device.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

type GetMemHandle = unsafe extern "C" fn(*mut CUipcMemHandle, CUdeviceptr) -> CUresult;
type OpenMemHandle = unsafe extern "C" fn(*mut CUdeviceptr, CUipcMemHandle, c_uint) -> CUresult;
type CloseMemHandle = unsafe extern "C" fn(CUdeviceptr) -> CUresult;

/// The IPC calls of the opened driver (fields named as the C symbols, as
/// in the generated `CudaLib`, for [`crate::call!`]).
#[allow(non_snake_case)]
pub struct IpcLib {
    _library: libloading::Library,
    path: String,
    /// `cuIpcGetMemHandle(CUipcMemHandle* pHandle, CUdeviceptr dptr)`.
    pub cuIpcGetMemHandle: Result<GetMemHandle, libloading::Error>,
    /// `cuIpcOpenMemHandle_v2(CUdeviceptr* pdptr, CUipcMemHandle handle,
    /// unsigned int Flags)`.
    pub cuIpcOpenMemHandle_v2: Result<OpenMemHandle, libloading::Error>,
    /// `cuIpcCloseMemHandle(CUdeviceptr dptr)`.
    pub cuIpcCloseMemHandle: Result<CloseMemHandle, libloading::Error>,
}

impl std::fmt::Debug for IpcLib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcLib").field("path", &self.path).finish()
    }
}

impl IpcLib {
    /// The error for a symbol this library lacks.
    pub fn missing(&self, symbol: &'static str) -> LoadError {
        LoadError::MissingSymbol {
            library: self.path.clone(),
            symbol,
            since: None,
        }
    }

    fn open(path: &str) -> Result<IpcLib, LoadError> {
        // SAFETY: `path` is the library `cuda()` already opened and accepted
        // as the CUDA driver; opening it again returns the same loaded
        // library and runs no new initialisers.
        let library = unsafe { crate::dynload::open_library(path) }
            .map_err(|reason| LoadError::open_failed("CUDA driver", path, reason))?;
        // SAFETY: each symbol, when present, has the signature `cuda.h`
        // declares, which the types above copy.
        let (get, open, close) = unsafe {
            (
                library
                    .get::<GetMemHandle>(b"cuIpcGetMemHandle\0")
                    .map(|s| *s),
                library
                    .get::<OpenMemHandle>(b"cuIpcOpenMemHandle_v2\0")
                    .map(|s| *s),
                library
                    .get::<CloseMemHandle>(b"cuIpcCloseMemHandle\0")
                    .map(|s| *s),
            )
        };
        Ok(IpcLib {
            _library: library,
            path: path.to_owned(),
            cuIpcGetMemHandle: get,
            cuIpcOpenMemHandle_v2: open,
            cuIpcCloseMemHandle: close,
        })
    }
}

/// The driver's IPC calls, from the library [`crate::cuda`] opened.
pub fn ipc() -> Result<&'static IpcLib, LoadError> {
    static IPC: std::sync::OnceLock<Result<IpcLib, LoadError>> = std::sync::OnceLock::new();
    IPC.get_or_init(|| IpcLib::open(crate::cuda()?.path()))
        .as_ref()
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_is_the_size_cuda_h_declares() {
        assert_eq!(std::mem::size_of::<CUipcMemHandle>(), 64);
        assert_eq!(std::mem::align_of::<CUipcMemHandle>(), 1);
    }
}
