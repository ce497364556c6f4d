//! `cargo xtask bench`: the GPU benchmarks as a bundle for a GPU box, and
//! their run on this box's GPUs.
//!
//! It builds `metrale-benches` with `cargo bench --no-run` (release): the
//! `collectives`, `cpu`, `one_shot_local` and `norm_local` bench executables, found in
//! cargo's `--message-format=json` artifacts, and the `gpu-bench` and
//! `bench-tables` binaries cargo builds beside them. A bundle is a
//! directory with those six executables (debug info stripped, symbols
//! kept), `run.sh` and `README.txt`; no emulator and no Rust toolchain are
//! needed on the box. `run.sh OUT ...`
//! runs the collectives bench with criterion's report folder in
//! `OUT/criterion`, then the tables, then the host-cost probe (and on
//! request the CPU bench, the one-shot kernel bench and NVIDIA's nccl-tests
//! beside them).
//!
//! `--bundle DIR` writes the bundle and stops (no GPU needed). Without it,
//! on a box with GPUs, the bundle goes to `target/bench-bundle` and runs at
//! once with `--out` (default `target/bench-out`); without a CUDA driver or
//! GPU it prints one line and exits 2, before building anything.
//! `--save-baseline NAME`, `--baseline NAME` and everything after `--` pass
//! through to criterion.
//!
//! Invariant: `run.sh` exports `NCCL_NVLS_ENABLE=0` (NVLink multicast can
//! take a shared host's GPUs out of service) and leaves every other `NCCL_*`
//! variable as given; nothing here sets them in xtask's own process.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

use crate::gpu_box;

const HELP: &str = "\
usage: cargo xtask bench [--bundle DIR] [--out DIR] [--quick] [--cpu] [--one-shot-local] [--norm-local]
                         [--norm-variants DIR] [--only-local] [--no-host-costs]
                         [--save-baseline NAME | --baseline NAME] [-- CRITERION_ARGS...]

Builds the benchmarks (cargo bench --no-run, release) into a bundle: the
collectives, cpu and one_shot_local bench executables, gpu-bench, bench-tables
and run.sh.
--bundle DIR writes it to DIR and stops (no GPU needed): copy DIR to the GPU
box and run `./run.sh OUT` there. Without --bundle, on this box's GPUs: the
bundle goes to target/bench-bundle and runs with OUT = --out (default
target/bench-out). OUT receives criterion's report folder (criterion/, and
criterion.tar.gz), the tables (tables.md), the logs and the host costs.
--save-baseline NAME / --baseline NAME go to criterion: save this run as
NAME, or compare it with NAME saved earlier in the same OUT on the same box.
--quick: smoke-test sizes and times. --cpu: the CPU bench too.
--one-shot-local: the one-shot kernel on one GPU with ranks simulated too.
--norm-local: the fused all-reduce + add + RMSNorm on one GPU, ranks
simulated, too. --norm-variants DIR: the fused and separate kernels' graph
replays up to 32 tokens with the committed PTX, then with each build in DIR
(`cargo xtask ptx --variants DIR`: one_shot-NAME.ptx, with
add_rms_norm-NAME.ptx and one_shot_sm90-NAME.ptx where there are;
probe-* unchecked; add_rms_norm_sm90-NAME.ptx alone, timed in the
one-shot + separate kernel, pdl* launched programmatically), then the
committed again; a table of the medians in OUT/norm-variants.md.
--only-local: skip the collectives bench, its tables and the host costs
(with --one-shot-local, --norm-local or --norm-variants).
--no-host-costs: skip gpu-bench's host time per call. Arguments after --
go to criterion (a filter such as all_reduce/, --measurement-time 5).
See docs/benchmarks.md.
";

/// The bench executables the bundle holds, by cargo target name.
const BENCHES: [&str; 4] = ["collectives", "cpu", "one_shot_local", "norm_local"];
/// The binaries the bundle holds.
const BINS: [&str; 2] = ["gpu-bench", "bench-tables"];

#[derive(Debug, Default, PartialEq)]
struct Cli {
    bundle: Option<PathBuf>,
    out: Option<PathBuf>,
    /// What goes to `run.sh` after OUT.
    pass: Vec<String>,
}

