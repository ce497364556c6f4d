//! The fused all-reduce + residual add + RMSNorm on one GPU (criterion):
//! `k` = 2, 4 and 8 ranks simulated on device 0
//! (`comm_suite::one_shot_local`), each rank's kernels on its own stream,
//! bf16, hidden 4096 and 8192 x tokens 1, 8, 32 and 128, side by side in
//! one run:
//! - `norm_local/{mode}/k{k}/fused`: the fused one-shot kernel
//!   (`bf16_one_shot_add_rms_norm`), one block a row;
//! - `.../fused_cluster` (devices of compute capability 9.0 and newer): the
//!   fused kernel as the backend launches it there with
//!   `METRALE_COMM_FUSED_CLUSTER=on`, a row spread over a
//!   thread block cluster (`bf16_one_shot_add_rms_norm_cluster`, cluster
//!   size `norm::fused_cluster_size`) up to 16 rows, the plain fused
//!   kernel from 32;
//! - `.../one_shot`: the plain one-shot all-reduce alone;
//! - `.../one_shot+norm`: the plain one-shot, then the separate add + norm
//!   kernel (`bf16_add_rms_norm`) on the same stream;
//! - `norm_local/{mode}/norm`: the separate kernel alone, one launch on
//!   one stream, with criterion's throughput the bytes it must move
//!   (x and the residual read, both written, the weight read: `4 n + h`
//!   values), so the report gives its bandwidth;
//! - `norm_local/{mode}/copy`: the anchor for that bandwidth, the
//!   driver's device-to-device copy (`cuMemcpyDtoDAsync`) of half those
//!   bytes (a copy reads and writes each), on the same stream, so the
//!   kernel's figure can be read beside what the device does with the same
//!   traffic at the same size;
//!
//! `mode` is `eager` (the host launches every rank's kernels per call) or
//! `graph` (graphs of [`GRAPH_CALLS`] calls per rank, replayed: the GPU's
//! time per call). The targets (fused at most 1.15x the one-shot;
//! at least 1.4x faster than one-shot + norm up to 32 tokens; the separate
//! kernel at >= 70 % of the device's bandwidth at 128 x 8192) are read off
//! this table (docs/benchmarks.md).
//!
//! `METRALE_ONE_SHOT_PTX=FILE` (the fused and plain one-shot kernels),
//! `METRALE_ONE_SHOT_SM90_PTX=FILE` (the fused cluster kernels) and
//! `METRALE_NORM_PTX=FILE` (the separate kernel) load the kernels from
//! `FILE` instead of the committed PTX: a change to the kernels compiled
//! with `cargo xtask ptx` can be timed against the committed ones in one
//! run on a box without Rust.
//!
//! `METRALE_NORM_PDL=1` launches the separate kernel (alone and after the
//! one-shot) as a programmatic dependent launch
//! (`norm::launch_add_rms_norm_programmatic`): only with a `METRALE_NORM_PTX`
//! build that waits for the kernel before it, the sm_90 variant
//! `add_rms_norm_sm90-pdl.ptx` (the bundle's `run.sh --norm-variants`
//! passes both).
//!
//! `METRALE_NORM_LOCAL_NO_CHECK=1` skips the check below: for timing probes,
//! kernels built to compute something else (a phase left out) to see what
//! that phase costs; their numbers say nothing of a correct kernel.
//!
//! Invariants: every (k, shape) starts with one call of each fused kernel, and of the
//! one-shot + separate kernel, checked against the host reference bit for bit on every
//! rank, and the separate kernel alone with three chained calls, eager and in a graph
//! (unless the check is skipped, as above); timed calls run in place
//! (the GPU's time does not depend on the values); every wait is bounded;
//! without a CUDA driver it prints one line and exits 0.

use std::time::{Duration, Instant};

use comm_suite::data::{check, random_vec};
use comm_suite::one_shot_local::{
    LANE_EAGER, LANE_GRAPH, LocalOneShot, launch_separate_norm, norm_pdl,
};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use metrale_comm::kernels::{self, OneShotElement};
use metrale_comm::norm::{self, NormArgs};
use nccl_safe::{Context, DeviceBuffer, Function, GraphExec, Module, Stream};

