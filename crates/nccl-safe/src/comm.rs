//! NCCL communicators: unique ids, initialisation, abort, and collectives.
//!
//! Invariants:
//! - A [`Comm`] and its [`AbortHandle`]s share one small lock over the raw
//!   handle and its status (live, aborted, destroyed). Abort and destroy take
//!   the lock, so an abort never touches a destroyed communicator; after an
//!   abort every call is refused with [`Error::Aborted`] without calling NCCL,
//!   and drop neither finalizes nor destroys.
//! - Collectives check lengths, counts, roots, peers, contexts and the status
//!   before NCCL sees them, and do not hold the lock while inside NCCL (NCCL
//!   allows `ncclCommAbort` from another thread during an operation).
//! - On a non-blocking communicator, `ncclInProgress` from a call means
//!   "being enqueued": the call polls `ncclCommGetAsyncError` (with a
//!   deadline) until it is no longer in progress, and every call first waits
//!   for earlier pending work the same way.
//! - Every host wait has a deadline; drop finalizes within
//!   [`DROP_DEADLINE`] or aborts instead, logging errors and never panicking.

use std::fmt;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cuda_sys::{CUstream, LoadError};
use nccl_sys::{Nccl, ncclComm_t, ncclConfig_t, ncclRedOp_t, ncclResult_t, ncclUniqueId};
use parking_lot::Mutex;

use crate::driver::Context;
use crate::error::{Error, Result, nccl_check, nccl_lib};
use crate::memory::{DataType, DeviceBuffer, Element};
use crate::stream::{Stream, poll_until};

/// How long a call on a non-blocking communicator waits for NCCL to finish
/// enqueueing earlier work (`ncclInProgress`) before giving up.
pub const ENQUEUE_DEADLINE: Duration = Duration::from_secs(30);

/// The call named by errors that are the communicator's asynchronous error
/// (see [`Error::is_async`]).
pub const ASYNC_ERROR_CALL: &str = "ncclCommGetAsyncError";

/// How long dropping a communicator waits for `ncclCommFinalize` before it
/// aborts the communicator instead.
pub const DROP_DEADLINE: Duration = Duration::from_secs(10);

/// How long a non-blocking split waits for the new communicator.
const SPLIT_DEADLINE: Duration = Duration::from_secs(60);

/// NCCL's `NCCL_CONFIG_UNDEF_INT`.
const UNDEF_INT: i32 = i32::MIN;

/// `NCCL_CONFIG_INITIALIZER`: every field undefined (NCCL's defaults).
pub fn default_config() -> ncclConfig_t {
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: nccl_sys::NCCL_VERSION_CODE,
        blocking: UNDEF_INT,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
    }
}

/// An NCCL unique id: the 128 bytes every rank of a communicator shares.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId([u8; 128]);

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId({}…)", &self.to_hex()[..16])
    }
}

impl UniqueId {
    /// A fresh id from `ncclGetUniqueId`.
    pub fn new() -> Result<UniqueId> {
        let mut raw = ncclUniqueId::default();
        // SAFETY: writes one ncclUniqueId through a valid pointer.
        let rc = unsafe { nccl_raw!(ncclGetUniqueId(&mut raw)) };
        nccl_check(rc, "ncclGetUniqueId", std::ptr::null_mut())?;
        Ok(UniqueId(raw.internal.map(|c| c as u8)))
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.0
    }

    /// An id from exactly 128 bytes.
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        let bytes: [u8; 128] = b.try_into().map_err(|_| {
            Error::invalid(
                "UniqueId::from_bytes",
                format!("expected 128 bytes, got {}", b.len()),
            )
        })?;
        Ok(UniqueId(bytes))
    }

    /// The id as 256 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        use fmt::Write;
        let mut s = String::with_capacity(256);
        for b in self.0 {
            let _ = write!(s, "{b:02x}");
        }
        s
    }

    /// An id from 256 hex digits (either case).
    pub fn from_hex(s: &str) -> Result<UniqueId> {
        let s = s.trim();
        if s.len() != 256 || !s.is_ascii() {
            return Err(Error::invalid(
                "UniqueId::from_hex",
                format!(
                    "expected 256 hex digits, got {} characters",
                    s.chars().count()
                ),
            ));
        }
        let mut out = [0u8; 128];
        for (i, byte) in out.iter_mut().enumerate() {
            let pair = &s[2 * i..2 * i + 2];
            *byte = u8::from_str_radix(pair, 16).map_err(|_| {
                Error::invalid(
                    "UniqueId::from_hex",
                    format!("`{pair}` at offset {} is not hex", 2 * i),
                )
            })?;
        }
        Ok(UniqueId(out))
    }

    /// The id in NCCL's layout.
    pub fn raw(&self) -> ncclUniqueId {
        ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

/// A reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Average (sum divided by the rank count).
    Avg,
}

