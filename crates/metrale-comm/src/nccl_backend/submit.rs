//! The path every operation takes: health check, flight-recorder entry, the
//! enqueue under the slot lock, the completion ticket and its
//! confirmation; poisoning; the calling thread's group.
//!
//! Invariants:
//! - A refused call (bad arguments, seen by NCCL or the driver before
//!   anything is enqueued) never poisons; any other failure of an enqueue
//!   poisons with that submission's op and sequence number.
//! - The path's host cost is constant: one clock read, each lock once, no
//!   allocation once the event pool is warm, and no driver call besides the
//!   capture query (callers' streams), the enqueue and one `cuEventRecord`.
//! - A waiter returns `Ok` only after `confirm`: the event completed, the
//!   communicator it ran on reports no asynchronous error, was not aborted,
//!   is still the current generation, and no one-shot kernel recorded a
//!   failure.
//! - Only the thread that opened a group submits while it is open; other
//!   threads wait on `group_closed` (bounded by the collective timeout).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use cuda_sys::CUstream;
use nccl_safe::{AbortHandle, Comm, DataType, Event, NcclCode, Stream};
use parking_lot::MutexGuard;

use super::{Inner, Slot};
use crate::backend::Result;
use crate::config::EnqueueMode;
use crate::diagnostics::{DumpHeader, OpState};
use crate::error::{CommError, Failure, FailureKind};
use crate::validate::Span;

/// What a thread waiting for a submission checks when its event completes:
/// the completion counts only if the communicator the work ran on neither
/// failed nor was aborted (by the watchdog, a reconnect or a shutdown).
pub(super) struct Ticket {
    pub(super) seq: u64,
    pub(super) event: Arc<Event>,
    pub(super) generation: u64,
    pub(super) comm: AbortHandle,
    /// The stream (as its watch key) the event is recorded on: once the
    /// ticket is confirmed, every submission there up to `seq` is good.
    pub(super) stream: usize,
}

/// What [`Inner::confirm`] found.
enum Verdict {
    Good,
    Aborted,
    Failed(FailureKind),
}

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
pub(super) struct WatchQueues {
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

    pub(super) fn push(&mut self, stream: CUstream, w: Watched) {
        let key = stream as usize;
        match self.position(key) {
            Some(i) => self.queues[i].1.push_back(w),
            None => self.queues.push((key, VecDeque::from([w]))),
        }
    }

    /// A pooled completion event, if any is left.
    pub(super) fn pooled_event(&mut self) -> Option<Arc<Event>> {
        self.pool.pop()
    }

    /// Returns finished events to the pool (those nothing else holds, up to
    /// the pool's cap).
    pub(super) fn recycle(&mut self, events: impl IntoIterator<Item = Arc<Event>>) {
        for ev in events {
            if Arc::strong_count(&ev) == 1 && self.pool.len() < EVENT_POOL_CAP {
                self.pool.push(ev);
            }
        }
    }

    /// Drops every pooled event (their communicator's context stays; a
    /// reconnect starts with a fresh pool).
    pub(super) fn clear_pool(&mut self) {
        self.pool.clear();
    }

    /// The streams with watched work.
    pub(super) fn streams(&self) -> Vec<usize> {
        self.queues.iter().map(|(s, _)| *s).collect()
    }

    /// The number of watched submissions on `stream`.
    pub(super) fn len_of(&self, stream: usize) -> usize {
        self.queue(stream).map_or(0, VecDeque::len)
    }

    /// The `i`-th oldest watched submission on `stream`.
    pub(super) fn get(&self, stream: usize, i: usize) -> Option<Watched> {
        self.queue(stream).and_then(|q| q.get(i).cloned())
    }

