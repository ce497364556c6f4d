//! One rank's GPU objects and how it issues and times each case.
//!
//! Per rank: its device's context, one raw `nccl_safe::Comm` (blocking, as
//! raw NCCL is at its best; joined within a deadline), a `NcclBackend` with
//! `FastPathPolicy::Never` (the `ours` of every operation group), on 2 or
//! more ranks one with `OneShotPolicy::Always` (through a TCP store on
//! loopback: the one-shot path is set up only over a store), and on 2 ranks
//! two more with `Always` and the default policy (the path sweep; the
//! default one through a store of its own, so that its path tuner times
//! the one-shot path too), each on its own communicator; one caller stream, two bf16 buffers of the
//! largest size, and two timing events. The backends' configurations are
//! pinned (`without_env_overrides`): `METRALE_COMM_*` does not change what
//! a group measures.
//!
//! Invariants:
//! - A run times its operations between two CUDA events on the stream they
//!   run on: the caller stream for raw NCCL, `all_reduce_async`, send/recv
//!   and graph replays, the backend's own stream for the rest. Host-waiting
//!   operations (broadcast, barrier, command) wait after each operation on
//!   both sides.
//! - Graph mode captures [`GRAPH_OPS`] operations once per case and replays
//!   the graph `ceil(iters / GRAPH_OPS)` times; the time is scaled to
//!   `iters` operations.
//! - At most two chunks of [`IN_FLIGHT`] operations are queued at a time
//!   (a pacing mark per chunk, on the timed stream), whatever the iteration
//!   count; both sides of a comparison are paced alike.
//! - Every view lies inside its buffer: both hold the largest planned size
//!   and a case's shape never exceeds it.
//! - The buffers' data is checked once, at construction (every all-reduce
//!   variant against a host reference); timed runs sum in place without
//!   refilling, so values may saturate, which the GPU's time does not
//!   depend on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use half::bf16;
use metrale_comm::rendezvous::TcpRendezvous;
use metrale_comm::{
    AllReducePath, BackendConfig, CommBackend, EnqueueMode, FastPathPolicy, LaunchMode,
    NcclBackend, OneShotPolicy,
};
use nccl_safe::{
    AbortHandle, Comm, Context, DataType, DeviceBuffer, DeviceView, DeviceViewMut, Event,
    GraphExec, Group, ReduceOp, Stream, UniqueId,
};

use super::plan::{Case, GRAPH_OPS, Impl, Mode, Op, Policy};
use super::team::{Meet, Member, WAIT, run_deadline};
use crate::tables::TunedRun;

/// What every rank is built from.
#[derive(Clone)]
pub struct Setup {
    /// Ranks.
    pub world: usize,
    /// The raw communicator's id, then the backends' (`Never`, and on 2
    /// ranks `Always` and the default).
    pub ids: Vec<UniqueId>,
    /// The backends' enqueue mode.
    pub enqueue: EnqueueMode,
    /// The largest size of any case, bytes.
    pub max_bytes: usize,
    /// Where rank 0 serves the one-shot backend's store (2 or more ranks).
    pub one_shot_store: Option<std::net::SocketAddr>,
    /// Where rank 0 serves the default backend's store (2 ranks; without
    /// one the default backend meets by its unique id, and its tuner
    /// cannot time the one-shot path).
    pub default_store: Option<std::net::SocketAddr>,
}

/// One rank.
pub struct Rank {
    rank: usize,
    world: usize,
    ctx: Arc<Context>,
    raw: Comm,
    never: NcclBackend,
    always: Option<NcclBackend>,
    default: Option<NcclBackend>,
    one_shot: Option<NcclBackend>,
    stream: Stream,
    a: DeviceBuffer<bf16>,
    b: DeviceBuffer<bf16>,
    /// The raw barrier's one f32.
    one: DeviceBuffer<f32>,
    start: Event,
    stop: Event,
    /// The pacing marks, recorded in turn (see [`IN_FLIGHT`]).
    marks: [Event; 2],
    graph: Option<(Case, GraphExec)>,
}

/// Operations issued between two pacing marks: a run keeps at most two
/// such chunks in flight (it waits for the mark before the last one), so
/// the stream never idles while criterion's large iteration counts do not
/// pile thousands of operations, and the backend's completion events, up
/// in the launch queue.
pub const IN_FLIGHT: u64 = 50;

