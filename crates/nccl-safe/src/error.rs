//! Typed errors and the one return-code mapping helper per library.
//!
//! Invariants:
//! - [`cuda_check`] is the only place a `CUresult` becomes an error; it keeps
//!   the raw code and adds the driver's name and message for it.
//! - [`nccl_check`] is the only place an `ncclResult_t` becomes an error; it
//!   keeps the raw code and adds NCCL's last-error text.
//! - Neither panics, even when the library cannot describe the code.

use std::ffi::{CStr, c_char};
use std::time::Duration;

use cuda_sys::{CUresult, Cuda};
use nccl_sys::{Nccl, ncclComm_t, ncclResult_t};

/// This crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in this crate.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The driver or NCCL library, or one of its symbols, is unavailable.
    #[error(transparent)]
    Load(#[from] cuda_sys::LoadError),
    /// A CUDA driver call failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// An NCCL call failed.
    #[error(transparent)]
    Nccl(#[from] NcclError),
    /// The communicator's asynchronous error (`ncclCommGetAsyncError`
    /// reported a failure, also when seen while a call waited for NCCL's
    /// background enqueue): work already enqueued failed, not a call's own
    /// arguments.
    #[error("asynchronous NCCL error: {0}")]
    Async(NcclError),
    /// An argument was refused before any library saw it.
    #[error("{call}: invalid argument: {reason}")]
    InvalidArgument {
        /// The operation that refused it.
        call: &'static str,
        /// Why.
        reason: String,
    },
    /// A host wait reached its deadline.
    #[error("{what} did not complete within {after:?}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long it was waited for.
        after: Duration,
    },
    /// The communicator was aborted; nothing was called.
    #[error("{call}: the communicator was aborted")]
    Aborted {
        /// The operation that was refused.
        call: &'static str,
    },
}

/// A failed CUDA driver call.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{call} failed: {name} ({code}): {message}")]
pub struct CudaError {
    /// The driver function.
    pub call: &'static str,
    /// The raw `CUresult`.
    pub code: i32,
    /// The code's name (`CUDA_ERROR_OUT_OF_MEMORY`).
    pub name: String,
    /// The driver's description of the code.
    pub message: String,
}

/// A failed NCCL call.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{call} failed: {code:?} ({raw}): {last_error}")]
pub struct NcclError {
    /// The NCCL function.
    pub call: &'static str,
    /// The result code, classified.
    pub code: NcclCode,
    /// The raw `ncclResult_t`.
    pub raw: i32,
    /// NCCL's last-error text (or its description of the code).
    pub last_error: String,
}

/// NCCL's failure codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NcclCode {
    /// A CUDA call made by NCCL failed.
    UnhandledCudaError,
    /// A system call failed.
    SystemError,
    /// An NCCL internal check failed.
    InternalError,
    /// An argument was invalid.
    InvalidArgument,
    /// NCCL was used incorrectly.
    InvalidUsage,
    /// A remote peer failed or disconnected.
    RemoteError,
    /// The operation is still in progress (non-blocking communicators).
    InProgress,
    /// A code this crate does not know.
    Unknown(i32),
}

impl NcclCode {
    /// Classifies a raw failure code (`ncclSuccess` is `Unknown(0)`).
    pub fn from_raw(raw: i32) -> NcclCode {
        match raw {
            1 => NcclCode::UnhandledCudaError,
            2 => NcclCode::SystemError,
            3 => NcclCode::InternalError,
            4 => NcclCode::InvalidArgument,
            5 => NcclCode::InvalidUsage,
            6 => NcclCode::RemoteError,
            7 => NcclCode::InProgress,
            other => NcclCode::Unknown(other),
        }
    }
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(call: &'static str, reason: impl Into<String>) -> Error {
        Error::InvalidArgument {
            call,
            reason: reason.into(),
        }
    }

