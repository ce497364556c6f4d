//! Communicators: their state, their strong-stream [`Chain`], where their
//! peers are ([`Peers`]: the in-process world or a mesh), the table of
//! live handles, and the parts of `ncclConfig_t` the emulator reads.
//!
//! Invariants: a handle is an id in [`COMMS`] until it is destroyed or
//! aborted (an aborted id stays in [`ABORTED`], so a later call says so);
//! a communicator's launches take tickets of its chain in issue order, and
//! a ticket is done when its work has run or been dropped, so an abort
//! never leaves the chain blocked.
//!
//! Lock order: a communicator's `splitting`, then a child's `st` (an abort
//! wakes the children of its splits under it); `st`, then the error texts'
//! locks (`errors`: an error is recorded while it is held). `p2p_seq`, a
//! chain's state, and the tables' locks are leaves. Others take `st` after
//! their own lock (the bootstrap registry, a `World`), never before.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CStr, c_int};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use nccl_sys::{ncclComm, ncclComm_t, ncclConfig_t, ncclResult_t};
use parking_lot::{Condvar, Mutex};

use super::errors::{fail, intern, record};
use super::net::{self, Endpoint, Joining, Mesh};
use super::world::{SplitChild, World};
use super::{CONFIG_MAGIC, R, TICK};
use crate::fault;
use crate::{Table, id_to_ptr, new_id, ptr_to_id};

/// Where a ready communicator's peers are.
#[derive(Clone)]
pub(super) enum Peers {
    /// Threads of this process: the in-process world.
    Local(Arc<World>),
    /// Ranks of other processes (and maybe this one), over sockets.
    Net(Arc<Mesh>),
}

impl Peers {
    /// The in-process world, if that is where the peers are.
    pub(super) fn local(&self) -> Option<&Arc<World>> {
        match self {
            Peers::Local(w) => Some(w),
            Peers::Net(_) => None,
        }
    }
}

pub(super) struct CommSt {
    pub(super) rank: i32,
    pub(super) nranks: i32,
    pub(super) world: Option<Peers>,
    pub(super) async_err: Option<ncclResult_t>,
    pub(super) last: Option<(u64, &'static CStr)>,
    pub(super) inflight: u64,
    /// Background enqueues of a non-blocking communicator not yet done.
    pub(super) pending: u32,
    pub(super) finalizing: bool,
    pub(super) regs: BTreeSet<u64>,
    pub(super) wins: BTreeSet<u64>,
}

/// A communicator's strong stream, NCCL's `sharedRes->deviceStream`:
/// every launch of the communicator (an operation outside a group, or the
/// communicator's part of a group, eager or replayed from a graph) takes
/// the next ticket when it is launched, and its work, on whatever stream,
/// first waits until every earlier ticket is done. NCCL 2.28.3 makes the
/// launch stream wait on the strong stream before each kernel and advances
/// the strong stream to the kernel's completion after it (`src/enqueue.cc`,
/// `ncclLaunchPrepare` and `ncclLaunchFinish`), so a communicator's work
/// runs in issue order across streams. Communicators split with
/// `splitShare` share their parent's chain (`commAlloc` in `src/init.cc`
/// reuses `parent->sharedRes`).
pub(super) struct Chain {
    pub(super) st: Mutex<ChainSt>,
    pub(super) cv: Condvar,
}

pub(super) struct ChainSt {
    /// The next ticket to hand out.
    pub(super) next: u64,
    /// Every ticket below this one is done.
    pub(super) done_below: u64,
    /// Tickets at or above `done_below` that are done (out of order: one
    /// dropped by an abort before an earlier one ran).
    pub(super) done: BTreeSet<u64>,
}

impl Chain {
    pub(super) fn new() -> Arc<Chain> {
        Arc::new(Chain {
            st: Mutex::new(ChainSt {
                next: 0,
                done_below: 0,
                done: BTreeSet::new(),
            }),
            cv: Condvar::new(),
        })
    }

    /// The next place in the chain; it is done when the ticket is dropped.
    pub(super) fn take(self: &Arc<Self>) -> Arc<Ticket> {
        let mut st = self.st.lock();
        let n = st.next;
        st.next += 1;
        Arc::new(Ticket {
            chain: self.clone(),
            n,
        })
    }