/// Every backend's configuration with fast-path policy `policy`. Pinned:
/// the `METRALE_COMM_*` environment must not turn `Never` into another
/// policy or move a rank to another device.
fn config(rank: usize, setup: &Setup, policy: FastPathPolicy) -> BackendConfig {
    BackendConfig::new(rank)
        .with_fast_path(policy)
        .with_enqueue(setup.enqueue)
        .with_init_timeout(WAIT)
        .without_env_overrides()
}

fn backend(
    rank: usize,
    setup: &Setup,
    id: &UniqueId,
    policy: FastPathPolicy,
) -> anyhow::Result<NcclBackend> {
    NcclBackend::with_unique_id(config(rank, setup, policy), id, rank, setup.world)
        .with_context(|| format!("backend with {policy:?}"))
}

/// The backend of the one-shot path (`OneShotPolicy::Always`, NCCL for the
/// rest), agreeing through the store at `addr`; an error says why the path
/// is off.
fn one_shot_backend(
    rank: usize,
    setup: &Setup,
    addr: std::net::SocketAddr,
) -> anyhow::Result<NcclBackend> {
    let config = config(rank, setup, FastPathPolicy::Never).with_one_shot(OneShotPolicy::Always);
    let rdzv = TcpRendezvous::new(rank, setup.world, addr, None, WAIT)
        .context("the one-shot backend's store")?;
    let b = NcclBackend::new(config, Box::new(rdzv)).context("backend with the one-shot path")?;
    if let Some(why) = b.one_shot_unavailable() {
        bail!("the one-shot path is off: {why}");
    }
    Ok(b)
}

/// The backend of the library's defaults (both paths tuned at set-up),
/// agreeing through the store at `addr`.
fn default_backend(
    rank: usize,
    setup: &Setup,
    addr: std::net::SocketAddr,
) -> anyhow::Result<NcclBackend> {
    let rdzv = TcpRendezvous::new(rank, setup.world, addr, None, WAIT)
        .context("the default backend's store")?;
    NcclBackend::new(config(rank, setup, FastPathPolicy::DEFAULT), Box::new(rdzv))
        .context("backend with the default policies")
}

/// A path's name on the plots (the all-reduce plot's series names).
fn path_name(p: AllReducePath) -> &'static str {
    match p {
        AllReducePath::Nccl => "NCCL",
        AllReducePath::FastPath => "fast path",
        AllReducePath::OneShot => "one-shot",
        _ => "another path",
    }
}

/// Random small-integer bf16 (±1..8, never zero) for rank `rank`: sums of
/// up to 8 ranks stay exact.
fn host_data(n: usize, rank: usize) -> Vec<bf16> {
    use rand::{Rng as _, SeedableRng as _};
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed + rank as u64);
    (0..n)
        .map(|_| {
            let v: i32 = rng.random_range(1..=8);
            let sign = if rng.random::<bool>() { 1.0 } else { -1.0 };
            bf16::from_f32(sign * v as f32)
        })
        .collect()
}

impl Rank {
    /// Builds rank `rank` (every rank at once: the inits are collective)
    /// and checks every all-reduce variant.
    pub fn new(rank: usize, setup: &Setup) -> anyhow::Result<Rank> {
        let ctx = Context::new(rank)?;
        let raw = Comm::init_rank_with_deadline(&ctx, &setup.ids[0], setup.world, rank, WAIT)
            .and_then(|c| c.into_blocking(WAIT))
            .context("raw communicator")?;
        let never = backend(rank, setup, &setup.ids[1], FastPathPolicy::Never)?;
        let (always, default) = match setup.ids.get(2..4) {
            Some([a, d]) => (
                Some(backend(rank, setup, a, FastPathPolicy::Always)?),
                Some(match setup.default_store {
                    Some(addr) => default_backend(rank, setup, addr)?,
                    None => backend(rank, setup, d, FastPathPolicy::DEFAULT)?,
                }),
            ),
            _ => (None, None),
        };
        let one_shot = match setup.one_shot_store {
            Some(addr) => Some(one_shot_backend(rank, setup, addr)?),
            None => None,
        };
        let elems = setup.max_bytes.div_ceil(2).max(1);
        let mut r = Rank {
            rank,
            world: setup.world,
            stream: Stream::new(&ctx)?,
            a: DeviceBuffer::alloc(&ctx, elems)?,
            b: DeviceBuffer::alloc(&ctx, elems)?,
            one: DeviceBuffer::from_host(&ctx, &[1.0f32])?,
            start: Event::new(&ctx, true)?,
            stop: Event::new(&ctx, true)?,
            marks: [Event::new(&ctx, false)?, Event::new(&ctx, false)?],
            ctx,
            raw,
            never,
            always,
            default,
            one_shot,
            graph: None,
        };
        r.verify()?;
        Ok(r)
    }

