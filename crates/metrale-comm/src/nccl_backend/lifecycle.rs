//! A backend's life: starting it (its watchdog), connecting a
//! communicator and learning its ranks' hosts, splitting one, reconnecting,
//! and shutdown in a safe order whatever state the backend is in.
//!
//! Invariants:
//! - The host census runs, or is skipped, alike on every rank (its
//!   condition reads only the world size, never a rank's own settings);
//!   it is one all-reduce of two words per rank (host, path settings) on
//!   the backend's stream, bounded by the init deadline; every rank ends
//!   with the same table (`hosts`), so every rank turns the peer-memory
//!   paths on or off alike, even when the ranks' settings differ. A
//!   set-up exchange that fails leaks its few bytes rather than free them
//!   under an all-reduce still waiting for a peer.
//! - A reconnect aborts before it takes the slot (a thread inside NCCL
//!   holding it is released by the abort, and the one-shot abort word ends
//!   any one-shot kernel), keeps the streams, events, scratch and kernel
//!   (an engine may hold the stream), and drops the old communicator's
//!   registrations. Every connect sets the one-shot path up again over the
//!   new communicator, releasing the old generation's peer buffers first
//!   (`one_shot_setup`: close mappings, barrier, free).
//! - Shutdown: abort first when nothing enqueued can finish (poisoned, or
//!   a command receive still waiting for the root); drain (bounded) every
//!   stream and event the backend's work used; release the one-shot peer
//!   buffers (after a host barrier with the peers, else leaked: they may
//!   still map them); only then deregister and free. Memory
//!   whose work cannot be proven finished is leaked with an error log,
//!   never freed under a kernel. A poisoned backend's shutdown waits for
//!   no peer (it skips the one-shot release barrier) and is bounded by
//!   [`FAILED_SHUTDOWN`], not the shutdown timeout; `Ok` means everything
//!   was released, [`CommError::Leaked`] names what was not and why,
//!   including what a reconnect's release of an earlier generation leaked.

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nccl_safe::{Comm, DataType, DeviceBuffer, Event, ReduceOp, UniqueId};
use parking_lot::Mutex;

use super::hosts::{Hosts, host_id, settings_word};
use super::one_shot::MAX_RANKS;
use super::watch::Pool;
use super::{Inner, NcclBackend, Slot, watchdog};
use crate::backend::Result;
use crate::config::EnqueueMode;
use crate::error::{CommError, FailureKind, Leak, LeakKind};
use crate::health::Health;

/// The shutdown bound of a poisoned backend: it aborts at once and waits
/// for no peer, so what is left is draining its own aborted work.
const FAILED_SHUTDOWN: Duration = Duration::from_millis(800);

impl Inner {
    /// Agrees on a unique id for `generation` and initialises the
    /// communicator into `slot`, bounded by the init timeout.
    pub(super) fn connect(&self, slot: &mut Slot, generation: u64) -> Result<()> {
        let timeout = self.config.init_timeout;
        let Some(rendezvous) = self.rendezvous.as_ref() else {
            return Err(CommError::Unsupported {
                op: "attempt_reconnect",
                reason: "a split backend reconnects by reconnecting its parent and \
                         splitting again"
                    .into(),
            });
        };
        let mut make = || {
            UniqueId::new()
                .map(|id| *id.as_bytes())
                .map_err(|e| e.to_string())
        };
        let bytes = rendezvous.exchange_id(generation, &mut make, timeout)?;
        let id = UniqueId::from_bytes(&bytes).map_err(|e| CommError::setup("unique id", e))?;
        let who = format!(
            "rank {} of {} (generation {generation})",
            self.rank, self.world_size
        );
        let mut comm =
            Comm::init_rank_with_deadline(&self.ctx, &id, self.world_size, self.rank, timeout)
                .map_err(|e| CommError::setup_of("communicator init", who.clone(), e))?;
        if self.config.enqueue == EnqueueMode::Blocking {
            comm = comm
                .into_blocking(timeout)
                .map_err(|e| CommError::setup_of("blocking communicator", who, e))?;
        }
        self.install(slot, comm, generation);
        self.host_census(slot)?;
        self.one_shot_setup(slot)?;
        self.tune(slot)
    }

