//! The watch part of a backend: the submissions the watchdog waits for,
//! one queue per stream in submission order, the per-stream marks of work
//! a waiter confirmed good, and the pool of completion events, all behind
//! [`Watch`]'s one lock.
//!
//! Invariants:
//! - A queue's order is its events' record order, which is their
//!   completion order: a pooled event is taken, recorded and pushed under
//!   one acquisition of the lock ([`Watch::record`]), so no other watch
//!   lands between. An entry is complete when a later one on its stream
//!   is, so only a queue's front needs asking.
//! - The lock is held to copy, push or pop, and across one `cuEventRecord`
//!   in [`Watch::record`]; never across another lock of the backend's, and
//!   never by the watchdog across a driver call.
//! - A failure is never named after a submission a waiter confirmed good
//!   (the marks); past [`GOOD_MARKS_CAP`] streams the oldest mark is
//!   forgotten, which names failures conservatively.
//!
//! Lock order: one lock (`queues`), a leaf below the slot lock.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use cuda_sys::CUstream;
use nccl_safe::{Context, Event};
use parking_lot::Mutex;

/// A submission the watchdog waits for.
#[derive(Clone)]
pub(super) struct Watched {
    pub(super) seq: u64,
    pub(super) op: &'static str,
    pub(super) generation: u64,
    pub(super) event: Arc<Event>,
    /// `None`: an idle wait (a command receive), no deadline.
    pub(super) deadline: Option<Instant>,
}

/// The watched submissions, one queue per stream in submission order, and
/// the pool of completion events for reuse (one lock for both: a
/// submission takes its event and pushes its watch under one acquisition).
/// Every event is recorded and pushed under one acquisition, so a queue's
/// order is its events' record order, which is their completion order:
/// an entry is complete when a later one is, and only a queue's front needs
/// asking: the watchdog's work per tick is one query per stream plus one
/// per completion, whatever the number in flight. A handful of streams is
/// the usual case, so the queues are a vector searched from its newest
/// queue back (no hashing on the submission path).
///
/// It also keeps, per stream, the newest submission a waiter confirmed
/// good (its event complete, then its communicator's asynchronous error
/// clear), so a failure seen later is never named after work a caller was
/// told had succeeded.
#[derive(Default)]
struct WatchQueues {
    queues: Vec<(usize, VecDeque<Watched>)>,
    pool: Vec<Arc<Event>>,
    good: Vec<(usize, u64)>,
}

/// The most streams whose confirmed-good mark is kept; past it the oldest
/// mark is forgotten (its stream's failures are then named as if nothing
/// there had been confirmed, the conservative choice).
const GOOD_MARKS_CAP: usize = 64;

impl WatchQueues {
    fn position(&self, stream: usize) -> Option<usize> {
        self.queues.iter().rposition(|(s, _)| *s == stream)
    }

    fn queue(&self, stream: usize) -> Option<&VecDeque<Watched>> {
        self.position(stream).map(|i| &self.queues[i].1)
    }

    fn push(&mut self, stream: CUstream, w: Watched) {
        let key = stream as usize;
        match self.position(key) {
            Some(i) => self.queues[i].1.push_back(w),
            None => self.queues.push((key, VecDeque::from([w]))),
        }
    }

    /// A pooled completion event, if any is left.
    fn pooled_event(&mut self) -> Option<Arc<Event>> {
        self.pool.pop()
    }

    /// Returns finished events to the pool (those nothing else holds, up to
    /// the pool's cap).
    fn recycle(&mut self, events: impl IntoIterator<Item = Arc<Event>>) {
        for ev in events {
            if Arc::strong_count(&ev) == 1 && self.pool.len() < EVENT_POOL_CAP {
                self.pool.push(ev);
            }
        }
    }

    /// Drops every pooled event (their communicator's context stays; a
    /// reconnect starts with a fresh pool).
    fn clear_pool(&mut self) {
        self.pool.clear();
    }

    /// The streams with watched work.
    fn streams(&self) -> Vec<usize> {
        self.queues.iter().map(|(s, _)| *s).collect()
    }

    /// The number of watched submissions on `stream`.
    fn len_of(&self, stream: usize) -> usize {
        self.queue(stream).map_or(0, VecDeque::len)
    }

    /// The `i`-th oldest watched submission on `stream`.
    fn get(&self, stream: usize, i: usize) -> Option<Watched> {
        self.queue(stream).and_then(|q| q.get(i).cloned())
    }

