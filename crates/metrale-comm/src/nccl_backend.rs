//! `NcclBackend`: the [`CommBackend`] over one NCCL communicator per rank.
//!
//! Invariants (NCCL's threading rules and the seed's defects made into rules):
//! - The communicator and everything used with it (streams, events, scratch,
//!   kernel, registrations) live in one `Slot` behind one lock, and every NCCL
//!   call is made while holding it: a reconnect on another thread cannot
//!   destroy the communicator under a call.
//! - The only operation on the communicator without that lock is abort,
//!   through nccl-safe's `AbortHandle`, which NCCL allows from another thread
//!   and which never touches a destroyed communicator.
//! - Every submission is health-checked, recorded in the flight recorder, and
//!   (unless captured into a CUDA graph) watched: a completion event goes to
//!   the watchdog, which poisons and aborts on a deadline miss or an
//!   asynchronous NCCL error.
//! - With `EnqueueMode::Blocking` (the default) the communicator is a
//!   blocking one (joined after the non-blocking init,
//!   `Comm::into_blocking`), and each NCCL call is itself watched: a call
//!   still inside NCCL at the collective timeout is poisoned by the
//!   watchdog, whose abort makes NCCL return.
//! - Once poisoned, every call is refused before NCCL is called, with the
//!   first failure; `attempt_reconnect` is the way back.
//! - Host waits poll with a deadline; only `recv_command_u32` idles without
//!   one, and it returns as soon as the backend fails or shuts down.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use half::bf16;
use nccl_safe::{
    AbortHandle, Comm, Context, DataType, DeviceBuffer, Event, Function, Module, NcclCode,
    ReduceOp, Stream, SymmetricBuffer, UniqueId,
};
use parking_lot::Mutex;

use crate::backend::{CommBackend, Result};
use crate::config::{BackendConfig, EnqueueMode};
use crate::diagnostics::{DumpHeader, FlightRecorder, OpState};
use crate::error::{CommError, Failure, FailureKind};
use crate::health::Health;
use crate::kernels;
use crate::rendezvous::{FixedIdRendezvous, Launch, Rendezvous, TcpRendezvous};
use crate::validate::{
    check_alloc, check_buffer, check_function, check_rank, check_register, per_world,
};

/// Which algorithm an all-reduce takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AllReducePath {
    /// NCCL's all-reduce.
    Nccl,
    /// Grouped send/recv into the scratch buffer, then the bf16 add kernel.
    FastPath,
}

/// The add kernel of the fast path.
enum AddKernel {
    /// The kernel shipped with the crate, loaded from its PTX.
    Bundled(Function),
    /// A `CUfunction` the engine supplied through `set_add_kernel`.
    External(u64),
    /// No kernel: the fast path is off.
    None,
}

impl AddKernel {
    fn raw(&self) -> Option<cuda_sys::CUfunction> {
        match self {
            AddKernel::Bundled(f) => Some(f.raw()),
            AddKernel::External(f) => Some(*f as cuda_sys::CUfunction),
            AddKernel::None => None,
        }
    }
}

/// The communicator and what is used with it; guarded by `Inner::slot`.
struct Slot {
    comm: Option<Comm>,
    /// The backend's own stream (the seed's "legacy" stream).
    stream: Stream,
    /// The stream of `all_reduce_async`.
    comm_stream: Stream,
    compute_done: Event,
    comm_done: Event,
    scratch: Option<DeviceBuffer<bf16>>,
    /// One f32 for the barrier.
    barrier_elem: DeviceBuffer<f32>,
    kernel: AddKernel,
    registered: HashMap<u64, (u64, usize)>,
    symmetric: HashMap<u64, SymmetricBuffer>,
    /// Compute streams to re-join at `group_end` (async all-reduces issued in
    /// a group).
    group_joins: Vec<u64>,
    /// Submissions inside a group, watched from `group_end`.
    group_watch: Vec<(u64, &'static str, u64)>,
}

/// A submission the watchdog waits for.
struct Watched {
    seq: u64,
    op: &'static str,
    generation: u64,
    event: Arc<Event>,
    deadline: Option<Instant>,
}

struct Inner {
    rank: usize,
    world_size: usize,
    config: BackendConfig,
    ctx: Arc<Context>,
    rendezvous: Box<dyn Rendezvous>,
    slot: Mutex<Slot>,
    /// Kept outside `slot` so that the watchdog can abort while another
    /// thread holds `slot` inside an NCCL call.
    abort: Mutex<Option<AbortHandle>>,
    health: Health,
    recorder: FlightRecorder,
    watched: Mutex<Vec<Watched>>,
    event_pool: Mutex<Vec<Arc<Event>>>,
    generation: AtomicU64,
    group_depth: AtomicUsize,
    /// The submission now inside an NCCL call on a blocking communicator
    /// (op, sequence number, since when), for the watchdog: such a call has
    /// no deadline of its own.
    in_call: Mutex<Option<(&'static str, u64, Instant)>>,
}

/// The NCCL implementation of [`CommBackend`]. See the module docs for its
/// invariants and `docs/operations.md` for its configuration.
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
            .field("healthy", &self.is_healthy())
            .finish()
    }
}

fn setup(stage: &'static str) -> impl FnOnce(nccl_safe::Error) -> CommError {
    move |e| CommError::Setup {
        stage,
        message: e.to_string(),
    }
}

/// Errors NCCL or the driver return for the call's own arguments, before
/// anything is enqueued: they do not poison.
fn is_refusal(e: &nccl_safe::Error) -> bool {
    match e {
        nccl_safe::Error::InvalidArgument { .. } | nccl_safe::Error::Load(_) => true,
        nccl_safe::Error::Nccl(n) => {
            matches!(n.code, NcclCode::InvalidArgument | NcclCode::InvalidUsage)
        }
        nccl_safe::Error::Cuda(c) => {
            c.code == cuda_sys::CUresult::CUDA_ERROR_INVALID_VALUE.0 as i32
        }
        _ => false,
    }
}

/// Waits a little longer each time: spins briefly (small collectives finish
/// in microseconds), then sleeps up to 1 ms, as the seed's broadcast did.
struct Backoff(u32);

impl Backoff {
    fn pause(&mut self) {
        self.0 += 1;
        if self.0 < 64 {
            std::thread::yield_now();
        } else {
            let us = (self.0 as u64 - 63).min(1000);
            std::thread::sleep(Duration::from_micros(us));
        }
    }
}

