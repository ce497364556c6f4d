//! `NcclBackend`: the [`CommBackend`] over one NCCL communicator per rank.
//!
//! Layout, one concern a file, each part a type that owns its fields. The
//! import graph has no circle (`cargo test -p xtask --test imports`); from
//! the bottom:
//! - the parts `Inner` and `Slot` hold, which name neither: `watch`
//!   (`Watch`: the watched submissions and the event pool), `calls`
//!   (`Calls`: the submission clock and the NCCL call a blocking
//!   communicator is inside), `fast_path` (`FastPath`: the 2-rank send/recv
//!   and add path, its kernel and scratch buffer), `one_shot` (`OneShot` and
//!   its `Flags`: the one-shot all-reduce's state and enqueue), `hosts`
//!   (which host each rank is on), `census` (the process's backends),
//!   `submission` (a `Submission`, its `Target` and `Ticket`, a group's
//!   pending submissions);
//! - this file: `NcclBackend`, `Inner`, `Slot`, construction and accessors;
//! - what acts on them: `failure` (refusing work, poisoning), `group` (the
//!   calling thread's group, and the slot lock around another thread's),
//!   `path` (the choice of all-reduce path and its enqueue),
//!   `one_shot_setup` (the one-shot path's set-up and release), `ops` (the
//!   trait's operations), `watchdog` (the thread that watches completions
//!   and deadlines), `submit` (the path every operation takes: health
//!   check, flight recorder, the enqueue under the slot lock, the watch,
//!   the completion ticket and its confirmation), `lifecycle` (start,
//!   connect and the host census, split, reconnect, shutdown and the
//!   teardown order).
//!
//! Invariants (NCCL's threading rules made into rules):
//! - The communicator and everything used with it (streams, events, the
//!   fast path's scratch and kernel, the one-shot path's buffers,
//!   registrations, the open group) live in one `Slot` behind one lock, and
//!   every NCCL call is made while holding it: a reconnect on another
//!   thread cannot destroy the communicator under a call.
//! - The only operations on the communicator without that lock are abort
//!   and the asynchronous-error query, through nccl-safe's `AbortHandle`,
//!   which NCCL allows from another thread and which never touches a
//!   destroyed communicator.
//! - Lock order: `slot`, then the watch lock (`Watch`, which also holds the
//!   event pool); `abort`, the one-shot `Flags` and `idle_pending` are
//!   leaves (held for a copy, a load, a swap, or the abort or event query
//!   they guard, never across another of the backend's locks), and so is
//!   `NcclBackend::watchdog` (held to join the watchdog thread, which never
//!   takes it). The watchdog never takes `slot`, and holds the watch lock
//!   only to copy or pop a queue's front, never across a driver call (a
//!   submitter holds it across one `cuEventRecord`); the call a blocking
//!   communicator is inside is published in two atomics (`Calls`). The locks of the
//!   parts come after these: `health`'s and the flight recorder's are
//!   leaves (the recorder's is taken under `slot` to record); the census
//!   lock is taken with no lock of the backend held (`census`); a
//!   rendezvous's locks are taken under `slot` (connect, the one-shot
//!   release barrier) and never take a backend lock; nccl-safe's
//!   communicator state lock comes last, inside NCCL calls and aborts.
//! - Every submission is health-checked, recorded in the flight recorder,
//!   and (unless captured into a CUDA graph or grouped) watched: a
//!   completion event goes to the watchdog, which poisons and aborts on a
//!   deadline miss or an asynchronous NCCL error.
//! - A completion counts only if its communicator neither failed nor was
//!   aborted (`submission::Ticket`, confirmed by `submit`).
//! - A group belongs to the thread that opened it; other threads' calls
//!   wait for it to end (bounded).
//! - With `EnqueueMode::Blocking` (the default) each NCCL call is itself
//!   watched: a call still inside NCCL at the collective timeout is
//!   poisoned by the watchdog, whose abort makes NCCL return.
//! - Once poisoned, every call is refused before NCCL is called, with the
//!   first failure; `attempt_reconnect` is the way back.
//! - Host waits poll with a deadline; only `recv_command_u32` idles without
//!   one, and it returns as soon as the backend fails, reconnects or shuts
//!   down.

mod calls;
mod census;
mod failure;
mod fast_path;
mod group;
mod hosts;
mod lifecycle;
mod one_shot;
mod one_shot_setup;
mod ops;
mod path;
mod path_table;
mod submission;
mod submit;
mod tune;
mod tune_cache;
mod watch;
mod watchdog;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::thread::JoinHandle;

