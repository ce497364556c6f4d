//! The emulated NCCL: communicators, groups, collectives, send/recv,
//! registration, errors and fault injection hooks.
//!
//! Ranks of one unique id meet in a process-wide registry (`bootstrap`) of
//! the process that made the id. When every rank is a thread of that process they
//! share a `World` (`world`), where collectives meet by sequence number and
//! sends post copies of their data into mailboxes keyed by their number;
//! when some are
//! other processes, every rank gets a mesh of loopback links (`net`), and
//! each computes its own outputs from its peers' messages.
//!
//! Invariants:
//! - A collective's sequence number is taken at launch (the API call, or the
//!   graph launch of captured work), so every rank agrees on matching. So
//!   is a send's (receive's) number among its communicator's sends to
//!   (receives from) that peer: the `k`-th send from `a` to `b` matches
//!   `b`'s `k`-th receive from `a`, in call order whatever the streams, as
//!   NCCL matches them. Within a group the items are numbered in call
//!   order; each stream's part runs its sends first (a send only posts),
//!   and the parts on several streams wait for each other before and
//!   after their items, as NCCL makes a group's streams wait for each
//!   other.
//! - In process, a collective is computed once, by the last rank to
//!   arrive, under the world's lock: every input is read before any output
//!   is written (in-place works), and no output is written once a
//!   participant has aborted, so an aborted rank's buffers are never
//!   touched after `ncclCommAbort` returns. Across processes each rank
//!   writes only its own outputs, under its mesh's lock, never after its
//!   abort returns.
//! - Waits are condition-variable waits with a short timeout that re-check
//!   the waiter's abort flag, so abort releases them promptly.
//! - Reductions run in rank order; 16-bit floats are computed in `f32` and
//!   rounded after each step, as NCCL's kernels do.
//! - A non-blocking communicator's operations (outside a group, or in a
//!   group whose end holds work of one) are launched at the call but reach
//!   the stream later, from a background thread, after a short random delay
//!   and, for the communicator's first operation, once every peer has
//!   launched its matching operation (NCCL connects lazily). The call
//!   returns `ncclInProgress`, `ncclCommGetAsyncError` says `ncclInProgress`
//!   until the enqueue is done, and any other operation on the communicator
//!   meanwhile is `ncclInvalidUsage`. Abort drops the pending work.
//! - A launched operation counts as in flight until its work runs or is
//!   dropped.
//! - A communicator's launches run in issue order across every stream, as
//!   NCCL's strong stream orders them: a launch (an operation outside a
//!   group, the communicator's part of a group, or its captured operations
//!   at each graph launch) takes the next ticket of the communicator's
//!   [`Chain`] when it is launched, and its work, on whatever stream, first
//!   waits until every earlier ticket is done, so the stream waits too.
//!   Children split from a `splitShare` communicator share its chain. A
//!   ticket is done when its work has run or been dropped (abort drops
//!   pending work; work of an aborted communicator waiting for its turn
//!   ends unrun), so an abort never leaves the chain blocked.
//! - An operation touches its buffers only when it runs, through
//!   `memory::access`, which holds them live from the check to the last
//!   byte: a buffer not allocated then (freed meanwhile) is the
//!   communicator's asynchronous `ncclUnhandledCudaError` ("illegal memory
//!   access") and nothing of that operation is written. An operation that
//!   runs on a device with a sticky CUDA error fails the same way, unrun.
//! - `ncclCommDestroy` returns only once no other communicator has work in
//!   flight on a device of this communicator's peers (NCCL's teardown
//!   unmaps buffers the peers' devices map, which waits for them), or once
//!   this communicator is aborted.
//!
//! # Layout
//! Lowest first; a module uses only modules of earlier lines
//! (`xtask/tests/imports.rs` checks that no import circles back):
//! - `errors` (result texts, last errors, the entry guard); `data`
//!   (element types and reductions); `coll` (what an operation is, and its
//!   all-or-nothing reads and writes of device memory);
//! - the transports: `world` (ranks that are threads of this process) and
//!   `net` (ranks in several processes: wire format, listener, links,
//!   meshes), which know no communicator;
//! - `comm` (communicators, their strong-stream chain, where their peers
//!   are, configs);
//! - `bootstrap` (unique ids, the registry where the ranks of an id meet,
//!   registration with the root across processes), `launch` (launching
//!   work onto streams, background enqueues, running it), `reg`
//!   (registration, windows, `ncclMemAlloc`);
//! - `group` (groups), `lifecycle` (finalize, destroy, abort, queries,
//!   `ncclGetLastError`);
//! - `init` (rank inits), `ops` (collectives and send/recv), `split`.
//!
//! # Locks
//! Taken in this order, never the reverse (each module doc says more):
//! - the bootstrap registry, then a member's `Comm::st` (its world set);
//! - a `World`'s state, then a split child's `Comm::st`, and the memory
//!   registry (the operation's reads and writes);
//! - a communicator's `splitting`, then a child's `Comm::st` (an abort);
//! - `Comm::st`, then the interned error texts or the last error (an
//!   error recorded while it is held);
//! - a mesh link's write lock, then the `Mesh`'s state, then the memory
//!   registry.
//!
//! Every other lock is a leaf, held with no other lock taken under it:
//! `Comm::p2p_seq`, a `Chain`'s state, a group `Join`'s, the tables of
//! communicators and aborted ids, the listener's routes and a
//! `Joining`'s links (never held together), and `fault`'s list. The
//! memory registry is the innermost lock of the crate (`cuda::memory`).

use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nccl_sys::ncclResult_t;

mod bootstrap;
mod coll;
mod comm;
mod data;
pub(crate) mod errors;
pub(crate) mod group;
pub(crate) mod init;
mod launch;
pub(crate) mod lifecycle;
mod net;
pub(crate) mod ops;
pub(crate) mod reg;
pub(crate) mod split;
mod world;

pub(super) const TICK: Duration = Duration::from_millis(20);
/// How often a background enqueue re-checks its peers and abort flags.
pub(super) const POLL: Duration = Duration::from_millis(1);
pub(super) const CONFIG_MAGIC: u32 = 0xcafe_beef;
pub(super) const VERSION: c_int = 22803;

pub(super) type R<T> = Result<T, ncclResult_t>;

pub(super) static CALLS: AtomicU64 = AtomicU64::new(0);

/// The number of NCCL API calls made so far in this process.
#[unsafe(no_mangle)]
pub extern "C" fn metrale_emu_nccl_calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}