impl NcclBackend {
    /// Builds a backend for the rank the rendezvous names, agreeing on the
    /// communicator through it. Init is bounded by `config.init_timeout`.
    pub fn new(config: BackendConfig, rendezvous: Box<dyn Rendezvous>) -> Result<NcclBackend> {
        let rank = rendezvous.rank();
        let world_size = rendezvous.world_size();
        if world_size == 0 || rank >= world_size {
            return Err(CommError::Config(format!(
                "rank {rank} is out of range for world size {world_size}"
            )));
        }
        let count = nccl_safe::device_count().map_err(setup("CUDA driver"))?;
        if config.device >= count {
            return Err(CommError::Config(format!(
                "device {} does not exist ({count} GPUs visible)",
                config.device
            )));
        }
        let ctx = Context::new(config.device).map_err(setup("CUDA context"))?;
        let slot = Slot::new(&ctx)?;
        let inner = Arc::new(Inner {
            rank,
            world_size,
            recorder: FlightRecorder::new(config.flight_recorder_capacity),
            config,
            ctx,
            rendezvous,
            slot: Mutex::new(slot),
            abort: Mutex::new(None),
            health: Health::new(),
            watched: Mutex::new(Vec::new()),
            event_pool: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
            group_depth: AtomicUsize::new(0),
            in_call: Mutex::new(None),
        });
        {
            let mut slot = inner.slot.lock();
            inner
                .ensure_scratch(&mut slot)
                .map_err(setup("fast-path scratch buffer"))?;
            inner.connect(&mut slot, 0)?;
        }
        let weak = Arc::downgrade(&inner);
        let watchdog = std::thread::Builder::new()
            .name(format!("metrale-watchdog-r{rank}"))
            .spawn(move || watchdog_loop(weak))
            .map_err(|e| CommError::Setup {
                stage: "watchdog thread",
                message: e.to_string(),
            })?;
        tracing::info!(
            rank,
            world_size,
            device = inner.config.device,
            "NCCL backend ready"
        );
        Ok(NcclBackend {
            inner,
            watchdog: Mutex::new(Some(watchdog)),
        })
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
    /// `reduce_scatter`, `broadcast` and `barrier` run. It lives as long as
    /// the backend (reconnects keep it).
    pub fn stream(&self) -> u64 {
        self.inner.slot.lock().stream.raw() as u64
    }

    /// The flight recorder of recent submissions.
    pub fn recorder(&self) -> &FlightRecorder {
        &self.inner.recorder
    }

    /// The communicator generation: 0, then one more per reconnect.
    pub fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::Acquire)
    }

    /// The failure that poisoned the backend, if any.
    pub fn failure(&self) -> Option<Arc<Failure>> {
        self.inner.health.failure()
    }

    /// The configuration the backend runs with.
    pub fn config(&self) -> &BackendConfig {
        &self.inner.config
    }

    /// Which path `all_reduce` takes now for `bytes` in ordinary device
    /// memory (buffers in registered or symmetric memory always take NCCL's
    /// all-reduce).
    pub fn all_reduce_path(&self, bytes: usize) -> AllReducePath {
        let slot = self.inner.slot.lock();
        self.inner.choose_path(&slot, None, bytes)
    }
}

impl Slot {
    fn new(ctx: &Arc<Context>) -> Result<Slot> {
        let kernel = match Module::load_ptx(ctx, kernels::BF16_ADD_PTX)
            .and_then(|m| m.function(kernels::BF16_ADD_NAME))
        {
            Ok(f) => AddKernel::Bundled(f),
            Err(e) => {
                tracing::warn!("bundled bf16 add kernel unavailable, fast path off: {e}");
                AddKernel::None
            }
        };
        Ok(Slot {
            comm: None,
            stream: Stream::new(ctx).map_err(setup("stream"))?,
            comm_stream: Stream::new(ctx).map_err(setup("stream"))?,
            compute_done: Event::new(ctx, false).map_err(setup("event"))?,
            comm_done: Event::new(ctx, false).map_err(setup("event"))?,
            scratch: None,
            barrier_elem: DeviceBuffer::from_host(ctx, &[1.0f32])
                .map_err(setup("barrier buffer"))?,
            kernel,
            registered: HashMap::new(),
            symmetric: HashMap::new(),
            group_joins: Vec::new(),
            group_watch: Vec::new(),
        })
    }
}

impl Slot {
    /// The communicator, or `Aborted` for `call` when there is none (after
    /// shutdown, or a failed reconnect).
    fn comm(&self, call: &'static str) -> nccl_safe::Result<&Comm> {
        self.comm.as_ref().ok_or(nccl_safe::Error::Aborted { call })
    }

    /// Whether `[ptr, ptr + bytes)` overlaps a registered buffer or a
    /// symmetric allocation. Such buffers take NCCL's all-reduce, which is
    /// what registration is for: on 2 H200s the fast path's grouped
    /// send/recv from a registered `ncclMemAlloc` buffer did not complete.
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

impl Inner {
    /// Agrees on a unique id for `generation` and initialises the
    /// communicator into `slot`, bounded by the init timeout.
    fn connect(&self, slot: &mut Slot, generation: u64) -> Result<()> {
        let timeout = self.config.init_timeout;
        let mut make = || {
            UniqueId::new()
                .map(|id| *id.as_bytes())
                .map_err(|e| e.to_string())
        };
        let bytes = self
            .rendezvous
            .exchange_id(generation, &mut make, timeout)?;
        let id = UniqueId::from_bytes(&bytes).map_err(setup("unique id"))?;
        let mut comm =
            Comm::init_rank_with_deadline(&self.ctx, &id, self.world_size, self.rank, timeout)
                .map_err(|e| CommError::Setup {
                    stage: "communicator init",
                    message: format!(
                        "rank {} of {} (generation {generation}): {e}",
                        self.rank, self.world_size
                    ),
                })?;
        if self.config.enqueue == EnqueueMode::Blocking {
            comm = comm.into_blocking(timeout).map_err(|e| CommError::Setup {
                stage: "blocking communicator",
                message: format!(
                    "rank {} of {} (generation {generation}): {e}",
                    self.rank, self.world_size
                ),
            })?;
        }
        // A call waits for NCCL's background enqueue at most as long as the
        // operation itself may take.
        comm.set_enqueue_deadline(Some(self.config.collective_timeout));
        *self.abort.lock() = Some(comm.abort_handle());
        slot.comm = Some(comm);
        self.generation.store(generation, Ordering::Release);
        Ok(())
    }

    /// Refuses work when shut down, reconnecting or poisoned.
    #[inline]
    fn check_usable(&self, op: &'static str) -> Result<()> {
        self.health.check(op, self.rank, self.world_size)
    }