/// Calls per rank in one captured graph.
const GRAPH_CALLS: u64 = 20;
/// The slot: 128 x 8192 bf16 values.
const SLOT_BYTES: usize = 2 << 20;
const HIDDEN: [usize; 2] = [4096, 8192];
const TOKENS: [usize; 4] = [1, 8, 32, 128];
const EPS: f32 = 1e-6;
const WAIT: Duration = Duration::from_secs(60);

/// The kernels of one call.
#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Fused,
    FusedCluster,
    OneShot,
    OneShotNorm,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Fused => "fused",
            Variant::FusedCluster => "fused_cluster",
            Variant::OneShot => "one_shot",
            Variant::OneShotNorm => "one_shot+norm",
        }
    }
}

struct Kernels {
    fused: Function,
    /// The cluster entry, on devices that launch clusters.
    cluster: Option<(Function, Module)>,
    plain: Function,
    norm: Function,
    _m: (Module, Module),
}

/// Per rank its residual, and the weight.
struct Rows {
    residual: Vec<DeviceBuffer<bf16>>,
    weight: DeviceBuffer<bf16>,
}

fn args(g: &LocalOneShot<bf16>, t: &Rows, r: usize, hidden: usize, rows: usize) -> NormArgs {
    NormArgs {
        x: g.data_ptr(r),
        residual: t.residual[r].device_ptr(),
        weight: t.weight.device_ptr(),
        hidden,
        rows,
        eps: EPS,
        dtype: nccl_safe::DataType::Bfloat16,
    }
}

/// One call of `v` on rank `r`'s stream (`s`, or the rank's own).
fn call(
    g: &LocalOneShot<bf16>,
    k: &Kernels,
    t: &Rows,
    (r, v, lane): (usize, Variant, u32),
    (hidden, rows): (usize, usize),
) {
    let s = g.stream(r).raw();
    let a = args(g, t, r, hidden, rows);
    // SAFETY: every kernel is of this context and of bf16; the control
    // block is rank `r`'s with live receive buffers; x holds a slot of
    // values (`rows * hidden` fit one), the residual and weight `rows *
    // hidden` and `hidden`; all outlive the work (every stream is waited
    // for before they drop).
    unsafe {
        match v {
            Variant::Fused => norm::launch_fused(&k.fused, g.ctrl_ptr(r), a, lane, s),
            Variant::FusedCluster => match &k.cluster {
                Some((f, _)) if norm::fused_cluster_size(hidden, rows, a.dtype) > 1 => {
                    norm::launch_fused_cluster(f, g.ctrl_ptr(r), a, lane, s)
                }
                _ => norm::launch_fused(&k.fused, g.ctrl_ptr(r), a, lane, s),
            },
            Variant::OneShot | Variant::OneShotNorm => kernels::launch_one_shot(
                &k.plain,
                g.ctrl_ptr(r),
                a.x,
                (rows * hidden, a.dtype),
                lane,
                s,
            )
            .and_then(|()| {
                if v == Variant::OneShotNorm {
                    launch_separate_norm(&k.norm, a, s)
                } else {
                    Ok(())
                }
            }),
        }
    }
    .expect("launch");
}

