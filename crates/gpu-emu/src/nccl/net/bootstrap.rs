//! The bootstrap: a rank of another process registers with the root (the
//! process that made the unique id) and gets the table of every rank's
//! endpoint; the root, once every rank has registered, sends the table to
//! its remote ranks and starts the mesh of its own.
//!
//! Invariants: a remote rank is expected by its own listener before it
//! registers; the root writes a table only after taking the entry out of
//! the in-process registry, so a registration that ends (its rank aborted
//! its init, or its process died) before then is withdrawn, and one that
//! ends after is ignored; every wait ends when the joining communicator is
//! aborted (its registration connection then closes, which withdraws it).

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nccl_sys::ncclResult_t;

use super::routes::{self, HANDSHAKE, Joining};
use super::wire::{self, Frame};
use super::{Endpoint, IdInfo, build, local_endpoint};
use crate::nccl::comm::Comm;
use crate::nccl::init::{self, Member};

/// How long a rank tries to reach its root.
const CONNECT: Duration = Duration::from_secs(5);

/// A rank of another process registered with this process's root.
pub(crate) struct Remote {
    pub(crate) ep: Endpoint,
    conn: Arc<TcpStream>,
    /// Set once the table is on its way: the registration is then final.
    pub(crate) token: Arc<AtomicBool>,
}

/// An error of a rank's init: its code and text.
pub(crate) type InitErr = (ncclResult_t, String);

/// Serves a `Register` received by this process's listener: joins the
/// rank to the id's registry entry (refusing it with the reason when it
/// cannot), then watches the connection until the table is sent,
/// withdrawing the rank if the connection ends first.
pub(super) fn on_register(id: [u8; 128], nranks: u32, rank: u32, ep: Endpoint, s: TcpStream) {
    let start = Instant::now();
    let conn = Arc::new(s);
    let token = Arc::new(AtomicBool::new(false));
    let remote = Remote {
        ep,
        conn: conn.clone(),
        token: token.clone(),
    };
    if let Err((code, msg)) = init::join(id, nranks as i32, rank as i32, Member::Remote(remote)) {
        let stop = || start.elapsed() > HANDSHAKE;
        let refused = Frame::Refused {
            code: code.0 as i32,
            msg,
        };
        let _ = wire::write_frame(&conn, &refused, &stop);
        return;
    }
    let mut byte = [0u8; 1];
    while !token.load(Ordering::Acquire) {
        match std::io::Read::read(&mut &*conn, &mut byte) {
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            // The rank closed (aborted, or its process ended) or broke the
            // protocol before the table: it no longer takes part.
            _ => {
                init::withdraw(&id, rank as usize, &token);
                return;
            }
        }
    }
}

/// Completes a world of the root's process whose ranks are not all in it:
/// every rank gets the table, the root's own ranks start their mesh.
pub(crate) fn start_world(key: u128, members: Vec<Member>) {
    let eps: Vec<Option<Endpoint>> = members
        .iter()
        .enumerate()
        .map(|(r, m)| match m {
            Member::Local(c) => local_endpoint(c.device, r as u32),
            Member::Remote(x) => Some(x.ep),
        })
        .collect();
    let Some(eps) = eps.into_iter().collect::<Option<Vec<Endpoint>>>() else {
        for m in &members {
            if let Member::Local(c) = m {
                c.fail_init(
                    ncclResult_t::ncclSystemError,
                    "gpu-emu: this process cannot listen on loopback",
                );
            }
        }
        return;
    };
    // The root's ranks are expected before any table leaves.
    let mut locals: Vec<(Arc<Comm>, Arc<Joining>, usize)> = Vec::new();
    for (r, m) in members.iter().enumerate() {
        if let Member::Local(c) = m {
            match routes::expect(key, r as u32, c.id) {
                Ok(j) => locals.push((c.clone(), j, r)),
                Err(e) => c.fail_init(ncclResult_t::ncclInvalidArgument, &e),
            }
        }
    }
    let start = Instant::now();
    let stop = || start.elapsed() > HANDSHAKE;
    let table = Frame::Table(eps.clone());
    for m in &members {
        if let Member::Remote(x) = m {
            x.token.store(true, Ordering::Release);
            if let Err(e) = wire::write_frame(&x.conn, &table, &stop) {
                tracing::warn!(error = %e, pid = x.ep.pid, "gpu-emu: the table did not reach a rank");
            }
        }
    }
    for (c, j, r) in locals {
        let eps = eps.clone();
        build::spawn_build(c, j, key, r, eps);
    }
}