    fn in_group(&self) -> bool {
        self.group_depth.load(Ordering::Acquire) > 0
    }

    fn refuse_in_group(&self, op: &'static str) -> Result<()> {
        if self.in_group() {
            return Err(CommError::InGroup { op });
        }
        Ok(())
    }

    /// The all-reduce path for `bytes` at `ptr` (`None`: an address outside
    /// registered and symmetric memory).
    fn choose_path(&self, slot: &Slot, ptr: Option<u64>, bytes: usize) -> AllReducePath {
        if self.world_size == 2
            && !self.in_group()
            && slot.kernel.raw().is_some()
            && self.config.fast_path.takes_fast_path(bytes)
            && !ptr.is_some_and(|p| slot.in_registered_memory(p, bytes))
        {
            AllReducePath::FastPath
        } else {
            AllReducePath::Nccl
        }
    }

    /// Poisons the backend with its first failure (later calls return the
    /// first), aborts the communicator, dumps the flight recorder.
    fn poison(&self, op: &'static str, seq: u64, kind: FailureKind) -> Arc<Failure> {
        let state = match kind {
            FailureKind::Timeout { .. } => OpState::TimedOut,
            _ => OpState::Failed,
        };
        let (failure, first) = self.health.poison(|| Failure {
            op,
            seq,
            rank: self.rank,
            world_size: self.world_size,
            generation: self.generation.load(Ordering::Acquire),
            kind,
        });
        if !first {
            return failure;
        }
        self.recorder.set_state(seq, state);
        if let Some(handle) = self.abort.lock().as_ref()
            && let Err(e) = handle.abort()
        {
            tracing::warn!(
                rank = self.rank,
                "aborting the poisoned communicator failed: {e}"
            );
        }
        tracing::error!(
            rank = self.rank,
            world_size = self.world_size,
            "communicator poisoned: {failure}\nrecent operations:\n{}",
            self.recorder.summary(16)
        );
        if let Some(dir) = &self.config.dump_dir {
            let header = DumpHeader {
                rank: self.rank,
                world_size: self.world_size,
                generation: failure.generation,
                reason: failure.to_string(),
                first_failed_seq: Some(seq),
            };
            match self.recorder.dump_json(dir, &header) {
                Ok(path) => tracing::error!(
                    rank = self.rank,
                    "flight recorder dumped to {}",
                    path.display()
                ),
                Err(e) => tracing::warn!(rank = self.rank, "flight recorder dump failed: {e}"),
            }
        }
        failure
    }

    fn take_event(&self) -> Result<Arc<Event>> {
        if let Some(ev) = self.event_pool.lock().pop() {
            return Ok(ev);
        }
        Event::new(&self.ctx, false)
            .map(Arc::new)
            .map_err(|source| CommError::Refused {
                op: "event",
                source,
            })
    }

    /// Records a completion event for `seq` on `stream` and hands it to the
    /// watchdog. `deadline: None` is an idle wait (no timeout).
    fn watch(
        &self,
        seq: u64,
        op: &'static str,
        stream: u64,
        deadline: Option<Instant>,
    ) -> Result<Arc<Event>> {
        let event = self.take_event()?;
        // SAFETY: `stream` is the backend's own stream or one the caller
        // vouched for (the unsafe contracts of the trait), of this context.
        if let Err(e) = unsafe { event.record_raw(stream as cuda_sys::CUstream) } {
            return Err(CommError::Failed(self.poison(
                op,
                seq,
                FailureKind::from_call(e),
            )));
        }
        self.watched.lock().push(Watched {
            seq,
            op,
            generation: self.generation.load(Ordering::Acquire),
            event: event.clone(),
            deadline,
        });
        Ok(event)
    }

    /// Submits one operation: health check, flight-recorder entry, the
    /// enqueue under the slot lock, then the watch. Returns the sequence
    /// number and, unless the work was captured or grouped, its completion
    /// event.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        op: &'static str,
        dtype: DataType,
        bytes: usize,
        stream: StreamSel,
        peer: Option<usize>,
        idle: bool,
        enqueue: impl FnOnce(&mut Slot, u64) -> nccl_safe::Result<()>,
    ) -> Result<(u64, Option<Arc<Event>>)> {
        self.check_usable(op)?;
        let mut slot = self.slot.lock();
        // Re-check under the lock: a reconnect or shutdown may have finished
        // while this thread waited for it.
        self.check_usable(op)?;
        if slot.comm.is_none() {
            return Err(CommError::Shutdown { op });
        }
        let raw_stream = match stream {
            StreamSel::Own => slot.stream.raw() as u64,
            StreamSel::Comm => slot.comm_stream.raw() as u64,
            StreamSel::Caller(s) => s,
        };
        let capturing = match stream {
            StreamSel::Caller(s) => self.is_capturing(s, op)?,
            _ => false,
        };
        let seq = self
            .recorder
            .record(op, dtype.name(), bytes, raw_stream, peer);
        let enqueued = self.in_nccl(op, seq, || enqueue(&mut slot, raw_stream));
        if let Err(e) = enqueued {
            if is_refusal(&e) {
                self.recorder.set_state(seq, OpState::Failed);
                return Err(CommError::Refused { op, source: e });
            }
            if self.health.is_shutdown() {
                // Shutdown aborted the communicator under this call.
                self.recorder.set_state(seq, OpState::Failed);
                return Err(CommError::Shutdown { op });
            }
            drop(slot);
            return Err(CommError::Failed(self.poison(
                op,
                seq,
                FailureKind::from_call(e),
            )));
        }
        // Under capture nothing is queried: the capturing thread may not
        // make calls that touch other streams' state.
        if !capturing
            && let Some(comm) = slot.comm.as_ref()
            && let Err(e) = comm.async_error()
        {
            drop(slot);
            return Err(CommError::Failed(self.poison(
                op,
                seq,
                FailureKind::AsyncError(e),
            )));
        }
        if capturing {
            // Captured work runs at graph launch; it is not watched.
            self.recorder.set_state(seq, OpState::Completed);
            return Ok((seq, None));
        }
        if self.in_group() {
            slot.group_watch.push((seq, op, raw_stream));
            return Ok((seq, None));
        }
        drop(slot);
        let deadline = (!idle).then(|| Instant::now() + self.config.collective_timeout);
        let event = self.watch(seq, op, raw_stream, deadline)?;
        Ok((seq, Some(event)))
    }