fn norm_local(c: &mut Criterion) {
    if let Err(e) = nccl_safe::device_count() {
        println!("norm_local: no CUDA driver ({e}); nothing to measure");
        return;
    }
    let ctx = Context::new(0).expect("device 0");
    // The driver compiles PTX at a module's load (a backend's first, or
    // every one with CUDA_CACHE_DISABLE=1): its time is printed, not
    // benched.
    let os_ptx =
        metrale_benches::ptx_or("norm_local", "METRALE_ONE_SHOT_PTX", kernels::ONE_SHOT_PTX);
    let t = std::time::Instant::now();
    let m1 = Module::load_ptx(&ctx, &os_ptx).expect("the one-shot PTX");
    let os_load = t.elapsed();
    let norm_ptx =
        metrale_benches::ptx_or("norm_local", "METRALE_NORM_PTX", norm::ADD_RMS_NORM_PTX);
    let t = std::time::Instant::now();
    let m2 = Module::load_ptx(&ctx, &norm_ptx).expect("the norm PTX");
    println!(
        "norm_local: module loads: the one-shot PTX ({} KB) {:.1} ms, the norm PTX ({} KB) {:.1} ms \
         (CUDA_CACHE_DISABLE={})",
        os_ptx.len() / 1000,
        os_load.as_secs_f64() * 1e3,
        norm_ptx.len() / 1000,
        t.elapsed().as_secs_f64() * 1e3,
        std::env::var("CUDA_CACHE_DISABLE").unwrap_or_default()
    );
    let dt = nccl_safe::DataType::Bfloat16;
    let cluster = match nccl_safe::driver::supports_cluster_launch(0) {
        Ok(true) => {
            let ptx = metrale_benches::ptx_or(
                "norm_local",
                "METRALE_ONE_SHOT_SM90_PTX",
                kernels::ONE_SHOT_SM90_PTX,
            );
            let t = std::time::Instant::now();
            let m = Module::load_ptx(&ctx, &ptx).expect("the sm_90 one-shot PTX");
            println!(
                "norm_local: module load: the sm_90 one-shot PTX ({} KB) {:.1} ms",
                ptx.len() / 1000,
                t.elapsed().as_secs_f64() * 1e3
            );
            let f = m
                .function(norm::fused_cluster_name(dt).unwrap_or_default())
                .expect("fused cluster");
            Some((f, m))
        }
        other => {
            println!(
                "norm_local: no cluster launch on device 0 ({other:?}); no fused_cluster rows"
            );
            None
        }
    };
    let k = Kernels {
        cluster,
        fused: m1
            .function(norm::fused_one_shot_name(dt).unwrap_or_default())
            .expect("fused"),
        plain: m1.function(kernels::BF16_ONE_SHOT_NAME).expect("one-shot"),
        norm: m2
            .function(norm::add_rms_norm_name(dt).unwrap_or_default())
            .expect("norm"),
        _m: (m1, m2),
    };
    if norm_pdl() {
        println!("norm_local: METRALE_NORM_PDL=1: the separate kernel launches programmatically");
    }
    let check = std::env::var_os("METRALE_NORM_LOCAL_NO_CHECK").is_none();
    if !check {
        println!("norm_local: METRALE_NORM_LOCAL_NO_CHECK is set: results are not checked");
    }
    for ranks in [2usize, 4, 8] {
        let mut g = LocalOneShot::<bf16>::new(&ctx, ranks, SLOT_BYTES, Duration::from_secs(30))
            .expect("buffers");
        let mut t = Rows {
            residual: (0..ranks)
                .map(|_| DeviceBuffer::<bf16>::alloc(&ctx, SLOT_BYTES / 2).expect("residual"))
                .collect(),
            weight: DeviceBuffer::from_host(&ctx, &vec![bf16::from_f32(0.75); 8192])
                .expect("weight"),
        };
        for mode in ["eager", "graph"] {
            for v in [
                Variant::Fused,
                Variant::FusedCluster,
                Variant::OneShot,
                Variant::OneShotNorm,
            ] {
                if v == Variant::FusedCluster && k.cluster.is_none() {
                    continue;
                }
                let mut group =
                    c.benchmark_group(format!("norm_local/{mode}/k{ranks}/{}", v.name()));
                for hidden in HIDDEN {
                    for tokens in TOKENS {
                        let shape = (hidden, tokens);
                        if check
                            && matches!(
                                v,
                                Variant::Fused | Variant::FusedCluster | Variant::OneShotNorm
                            )
                            && mode == "eager"
                        {
                            check_first(&mut g, &k, &mut t, v, shape);
                        }
                        let id = BenchmarkId::from_parameter(format!("{tokens}x{hidden}"));
                        group.throughput(Throughput::Bytes((hidden * tokens * 2) as u64));
                        if mode == "eager" {
                            group.bench_function(id, |b| {
                                b.iter_custom(|iters| {
                                    let t0 = Instant::now();
                                    for _ in 0..iters {
                                        for r in 0..ranks {
                                            call(&g, &k, &t, (r, v, LANE_EAGER), shape);
                                        }
                                    }
                                    g.wait().expect("wait");
                                    t0.elapsed()
                                })
                            });
                        } else {
                            let execs = capture(&g, &k, &t, v, shape);
                            group.bench_function(id, |b| {
                                b.iter_custom(|iters| replay(&g, &execs, iters))
                            });
                        }
                    }
                }
                group.finish();
            }
        }
    }
    norm_alone(c, &ctx, &k, check);
}

