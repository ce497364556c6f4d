//! The emulated NCCL: communicators, groups, collectives, send/recv,
//! registration, errors and fault injection hooks.
//!
//! Ranks of one unique id meet in a process-wide registry of the process
//! that made the id. When every rank is a thread of that process they
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
//! One file per API family: `init` (unique ids, rank inits, the in-process
//! registry), `split`, `group`, `ops` (collectives and send/recv),
//! `lifecycle` (finalize, destroy, abort, queries), `reg` (registration,
//! windows, `ncclMemAlloc`), `errors` (result texts, last errors); and the
//! machinery under them: `comm` (communicators, their strong-stream
//! chain, configs), `launch` (launching work onto streams, background
//! enqueues, running it), `world` (the in-process meeting of ranks),
//! `net` (ranks in several processes: bootstrap, links, wire format) and
//! `data` (element types and reductions).

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