    /// Makes `comm` this backend's communicator of `generation`.
    pub(super) fn install(&self, slot: &mut Slot, mut comm: Comm, generation: u64) {
        // A call waits for NCCL's background enqueue at most as long as the
        // operation itself may take.
        comm.set_enqueue_deadline(Some(self.config.collective_timeout));
        *self.abort.lock() = Some(comm.abort_handle());
        slot.comm = Some(comm);
        self.generation.store(generation, Ordering::Release);
        // A new communicator's splits count from 1 again, on every rank
        // alike (a reconnect is collective), whatever a failed split left.
        self.splits.store(0, Ordering::Relaxed);
    }

    /// Waits, until `deadline`, for all work the backend enqueued: its own
    /// stream, the last fast path that used the scratch buffer
    /// (possibly on a caller's stream), and every watched submission.
    fn drain(&self, slot: &Slot, deadline: Instant) -> nccl_safe::Result<()> {
        let left = || deadline.saturating_duration_since(Instant::now());
        slot.stream.wait_until_idle(left())?;
        slot.fast.drain(left())?;
        let events: Vec<Arc<Event>> = self.watch.events();
        for ev in events {
            ev.wait_with_deadline(left())?;
        }
        Ok(())
    }

    /// Aborts the communicator (and every one-shot kernel) now, without the
    /// slot lock.
    pub(super) fn abort_now(&self, why: &str) {
        self.one_shot_flags.abort();
        if let Some(handle) = self.abort.lock().as_ref()
            && let Err(e) = handle.abort()
        {
            tracing::warn!(rank = self.rank, "{why}: abort failed: {e}");
        }
    }
}

impl Inner {
    /// Whether this communicator learns its ranks' hosts and settings: a
    /// world the one-shot path (2 to 8 ranks) or the fast path (2) could
    /// serve. It reads only the world size, which every rank shares, never
    /// a rank's own settings, so every rank runs the census or skips it
    /// alike (a rank whose policy rules the paths out still reports it).
    fn needs_census(&self) -> bool {
        (2..=MAX_RANKS).contains(&self.world_size)
    }

    /// What this rank's choice of path depends on besides the world and
    /// the call: every rank must report the same.
    pub(super) fn settings(&self, slot: &Slot) -> String {
        format!(
            "one-shot {:?}; fast path {:?}; scratch {} bytes; add kernel {}; tune {}; tune trials {:?}",
            self.config.one_shot,
            self.config.fast_path,
            self.config.scratch_bytes,
            slot.fast.has_kernel(),
            self.config.tune,
            self.config.tune_trials
        )
    }

    /// Learns every rank's host and path settings over the slot's (new)
    /// communicator, or forgets them where no path could use them.
    pub(super) fn host_census(&self, slot: &mut Slot) -> Result<()> {
        slot.hosts = None;
        if !self.needs_census() {
            return Ok(());
        }
        let deadline = Instant::now() + self.config.init_timeout;
        let own = [host_id(), settings_word(&self.settings(slot))];
        let all = self.gather_words(slot, &own, deadline).map_err(|e| {
            self.abort_now("host census");
            CommError::setup("host census", e)
        })?;
        let (ids, settings): (Vec<u64>, Vec<u64>) = all.iter().map(|w| (w[0], w[1])).unzip();
        let hosts = Hosts::new(ids, &settings);
        if let Some(why) = hosts.peer_paths_off() {
            tracing::info!(
                rank = self.rank,
                world_size = self.world_size,
                "the one-shot and fast paths are off for this communicator: {why}"
            );
        }
        slot.hosts = Some(hosts);
        Ok(())
    }

    /// Every rank's `words` (the same count on every rank), by rank: each
    /// rank's words in its own part of one [`Self::exchange_bytes`],
    /// little-endian.
    pub(super) fn gather_words(
        &self,
        slot: &mut Slot,
        words: &[u64],
        deadline: Instant,
    ) -> nccl_safe::Result<Vec<Vec<u64>>> {
        let n = words.len() * 8;
        let mut mine = vec![0u8; n * self.world_size];
        for (i, w) in words.iter().enumerate() {
            mine[self.rank * n + i * 8..][..8].copy_from_slice(&w.to_le_bytes());
        }
        let all = self.exchange_bytes(slot, &mine, deadline)?;
        Ok(all
            .chunks_exact(n)
            .map(|c| {
                c.chunks_exact(8)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect()
            })
            .collect())
    }

