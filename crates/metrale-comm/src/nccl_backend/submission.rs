//! What a submission is, as values: a [`Submission`] (what the flight
//! recorder logs, where it runs, how its completion is awaited), the
//! [`Target`] its enqueue goes to, the [`Ticket`] a waiting caller holds,
//! and the submissions pending in a thread's open group. `submit` and
//! `group` act on them; the parts that enqueue (`one_shot`) read a
//! `Target`.
//!
//! Invariant: these are plain values; nothing here locks, waits or calls
//! the driver.

use std::sync::Arc;
use std::thread::ThreadId;

use cuda_sys::CUstream;
use nccl_safe::{AbortHandle, DataType, Event, StreamRef};

use crate::validate::Span;

/// What a thread waiting for a submission checks when its event completes:
/// the completion counts only if the communicator the work ran on neither
/// failed nor was aborted (by the watchdog, a reconnect or a shutdown).
pub(super) struct Ticket {
    pub(super) seq: u64,
    pub(super) event: Arc<Event>,
    pub(super) generation: u64,
    pub(super) comm: AbortHandle,
    /// The stream (as its watch key) the event is recorded on: once the
    /// ticket is confirmed, every submission there up to `seq` is good.
    pub(super) stream: usize,
    /// How the caller waits: within the collective timeout, or idle.
    pub(super) wait: Wait,
}

/// Which stream a submission runs on.
#[derive(Clone, Copy)]
pub(super) enum StreamSel {
    /// The backend's own stream.
    Own,
    /// A caller's stream (a `StreamRef` the operation borrowed).
    Caller(CUstream),
}

/// How a submission's completion is awaited.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Wait {
    /// By the watchdog alone, within the collective timeout.
    Watched,
    /// By the caller too, through its [`Ticket`], within the collective
    /// timeout.
    Ticket,
    /// By the caller, through its ticket, with no deadline (a command
    /// receive waits for the root's next command).
    Idle,
}

/// One operation to submit, built from its checked view.
#[derive(Clone, Copy)]
pub(super) struct Submission {
    pub(super) op: &'static str,
    /// The payload's element type, for the flight recorder.
    pub(super) dtype: DataType,
    /// The payload's size, for the flight recorder.
    pub(super) bytes: usize,
    /// The peer or root, for the flight recorder.
    pub(super) peer: Option<usize>,
    pub(super) stream: StreamSel,
    pub(super) wait: Wait,
}

impl Submission {
    /// `op` on the payload `span`, on the backend's stream, watched.
    pub(super) fn of(op: &'static str, span: &Span) -> Submission {
        Submission::sized(op, span.dtype, span.bytes())
    }

    /// `op` on `bytes` of `dtype` of the backend's own (the barrier's
    /// element), on its stream, watched.
    pub(super) fn sized(op: &'static str, dtype: DataType, bytes: usize) -> Submission {
        Submission {
            op,
            dtype,
            bytes,
            peer: None,
            stream: StreamSel::Own,
            wait: Wait::Watched,
        }
    }

    /// The same, on the caller's `stream`.
    pub(super) fn on(self, stream: StreamRef<'_>) -> Submission {
        Submission {
            stream: StreamSel::Caller(stream.as_raw()),
            ..self
        }
    }

    /// The same, naming `peer` (a send's destination, a receive's source, a
    /// broadcast's root).
    pub(super) fn with_peer(self, peer: usize) -> Submission {
        Submission {
            peer: Some(peer),
            ..self
        }
    }

    /// The same, awaited as `wait` says.
    pub(super) fn awaited(self, wait: Wait) -> Submission {
        Submission { wait, ..self }
    }
}

/// Whether an enqueue is captured into a CUDA graph.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Capture {
    /// Runs now, in stream order.
    Eager,
    /// Captured: runs at each launch of the graph.
    Graph,
}

/// Where an enqueue goes: the submission's stream, resolved, and whether
/// it is being captured.
#[derive(Clone, Copy)]
pub(super) struct Target {
    pub(super) stream: CUstream,
    pub(super) capture: Capture,
}

/// A group open on one thread.
pub(super) struct GroupState {
    pub(super) owner: ThreadId,
    pub(super) depth: usize,
    /// Submissions inside the group, watched from its end.
    pub(super) watch: Vec<GroupedOp>,
}

/// A submission made inside a group.
pub(super) struct GroupedOp {
    pub(super) seq: u64,
    pub(super) op: &'static str,
    pub(super) stream: CUstream,
}
