//! Errors of the policy layer.
//!
//! Invariants: an error from bad input ([`CommError::InvalidArgument`],
//! [`CommError::UnknownHandle`], [`CommError::InGroup`]) never poisons the
//! backend; [`CommError::Poisoned`] always carries the first failure, so a
//! refused call names what failed first.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::rendezvous::RendezvousError;

/// Why a backend call failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// The arguments are wrong; nothing was submitted.
    #[error("{op}: invalid argument: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A handle or address the backend does not know (never handed out, or
    /// already released).
    #[error("{op}: unknown handle {handle:#x} (never handed out, or already released)")]
    UnknownHandle {
        /// The operation.
        op: &'static str,
        /// The handle or address.
        handle: u64,
    },
    /// An operation that waits for completion was called inside
    /// `group_start`/`group_end`, where it would wait for work the group has
    /// not launched yet.
    #[error("{op}: refused inside group_start/group_end: it waits for completion")]
    InGroup {
        /// The operation.
        op: &'static str,
    },
    /// The backend is poisoned by an earlier failure and refuses work.
    #[error(
        "{op}: refused: communicator poisoned (rank {rank} of {world_size}) by: {cause}; \
         stop all ranks, or call attempt_reconnect on every rank"
    )]
    Poisoned {
        /// The refused operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The number of ranks.
        world_size: usize,
        /// The first failure.
        #[source]
        cause: Arc<Failure>,
    },
    /// This call's own operation failed and poisoned the backend.
    #[error("{0}")]
    Failed(#[source] Arc<Failure>),
    /// A call to NCCL or the driver was refused before anything was
    /// enqueued (the backend stays healthy).
    #[error("{op}: {source}")]
    Refused {
        /// The operation.
        op: &'static str,
        /// NCCL's or the driver's error.
        source: nccl_safe::Error,
    },
    /// The backend was shut down.
    #[error("{op}: the backend is shut down")]
    Shutdown {
        /// The operation.
        op: &'static str,
    },
    /// Another thread is replacing the communicator (`attempt_reconnect`).
    #[error("{op}: refused: the communicator is being reconnected")]
    Reconnecting {
        /// The operation.
        op: &'static str,
    },
    /// The communicator an operation ran on was aborted (by a reconnect)
    /// before the operation was seen complete: its buffers hold no result.
    #[error(
        "{op} (seq {seq}, generation {generation}) was aborted by a reconnect before it \
         completed; its buffers hold no result"
    )]
    Aborted {
        /// The operation.
        op: &'static str,
        /// Its sequence number in the flight recorder.
        seq: u64,
        /// The communicator generation it ran on.
        generation: u64,
    },
    /// `shutdown` released everything else but leaked these (memory a
    /// peer may still map, or work that could not be proven finished,
    /// also what a reconnect left of an earlier generation): the
    /// process should not build another backend on the same device
    /// without accounting for them; a supervisor restarts the process.
    #[error("{op}: leaked {}", leak_list(.leaks))]
    Leaked {
        /// The operation (`shutdown`).
        op: &'static str,
        /// What was leaked, and why; never empty.
        leaks: Vec<Leak>,
    },
    /// The operation does not exist for this backend (send on one rank).
    #[error("{op}: unsupported: {reason}")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// Setting up the backend failed (device, context, buffers, init); the
    /// driver's or NCCL's error is the source.
    #[error("{stage}{}: {source}", if context.is_empty() { String::new() } else { format!(" ({context})") })]
    Setup {
        /// What was being set up.
        stage: &'static str,
        /// Which rank and generation, when that helps.
        context: String,
        /// The driver's or NCCL's error.
        #[source]
        source: nccl_safe::Error,
    },
    /// A thread the backend needs could not be started.
    #[error("starting the {what} thread failed: {source}")]
    Thread {
        /// Which thread.
        what: &'static str,
        /// The system's error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// Another thread kept a group open for longer than the collective
    /// timeout, so this call could not reach the communicator.
    #[error("{op}: another thread's group stayed open for {waited:?}")]
    GroupBusy {
        /// The operation.
        op: &'static str,
        /// How long it waited.
        waited: Duration,
    },
    /// The rendezvous failed.
    #[error(transparent)]
    Rendezvous(Arc<RendezvousError>),
    /// The configuration or environment is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
}

