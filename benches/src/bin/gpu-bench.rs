//! `gpu-bench`: the host time per call, which criterion cannot take: an
//! eager 8 B all-reduce (and, on 2 GPUs, a grouped send/recv) issued
//! through raw NCCL and through the backend, the single driver and NCCL
//! calls each backend submission adds (`cuEventRecord`, `cuEventQuery`,
//! `ncclCommGetAsyncError`, `cuStreamIsCapturing`), and one launch of a
//! small kernel (the floor of the fast path's add and of the one-shot).
//!
//! Why not criterion: an issue-only probe must issue a bounded batch (50
//! calls), then wait for the GPU untimed, with every rank issuing at once.
//! Criterion picks the iteration count (thousands for an 8 B operation);
//! that many launches back to back fill the driver's launch queue, and the
//! host then waits for the GPU inside the timed loop, which measures the
//! stream, not the host. The stream time per operation is the collectives
//! bench's (`cargo bench --bench collectives`).
//!
//! One or two ranks, threads of this process, each with its own CUDA
//! context, a raw blocking `Comm` and a `NcclBackend` (`Never`); each trial
//! starts at a barrier of both ranks. Without a CUDA driver or NCCL it
//! prints why and exits 0.
//!
//! Invariants: every number is rank 0's median of `--trials` trials (after
//! one warm-up trial), with the trials' noise; every host wait has a
//! deadline, and a failing rank breaks the barrier for the other.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use half::bf16;
use metrale_benches::Sample;
use metrale_benches::collectives::team::{Meet, WAIT};
use metrale_comm::{BackendConfig, CommBackend, EnqueueMode, FastPathPolicy, NcclBackend, kernels};
use nccl_safe::{
    Comm, Context, DataType, DeviceBuffer, DeviceView, DeviceViewMut, Event, Group, Module,
    ReduceOp, Stream, UniqueId,
};

const HELP: &str = "\
usage: gpu-bench [--host-costs] [--trials N] [--enqueue nonblocking|blocking] [--out FILE]

Host time per call of an eager 8 B operation, raw NCCL and the backend,
and of the driver and NCCL calls each backend submission adds; rank 0's
median of --trials (default 15) trials of 50 calls (1000 for the single
calls). One or two GPUs (send/recv needs two). --host-costs is what it
does and is accepted for older command lines. The stream time of every
collective is the criterion bench: cargo bench -p metrale-benches --bench
collectives. Prints a markdown table, and writes it to --out when given.
";

/// Operations issued back to back per trial.
const CALLS: usize = 50;
/// Single driver or NCCL calls per trial.
const MICRO: usize = 1000;

#[derive(Debug, Clone)]
struct Opts {
    out: Option<PathBuf>,
    trials: usize,
    enqueue: EnqueueMode,
}

fn parse_args() -> anyhow::Result<Option<Opts>> {
    let mut o = Opts {
        out: None,
        trials: 15,
        enqueue: EnqueueMode::default(),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--help" | "-h" => {
                print!("{HELP}");
                return Ok(None);
            }
            "--host-costs" => {}
            "--out" => o.out = Some(PathBuf::from(it.next().context("--out needs a file")?)),
            "--trials" => {
                o.trials = it
                    .next()
                    .context("--trials needs a number")?
                    .parse::<usize>()
                    .context("--trials")?
                    .max(1)
            }
            "--enqueue" => {
                o.enqueue = EnqueueMode::parse(it.next().context("--enqueue needs a mode")?)
                    .map_err(|e| anyhow::anyhow!("--enqueue: {e}"))?
            }
            other => bail!("unknown option `{other}`\n{HELP}"),
        }
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

