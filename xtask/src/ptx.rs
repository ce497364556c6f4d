//! `cargo xtask ptx [--check | --variants DIR]`: writes the kernels' ABI
//! header (`crates/metrale-comm/kernels/abi.h`, from `crates/kernel-abi`)
//! and compiles the project's CUDA kernels
//! (`crates/metrale-comm/kernels/*.cu`) to the PTX committed beside them;
//! `--check` says whether both are current; `--variants DIR` writes the
//! kernels' uncommitted builds (a macro defined: variants to time against
//! the committed PTX, and probes) into DIR and touches nothing committed.
//!
//! nvcc is `nvcc` on `PATH`, else `$CUDA_HOME/bin/nvcc`, else the pinned
//! CUDA 13.0 compiler wheels from PyPI (`nvidia-cuda-nvcc`, `nvidia-nvvm` for
//! cicc and libdevice, `nvidia-cuda-crt`, `nvidia-cuda-cccl` and
//! `nvidia-cuda-runtime` for the headers), downloaded with pip and unpacked
//! into `target/xtask-cache/nvcc/`, where they form one toolkit tree.
//!
//! Invariants:
//! - The kernels are compiled with `--ptx -arch=compute_80`: sm_80 is the
//!   oldest architecture with native bf16. One build is for Hopper and
//!   newer: `one_shot.cu` with `-DOS_CLUSTER` for `compute_90` (its fused
//!   entries split a row over a thread block cluster) into
//!   `one_shot_sm90.ptx`, relabelled [`PTX_ISA_SM90`] (7.8, the first ISA
//!   with sm_90 and clusters) and checked by `ptxas` for sm_90.
//! - nvcc 12.x/13.x stamp their own, recent, PTX ISA on the `.version` line,
//!   which would make the driver that JIT-compiles the PTX at least as new
//!   as the compiler. The output is therefore relabelled [`PTX_ISA`] (7.0,
//!   the first ISA with sm_80 and bf16) and then assembled by the `ptxas`
//!   beside nvcc for sm_80, which rejects any instruction the lower ISA
//!   lacks; the command fails rather than commit PTX that ISA cannot express.
//! - With the pinned wheels the output is a pure function of the sources, so
//!   `--check` compiles into `target/` and compares bytes instead of writing.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::workspace_root;

/// The PTX ISA written on the `.version` line of the committed PTX.
const PTX_ISA: &str = "7.0";

/// The virtual architecture the kernels are compiled for.
const ARCH: &str = "compute_80";

/// The real architecture `ptxas` checks the relabelled PTX against.
const CHECK_ARCH: &str = "sm_80";

/// The PTX ISA of the Hopper build (7.8: sm_90, clusters).
const PTX_ISA_SM90: &str = "7.8";

/// One build: the source, the committed PTX, the virtual architecture, the
/// ISA written on the `.version` line, the architecture `ptxas` checks
/// against and the macros defined.
struct Build {
    src: &'static str,
    dst: &'static str,
    arch: &'static str,
    isa: &'static str,
    check_arch: &'static str,
    defines: &'static [&'static str],
}

const fn build(src: &'static str, dst: &'static str) -> Build {
    Build {
        src,
        dst,
        arch: ARCH,
        isa: PTX_ISA,
        check_arch: CHECK_ARCH,
        defines: &[],
    }
}

/// The pinned CUDA 13.0 compiler wheels, with a file each must provide
/// (relative to the unpacked `nvidia/cu13/` tree).
const WHEELS: &[(&str, &str)] = &[
    ("nvidia-cuda-nvcc==13.0.88", "bin/nvcc"),
    ("nvidia-nvvm==13.0.88", "nvvm/bin/cicc"),
    ("nvidia-cuda-crt==13.0.88", "include/crt/host_defines.h"),
    ("nvidia-cuda-cccl==13.0.85", "include/nv/target"),
    ("nvidia-cuda-runtime==13.0.96", "include/cuda_runtime.h"),
];

/// The kernels' ABI header, generated from `crates/kernel-abi`.
const ABI_HEADER: &str = "crates/metrale-comm/kernels/abi.h";

/// The sources that more than one build compiles.
const ONE_SHOT_CU: &str = "crates/metrale-comm/kernels/one_shot.cu";
const ADD_RMS_NORM_CU: &str = "crates/metrale-comm/kernels/add_rms_norm.cu";

/// The kernels' builds, paths relative to the workspace root.
const KERNELS: &[Build] = &[
    build(
        "crates/metrale-comm/kernels/bf16_add.cu",
        "crates/metrale-comm/kernels/bf16_add.ptx",
    ),
    build(ONE_SHOT_CU, "crates/metrale-comm/kernels/one_shot.ptx"),
    cluster(&["OS_CLUSTER"]),
    build(
        ADD_RMS_NORM_CU,
        "crates/metrale-comm/kernels/add_rms_norm.ptx",
    ),
];

