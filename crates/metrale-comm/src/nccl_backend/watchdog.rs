//! The watchdog thread: every `watchdog_interval` it polls the watched
//! submissions' completion events, the call a blocking communicator is
//! inside, and the communicator's asynchronous error.
//!
//! Invariants:
//! - It never takes the slot lock: the asynchronous error is asked for
//!   through the abort handle, so a thread inside NCCL never delays it.
//! - The asynchronous error, and the one-shot kernel's status (a kernel
//!   that gave up completes its event too), are asked for before any
//!   finished submission is marked complete, so a submission whose event
//!   fired on a failed communicator is named as the failure (op and seq),
//!   never recorded as done; unless a waiter had confirmed it good (its
//!   event complete and the error clear, then its caller told of success),
//!   which the watch queues remember per stream.
//! - It holds only a weak reference between ticks, and exits at shutdown.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use nccl_safe::Event;

use super::Inner;
use super::watch::Watched;
use crate::error::FailureKind;

pub(super) fn watchdog_loop(inner: Weak<Inner>) {
    loop {
        let Some(inner) = inner.upgrade() else { return };
        if inner.health.is_shutdown() {
            return;
        }
        let interval = inner.config.watchdog_interval;
        inner.watchdog_tick();
        drop(inner);
        std::thread::sleep(interval);
    }
}

impl Inner {
    /// One pass of the watchdog: poisons on a missed deadline, a call stuck
    /// inside NCCL or an asynchronous error, and otherwise marks finished
    /// submissions complete. Per stream it asks at most about log2 of the
    /// watched events (a binary search for the last complete one), so the
    /// cost of a tick barely grows with the work in flight.
    pub(super) fn watchdog_tick(&self) {
        let now = Instant::now();
        let generation = self.generation.load(Ordering::Acquire);
        let mut expired: Option<(&'static str, u64)> = None;
        let mut failed: Option<(&'static str, u64, nccl_safe::Error)> = None;
        let mut done: Vec<(usize, &'static str, u64, Arc<Event>)> = Vec::new();
        let streams = self.watch.streams();
        for stream in streams {
            // Work on one stream completes in order, so a submission is
            // complete when a later one on its stream is: find the boundary
            // between the complete prefix and the rest with a binary search
            // (one query when everything is done, or when nothing is),
            // asking the driver with no lock held.
            let n = self.watch.len_of(stream);
            let Some(first) = self.watch.get(stream, 0) else {
                continue;
            };
            let query = |i: usize| -> Option<(Watched, nccl_safe::Result<bool>)> {
                let w = self.watch.get(stream, i)?;
                let r = if w.generation == generation {
                    w.event.query()
                } else {
                    Ok(true)
                };
                Some((w, r))
            };
            let front = query(0);
            let front_done = matches!(front, Some((_, Ok(true))));
            let complete = match if front_done { query(n - 1) } else { None } {
                Some((_, Ok(true))) => n,
                _ => {
                    // [0, lo) complete, [hi, n) not (or failed).
                    let (mut lo, mut hi) = if front_done { (1, n - 1) } else { (0, 0) };
                    let mut stop: Option<(Watched, nccl_safe::Result<bool>)> =
                        if front_done { None } else { front };
                    while lo < hi {
                        let mid = lo + (hi - lo) / 2;
                        match query(mid) {
                            Some((_, Ok(true))) => lo = mid + 1,
                            Some(other) => {
                                hi = mid;
                                stop = Some(other);
                            }
                            None => break,
                        }
                    }
                    // The first incomplete one: its deadline, or its error.
                    let blocker = if stop.as_ref().is_some_and(|(w, _)| {
                        self.watch.get(stream, lo).map(|x| x.seq) == Some(w.seq)
                    }) {
                        stop
                    } else {
                        query(lo)
                    };
                    match blocker {
                        Some((w, Err(e))) if failed.as_ref().is_none_or(|(_, s, _)| w.seq < *s) => {
                            failed = Some((w.op, w.seq, e));
                        }
                        Some((_, Err(_))) => {}
                        Some((w, _)) => {
                            let with_deadline = if w.deadline.is_some() {
                                Some(w)
                            } else {
                                self.watch.first_with_deadline(stream)
                            };
                            if let Some(d) = with_deadline
                                && d.deadline.is_some_and(|at| now >= at)
                                && expired.is_none_or(|(_, s)| d.seq < s)
                            {
                                expired = Some((d.op, d.seq));
                            }
                        }
                        None => {}
                    }
                    lo
                }
            };
            if complete > 0 {
                let taken = self.watch.take_front(stream, first.seq, complete);
                done.extend(
                    taken
                        .into_iter()
                        .filter(|w| w.generation == generation)
                        .map(|w| (stream, w.op, w.seq, w.event)),
                );
            }
        }
        if self.health.is_poisoned() {
            return;
        }
        // A call stuck inside NCCL on a blocking communicator counts as
        // timed out too: poisoning aborts the communicator, which makes NCCL
        // return from it.
        if let Some(stuck_seq) = self.calls.stuck(self.config.collective_timeout) {
            let op = self.recorder.op_of(stuck_seq).unwrap_or("nccl call");
            expired = Some((op, stuck_seq));
        }
        if let Some((op, seq)) = expired {
            self.poison(
                op,
                seq,
                FailureKind::Timeout {
                    after: self.config.collective_timeout,
                },
            );
            return;
        }
        if let Some((op, seq, e)) = failed {
            self.poison(op, seq, FailureKind::from_call(e));
            return;
        }
        let handle = self.abort.lock().clone();
        let async_err = match handle.map(|h| h.async_error()) {
            Some(Err(nccl_safe::Error::Aborted { .. })) | Some(Ok(())) | None => None,
            Some(Err(e)) => Some(e),
        };
        let failure = async_err
            .map(FailureKind::AsyncError)
            .or_else(|| self.one_shot_flags.failure());
        if let Some(kind) = failure {
            // Named after the oldest submission not confirmed good by a
            // waiter (which told its caller it succeeded).
            let blamed = self.watch.blame(&done, generation);
            let (op, seq) = blamed.unwrap_or_else(|| {
                // Nothing watched yet (a submission between its record
                // and its watch): the last recorded one.
                let seq = self.recorder.last_seq();
                (self.recorder.op_of(seq).unwrap_or("all_reduce"), seq)
            });
            self.poison(op, seq, kind);
            return;
        }
        self.recorder
            .set_completed(done.iter().map(|(_, _, seq, _)| *seq));
        self.watch.recycle(done.into_iter().map(|(_, _, _, ev)| ev));
    }
}

#[cfg(feature = "bench-internals")]
impl super::NcclBackend {
    /// Runs one watchdog pass on the calling thread (benchmarks of its cost;
    /// not part of the API).
    pub fn watchdog_tick_for_bench(&self) {
        self.inner.watchdog_tick();
    }

    /// The number of submissions the watchdog watches (benchmarks).
    pub fn watched_for_bench(&self) -> usize {
        self.inner.watch.len()
    }
}