    /// Removes and returns the `k` oldest submissions of `stream` if the
    /// oldest is `seq` (nothing else removes from a queue's front); drops
    /// empty queues.
    pub(super) fn take_front(&mut self, stream: usize, seq: u64, k: usize) -> Vec<Watched> {
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
    pub(super) fn first_with_deadline(&self, stream: usize) -> Option<Watched> {
        self.queue(stream)
            .and_then(|q| q.iter().find(|w| w.deadline.is_some()).cloned())
    }

    /// Every watched submission's event.
    pub(super) fn events(&self) -> Vec<Arc<Event>> {
        self.queues
            .iter()
            .flat_map(|(_, q)| q)
            .map(|w| w.event.clone())
            .collect()
    }

    /// The oldest watched submission of `generation` that has a deadline
    /// and was not confirmed good.
    pub(super) fn oldest_with_deadline(&self, generation: u64) -> Option<(&'static str, u64)> {
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
    pub(super) fn mark_good(&mut self, stream: usize, seq: u64) {
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
    pub(super) fn is_good(&self, stream: usize, seq: u64) -> bool {
        self.good.iter().any(|&(s, g)| s == stream && seq <= g)
    }

    /// Forgets every watched submission and every confirmed-good mark (the
    /// pool stays).
    pub(super) fn clear(&mut self) {
        self.queues.clear();
        self.good.clear();
    }

    /// The newest watched event of each stream, with the stream's key.
    pub(super) fn newest_events(&self) -> Vec<(usize, Arc<Event>)> {
        self.queues
            .iter()
            .filter_map(|(s, q)| q.back().map(|w| (*s, w.event.clone())))
            .collect()
    }

    /// The number of watched submissions.
    #[cfg(feature = "bench-internals")]
    pub(super) fn len(&self) -> usize {
        self.queues.iter().map(|(_, q)| q.len()).sum()
    }
}

/// A group open on one thread.
pub(super) struct GroupState {
    pub(super) owner: ThreadId,
    pub(super) depth: usize,
    /// Submissions inside the group, watched from its end.
    pub(super) watch: Vec<GroupedOp>,
}

/// A submission made inside a group.
pub(super) struct GroupedOp {
    pub(super) seq: u64,
    pub(super) op: &'static str,
    pub(super) stream: CUstream,
}

/// Which stream a submission runs on.
#[derive(Clone, Copy)]
pub(super) enum StreamSel {
    Own,
    Caller(CUstream),
}

/// What a submission is, for the flight recorder.
#[derive(Clone, Copy)]
pub(super) struct OpInfo {
    pub(super) op: &'static str,
    pub(super) dtype: DataType,
    pub(super) bytes: usize,
    pub(super) peer: Option<usize>,
}

impl OpInfo {
    /// A collective `op` on the payload `span` (no peer).
    pub(super) fn collective(op: &'static str, span: &Span) -> OpInfo {
        OpInfo {
            op,
            dtype: span.dtype,
            bytes: span.bytes(),
            peer: None,
        }
    }
}

/// Completion events kept for reuse: as many as operations are usually in
/// flight, so that a submission records a pooled event instead of creating
/// one (`cuEventCreate` and `cuEventDestroy` cost a submission more than
/// everything else it does).
const EVENT_POOL_CAP: usize = 4096;

/// Errors NCCL or the driver return for the call's own arguments, before
/// anything is enqueued: they do not poison.
fn is_refusal(e: &nccl_safe::Error) -> bool {
    match e {
        nccl_safe::Error::InvalidArgument { .. } | nccl_safe::Error::Load(_) => true,
        nccl_safe::Error::Nccl(n) => {
            matches!(n.code, NcclCode::InvalidArgument | NcclCode::InvalidUsage)
        }
        nccl_safe::Error::Cuda(c) => {
            c.code == cuda_sys::CUresult::CUDA_ERROR_INVALID_VALUE.0 as i32
        }
        _ => false,
    }
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
    /// Refuses work when shut down, reconnecting or poisoned.
    #[inline]
    pub(super) fn check_usable(&self, op: &'static str) -> Result<()> {
        self.health.check(op, self.rank, self.world_size)
    }

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

    /// Poisons the backend with its first failure (later calls return the
    /// first), aborts the communicator, dumps the flight recorder.
    pub(super) fn poison(&self, op: &'static str, seq: u64, kind: FailureKind) -> Arc<Failure> {
        let state = if kind.is_timeout() {
            OpState::TimedOut
        } else {
            OpState::Failed
        };
        let elsewhere = if kind.is_timeout() && !self.health.is_poisoned() {
            self.census.in_flight_elsewhere()
        } else {
            Vec::new()
        };
        let (failure, first) = self.health.poison(|| Failure {
            op,
            seq,
            rank: self.rank,
            world_size: self.world_size,
            generation: self.generation.load(Ordering::Acquire),
            kind,
            backend: self.census.id(),
            elsewhere,
        });
        if !first {
            return failure;
        }
        self.recorder.set_state(seq, state);
        self.one_shot_abort();
        if let Some(handle) = self.abort.lock().as_ref()
            && let Err(e) = handle.abort()
        {
            tracing::warn!(
                rank = self.rank,
                "aborting the poisoned communicator failed: {e}"
            );
        }
        tracing::error!(
            rank = self.rank,
            world_size = self.world_size,
            "communicator poisoned: {failure}\nrecent operations:\n{}",
            self.recorder.summary(16)
        );
        if let Some(dir) = &self.config.dump_dir {
            let header = DumpHeader {
                rank: self.rank,
                world_size: self.world_size,
                generation: failure.generation,
                reason: failure.to_string(),
                first_failed_seq: Some(seq),
            };
            match self.recorder.dump_json(dir, &header) {
                Ok(path) => tracing::error!(
                    rank = self.rank,
                    "flight recorder dumped to {}",
                    path.display()
                ),
                Err(e) => tracing::warn!(rank = self.rank, "flight recorder dump failed: {e}"),
            }
        }
        failure
    }

    /// Poisons for a failed call of `op`/`seq` and returns its error.
    pub(super) fn fail(&self, op: &'static str, seq: u64, e: nccl_safe::Error) -> CommError {
        CommError::Failed(self.poison(op, seq, FailureKind::from_call(e)))
    }

    pub(super) fn take_event(&self) -> Result<Arc<Event>> {
        if let Some(ev) = self.watched.lock().pooled_event() {
            return Ok(ev);
        }
        self.new_event()
    }

    fn new_event(&self) -> Result<Arc<Event>> {
        Event::new(&self.ctx, false)
            .map(Arc::new)
            .map_err(|source| CommError::Refused {
                op: "event",
                source,
            })
    }

    /// Returns finished events to the pool.
    pub(super) fn recycle(&self, events: impl IntoIterator<Item = Arc<Event>>) {
        self.watched.lock().recycle(events);
    }

    /// Records one completion event on `stream`, after the submissions
    /// `ops` (seq, op; all already enqueued there, oldest first), and hands
    /// each to the watchdog with that event. `deadline: None` is an idle
    /// wait (no timeout). A pooled event is taken, recorded and watched
    /// under one acquisition of the `watched` lock, so no other watch lands
    /// between and a queue's order stays its events' record order (the
    /// watchdog holds that lock only to copy or pop, never across a driver
    /// call, so it waits at most one record). A failed record poisons,
    /// named by the first of `ops`.
    pub(super) fn watch(
        &self,
        stream: CUstream,
        ops: &[(u64, &'static str)],
        deadline: Option<Instant>,
    ) -> Result<Arc<Event>> {
        let mut watched = self.watched.lock();
        let event = match watched.pooled_event() {
            Some(ev) => ev,
            None => {
                // Creating an event is slow: not under the lock.
                drop(watched);
                let ev = self.new_event()?;
                watched = self.watched.lock();
                ev
            }
        };
        // SAFETY: `stream` is the backend's own stream or one the caller
        // vouched for (a `StreamRef`, live until its group's work is
        // watched when grouped), of this context.
        if let Err(e) = unsafe { event.record_raw(stream) } {
            watched.recycle([event]);
            drop(watched);
            let (seq, op) = ops.first().copied().unwrap_or((0, "watch"));
            return Err(self.fail(op, seq, e));
        }
        let generation = self.generation.load(Ordering::Acquire);
        for &(seq, op) in ops {
            watched.push(
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

    /// Submits one operation that no thread waits for by ticket (its
    /// completion is watched, and seen by `synchronize`); returns its
    /// sequence number. See [`Inner::submit_waited`].
    pub(super) fn submit(
        &self,
        info: OpInfo,
        stream: StreamSel,
        idle: bool,
        enqueue: impl FnOnce(&Inner, &mut Slot, CUstream, bool) -> nccl_safe::Result<()>,
    ) -> Result<u64> {
        self.submit_inner(info, stream, idle, false, enqueue)
            .map(|(seq, _)| seq)
    }

    /// Submits one operation: health check, flight-recorder entry, the
    /// enqueue under the slot lock, then the watch. Returns the sequence
    /// number and, unless the work was captured or grouped, its ticket.
    /// `idle`: no deadline (a command receive).
    pub(super) fn submit_waited(
        &self,
        info: OpInfo,
        stream: StreamSel,
        idle: bool,
        enqueue: impl FnOnce(&Inner, &mut Slot, CUstream, bool) -> nccl_safe::Result<()>,
    ) -> Result<(u64, Option<Ticket>)> {
        self.submit_inner(info, stream, idle, true, enqueue)
    }

    /// The submission path. Its host cost is a constant: one clock read
    /// (the recorder's time, the deadline and the blocking call's start all
    /// come from it), the slot, recorder and `watched` locks once each, the
    /// capture query on callers' streams, the enqueue and one
    /// `cuEventRecord`. Asynchronous errors are not asked for here: the
    /// watchdog asks every tick and every wait confirms through its ticket,
    /// so no completion is reported on a failed communicator.
    fn submit_inner(
        &self,
        info: OpInfo,
        stream: StreamSel,
        idle: bool,
        want_ticket: bool,
        enqueue: impl FnOnce(&Inner, &mut Slot, CUstream, bool) -> nccl_safe::Result<()>,
    ) -> Result<(u64, Option<Ticket>)> {
        let op = info.op;
        self.check_usable(op)?;
        let mut slot = self.lock_slot(op)?;
        // Re-check under the lock: a reconnect or shutdown may have finished
        // while this thread waited for it.
        self.check_usable(op)?;
        if slot.comm.is_none() {
            return Err(CommError::Shutdown { op });
        }
        let raw_stream = match stream {
            StreamSel::Own => slot.stream.raw(),
            StreamSel::Caller(s) => s,
        };
        let capturing = match stream {
            StreamSel::Caller(s) => self.is_capturing(s, op)?,
            _ => false,
        };
        let now = Instant::now();
        let since_born_us = self.us_since_born(now);
        let seq = self.recorder.record_at(
            op,
            info.dtype.name(),
            info.bytes,
            raw_stream as u64,
            info.peer,
            self.born_unix_us + since_born_us,
        );
        let enqueued = self.in_nccl(seq, since_born_us, || {
            enqueue(self, &mut slot, raw_stream, capturing)
        });
        if let Err(e) = enqueued {
            if is_refusal(&e) {
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
        if capturing {
            // Captured work runs at graph launch; it is not watched.
            self.recorder.set_state(seq, OpState::Completed);
            return Ok((seq, None));
        }
        if self.in_group(&slot) {
            if let Some(g) = slot.group.as_mut() {
                g.watch.push(GroupedOp {
                    seq,
                    op,
                    stream: raw_stream,
                });
            }
            return Ok((seq, None));
        }
        let comm = if want_ticket {
            match slot.comm.as_ref().map(Comm::abort_handle) {
                Some(c) => Some(c),
                None => return Err(CommError::Shutdown { op }),
            }
        } else {
            None
        };
        let generation = self.generation.load(Ordering::Acquire);
        drop(slot);
        let deadline = (!idle).then(|| now + self.config.collective_timeout);
        let event = self.watch(raw_stream, &[(seq, op)], deadline)?;
        Ok((
            seq,
            comm.map(|comm| Ticket {
                seq,
                event,
                generation,
                comm,
                stream: raw_stream as usize,
            }),
        ))
    }

    /// Microseconds from `born` to now.
    pub(super) fn since_born_us(&self) -> u64 {
        self.us_since_born(Instant::now())
    }

    /// Microseconds from `born` to `at`.
    fn us_since_born(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.born).as_micros() as u64
    }

    /// Runs `f`, which calls NCCL for submission `seq`; on a blocking
    /// communicator the watchdog sees the call while it runs.
    /// `since_born_us`: the call's start, in microseconds after `born`.
    pub(super) fn in_nccl<T>(&self, seq: u64, since_born_us: u64, f: impl FnOnce() -> T) -> T {
        if self.config.enqueue != EnqueueMode::Blocking {
            return f();
        }
        // Two atomics, no lock: the watchdog reads the sequence number, then
        // the start; the op is named from the flight recorder by `seq`.
        self.in_call_since_us
            .store(since_born_us, Ordering::Release);
        self.in_call_seq.store(seq, Ordering::Release);
        let out = f();
        self.in_call_seq.store(0, Ordering::Release);
        out
    }

    pub(super) fn is_capturing(&self, stream: CUstream, op: &'static str) -> Result<bool> {
        // SAFETY: `stream` came from a `StreamRef`, a live stream of this
        // context.
        unsafe { Stream::is_capturing_raw(&self.ctx, stream) }
            .map_err(|source| CommError::Refused { op, source })
    }

    /// Waits for the ticket's event (the completion of its submission),
    /// bounded by the collective timeout unless `idle`, then confirms that
    /// the communicator it ran on did not fail or get aborted meanwhile.
    /// Returns early with an error when the backend is poisoned, shut down
    /// or reconnected.
    pub(super) fn wait(&self, op: &'static str, ticket: &Ticket, idle: bool) -> Result<()> {
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
                .one_shot_failure()
                .map_or(Verdict::Good, Verdict::Failed),
            Err(nccl_safe::Error::Aborted { .. }) => Verdict::Aborted,
            Err(e) => Verdict::Failed(FailureKind::AsyncError(e)),
        };
        match verdict {
            Verdict::Good => {
                self.watched.lock().mark_good(ticket.stream, seq);
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

    /// The error for a submission whose communicator was aborted before the
    /// submission was seen complete: its buffers hold no result.
    pub(super) fn aborted(&self, op: &'static str, ticket: &Ticket) -> CommError {
        if self.health.is_poisoned() {
            return self.own_or_poisoned(op, ticket.seq);
        }
        if self.health.is_shutdown() {
            return CommError::Shutdown { op };
        }
        if self.health.is_reconnecting() {
            return CommError::Reconnecting { op };
        }
        CommError::Aborted {
            op,
            seq: ticket.seq,
            generation: ticket.generation,
        }
    }

    /// `Failed` when `seq` itself is the first failure, else `Poisoned`.
    pub(super) fn own_or_poisoned(&self, op: &'static str, seq: u64) -> CommError {
        match self.health.failure() {
            Some(f) if f.seq == seq => CommError::Failed(f),
            Some(cause) => CommError::Poisoned {
                op,
                rank: self.rank,
                world_size: self.world_size,
                cause,
            },
            None => CommError::Reconnecting { op },
        }
    }

    /// The oldest watched submission of this generation that has a deadline.
    pub(super) fn oldest_pending(&self) -> Option<(&'static str, u64)> {
        let generation = self.generation.load(Ordering::Acquire);
        self.watched.lock().oldest_with_deadline(generation)
    }
}

/// `ncclGroupStart` (`start`) or `ncclGroupEnd`; `ncclInProgress` counts as
/// success (on non-blocking communicators each communicator's next call
/// waits for the group's enqueue).
pub(super) fn nccl_group_call(op: &'static str, start: bool) -> Result<()> {
    let refused = |source| CommError::Refused { op, source };
    let nccl = nccl_sys::nccl().map_err(|e| refused(e.into()))?;
    // SAFETY: group calls take no arguments; NCCL keeps the group state per
    // thread.
    let rc = unsafe {
        if start {
            nccl_sys::call!(nccl, ncclGroupStart())
        } else {
            nccl_sys::call!(nccl, ncclGroupEnd())
        }
    }
    .map_err(|e| refused(e.into()))?;
    let call = if start {
        "ncclGroupStart"
    } else {
        "ncclGroupEnd"
    };
    if rc == nccl_sys::ncclResult_t::ncclInProgress {
        return Ok(());
    }
    nccl_safe::nccl_check(rc, call, std::ptr::null_mut()).map_err(refused)
}
