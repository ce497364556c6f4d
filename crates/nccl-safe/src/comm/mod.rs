//! NCCL communicators: unique ids, initialisation, abort, and collectives.
//!
//! Layout: `id` (the unique id), `types` (the config and reduction
//! operators), `state` (the shared handle state, abort and the asynchronous
//! error), `init` (init, split, the blocking join), `raw` (collectives on raw
//! addresses and the enqueue protocol), `typed` (collectives on
//! [`DeviceBuffer`]s); this file holds the [`Comm`] type, its accessors and
//! its teardown.
//!
//! Invariants:
//! - A [`Comm`] and its [`AbortHandle`]s share one small lock over the raw
//!   handle and its status (live, aborted, destroyed). Abort and destroy take
//!   the lock, so an abort never touches a destroyed communicator; after an
//!   abort every call is refused with [`Error::Aborted`] without calling NCCL,
//!   and drop neither finalizes nor destroys.
//! - Collectives check lengths, counts, roots, peers, contexts and the status
//!   before NCCL sees them, and do not hold the lock while inside NCCL (NCCL
//!   allows `ncclCommAbort` from another thread during an operation).
//! - On a non-blocking communicator, `ncclInProgress` from a call means
//!   "being enqueued": the call polls `ncclCommGetAsyncError` (with a
//!   deadline) until it is no longer in progress, and every call first waits
//!   for earlier pending work the same way.
//! - Every host wait has a deadline; drop finalizes within
//!   [`DROP_DEADLINE`] or aborts instead, logging errors and never panicking.

use std::fmt;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cuda_sys::LoadError;
use nccl_sys::{Nccl, ncclComm_t, ncclResult_t};

use crate::driver::Context;
use crate::error::{Error, Result, nccl_async_check, nccl_check, nccl_lib};
use crate::memory::{DeviceBuffer, Element};
use crate::stream::Stream;

/// How long a call on a non-blocking communicator waits for NCCL to finish
/// enqueueing earlier work (`ncclInProgress`) before giving up.
pub const ENQUEUE_DEADLINE: Duration = Duration::from_secs(30);

/// The call named by errors that are the communicator's asynchronous error
/// (see [`Error::is_async`]).
pub const ASYNC_ERROR_CALL: &str = "ncclCommGetAsyncError";

/// How long dropping a communicator waits for `ncclCommFinalize` before it
/// aborts the communicator instead.
pub const DROP_DEADLINE: Duration = Duration::from_secs(10);

/// How long a non-blocking split waits for the new communicator.
const SPLIT_DEADLINE: Duration = Duration::from_secs(60);

/// NCCL's `NCCL_CONFIG_UNDEF_INT`.
const UNDEF_INT: i32 = i32::MIN;

mod id;
mod init;
mod raw;
mod state;
#[cfg(test)]
mod tests;
mod typed;
mod types;

pub use id::UniqueId;
pub use state::AbortHandle;
pub use types::{ReduceOp, default_config};

use state::{CommState, Pending, Shared, Status, abort_shared, async_state, wait_shared};

/// An NCCL communicator: one rank's membership in a group of ranks.
///
/// `Send` but not `Sync`: NCCL forbids concurrent calls on one communicator.
/// Use [`Comm::abort_handle`] to abort from another thread.
pub struct Comm {
    state: Shared,
    raw: ncclComm_t,
    ctx: Arc<Context>,
    rank: usize,
    count: usize,
    device: usize,
    nonblocking: bool,
    /// How long a call waits for NCCL to finish enqueueing on a non-blocking
    /// communicator; `None`: until done or aborted.
    enqueue_deadline: Option<Duration>,
}

// SAFETY: a communicator may be used from any thread, one at a time; the raw
// pointer field keeps Comm !Sync, so one thread at a time is what it gets.
unsafe impl Send for Comm {}

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Comm")
            .field("rank", &self.rank)
            .field("count", &self.count)
            .field("device", &self.device)
            .field("nonblocking", &self.nonblocking)
            .field("status", &self.state.lock().status)
            .finish()
    }
}

