//! The path tuner on the emulator, with the time of each path injected
//! (the emulator's cost model: every stream keeps a virtual clock that an
//! operation advances by its injected cost, and event timings read it), so
//! the choice is deterministic: the one-shot path slower than NCCL's
//! all-reduce; faster below a size, with eager and graph tables that
//! differ; one rank slow; the set-up probe or one tuner check failing on
//! one rank; and the cache (a hit skips the timing; corrupt, truncated,
//! foreign-key and edited files are ignored; ranks with different caches
//! tune again; a cache that cannot be written still starts).
//!
//! Invariants checked: every rank holds the same table, the one the
//! injected costs decide (the worst rank's times, the margin, contiguous
//! ranges); a path whose check failed on any rank is not taken; after
//! each case every all-reduce (eager at sizes on each side of every
//! range's ends, and a graph replay) is right in every element, outputs
//! poisoned before the run.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context as _, bail, ensure};
use half::bf16;
use metrale_comm::timing::Trials;
use metrale_comm::{
    AllReducePath, BackendConfig, CommBackend, FastPathPolicy, LaunchMode, NcclBackend,
    OneShotPolicy, PathRange, TuneCache,
};
use nccl_safe::{DataType, DeviceBuffer, Stream};

use super::exact;
use crate::RankCtx;
use crate::data::{
    POISON_BYTE, all_reduce_reference, captured_all_reduce_reference, check, random_vec,
};
use crate::emu::{Cost, CostMode, CostOp, EmuControl, Fault};

use AllReducePath::{FastPath, Nccl, OneShot};

/// The tuner's trials here: the injected costs make every call's time
/// exact, so one trial of one call reads what the default ladder's
/// median of 5 x 16 reads, at a hundredth of the set-up (the other
/// scenarios' tuned backends take the suite's [`crate::EMU_TUNE_TRIALS`]
/// on the emulator, the library's trials on GPUs).
const EXACT: Trials = Trials {
    trials: 1,
    calls: 1,
};

fn cost(rank: Option<usize>, op: CostOp, mode: CostMode, base_ns: u64, ns_per_kib: u64) -> Cost {
    Cost {
        rank,
        op,
        mode,
        base_ns,
        ns_per_kib,
    }
}

/// NCCL's all-reduce: 20 us + 10 ns/KiB in both modes.
fn nccl() -> Cost {
    cost(None, CostOp::AllReduce, CostMode::Any, 20_000, 10)
}

/// The one-shot faster than NCCL up to 128 KiB eagerly (5 us + 100 ns/KiB)
/// and up to 32 KiB in graphs (5 us + 400 ns/KiB).
fn one_shot_fast_below() -> [Cost; 2] {
    [
        cost(None, CostOp::OneShot, CostMode::Eager, 5_000, 100),
        cost(None, CostOp::OneShot, CostMode::Graph, 5_000, 400),
    ]
}

/// A range of `path` from `min` to `max` bytes.
fn range(path: AllReducePath, min_bytes: usize, max_bytes: usize) -> PathRange {
    PathRange {
        path,
        min_bytes,
        max_bytes,
    }
}

/// Sets the costs, on every rank (in threads mode the ranks share one
/// table: every rank sets the same entries), after the previous case's
/// backends are gone everywhere.
fn set_costs(ctx: &RankCtx, emu: &EmuControl, costs: &[Cost], case: &str) -> anyhow::Result<()> {
    ctx.barrier(&format!("tune {case}: previous case done"))?;
    emu.clear_costs();
    emu.set_costs(costs)?;
    ctx.barrier(&format!("tune {case}: costs set"))
}

/// The scenario's base configuration: the one-shot path tuned, no fast
/// path (a case adds it), no cache (a case adds one).
fn base(ctx: &RankCtx) -> BackendConfig {
    ctx.config()
        .with_one_shot(OneShotPolicy::Auto)
        .with_fast_path(FastPathPolicy::Never)
        .with_tune(true)
        .with_tune_cache(TuneCache::Off)
        .with_tune_trials(EXACT)
}

/// `tune_choice`.
pub fn choice(ctx: &RankCtx) -> anyhow::Result<()> {
    let Some(emu) = ctx.emu() else {
        return Err(RankCtx::skip("needs the emulator's cost model"));
    };
    let result = cases(ctx, emu);
    ctx.barrier("tune: done")?;
    emu.clear_costs();
    result
}

