//! A cross-process communicator's mesh: one TCP link to every peer, a
//! reader thread per link filling mailboxes, and the operations run over
//! it.
//!
//! A collective sends every peer a `Coll` message for its sequence number
//! (its arguments, and the part of this rank's input that peer needs:
//! all of it for an all-reduce or all-gather, block `j` for peer `j` of a
//! reduce-scatter or all-to-all, nothing where the peer needs nothing),
//! waits for every peer's, checks that the arguments match, and computes
//! its own output from the inputs in rank order, so every rank computes
//! what the in-process world would. A send posts a `P2p` message (eager,
//! as in process); a receive takes the next message from its peer.
//!
//! Invariants:
//! - This rank's output is written under the mesh's lock after checking
//!   that it is not closed, and close takes the same lock, so no buffer is
//!   written after `ncclCommAbort` returns; device memory is touched only
//!   through `memory::access`.
//! - A message is written whole under its link's write lock; a writer
//!   gives up (the link is then broken) when the mesh is closed or the
//!   link fails. A write that fails, or finds the link broken, while the
//!   mesh is open is not itself the peer's loss: the peer closed its end,
//!   and whether it left or was lost is what it sent before (a `Bye` or
//!   not), so the send waits for the link's reader to decide, as a wait
//!   for that peer does; a peer that left therefore blocks this rank's
//!   collectives until abort whichever side of its close they run.
//! - A peer is `Up`, `Left` (it sent `Bye`: waits for it block until
//!   abort, sends to it are dropped, as a send to a peer that aborted is
//!   in process) or `Lost` (its link ended otherwise: waits that need it
//!   and sends to it fail with `ncclRemoteError`).
//! - A reader ends at its link's end, or [`DRAIN`] after this rank closed
//!   the mesh; the link's socket closes when the mesh is dropped.
//!
//! Lock order: the mesh's state, then the memory registry (outputs are
//! written under the state's lock). A link's write lock is a leaf: a
//! writer takes the state before and after it, never while holding it, and
//! a close releases the state before it takes the write locks, and waits
//! for one at most [`BYE_WAIT`].

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nccl_sys::ncclResult_t;
use parking_lot::{Condvar, Mutex};

use super::Endpoint;
use super::wire::{self, Frame, IO_TICK};
use crate::nccl::coll::{CollErr, Desc, Kind, read, write_all};
use crate::nccl::data::{Dt, reduce};

/// How long a reader keeps draining its link after this rank closed.
const DRAIN: Duration = Duration::from_secs(2);
/// How long a close waits for a writer to finish its message before it
/// gives up on saying `Bye` on that link.
pub(super) const BYE_WAIT: Duration = Duration::from_millis(200);
/// How long a writer whose link broke waits for the link's reader to say
/// whether the peer left or was lost (the reader reaches the end of a
/// broken link within a tick once it runs).
const SETTLE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Peer {
    Up,
    Left,
    Lost(String),
}

struct Link {
    s: TcpStream,
    /// Held for a whole message.
    w: Mutex<()>,
    /// A writer gave up inside a message: nothing more can be framed.
    broken: AtomicBool,
}

struct CollMsg {
    kind: u8,
    dt: u8,
    op: u8,
    count: u64,
    root: u32,
    data: Vec<u8>,
}

struct P2pMsg {
    dt: u8,
    count: u64,
    data: Vec<u8>,
}

#[derive(Default)]
struct MeshSt {
    closed_at: Option<Instant>,
    peers: Vec<Option<Peer>>,
    coll: BTreeMap<(u64, usize), CollMsg>,
    /// Sends received and not yet matched, by (source, the send's number
    /// among the source's sends to this rank).
    p2p: BTreeMap<(usize, u64), P2pMsg>,
    splits: BTreeMap<(u64, usize), (i32, i32)>,
    /// Splits this rank takes no part in: their messages are dropped.
    discard: BTreeSet<u64>,
    /// The text of the first peer lost (the one that stopped answering
    /// first), reported as the communicator's asynchronous error.
    first_lost: Option<String>,
}

