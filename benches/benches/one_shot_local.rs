//! The one-shot kernels' own cost on one GPU (criterion): `k` = 2, 4 and 8
//! ranks simulated on device 0 (`comm_suite::one_shot_local`), each rank's
//! kernel on its own stream, per call at 8 B to 1 MiB, eager (the host
//! launches every rank's kernel per call) and in replayed graphs of
//! [`GRAPH_CALLS`] calls per rank (the GPU's time per call), in bf16, each
//! call alone (`graph/k{k}`) and bracketed by the external event wait and
//! record that order the backend's captured one-shots by launch
//! (`graph_serial/k{k}`, decision 0017); the
//! f16 and f32 kernels in replayed graphs at `k` = 2
//! (`one_shot_local/graph_f16/k2`, `graph_f32/k2`); and, as the
//! floor of a replayed call, `one_shot_local/graph/floor`: one 8-value
//! `bf16_add_inplace` per rank per call, in the same graphs on the same
//! two streams. It shows the
//! kernel's launch, protocol and memory traffic on one GPU's memory, not
//! NVLink: a lower bound on what the path costs across GPUs, and the place
//! to see a change to the kernel itself. NCCL has nothing to compare on one
//! device (it refuses two ranks there); the cross-GPU comparison is the
//! collectives bench's `all_reduce_paths` groups.
//!
//! `METRALE_ONE_SHOT_PTX=FILE` loads the kernels from `FILE` instead of the
//! committed PTX: a change to `one_shot.cu` compiled with `cargo xtask
//! ptx` can be timed against the committed one on a box without Rust.
//!
//! Beside criterion, the path tuner's own timing method
//! (`metrale_comm::timing`) measures the same eager and graph calls; after
//! the run both figures go side by side into `tuner-vs-criterion.md` in
//! criterion's directory (the tuner must read what criterion reads).
//! `METRALE_TUNER_EAGER_TRIALS=15x16,5x64` adds other trial shapes
//! (trials x calls) for the eager calls, each a row of that table;
//! `METRALE_TUNER_REPEATS=21` measures the tuner's own shape 21 times and
//! adds the median of those figures (their range in its label).
//!
//! After the run its table and plot go beside criterion's directory's
//! groups: `one-shot-local.md` and `one-shot-local.svg` in it
//! (`metrale_benches::plots::one_shot_local`, from this run's estimates).
//!
//! Invariants: every (k, size) starts from data checked once against the
//! host reference; timed calls sum in place without refilling (the GPU's
//! time does not depend on the values); every wait is bounded; without a
//! CUDA driver it prints one line and exits 0.

use std::time::{Duration, Instant};

use comm_suite::data::SuiteElem;
use comm_suite::one_shot_local::{LANE_EAGER, LocalOneShot};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use half::{bf16, f16};
use metrale_comm::kernels::{self, OneShotElement};
use metrale_comm::timing::{self, Trials};
use nccl_safe::{Context, DeviceBuffer, GraphExec, Module, Stream};

/// Calls per rank in one captured graph.
const GRAPH_CALLS: u64 = 20;
/// The slot (the largest call).
const SLOT_BYTES: usize = 1 << 20;
const SIZES: [usize; 6] = [8, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20];

