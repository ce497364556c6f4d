//! A world that spans hosts (the nodes modes: two emulated hosts, started
//! with the variables torchrun or srun sets on the nodes of a multi-node
//! job): the world backend comes from `NcclBackend::from_env`, all-reduces
//! on NCCL with the one-shot and fast paths off (peer memory exists only
//! inside a host), a tensor-parallel group split per host gets the
//! one-shot path, and a data-parallel group split across the hosts does
//! not, even with the fast path forced on.
//!
//! Invariants: every output is poisoned before the run and every element
//! checked against a host reference; set-up (from_env and both splits) is
//! bounded by the init deadline and asserted to end within it.

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use half::bf16;
use metrale_comm::{AllReducePath, CommBackend, FastPathPolicy, NcclBackend};
use nccl_safe::DeviceBuffer;

use super::exact;
use super::oneshot::check_in;
use crate::RankCtx;
use crate::data::{POISON_BYTE, check, random_vec, sum_in_rank_order};
use crate::orchestrator::NODES;

/// The init deadline of the scenario's backends.
const INIT: Duration = Duration::from_secs(30);

/// A checked bf16 all-reduce of `n` values on `b`, whose rank `c` is the
/// suite's rank `members[c]`; `one_shot`: checked bit for bit against the
/// one-shot reference, else against the rank-order sum.
fn reduce_in(
    ctx: &RankCtx,
    b: &NcclBackend,
    members: &[usize],
    (seed, salt, n): (u64, u64, usize),
    what: &str,
) -> anyhow::Result<()> {
    let mine = random_vec::<bf16>(seed, ctx.rank, salt, n);
    let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), n)?;
    buf.fill_bytes(POISON_BYTE)?;
    buf.copy_from_host(&mine)?;
    let path = b.all_reduce_path(2 * n);
    b.all_reduce(buf.view_mut())
        .with_context(|| format!("{what}: all_reduce"))?;
    b.synchronize()
        .with_context(|| format!("{what}: synchronize"))?;
    let got = buf.to_host_vec()?;
    if path == AllReducePath::OneShot {
        check_in(ctx, Some(members), what, &got, |k| {
            random_vec(seed, k, salt, n)
        })
    } else {
        let inputs: Vec<Vec<bf16>> = members
            .iter()
            .map(|&k| random_vec(seed, k, salt, n))
            .collect();
        let exact = exact(ctx) || members.len() <= 2;
        check(
            what,
            &got,
            &sum_in_rank_order(&inputs),
            exact,
            members.len(),
        )
    }
}

/// `nodes_split_one_shot`.
pub fn split_one_shot(ctx: &RankCtx) -> anyhow::Result<()> {
    let (w, r) = (ctx.world_size, ctx.rank);
    ensure!(
        w % NODES == 0 && w >= NODES,
        "{w} ranks do not split over {NODES} hosts"
    );
    let per = w / NODES;
    let (node, local) = (r / per, r % per);
    let seed = ctx.shared_seed("nodes")?;
    let started = Instant::now();
    ctx.step("NcclBackend::from_env over two hosts");
    let cfg = ctx
        .config()
        .with_init_timeout(INIT)
        .with_one_shot(crate::ONE_SHOT_TO_1M)
        .with_fast_path(FastPathPolicy::Always);
    let world = NcclBackend::from_env(|device| {
        let mut c = cfg.clone();
        c.device = device;
        c
    })
    .context("NcclBackend::from_env")?;
    ensure!(
        (world.rank(), world.world_size(), world.config().device) == (r, w, ctx.device),
        "from_env made rank {} of {} on device {}, the launcher says rank {r} of {w} on \
         device {}",
        world.rank(),
        world.world_size(),
        world.config().device,
        ctx.device
    );
    let why = world
        .one_shot_unavailable()
        .context("the one-shot path is on for a world that spans two hosts")?;
    ensure!(
        why.contains("span 2 hosts"),
        "the world's one-shot path is off for another reason: {why}"
    );
    ensure!(
        world.all_reduce_path(4 << 20) == AllReducePath::Nccl,
        "a world spanning hosts takes {:?}",
        world.all_reduce_path(4 << 20)
    );
    let everyone: Vec<usize> = (0..w).collect();
    reduce_in(ctx, &world, &everyone, (seed, 1, 3001), "world all_reduce")?;

    ctx.step("split: a tensor-parallel group per host");
    let tp = world
        .split_backend(Some(node as u32), r)?
        .context("no tensor-parallel group")?;
    let tp_members: Vec<usize> = (node * per..(node + 1) * per).collect();
    ensure!(
        (tp.rank(), tp.world_size()) == (local, per),
        "the group of host {node}: rank {} of {}, expected {local} of {per}",
        tp.rank(),
        tp.world_size()
    );
    ctx.step("split: a data-parallel group across the hosts");
    let dp = world
        .split_backend(Some(local as u32), r)?
        .context("no data-parallel group")?;
    let dp_members: Vec<usize> = (0..NODES).map(|h| h * per + local).collect();
    let took = started.elapsed();
    ensure!(
        took < INIT,
        "set-up (from_env and two splits) took {took:?}, past the {INIT:?} deadline"
    );

    if per >= 2 {
        ensure!(
            tp.one_shot_unavailable().is_none(),
            "host {node}'s group has no one-shot path: {:?}",
            tp.one_shot_unavailable()
        );
        ensure!(
            tp.all_reduce_path(2 * 3001) == AllReducePath::OneShot,
            "host {node}'s group takes {:?} at 3001 values",
            tp.all_reduce_path(2 * 3001)
        );
    }
    if per == 2 {
        // Past the one-shot range the 2-rank group of one host takes the
        // fast path (forced on), unlike the group across hosts below.
        ensure!(
            tp.all_reduce_path(4 << 20) == AllReducePath::FastPath,
            "host {node}'s 2-rank group takes {:?} at 4 MiB",
            tp.all_reduce_path(4 << 20)
        );
    }
    for (salt, n) in [(2, 3001), (3, 1), (4, 300_001), (5, (4 << 20) / 2 + 5)] {
        reduce_in(
            ctx,
            &tp,
            &tp_members,
            (seed, salt, n),
            &format!("host {node}'s group, {n} values"),
        )?;
    }
    ensure!(
        dp.one_shot_unavailable()
            .is_some_and(|why| why.contains("span 2 hosts")),
        "the group across hosts: one-shot {:?}",
        dp.one_shot_unavailable()
    );
    ensure!(
        dp.all_reduce_path(4 << 20) == AllReducePath::Nccl,
        "the 2-rank group across hosts takes {:?} at 4 MiB (fast path forced on)",
        dp.all_reduce_path(4 << 20)
    );
    for (salt, n) in [(6, 3001), (7, (4 << 20) / 2 + 5)] {
        reduce_in(
            ctx,
            &dp,
            &dp_members,
            (seed, salt, n),
            &format!("the group across hosts, {n} values"),
        )?;
    }
    ctx.barrier("nodes: before shutdown")?;
    tp.shutdown()?;
    dp.shutdown()?;
    world.shutdown()?;
    super::oneshot::no_mapping_left(ctx, "nodes")
}