fn cases(ctx: &RankCtx, emu: &EmuControl) -> anyhow::Result<()> {
    let (w, r) = (ctx.world_size, ctx.rank);
    let fast = [one_shot_fast_below().to_vec(), vec![nccl()]].concat();

    // 1. The one-shot slower than NCCL at every size: NCCL everywhere.
    ctx.step("one-shot slower than NCCL");
    set_costs(
        ctx,
        emu,
        &[
            nccl(),
            cost(None, CostOp::OneShot, CostMode::Any, 50_000, 200),
        ],
        "slower",
    )?;
    let b = ctx.backend("tune-slower", base(ctx))?;
    expect(&b, &[], &[], "one-shot slower")?;
    verify(ctx, &b, "one-shot slower")?;
    b.shutdown()?;

    // 2. Faster below 128 KiB eagerly, 32 KiB in graphs; on 2 ranks the
    // fast path (a send of 24 us + 2 ns/KiB) wins from 2 MiB.
    ctx.step("one-shot faster below a size, eager and graph apart");
    let mut costs = fast.clone();
    costs.push(cost(None, CostOp::Send, CostMode::Any, 24_000, 2));
    set_costs(ctx, emu, &costs, "faster")?;
    let config = if w == 2 {
        base(ctx).with_fast_path(FastPathPolicy::Auto)
    } else {
        base(ctx)
    };
    let b = ctx.backend("tune-faster", config)?;
    let mut eager = vec![range(OneShot, 0, 128 << 10)];
    if w == 2 {
        eager.push(range(FastPath, 2 << 20, 8 << 20));
    }
    expect(
        &b,
        &eager,
        &[range(OneShot, 0, 32 << 10)],
        "one-shot faster below",
    )?;
    for (bytes, want) in [
        (2, OneShot),
        (128 << 10, OneShot),
        ((128 << 10) + 2, Nccl),
        (256 << 10, Nccl),
    ] {
        let got = b.all_reduce_path(bytes);
        ensure!(got == want, "{bytes} bytes, eager: {got:?}, not {want:?}");
    }
    let above = if w == 2 { FastPath } else { Nccl };
    ensure!(b.all_reduce_path(2 << 20) == above);
    for (bytes, want) in [
        (32 << 10, OneShot),
        ((32 << 10) + 2, Nccl),
        (128 << 10, Nccl),
    ] {
        let got = b.all_reduce_path_captured(DataType::Bfloat16, bytes);
        ensure!(
            got == want,
            "{bytes} bytes, captured: {got:?}, not {want:?}"
        );
    }
    verify(ctx, &b, "one-shot faster below")?;
    b.shutdown()?;

    // 3. One rank slow: its eager one-shot costs 10x; every rank takes its
    // choice (NCCL eagerly), the graph table is unchanged.
    ctx.step("one rank slow");
    let mut costs = fast.clone();
    costs.push(cost(
        Some(w - 1),
        CostOp::OneShot,
        CostMode::Eager,
        50_000,
        200,
    ));
    set_costs(ctx, emu, &costs, "one slow")?;
    let b = ctx.backend("tune-one-slow", base(ctx))?;
    expect(&b, &[], &[range(OneShot, 0, 32 << 10)], "one rank slow")?;
    verify(ctx, &b, "one rank slow")?;
    b.shutdown()?;

    // 4. The set-up probe fails on the last rank (its first one-shot
    // kernel writes a wrong word): the path is off on every rank.
    ctx.step("the probe fails on one rank");
    set_costs(ctx, emu, &fast, "probe fails")?;
    if r == w - 1 {
        emu.inject(r, Fault::Corrupts, 1)?;
    }
    let b = ctx.backend("tune-probe-fails", base(ctx))?;
    let why = b.one_shot_unavailable().unwrap_or_default();
    ensure!(
        why.contains("probe") && why.contains(&format!("rank {}", w - 1)),
        "the one-shot path's reason: `{why}`"
    );
    ensure!(b.path_table().is_none(), "nothing to tune, yet a table");
    for bytes in [2, 8 << 10, 128 << 10] {
        ensure!(b.all_reduce_path(bytes) == Nccl, "{bytes} bytes");
    }
    verify(ctx, &b, "probe fails")?;
    b.shutdown()?;

    // 5. A tuner check fails on the last rank at 8 bytes (its fifth
    // one-shot kernel: after the probe's four): that size takes NCCL on
    // every rank, the rest of the range stays.
    ctx.step("a tuner check fails on one rank");
    set_costs(ctx, emu, &fast, "check fails")?;
    if r == w - 1 {
        emu.inject(r, Fault::Corrupts, 5)?;
    }
    let b = ctx.backend("tune-check-fails", base(ctx))?;
    expect(
        &b,
        &[range(OneShot, 32, 128 << 10)],
        &[range(OneShot, 32, 32 << 10)],
        "a check fails at 8 bytes",
    )?;
    ensure!(b.all_reduce_path(8) == Nccl && b.all_reduce_path(2) == Nccl);
    verify(ctx, &b, "check fails")?;
    b.shutdown()?;

    cache_cases(ctx, emu, &fast)
}