    /// Runs `f`, which calls NCCL for submission `seq`; on a blocking
    /// communicator the watchdog sees the call while it runs.
    fn in_nccl<T>(&self, op: &'static str, seq: u64, f: impl FnOnce() -> T) -> T {
        if self.config.enqueue != EnqueueMode::Blocking {
            return f();
        }
        *self.in_call.lock() = Some((op, seq, Instant::now()));
        let out = f();
        *self.in_call.lock() = None;
        out
    }

    fn is_capturing(&self, stream: u64, op: &'static str) -> Result<bool> {
        // SAFETY: the caller vouches that `stream` is a live stream of this
        // context (the trait's contract); the borrowed wrapper does not
        // destroy it.
        let s = unsafe { Stream::borrowed(&self.ctx, stream as cuda_sys::CUstream) };
        s.is_capturing()
            .map_err(|source| CommError::Refused { op, source })
    }

    /// Waits for `event` (the completion of `seq`), bounded by the
    /// collective timeout unless `idle`. Returns early with an error when the
    /// backend is poisoned or shut down.
    fn wait(&self, op: &'static str, seq: u64, event: &Event, idle: bool) -> Result<()> {
        let deadline = Instant::now() + self.config.collective_timeout;
        let mut backoff = Backoff(0);
        loop {
            if self.health.is_poisoned() {
                return Err(self.own_or_poisoned(op, seq));
            }
            match event.query() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    return Err(CommError::Failed(self.poison(
                        op,
                        seq,
                        FailureKind::from_call(e),
                    )));
                }
            }
            if self.health.is_shutdown() {
                return Err(CommError::Shutdown { op });
            }
            if !idle && Instant::now() >= deadline {
                let (op, seq) = self.oldest_pending().unwrap_or((op, seq));
                let f = self.poison(
                    op,
                    seq,
                    FailureKind::Timeout {
                        after: self.config.collective_timeout,
                    },
                );
                return Err(CommError::Failed(f));
            }
            backoff.pause();
        }
    }

    /// `Failed` when `seq` itself is the first failure, else `Poisoned`.
    fn own_or_poisoned(&self, op: &'static str, seq: u64) -> CommError {
        match self.health.failure() {
            Some(f) if f.seq == seq => CommError::Failed(f),
            Some(cause) => CommError::Poisoned {
                op,
                rank: self.rank,
                world_size: self.world_size,
                cause,
            },
            None => CommError::Reconnecting { op },
        }
    }

    fn oldest_pending(&self) -> Option<(&'static str, u64)> {
        let generation = self.generation.load(Ordering::Acquire);
        self.watched
            .lock()
            .iter()
            .filter(|w| w.generation == generation && w.deadline.is_some())
            .min_by_key(|w| w.seq)
            .map(|w| (w.op, w.seq))
    }

    /// One pass of the watchdog: completes finished submissions, poisons on
    /// a missed deadline or an asynchronous error.
    fn watchdog_tick(&self) {
        let now = Instant::now();
        let generation = self.generation.load(Ordering::Acquire);
        let mut expired: Option<(&'static str, u64)> = None;
        let mut failed: Option<(&'static str, u64, nccl_safe::Error)> = None;
        let mut done = Vec::new();
        {
            let mut watched = self.watched.lock();
            watched.retain(|w| {
                if w.generation != generation {
                    return false;
                }
                match w.event.query() {
                    Ok(true) => {
                        self.recorder.set_state(w.seq, OpState::Completed);
                        done.push(w.event.clone());
                        false
                    }
                    Ok(false) => {
                        if w.deadline.is_some_and(|d| now >= d)
                            && expired.is_none_or(|(_, s)| w.seq < s)
                        {
                            expired = Some((w.op, w.seq));
                        }
                        true
                    }
                    Err(e) => {
                        if failed.is_none() {
                            failed = Some((w.op, w.seq, e));
                        }
                        true
                    }
                }
            });
        }
        {
            let mut pool = self.event_pool.lock();
            for ev in done {
                if Arc::strong_count(&ev) == 1 && pool.len() < 64 {
                    pool.push(ev);
                }
            }
        }
        if self.health.is_poisoned() {
            return;
        }
        // A call stuck inside NCCL on a blocking communicator counts as
        // timed out too: poisoning aborts the communicator, which makes NCCL
        // return from it.
        let stuck = *self.in_call.lock();
        let stuck = stuck
            .filter(|&(_, _, since)| {
                now.saturating_duration_since(since) >= self.config.collective_timeout
            })
            .map(|(op, seq, _)| (op, seq));
        if let Some((op, seq)) = stuck.or(expired) {
            self.poison(
                op,
                seq,
                FailureKind::Timeout {
                    after: self.config.collective_timeout,
                },
            );
            return;
        }
        if let Some((op, seq, e)) = failed {
            self.poison(op, seq, FailureKind::from_call(e));
            return;
        }
        // The asynchronous error needs the communicator: skip this round if
        // another thread holds it.
        let async_err = match self.slot.try_lock_for(Duration::from_millis(1)) {
            Some(slot) => match slot.comm.as_ref() {
                Some(comm) if !comm.is_aborted() => comm.async_error().err(),
                _ => None,
            },
            None => None,
        };
        if let Some(e) = async_err {
            let (op, seq) = self
                .oldest_pending()
                .unwrap_or(("async error", self.recorder.last_seq()));
            self.poison(op, seq, FailureKind::AsyncError(e));
        }
    }

    /// Allocates the fast path's scratch buffer once, at its final size:
    /// the configured scratch capacity, capped by the largest payload the
    /// policy sends down the fast path. Called at construction and from
    /// `set_add_kernel`, so the fast path never allocates while the caller's
    /// stream is being captured, and a buffer is never freed under work
    /// still in flight.
    fn ensure_scratch(&self, slot: &mut Slot) -> nccl_safe::Result<()> {
        if slot.scratch.is_some() || self.world_size != 2 || slot.kernel.raw().is_none() {
            return Ok(());
        }
        let Some(max) = self.config.fast_path.max_fast_bytes() else {
            return Ok(());
        };
        let elems = (self.config.scratch_bytes.min(max) / 2).max(1);
        slot.scratch = Some(DeviceBuffer::alloc(&self.ctx, elems)?);
        Ok(())
    }

    /// Enqueues the 2-rank fast path on `stream`: for each chunk that fits
    /// the scratch buffer, a grouped send/recv with the peer, then the add.
    fn fast_path(
        &self,
        slot: &mut Slot,
        ptr: u64,
        bytes: usize,
        stream: u64,
    ) -> nccl_safe::Result<()> {
        let n = bytes / 2;
        self.ensure_scratch(slot)?;
        let (scratch, chunk_elems) = slot
            .scratch
            .as_ref()
            .map(|s| (s.device_ptr(), s.len()))
            .ok_or_else(|| nccl_safe::Error::invalid("fast path", "no scratch buffer"))?;
        let kernel = slot
            .kernel
            .raw()
            .ok_or_else(|| nccl_safe::Error::invalid("fast path", "no add kernel"))?;
        let comm = slot.comm("fast path")?;
        let peer = 1 - self.rank;
        let cu_stream = stream as cuda_sys::CUstream;
        let mut off = 0usize;
        while off < n {
            let len = chunk_elems.min(n - off);
            let chunk = ptr + (off * 2) as u64;
            nccl_safe::group(|| {
                // SAFETY: `chunk` lies inside the caller's buffer (trait
                // contract) and `scratch` holds at least `len` elements; both
                // are device memory of this context; the stream is ours or
                // the caller's live stream.
                unsafe {
                    comm.send_raw(chunk, len, DataType::Bfloat16, peer, cu_stream)?;
                    comm.recv_raw(scratch, len, DataType::Bfloat16, peer, cu_stream)
                }
            })?;
            // On a non-blocking communicator the group may still be being
            // enqueued: the add must come after the receive on the stream.
            comm.wait_ready()?;
            // SAFETY: the kernel has the documented add signature (bundled, or
            // the engine's under set_add_kernel's contract) and both ranges
            // hold `len` bf16 elements.
            unsafe { launch_add(&self.ctx, kernel, chunk, scratch, len as u64, cu_stream)? };
            off += len;
        }
        Ok(())
    }

    /// Enqueues an all-reduce (either path) of bf16 in place on `stream`.
    fn all_reduce_on(
        &self,
        slot: &mut Slot,
        ptr: u64,
        bytes: usize,
        stream: u64,
    ) -> nccl_safe::Result<()> {
        match self.choose_path(slot, Some(ptr), bytes) {
            AllReducePath::FastPath => self.fast_path(slot, ptr, bytes, stream),
            AllReducePath::Nccl => {
                let comm = slot.comm("all_reduce")?;
                // SAFETY: `ptr` is valid for `bytes` (trait contract) on this
                // context; the stream is live.
                unsafe {
                    comm.all_reduce_raw(
                        ptr,
                        ptr,
                        bytes / 2,
                        DataType::Bfloat16,
                        ReduceOp::Sum,
                        stream as cuda_sys::CUstream,
                    )
                }
            }
        }
    }
}

/// Launches the bf16 add kernel: `dst[i] += src[i]` for `i < n`.
///
/// # Safety
/// `kernel` takes `(bf16* dst, const bf16* src, u64 n)`; `dst` and `src` are
/// device memory of `ctx` valid for `n` elements; `stream` is a live stream of
/// `ctx`.
unsafe fn launch_add(
    ctx: &Context,
    kernel: cuda_sys::CUfunction,
    dst: u64,
    src: u64,
    n: u64,
    stream: cuda_sys::CUstream,
) -> nccl_safe::Result<()> {
    let (grid, block) = kernels::launch_config(n);
    let (mut dst, mut src, mut n) = (dst, src, n);
    let mut params = [
        (&mut dst as *mut u64).cast::<c_void>(),
        (&mut src as *mut u64).cast::<c_void>(),
        (&mut n as *mut u64).cast::<c_void>(),
    ];
    // SAFETY: the parameters match the kernel's signature and live through
    // the call, which copies them; the rest is this function's contract.
    unsafe { nccl_safe::launch_raw(ctx, kernel, grid, block, 0, stream, &mut params) }
}

/// Which stream a submission runs on.
#[derive(Clone, Copy)]
enum StreamSel {
    Own,
    Comm,
    Caller(u64),
}

fn watchdog_loop(inner: Weak<Inner>) {
    loop {
        let Some(inner) = inner.upgrade() else { return };
        if inner.health.is_shutdown() {
            return;
        }
        let interval = inner.config.watchdog_interval;
        inner.watchdog_tick();
        drop(inner);
        std::thread::sleep(interval);
    }
}

impl CommBackend for NcclBackend {
    unsafe fn all_reduce(&self, ptr: u64, bytes: usize) -> Result<()> {
        const OP: &str = "all_reduce";
        check_buffer(OP, "buffer", ptr, bytes, 2)?;
        if bytes == 0 {
            return self.inner.check_usable(OP);
        }
        let inner = &*self.inner;
        inner.submit(
            OP,
            DataType::Bfloat16,
            bytes,
            StreamSel::Own,
            None,
            false,
            |slot, s| inner.all_reduce_on(slot, ptr, bytes, s),
        )?;
        Ok(())
    }

    unsafe fn all_reduce_async(&self, ptr: u64, bytes: usize, compute_stream: u64) -> Result<()> {
        const OP: &str = "all_reduce_async";
        check_buffer(OP, "buffer", ptr, bytes, 2)?;
        if bytes == 0 {
            return self.inner.check_usable(OP);
        }
        let inner = &*self.inner;
        let capturing = {
            inner.check_usable(OP)?;
            inner.is_capturing(compute_stream, OP)?
        };
        if capturing {
            // Under capture: everything on the capturing stream, nothing
            // waits on the host, no event is queried.
            inner.submit(
                OP,
                DataType::Bfloat16,
                bytes,
                StreamSel::Caller(compute_stream),
                None,
                false,
                |slot, s| inner.all_reduce_on(slot, ptr, bytes, s),
            )?;
            return Ok(());
        }
        let in_group = inner.in_group();
        inner.submit(
            OP,
            DataType::Bfloat16,
            bytes,
            StreamSel::Comm,
            None,
            false,
            |slot, s| {
                let compute = compute_stream as cuda_sys::CUstream;
                // SAFETY: `compute_stream` is a live stream of this context (trait
                // contract); the comm stream is ours.
                unsafe {
                    slot.compute_done.record_raw(compute)?;
                    slot.compute_done.wait_raw(s as cuda_sys::CUstream)?;
                }
                inner.all_reduce_on(slot, ptr, bytes, s)?;
                if in_group {
                    // The group's work is launched at group_end: join there.
                    slot.group_joins.push(compute_stream);
                    return Ok(());
                }
                // SAFETY: as above.
                unsafe {
                    slot.comm_done.record_raw(s as cuda_sys::CUstream)?;
                    slot.comm_done.wait_raw(compute)
                }
            },
        )?;
        Ok(())
    }

    unsafe fn register_buffer(&self, ptr: u64, bytes: usize) -> Result<u64> {
        const OP: &str = "register_buffer";
        check_register(OP, ptr, bytes)?;
        self.inner.check_usable(OP)?;
        let mut slot = self.inner.slot.lock();
        let comm = slot.comm.as_ref().ok_or(CommError::Shutdown { op: OP })?;
        // SAFETY: `ptr` is a device allocation valid for `bytes` until
        // deregistered (trait contract).
        let handle = unsafe { comm.register_raw(ptr, bytes) }
            .map_err(|source| CommError::Refused { op: OP, source })?;
        let handle = handle as u64;
        slot.registered.insert(handle, (ptr, bytes));
        Ok(handle)
    }

    fn deregister_buffer(&self, handle: u64) -> Result<()> {
        const OP: &str = "deregister_buffer";
        self.inner.check_usable(OP)?;
        let mut slot = self.inner.slot.lock();
        if slot.registered.remove(&handle).is_none() {
            return Err(CommError::UnknownHandle { op: OP, handle });
        }
        let comm = slot.comm.as_ref().ok_or(CommError::Shutdown { op: OP })?;
        // SAFETY: `handle` came from `register_raw` on this communicator and
        // was just removed from the map, so it is deregistered once.
        unsafe { comm.deregister_raw(handle as *mut c_void) }
            .map_err(|source| CommError::Refused { op: OP, source })
    }

    fn symmetric_alloc(&self, bytes: usize) -> Result<u64> {
        const OP: &str = "symmetric_alloc";
        check_alloc(OP, bytes)?;
        self.inner.check_usable(OP)?;
        let buf = SymmetricBuffer::alloc(&self.inner.ctx, bytes)
            .map_err(|source| CommError::Refused { op: OP, source })?;
        let ptr = buf.device_ptr();
        self.inner.slot.lock().symmetric.insert(ptr, buf);
        Ok(ptr)
    }

    fn symmetric_free(&self, ptr: u64) -> Result<()> {
        // Freeing memory does not touch the communicator: allowed when
        // poisoned, so an engine can always release what it holds.
        const OP: &str = "symmetric_free";
        if self.inner.health.is_shutdown() {
            return Err(CommError::Shutdown { op: OP });
        }
        let buf = self.inner.slot.lock().symmetric.remove(&ptr);
        match buf {
            Some(buf) => {
                drop(buf);
                Ok(())
            }
            None => Err(CommError::UnknownHandle {
                op: OP,
                handle: ptr,
            }),
        }
    }

    unsafe fn set_add_kernel(&self, function: u64) -> Result<()> {
        const OP: &str = "set_add_kernel";
        check_function(OP, function)?;
        self.inner.check_usable(OP)?;
        let mut slot = self.inner.slot.lock();
        slot.kernel = AddKernel::External(function);
        self.inner
            .ensure_scratch(&mut slot)
            .map_err(|source| CommError::Refused { op: OP, source })?;
        drop(slot);
        tracing::info!(
            rank = self.inner.rank,
            "engine-supplied bf16 add kernel set"
        );
        Ok(())
    }

    unsafe fn all_gather(&self, send_ptr: u64, recv_ptr: u64, bytes: usize) -> Result<()> {
        const OP: &str = "all_gather";
        check_buffer(OP, "send buffer", send_ptr, bytes, 1)?;
        let total = per_world(OP, bytes, self.inner.world_size)?;
        check_buffer(OP, "receive buffer", recv_ptr, total, 1)?;
        if bytes == 0 {
            return self.inner.check_usable(OP);
        }
        self.inner.submit(
            OP,
            DataType::Uint8,
            bytes,
            StreamSel::Own,
            None,
            false,
            |slot, s| {
                let comm = slot.comm(OP)?;
                // SAFETY: buffer sizes per the trait contract; stream is ours.
                unsafe {
                    comm.all_gather_raw(
                        send_ptr,
                        recv_ptr,
                        bytes,
                        DataType::Uint8,
                        s as cuda_sys::CUstream,
                    )
                }
            },
        )?;
        Ok(())
    }

    unsafe fn reduce_scatter(
        &self,
        send_ptr: u64,
        recv_ptr: u64,
        recv_bytes: usize,
        dtype: DataType,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let elem = dtype.size();
        check_buffer(OP, "receive buffer", recv_ptr, recv_bytes, elem)?;
        let total = per_world(OP, recv_bytes, self.inner.world_size)?;
        check_buffer(OP, "send buffer", send_ptr, total, elem)?;
        if recv_bytes == 0 {
            return self.inner.check_usable(OP);
        }
        self.inner.submit(
            OP,
            dtype,
            recv_bytes,
            StreamSel::Own,
            None,
            false,
            |slot, s| {
                let comm = slot.comm(OP)?;
                // SAFETY: buffer sizes per the trait contract; stream is ours.
                unsafe {
                    comm.reduce_scatter_raw(
                        send_ptr,
                        recv_ptr,
                        recv_bytes / elem,
                        dtype,
                        ReduceOp::Sum,
                        s as cuda_sys::CUstream,
                    )
                }
            },
        )?;
        Ok(())
    }

    unsafe fn broadcast(&self, ptr: u64, bytes: usize, root: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.broadcast_wait("broadcast", ptr, bytes, root, false) }
    }

    unsafe fn recv_command_u32(&self, ptr: u64, root: usize) -> Result<()> {
        const OP: &str = "recv_command_u32";
        check_rank(OP, "root", root, self.inner.world_size)?;
        if root == self.inner.rank {
            return Err(CommError::InvalidArgument {
                op: OP,
                reason: format!("rank {root} is the root: only other ranks receive commands"),
            });
        }
        // SAFETY: forwarded contract (4 bytes at `ptr`).
        unsafe { self.broadcast_wait(OP, ptr, 4, root, true) }
    }

    fn barrier(&self) -> Result<()> {
        const OP: &str = "barrier";
        let inner = &*self.inner;
        inner.refuse_in_group(OP)?;
        let (seq, event) = inner.submit(
            OP,
            DataType::Float32,
            4,
            StreamSel::Own,
            None,
            false,
            |slot, s| {
                let comm = slot.comm(OP)?;
                let p = slot.barrier_elem.device_ptr();
                // SAFETY: one f32 of our own buffer; our stream.
                unsafe {
                    comm.all_reduce_raw(
                        p,
                        p,
                        1,
                        DataType::Float32,
                        ReduceOp::Max,
                        s as cuda_sys::CUstream,
                    )
                }
            },
        )?;
        match event {
            Some(ev) => inner.wait(OP, seq, &ev, false),
            None => Ok(()),
        }
    }

    unsafe fn send_to(&self, ptr: u64, bytes: usize, dest_rank: usize, stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.p2p("send_to", ptr, bytes, dest_rank, stream, true) }
    }

    unsafe fn recv_from(&self, ptr: u64, bytes: usize, src_rank: usize, stream: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.p2p("recv_from", ptr, bytes, src_rank, stream, false) }
    }

    fn group_start(&self) -> Result<()> {
        const OP: &str = "group_start";
        self.inner.check_usable(OP)?;
        let _slot = self.inner.slot.lock();
        nccl_group_call(OP, true)?;
        self.inner.group_depth.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    fn group_end(&self) -> Result<()> {
        const OP: &str = "group_end";
        let inner = &*self.inner;
        let mut slot = inner.slot.lock();
        let depth = inner.group_depth.load(Ordering::Acquire);
        if depth == 0 {
            return Err(CommError::InvalidArgument {
                op: OP,
                reason: "group_end without group_start".into(),
            });
        }
        inner.group_depth.store(depth - 1, Ordering::Release);
        // The outermost group end launches the group's work (and on a
        // blocking communicator may wait there for a peer's connection).
        let first = slot
            .group_watch
            .first()
            .map(|w| w.0)
            .unwrap_or_else(|| inner.recorder.last_seq());
        let ended = inner.in_nccl(OP, first, || nccl_group_call(OP, false));
        if depth > 1 {
            return ended;
        }
        let joins = std::mem::take(&mut slot.group_joins);
        let watch = std::mem::take(&mut slot.group_watch);
        if let Err(e) = ended {
            let seq = watch
                .first()
                .map(|w| w.0)
                .unwrap_or_else(|| inner.recorder.last_seq());
            drop(slot);
            if let CommError::Refused { source, .. } = e {
                return Err(CommError::Failed(inner.poison(
                    OP,
                    seq,
                    FailureKind::CallFailed(source),
                )));
            }
            return Err(e);
        }
        // The group's work may still be being enqueued (non-blocking
        // communicator): events recorded now would complete before it.
        let ready = match slot.comm.as_ref() {
            Some(comm) => comm.wait_ready(),
            None => Err(nccl_safe::Error::Aborted { call: OP }),
        };
        if let Err(e) = ready {
            drop(slot);
            let seq = watch
                .first()
                .map(|w| w.0)
                .unwrap_or_else(|| inner.recorder.last_seq());
            return Err(CommError::Failed(inner.poison(
                OP,
                seq,
                FailureKind::from_call(e),
            )));
        }
        let comm_stream = slot.comm_stream.raw();
        for compute in joins {
            // SAFETY: the compute streams came from all_reduce_async calls,
            // whose contract makes them live streams of this context.
            let joined = unsafe {
                slot.comm_done
                    .record_raw(comm_stream)
                    .and_then(|()| slot.comm_done.wait_raw(compute as cuda_sys::CUstream))
            };
            if let Err(e) = joined {
                drop(slot);
                let seq = inner.recorder.last_seq();
                return Err(CommError::Failed(inner.poison(
                    OP,
                    seq,
                    FailureKind::from_call(e),
                )));
            }
        }
        drop(slot);
        let deadline = Instant::now() + inner.config.collective_timeout;
        for (seq, op, stream) in watch {
            inner.watch(seq, op, stream, Some(deadline))?;
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        const OP: &str = "synchronize";
        let inner = &*self.inner;
        inner.refuse_in_group(OP)?;
        inner.check_usable(OP)?;
        let events = {
            let slot = inner.slot.lock();
            let mut events = Vec::with_capacity(2);
            for s in [&slot.stream, &slot.comm_stream] {
                let ev = inner.take_event()?;
                ev.record(s)
                    .map_err(|source| CommError::Refused { op: OP, source })?;
                events.push(ev);
            }
            events
        };
        let seq = inner.recorder.last_seq();
        for ev in &events {
            inner.wait(OP, seq, ev, false)?;
        }
        let mut pool = inner.event_pool.lock();
        for ev in events {
            if Arc::strong_count(&ev) == 1 && pool.len() < 64 {
                pool.push(ev);
            }
        }
        Ok(())
    }

    fn is_healthy(&self) -> bool {
        self.inner.health.is_healthy()
    }

    fn attempt_reconnect(&self) -> Result<()> {
        const OP: &str = "attempt_reconnect";
        let inner = &*self.inner;
        if inner.health.is_shutdown() {
            return Err(CommError::Shutdown { op: OP });
        }
        if !inner.health.begin_reconnect() {
            return Err(CommError::Reconnecting { op: OP });
        }
        struct EndReconnect<'a>(&'a Health);
        impl Drop for EndReconnect<'_> {
            fn drop(&mut self) {
                self.0.end_reconnect();
            }
        }
        let _end = EndReconnect(&inner.health);
        // Abort first, without the slot lock: a thread inside NCCL holding the
        // lock is released by the abort.
        if let Some(handle) = inner.abort.lock().take()
            && let Err(e) = handle.abort()
        {
            tracing::warn!(rank = inner.rank, "abort before reconnect failed: {e}");
        }
        let mut slot = inner.slot.lock();
        let old = slot.comm.take();
        drop(old);
        if !slot.registered.is_empty() {
            tracing::warn!(
                rank = inner.rank,
                count = slot.registered.len(),
                "registrations die with the old communicator; register again"
            );
            slot.registered.clear();
        }
        let next = inner.generation.load(Ordering::Acquire) + 1;
        // The streams, events, scratch and kernel stay: the abort ended the
        // old communicator's kernels, and an engine may hold `stream()`.
        slot.group_joins.clear();
        slot.group_watch.clear();
        inner.group_depth.store(0, Ordering::Release);
        inner.watched.lock().clear();
        inner.event_pool.lock().clear();
        if let Err(e) = inner.connect(&mut slot, next) {
            drop(slot);
            // No communicator is left: make every later call say why.
            let seq = inner.recorder.last_seq();
            inner.health.clear();
            inner.poison(OP, seq, FailureKind::Reconnect(e.to_string()));
            return Err(e);
        }
        inner.health.clear();
        tracing::info!(
            rank = inner.rank,
            generation = next,
            "communicator reconnected"
        );
        Ok(())
    }

    fn shutdown(&self) -> Result<()> {
        let inner = &*self.inner;
        if !inner.health.begin_shutdown() {
            return Ok(());
        }
        let deadline = Instant::now() + inner.config.shutdown_timeout;
        let mut result = Ok(());
        {
            // A thread idling in recv_command_u32 holds the slot: abort to
            // release it if it is not free within the shutdown timeout.
            let mut slot = match inner.slot.try_lock_for(inner.config.shutdown_timeout) {
                Some(slot) => slot,
                None => {
                    if let Some(handle) = inner.abort.lock().as_ref()
                        && let Err(e) = handle.abort()
                    {
                        tracing::warn!(rank = inner.rank, "shutdown: abort failed: {e}");
                    }
                    inner.slot.lock()
                }
            };
            let healthy = !inner.health.is_poisoned();
            let mut idle = healthy;
            if healthy {
                for s in [&slot.stream, &slot.comm_stream] {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if let Err(e) = s.wait_until_idle(left) {
                        tracing::warn!(rank = inner.rank, "shutdown: work did not drain: {e}");
                        result = Err(CommError::Refused {
                            op: "shutdown",
                            source: e,
                        });
                        idle = false;
                        break;
                    }
                }
            }
            if !idle {
                if let Some(handle) = inner.abort.lock().take()
                    && let Err(e) = handle.abort()
                {
                    tracing::warn!(rank = inner.rank, "shutdown: abort failed: {e}");
                }
            } else if let Some(comm) = slot.comm.take() {
                let registered = std::mem::take(&mut slot.registered);
                for handle in registered.into_keys() {
                    // SAFETY: each handle came from `register_raw` on this
                    // communicator and is deregistered once (drained).
                    if let Err(e) = unsafe { comm.deregister_raw(handle as *mut c_void) } {
                        tracing::warn!(rank = inner.rank, "shutdown: deregister failed: {e}");
                    }
                }
            }
            slot.registered.clear();
            slot.symmetric.clear();
            slot.scratch = None;
            slot.comm = None;
            inner.abort.lock().take();
        }
        inner.watched.lock().clear();
        if let Some(handle) = self.watchdog.lock().take()
            && handle.join().is_err()
        {
            tracing::warn!(rank = inner.rank, "watchdog thread panicked");
        }
        result
    }

    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world_size(&self) -> usize {
        self.inner.world_size
    }
}

