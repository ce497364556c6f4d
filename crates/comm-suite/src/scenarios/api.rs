//! Scenarios of the 0.2 API: dtype-generic all-reduce (f16, f32, bf16),
//! all-to-all with equal and per-peer counts, sub-communicators from
//! `split` running collectives concurrently, and groups owned by the
//! thread that opened them.
//!
//! Invariants: outputs are poisoned before every operation and every
//! element is checked against a host reference; every rank issues the same
//! operations on each communicator in the same order.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use half::{bf16, f16};
use metrale_comm::{AllReducePath, CommBackend, FastPathPolicy, Group, NcclBackend};
use nccl_safe::{DeviceBuffer, Stream};

use super::exact;
use crate::RankCtx;
use crate::data::{
    POISON_BYTE, SuiteElem, all_reduce_reference, check, random_vec, sum_in_rank_order,
};

const WAIT: Duration = Duration::from_secs(60);

fn reduce_typed<T: SuiteElem>(
    ctx: &RankCtx,
    b: &NcclBackend,
    compute: &Stream,
    seed: u64,
    n: usize,
) -> anyhow::Result<()> {
    let w = ctx.world_size;
    for asynchronous in [false, true] {
        let salt = (n as u64) << 8 | asynchronous as u64;
        let inputs: Vec<Vec<T>> = (0..w).map(|k| random_vec(seed, k, salt, n)).collect();
        let what = format!(
            "all_reduce{} {n} x {}",
            if asynchronous { "_async" } else { "" },
            T::DATA_TYPE
        );
        ctx.step(what.clone());
        let mut buf = DeviceBuffer::from_host(b.context(), &inputs[ctx.rank])?;
        if asynchronous {
            b.all_reduce_async(buf.view_mut(), compute.as_ref())
                .with_context(|| what.clone())?;
            compute.wait_until_idle(WAIT)?;
        } else {
            b.all_reduce(buf.view_mut()).with_context(|| what.clone())?;
            b.synchronize().with_context(|| what.clone())?;
        }
        check(
            &what,
            &buf.to_host_vec()?,
            &all_reduce_reference(b, &inputs),
            exact(ctx),
            w,
        )?;
    }
    Ok(())
}

/// f16, f32 and bf16 all-reduce, sync and async, at odd and round sizes up
/// to 2 MiB, with the fast path allowed (it serves bf16 only).
pub fn all_reduce_dtypes(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("dtypes")?;
    let b = ctx.backend(
        "dtypes",
        ctx.config().with_fast_path(FastPathPolicy::Always),
    )?;
    let compute = Stream::new(b.context())?;
    for n in [1usize, 3, 1000, 4097, 65_537, 1 << 20] {
        reduce_typed::<f16>(ctx, &b, &compute, seed, n)?;
        reduce_typed::<f32>(ctx, &b, &compute, seed, n)?;
        reduce_typed::<bf16>(ctx, &b, &compute, seed, n)?;
    }
    ensure!(b.is_healthy(), "unhealthy after the dtype sweep");
    b.shutdown()?;
    Ok(())
}