    pub(super) fn complete(&self, n: u64) {
        let mut st = self.st.lock();
        st.done.insert(n);
        loop {
            let next = st.done_below;
            if !st.done.remove(&next) {
                break;
            }
            st.done_below += 1;
        }
        self.cv.notify_all();
    }

    pub(super) fn wake(&self) {
        let _st = self.st.lock();
        self.cv.notify_all();
    }
}

/// A launch's place in its communicator's chain, shared by the launch's
/// work items; done (and the chain advances) when the last is dropped,
/// whether it ran or was dropped unrun.
pub(super) struct Ticket {
    pub(super) chain: Arc<Chain>,
    pub(super) n: u64,
}

impl Ticket {
    /// Waits until every earlier launch on the chain is done; false when
    /// `comm` is aborted first.
    pub(super) fn wait_turn(&self, comm: &Comm) -> bool {
        let mut st = self.chain.st.lock();
        while st.done_below < self.n {
            if comm.aborted() {
                return false;
            }
            self.chain.cv.wait_for(&mut st, TICK);
        }
        true
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.chain.complete(self.n);
    }
}

/// The parts of an `ncclConfig_t` the emulator uses.
#[derive(Debug, Clone, Copy)]
pub(super) struct Cfg {
    pub(super) blocking: bool,
    /// `splitShare`: children split from this communicator share its
    /// resources (its strong stream among them).
    pub(super) split_share: bool,
}

/// One rank's communicator.
pub(super) struct Comm {
    pub(super) id: u64,
    pub(super) device: i32,
    pub(super) blocking: bool,
    /// Children split from it share its chain (`config.splitShare`).
    pub(super) split_share: bool,
    /// Its strong stream; shared with the parent when split with
    /// `splitShare`.
    pub(super) chain: Arc<Chain>,
    /// Never joined (`nojoin` fault): its operations block until abort.
    pub(super) ghost: bool,
    pub(super) aborted: AtomicBool,
    /// Crashed (`die` fault): every call fails with `ncclSystemError`.
    pub(super) dead: AtomicBool,
    pub(super) seq: AtomicU64,
    /// Point-to-point operations launched so far, by (peer, is a send):
    /// the `k`-th send to a peer matches that peer's `k`-th receive from
    /// this rank, in issue order whatever the streams (NCCL matches them
    /// so: every launch of a communicator is ordered on its strong stream,
    /// and a group posts its operations to each peer in call order).
    pub(super) p2p_seq: Mutex<BTreeMap<(usize, bool), u64>>,
    pub(super) split_seq: AtomicU64,
    /// Children of a split still waiting for their peers: aborting this
    /// communicator aborts them too (NCCL's `childAbortFlag`).
    pub(super) splitting: Mutex<Vec<Arc<Comm>>>,
    /// A non-blocking communicator's first operation has been enqueued
    /// (NCCL connects lazily at first use).
    pub(super) connected: AtomicBool,
    pub(super) st: Mutex<CommSt>,
    pub(super) cv: Condvar,
}

impl Comm {
    pub(super) fn new(
        device: i32,
        cfg: Cfg,
        chain: Arc<Chain>,
        ghost: bool,
        rank: i32,
        nranks: i32,
    ) -> Arc<Comm> {
        Arc::new(Comm {
            id: new_id(),
            device,
            blocking: cfg.blocking,
            split_share: cfg.split_share,
            chain,
            ghost,
            aborted: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            seq: AtomicU64::new(0),
            p2p_seq: Mutex::new(BTreeMap::new()),
            split_seq: AtomicU64::new(0),
            splitting: Mutex::new(Vec::new()),
            connected: AtomicBool::new(false),
            st: Mutex::new(CommSt {
                rank,
                nranks,
                world: None,
                async_err: None,
                last: None,
                inflight: 0,
                pending: 0,
                finalizing: false,
                regs: BTreeSet::new(),
                wins: BTreeSet::new(),
            }),
            cv: Condvar::new(),
        })
    }

    pub(super) fn handle(&self) -> ncclComm_t {
        id_to_ptr::<ncclComm>(self.id)
    }

