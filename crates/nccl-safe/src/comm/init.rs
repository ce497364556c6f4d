//! Joining communicators: `init_rank` (blocking and non-blocking with a
//! deadline), `init_all`, `split`, and `into_blocking`.
//!
//! Invariant: every wait here has a deadline; a communicator is torn down only
//! while no peer can have work in flight that waits for this rank.

use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::Duration;

use nccl_sys::{ncclComm_t, ncclResult_t};
use parking_lot::Mutex;

use crate::driver::Context;
use crate::error::{Error, Result, nccl_check};
use crate::memory::{DataType, DeviceBuffer};
use crate::stream::Stream;

use super::*;

pub(super) fn check_rank_args(
    call: &'static str,
    nranks: usize,
    rank: usize,
) -> Result<(i32, i32)> {
    if nranks == 0 || nranks > i32::MAX as usize {
        return Err(Error::invalid(
            call,
            format!("nranks {nranks} out of range"),
        ));
    }
    if rank >= nranks {
        return Err(Error::invalid(
            call,
            format!("rank {rank} is not below nranks {nranks}"),
        ));
    }
    Ok((nranks as i32, rank as i32))
}

impl Comm {
    fn from_raw(
        raw: ncclComm_t,
        ctx: &Arc<Context>,
        rank: usize,
        count: usize,
        device: usize,
        nonblocking: bool,
    ) -> Comm {
        Comm {
            state: Arc::new(Mutex::new(CommState {
                raw,
                status: Status::Live,
            })),
            raw,
            ctx: Arc::clone(ctx),
            rank,
            count,
            device,
            nonblocking,
            enqueue_deadline: Some(ENQUEUE_DEADLINE),
        }
    }

    /// Joins rank `rank` of `nranks` to the communicator `id`
    /// (`ncclCommInitRank`, blocking until every rank joins).
    pub fn init_rank(
        ctx: &Arc<Context>,
        id: &UniqueId,
        nranks: usize,
        rank: usize,
    ) -> Result<Comm> {
        let (n, r) = check_rank_args("ncclCommInitRank", nranks, rank)?;
        ctx.make_current()?;
        let mut raw: ncclComm_t = std::ptr::null_mut();
        // SAFETY: writes one handle through a valid pointer; the device's
        // context is current.
        let rc = unsafe { nccl_raw!(ncclCommInitRank(&mut raw, n, id.raw(), r)) };
        nccl_check(rc, "ncclCommInitRank", raw)?;
        if raw.is_null() {
            return Err(Error::invalid(
                "ncclCommInitRank",
                "NCCL returned no communicator",
            ));
        }
        Ok(Comm::from_raw(raw, ctx, rank, nranks, ctx.ordinal(), false))
    }

    /// Joins like [`Comm::init_rank`] but non-blocking, waiting at most
    /// `timeout`; at the deadline the half-made communicator is aborted and
    /// [`Error::Timeout`] (`"communicator init"`) returned. The communicator
    /// stays non-blocking.
    pub fn init_rank_with_deadline(
        ctx: &Arc<Context>,
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        timeout: Duration,
    ) -> Result<Comm> {
        let (n, r) = check_rank_args("ncclCommInitRankConfig", nranks, rank)?;
        ctx.make_current()?;
        let mut config = default_config();
        config.blocking = 0;
        let mut raw: ncclComm_t = std::ptr::null_mut();
        // SAFETY: writes one handle through a valid pointer; `config` is a
        // valid config that outlives the call; the context is current.
        let rc = unsafe {
            nccl_raw!(ncclCommInitRankConfig(
                &mut raw,
                n,
                id.raw(),
                r,
                &mut config
            ))
        };
        if rc != ncclResult_t::ncclInProgress {
            nccl_check(rc, "ncclCommInitRankConfig", raw)?;
        }
        if raw.is_null() {
            return Err(Error::invalid(
                "ncclCommInitRankConfig",
                "NCCL returned no communicator",
            ));
        }
        let comm = Comm::from_raw(raw, ctx, rank, nranks, ctx.ordinal(), true);
        match wait_shared(
            &comm.state,
            "communicator init",
            "ncclCommInitRankConfig",
            timeout,
        ) {
            Ok(()) => Ok(comm),
            Err(e) => {
                if let Err(abort) = comm.abort() {
                    tracing::warn!(error = %abort, "aborting a failed communicator init failed");
                }
                Err(e)
            }
        }
    }

