//! Two communicators over the same devices, each rank using both at once
//! from two threads (decision 0016).
//!
//! - `two_worlds_concurrent`: a valid program. Each world's operations
//!   run on its own streams, issued in the same order on every rank of
//!   that world, and nothing waits for a whole device while work is in
//!   flight (every buffer is allocated before the threads start and freed
//!   after they join). NCCL runs this as long as both communicators'
//!   kernels fit on the GPU at once; the emulator runs it; every element
//!   is checked.
//! - `two_worlds_free_deadlock`: the deadlock NCCL warns of. Rank 0 of
//!   world B and rank 1 of world A each have an all-reduce in flight when
//!   the other world's thread on the same device frees memory: a free
//!   waits for all the device's work, so each free waits for a kernel
//!   that waits for the other free's thread. World B's shorter deadline
//!   breaks the cycle: its rank 0 times out with an error naming its own
//!   all-reduce and, when the ranks share a process, world A's all-reduce
//!   pending on rank 1; its abort frees world A to finish, correct; world
//!   B's rank 1 then times out too (across processes its all-reduce may
//!   instead complete with rank 0's part sent before the abort), both
//!   reconnect and run again.
//!
//! Invariants: outputs are poisoned before every operation and every
//! element is checked against a host reference; every wait is bounded
//! (the collective timeouts and the suite store's).

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use metrale_comm::{CommBackend, CommError, FailureKind, FastPathPolicy, NcclBackend};
use nccl_safe::{DeviceBuffer, Stream};

use super::exact;
use crate::data::{POISON_BYTE, check, random_vec, sum_in_rank_order};
use crate::{Mode, RankCtx};

/// The rounds of the concurrent program, per world.
const ROUNDS: u64 = 24;

/// One world's buffers for [`ROUNDS`] rounds, allocated up front.
struct Bufs {
    reduce: DeviceBuffer<f32>,
    gather_send: DeviceBuffer<f32>,
    gathered: DeviceBuffer<f32>,
    ring_send: DeviceBuffer<f32>,
    ring_recv: DeviceBuffer<f32>,
    compute: Stream,
}

const N: usize = 3001;

impl Bufs {
    fn new(be: &NcclBackend) -> anyhow::Result<Bufs> {
        let c = be.context();
        let w = be.world_size();
        Ok(Bufs {
            reduce: DeviceBuffer::alloc(c, N)?,
            gather_send: DeviceBuffer::alloc(c, N)?,
            gathered: DeviceBuffer::alloc(c, N * w)?,
            ring_send: DeviceBuffer::alloc(c, N)?,
            ring_recv: DeviceBuffer::alloc(c, N)?,
            compute: Stream::new(c)?,
        })
    }
}

/// One world's rounds: an all-reduce on the backend's stream, an
/// asynchronous one on a compute stream, an all-gather and a send/recv
/// ring in a group, each round checked.
fn rounds(ctx: &RankCtx, be: &NcclBackend, bufs: &mut Bufs, seed: u64) -> anyhow::Result<()> {
    let (w, r) = (be.world_size(), be.rank());
    let (to, from) = ((r + 1) % w, (r + w - 1) % w);
    for round in 0..ROUNDS {
        let ins: Vec<Vec<f32>> = (0..w).map(|k| random_vec(seed, k, round, N)).collect();
        let what = |op: &str| format!("world {seed:#x} round {round} {op}");
        bufs.reduce.copy_from_host(&ins[r])?;
        if round % 2 == 0 {
            be.all_reduce(bufs.reduce.view_mut())
        } else {
            be.all_reduce_async(bufs.reduce.view_mut(), bufs.compute.as_ref())
        }
        .with_context(|| what("all_reduce"))?;
        bufs.gather_send.copy_from_host(&ins[r])?;
        bufs.gathered.fill_bytes(POISON_BYTE)?;
        be.all_gather(bufs.gather_send.view(), bufs.gathered.view_mut())
            .with_context(|| what("all_gather"))?;
        bufs.ring_send.copy_from_host(&ins[r])?;
        bufs.ring_recv.fill_bytes(POISON_BYTE)?;
        be.group_start()?;
        let sent = be
            .send_to(bufs.ring_send.view(), to, bufs.compute.as_ref())
            .and_then(|()| be.recv_from(bufs.ring_recv.view_mut(), from, bufs.compute.as_ref()));
        let ended = be.group_end();
        sent.and(ended).with_context(|| what("send/recv ring"))?;
        be.synchronize().with_context(|| what("synchronize"))?;
        check(
            &what("all_reduce"),
            &bufs.reduce.to_host_vec()?,
            &sum_in_rank_order(&ins),
            exact(ctx),
            w,
        )?;
        check(
            &what("all_gather"),
            &bufs.gathered.to_host_vec()?,
            &ins.concat(),
            true,
            w,
        )?;
        check(
            &what("send/recv ring"),
            &bufs.ring_recv.to_host_vec()?,
            &ins[from],
            true,
            w,
        )?;
    }
    Ok(())
}