impl ReduceOp {
    /// NCCL's code for the operator.
    pub fn to_raw(self) -> ncclRedOp_t {
        match self {
            ReduceOp::Sum => ncclRedOp_t::ncclSum,
            ReduceOp::Prod => ncclRedOp_t::ncclProd,
            ReduceOp::Max => ncclRedOp_t::ncclMax,
            ReduceOp::Min => ncclRedOp_t::ncclMin,
            ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        }
    }

    /// A short name (`"sum"`, `"prod"`, `"max"`, `"min"`, `"avg"`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Live,
    Aborted,
    Destroyed,
}

/// The raw handle and its status, shared by a [`Comm`] and its abort
/// handles.
struct CommState {
    raw: ncclComm_t,
    status: Status,
}

// SAFETY: the handle is only used under the state's lock or by the owning
// Comm, and NCCL allows ncclCommAbort / ncclCommGetAsyncError from any thread.
unsafe impl Send for CommState {}

type Shared = Arc<Mutex<CommState>>;

/// Aborts the communicator if it is live; nothing otherwise.
fn abort_shared(state: &Mutex<CommState>, ctx: &Context) -> Result<()> {
    let mut st = state.lock();
    if st.status != Status::Live {
        return Ok(());
    }
    st.status = Status::Aborted;
    let raw = st.raw;
    if let Err(e) = ctx.make_current() {
        tracing::warn!(error = %e, "making the context current before abort failed");
    }
    // SAFETY: the status was Live under the lock, so `raw` is a live
    // communicator; NCCL allows abort during an operation on another thread.
    let rc = unsafe { nccl_raw!(ncclCommAbort(raw)) };
    if rc == ncclResult_t::ncclInProgress {
        return Ok(());
    }
    nccl_check(rc, "ncclCommAbort", std::ptr::null_mut())
}

/// One poll of `ncclCommGetAsyncError` under the lock; `Aborted` when the
/// communicator is no longer live.
fn async_state(state: &Mutex<CommState>, call: &'static str) -> Result<ncclResult_t> {
    let st = state.lock();
    if st.status != Status::Live {
        return Err(Error::Aborted { call });
    }
    let mut result = ncclResult_t::ncclSuccess;
    // SAFETY: live under the lock; writes one result through a valid pointer.
    let rc = unsafe { nccl_raw!(ncclCommGetAsyncError(st.raw, &mut result)) };
    nccl_check(rc, "ncclCommGetAsyncError", st.raw)?;
    Ok(result)
}

/// Polls until the communicator is no longer `ncclInProgress`: `Ok` on
/// success, the NCCL error, `Aborted`, or `Timeout { what }` at the deadline.
fn wait_shared(
    state: &Mutex<CommState>,
    what: &'static str,
    call: &'static str,
    timeout: Duration,
) -> Result<()> {
    poll_until(what, timeout, || {
        let r = async_state(state, call)?;
        if r == ncclResult_t::ncclSuccess {
            Ok(true)
        } else if r == ncclResult_t::ncclInProgress {
            Ok(false)
        } else {
            // The communicator's asynchronous error, seen while waiting: it
            // is reported as such (`Error::is_async`), not as `call`'s own.
            // NCCL's error text is read under the lock, from the
            // communicator only while it is live.
            let st = state.lock();
            let raw = if st.status == Status::Live {
                st.raw
            } else {
                std::ptr::null_mut()
            };
            nccl_check(r, ASYNC_ERROR_CALL, raw).map(|()| true)
        }
    })
}

/// An NCCL communicator: one rank's membership in a group of ranks.
///
/// `Send` but not `Sync`: NCCL forbids concurrent calls on one communicator.
/// Use [`Comm::abort_handle`] to abort from another thread.
pub struct Comm {
    state: Shared,
    raw: ncclComm_t,
    ctx: Arc<Context>,
    rank: usize,
    count: usize,
    device: usize,
    nonblocking: bool,
    /// How long a call waits for NCCL to finish enqueueing on a non-blocking
    /// communicator; `None`: until done or aborted.
    enqueue_deadline: Option<Duration>,
}

