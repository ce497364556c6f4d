//! NCCL's result texts and last errors: the process's last error, each
//! thread's, and the entry guard every exported call runs under.
//!
//! Invariants: every error text is interned once and lives for the
//! process, so `ncclGetLastError` hands out static C strings; each error
//! takes a place in one process-wide order, so the newer of a
//! communicator's and a thread's last error can be told; no panic crosses
//! the C boundary (`entry`). `ncclGetLastError`, which needs the
//! communicator table, is answered by `lifecycle` through
//! [`newest_error`]. The interned texts' lock and the last error's are
//! leaves: one is never held while the other, or anything else, is taken
//! (they may be taken while a communicator's state is held).

use std::collections::BTreeMap;
use std::ffi::{CStr, c_char};
use std::sync::atomic::{AtomicU64, Ordering};

use nccl_sys::ncclResult_t;
use parking_lot::Mutex;

use super::{CALLS, R};
use crate::put;

pub(super) static INTERNED: Mutex<BTreeMap<String, &'static CStr>> = Mutex::new(BTreeMap::new());
pub(super) static LAST: Mutex<&'static CStr> = Mutex::new(c"");
pub(super) static ERR_SEQ: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The calling thread's last error, with its place in the error order.
    static THREAD_LAST: std::cell::Cell<Option<(u64, &'static CStr)>> =
        const { std::cell::Cell::new(None) };
}

/// The newer of `own` (a communicator's last error) and the calling
/// thread's last error, else the process's.
pub(super) fn newest_error(own: Option<(u64, &'static CStr)>) -> &'static CStr {
    let mine = THREAD_LAST.with(std::cell::Cell::get);
    let newest = match (own, mine) {
        (Some(a), Some(b)) => Some(if a.0 > b.0 { a } else { b }),
        (a, b) => a.or(b),
    };
    newest.map_or_else(|| *LAST.lock(), |(_, m)| m)
}

/// Records `m` as the process's and the calling thread's last error;
/// returns it with its sequence number.
pub(super) fn record(m: &'static CStr) -> (u64, &'static CStr) {
    let e = (ERR_SEQ.fetch_add(1, Ordering::Relaxed), m);
    *LAST.lock() = m;
    THREAD_LAST.with(|t| t.set(Some(e)));
    e
}

/// A static C string with the text of `s` (each distinct text is kept once).
pub(super) fn intern(s: &str) -> &'static CStr {
    let mut m = INTERNED.lock();
    if let Some(c) = m.get(s) {
        return c;
    }
    let bytes: Vec<u8> = s.bytes().filter(|b| *b != 0).collect();
    let c: &'static CStr = match std::ffi::CString::new(bytes) {
        Ok(c) => Box::leak(c.into_boxed_c_str()),
        Err(_) => c"",
    };
    m.insert(s.to_owned(), c);
    c
}

/// Records `msg` as the last error and returns `code`.
pub(super) fn err(code: ncclResult_t, msg: impl AsRef<str>) -> ncclResult_t {
    let m = format!("emulated NCCL: {}", msg.as_ref());
    record(intern(&m));
    code
}

pub(super) fn fail<T>(code: ncclResult_t, msg: impl AsRef<str>) -> R<T> {
    Err(err(code, msg))
}

pub(super) fn unimplemented(name: &str) -> ncclResult_t {
    err(
        ncclResult_t::ncclInvalidUsage,
        format!("{name} is not implemented by the emulator"),
    )
}

pub(super) fn entry(f: impl FnOnce() -> R<ncclResult_t>) -> ncclResult_t {
    CALLS.fetch_add(1, Ordering::Relaxed);
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(c) | Err(c)) => c,
        Err(_) => err(ncclResult_t::ncclInternalError, "internal panic"),
    }
}

/// Writes an out-parameter or fails with `ncclInvalidArgument`.
///
/// # Safety
/// `p` is null or valid for a write.
pub(super) unsafe fn out<T>(p: *mut T, v: T, what: &str) -> R<()> {
    // SAFETY: `p` is null or valid (this function's contract).
    if unsafe { put(p, v) } {
        Ok(())
    } else {
        fail(ncclResult_t::ncclInvalidArgument, format!("{what} is NULL"))
    }
}

/// `ncclGetErrorString`: NCCL's static texts.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
    CALLS.fetch_add(1, Ordering::Relaxed);
    let s: &'static CStr = match result.0 {
        0 => c"no error",
        1 => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        2 => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3 => c"internal error - please report this issue to the NCCL developers",
        4 => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        5 => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        _ => c"unknown result code",
    };
    s.as_ptr()
}