    /// The next point-to-point sequence number (from 1) of the sends to
    /// `peer` (`is_send`) or of the receives from it.
    pub(super) fn next_p2p(&self, peer: usize, is_send: bool) -> u64 {
        let mut m = self.p2p_seq.lock();
        let c = m.entry((peer, is_send)).or_default();
        *c += 1;
        *c
    }

    pub(super) fn aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    pub(super) fn set_world(&self, rank: i32, nranks: i32, w: Peers) {
        let mut st = self.st.lock();
        st.rank = rank;
        st.nranks = nranks;
        st.world = Some(w);
        self.cv.notify_all();
    }

    pub(super) fn set_async(&self, code: ncclResult_t, msg: &str) {
        let m = record(intern(&format!("emulated NCCL: {msg}")));
        let mut st = self.st.lock();
        st.async_err.get_or_insert(code);
        st.last = Some(m);
    }

    /// Counts an enqueue call of a blocking communicator; at an injected
    /// `stall` it waits for an abort and then fails, as a blocking NCCL
    /// call stuck in connection set-up does.
    pub(super) fn enqueue_call(&self) -> R<()> {
        if !self.blocking {
            return Ok(());
        }
        let rank = self.st.lock().rank;
        if fault::take_stall(rank) {
            self.wait_aborted();
            return fail(
                ncclResult_t::ncclInternalError,
                "connection set-up abandoned: the communicator was aborted",
            );
        }
        Ok(())
    }

    pub(super) fn wait_aborted(&self) {
        let mut st = self.st.lock();
        while !self.aborted() {
            self.cv.wait_for(&mut st, TICK);
        }
    }

    /// Waits until the communicator is ready, aborted, or failed its init
    /// (an asynchronous error before it is ready, see [`Comm::fail_init`]).
    pub(super) fn wait_ready(&self) {
        let mut st = self.st.lock();
        while st.world.is_none() && st.async_err.is_none() && !self.aborted() {
            self.cv.wait_for(&mut st, TICK);
        }
    }

    /// The error of an init that failed after its call returned (a
    /// bootstrap across processes), as `ncclCommGetAsyncError` and a
    /// blocking init report it; nothing once the communicator is aborted.
    pub(super) fn fail_init(&self, code: ncclResult_t, msg: &str) {
        if self.aborted() {
            return;
        }
        self.set_async(code, msg);
        let _st = self.st.lock();
        self.cv.notify_all();
    }

    /// Builds this rank's mesh (rank `me` of `eps`, routing key `key`)
    /// and makes the communicator ready over it, or failed; nothing when
    /// it was aborted meanwhile (a mesh started just before the abort is
    /// closed at once).
    pub(super) fn build_mesh(
        &self,
        joining: Arc<Joining>,
        key: u128,
        me: usize,
        eps: Vec<Endpoint>,
    ) {
        let stop = || self.aborted();
        match net::build(joining, self.id, key, me, eps, &stop) {
            Ok(mesh) => {
                let n = mesh.eps.len();
                self.set_world(me as i32, n as i32, Peers::Net(mesh.clone()));
                if self.aborted() {
                    mesh.close();
                }
            }
            Err(None) => {}
            Err(Some((code, msg))) => self.fail_init(code, &msg),
        }
    }

    /// The init error of a communicator that is not ready, with its text
    /// recorded as the calling thread's last error.
    pub(super) fn init_error(&self) -> Option<ncclResult_t> {
        let st = self.st.lock();
        if st.world.is_some() {
            return None;
        }
        let code = st.async_err?;
        if let Some((_, m)) = st.last {
            record(m);
        }
        Some(code)
    }

    /// (rank, nranks, world) of a ready communicator.
    pub(super) fn ready(&self) -> R<(usize, usize, Option<Peers>)> {
        let st = self.st.lock();
        if st.world.is_none() && !self.ghost {
            return fail(
                ncclResult_t::ncclInvalidArgument,
                "attempt to use a communicator before its initialization completed",
            );
        }
        Ok((st.rank as usize, st.nranks as usize, st.world.clone()))
    }