impl From<RendezvousError> for CommError {
    fn from(e: RendezvousError) -> Self {
        CommError::Rendezvous(Arc::new(e))
    }
}

impl CommError {
    /// [`CommError::Setup`] of `stage` with no context.
    pub(crate) fn setup(stage: &'static str, source: nccl_safe::Error) -> CommError {
        CommError::Setup {
            stage,
            context: String::new(),
            source,
        }
    }

    /// [`CommError::Setup`] of `stage` for `context` (rank, generation).
    pub(crate) fn setup_of(
        stage: &'static str,
        context: String,
        source: nccl_safe::Error,
    ) -> CommError {
        CommError::Setup {
            stage,
            context,
            source,
        }
    }

    /// The NCCL or driver error behind this error, if one is: a refused
    /// call's, a failed setup's, or the failure's that poisoned the backend.
    pub fn nccl_error(&self) -> Option<&nccl_safe::Error> {
        match self {
            CommError::Refused { source, .. } | CommError::Setup { source, .. } => Some(source),
            CommError::Poisoned { cause, .. } | CommError::Failed(cause) => cause.kind.nccl_error(),
            _ => None,
        }
    }

    /// The first failure behind this error, for `Poisoned` and `Failed`.
    pub fn failure(&self) -> Option<&Failure> {
        match self {
            CommError::Poisoned { cause, .. } | CommError::Failed(cause) => Some(cause),
            _ => None,
        }
    }

    /// True for errors caused by the arguments of the call.
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            CommError::InvalidArgument { .. }
                | CommError::UnknownHandle { .. }
                | CommError::InGroup { .. }
        )
    }
}

fn leak_list(leaks: &[Leak]) -> String {
    leaks
        .iter()
        .map(Leak::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// What a [`Leak`] left allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeakKind {
    /// The one-shot path's receive buffer (its peers map it).
    OneShotReceiveBuffer,
    /// The one-shot kernels' control block and host-pinned words.
    OneShotControlBlock,
    /// This rank's mappings of the peers' one-shot buffers.
    OneShotPeerMappings,
    /// The fast path's scratch buffer.
    Scratch,
    /// Buffers from `alloc_symmetric`.
    SymmetricMemory,
}

impl fmt::Display for LeakKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LeakKind::OneShotReceiveBuffer => "the one-shot receive buffer",
            LeakKind::OneShotControlBlock => "the one-shot control block",
            LeakKind::OneShotPeerMappings => "the mappings of the peers' one-shot buffers",
            LeakKind::Scratch => "the fast path's scratch buffer",
            LeakKind::SymmetricMemory => "symmetric memory",
        })
    }
}

/// One thing a shutdown left allocated rather than free it under a peer or
/// a kernel that may still use it, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leak {
    /// What.
    pub what: LeakKind,
    /// Its device bytes (0 where not known, or host memory).
    pub bytes: usize,
    /// Why it could not be released.
    pub why: String,
}

impl Leak {
    pub(crate) fn new(what: LeakKind, bytes: usize, why: impl Into<String>) -> Leak {
        Leak {
            what,
            bytes,
            why: why.into(),
        }
    }
}

impl fmt::Display for Leak {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.what)?;
        if self.bytes > 0 {
            write!(f, " ({} bytes)", self.bytes)?;
        }
        write!(f, ": {}", self.why)
    }
}

/// What poisoned a communicator: the op, its sequence number and the cause.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The operation that failed or did not complete.
    pub op: &'static str,
    /// Its sequence number in this rank's flight recorder.
    pub seq: u64,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// The communicator generation (0, then +1 per reconnect).
    pub generation: u64,
    /// What happened.
    pub kind: FailureKind,
    /// The failing backend's number in this process (`NcclBackend::id`).
    pub backend: u64,
    /// For a timeout: what the process's other communicators had in flight
    /// when it was seen. Communicators that share devices can deadlock on
    /// each other (ranks that issue their work in different orders, or a
    /// free that waits for a whole device while another communicator's
    /// kernel waits for a peer); this names the other side.
    pub elsewhere: Vec<InFlightElsewhere>,
    /// The rank that stopped answering first, where it is known (a
    /// timeout's census of who reported it through the store).
    pub suspect: Option<Suspect>,
}

