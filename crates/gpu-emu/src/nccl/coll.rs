//! What an operation is, whichever transport runs it: a collective's
//! [`Kind`] and its [`Desc`] (buffers, count, type, reduction, root), the
//! error an operation ends with, and the all-or-nothing reads and writes
//! of device memory both transports (`world` in process, `net` across
//! processes) make.
//!
//! Invariant: device memory is touched only through `memory::access`, a
//! read or a set of writes at a time: a buffer not allocated then (freed
//! meanwhile) is `ncclUnhandledCudaError` and nothing of that write set is
//! written.

use nccl_sys::ncclResult_t;

use super::data::{Dt, Op};
use crate::cuda::memory::{self, Span};

/// The collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AlltoAll,
    Gather,
    Scatter,
}

impl Kind {
    /// Its number on the wire.
    pub(super) fn code(self) -> u8 {
        self as u8
    }

    pub(super) fn reduces(self) -> bool {
        matches!(self, Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter)
    }

    pub(super) fn rooted(self) -> bool {
        matches!(
            self,
            Kind::Broadcast | Kind::Reduce | Kind::Gather | Kind::Scatter
        )
    }

    /// (send, recv) sizes in elements for `rank`; 0 when unused.
    pub(super) fn sizes(self, count: usize, n: usize, is_root: bool) -> Option<(usize, usize)> {
        let nc = count.checked_mul(n)?;
        let root = |v: usize| if is_root { v } else { 0 };
        Some(match self {
            Kind::AllReduce => (count, count),
            Kind::Broadcast => (root(count), count),
            Kind::Reduce => (count, root(count)),
            Kind::AllGather => (count, nc),
            Kind::ReduceScatter => (nc, count),
            Kind::AlltoAll => (nc, nc),
            Kind::Gather => (count, root(nc)),
            Kind::Scatter => (root(nc), count),
        })
    }
}

/// One rank's part in a collective.
#[derive(Debug, Clone, Copy)]
pub(super) struct Desc {
    pub(super) kind: Kind,
    pub(super) send: u64,
    pub(super) recv: u64,
    pub(super) count: usize,
    pub(super) dt: Dt,
    pub(super) op: Op,
    pub(super) root: usize,
}

/// The error an operation ends with: its code and text.
pub(super) type CollErr = (ncclResult_t, String);

/// A buffer was not allocated when the operation touched it.
pub(super) fn illegal() -> CollErr {
    (
        ncclResult_t::ncclUnhandledCudaError,
        "illegal memory access: a buffer was freed while an operation used it".into(),
    )
}

/// A copy of `[p, p + len)`, read while the range is held live.
pub(super) fn read(p: u64, len: usize) -> Result<Vec<u8>, CollErr> {
    let mut v = vec![0u8; len];
    let to = v.as_mut_ptr() as usize as u64;
    // SAFETY: `[p, p + len)` is a live device allocation for the whole copy
    // (`access` holds the registry until it returns) and `v` holds `len`
    // bytes.
    memory::access(&[Span::device(p, len)], || unsafe {
        memory::copy(to, p, len)
    })
    .ok_or_else(illegal)?;
    Ok(v)
}

/// Writes every `(destination, bytes)` pair, all or none: only if every
/// destination is live, held live until the last byte is written.
pub(super) fn write_all(writes: &[(u64, Vec<u8>)]) -> Result<(), CollErr> {
    let spans: Vec<Span> = writes
        .iter()
        .map(|(p, v)| Span::device(*p, v.len()))
        .collect();
    memory::access(&spans, || {
        for (p, v) in writes {
            // SAFETY: every destination is a live device allocation for the
            // whole loop (`access` holds the registry) and `v` holds the
            // bytes to copy.
            unsafe { memory::copy(*p, v.as_ptr() as usize as u64, v.len()) };
        }
    })
    .ok_or_else(illegal)
}