    /// One communicator per device of this process (`ncclCommInitAll`);
    /// rank `i` uses `devices[i]`.
    pub fn init_all(devices: &[usize]) -> Result<Vec<Comm>> {
        if devices.is_empty() || devices.len() > i32::MAX as usize {
            return Err(Error::invalid(
                "ncclCommInitAll",
                format!("{} devices", devices.len()),
            ));
        }
        let ctxs = devices
            .iter()
            .map(|&d| Context::new(d))
            .collect::<Result<Vec<_>>>()?;
        let devlist: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
        let mut raws: Vec<ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        ctxs[0].make_current()?;
        let n = devices.len() as i32;
        // SAFETY: `raws` has room for `n` handles and `devlist` holds `n`
        // ordinals, both outliving the call.
        let rc = unsafe { nccl_raw!(ncclCommInitAll(raws.as_mut_ptr(), n, devlist.as_ptr())) };
        nccl_check(rc, "ncclCommInitAll", std::ptr::null_mut())?;
        let comms: Vec<Comm> = raws
            .iter()
            .zip(&ctxs)
            .zip(devices)
            .enumerate()
            .filter(|(_, ((raw, _), _))| !raw.is_null())
            .map(|(i, ((&raw, ctx), &d))| Comm::from_raw(raw, ctx, i, devices.len(), d, false))
            .collect();
        if comms.len() != devices.len() {
            return Err(Error::invalid(
                "ncclCommInitAll",
                "NCCL returned fewer communicators than devices",
            ));
        }
        Ok(comms)
    }

    /// Splits the communicator (`ncclCommSplit`, called by every rank):
    /// ranks with the same `color` form a new communicator, ordered by `key`
    /// then old rank. `None` takes part without joining and gives `Ok(None)`.
    /// On a non-blocking communicator it waits (up to 60 s) until NCCL has
    /// made the new communicator, which it does after the call returns.
    pub fn split(&self, color: Option<i32>, key: i32) -> Result<Option<Comm>> {
        const CALL: &str = "ncclCommSplit";
        let c = match color {
            Some(c) if c < 0 => {
                return Err(Error::invalid(CALL, format!("color {c} is negative")));
            }
            Some(c) => c,
            None => nccl_sys::NCCL_SPLIT_NOCOLOR,
        };
        let mut config = default_config();
        if self.nonblocking {
            config.blocking = 0;
        }
        // NCCL stores the new communicator when its set-up ends. Under a
        // non-blocking parent that is on a background thread, after the call
        // has returned (NCCL 2.28 returns `ncclSuccess` with the handle still
        // NULL, the parent in progress until then): the handle's slot lives
        // on the heap and is leaked if the split does not settle, so a late
        // store never lands in freed memory.
        let slot = Box::new(AtomicPtr::<nccl_sys::ncclComm>::new(std::ptr::null_mut()));
        let settled = self
            .enqueue(CALL, |lib, comm| {
                // SAFETY: `comm` is live (checked by enqueue); `slot` stays
                // valid for NCCL's store (freed only once the split settled);
                // `config` outlives the call.
                unsafe {
                    nccl_sys::call!(lib, ncclCommSplit(comm, c, key, slot.as_ptr(), &mut config))
                }
            })
            .and_then(|()| {
                if self.nonblocking {
                    wait_shared(&self.state, "communicator split", CALL, SPLIT_DEADLINE)
                } else {
                    Ok(())
                }
            });
        if let Err(e) = settled {
            std::mem::forget(slot);
            return Err(e);
        }
        let raw: ncclComm_t = slot.load(Ordering::Acquire);
        if raw.is_null() {
            return if color.is_none() {
                Ok(None)
            } else {
                Err(Error::invalid(CALL, "NCCL returned no communicator"))
            };
        }
        let mut child = Comm::from_raw(raw, &self.ctx, 0, 0, self.device, self.nonblocking);
        let finish = |child: &mut Comm| -> Result<()> {
            if child.nonblocking {
                wait_shared(&child.state, "communicator split", CALL, SPLIT_DEADLINE)?;
            }
            let (mut rank, mut count) = (0i32, 0i32);
            // SAFETY: the new communicator is live; each call writes one int.
            let rc = unsafe { nccl_raw!(ncclCommUserRank(child.raw, &mut rank)) };
            nccl_check(rc, "ncclCommUserRank", child.raw)?;
            // SAFETY: as above.
            let rc = unsafe { nccl_raw!(ncclCommCount(child.raw, &mut count)) };
            nccl_check(rc, "ncclCommCount", child.raw)?;
            child.rank = usize::try_from(rank).unwrap_or(0);
            child.count = usize::try_from(count).unwrap_or(0);
            Ok(())
        };
        match finish(&mut child) {
            Ok(()) => Ok(Some(child)),
            Err(e) => {
                if let Err(abort) = child.abort() {
                    tracing::warn!(error = %abort, "aborting a failed split communicator failed");
                }
                Err(e)
            }
        }
    }