/// One fused call (`v`) on every rank, checked against the host reference.
fn check_first(
    g: &mut LocalOneShot<bf16>,
    k: &Kernels,
    t: &mut Rows,
    v: Variant,
    (hidden, rows): (usize, usize),
) {
    let n = hidden * rows;
    let inputs = g.fill(0x0e0 + n as u64, n).expect("fill");
    let res0: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32((i % 13) as f32 / 4.0 - 1.5))
        .collect();
    for r in &mut t.residual {
        r.copy_prefix_from_host(&res0).expect("residual");
    }
    for r in 0..g.ranks() {
        call(g, k, t, (r, v, LANE_EAGER), (hidden, rows));
    }
    g.wait().expect("wait");
    let sum = kernels::one_shot_sum(&inputs).expect("sum");
    let mut want_r = res0;
    let w = vec![bf16::from_f32(0.75); hidden];
    let want_x = norm::add_rms_norm_reference(&sum, &mut want_r, &w, EPS);
    for r in 0..g.ranks() {
        let x = g.output(r).expect("x");
        let res = t.residual[r].to_host_vec().expect("residual");
        assert!(
            (0..n).all(|i| x[i].to_bits32() == want_x[i].to_bits32()
                && res[i].to_bits32() == want_r[i].to_bits32()),
            "rank {r}: the {} call at {rows} x {hidden} differs from the reference",
            v.name()
        );
    }
}

/// Per rank, a graph of [`GRAPH_CALLS`] calls of `v` on lane 1.
fn capture(
    g: &LocalOneShot<bf16>,
    k: &Kernels,
    t: &Rows,
    v: Variant,
    shape: (usize, usize),
) -> Vec<GraphExec> {
    (0..g.ranks())
        .map(|r| {
            let s = g.stream(r);
            s.begin_capture().expect("capture");
            for _ in 0..GRAPH_CALLS {
                call(g, k, t, (r, v, LANE_GRAPH), shape);
            }
            s.end_capture()
                .expect("end capture")
                .instantiate()
                .expect("instantiate")
        })
        .collect()
}

