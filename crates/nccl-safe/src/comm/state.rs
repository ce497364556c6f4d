//! The state a [`Comm`] shares with its [`AbortHandle`]s: the raw handle and
//! its status under one small lock.
//!
//! Invariant: the raw handle is used only under the lock while the status is
//! live; abort and destroy take the lock, so an abort never touches a
//! destroyed communicator.
//!
//! Lock order: none nested. A communicator's state lock is a leaf: held
//! across the NCCL call it guards (abort, the asynchronous-error query, the
//! last-error text) and making the context current, never across another
//! lock, and no two communicators' state locks are held at once. The
//! hand-off of a blocking join (`Pending`, `Comm::into_blocking`) has a
//! lock of its own, a leaf too: it is set or swapped under it, and the
//! abort it leads to is made after it is released. A caller may hold its
//! own locks around any of these (the backend's slot or abort lock).

use std::sync::Arc;
use std::time::Duration;

use nccl_sys::{ncclComm_t, ncclResult_t};
use parking_lot::Mutex;

use crate::driver::Context;
use crate::error::{Error, Result, nccl_async_check, nccl_check};
use crate::stream::poll_until;

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Status {
    Live,
    Aborted,
    Destroyed,
}

/// The raw handle and its status, shared by a [`Comm`] and its abort
/// handles.
pub(super) struct CommState {
    pub(super) raw: ncclComm_t,
    pub(super) status: Status,
}

// SAFETY: the handle is only used under the state's lock or by the owning
// Comm, and NCCL allows ncclCommAbort / ncclCommGetAsyncError from any thread.
unsafe impl Send for CommState {}

pub(super) type Shared = Arc<Mutex<CommState>>;

/// Aborts the communicator if it is live; nothing otherwise.
pub(super) fn abort_shared(state: &Mutex<CommState>, ctx: &Context) -> Result<()> {
    let mut st = state.lock();
    if st.status != Status::Live {
        return Ok(());
    }
    st.status = Status::Aborted;
    let raw = st.raw;
    if let Err(e) = ctx.make_current() {
        tracing::warn!(error = %e, "making the context current before abort failed");
    }
    // SAFETY: the status was Live under the lock, so `raw` is a live
    // communicator; NCCL allows abort during an operation on another thread.
    let rc = unsafe { nccl_raw!(ncclCommAbort(raw)) };
    if rc == ncclResult_t::ncclInProgress {
        return Ok(());
    }
    nccl_check(rc, "ncclCommAbort", std::ptr::null_mut())
}

/// One poll of `ncclCommGetAsyncError` under the lock; `Aborted` when the
/// communicator is no longer live.
pub(super) fn async_state(state: &Mutex<CommState>, call: &'static str) -> Result<ncclResult_t> {
    let st = state.lock();
    if st.status != Status::Live {
        return Err(Error::Aborted { call });
    }
    let mut result = ncclResult_t::ncclSuccess;
    // SAFETY: live under the lock; writes one result through a valid pointer.
    let rc = unsafe { nccl_raw!(ncclCommGetAsyncError(st.raw, &mut result)) };
    nccl_check(rc, "ncclCommGetAsyncError", st.raw)?;
    Ok(result)
}

/// Polls until the communicator is no longer `ncclInProgress`: `Ok` on
/// success, the NCCL error, `Aborted`, or `Timeout { what }` at the deadline.
pub(super) fn wait_shared(
    state: &Mutex<CommState>,
    what: &'static str,
    call: &'static str,
    timeout: Duration,
) -> Result<()> {
    poll_until(what, timeout, || {
        let r = async_state(state, call)?;
        if r == ncclResult_t::ncclSuccess {
            Ok(true)
        } else if r == ncclResult_t::ncclInProgress {
            Ok(false)
        } else {
            // The communicator's asynchronous error, seen while waiting: it
            // is reported as such (`Error::is_async`), not as `call`'s own.
            // NCCL's error text is read under the lock, from the
            // communicator only while it is live.
            let st = state.lock();
            let raw = if st.status == Status::Live {
                st.raw
            } else {
                std::ptr::null_mut()
            };
            nccl_async_check(r, raw).map(|()| true)
        }
    })
}

/// Where `Comm::into_blocking`'s helper thread stands, shared with the
/// caller waiting for it.
pub(super) enum Pending {
    /// `ncclCommInitRank` has not returned yet.
    Waiting,
    /// The blocking communicator exists; this aborts it.
    Joined(AbortHandle),
    /// The caller's deadline passed.
    GaveUp,
}

/// Aborts a [`Comm`] from any thread.
#[derive(Clone)]
pub struct AbortHandle {
    pub(super) state: Shared,
    pub(super) ctx: Arc<Context>,
}

impl fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AbortHandle")
            .field("status", &self.state.lock().status)
            .finish()
    }
}

impl AbortHandle {
    /// Aborts the communicator (`ncclCommAbort`); idempotent, and a no-op
    /// once the communicator was dropped.
    pub fn abort(&self) -> Result<()> {
        abort_shared(&self.state, &self.ctx)
    }

    /// True once the communicator was aborted.
    pub fn is_aborted(&self) -> bool {
        self.state.lock().status == Status::Aborted
    }

    /// The communicator's asynchronous error, as [`Comm::async_error`]
    /// answers it, from any thread (NCCL allows `ncclCommGetAsyncError`
    /// concurrently with calls on the communicator): `Ok` for success and
    /// in-progress, the NCCL error otherwise, and [`Error::Aborted`] once the
    /// communicator was aborted or dropped.
    pub fn async_error(&self) -> Result<()> {
        let st = self.state.lock();
        if st.status != Status::Live {
            return Err(Error::Aborted {
                call: ASYNC_ERROR_CALL,
            });
        }
        let mut result = ncclResult_t::ncclSuccess;
        // SAFETY: live under the lock, which is held until NCCL's error text
        // is read below; writes one result through a valid pointer.
        let rc = unsafe { nccl_raw!(ncclCommGetAsyncError(st.raw, &mut result)) };
        nccl_check(rc, "ncclCommGetAsyncError", st.raw)?;
        if result == ncclResult_t::ncclInProgress {
            return Ok(());
        }
        nccl_async_check(result, st.raw)
    }
}
