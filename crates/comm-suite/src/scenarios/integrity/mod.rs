//! Integrity scenarios: a backend call returns `Ok` only for work that was
//! done right, and a failure stays a failure. Each reproduces one defect of
//! issue #14 on 2 ranks; one file per kind of defect:
//! - `overlap`, `int_fast_path_streams`: fast-path all-reduces issued on
//!   the backend's stream, a caller stream (`all_reduce_async`) and a
//!   replayed graph on a caller stream (a captured all-reduce takes NCCL's
//!   path and overlaps the others), with no synchronize between, and by
//!   four threads of a rank sharing one backend, all give the exact sum;
//! - `failures`, `int_mismatch_reported`: an all-reduce the emulator fails
//!   (the ranks pass different sizes) is reported by that call or by
//!   `synchronize`, naming `all_reduce` and its sequence number, and
//!   poisons; `int_shutdown_after_failure`: `shutdown` right after a failed
//!   fast-path all-reduce returns within its timeout and leaves nothing
//!   running on memory it freed or that the caller frees next;
//! - `waiters`, `int_reconnect_aborts_waiters`: a thread waiting in
//!   `synchronize` or idling in `recv_command_u32` while another thread
//!   reconnects gets an error, never `Ok` for work the reconnect aborted;
//!   `int_shutdown_idle_worker`: `shutdown` while another thread idles in
//!   `recv_command_u32` returns promptly, not after its timeout.
//!
//! This file holds what they share: the data, its upload, the exact check
//! and the listing of what was wrong.
//!
//! Invariants: inputs are small non-zero integers, so every sum is exact in
//! bf16 and every element is compared bit for bit; a rank never stops
//! early on a wrong result (it finishes the same calls as its peer and
//! reports everything it saw at the end); every wait has a deadline;
//! scenarios that inject emulator faults skip on GPUs and reset the faults
//! when they end.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use half::bf16;
use metrale_comm::{CommBackend, CommError, NcclBackend};
use nccl_safe::{Context, DeviceBuffer};

use crate::RankCtx;
use crate::data::{ints_to_bf16, small_ints};

mod failures;
mod overlap;
mod waiters;

pub use failures::{mismatch_reported, shutdown_after_failure};
pub use overlap::fast_path_streams;
pub use waiters::{reconnect_aborts_waiters, shutdown_idle_worker};

/// How much later than its bound an error may come.
const SLACK: Duration = Duration::from_secs(1);
/// How many wrong buffers a failure lists one by one.
const LISTED: usize = 12;

/// One buffer's input on this rank and the sum over all ranks.
struct Data {
    mine: Vec<i32>,
    sum: Vec<i32>,
}

fn data(ctx: &RankCtx, seed: u64, salt: u64, n: usize) -> Data {
    let inputs: Vec<Vec<i32>> = (0..ctx.world_size)
        .map(|k| small_ints(seed, k, salt, n))
        .collect();
    let mut sum = vec![0i32; n];
    for v in &inputs {
        for (s, x) in sum.iter_mut().zip(v) {
            *s += x;
        }
    }
    Data {
        mine: inputs[ctx.rank].clone(),
        sum,
    }
}

fn upload(c: &Arc<Context>, v: &[i32]) -> anyhow::Result<DeviceBuffer<bf16>> {
    Ok(DeviceBuffer::from_host(c, &ints_to_bf16(v))?)
}

/// `None` when `got` holds `want` exactly, else what is wrong, counting the
/// elements that still hold this rank's `input`.
fn wrong(what: &str, got: &[bf16], want: &[i32], input: &[i32]) -> Option<String> {
    let mut bad = 0usize;
    let mut unreduced = 0usize;
    let mut first = None;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32();
        if g != *w as f32 {
            bad += 1;
            if g == input[i] as f32 {
                unreduced += 1;
            }
            if first.is_none() {
                first = Some((i, g, *w));
            }
        }
    }
    let (i, g, w) = first?;
    Some(format!(
        "{what}: {bad} of {} elements wrong ({unreduced} still hold this rank's input); \
         first at {i}: got {g}, expected {w}",
        got.len()
    ))
}

/// Lists at most [`LISTED`] lines, then how many more there are.
fn listing(lines: &[String]) -> String {
    let mut s = lines
        .iter()
        .take(LISTED)
        .map(|l| format!("\n  {l}"))
        .collect::<String>();
    if lines.len() > LISTED {
        s.push_str(&format!("\n  ... and {} more", lines.len() - LISTED));
    }
    s
}

/// A correct all-reduce of 4097 elements, checked.
fn reduce_ok(ctx: &RankCtx, b: &NcclBackend, seed: u64, salt: u64) -> anyhow::Result<()> {
    let n = 4097;
    let d = data(ctx, seed, salt, n);
    let mut buf = upload(b.context(), &d.mine)?;
    b.all_reduce(buf.view_mut())
        .and_then(|()| b.synchronize())
        .with_context(|| format!("the all_reduce (salt {salt}) of a healthy backend"))?;
    if let Some(w) = wrong("all_reduce", &buf.to_host_vec()?, &d.sum, &d.mine) {
        anyhow::bail!("{w}");
    }
    Ok(())
}

/// The name of `e`'s variant, for messages about the wrong kind of error.
fn variant(e: &CommError) -> &'static str {
    match e {
        CommError::InvalidArgument { .. } => "InvalidArgument",
        CommError::UnknownHandle { .. } => "UnknownHandle",
        CommError::InGroup { .. } => "InGroup",
        CommError::Poisoned { .. } => "Poisoned",
        CommError::Failed(_) => "Failed",
        CommError::Refused { .. } => "Refused",
        CommError::Shutdown { .. } => "Shutdown",
        CommError::Reconnecting { .. } => "Reconnecting",
        CommError::Aborted { .. } => "Aborted",
        CommError::GroupBusy { .. } => "GroupBusy",
        CommError::Thread { .. } => "Thread",
        CommError::Unsupported { .. } => "Unsupported",
        CommError::Setup { .. } => "Setup",
        CommError::Rendezvous(_) => "Rendezvous",
        CommError::Config(_) => "Config",
        _ => "another error",
    }
}
