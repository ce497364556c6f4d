//! `cargo xtask bench`: the GPU benchmarks as a markdown table.
//!
//! It first asks the CUDA driver (through `cuda-sys`) how many GPUs there
//! are; without a driver or GPU it prints one line and exits 2, like
//! `gpu-test`. Otherwise it builds `metrale-benches`' `gpu-bench` binary in
//! release mode and runs it with the remaining options (`--out FILE`,
//! `--crossover`, `--min`, `--max`, `--factor`, `--trials`, `--ops`,
//! `--modes`, `--enqueue`, `--host-costs`),
//! returning its exit code; with one GPU the binary itself says why it
//! measures nothing and exits 0. `--bundle DIR` builds and writes the binary
//! and a `run.sh` to DIR, for a GPU box without Rust; it needs no GPU.
//!
//! Invariant: the NCCL environment is passed through as given; nothing here
//! sets or alters `NCCL_*` variables.

use std::path::Path;

use crate::gpu_box;

const HELP: &str = "\
usage: cargo xtask bench [--out FILE] [--crossover] [--min BYTES] [--max BYTES]
                         [--factor N] [--trials N] [--ops a,b] [--modes eager,graph]
                         [--enqueue nonblocking|blocking] [--host-costs] [--bundle DIR]

Builds benches/ (gpu-bench, --release) and runs it on this box's GPUs: every
CommBackend collective next to raw NCCL, 8 B to 1 GiB, eager and under CUDA
graph replay, and the 2-rank all-reduce paths. --crossover: only the paths,
sizes by factor 2, and the recommended METRALE_COMM_FAST_PATH range.
--host-costs: only the host time per call of eager 8 B operations and of
the driver and NCCL calls each submission adds.
--bundle DIR writes the binary and a run.sh to DIR instead (no GPU needed).
See docs/benchmarks.md.
";

/// Runs the subcommand.
pub fn run(args: &[String]) -> anyhow::Result<i32> {
    let (bundle, mut pass) = match gpu_box::parse_cli(
        "bench",
        HELP,
        &["--crossover", "--host-costs"],
        &[
            "--out",
            "--min",
            "--max",
            "--factor",
            "--trials",
            "--ops",
            "--modes",
            "--enqueue",
        ],
        args,
    )? {
        gpu_box::Cli::Exit(code) => return Ok(code),
        gpu_box::Cli::Run { bundle, pass } => (bundle, pass),
    };
    for i in 1..pass.len() {
        if pass[i - 1] == "--out" {
            pass[i] = absolute(&pass[i])?;
        }
    }
    gpu_box::GpuProgram {
        tool: "bench",
        package: "metrale-benches",
        bin: "gpu-bench",
        leading_args: &[],
        no_gpu_hint: "the GPU benchmarks need 2 GPUs (CPU benchmarks: cargo bench -p metrale-benches --bench cpu)",
        run_sh: RUN_SH,
        readme: README,
    }
    .run(bundle.as_deref(), &pass)
}

/// `--out` relative to the caller's directory, not the workspace root.
fn absolute(p: &str) -> anyhow::Result<String> {
    let p = Path::new(p);
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()?.join(p)
    };
    Ok(abs.to_string_lossy().into_owned())
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs the metrale-comm GPU benchmarks on this box's first 2 GPUs.
# Options: --out FILE --crossover --min BYTES --max BYTES --factor N --trials N --ops a,b --modes eager,graph --enqueue MODE --host-costs
# NCCL_* variables are passed through exactly as given.
set -euo pipefail
cd "$(dirname "$0")"
exec ./gpu-bench "$@"
"#;

const README: &str = "\
metrale-comm GPU benchmark bundle
=================================

Run on a box with 2 NVIDIA GPUs, a driver and libnccl.so.2 (NCCL >= 2.19):

    ./run.sh --out results.md           # every collective, 8 B to 1 GiB, eager and graph
    ./run.sh --crossover --out fast.md  # the all-reduce paths by factor 2, and the
                                        # recommended METRALE_COMM_FAST_PATH range

It prints markdown tables: our CommBackend next to raw NCCL in the same run,
time per operation and nccl-tests' algbw/busbw. With fewer than 2 GPUs it
says so and exits 0. No Rust toolchain is needed.
";