/// Builds of the kernels that are never committed, each named: variants to
/// time against the committed PTX (`norm_local` loads them through
/// `METRALE_ONE_SHOT_PTX`, `METRALE_ONE_SHOT_SM90_PTX` and
/// `METRALE_NORM_PTX`, as does the suite's `norm_kernel` scenario), and
/// probes that leave a phase out to show what it costs (wrong results:
/// time them with `METRALE_NORM_LOCAL_NO_CHECK=1`). The macros are documented where the
/// kernels test them.
const VARIANTS: &[(&str, Build)] = &[
    ("one-barrier", variant(ONE_SHOT_CU, &["NORM_ONE_BARRIER"])),
    (
        "one-barrier",
        variant(ADD_RMS_NORM_CU, &["NORM_ONE_BARRIER"]),
    ),
    ("probe-nosum", variant(ONE_SHOT_CU, &["OS_PROBE_NOSUM"])),
    (
        "probe-nosum",
        variant(ADD_RMS_NORM_CU, &["NORM_PROBE_NOSUM"]),
    ),
    ("probe-noinv", variant(ONE_SHOT_CU, &["OS_PROBE_NOINV"])),
    (
        "probe-noinv",
        variant(ADD_RMS_NORM_CU, &["NORM_PROBE_NOINV"]),
    ),
    ("probe-bare", variant(ONE_SHOT_CU, &["OS_PROBE_BARE"])),
    ("probe-bare", variant(ADD_RMS_NORM_CU, &["NORM_PROBE_BARE"])),
    ("probe-k2only", variant(ONE_SHOT_CU, &["OS_FUSED_WORLD=2"])),
    ("probe-k4only", variant(ONE_SHOT_CU, &["OS_FUSED_WORLD=4"])),
    ("probe-k8only", variant(ONE_SHOT_CU, &["OS_FUSED_WORLD=8"])),
    ("pack2", variant(ONE_SHOT_CU, &["NORM_PACK2"])),
    ("pack2", variant(ADD_RMS_NORM_CU, &["NORM_PACK2"])),
    ("pack2", cluster(&["OS_CLUSTER", "NORM_PACK2"])),
    ("probe-empty", variant(ONE_SHOT_CU, &["OS_PROBE_EMPTY"])),
    (
        "probe-empty",
        variant(ADD_RMS_NORM_CU, &["NORM_PROBE_EMPTY"]),
    ),
    (
        "pdl",
        sm90(ADD_RMS_NORM_CU, ADD_RMS_NORM_SM90, &["NORM_PDL"]),
    ),
];

/// The name an sm_90 build of the separate kernel takes (a variant's stem:
/// no such file is committed).
const ADD_RMS_NORM_SM90: &str = "crates/metrale-comm/kernels/add_rms_norm_sm90.ptx";

/// The cluster entries' module (`one_shot.cu` for sm_90, `defines` with
/// `OS_CLUSTER`), committed or a variant.
const fn cluster(defines: &'static [&'static str]) -> Build {
    sm90(
        ONE_SHOT_CU,
        "crates/metrale-comm/kernels/one_shot_sm90.ptx",
        defines,
    )
}

/// A build of `src` for sm_90 (PTX ISA 7.8: clusters, programmatic
/// dependent launch), with `defines`, to `dst`.
const fn sm90(src: &'static str, dst: &'static str, defines: &'static [&'static str]) -> Build {
    Build {
        src,
        dst,
        arch: "compute_90",
        isa: PTX_ISA_SM90,
        check_arch: "sm_90",
        defines,
    }
}