    /// Every rank's `mine` (zero outside the rank's own part) summed
    /// byte-wise: each rank's part, gathered, over one all-reduce of bytes
    /// on the backend's stream (all-reduces are connected at init, so this
    /// makes no connection inside a blocking call), bounded by `deadline`.
    pub(super) fn exchange_bytes(
        &self,
        slot: &mut Slot,
        mine: &[u8],
        deadline: Instant,
    ) -> nccl_safe::Result<Vec<u8>> {
        let buf = DeviceBuffer::<u8>::from_host(&self.ctx, mine)?;
        let left = || deadline.saturating_duration_since(Instant::now());
        // On a non-blocking communicator the enqueue itself waits for the
        // peers (NCCL connects at a peer's first operation): bounded by
        // this deadline too, not the collective timeout.
        let comm = slot.comm.as_mut().ok_or(nccl_safe::Error::Aborted {
            call: "set-up exchange",
        })?;
        let usual = comm.enqueue_deadline();
        comm.set_enqueue_deadline(Some(left()));
        let comm = &*comm;
        let stream = slot.stream.raw();
        // SAFETY: the buffer holds `mine.len()` bytes of this context; our
        // own stream.
        let done = unsafe {
            comm.all_reduce_raw(
                buf.device_ptr(),
                buf.device_ptr(),
                mine.len(),
                DataType::Uint8,
                ReduceOp::Sum,
                stream,
            )
        }
        .and_then(|()| slot.stream.wait_until_idle(left()))
        .and_then(|()| comm.async_error());
        if let Some(comm) = slot.comm.as_mut() {
            comm.set_enqueue_deadline(usual);
        }
        if let Err(e) = done {
            // The all-reduce may still be waiting for a peer that never
            // came: freeing its buffer would wait for the whole device,
            // past any deadline, before the caller's abort could end it.
            tracing::warn!(
                rank = self.rank,
                bytes = mine.len(),
                "set-up exchange failed ({e}): its buffer is leaked, not freed under it"
            );
            std::mem::forget(buf);
            return Err(e);
        }
        buf.to_host_vec()
    }
}

impl NcclBackend {
    /// Starts the watchdog of a connected backend.
    pub(super) fn start(inner: Arc<Inner>) -> Result<NcclBackend> {
        let weak = Arc::downgrade(&inner);
        let rank = inner.rank;
        let thread = std::thread::Builder::new()
            .name(format!("metrale-watchdog-r{rank}"))
            .spawn(move || watchdog::watchdog_loop(weak))
            .map_err(|e| CommError::Thread {
                what: "watchdog",
                source: Arc::new(e),
            })?;
        tracing::info!(
            rank,
            world_size = inner.world_size,
            device = inner.config.device,
            "NCCL backend ready"
        );
        Ok(NcclBackend {
            inner,
            watchdog: Mutex::new(Some(thread)),
        })
    }

    /// See [`crate::CommBackend::split`]. The sub-communicator has the
    /// one-shot path as its parent has (its group meets in the parent's
    /// store, [`crate::rendezvous::Rendezvous::group`]); it does not
    /// reconnect by itself: the parent reconnects and splits again.
    pub fn split_backend(&self, color: Option<u32>, key: usize) -> Result<Option<NcclBackend>> {
        const OP: &str = "split";
        let inner = &*self.inner;
        let (color, key) = crate::validate::split(OP, color, key)?;
        inner.check_usable(OP)?;
        let slot = inner.lock_slot(OP)?;
        inner.refuse_in_group(&slot, OP)?;
        let comm = slot
            .comm(OP)
            .map_err(|source| CommError::Refused { op: OP, source })?;
        let seq = inner.recorder.record(OP, "-", 0, 0, None);
        // Every rank splits in the same order (NCCL requires it), so the
        // count and the generation name the sub-communicator's group alike
        // on all its ranks.
        let group = format!(
            "split-{}.{}-c{}",
            inner.generation.load(Ordering::Acquire),
            inner.splits.fetch_add(1, Ordering::Relaxed) + 1,
            color.unwrap_or(-1)
        );
        let child = inner
            .calls
            .inside(seq, inner.calls.now_us(), || comm.split(color, key));
        drop(slot);
        let child = match child {
            Ok(Some(child)) => child,
            Ok(None) => return Ok(None),
            Err(e) if e.is_nccl(nccl_safe::NcclCode::InvalidArgument) => {
                return Err(CommError::Refused { op: OP, source: e });
            }
            Err(e) => return Err(inner.fail(OP, seq, e)),
        };
        let (rank, world) = (child.rank(), child.count());
        // The group's own rendezvous in the parent's store, for the one-shot
        // path's release barrier. A rank without one still takes part in
        // the set-up's exchanges (with a failed record), so the ranks'
        // collectives match.
        let store = inner.store.as_ref().and_then(|rv| {
            rv.group(&group, rank, world)
                .map(Arc::from)
                .inspect_err(|e| tracing::warn!(rank = inner.rank, "split: {e}"))
                .ok()
        });
        let child_inner = Inner::new(
            inner.config.clone(),
            (rank, world),
            None,
            store,
            Some(inner.ctx.clone()),
        )?;
        {
            let mut slot = child_inner.slot.lock();
            slot.fast
                .ensure_scratch(&child_inner.ctx, world, &child_inner.config)
                .map_err(|e| CommError::setup("fast-path scratch buffer", e))?;
            child_inner.install(&mut slot, child, 0);
            child_inner.host_census(&mut slot)?;
            child_inner.one_shot_setup(&mut slot)?;
            child_inner.tune(&mut slot)?;
        }
        NcclBackend::start(child_inner).map(Some)
    }

