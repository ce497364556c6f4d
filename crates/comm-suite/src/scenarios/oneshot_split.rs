//! The one-shot all-reduce on split sub-communicators: the tensor-parallel
//! groups an engine cuts from a larger world. A sub-communicator sets the
//! path up over its own communicator and meets its group at release under
//! the group's own keys in the parent's store, so it has the path as its
//! parent has.
//!
//! The scenario splits the world in reverse rank order, by rank parity
//! (groups of one where the world has fewer than four ranks: the path is
//! off there, for its size), the reversed group again into pairs (a
//! sub-communicator's split), and the world once more with the reversed
//! group's color; runs a sweep on the reversed group and the pairs, and
//! one-shots of all five communicators in flight at once; then the parent
//! reconnects and splits again while the reversed group lives on, shuts
//! down and is dropped before it, and the reversed group still works.
//! Last, a split in which only the last rank has no group in the store,
//! and a split that the last rank refuses, then a reconnect and a split
//! that works.
//!
//! Invariants: every output element is checked against the host reference
//! of the group's inputs in the group's rank order, on every rank (so the
//! group's outputs are bit-identical); every group of two or more ranks
//! has the path on wherever the parent has it (on the emulator always);
//! every shutdown ends well within the shutdown timeout (a release barrier
//! that a peer never meets lasts all of it), and device memory comes back;
//! communicators are torn down only while every rank is idle (barriers);
//! on the emulator the scenario ends with no CUDA IPC mapping open and no
//! free of memory still mapped.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use half::bf16;
use metrale_comm::rendezvous::{ID_LEN, Rendezvous, RendezvousError};
use metrale_comm::{
    AllReducePath, CommBackend, CommError, EnqueueMode, NcclBackend, OneShotPolicy,
};
use nccl_safe::{DeviceBuffer, Stream};

use super::oneshot::{check_in, no_mapping_left, one_shot_backend, one_shot_config, sweep};
use super::reliability::all_reduce_ok;
use crate::RankCtx;
use crate::data::random_vec;

/// Element counts of a group's sweep (bf16): odd counts, and one past the
/// 1 MiB slot (two launches).
const SIZES: &[usize] = &[1, 3, 4097, 65_535, (1 << 19) + 3];

/// How long a shutdown may take: half the default shutdown timeout.
const SHUTDOWN_BOUND: Duration = Duration::from_secs(5);

/// Checks that `b` is this rank's sub-communicator of `members` (its rank
/// `c` is the suite's rank `members[c]`) and that the one-shot path is on,
/// or off for a group of one.
fn expect_group(
    ctx: &RankCtx,
    b: &NcclBackend,
    members: &[usize],
    what: &str,
) -> anyhow::Result<()> {
    ensure!(
        b.world_size() == members.len() && members.get(b.rank()) == Some(&ctx.rank),
        "{what}: rank {} of {}, expected rank {} of {members:?}",
        b.rank(),
        b.world_size(),
        ctx.rank
    );
    let off = b.one_shot_unavailable();
    if members.len() < 2 {
        let why = off.unwrap_or_default();
        ensure!(
            why.contains("1 ranks"),
            "{what}: a group of one: the path's reason is `{why}`"
        );
        return Ok(());
    }
    if let Some(why) = off {
        bail!("{what}: the one-shot path is off where its parent's is on: {why}");
    }
    let path = b.all_reduce_path(2);
    ensure!(
        path == AllReducePath::OneShot,
        "{what}: all_reduce_path(2) = {path:?}"
    );
    Ok(())
}

/// A sub-communicator of `parent` for `color` and `key`, checked against
/// its expected `members`.
fn split_into(
    ctx: &RankCtx,
    parent: &NcclBackend,
    (color, key): (u32, usize),
    members: &[usize],
    what: &str,
) -> anyhow::Result<NcclBackend> {
    ctx.step(format!("split: {what}"));
    let b = parent
        .split_backend(Some(color), key)
        .with_context(|| format!("split: {what}"))?
        .with_context(|| format!("split: {what}: no sub-communicator for a color"))?;
    expect_group(ctx, &b, members, what)?;
    Ok(b)
}

/// One eager all-reduce of `n` fresh values on each of `comms` (each with
/// its members, `None`: the world), all in flight before any is waited
/// for, in the same order on every rank; every output checked.
fn all_at_once(
    ctx: &RankCtx,
    comms: &[(&str, &NcclBackend, Option<&[usize]>)],
    seed: u64,
    salt: u64,
) -> anyhow::Result<()> {
    let n = 3001;
    let input = |k: usize, i: usize| random_vec::<bf16>(seed, k, salt << 8 | i as u64, n);
    let mut bufs = Vec::with_capacity(comms.len());
    for (i, (_, b, _)) in comms.iter().enumerate() {
        bufs.push(DeviceBuffer::from_host(b.context(), &input(ctx.rank, i))?);
    }
    for ((what, b, _), buf) in comms.iter().zip(&mut bufs) {
        b.all_reduce(buf.view_mut())
            .with_context(|| format!("{what}: all_reduce"))?;
    }
    for (what, b, _) in comms {
        b.synchronize()
            .with_context(|| format!("{what}: synchronize"))?;
    }
    for (i, ((what, _, members), buf)) in comms.iter().zip(&bufs).enumerate() {
        let what = format!("{what}: one of {} in flight at once", comms.len());
        check_in(ctx, *members, &what, &buf.to_host_vec()?, |k| input(k, i))?;
    }
    Ok(())
}

