//! `cargo xtask`: the project's automation, in Rust so that it runs wherever
//! cargo does. Each subcommand lives in its own module; `main` only dispatches.

mod bench;
mod bindgen_cmd;
mod diagnose;
mod gpu_box;
mod gpu_test;
mod plot;
mod probe;
mod ptx;
mod store_box;
mod tune;

use std::path::{Path, PathBuf};

const USAGE: &str = "\
usage: cargo xtask <command> [options]

commands:
  bindgen [--check]   regenerate crates/cuda-sys and crates/nccl-sys bindings
                      (--check: fail if the committed output differs)
  ptx [--check]       compile the project's CUDA kernels to the committed PTX
  ptx --variants DIR  write the kernels' uncommitted builds (variants, probes)
                      into DIR
  probe               print the driver, the GPUs and peer access, and NCCL
  gpu-test [opts]     run the multi-rank suite on this box's GPUs (--help)
  bench [opts]        build the GPU benchmarks into a bundle for a GPU box, or
                      run it on this box's GPUs (--help)
  diagnose DIR        read the flight-recorder dumps of all ranks in DIR and
                      name the first operation the ranks disagree on
  store-bundle DIR    build the rendezvous store's checks for a box with torch
                      (client suite, store bench, torchrun on the emulator)
  plot store FILE     the store's time to barrier from a store table, as SVG
  plot docs [--check] redraw docs/plots/*.svg from docs/benchmarks.md's tables
  tune [opts]         print the path tuner's table and set-up cost on this box's
                      GPUs, or build it into a bundle (--help)
";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match run(&args) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("xtask: {err:#}");
            1
        }
    };
    std::process::exit(code);
}

fn run(args: &[String]) -> anyhow::Result<i32> {
    let Some((cmd, rest)) = args.split_first() else {
        eprint!("{USAGE}");
        return Ok(2);
    };
    match cmd.as_str() {
        "bindgen" => bindgen_cmd::run(rest),
        "ptx" => ptx::run(rest),
        "probe" => probe::run(rest),
        "gpu-test" => gpu_test::run(rest),
        "bench" => bench::run(rest),
        "diagnose" => diagnose::run(rest),
        "store-bundle" => store_box::run(rest),
        "plot" => plot::run(rest),
        "tune" => tune::run(rest),
        "help" | "--help" | "-h" => {
            print!("{USAGE}");
            Ok(0)
        }
        other => {
            eprintln!("xtask: unknown command `{other}`");
            eprint!("{USAGE}");
            Ok(2)
        }
    }
}

/// The workspace root (the parent of `xtask/`).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Parses the `[--check]` argument of a generator subcommand.
pub fn check_flag(args: &[String], usage: &str) -> anyhow::Result<bool> {
    match args {
        [] => Ok(false),
        [flag] if flag == "--check" => Ok(true),
        _ => anyhow::bail!("usage: {usage}"),
    }
}

/// Writes a generated file, `root/rel`, unless it already holds `text`; with
/// `check`, writes nothing. Returns whether the file was stale.
pub fn update_generated(
    tool: &str,
    root: &Path,
    rel: &str,
    text: &str,
    check: bool,
) -> anyhow::Result<bool> {
    let path = root.join(rel);
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    if current == text {
        println!("xtask {tool}: {rel} is up to date");
        return Ok(false);
    }
    if !check {
        std::fs::write(&path, text)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
        println!("xtask {tool}: wrote {rel}");
    }
    Ok(true)
}
