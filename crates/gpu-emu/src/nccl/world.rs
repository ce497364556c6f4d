//! The in-process meeting of a communicator's ranks: a [`World`] where
//! collectives meet by sequence number and sends post copies of their data
//! into mailboxes keyed by (source, destination, the send's number among
//! the source's sends to the destination), which the receive of the same
//! number takes.
//!
//! Invariants: a collective is computed once, by the last rank to arrive,
//! under the world's lock: every input is read before any output is written
//! (in-place works), and no output is written once a participant has
//! aborted, so an aborted rank's buffers are never touched after
//! `ncclCommAbort` returns. Every access to device memory goes through
//! `memory::access`, all or nothing. The world knows no communicator: a
//! split's children are [`SplitChild`]ren, which the last rank to arrive
//! gives their own worlds.
//!
//! Lock order: the world's state, then the memory registry (an
//! operation's reads and writes run under it) or a split child's
//! `Comm::st` (the child's world is set under it). No one holds another
//! lock while taking it (a launch or an abort releases its
//! communicator's state first).

use std::collections::BTreeMap;
use std::sync::Arc;

use nccl_sys::ncclResult_t;
use parking_lot::{Condvar, Mutex};

use super::TICK;
use super::coll::{CollErr, Desc, Kind, read, write_all};
use super::data::{Dt, reduce};

pub(super) struct Slot {
    pub(super) descs: Vec<Option<Desc>>,
    pub(super) done: bool,
    pub(super) error: Option<(ncclResult_t, String)>,
    pub(super) left: usize,
}

pub(super) struct Msg {
    pub(super) data: Vec<u8>,
    pub(super) count: usize,
    pub(super) dt: Dt,
}

/// A communicator made by a split, as the world gathering the split sees
/// it: the last rank to arrive gives every child of a color its own world.
pub(super) trait SplitChild: Send + Sync {
    /// The child's device.
    fn device(&self) -> i32;
    /// Makes the child rank `rank` of `nranks` of `world`.
    fn join_local(&self, rank: i32, nranks: i32, world: Arc<World>);
}

/// A split's child, as the world holds it.
pub(super) type Child = Arc<dyn SplitChild>;

/// One rank's part in a split: its color and key, and its child (none for
/// `NCCL_SPLIT_NOCOLOR`).
pub(super) struct SplitEntry {
    pub(super) color: i32,
    pub(super) key: i32,
    pub(super) comm: Option<Child>,
}

pub(super) struct WorldSt {
    pub(super) aborted: Vec<bool>,
    /// The highest collective sequence number each rank has launched.
    pub(super) launched: Vec<u64>,
    /// Point-to-point operations launched, by (source, destination, is the
    /// send side).
    pub(super) p2p: BTreeMap<(usize, usize, bool), u64>,
    pub(super) slots: BTreeMap<u64, Slot>,
    /// Sends posted and not yet received, by (source, destination, the
    /// send's number among the source's sends to the destination).
    pub(super) mail: BTreeMap<(usize, usize, u64), Msg>,
    pub(super) splits: BTreeMap<u64, Vec<Option<SplitEntry>>>,
}

/// The ranks of one communicator, once all have joined.
pub(super) struct World {
    pub(super) n: usize,
    /// Each rank's device.
    pub(super) devices: Vec<i32>,
    pub(super) st: Mutex<WorldSt>,
    pub(super) cv: Condvar,
}

impl World {
    pub(super) fn new(devices: Vec<i32>) -> Arc<World> {
        let n = devices.len();
        Arc::new(World {
            n,
            devices,
            st: Mutex::new(WorldSt {
                aborted: vec![false; n],
                launched: vec![0; n],
                p2p: BTreeMap::new(),
                slots: BTreeMap::new(),
                mail: BTreeMap::new(),
                splits: BTreeMap::new(),
            }),
            cv: Condvar::new(),
        })
    }
}

