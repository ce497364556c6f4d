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
//!   never recorded as done.
//! - It holds only a weak reference between ticks, and exits at shutdown.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use nccl_safe::Event;

use super::Inner;
use crate::diagnostics::OpState;
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
    /// submissions complete. Per stream it asks only the oldest watched
    /// event, and the next once that one completed: the cost of a tick does
    /// not grow with the work in flight.
    pub(super) fn watchdog_tick(&self) {
        let now = Instant::now();
        let generation = self.generation.load(Ordering::Acquire);
        let mut expired: Option<(&'static str, u64)> = None;
        let mut failed: Option<(&'static str, u64, nccl_safe::Error)> = None;
        let mut done: Vec<(&'static str, u64, Arc<Event>)> = Vec::new();
        let streams = self.watched.lock().streams();
        for stream in streams {
            loop {
                let Some(front) = self.watched.lock().front(stream) else {
                    break;
                };
                if front.generation != generation {
                    self.watched.lock().pop(stream, front.seq);
                    continue;
                }
                // The driver is asked without any lock held.
                match front.event.query() {
                    Ok(true) => {
                        self.watched.lock().pop(stream, front.seq);
                        done.push((front.op, front.seq, front.event));
                    }
                    Ok(false) => {
                        let first = if front.deadline.is_some() {
                            Some(front)
                        } else {
                            self.watched.lock().first_with_deadline(stream)
                        };
                        if let Some(w) = first
                            && w.deadline.is_some_and(|d| now >= d)
                            && expired.is_none_or(|(_, s)| w.seq < s)
                        {
                            expired = Some((w.op, w.seq));
                        }
                        break;
                    }
                    Err(e) => {
                        if failed.as_ref().is_none_or(|(_, s, _)| front.seq < *s) {
                            failed = Some((front.op, front.seq, e));
                        }
                        break;
                    }
                }
            }
        }
        if self.health.is_poisoned() {
            return;
        }
        // A call stuck inside NCCL on a blocking communicator counts as
        // timed out too: poisoning aborts the communicator, which makes NCCL
        // return from it.
        let stuck_seq = self.in_call_seq.load(Ordering::Acquire);
        if stuck_seq != 0 {
            let since = self.in_call_since_us.load(Ordering::Acquire);
            let running = (self.born.elapsed().as_micros() as u64).saturating_sub(since);
            if running >= self.config.collective_timeout.as_micros() as u64
                && self.in_call_seq.load(Ordering::Acquire) == stuck_seq
            {
                let op = self.recorder.op_of(stuck_seq).unwrap_or("nccl call");
                expired = Some((op, stuck_seq));
            }
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
            .or_else(|| self.one_shot_failure());
        if let Some(kind) = failure {
            let (op, seq) = done
                .iter()
                .map(|(op, seq, _)| (*op, *seq))
                .chain(self.oldest_pending())
                .min_by_key(|&(_, seq)| seq)
                .unwrap_or(("all_reduce", self.recorder.last_seq()));
            self.poison(op, seq, kind);
            return;
        }
        for (_, seq, _) in &done {
            self.recorder.set_state(*seq, OpState::Completed);
        }
        self.recycle(done.into_iter().map(|(_, _, ev)| ev));
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
        self.inner.watched.lock().len()
    }
}
