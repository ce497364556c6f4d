//! `gpu-bench`: every `CommBackend` collective on 2 GPUs, side by side with
//! the same operation issued straight through nccl-safe in the same run, and
//! the 2-rank all-reduce paths (NCCL, send/recv + add, the one-shot path
//! over peer memory, automatic choice).
//!
//! Two ranks are two threads of this process, each with its own CUDA
//! context. Per rank: one raw `Comm` and three `NcclBackend`s (fast-path
//! policy `Never`, `Always` and the default), each on its own communicator.
//! For every size and mode the ranks meet at a barrier, then run warm-up
//! iterations and several trials; a trial times `iters` operations between
//! two CUDA events on the stream the operations run on (eager), or one
//! replay of a graph that captured `iters` operations (graph). The per-op time
//! is the median trial of rank 0. Buffers hold random small-integer bf16
//! (never zeros) and are refilled before every trial, so in-place sums never
//! overflow. Before the sweep each all-reduce variant is checked against a
//! host reference on poisoned outputs.
//!
//! Without a CUDA driver, NCCL or 2 GPUs it prints why and exits 0. Every
//! host wait has a deadline; a failing rank releases the other through the
//! shared barrier.
//!
//! Invariants: every ratio printed is between two measurements of this run;
//! the backend's `broadcast` waits on the host by contract, so both
//! broadcast columns include a host wait per operation; only operations that
//! take a caller stream (`all_reduce_async`, `send_to`/`recv_from`) can be
//! captured through the backend, so graph rows cover all-reduce and
//! send/recv.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use half::bf16;
use metrale_benches::{
    Collective, OpRow, PathPoint, PathRow, Sample, crossover_summary, human_bytes,
    one_shot_crossover_summary, ops_table, paths_table, size_series,
};
use metrale_comm::rendezvous::FileRendezvous;
use metrale_comm::{
    AllReducePath, BackendConfig, CommBackend, EnqueueMode, FastPathPolicy, NcclBackend,
    OneShotPolicy,
};
use nccl_safe::{
    Comm, Context, DataType, DeviceBuffer, DeviceView, DeviceViewMut, Event, Group, ReduceOp,
    Stream, StreamRef, UniqueId,
};
use parking_lot::{Condvar, Mutex};
use rand::Rng as _;

const HELP: &str = "\
usage: gpu-bench [--out FILE] [--crossover] [--min BYTES] [--max BYTES]
                 [--factor N] [--trials N] [--ops a,b] [--modes eager,graph]
                 [--enqueue nonblocking|blocking] [--host-costs]

Sizes run from --min (default 8) to --max (default 1G) by --factor (default 4;
--crossover alone defaults to 2 and all-reduce only). --ops picks among
all_reduce, all_gather, reduce_scatter, broadcast, send_recv, paths.
--enqueue sets the backends' EnqueueMode (default blocking, the
backend's default). --host-costs measures, instead of the sweep, the host
time per call of an eager 8 B operation (raw NCCL and the backend) and of
the driver and NCCL calls the backend adds to each submission. Prints markdown tables and writes them to --out when given.
";

const WAIT: Duration = Duration::from_secs(120);

#[derive(Debug, Clone)]
struct Opts {
    out: Option<PathBuf>,
    crossover: bool,
    min: usize,
    max: usize,
    factor: usize,
    trials: usize,
    ops: Vec<String>,
    modes: Vec<Mode>,
    enqueue: EnqueueMode,
    host_costs: bool,
}