/// Starts the init of rank `rank` of an id made by another process:
/// expects its links, then registers with the root and builds its mesh on
/// a thread of its own. An error is returned at once only when the rank
/// cannot take part at all.
pub(crate) fn join_via_root(
    comm: &Arc<Comm>,
    info: IdInfo,
    id: [u8; 128],
    nranks: usize,
    rank: usize,
) -> Result<(), InitErr> {
    if nranks > wire::MAX_RANKS {
        return Err((
            ncclResult_t::ncclInvalidUsage,
            format!(
                "gpu-emu: a communicator of more than {} ranks is not emulated across processes",
                wire::MAX_RANKS
            ),
        ));
    }
    let Some(ep) = local_endpoint(comm.device, rank as u32) else {
        return Err((
            ncclResult_t::ncclSystemError,
            "gpu-emu: this process cannot listen on loopback, so it cannot join a communicator of another process".into(),
        ));
    };
    let joining = routes::expect(info.key, rank as u32, comm.id)
        .map_err(|e| (ncclResult_t::ncclInvalidArgument, e))?;
    let c = comm.clone();
    let spawned = std::thread::Builder::new()
        .name("emu-nccl-bootstrap".into())
        .spawn(move || match register(&c, info, id, nranks, rank, ep) {
            Ok(table) => build::build(c, joining, info.key, rank, table),
            Err(e) => {
                routes::forget(c.id);
                if let Some((code, msg)) = e {
                    c.fail_init(code, &msg);
                }
            }
        });
    spawned.map(|_| ()).map_err(|e| {
        routes::forget(comm.id);
        (
            ncclResult_t::ncclSystemError,
            format!("gpu-emu: cannot start the bootstrap thread: {e}"),
        )
    })
}

/// Registers with the root and returns the table; `Err(None)` when the
/// communicator was aborted meanwhile.
fn register(
    comm: &Comm,
    info: IdInfo,
    id: [u8; 128],
    nranks: usize,
    rank: usize,
    ep: Endpoint,
) -> Result<Vec<Endpoint>, Option<InitErr>> {
    let root = SocketAddr::from((Ipv4Addr::LOCALHOST, info.port));
    let who = format!(
        "the bootstrap root of this unique id (process {}, {root})",
        info.pid
    );
    let s = TcpStream::connect_timeout(&root, CONNECT).map_err(|e| {
        Some((
            ncclResult_t::ncclSystemError,
            format!(
                "gpu-emu: {who} cannot be reached: {e}; the process that called ncclGetUniqueId must live until every rank has joined"
            ),
        ))
    })?;
    let stop = || comm.aborted();
    let lost = |e: std::io::Error| {
        (!comm.aborted()).then(|| {
            (
                ncclResult_t::ncclRemoteError,
                format!("gpu-emu: the connection to {who} failed: {e}"),
            )
        })
    };
    let reg = Frame::Register {
        id,
        nranks: nranks as u32,
        rank: rank as u32,
        ep,
    };
    wire::prepare(&s)
        .and_then(|()| wire::write_preamble(&s, &stop))
        .and_then(|()| wire::write_frame(&s, &reg, &stop))
        .map_err(lost)?;
    match wire::read_frame(&s, &stop) {
        Ok(Some(Frame::Table(t))) if t.len() == nranks => Ok(t),
        Ok(Some(Frame::Refused { code, msg })) => Err(Some((ncclResult_t(code as u32), msg))),
        Ok(None) => Err(Some((
            ncclResult_t::ncclRemoteError,
            format!("gpu-emu: {who} closed the connection before every rank joined"),
        ))),
        Ok(Some(other)) => Err(Some((
            ncclResult_t::ncclInternalError,
            format!("gpu-emu: {who} answered {other:?}"),
        ))),
        Err(e) => Err(lost(e)),
    }
}