    /// The ranges the default backend's path tuner chose (every rank
    /// holds the same table), for the run's plots; empty without a
    /// default backend or a tuned table.
    pub fn tuned(&self) -> Vec<TunedRun> {
        let Some(table) = self.default.as_ref().and_then(NcclBackend::path_table) else {
            return Vec::new();
        };
        LaunchMode::ALL
            .iter()
            .flat_map(|&mode| {
                table.ranges(mode).iter().map(move |r| TunedRun {
                    min_bytes: r.min_bytes as u64,
                    max_bytes: r.max_bytes as u64,
                    path: path_name(r.path).to_owned(),
                    mode: mode.to_string(),
                })
            })
            .collect()
    }

    fn backend(&self, p: Policy) -> anyhow::Result<&NcclBackend> {
        match p {
            Policy::Never => Ok(&self.never),
            Policy::Always => self.always.as_ref().context("no Always backend"),
            Policy::Default => self.default.as_ref().context("no default backend"),
            Policy::OneShot => self.one_shot.as_ref().context("no one-shot backend"),
        }
    }

    /// The stream a case's work runs on: where its timing events go.
    fn timing_stream(&self, case: &Case) -> anyhow::Result<Stream> {
        let raw = match (case.imp, case.op, case.mode) {
            (Impl::Raw, ..) | (_, _, Mode::Graph) => self.stream.raw(),
            (Impl::Backend(_), Op::AllReduceAsync | Op::SendRecv, _) => self.stream.raw(),
            (Impl::Backend(p), ..) => self.backend(p)?.stream().as_raw(),
        };
        // SAFETY: `raw` is this rank's stream or one of its backends' own
        // streams, both of this context, and both outlive the borrowed
        // wrapper, which lives for one run.
        Ok(unsafe { Stream::borrowed(&self.ctx, raw) })
    }

    /// Enqueues one operation of `case` (and waits for it where the
    /// operation waits on the host).
    fn issue(&self, case: &Case) -> anyhow::Result<()> {
        let (a, b, s) = (self.a.device_ptr(), self.b.device_ptr(), self.stream.raw());
        let (w, me, n) = (self.world, self.rank, case.shape.count);
        let (next, prev) = ((me + 1) % w, (me + w - 1) % w);
        let bf = DataType::Bfloat16;
        match case.imp {
            // SAFETY (every raw arm): `a` and `b` are this context's device
            // memory, each holding the largest planned size, and no case's
            // shape exceeds it (`n * w` elements at most); `s` is this
            // rank's live stream.
            Impl::Raw => match case.op {
                Op::AllReduce | Op::AllReduceAsync => {
                    // SAFETY: see above.
                    unsafe { self.raw.all_reduce_raw(a, a, n, bf, ReduceOp::Sum, s)? }
                }
                // SAFETY: see above (n sent, n * w received).
                Op::AllGather => unsafe { self.raw.all_gather_raw(a, b, n, bf, s)? },
                Op::ReduceScatter => {
                    // SAFETY: see above (n * w sent, n received).
                    unsafe { self.raw.reduce_scatter_raw(a, b, n, bf, ReduceOp::Sum, s)? }
                }
                Op::Broadcast => {
                    // SAFETY: see above.
                    unsafe { self.raw.broadcast_raw(a, a, n, bf, 0, s)? };
                    self.stream.wait_until_idle(WAIT)?;
                }
                Op::SendRecv => {
                    let group = Group::start()?;
                    // SAFETY: see above.
                    unsafe {
                        self.raw.send_raw(a, n, bf, next, s)?;
                        self.raw.recv_raw(b, n, bf, prev, s)?;
                    }
                    group.end()?;
                }
                // SAFETY: see above (n * w each way).
                Op::AllToAll => unsafe { self.raw.all_to_all_raw(a, b, n, bf, s)? },
                Op::AllToAllV => self.raw_blocks(n)?,
                Op::Barrier => {
                    let p = self.one.device_ptr();
                    // SAFETY: one f32 of this rank's buffer; its stream.
                    unsafe {
                        self.raw
                            .all_reduce_raw(p, p, 1, DataType::Float32, ReduceOp::Max, s)?
                    };
                    self.stream.wait_until_idle(WAIT)?;
                }
                Op::CommandU32 => {
                    // SAFETY: see above (one u32).
                    unsafe { self.raw.broadcast_raw(a, a, 1, DataType::Uint32, 0, s)? };
                    self.stream.wait_until_idle(WAIT)?;
                }
            },
            Impl::Backend(p) => {
                let be = self.backend(p)?;
                // SAFETY: as for the raw arms: every view below lies inside
                // `a` or `b`, which outlive the operation's use of it (each
                // run waits for its work before the buffers can go).
                let m = |ptr: u64, len: usize, t| unsafe { DeviceViewMut::from_raw(ptr, len, t) };
                // SAFETY: as above.
                let v = |ptr: u64, len: usize, t| unsafe { DeviceView::from_raw(ptr, len, t) };
                let st = self.stream.as_ref();
                match case.op {
                    Op::AllReduce => be.all_reduce(m(a, n, bf))?,
                    Op::AllReduceAsync => be.all_reduce_async(m(a, n, bf), st)?,
                    Op::AllGather => be.all_gather(v(a, n, bf), m(b, n * w, bf))?,
                    Op::ReduceScatter => be.reduce_scatter(v(a, n * w, bf), m(b, n, bf))?,
                    Op::Broadcast => be.broadcast(m(a, n, bf), 0)?,
                    Op::SendRecv => {
                        be.group_start()?;
                        let sent = be
                            .send_to(v(a, n, bf), next, st)
                            .and_then(|()| be.recv_from(m(b, n, bf), prev, st));
                        be.group_end()?;
                        sent?;
                    }
                    Op::AllToAll => be.all_to_all(v(a, n * w, bf), m(b, n * w, bf))?,
                    Op::AllToAllV => {
                        let counts = vec![n; w];
                        be.all_to_all_v(v(a, n * w, bf), &counts, m(b, n * w, bf), &counts)?
                    }
                    Op::Barrier => be.barrier()?,
                    Op::CommandU32 if me == 0 => be.broadcast(m(a, 1, DataType::Uint32), 0)?,
                    Op::CommandU32 => be.recv_command_u32(m(a, 1, DataType::Uint32), 0)?,
                }
            }
        }
        Ok(())
    }

