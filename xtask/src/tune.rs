//! `cargo xtask tune`: the path tuner's table on this box's GPUs, in
//! nccl-tests-like columns, with what the tuner costs a set-up (`comm-suite
//! tune`, built in release mode). `--bundle DIR` writes the binary and a
//! run script to carry to a GPU box without Rust; the suite's bundle
//! (`cargo xtask gpu-test --bundle`) runs the same as `./comm-suite tune`.
//!
//! Invariant: the NCCL environment is passed through as given; nothing here
//! sets or alters `NCCL_NVLS_ENABLE`.

use crate::gpu_box;

const HELP: &str = "\
usage: cargo xtask tune [--gpus N] [--bundle DIR]

Builds every rank's backend on this box's GPUs (one rank per GPU, threads
of one process) with the default policies, and prints the path table the
tuner decided: per size, NCCL's all-reduce, the one-shot path and the fast
path in microseconds per call, and the path taken, eager and in graphs;
then the set-up time with the tuner timing, with its cached table, and with
the same paths by fixed ranges (three rounds each). One GPU has nothing to
tune; it still shows the set-up times.
--bundle DIR writes the binary and a run.sh to DIR instead of running.
";

/// Runs the subcommand.
pub fn run(args: &[String]) -> anyhow::Result<i32> {
    let (bundle, pass) = match gpu_box::parse_cli("tune", HELP, &[], &["--gpus"], args)? {
        gpu_box::Cli::Exit(code) => return Ok(code),
        gpu_box::Cli::Run { bundle, pass } => (bundle, pass),
    };
    gpu_box::GpuProgram {
        tool: "tune",
        package: "comm-suite",
        bin: "comm-suite",
        leading_args: &["tune"],
        no_gpu_hint: "on a machine without GPUs, `comm-suite tune --emulator` shows the tuner on \
                      the CPU emulator",
        run_sh: RUN_SH,
        readme: README,
    }
    .run(bundle.as_deref(), &pass)
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# Prints the path tuner's table on this box's GPUs. Options: --gpus N
# NCCL_* variables are passed through exactly as given.
set -euo pipefail
cd "$(dirname "$0")"
exec ./comm-suite tune "$@"
"#;

const README: &str = "\
metrale-comm path tuner bundle
==============================

Run on a box with NVIDIA GPUs, a driver and libnccl.so.2 (NCCL >= 2.19):

    ./run.sh            # every GPU
    ./run.sh --gpus 2

It prints the table the tuner decides at set-up (nccl-tests-like columns,
eager and graph) and the set-up times. No Rust toolchain is needed.
";