impl MeshSt {
    /// What a send to `j` comes to once `j` is no longer up: dropped when
    /// it left, its loss when it is lost; `None` while it is up.
    fn fate(&self, j: usize) -> Option<Result<(), CollErr>> {
        match self.peers.get(j) {
            Some(Some(Peer::Left)) => Some(Ok(())),
            Some(Some(Peer::Lost(why))) => Some(Err(remote(why.clone()))),
            _ => None,
        }
    }
}

/// A cross-process communicator's links and mailboxes.
pub(crate) struct Mesh {
    /// The routing key (children's keys derive from it).
    pub(crate) key: u128,
    /// This rank.
    pub(crate) rank: usize,
    /// Every rank's endpoint.
    pub(crate) eps: Vec<Endpoint>,
    links: Vec<Option<Link>>,
    closed: AtomicBool,
    st: Mutex<MeshSt>,
    cv: Condvar,
}

/// Why a link ended without `Bye`: its end or its error, if any.
fn gone_reason(e: Option<&std::io::Error>) -> String {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    match e {
        None => "its process exited or was killed (its link ended without a goodbye)".into(),
        Some(e)
            if matches!(
                e.kind(),
                BrokenPipe | ConnectionAborted | ConnectionReset | UnexpectedEof
            ) =>
        {
            format!("its process exited or was killed (its link ended without a goodbye: {e})")
        }
        Some(e) => format!("its link failed: {e}"),
    }
}

fn remote(msg: String) -> CollErr {
    (ncclResult_t::ncclRemoteError, msg)
}

/// A message on its way in.
enum Partial {
    Coll(u64, CollMsg, usize),
    P2p(u64, P2pMsg, usize),
}

