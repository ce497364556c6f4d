//! This process's listener and the routes of incoming connections: a
//! `Register` goes to the handler the listener was started with (the
//! bootstrap root's, `nccl::bootstrap`), a `Hello` to the communicator that
//! expects a link from that peer.
//!
//! A communicator that may receive links (every rank of a cross-process
//! communicator, before its mesh is complete) is expected under its
//! routing key and slot; it is expected before any peer can know where it
//! is (before its `Register` is sent, before the root sends any table, or
//! before its `Split` message is sent), so a `Hello` never arrives early.
//!
//! Invariants: the listener is started once per process and lives as long
//! as it; one connection's handshake (preamble and first frame) is bounded
//! by [`HANDSHAKE`]; a link is handed over only after its `HelloOk` was
//! written, and a `Hello` nobody expects is refused, never parked. The
//! routes' lock and a [`Joining`]'s links are leaves, never held together
//! (a route is looked up and released before its links are locked).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use nccl_sys::ncclResult_t;
use parking_lot::{Condvar, Mutex};

use super::Endpoint;
use super::wire::{self, Frame, IO_TICK};

/// How long an incoming connection may take to say who it is.
pub(crate) const HANDSHAKE: Duration = Duration::from_secs(10);

/// A communicator waiting for links from its peers, by the peers' slots.
pub(crate) struct Joining {
    comm_id: u64,
    links: Mutex<BTreeMap<u32, TcpStream>>,
    cv: Condvar,
}

impl Joining {
    /// Waits until a link from each of `slots` has arrived and takes them
    /// (in the order of `slots`); `None` once `stop` says so.
    pub(super) fn take_links(
        &self,
        slots: &[u32],
        stop: &dyn Fn() -> bool,
    ) -> Option<Vec<TcpStream>> {
        let mut links = self.links.lock();
        loop {
            if slots.iter().all(|s| links.contains_key(s)) {
                return Some(slots.iter().filter_map(|s| links.remove(s)).collect());
            }
            if stop() {
                return None;
            }
            self.cv.wait_for(&mut links, IO_TICK);
        }
    }
}

type RouteKey = (u128, u32);

static ROUTES: Mutex<BTreeMap<RouteKey, Arc<Joining>>> = Mutex::new(BTreeMap::new());

/// Expects links for communicator `comm_id` under `(key, slot)`; an error
/// text when another communicator of this process already is.
pub(crate) fn expect(key: u128, slot: u32, comm_id: u64) -> Result<Arc<Joining>, String> {
    let mut r = ROUTES.lock();
    if r.contains_key(&(key, slot)) {
        return Err(format!("rank {slot} joined twice"));
    }
    let j = Arc::new(Joining {
        comm_id,
        links: Mutex::new(BTreeMap::new()),
        cv: Condvar::new(),
    });
    r.insert((key, slot), j.clone());
    Ok(j)
}

/// Stops expecting links for `comm_id` (links that arrived and were not
/// taken are closed).
pub(crate) fn forget(comm_id: u64) {
    ROUTES.lock().retain(|_, j| j.comm_id != comm_id);
}

/// Serves a `Register` frame (id, nranks, rank, endpoint) that arrived on
/// its connection.
pub(crate) type OnRegister = fn([u8; 128], u32, u32, Endpoint, TcpStream);

/// This process's loopback port, the listener started on first use, with
/// `on_register` serving registrations (every caller passes the bootstrap
/// root's handler); `None` when it cannot listen.
pub(crate) fn port(on_register: OnRegister) -> Option<u16> {
    static PORT: OnceLock<Option<u16>> = OnceLock::new();
    *PORT.get_or_init(|| {
        let started = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).and_then(|l| {
            let port = l.local_addr()?.port();
            std::thread::Builder::new()
                .name("emu-nccl-listen".into())
                .spawn(move || accept_loop(l, on_register))?;
            Ok(port)
        });
        match started {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!(error = %e, "gpu-emu: cannot listen on loopback; communicators cannot span processes");
                None
            }
        }
    })
}

fn accept_loop(l: TcpListener, on_register: OnRegister) {
    for s in l.incoming() {
        match s {
            Ok(s) => {
                let spawned = std::thread::Builder::new()
                    .name("emu-nccl-accept".into())
                    .spawn(move || handle(s, on_register));
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "gpu-emu: cannot serve a connection");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "gpu-emu: accept failed");
                std::thread::sleep(IO_TICK);
            }
        }
    }
}

/// Reads who the connection is and hands it on.
fn handle(s: TcpStream, on_register: OnRegister) {
    let start = Instant::now();
    let stop = || start.elapsed() > HANDSHAKE;
    let first = wire::prepare(&s)
        .and_then(|()| wire::read_preamble(&s, &stop))
        .and_then(|()| wire::read_frame(&s, &stop));
    match first {
        Ok(Some(Frame::Register {
            id,
            nranks,
            rank,
            ep,
        })) => on_register(id, nranks, rank, ep, s),
        Ok(Some(Frame::Hello { key, to, from })) => on_hello(key, to, from, s),
        Ok(_) => tracing::debug!("gpu-emu: a connection sent no handshake"),
        Err(e) => tracing::debug!(error = %e, "gpu-emu: a connection's handshake failed"),
    }
}

fn on_hello(key: u128, to: u32, from: u32, s: TcpStream) {
    let start = Instant::now();
    let stop = || start.elapsed() > HANDSHAKE;
    let Some(j) = ROUTES.lock().get(&(key, to)).cloned() else {
        let refused = Frame::Refused {
            code: ncclResult_t::ncclRemoteError.0 as i32,
            msg: format!(
                "no communicator of process {} expects a link for slot {to} (aborted or destroyed)",
                std::process::id()
            ),
        };
        let _ = wire::write_frame(&s, &refused, &stop);
        return;
    };
    if wire::write_frame(&s, &Frame::HelloOk, &stop).is_ok() {
        let mut links = j.links.lock();
        links.entry(from).or_insert(s);
        j.cv.notify_all();
    }
}