impl NcclBackend {
    /// A broadcast from `root` waited for on the host: with the collective
    /// deadline, or idle (no deadline) for `recv_command_u32`.
    ///
    /// # Safety
    /// `ptr` is device memory of this backend's GPU valid for `bytes`.
    unsafe fn broadcast_wait(
        &self,
        op: &'static str,
        ptr: u64,
        bytes: usize,
        root: usize,
        idle: bool,
    ) -> Result<()> {
        let inner = &*self.inner;
        check_buffer(op, "buffer", ptr, bytes, 1)?;
        check_rank(op, "root", root, inner.world_size)?;
        inner.refuse_in_group(op)?;
        if bytes == 0 {
            return inner.check_usable(op);
        }
        let (seq, event) = inner.submit(
            op,
            DataType::Uint8,
            bytes,
            StreamSel::Own,
            Some(root),
            idle,
            |slot, s| {
                let comm = slot
                    .comm
                    .as_mut()
                    .ok_or(nccl_safe::Error::Aborted { call: op })?;
                // An idle receive waits for the root with no deadline, also
                // while NCCL connects to it (the first operation with a peer
                // stays in progress until the peer joins); shutdown or a
                // failure aborts the communicator, which ends the wait.
                let saved = comm.enqueue_deadline();
                if idle {
                    comm.set_enqueue_deadline(None);
                }
                // SAFETY: `ptr` valid for `bytes` (contract); our stream.
                let r = unsafe {
                    comm.broadcast_raw(
                        ptr,
                        ptr,
                        bytes,
                        DataType::Uint8,
                        root,
                        s as cuda_sys::CUstream,
                    )
                };
                comm.set_enqueue_deadline(saved);
                r
            },
        )?;
        match event {
            Some(ev) => inner.wait(op, seq, &ev, idle),
            None => Ok(()),
        }
    }

