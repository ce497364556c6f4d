//! A minimal two-rank program: each rank builds an `NcclBackend` from its
//! launcher's environment, all-reduces a bf16 buffer and checks the sum.
//! The device is the launcher's local rank (`LOCAL_RANK` here), or
//! `METRALE_COMM_DEVICE` when set.
//!
//! `cargo run --release -p metrale-comm --example two_ranks` runs anywhere:
//! without a launcher in the environment it launches itself twice (ranks 0
//! and 1, `MASTER_ADDR=127.0.0.1`, a free port), as torchrun would, on two
//! GPUs when the CUDA driver shows at least two, else on the CPU emulator
//! (`libgpu_emu.so`, found beside this binary or under `target/<profile>/`;
//! `cargo build -p gpu-emu` builds it), and its first line says which.
//! `METRALE_CUDA_LIBRARY`, when set, is used as it is. Under a launcher
//! (`torchrun --no-python --standalone --nproc-per-node 2 two_ranks`,
//! `srun`, `mpirun`) it is one rank.
//!
//! Invariant: the launcher waits for both ranks and fails when either does
//! (stopping the other).

use std::path::{Path, PathBuf};

use half::bf16;
use metrale_comm::{BackendConfig, CommBackend, NcclBackend};
use nccl_safe::DeviceBuffer;

fn main() -> anyhow::Result<()> {
    if metrale_comm::rendezvous::Launch::from_env().is_err() {
        // The launcher's errors are for a person: one message, no trace.
        if let Err(e) = launch_two_ranks() {
            eprintln!("{e:#}");
            std::process::exit(1);
        }
        return Ok(());
    }
    let backend = NcclBackend::from_env(BackendConfig::new)?;
    let rank = backend.rank();

    // Rank r contributes (i % 7) + r + 1 at index i.
    let n = 1 << 20;
    let host: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32((i % 7 + rank + 1) as f32))
        .collect();
    let mut buf = DeviceBuffer::from_host(backend.context(), &host)?;

    // The buffer's typed view: its address, length and element type.
    backend.all_reduce(buf.view_mut())?;
    backend.synchronize()?;

    let out = buf.to_host_vec()?;
    for (i, v) in out.iter().enumerate() {
        let want = bf16::from_f32((2 * (i % 7) + 3) as f32);
        anyhow::ensure!(
            *v == want,
            "rank {rank}: element {i} is {v}, expected {want}"
        );
    }
    println!(
        "rank {rank} (process {}): all-reduce of {n} bf16 elements is correct",
        std::process::id()
    );
    backend.shutdown()?;
    Ok(())
}

/// Where the ranks run.
enum Target {
    /// The libraries the environment names.
    AsSet,
    /// The GPUs, through the system's driver and NCCL.
    Gpus,
    /// The CPU emulator at this path.
    Emulator(PathBuf),
}

/// Picks where the ranks run and says so (the program's first line).
fn choose() -> anyhow::Result<Target> {
    if let Some(lib) = std::env::var_os(cuda_sys::LIBRARY_ENV) {
        println!(
            "two_ranks: on the driver library {} names ({})",
            cuda_sys::LIBRARY_ENV,
            Path::new(&lib).display()
        );
        return Ok(Target::AsSet);
    }
    let why = match nccl_safe::device_count() {
        Ok(n) if n >= 2 => {
            println!("two_ranks: on GPUs 0 and 1 of {n} (CUDA driver found)");
            return Ok(Target::Gpus);
        }
        Ok(n) => format!("the CUDA driver shows {n} GPU(s), two are needed"),
        Err(e) => format!("no usable CUDA driver: {e}"),
    };
    let lib = find_emulator(&why)?;
    println!("two_ranks: on the CPU emulator ({})", lib.display());
    println!("two_ranks: not on GPUs: {why}");
    Ok(Target::Emulator(lib))
}

/// `libgpu_emu.so` beside this binary (`target/<profile>/examples`): in
/// `deps/` there (built with the examples) or in `target/<profile>/`, for
/// this profile first, then the other.
fn find_emulator(why: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let examples = exe.parent().unwrap_or(Path::new("."));
    let profile_dir = examples.parent().unwrap_or(examples);
    let target = profile_dir.parent().unwrap_or(profile_dir);
    let mut tried = Vec::new();
    let mut dirs = vec![
        examples.to_path_buf(),
        profile_dir.join("deps"),
        profile_dir.to_path_buf(),
    ];
    for other in ["debug", "release"] {
        let d = target.join(other);
        if d != profile_dir {
            dirs.push(d.clone());
            dirs.push(d.join("deps"));
        }
    }
    for d in dirs {
        let p = d.join("libgpu_emu.so");
        if p.is_file() {
            return Ok(p);
        }
        tried.push(p.display().to_string());
    }
    anyhow::bail!(
        "two_ranks: not on GPUs ({why}), and the CPU emulator is not built \
         (looked for {}): build it with `cargo build -p gpu-emu` and run again",
        tried.join(", ")
    )
}

fn launch_two_ranks() -> anyhow::Result<()> {
    let target = choose()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let exe = std::env::current_exe()?;
    let mut children: Vec<_> = (0..2)
        .map(|rank| {
            let mut cmd = std::process::Command::new(&exe);
            cmd.env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string());
            match &target {
                Target::Emulator(lib) => {
                    cmd.env(cuda_sys::LIBRARY_ENV, lib)
                        .env(nccl_sys::LIBRARY_ENV, lib);
                }
                Target::AsSet | Target::Gpus => {}
            }
            cmd.spawn()
        })
        .collect::<Result<_, _>>()?;
    // A rank that fails takes the other down with it, rather than leaving
    // it to wait for its peer until its init deadline.
    let mut done = [false; 2];
    while !done.iter().all(|d| *d) {
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            if let Some(status) = child.try_wait()? {
                done[rank] = true;
                if !status.success() {
                    for c in &mut children {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    anyhow::bail!("rank {rank} failed ({status})");
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Ok(())
}
