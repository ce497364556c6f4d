//! `graph_events_one_device`: what the one-shot path's graph-lane order
//! (decision 0017) takes from CUDA's external events, checked on the
//! driver it runs on (one GPU, or the emulator):
//! 1. a graph's external wait waits, at each launch, for an external
//!    record node of a graph launched before it on another stream;
//! 2. eager work that waits for the event after a launch waits for that
//!    graph's record;
//! 3. launched the other way round, the later graph does not wait for the
//!    earlier's (the wait takes the record as of its own launch).
//!
//! It also reports, without asserting, whether an external wait placed
//! after an external record of the same event inside one graph ever
//! completes (the backend never places one there).
//!
//! A held stream is a one-shot kernel of rank 0 of two simulated ranks
//! whose peer never arrives: it spins until its bound ([`HOLD`]) and ends
//! with the timeout status, which the scenario expects.
//!
//! Invariants: every wait is bounded; the marker buffers are poisoned
//! before each step and checked byte for byte.

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use half::bf16;
use metrale_comm::kernels;
use nccl_safe::{DeviceBuffer, Event, GraphExec, Module, Stream};

use crate::RankCtx;
use crate::one_shot_local::{LANE_EAGER, LocalOneShot};

/// How long the holding kernel spins.
const HOLD: Duration = Duration::from_millis(600);
/// How long a held stream is watched for running early.
const EARLY: Duration = Duration::from_millis(200);
const WAIT: Duration = Duration::from_secs(20);

/// A holding kernel (rank 0 of two, its peer never coming) in a graph
/// that then records `ev` as an external event; fresh each time, since a
/// kernel that finds its control block's status set ends at once.
fn held_graph(
    c: &std::sync::Arc<nccl_safe::Context>,
    f: &nccl_safe::Function,
    ev: &Event,
) -> anyhow::Result<(LocalOneShot<bf16>, GraphExec)> {
    let hold = LocalOneShot::<bf16>::new(c, 2, 16 << 10, HOLD)?;
    let held = capture(hold.stream(0), |s| {
        hold.launch(f, 0, 8, LANE_EAGER)?;
        // SAFETY: `s` is a live stream of `c`, capturing; the event lives
        // until the graph's launches are done (the caller waits).
        unsafe { ev.record_external_raw(s.raw()) }?;
        Ok(())
    })
    .context("capturing the held graph")?;
    Ok((hold, held))
}

/// Drops a holding kernel's ranks; its timeout status is the expected one.
fn release(hold: LocalOneShot<bf16>) -> anyhow::Result<()> {
    hold.stream(0).wait_until_idle(WAIT)?;
    hold.flags(0).store(1, 0);
    drop(hold);
    Ok(())
}

fn capture(
    s: &Stream,
    body: impl FnOnce(&Stream) -> anyhow::Result<()>,
) -> anyhow::Result<GraphExec> {
    s.begin_capture()?;
    let r = body(s);
    let g = s.end_capture()?;
    r?;
    Ok(g.instantiate()?)
}

/// See the module docs.
pub fn one_device(ctx: &RankCtx) -> anyhow::Result<()> {
    let c = ctx.context()?;
    let module = Module::load_ptx(&c, kernels::ONE_SHOT_PTX)?;
    let f = module.function(kernels::BF16_ONE_SHOT_NAME)?;
    let ev = Event::new(&c, false)?;
    let (s2, s3) = (Stream::new(&c)?, Stream::new(&c)?);
    let src = DeviceBuffer::<u8>::from_host(&c, &[0x5Au8; 256])?;
    let mut dst = DeviceBuffer::<u8>::alloc(&c, 256)?;
    let (to, from) = (dst.device_ptr(), src.device_ptr());
    // In the closures below: the streams are live streams of `c`,
    // capturing where captured; `src` and `dst` hold 256 bytes and live
    // until every stream is idle at the end; the event lives as long.
    let copy = |s: &Stream| -> anyhow::Result<()> {
        // SAFETY: see above.
        unsafe { nccl_safe::copy_device_async(&c, to, from, 256, s.raw()) }?;
        Ok(())
    };
    let waiting = capture(&s2, |s| {
        // SAFETY: see above.
        unsafe { ev.wait_external_raw(s.raw()) }?;
        copy(s)
    })
    .context("capturing the waiting graph")?;
    let idle = |what: &str| -> anyhow::Result<()> {
        for s in [&s2, &s3] {
            s.wait_until_idle(WAIT).with_context(|| what.to_string())?;
        }
        Ok(())
    };
    let marker = |dst: &DeviceBuffer<u8>| -> anyhow::Result<Vec<u8>> { Ok(dst.to_host_vec()?) };

    ctx.step("1: a graph waits for the record of a graph launched before it");
    dst.fill_bytes(0x7F)?;
    let (hold, held) = held_graph(&c, &f, &ev)?;
    held.launch(hold.stream(0))?;
    waiting.launch(&s2)?;
    std::thread::sleep(EARLY);
    ensure!(
        !s2.query()?,
        "1: a graph's external wait did not wait for the record of a graph launched before it"
    );
    idle("1")?;
    drop(held);
    release(hold)?;
    ensure!(
        marker(&dst)? == vec![0x5A; 256],
        "1: the waiting graph's copy"
    );

    ctx.step("2: eager work waits for a launched graph's record");
    dst.fill_bytes(0x7F)?;
    let (hold, held) = held_graph(&c, &f, &ev)?;
    held.launch(hold.stream(0))?;
    // SAFETY: `s3` is a live stream of `c`; the event is ours.
    unsafe { ev.wait_raw(s3.raw()) }?;
    copy(&s3)?;
    std::thread::sleep(EARLY);
    ensure!(
        !s3.query()?,
        "2: eager work did not wait for the graph's record"
    );
    idle("2")?;
    drop(held);
    release(hold)?;
    ensure!(marker(&dst)? == vec![0x5A; 256], "2: the eager copy");

    ctx.step("3: a graph launched first does not wait for one launched later");
    dst.fill_bytes(0x7F)?;
    let (hold, held) = held_graph(&c, &f, &ev)?;
    let t = Instant::now();
    waiting.launch(&s2)?;
    held.launch(hold.stream(0))?;
    s2.wait_until_idle(WAIT)?;
    ensure!(
        t.elapsed() < HOLD,
        "3: the graph launched first waited {:?} for a record launched after it",
        t.elapsed()
    );
    idle("3")?;
    ensure!(marker(&dst)? == vec![0x5A; 256], "3: the copy");
    drop(held);
    release(hold)?;

    ctx.step("report: an external wait after a record of the same event in one graph");
    let self_wait = capture(&s2, |s| {
        // SAFETY: see above.
        unsafe { ev.record_external_raw(s.raw()) }?;
        copy(s)?;
        // SAFETY: see above.
        unsafe { ev.wait_external_raw(s.raw()) }?;
        copy(s)
    })?;
    self_wait.launch(&s2)?;
    let done = s2.wait_until_idle(Duration::from_secs(2)).is_ok();
    if !done {
        // Unstick it: an eager record completes whatever the wait holds
        // out for (event values only grow).
        // SAFETY: `s3` is a live stream of `c`; the event is ours.
        unsafe { ev.record_raw(s3.raw()) }?;
    }
    let released = done || s2.wait_until_idle(Duration::from_secs(5)).is_ok();
    println!(
        "graph_events_one_device: an external wait after an external record of the same event \
         in one graph {}",
        if done {
            "completes"
        } else if released {
            "waits for that graph's own record (released by a later eager record)"
        } else {
            "waits, and a later eager record did not release it"
        }
    );
    idle("the report")?;
    Ok(())
}