    /// Send or receive on the caller's stream.
    ///
    /// # Safety
    /// As for `send_to` / `recv_from`.
    unsafe fn p2p(
        &self,
        op: &'static str,
        ptr: u64,
        bytes: usize,
        peer: usize,
        stream: u64,
        send: bool,
    ) -> Result<()> {
        let inner = &*self.inner;
        check_buffer(op, "buffer", ptr, bytes, 1)?;
        check_rank(op, "peer", peer, inner.world_size)?;
        if peer == inner.rank {
            return Err(CommError::InvalidArgument {
                op,
                reason: format!(
                    "rank {peer} cannot {} itself",
                    if send { "send to" } else { "receive from" }
                ),
            });
        }
        if bytes == 0 {
            return inner.check_usable(op);
        }
        inner.submit(
            op,
            DataType::Uint8,
            bytes,
            StreamSel::Caller(stream),
            Some(peer),
            false,
            |slot, s| {
                let comm = slot.comm(op)?;
                let s = s as cuda_sys::CUstream;
                // SAFETY: `ptr` valid for `bytes` and `stream` live (contract).
                unsafe {
                    if send {
                        comm.send_raw(ptr, bytes, DataType::Uint8, peer, s)
                    } else {
                        comm.recv_raw(ptr, bytes, DataType::Uint8, peer, s)
                    }
                }
            },
        )?;
        Ok(())
    }
}

/// `ncclGroupStart` (`start`) or `ncclGroupEnd`; `ncclInProgress` counts as
/// success.
fn nccl_group_call(op: &'static str, start: bool) -> Result<()> {
    let refused = |source| CommError::Refused { op, source };
    let nccl = nccl_sys::nccl().map_err(|e| refused(e.into()))?;
    // SAFETY: group calls take no arguments; NCCL keeps the group state per
    // thread.
    let rc = unsafe {
        if start {
            nccl_sys::call!(nccl, ncclGroupStart())
        } else {
            nccl_sys::call!(nccl, ncclGroupEnd())
        }
    }
    .map_err(|e| refused(e.into()))?;
    let call = if start {
        "ncclGroupStart"
    } else {
        "ncclGroupEnd"
    };
    // On non-blocking communicators the group's work may still be being
    // enqueued: each communicator's next call waits for it (nccl-safe).
    if rc == nccl_sys::ncclResult_t::ncclInProgress {
        return Ok(());
    }
    nccl_safe::nccl_check(rc, call, std::ptr::null_mut()).map_err(refused)
}

impl Drop for NcclBackend {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!(rank = self.inner.rank, "shutdown on drop: {e}");
        }
    }
}