/// Joins world A's and world B's threads: both run to their end, then
/// the first error (world A's first).
fn join_both(
    ta: std::thread::ScopedJoinHandle<'_, anyhow::Result<()>>,
    tb: std::thread::ScopedJoinHandle<'_, anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let ra = ta
        .join()
        .map_err(|_| anyhow::anyhow!("world A's thread panicked"))?;
    let rb = tb
        .join()
        .map_err(|_| anyhow::anyhow!("world B's thread panicked"))?;
    ra.context("world A")?;
    rb.context("world B")
}

/// `two_worlds_concurrent`.
pub fn concurrent(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("two-worlds")?;
    let a = ctx.backend("world-a", ctx.config())?;
    let b = ctx.backend(
        "world-b",
        ctx.config().with_fast_path(FastPathPolicy::Never),
    )?;
    let mut bufs = [Bufs::new(&a)?, Bufs::new(&b)?];
    ctx.barrier("two worlds allocated")?;
    ctx.step("both worlds' rounds at once");
    let [ba, bb] = &mut bufs;
    std::thread::scope(|s| -> anyhow::Result<()> {
        let ta = s.spawn(|| rounds(ctx, &a, ba, seed));
        let tb = s.spawn(|| rounds(ctx, &b, bb, seed ^ 0xb));
        join_both(ta, tb)
    })?;
    ensure!(a.is_healthy() && b.is_healthy(), "a world was poisoned");
    // Freeing waits for the device: only once no peer can be waiting on
    // this rank's work in either world.
    ctx.barrier("two worlds done")?;
    drop(bufs);
    a.shutdown()?;
    b.shutdown()?;
    Ok(())
}

/// World B's collective timeout in `two_worlds_free_deadlock`; world A's
/// is five times as long, so B's rank 0 is the one that breaks the cycle.
const B_TIMEOUT: Duration = Duration::from_secs(2);

/// Asserts `e` is world B's timeout of an all-reduce; in threads mode it
/// must also name world A's all-reduce pending on rank 1 (`a1`, its
/// backend id) when `names_a1`.
fn b_timed_out(ctx: &RankCtx, e: &CommError, names_a1: Option<u64>) -> anyhow::Result<()> {
    let f = e
        .failure()
        .with_context(|| format!("world B failed without a recorded failure: {e}"))?;
    ensure!(
        matches!(f.kind, FailureKind::Timeout { .. }) && f.op == "all_reduce",
        "world B: expected its all_reduce to time out, got: {e}"
    );
    if let Some(a1) = names_a1 {
        ensure!(
            f.elsewhere
                .iter()
                .any(|x| x.backend == a1 && x.op == "all_reduce" && x.rank == 1),
            "rank {}: world B's timeout does not name world A's pending all_reduce on rank 1 \
             (backend {a1}): {e}",
            ctx.rank
        );
    }
    Ok(())
}

