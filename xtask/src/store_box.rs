//! `cargo xtask store-bundle DIR`: the rendezvous store's checks for a box
//! with PyTorch (no Rust needed there): PyTorch's TCPStore client against
//! metrale's server for every query it has, a Rust process and a PyTorch
//! process sharing a store both ways round, metrale's server beside
//! PyTorch's at 1,024, 4,096 and 16,384 ranks, and the multi-rank suite
//! under real torchrun at world 2 and 4 on the CPU emulator.
//!
//! It builds (release) metrale-rendezvous's `store_bench` example (as
//! `store-bench`), `comm-suite`, the emulator (`libgpu_emu.so`, beside
//! `comm-suite`, where the suite looks for it) and metrale-rendezvous's
//! `tcpstore_tool` and `torch_interop` examples, strips their debug info,
//! and copies them with the Python scripts (metrale-rendezvous's
//! `benches/torch_store_bench.py`, `tests/fixtures/torch_client_suite.py`
//! and `examples/torch_interop.py`), `run.sh` and `README.txt` into DIR.
//!
//! Invariant: `run.sh` exports `NCCL_NVLS_ENABLE=0` and needs no GPU: the
//! suite runs on the emulator there.

use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, bail};

const HELP: &str = "\
usage: cargo xtask store-bundle DIR

Builds (release) store-bench, comm-suite with the CPU emulator and the
tcpstore_tool and torch_interop examples, and writes them with the Python
scripts, run.sh and README.txt to DIR. On a box with torch: ./run.sh OUT
(see README.txt).
";

/// What cargo builds, and where it lands under target/release.
const BUILDS: [(&[&str], &str, &str); 5] = [
    (
        &["-p", "metrale-rendezvous", "--example", "store_bench"],
        "examples/store_bench",
        "store-bench",
    ),
    (
        &["-p", "comm-suite", "--bin", "comm-suite"],
        "comm-suite",
        "comm-suite",
    ),
    (&["-p", "gpu-emu"], "libgpu_emu.so", "libgpu_emu.so"),
    (
        &["-p", "metrale-rendezvous", "--example", "tcpstore_tool"],
        "examples/tcpstore_tool",
        "tcpstore_tool",
    ),
    (
        &["-p", "metrale-rendezvous", "--example", "torch_interop"],
        "examples/torch_interop",
        "torch_interop",
    ),
];

/// The scripts the bundle carries, from the workspace root.
const SCRIPTS: [&str; 3] = [
    "crates/metrale-rendezvous/benches/torch_store_bench.py",
    "crates/metrale-rendezvous/tests/fixtures/torch_client_suite.py",
    "crates/metrale-rendezvous/examples/torch_interop.py",
];

/// Runs the subcommand.
pub fn run(args: &[String]) -> anyhow::Result<i32> {
    let dir = match args {
        [flag] if flag == "--help" || flag == "-h" => {
            print!("{HELP}");
            return Ok(0);
        }
        [dir] if !dir.starts_with('-') => Path::new(dir).to_path_buf(),
        _ => {
            eprint!("{HELP}");
            return Ok(2);
        }
    };
    let root = crate::workspace_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("release");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (cargo_args, built, name) in BUILDS {
        let status = Command::new(&cargo)
            .current_dir(&root)
            .arg("build")
            .arg("--release")
            .args(cargo_args)
            .status()
            .context("running cargo build")?;
        if !status.success() {
            bail!("cargo build --release {} failed", cargo_args.join(" "));
        }
        copy_exe(&target.join(built), &dir.join(name))?;
    }
    for script in SCRIPTS {
        let from = root.join(script);
        let name = from.file_name().context("a script's name")?;
        copy_exe(&from, &dir.join(name))?;
    }
    let sh = dir.join("run.sh");
    std::fs::write(&sh, RUN_SH)?;
    set_exec(&sh)?;
    std::fs::write(dir.join("README.txt"), README)?;
    println!(
        "store-bundle: written to {} (copy it to a box with torch and run ./run.sh OUT there)",
        dir.display()
    );
    Ok(0)
}