    /// Removes and returns the `k` oldest submissions of `stream` if the
    /// oldest is `seq` (nothing else removes from a queue's front); drops
    /// empty queues.
    fn take_front(&mut self, stream: usize, seq: u64, k: usize) -> Vec<Watched> {
        let Some(i) = self.position(stream) else {
            return Vec::new();
        };
        let q = &mut self.queues[i].1;
        let taken = if q.front().is_some_and(|w| w.seq == seq) {
            q.drain(..k.min(q.len())).collect()
        } else {
            Vec::new()
        };
        if q.is_empty() {
            self.queues.swap_remove(i);
        }
        taken
    }

    /// The first submission on `stream` that has a deadline (the front,
    /// unless an idle command receive is ahead of it).
    fn first_with_deadline(&self, stream: usize) -> Option<Watched> {
        self.queue(stream)
            .and_then(|q| q.iter().find(|w| w.deadline.is_some()).cloned())
    }

    /// Every watched submission's event.
    fn events(&self) -> Vec<Arc<Event>> {
        self.queues
            .iter()
            .flat_map(|(_, q)| q)
            .map(|w| w.event.clone())
            .collect()
    }

    /// The oldest watched submission of `generation` that has a deadline
    /// and was not confirmed good.
    fn oldest_with_deadline(&self, generation: u64) -> Option<(&'static str, u64)> {
        self.queues
            .iter()
            .flat_map(|(s, q)| q.iter().map(move |w| (*s, w)))
            .filter(|(s, w)| {
                w.generation == generation && w.deadline.is_some() && !self.is_good(*s, w.seq)
            })
            .min_by_key(|(_, w)| w.seq)
            .map(|(_, w)| (w.op, w.seq))
    }

    /// Records that every submission on `stream` up to `seq` succeeded.
    fn mark_good(&mut self, stream: usize, seq: u64) {
        if let Some(g) = self.good.iter_mut().find(|(s, _)| *s == stream) {
            g.1 = g.1.max(seq);
            return;
        }
        if self.good.len() >= GOOD_MARKS_CAP
            && let Some(i) = (0..self.good.len()).min_by_key(|&i| self.good[i].1)
        {
            self.good.swap_remove(i);
        }
        self.good.push((stream, seq));
    }

    /// Whether submission `seq` on `stream` was confirmed good.
    fn is_good(&self, stream: usize, seq: u64) -> bool {
        self.good.iter().any(|&(s, g)| s == stream && seq <= g)
    }

    /// Forgets every watched submission and every confirmed-good mark (the
    /// pool stays).
    fn clear(&mut self) {
        self.queues.clear();
        self.good.clear();
    }

    /// The newest watched event of each stream, with the stream's key.
    fn newest_events(&self) -> Vec<(usize, Arc<Event>)> {
        self.queues
            .iter()
            .filter_map(|(s, q)| q.back().map(|w| (*s, w.event.clone())))
            .collect()
    }

    /// The number of watched submissions.
    #[cfg(feature = "bench-internals")]
    fn len(&self) -> usize {
        self.queues.iter().map(|(_, q)| q.len()).sum()
    }
}

/// Completion events kept for reuse: as many as operations are usually in
/// flight, so that a submission records a pooled event instead of creating
/// one (`cuEventCreate` and `cuEventDestroy` cost a submission more than
/// everything else it does).
const EVENT_POOL_CAP: usize = 4096;

/// Why [`Watch::record`] watched nothing.
pub(super) enum WatchError {
    /// No completion event could be made (nothing was recorded).
    NoEvent(nccl_safe::Error),
    /// Recording the event on the stream failed.
    Record(nccl_safe::Error),
}

/// The watched submissions and the event pool of one backend.
pub(super) struct Watch {
    queues: Mutex<WatchQueues>,
    ctx: Arc<Context>,
}

impl Watch {
    /// An empty watch whose events belong to `ctx`.
    pub(super) fn new(ctx: &Arc<Context>) -> Watch {
        Watch {
            queues: Mutex::new(WatchQueues::default()),
            ctx: Arc::clone(ctx),
        }
    }

    fn new_event(&self) -> nccl_safe::Result<Arc<Event>> {
        Event::new(&self.ctx, false).map(Arc::new)
    }

    /// A completion event: a pooled one, else a new one.
    pub(super) fn take_event(&self) -> nccl_safe::Result<Arc<Event>> {
        if let Some(ev) = self.queues.lock().pooled_event() {
            return Ok(ev);
        }
        self.new_event()
    }

    /// Returns finished events to the pool.
    pub(super) fn recycle(&self, events: impl IntoIterator<Item = Arc<Event>>) {
        self.queues.lock().recycle(events);
    }