    /// True when this is an NCCL failure (of a call, or asynchronous) with
    /// the given code.
    pub fn is_nccl(&self, code: NcclCode) -> bool {
        matches!(self, Error::Nccl(e) | Error::Async(e) if e.code == code)
    }

    /// True when this is the communicator's asynchronous error (reported by
    /// `ncclCommGetAsyncError`, also when seen while a call waited for NCCL's
    /// background enqueue), rather than an error of a call itself.
    pub fn is_async(&self) -> bool {
        matches!(self, Error::Async(_))
    }
}

/// The process's CUDA driver, as this crate's error type.
pub(crate) fn cuda_lib() -> Result<&'static Cuda> {
    Ok(cuda_sys::cuda()?)
}

/// The process's NCCL, as this crate's error type.
pub(crate) fn nccl_lib() -> Result<&'static Nccl> {
    Ok(nccl_sys::nccl()?)
}

/// Copies a C string the library owns; `None` for null.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid for the
/// duration of the call.
pub(crate) unsafe fn c_string(p: *const c_char) -> Option<String> {
    if p.is_null() {
        None
    } else {
        // SAFETY: non-null and NUL-terminated (this function's contract).
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}

/// A fallback name for common driver codes, used when the driver cannot
/// name the code itself.
fn fallback_cuda_name(code: i32) -> String {
    let name = match code {
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        218 => "CUDA_ERROR_INVALID_PTX",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        900 => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return format!("CUresult({code})"),
    };
    name.to_owned()
}

/// Builds the error for a failed driver call, asking the driver (when it is
/// open) for the code's name and message.
pub(crate) fn cuda_error(rc: CUresult, call: &'static str) -> CudaError {
    let code = rc.0 as i32;
    let mut name = None;
    let mut message = None;
    if let Ok(lib) = cuda_sys::cuda() {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes one pointer through a valid out pointer.
        if let Ok(r) = unsafe { cuda_sys::call!(lib, cuGetErrorName(rc, &mut p)) }
            && r == CUresult::CUDA_SUCCESS
        {
            // SAFETY: on success the driver points `p` at a static string.
            name = unsafe { c_string(p) };
        }
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorString writes one pointer through a valid out pointer.
        if let Ok(r) = unsafe { cuda_sys::call!(lib, cuGetErrorString(rc, &mut p)) }
            && r == CUresult::CUDA_SUCCESS
        {
            // SAFETY: on success the driver points `p` at a static string.
            message = unsafe { c_string(p) };
        }
    }
    CudaError {
        call,
        code,
        name: name.unwrap_or_else(|| fallback_cuda_name(code)),
        message: message.unwrap_or_else(|| "no description from the driver".to_owned()),
    }
}

/// Maps a driver return code: `Ok(())` for `CUDA_SUCCESS`, else
/// [`Error::Cuda`] with the code's name and message from
/// `cuGetErrorName`/`cuGetErrorString`.
pub fn cuda_check(rc: CUresult, call: &'static str) -> Result<()> {
    if rc == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(cuda_error(rc, call)))
    }
}

/// NCCL's text for the last error (`ncclGetLastError`), else its description
/// of `rc` (`ncclGetErrorString`), else an empty string.
pub(crate) fn nccl_error_text(rc: ncclResult_t, comm: ncclComm_t) -> String {
    let Ok(lib) = nccl_sys::nccl() else {
        return String::new();
    };
    // SAFETY: ncclGetLastError accepts a null or live communicator (the
    // caller passes one of those) and returns a NUL-terminated string or null.
    if let Ok(p) = unsafe { nccl_sys::call!(lib, ncclGetLastError(comm)) } {
        // SAFETY: NCCL returns null or a NUL-terminated string it owns.
        if let Some(s) = unsafe { c_string(p) }.filter(|s| !s.is_empty()) {
            return s;
        }
    }
    // SAFETY: ncclGetErrorString takes any code and returns a static string.
    if let Ok(p) = unsafe { nccl_sys::call!(lib, ncclGetErrorString(rc)) } {
        // SAFETY: NCCL returns null or a static NUL-terminated string.
        if let Some(s) = unsafe { c_string(p) } {
            return s;
        }
    }
    String::new()
}

