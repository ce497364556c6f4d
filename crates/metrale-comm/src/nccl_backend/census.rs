//! The census of the process's live backends: each backend registers its
//! device, rank and flight recorder while it lives, so that a backend that
//! misses a deadline can name what the process's other communicators had
//! in flight at that moment. Communicators that share devices deadlock
//! when their ranks issue work in different orders, or when a host call
//! that waits for a whole device (a free) runs while another
//! communicator's kernel waits for a peer (decision 0016): the one that
//! times out then names the others' pending operations, not only its own.
//!
//! Invariants: entries hold only a weak reference to a recorder, so the
//! census never keeps a backend's state alive, and an entry is removed
//! when its backend's state is dropped.
//!
//! Lock order: the census lock (`LIVE`, the one static), then each other
//! backend's recorder lock, a leaf, one at a time (reading its work in
//! flight). The census lock is taken only to register, to deregister and
//! to read the others' recorders, and never while the caller holds a lock
//! of its backend (poisoning asks the census before it takes any).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use crate::diagnostics::{FlightRecorder, OpState, now_unix_us};
use crate::error::InFlightElsewhere;

/// The most pending operations named per other backend.
const PER_BACKEND: usize = 4;

struct Entry {
    id: u64,
    device: usize,
    rank: usize,
    world_size: usize,
    recorder: Weak<FlightRecorder>,
}

static LIVE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A backend's place in the census; leaving it on drop.
pub(super) struct Registration {
    id: u64,
}

impl Registration {
    /// Registers a backend of `rank` of `world_size` on `device`.
    pub(super) fn new(
        device: usize,
        rank: usize,
        world_size: usize,
        recorder: &Arc<FlightRecorder>,
    ) -> Registration {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        LIVE.lock().push(Entry {
            id,
            device,
            rank,
            world_size,
            recorder: Arc::downgrade(recorder),
        });
        Registration { id }
    }

    /// The backend's number, unique in the process.
    pub(super) fn id(&self) -> u64 {
        self.id
    }

    /// The operations every other live backend of the process has in
    /// flight now (submitted, completion never seen: timed-out ones too),
    /// oldest first, at most a few per backend.
    pub(super) fn in_flight_elsewhere(&self) -> Vec<InFlightElsewhere> {
        let now = now_unix_us();
        let live = LIVE.lock();
        let mut out = Vec::new();
        for e in live.iter().filter(|e| e.id != self.id) {
            let Some(recorder) = e.recorder.upgrade() else {
                continue;
            };
            for r in recorder.in_flight(PER_BACKEND) {
                out.push(InFlightElsewhere {
                    backend: e.id,
                    rank: e.rank,
                    world_size: e.world_size,
                    device: e.device,
                    op: r.op,
                    seq: r.seq,
                    pending_for: Duration::from_micros(now.saturating_sub(r.enqueued_unix_us)),
                    timed_out: r.state == OpState::TimedOut,
                });
            }
        }
        out
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        LIVE.lock().retain(|e| e.id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_what_other_backends_have_in_flight() {
        let a = Arc::new(FlightRecorder::new(8));
        let b = Arc::new(FlightRecorder::new(8));
        let ra = Registration::new(0, 0, 2, &a);
        let rb = Registration::new(1, 1, 2, &b);
        let done = b.record("all_gather", "bf16", 8, 1, None);
        b.set_state(done, OpState::Completed);
        let pending = b.record("all_reduce", "bf16", 8, 1, None);
        a.record("broadcast", "f32", 4, 1, Some(0));
        let seen = ra.in_flight_elsewhere();
        let mine: Vec<_> = seen.iter().filter(|x| x.backend == rb.id()).collect();
        assert_eq!(mine.len(), 1, "{seen:?}");
        assert_eq!(
            (
                mine[0].op.as_str(),
                mine[0].seq,
                mine[0].device,
                mine[0].rank
            ),
            ("all_reduce", pending, 1, 1)
        );
        assert!(seen.iter().all(|x| x.backend != ra.id()), "its own ops");
        let gone = rb.id();
        drop(rb);
        assert!(
            ra.in_flight_elsewhere().iter().all(|x| x.backend != gone),
            "a backend that left is not named"
        );
    }
}