fn set_exec(p: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// Copies an executable (or script), its debug info stripped where
/// `strip` can (symbols stay for backtraces).
fn copy_exe(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    set_exec(to)?;
    if to.extension().is_none_or(|e| e != "py") {
        let stripped = Command::new("strip")
            .arg("--strip-debug")
            .arg(to)
            .status()
            .is_ok_and(|s| s.success());
        if !stripped {
            eprintln!(
                "store-bundle: `strip --strip-debug` failed or is missing; {} keeps its debug info",
                to.display()
            );
        }
    }
    Ok(())
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# The rendezvous store's checks on a box with torch (no GPU needed):
#   OUT/torch-client-suite.txt  PyTorch's TCPStore client against metrale's server, every query
#   OUT/torch-interop.txt       a Rust process and a torch process sharing a store, each serving in turn
#   OUT/store-bench.md          metrale's store beside PyTorch's (libuv) at 1,024, 4,096, 16,384 ranks
#   OUT/torchrun-world2.txt     the suite under real torchrun, 2 ranks on the CPU emulator
#   OUT/torchrun-world4.txt     ... 4 ranks
#   OUT/summary.txt             PASS/FAIL per step
# usage: ./run.sh OUT [--sizes 1024,4096,16384] [--repeat N] [--legacy] [--scenarios a,b] [--skip-bench] [--skip-suite]
#   --repeat N: each size N times, the servers interleaved; medians in the table
#   PYTHON   (default /opt/torch/.venv/bin/python3)
#   TORCHRUN (default /opt/torch/.venv/bin/torchrun)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
mkdir -p "$1" && out="$(cd "$1" && pwd)" || exit 2
shift
sizes=1024,4096,16384 repeat=1 legacy=() scenarios=() bench=1 suite=1
while [ $# -gt 0 ]; do
    case "$1" in
        --sizes) sizes="$2"; shift ;;
        --repeat) repeat="$2"; shift ;;
        --legacy) legacy=(--legacy) ;;
        --scenarios) scenarios=(--scenarios "$2"); shift ;;
        --skip-bench) bench=0 ;;
        --skip-suite) suite=0 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
py=${PYTHON:-/opt/torch/.venv/bin/python3}
export TORCHRUN=${TORCHRUN:-/opt/torch/.venv/bin/torchrun}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
status=0
summary=()
step() { # name, command...
    local name=$1
    shift
    echo "== $name"
    if "$@"; then
        summary+=("PASS $name")
    else
        summary+=("FAIL $name (exit $?)")
        status=1
    fi
}
{ uname -a; nproc; "$py" -c 'import torch; print("torch", torch.__version__)'; "$TORCHRUN" --help >/dev/null && echo "torchrun: $TORCHRUN"; ulimit -n; } >"$out/machine.txt" 2>&1
step "torch client suite (torch's client, metrale's server)" \
    "$py" "$here/torch_client_suite.py" "$here/tcpstore_tool" "$out/torch-client-suite.txt"
step "torch interop (rust serves, torch connects; torch serves, rust connects)" \
    "$py" "$here/torch_interop.py" "$here/torch_interop" "$out/torch-interop.txt"
if [ "$bench" = 1 ]; then
    step "store bench (metrale beside torch)" \
        "$py" "$here/torch_store_bench.py" "$here/store-bench" --sizes "$sizes" --repeat "$repeat" "${legacy[@]}" --out "$out/store-bench.md"
fi
if [ "$suite" = 1 ]; then
    for world in 2 4; do
        step "torchrun, world $world, CPU emulator" bash -c \
            "set -o pipefail; '$here/comm-suite' run --emulator --modes torchrun --gpus $world --timeout 150 --torchrun '$TORCHRUN' ${scenarios[*]} 2>&1 | tee '$out/torchrun-world$world.txt'"
    done
fi
echo
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit $status
"#;

const README: &str = "\
metrale-rendezvous store bundle
===============================

Run on a box with torch (2.11 was asked for; any 2.x runs) and no Rust:

    ./run.sh OUT                              # everything below, ~10 min on 16 cores
    ./run.sh OUT --skip-suite                 # the client suite and the bench only
    ./run.sh OUT --skip-bench --scenarios safe_collectives,backend_engine_flow

1. torch_client_suite.py: PyTorch's TCPStore client against metrale's
   server (tcpstore_tool serve) and against torch's libuv server, every
   query its client has; each answer checked (OUT/torch-client-suite.txt).
2. torch_interop.py: a Rust process (torch_interop) and a torch
   process share one store, first metrale's (torch_interop serve, torch's
   client connects), then torch's (TCPStore(is_master=True), torch_interop
   connect): greetings, a barrier, a compare_set race, a message each
   way through the queues, checked on both sides (OUT/torch-interop.txt).
3. torch_store_bench.py: a rendezvous of 1,024, 4,096 and 16,384 ranks
   (metrale's TcpRendezvous, threads of store-bench's children) through
   metrale's store and through torch's: time to barrier, the serving
   process's peak RSS, threads and fds (OUT/store-bench.md).
4. comm-suite under real torchrun --no-python, world 2 and 4, ranks on
   the CPU emulator (libgpu_emu.so beside comm-suite)
   (OUT/torchrun-world{2,4}.txt).

PYTHON and TORCHRUN override /opt/torch/.venv/bin/{python3,torchrun}.
NCCL_NVLS_ENABLE=0 is exported. OUT/summary.txt says PASS/FAIL per step.
";