/// See the module docs.
pub fn split(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("oneshot-split")?;
    let (w, r) = (ctx.world_size, ctx.rank);
    let free_before = ctx.context()?.mem_info()?.0;
    let parent = one_shot_backend(
        ctx,
        "oneshot-split",
        one_shot_config(ctx, OneShotPolicy::Always),
    )?;
    let compute = Stream::new(parent.context())?;

    let rev_members: Vec<usize> = (0..w).rev().collect();
    let rev = split_into(
        ctx,
        &parent,
        (7, w - 1 - r),
        &rev_members,
        "every rank, reversed",
    )?;
    let halves: Vec<usize> = (0..w).filter(|k| k % 2 == r % 2).collect();
    let half = split_into(ctx, &parent, ((r % 2) as u32, r), &halves, "by rank parity")?;
    // The reversed group's split into pairs of its ranks.
    let pairs: Vec<usize> = rev_members
        .chunks(2)
        .nth(rev.rank() / 2)
        .context("the pair of this rank")?
        .to_vec();
    let pair = split_into(
        ctx,
        &rev,
        ((rev.rank() / 2) as u32, rev.rank()),
        &pairs,
        "the reversed group in pairs",
    )?;
    // The reversed group's color again, in rank order: a group of its own.
    let world: Vec<usize> = (0..w).collect();
    let twin = split_into(
        ctx,
        &parent,
        (7, r),
        &world,
        "every rank, the same color again",
    )?;

    ctx.step("sweep on the reversed group");
    sweep::<bf16>(ctx, (&rev, Some(&rev_members)), &compute, seed, SIZES)?;
    if pairs.len() > 1 {
        ctx.step("sweep on the pairs");
        sweep::<bf16>(ctx, (&pair, Some(&pairs)), &compute, seed ^ 1, SIZES)?;
    }
    ctx.step("one-shots of the parent and of every sub-communicator in flight at once");
    let comms = [
        ("the parent", &parent, None),
        ("the reversed group", &rev, Some(&rev_members[..])),
        ("the parity group", &half, Some(&halves[..])),
        ("the pair", &pair, Some(&pairs[..])),
        ("the twin group", &twin, Some(&world[..])),
    ];
    all_at_once(ctx, &comms, seed, 1)?;

    ctx.barrier("oneshot-split: before the pairs, halves and twin shut down")?;
    shut(&pair, "the pair")?;
    shut(&half, "the parity group")?;
    shut(&twin, "the twin group")?;
    ensure!(
        matches!(rev.attempt_reconnect(), Err(CommError::Unsupported { .. })),
        "a sub-communicator reconnected by itself"
    );

    ctx.step("the parent reconnects and splits again; the reversed group lives on");
    ctx.barrier("oneshot-split: before the parent's reconnect")?;
    parent
        .attempt_reconnect()
        .context("the parent's reconnect")?;
    let again = split_into(ctx, &parent, (7, r), &world, "after the parent's reconnect")?;
    let comms = [
        ("the parent, reconnected", &parent, None),
        ("the split after the reconnect", &again, Some(&world[..])),
        ("the reversed group", &rev, Some(&rev_members[..])),
    ];
    all_at_once(ctx, &comms, seed, 2)?;

    ctx.step("the parent shuts down and goes before the reversed group");
    ctx.barrier("oneshot-split: before the parent shuts down")?;
    shut(&again, "the split after the reconnect")?;
    shut(&parent, "the parent")?;
    drop((parent, pair, half, twin, again, compute));
    all_at_once(
        ctx,
        &[("the reversed group", &rev, Some(&rev_members[..]))],
        seed,
        3,
    )?;
    ctx.barrier("oneshot-split: before the reversed group shuts down")?;
    shut(&rev, "the reversed group")?;
    drop(rev);
    without_a_group_on_the_last_rank(ctx, &world)?;
    refused_on_the_last_rank(ctx, seed, &world)?;
    let free_after = ctx.context()?.mem_info()?.0;
    let slack = if ctx.on_gpu() { 64 << 20 } else { 0 };
    ensure!(
        free_after + slack >= free_before,
        "device memory free went from {free_before} to {free_after}: a sub-communicator's \
         buffers were not freed"
    );
    no_mapping_left(ctx, "oneshot-split")
}