use nccl_safe::{
    AbortHandle, Comm, Context, DeviceBuffer, Event, Stream, SymmetricBuffer, UniqueId,
};
use parking_lot::{Condvar, Mutex};

use crate::backend::Result;
use crate::config::BackendConfig;
use crate::diagnostics::FlightRecorder;
use crate::error::{CommError, Failure};
use crate::health::Health;
use crate::rendezvous::{FixedIdRendezvous, Launch, Rendezvous, TcpRendezvous};

use calls::Calls;
use fast_path::FastPath;
pub use hosts::HOST_ID_ENV;
pub use path_table::AllReducePath;
pub use path_table::{
    LaunchMode, MARGIN_FRACTION, MARGIN_NS, PathRange, PathTable, Rung, TIMED_PATHS,
};
use submission::GroupState;
use watch::Watch;

/// The communicator and what is used with it; guarded by `Inner::slot`.
struct Slot {
    comm: Option<Comm>,
    /// The backend's own stream, where its collectives run.
    stream: Stream,
    /// One f32 for the barrier.
    barrier_elem: DeviceBuffer<f32>,
    /// The 2-rank fast path's kernel and scratch buffer.
    fast: FastPath,
    /// Registration handle -> (address, bytes).
    registered: HashMap<u64, (u64, usize)>,
    /// Symmetric allocations by address.
    symmetric: HashMap<u64, SymmetricBuffer>,
    /// The group a thread has open, if any.
    group: Option<GroupState>,
    /// The one-shot all-reduce's buffers, kernel and ordering event.
    one_shot: one_shot::OneShot,
    /// Every rank's host, learned at connect where a path needs it.
    hosts: Option<hosts::Hosts>,
    /// The tuned path table of this communicator, where the tuner ran.
    tuned: Option<path_table::PathTable>,
    /// What a reconnect's release of an earlier generation's one-shot
    /// buffers leaked; `shutdown` reports it with its own.
    leaked: Vec<crate::error::Leak>,
}

// SAFETY: the raw streams the one-shot state keeps are only compared and
// passed to the driver under the slot lock; every other field is Send
// (`FastPath` states its own reason).
unsafe impl Send for Slot {}

struct Inner {
    rank: usize,
    world_size: usize,
    config: BackendConfig,
    ctx: Arc<Context>,
    /// How reconnects agree on a new id; `None` for a split communicator.
    rendezvous: Option<Arc<dyn Rendezvous>>,
    /// Where this backend's ranks meet at host barriers (the one-shot
    /// release): the rendezvous, or for a split communicator its group's
    /// rendezvous in the parent's store; `None` where there is no store.
    store: Option<Arc<dyn Rendezvous>>,
    /// Splits of this backend's communicator so far (reset when a new one is
    /// installed): with the generation, they name a sub-communicator's
    /// group in the store (every rank splits in the same order, as NCCL
    /// requires).
    splits: AtomicU64,
    slot: Mutex<Slot>,
    /// Signalled when a thread's group ends, for threads waiting to submit.
    group_closed: Condvar,
    /// Kept outside `slot` so that the watchdog can abort and ask for the
    /// asynchronous error while another thread holds `slot` inside an NCCL
    /// call.
    abort: Mutex<Option<AbortHandle>>,
    health: Health,
    recorder: Arc<FlightRecorder>,
    /// This backend's place in the process's census of backends.
    census: census::Registration,
    /// The watched submissions and the event pool.
    watch: Watch,
    generation: AtomicU64,
    /// The submission clock, and the NCCL call a blocking communicator is
    /// inside (for the watchdog: such a call has no deadline of its own).
    calls: Calls,
    /// The one-shot path's host-pinned abort and status words while it is
    /// on: kept outside `slot` so that the watchdog reads the status and
    /// `poison` sets the abort without it.
    one_shot_flags: one_shot::Flags,
    /// The completion event of a `recv_command_u32` enqueued and not yet
    /// seen complete: shutdown aborts such a receive at once, since only
    /// the root's next command could complete it.
    idle_pending: Mutex<Option<Arc<Event>>>,
    /// The add + norm kernels, loaded on first use (set once).
    norm: std::sync::OnceLock<crate::norm::NormKernels>,
}

/// The NCCL implementation of [`CommBackend`](crate::CommBackend). See the
/// module docs for its invariants and `docs/operations.md` for its
/// configuration.
pub struct NcclBackend {
    inner: Arc<Inner>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBackend")
            .field("rank", &self.inner.rank)
            .field("world_size", &self.inner.world_size)
            .field("device", &self.inner.config.device)
            .field("generation", &self.generation())
            .field("healthy", &self.inner.health.is_healthy())
            .finish()
    }
}

