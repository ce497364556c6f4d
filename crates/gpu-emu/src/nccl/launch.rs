//! Launching operations: a launch takes its sequence number, its ticket on
//! the communicator's chain and its fault, and becomes stream work; a
//! non-blocking communicator's work is handed to a background enqueue;
//! the work runs the operation when the stream reaches it.
//!
//! Invariants: a launched operation counts as in flight until its work
//! runs or is dropped; its work first waits for its turn on the chain and
//! ends unrun, touching no memory, when its communicator is aborted first;
//! an all-reduce or a send that runs to completion is charged its cost on
//! the stream's virtual clock (`cost`), one that fails or ends unrun none;
//! a background enqueue drops the work of a communicator aborted meanwhile.
//! A group [`Join`]'s lock is a leaf; a launch takes the communicator's
//! state and its world's one after the other, never together.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use nccl_sys::ncclResult_t;

use super::coll::{Desc, Kind};
use super::comm::{Comm, Inflight, Peers, Ticket};
use super::data::Dt;
use super::world::{World, run_coll, run_recv, run_send};
use super::{POLL, TICK};
use crate::cost::{self, CostOp};
use crate::cuda::driver;
use crate::cuda::stream::{self, Launcher, Target, Work};
use crate::fault::{self, Fault};

pub(super) enum Body {
    Coll(Desc),
    Send {
        peer: usize,
        buf: u64,
        count: usize,
        dt: Dt,
    },
    Recv {
        peer: usize,
        buf: u64,
        count: usize,
        dt: Dt,
    },
}

/// The tickets of one group launch, one per chain: communicators that
/// share a chain (a `splitShare` family) share the group's ticket, so the
/// group's items, which run in one task per stream with sends first, never
/// wait for one another through the chain. (NCCL launches such
/// communicators' kernels one after another; in one task that order
/// would make a send wait for a recv queued behind it.)
#[derive(Default)]
pub(super) struct Tickets(Vec<Arc<Ticket>>);

impl Tickets {
    /// The ticket of `comm`'s chain in this launch, taken at its first use.
    pub(super) fn of(&mut self, comm: &Arc<Comm>) -> Arc<Ticket> {
        if let Some(t) = self.0.iter().find(|t| Arc::ptr_eq(&t.chain, &comm.chain)) {
            return t.clone();
        }
        let t = comm.chain.take();
        self.0.push(t.clone());
        t
    }
}

/// The streams of one group launch. NCCL makes every stream of a group
/// wait for all of them before the group's kernel, and all of them wait
/// for the kernel after it ("Mixing Multiple Streams within the same
/// ncclGroupStart/End() group" in NCCL's user guide): each stream's part
/// first [`meet`](Join::meet)s the others' arrival, then runs its items,
/// then meets the others' end. A wait ends early once one of the group's
/// communicators is aborted, so an abort never leaves a stream waiting.
pub(super) struct Join {
    parts: usize,
    comms: Vec<Arc<Comm>>,
    /// How many parts arrived, and how many ran their items.
    st: Mutex<[usize; 2]>,
    cv: Condvar,
}

impl Join {
    /// A join of `parts` streams over `comms`.
    pub(super) fn new(parts: usize, comms: Vec<Arc<Comm>>) -> Arc<Join> {
        Arc::new(Join {
            parts,
            comms,
            st: Mutex::new([0; 2]),
            cv: Condvar::new(),
        })
    }

    /// Counts this part in `phase` (0: arrived, 1: ran) and waits until
    /// every part has, or one of the communicators is aborted.
    fn meet(&self, phase: usize) {
        let mut st = self.st.lock();
        st[phase] += 1;
        self.cv.notify_all();
        while st[phase] < self.parts && !self.comms.iter().any(|c| c.aborted()) {
            self.cv.wait_for(&mut st, TICK);
        }
    }

    /// `works` as one stream's part of the join.
    pub(super) fn part(self: &Arc<Self>, works: Vec<Work>) -> Work {
        let join = self.clone();
        Box::new(move || {
            join.meet(0);
            for w in works {
                w();
            }
            join.meet(1);
        })
    }
}

/// Work items run in order as one task.
pub(super) fn sequence(works: Vec<Work>) -> Work {
    Box::new(move || {
        for w in works {
            w();
        }
    })
}

/// A launcher of `body` for the stream (immediate launch or capture): each
/// launch takes the next ticket of the communicator's chain.
pub(super) fn launcher(comm: Arc<Comm>, body: Arc<Body>) -> Launcher {
    Arc::new(move || launch(&comm, &body, comm.chain.take()).0)
}

/// A group item recorded on a capturing stream: its communicator, its
/// operation and whether it is a send.
pub(super) type Captured = (Arc<Comm>, Arc<Body>, bool);