    /// The raw side of `all_to_all_v`: what the backend does, straight
    /// through nccl-safe (a grouped send/recv of `n` elements with every
    /// peer, a device copy of this rank's own block).
    fn raw_blocks(&self, n: usize) -> anyhow::Result<()> {
        let (a, b, s) = (self.a.device_ptr(), self.b.device_ptr(), self.stream.raw());
        let block = (n * 2) as u64;
        nccl_safe::group(|| {
            for peer in 0..self.world {
                let off = peer as u64 * block;
                if peer == self.rank {
                    // SAFETY: both blocks lie inside `a` and `b` (n * w
                    // elements at most); the stream is this rank's.
                    unsafe { nccl_safe::copy_device_async(&self.ctx, b + off, a + off, n * 2, s)? };
                } else {
                    // SAFETY: as above.
                    unsafe {
                        self.raw.send_raw(a + off, n, DataType::Bfloat16, peer, s)?;
                        self.raw.recv_raw(b + off, n, DataType::Bfloat16, peer, s)?;
                    }
                }
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Captures [`GRAPH_OPS`] operations of `case` on the caller stream,
    /// unless the graph in hand is already that case's.
    fn prepare_graph(&mut self, case: &Case) -> anyhow::Result<()> {
        if self.graph.as_ref().is_some_and(|(c, _)| c == case) {
            return Ok(());
        }
        self.graph = None;
        self.stream.wait_until_idle(WAIT)?;
        self.stream.begin_capture()?;
        let issued = (0..GRAPH_OPS).try_for_each(|_| self.issue(case));
        let graph = self.stream.end_capture();
        issued.context("issuing under capture")?;
        let exec = graph?.instantiate()?;
        self.graph = Some((*case, exec));
        Ok(())
    }

    /// Waits for `event` until `deadline`, or until another rank fails.
    /// Spins for the first 100 µs, then naps 20 µs between queries.
    fn wait(event: &Event, meet: &Meet, deadline: Duration) -> anyhow::Result<()> {
        let start = Instant::now();
        while !event.query()? {
            if meet.is_broken() {
                bail!("another rank failed while this one waited for its GPU");
            }
            let waited = start.elapsed();
            if waited >= deadline {
                bail!("the GPU work did not finish within {deadline:?}");
            }
            if waited < Duration::from_micros(100) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        Ok(())
    }

    /// Pacing mark `k` (one per [`IN_FLIGHT`] operations): records mark
    /// `k % 2` on `stream` and waits for mark `k - 1`, so that at most two
    /// chunks are queued.
    fn pace(&self, k: u64, stream: &Stream, meet: &Meet, deadline: Duration) -> anyhow::Result<()> {
        self.marks[(k % 2) as usize].record(stream)?;
        if k > 0 {
            Self::wait(&self.marks[((k - 1) % 2) as usize], meet, deadline)?;
        }
        Ok(())
    }

    /// Checks every all-reduce variant once against a host reference, every
    /// element: at a small size, and at one inside the default fast-path
    /// range where the buffers hold it.
    fn verify(&mut self) -> anyhow::Result<()> {
        let imps = [
            Impl::Raw,
            Impl::Backend(Policy::Never),
            Impl::Backend(Policy::Always),
            Impl::Backend(Policy::Default),
            Impl::Backend(Policy::OneShot),
        ];
        for bytes in [1 << 10, 3 << 20] {
            let Some(shape) = Op::AllReduce.shape(bytes, self.world) else {
                continue;
            };
            if shape.count > self.a.len() {
                continue;
            }
            let mine = host_data(shape.count, self.rank);
            let mut want = vec![0f32; shape.count];
            for r in 0..self.world {
                for (w, x) in want.iter_mut().zip(host_data(shape.count, r)) {
                    *w += x.to_f32();
                }
            }
            for imp in imps {
                if let Impl::Backend(p) = imp
                    && self.backend(p).is_err()
                {
                    continue;
                }
                self.a.copy_prefix_from_host(&mine)?;
                let case = Case {
                    op: Op::AllReduce,
                    mode: Mode::Eager,
                    imp,
                    shape,
                };
                self.issue(&case)?;
                self.stream.wait_until_idle(WAIT)?;
                if let Impl::Backend(p) = imp {
                    self.backend(p)?.synchronize()?;
                }
                let got = self.a.to_host_vec()?;
                let wrong = (0..shape.count)
                    .filter(|&i| got[i].to_f32() != want[i])
                    .count();
                ensure!(
                    wrong == 0,
                    "all-reduce check failed: {imp:?} at {bytes} B, {wrong} of {} elements wrong",
                    shape.count
                );
            }
        }
        Ok(())
    }
}

impl Member for Rank {
    fn run(&mut self, case: &Case, iters: u64, meet: &Meet) -> anyhow::Result<Duration> {
        self.ctx.make_current()?;
        if case.shape.bytes.div_ceil(2) > self.a.len() {
            bail!("{} B do not fit the buffers", case.shape.bytes);
        }
        if case.mode == Mode::Graph {
            self.prepare_graph(case)?;
        }
        let timing = self.timing_stream(case)?;
        meet.wait()?;
        self.start.record(&timing)?;
        let deadline = run_deadline(iters);
        let ops = match &self.graph {
            Some((c, exec)) if case.mode == Mode::Graph && c == case => {
                let launches = iters.div_ceil(GRAPH_OPS);
                let per_mark = IN_FLIGHT.div_ceil(GRAPH_OPS);
                for i in 0..launches {
                    exec.launch(&self.stream)?;
                    if (i + 1) % per_mark == 0 {
                        self.pace(i / per_mark, &timing, meet, deadline)?;
                    }
                }
                launches * GRAPH_OPS
            }
            _ => {
                for i in 0..iters {
                    self.issue(case)?;
                    if (i + 1) % IN_FLIGHT == 0 {
                        self.pace(i / IN_FLIGHT, &timing, meet, deadline)?;
                    }
                }
                iters
            }
        };
        self.stop.record(&timing)?;
        Self::wait(&self.stop, meet, deadline)?;
        let ms = f64::from(self.stop.elapsed_ms(&self.start)?);
        Ok(Duration::from_secs_f64(
            ms / 1e3 * iters as f64 / ops.max(1) as f64,
        ))
    }

    fn abort_handle(&self) -> Option<AbortHandle> {
        Some(self.raw.abort_handle())
    }

    fn shutdown(mut self) {
        self.graph = None;
        if let Err(e) = self.stream.wait_until_idle(WAIT) {
            tracing::warn!(rank = self.rank, "draining the bench stream: {e}");
        }
        for b in [
            Some(&self.never),
            self.always.as_ref(),
            self.default.as_ref(),
        ]
        .into_iter()
        .flatten()
        {
            if let Err(e) = b.shutdown() {
                tracing::warn!(rank = self.rank, "backend shutdown: {e}");
            }
        }
    }
}