/// Maps an nccl-safe error met while setting up `stage` to
/// [`CommError::Setup`], keeping it as the source.
fn setup(stage: &'static str) -> impl FnOnce(nccl_safe::Error) -> CommError {
    move |e| CommError::setup(stage, e)
}

impl NcclBackend {
    /// Builds a backend for the rank the rendezvous names, agreeing on the
    /// communicator through it. Init is bounded by `config.init_timeout`.
    /// The `METRALE_COMM_*` environment overrides `config` here as in every
    /// constructor, unless `config.without_env_overrides()`.
    pub fn new(config: BackendConfig, rendezvous: Box<dyn Rendezvous>) -> Result<NcclBackend> {
        let rank = rendezvous.rank();
        let world_size = rendezvous.world_size();
        let rendezvous: Arc<dyn Rendezvous> = Arc::from(rendezvous);
        let store = rendezvous.has_store().then(|| Arc::clone(&rendezvous));
        let inner = Inner::new(config, (rank, world_size), Some(rendezvous), store, None)?;
        {
            let mut slot = inner.slot.lock();
            slot.fast
                .ensure_scratch(&inner.ctx, world_size, &inner.config)
                .map_err(setup("fast-path scratch buffer"))?;
            inner.connect(&mut slot, 0)?;
        }
        NcclBackend::start(inner)
    }

    /// Builds a backend from the launcher's environment (`env://`): torchrun,
    /// Slurm, Open MPI, MPICH / Intel MPI / PMIx, a Kubeflow PyTorchJob or
    /// plain `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
    /// (`rendezvous::Launch`; precedence in docs/operations.md). The device
    /// is the launcher's local rank, or `METRALE_COMM_DEVICE`: `config`
    /// builds the configuration for it (`BackendConfig::new` for the
    /// defaults) and must keep that device. `METRALE_COMM_*` overrides apply
    /// on top. Under torchrun every rank is a client of the agent's store;
    /// elsewhere rank 0 serves one on `MASTER_PORT`.
    pub fn from_env(config: impl FnOnce(usize) -> BackendConfig) -> Result<NcclBackend> {
        let launch = Launch::from_env()?;
        let config = config(launch.device).with_env_overrides()?;
        if config.device != launch.device {
            return Err(CommError::Config(format!(
                "from_env: the device is {} (from {}), but the configuration names device {}; \
                 set METRALE_COMM_DEVICE to choose another",
                launch.device, launch.device_from, config.device
            )));
        }
        let rv = TcpRendezvous::from_launch(&launch, config.init_timeout)?;
        NcclBackend::new(config, Box::new(rv))
    }

    /// Builds a backend from a unique id the engine distributed itself
    /// (rank 0 made it with `nccl_safe::UniqueId::new`). Such a backend
    /// cannot reconnect: that needs a rendezvous to agree on a new id.
    pub fn with_unique_id(
        config: BackendConfig,
        id: &UniqueId,
        rank: usize,
        world_size: usize,
    ) -> Result<NcclBackend> {
        let rv = FixedIdRendezvous::new(rank, world_size, *id.as_bytes())?;
        NcclBackend::new(config, Box::new(rv))
    }

    /// The CUDA context of this backend's device.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner.ctx
    }

    /// The backend's own stream, where `all_reduce`, `all_gather`,
    /// `reduce_scatter`, `broadcast`, `all_to_all` and `barrier` run. It
    /// lives as long as the backend (reconnects keep it): work an engine
    /// queues on it is ordered with those operations.
    pub fn stream(&self) -> nccl_safe::StreamRef<'_> {
        let raw = self.inner.slot.lock().stream.raw();
        // SAFETY: the stream is the backend's and lives as long as `self`,
        // which the returned borrow cannot outlive.
        unsafe { nccl_safe::StreamRef::from_raw(raw) }
    }

    /// This backend's number, unique in the process: errors and logs name
    /// backends by it ([`Failure::backend`], [`crate::error::InFlightElsewhere`]).
    pub fn id(&self) -> u64 {
        self.inner.census.id()
    }

    /// The flight recorder of recent submissions.
    pub fn recorder(&self) -> &FlightRecorder {
        &self.inner.recorder
    }

    /// The communicator generation: 0, then one more per reconnect.
    pub fn generation(&self) -> u64 {
        self.inner
            .generation
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// The failure that poisoned the backend, if any.
    pub fn failure(&self) -> Option<Arc<Failure>> {
        self.inner.health.failure()
    }

    /// The configuration the backend runs with.
    pub fn config(&self) -> &BackendConfig {
        &self.inner.config
    }

    /// Why the one-shot all-reduce is off on this backend (policy, world
    /// size, or which rank failed set-up or the proof of peer access, and
    /// how), `None` while it is on. The same reason is logged at set-up.
    pub fn one_shot_unavailable(&self) -> Option<String> {
        self.inner
            .slot
            .lock()
            .one_shot
            .why_off()
            .map(str::to_string)
    }
}