/// A launcher of a group's items (in call order, each with whether it is a
/// send) on one capturing stream: each launch (each graph launch) takes
/// one ticket per chain for all its items and their sequence numbers in
/// call order, and runs the sends first.
pub(super) fn group_launcher(items: Vec<Captured>) -> Launcher {
    Arc::new(move || {
        let mut tickets = Tickets::default();
        let mut sends = Vec::new();
        let mut rest = Vec::new();
        for (c, b, is_send) in &items {
            let w = launch(c, b, tickets.of(c)).0;
            if *is_send {
                sends.push(w)
            } else {
                rest.push(w)
            }
        }
        sends.extend(rest);
        sequence(sends)
    })
}

/// What a non-blocking communicator's first operation waits for before it
/// is enqueued: its peers' matching launches.
pub(super) enum Need {
    /// Never satisfied: the communicator has no world (it never joined).
    Never,
    /// Every rank launched collective `seq`.
    Coll { world: Arc<World>, seq: u64 },
    /// Met at once: the peers are other processes, whose launches this
    /// process does not see (lazy connection is not emulated across
    /// processes).
    Met,
    /// At least `k` launches on the `(src, dst, send side)` counter.
    P2p {
        world: Arc<World>,
        key: (usize, usize, bool),
        k: u64,
    },
}

impl Need {
    pub(super) fn met(&self) -> bool {
        match self {
            Need::Never => false,
            Need::Met => true,
            Need::Coll { world, seq } => world.st.lock().launched.iter().all(|s| s >= seq),
            Need::P2p { world, key, k } => world.st.lock().p2p.get(key).copied().unwrap_or(0) >= *k,
        }
    }
}

/// Launches `body` now as part of the launch holding `ticket`: takes its
/// sequence number, registers the launch with the world (for lazy
/// connection), takes its fault, counts it in flight until its work runs or
/// is dropped, and returns the work with what a first operation waits for.
/// The work first waits for its turn on the communicator's chain; aborted
/// meanwhile, it ends without touching memory.
pub(super) fn launch(comm: &Arc<Comm>, body: &Arc<Body>, ticket: Arc<Ticket>) -> (Work, Need) {
    // A collective's number among the communicator's collectives, a
    // send's (receive's) among its sends to (receives from) that peer:
    // both in issue order.
    let seq = match **body {
        Body::Coll(_) => comm.seq.fetch_add(1, Ordering::AcqRel) + 1,
        Body::Send { peer, .. } => comm.next_p2p(peer, true),
        Body::Recv { peer, .. } => comm.next_p2p(peer, false),
    };
    let (rank, world) = {
        let mut st = comm.st.lock();
        st.inflight += 1;
        (st.rank, st.world.clone())
    };
    let g = Inflight(comm.clone());
    let need = match world {
        None => Need::Never,
        Some(Peers::Net(_)) => Need::Met,
        Some(Peers::Local(world)) => {
            let r = rank as usize;
            let need = {
                let mut ws = world.st.lock();
                match **body {
                    Body::Coll(_) => {
                        if let Some(l) = ws.launched.get_mut(r) {
                            *l = (*l).max(seq);
                        }
                        None
                    }
                    Body::Send { peer, .. } => {
                        let c = ws.p2p.entry((r, peer, true)).or_default();
                        *c += 1;
                        Some(((r, peer, false), *c))
                    }
                    Body::Recv { peer, .. } => {
                        let c = ws.p2p.entry((peer, r, false)).or_default();
                        *c += 1;
                        Some(((peer, r, true), *c))
                    }
                }
            };
            match need {
                None => Need::Coll { world, seq },
                Some((key, k)) => Need::P2p { world, key, k },
            }
        }
    };
    let f = fault::take_op(rank);
    if f == Some(Fault::Die) {
        comm.dead.store(true, Ordering::Release);
    }
    let comm = comm.clone();
    let body = body.clone();
    let work: Work = Box::new(move || {
        let _g = g;
        if ticket.wait_turn(&comm) {
            run(&comm, seq, f, &body);
        }
        drop(ticket);
    });
    (work, need)
}

/// Launched work and the communicators whose operations it runs.
pub(super) type CommWork = (Vec<Arc<Comm>>, Work);

/// Work of non-blocking communicators that NCCL's background thread
/// enqueues later.
#[derive(Default)]
pub(super) struct Job {
    /// Per stream, in call order: each communicator's launched work.
    pub(super) items: Vec<(Target, Vec<CommWork>)>,
    /// The non-blocking communicators involved, each once.
    pub(super) comms: Vec<Arc<Comm>>,
    /// What first operations wait for, by communicator.
    pub(super) needs: Vec<(Arc<Comm>, Need)>,
}

