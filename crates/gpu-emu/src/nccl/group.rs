//! Groups: `ncclGroupStart` / `ncclGroupEnd`, per thread, nesting; the
//! outermost end launches the group's items in call order, one task per
//! stream with sends first.
//!
//! Invariants: a grouped call that fails makes the group end fail; the
//! group is one launch per communicator chain (one ticket per chain for
//! all its items); an item's sequence number (among its communicator's
//! collectives, or its sends to or receives from one peer) is its place
//! in the calls, whatever its stream; with work of a non-blocking communicator the tasks are
//! enqueued in the background and the end is `ncclInProgress`.

use std::cell::RefCell;
use std::sync::Arc;

use nccl_sys::{ncclResult_t, ncclSimInfo_t};

use super::R;
use super::comm::Comm;
use super::errors::{entry, err, fail, unimplemented};
use super::launch::{
    Body, Captured, Job, Join, Need, Tickets, defer, group_launcher, launch, sequence,
};
use crate::cuda::stream::{self, Target, Work};

pub(super) struct GroupItem {
    pub(super) target: Target,
    pub(super) is_send: bool,
    pub(super) comm: Arc<Comm>,
    pub(super) body: Arc<Body>,
}

#[derive(Default)]
pub(super) struct Grp {
    pub(super) depth: u32,
    pub(super) items: Vec<GroupItem>,
    pub(super) inits: Vec<Arc<Comm>>,
    pub(super) err: Option<ncclResult_t>,
}

thread_local! {
    pub(super) static GROUP: RefCell<Grp> = RefCell::new(Grp::default());
}

pub(super) fn in_group() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

/// Records a failure of a grouped call so that the group end reports it.
pub(super) fn grouped<T>(r: R<T>) -> R<T> {
    if let Err(e) = &r {
        GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.depth > 0 && g.err.is_none() {
                g.err = Some(*e);
            }
        });
    }
    r
}