fn parse_args() -> anyhow::Result<Option<Opts>> {
    let mut o = Opts {
        out: None,
        crossover: false,
        min: 8,
        max: 1 << 30,
        factor: 0,
        trials: 7,
        ops: Vec::new(),
        modes: vec![Mode::Eager, Mode::Graph],
        enqueue: EnqueueMode::default(),
        host_costs: false,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    let bytes = |v: Option<&String>, name: &str| -> anyhow::Result<usize> {
        let v = v.with_context(|| format!("{name} needs a value"))?;
        metrale_comm::config::parse_bytes(v).map_err(|e| anyhow::anyhow!("{name}: {e}"))
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "--help" | "-h" => {
                print!("{HELP}");
                return Ok(None);
            }
            "--out" => o.out = Some(PathBuf::from(it.next().context("--out needs a file")?)),
            "--crossover" => o.crossover = true,
            "--host-costs" => o.host_costs = true,
            "--enqueue" => {
                o.enqueue = EnqueueMode::parse(it.next().context("--enqueue needs a mode")?)
                    .map_err(|e| anyhow::anyhow!("--enqueue: {e}"))?
            }
            "--min" => o.min = bytes(it.next(), "--min")?,
            "--max" => o.max = bytes(it.next(), "--max")?,
            "--factor" => o.factor = bytes(it.next(), "--factor")?,
            "--trials" => o.trials = bytes(it.next(), "--trials")?.max(1),
            "--ops" => {
                o.ops = it
                    .next()
                    .context("--ops needs a list")?
                    .split(',')
                    .map(|s| s.trim().to_owned())
                    .collect()
            }
            "--modes" => {
                o.modes = Vec::new();
                for m in it.next().context("--modes needs a list")?.split(',') {
                    o.modes.push(match m.trim() {
                        "eager" => Mode::Eager,
                        "graph" => Mode::Graph,
                        other => bail!("unknown mode `{other}` (eager, graph)"),
                    });
                }
            }
            other => bail!("unknown option `{other}`\n{HELP}"),
        }
    }
    if o.factor == 0 {
        o.factor = if o.crossover && o.ops.is_empty() {
            2
        } else {
            4
        };
    }
    if o.ops.is_empty() {
        o.ops = if o.crossover {
            vec!["paths".into()]
        } else {
            [
                "all_reduce",
                "all_gather",
                "reduce_scatter",
                "broadcast",
                "send_recv",
                "paths",
            ]
            .map(String::from)
            .to_vec()
        };
    }
    if o.min < 4 || o.min > o.max || !o.min.is_multiple_of(4) {
        bail!("--min must be a multiple of 4 bytes, at least 4 and at most --max");
    }
    Ok(Some(o))
}

fn main() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
    let code = match parse_args() {
        Ok(None) => 0,
        Ok(Some(opts)) => match run(&opts) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("gpu-bench: {e:#}");
                1
            }
        },
        Err(e) => {
            eprintln!("gpu-bench: {e:#}");
            2
        }
    };
    std::process::exit(code);
}

/// A two-party barrier with a deadline that a failing rank can break.
struct Meet {
    state: Mutex<(usize, u64, bool)>,
    cv: Condvar,
}

impl Meet {
    fn new() -> Meet {
        Meet {
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        }
    }

    fn wait(&self, parties: usize) -> anyhow::Result<()> {
        let mut s = self.state.lock();
        if s.2 {
            bail!("the other rank failed");
        }
        let round = s.1;
        s.0 += 1;
        if s.0 == parties {
            s.0 = 0;
            s.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let deadline = std::time::Instant::now() + WAIT;
        while s.1 == round && !s.2 {
            if self.cv.wait_until(&mut s, deadline).timed_out() {
                s.2 = true;
                self.cv.notify_all();
                bail!("the other rank did not arrive within {WAIT:?}");
            }
        }
        if s.2 {
            bail!("the other rank failed");
        }
        Ok(())
    }

    fn fail(&self) {
        self.state.lock().2 = true;
        self.cv.notify_all();
    }
}

fn run(opts: &Opts) -> anyhow::Result<()> {
    let count = match nccl_safe::device_count() {
        Ok(n) => n,
        Err(e) => {
            println!("gpu-bench: no usable CUDA driver ({e}); nothing to measure");
            return Ok(());
        }
    };
    if count < 2 {
        println!("gpu-bench: {count} GPU(s) visible, the benchmarks need 2; nothing to measure");
        return Ok(());
    }
    let id = match UniqueId::new() {
        Ok(id) => *id.as_bytes(),
        Err(e) => {
            println!("gpu-bench: NCCL is not usable ({e}); nothing to measure");
            return Ok(());
        }
    };
    let version = nccl_safe::nccl_version().unwrap_or_else(|e| format!("(version unknown: {e})"));
    println!("gpu-bench: 2 of {count} GPUs, NCCL {version}");
    let dir = std::env::temp_dir().join(format!("metrale-gpu-bench-{}", std::process::id()));
    let meet = Arc::new(Meet::new());
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let (meet, dir, opts) = (meet.clone(), dir.clone(), opts.clone());
                scope.spawn(move || {
                    let r = rank_main(rank, &id, &dir, &opts, &meet);
                    if r.is_err() {
                        meet.fail();
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("rank thread panicked")))
            })
            .collect::<Vec<_>>()
    });
    let _ = std::fs::remove_dir_all(&dir);
    let mut it = results.into_iter();
    let r0 = it.next().context("rank 0 result")?;
    let r1 = it.next().context("rank 1 result")?;
    let report = match (r0, r1) {
        (Ok(rep), Ok(_)) => rep,
        (Err(e), _) => return Err(e.context("rank 0")),
        (_, Err(e)) => return Err(e.context("rank 1")),
    };
    let failed = !report.failures.is_empty();
    let text = report.render(opts);
    println!("{text}");
    if let Some(out) = &opts.out {
        std::fs::write(out, &text).with_context(|| format!("writing {}", out.display()))?;
        println!("gpu-bench: tables written to {}", out.display());
    }
    if failed {
        bail!("correctness checks failed (see the top of the report)");
    }
    Ok(())
}