    pub(super) fn reconnect(&self) -> Result<()> {
        const OP: &str = "attempt_reconnect";
        let inner = &*self.inner;
        if inner.health.is_shutdown() {
            return Err(CommError::Shutdown { op: OP });
        }
        if inner.rendezvous.is_none() {
            return Err(CommError::Unsupported {
                op: OP,
                reason: "a split backend reconnects by reconnecting its parent and \
                         splitting again"
                    .into(),
            });
        }
        if !inner.health.begin_reconnect() {
            return Err(CommError::Reconnecting { op: OP });
        }
        struct EndReconnect<'a>(&'a Health);
        impl Drop for EndReconnect<'_> {
            fn drop(&mut self) {
                self.0.end_reconnect();
            }
        }
        let _end = EndReconnect(&inner.health);
        // Abort first, without the slot lock: a thread inside NCCL holding the
        // lock is released by the abort, a one-shot kernel by its abort word.
        inner.one_shot_flags.abort();
        if let Some(handle) = inner.abort.lock().take()
            && let Err(e) = handle.abort()
        {
            tracing::warn!(rank = inner.rank, "abort before reconnect failed: {e}");
        }
        let mut slot = inner.slot.lock();
        drop(slot.comm.take());
        if !slot.registered.is_empty() {
            tracing::warn!(
                rank = inner.rank,
                count = slot.registered.len(),
                "registrations die with the old communicator; register again"
            );
            slot.registered.clear();
        }
        let next = inner.generation.load(Ordering::Acquire) + 1;
        // The streams, events, scratch and kernel stay: the abort ended the
        // old communicator's kernels, the scratch's next user waits for its
        // last one, and an engine may hold `stream()`.
        if slot.group.take().is_some() {
            inner.group_closed.notify_all();
        }
        inner.watch.clear(Pool::Drop);
        if let Err(e) = inner.connect(&mut slot, next) {
            drop(slot);
            // No communicator is left: make every later call say why.
            let seq = inner.recorder.last_seq();
            inner.health.clear();
            inner.poison(OP, seq, FailureKind::Reconnect(Box::new(e.clone())));
            return Err(e);
        }
        inner.health.clear();
        tracing::info!(
            rank = inner.rank,
            generation = next,
            "communicator reconnected"
        );
        Ok(())
    }

    pub(super) fn shut_down(&self) -> Result<()> {
        let inner = &*self.inner;
        if !inner.health.begin_shutdown() {
            return Ok(());
        }
        // After a failure nothing waits for a peer: the bound is short.
        let failed = inner.health.is_poisoned();
        let timeout = if failed {
            inner.config.shutdown_timeout.min(FAILED_SHUTDOWN)
        } else {
            inner.config.shutdown_timeout
        };
        let deadline = Instant::now() + timeout;
        let mut aborted = false;
        let mut timed_out = false;
        // A command receive left enqueued completes only when the root sends
        // its next command; a poisoned communicator completes nothing: abort
        // both at once, so that the streams drain.
        let idle_left = inner
            .idle_pending
            .lock()
            .as_ref()
            .is_some_and(|ev| !matches!(ev.query(), Ok(true)));
        if idle_left || failed {
            inner.abort_now("shutdown");
            aborted = true;
        }
        // A thread inside a blocking NCCL call holds the slot; an abort makes
        // NCCL return.
        let mut slot = match inner.slot.try_lock_until(deadline) {
            Some(slot) => slot,
            None => {
                timed_out = true;
                inner.abort_now("shutdown");
                aborted = true;
                match inner.slot.try_lock_for(timeout) {
                    Some(slot) => slot,
                    None => {
                        tracing::error!(
                            rank = inner.rank,
                            "shutdown: a thread stays inside NCCL after the abort; \
                             the backend's memory is left allocated"
                        );
                        self.join_watchdog();
                        return Err(CommError::Refused {
                            op: "shutdown",
                            source: nccl_safe::Error::Timeout {
                                what: "the communicator lock after abort",
                                after: timeout,
                            },
                        });
                    }
                }
            }
        };
        let mut drained = inner.drain(&slot, deadline);
        if drained.is_err() && !aborted {
            timed_out = true;
            tracing::warn!(
                rank = inner.rank,
                "shutdown: work did not drain within {timeout:?}; aborting the communicator"
            );
            inner.abort_now("shutdown");
            aborted = true;
            drained = inner.drain(&slot, Instant::now() + timeout);
        }
        let result = match drained {
            Ok(()) => {
                let mut leaks = std::mem::take(&mut slot.leaked);
                leaks.extend(inner.one_shot_release(&mut slot, deadline));
                if !aborted && let Some(comm) = slot.comm.take() {
                    for handle in std::mem::take(&mut slot.registered).into_keys() {
                        // SAFETY: each handle came from `register_raw` on this
                        // communicator and is deregistered once, after its
                        // work drained.
                        if let Err(e) = unsafe { comm.deregister_raw(handle as *mut c_void) } {
                            tracing::warn!(rank = inner.rank, "shutdown: deregister failed: {e}");
                        }
                    }
                }
                slot.symmetric.clear();
                slot.fast.free();
                if !leaks.is_empty() {
                    Err(CommError::Leaked {
                        op: "shutdown",
                        leaks,
                    })
                } else if timed_out {
                    Err(CommError::Refused {
                        op: "shutdown",
                        source: nccl_safe::Error::Timeout {
                            what: "enqueued work to drain",
                            after: timeout,
                        },
                    })
                } else {
                    Ok(())
                }
            }
            Err(e) => {
                // Memory whose work cannot be proven finished is leaked, not
                // freed under a kernel that may still use it (a free would
                // also wait for that kernel).
                let why = format!("work did not drain after the abort ({e})");
                let symmetric = std::mem::take(&mut slot.symmetric);
                let scratch = slot.fast.leak();
                tracing::error!(
                    rank = inner.rank,
                    symmetric = symmetric.len(),
                    scratch,
                    "shutdown: {why}; leaking the backend's device memory"
                );
                let mut leaks = std::mem::take(&mut slot.leaked);
                if !symmetric.is_empty() {
                    let bytes = symmetric.values().map(|b| b.bytes()).sum();
                    leaks.push(Leak::new(LeakKind::SymmetricMemory, bytes, why.clone()));
                }
                if scratch {
                    leaks.push(Leak::new(LeakKind::Scratch, 0, why.clone()));
                }
                for (_, buf) in symmetric {
                    std::mem::forget(buf);
                }
                leaks.extend(inner.one_shot_leak(&mut slot, &why));
                if leaks.is_empty() {
                    Err(CommError::Refused {
                        op: "shutdown",
                        source: e,
                    })
                } else {
                    Err(CommError::Leaked {
                        op: "shutdown",
                        leaks,
                    })
                }
            }
        };
        slot.registered.clear();
        slot.comm = None;
        if slot.group.take().is_some() {
            inner.group_closed.notify_all();
        }
        inner.abort.lock().take();
        drop(slot);
        inner.watch.clear(Pool::Keep);
        self.join_watchdog();
        result
    }

    fn join_watchdog(&self) {
        if let Some(handle) = self.watchdog.lock().take()
            && handle.join().is_err()
        {
            tracing::warn!(rank = self.inner.rank, "watchdog thread panicked");
        }
    }
}
