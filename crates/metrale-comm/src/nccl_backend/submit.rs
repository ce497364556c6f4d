//! The path every operation takes: a [`Submission`] (what the flight
//! recorder logs, where it runs, how its completion is awaited), checked
//! for health, recorded, enqueued under the slot lock, then watched; and
//! the wait and confirmation behind every completion a caller is told of.
//!
//! Invariants:
//! - A refused call (bad arguments, seen by NCCL or the driver before
//!   anything is enqueued) never poisons; any other failure of an enqueue
//!   poisons with that submission's op and sequence number (`failure`).
//! - The path's host cost is constant: one clock read, each lock once, no
//!   allocation once the event pool is warm, and no driver call besides the
//!   capture query (callers' streams), the enqueue and one `cuEventRecord`.
//! - A waiter returns `Ok` only after `confirm`: the event completed, the
//!   communicator it ran on reports no asynchronous error, was not aborted,
//!   is still the current generation, and no one-shot kernel recorded a
//!   failure.
//! - Work captured into a graph is not watched (it runs at launch); work
//!   inside a group is watched from the group's end (`group`).
//!
//! Lock order: `slot`, then the watch lock (`synchronize` takes an event
//! under the slot); `submit` releases the slot before it watches
//! (`Watch::record`); the flight recorder's lock is taken under the slot.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cuda_sys::CUstream;
use nccl_safe::{Comm, Event, Stream};

use super::submission::{Capture, GroupedOp, StreamSel, Submission, Target, Ticket, Wait};
use super::watch::WatchError;
use super::{Inner, Slot};
use crate::backend::Result;
use crate::diagnostics::OpState;
use crate::error::{CommError, FailureKind};

/// What [`Inner::confirm`] found.
enum Verdict {
    Good,
    Aborted,
    Failed(FailureKind),
}

/// Waits a little longer each time: spins briefly (small collectives finish
/// in microseconds), then sleeps up to 1 ms.
pub(super) struct Backoff(u32);

impl Backoff {
    pub(super) fn new() -> Backoff {
        Backoff(0)
    }

    pub(super) fn pause(&mut self) {
        self.0 += 1;
        if self.0 < 64 {
            std::thread::yield_now();
        } else {
            let us = (self.0 as u64 - 63).min(1000);
            std::thread::sleep(Duration::from_micros(us));
        }
    }
}

