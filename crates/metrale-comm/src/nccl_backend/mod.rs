//! `NcclBackend`: the [`CommBackend`] over one NCCL communicator per rank.
//!
//! Layout, one concern a file: this file (the types, construction and
//! accessors), `submit` (the path every operation takes: health check,
//! flight recorder, the enqueue under the slot lock, the completion ticket
//! and its confirmation, per-thread groups), `watchdog` (the thread that
//! watches completions and deadlines), `fast_path` (the choice of
//! all-reduce path, the 2-rank send/recv + add path and its scratch
//! buffer), `one_shot` (the one-shot all-reduce over peer memory, its
//! set-up, proof and release), `lifecycle` (connect, split, reconnect,
//! shutdown and the teardown order), `ops` (the trait's operations).
//!
//! Invariants (NCCL's threading rules made into rules):
//! - The communicator and everything used with it (streams, events, scratch,
//!   kernel, registrations, the open group) live in one `Slot` behind one
//!   lock, and every NCCL call is made while holding it: a reconnect on
//!   another thread cannot destroy the communicator under a call.
//! - The only operations on the communicator without that lock are abort
//!   and the asynchronous-error query, through nccl-safe's `AbortHandle`,
//!   which NCCL allows from another thread and which never touches a
//!   destroyed communicator.
//! - Lock order: `slot`, then `watched` (which also holds the event pool);
//!   `abort`, `one_shot_flags` and `idle_pending` are leaves (held for a
//!   copy, a load, a swap, or the abort or event query they guard, never
//!   across another of the backend's locks), and so is
//!   `NcclBackend::watchdog` (held to join the watchdog thread, which never
//!   takes it). The watchdog never takes `slot`, and holds `watched` only
//!   to copy or pop a queue's front, never across a driver call (a
//!   submitter holds it across one `cuEventRecord`); the call a blocking
//!   communicator is inside is published in two atomics. The locks of the
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
//!   aborted (`submit::Ticket`).
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

mod census;
mod fast_path;
mod hosts;
mod lifecycle;
mod one_shot;
mod ops;
mod submit;
mod watchdog;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::thread::JoinHandle;

use half::bf16;
use nccl_safe::{
    AbortHandle, Comm, Context, DeviceBuffer, Event, Module, Stream, SymmetricBuffer, UniqueId,
};
use parking_lot::{Condvar, Mutex};

use crate::backend::{AddKernel, Result};
use crate::config::BackendConfig;
use crate::diagnostics::FlightRecorder;
use crate::error::{CommError, Failure};
use crate::health::Health;
use crate::kernels;
use crate::rendezvous::{FixedIdRendezvous, Launch, Rendezvous, TcpRendezvous};

pub use fast_path::AllReducePath;
pub use hosts::HOST_ID_ENV;
use submit::{GroupState, WatchQueues};

/// The communicator and what is used with it; guarded by `Inner::slot`.
struct Slot {
    comm: Option<Comm>,
    /// The backend's own stream, where its collectives run.
    stream: Stream,
    scratch: Option<DeviceBuffer<bf16>>,
    /// Recorded after the last fast-path kernel that reads `scratch`; a
    /// fast path on another stream waits for it before its receive
    /// overwrites `scratch` (NCCL orders its own kernels by issue, not the
    /// add kernel behind them).
    scratch_free: Event,
    /// The stream `scratch_free` was last recorded on; `None` before the
    /// first use.
    scratch_stream: Option<cuda_sys::CUstream>,
    /// One f32 for the barrier.
    barrier_elem: DeviceBuffer<f32>,
    /// The fast path's add kernel; `None` turns the fast path off.
    kernel: Option<AddKernel>,
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
}