    /// Turns a non-blocking communicator into a blocking one over the same
    /// ranks (every rank calls this). A blocking communicator enqueues on
    /// the calling thread; on a non-blocking one NCCL starts a thread for
    /// every call, tens of microseconds per eager operation. The price is
    /// that calls on the blocking communicator have no deadline of their
    /// own.
    ///
    /// Rank 0 draws a fresh unique id and broadcasts it over this
    /// communicator (which also shows that every rank got here); every rank
    /// then finalizes and destroys this communicator (within
    /// [`DROP_DEADLINE`]; no rank can issue work on the new communicator
    /// before all have joined it, so no peer's GPU is waiting for this rank
    /// while NCCL unmaps the buffers it shares with it). Then every rank
    /// joins a blocking communicator with the id on a helper thread and
    /// makes NCCL connect it there (all-reduces at three sizes and, with two
    /// ranks, a send/recv with the peer), so that no later call sets up a
    /// connection inside a CUDA graph capture. The exchange and the join are
    /// bounded by `timeout`: on a miss, this communicator (while the
    /// exchange runs) or the blocking one (once its init has returned; its
    /// connection work may be on the GPU) is aborted and [`Error::Timeout`]
    /// is returned. A rank that dies after the broadcast leaves its peers'
    /// helper threads blocked inside `ncclCommInitRank` until NCCL gives up
    /// (each aborts its communicator itself when it returns); the callers
    /// still get their error at the deadline. A blocking communicator is
    /// returned as it is.
    pub fn into_blocking(mut self, timeout: Duration) -> Result<Comm> {
        const WHAT: &str = "blocking communicator init";
        if !self.nonblocking {
            return Ok(self);
        }
        let start = std::time::Instant::now();
        self.set_enqueue_deadline(Some(timeout));
        let timed_out = |e: Error| match e {
            Error::Timeout { .. } => Error::Timeout {
                what: WHAT,
                after: timeout,
            },
            other => other,
        };
        // Declared before the exchange so that, on a failure, they are
        // dropped only after the abort has ended a broadcast still running.
        let stream = Stream::new(&self.ctx)?;
        let mut buf = DeviceBuffer::<u8>::alloc(&self.ctx, 128)?;
        let id = match self.share_unique_id(&stream, &mut buf, timeout) {
            Ok(id) => id,
            Err(e) => {
                if let Err(abort) = self.abort() {
                    tracing::warn!(error = %abort, "aborting after a failed id exchange failed");
                }
                return Err(timed_out(e));
            }
        };
        // Every rank has waited for the broadcast, so no work of this
        // communicator is in flight anywhere. Tear it down now, before any
        // rank can join the blocking communicator and issue work on it:
        // NCCL's teardown unmaps buffers that the peers' GPUs can access,
        // which waits for those GPUs, and a peer already running a kernel
        // that waits for this rank never goes idle
        // (docs/decisions/0003-teardown-before-blocking-join.md).
        drop(buf);
        drop(stream);
        self.finalize_and_destroy()?;
        let (ctx, nranks, rank) = (Arc::clone(&self.ctx), self.count, self.rank);
        let (tx, rx) = mpsc::channel();
        // The blocking communicator's abort handle once its init returns,
        // or `GaveUp` once the caller's deadline has passed: whichever
        // comes second aborts it, so that connection work stuck on the GPU
        // never outlives the deadline (a peer's teardown would wait for it).
        let pending = Arc::new(Mutex::new(Pending::Waiting));
        let helper_pending = Arc::clone(&pending);
        std::thread::Builder::new()
            .name("nccl-blocking-init".into())
            .spawn(move || {
                let comm = Comm::init_rank(&ctx, &id, nranks, rank).and_then(|c| {
                    let handle = c.abort_handle();
                    let gave_up = {
                        let mut p = helper_pending.lock();
                        let gave_up = matches!(*p, Pending::GaveUp);
                        *p = Pending::Joined(handle.clone());
                        gave_up
                    };
                    if gave_up {
                        handle.abort()?;
                    }
                    c.connect_now()?;
                    Ok(c)
                });
                // A communicator nobody waits for any more is dropped here.
                if let Err(mpsc::SendError(Ok(late))) = tx.send(comm) {
                    drop(late);
                }
            })
            .map_err(|e| Error::invalid(WHAT, format!("spawning the init thread: {e}")))?;
        match rx.recv_timeout(timeout.saturating_sub(start.elapsed())) {
            Ok(comm) => comm,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let joined = std::mem::replace(&mut *pending.lock(), Pending::GaveUp);
                if let Pending::Joined(handle) = joined
                    && let Err(abort) = handle.abort()
                {
                    tracing::warn!(error = %abort, "aborting a blocking communicator stuck connecting failed");
                }
                Err(Error::Timeout {
                    what: WHAT,
                    after: timeout,
                })
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(Error::invalid(
                WHAT,
                "the init thread ended without a result",
            )),
        }
    }