fn replay(g: &LocalOneShot<bf16>, execs: &[GraphExec], iters: u64) -> Duration {
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

/// The separate kernel alone, one stream, eager and in graphs (checked
/// first, when `check`).
fn norm_alone(c: &mut Criterion, ctx: &std::sync::Arc<Context>, k: &Kernels, check: bool) {
    let n = 128 * 8192;
    let x = DeviceBuffer::from_host(ctx, &vec![bf16::from_f32(0.5); n]).expect("x");
    let r = DeviceBuffer::from_host(ctx, &vec![bf16::from_f32(0.25); n]).expect("residual");
    let w = DeviceBuffer::from_host(ctx, &vec![bf16::from_f32(0.75); 8192]).expect("weight");
    let s = Stream::new(ctx).expect("stream");
    if check {
        check_chain(ctx, &s, k);
    }
    let launch = |hidden: usize, rows: usize| {
        let a = NormArgs {
            x: x.device_ptr(),
            residual: r.device_ptr(),
            weight: w.device_ptr(),
            hidden,
            rows,
            eps: EPS,
            dtype: nccl_safe::DataType::Bfloat16,
        };
        // SAFETY: the buffers hold 128 x 8192 values and a row of weight,
        // and outlive the work (waited for below); the stream is live.
        unsafe { launch_separate_norm(&k.norm, a, s.raw()) }.expect("launch");
    };
    // The anchor: the driver's device-to-device copy of half the bytes the
    // kernel moves (a copy reads and writes each byte), same stream.
    let copy_max = (4 * 128 + 1) * 8192;
    let src = DeviceBuffer::<u8>::alloc(ctx, copy_max).expect("copy source");
    let dst = DeviceBuffer::<u8>::alloc(ctx, copy_max).expect("copy target");
    let copy = |hidden: usize, tokens: usize| {
        let bytes = (4 * tokens + 1) * hidden;
        // SAFETY: both buffers are device memory of `ctx` holding
        // `copy_max >= bytes` bytes, apart, and outlive the copy (waited
        // for below); the stream is live.
        unsafe {
            nccl_safe::copy_device_async(ctx, dst.device_ptr(), src.device_ptr(), bytes, s.raw())
        }
        .expect("copy");
    };
    for mode in ["eager", "graph"] {
        for (what, work) in [("copy", &copy as &dyn Fn(usize, usize)), ("norm", &launch)] {
            let mut group = c.benchmark_group(format!("norm_local/{mode}/{what}"));
            for hidden in HIDDEN {
                for tokens in TOKENS {
                    let id = BenchmarkId::from_parameter(format!("{tokens}x{hidden}"));
                    group.throughput(Throughput::Bytes(((4 * tokens + 1) * hidden * 2) as u64));
                    let one = || work(hidden, tokens);
                    one_stream(&mut group, id, mode == "graph", &s, &one);
                }
            }
            group.finish();
        }
    }
}

/// Three chained calls of the separate kernel at 128 x 8192 (each reads
/// what the one before wrote), eagerly and then as one graph replayed
/// once, against the host reference bit for bit: the timed chains' order,
/// a programmatic launch's wait included.
fn check_chain(ctx: &std::sync::Arc<Context>, s: &Stream, k: &Kernels) {
    const ROWS: usize = 128;
    const HIDDEN: usize = 8192;
    let n = ROWS * HIDDEN;
    let x0 = random_vec::<bf16>(0xc4a1, 0, 1, n);
    let r0 = random_vec::<bf16>(0xc4a1, 0, 2, n);
    let w0 = random_vec::<bf16>(0xc4a1, 0, 3, HIDDEN);
    let mut x = DeviceBuffer::<bf16>::alloc(ctx, n).expect("x");
    let mut r = DeviceBuffer::<bf16>::alloc(ctx, n).expect("residual");
    let w = DeviceBuffer::from_host(ctx, &w0).expect("weight");
    let a = NormArgs {
        x: x.device_ptr(),
        residual: r.device_ptr(),
        weight: w.device_ptr(),
        hidden: HIDDEN,
        rows: ROWS,
        eps: EPS,
        dtype: nccl_safe::DataType::Bfloat16,
    };
    let three = || {
        for _ in 0..3 {
            // SAFETY: the buffers hold ROWS x HIDDEN values and a row of
            // weight and outlive the work (waited for below); the stream
            // is live.
            unsafe { launch_separate_norm(&k.norm, a, s.raw()) }.expect("launch");
        }
    };
    for graph in [false, true] {
        x.copy_from_host(&x0).expect("x");
        r.copy_from_host(&r0).expect("residual");
        if graph {
            s.begin_capture().expect("capture");
            three();
            let exec = s
                .end_capture()
                .expect("end")
                .instantiate()
                .expect("instantiate");
            exec.launch(s).expect("replay");
            s.wait_until_idle(WAIT).expect("wait");
        } else {
            three();
            s.wait_until_idle(WAIT).expect("wait");
        }
        let (mut want_x, mut want_r) = (x0.clone(), r0.clone());
        for _ in 0..3 {
            want_x = norm::add_rms_norm_reference(&want_x, &mut want_r, &w0, EPS);
        }
        let mode = if graph { "graph" } else { "eager" };
        for (what, got, want) in [("x", &x, &want_x), ("residual", &r, &want_r)] {
            let got = got.to_host_vec().expect(what);
            check(
                &format!("the separate kernel's three chained calls ({mode}): {what}"),
                &got,
                want,
                true,
                1,
            )
            .expect("the separate kernel's chained calls");
        }
    }
}

/// Benchmarks `one` (work enqueued on `s`) as `id`: eagerly, `iters`
/// calls then one wait; or in graphs of [`GRAPH_CALLS`] calls, replayed.
fn one_stream(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    id: BenchmarkId,
    graph: bool,
    s: &Stream,
    one: &dyn Fn(),
) {
    if !graph {
        group.bench_function(id, |b| {
            b.iter_custom(|iters| {
                let t0 = Instant::now();
                for _ in 0..iters {
                    one();
                }
                s.wait_until_idle(WAIT).expect("wait");
                t0.elapsed()
            })
        });
        return;
    }
    s.begin_capture().expect("capture");
    for _ in 0..GRAPH_CALLS {
        one();
    }
    let exec = s
        .end_capture()
        .expect("end")
        .instantiate()
        .expect("instantiate");
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let launches = iters.div_ceil(GRAPH_CALLS);
            let t0 = Instant::now();
            for _ in 0..launches {
                exec.launch(s).expect("replay");
            }
            s.wait_until_idle(WAIT).expect("wait");
            t0.elapsed()
                .mul_f64(iters as f64 / (launches * GRAPH_CALLS) as f64)
        })
    });
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
        targets = norm_local
    }
}
criterion_main!(group::benches);
