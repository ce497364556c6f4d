//! The network transport beneath the communicators: communicators whose
//! ranks are separate processes, over TCP on loopback.
//!
//! # How links are made
//! - Each process that makes a unique id or joins a communicator of another
//!   process listens on one loopback port (`routes`), started on first use,
//!   served by one accept thread for the life of the process. A `Register`
//!   frame is handed to the handler the listener was started with (the
//!   bootstrap root's, `nccl::bootstrap`); a `Hello` to the communicator
//!   that expects a link from that peer.
//! - Once every rank knows every rank's [`Endpoint`], the ranks build a
//!   mesh (`build`): rank `i` connects to every lower rank's port and says
//!   `Hello` (key, slots); the listener hands the connection to the
//!   communicator expecting it, which answers `HelloOk`. A mesh is ready
//!   once it holds a link to every peer (`mesh`).
//!
//! # What a dead peer looks like
//! A peer that closes a link after `Bye` (its destroy or abort) has left:
//! operations waiting for it stay blocked until this rank aborts, as on
//! GPUs when a peer stops calling; a send that finds the link closed
//! waits for its reader to say which of the two the peer did, so a peer
//! that left blocks a collective whether its close comes before, during or
//! after this rank's operation. A link that ends without `Bye` (the
//! process exited or was killed, or a malformed frame) is lost: every wait
//! that needs that peer, and every send to it, ends with `ncclRemoteError`
//! as the communicator's asynchronous error, naming the peer. The first
//! peer lost is also the communicator's asynchronous error as soon as its
//! link ends, with no operation in flight (`ncclCommGetAsyncError` asks
//! the mesh), as NCCL's proxy reports a remote error: a watchdog polling
//! it sees a killed peer within its interval, also while only work
//! outside NCCL (a one-shot kernel) waits for that peer. A peer that exits
//! without destroying its communicator is therefore an error to the ranks
//! still holding theirs.
//!
//! # Invariants
//! - Nothing here knows a communicator: a mesh is built for a routing key,
//!   a rank and the endpoints, and ends when a `stop` condition (its
//!   communicator's abort) says so; same-process ranks of an id made in
//!   this process never touch a socket (they never get here).
//! - Every wait is bounded by a short tick between checks of an abort or
//!   close flag, so `ncclCommAbort` ends it.
//! - Frames are bounded (`wire::MAX_FRAME`); payloads travel as chunks.

mod build;
mod mesh;
pub(super) mod routes;
pub(super) mod wire;

use nccl_sys::ncclResult_t;

pub(super) use build::build;
pub(super) use mesh::Mesh;
pub(super) use routes::{Joining, expect, forget};

/// An error of a rank's init: its code and text.
pub(crate) type InitErr = (ncclResult_t, String);

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_keys_differ() {
        let k = 0x1234_5678_9abc_def0_1122_3344_5566_7788u128;
        assert_eq!(child_key(k, 1), child_key(k, 1));
        assert_ne!(child_key(k, 1), child_key(k, 2));
        assert_ne!(child_key(k, 1), child_key(k + 1, 1));
    }
}
