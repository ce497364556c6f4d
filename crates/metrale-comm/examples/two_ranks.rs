//! A minimal two-rank program: each rank builds an `NcclBackend` from its
//! launcher's environment, all-reduces a bf16 buffer and checks the sum.
//! The device is the launcher's local rank (`LOCAL_RANK` here), or
//! `METRALE_COMM_DEVICE` when set.
//!
//! Run on a box with two GPUs: `cargo run --release --example two_ranks`.
//! Without a launcher in the environment it launches itself twice (ranks 0
//! and 1, `MASTER_ADDR=127.0.0.1`, a free port); under a launcher
//! (`torchrun --no-python --standalone --nproc-per-node 2 two_ranks`,
//! `srun`, `mpirun`) it is one rank.

use half::bf16;
use metrale_comm::{BackendConfig, CommBackend, NcclBackend};
use nccl_safe::DeviceBuffer;

fn main() -> anyhow::Result<()> {
    if metrale_comm::rendezvous::Launch::from_env().is_err() {
        return launch_two_ranks();
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
    println!("rank {rank}: all-reduce of {n} bf16 elements is correct");
    backend.shutdown()?;
    Ok(())
}

fn launch_two_ranks() -> anyhow::Result<()> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let exe = std::env::current_exe()?;
    let children: Vec<_> = (0..2)
        .map(|rank| {
            std::process::Command::new(&exe)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    for mut child in children {
        anyhow::ensure!(child.wait()?.success(), "a rank failed");
    }
    Ok(())
}
