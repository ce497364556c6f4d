//! Unique ids and rank inits: `ncclGetVersion`, `ncclGetUniqueId`,
//! `ncclCommInitRank`, `ncclCommInitRankConfig`, `ncclCommInitAll`; the
//! ranks meet through `bootstrap`.
//!
//! Invariants: an init fault is taken before the rank registers, so a
//! rank that never joins leaves no trace; a blocking init returns once
//! the communicator is ready (or failed), a non-blocking one at once
//! (`ncclInProgress`), one in a group at the group's end.

use std::ffi::{c_char, c_int};

use nccl_sys::{ncclComm_t, ncclConfig_t, ncclResult_t, ncclUniqueId};

use super::bootstrap::{self, Member, fresh_id, join, key_of, parse_id};
use super::comm::{COMMS, Chain, Comm, init_config};
use super::errors::{entry, err, fail, out, unimplemented};
use super::group::{GROUP, grouped, in_group};
use super::{R, VERSION};
use crate::cuda::driver;
use crate::fault::{self, Fault};
use crate::put;

/// `ncclGetVersion`: 22803.
///
/// # Safety
/// `version` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    entry(|| {
        // SAFETY: `version` is null or valid (this function's contract).
        unsafe { out(version, VERSION, "version") }?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclGetUniqueId`: random bytes carrying this process's loopback
/// address (the bootstrap root of ranks of other processes, see `net`).
///
/// # Safety
/// `id` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut ncclUniqueId) -> ncclResult_t {
    entry(|| {
        let v = ncclUniqueId {
            internal: fresh_id().map(|b| b as c_char),
        };
        // SAFETY: `id` is null or valid (this function's contract).
        unsafe { out(id, v, "uniqueId") }?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// Shared body of the rank inits.
///
/// # Safety
/// `out_comm` is null or valid for a write; `cfg` is null or a valid config.
pub(super) unsafe fn init_rank(
    out_comm: *mut ncclComm_t,
    nranks: c_int,
    id: &ncclUniqueId,
    rank: c_int,
    cfg: *const ncclConfig_t,
) -> R<ncclResult_t> {
    if out_comm.is_null() {
        return fail(ncclResult_t::ncclInvalidArgument, "comm is NULL");
    }
    // SAFETY: `cfg` is null or a valid config (this function's contract).
    let cfg = unsafe { init_config(cfg) }?;
    let blocking = cfg.blocking;
    if nranks < 1 {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("invalid nranks {nranks}"),
        );
    }
    if rank < 0 || rank >= nranks {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("rank {rank} is out of range for {nranks} ranks"),
        );
    }
    let f = fault::take_init(rank);
    if f == Some(Fault::InitFail) {
        return fail(ncclResult_t::ncclSystemError, "injected init failure");
    }
    let ghost = f == Some(Fault::NoJoin);
    let device = driver::current_device().unwrap_or(0);
    let comm = Comm::new(device, cfg, Chain::new(), ghost, rank, nranks);
    if !ghost {
        let key = key_of(id);
        let joined = match parse_id(&key) {
            Some(info) if !info.is_mine() => {
                bootstrap::join_via_root(&comm, info, key, nranks as usize, rank as usize)
            }
            _ => join(key, nranks, rank, Member::Local(comm.clone())),
        };
        joined.map_err(|(code, msg)| err(code, msg))?;
    }
    COMMS.insert_at(comm.id, comm.clone());
    // SAFETY: `out_comm` is non-null and valid (this function's contract).
    unsafe { put(out_comm, comm.handle()) };
    if in_group() {
        GROUP.with(|g| g.borrow_mut().inits.push(comm.clone()));
        return Ok(ncclResult_t::ncclSuccess);
    }
    if !blocking {
        return Ok(ncclResult_t::ncclInProgress);
    }
    if !ghost {
        comm.wait_ready();
        if let Some(code) = comm.init_error() {
            return Err(code);
        }
    }
    Ok(ncclResult_t::ncclSuccess)
}

/// `ncclCommInitRank`: blocking init of one rank.
///
/// # Safety
/// `comm` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut ncclComm_t,
    nranks: c_int,
    comm_id: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    entry(|| {
        // SAFETY: `comm` is null or valid (this function's contract).
        grouped(unsafe { init_rank(comm, nranks, &comm_id, rank, std::ptr::null()) })
    })
}

/// `ncclCommInitRankConfig`: init of one rank; `config.blocking = 0` makes
/// it non-blocking.
///
/// # Safety
/// `comm` is null or valid for a write; `config` is null or a valid config.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    comm_id: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    entry(|| {
        // SAFETY: forwarded from this function's contract.
        grouped(unsafe { init_rank(comm, nranks, &comm_id, rank, config) })
    })
}

/// `ncclCommInitAll`: `ndev` ranks of one communicator in this thread.
///
/// # Safety
/// `comms` is null or valid for `ndev` writes; `devlist` is null or valid
/// for `ndev` reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut ncclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> ncclResult_t {
    entry(|| {
        if comms.is_null() {
            return fail(ncclResult_t::ncclInvalidArgument, "comms is NULL");
        }
        if ndev < 1 {
            return fail(
                ncclResult_t::ncclInvalidArgument,
                format!("invalid ndev {ndev}"),
            );
        }
        let mut devs = Vec::new();
        for i in 0..ndev as usize {
            let d = if devlist.is_null() {
                i as c_int
            } else {
                // SAFETY: `devlist` holds `ndev` ints (this function's contract).
                unsafe { *devlist.add(i) }
            };
            if d < 0 || d >= driver::device_count() {
                return fail(
                    ncclResult_t::ncclInvalidArgument,
                    format!("invalid device {d}"),
                );
            }
            devs.push(d);
        }
        use rand::Rng;
        let mut key = [0u8; 128];
        rand::rng().fill(&mut key[..]);
        for (i, d) in devs.into_iter().enumerate() {
            // SAFETY: a null config.
            let cfg = unsafe { init_config(std::ptr::null()) }?;
            let c = Comm::new(d, cfg, Chain::new(), false, i as c_int, ndev);
            join(key, ndev, i as c_int, Member::Local(c.clone()))
                .map_err(|(code, msg)| err(code, msg))?;
            COMMS.insert_at(c.id, c.clone());
            // SAFETY: `comms` holds `ndev` slots (this function's contract).
            unsafe { put(comms.add(i), c.handle()) };
        }
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommShrink`: not implemented.
///
/// # Safety
/// No pointer is used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommShrink(
    _comm: ncclComm_t,
    _exclude: *mut c_int,
    _count: c_int,
    _newcomm: *mut ncclComm_t,
    _config: *mut ncclConfig_t,
    _flags: c_int,
) -> ncclResult_t {
    entry(|| Err(unimplemented("ncclCommShrink")))
}

/// `ncclCommInitRankScalable`: not implemented.
///
/// # Safety
/// No pointer is used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    _newcomm: *mut ncclComm_t,
    _nranks: c_int,
    _myrank: c_int,
    _n_id: c_int,
    _ids: *mut ncclUniqueId,
    _config: *mut ncclConfig_t,
) -> ncclResult_t {
    entry(|| Err(unimplemented("ncclCommInitRankScalable")))
}