fn one_shot_local(c: &mut Criterion) {
    if let Err(e) = nccl_safe::device_count() {
        println!("one_shot_local: no CUDA driver ({e}); nothing to measure");
        return;
    }
    if let Ok(d) = nccl_safe::device_info(0) {
        *DEVICE.lock() = d.name;
    }
    let ctx = Context::new(0).expect("device 0");
    let ptx = metrale_benches::ptx_or(
        "one_shot_local",
        "METRALE_ONE_SHOT_PTX",
        kernels::ONE_SHOT_PTX,
    );
    let module = Module::load_ptx(&ctx, &ptx).expect("the one-shot PTX");
    let f = module
        .function(kernels::BF16_ONE_SHOT_NAME)
        .expect("the one-shot entry point");
    for k in [2usize, 4, 8] {
        let mut g = LocalOneShot::<bf16>::new(&ctx, k, SLOT_BYTES, Duration::from_secs(30))
            .expect("buffers");
        let mut eager = c.benchmark_group(format!("one_shot_local/eager/k{k}"));
        for bytes in SIZES {
            let n = bytes / 2;
            let inputs = g.fill(0x1ca1 + k as u64, n).expect("fill");
            g.launch_all(&f, n, LANE_EAGER).expect("launch");
            g.wait().expect("wait");
            g.check("the first call", &inputs).expect("the sum");
            eager.throughput(Throughput::Bytes(bytes as u64));
            eager.bench_with_input(BenchmarkId::from_parameter(bytes), &n, |b, &n| {
                b.iter_custom(|iters| {
                    let t = Instant::now();
                    for _ in 0..iters {
                        g.launch_all(&f, n, LANE_EAGER).expect("launch");
                    }
                    g.wait().expect("wait");
                    t.elapsed()
                })
            });
        }
        eager.finish();
        graphs(c, &format!("one_shot_local/graph/k{k}"), &g, &f, false);
        tuner_method(&ctx, &g, &f, k).expect("the tuner's timing method");
        tuner_ladder_cost(&ctx, &g, &f, k).expect("the tuner's one-shot ladder");
        graphs(
            c,
            &format!("one_shot_local/graph_serial/k{k}"),
            &g,
            &f,
            true,
        );
        if k == 2 {
            let floor_graphs = Floor::new(&ctx, &g).expect("the floor's graphs");
            let mut floor = c.benchmark_group("one_shot_local/graph/floor");
            floor.bench_function("k2", |b| {
                b.iter_custom(|iters| replay(&g, &floor_graphs.execs, iters))
            });
            floor.finish();
        }
    }
    typed_graphs::<f16>(c, &ctx, &module, "graph_f16");
    typed_graphs::<f32>(c, &ctx, &module, "graph_f32");
}

/// The group `name`: graphs of [`GRAPH_CALLS`] calls per rank of `g`,
/// replayed, at every size; `serial`: each call bracketed by the external
/// wait and record the backend puts around a captured one-shot (what
/// ordering replays by launch costs).
fn graphs<T: OneShotElement + SuiteElem>(
    c: &mut Criterion,
    name: &str,
    g: &LocalOneShot<T>,
    f: &nccl_safe::Function,
    serial: bool,
) {
    let mut graph = c.benchmark_group(name);
    for bytes in SIZES {
        let n = bytes / T::DATA_TYPE.size();
        let execs: Vec<_> = (0..g.ranks())
            .map(|r| {
                if serial {
                    g.capture_serial(f, r, n, GRAPH_CALLS as usize)
                } else {
                    g.capture(f, r, n, GRAPH_CALLS as usize)
                }
                .expect("capture")
            })
            .collect();
        graph.throughput(Throughput::Bytes(bytes as u64));
        graph.bench_with_input(BenchmarkId::from_parameter(bytes), &n, |b, _| {
            b.iter_custom(|iters| replay(g, &execs, iters))
        });
    }
    graph.finish();
}

/// `T`'s kernel on 2 ranks, in replayed graphs (`one_shot_local/{group}/k2`),
/// after one call checked against the host reference.
fn typed_graphs<T: OneShotElement + SuiteElem>(
    c: &mut Criterion,
    ctx: &std::sync::Arc<Context>,
    module: &Module,
    group: &str,
) {
    let name = kernels::one_shot_name(T::DATA_TYPE).expect("a one-shot type");
    let f = module.function(name).expect("the one-shot entry point");
    let mut g =
        LocalOneShot::<T>::new(ctx, 2, SLOT_BYTES, Duration::from_secs(30)).expect("buffers");
    let n = g.max_elems();
    let inputs = g.fill(0x1ca1, n).expect("fill");
    g.launch_all(&f, n, LANE_EAGER).expect("launch");
    g.wait().expect("wait");
    g.check("the first call", &inputs).expect("the sum");
    graphs(c, &format!("one_shot_local/{group}/k2"), &g, &f, false);
}