// SAFETY: a communicator may be used from any thread, one at a time; the raw
// pointer field keeps Comm !Sync, so one thread at a time is what it gets.
unsafe impl Send for Comm {}

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Comm")
            .field("rank", &self.rank)
            .field("count", &self.count)
            .field("device", &self.device)
            .field("nonblocking", &self.nonblocking)
            .field("status", &self.state.lock().status)
            .finish()
    }
}

/// Where `Comm::into_blocking`'s helper thread stands, shared with the
/// caller waiting for it.
enum Pending {
    /// `ncclCommInitRank` has not returned yet.
    Waiting,
    /// The blocking communicator exists; this aborts it.
    Joined(AbortHandle),
    /// The caller's deadline passed.
    GaveUp,
}

/// Aborts a [`Comm`] from any thread.
#[derive(Clone)]
pub struct AbortHandle {
    state: Shared,
    ctx: Arc<Context>,
}

impl fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AbortHandle")
            .field("status", &self.state.lock().status)
            .finish()
    }
}

impl AbortHandle {
    /// Aborts the communicator (`ncclCommAbort`); idempotent, and a no-op
    /// once the communicator was dropped.
    pub fn abort(&self) -> Result<()> {
        abort_shared(&self.state, &self.ctx)
    }

    /// True once the communicator was aborted.
    pub fn is_aborted(&self) -> bool {
        self.state.lock().status == Status::Aborted
    }

    /// The communicator's asynchronous error, as [`Comm::async_error`]
    /// answers it, from any thread (NCCL allows `ncclCommGetAsyncError`
    /// concurrently with calls on the communicator): `Ok` for success and
    /// in-progress, the NCCL error otherwise, and [`Error::Aborted`] once the
    /// communicator was aborted or dropped.
    pub fn async_error(&self) -> Result<()> {
        let st = self.state.lock();
        if st.status != Status::Live {
            return Err(Error::Aborted {
                call: ASYNC_ERROR_CALL,
            });
        }
        let mut result = ncclResult_t::ncclSuccess;
        // SAFETY: live under the lock, which is held until NCCL's error text
        // is read below; writes one result through a valid pointer.
        let rc = unsafe { nccl_raw!(ncclCommGetAsyncError(st.raw, &mut result)) };
        nccl_check(rc, "ncclCommGetAsyncError", st.raw)?;
        if result == ncclResult_t::ncclInProgress {
            return Ok(());
        }
        nccl_check(result, ASYNC_ERROR_CALL, st.raw)
    }
}

