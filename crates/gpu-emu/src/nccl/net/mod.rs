//! Communicators whose ranks are separate processes: NCCL's bootstrap and
//! transports, emulated over TCP on loopback.
//!
//! # How ranks find each other
//! - Each process that makes a unique id or joins a communicator of another
//!   process listens on one loopback port (`routes`), started on first use,
//!   served by one accept thread for the life of the process.
//! - `ncclGetUniqueId` writes into the id a magic, a random 128-bit key,
//!   this process's nonce, pid and port: the process that made the id is
//!   its bootstrap root, as NCCL's `ncclGetUniqueId` starts the root thread
//!   in the calling process.
//! - A rank of the root's process registers in the in-process registry as
//!   before; a rank of another process connects to the root and sends
//!   `Register` (`bootstrap`). When every rank has registered, the root
//!   decides: all ranks in its process, an in-process world (threads, no
//!   socket); otherwise every rank gets the `Table` of endpoints (nonce, pid,
//!   port, device, slot), and the ranks build a mesh (`mesh`): rank `i`
//!   connects to every lower rank's port and says `Hello` (key, slots); the
//!   listener hands the connection to the communicator expecting it, which
//!   answers `HelloOk`. A communicator is ready once it holds a link to
//!   every peer.
//!
//! # What a dead peer looks like
//! A peer that closes a link after `Bye` (its destroy or abort) has left:
//! operations waiting for it stay blocked until this rank aborts, as on
//! GPUs when a peer stops calling. A link that ends without `Bye` (the
//! process exited or was killed, or a malformed frame) is lost: every wait
//! that needs that peer, and every send to it, ends with `ncclRemoteError`
//! as the communicator's asynchronous error, naming the peer. A lost peer
//! is only reported by work that needs it, so a peer that exits after its
//! last operation without destroying its communicator is not an error.
//!
//! # Invariants
//! - Same-process ranks of an id made in this process never touch a
//!   socket.
//! - Every wait is bounded by a short tick between checks of an abort or
//!   close flag, so `ncclCommAbort` ends it.
//! - Frames are bounded (`wire::MAX_FRAME`); payloads travel as chunks.

pub(super) mod bootstrap;
pub(super) mod build;
pub(super) mod mesh;
pub(super) mod routes;
pub(super) mod wire;

use std::sync::{Arc, OnceLock};

pub(super) use mesh::Mesh;
pub(super) use routes::Joining;

const ID_MAGIC: [u8; 8] = *b"MTRLEMU1";

/// Where one rank of a cross-process communicator is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Endpoint {
    /// Its process's nonce.
    pub(super) nonce: u64,
    /// Its process id (for messages).
    pub(super) pid: u32,
    /// Its process's loopback port.
    pub(super) port: u16,
    /// Its device (in its process).
    pub(super) device: i32,
    /// What its process's listener routes its connections by: the rank,
    /// or for a split child the parent's rank.
    pub(super) slot: u32,
}

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
pub(super) fn nonce() -> u64 {
    static NONCE: OnceLock<u64> = OnceLock::new();
    *NONCE.get_or_init(|| rand::random::<u64>() | 1)
}

/// A fresh unique id: random bytes, with the root's address when this
/// process's listener runs (else an id that only same-process ranks can
/// use).
pub(super) fn fresh_id() -> [u8; 128] {
    let mut b: [u8; 128] = rand::random();
    match routes::port() {
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

/// The routing key of the child made by split number `seq` of the
/// communicator with key `parent`: the same on every rank.
pub(super) fn child_key(parent: u128, seq: u64) -> u128 {
    // SplitMix64 over both halves of the key and the sequence number.
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let (hi, lo) = ((parent >> 64) as u64, parent as u64);
    let a = mix(hi ^ mix(seq));
    let b = mix(lo ^ mix(a ^ seq.rotate_left(17)));
    (u128::from(a) << 64) | u128::from(b)
}

/// Expects links for communicator `comm_id` under `(key, slot)`; an error
/// text when another communicator of this process already is.
pub(crate) fn expect(key: u128, slot: u32, comm_id: u64) -> Result<Arc<Joining>, String> {
    routes::expect(key, slot, comm_id)
}

/// Stops every link wait of communicator `comm_id` (its init is given
/// up).
pub(crate) fn forget(comm_id: u64) {
    routes::forget(comm_id);
}

/// This process's endpoint for a rank on `device` routed by `slot`, when
/// its listener runs.
pub(super) fn local_endpoint(device: i32, slot: u32) -> Option<Endpoint> {
    Some(Endpoint {
        nonce: nonce(),
        pid: std::process::id(),
        port: routes::port()?,
        device,
        slot,
    })
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
        assert_eq!(Some(info.port), routes::port());
        assert!(parse_id(&[0u8; 128]).is_none());
    }

    #[test]
    fn child_keys_differ() {
        let k = 0x1234_5678_9abc_def0_1122_3344_5566_7788u128;
        assert_eq!(child_key(k, 1), child_key(k, 1));
        assert_ne!(child_key(k, 1), child_key(k, 2));
        assert_ne!(child_key(k, 1), child_key(k + 1, 1));
    }
}