/// The tuner's timing method (`metrale_comm::timing`: device events around
/// a trial, the median of its trials) on the same calls as criterion's
/// `eager/k{k}` and `graph/k{k}` groups, kept for the comparison `main`
/// writes after criterion's run.
fn tuner_method(
    ctx: &std::sync::Arc<Context>,
    g: &LocalOneShot<bf16>,
    f: &nccl_safe::Function,
    k: usize,
) -> anyhow::Result<()> {
    for bytes in SIZES {
        let n = bytes / 2;
        let trials = Trials::for_bytes(bytes);
        let eager = time_eager(ctx, g, f, n, trials)?;
        // Other trial shapes for the eager calls, beside the tuner's own.
        for other in eager_trials_env() {
            let t = time_eager(ctx, g, f, n, other)?;
            println!(
                "one_shot_local: tuner method {}x{}: one_shot_local/eager/k{k}/{bytes}: {:.3} us",
                other.trials,
                other.calls,
                t.as_secs_f64() * 1e6
            );
            TUNER.lock().push((
                format!("one_shot_local/eager/k{k}"),
                bytes,
                format!("{}x{}", other.trials, other.calls),
                t,
            ));
        }
        // The tuner's own shape, measured `METRALE_TUNER_REPEATS` times:
        // the median of its figures (the method's bias) beside criterion,
        // their range (one set-up's spread) in the row's label.
        let repeats = tuner_repeats_env();
        if repeats > 1 {
            let mut runs = (0..repeats)
                .map(|_| time_eager(ctx, g, f, n, trials))
                .collect::<anyhow::Result<Vec<Duration>>>()?;
            runs.sort();
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            let label = format!(
                "{}x{}, median of {repeats} ({:.2}-{:.2})",
                trials.trials,
                trials.calls,
                us(runs[0]),
                us(runs[repeats - 1])
            );
            println!(
                "one_shot_local: tuner method {label}: one_shot_local/eager/k{k}/{bytes}: {:.3} us",
                us(runs[repeats / 2])
            );
            TUNER.lock().push((
                format!("one_shot_local/eager/k{k}"),
                bytes,
                label,
                runs[repeats / 2],
            ));
        }
        let graph = time_graph(ctx, g, f, n, trials)?;
        // Printed as measured too, so a run cut short still shows them.
        for (mode, t) in [("eager", eager), ("graph", graph)] {
            println!(
                "one_shot_local: tuner method: one_shot_local/{mode}/k{k}/{bytes}: {:.3} us",
                t.as_secs_f64() * 1e6
            );
        }
        let mut kept = TUNER.lock();
        let own = |t: Trials| format!("{}x{}", t.trials, t.calls);
        kept.push((
            format!("one_shot_local/eager/k{k}"),
            bytes,
            own(trials),
            eager,
        ));
        kept.push((
            format!("one_shot_local/graph/k{k}"),
            bytes,
            own(trials),
            graph,
        ));
    }
    Ok(())
}

/// What the path tuner's timing of the one-shot path costs at set-up, on
/// `k` simulated ranks: its ladder (8 B by x4 to
/// `AUTO_ONE_SHOT_MAX_BYTES`), each rung timed eagerly and as a captured,
/// instantiated and replayed graph with `Trials::for_bytes`, as
/// `nccl_backend/tune.rs` does; the wall time, printed. NCCL's own rungs
/// (which the tuner times beside it) and the fast path's cannot run on one
/// device.
fn tuner_ladder_cost(
    ctx: &std::sync::Arc<Context>,
    g: &LocalOneShot<bf16>,
    f: &nccl_safe::Function,
    k: usize,
) -> anyhow::Result<()> {
    let top = metrale_comm::config::AUTO_ONE_SHOT_MAX_BYTES.min(SLOT_BYTES);
    let mut rungs: Vec<usize> = std::iter::successors(Some(8usize), |s| Some(s * 4))
        .take_while(|&s| s <= top)
        .collect();
    if rungs.last() != Some(&top) {
        rungs.push(top);
    }
    let (mut eager, mut graph) = (Duration::ZERO, Duration::ZERO);
    for &bytes in &rungs {
        let n = bytes / 2;
        let trials = Trials::for_bytes(bytes);
        let t = Instant::now();
        time_eager(ctx, g, f, n, trials)?;
        eager += t.elapsed();
        let t = Instant::now();
        time_graph(ctx, g, f, n, trials)?;
        graph += t.elapsed();
    }
    println!(
        "one_shot_local: the tuner's one-shot ladder at k{k}: {} rungs, {:.1} ms \
         (eager {:.1} ms, graph capture and timing {:.1} ms)",
        rungs.len(),
        (eager + graph).as_secs_f64() * 1e3,
        eager.as_secs_f64() * 1e3,
        graph.as_secs_f64() * 1e3
    );
    Ok(())
}

