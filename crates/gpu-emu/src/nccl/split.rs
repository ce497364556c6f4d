//! `ncclCommSplit`: a collective over the parent; ranks of one color form
//! a communicator ordered by (key, parent rank).
//!
//! Invariants: a child shares its parent's chain only when the parent's
//! config sets `splitShare`; a blocking split waits for the child's peers
//! and ends when the parent is aborted meanwhile; a non-blocking parent's
//! split returns at once with no communicator, and stores the child once it
//! is ready, the parent in progress until then (as NCCL 2.28 does).

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, Ordering};

use nccl_sys::{NCCL_SPLIT_NOCOLOR, ncclComm_t, ncclConfig_t, ncclResult_t};

use super::R;
use super::comm::{COMMS, Cfg, Chain, Comm, Peers, lookup, parse_config};
use super::errors::{entry, err, fail};
use super::group::{GROUP, grouped, in_group};
use super::net::{self, Endpoint, Joining, Mesh};
use super::world::{Child, SplitEntry, World};
use crate::put;

/// `ncclCommSplit`: a collective over the parent; ranks of one color form a
/// communicator ordered by (key, parent rank).
///
/// # Safety
/// `newcomm` is null or valid for a write; `config` is null or a valid
/// config.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommSplit(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    entry(|| {
        grouped((|| {
            let parent = lookup(comm)?;
            let (rank, n, world) = parent.ready()?;
            parent.idle()?;
            let Some(world) = world else {
                return fail(
                    ncclResult_t::ncclInvalidUsage,
                    "split of a communicator that never joined",
                );
            };
            if newcomm.is_null() {
                return fail(ncclResult_t::ncclInvalidArgument, "newcomm is NULL");
            }
            let inherited = Cfg {
                blocking: parent.blocking,
                split_share: parent.split_share,
            };
            // SAFETY: `config` is null or valid (this function's contract).
            let cfg = unsafe { parse_config(config, inherited) }?;
            let blocking = cfg.blocking;
            // The parent's `splitShare` decides (`comm->shareResources` in
            // NCCL's `ncclCommSplit`): the child uses the parent's strong
            // stream, so their work is ordered as one communicator's.
            let chain = if parent.split_share {
                parent.chain.clone()
            } else {
                Chain::new()
            };
            if color < 0 && color != NCCL_SPLIT_NOCOLOR {
                return fail(
                    ncclResult_t::ncclInvalidArgument,
                    format!("invalid color {color}"),
                );
            }
            let child = (color != NCCL_SPLIT_NOCOLOR)
                .then(|| Comm::new(parent.device, cfg, chain, false, -1, -1));
            let h = child.as_ref().map_or(std::ptr::null_mut(), |c| c.handle());
            if let Some(c) = &child {
                COMMS.insert_at(c.id, c.clone());
            }
            // A non-blocking parent's child is handed over only once it is
            // ready, by a background thread, as NCCL does.
            let later = !parent.blocking && !in_group() && child.is_some();
            // SAFETY: `newcomm` is non-null and valid (this function's contract).
            unsafe { put(newcomm, if later { std::ptr::null_mut() } else { h }) };
            let seq = parent.split_seq.fetch_add(1, Ordering::AcqRel) + 1;
            match world {
                Peers::Local(w) => meet_local(&w, seq, rank, n, color, key, &child),
                Peers::Net(m) => meet_net(&m, seq, rank, color, key, &child)?,
            }
            let Some(child) = child else {
                return Ok(ncclResult_t::ncclSuccess);
            };
            if in_group() {
                GROUP.with(|g| g.borrow_mut().inits.push(child));
                return Ok(ncclResult_t::ncclSuccess);
            }
            if later {
                // SAFETY: `newcomm` stays valid until the parent leaves
                // `ncclInProgress` (NCCL's contract for a non-blocking split).
                unsafe { hand_over(&parent, child, newcomm) };
                return Ok(ncclResult_t::ncclSuccess);
            }
            if !blocking {
                return Ok(ncclResult_t::ncclInProgress);
            }
            parent.splitting.lock().push(child.clone());
            child.wait_ready();
            parent.splitting.lock().retain(|c| c.id != child.id);
            if child.aborted() {
                return fail(
                    ncclResult_t::ncclInternalError,
                    "split abandoned: the parent communicator was aborted",
                );
            }
            Ok(ncclResult_t::ncclSuccess)
        })())
    })
}