impl Inner {
    /// The shared state of a backend for `rank` of `world_size` on
    /// `config.device`, in `ctx` when given (a split's, its parent's).
    fn new(
        config: BackendConfig,
        (rank, world_size): (usize, usize),
        rendezvous: Option<Arc<dyn Rendezvous>>,
        store: Option<Arc<dyn Rendezvous>>,
        ctx: Option<Arc<Context>>,
    ) -> Result<Arc<Inner>> {
        // The same precedence whatever the entry point: the code's
        // configuration, then the environment.
        let config = config.with_env_overrides()?.with_tuning_resolved();
        config.validate()?;
        if world_size == 0 || rank >= world_size {
            return Err(CommError::Config(format!(
                "rank {rank} is out of range for world size {world_size}"
            )));
        }
        let ctx = match ctx {
            Some(ctx) => ctx,
            None => {
                let count = nccl_safe::device_count().map_err(setup("CUDA driver"))?;
                if config.device >= count {
                    return Err(CommError::Config(format!(
                        "device {} does not exist ({count} GPUs visible)",
                        config.device
                    )));
                }
                Context::new(config.device).map_err(setup("CUDA context"))?
            }
        };
        let slot = Slot::new(&ctx)?;
        let recorder = Arc::new(FlightRecorder::new(config.flight_recorder_capacity));
        let census = census::Registration::new(config.device, rank, world_size, &recorder);
        let watch = Watch::new(&ctx);
        let calls = Calls::new(config.enqueue);
        Ok(Arc::new(Inner {
            rank,
            world_size,
            recorder,
            census,
            config,
            ctx,
            rendezvous,
            store,
            splits: AtomicU64::new(0),
            slot: Mutex::new(slot),
            group_closed: Condvar::new(),
            abort: Mutex::new(None),
            health: Health::new(),
            watch,
            generation: AtomicU64::new(0),
            calls,
            one_shot_flags: one_shot::Flags::default(),
            idle_pending: Mutex::new(None),
            norm: std::sync::OnceLock::new(),
        }))
    }
}

impl Slot {
    fn new(ctx: &Arc<Context>) -> Result<Slot> {
        Ok(Slot {
            comm: None,
            stream: Stream::new(ctx).map_err(setup("stream"))?,
            barrier_elem: DeviceBuffer::from_host(ctx, &[1.0f32])
                .map_err(setup("barrier buffer"))?,
            fast: FastPath::new(ctx).map_err(setup("event"))?,
            registered: HashMap::new(),
            symmetric: HashMap::new(),
            group: None,
            one_shot: one_shot::OneShot::new(ctx).map_err(setup("one-shot state"))?,
            hosts: None,
            tuned: None,
            leaked: Vec::new(),
        })
    }

    /// The communicator, or `Aborted` for `call` when there is none (after
    /// shutdown, or a failed reconnect).
    fn comm(&self, call: &'static str) -> nccl_safe::Result<&Comm> {
        self.comm.as_ref().ok_or(nccl_safe::Error::Aborted { call })
    }

    /// Whether `[ptr, ptr + bytes)` overlaps a registered buffer or a
    /// symmetric allocation. Such buffers take NCCL's all-reduce, which is
    /// what registration is for (and the fast path's grouped send/recv from
    /// registered `ncclMemAlloc` memory is not supported).
    fn in_registered_memory(&self, ptr: u64, bytes: usize) -> bool {
        let end = ptr.saturating_add(bytes as u64);
        let overlaps =
            |start: u64, len: usize| ptr < start.saturating_add(len as u64) && start < end;
        self.registered
            .values()
            .any(|&(start, len)| overlaps(start, len))
            || self
                .symmetric
                .iter()
                .any(|(&start, buf)| overlaps(start, buf.bytes()))
    }
}

impl Drop for NcclBackend {
    fn drop(&mut self) {
        if let Err(e) = crate::CommBackend::shutdown(self) {
            tracing::warn!(rank = self.inner.rank, "shutdown on drop: {e}");
        }
    }
}