/// The tuner's method on `n` values' eager calls of every simulated rank.
fn time_eager(
    ctx: &std::sync::Arc<Context>,
    g: &LocalOneShot<bf16>,
    f: &nccl_safe::Function,
    n: usize,
    trials: Trials,
) -> anyhow::Result<Duration> {
    let streams: Vec<&Stream> = (0..g.ranks()).map(|r| g.stream(r)).collect();
    timing::time_per_call(ctx, &streams, trials, TUNER_WAIT, || {
        (0..trials.calls).try_for_each(|_| g.launch_all(f, n, LANE_EAGER))
    })
}

/// The tuner's method on graphs of `trials.calls` calls of `n` values,
/// one per simulated rank, captured and instantiated here, then replayed.
fn time_graph(
    ctx: &std::sync::Arc<Context>,
    g: &LocalOneShot<bf16>,
    f: &nccl_safe::Function,
    n: usize,
    trials: Trials,
) -> anyhow::Result<Duration> {
    let streams: Vec<&Stream> = (0..g.ranks()).map(|r| g.stream(r)).collect();
    let execs: Vec<GraphExec> = (0..g.ranks())
        .map(|r| g.capture(f, r, n, trials.calls))
        .collect::<anyhow::Result<_>>()?;
    timing::time_per_call(ctx, &streams, trials, TUNER_WAIT, || {
        execs
            .iter()
            .enumerate()
            .try_for_each(|(r, e)| e.launch(g.stream(r)).map_err(anyhow::Error::from))
    })
}

/// The bound of one measurement's host wait.
const TUNER_WAIT: Duration = Duration::from_secs(30);

/// How many times the tuner's own eager shape is measured for the
/// median row (`METRALE_TUNER_REPEATS=21`); 1 (no such row) unless set.
fn tuner_repeats_env() -> usize {
    std::env::var("METRALE_TUNER_REPEATS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(1)
        .clamp(1, 1001)
}

/// Extra trial shapes for the eager calls, `TRIALSxCALLS` separated by
/// commas (`METRALE_TUNER_EAGER_TRIALS=15x16,9x64`): each is measured
/// beside the tuner's own and gets its row in the comparison.
fn eager_trials_env() -> Vec<Trials> {
    std::env::var("METRALE_TUNER_EAGER_TRIALS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|s| {
            let (t, c) = s.trim().split_once('x')?;
            Some(Trials {
                trials: t.parse().ok()?,
                calls: c.parse().ok()?,
            })
        })
        .filter(|t| t.trials > 0 && t.calls > 0)
        .collect()
}

/// The tuner method's figures: (criterion group, bytes, the trials as
/// `TRIALSxCALLS`, time per call).
static TUNER: parking_lot::Mutex<Vec<(String, usize, String, Duration)>> =
    parking_lot::Mutex::new(Vec::new());

/// The tuner method's figures beside criterion's, as a markdown table.
fn tuner_vs_criterion(entries: &[metrale_benches::tables::Entry]) -> String {
    let mut out = String::from(
        "| group | bytes | trials | criterion (us) | tuner method (us) | difference |\n|---|---:|---|---:|---:|---:|\n",
    );
    for (group, bytes, shape, t) in TUNER.lock().iter() {
        // `BenchmarkId::from_parameter(bytes)`: criterion files the size
        // as the function's name, with the throughput beside it.
        let Some(e) = entries
            .iter()
            .find(|e| &e.group == group && e.bytes == Some(*bytes))
        else {
            continue;
        };
        let ours = t.as_secs_f64() * 1e6;
        out.push_str(&format!(
            "| {group} | {bytes} | {shape} | {:.2} | {ours:.2} | {:+.1} % |\n",
            e.time.us,
            (ours / e.time.us - 1.0) * 100.0
        ));
    }
    out
}