/// The cache: hit, damaged files, ranks that differ, no writable cache.
fn cache_cases(ctx: &RankCtx, emu: &EmuControl, costs: &[Cost]) -> anyhow::Result<()> {
    let (w, r) = (ctx.world_size, ctx.rank);
    let dir = ctx.dump_dir().with_file_name("tune-cache");
    let with = |d: &Path| base(ctx).with_tune_cache(TuneCache::Dir(d.to_path_buf()));
    let eager = [range(OneShot, 0, 128 << 10)];
    let graph = [range(OneShot, 0, 32 << 10)];
    set_costs(ctx, emu, costs, "cache")?;

    ctx.step("cache: first start times, second start hits");
    let started = Instant::now();
    let b = ctx.backend("tune-cache-1", with(&dir))?;
    let first = started.elapsed();
    let t = expect(&b, &eager, &graph, "first start")?;
    ensure!(!t.from_cache(), "the first start read a cache");
    b.shutdown()?;
    ctx.barrier("tune cache: written")?;
    let started = Instant::now();
    let b = ctx.backend("tune-cache-2", with(&dir))?;
    let second = started.elapsed();
    let t = expect(&b, &eager, &graph, "second start")?;
    ensure!(t.from_cache(), "the second start did not use the cache");
    verify(ctx, &b, "cache hit")?;
    b.shutdown()?;
    if r == 0 {
        println!(
            "tune_choice: world {w}: set-up with the path tuner timing: {first:?}; \
             with its cached table: {second:?}"
        );
    }

    let file = cache_file(&dir)?;
    let good = std::fs::read_to_string(&file).context("the cache file")?;
    let damaged: [(&str, String); 3] = [
        ("truncated", good[..good.len() / 2].to_string()),
        ("of another key", {
            let key = field(&good, "world_key")?;
            good.replace(&key, "0123456789abcdef")
        }),
        ("hand-edited", {
            let ns = field(&good, "bytes")?;
            good.replacen(&format!("\"bytes\": {ns}"), "\"bytes\": 16", 1)
        }),
    ];
    for (what, text) in damaged {
        ctx.step(format!("cache: a file {what} is ignored"));
        ctx.barrier(&format!("tune cache {what}: before"))?;
        if r == 0 {
            std::fs::write(&file, &text)?;
        }
        ctx.barrier(&format!("tune cache {what}: written"))?;
        let b = ctx.backend(&format!("tune-cache-{what}"), with(&dir))?;
        let t = expect(&b, &eager, &graph, what)?;
        ensure!(!t.from_cache(), "a cache file {what} was used");
        verify(ctx, &b, what)?;
        b.shutdown()?;
    }

    ctx.step("cache: ranks with different caches tune again");
    let mine = dir.with_file_name(format!("tune-cache-rank-{r}"));
    std::fs::create_dir_all(&mine)?;
    if r == 0 {
        std::fs::copy(&file, mine.join(file.file_name().context("name")?))?;
    }
    ctx.barrier("tune cache: per-rank dirs")?;
    let b = ctx.backend("tune-cache-differ", with(&mine))?;
    let t = expect(&b, &eager, &graph, "different caches")?;
    ensure!(
        !t.from_cache(),
        "rank {r} used a cache only rank 0 had (the ranks must tune again)"
    );
    b.shutdown()?;

    ctx.step("cache: a directory that cannot be written still starts");
    // A path below a regular file: no directory can be made there, even
    // as root.
    let blocker = dir.with_file_name(format!("tune-cache-blocker-{r}"));
    std::fs::write(&blocker, b"not a directory")?;
    let b = ctx.backend("tune-cache-unwritable", with(&blocker.join("cache")))?;
    let t = expect(&b, &eager, &graph, "unwritable cache")?;
    ensure!(!t.from_cache());
    verify(ctx, &b, "unwritable cache")?;
    b.shutdown()?;
    Ok(())
}