/// `two_worlds_free_deadlock`.
pub fn free_deadlock(ctx: &RankCtx) -> anyhow::Result<()> {
    if ctx.on_gpu() {
        return Err(RankCtx::skip(
            "the free that waits for the device is the emulator's model of the driver's \
             implicit synchronisation; on GPUs this deadlock is not asserted",
        ));
    }
    let (w, r) = (ctx.world_size, ctx.rank);
    let seed = ctx.shared_seed("free-deadlock")?;
    let never = ctx.config().with_fast_path(FastPathPolicy::Never);
    let a = ctx.backend(
        "world-a",
        never.clone().with_collective_timeout(5 * B_TIMEOUT),
    )?;
    let b = ctx.backend("world-b", never.with_collective_timeout(B_TIMEOUT))?;
    let c = a.context().clone();
    ctx.set(&format!("a-id/{r}"), &a.id().to_le_bytes())?;
    let a1 = u64::from_le_bytes(
        ctx.get("a-id/1")?
            .try_into()
            .map_err(|_| anyhow::anyhow!("a backend id of the wrong size"))?,
    );
    let ins: Vec<Vec<f32>> = (0..w).map(|k| random_vec(seed, k, 1, N)).collect();
    let want = sum_in_rank_order(&ins);
    let mut ba = DeviceBuffer::from_host(&c, &ins[r])?;
    let mut bb = DeviceBuffer::from_host(&c, &ins[r])?;
    // What each rank's other thread frees while the all-reduces wait.
    let doomed_a = DeviceBuffer::<f32>::alloc(&c, 64)?;
    let doomed_b = DeviceBuffer::<f32>::alloc(&c, 64)?;
    // One checked all-reduce on each world first: a non-blocking
    // communicator's first operation waits inside the call for its peers
    // (NCCL connects lazily), which would hold world A's rank 1 before the
    // deadlock is set up.
    for (be, name) in [(&a, "A"), (&b, "B")] {
        let warm: Vec<Vec<f32>> = (0..w).map(|k| random_vec(seed, k, 3, N)).collect();
        let mut buf = DeviceBuffer::from_host(&c, &warm[r])?;
        be.all_reduce(buf.view_mut())?;
        be.synchronize()?;
        check(
            &format!("world {name}'s first all-reduce"),
            &buf.to_host_vec()?,
            &sum_in_rank_order(&warm),
            exact(ctx),
            w,
        )?;
    }
    ctx.barrier("deadlock set up")?;
    let started = Instant::now();
    let in_one_process = ctx.mode == Mode::Threads;
    let names_a1 = in_one_process.then_some(a1);
    std::thread::scope(|s| -> anyhow::Result<()> {
        let (a, b, ba, bb, want) = (&a, &b, &mut ba, &mut bb, &want);
        let ta = s.spawn(move || -> anyhow::Result<()> {
            if r == 1 {
                // World A's rank 1: its all-reduce waits for rank 0's,
                // which comes only after rank 0's free.
                a.all_reduce(ba.view_mut())?;
                ctx.set("pending/a1", b"1")?;
            } else {
                ctx.get("pending/a1")?;
                ctx.get("pending/b0")?;
                ctx.step("world A rank 0 frees under world B's pending all_reduce");
                drop(doomed_a);
                a.all_reduce(ba.view_mut())?;
            }
            a.synchronize().context("world A's all_reduce")
        });
        let tb = s.spawn(move || -> anyhow::Result<()> {
            if r == 0 {
                b.all_reduce(bb.view_mut())?;
                ctx.set("pending/b0", b"1")?;
                let e = b
                    .synchronize()
                    .err()
                    .context("world B's rank 0 finished an all_reduce its peer never joined")?;
                b_timed_out(ctx, &e, names_a1)
            } else {
                ctx.get("pending/a1")?;
                ctx.get("pending/b0")?;
                ctx.step("world B rank 1 frees under world A's pending all_reduce");
                drop(doomed_b);
                b.all_reduce(bb.view_mut())?;
                match b.synchronize() {
                    Err(e) => b_timed_out(ctx, &e, None),
                    // Across processes rank 0's part may have reached this
                    // rank before its abort: the all-reduce completes, as
                    // over NCCL's network transport.
                    Ok(()) if !in_one_process => {
                        check("world B on rank 1", &bb.to_host_vec()?, want, exact(ctx), w)
                    }
                    Ok(()) => {
                        anyhow::bail!("world B's rank 1 finished an all_reduce its peer aborted")
                    }
                }
            }
        });
        join_both(ta, tb)
    })?;
    let took = started.elapsed();
    ensure!(
        took < 4 * B_TIMEOUT + Duration::from_secs(3),
        "the deadlock took {took:?} to resolve"
    );
    check(
        "world A after the deadlock",
        &ba.to_host_vec()?,
        &want,
        exact(ctx),
        w,
    )?;
    ensure!(a.is_healthy(), "world A was poisoned");
    ensure!(
        r == 1 || !b.is_healthy(),
        "world B is still healthy after its timeout"
    );
    // Every rank of world B reconnects (a healthy one too: the others
    // need its new communicator).
    ctx.step("world B reconnects");
    b.attempt_reconnect().context("world B's reconnect")?;
    let again: Vec<Vec<f32>> = (0..w).map(|k| random_vec(seed, k, 2, N)).collect();
    bb.copy_from_host(&again[r])?;
    b.all_reduce(bb.view_mut())?;
    b.synchronize()?;
    check(
        "world B after its reconnect",
        &bb.to_host_vec()?,
        &sum_in_rank_order(&again),
        exact(ctx),
        w,
    )?;
    ctx.barrier("deadlock resolved")?;
    a.shutdown()?;
    b.shutdown()?;
    Ok(())
}