    /// Refuses a call while an earlier background enqueue of this
    /// (non-blocking) communicator is pending: the user must first poll
    /// `ncclCommGetAsyncError` until it leaves `ncclInProgress`.
    pub(super) fn idle(&self) -> R<()> {
        if self.st.lock().pending > 0 {
            return fail(
                ncclResult_t::ncclInvalidUsage,
                "previous operation still in progress (non-blocking communicator)",
            );
        }
        Ok(())
    }
}

impl SplitChild for Comm {
    fn device(&self) -> i32 {
        self.device
    }

    fn join_local(&self, rank: i32, nranks: i32, world: Arc<World>) {
        self.set_world(rank, nranks, Peers::Local(world));
    }
}

/// Counts one in-flight operation of a communicator until dropped.
pub(super) struct Inflight(pub(super) Arc<Comm>);

impl Drop for Inflight {
    fn drop(&mut self) {
        let mut st = self.0.st.lock();
        st.inflight = st.inflight.saturating_sub(1);
        self.0.cv.notify_all();
    }
}

pub(super) static COMMS: Table<Comm> = Table::new();
pub(super) static ABORTED: Mutex<BTreeSet<u64>> = Mutex::new(BTreeSet::new());

pub(super) fn lookup_any(h: ncclComm_t) -> R<Arc<Comm>> {
    if h.is_null() {
        return fail(ncclResult_t::ncclInvalidArgument, "comm is NULL");
    }
    let id = ptr_to_id(h);
    if let Some(c) = COMMS.get(id) {
        return Ok(c);
    }
    if ABORTED.lock().contains(&id) {
        fail(
            ncclResult_t::ncclInvalidUsage,
            "communicator was aborted (ncclCommAbort frees it)",
        )
    } else {
        fail(ncclResult_t::ncclInvalidArgument, "unknown communicator")
    }
}

pub(super) fn lookup(h: ncclComm_t) -> R<Arc<Comm>> {
    let c = lookup_any(h)?;
    if c.dead.load(Ordering::Acquire) {
        return fail(
            ncclResult_t::ncclSystemError,
            "communicator crashed (injected fault)",
        );
    }
    Ok(c)
}

/// `NCCL_COMM_SPLIT_SHARE_RESOURCES`, which overrides every config's
/// `splitShare` when set (`parseCommConfig` in NCCL's `src/init.cc`).
pub(super) fn split_share_env() -> Option<bool> {
    let v = std::env::var("NCCL_COMM_SPLIT_SHARE_RESOURCES").ok()?;
    v.trim().parse::<i32>().ok().map(|n| n == 1)
}

/// The config's blocking mode and `splitShare`, from an optional config;
/// `default` for a null one (a split's null config copies the parent's).
///
/// # Safety
/// `cfg` is null or points to a config of at least `cfg.size` bytes.
pub(super) unsafe fn parse_config(cfg: *const ncclConfig_t, default: Cfg) -> R<Cfg> {
    if cfg.is_null() {
        return Ok(default);
    }
    // SAFETY: `cfg` points to a config (this function's contract); its
    // leading `size` and `magic` fields are present in every version.
    let (size, magic) = unsafe { ((*cfg).size, (*cfg).magic) };
    if magic != CONFIG_MAGIC {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("config magic {magic:#x} is not 0xcafebeef: use NCCL_CONFIG_INITIALIZER"),
        );
    }
    if !(20..=4096).contains(&size) {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("config size {size} is invalid"),
        );
    }
    // SAFETY: the config holds at least 20 bytes, so `blocking` is present.
    let b = unsafe { (*cfg).blocking };
    let share_end = std::mem::offset_of!(ncclConfig_t, splitShare) + size_of::<c_int>();
    let share = if size >= share_end {
        // SAFETY: the config holds `size` bytes, past `splitShare`.
        unsafe { (*cfg).splitShare }
    } else {
        i32::MIN
    };
    Ok(Cfg {
        blocking: b == i32::MIN || b != 0,
        split_share: split_share_env().unwrap_or(share == 1),
    })
}

/// The config of a communicator made by an init call.
///
/// # Safety
/// As [`parse_config`].
pub(super) unsafe fn init_config(cfg: *const ncclConfig_t) -> R<Cfg> {
    let default = Cfg {
        blocking: true,
        split_share: split_share_env().unwrap_or(false),
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { parse_config(cfg, default) }
}
