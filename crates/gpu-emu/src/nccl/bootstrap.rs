//! Where the ranks of a unique id meet (NCCL's bootstrap): the unique id,
//! the registry of the process that made it (its bootstrap root), and
//! the registration of ranks of other processes with that root over this
//! process's listener.
//!
//! - `ncclGetUniqueId` writes into the id a magic, a random routing key,
//!   and this process's nonce, pid and loopback port ([`fresh_id`]).
//! - A rank of the root's process joins the root's registry ([`join`]); a
//!   rank of another process connects to the root and sends `Register`
//!   ([`join_via_root`]), which the root's listener hands to
//!   [`on_register`].
//! - The last rank to join completes the world: when every rank is of the
//!   root's process, an in-process `World` (no socket); otherwise the root
//!   sends every remote rank the table of endpoints and its own ranks, as
//!   the others on receiving it, build their mesh (`Comm::build_mesh`).
//!
//! Invariants: a rank joins its id's registry entry once; an init fault is
//! taken before the rank registers, so a rank that never joins leaves no
//! trace. A remote rank is expected by its own listener before it
//! registers; the root writes a table only after taking the entry out of
//! the registry, so a registration that ends (its rank aborted its init,
//! or its process died) before then is withdrawn, and one that ends after
//! is ignored; every wait ends when the joining communicator is aborted
//! (its registration connection then closes, which withdraws it).
//!
//! Lock order: the registry's lock, then a member's `Comm::st` (the last
//! rank to join sets every in-process member's world under it). It is
//! released before a table is sent or a mesh is started, and nothing
//! else is taken under it.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use nccl_sys::{ncclResult_t, ncclUniqueId};
use parking_lot::Mutex;

use super::comm::{Comm, Peers};
use super::net::routes::{self, HANDSHAKE};
use super::net::wire::{self, Frame};
use super::net::{Endpoint, InitErr, Joining};
use super::world::World;

const ID_MAGIC: [u8; 8] = *b"MTRLEMU1";

/// What a unique id made by `ncclGetUniqueId` says about its root.
#[derive(Debug, Clone, Copy)]
pub(super) struct IdInfo {
    /// The communicator's routing key.
    pub(super) key: u128,
    /// The root process's nonce.
    pub(super) nonce: u64,
    /// The root process's id.
    pub(super) pid: u32,
    /// The root process's loopback port.
    pub(super) port: u16,
}

impl IdInfo {
    /// Whether the id was made by this process.
    pub(super) fn is_mine(&self) -> bool {
        self.nonce == nonce()
    }
}

/// This process's nonce: random, drawn once.
fn nonce() -> u64 {
    static NONCE: OnceLock<u64> = OnceLock::new();
    *NONCE.get_or_init(|| rand::random::<u64>() | 1)
}

/// A fresh unique id: random bytes, with the root's address when this
/// process's listener runs (else an id that only same-process ranks can
/// use).
pub(super) fn fresh_id() -> [u8; 128] {
    let mut b: [u8; 128] = rand::random();
    match port() {
        Some(port) => {
            b[..8].copy_from_slice(&ID_MAGIC);
            b[24..32].copy_from_slice(&nonce().to_le_bytes());
            b[32..36].copy_from_slice(&std::process::id().to_le_bytes());
            b[36..38].copy_from_slice(&port.to_le_bytes());
        }
        None => b[0] ^= 0xff,
    }
    b
}

/// The root's address in an id made by [`fresh_id`].
pub(super) fn parse_id(b: &[u8; 128]) -> Option<IdInfo> {
    if b[..8] != ID_MAGIC {
        return None;
    }
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
    Some(IdInfo {
        key: u128::from_le_bytes(b[8..24].try_into().ok()?),
        nonce: u64_at(24),
        pid: u32::from_le_bytes(b[32..36].try_into().ok()?),
        port: u16::from_le_bytes(b[36..38].try_into().ok()?),
    })
}

/// This process's loopback port, its listener started on first use with
/// [`on_register`] serving the registrations of other processes' ranks;
/// `None` when it cannot listen.
fn port() -> Option<u16> {
    routes::port(on_register)
}

/// The registry's key of an id: its bytes.
pub(super) fn key_of(id: &ncclUniqueId) -> [u8; 128] {
    id.internal.map(|c| c as u8)
}

/// This process's endpoint for a rank on `device` routed by `slot`, when
/// its listener runs.
fn local_endpoint(device: i32, slot: u32) -> Option<Endpoint> {
    Some(Endpoint {
        nonce: nonce(),
        pid: std::process::id(),
        port: port()?,
        device,
        slot,
    })
}

/// A rank registered with an id of this process.
pub(super) enum Member {
    /// A rank of this process.
    Local(Arc<Comm>),
    /// A rank of another process, registered through the listener.
    Remote(Remote),
}

/// The ranks registered so far with one id.
struct Pending {
    nranks: i32,
    members: Vec<Option<Member>>,
}

/// The registry, by id: the ranks that joined here (this process's, and
/// other processes' registered through the listener) until all have.
static PENDING: Mutex<BTreeMap<[u8; 128], Pending>> = Mutex::new(BTreeMap::new());

