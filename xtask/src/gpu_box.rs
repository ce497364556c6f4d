//! What the GPU subcommands share: finding the GPUs through the driver
//! (`gpu-test` and `bench`), and building a release binary and writing a
//! bundle for a box without Rust (`gpu-test`; `bench` builds its own from
//! `cargo bench --no-run`).
//!
//! Invariant: nothing here parses `nvidia-smi`; a machine without a driver
//! or GPUs gives one line saying what is missing.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

/// The number of GPUs, or the reason there are none, as one line.
pub fn detect_gpus() -> Result<usize, String> {
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

/// Builds `package`'s binary `bin` in release mode and returns its path.
pub fn build_release_bin(package: &str, bin: &str) -> anyhow::Result<PathBuf> {
    let root = crate::workspace_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(&root)
        .args(["build", "--release", "-p", package, "--bin", bin])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("cargo build --release -p {package} --bin {bin} failed");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let exe = target.join("release").join(bin);
    if !exe.is_file() {
        bail!("{} was not built", exe.display());
    }
    Ok(exe)
}

/// Writes a bundle: the binary as `dir/name`, `run.sh` and `README.txt`.
pub fn write_bundle(
    exe: &Path,
    dir: &Path,
    name: &str,
    run_sh: &str,
    readme: &str,
) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let bin = dir.join(name);
    std::fs::copy(exe, &bin).with_context(|| format!("copying to {}", bin.display()))?;
    let sh = dir.join("run.sh");
    std::fs::write(&sh, run_sh)?;
    std::fs::set_permissions(&sh, std::fs::Permissions::from_mode(0o755))?;
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755))?;
    std::fs::write(dir.join("README.txt"), readme)?;
    Ok(())
}

/// What a GPU subcommand's command line asks for.
pub enum Cli {
    /// Exit at once with this status (`--help`: 0, an unknown option: 2).
    Exit(i32),
    /// Run, or write the bundle to `bundle`, passing `pass` on.
    Run {
        /// `--bundle DIR`.
        bundle: Option<PathBuf>,
        /// The options for the program, in order.
        pass: Vec<String>,
    },
}

/// Parses a GPU subcommand's options: `--help`, `--bundle DIR`, the
/// `flags` (no value) and the `valued` options (one value each), which are
/// passed on; anything else prints `help` and exits 2.
pub fn parse_cli(
    tool: &str,
    help: &str,
    flags: &[&str],
    valued: &[&str],
    args: &[String],
) -> anyhow::Result<Cli> {
    let mut bundle: Option<PathBuf> = None;
    let mut pass: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--help" | "-h" => {
                print!("{help}");
                return Ok(Cli::Exit(0));
            }
            "--bundle" => {
                let dir = it.next().context("--bundle needs a directory")?;
                bundle = Some(PathBuf::from(dir));
            }
            f if flags.contains(&f) => pass.push(a.clone()),
            v if valued.contains(&v) => {
                let value = it.next().with_context(|| format!("{a} needs a value"))?;
                pass.push(a.clone());
                pass.push(value.clone());
            }
            other => {
                eprintln!("{tool}: unknown option `{other}`");
                eprint!("{help}");
                return Ok(Cli::Exit(2));
            }
        }
    }
    Ok(Cli::Run { bundle, pass })
}

/// A release binary that runs on a GPU box: built and run here, or written
/// into a bundle for a box without Rust.
pub struct GpuProgram {
    /// The xtask subcommand's name, for messages.
    pub tool: &'static str,
    /// The cargo package and binary.
    pub package: &'static str,
    /// The binary's name.
    pub bin: &'static str,
    /// Arguments before the passed-through ones.
    pub leading_args: &'static [&'static str],
    /// What to say, after the reason, when there are no GPUs.
    pub no_gpu_hint: &'static str,
    /// The bundle's `run.sh` and `README.txt`.
    pub run_sh: &'static str,
    /// See `run_sh`.
    pub readme: &'static str,
}

impl GpuProgram {
    /// Writes the bundle into `bundle` when given; else, on a machine with
    /// GPUs, builds and runs the binary with `pass` and returns its exit
    /// code; without GPUs, prints one line on stderr and returns 2.
    pub fn run(&self, bundle: Option<&Path>, pass: &[String]) -> anyhow::Result<i32> {
        let tool = self.tool;
        if let Some(dir) = bundle {
            let exe = build_release_bin(self.package, self.bin)?;
            write_bundle(&exe, dir, self.bin, self.run_sh, self.readme)?;
            println!(
                "{tool}: bundle written to {} (copy it to a GPU box and run ./run.sh)",
                dir.display()
            );
            return Ok(0);
        }
        match detect_gpus() {
            Ok(n) => println!("{tool}: {n} GPU(s) found"),
            Err(line) => {
                eprintln!("{tool}: {line}; {}", self.no_gpu_hint);
                return Ok(2);
            }
        }
        let exe = build_release_bin(self.package, self.bin)?;
        let status = Command::new(&exe)
            .args(self.leading_args)
            .args(pass)
            .status()
            .with_context(|| format!("running {}", exe.display()))?;
        Ok(status.code().unwrap_or(1))
    }
}
