//! Collectives and send/recv: argument checks, then a launch (or a place
//! in the thread's group); `ncclRedOpCreatePreMulSum` and
//! `ncclRedOpDestroy`.
//!
//! Invariants: every root, peer, count, type and buffer range is checked
//! before anything is launched; a count of 0 launches nothing.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cuda_sys::cudaStream_t;
use nccl_sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclScalarResidence_t};

use super::R;
use super::coll::{Desc, Kind};
use super::comm::{Comm, lookup};
use super::data::{Dt, Op};
use super::errors::{entry, err, fail, unimplemented};
use super::group::{GROUP, GroupItem, grouped, in_group};
use super::launch::{Body, Job, defer, launch, launcher};
use crate::cuda::memory::range_ok;
use crate::cuda::stream;

pub(super) fn check_buf(p: u64, elems: usize, esz: usize, what: &str) -> R<()> {
    let Some(len) = elems.checked_mul(esz) else {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("{what}: size overflows"),
        );
    };
    if len > 0 && !range_ok(p, len, true) {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("{what} {p:#x} is not inside a live device allocation of {len} bytes"),
        );
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(super) fn coll(
    kind: Kind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dt: ncclDataType_t,
    op: ncclRedOp_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry(|| {
        grouped((|| {
            let c = lookup(comm)?;
            let (rank, n, _) = c.ready()?;
            c.idle()?;
            let dt = Dt::from_nccl(dt)?;
            let op = if kind.reduces() {
                Op::from_nccl(op)?
            } else {
                Op::Sum
            };
            let root = if kind.rooted() {
                if root < 0 || root as usize >= n {
                    return fail(
                        ncclResult_t::ncclInvalidArgument,
                        format!("root {root} is out of range for {n} ranks"),
                    );
                }
                root as usize
            } else {
                0
            };
            if count == 0 {
                return Ok(ncclResult_t::ncclSuccess);
            }
            let Some((sn, rn)) = kind.sizes(count, n, rank == root) else {
                return fail(ncclResult_t::ncclInvalidArgument, "count overflows");
            };
            let (s, r) = (send as usize as u64, recv as usize as u64);
            check_buf(s, sn, dt.size(), "sendbuff")?;
            check_buf(r, rn, dt.size(), "recvbuff")?;
            let d = Desc {
                kind,
                send: s,
                recv: r,
                count,
                dt,
                op,
                root,
            };
            submit_op(&c, stream, false, Body::Coll(d))
        })())
    })
}

pub(super) fn p2p(
    is_send: bool,
    buf: u64,
    count: usize,
    dt: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry(|| {
        grouped((|| {
            let c = lookup(comm)?;
            let (_, n, _) = c.ready()?;
            c.idle()?;
            let dt = Dt::from_nccl(dt)?;
            if peer < 0 || peer as usize >= n {
                return fail(
                    ncclResult_t::ncclInvalidArgument,
                    format!("peer {peer} is out of range for {n} ranks"),
                );
            }
            if count == 0 {
                return Ok(ncclResult_t::ncclSuccess);
            }
            check_buf(
                buf,
                count,
                dt.size(),
                if is_send { "sendbuff" } else { "recvbuff" },
            )?;
            let peer = peer as usize;
            let body = if is_send {
                Body::Send {
                    peer,
                    buf,
                    count,
                    dt,
                }
            } else {
                Body::Recv {
                    peer,
                    buf,
                    count,
                    dt,
                }
            };
            submit_op(&c, stream, is_send, body)
        })())
    })
}

/// `ncclRedOpCreatePreMulSum`: not implemented.
///
/// # Safety
/// No pointer is used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    _op: *mut ncclRedOp_t,
    _scalar: *mut c_void,
    _dt: ncclDataType_t,
    _residence: ncclScalarResidence_t,
    _comm: ncclComm_t,
) -> ncclResult_t {
    entry(|| Err(unimplemented("ncclRedOpCreatePreMulSum")))
}