fn run(opts: &Opts) -> anyhow::Result<()> {
    let count = match nccl_safe::device_count() {
        Ok(n) if n > 0 => n,
        Ok(_) => {
            println!("gpu-bench: no GPU visible; nothing to measure");
            return Ok(());
        }
        Err(e) => {
            println!("gpu-bench: no usable CUDA driver ({e}); nothing to measure");
            return Ok(());
        }
    };
    let world = count.min(2);
    let ids = match (0..2)
        .map(|_| UniqueId::new())
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(ids) => ids,
        Err(e) => {
            println!("gpu-bench: NCCL is not usable ({e}); nothing to measure");
            return Ok(());
        }
    };
    let version = nccl_safe::nccl_version().unwrap_or_else(|e| format!("(version unknown: {e})"));
    println!("gpu-bench: {world} of {count} GPU(s), NCCL {version}");
    let meet = Arc::new(Meet::new(world));
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (meet, ids, opts) = (meet.clone(), ids.clone(), opts.clone());
                scope.spawn(move || {
                    let r = rank_main(rank, world, &ids, &opts, &meet);
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
    let mut rows = None;
    for (rank, r) in results.into_iter().enumerate() {
        let r = r.with_context(|| format!("rank {rank}"))?;
        if rank == 0 {
            rows = Some(r);
        }
    }
    let text = format!(
        "# gpu-bench: host time per call\n\n{world} rank(s) (threads of one process), {} trials, \
         rank 0's median; backends EnqueueMode::{:?}.\n\n{}",
        opts.trials,
        opts.enqueue,
        host_table(&rows.unwrap_or_default())
    );
    println!("{text}");
    if let Some(out) = &opts.out {
        std::fs::write(out, &text).with_context(|| format!("writing {}", out.display()))?;
        println!("gpu-bench: table written to {}", out.display());
    }
    Ok(())
}

/// One rank's objects.
struct Rank {
    rank: usize,
    world: usize,
    ctx: Arc<Context>,
    raw: Comm,
    ours: NcclBackend,
    stream: Stream,
    a: DeviceBuffer<bf16>,
    b: DeviceBuffer<bf16>,
}

/// What a probe issues.
#[derive(Debug, Clone, Copy)]
enum Probe {
    RawAllReduce,
    OursAllReduce,
    RawSendRecv,
    OursSendRecv,
}

impl Rank {
    /// Issues one 8 B operation, eagerly.
    fn issue(&self, p: Probe) -> anyhow::Result<()> {
        let (a, b, s) = (self.a.device_ptr(), self.b.device_ptr(), self.stream.raw());
        let peer = (self.rank + 1) % self.world;
        let bf = DataType::Bfloat16;
        // SAFETY (every arm): `a` and `b` are 4-element bf16 buffers of this
        // context, used for 4 elements at most; `s` is this rank's stream.
        match p {
            // SAFETY: see above.
            Probe::RawAllReduce => unsafe {
                self.raw.all_reduce_raw(a, a, 4, bf, ReduceOp::Sum, s)?
            },
            Probe::OursAllReduce => {
                // SAFETY: see above.
                let view = unsafe { DeviceViewMut::from_raw(a, 4, bf) };
                self.ours.all_reduce(view)?
            }
            Probe::RawSendRecv => {
                let group = Group::start()?;
                // SAFETY: see above.
                unsafe {
                    self.raw.send_raw(a, 4, bf, peer, s)?;
                    self.raw.recv_raw(b, 4, bf, peer, s)?;
                }
                group.end()?;
            }
            Probe::OursSendRecv => {
                // SAFETY: see above.
                let (send, recv) = unsafe {
                    (
                        DeviceView::from_raw(a, 4, bf),
                        DeviceViewMut::from_raw(b, 4, bf),
                    )
                };
                let st = self.stream.as_ref();
                self.ours.group_start()?;
                let r = self
                    .ours
                    .send_to(send, peer, st)
                    .and_then(|()| self.ours.recv_from(recv, peer, st));
                self.ours.group_end()?;
                r?;
            }
        }
        Ok(())
    }

    /// Waits for everything `p` enqueued.
    fn settle(&self, p: Probe) -> anyhow::Result<()> {
        self.stream.wait_until_idle(WAIT)?;
        if matches!(p, Probe::OursAllReduce | Probe::OursSendRecv) {
            self.ours.synchronize()?;
        }
        Ok(())
    }
}

fn rank_main(
    rank: usize,
    world: usize,
    ids: &[UniqueId],
    opts: &Opts,
    meet: &Meet,
) -> anyhow::Result<Vec<(&'static str, Sample)>> {
    let ctx = Context::new(rank)?;
    // Raw NCCL at its best: a blocking communicator, joined within WAIT.
    let raw = Comm::init_rank_with_deadline(&ctx, &ids[0], world, rank, WAIT)
        .and_then(|c| c.into_blocking(WAIT))
        .context("raw communicator")?;
    let config = BackendConfig::new(rank)
        .with_fast_path(FastPathPolicy::Never)
        .with_enqueue(opts.enqueue)
        .with_init_timeout(WAIT)
        .without_env_overrides();
    let ours = NcclBackend::with_unique_id(config, &ids[1], rank, world).context("backend")?;
    let host = vec![bf16::from_f32(1.0); 4];
    let r = Rank {
        rank,
        world,
        stream: Stream::new(&ctx)?,
        a: DeviceBuffer::from_host(&ctx, &host)?,
        b: DeviceBuffer::from_host(&ctx, &host)?,
        ctx,
        raw,
        ours,
    };
    let rows = host_costs(&r, opts, meet);
    if let Err(e) = r.ours.shutdown() {
        tracing::warn!(rank, "backend shutdown: {e}");
    }
    rows
}

/// The table's rows, both ranks calling at once.
fn host_costs(r: &Rank, opts: &Opts, meet: &Meet) -> anyhow::Result<Vec<(&'static str, Sample)>> {
    let mut probes = vec![
        ("raw all_reduce 8 B, issue only", Probe::RawAllReduce),
        ("backend all_reduce 8 B, issue only", Probe::OursAllReduce),
    ];
    if r.world == 2 {
        probes.push(("raw send/recv 8 B, issue only", Probe::RawSendRecv));
        probes.push(("backend send/recv 8 B, issue only", Probe::OursSendRecv));
    }
    r.ctx.make_current()?;
    let mut rows = Vec::new();
    for (what, p) in probes {
        let sample = host_trials(opts, meet, CALLS, || r.issue(p), || r.settle(p))?;
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
    // The floor of every kernel path (the fast path's add, the one-shot):
    // one launch, in batches of CALLS so the driver's queue never fills.
    let module = Module::load_ptx(&r.ctx, kernels::BF16_ADD_PTX)?;
    let add = module.function(kernels::BF16_ADD_NAME)?;
    let launch = || -> anyhow::Result<()> {
        // SAFETY: `add` is the add kernel of this context; both buffers
        // hold 4 values and outlive the trial, which waits for the stream.
        unsafe {
            kernels::launch_add(
                &r.ctx,
                add.raw(),
                r.a.device_ptr(),
                r.b.device_ptr(),
                4,
                r.stream.raw(),
            )
        }?;
        Ok(())
    };
    let sample = host_trials(opts, meet, CALLS, launch, || {
        Ok(r.stream.wait_until_idle(WAIT)?)
    })?;
    rows.push(("cuLaunchKernel (the add kernel, 4 values)", sample));
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
        meet.wait()?;
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