fn parse(args: &[String]) -> anyhow::Result<Result<Cli, i32>> {
    let mut cli = Cli::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--help" | "-h" => {
                print!("{HELP}");
                return Ok(Err(0));
            }
            "--bundle" => {
                cli.bundle = Some(it.next().context("--bundle needs a directory")?.into())
            }
            "--out" => cli.out = Some(it.next().context("--out needs a directory")?.into()),
            "--quick" | "--cpu" | "--one-shot-local" | "--norm-local" | "--only-local"
            | "--no-host-costs" => cli.pass.push(a.clone()),
            "--norm-variants" => {
                let dir = it.next().context("--norm-variants needs a directory")?;
                cli.pass.extend([a.clone(), dir.clone()]);
            }
            "--save-baseline" | "--baseline" => {
                let name = it.next().with_context(|| format!("{a} needs a name"))?;
                cli.pass.extend([a.clone(), name.clone()]);
            }
            "--" => {
                cli.pass.push("--".into());
                cli.pass.extend(it.by_ref().cloned());
            }
            other => {
                eprintln!("bench: unknown option `{other}`");
                eprint!("{HELP}");
                return Ok(Err(2));
            }
        }
    }
    Ok(Ok(cli))
}

/// Runs the subcommand.
pub fn run(args: &[String]) -> anyhow::Result<i32> {
    let cli = match parse(args)? {
        Ok(cli) => cli,
        Err(code) => return Ok(code),
    };
    let root = crate::workspace_root();
    if let Some(dir) = &cli.bundle {
        build_bundle(&root, dir)?;
        println!(
            "bench: bundle written to {} (copy it to a GPU box and run ./run.sh OUT there)",
            dir.display()
        );
        return Ok(0);
    }
    match gpu_box::detect_gpus() {
        Ok(n) => println!("bench: {n} GPU(s) found"),
        Err(line) => {
            eprintln!(
                "bench: {line}; the GPU benchmarks need a GPU (CPU benchmarks: cargo bench -p metrale-benches --bench cpu; a bundle for a GPU box: cargo xtask bench --bundle DIR)"
            );
            return Ok(2);
        }
    }
    let target = target_dir(&root);
    let dir = target.join("bench-bundle");
    build_bundle(&root, &dir)?;
    let out = absolute(&cli.out.unwrap_or_else(|| target.join("bench-out")))?;
    let status = Command::new(dir.join("run.sh"))
        .arg(&out)
        .args(&cli.pass)
        .status()
        .context("running run.sh")?;
    Ok(status.code().unwrap_or(1))
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
}

/// A path relative to the caller's directory, made absolute.
fn absolute(p: &Path) -> anyhow::Result<PathBuf> {
    Ok(if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()?.join(p)
    })
}

/// One executable cargo reported.
#[derive(Debug, Clone, PartialEq)]
struct Artifact {
    /// `bench` or `bin`.
    kind: String,
    /// The target's name.
    name: String,
    /// Built as a test or bench harness (`profile.test`).
    test: bool,
    executable: PathBuf,
}

/// The executables among cargo's JSON messages (one per line).
fn artifacts(json_lines: &str) -> Vec<Artifact> {
    json_lines
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["reason"] == "compiler-artifact")
        .filter_map(|v| {
            Some(Artifact {
                kind: v["target"]["kind"].get(0)?.as_str()?.to_owned(),
                name: v["target"]["name"].as_str()?.to_owned(),
                test: v["profile"]["test"].as_bool().unwrap_or(false),
                executable: PathBuf::from(v["executable"].as_str()?),
            })
        })
        .collect()
}

/// The bundle's executables, as (name in the bundle, path): the benches
/// (bench harness builds) and the binaries (plain builds).
fn pick(found: &[Artifact]) -> anyhow::Result<Vec<(&'static str, PathBuf)>> {
    let mut out = Vec::new();
    for (names, kind, test) in [(&BENCHES[..], "bench", true), (&BINS[..], "bin", false)] {
        for name in names.iter().copied() {
            let a = found
                .iter()
                .rev()
                .find(|a| a.kind == kind && a.name == name && a.test == test)
                .with_context(|| format!("cargo built no {kind} `{name}`"))?;
            out.push((name, a.executable.clone()));
        }
    }
    Ok(out)
}

/// Builds the benchmarks and writes the bundle into `dir`.
fn build_bundle(root: &Path, dir: &Path) -> anyhow::Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root).args([
        "bench",
        "--no-run",
        "--message-format=json-render-diagnostics",
        "-p",
        "metrale-benches",
    ]);
    for b in BENCHES {
        cmd.args(["--bench", b]);
    }
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running cargo bench --no-run")?;
    if !out.status.success() {
        bail!("cargo bench --no-run -p metrale-benches failed");
    }
    let exes = pick(&artifacts(&String::from_utf8_lossy(&out.stdout)))?;
    write_bundle(dir, &exes)
}