    /// Records one completion event on `stream`, after the submissions
    /// `ops` (seq, op; all already enqueued there, oldest first), and
    /// watches each with that event, stamped with the current `generation`.
    /// `deadline: None` is an idle wait (no timeout). A pooled event is
    /// taken, recorded and pushed under one acquisition of the lock (an
    /// event is created, when the pool is empty, outside it).
    pub(super) fn record(
        &self,
        stream: CUstream,
        ops: &[(u64, &'static str)],
        generation: &AtomicU64,
        deadline: Option<Instant>,
    ) -> Result<Arc<Event>, WatchError> {
        let mut queues = self.queues.lock();
        let event = match queues.pooled_event() {
            Some(ev) => ev,
            None => {
                // Creating an event is slow: not under the lock.
                drop(queues);
                let ev = self.new_event().map_err(WatchError::NoEvent)?;
                queues = self.queues.lock();
                ev
            }
        };
        // SAFETY: `stream` is the backend's own stream or one the caller
        // vouched for (a `StreamRef`, live until its group's work is
        // watched when grouped), of this context.
        if let Err(e) = unsafe { event.record_raw(stream) } {
            queues.recycle([event]);
            return Err(WatchError::Record(e));
        }
        let generation = generation.load(Ordering::Acquire);
        for &(seq, op) in ops {
            queues.push(
                stream,
                Watched {
                    seq,
                    op,
                    generation,
                    event: event.clone(),
                    deadline,
                },
            );
        }
        Ok(event)
    }

    /// The streams with watched work.
    pub(super) fn streams(&self) -> Vec<usize> {
        self.queues.lock().streams()
    }

    /// The number of watched submissions on `stream`.
    pub(super) fn len_of(&self, stream: usize) -> usize {
        self.queues.lock().len_of(stream)
    }

    /// The `i`-th oldest watched submission on `stream`.
    pub(super) fn get(&self, stream: usize, i: usize) -> Option<Watched> {
        self.queues.lock().get(stream, i)
    }

    /// Removes and returns the `k` oldest submissions of `stream` if the
    /// oldest is `seq`.
    pub(super) fn take_front(&self, stream: usize, seq: u64, k: usize) -> Vec<Watched> {
        self.queues.lock().take_front(stream, seq, k)
    }

    /// The first submission on `stream` that has a deadline.
    pub(super) fn first_with_deadline(&self, stream: usize) -> Option<Watched> {
        self.queues.lock().first_with_deadline(stream)
    }

    /// Every watched submission's event.
    pub(super) fn events(&self) -> Vec<Arc<Event>> {
        self.queues.lock().events()
    }

    /// The newest watched event of each stream, with the stream's key.
    pub(super) fn newest_events(&self) -> Vec<(usize, Arc<Event>)> {
        self.queues.lock().newest_events()
    }

    /// The oldest watched submission of `generation` that has a deadline
    /// and was not confirmed good.
    pub(super) fn oldest_with_deadline(&self, generation: u64) -> Option<(&'static str, u64)> {
        self.queues.lock().oldest_with_deadline(generation)
    }

    /// Records that every submission on `stream` up to `seq` succeeded.
    pub(super) fn mark_good(&self, stream: usize, seq: u64) {
        self.queues.lock().mark_good(stream, seq);
    }

    /// Whom a failure seen now is named after: the oldest of `done`
    /// (stream, op, seq; complete but not yet marked) not confirmed good,
    /// and of the watched submissions of `generation` with a deadline.
    pub(super) fn blame(
        &self,
        done: &[(usize, &'static str, u64, Arc<Event>)],
        generation: u64,
    ) -> Option<(&'static str, u64)> {
        let queues = self.queues.lock();
        done.iter()
            .filter(|(stream, _, seq, _)| !queues.is_good(*stream, *seq))
            .map(|(_, op, seq, _)| (*op, *seq))
            .chain(queues.oldest_with_deadline(generation))
            .min_by_key(|&(_, seq)| seq)
    }

    /// Forgets every watched submission and every confirmed-good mark;
    /// with `pool`, the pooled events too (a reconnect starts afresh).
    pub(super) fn clear(&self, pool: Pool) {
        let mut queues = self.queues.lock();
        queues.clear();
        if pool == Pool::Drop {
            queues.clear_pool();
        }
    }

    /// The number of watched submissions.
    #[cfg(feature = "bench-internals")]
    pub(super) fn len(&self) -> usize {
        self.queues.lock().len()
    }
}

/// Whether [`Watch::clear`] keeps the pooled events.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pool {
    Keep,
    Drop,
}