/// Computes a collective from every rank's descriptor and writes outputs.
pub(super) fn compute(descs: &[Desc]) -> Result<(), CollErr> {
    let n = descs.len();
    let d0 = descs[0];
    if descs.iter().any(|d| {
        d.kind != d0.kind
            || d.count != d0.count
            || d.dt != d0.dt
            || d.op != d0.op
            || d.root != d0.root
    }) {
        return Err((
            ncclResult_t::ncclInvalidUsage,
            format!("mismatched {:?} arguments across ranks", d0.kind),
        ));
    }
    let b = d0.count * d0.dt.size();
    let root = d0.root;
    let mut writes: Vec<(u64, Vec<u8>)> = Vec::new();
    match d0.kind {
        Kind::AllReduce | Kind::Reduce => {
            let ins = descs
                .iter()
                .map(|d| read(d.send, b))
                .collect::<Result<Vec<_>, _>>()?;
            let acc = reduce(d0.dt, d0.op, &ins);
            if d0.kind == Kind::AllReduce {
                writes.extend(descs.iter().map(|d| (d.recv, acc.clone())));
            } else {
                writes.push((descs[root].recv, acc));
            }
        }
        Kind::Broadcast => {
            let data = read(descs[root].send, b)?;
            writes.extend(descs.iter().map(|d| (d.recv, data.clone())));
        }
        Kind::AllGather | Kind::Gather => {
            let mut all = Vec::with_capacity(b * n);
            for d in descs {
                all.extend(read(d.send, b)?);
            }
            if d0.kind == Kind::AllGather {
                writes.extend(descs.iter().map(|d| (d.recv, all.clone())));
            } else {
                writes.push((descs[root].recv, all));
            }
        }
        Kind::ReduceScatter => {
            let ins = descs
                .iter()
                .map(|d| read(d.send, b * n))
                .collect::<Result<Vec<_>, _>>()?;
            let acc = reduce(d0.dt, d0.op, &ins);
            for (r, d) in descs.iter().enumerate() {
                writes.push((d.recv, acc[r * b..(r + 1) * b].to_vec()));
            }
        }
        Kind::AlltoAll => {
            let ins = descs
                .iter()
                .map(|d| read(d.send, b * n))
                .collect::<Result<Vec<_>, _>>()?;
            for (r, d) in descs.iter().enumerate() {
                let mut o = Vec::with_capacity(b * n);
                for x in &ins {
                    o.extend_from_slice(&x[r * b..(r + 1) * b]);
                }
                writes.push((d.recv, o));
            }
        }
        Kind::Scatter => {
            let all = read(descs[root].send, b * n)?;
            for (r, d) in descs.iter().enumerate() {
                writes.push((d.recv, all[r * b..(r + 1) * b].to_vec()));
            }
        }
    }
    write_all(&writes)
}

/// `None` when the rank aborted before the collective completed.
pub(super) fn run_coll(w: &World, r: usize, seq: u64, d: Desc) -> Option<Result<(), CollErr>> {
    let n = w.n;
    let mut st = w.st.lock();
    if st.aborted[r] {
        return None;
    }
    let any_aborted = st.aborted.iter().any(|a| *a);
    let slot = st.slots.entry(seq).or_insert_with(|| Slot {
        descs: vec![None; n],
        done: false,
        error: None,
        left: 0,
    });
    slot.descs[r] = Some(d);
    if !slot.done && !any_aborted && slot.descs.iter().all(Option::is_some) {
        let descs: Vec<Desc> = slot.descs.iter().flatten().copied().collect();
        slot.error = compute(&descs).err();
        slot.done = true;
        w.cv.notify_all();
    }
    loop {
        let aborted = st.aborted[r];
        let slot = st.slots.get_mut(&seq)?;
        if slot.done {
            slot.left += 1;
            let e = slot.error.clone();
            if slot.left == n {
                st.slots.remove(&seq);
            }
            return Some(e.map_or(Ok(()), Err));
        }
        if aborted {
            return None;
        }
        w.cv.wait_for(&mut st, TICK);
    }
}

/// Posts send number `seq` of rank `r` to `peer`.
pub(super) fn run_send(
    w: &World,
    r: usize,
    peer: usize,
    seq: u64,
    buf: u64,
    count: usize,
    dt: Dt,
) -> Option<Result<(), CollErr>> {
    let mut st = w.st.lock();
    if st.aborted[r] {
        return None;
    }
    let data = match read(buf, count * dt.size()) {
        Ok(d) => d,
        Err(e) => return Some(Err(e)),
    };
    st.mail.insert((r, peer, seq), Msg { data, count, dt });
    w.cv.notify_all();
    Some(Ok(()))
}

/// Receive number `seq` of rank `r` from `peer`: it matches that peer's
/// send number `seq` to `r`.
pub(super) fn run_recv(
    w: &World,
    r: usize,
    peer: usize,
    seq: u64,
    buf: u64,
    count: usize,
    dt: Dt,
) -> Option<Result<(), CollErr>> {
    let mut st = w.st.lock();
    let m = loop {
        if st.aborted[r] {
            return None;
        }
        if let Some(m) = st.mail.remove(&(peer, r, seq)) {
            break m;
        }
        w.cv.wait_for(&mut st, TICK);
    };
    if m.count != count || m.dt != dt {
        return Some(Err((
            ncclResult_t::ncclInvalidUsage,
            format!(
                "recv of {count} {dt:?} from rank {peer} matched a send of {} {:?}",
                m.count, m.dt
            ),
        )));
    }
    Some(write_all(&[(buf, m.data)]))
}