fn write_bundle(dir: &Path, exes: &[(&str, PathBuf)]) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let exec = std::fs::Permissions::from_mode(0o755);
    for (name, exe) in exes {
        let to = dir.join(name);
        std::fs::copy(exe, &to)
            .with_context(|| format!("copying {} to {}", exe.display(), to.display()))?;
        std::fs::set_permissions(&to, exec.clone())?;
        // The release profile keeps line tables (debug = 1): about 27 MiB
        // a binary, a tenth of it without. Symbols stay for backtraces.
        let stripped = Command::new("strip")
            .arg("--strip-debug")
            .arg(&to)
            .status()
            .is_ok_and(|s| s.success());
        if !stripped {
            eprintln!(
                "bench: `strip --strip-debug` failed or is missing; {name} keeps its debug info"
            );
        }
    }
    let sh = dir.join("run.sh");
    std::fs::write(&sh, RUN_SH)?;
    std::fs::set_permissions(&sh, exec)?;
    std::fs::write(dir.join("README.txt"), README)?;
    Ok(())
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs the metrale-comm GPU benchmarks on this box's GPUs and writes every
# result under OUT:
#   OUT/criterion/         criterion's report folder (and OUT/criterion.tar.gz)
#   OUT/collectives*.log   the collectives bench's output
#   OUT/tables*.md         the nccl-tests-style tables, from criterion's estimates
#   OUT/host-costs*.md     gpu-bench: host time per call
#   OUT/cpu*.log           the CPU bench (--cpu)
#   OUT/tables*-all-reduce.svg, OUT/tables*-busbw-{eager,graph}.svg  the tables' plots
#   OUT/one-shot-local*.log the one-shot kernel on one GPU, ranks simulated (--one-shot-local),
#                          its table and plot in OUT/one-shot-local*.{md,svg}
#   OUT/norm-local*.log    the fused all-reduce + add + RMSNorm on one GPU, ranks simulated (--norm-local)
#   OUT/norm-variants.md   the fused and separate kernels, committed against each build in DIR
#                          (--norm-variants DIR; logs in OUT/norm-variant-*.log)
#   OUT/nccl-tests*.txt    NVIDIA's nccl-tests beside them (--nccl-tests DIR)
# usage: ./run.sh OUT [--quick] [--cpu] [--one-shot-local] [--norm-local] [--norm-variants DIR]
#                     [--only-local] [--no-host-costs]
#                     [--nccl-tests DIR]
#                     [--save-baseline NAME | --baseline NAME] [CRITERION_ARGS...]
# --save-baseline / --baseline go to criterion (and name the files: -NAME,
# -vs-NAME); a baseline lives in OUT/criterion, so compare runs that share
# OUT on the same box. NCCL_NVLS_ENABLE=0 is exported; every other NCCL_*
# variable is passed through as given.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
mkdir -p "$1" && out="$(cd "$1" && pwd)" || exit 2
shift
export NCCL_NVLS_ENABLE=0
export CRITERION_HOME="$out/criterion"
cpu=0 local=0 norm=0 variants="" collectives=1 host=1 nccl_tests="" suffix="" base=() crit=()
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) export METRALE_BENCH_QUICK=1 ;;
        --cpu) cpu=1 ;;
        --one-shot-local) local=1 ;;
        --norm-local) norm=1 ;;
        --norm-variants) variants="$2"; shift ;;
        --only-local) collectives=0; host=0 ;;
        --no-host-costs) host=0 ;;
        --nccl-tests) nccl_tests="$2"; shift ;;
        --save-baseline) base=("$1" "$2"); suffix="-$2"; shift ;;
        --baseline) base=("$1" "$2"); suffix="-vs-$2"; shift ;;
        --) ;;
        *) crit+=("$1") ;;
    esac
    shift