impl Job {
    /// Notes `comm`'s part in the job; a not yet connected non-blocking
    /// communicator's operation waits for `need`.
    pub(super) fn add_comm(&mut self, comm: &Arc<Comm>, need: Need) {
        if comm.blocking {
            return;
        }
        if !self.comms.iter().any(|c| Arc::ptr_eq(c, comm)) {
            self.comms.push(comm.clone());
        }
        if !comm.connected.load(Ordering::Acquire) {
            self.needs.push((comm.clone(), need));
        }
    }
}

/// Marks `comms` as no longer pending (and connected).
pub(super) fn finish(comms: &[Arc<Comm>]) {
    for c in comms {
        c.connected.store(true, Ordering::Release);
        let mut st = c.st.lock();
        st.pending = st.pending.saturating_sub(1);
        c.cv.notify_all();
    }
}

/// Hands `job` to a background thread that enqueues it after a short
/// random delay and, for first operations, once the peers' matching
/// operations are launched; until then its communicators are pending.
/// Work whose communicators were all aborted meanwhile is dropped, not
/// enqueued.
pub(super) fn defer(job: Job) {
    for c in &job.comms {
        c.st.lock().pending += 1;
    }
    let comms = job.comms.clone();
    let spawned = std::thread::Builder::new()
        .name("emu-nccl-enqueue".into())
        .spawn(move || {
            use rand::Rng;
            let delay = rand::rng().random_range(200..2000);
            std::thread::sleep(Duration::from_micros(delay));
            loop {
                let waiting = job.needs.iter().any(|(c, n)| !c.aborted() && !n.met());
                if !waiting || job.comms.iter().all(|c| c.aborted()) {
                    break;
                }
                std::thread::sleep(POLL);
            }
            for (t, works) in job.items {
                let works: Vec<Work> = works
                    .into_iter()
                    .filter(|(cs, _)| !cs.iter().all(|c| c.aborted()))
                    .map(|(_, w)| w)
                    .collect();
                if !works.is_empty() {
                    stream::push_launched(&t, sequence(works));
                }
            }
            finish(&job.comms);
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "could not start the emulated NCCL enqueue thread");
        for c in &comms {
            c.set_async(
                ncclResult_t::ncclSystemError,
                "could not start the background enqueue thread",
            );
        }
        finish(&comms);
    }
}

/// Advances the stream's virtual clock by the cost of `body` run to
/// completion by `rank` (`cost`): an all-reduce or a send, by its bytes.
fn charge(rank: usize, body: &Body) {
    let (op, count, dt) = match *body {
        Body::Coll(d) if d.kind == Kind::AllReduce => (CostOp::AllReduce, d.count, d.dt),
        Body::Send { count, dt, .. } => (CostOp::Send, count, dt),
        _ => return,
    };
    cost::charge(op, rank, count.saturating_mul(dt.size()));
}

pub(super) fn run(comm: &Arc<Comm>, seq: u64, f: Option<Fault>, body: &Body) {
    if matches!(f, Some(Fault::Hang | Fault::Die)) {
        comm.wait_aborted();
        return;
    }
    if driver::sticky(comm.device).is_err() {
        // The context is broken: NCCL's kernel cannot run, and NCCL reports
        // the CUDA error; the peers wait for this rank, as on GPUs.
        comm.set_async(
            ncclResult_t::ncclUnhandledCudaError,
            "the device has a sticky CUDA error (work touched memory that is not allocated)",
        );
        return;
    }
    let (rank, world) = {
        let st = comm.st.lock();
        (st.rank as usize, st.world.clone())
    };
    let Some(world) = world else {
        comm.wait_aborted();
        return;
    };
    let outcome = match (&world, body) {
        (Peers::Local(w), Body::Coll(d)) => run_coll(w, rank, seq, *d),
        (Peers::Net(m), Body::Coll(d)) => m.run_coll(seq, *d),
        (
            Peers::Local(w),
            Body::Send {
                peer,
                buf,
                count,
                dt,
            },
        ) => run_send(w, rank, *peer, seq, *buf, *count, *dt),
        (
            Peers::Net(m),
            Body::Send {
                peer,
                buf,
                count,
                dt,
            },
        ) => m.run_send(*peer, seq, *buf, *count, *dt),
        (
            Peers::Local(w),
            Body::Recv {
                peer,
                buf,
                count,
                dt,
            },
        ) => run_recv(w, rank, *peer, seq, *buf, *count, *dt),
        (
            Peers::Net(m),
            Body::Recv {
                peer,
                buf,
                count,
                dt,
            },
        ) => m.run_recv(*peer, seq, *buf, *count, *dt),
    };
    if let Some(Ok(())) = outcome {
        charge(rank, body);
    }
    match outcome {
        Some(Ok(())) if f == Some(Fault::Async) => {
            comm.set_async(ncclResult_t::ncclSystemError, "injected asynchronous error");
        }
        Some(Err((code, msg))) => comm.set_async(code, &msg),
        _ => {}
    }
}