#[derive(Default)]
struct Report {
    /// Correctness-check failures (the sweep still runs and is reported).
    failures: Vec<String>,
    ops: Vec<OpRow>,
    paths: Vec<PathRow>,
    /// `--host-costs`: (what, per-call host time).
    host: Vec<(&'static str, Sample)>,
}

impl Report {
    fn render(&self, opts: &Opts) -> String {
        let mut s = String::from("# gpu-bench results\n\n");
        for f in &self.failures {
            s.push_str(&format!("**CORRECTNESS CHECK FAILED**: {f}\n\n"));
        }
        s.push_str(&format!(
            "2 ranks (threads of one process), {} trials per point, median per-op time of rank 0; \
             busbw with nccl-tests' formulas; every ratio is within this run. \
             Backends: EnqueueMode::{:?}.\n\n",
            opts.trials, opts.enqueue
        ));
        if !self.host.is_empty() {
            s.push_str("## Host time per call\n\n");
            s.push_str(&host_table(&self.host));
            s.push('\n');
        }
        if !self.ops.is_empty() {
            s.push_str("## CommBackend vs raw NCCL (nccl-safe)\n\n");
            s.push_str(&ops_table(&self.ops, 2));
            s.push('\n');
        }
        if !self.paths.is_empty() {
            s.push_str("## 2-rank all-reduce paths\n\n");
            s.push_str(&paths_table(&self.paths, 2));
            s.push_str("\n## Crossover\n\n");
            for mode in ["eager", "graph"] {
                let pts: Vec<PathPoint> = self
                    .paths
                    .iter()
                    .filter(|r| r.mode == mode)
                    .map(|r| r.point.clone())
                    .collect();
                if !pts.is_empty() {
                    s.push_str(&crossover_summary(mode, &pts));
                }
                let one: Vec<PathPoint> = self
                    .paths
                    .iter()
                    .filter(|r| r.mode == mode)
                    .filter_map(|r| {
                        r.one_shot.clone().map(|fast| PathPoint {
                            fast,
                            ..r.point.clone()
                        })
                    })
                    .collect();
                if !one.is_empty() {
                    s.push_str(&one_shot_crossover_summary(mode, &one));
                }
            }
            s.push_str(
                "\nThe default policy follows the graph-replay crossover (decode steps run under \
                 graph replay).\n",
            );
        }
        s
    }
}

/// One rank's objects.
struct Rank {
    rank: usize,
    ctx: Arc<Context>,
    raw: Comm,
    never: NcclBackend,
    always: NcclBackend,
    oneshot: NcclBackend,
    auto: NcclBackend,
    /// The stream raw NCCL and the caller-stream backend ops run on.
    stream: Stream,
    a: DeviceBuffer<bf16>,
    b: DeviceBuffer<bf16>,
    /// Twice the largest size: all-gather output, reduce-scatter input.
    g: DeviceBuffer<bf16>,
    host: Vec<bf16>,
    start: Event,
    stop: Event,
}

fn backend(
    rank: usize,
    dir: &std::path::Path,
    name: &str,
    (policy, one_shot): (FastPathPolicy, OneShotPolicy),
    enqueue: EnqueueMode,
) -> anyhow::Result<NcclBackend> {
    let rv = FileRendezvous::new(rank, 2, dir.join(name))?;
    let config = BackendConfig::new(rank)
        .with_fast_path(policy)
        .with_one_shot(one_shot)
        .with_enqueue(enqueue)
        .with_init_timeout(WAIT);
    NcclBackend::new(config, Box::new(rv)).with_context(|| format!("backend {name}"))
}

fn random_host(n: usize, seed: u64) -> Vec<bf16> {
    use rand::SeedableRng as _;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let v: i32 = rng.random_range(1..=8);
            bf16::from_f32(if rng.random::<bool>() {
                v as f32
            } else {
                -(v as f32)
            })
        })
        .collect()
}