/// All-to-all with equal blocks (f32), then with per-peer counts drawn from
/// the shared seed (bf16; zero counts included).
pub fn all_to_all(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("a2a")?;
    let (w, r) = (ctx.world_size, ctx.rank);
    let b = ctx.backend("a2a", ctx.config())?;
    let c = b.context().clone();
    for block in [1usize, 7, 4096, 65_537] {
        ctx.step(format!("all_to_all {block} per peer"));
        let inputs: Vec<Vec<f32>> = (0..w)
            .map(|k| random_vec(seed, k, block as u64, block * w))
            .collect();
        let send = DeviceBuffer::from_host(&c, &inputs[r])?;
        let mut recv = DeviceBuffer::<f32>::alloc(&c, block * w)?;
        recv.fill_bytes(POISON_BYTE)?;
        b.all_to_all(send.view(), recv.view_mut())?;
        b.synchronize()?;
        let want: Vec<f32> = (0..w)
            .flat_map(|i| inputs[i][r * block..(r + 1) * block].to_vec())
            .collect();
        check("all_to_all", &recv.to_host_vec()?, &want, true, w)?;
    }
    for round in 0..4u64 {
        ctx.step(format!("all_to_all_v round {round}"));
        // counts[i][j]: what rank i sends rank j; the same on every rank.
        let mut rng = crate::data::Rng::new(seed, 0, 0xa2a0 + round);
        let counts: Vec<Vec<usize>> = (0..w)
            .map(|_| {
                (0..w)
                    .map(|_| match rng.next_u64() % 4 {
                        0 => 0,
                        1 => 1,
                        2 => 1000 + (rng.next_u64() % 3000) as usize,
                        _ => (rng.next_u64() % 70_000) as usize,
                    })
                    .collect()
            })
            .collect();
        let sent: Vec<Vec<bf16>> = (0..w)
            .map(|i| random_vec(seed, i, 0xa2a1 + round, counts[i].iter().sum()))
            .collect();
        let send_counts = counts[r].clone();
        let recv_counts: Vec<usize> = (0..w).map(|i| counts[i][r]).collect();
        let send = DeviceBuffer::from_host(&c, &pad(&sent[r]))?;
        let total: usize = recv_counts.iter().sum();
        let mut recv = DeviceBuffer::<bf16>::alloc(&c, total.max(1))?;
        recv.fill_bytes(POISON_BYTE)?;
        let send_view = send.view();
        let send_view = if sent[r].is_empty() {
            // SAFETY: an empty prefix of `send`.
            unsafe { nccl_safe::DeviceView::from_raw(send_view.ptr(), 0, send_view.dtype()) }
        } else {
            send_view
        };
        b.all_to_all_v(send_view, &send_counts, recv.view_mut(), &recv_counts)?;
        b.synchronize()?;
        let mut want = Vec::with_capacity(total);
        for (i, row) in counts.iter().enumerate() {
            let off: usize = row[..r].iter().sum();
            want.extend_from_slice(&sent[i][off..off + row[r]]);
        }
        let got = recv.to_host_vec()?;
        check("all_to_all_v", &got[..total], &want, true, w)?;
    }
    ensure!(b.is_healthy(), "unhealthy after all-to-all");
    b.shutdown()?;
    Ok(())
}

/// One element when `v` is empty (a device buffer is never empty).
fn pad(v: &[bf16]) -> Vec<bf16> {
    if v.is_empty() {
        vec![bf16::ONE]
    } else {
        v.to_vec()
    }
}

/// `split` by `rank % 2` into two sub-groups that run collectives at the
/// same time; a rank that passes no color gets `None`; the parent keeps
/// working, and a sub-group's poisoning would be its own.
pub fn split_concurrent(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("split")?;
    let (w, r) = (ctx.world_size, ctx.rank);
    let parent = ctx.backend("split", ctx.config())?;
    ctx.step("split by rank % 2");
    let color = (r % 2) as u32;
    let child = parent
        .split(Some(color), r)?
        .context("a rank with a color got no sub-communicator")?;
    let members: Vec<usize> = (0..w).filter(|k| k % 2 == r % 2).collect();
    ensure!(
        child.world_size() == members.len() && members[child.rank()] == r,
        "sub-group rank {} of {}, expected {:?}",
        child.rank(),
        child.world_size(),
        members
    );
    let c = parent.context().clone();
    for round in 0..3u64 {
        ctx.step(format!("sub-group {color} all_reduce round {round}"));
        let n = 4097 + round as usize * 1000;
        let inputs: Vec<Vec<f32>> = members
            .iter()
            .map(|&k| random_vec(seed, k, round, n))
            .collect();
        let mut buf = DeviceBuffer::from_host(&c, &inputs[child.rank()])?;
        child.all_reduce(buf.view_mut())?;
        child.synchronize()?;
        check(
            &format!("sub-group {color} all_reduce"),
            &buf.to_host_vec()?,
            &sum_in_rank_order(&inputs),
            exact(ctx),
            members.len(),
        )?;
        let mut gathered = DeviceBuffer::<f32>::alloc(&c, n * members.len())?;
        gathered.fill_bytes(POISON_BYTE)?;
        let send = DeviceBuffer::from_host(&c, &inputs[child.rank()])?;
        child.all_gather(send.view(), gathered.view_mut())?;
        child.synchronize()?;
        check(
            &format!("sub-group {color} all_gather"),
            &gathered.to_host_vec()?,
            &inputs.concat(),
            true,
            members.len(),
        )?;
    }
    ctx.step("split with no color on odd ranks");
    let none = parent.split((r % 2 == 0).then_some(0), r)?;
    ensure!(
        none.is_some() == (r % 2 == 0),
        "split without a color returned a backend, or with one returned none"
    );
    // A communicator is torn down only while no peer can be waiting for
    // this rank on another one (NCCL's teardown waits for the GPUs that map
    // its buffers): every rank is idle at the barrier.
    ctx.barrier("before dropping the second split")?;
    drop(none);
    ctx.barrier("second split dropped")?;
    ctx.step("parent all_reduce after the splits");
    let inputs: Vec<Vec<f32>> = (0..w).map(|k| random_vec(seed, k, 99, 1000)).collect();
    let mut buf = DeviceBuffer::from_host(&c, &inputs[r])?;
    parent.all_reduce(buf.view_mut())?;
    parent.synchronize()?;
    check(
        "parent all_reduce",
        &buf.to_host_vec()?,
        &sum_in_rank_order(&inputs),
        exact(ctx),
        w,
    )?;
    ctx.barrier("before the sub-group's shutdown")?;
    child.shutdown()?;
    parent.shutdown()?;
    Ok(())
}