impl Mesh {
    pub(super) fn start(
        key: u128,
        rank: usize,
        eps: Vec<Endpoint>,
        links: Vec<Option<TcpStream>>,
    ) -> Arc<Mesh> {
        let n = eps.len();
        let mesh = Arc::new(Mesh {
            key,
            rank,
            eps,
            links: links
                .into_iter()
                .map(|s| {
                    s.map(|s| Link {
                        s,
                        w: Mutex::new(()),
                        broken: AtomicBool::new(false),
                    })
                })
                .collect(),
            closed: AtomicBool::new(false),
            st: Mutex::new(MeshSt {
                peers: (0..n).map(|j| (j != rank).then_some(Peer::Up)).collect(),
                ..MeshSt::default()
            }),
            cv: Condvar::new(),
        });
        for j in (0..n).filter(|&j| j != rank) {
            let m = mesh.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("emu-nccl-link{j}"))
                .spawn(move || m.read_link(j));
            if let Err(e) = spawned {
                mesh.lost(
                    j,
                    format!("gpu-emu: cannot start the reader of the link to rank {j}: {e}"),
                );
            }
        }
        mesh
    }

    fn who(&self, j: usize) -> String {
        format!("rank {j} (process {})", self.eps[j].pid)
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Marks `j` lost (unless it left) with the text every wait and send
    /// that needs it reports.
    fn lost(&self, j: usize, why: String) {
        let msg = format!("{} is gone: {why}", self.who(j));
        let mut st = self.st.lock();
        if let Some(p @ Some(Peer::Up)) = st.peers.get_mut(j) {
            *p = Some(Peer::Lost(msg.clone()));
            if !self.is_closed() {
                st.first_lost.get_or_insert(msg);
            }
        }
        self.cv.notify_all();
    }

    /// The first peer lost while this mesh was open (its text names the
    /// rank and its process), whether or not any work needed it.
    pub(crate) fn first_lost(&self) -> Option<String> {
        self.st.lock().first_lost.clone()
    }

    /// The reader of the link to `j`.
    fn read_link(self: Arc<Self>, j: usize) {
        let Some(link) = &self.links[j] else { return };
        let stop = || {
            self.st
                .lock()
                .closed_at
                .is_some_and(|t| t.elapsed() > DRAIN)
        };
        let mut cur: Option<Partial> = None;
        loop {
            let f = match wire::read_frame(&link.s, &stop) {
                Ok(Some(f)) => f,
                Ok(None) => {
                    self.lost(j, gone_reason(None));
                    return;
                }
                Err(e) => {
                    if !self.is_closed() {
                        self.lost(j, gone_reason(Some(&e)));
                    }
                    return;
                }
            };
            match (f, cur.take()) {
                (
                    Frame::Coll {
                        seq,
                        kind,
                        dt,
                        op,
                        count,
                        root,
                        total,
                    },
                    None,
                ) => {
                    let msg = CollMsg {
                        kind,
                        dt,
                        op,
                        count,
                        root,
                        data: Vec::new(),
                    };
                    cur = Some(Partial::Coll(seq, msg, total as usize));
                }
                (
                    Frame::P2p {
                        seq,
                        dt,
                        count,
                        total,
                    },
                    None,
                ) => {
                    cur = Some(Partial::P2p(
                        seq,
                        P2pMsg {
                            dt,
                            count,
                            data: Vec::new(),
                        },
                        total as usize,
                    ));
                }
                (Frame::Chunk(b), Some(mut p)) => {
                    let (data, total) = match &mut p {
                        Partial::Coll(_, m, t) => (&mut m.data, *t),
                        Partial::P2p(_, m, t) => (&mut m.data, *t),
                    };
                    if data.len() + b.len() > total {
                        self.lost(j, "it sent more than it announced".into());
                        return;
                    }
                    data.extend_from_slice(&b);
                    cur = Some(p);
                }
                (Frame::Split { seq, color, key }, None) => {
                    let mut st = self.st.lock();
                    if !st.discard.contains(&seq) {
                        st.splits.insert((seq, j), (color, key));
                        self.cv.notify_all();
                    }
                }
                (Frame::Bye, None) => {
                    let mut st = self.st.lock();
                    if let Some(p @ Some(Peer::Up)) = st.peers.get_mut(j) {
                        *p = Some(Peer::Left);
                    }
                    self.cv.notify_all();
                }
                (other, _) => {
                    self.lost(j, format!("it sent an unexpected {other:?}"));
                    return;
                }
            }
            let complete = match &cur {
                Some(Partial::Coll(_, m, t)) => m.data.len() == *t,
                Some(Partial::P2p(_, m, t)) => m.data.len() == *t,
                None => false,
            };
            if complete {
                let mut st = self.st.lock();
                match cur.take() {
                    Some(Partial::Coll(seq, m, _)) => {
                        st.coll.insert((seq, j), m);
                    }
                    Some(Partial::P2p(seq, m, _)) => {
                        st.p2p.insert((j, seq), m);
                    }
                    None => {}
                }
                self.cv.notify_all();
            }
        }
    }

    /// Writes one message to `j`: `Ok(())` also when it was dropped (`j`
    /// left), `None` when this mesh closed meanwhile.
    fn send(&self, j: usize, head: &Frame, data: &[u8]) -> Option<Result<(), CollErr>> {
        let link = self.links.get(j)?.as_ref()?;
        if let Some(r) = self.st.lock().fate(j) {
            return Some(r);
        }
        let stop = || self.is_closed();
        let failed = {
            let _w = link.w.lock();
            if link.broken.load(Ordering::Acquire) {
                None
            } else {
                let r = wire::write_frame(&link.s, head, &stop)
                    .and_then(|()| wire::write_chunks(&link.s, data, &stop));
                match r {
                    Ok(()) => return Some(Ok(())),
                    Err(e) => {
                        link.broken.store(true, Ordering::Release);
                        Some(e)
                    }
                }
            }
        };
        if self.is_closed() {
            return None;
        }
        self.settle(j, failed.as_ref())
    }

    /// The link to `j` broke under a writer (`e`, or an earlier writer's
    /// error): `j` closed its end, and only what it sent before (a `Bye`
    /// or not) says whether it left or was lost, so this waits for the
    /// reader to reach the link's end, at most [`SETTLE`], then marks `j`
    /// lost if the reader has not decided; `None` when the mesh closes
    /// first.
    fn settle(&self, j: usize, e: Option<&std::io::Error>) -> Option<Result<(), CollErr>> {
        let deadline = Instant::now() + SETTLE;
        {
            let mut st = self.st.lock();
            loop {
                if self.is_closed() {
                    return None;
                }
                if let Some(r) = st.fate(j) {
                    return Some(r);
                }
                if Instant::now() >= deadline {
                    break;
                }
                self.cv.wait_for(&mut st, IO_TICK);
            }
        }
        self.lost(j, gone_reason(e));
        Some(self.st.lock().fate(j).unwrap_or(Ok(())))
    }

    /// Waits until `take` finds what it needs from the peers in `need`;
    /// `Err` when a peer it still needs is lost, `None` when this mesh
    /// closed first.
    fn wait<T>(
        &self,
        need: &[usize],
        mut take: impl FnMut(&mut MeshSt) -> Option<T>,
        has: impl Fn(&MeshSt, usize) -> bool,
    ) -> Option<Result<T, CollErr>> {
        let mut st = self.st.lock();
        loop {
            if self.is_closed() {
                return None;
            }
            if let Some(v) = take(&mut st) {
                return Some(Ok(v));
            }
            for &j in need {
                if let Some(Some(Peer::Lost(why))) = st.peers.get(j)
                    && !has(&st, j)
                {
                    return Some(Err(remote(why.clone())));
                }
            }
            self.cv.wait_for(&mut st, IO_TICK);
        }
    }

    /// Writes this rank's outputs, unless the mesh is closed.
    fn write_out(&self, writes: &[(u64, Vec<u8>)]) -> Option<Result<(), CollErr>> {
        let _st = self.st.lock();
        if self.is_closed() {
            return None;
        }
        Some(write_all(writes))
    }

    /// Runs collective `seq` on this rank; `None` when the mesh closed
    /// before it completed.
    pub(crate) fn run_coll(&self, seq: u64, d: Desc) -> Option<Result<(), CollErr>> {
        if self.is_closed() {
            return None;
        }
        let (n, r) = (self.eps.len(), self.rank);
        let b = d.count * d.dt.size();
        let (sn, _) = d.kind.sizes(d.count, n, r == d.root)?;
        // A rank that sends nothing (a broadcast's non-root, a scatter's)
        // may pass any send pointer: it is not read.
        let own = match sn {
            0 => Vec::new(),
            _ => match read(d.send, sn * d.dt.size()) {
                Ok(v) => v,
                Err(e) => return Some(Err(e)),
            },
        };
        let block = |j: usize| own.get(j * b..(j + 1) * b).unwrap_or(&[]);
        let for_peer = |j: usize| -> &[u8] {
            match d.kind {
                Kind::AllReduce | Kind::AllGather => &own,
                Kind::Broadcast if r == d.root => &own,
                Kind::Reduce | Kind::Gather if j == d.root => &own,
                Kind::ReduceScatter | Kind::AlltoAll => block(j),
                Kind::Scatter if r == d.root => block(j),
                _ => &[],
            }
        };
        let (kind, dt, op) = (d.kind.code(), d.dt.code(), d.op.code());
        let peers: Vec<usize> = (0..n).filter(|&j| j != r).collect();
        for &j in &peers {
            let data = for_peer(j);
            let head = Frame::Coll {
                seq,
                kind,
                dt,
                op,
                count: d.count as u64,
                root: d.root as u32,
                total: data.len() as u64,
            };
            if let Err(e) = self.send(j, &head, data)? {
                return Some(Err(e));
            }
        }
        let got = self.wait(
            &peers,
            |st| {
                peers
                    .iter()
                    .all(|&j| st.coll.contains_key(&(seq, j)))
                    .then(|| {
                        peers
                            .iter()
                            .filter_map(|&j| st.coll.remove(&(seq, j)))
                            .collect::<Vec<_>>()
                    })
            },
            |st, j| st.coll.contains_key(&(seq, j)),
        )?;
        let msgs = match got {
            Ok(m) => m,
            Err(e) => return Some(Err(e)),
        };
        let mine = match d.kind {
            Kind::ReduceScatter | Kind::AlltoAll | Kind::Scatter => block(r).to_vec(),
            _ => own.clone(),
        };
        let mut inputs: Vec<Vec<u8>> = Vec::with_capacity(n);
        let mut mine = Some(mine);
        let mut it = msgs.into_iter();
        for j in 0..n {
            if j == r {
                inputs.push(mine.take().unwrap_or_default());
                continue;
            }
            let Some(m) = it.next() else {
                return Some(Err(remote("a message went missing".into())));
            };
            if (m.kind, m.dt, m.op, m.count, m.root)
                != (kind, dt, op, d.count as u64, d.root as u32)
            {
                return Some(Err((
                    ncclResult_t::ncclInvalidUsage,
                    format!(
                        "mismatched {:?} arguments across ranks (rank {j} differs)",
                        d.kind
                    ),
                )));
            }
            inputs.push(m.data);
        }
        let out = match d.kind {
            Kind::AllReduce | Kind::ReduceScatter => Some(reduce(d.dt, d.op, &inputs)),
            Kind::Reduce => (r == d.root).then(|| reduce(d.dt, d.op, &inputs)),
            Kind::Broadcast | Kind::Scatter => Some(inputs[d.root].clone()),
            Kind::AllGather | Kind::AlltoAll => Some(inputs.concat()),
            Kind::Gather => (r == d.root).then(|| inputs.concat()),
        };
        let expect = d.kind.sizes(d.count, n, r == d.root)?.1 * d.dt.size();
        match out {
            Some(o) if o.len() != expect => Some(Err((
                ncclResult_t::ncclInvalidUsage,
                format!(
                    "{:?}: a peer sent {} bytes where {expect} were expected",
                    d.kind,
                    o.len()
                ),
            ))),
            Some(o) => self.write_out(&[(d.recv, o)]),
            None => Some(Ok(())),
        }
    }

    /// Posts `count` elements at `buf` for peer `j`, as this rank's send
    /// number `seq` to it.
    pub(crate) fn run_send(
        &self,
        j: usize,
        seq: u64,
        buf: u64,
        count: usize,
        dt: Dt,
    ) -> Option<Result<(), CollErr>> {
        if self.is_closed() {
            return None;
        }
        let data = match read(buf, count * dt.size()) {
            Ok(v) => v,
            Err(e) => return Some(Err(e)),
        };
        let head = Frame::P2p {
            seq,
            dt: dt.code(),
            count: count as u64,
            total: data.len() as u64,
        };
        self.send(j, &head, &data)
    }

    /// Receives peer `j`'s send number `seq` to this rank into `buf`.
    pub(crate) fn run_recv(
        &self,
        j: usize,
        seq: u64,
        buf: u64,
        count: usize,
        dt: Dt,
    ) -> Option<Result<(), CollErr>> {
        let m = match self.wait(
            &[j],
            |st| st.p2p.remove(&(j, seq)),
            |st, j| st.p2p.contains_key(&(j, seq)),
        )? {
            Ok(m) => m,
            Err(e) => return Some(Err(e)),
        };
        if m.count != count as u64 || m.dt != dt.code() || m.data.len() != count * dt.size() {
            return Some(Err((
                ncclResult_t::ncclInvalidUsage,
                format!(
                    "recv of {count} {dt:?} from rank {j} matched a send of {} elements of type code {}",
                    m.count, m.dt
                ),
            )));
        }
        self.write_out(&[(buf, m.data)])
    }

    /// Tells every peer this rank's part in split `seq`.
    pub(crate) fn send_split(&self, seq: u64, color: i32, key: i32) -> Result<(), CollErr> {
        let head = Frame::Split { seq, color, key };
        for j in (0..self.eps.len()).filter(|&j| j != self.rank) {
            match self.send(j, &head, &[]) {
                Some(Ok(())) => {}
                Some(Err(e)) => return Err(e),
                None => {
                    return Err((
                        ncclResult_t::ncclInvalidUsage,
                        "the communicator was aborted".into(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every rank's (color, key) of split `seq` (this rank's given);
    /// `None` when the mesh closed or `stop` said so first.
    pub(crate) fn wait_splits(
        &self,
        seq: u64,
        mine: (i32, i32),
        stop: &dyn Fn() -> bool,
    ) -> Option<Result<Vec<(i32, i32)>, CollErr>> {
        let peers: Vec<usize> = (0..self.eps.len()).filter(|&j| j != self.rank).collect();
        let mut st = self.st.lock();
        loop {
            if self.is_closed() || stop() {
                return None;
            }
            if peers.iter().all(|&j| st.splits.contains_key(&(seq, j))) {
                let all = (0..self.eps.len())
                    .map(|j| {
                        if j == self.rank {
                            Some(mine)
                        } else {
                            st.splits.remove(&(seq, j))
                        }
                    })
                    .collect::<Option<Vec<_>>>()?;
                return Some(Ok(all));
            }
            for &j in &peers {
                if let Some(Some(Peer::Lost(why))) = st.peers.get(j)
                    && !st.splits.contains_key(&(seq, j))
                {
                    return Some(Err(remote(why.clone())));
                }
            }
            self.cv.wait_for(&mut st, IO_TICK);
        }
    }

    /// Drops the messages of split `seq`, now and later.
    pub(crate) fn discard_splits(&self, seq: u64) {
        let mut st = self.st.lock();
        st.discard.insert(seq);
        st.splits.retain(|(s, _), _| *s != seq);
    }

    /// Closes this rank's side (destroy or abort): no more output is
    /// written, blocked waits end, every peer is told `Bye` (unless a
    /// writer was cut off inside a message on that link), and the readers
    /// drain for [`DRAIN`]. Closing twice does nothing.
    pub(crate) fn close(&self) {
        {
            let mut st = self.st.lock();
            if self.closed.swap(true, Ordering::AcqRel) {
                return;
            }
            st.closed_at = Some(Instant::now());
            self.cv.notify_all();
        }
        let start = Instant::now();
        let stop = || start.elapsed() > BYE_WAIT;
        for link in self.links.iter().flatten() {
            if let Some(_w) = link.w.try_lock_for(BYE_WAIT)
                && !link.broken.load(Ordering::Acquire)
            {
                let _ = wire::write_frame(&link.s, &Frame::Bye, &stop);
            }
            let _ = link.s.shutdown(Shutdown::Write);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    /// A mesh of rank 0 of two whose link to rank 1 is one end of a
    /// loopback connection; the other end is returned, as rank 1.
    fn mesh() -> (Arc<Mesh>, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mine = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (theirs, _) = l.accept().expect("accept");
        wire::prepare(&mine).expect("prepare");
        let ep = Endpoint {
            nonce: 1,
            pid: std::process::id(),
            port: 0,
            device: 0,
            slot: 0,
        };
        (
            Mesh::start(7, 0, vec![ep, ep], vec![None, Some(mine)]),
            theirs,
        )
    }

    #[test]
    fn a_send_on_a_broken_link_waits_for_the_reader_to_say_left_or_lost() {
        for bye in [true, false] {
            let (m, theirs) = mesh();
            if let Some(Some(link)) = m.links.get(1) {
                link.broken.store(true, Ordering::Release);
            }
            let m2 = m.clone();
            let head = Frame::Split {
                seq: 1,
                color: 0,
                key: 0,
            };
            let t = std::thread::spawn(move || m2.send(1, &head, &[]));
            std::thread::sleep(Duration::from_millis(100));
            assert!(!t.is_finished(), "the send waits while the peer is up");
            if bye {
                wire::write_frame(&theirs, &Frame::Bye, &|| false).expect("bye");
            }
            drop(theirs);
            let r = t.join().expect("the sender");
            if bye {
                assert!(matches!(r, Some(Ok(()))), "dropped, the peer left");
            } else {
                assert!(
                    matches!(&r, Some(Err((ncclResult_t::ncclRemoteError, why))) if why.contains("rank 1")),
                    "lost"
                );
            }
            m.close();
        }
    }
}
