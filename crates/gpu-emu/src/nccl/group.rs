//! Groups: `ncclGroupStart` / `ncclGroupEnd`, per thread, nesting; the
//! outermost end launches the group's items, one task per stream with
//! sends first.
//!
//! Invariants: a grouped call that fails makes the group end fail; the
//! group is one launch per communicator chain (one ticket per chain for
//! all its items); with work of a non-blocking communicator the tasks are
//! enqueued in the background and the end is `ncclInProgress`.

use std::cell::RefCell;
use std::sync::Arc;

use nccl_sys::{ncclResult_t, ncclSimInfo_t};

use super::R;
use super::comm::Comm;
use super::errors::{entry, err, fail, unimplemented};
use super::launch::{Body, Job, Tickets, defer, group_launcher, launch, sequence};
use crate::stream::{self, Target};

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
    // One task per stream, sends first, streams in order of first use.
    let mut per: Vec<(Target, Vec<GroupItem>)> = Vec::new();
    for it in items {
        match per
            .iter_mut()
            .find(|(t, _)| Arc::ptr_eq(&t.stream, &it.target.stream))
        {
            Some((_, v)) => v.push(it),
            None => {
                let t = Target {
                    stream: it.target.stream.clone(),
                    sync: it.target.sync,
                };
                per.push((t, vec![it]));
            }
        }
    }
    for (_, v) in per.iter_mut() {
        v.sort_by_key(|it| !it.is_send);
    }
    let deferred = per
        .iter()
        .any(|(t, v)| !t.stream.capturing() && v.iter().any(|it| !it.comm.blocking));
    let mut result = ncclResult_t::ncclSuccess;
    // The group is one launch per communicator: its items on every stream
    // share one ticket of the communicator's chain (one per chain, see
    // `Tickets`). Work recorded on a capturing stream takes its tickets at
    // each graph launch instead.
    let mut tickets = Tickets::default();
    let recorded = |t: &Target, v: Vec<GroupItem>| {
        let items = v.into_iter().map(|it| (it.comm, it.body)).collect();
        stream::enqueue(t, group_launcher(items));
    };
    if deferred {
        let mut job = Job::default();
        for (t, v) in per {
            if t.stream.capturing() {
                recorded(&t, v);
                continue;
            }
            let mut works = Vec::with_capacity(v.len());
            for it in v {
                let (w, need) = launch(&it.comm, &it.body, tickets.of(&it.comm));
                job.add_comm(&it.comm, need);
                works.push((it.comm, w));
            }
            job.items.push((t, works));
        }
        drop(tickets);
        defer(job);
        result = ncclResult_t::ncclInProgress;
    } else {
        let mut waits = Vec::new();
        for (t, v) in per {
            if t.stream.capturing() {
                recorded(&t, v);
                continue;
            }
            let works = v
                .iter()
                .map(|it| launch(&it.comm, &it.body, tickets.of(&it.comm)).0)
                .collect();
            stream::push_launched(&t, sequence(works));
            if t.sync {
                waits.push(t.stream);
            }
        }
        drop(tickets);
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
