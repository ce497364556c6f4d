//! The end of a communicator and its queries: `ncclCommFinalize`,
//! `ncclCommDestroy`, `ncclCommAbort`, `ncclCommGetAsyncError`,
//! `ncclCommCount`, `ncclCommCuDevice`, `ncclCommUserRank`,
//! `ncclGetLastError`.
//!
//! Invariants: a destroy waits for the communicator's work and for its
//! peers' devices (NCCL's teardown unmaps buffers they map), ending early
//! only when the communicator is aborted; an abort frees the handle at
//! once and releases the communicator's blocked work promptly.

use std::collections::BTreeSet;
use std::ffi::{c_char, c_int};
use std::sync::atomic::Ordering;

use nccl_sys::{ncclComm_t, ncclResult_t};

use super::bootstrap::unjoin;
use super::comm::{ABORTED, COMMS, Comm, Peers, lookup, lookup_any};
use super::errors::{entry, newest_error, out};
use super::net;
use super::{CALLS, TICK};
use crate::{guard, ptr_to_id};

/// `ncclCommFinalize`: flushes the communicator's work (non-blocking
/// communicators report `ncclInProgress` while work is pending).
#[unsafe(no_mangle)]
pub extern "C" fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
    entry(|| {
        let c = lookup(comm)?;
        c.idle()?;
        let mut st = c.st.lock();
        st.finalizing = true;
        if !c.blocking {
            return Ok(if st.inflight > 0 {
                ncclResult_t::ncclInProgress
            } else {
                ncclResult_t::ncclSuccess
            });
        }
        while st.inflight > 0 && !c.aborted() {
            c.cv.wait_for(&mut st, TICK);
        }
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommDestroy`: waits for the communicator's work, then for the
/// peers' devices to be idle, then frees it. After an abort the handle is
/// already freed: `ncclInvalidUsage`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
    entry(|| {
        let c = lookup(comm)?;
        {
            let mut st = c.st.lock();
            while st.inflight > 0 && !c.aborted() {
                c.cv.wait_for(&mut st, TICK);
            }
        }
        let world = c.st.lock().world.clone();
        match world {
            Some(Peers::Local(_)) => wait_peer_devices_idle(&c),
            Some(Peers::Net(m)) => m.close(),
            None => {
                // An init still under way on a bootstrap or mesh thread
                // gives up.
                c.aborted.store(true, Ordering::Release);
                unjoin(&c);
                net::forget(c.id);
            }
        }
        COMMS.remove(c.id);
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// NCCL's teardown unmaps the buffers this rank shares with its peers'
/// devices, which waits for those devices: while another communicator has
/// work in flight on a peer's device (work that may be waiting for this
/// rank), the destroy does not return, until this communicator is aborted.
/// (Peers in other processes have devices of their own process: this wait
/// is not emulated across processes.)
pub(super) fn wait_peer_devices_idle(c: &Comm) {
    let Some(world) = c.st.lock().world.as_ref().and_then(Peers::local).cloned() else {
        return;
    };
    let peers: BTreeSet<i32> = world
        .devices
        .iter()
        .copied()
        .filter(|&d| d >= 0 && d != c.device)
        .collect();
    while !c.aborted() {
        let busy = COMMS
            .values()
            .iter()
            .any(|o| o.id != c.id && peers.contains(&o.device) && o.st.lock().inflight > 0);
        if !busy {
            return;
        }
        std::thread::sleep(TICK);
    }
}

/// `ncclCommAbort`: frees the communicator at once and releases its
/// blocked work promptly; peers stay blocked until they abort.
#[unsafe(no_mangle)]
pub extern "C" fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
    entry(|| {
        let c = lookup_any(comm)?;
        COMMS.remove(c.id);
        ABORTED.lock().insert(c.id);
        c.aborted.store(true, Ordering::Release);
        // Its work waiting for a turn on the chain ends now, unrun.
        c.chain.wake();
        for child in c.splitting.lock().drain(..) {
            child.aborted.store(true, Ordering::Release);
            let _st = child.st.lock();
            child.cv.notify_all();
        }
        let (rank, world) = {
            let st = c.st.lock();
            c.cv.notify_all();
            (st.rank, st.world.clone())
        };
        match world {
            Some(Peers::Local(w)) => {
                let mut st = w.st.lock();
                if let Some(a) = st.aborted.get_mut(rank as usize) {
                    *a = true;
                }
                w.cv.notify_all();
            }
            Some(Peers::Net(m)) => m.close(),
            None => {
                unjoin(&c);
                net::forget(c.id);
            }
        }
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommGetAsyncError`: the first asynchronous error (a peer lost from
/// a cross-process mesh is one, see `net`), `ncclInProgress` while init, a background enqueue or a non-blocking finalize is pending,
/// else `ncclSuccess`.
///
/// # Safety
/// `async_error` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommGetAsyncError(
    comm: ncclComm_t,
    async_error: *mut ncclResult_t,
) -> ncclResult_t {
    entry(|| {
        let c = lookup(comm)?;
        // A peer whose link ended without `Bye` is the asynchronous error
        // even when no operation needed it (the mesh's lock is taken
        // without the communicator's).
        let mesh = match &*c.st.lock() {
            st if st.async_err.is_some() => None,
            st => match &st.world {
                Some(Peers::Net(m)) => Some(m.clone()),
                _ => None,
            },
        };
        if let Some(lost) = mesh.and_then(|m| m.first_lost())
            && !c.aborted()
        {
            c.set_async(ncclResult_t::ncclRemoteError, &lost);
        }
        let v = {
            let st = c.st.lock();
            if let Some(e) = st.async_err {
                e
            } else if (st.world.is_none() && !(c.ghost && c.blocking))
                || st.pending > 0
                || (st.finalizing && st.inflight > 0)
            {
                ncclResult_t::ncclInProgress
            } else {
                ncclResult_t::ncclSuccess
            }
        };
        // SAFETY: `async_error` is null or valid (this function's contract).
        unsafe { out(async_error, v, "asyncError") }?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommCount`.
///
/// # Safety
/// `count` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t {
    entry(|| {
        let (_, n, _) = lookup(comm)?.ready()?;
        // SAFETY: `count` is null or valid (this function's contract).
        unsafe { out(count, n as c_int, "count") }?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommCuDevice`.
///
/// # Safety
/// `device` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    entry(|| {
        let c = lookup(comm)?;
        c.ready()?;
        // SAFETY: `device` is null or valid (this function's contract).
        unsafe { out(device, c.device, "device") }?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommUserRank`.
///
/// # Safety
/// `rank` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
    entry(|| {
        let (r, _, _) = lookup(comm)?.ready()?;
        // SAFETY: `rank` is null or valid (this function's contract).
        unsafe { out(rank, r as c_int, "rank") }?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclGetLastError`: the newer of the communicator's last asynchronous
/// error and the calling thread's last error, else the process's; a static
/// NUL-terminated string.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
    CALLS.fetch_add(1, Ordering::Relaxed);
    guard(c"".as_ptr(), || {
        let own = (!comm.is_null())
            .then(|| COMMS.get(ptr_to_id(comm)))
            .flatten()
            .and_then(|c| c.st.lock().last);
        newest_error(own).as_ptr()
    })
}