/// Replays every rank's graph until `iters` calls ran; the time scaled to
/// `iters` calls.
fn replay<T: OneShotElement + SuiteElem>(
    g: &LocalOneShot<T>,
    execs: &[GraphExec],
    iters: u64,
) -> Duration {
    let launches = iters.div_ceil(GRAPH_CALLS);
    let t = Instant::now();
    for _ in 0..launches {
        for (r, exec) in execs.iter().enumerate() {
            exec.launch(g.stream(r)).expect("replay");
        }
    }
    g.wait().expect("wait");
    t.elapsed()
        .mul_f64(iters as f64 / (launches * GRAPH_CALLS) as f64)
}

/// Per rank stream of a [`LocalOneShot`], a graph of [`GRAPH_CALLS`]
/// launches of the add kernel on 8 values: the cost of one small kernel
/// per call. Fields drop in order: the graphs before what they use.
struct Floor {
    execs: Vec<GraphExec>,
    _module: Module,
    _dst: DeviceBuffer<bf16>,
    _src: DeviceBuffer<bf16>,
}

impl Floor {
    fn new(ctx: &std::sync::Arc<Context>, g: &LocalOneShot<bf16>) -> anyhow::Result<Floor> {
        let module = Module::load_ptx(ctx, kernels::BF16_ADD_PTX)?;
        let add = module.function(kernels::BF16_ADD_NAME)?;
        let dst = DeviceBuffer::<bf16>::from_host(ctx, &[bf16::ONE; 8])?;
        let src = DeviceBuffer::<bf16>::from_host(ctx, &[bf16::ZERO; 8])?;
        let mut execs = Vec::new();
        for r in 0..g.ranks() {
            let s: &Stream = g.stream(r);
            s.begin_capture()?;
            let launched = (0..GRAPH_CALLS).try_for_each(|_| {
                // SAFETY: `add` is the add kernel of this context; both
                // buffers hold 8 values of it and outlive the graphs
                // (fields of the same `Floor`, dropped after them); the
                // stream is live.
                unsafe {
                    kernels::launch_add(
                        ctx,
                        add.raw(),
                        dst.device_ptr(),
                        src.device_ptr(),
                        8,
                        s.raw(),
                    )
                }
            });
            let graph = s.end_capture()?;
            launched?;
            execs.push(graph.instantiate()?);
        }
        Ok(Floor {
            execs,
            _module: module,
            _dst: dst,
            _src: src,
        })
    }
}

fn config() -> Criterion {
    Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
}

/// The criterion group (in a private module: the macro's function is
/// public and undocumented).
mod group {
    use super::*;
    criterion_group! {
        name = benches;
        config = config();
        targets = one_shot_local
    }
}
/// Device 0's name, for the plot's title.
static DEVICE: parking_lot::Mutex<String> = parking_lot::Mutex::new(String::new());

/// Criterion's `main`, then this run's table and plot.
fn main() {
    let started = metrale_benches::tables::RunInfo::now_unix();
    group::benches();
    Criterion::default().configure_from_args().final_summary();
    let device = DEVICE.lock().clone();
    if device.is_empty() {
        return;
    }
    let dir = metrale_benches::tables::criterion_dir();
    let entries = metrale_benches::tables::read_entries(&dir, started.saturating_sub(1), None);
    if let Ok(entries) = &entries {
        let table = tuner_vs_criterion(entries);
        println!("one_shot_local: the tuner's timing method beside criterion\n{table}");
        let path = dir.join("tuner-vs-criterion.md");
        if let Err(e) = std::fs::write(&path, table) {
            eprintln!("one_shot_local: writing {}: {e}", path.display());
        }
    }
    let written = entries.and_then(|entries| {
        let date = bench_plot::date_utc(started);
        metrale_benches::plots::one_shot_local(&entries, &format!("1 × {device}"), &date)
    });
    match written {
        Ok(Some((md, svg))) => {
            for (name, text) in [("one-shot-local.md", md), ("one-shot-local.svg", svg)] {
                let path = dir.join(name);
                match std::fs::write(&path, text) {
                    Ok(()) => println!("one_shot_local: wrote {}", path.display()),
                    Err(e) => eprintln!("one_shot_local: writing {}: {e}", path.display()),
                }
            }
        }
        Ok(None) => {}
        Err(e) => eprintln!("one_shot_local: the table and plot: {e:#}"),
    }
}
