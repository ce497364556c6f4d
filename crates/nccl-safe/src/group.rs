//! NCCL groups: calls between `ncclGroupStart` and `ncclGroupEnd` are
//! fused and launched together.
//!
//! Invariants:
//! - Every started [`Group`] is ended exactly once: by [`Group::end`], or by
//!   its drop (which logs any error and never panics).
//! - A group belongs to the thread that started it (NCCL keeps group state
//!   per thread), so [`Group`] is neither `Send` nor `Sync`.
//! - `ncclInProgress` from `ncclGroupEnd` (non-blocking communicators) counts
//!   as success: the group's work is still being enqueued in the background.
//!   Each communicator's next NCCL call waits for it, but stream work that is
//!   not NCCL's (a kernel launch, an event record) does not: call
//!   [`crate::Comm::wait_ready`] on each communicator of the group first.

use std::marker::PhantomData;

use nccl_sys::ncclResult_t;

use crate::error::{Result, nccl_check};

/// A started NCCL group; end it with [`Group::end`].
#[must_use = "a group must be ended; dropping it ends it and only logs errors"]
#[derive(Debug)]
pub struct Group {
    ended: bool,
    _thread_bound: PhantomData<*const ()>,
}

fn group_end() -> Result<()> {
    // SAFETY: ncclGroupEnd takes no arguments; a group was started on this
    // thread by the Group being ended.
    let rc = unsafe { nccl_raw!(ncclGroupEnd()) };
    if rc == ncclResult_t::ncclInProgress {
        return Ok(());
    }
    nccl_check(rc, "ncclGroupEnd", std::ptr::null_mut())
}

impl Group {
    /// Starts a group (`ncclGroupStart`).
    pub fn start() -> Result<Group> {
        // SAFETY: ncclGroupStart takes no arguments.
        let rc = unsafe { nccl_raw!(ncclGroupStart()) };
        nccl_check(rc, "ncclGroupStart", std::ptr::null_mut())?;
        Ok(Group {
            ended: false,
            _thread_bound: PhantomData,
        })
    }

    /// Ends the group (`ncclGroupEnd`), launching its calls.
    pub fn end(mut self) -> Result<()> {
        self.ended = true;
        group_end()
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if !self.ended
            && let Err(e) = group_end()
        {
            tracing::error!(error = %e, "ending an NCCL group on drop failed");
        }
    }
}

/// Runs `f` inside a group; the group ends even when `f` fails, and `f`'s
/// error wins over the end's. On non-blocking communicators, call
/// [`crate::Comm::wait_ready`] before ordering other stream work after the
/// group.
pub fn group<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    let g = Group::start()?;
    let r = f();
    let ended = g.end();
    match r {
        Err(e) => {
            if let Err(end) = ended {
                tracing::warn!(error = %end, "ncclGroupEnd after a failed group body also failed");
            }
            Err(e)
        }
        Ok(v) => ended.map(|()| v),
    }
}
