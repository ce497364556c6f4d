//! Building a mesh: rank `i` connects to every lower rank and says
//! `Hello`, takes the links of every higher rank from its listener, and
//! the communicator becomes ready; a split child first waits for every
//! rank's part in the split.
//!
//! Invariants: the communicator stops being expected by the listener
//! whatever the outcome; a mesh is made ready only if the communicator is
//! not aborted, and closed at once if an abort came meanwhile; a half-built
//! mesh says `Bye` on the links it has, so its peers do not report it lost.

use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Instant;

use nccl_sys::ncclResult_t;

use super::Endpoint;
use super::bootstrap::InitErr;
use super::mesh::{BYE_WAIT, Mesh};
use super::routes::{self, Joining};
use super::wire::{self, Frame};
use crate::nccl::comm::Comm;
use crate::nccl::comm::Peers;

/// Builds the mesh of rank `me` on a thread of its own.
pub(crate) fn spawn_build(
    comm: Arc<Comm>,
    joining: Arc<Joining>,
    key: u128,
    me: usize,
    eps: Vec<Endpoint>,
) {
    let c = comm.clone();
    let spawned = std::thread::Builder::new()
        .name("emu-nccl-mesh".into())
        .spawn(move || build(c, joining, key, me, eps));
    if let Err(e) = spawned {
        routes::forget(comm.id);
        comm.fail_init(
            ncclResult_t::ncclSystemError,
            &format!("gpu-emu: cannot start the mesh thread: {e}"),
        );
    }
}

/// Waits on a thread of its own for every rank's part in split `seq` of
/// `parent`, then builds the mesh of the child of this rank's color:
/// ranks ordered by (key, parent rank), each routed by its parent rank.
pub(crate) fn spawn_child(
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
                    routes::forget(c.id);
                    return;
                }
                Some(Err((code, msg))) => {
                    routes::forget(c.id);
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
            build(c, joining, key, me, eps);
        });
    if let Err(e) = spawned {
        routes::forget(child.id);
        child.fail_init(
            ncclResult_t::ncclSystemError,
            &format!("gpu-emu: cannot start the split thread: {e}"),
        );
    }
}

/// Connects rank `me` to every lower rank, takes the links of every higher
/// one, and makes the communicator ready (or failed, or nothing when it
/// was aborted meanwhile).
pub(crate) fn build(
    comm: Arc<Comm>,
    joining: Arc<Joining>,
    key: u128,
    me: usize,
    eps: Vec<Endpoint>,
) {
    let stop = || comm.aborted();
    let mut links: Vec<Option<TcpStream>> = (0..eps.len()).map(|_| None).collect();
    let mut outcome: Result<(), Option<InitErr>> = Ok(());
    for j in 0..me {
        match connect(key, &eps[me], &eps[j], j, &stop) {
            Ok(s) => links[j] = Some(s),
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
    }
    if outcome.is_ok() {
        let higher: Vec<u32> = eps[me + 1..].iter().map(|e| e.slot).collect();
        match joining.take_links(&higher, &stop) {
            Some(got) => {
                for (j, s) in (me + 1..eps.len()).zip(got) {
                    links[j] = Some(s);
                }
            }
            None => outcome = Err(None),
        }
    }
    routes::forget(comm.id);
    match outcome {
        Ok(()) if !comm.aborted() => {
            let n = eps.len();
            let mesh = Mesh::start(key, me, eps, links);
            comm.set_world(me as i32, n as i32, Peers::Net(mesh.clone()));
            if comm.aborted() {
                mesh.close();
            }
        }
        Ok(()) | Err(None) => say_bye(links.into_iter().flatten()),
        Err(Some((code, msg))) => {
            say_bye(links.into_iter().flatten());
            comm.fail_init(code, &msg);
        }
    }
}

/// Says `Bye` on links of a mesh that will not be (best effort).
fn say_bye(links: impl Iterator<Item = TcpStream>) {
    let start = Instant::now();
    let stop = || start.elapsed() > BYE_WAIT;
    for s in links {
        let _ = wire::write_frame(&s, &Frame::Bye, &stop);
        let _ = s.shutdown(Shutdown::Write);
    }
}

fn connect(
    key: u128,
    mine: &Endpoint,
    peer: &Endpoint,
    j: usize,
    stop: &dyn Fn() -> bool,
) -> Result<TcpStream, Option<InitErr>> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, peer.port));
    let who = format!("rank {j} (process {}, {addr})", peer.pid);
    let failed = |e: std::io::Error| {
        (!stop()).then(|| {
            (
                ncclResult_t::ncclRemoteError,
                format!("gpu-emu: connecting to {who} failed: {e}"),
            )
        })
    };
    let s = TcpStream::connect_timeout(&addr, routes::HANDSHAKE).map_err(failed)?;
    let hello = Frame::Hello {
        key,
        to: peer.slot,
        from: mine.slot,
    };
    wire::prepare(&s)
        .and_then(|()| wire::write_preamble(&s, stop))
        .and_then(|()| wire::write_frame(&s, &hello, stop))
        .map_err(failed)?;
    match wire::read_frame(&s, stop) {
        Ok(Some(Frame::HelloOk)) => Ok(s),
        Ok(Some(Frame::Refused { code, msg })) => Err(Some((ncclResult_t(code as u32), msg))),
        Ok(other) => Err(Some((
            ncclResult_t::ncclRemoteError,
            format!("gpu-emu: {who} answered {other:?} to its link"),
        ))),
        Err(e) => Err(failed(e)),
    }
}