/// The rank a [`Failure`] names as the one that stopped answering, and
/// how that is known.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Suspect {
    /// The rank.
    pub rank: usize,
    /// How it is known.
    pub evidence: String,
}

/// An operation another backend of this process had in flight when a
/// [`Failure`] was recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InFlightElsewhere {
    /// That backend's number in this process (`NcclBackend::id`).
    pub backend: u64,
    /// Its rank.
    pub rank: usize,
    /// Its number of ranks.
    pub world_size: usize,
    /// Its CUDA device.
    pub device: usize,
    /// The operation.
    pub op: String,
    /// Its sequence number in that backend's flight recorder.
    pub seq: u64,
    /// How long it had been in flight.
    pub pending_for: Duration,
    /// That backend had already recorded it as timed out.
    pub timed_out: bool,
}

impl fmt::Display for InFlightElsewhere {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "backend {} (rank {} of {}, device {}): {} seq {} for {:.1?}",
            self.backend,
            self.rank,
            self.world_size,
            self.device,
            self.op,
            self.seq,
            self.pending_for
        )
    }
}

/// The kind of a [`Failure`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum FailureKind {
    /// The operation did not complete within the collective timeout.
    Timeout {
        /// The timeout.
        after: Duration,
    },
    /// NCCL reported an asynchronous error on the communicator.
    AsyncError(nccl_safe::Error),
    /// The call itself failed after work may have been enqueued.
    CallFailed(nccl_safe::Error),
    /// `attempt_reconnect` could not build a new communicator.
    Reconnect(Box<CommError>),
    /// A one-shot all-reduce kernel recorded a status: it waited past its
    /// own deadline for a peer (`Timeout`, the collective timeout plus a
    /// grace, for work no watchdog sees such as graph replays), found its
    /// lane held by another running call (`Concurrent`), or refused a
    /// launch outside its contract (`BadLaunch`).
    OneShot {
        /// What the kernel recorded.
        status: crate::kernels::OneShotStatus,
    },
}

impl FailureKind {
    /// The NCCL or driver error behind the failure, if one is.
    pub fn nccl_error(&self) -> Option<&nccl_safe::Error> {
        match self {
            FailureKind::AsyncError(e) | FailureKind::CallFailed(e) => Some(e),
            FailureKind::Reconnect(e) => e.nccl_error(),
            FailureKind::Timeout { .. } | FailureKind::OneShot { .. } => None,
        }
    }

    /// True for a deadline missed: the watchdog's, a waiter's, or a
    /// one-shot kernel's own.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            FailureKind::Timeout { .. }
                | FailureKind::OneShot {
                    status: crate::kernels::OneShotStatus::Timeout
                }
        )
    }

    /// `AsyncError` when `e` is the communicator's asynchronous error (seen
    /// while the call waited for NCCL), else `CallFailed`.
    pub fn from_call(e: nccl_safe::Error) -> FailureKind {
        if e.is_async() {
            FailureKind::AsyncError(e)
        } else {
            FailureKind::CallFailed(e)
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (seq {}, rank {} of {}, generation {}, backend {}) ",
            self.op, self.seq, self.rank, self.world_size, self.generation, self.backend
        )?;
        match &self.kind {
            FailureKind::Timeout { after } => write!(f, "did not complete within {after:?}"),
            FailureKind::AsyncError(e) => write!(f, "hit an asynchronous NCCL error: {e}"),
            FailureKind::CallFailed(e) => write!(f, "failed: {e}"),
            FailureKind::Reconnect(e) => write!(f, "could not reconnect: {e}"),
            FailureKind::OneShot { status } => write!(f, "failed in the one-shot kernel: {status}"),
        }?;
        if let Some(s) = &self.suspect {
            write!(
                f,
                "; rank {} stopped answering first ({})",
                s.rank, s.evidence
            )?;
        }
        if !self.elsewhere.is_empty() {
            write!(
                f,
                "; in flight meanwhile on this process's other communicators:"
            )?;
            for (i, x) in self.elsewhere.iter().enumerate() {
                write!(f, "{} {x}", if i == 0 { "" } else { ";" })?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for Failure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            FailureKind::AsyncError(e) | FailureKind::CallFailed(e) => Some(e),
            FailureKind::Reconnect(e) => Some(&**e),
            FailureKind::Timeout { .. } | FailureKind::OneShot { .. } => None,
        }
    }
}
