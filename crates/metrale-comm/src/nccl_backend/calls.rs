//! The clock of a backend's submissions and the tracking of the NCCL call a
//! blocking communicator is inside: [`Calls`].
//!
//! Invariants:
//! - One monotonic clock read per submission: the flight recorder's time,
//!   the deadline and a blocking call's start all come from it, as
//!   microseconds after the backend was made (`born`).
//! - On a blocking communicator ([`EnqueueMode::Blocking`]) the call in
//!   progress is published in two atomics, the sequence number last, and
//!   cleared when it returns; the watchdog reads the sequence number, then
//!   the start, then the sequence number again. On a non-blocking
//!   communicator no call blocks, and nothing is published.
//!
//! Lock order: no lock (atomics only).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::config::EnqueueMode;

/// The submission clock and the blocking call in progress.
pub(super) struct Calls {
    /// Whether NCCL calls block (`EnqueueMode::Blocking`): only then is a
    /// call in progress tracked.
    blocking: bool,
    /// The sequence number of the submission now inside an NCCL call (0:
    /// none).
    seq: AtomicU64,
    /// When that call started, in microseconds after `born`.
    since_us: AtomicU64,
    /// When the backend was made: the origin of `since_us`.
    born: Instant,
    /// `born` as microseconds since the Unix epoch.
    born_unix_us: u64,
}

impl Calls {
    pub(super) fn new(enqueue: EnqueueMode) -> Calls {
        Calls {
            blocking: enqueue == EnqueueMode::Blocking,
            seq: AtomicU64::new(0),
            since_us: AtomicU64::new(0),
            born: Instant::now(),
            born_unix_us: crate::diagnostics::now_unix_us(),
        }
    }

    /// Microseconds from `born` to now.
    pub(super) fn now_us(&self) -> u64 {
        self.us_at(Instant::now())
    }

    /// Microseconds from `born` to `at`.
    pub(super) fn us_at(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.born).as_micros() as u64
    }

    /// Microseconds since the Unix epoch at `us` after `born`.
    pub(super) fn unix_us(&self, us: u64) -> u64 {
        self.born_unix_us + us
    }

    /// Runs `f`, which calls NCCL for submission `seq` starting at
    /// `since_us`; on a blocking communicator the watchdog sees the call
    /// while it runs.
    pub(super) fn inside<T>(&self, seq: u64, since_us: u64, f: impl FnOnce() -> T) -> T {
        if !self.blocking {
            return f();
        }
        // Two atomics, no lock: the watchdog reads the sequence number, then
        // the start; the op is named from the flight recorder by `seq`.
        self.since_us.store(since_us, Ordering::Release);
        self.seq.store(seq, Ordering::Release);
        let out = f();
        self.seq.store(0, Ordering::Release);
        out
    }

    /// The submission inside an NCCL call for `timeout` or longer, if any.
    pub(super) fn stuck(&self, timeout: Duration) -> Option<u64> {
        let seq = self.seq.load(Ordering::Acquire);
        if seq == 0 {
            return None;
        }
        let since = self.since_us.load(Ordering::Acquire);
        let running = self.now_us().saturating_sub(since);
        (running >= timeout.as_micros() as u64 && self.seq.load(Ordering::Acquire) == seq)
            .then_some(seq)
    }
}