/// Shuts `b` down, well within the shutdown timeout (10 s): a release
/// barrier that a peer never meets (its group named otherwise) would last
/// all of it, and leak.
fn shut(b: &NcclBackend, what: &str) -> anyhow::Result<()> {
    let t = Instant::now();
    b.shutdown().with_context(|| format!("{what}: shutdown"))?;
    ensure!(
        t.elapsed() < SHUTDOWN_BOUND,
        "{what}: the shutdown took {:?}",
        t.elapsed()
    );
    Ok(())
}

/// A split that the last rank refuses before it reaches NCCL (a group open
/// on its thread) while the others go into it: theirs fail at the
/// collective timeout, which poisons them. After a reconnect on every
/// rank, a split names its group alike on every rank again: it has the
/// path, sums right, and shuts down at once.
fn refused_on_the_last_rank(ctx: &RankCtx, seed: u64, world: &[usize]) -> anyhow::Result<()> {
    let (w, r) = (ctx.world_size, ctx.rank);
    let cfg = one_shot_config(ctx, OneShotPolicy::Always)
        .with_collective_timeout(Duration::from_secs(2))
        .with_enqueue(EnqueueMode::Blocking);
    let b = one_shot_backend(ctx, "oneshot-split-refused", cfg)?;
    ctx.step("a split the last rank refuses");
    let split = if r == w - 1 {
        b.group_start()?;
        let refused = b.split_backend(Some(0), r);
        b.group_end()?;
        ensure!(
            matches!(refused, Err(CommError::InGroup { .. })),
            "a split inside a group: {refused:?}"
        );
        None
    } else {
        Some(b.split_backend(Some(0), r))
    };
    if let Some(got) = split {
        ensure!(
            got.is_err(),
            "a split without the last rank returned a sub-communicator"
        );
    }
    ctx.barrier("oneshot-split-refused: before the reconnect")?;
    b.attempt_reconnect()
        .context("the reconnect after a refused split")?;
    let child = split_into(ctx, &b, (0, r), world, "the split after a refused one")?;
    all_at_once(
        ctx,
        &[("the split after a refused one", &child, Some(world))],
        seed,
        5,
    )?;
    ctx.barrier("oneshot-split-refused: before shutdown")?;
    shut(&child, "the split after a refused one")?;
    shut(&b, "the backend of the refused split")?;
    Ok(())
}

/// A rendezvous that has no groups (the trait's default, as where a rank
/// cannot reach the store again); the rest is `0`'s.
#[derive(Debug)]
struct NoGroups(Box<dyn Rendezvous>);

impl Rendezvous for NoGroups {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    fn exchange_id(
        &self,
        generation: u64,
        make: &mut dyn FnMut() -> Result<[u8; ID_LEN], String>,
        timeout: Duration,
    ) -> Result<[u8; ID_LEN], RendezvousError> {
        self.0.exchange_id(generation, make, timeout)
    }

    fn barrier(&self, name: &str, timeout: Duration) -> Result<(), RendezvousError> {
        self.0.barrier(name, timeout)
    }
}

/// A split where only the last rank has no group in the store: every rank
/// still takes the set-up's steps, the path is off on all of them with
/// that rank named, the sums are right (NCCL's path), and the shutdown
/// does not wait for a release barrier (no rank mapped a peer's buffer),
/// which would last the whole shutdown timeout.
fn without_a_group_on_the_last_rank(ctx: &RankCtx, world: &[usize]) -> anyhow::Result<()> {
    let (w, r) = (ctx.world_size, ctx.rank);
    ctx.step("a split whose group the last rank cannot have");
    let rv = ctx.rendezvous("oneshot-split-nogroup")?;
    let rv: Box<dyn Rendezvous> = if r == w - 1 {
        Box::new(NoGroups(rv))
    } else {
        rv
    };
    let cfg = one_shot_config(ctx, OneShotPolicy::Always);
    let b =
        NcclBackend::new(cfg, rv).context("NcclBackend::new without groups on the last rank")?;
    expect_group(
        ctx,
        &b,
        world,
        "the parent of a split without a group on the last rank",
    )?;
    let child = b
        .split_backend(Some(0), r)?
        .context("a split with a color got no sub-communicator")?;
    let why = child.one_shot_unavailable().unwrap_or_default();
    let named = format!("rank {}: no rendezvous store", w - 1);
    ensure!(
        why.contains(&named) && !why.contains("rank 0:"),
        "the split's one-shot path: `{why}`, want it off naming `{named}` alone"
    );
    all_reduce_ok(ctx, &child, 70).context("all_reduce on the split without its group")?;
    ctx.barrier("oneshot-split: before the split without its group shuts down")?;
    shut(&child, "the split without its group")?;
    shut(&b, "the parent of the split without its group")?;
    Ok(())
}