fn check_rank_args(call: &'static str, nranks: usize, rank: usize) -> Result<(i32, i32)> {
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
        let mut raw: ncclComm_t = std::ptr::null_mut();
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: `comm` is live (checked by enqueue); writes one handle
            // through a valid pointer; `config` outlives the call.
            unsafe { nccl_sys::call!(lib, ncclCommSplit(comm, c, key, &mut raw, &mut config)) }
        })?;
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
        // that waits for this rank never goes idle. (With the teardown after
        // the join, two H200s in one process left one rank inside this
        // function past its deadline while its peer ran its first
        // collective.)
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

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The device ordinal this rank uses.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The context of this rank's device.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw handle (owned by this value; invalid after an abort).
    pub fn raw(&self) -> ncclComm_t {
        self.raw
    }

    /// True for a non-blocking communicator ([`Comm::init_rank_with_deadline`]).
    pub fn is_nonblocking(&self) -> bool {
        self.nonblocking
    }

    /// The communicator's asynchronous error (`ncclCommGetAsyncError`):
    /// `Ok` for success and in-progress, the NCCL error otherwise, and
    /// [`Error::Aborted`] after an abort.
    pub fn async_error(&self) -> Result<()> {
        let r = async_state(&self.state, ASYNC_ERROR_CALL)?;
        if r == ncclResult_t::ncclInProgress {
            return Ok(());
        }
        nccl_check(r, ASYNC_ERROR_CALL, self.raw)
    }

    /// NCCL's last error text (`ncclGetLastError`).
    pub fn last_error(&self) -> String {
        let st = self.state.lock();
        if st.status != Status::Live {
            return "the communicator was aborted".to_owned();
        }
        let Ok(lib) = nccl_lib() else {
            return String::new();
        };
        // SAFETY: the communicator is live under the lock.
        match unsafe { nccl_sys::call!(lib, ncclGetLastError(st.raw)) } {
            // SAFETY: NCCL returns null or a NUL-terminated string it owns.
            Ok(p) => unsafe { crate::error::c_string(p) }.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// Aborts the communicator (`ncclCommAbort`); idempotent.
    pub fn abort(&self) -> Result<()> {
        abort_shared(&self.state, &self.ctx)
    }

    /// A handle that can abort this communicator from any thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            state: Arc::clone(&self.state),
            ctx: Arc::clone(&self.ctx),
        }
    }

    /// True once the communicator was aborted.
    pub fn is_aborted(&self) -> bool {
        self.state.lock().status == Status::Aborted
    }

    /// Sets how long a call on a non-blocking communicator waits for NCCL to
    /// finish enqueueing (its own work, or earlier work); `None` waits until
    /// the enqueue is done or the communicator is aborted (through an
    /// [`AbortHandle`] from another thread). The default is
    /// [`ENQUEUE_DEADLINE`].
    ///
    /// NCCL connects peers lazily, at their first operation, so on a
    /// non-blocking communicator the first operation with a peer stays
    /// in progress until that peer issues its side.
    pub fn set_enqueue_deadline(&mut self, deadline: Option<Duration>) {
        self.enqueue_deadline = deadline;
    }

    /// The current enqueue deadline (see [`Comm::set_enqueue_deadline`]).
    pub fn enqueue_deadline(&self) -> Option<Duration> {
        self.enqueue_deadline
    }

    fn enqueue_timeout(&self) -> Duration {
        self.enqueue_deadline.unwrap_or(Duration::MAX)
    }

    /// Waits until NCCL has enqueued every call made so far on this
    /// communicator onto its streams, and reports a pending asynchronous
    /// error. On a non-blocking communicator, `ncclGroupEnd` (from [`Group`]
    /// or [`crate::group`]) may return before the group's work reaches the
    /// stream: call this before relying on stream order (a kernel launched
    /// after a grouped send/recv, an event recorded to detect completion).
    /// A no-op on a blocking communicator, except that it refuses after an
    /// abort.
    ///
    /// [`Group`]: crate::Group
    pub fn wait_ready(&self) -> Result<()> {
        self.ready("wait_ready")
    }

    /// Refuses the call after an abort; on a non-blocking communicator,
    /// first waits for earlier pending work (and reports its error).
    pub(crate) fn ready(&self, call: &'static str) -> Result<()> {
        if self.nonblocking {
            wait_shared(&self.state, "nccl enqueue", call, self.enqueue_timeout())
        } else if self.state.lock().status != Status::Live {
            Err(Error::Aborted { call })
        } else {
            Ok(())
        }
    }

    /// Maps a call's return code; `ncclInProgress` on a non-blocking
    /// communicator waits until the work is enqueued.
    pub(crate) fn settle(&self, rc: ncclResult_t, call: &'static str) -> Result<()> {
        if rc == ncclResult_t::ncclInProgress && self.nonblocking {
            wait_shared(&self.state, "nccl enqueue", call, self.enqueue_timeout())
        } else {
            nccl_check(rc, call, self.raw)
        }
    }

    /// Checks the status, makes the context current, makes the call (without
    /// holding the lock) and maps its result.
    pub(crate) fn enqueue(
        &self,
        call: &'static str,
        f: impl FnOnce(&'static Nccl, ncclComm_t) -> std::result::Result<ncclResult_t, LoadError>,
    ) -> Result<()> {
        self.ready(call)?;
        self.ctx.make_current()?;
        let rc = f(nccl_lib()?, self.raw)?;
        self.settle(rc, call)
    }

    fn check_index(&self, call: &'static str, what: &str, i: usize) -> Result<i32> {
        if i >= self.count {
            return Err(Error::invalid(
                call,
                format!("{what} {i} is not below the rank count {}", self.count),
            ));
        }
        Ok(i as i32)
    }

    fn check_ptr(call: &'static str, what: &str, ptr: u64, count: usize) -> Result<()> {
        if ptr == 0 && count > 0 {
            return Err(Error::invalid(
                call,
                format!("{what} is null with count {count}"),
            ));
        }
        Ok(())
    }

    pub(crate) fn check_ctx(&self, call: &'static str, what: &str, ctx: &Context) -> Result<()> {
        if ctx.raw() != self.ctx.raw() {
            return Err(Error::invalid(
                call,
                format!(
                    "{what} belongs to device {}, the communicator to device {}",
                    ctx.ordinal(),
                    self.ctx.ordinal()
                ),
            ));
        }
        Ok(())
    }

    fn check_aborted(&self, call: &'static str) -> Result<()> {
        if self.is_aborted() {
            return Err(Error::Aborted { call });
        }
        Ok(())
    }

    fn check_typed<T: Element>(
        &self,
        call: &'static str,
        bufs: &[&DeviceBuffer<T>],
        stream: &Stream,
    ) -> Result<()> {
        self.check_aborted(call)?;
        for b in bufs {
            self.check_ctx(call, "a buffer", b.context())?;
        }
        self.check_ctx(call, "the stream", stream.context())
    }

    fn len_mismatch(call: &'static str, detail: String) -> Error {
        Error::invalid(call, detail)
    }

    fn check_same_len(call: &'static str, send: usize, recv: usize) -> Result<()> {
        if send != recv {
            return Err(Self::len_mismatch(
                call,
                format!("send has {send} elements, recv {recv}"),
            ));
        }
        Ok(())
    }

    // ---- raw collectives ----

    /// `ncclAllReduce` on raw device addresses.
    ///
    /// # Safety
    /// `send` and `recv` are device memory of this communicator's device,
    /// valid for `count` elements of `dtype` until the stream work completes;
    /// `stream` is a live stream of this communicator's context.
    pub unsafe fn all_reduce_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclAllReduce";
        Self::check_ptr(CALL, "send", send, count)?;
        Self::check_ptr(CALL, "recv", recv, count)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointers, counts and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclAllReduce(
                        send as *const _,
                        recv as *mut _,
                        count,
                        dtype.to_raw(),
                        op.to_raw(),
                        comm,
                        stream
                    )
                )
            }
        })
    }

    /// `ncclBroadcast` on raw device addresses (`send` is read on `root`).
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`].
    pub unsafe fn broadcast_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclBroadcast";
        let root = self.check_index(CALL, "root", root)?;
        if root as usize == self.rank {
            Self::check_ptr(CALL, "send", send, count)?;
        }
        Self::check_ptr(CALL, "recv", recv, count)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointers, counts and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclBroadcast(
                        send as *const _,
                        recv as *mut _,
                        count,
                        dtype.to_raw(),
                        root,
                        comm,
                        stream
                    )
                )
            }
        })
    }

    /// `ncclReduce` on raw device addresses (`recv` is written on `root`).
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclReduce";
        let root = self.check_index(CALL, "root", root)?;
        Self::check_ptr(CALL, "send", send, count)?;
        if root as usize == self.rank {
            Self::check_ptr(CALL, "recv", recv, count)?;
        }
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointers, counts and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclReduce(
                        send as *const _,
                        recv as *mut _,
                        count,
                        dtype.to_raw(),
                        op.to_raw(),
                        root,
                        comm,
                        stream
                    )
                )
            }
        })
    }

    /// `ncclAllGather`: `send` holds `send_count` elements, `recv`
    /// `send_count * count()`.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`], with those sizes.
    pub unsafe fn all_gather_raw(
        &self,
        send: u64,
        recv: u64,
        send_count: usize,
        dtype: DataType,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclAllGather";
        Self::check_ptr(CALL, "send", send, send_count)?;
        Self::check_ptr(CALL, "recv", recv, send_count)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointers, counts and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclAllGather(
                        send as *const _,
                        recv as *mut _,
                        send_count,
                        dtype.to_raw(),
                        comm,
                        stream
                    )
                )
            }
        })
    }

    /// `ncclReduceScatter`: `recv` holds `recv_count` elements, `send`
    /// `recv_count * count()`.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`], with those sizes.
    pub unsafe fn reduce_scatter_raw(
        &self,
        send: u64,
        recv: u64,
        recv_count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclReduceScatter";
        Self::check_ptr(CALL, "send", send, recv_count)?;
        Self::check_ptr(CALL, "recv", recv, recv_count)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointers, counts and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclReduceScatter(
                        send as *const _,
                        recv as *mut _,
                        recv_count,
                        dtype.to_raw(),
                        op.to_raw(),
                        comm,
                        stream
                    )
                )
            }
        })
    }

    /// `ncclAlltoAll` (NCCL 2.28+): both buffers hold
    /// `count_per_peer * count()` elements.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`], with those sizes.
    pub unsafe fn all_to_all_raw(
        &self,
        send: u64,
        recv: u64,
        count_per_peer: usize,
        dtype: DataType,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclAlltoAll";
        Self::check_ptr(CALL, "send", send, count_per_peer)?;
        Self::check_ptr(CALL, "recv", recv, count_per_peer)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointers, counts and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclAlltoAll(
                        send as *const _,
                        recv as *mut _,
                        count_per_peer,
                        dtype.to_raw(),
                        comm,
                        stream
                    )
                )
            }
        })
    }

    /// `ncclSend` of `count` elements to `peer`.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`].
    pub unsafe fn send_raw(
        &self,
        ptr: u64,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclSend";
        let peer = self.check_index(CALL, "peer", peer)?;
        Self::check_ptr(CALL, "buffer", ptr, count)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointer, count and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclSend(ptr as *const _, count, dtype.to_raw(), peer, comm, stream)
                )
            }
        })
    }

    /// `ncclRecv` of `count` elements from `peer`.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`].
    pub unsafe fn recv_raw(
        &self,
        ptr: u64,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclRecv";
        let peer = self.check_index(CALL, "peer", peer)?;
        Self::check_ptr(CALL, "buffer", ptr, count)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointer, count and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclRecv(ptr as *mut _, count, dtype.to_raw(), peer, comm, stream)
                )
            }
        })
    }

    // ---- typed collectives ----

    /// All-reduce: `recv[i] = op over ranks of send[i]`; equal lengths.
    pub fn all_reduce<T: Element>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "all_reduce";
        self.check_typed(CALL, &[send, recv], stream)?;
        Self::check_same_len(CALL, send.len(), recv.len())?;
        // SAFETY: both buffers are live device memory of this communicator's
        // context with `len` elements; the stream belongs to the same context.
        unsafe {
            self.all_reduce_raw(
                send.device_ptr(),
                recv.device_ptr(),
                send.len(),
                T::DATA_TYPE,
                op,
                stream.raw(),
            )
        }
    }

    /// In-place all-reduce.
    pub fn all_reduce_in_place<T: Element>(
        &self,
        buf: &mut DeviceBuffer<T>,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        self.check_typed("all_reduce_in_place", &[buf], stream)?;
        // SAFETY: the buffer is live device memory of this communicator's
        // context; the stream belongs to the same context.
        unsafe {
            self.all_reduce_raw(
                buf.device_ptr(),
                buf.device_ptr(),
                buf.len(),
                T::DATA_TYPE,
                op,
                stream.raw(),
            )
        }
    }

    /// Broadcast from `root`'s `send` into every rank's `recv`; equal lengths.
    pub fn broadcast<T: Element>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "broadcast";
        self.check_typed(CALL, &[send, recv], stream)?;
        self.check_index(CALL, "root", root)?;
        Self::check_same_len(CALL, send.len(), recv.len())?;
        // SAFETY: as in all_reduce.
        unsafe {
            self.broadcast_raw(
                send.device_ptr(),
                recv.device_ptr(),
                send.len(),
                T::DATA_TYPE,
                root,
                stream.raw(),
            )
        }
    }

    /// In-place broadcast from `root`.
    pub fn broadcast_in_place<T: Element>(
        &self,
        buf: &mut DeviceBuffer<T>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "broadcast_in_place";
        self.check_typed(CALL, &[buf], stream)?;
        self.check_index(CALL, "root", root)?;
        // SAFETY: as in all_reduce_in_place.
        unsafe {
            self.broadcast_raw(
                buf.device_ptr(),
                buf.device_ptr(),
                buf.len(),
                T::DATA_TYPE,
                root,
                stream.raw(),
            )
        }
    }

    /// Reduce into `root`'s `recv`; equal lengths on every rank.
    pub fn reduce<T: Element>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        op: ReduceOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "reduce";
        self.check_typed(CALL, &[send, recv], stream)?;
        self.check_index(CALL, "root", root)?;
        Self::check_same_len(CALL, send.len(), recv.len())?;
        // SAFETY: as in all_reduce.
        unsafe {
            self.reduce_raw(
                send.device_ptr(),
                recv.device_ptr(),
                send.len(),
                T::DATA_TYPE,
                op,
                root,
                stream.raw(),
            )
        }
    }

    /// All-gather: `recv.len() == send.len() * count()`, rank-major.
    pub fn all_gather<T: Element>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "all_gather";
        self.check_typed(CALL, &[send, recv], stream)?;
        if send.len().checked_mul(self.count) != Some(recv.len()) {
            return Err(Self::len_mismatch(
                CALL,
                format!(
                    "recv has {} elements, expected send {} x {} ranks",
                    recv.len(),
                    send.len(),
                    self.count
                ),
            ));
        }
        // SAFETY: as in all_reduce, with recv holding send.len() * count().
        unsafe {
            self.all_gather_raw(
                send.device_ptr(),
                recv.device_ptr(),
                send.len(),
                T::DATA_TYPE,
                stream.raw(),
            )
        }
    }

    /// Reduce-scatter: `send.len() == recv.len() * count()`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "reduce_scatter";
        self.check_typed(CALL, &[send, recv], stream)?;
        if recv.len().checked_mul(self.count) != Some(send.len()) {
            return Err(Self::len_mismatch(
                CALL,
                format!(
                    "send has {} elements, expected recv {} x {} ranks",
                    send.len(),
                    recv.len(),
                    self.count
                ),
            ));
        }
        // SAFETY: as in all_reduce, with send holding recv.len() * count().
        unsafe {
            self.reduce_scatter_raw(
                send.device_ptr(),
                recv.device_ptr(),
                recv.len(),
                T::DATA_TYPE,
                op,
                stream.raw(),
            )
        }
    }

    /// All-to-all (NCCL 2.28+): equal lengths, a multiple of `count()`;
    /// block `j` of `send` goes to rank `j`.
    pub fn all_to_all<T: Element>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "all_to_all";
        self.check_typed(CALL, &[send, recv], stream)?;
        if send.len() != recv.len() || !send.len().is_multiple_of(self.count.max(1)) {
            return Err(Self::len_mismatch(
                CALL,
                format!(
                    "send has {} elements, recv {}; both must be equal multiples of {} ranks",
                    send.len(),
                    recv.len(),
                    self.count
                ),
            ));
        }
        // SAFETY: as in all_reduce.
        unsafe {
            self.all_to_all_raw(
                send.device_ptr(),
                recv.device_ptr(),
                send.len() / self.count.max(1),
                T::DATA_TYPE,
                stream.raw(),
            )
        }
    }

    /// Sends the whole buffer to `peer` (pair with the peer's [`Comm::recv`],
    /// usually inside a [`crate::Group`]).
    pub fn send<T: Element>(
        &self,
        buf: &DeviceBuffer<T>,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "send";
        self.check_typed(CALL, &[buf], stream)?;
        self.check_index(CALL, "peer", peer)?;
        // SAFETY: as in all_reduce.
        unsafe {
            self.send_raw(
                buf.device_ptr(),
                buf.len(),
                T::DATA_TYPE,
                peer,
                stream.raw(),
            )
        }
    }

    /// Receives the whole buffer from `peer`.
    pub fn recv<T: Element>(
        &self,
        buf: &mut DeviceBuffer<T>,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "recv";
        self.check_typed(CALL, &[buf], stream)?;
        self.check_index(CALL, "peer", peer)?;
        // SAFETY: as in all_reduce.
        unsafe {
            self.recv_raw(
                buf.device_ptr(),
                buf.len(),
                T::DATA_TYPE,
                peer,
                stream.raw(),
            )
        }
    }

    /// Finalizes then destroys a live communicator; aborts it instead when
    /// finalize fails or misses [`DROP_DEADLINE`].
    fn finalize_and_destroy(&self) -> Result<()> {
        const CALL: &str = "ncclCommFinalize";
        if let Err(e) = self.ctx.make_current() {
            tracing::warn!(error = %e, "making the context current before finalize failed");
        }
        let finalized = if self.nonblocking {
            wait_shared(&self.state, "communicator finalize", CALL, DROP_DEADLINE).and_then(|()| {
                // SAFETY: the communicator is live (just checked under the
                // lock) and owned by this value; an abort from another thread
                // during the call is allowed by NCCL.
                let rc = unsafe { nccl_raw!(ncclCommFinalize(self.raw)) };
                if rc == ncclResult_t::ncclInProgress {
                    wait_shared(&self.state, "communicator finalize", CALL, DROP_DEADLINE)
                } else {
                    nccl_check(rc, CALL, self.raw)
                }
            })
        } else {
            // A blocking finalize cannot be interrupted except by an abort
            // from another thread: a watchdog thread aborts at the deadline.
            let (done, wait) = mpsc::channel::<()>();
            let state = Arc::clone(&self.state);
            let ctx = Arc::clone(&self.ctx);
            let watchdog = std::thread::Builder::new()
                .name("nccl-finalize-watchdog".into())
                .spawn(move || {
                    if let Err(mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(DROP_DEADLINE) {
                        tracing::warn!("ncclCommFinalize missed its deadline; aborting");
                        if let Err(e) = abort_shared(&state, &ctx) {
                            tracing::warn!(error = %e, "abort after a finalize timeout failed");
                        }
                    }
                });
            if watchdog.is_err() {
                tracing::warn!("no finalize watchdog thread; finalizing without a deadline");
            }
            // SAFETY: live (checked by the caller under the lock; only an abort
            // can change that, and NCCL allows abort during the call).
            let rc = unsafe { nccl_raw!(ncclCommFinalize(self.raw)) };
            drop(done);
            if let Ok(w) = watchdog {
                let _ = w.join();
            }
            if self.is_aborted() {
                Err(Error::Timeout {
                    what: "communicator finalize",
                    after: DROP_DEADLINE,
                })
            } else {
                nccl_check(rc, CALL, self.raw)
            }
        };
        if let Err(e) = finalized {
            if let Err(abort) = self.abort() {
                tracing::warn!(error = %abort, "abort after a failed finalize failed");
            }
            return match e {
                Error::Aborted { .. } => Ok(()),
                e => Err(e),
            };
        }
        let mut st = self.state.lock();
        if st.status != Status::Live {
            return Ok(());
        }
        st.status = Status::Destroyed;
        // SAFETY: live until the line above, under the lock, so no abort can
        // run on it; destroyed once, here.
        let rc = unsafe { nccl_raw!(ncclCommDestroy(self.raw)) };
        nccl_check(rc, "ncclCommDestroy", std::ptr::null_mut())
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.state.lock().status != Status::Live {
            // Aborted: NCCL already freed it.
            return;
        }
        if let Err(e) = self.finalize_and_destroy() {
            tracing::error!(rank = self.rank, error = %e, "closing a communicator failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    #[test]
    fn unique_id_hex_round_trip() {
        let mut rng = rand::rng();
        let mut bytes = [0u8; 128];
        rng.fill(&mut bytes[..]);
        bytes[0] = 0xab;
        let id = UniqueId::from_bytes(&bytes).unwrap();
        let hex = id.to_hex();
        assert_eq!(hex.len(), 256);
        assert!(hex.starts_with("ab"));
        let back = UniqueId::from_hex(&hex).unwrap();
        assert_eq!(back, id);
        assert_eq!(back.as_bytes(), &bytes);
        assert_eq!(UniqueId::from_hex(&hex.to_uppercase()).unwrap(), id);
        let raw = id.raw();
        for (r, b) in raw.internal.iter().zip(bytes) {
            assert_eq!(*r as u8, b);
        }
        let dbg = format!("{id:?}");
        assert!(dbg.starts_with("UniqueId(ab"), "{dbg}");
        assert!(dbg.len() < 40, "{dbg}");
    }

    #[test]
    fn unique_id_rejects_bad_input() {
        let e = UniqueId::from_bytes(&[0u8; 127]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    call: "UniqueId::from_bytes",
                    ..
                }
            ),
            "{e}"
        );
        let e = UniqueId::from_hex("abc").unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let mut bad = "0".repeat(256);
        bad.replace_range(10..12, "zz");
        let e = UniqueId::from_hex(&bad).unwrap_err();
        assert!(e.to_string().contains("zz"), "{e}");
        let e = UniqueId::from_hex(&"é".repeat(128)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    }

    #[test]
    fn default_config_matches_the_c_initializer() {
        let c = default_config();
        assert_eq!(c.size, 80);
        assert_eq!(c.magic, 0xcafebeef);
        assert_eq!(c.version, 22803);
        for v in [
            c.blocking,
            c.cgaClusterSize,
            c.minCTAs,
            c.maxCTAs,
            c.splitShare,
            c.trafficClass,
            c.collnetEnable,
            c.CTAPolicy,
            c.shrinkShare,
            c.nvlsCTAs,
            c.nChannelsPerNetPeer,
            c.nvlinkCentricSched,
        ] {
            assert_eq!(v, i32::MIN);
        }
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn reduce_ops_map_to_nccl_codes() {
        let ops = [
            (ReduceOp::Sum, 0, "sum"),
            (ReduceOp::Prod, 1, "prod"),
            (ReduceOp::Max, 2, "max"),
            (ReduceOp::Min, 3, "min"),
            (ReduceOp::Avg, 4, "avg"),
        ];
        for (op, raw, name) in ops {
            assert_eq!(op.to_raw().0, raw);
            assert_eq!(op.name(), name);
        }
    }

    #[test]
    fn rank_arguments_are_checked() {
        assert!(check_rank_args("x", 0, 0).is_err());
        assert!(check_rank_args("x", 2, 2).is_err());
        assert_eq!(check_rank_args("x", 4, 3).unwrap(), (4, 3));
    }

    #[test]
    fn thread_safety_markers() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send::<Comm>();
        send_sync::<AbortHandle>();
    }
}