/// Two threads share one backend: thread A holds a group open around a
/// send/recv ring while thread B calls `barrier` and asks for the fast-path
/// choice. B's calls neither fail with `InGroup` nor see A's group: the
/// barrier waits for A's group to end, then runs.
pub fn thread_groups(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("tgroups")?;
    let (w, r) = (ctx.world_size, ctx.rank);
    let b = Arc::new(ctx.backend(
        "tgroups",
        ctx.config().with_fast_path(FastPathPolicy::Always),
    )?);
    let c = b.context().clone();
    let n = 4096;
    let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, 1, n)).collect();
    let send = DeviceBuffer::from_host(&c, &inputs[r])?;
    let mut recv = DeviceBuffer::<bf16>::alloc(&c, n)?;
    recv.fill_bytes(POISON_BYTE)?;
    let stream = Stream::new(&c)?;
    let (to, from) = ((r + 1) % w, (r + w - 1) % w);
    let (opened_tx, opened_rx) = mpsc::channel::<()>();
    ctx.step("thread A: group with a send/recv ring; thread B: barrier");
    let hold = Duration::from_millis(300);
    let (b_result, b_took, b_path) = std::thread::scope(|scope| -> anyhow::Result<_> {
        let bb = b.clone();
        let other = scope.spawn(move || {
            opened_rx
                .recv_timeout(WAIT)
                .map_err(|_| anyhow::anyhow!("thread A never opened its group"))?;
            let path = bb.all_reduce_path(2 << 20);
            let t = Instant::now();
            let res = bb.barrier();
            anyhow::Ok((res, t.elapsed(), path))
        });
        if w > 1 {
            let group = Group::start(&*b)?;
            b.send_to(send.view(), to, stream.as_ref())?;
            b.recv_from(recv.view_mut(), from, stream.as_ref())?;
            let _ = opened_tx.send(());
            std::thread::sleep(hold);
            group.end()?;
        } else {
            let group = Group::start(&*b)?;
            let _ = opened_tx.send(());
            std::thread::sleep(hold);
            group.end()?;
        }
        other
            .join()
            .map_err(|_| anyhow::anyhow!("thread B panicked"))?
    })?;
    b_result.context("thread B's barrier during thread A's group")?;
    ensure!(
        b_took >= hold / 2,
        "thread B's barrier returned after {b_took:?}, inside thread A's group"
    );
    let want_path = if w == 2 {
        AllReducePath::FastPath
    } else {
        AllReducePath::Nccl
    };
    ensure!(
        b_path == want_path,
        "thread B saw {b_path:?} while thread A's group was open, expected {want_path:?}"
    );
    if w > 1 {
        stream.wait_until_idle(WAIT)?;
        check(
            "send/recv ring in thread A's group",
            &recv.to_host_vec()?,
            &inputs[from],
            true,
            w,
        )?;
    }
    ensure!(b.is_healthy(), "unhealthy after the threads' groups");
    b.shutdown()?;
    Ok(())
}