/// A variant of `src` for sm_80, with `defines` (its output, `STEM-NAME.ptx`
/// in the directory given, is named after `dst`, here `src`).
const fn variant(src: &'static str, defines: &'static [&'static str]) -> Build {
    Build {
        src,
        dst: src,
        arch: ARCH,
        isa: PTX_ISA,
        check_arch: CHECK_ARCH,
        defines,
    }
}

/// Runs the subcommand.
pub fn run(args: &[String]) -> Result<i32> {
    if let [flag, dir] = args
        && flag == "--variants"
    {
        return variants(Path::new(dir));
    }
    let check = crate::check_flag(args, "cargo xtask ptx [--check | --variants DIR]")?;
    let root = workspace_root();
    let nvcc = find_nvcc(&root)?;
    println!("xtask ptx: using {}", nvcc.display());
    let out_dir = root.join("target/xtask-cache/ptx-out");
    std::fs::create_dir_all(&out_dir)?;
    let mut stale = Vec::new();
    // The header first: the kernels include it (`#include "abi.h"` finds
    // the one beside them).
    if crate::update_generated(
        "ptx",
        &root,
        ABI_HEADER,
        &metrale_kernel_abi::cuda_header(),
        check,
    )? && check
    {
        stale.push(ABI_HEADER);
    }
    for b in KERNELS {
        let text = compile(&nvcc, &root, b, &out_dir)?;
        if crate::update_generated("ptx", &root, b.dst, &text, check)? && check {
            stale.push(b.dst);
        }
    }
    if !stale.is_empty() {
        eprintln!(
            "xtask ptx --check: committed files differ from what {} and crates/kernel-abi \
             produce: {}; \
             run `cargo xtask ptx` (the committed PTX comes from the pinned \
             nvcc 13.0.88 wheel: with another nvcc on PATH the bytes differ)",
            nvcc.display(),
            stale.join(", ")
        );
        return Ok(1);
    }
    Ok(0)
}

/// `--variants DIR`: writes each of [`VARIANTS`] to `DIR/<source
/// stem>-<name>.ptx`, compiled and checked as the committed builds are.
fn variants(dir: &Path) -> Result<i32> {
    let root = workspace_root();
    let nvcc = find_nvcc(&root)?;
    println!("xtask ptx: using {}", nvcc.display());
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, b) in VARIANTS {
        let out_dir = root.join("target/xtask-cache/ptx-variants").join(name);
        std::fs::create_dir_all(&out_dir)?;
        let text = compile(&nvcc, &root, b, &out_dir)?;
        let stem = Path::new(b.dst)
            .file_stem()
            .and_then(|s| s.to_str())
            .context("kernel output without a name")?;
        let to = dir.join(format!("{stem}-{name}.ptx"));
        std::fs::write(&to, text).with_context(|| format!("writing {}", to.display()))?;
        println!(
            "xtask ptx: wrote {} ({})",
            to.display(),
            b.defines.join(" ")
        );
    }
    Ok(0)
}

/// Compiles one build to PTX, relabels its ISA and checks it with ptxas.
fn compile(nvcc: &Path, root: &Path, b: &Build, out_dir: &Path) -> Result<String> {
    let src = root.join(b.src);
    let stem = Path::new(b.dst)
        .file_stem()
        .and_then(|s| s.to_str())
        .context("kernel output without a name")?;
    let raw = out_dir.join(format!("{stem}.nvcc.ptx"));
    let status = Command::new(nvcc)
        .args(["--ptx", &format!("-arch={}", b.arch)])
        .args(b.defines.iter().map(|d| format!("-D{d}")))
        .arg("-o")
        .arg(&raw)
        .arg(&src)
        .status()
        .with_context(|| format!("running {}", nvcc.display()))?;
    if !status.success() {
        bail!("nvcc failed on {}", src.display());
    }
    let text = std::fs::read_to_string(&raw)?;
    let text = relabel(&text, b.isa, b.check_arch)?;
    let relabelled = out_dir.join(format!("{stem}.ptx"));
    std::fs::write(&relabelled, &text)?;
    let ptxas = nvcc.with_file_name("ptxas");
    let status = Command::new(&ptxas)
        .args([&format!("-arch={}", b.check_arch), "-o"])
        .arg(out_dir.join(format!("{stem}.cubin")))
        .arg(&relabelled)
        .status()
        .with_context(|| format!("running {}", ptxas.display()))?;
    if !status.success() {
        bail!(
            "ptxas rejects {} as PTX ISA {}: the kernel uses an instruction \
             that needs a newer ISA (and a newer driver); change the kernel or \
             the build's ISA in xtask/src/ptx.rs",
            relabelled.display(),
            b.isa
        );
    }
    Ok(text)
}

/// Rewrites the `.version` line of `ptx` to `isa`, and notes the change in a
/// comment above it. Fails when nvcc's ISA is older than `isa` or missing.
fn relabel(ptx: &str, isa: &str, check_arch: &str) -> Result<String> {
    let mut out = String::with_capacity(ptx.len() + 128);
    let mut found = false;
    for line in ptx.lines() {
        if let Some(v) = line.trim().strip_prefix(".version ") {
            if found {
                bail!("nvcc output has two .version lines");
            }
            found = true;
            let v = v.trim();
            if parse_isa(v)? < parse_isa(isa)? {
                bail!("nvcc wrote PTX ISA {v}, older than the {isa} required");
            }
            if v != isa {
                out.push_str(&format!(
                    "// .version relabelled from {v} to {isa} by `cargo xtask ptx`; \
                     checked with ptxas -arch={check_arch}\n"
                ));
            }
            out.push_str(&format!(".version {isa}\n"));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !found {
        bail!("nvcc output has no .version line");
    }
    Ok(out)
}

fn parse_isa(v: &str) -> Result<(u32, u32)> {
    let (major, minor) = v
        .split_once('.')
        .with_context(|| format!("bad PTX ISA version `{v}`"))?;
    Ok((
        major
            .parse()
            .with_context(|| format!("bad PTX ISA `{v}`"))?,
        minor
            .parse()
            .with_context(|| format!("bad PTX ISA `{v}`"))?,
    ))
}

/// `nvcc` on PATH, else `$CUDA_HOME/bin/nvcc`, else the pinned wheels.
fn find_nvcc(root: &Path) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let nvcc = dir.join("nvcc");
            if nvcc.is_file() {
                return Ok(nvcc);
            }
        }
    }
    if let Some(home) = std::env::var_os("CUDA_HOME").filter(|h| !h.is_empty()) {
        let nvcc = PathBuf::from(home).join("bin/nvcc");
        if nvcc.is_file() {
            return Ok(nvcc);
        }
    }
    fetch_wheels(root)
}