/// A non-blocking parent's split as NCCL 2.28 answers it: the call returns
/// `ncclSuccess` with `*newcomm` still NULL, and the parent is in progress
/// (`ncclCommGetAsyncError`) until a background thread, once the child is
/// ready (or failed, or was aborted with its parent), stores the child in
/// `*newcomm` (`ncclCommInitRankFunc` in NCCL's `src/init.cc`, whose
/// `ncclCommSplit` returns the result of `ncclCommInitChildComm` even when
/// the group it ends is non-blocking).
///
/// # Safety
/// `newcomm` is valid for a write until the parent leaves `ncclInProgress`.
unsafe fn hand_over(parent: &Arc<Comm>, child: Arc<Comm>, newcomm: *mut ncclComm_t) {
    parent.st.lock().pending += 1;
    parent.splitting.lock().push(child.clone());
    let (owner, id) = (parent.clone(), child.id);
    let out = newcomm as usize;
    let spawned = std::thread::Builder::new()
        .name("emu-nccl-split".into())
        .spawn(move || {
            child.wait_ready();
            owner.splitting.lock().retain(|c| c.id != child.id);
            // SAFETY: the caller keeps `*newcomm` valid until the parent
            // leaves `ncclInProgress`, which it does only below.
            let slot = unsafe { AtomicPtr::from_ptr(out as *mut ncclComm_t) };
            slot.store(child.handle(), Ordering::Release);
            let mut st = owner.st.lock();
            st.pending = st.pending.saturating_sub(1);
            owner.cv.notify_all();
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "could not start the emulated NCCL split thread");
        parent.splitting.lock().retain(|c| c.id != id);
        parent.set_async(
            ncclResult_t::ncclSystemError,
            "could not start the background split thread",
        );
        let mut st = parent.st.lock();
        st.pending = st.pending.saturating_sub(1);
    }
}

/// Adds this rank's part in split `seq` to the in-process world; the last
/// rank to arrive makes every child's world.
fn meet_local(
    world: &World,
    seq: u64,
    rank: usize,
    n: usize,
    color: i32,
    key: i32,
    child: &Option<Arc<Comm>>,
) {
    let mut st = world.st.lock();
    let entries = st
        .splits
        .entry(seq)
        .or_insert_with(|| std::iter::repeat_with(|| None).take(n).collect());
    entries[rank] = Some(SplitEntry {
        color,
        key,
        comm: child.clone().map(|c| c as Child),
    });
    if !entries.iter().all(Option::is_some) {
        return;
    }
    let entries: Vec<SplitEntry> = st
        .splits
        .remove(&seq)
        .unwrap_or_default()
        .into_iter()
        .flatten()
        .collect();
    let mut by_color: BTreeMap<i32, Vec<(i32, usize, Child)>> = BTreeMap::new();
    for (r, e) in entries.into_iter().enumerate() {
        if let Some(c) = e.comm {
            by_color.entry(e.color).or_default().push((e.key, r, c));
        }
    }
    for (_, mut members) in by_color {
        members.sort_by_key(|(k, r, _)| (*k, *r));
        let w = World::new(members.iter().map(|(_, _, c)| c.device()).collect());
        let len = members.len() as i32;
        for (i, (_, _, c)) in members.into_iter().enumerate() {
            c.join_local(i as i32, len, w.clone());
        }
    }
}

/// Tells every peer process this rank's part in split `seq`; a child then
/// waits for every rank's part and builds its mesh on a thread of its own,
/// routed by its parent rank under a key every rank derives alike.
fn meet_net(
    mesh: &Arc<Mesh>,
    seq: u64,
    rank: usize,
    color: i32,
    key: i32,
    child: &Option<Arc<Comm>>,
) -> R<()> {
    let ckey = net::child_key(mesh.key, seq);
    let joining = match child {
        Some(c) => Some(
            net::expect(ckey, rank as u32, c.id)
                .map_err(|m| err(ncclResult_t::ncclInvalidArgument, m))?,
        ),
        None => None,
    };
    if let Err((code, msg)) = mesh.send_split(seq, color, key) {
        if let Some(c) = child {
            net::forget(c.id);
            c.fail_init(code, &msg);
        }
        return fail(code, msg);
    }
    match (child, joining) {
        (Some(c), Some(j)) => spawn_child(mesh.clone(), c.clone(), j, ckey, seq, (color, key)),
        _ => mesh.discard_splits(seq),
    }
    Ok(())
}

/// Waits on a thread of its own for every rank's part in split `seq` of
/// `parent`, then builds the mesh of the child of this rank's color:
/// ranks ordered by (key, parent rank), each routed by its parent rank.
fn spawn_child(
    parent: Arc<Mesh>,
    child: Arc<Comm>,
    joining: Arc<Joining>,
    key: u128,
    seq: u64,
    mine: (i32, i32),
) {
    let c = child.clone();
    let spawned = std::thread::Builder::new()
        .name("emu-nccl-split".into())
        .spawn(move || {
            let stop = || c.aborted();
            let all = match parent.wait_splits(seq, mine, &stop) {
                None => {
                    net::forget(c.id);
                    return;
                }
                Some(Err((code, msg))) => {
                    net::forget(c.id);
                    c.fail_init(code, &msg);
                    return;
                }
                Some(Ok(all)) => all,
            };
            let mut members: Vec<(i32, usize)> = all
                .iter()
                .enumerate()
                .filter(|(_, (color, _))| *color == mine.0)
                .map(|(r, (_, k))| (*k, r))
                .collect();
            members.sort_unstable();
            let me = members
                .iter()
                .position(|&(_, r)| r == parent.rank)
                .unwrap_or(0);
            let eps = members
                .iter()
                .map(|&(_, r)| Endpoint {
                    slot: r as u32,
                    ..parent.eps[r]
                })
                .collect();
            c.build_mesh(joining, key, me, eps);
        });
    if let Err(e) = spawned {
        net::forget(child.id);
        child.fail_init(
            ncclResult_t::ncclSystemError,
            &format!("gpu-emu: cannot start the split thread: {e}"),
        );
    }
}