/// `ncclRedOpDestroy`: no custom operation exists, so always an error.
#[unsafe(no_mangle)]
pub extern "C" fn ncclRedOpDestroy(op: ncclRedOp_t, comm: ncclComm_t) -> ncclResult_t {
    entry(|| {
        lookup(comm)?;
        if op.0 < 5 {
            fail(
                ncclResult_t::ncclInvalidArgument,
                "cannot destroy a built-in reduction operation",
            )
        } else {
            fail(
                ncclResult_t::ncclInvalidArgument,
                format!("unknown reduction operation {}", op.0),
            )
        }
    })
}

/// `ncclAllReduce`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::AllReduce,
        sendbuff,
        recvbuff,
        count,
        datatype,
        op,
        0,
        comm,
        stream,
    )
}

/// `ncclBroadcast`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::Broadcast,
        sendbuff,
        recvbuff,
        count,
        datatype,
        ncclRedOp_t::ncclSum,
        root,
        comm,
        stream,
    )
}

/// `ncclBcast`: in-place broadcast.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBcast(
    buff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::Broadcast,
        buff,
        buff,
        count,
        datatype,
        ncclRedOp_t::ncclSum,
        root,
        comm,
        stream,
    )
}

/// `ncclReduce`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::Reduce,
        sendbuff,
        recvbuff,
        count,
        datatype,
        op,
        root,
        comm,
        stream,
    )
}

/// `ncclAllGather`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::AllGather,
        sendbuff,
        recvbuff,
        sendcount,
        datatype,
        ncclRedOp_t::ncclSum,
        0,
        comm,
        stream,
    )
}

/// `ncclReduceScatter`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::ReduceScatter,
        sendbuff,
        recvbuff,
        recvcount,
        datatype,
        op,
        0,
        comm,
        stream,
    )
}

/// `ncclAlltoAll`: `count` elements to and from each peer.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::AlltoAll,
        sendbuff,
        recvbuff,
        count,
        datatype,
        ncclRedOp_t::ncclSum,
        0,
        comm,
        stream,
    )
}

/// `ncclGather`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::Gather,
        sendbuff,
        recvbuff,
        count,
        datatype,
        ncclRedOp_t::ncclSum,
        root,
        comm,
        stream,
    )
}

/// `ncclScatter`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::Scatter,
        sendbuff,
        recvbuff,
        count,
        datatype,
        ncclRedOp_t::ncclSum,
        root,
        comm,
        stream,
    )
}

/// `ncclSend`: posts a copy of the data for `peer` when the stream runs it.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    p2p(
        true,
        sendbuff as usize as u64,
        count,
        datatype,
        peer,
        comm,
        stream,
    )
}

/// `ncclRecv`: blocks its stream until the matching send's data is there.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    p2p(
        false,
        recvbuff as usize as u64,
        count,
        datatype,
        peer,
        comm,
        stream,
    )
}

/// Launches (or groups) an operation of `comm` on `stream`. A
/// non-blocking communicator's operation outside a group is enqueued in the
/// background: `ncclInProgress`.
pub(super) fn submit_op(
    comm: &Arc<Comm>,
    stream: cudaStream_t,
    is_send: bool,
    body: Body,
) -> R<ncclResult_t> {
    let target = stream::resolve(stream, Some(comm.device)).map_err(|e| {
        err(
            ncclResult_t::ncclInvalidArgument,
            format!("invalid stream (CUDA error {})", e.0),
        )
    })?;
    let body = Arc::new(body);
    if in_group() {
        GROUP.with(|g| {
            g.borrow_mut().items.push(GroupItem {
                target,
                is_send,
                comm: comm.clone(),
                body,
            })
        });
        return Ok(ncclResult_t::ncclSuccess);
    }
    comm.enqueue_call()?;
    if !comm.blocking && !target.stream.capturing() {
        let (w, need) = launch(comm, &body, comm.chain.take());
        let mut job = Job::default();
        job.add_comm(comm, need);
        job.items.push((target, vec![(vec![comm.clone()], w)]));
        defer(job);
        return Ok(ncclResult_t::ncclInProgress);
    }
    stream::submit(&target, launcher(comm.clone(), body)).map_err(|e| {
        err(
            ncclResult_t::ncclUnhandledCudaError,
            format!("stream error {}", e.0),
        )
    })?;
    Ok(ncclResult_t::ncclSuccess)
}