/// Downloads and unpacks the pinned compiler wheels unless already there;
/// returns the path of their nvcc.
fn fetch_wheels(root: &Path) -> Result<PathBuf> {
    let cache = root.join("target/xtask-cache/nvcc");
    let tree = cache.join("nvidia/cu13");
    std::fs::create_dir_all(&cache)?;
    for (wheel, marker) in WHEELS {
        if tree.join(marker).exists() {
            continue;
        }
        let name = wheel.split("==").next().unwrap_or(wheel).replace('-', "_");
        let version = wheel.split("==").nth(1).unwrap_or_default();
        let prefix = format!("{name}-{version}-");
        let find = || -> Result<Option<PathBuf>> {
            Ok(std::fs::read_dir(&cache)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .find(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
                }))
        };
        let whl = match find()? {
            Some(whl) => whl,
            None => {
                println!(
                    "xtask ptx: no nvcc on PATH or in $CUDA_HOME; downloading {wheel} \
                     from PyPI into {}",
                    cache.display()
                );
                let status = Command::new("python3")
                    .args([
                        "-m",
                        "pip",
                        "download",
                        "--quiet",
                        "--no-deps",
                        "--only-binary=:all:",
                    ])
                    .args([
                        "--python-version",
                        "3.12",
                        "--platform",
                        "manylinux2014_x86_64",
                        "-d",
                    ])
                    .arg(&cache)
                    .arg(wheel)
                    .status()
                    .context("running `python3 -m pip download` (is pip installed?)")?;
                if !status.success() {
                    bail!("pip could not download {wheel}");
                }
                find()?.with_context(|| format!("no wheel for {wheel} in {}", cache.display()))?
            }
        };
        println!("xtask ptx: unpacking {}", whl.display());
        let status = Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&whl)
            .arg(&cache)
            .status()
            .context("running `python3 -m zipfile`")?;
        if !status.success() || !tree.join(marker).exists() {
            bail!("{} did not contain nvidia/cu13/{marker}", whl.display());
        }
    }
    // zipfile drops the executable bits.
    for dir in [tree.join("bin"), tree.join("nvvm/bin")] {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.is_file() {
                let mut perms = std::fs::metadata(&path)?.permissions();
                if perms.mode() & 0o111 != 0o111 {
                    perms.set_mode(perms.mode() | 0o755);
                    std::fs::set_permissions(&path, perms)?;
                }
            }
        }
    }
    Ok(tree.join("bin/nvcc"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relabel_rewrites_the_version_line_only() {
        let ptx = "//\n// Generated\n//\n\n.version 9.0\n.target sm_80\n";
        let out = relabel(ptx, "7.0", "sm_80").unwrap();
        assert_eq!(
            out,
            "//\n// Generated\n//\n\n// .version relabelled from 9.0 to 7.0 by \
             `cargo xtask ptx`; checked with ptxas -arch=sm_80\n.version 7.0\n.target sm_80\n"
        );
        assert_eq!(
            relabel(".version 7.0\n", "7.0", "sm_80").unwrap(),
            ".version 7.0\n"
        );
    }

    #[test]
    fn relabel_refuses_odd_input() {
        assert!(relabel(".target sm_80\n", "7.0", "sm_80").is_err());
        assert!(relabel(".version 6.5\n", "7.0", "sm_80").is_err());
        assert!(relabel(".version 9.0\n.version 9.0\n", "7.0", "sm_80").is_err());
        assert!(relabel(".version nine\n", "7.0", "sm_80").is_err());
    }

    #[test]
    fn isa_versions_compare_numerically() {
        assert!(parse_isa("7.10").unwrap() > parse_isa("7.8").unwrap());
        assert_eq!(parse_isa("9.0").unwrap(), (9, 0));
    }
}
