//! `cargo xtask gpu-test`: the multi-rank suite on every GPU of a box.
//!
//! It first asks the CUDA driver (through `cuda-sys`) whether there is a
//! driver and at least one GPU; without one it prints a single line saying
//! so and exits 2. Otherwise it builds `comm-suite` in release mode and runs
//! `comm-suite run` with the remaining options, returning its exit code.
//! `--bundle DIR` builds and writes a self-contained directory (binary, run
//! script, README) to carry to a GPU box without Rust; it needs no GPU.
//!
//! Invariant: the NCCL environment is passed through as given; nothing here
//! sets or alters `NCCL_NVLS_ENABLE`.

use crate::gpu_box;

const HELP: &str = "\
usage: cargo xtask gpu-test [--gpus N] [--modes threads,processes,socket,torchrun,nodes,nodes-srun]
                            [--scenarios a,b] [--timeout SECS] [--repeat N]
                            [--torchrun PATH] [--bundle DIR]

Runs crates/comm-suite on this box's GPUs (built with --release): every
scenario in every mode, then a table. The default modes are threads,
processes and socket; torchrun mode launches the ranks with real
`torchrun --no-python` (--torchrun, else $TORCHRUN, else
/opt/torch/.venv/bin/torchrun; skipped with one line where there is none).
The nodes and nodes-srun modes split the ranks over two emulated hosts
(NCCL_HOSTID per host, torchrun's or srun's multi-node variables) and run
the multi-host scenarios; on GPUs NCCL then connects the two halves over
its network transport.
--bundle DIR writes the binary and a run.sh to DIR instead of running
(works without GPUs).
";

/// Runs the subcommand.
pub fn run(args: &[String]) -> anyhow::Result<i32> {
    let (bundle, pass) = match gpu_box::parse_cli(
        "gpu-test",
        HELP,
        &[],
        &[
            "--gpus",
            "--modes",
            "--scenarios",
            "--timeout",
            "--repeat",
            "--torchrun",
        ],
        args,
    )? {
        gpu_box::Cli::Exit(code) => return Ok(code),
        gpu_box::Cli::Run { bundle, pass } => (bundle, pass),
    };
    gpu_box::GpuProgram {
        tool: "gpu-test",
        package: "comm-suite",
        bin: "comm-suite",
        leading_args: &["run"],
        no_gpu_hint: "on a machine without GPUs run `cargo test --workspace`, which runs the same suite on the CPU emulator",
        run_sh: RUN_SH,
        readme: README,
    }
    .run(bundle.as_deref(), &pass)
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs the metrale-comm multi-rank suite on this box's GPUs.
# Options: --gpus N --modes threads,processes,socket,torchrun,nodes,nodes-srun --scenarios a,b --timeout SECS --repeat N
#          --torchrun PATH (torchrun mode; else $TORCHRUN, else /opt/torch/.venv/bin/torchrun)
# NCCL_* variables are passed through exactly as given.
#        ./run.sh --sanitizer [a,b]   compute-sanitizer memcheck, racecheck and synccheck over the
#          one-device kernel scenarios (default oneshot_kernel_one_device,norm_kernel_one_device);
#          the tool from $COMPUTE_SANITIZER, else PATH, else /usr/local/cuda/bin; $SANITIZER_TOOLS
#          picks the tools (e.g. SANITIZER_TOOLS=racecheck).
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "--sanitizer" ]; then
    shift
    cs="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
    if [ ! -x "$cs" ]; then
        echo "run.sh --sanitizer: no compute-sanitizer at $cs (set COMPUTE_SANITIZER)"
        exit 2
    fi
    scenarios="${1:-oneshot_kernel_one_device,norm_kernel_one_device}"
    # Steps that need several simulated ranks' kernels co-scheduled skip
    # under the tool, which runs kernels one at a time; they say so.
    export METRALE_UNDER_SANITIZER=1
    status=0
    for tool in ${SANITIZER_TOOLS:-memcheck racecheck synccheck}; do
        for s in ${scenarios//,/ }; do
            echo "== compute-sanitizer --tool $tool: $s"
            METRALE_SUITE_DIR="$(mktemp -d)" "$cs" --tool "$tool" --error-exitcode 99 \
                ./comm-suite threads --world 1 --scenario "$s" --timeout 3600 &&
                echo "   $tool $s: clean" || { echo "   $tool $s: FAILED"; status=1; }
        done
    done
    exit $status
fi
exec ./comm-suite run "$@"
"#;

const README: &str = "\
metrale-comm GPU test bundle
============================

Run on a box with NVIDIA GPUs, a driver and libnccl.so.2 (NCCL >= 2.19):

    ./run.sh                       # every scenario, modes threads,processes,socket
    ./run.sh --gpus 2 --modes threads --scenarios backend_all_reduce
    ./run.sh --modes torchrun      # ranks launched by torchrun --no-python
    ./comm-suite list              # the scenarios
    ./run.sh --sanitizer           # compute-sanitizer memcheck, racecheck, synccheck over
                                   # oneshot_kernel_one_device and norm_kernel_one_device

It prints one line per scenario as it finishes, then a table
(scenario x mode: PASS/FAIL/SKIP and seconds), and exits non-zero on any
failure. On a hang it kills the ranks, says where each rank was and prints
the flight-recorder analysis. No Rust toolchain is needed.
";
