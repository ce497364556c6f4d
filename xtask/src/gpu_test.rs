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

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

const HELP: &str = "\
usage: cargo xtask gpu-test [--gpus N] [--modes threads,processes,socket]
                            [--scenarios a,b] [--timeout SECS] [--repeat N]
                            [--bundle DIR]

Runs crates/comm-suite on this box's GPUs (built with --release): every
scenario in every mode, then a table. --bundle DIR writes the binary and a
run.sh to DIR instead of running (works without GPUs).
";

/// Runs the subcommand.
pub fn run(args: &[String]) -> anyhow::Result<i32> {
    let mut bundle: Option<PathBuf> = None;
    let mut pass: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--help" | "-h" => {
                print!("{HELP}");
                return Ok(0);
            }
            "--bundle" => {
                let dir = it.next().context("--bundle needs a directory")?;
                bundle = Some(PathBuf::from(dir));
            }
            "--gpus" | "--modes" | "--scenarios" | "--timeout" | "--repeat" => {
                let v = it.next().with_context(|| format!("{a} needs a value"))?;
                pass.push(a.clone());
                pass.push(v.clone());
            }
            other => {
                eprintln!("gpu-test: unknown option `{other}`");
                eprint!("{HELP}");
                return Ok(2);
            }
        }
    }
    if let Some(dir) = bundle {
        let exe = build()?;
        write_bundle(&exe, &dir)?;
        println!(
            "gpu-test: bundle written to {} (copy it to a GPU box and run ./run.sh)",
            dir.display()
        );
        return Ok(0);
    }
    match detect_gpus() {
        Ok(n) => println!("gpu-test: {n} GPU(s) found"),
        Err(line) => {
            println!(
                "gpu-test: {line}; on a machine without GPUs run `cargo test --workspace`, which runs the same suite on the CPU emulator"
            );
            return Ok(2);
        }
    }
    let exe = build()?;
    let status = Command::new(&exe)
        .arg("run")
        .args(&pass)
        .status()
        .with_context(|| format!("running {}", exe.display()))?;
    Ok(status.code().unwrap_or(1))
}

/// The number of GPUs, or the reason there are none, as one line.
fn detect_gpus() -> Result<usize, String> {
    let lib = cuda_sys::cuda().map_err(|e| format!("no CUDA driver found ({e})"))?;
    // SAFETY: cuInit takes a flags integer and touches no caller memory.
    let rc = unsafe { cuda_sys::call!(lib, cuInit(0)) }.map_err(|e| e.to_string())?;
    if rc != cuda_sys::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "the CUDA driver at {} failed to initialise (CUresult {})",
            lib.path(),
            rc.0
        ));
    }
    let mut count: std::os::raw::c_int = 0;
    // SAFETY: `count` is a live, writable c_int for the duration of the call.
    let rc =
        unsafe { cuda_sys::call!(lib, cuDeviceGetCount(&mut count)) }.map_err(|e| e.to_string())?;
    if rc != cuda_sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuDeviceGetCount failed (CUresult {})", rc.0));
    }
    if count <= 0 {
        return Err(format!("the CUDA driver at {} sees no GPU", lib.path()));
    }
    Ok(count as usize)
}

/// Builds the suite in release mode and returns the binary's path.
fn build() -> anyhow::Result<PathBuf> {
    let root = crate::workspace_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(&root)
        .args([
            "build",
            "--release",
            "-p",
            "comm-suite",
            "--bin",
            "comm-suite",
        ])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("cargo build --release -p comm-suite failed");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let exe = target.join("release").join("comm-suite");
    if !exe.is_file() {
        bail!("{} was not built", exe.display());
    }
    Ok(exe)
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs the metrale-comm multi-rank suite on this box's GPUs.
# Options: --gpus N --modes threads,processes,socket --scenarios a,b --timeout SECS --repeat N
# NCCL_* variables are passed through exactly as given.
set -euo pipefail
cd "$(dirname "$0")"
exec ./comm-suite run "$@"
"#;

const README: &str = "\
metrale-comm GPU test bundle
============================

Run on a box with NVIDIA GPUs, a driver and libnccl.so.2 (NCCL >= 2.19):

    ./run.sh                       # every scenario, modes threads,processes,socket
    ./run.sh --gpus 2 --modes threads --scenarios backend_all_reduce
    ./comm-suite list              # the scenarios

It prints one line per scenario as it finishes, then a table
(scenario x mode: PASS/FAIL/SKIP and seconds), and exits non-zero on any
failure. On a hang it kills the ranks, says where each rank was and prints
the flight-recorder analysis. No Rust toolchain is needed.
";

/// Writes the bundle directory.
fn write_bundle(exe: &Path, dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let bin = dir.join("comm-suite");
    std::fs::copy(exe, &bin).with_context(|| format!("copying to {}", bin.display()))?;
    let sh = dir.join("run.sh");
    std::fs::write(&sh, RUN_SH)?;
    std::fs::set_permissions(&sh, std::fs::Permissions::from_mode(0o755))?;
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755))?;
    std::fs::write(dir.join("README.txt"), README)?;
    Ok(())
}
