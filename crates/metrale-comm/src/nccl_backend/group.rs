//! Groups and the slot: the calling thread's group (`group_start` /
//! `group_end`), and taking the slot lock around another thread's open
//! group.
//!
//! Invariants:
//! - A group belongs to the thread that opened it; only that thread submits
//!   while it is open; other threads' calls wait on `group_closed` for it
//!   to end, bounded by the collective timeout (`GroupBusy` past it).
//! - Submissions inside a group are watched from its outermost end, one
//!   completion event per stream recorded after the group's last operation
//!   there, each submission still named by its own op and sequence number.
//! - A failed outermost `ncclGroupEnd` poisons, named after the group's
//!   first submission; a nested end counts down and returns what its
//!   `ncclGroupEnd` returned.
//!
//! Lock order: `slot` (with its condition variable `group_closed`), then
//! the watch lock (`watch_group`, after the slot is released).

use std::time::Instant;

use cuda_sys::CUstream;
use parking_lot::MutexGuard;

use super::submission::{GroupState, GroupedOp};
use super::{Inner, Slot};
use crate::backend::Result;
use crate::error::{CommError, FailureKind};

impl Inner {
    /// True when the calling thread has a group open on this backend.
    pub(super) fn in_group(&self, slot: &Slot) -> bool {
        slot.group
            .as_ref()
            .is_some_and(|g| g.owner == std::thread::current().id())
    }

    /// The slot, once no other thread has a group open (bounded by the
    /// collective timeout).
    pub(super) fn lock_slot(&self, op: &'static str) -> Result<MutexGuard<'_, Slot>> {
        let mut slot = self.slot.lock();
        if slot.group.is_none() {
            return Ok(slot);
        }
        let me = std::thread::current().id();
        let deadline = Instant::now() + self.config.collective_timeout;
        while slot.group.as_ref().is_some_and(|g| g.owner != me) {
            if self
                .group_closed
                .wait_until(&mut slot, deadline)
                .timed_out()
            {
                return Err(CommError::GroupBusy {
                    op,
                    waited: self.config.collective_timeout,
                });
            }
        }
        Ok(slot)
    }

    pub(super) fn refuse_in_group(&self, slot: &Slot, op: &'static str) -> Result<()> {
        if self.in_group(slot) {
            return Err(CommError::InGroup { op });
        }
        Ok(())
    }

    /// Watches the submissions of a group that just ended: one completion
    /// event per stream, recorded after the group's last operation there
    /// (a group's operations launch together), shared by the watch of each
    /// of them, so each is still named by its own op and seq.
    pub(super) fn watch_group(&self, ops: &[GroupedOp], deadline: Instant) -> Result<()> {
        let mut streams: Vec<CUstream> = Vec::new();
        for w in ops {
            if !streams.contains(&w.stream) {
                streams.push(w.stream);
            }
        }
        for stream in streams {
            let on: Vec<(u64, &'static str)> = ops
                .iter()
                .filter(|w| w.stream == stream)
                .map(|w| (w.seq, w.op))
                .collect();
            self.watch(stream, &on, Some(deadline))?;
        }
        Ok(())
    }

    /// Opens (or nests) the calling thread's group.
    pub(super) fn group_start(&self) -> Result<()> {
        const OP: &str = "group_start";
        self.check_usable(OP)?;
        let mut slot = self.lock_slot(OP)?;
        nccl_group_start(OP)?;
        match slot.group.as_mut() {
            Some(g) => g.depth += 1,
            None => {
                slot.group = Some(GroupState {
                    owner: std::thread::current().id(),
                    depth: 1,
                    watch: Vec::new(),
                })
            }
        }
        Ok(())
    }

    /// Ends the calling thread's group; the outermost end launches and
    /// watches its work.
    pub(super) fn group_end(&self) -> Result<()> {
        const OP: &str = "group_end";
        let inner = self;
        let mut slot = self.slot.lock();
        let me = std::thread::current().id();
        let Some(group) = slot.group.as_mut().filter(|g| g.owner == me) else {
            return Err(CommError::InvalidArgument {
                op: OP,
                reason: "group_end without group_start on this thread".into(),
            });
        };
        group.depth -= 1;
        let outermost = group.depth == 0;
        let first = group
            .watch
            .first()
            .map(|w| w.seq)
            .unwrap_or_else(|| inner.recorder.last_seq());
        // The outermost group end launches the group's work (and on a
        // blocking communicator may wait there for a peer's connection).
        let ended = inner
            .calls
            .inside(first, inner.calls.now_us(), || nccl_group_end(OP));
        if !outermost {
            return ended;
        }
        let group = slot.group.take().expect("checked above");
        inner.group_closed.notify_all();
        if let Err(e) = ended {
            drop(slot);
            if let CommError::Refused { source, .. } = e {
                return Err(CommError::Failed(inner.poison(
                    OP,
                    first,
                    FailureKind::CallFailed(source),
                )));
            }
            return Err(e);
        }
        // The group's work may still be being enqueued (non-blocking
        // communicator): events recorded now would complete before it.
        let ready = match slot.comm.as_ref() {
            Some(comm) => comm.wait_ready(),
            None => Err(nccl_safe::Error::Aborted { call: OP }),
        };
        if let Err(e) = ready {
            drop(slot);
            return Err(inner.fail(OP, first, e));
        }
        drop(slot);
        let deadline = Instant::now() + inner.config.collective_timeout;
        inner.watch_group(&group.watch, deadline)
    }
}

/// `ncclGroupStart`.
fn nccl_group_start(op: &'static str) -> Result<()> {
    let nccl = nccl_sys::nccl().map_err(|e| refused(op, e.into()))?;
    // SAFETY: the call takes no arguments; NCCL keeps the group state per
    // thread.
    let rc = unsafe { nccl_sys::call!(nccl, ncclGroupStart()) };
    group_result(op, rc, "ncclGroupStart")
}

/// `ncclGroupEnd`.
fn nccl_group_end(op: &'static str) -> Result<()> {
    let nccl = nccl_sys::nccl().map_err(|e| refused(op, e.into()))?;
    // SAFETY: as for `ncclGroupStart`.
    let rc = unsafe { nccl_sys::call!(nccl, ncclGroupEnd()) };
    group_result(op, rc, "ncclGroupEnd")
}

fn refused(op: &'static str, source: nccl_safe::Error) -> CommError {
    CommError::Refused { op, source }
}

/// A group call's result; `ncclInProgress` counts as success (on
/// non-blocking communicators each communicator's next call waits for the
/// group's enqueue).
fn group_result(
    op: &'static str,
    rc: std::result::Result<nccl_sys::ncclResult_t, nccl_sys::LoadError>,
    call: &'static str,
) -> Result<()> {
    let rc = rc.map_err(|e| refused(op, e.into()))?;
    if rc == nccl_sys::ncclResult_t::ncclInProgress {
        return Ok(());
    }
    nccl_safe::nccl_check(rc, call, std::ptr::null_mut()).map_err(|e| refused(op, e))
}