    /// Makes NCCL connect this (blocking) communicator now rather than at
    /// the first operation of each kind: all-reduces of 4 B, 64 KiB and
    /// 4 MiB (NCCL's protocols and algorithms change with size) and, with
    /// two ranks, a grouped send/recv with the peer. Connection set-up at
    /// first use happens inside the call on a blocking communicator, where
    /// it waits for the peers without a deadline and, when the caller's
    /// stream is being captured, invalidates the capture.
    fn connect_now(&self) -> Result<()> {
        const ELEMS: [usize; 3] = [1, 16 << 10, 1 << 20];
        let stream = Stream::new(&self.ctx)?;
        let mut buf = DeviceBuffer::<f32>::alloc(&self.ctx, ELEMS[2])?;
        buf.fill_bytes(0)?;
        for n in ELEMS {
            // SAFETY: `buf` holds at least `n` f32 of this context and
            // outlives the wait below; the stream is live.
            unsafe {
                self.all_reduce_raw(
                    buf.device_ptr(),
                    buf.device_ptr(),
                    n,
                    DataType::Float32,
                    ReduceOp::Sum,
                    stream.raw(),
                )?;
            }
        }
        if self.count == 2 {
            let peer = 1 - self.rank;
            let (lo, hi) = (buf.device_ptr(), buf.device_ptr() + 4);
            crate::group(|| {
                // SAFETY: both one-element ranges lie inside `buf`; the
                // stream is live.
                unsafe {
                    self.send_raw(lo, 1, DataType::Float32, peer, stream.raw())?;
                    self.recv_raw(hi, 1, DataType::Float32, peer, stream.raw())
                }
            })?;
        }
        stream.wait_until_idle(ENQUEUE_DEADLINE)?;
        self.async_error()
    }

    /// Rank 0's fresh unique id, broadcast to every rank over this
    /// communicator through `buf` (128 bytes) on `stream`; waits at most
    /// `timeout` for the broadcast.
    fn share_unique_id(
        &self,
        stream: &Stream,
        buf: &mut DeviceBuffer<u8>,
        timeout: Duration,
    ) -> Result<UniqueId> {
        let bytes = if self.rank == 0 {
            *UniqueId::new()?.as_bytes()
        } else {
            [0u8; 128]
        };
        buf.copy_from_host(&bytes)?;
        self.broadcast_in_place(buf, 0, stream)?;
        stream.wait_until_idle(timeout)?;
        self.async_error()?;
        let mut out = [0u8; 128];
        buf.copy_to_host(&mut out)?;
        UniqueId::from_bytes(&out)
    }
}