impl Comm {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The device ordinal this rank uses.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The context of this rank's device.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw handle (owned by this value; invalid after an abort).
    pub fn raw(&self) -> ncclComm_t {
        self.raw
    }

    /// True for a non-blocking communicator ([`Comm::init_rank_with_deadline`]).
    pub fn is_nonblocking(&self) -> bool {
        self.nonblocking
    }

    /// The communicator's asynchronous error (`ncclCommGetAsyncError`):
    /// `Ok` for success and in-progress, the NCCL error otherwise, and
    /// [`Error::Aborted`] after an abort.
    pub fn async_error(&self) -> Result<()> {
        let r = async_state(&self.state, ASYNC_ERROR_CALL)?;
        if r == ncclResult_t::ncclInProgress {
            return Ok(());
        }
        nccl_async_check(r, self.raw)
    }

    /// NCCL's last error text (`ncclGetLastError`).
    pub fn last_error(&self) -> String {
        let st = self.state.lock();
        if st.status != Status::Live {
            return "the communicator was aborted".to_owned();
        }
        let Ok(lib) = nccl_lib() else {
            return String::new();
        };
        // SAFETY: the communicator is live under the lock.
        match unsafe { nccl_sys::call!(lib, ncclGetLastError(st.raw)) } {
            // SAFETY: NCCL returns null or a NUL-terminated string it owns.
            Ok(p) => unsafe { crate::error::c_string(p) }.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// Aborts the communicator (`ncclCommAbort`); idempotent.
    pub fn abort(&self) -> Result<()> {
        abort_shared(&self.state, &self.ctx)
    }

    /// A handle that can abort this communicator from any thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            state: Arc::clone(&self.state),
            ctx: Arc::clone(&self.ctx),
        }
    }

    /// True once the communicator was aborted.
    pub fn is_aborted(&self) -> bool {
        self.state.lock().status == Status::Aborted
    }

    /// Sets how long a call on a non-blocking communicator waits for NCCL to
    /// finish enqueueing (its own work, or earlier work); `None` waits until
    /// the enqueue is done or the communicator is aborted (through an
    /// [`AbortHandle`] from another thread). The default is
    /// [`ENQUEUE_DEADLINE`].
    ///
    /// NCCL connects peers lazily, at their first operation, so on a
    /// non-blocking communicator the first operation with a peer stays
    /// in progress until that peer issues its side.
    pub fn set_enqueue_deadline(&mut self, deadline: Option<Duration>) {
        self.enqueue_deadline = deadline;
    }

    /// The current enqueue deadline (see [`Comm::set_enqueue_deadline`]).
    pub fn enqueue_deadline(&self) -> Option<Duration> {
        self.enqueue_deadline
    }

    fn enqueue_timeout(&self) -> Duration {
        self.enqueue_deadline.unwrap_or(Duration::MAX)
    }

    /// Waits until NCCL has enqueued every call made so far on this
    /// communicator onto its streams, and reports a pending asynchronous
    /// error. On a non-blocking communicator, `ncclGroupEnd` (from [`Group`]
    /// or [`crate::group`]) may return before the group's work reaches the
    /// stream: call this before relying on stream order (a kernel launched
    /// after a grouped send/recv, an event recorded to detect completion).
    /// A no-op on a blocking communicator, except that it refuses after an
    /// abort.
    ///
    /// [`Group`]: crate::Group
    pub fn wait_ready(&self) -> Result<()> {
        self.ready("wait_ready")
    }

    /// Refuses the call after an abort; on a non-blocking communicator,
    /// first waits for earlier pending work (and reports its error).
    pub(crate) fn ready(&self, call: &'static str) -> Result<()> {
        if self.nonblocking {
            wait_shared(&self.state, "nccl enqueue", call, self.enqueue_timeout())
        } else if self.state.lock().status != Status::Live {
            Err(Error::Aborted { call })
        } else {
            Ok(())
        }
    }

