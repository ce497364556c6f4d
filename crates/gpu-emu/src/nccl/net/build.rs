//! Building a mesh: rank `i` connects to every lower rank and says
//! `Hello`, takes the links of every higher rank from its listener, and
//! the mesh starts.
//!
//! Invariants: the communicator (`comm_id`) stops being expected by the
//! listener whatever the outcome; a mesh is started only if `stop` (the
//! communicator's abort) has not said so; a half-built mesh says `Bye` on
//! the links it has, so its peers do not report it lost.

use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Instant;

use nccl_sys::ncclResult_t;

use super::mesh::{BYE_WAIT, Mesh};
use super::routes::{self, Joining};
use super::wire::{self, Frame};
use super::{Endpoint, InitErr};

/// Connects rank `me` to every lower rank, takes the links of every higher
/// one, and starts the mesh of communicator `comm_id` for routing key
/// `key`: `Err(None)` when `stop` said so meanwhile, `Err(Some(..))` when
/// it failed.
pub(crate) fn build(
    joining: Arc<Joining>,
    comm_id: u64,
    key: u128,
    me: usize,
    eps: Vec<Endpoint>,
    stop: &dyn Fn() -> bool,
) -> Result<Arc<Mesh>, Option<InitErr>> {
    let mut links: Vec<Option<TcpStream>> = (0..eps.len()).map(|_| None).collect();
    let mut outcome: Result<(), Option<InitErr>> = Ok(());
    for j in 0..me {
        match connect(key, &eps[me], &eps[j], j, stop) {
            Ok(s) => links[j] = Some(s),
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
    }
    if outcome.is_ok() {
        let higher: Vec<u32> = eps[me + 1..].iter().map(|e| e.slot).collect();
        match joining.take_links(&higher, stop) {
            Some(got) => {
                for (j, s) in (me + 1..eps.len()).zip(got) {
                    links[j] = Some(s);
                }
            }
            None => outcome = Err(None),
        }
    }
    routes::forget(comm_id);
    match outcome {
        Ok(()) if !stop() => Ok(Mesh::start(key, me, eps, links)),
        Ok(()) | Err(None) => {
            say_bye(links.into_iter().flatten());
            Err(None)
        }
        Err(Some(e)) => {
            say_bye(links.into_iter().flatten());
            Err(Some(e))
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