pub(super) fn group_end() -> R<ncclResult_t> {
    let taken = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return None;
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Some(None);
        }
        Some(Some((
            std::mem::take(&mut g.items),
            std::mem::take(&mut g.inits),
            g.err.take(),
        )))
    });
    let (items, inits, gerr) = match taken {
        None => {
            return fail(
                ncclResult_t::ncclInvalidUsage,
                "ncclGroupEnd without ncclGroupStart",
            );
        }
        Some(None) => return Ok(ncclResult_t::ncclSuccess),
        Some(Some(t)) => t,
    };
    if let Some(e) = gerr {
        return Err(e);
    }
    let mut involved: Vec<&Arc<Comm>> = Vec::new();
    for it in &items {
        if !involved.iter().any(|c| Arc::ptr_eq(c, &it.comm)) {
            involved.push(&it.comm);
        }
    }
    for c in involved {
        c.enqueue_call()?;
    }
    // One task per stream, streams in order of first use. Every item is
    // launched in call order (its sequence number among the
    // communicator's collectives, or among its sends to or receives from
    // its peer, is its place in the calls, whatever its stream), and each
    // task runs its sends first: a send only posts, so no receive waits
    // for a send queued behind it.
    let mut targets: Vec<Target> = Vec::new();
    let mut at: Vec<usize> = Vec::with_capacity(items.len());
    for it in &items {
        let k = match targets
            .iter()
            .position(|t| Arc::ptr_eq(&t.stream, &it.target.stream))
        {
            Some(k) => k,
            None => {
                targets.push(Target {
                    stream: it.target.stream.clone(),
                    sync: it.target.sync,
                });
                targets.len() - 1
            }
        };
        at.push(k);
    }
    let deferred = items
        .iter()
        .any(|it| !it.target.stream.capturing() && !it.comm.blocking);
    let mut result = ncclResult_t::ncclSuccess;
    // The group is one launch per communicator: its items on every stream
    // share one ticket of the communicator's chain (one per chain, see
    // `Tickets`). Work recorded on a capturing stream takes its tickets
    // and numbers at each graph launch instead.
    let mut tickets = Tickets::default();
    let mut launched: Vec<Vec<Launched>> = targets.iter().map(|_| Vec::new()).collect();
    let mut recorded: Vec<Vec<Captured>> = targets.iter().map(|_| Vec::new()).collect();
    for (it, k) in items.into_iter().zip(at) {
        if targets[k].stream.capturing() {
            recorded[k].push((it.comm, it.body, it.is_send));
            continue;
        }
        let (work, need) = launch(&it.comm, &it.body, tickets.of(&it.comm));
        launched[k].push(Launched {
            comm: it.comm,
            is_send: it.is_send,
            work,
            need,
        });
    }
    drop(tickets);
    for (t, r) in targets.iter().zip(recorded) {
        if !r.is_empty() {
            stream::enqueue(t, group_launcher(r));
        }
    }
    let launched: Vec<(Target, Vec<Launched>)> = targets
        .into_iter()
        .zip(launched)
        .filter(|(_, v)| !v.is_empty())
        .collect();
    // With several streams, each stream's part meets the others before
    // and after its items (`Join`).
    let join = (launched.len() > 1).then(|| {
        let mut comms: Vec<Arc<Comm>> = Vec::new();
        for l in launched.iter().flat_map(|(_, v)| v) {
            if !comms.iter().any(|c| Arc::ptr_eq(c, &l.comm)) {
                comms.push(l.comm.clone());
            }
        }
        Join::new(launched.len(), comms)
    });
    let part = |v: Vec<Launched>| -> Part {
        let mut comms: Vec<Arc<Comm>> = Vec::new();
        let mut needs = Vec::new();
        let mut works = Vec::with_capacity(v.len());
        for l in sends_first(v) {
            if !comms.iter().any(|c| Arc::ptr_eq(c, &l.comm)) {
                comms.push(l.comm.clone());
            }
            needs.push((l.comm, l.need));
            works.push(l.work);
        }
        let work = match &join {
            Some(j) => j.part(works),
            None => sequence(works),
        };
        Part { comms, work, needs }
    };
    if deferred {
        let mut job = Job::default();
        for (t, v) in launched {
            let Part { comms, work, needs } = part(v);
            for (c, need) in needs {
                job.add_comm(&c, need);
            }
            // A part is dropped unrun only once all its communicators are
            // aborted, which also ends the other parts' waits for it; an
            // item of an aborted communicator in a part that runs ends
            // unrun by itself (`launch`).
            job.items.push((t, vec![(comms, work)]));
        }
        defer(job);
        result = ncclResult_t::ncclInProgress;
    } else {
        let mut waits = Vec::new();
        for (t, v) in launched {
            stream::push_launched(&t, part(v).work);
            if t.sync {
                waits.push(t.stream);
            }
        }
        for s in waits {
            s.wait_idle().map_err(|e| {
                err(
                    ncclResult_t::ncclUnhandledCudaError,
                    format!("stream error {}", e.0),
                )
            })?;
        }
    }
    for c in inits {
        if c.blocking {
            c.wait_ready();
            if let Some(code) = c.init_error() {
                return Err(code);
            }
        } else if c.st.lock().world.is_none() {
            result = ncclResult_t::ncclInProgress;
        }
    }
    Ok(result)
}

/// A group item launched on a stream that is not capturing.
struct Launched {
    comm: Arc<Comm>,
    is_send: bool,
    work: Work,
    need: Need,
}

/// One stream's part of a group launch: its communicators, its work, and
/// what each item's first operation waits for.
struct Part {
    comms: Vec<Arc<Comm>>,
    work: Work,
    needs: Vec<(Arc<Comm>, Need)>,
}

/// `v` with its sends first, each part in call order.
fn sends_first(v: Vec<Launched>) -> Vec<Launched> {
    let (mut sends, rest): (Vec<_>, Vec<_>) = v.into_iter().partition(|l| l.is_send);
    sends.extend(rest);
    sends
}

/// `ncclGroupSimulateEnd`: not implemented.
///
/// # Safety
/// No pointer is used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGroupSimulateEnd(_sim: *mut ncclSimInfo_t) -> ncclResult_t {
    entry(|| Err(unimplemented("ncclGroupSimulateEnd")))
}

/// `ncclGroupStart`: groups nest per thread.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGroupStart() -> ncclResult_t {
    entry(|| {
        GROUP.with(|g| g.borrow_mut().depth += 1);
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclGroupEnd`: the outermost end launches the group, one task per
/// stream with sends first; with work of a non-blocking communicator the
/// tasks are enqueued in the background and the end is `ncclInProgress`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGroupEnd() -> ncclResult_t {
    entry(group_end)
}