/// The one cache file in `dir`.
fn cache_file(dir: &Path) -> anyhow::Result<PathBuf> {
    let files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    match files.as_slice() {
        [one] => Ok(one.clone()),
        other => bail!(
            "expected one cache file in {}, found {other:?}",
            dir.display()
        ),
    }
}

/// The first value of `"name": value` in a JSON text, as written.
fn field(text: &str, name: &str) -> anyhow::Result<String> {
    let at = text
        .find(&format!("\"{name}\":"))
        .with_context(|| format!("no `{name}` in the cache file"))?;
    let rest = text[at + name.len() + 3..].trim_start();
    let end = rest
        .find([',', '\n', '}'])
        .context("an unterminated value")?;
    Ok(rest[..end].trim().trim_matches('"').to_string())
}

/// Checks `b`'s table against the ranges expected in each mode.
fn expect(
    b: &NcclBackend,
    eager: &[PathRange],
    graph: &[PathRange],
    what: &str,
) -> anyhow::Result<metrale_comm::PathTable> {
    let t = b
        .path_table()
        .with_context(|| format!("{what}: no path table"))?;
    ensure!(
        t.ranges(LaunchMode::Eager) == eager && t.ranges(LaunchMode::Graph) == graph,
        "{what}: the table is\n{t}\nnot eager {eager:?}, graph {graph:?}"
    );
    Ok(t)
}

/// Every all-reduce right: eager at sizes on each side of every range end
/// of the table, and a captured one replayed twice; random data, outputs
/// poisoned first, every element checked.
fn verify(ctx: &RankCtx, b: &NcclBackend, what: &str) -> anyhow::Result<()> {
    let (w, r) = (ctx.world_size, ctx.rank);
    let seed = ctx.shared_seed(&format!("tune-{what}"))?;
    let mut sizes = vec![2usize, 8, 30];
    if let Some(t) = b.path_table() {
        for mode in LaunchMode::ALL {
            for rg in t.ranges(mode) {
                sizes.extend([rg.min_bytes.max(2), rg.max_bytes, rg.max_bytes + 2]);
            }
        }
    }
    sizes.sort_unstable();
    sizes.dedup();
    for (salt, bytes) in (0..).zip(sizes) {
        let n = bytes / 2;
        let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, salt, n)).collect();
        let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), n)?;
        buf.fill_bytes(POISON_BYTE)?;
        buf.copy_from_host(&inputs[r])?;
        b.all_reduce(buf.view_mut())
            .with_context(|| format!("{what}: all_reduce of {bytes} bytes"))?;
        b.synchronize()?;
        check(
            &format!(
                "{what}: all_reduce of {bytes} bytes ({:?})",
                b.all_reduce_path(bytes)
            ),
            &buf.to_host_vec()?,
            &all_reduce_reference(b, &inputs),
            exact(ctx),
            w,
        )?;
    }
    // A captured all-reduce, replayed twice on new data.
    let n = 4099;
    let compute = Stream::new(b.context())?;
    let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), n)?;
    compute.begin_capture()?;
    let captured = b.all_reduce_async(buf.view_mut(), compute.as_ref());
    let graph = compute.end_capture()?;
    captured?;
    let exec = graph.instantiate()?;
    for replay in 0..2u64 {
        let inputs: Vec<Vec<bf16>> = (0..w)
            .map(|k| random_vec(seed, k, 1000 + replay, n))
            .collect();
        buf.fill_bytes(POISON_BYTE)?;
        buf.copy_from_host(&inputs[r])?;
        exec.launch(&compute)?;
        compute.wait_until_idle(std::time::Duration::from_secs(30))?;
        check(
            &format!("{what}: graph replay {replay}"),
            &buf.to_host_vec()?,
            &captured_all_reduce_reference(b, &inputs),
            exact(ctx),
            w,
        )?;
    }
    Ok(())
}