// SAFETY: the raw streams in `scratch_stream` and the one-shot state are
// only compared and passed to the driver under the slot lock; every other
// field is Send.
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
    watched: Mutex<WatchQueues>,
    generation: AtomicU64,
    /// The sequence number of the submission now inside an NCCL call on a
    /// blocking communicator (0: none), for the watchdog: such a call has no
    /// deadline of its own. `in_call_since_us` is when it started, in
    /// microseconds after `born`.
    in_call_seq: AtomicU64,
    in_call_since_us: AtomicU64,
    /// When the backend was made: the origin of `in_call_since_us`.
    born: std::time::Instant,
    /// `born` as microseconds since the Unix epoch: submissions stamp the
    /// flight recorder from the one monotonic clock read they make.
    born_unix_us: u64,
    /// The one-shot path's host-pinned abort and status words while it is
    /// on: kept outside `slot` so that the watchdog reads the status and
    /// `poison` sets the abort without it.
    one_shot_flags: Mutex<Option<Arc<nccl_safe::HostWords>>>,
    /// The completion event of a `recv_command_u32` enqueued and not yet
    /// seen complete: shutdown aborts such a receive at once, since only
    /// the root's next command could complete it.
    idle_pending: Mutex<Option<Arc<Event>>>,
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
            inner
                .ensure_scratch(&mut slot)
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

    /// Starts the watchdog of a connected backend.
    fn start(inner: Arc<Inner>) -> Result<NcclBackend> {
        let weak = Arc::downgrade(&inner);
        let rank = inner.rank;
        let watchdog = std::thread::Builder::new()
            .name(format!("metrale-watchdog-r{rank}"))
            .spawn(move || watchdog::watchdog_loop(weak))
            .map_err(|e| CommError::Thread {
                what: "watchdog",
                source: Arc::new(e),
            })?;
        tracing::info!(
            rank,
            world_size = inner.world_size,
            device = inner.config.device,
            "NCCL backend ready"
        );
        Ok(NcclBackend {
            inner,
            watchdog: Mutex::new(Some(watchdog)),
        })
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

    /// Which path an eager bf16 `all_reduce` takes now for `bytes` in
    /// ordinary device memory: [`NcclBackend::all_reduce_path_of`] for
    /// bf16.
    pub fn all_reduce_path(&self, bytes: usize) -> AllReducePath {
        self.all_reduce_path_of(nccl_safe::DataType::Bfloat16, bytes)
    }

    /// Which path an eager `all_reduce` of `dtype` takes now for `bytes` in
    /// ordinary device memory. Buffers in registered or symmetric memory
    /// always take NCCL's all-reduce, and so do types other than bf16, f16
    /// and f32 (the one-shot path's) and, on the fast path, other than
    /// bf16; work captured into a CUDA graph takes the one-shot path or
    /// NCCL's.
    pub fn all_reduce_path_of(&self, dtype: nccl_safe::DataType, bytes: usize) -> AllReducePath {
        let slot = self.inner.slot.lock();
        self.inner.choose_path(&slot, None, bytes, dtype, false)
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
        let config = config.with_env_overrides()?;
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
            watched: Mutex::new(WatchQueues::default()),
            generation: AtomicU64::new(0),
            in_call_seq: AtomicU64::new(0),
            in_call_since_us: AtomicU64::new(0),
            born: std::time::Instant::now(),
            born_unix_us: crate::diagnostics::now_unix_us(),
            one_shot_flags: Mutex::new(None),
            idle_pending: Mutex::new(None),
        }))
    }
}

impl Slot {
    fn new(ctx: &Arc<Context>) -> Result<Slot> {
        let kernel = match Module::load_ptx(ctx, kernels::BF16_ADD_PTX)
            .and_then(|m| m.function(kernels::BF16_ADD_NAME))
        {
            Ok(f) => Some(AddKernel::new(f)),
            Err(e) => {
                tracing::warn!("bundled bf16 add kernel unavailable, fast path off: {e}");
                None
            }
        };
        Ok(Slot {
            comm: None,
            stream: Stream::new(ctx).map_err(setup("stream"))?,
            scratch: None,
            scratch_free: Event::new(ctx, false).map_err(setup("event"))?,
            scratch_stream: None,
            barrier_elem: DeviceBuffer::from_host(ctx, &[1.0f32])
                .map_err(setup("barrier buffer"))?,
            kernel,
            registered: HashMap::new(),
            symmetric: HashMap::new(),
            group: None,
            one_shot: one_shot::OneShot::new(ctx).map_err(setup("one-shot state"))?,
            hosts: None,
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