fn rank_main(
    rank: usize,
    id: &[u8; 128],
    dir: &std::path::Path,
    opts: &Opts,
    meet: &Meet,
) -> anyhow::Result<Report> {
    let ctx = Context::new(rank)?;
    let uid = UniqueId::from_bytes(id)?;
    // Raw NCCL at its best: a blocking communicator, so each call returns
    // once its work is on the stream (the backend's non-blocking one may have
    // to wait for NCCL's background enqueue, which is part of its overhead).
    let raw = Comm::init_rank(&ctx, &uid, 2, rank).context("raw communicator")?;
    // `never` is the NCCL path and `always` the fast path (both with the
    // one-shot path off), `oneshot` the one-shot path at every size, `auto`
    // every default.
    let off = OneShotPolicy::Never;
    let never = backend(
        rank,
        dir,
        "never",
        (FastPathPolicy::Never, off),
        opts.enqueue,
    )?;
    let always = backend(
        rank,
        dir,
        "always",
        (FastPathPolicy::Always, off),
        opts.enqueue,
    )?;
    let oneshot = backend(
        rank,
        dir,
        "oneshot",
        (FastPathPolicy::Never, OneShotPolicy::Always),
        opts.enqueue,
    )?;
    if let Some(why) = oneshot.one_shot_unavailable() {
        eprintln!("gpu-bench: rank {rank}: the one-shot path is off, not measured: {why}");
    }
    let auto = backend(
        rank,
        dir,
        "auto",
        (FastPathPolicy::DEFAULT, OneShotPolicy::DEFAULT),
        opts.enqueue,
    )?;
    let max = opts.max;
    let elems = max.div_ceil(2);
    let mut r = Rank {
        rank,
        stream: Stream::new(&ctx)?,
        a: DeviceBuffer::alloc(&ctx, elems)?,
        b: DeviceBuffer::alloc(&ctx, elems)?,
        g: DeviceBuffer::alloc(&ctx, 2 * elems)?,
        host: random_host(2 * elems, 0x5eed + rank as u64),
        start: Event::new(&ctx, true)?,
        stop: Event::new(&ctx, true)?,
        ctx,
        raw,
        never,
        always,
        oneshot,
        auto,
    };
    r.g.copy_from_host(&r.host)?;
    meet.wait(2)?;
    let failures = verify_all_reduce(&mut r, opts, meet)?;
    for f in &failures {
        eprintln!("gpu-bench: rank {rank}: correctness check failed: {f}");
    }
    let sizes = size_series(opts.min, opts.max, opts.factor);
    let want = |name: &str| opts.ops.iter().any(|o| o == name);
    let mut report = Report {
        failures,
        ..Report::default()
    };
    if opts.host_costs {
        report.host = host_costs(&r, opts, meet)?;
        return Ok(report);
    }
    // Eager first at every size: the fast path allocates its scratch then,
    // never under capture.
    for &mode in &opts.modes {
        for &bytes in &sizes {
            for op in [
                Collective::AllReduce,
                Collective::AllGather,
                Collective::ReduceScatter,
                Collective::Broadcast,
                Collective::SendRecv,
            ] {
                if !want(op.name())
                    || (mode == Mode::Graph
                        && !matches!(op, Collective::AllReduce | Collective::SendRecv))
                {
                    continue;
                }
                let raw = measure(&mut r, opts, meet, mode, bytes, Impl::Raw(op))?;
                let ours = measure(
                    &mut r,
                    opts,
                    meet,
                    mode,
                    bytes,
                    Impl::Backend(op, Which::Never),
                )?;
                report.ops.push(OpRow {
                    op,
                    mode: mode.name(),
                    bytes,
                    raw,
                    ours,
                });
            }
            if want("paths") && bytes.is_multiple_of(2) {
                let nccl = measure(
                    &mut r,
                    opts,
                    meet,
                    mode,
                    bytes,
                    Impl::Raw(Collective::AllReduce),
                )?;
                let fast = measure(
                    &mut r,
                    opts,
                    meet,
                    mode,
                    bytes,
                    Impl::Backend(Collective::AllReduce, Which::Always),
                )?;
                let auto = measure(
                    &mut r,
                    opts,
                    meet,
                    mode,
                    bytes,
                    Impl::Backend(Collective::AllReduce, Which::Auto),
                )?;
                let one_shot = if r.oneshot.one_shot_unavailable().is_none() {
                    Some(measure(
                        &mut r,
                        opts,
                        meet,
                        mode,
                        bytes,
                        Impl::Backend(Collective::AllReduce, Which::OneShot),
                    )?)
                } else {
                    None
                };
                let auto_path = match r.auto.all_reduce_path(bytes) {
                    AllReducePath::FastPath => "fast path",
                    AllReducePath::OneShot => "one-shot",
                    _ => "NCCL",
                };
                report.paths.push(PathRow {
                    mode: mode.name(),
                    point: PathPoint { bytes, nccl, fast },
                    auto,
                    auto_path,
                    one_shot,
                });
            }
            if rank == 0 {
                eprintln!("gpu-bench: {} {} done", mode.name(), human_bytes(bytes));
            }
        }
    }
    for b in [&r.never, &r.always, &r.oneshot, &r.auto] {
        if let Err(e) = b.shutdown() {
            tracing::warn!(rank, "backend shutdown: {e}");
        }
    }
    Ok(report)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Eager,
    Graph,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Eager => "eager",
            Mode::Graph => "graph",
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Which {
    Never,
    Always,
    OneShot,
    Auto,
}

#[derive(Debug, Clone, Copy)]
enum Impl {
    Raw(Collective),
    Backend(Collective, Which),
}

impl Rank {
    fn backend(&self, w: Which) -> &NcclBackend {
        match w {
            Which::Never => &self.never,
            Which::Always => &self.always,
            Which::OneShot => &self.oneshot,
            Which::Auto => &self.auto,
        }
    }

    /// The stream an implementation's operations run on (where the timing
    /// events go, and where graphs are captured).
    fn op_stream(&self, imp: Impl, mode: Mode) -> u64 {
        match imp {
            Impl::Backend(Collective::AllReduce, w) if mode == Mode::Eager => {
                self.backend(w).stream().as_raw() as u64
            }
            Impl::Backend(Collective::SendRecv, _)
            | Impl::Raw(_)
            | Impl::Backend(Collective::AllReduce, _) => self.stream.raw() as u64,
            Impl::Backend(_, w) => self.backend(w).stream().as_raw() as u64,
        }
    }

    /// Enqueues one operation of `bytes` (nccl-tests' size convention).
    fn issue(&self, imp: Impl, mode: Mode, bytes: usize) -> anyhow::Result<()> {
        let (a, b, g) = (
            self.a.device_ptr(),
            self.b.device_ptr(),
            self.g.device_ptr(),
        );
        let s = self.stream.raw();
        let peer = 1 - self.rank;
        let half = bytes / 2;
        match imp {
            // SAFETY (all raw arms): the buffers are this context's device
            // memory, sized for `max` (a, b) and `2 * max` (g) bytes, and
            // `bytes <= max`; the stream is this rank's live stream.
            Impl::Raw(op) => match op {
                Collective::AllReduce => {
                    // SAFETY: see above.
                    unsafe {
                        self.raw
                            .all_reduce_raw(a, a, half, DataType::Bfloat16, ReduceOp::Sum, s)?
                    }
                }
                Collective::AllGather => {
                    // SAFETY: see above; g holds `bytes`.
                    unsafe {
                        self.raw
                            .all_gather_raw(a, g, bytes / 2, DataType::Uint8, s)?
                    }
                }
                Collective::ReduceScatter => {
                    // SAFETY: see above; g holds `bytes`, b half of it.
                    unsafe {
                        self.raw.reduce_scatter_raw(
                            g,
                            b,
                            bytes / 4,
                            DataType::Bfloat16,
                            ReduceOp::Sum,
                            s,
                        )?
                    }
                }
                Collective::Broadcast => {
                    // SAFETY: see above.
                    unsafe { self.raw.broadcast_raw(a, a, bytes, DataType::Uint8, 0, s)? };
                    self.stream.wait_until_idle(WAIT)?;
                }
                Collective::SendRecv => {
                    let group = Group::start()?;
                    // SAFETY: see above.
                    unsafe {
                        self.raw.send_raw(a, bytes, DataType::Uint8, peer, s)?;
                        self.raw.recv_raw(b, bytes, DataType::Uint8, peer, s)?;
                    }
                    group.end()?;
                }
            },
            // SAFETY (all backend arms): as above; the streams are this
            // backend's context's (each backend has its own context handle
            // for the same device, and the primary-context model makes them
            // one context).
            Impl::Backend(op, w) => {
                let be = self.backend(w);
                let (u8s, bf) = (DataType::Uint8, DataType::Bfloat16);
                // SAFETY: see above: each view lies inside its buffer.
                let m = |p: u64, n: usize, t| unsafe { DeviceViewMut::from_raw(p, n, t) };
                // SAFETY: as above.
                let v = |p: u64, n: usize, t| unsafe { DeviceView::from_raw(p, n, t) };
                // SAFETY: this rank's live stream, alive while `self` is.
                let st = unsafe { StreamRef::from_raw(s) };
                match op {
                    Collective::AllReduce => match mode {
                        Mode::Eager => be.all_reduce(m(a, half, bf))?,
                        Mode::Graph => be.all_reduce_async(m(a, half, bf), st)?,
                    },
                    // g holds `bytes`: both ranks' halves.
                    Collective::AllGather => {
                        be.all_gather(v(a, bytes / 2, u8s), m(g, bytes, u8s))?
                    }
                    Collective::ReduceScatter => {
                        be.reduce_scatter(v(g, bytes / 2, bf), m(b, bytes / 4, bf))?
                    }
                    Collective::Broadcast => be.broadcast(m(a, bytes, u8s), 0)?,
                    Collective::SendRecv => {
                        be.group_start()?;
                        let r = be
                            .send_to(v(a, bytes, u8s), peer, st)
                            .and_then(|()| be.recv_from(m(b, bytes, u8s), peer, st));
                        be.group_end()?;
                        r?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Rewrites the first `bytes` of `a` (all of it for `usize::MAX`) with
    /// this rank's random data; the copy has landed when this returns.
    fn refill(&mut self, bytes: usize) -> anyhow::Result<()> {
        let n = (bytes / 2).clamp(1, self.a.len());
        self.a.copy_prefix_from_host(&self.host[..n])?;
        Ok(())
    }
}

fn iters_for(bytes: usize) -> usize {
    match bytes {
        0..=0x100_0000 => 50,
        0x100_0001..=0x800_0000 => 20,
        _ => 5,
    }
}

/// Measures one implementation at one size: warm-up, then trials; returns
/// rank 0's (and rank 1's) per-op trial times.
fn measure(
    r: &mut Rank,
    opts: &Opts,
    meet: &Meet,
    mode: Mode,
    bytes: usize,
    imp: Impl,
) -> anyhow::Result<Sample> {
    let iters = iters_for(bytes);
    let stream_raw = r.op_stream(imp, mode);
    r.ctx.make_current()?;
    // SAFETY: `stream_raw` is a live stream of this rank's context (ours or
    // a backend's), which outlives this borrowed wrapper.
    let stream = unsafe { Stream::borrowed(&r.ctx, stream_raw as cuda_sys::CUstream) };
    // `GPU_BENCH_TRACE=1`: a line per step on stderr (unbuffered), so a
    // crash shows where it happened.
    let trace = |what: &str| {
        if std::env::var_os("GPU_BENCH_TRACE").is_some() {
            eprintln!(
                "gpu-bench: rank {} {} {imp:?} {}: {what}",
                r.rank,
                mode.name(),
                human_bytes(bytes)
            );
        }
    };
    let graph = if mode == Mode::Graph {
        // Capture `iters` operations on our stream.
        r.stream.wait_until_idle(WAIT)?;
        meet.wait(2)?;
        trace("begin capture");
        r.stream.begin_capture()?;
        let issued = (0..iters).try_for_each(|_| r.issue(imp, mode, bytes));
        trace("end capture");
        let g = r.stream.end_capture();
        issued.context("issuing under capture")?;
        trace("instantiate");
        Some(g?.instantiate()?)
    } else {
        None
    };
    let run_once = |r: &Rank| -> anyhow::Result<()> {
        match &graph {
            Some(exec) => exec.launch(&r.stream)?,
            None => {
                for _ in 0..iters {
                    r.issue(imp, mode, bytes)?;
                }
            }
        }
        Ok(())
    };
    // Warm-up.
    r.refill(bytes)?;
    meet.wait(2)?;
    run_once(r)?;
    stream.wait_until_idle(WAIT)?;
    r.stream.wait_until_idle(WAIT)?;
    let mut trials = Vec::with_capacity(opts.trials);
    for _ in 0..opts.trials {
        r.refill(bytes)?;
        meet.wait(2)?;
        r.start.record(&stream)?;
        run_once(r)?;
        r.stop.record(&stream)?;
        r.stop.wait_with_deadline(WAIT)?;
        let ms = r.stop.elapsed_ms(&r.start)?;
        trials.push(f64::from(ms) * 1000.0 / iters as f64);
    }
    r.stream.wait_until_idle(WAIT)?;
    drop(graph);
    Sample::new(trials).context("no valid trial time")
}

/// Host time per call, both ranks calling at once as in the sweep: an
/// eager 8 B all-reduce and grouped send/recv, raw and through the
/// `Never` backend (`CALLS` issued back to back, then waited for), and the
/// calls each backend submission adds: `cuEventRecord` (the completion
/// event), `cuEventQuery` (the watchdog's poll), `ncclCommGetAsyncError`,
/// `cuStreamIsCapturing` (operations on a caller stream).
fn host_costs(r: &Rank, opts: &Opts, meet: &Meet) -> anyhow::Result<Vec<(&'static str, Sample)>> {
    const CALLS: usize = 50;
    const MICRO: usize = 1000;
    let ops: [(&'static str, Impl); 4] = [
        ("raw all_reduce 8 B", Impl::Raw(Collective::AllReduce)),
        (
            "backend all_reduce 8 B",
            Impl::Backend(Collective::AllReduce, Which::Never),
        ),
        ("raw send/recv 8 B", Impl::Raw(Collective::SendRecv)),
        (
            "backend send/recv 8 B",
            Impl::Backend(Collective::SendRecv, Which::Never),
        ),
    ];
    r.ctx.make_current()?;
    let mut rows = Vec::new();
    for (what, imp) in ops {
        let stream_raw = r.op_stream(imp, Mode::Eager);
        // SAFETY: `stream_raw` is a live stream of this rank's context (ours
        // or a backend's), which outlives this borrowed wrapper.
        let stream = unsafe { Stream::borrowed(&r.ctx, stream_raw as cuda_sys::CUstream) };
        let sample = host_trials(
            opts,
            meet,
            CALLS,
            || r.issue(imp, Mode::Eager, 8),
            || {
                stream.wait_until_idle(WAIT)?;
                if let Impl::Backend(_, w) = imp {
                    r.backend(w).synchronize()?;
                }
                Ok(())
            },
        )?;
        rows.push((what, sample));
    }
    let event = Event::new(&r.ctx, false)?;
    r.stream.wait_until_idle(WAIT)?;
    let micro: [(&'static str, &dyn Fn() -> anyhow::Result<()>); 4] = [
        ("cuEventRecord (idle stream)", &|| {
            Ok(event.record(&r.stream)?)
        }),
        ("cuEventQuery (completed event)", &|| {
            event.query()?;
            Ok(())
        }),
        ("ncclCommGetAsyncError", &|| Ok(r.raw.async_error()?)),
        ("cuStreamIsCapturing", &|| {
            r.stream.is_capturing()?;
            Ok(())
        }),
    ];
    for (what, call) in micro {
        let sample = host_trials(opts, meet, MICRO, call, || {
            Ok(r.stream.wait_until_idle(WAIT)?)
        })?;
        rows.push((what, sample));
    }
    Ok(rows)
}

/// Host time per call of `call`, made `calls` times back to back with the
/// other rank doing the same: a warm-up trial, then `opts.trials` timed
/// ones; `settle` waits for the trial's work, untimed.
fn host_trials(
    opts: &Opts,
    meet: &Meet,
    calls: usize,
    call: impl Fn() -> anyhow::Result<()>,
    settle: impl Fn() -> anyhow::Result<()>,
) -> anyhow::Result<Sample> {
    let mut trials = Vec::with_capacity(opts.trials);
    for trial in 0..=opts.trials {
        meet.wait(2)?;
        let t = std::time::Instant::now();
        for _ in 0..calls {
            call()?;
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / calls as f64;
        settle()?;
        if trial > 0 {
            trials.push(us);
        }
    }
    Sample::new(trials).context("no valid trial time")
}

fn host_table(rows: &[(&'static str, Sample)]) -> String {
    let mut s = String::from(
        "| call | host µs per call (rank 0 median) | min | noise % |\n|---|---:|---:|---:|\n",
    );
    for (what, sample) in rows {
        s.push_str(&format!(
            "| {what} | {:.3} | {:.3} | {:.1} |\n",
            sample.median(),
            sample.min(),
            sample.noise() * 100.0
        ));
    }
    s
}

/// Checks every all-reduce variant once at a few sizes against a host
/// reference, every element; returns the failures found.
fn verify_all_reduce(r: &mut Rank, opts: &Opts, meet: &Meet) -> anyhow::Result<Vec<String>> {
    let mut failures = Vec::new();
    let sizes = [opts.min.max(8) & !1, 3 << 20, 40 << 20]
        .into_iter()
        .filter(|&b| b <= opts.max);
    // A prefix of the peer's data (same seed, same draws).
    let peer_host = random_host((40 << 20) / 2, 0x5eed + (1 - r.rank) as u64);
    for bytes in sizes {
        let n = bytes / 2;
        let want: Vec<f32> = (0..n)
            .map(|i| r.host[i].to_f32() + peer_host[i].to_f32())
            .collect();
        for imp in [
            Impl::Raw(Collective::AllReduce),
            Impl::Backend(Collective::AllReduce, Which::Never),
            Impl::Backend(Collective::AllReduce, Which::Always),
            Impl::Backend(Collective::AllReduce, Which::OneShot),
            Impl::Backend(Collective::AllReduce, Which::Auto),
        ] {
            if matches!(imp, Impl::Backend(_, Which::OneShot))
                && r.oneshot.one_shot_unavailable().is_some()
            {
                continue;
            }
            // In place: the input is this rank's data, and every peer value
            // is non-zero, so an element the operation did not write fails.
            // The whole buffer: the check below reads past the payload.
            r.refill(usize::MAX)?;
            meet.wait(2)?;
            r.issue(imp, Mode::Eager, bytes)?;
            r.stream.wait_until_idle(WAIT)?;
            if let Impl::Backend(_, w) = imp {
                r.backend(w).synchronize()?;
            }
            let mut got = vec![bf16::from_f32(f32::NAN); r.a.len()];
            r.a.copy_to_host(&mut got)?;
            // Past the payload nothing may change.
            if let Some(i) = (n..got.len()).find(|&i| got[i].to_bits() != r.host[i].to_bits()) {
                failures.push(format!(
                    "{imp:?} at {}: element {i}, past the payload, changed",
                    human_bytes(bytes)
                ));
            }
            let wrong = (0..n).filter(|&i| got[i].to_f32() != want[i]).count();
            if let Some(i) = (0..n).find(|&i| got[i].to_f32() != want[i]) {
                failures.push(format!(
                    "{imp:?} at {}: {wrong} of {n} elements wrong, first {i}: {} (expected {}, own {})",
                    human_bytes(bytes),
                    got[i],
                    want[i],
                    r.host[i]
                ));
            }
        }
    }
    Ok(failures)
}