done
status=0
{ uname -a; nvidia-smi -L 2>&1 || true; env | grep -E '^(NCCL_|METRALE_)' || true; } >"$out/machine$suffix.txt"
if [ "$collectives" = 1 ]; then
    "$here/collectives" --bench "${base[@]}" "${crit[@]}" 2>&1 | tee "$out/collectives$suffix.log" || status=1
    tables=(--out "$out/tables$suffix.md")
    [ ${#base[@]} -eq 2 ] && [ "${base[0]}" = --baseline ] && tables+=(--baseline "${base[1]}")
    "$here/bench-tables" "$CRITERION_HOME" "${tables[@]}" || status=1
fi
if [ "$host" = 1 ]; then
    "$here/gpu-bench" --host-costs --out "$out/host-costs$suffix.md" 2>&1 | tee "$out/host-costs$suffix.log" || status=1
fi
if [ "$cpu" = 1 ]; then
    "$here/cpu" --bench "${base[@]}" 2>&1 | tee "$out/cpu$suffix.log" || status=1
fi
if [ "$local" = 1 ]; then
    "$here/one_shot_local" --bench "${base[@]}" 2>&1 | tee "$out/one-shot-local$suffix.log" || status=1
    for f in md svg; do
        [ -f "$CRITERION_HOME/one-shot-local.$f" ] && cp "$CRITERION_HOME/one-shot-local.$f" "$out/one-shot-local$suffix.$f"
    done
fi
if [ "$norm" = 1 ]; then
    "$here/norm_local" --bench "${base[@]}" 2>&1 | tee "$out/norm-local$suffix.log" || status=1
fi
if [ -n "$variants" ]; then
    # Graph replays up to 32 tokens: the fused kernel at 2, 4 and 8
    # simulated ranks, and the separate kernel; the plain one-shot (the
    # same in every build) and the one-shot + separate kernel in the first
    # run only, and in each separate-kernel-only build's (sm_90,
    # add_rms_norm_sm90-NAME.ptx; NAME pdl* launched programmatically).
    shapes='(1x4096|1x8192|8x8192|32x4096|32x8192)'
    vf="norm_local/graph/(k[248]/fused/$shapes|norm/[0-9]+x[0-9]+)\$"
    nf="norm_local/graph/(k[248]/one_shot\\+norm/$shapes|norm/[0-9]+x[0-9]+)\$"
    runs=()
    vrun() {
        local name=$1 filter=$2; shift 2
        runs+=("$name")
        env "$@" "$here/norm_local" --bench --noplot --sample-size 10 --measurement-time 0.5 \
            --warm-up-time 0.1 "$filter" >"$out/norm-variant-$name.log" 2>&1 || status=1
    }
    vrun committed "norm_local/graph/(k[248]/(fused|one_shot|one_shot\\+norm)/$shapes|norm/[0-9]+x[0-9]+)\$"
    for p in "$variants"/one_shot-*.ptx; do
        [ -f "$p" ] || continue
        name=$(basename "$p" .ptx); name=${name#one_shot-}
        envs=(METRALE_ONE_SHOT_PTX="$p")
        [ -f "$variants/add_rms_norm-$name.ptx" ] && envs+=(METRALE_NORM_PTX="$variants/add_rms_norm-$name.ptx")
        [ -f "$variants/one_shot_sm90-$name.ptx" ] && envs+=(METRALE_ONE_SHOT_SM90_PTX="$variants/one_shot_sm90-$name.ptx")
        case "$name" in probe-*) envs+=(METRALE_NORM_LOCAL_NO_CHECK=1) ;; esac
        vrun "$name" "$vf" "${envs[@]}"
    done
    for p in "$variants"/add_rms_norm_sm90-*.ptx; do
        [ -f "$p" ] || continue
        name=$(basename "$p" .ptx); name=${name#add_rms_norm_sm90-}
        envs=(METRALE_NORM_PTX="$p")
        case "$name" in pdl*) envs+=(METRALE_NORM_PDL=1) ;; esac
        vrun "$name" "$nf" "${envs[@]}"
    done
    vrun committed-again "$vf"
    # One row a benchmark, one column a run: criterion's median estimate, µs.
    for r in "${runs[@]}"; do
        awk -v run="$r" '/^norm_local\//{id=$1} /time:/{for (i=1;i<=NF;i++) if ($i=="time:") t=i; if (id!="") {v=$(t+3); u=$(t+4); if (u=="ns") v/=1000; if (u=="ms") v*=1000; print run, id, v; id=""}}' "$out/norm-variant-$r.log"
    done | awk -v cols="${runs[*]}" 'BEGIN{n=split(cols,c," ")} {v[$2" "$1]=$3; if (!($2 in seen)) {seen[$2]=1; ids[++m]=$2}}
        END{printf "| benchmark (µs) |"; for (i=1;i<=n;i++) printf " %s |", c[i]; printf "\n|---|"; for (i=1;i<=n;i++) printf "---:|"; printf "\n";
            for (j=1;j<=m;j++) {printf "| %s |", ids[j]; for (i=1;i<=n;i++) printf " %s |", v[ids[j]" "c[i]]; printf "\n"}}' >"$out/norm-variants.md"
    cat "$out/norm-variants.md"
fi
if [ -n "$nccl_tests" ]; then
    n="${METRALE_BENCH_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}"
    for t in all_reduce all_gather reduce_scatter broadcast sendrecv alltoall; do
        [ -x "$nccl_tests/${t}_perf" ] || continue
        for g in "" "-G 20"; do
            echo "== ${t}_perf -b 8 -e 1G -f 4 -g $n -d bfloat16 -w 5 -n 20 $g"
            "$nccl_tests/${t}_perf" -b 8 -e 1G -f 4 -g "$n" -d bfloat16 -w 5 -n 20 $g 2>&1 || status=1
        done
    done | tee "$out/nccl-tests$suffix.txt"
fi
tar -czf "$out/criterion.tar.gz" -C "$out" criterion || status=1
exit $status
"#;

const README: &str = "\
metrale-comm GPU benchmark bundle
=================================

Run on a box with NVIDIA GPUs, a driver and libnccl.so.2 (NCCL >= 2.19;
set METRALE_NCCL_LIBRARY to use another libnccl):

    ./run.sh OUT                        # every collective, raw NCCL beside ours,
                                        # eager and graph replay, on all GPUs
    ./run.sh OUT --save-baseline main   # ... and keep the numbers as `main`
    ./run.sh OUT --baseline main        # a later build compared with `main`
    ./run.sh OUT --quick                # a smoke test (seconds)
    ./run.sh OUT all_reduce/            # criterion's filter: one operation
    ./run.sh OUT --only-local --norm-variants DIR
                                        # the norm kernels, committed against the
                                        # builds of `cargo xtask ptx --variants DIR`

OUT gets criterion's report folder (criterion/ and criterion.tar.gz), the
tables (tables.md: time, algbw, busbw, ours/raw and noise per size) and
their plots (tables-all-reduce.svg, tables-busbw-eager.svg,
tables-busbw-graph.svg), the logs and gpu-bench's host time per call. With no GPU or no NCCL the
benches say so in one line and exit 0. NCCL_NVLS_ENABLE=0 is set by
run.sh. No Rust toolchain is needed.
";

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options_pass_through_to_run_sh() {
        let cli = parse(&args(&[
            "--out",
            "o",
            "--baseline",
            "main",
            "--quick",
            "--norm-variants",
            "v",
            "--",
            "all_reduce/",
            "--measurement-time",
            "5",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(cli.out, Some(PathBuf::from("o")));
        assert_eq!(cli.bundle, None);
        assert_eq!(
            cli.pass,
            args(&[
                "--baseline",
                "main",
                "--quick",
                "--norm-variants",
                "v",
                "--",
                "all_reduce/",
                "--measurement-time",
                "5"
            ])
        );
        assert_eq!(parse(&args(&["--frobnicate"])).unwrap(), Err(2));
        assert!(parse(&args(&["--save-baseline"])).is_err());
        assert!(parse(&args(&["--norm-variants"])).is_err());
    }

    #[test]
    fn the_bundle_takes_bench_harness_builds_and_plain_binaries() {
        let msg = |kind: &str, name: &str, test: bool, exe: &str| {
            format!(
                r#"{{"reason":"compiler-artifact","target":{{"kind":["{kind}"],"name":"{name}"}},"profile":{{"test":{test}}},"executable":"{exe}"}}"#
            )
        };
        let lines = [
            msg("lib", "metrale_benches", false, "null").replace("\"null\"", "null"),
            msg("bin", "gpu-bench", true, "/t/deps/gpu_bench-1"),
            msg("bin", "gpu-bench", false, "/t/gpu-bench"),
            msg("bin", "bench-tables", false, "/t/bench-tables"),
            msg("bench", "collectives", true, "/t/deps/collectives-2"),
            msg("bin", "collectives", false, "/t/collectives"),
            msg("bench", "cpu", true, "/t/deps/cpu-3"),
            msg("bench", "one_shot_local", true, "/t/deps/one_shot_local-4"),
            msg("bench", "norm_local", true, "/t/deps/norm_local-5"),
            r#"{"reason":"build-finished","success":true}"#.to_owned(),
        ]
        .join("\n");
        let found = artifacts(&lines);
        assert_eq!(found.len(), 8);
        let picked = pick(&found).unwrap();
        assert_eq!(
            picked,
            vec![
                ("collectives", PathBuf::from("/t/deps/collectives-2")),
                ("cpu", PathBuf::from("/t/deps/cpu-3")),
                ("one_shot_local", PathBuf::from("/t/deps/one_shot_local-4")),
                ("norm_local", PathBuf::from("/t/deps/norm_local-5")),
                ("gpu-bench", PathBuf::from("/t/gpu-bench")),
                ("bench-tables", PathBuf::from("/t/bench-tables")),
            ]
        );
        let e = pick(&found[..3]).unwrap_err().to_string();
        assert!(e.contains("bench `collectives`"), "{e}");
    }
}