/// Adds rank `rank` to the ranks of `key`; the last to join completes the
/// world: an in-process one when every rank is of this process (under
/// the registry's lock), else the mesh of every rank (after it).
pub(super) fn join(key: [u8; 128], nranks: i32, rank: i32, m: Member) -> Result<(), InitErr> {
    let invalid = |m: String| Err((ncclResult_t::ncclInvalidArgument, m));
    if nranks < 1 || rank < 0 || rank >= nranks {
        return invalid(format!("rank {rank} is out of range for {nranks} ranks"));
    }
    let mut p = PENDING.lock();
    let e = p.entry(key).or_insert_with(|| Pending {
        nranks,
        members: std::iter::repeat_with(|| None)
            .take(nranks as usize)
            .collect(),
    });
    if e.nranks != nranks {
        return invalid(format!(
            "nranks {nranks} differs from {} of other ranks",
            e.nranks
        ));
    }
    let slot = &mut e.members[rank as usize];
    if slot.is_some() {
        return invalid(format!("rank {rank} joined twice"));
    }
    *slot = Some(m);
    if !e.members.iter().all(Option::is_some) {
        return Ok(());
    }
    let members: Vec<Member> = p
        .remove(&key)
        .map(|e| e.members.into_iter().flatten().collect())
        .unwrap_or_default();
    let local: Option<Vec<Arc<Comm>>> = members
        .iter()
        .map(|m| match m {
            Member::Local(c) => Some(c.clone()),
            Member::Remote(_) => None,
        })
        .collect();
    match local {
        Some(comms) => {
            let w = World::new(comms.iter().map(|c| c.device).collect());
            for (r, c) in comms.into_iter().enumerate() {
                c.set_world(r as i32, nranks, Peers::Local(w.clone()));
            }
        }
        None => {
            drop(p);
            let route = parse_id(&key).map_or(0, |i| i.key);
            start_world(route, members);
        }
    }
    Ok(())
}

/// Takes a rank of this process whose init ends unfinished out of the
/// registry.
pub(super) fn unjoin(comm: &Arc<Comm>) {
    let mut p = PENDING.lock();
    p.retain(|_, e| {
        for m in e.members.iter_mut() {
            if matches!(m, Some(Member::Local(x)) if Arc::ptr_eq(x, comm)) {
                *m = None;
            }
        }
        e.members.iter().any(Option::is_some)
    });
}

/// Takes rank `rank` of another process, registered under `token`, out of
/// the registry of `key` (its registration ended before the table).
fn withdraw(key: &[u8; 128], rank: usize, token: &Arc<AtomicBool>) {
    let mut p = PENDING.lock();
    let Some(e) = p.get_mut(key) else { return };
    if let Some(m @ Some(Member::Remote(_))) = e.members.get_mut(rank)
        && matches!(m, Some(Member::Remote(x)) if Arc::ptr_eq(&x.token, token))
    {
        *m = None;
    }
    if e.members.iter().all(Option::is_none) {
        p.remove(key);
    }
}

/// How long a rank tries to reach its root.
const CONNECT: Duration = Duration::from_secs(5);

/// A rank of another process registered with this process's root.
pub(super) struct Remote {
    pub(super) ep: Endpoint,
    conn: Arc<TcpStream>,
    /// Set once the table is on its way: the registration is then final.
    pub(super) token: Arc<AtomicBool>,
}

/// Serves a `Register` received by this process's listener: joins the
/// rank to the id's registry entry (refusing it with the reason when it
/// cannot), then watches the connection until the table is sent,
/// withdrawing the rank if the connection ends first.
fn on_register(id: [u8; 128], nranks: u32, rank: u32, ep: Endpoint, s: TcpStream) {
    let start = Instant::now();
    let conn = Arc::new(s);
    let token = Arc::new(AtomicBool::new(false));
    let remote = Remote {
        ep,
        conn: conn.clone(),
        token: token.clone(),
    };
    if let Err((code, msg)) = join(id, nranks as i32, rank as i32, Member::Remote(remote)) {
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
                withdraw(&id, rank as usize, &token);
                return;
            }
        }
    }
}

/// Completes a world of the root's process whose ranks are not all in it:
/// every rank gets the table, the root's own ranks start their mesh.
fn start_world(key: u128, members: Vec<Member>) {
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
        spawn_build(c, j, key, r, eps);
    }
}

/// Starts the init of rank `rank` of an id made by another process:
/// expects its links, then registers with the root and builds its mesh on
/// a thread of its own. An error is returned at once only when the rank
/// cannot take part at all.
pub(super) fn join_via_root(
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
            Ok(table) => c.build_mesh(joining, info.key, rank, table),
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

/// Builds the mesh of rank `me` on a thread of its own.
fn spawn_build(comm: Arc<Comm>, joining: Arc<Joining>, key: u128, me: usize, eps: Vec<Endpoint>) {
    let c = comm.clone();
    let spawned = std::thread::Builder::new()
        .name("emu-nccl-mesh".into())
        .spawn(move || c.build_mesh(joining, key, me, eps));
    if let Err(e) = spawned {
        routes::forget(comm.id);
        comm.fail_init(
            ncclResult_t::ncclSystemError,
            &format!("gpu-emu: cannot start the mesh thread: {e}"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_the_root() {
        let id = fresh_id();
        let info = parse_id(&id).expect("the listener runs in tests");
        assert!(info.is_mine());
        assert_eq!(info.pid, std::process::id());
        assert_eq!(Some(info.port), port());
        assert!(parse_id(&[0u8; 128]).is_none());
    }
}