/// Builds an [`NcclError`] from its parts (no library call).
pub(crate) fn nccl_error(rc: ncclResult_t, call: &'static str, last_error: String) -> NcclError {
    let raw = rc.0 as i32;
    NcclError {
        call,
        code: NcclCode::from_raw(raw),
        raw,
        last_error,
    }
}

/// Maps an NCCL return code: `Ok(())` for `ncclSuccess`, else
/// [`Error::Nccl`] with NCCL's last-error text for `comm` (which may be null).
///
/// `ncclInProgress` is an error here ([`NcclCode::InProgress`]); callers that
/// accept it on non-blocking communicators test for it first.
pub fn nccl_check(rc: ncclResult_t, call: &'static str, comm: ncclComm_t) -> Result<()> {
    if rc == ncclResult_t::ncclSuccess {
        Ok(())
    } else {
        Err(Error::Nccl(nccl_error(rc, call, nccl_error_text(rc, comm))))
    }
}

/// Maps the result `ncclCommGetAsyncError` reported for `comm` (a live
/// communicator, or null) to [`Error::Async`]; `ncclSuccess` is `Ok`.
pub fn nccl_async_check(result: ncclResult_t, comm: ncclComm_t) -> Result<()> {
    match nccl_check(result, crate::comm::ASYNC_ERROR_CALL, comm) {
        Err(Error::Nccl(e)) => Err(Error::Async(e)),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_error_text_names_call_code_and_message() {
        let e = Error::Cuda(CudaError {
            call: "cuMemAlloc_v2",
            code: 2,
            name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
            message: "out of memory".into(),
        });
        assert_eq!(
            e.to_string(),
            "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"
        );
    }

    #[test]
    fn nccl_error_text_names_call_code_and_last_error() {
        let e = Error::Nccl(nccl_error(
            ncclResult_t::ncclRemoteError,
            "ncclAllReduce",
            "peer 3 went away".into(),
        ));
        assert_eq!(
            e.to_string(),
            "ncclAllReduce failed: RemoteError (6): peer 3 went away"
        );
        assert!(e.is_nccl(NcclCode::RemoteError));
        assert!(!e.is_nccl(NcclCode::InProgress));
    }

    #[test]
    fn nccl_codes_classify_every_raw_value() {
        let expected = [
            (1, NcclCode::UnhandledCudaError),
            (2, NcclCode::SystemError),
            (3, NcclCode::InternalError),
            (4, NcclCode::InvalidArgument),
            (5, NcclCode::InvalidUsage),
            (6, NcclCode::RemoteError),
            (7, NcclCode::InProgress),
            (42, NcclCode::Unknown(42)),
        ];
        for (raw, code) in expected {
            assert_eq!(NcclCode::from_raw(raw), code);
        }
    }

    #[test]
    fn success_codes_are_ok() {
        assert!(cuda_check(CUresult::CUDA_SUCCESS, "cuInit").is_ok());
        assert!(
            nccl_check(
                ncclResult_t::ncclSuccess,
                "ncclGroupEnd",
                std::ptr::null_mut()
            )
            .is_ok()
        );
    }

    #[test]
    fn other_errors_format() {
        let e = Error::invalid("all_reduce", "lengths differ");
        assert_eq!(
            e.to_string(),
            "all_reduce: invalid argument: lengths differ"
        );
        let e = Error::Timeout {
            what: "stream",
            after: Duration::from_millis(5),
        };
        assert_eq!(e.to_string(), "stream did not complete within 5ms");
        let e = Error::Aborted { call: "ncclSend" };
        assert_eq!(e.to_string(), "ncclSend: the communicator was aborted");
        assert_eq!(fallback_cuda_name(600), "CUDA_ERROR_NOT_READY");
        assert_eq!(fallback_cuda_name(12345), "CUresult(12345)");
    }
}
