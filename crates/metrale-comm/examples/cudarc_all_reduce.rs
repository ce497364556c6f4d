//! All-reduces a cudarc buffer with metrale-comm: one rank per visible GPU
//! (at most two), as threads of this process.
//!
//! `cargo run --release -p metrale-comm --features cudarc --example cudarc_all_reduce`
//! on a GPU box (cudarc opens the system's CUDA driver itself).

use std::sync::Arc;

use cudarc::driver::CudaContext;
use half::bf16;
use metrale_comm::{BackendConfig, CommBackend, NcclBackend, UniqueId};
use nccl_safe::cudarc_interop;

fn main() -> anyhow::Result<()> {
    let gpus = CudaContext::device_count()?.clamp(1, 2) as usize;
    let id = UniqueId::new()?;
    let ranks: Vec<_> = (0..gpus)
        .map(|rank| {
            let id = id.clone();
            std::thread::spawn(move || rank_main(rank, gpus, &id))
        })
        .collect();
    for r in ranks {
        r.join().map_err(|_| anyhow::anyhow!("a rank panicked"))??;
    }
    Ok(())
}

fn rank_main(rank: usize, world: usize, id: &UniqueId) -> anyhow::Result<()> {
    let ctx: Arc<CudaContext> = CudaContext::new(rank)?;
    let stream = ctx.new_stream()?;
    let n = 1 << 20;
    let host: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32((i % 7 + rank + 1) as f32))
        .collect();
    let mut x = stream.clone_htod(&host)?;

    let backend = NcclBackend::with_unique_id(BackendConfig::new(rank), id, rank, world)?;
    {
        let buf = cudarc_interop::view_mut(&mut x, &stream);
        backend.all_reduce_async(buf.view, cudarc_interop::stream_ref(&stream))?;
    }
    let out = stream.clone_dtoh(&x)?;
    for (i, v) in out.iter().enumerate() {
        let want: usize = (0..world).map(|r| i % 7 + r + 1).sum();
        anyhow::ensure!(
            *v == bf16::from_f32(want as f32),
            "rank {rank}: element {i} is {v}, expected {want}"
        );
    }
    println!("rank {rank} of {world}: all-reduce of a cudarc buffer ({n} bf16) is correct");
    backend.shutdown()?;
    Ok(())
}