    /// Maps a call's return code; `ncclInProgress` on a non-blocking
    /// communicator waits until the work is enqueued.
    pub(crate) fn settle(&self, rc: ncclResult_t, call: &'static str) -> Result<()> {
        if rc == ncclResult_t::ncclInProgress && self.nonblocking {
            wait_shared(&self.state, "nccl enqueue", call, self.enqueue_timeout())
        } else {
            nccl_check(rc, call, self.raw)
        }
    }

    /// Checks the status, makes the context current, makes the call (without
    /// holding the lock) and maps its result.
    pub(crate) fn enqueue(
        &self,
        call: &'static str,
        f: impl FnOnce(&'static Nccl, ncclComm_t) -> std::result::Result<ncclResult_t, LoadError>,
    ) -> Result<()> {
        self.ready(call)?;
        self.ctx.make_current()?;
        let rc = f(nccl_lib()?, self.raw)?;
        self.settle(rc, call)
    }

    fn check_index(&self, call: &'static str, what: &str, i: usize) -> Result<i32> {
        if i >= self.count {
            return Err(Error::invalid(
                call,
                format!("{what} {i} is not below the rank count {}", self.count),
            ));
        }
        Ok(i as i32)
    }

    fn check_ptr(call: &'static str, what: &str, ptr: u64, count: usize) -> Result<()> {
        if ptr == 0 && count > 0 {
            return Err(Error::invalid(
                call,
                format!("{what} is null with count {count}"),
            ));
        }
        Ok(())
    }

    pub(crate) fn check_ctx(&self, call: &'static str, what: &str, ctx: &Context) -> Result<()> {
        if ctx.raw() != self.ctx.raw() {
            return Err(Error::invalid(
                call,
                format!(
                    "{what} belongs to device {}, the communicator to device {}",
                    ctx.ordinal(),
                    self.ctx.ordinal()
                ),
            ));
        }
        Ok(())
    }

    fn check_aborted(&self, call: &'static str) -> Result<()> {
        if self.is_aborted() {
            return Err(Error::Aborted { call });
        }
        Ok(())
    }

    fn check_typed<T: Element>(
        &self,
        call: &'static str,
        bufs: &[&DeviceBuffer<T>],
        stream: &Stream,
    ) -> Result<()> {
        self.check_aborted(call)?;
        for b in bufs {
            self.check_ctx(call, "a buffer", b.context())?;
        }
        self.check_ctx(call, "the stream", stream.context())
    }

    fn len_mismatch(call: &'static str, detail: String) -> Error {
        Error::invalid(call, detail)
    }

    fn check_same_len(call: &'static str, send: usize, recv: usize) -> Result<()> {
        if send != recv {
            return Err(Self::len_mismatch(
                call,
                format!("send has {send} elements, recv {recv}"),
            ));
        }
        Ok(())
    }
}

impl Comm {
    /// Finalizes then destroys a live communicator; aborts it instead when
    /// finalize fails or misses [`DROP_DEADLINE`].
    fn finalize_and_destroy(&self) -> Result<()> {
        const CALL: &str = "ncclCommFinalize";
        if let Err(e) = self.ctx.make_current() {
            tracing::warn!(error = %e, "making the context current before finalize failed");
        }
        let finalized = if self.nonblocking {
            wait_shared(&self.state, "communicator finalize", CALL, DROP_DEADLINE).and_then(|()| {
                // SAFETY: the communicator is live (just checked under the
                // lock) and owned by this value; an abort from another thread
                // during the call is allowed by NCCL.
                let rc = unsafe { nccl_raw!(ncclCommFinalize(self.raw)) };
                if rc == ncclResult_t::ncclInProgress {
                    wait_shared(&self.state, "communicator finalize", CALL, DROP_DEADLINE)
                } else {
                    nccl_check(rc, CALL, self.raw)
                }
            })
        } else {
            // A blocking finalize cannot be interrupted except by an abort
            // from another thread: a watchdog thread aborts at the deadline.
            let (done, wait) = mpsc::channel::<()>();
            let state = Arc::clone(&self.state);
            let ctx = Arc::clone(&self.ctx);
            let watchdog = std::thread::Builder::new()
                .name("nccl-finalize-watchdog".into())
                .spawn(move || {
                    if let Err(mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(DROP_DEADLINE) {
                        tracing::warn!("ncclCommFinalize missed its deadline; aborting");
                        if let Err(e) = abort_shared(&state, &ctx) {
                            tracing::warn!(error = %e, "abort after a finalize timeout failed");
                        }
                    }
                });
            if watchdog.is_err() {
                tracing::warn!("no finalize watchdog thread; finalizing without a deadline");
            }
            // SAFETY: live (checked by the caller under the lock; only an abort
            // can change that, and NCCL allows abort during the call).
            let rc = unsafe { nccl_raw!(ncclCommFinalize(self.raw)) };
            drop(done);
            if let Ok(w) = watchdog {
                let _ = w.join();
            }
            if self.is_aborted() {
                Err(Error::Timeout {
                    what: "communicator finalize",
                    after: DROP_DEADLINE,
                })
            } else {
                nccl_check(rc, CALL, self.raw)
            }
        };
        if let Err(e) = finalized {
            if let Err(abort) = self.abort() {
                tracing::warn!(error = %abort, "abort after a failed finalize failed");
            }
            return match e {
                Error::Aborted { .. } => Ok(()),
                e => Err(e),
            };
        }
        {
            let mut st = self.state.lock();
            if st.status != Status::Live {
                return Ok(());
            }
            // From here no abort touches it: it is this function's to destroy.
            st.status = Status::Destroyed;
        }
        // NCCL's teardown waits for the GPUs that map the communicator's
        // buffers, with no deadline of its own: destroy on a helper thread and
        // wait for it at most DROP_DEADLINE. Past that the thread is left to
        // finish on its own (the handle is never used again) and the caller
        // gets a timeout instead of a wait without end.
        struct Raw(ncclComm_t);
        // SAFETY: the handle goes to the one thread that destroys it; nothing
        // else uses it after the status became Destroyed.
        unsafe impl Send for Raw {}
        let raw = Raw(self.raw);
        let ctx = Arc::clone(&self.ctx);
        let (tx, rx) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("nccl-destroy".into())
            .spawn(move || {
                let raw = raw;
                if let Err(e) = ctx.make_current() {
                    tracing::warn!(error = %e, "making the context current before destroy failed");
                }
                let destroy = || -> Result<()> {
                    // SAFETY: live and finalized, and only this thread uses it
                    // (the status is Destroyed); destroyed once, here.
                    let rc = unsafe { nccl_raw!(ncclCommDestroy(raw.0)) };
                    nccl_check(rc, "ncclCommDestroy", std::ptr::null_mut())
                };
                let _ = tx.send(destroy());
            });
        if let Err(e) = spawned {
            tracing::error!(
                error = %e,
                "no thread to destroy the communicator on; leaving it allocated"
            );
            return Ok(());
        }
        match rx.recv_timeout(DROP_DEADLINE) {
            Ok(r) => r,
            Err(_) => {
                tracing::error!(
                    "ncclCommDestroy did not return within {DROP_DEADLINE:?} (a peer's GPU \
                     still runs work that maps this communicator); it finishes in the background"
                );
                Err(Error::Timeout {
                    what: "ncclCommDestroy",
                    after: DROP_DEADLINE,
                })
            }
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.state.lock().status != Status::Live {
            // Aborted: NCCL already freed it.
            return;
        }
        if let Err(e) = self.finalize_and_destroy() {
            tracing::error!(rank = self.rank, error = %e, "closing a communicator failed");
        }
    }
}