impl Inner {
    /// Records one completion event on `stream` after the submissions `ops`
    /// (seq, op; oldest first) and hands each to the watchdog with it
    /// (`Watch::record`). A failed record poisons, named by the first of
    /// `ops`.
    pub(super) fn watch(
        &self,
        stream: CUstream,
        ops: &[(u64, &'static str)],
        deadline: Option<Instant>,
    ) -> Result<Arc<Event>> {
        self.watch
            .record(stream, ops, &self.generation, deadline)
            .map_err(|e| match e {
                WatchError::NoEvent(source) => CommError::Refused {
                    op: "event",
                    source,
                },
                WatchError::Record(e) => {
                    let (seq, op) = ops.first().copied().unwrap_or((0, "watch"));
                    self.fail(op, seq, e)
                }
            })
    }

    /// A completion event for a caller's own record (`synchronize`).
    pub(super) fn take_event(&self) -> Result<Arc<Event>> {
        self.watch
            .take_event()
            .map_err(|source| CommError::Refused {
                op: "event",
                source,
            })
    }

    /// Submits one operation: health check, flight-recorder entry, the
    /// enqueue under the slot lock (`enqueue` gets the resolved [`Target`]),
    /// then the watch; returns the ticket when the caller waits
    /// (`Wait::Ticket`, `Wait::Idle`) and the work was neither captured nor
    /// grouped. Its host cost is a constant: one clock read (the
    /// recorder's time, the deadline and the blocking call's start all come
    /// from it), the slot, recorder and watch locks once each, the capture
    /// query on callers' streams, the enqueue and one `cuEventRecord`.
    /// Asynchronous errors are not asked for here: the watchdog asks every
    /// tick and every wait confirms through its ticket, so no completion is
    /// reported on a failed communicator.
    pub(super) fn submit(
        &self,
        sub: Submission,
        enqueue: impl FnOnce(&Inner, &mut Slot, Target) -> nccl_safe::Result<()>,
    ) -> Result<Option<Ticket>> {
        let op = sub.op;
        self.check_usable(op)?;
        let mut slot = self.lock_slot(op)?;
        // Re-check under the lock: a reconnect or shutdown may have finished
        // while this thread waited for it.
        self.check_usable(op)?;
        if slot.comm.is_none() {
            return Err(CommError::Shutdown { op });
        }
        let target = match sub.stream {
            StreamSel::Own => Target {
                stream: slot.stream.raw(),
                capture: Capture::Eager,
            },
            StreamSel::Caller(s) => Target {
                stream: s,
                capture: if self.is_capturing(s, op)? {
                    Capture::Graph
                } else {
                    Capture::Eager
                },
            },
        };
        let now = Instant::now();
        let since_us = self.calls.us_at(now);
        let seq = self.recorder.record_at(
            op,
            sub.dtype.name(),
            sub.bytes,
            target.stream as u64,
            sub.peer,
            self.calls.unix_us(since_us),
        );
        let enqueued = self
            .calls
            .inside(seq, since_us, || enqueue(self, &mut slot, target));
        if let Err(e) = enqueued {
            if super::failure::is_refusal(&e) {
                self.recorder.set_state(seq, OpState::Failed);
                return Err(CommError::Refused { op, source: e });
            }
            if self.health.is_shutdown() {
                // Shutdown aborted the communicator under this call.
                self.recorder.set_state(seq, OpState::Failed);
                return Err(CommError::Shutdown { op });
            }
            drop(slot);
            return Err(self.fail(op, seq, e));
        }
        if target.capture == Capture::Graph {
            // Captured work runs at graph launch; it is not watched.
            self.recorder.set_state(seq, OpState::Completed);
            return Ok(None);
        }
        if self.in_group(&slot) {
            if let Some(g) = slot.group.as_mut() {
                g.watch.push(GroupedOp {
                    seq,
                    op,
                    stream: target.stream,
                });
            }
            return Ok(None);
        }
        let comm = match sub.wait {
            Wait::Watched => None,
            Wait::Ticket | Wait::Idle => match slot.comm.as_ref().map(Comm::abort_handle) {
                Some(c) => Some(c),
                None => return Err(CommError::Shutdown { op }),
            },
        };
        let generation = self.generation.load(Ordering::Acquire);
        drop(slot);
        let deadline = (sub.wait != Wait::Idle).then(|| now + self.config.collective_timeout);
        let event = self.watch(target.stream, &[(seq, op)], deadline)?;
        Ok(comm.map(|comm| Ticket {
            seq,
            event,
            generation,
            comm,
            stream: target.stream as usize,
            wait: sub.wait,
        }))
    }

    /// Whether the caller's `stream` is being captured into a graph.
    pub(super) fn is_capturing(&self, stream: CUstream, op: &'static str) -> Result<bool> {
        // SAFETY: `stream` came from a `StreamRef`, a live stream of this
        // context.
        unsafe { Stream::is_capturing_raw(&self.ctx, stream) }
            .map_err(|source| CommError::Refused { op, source })
    }

    /// Waits for the ticket's event (the completion of its submission),
    /// bounded by the collective timeout unless the ticket is idle
    /// (`Wait::Idle`), then confirms that the communicator it ran on did
    /// not fail or get aborted meanwhile.
    /// Returns early with an error when the backend is poisoned, shut down
    /// or reconnected.
    pub(super) fn wait(&self, op: &'static str, ticket: &Ticket) -> Result<()> {
        let idle = ticket.wait == Wait::Idle;
        let seq = ticket.seq;
        let deadline = Instant::now() + self.config.collective_timeout;
        let mut backoff = Backoff::new();
        loop {
            if self.health.is_poisoned() {
                return Err(self.own_or_poisoned(op, seq));
            }
            match ticket.event.query() {
                Ok(true) => return self.confirm(op, ticket),
                Ok(false) => {}
                Err(e) => return Err(self.fail(op, seq, e)),
            }
            if self.health.is_shutdown() {
                return Err(CommError::Shutdown { op });
            }
            if self.generation.load(Ordering::Acquire) != ticket.generation {
                return Err(self.aborted(op, ticket));
            }
            if !idle && Instant::now() >= deadline {
                let (op, seq) = self.oldest_pending().unwrap_or((op, seq));
                let f = self.poison(
                    op,
                    seq,
                    FailureKind::Timeout {
                        after: self.config.collective_timeout,
                    },
                );
                return Err(CommError::Failed(f));
            }
            backoff.pause();
        }
    }

    /// The check behind every completion a caller is told of: the event of
    /// `ticket` completed, and its communicator reports no asynchronous
    /// error and was not aborted. An asynchronous error poisons, attributed
    /// to the oldest submission not confirmed good. On success the ticket's
    /// stream is marked good up to its seq before the caller is told, so a
    /// failure that comes later is never named after a submission the
    /// caller was told succeeded.
    pub(super) fn confirm(&self, op: &'static str, ticket: &Ticket) -> Result<()> {
        let seq = ticket.seq;
        if self.health.is_poisoned() {
            return Err(self.own_or_poisoned(op, seq));
        }
        let verdict = match ticket.comm.async_error() {
            Ok(()) if self.generation.load(Ordering::Acquire) != ticket.generation => {
                Verdict::Aborted
            }
            // A one-shot kernel that gave up (its own deadline) completes its
            // event too: its status says it holds no sum.
            Ok(()) => self
                .one_shot_flags
                .failure()
                .map_or(Verdict::Good, Verdict::Failed),
            Err(nccl_safe::Error::Aborted { .. }) => Verdict::Aborted,
            Err(e) => Verdict::Failed(FailureKind::AsyncError(e)),
        };
        match verdict {
            Verdict::Good => {
                self.watch.mark_good(ticket.stream, seq);
                Ok(())
            }
            Verdict::Aborted => Err(self.aborted(op, ticket)),
            Verdict::Failed(kind) => {
                let (first_op, first_seq) = self
                    .oldest_pending()
                    .filter(|&(_, s)| s < seq)
                    .unwrap_or((op, seq));
                // A synchronize's ticket carries the last submission's seq:
                // name that submission, not the wait.
                let first_op = self.recorder.op_of(first_seq).unwrap_or(first_op);
                self.poison(first_op, first_seq, kind);
                Err(self.own_or_poisoned(op, seq))
            }
        }
    }
}
