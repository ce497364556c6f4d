//! Reliability scenarios: deadlines, poisoning, abort, reconnect cycles,
//! init without a rank, the flight-recorder analysis, idle command waits,
//! and SIGKILL of a rank (orchestrated, processes only).
//!
//! Invariants: scenarios that inject emulator faults reset them before they
//! return (also on error); every timing bound is the configured deadline
//! plus one second.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use half::bf16;
use metrale_comm::{
    CommBackend, CommError, FailureKind, FastPathPolicy, NcclBackend, OneShotPolicy,
};
use nccl_safe::DeviceBuffer;

use crate::data::{check, random_vec, sum_in_rank_order};
use crate::emu::{EmuControl, Fault};
use crate::{RankCtx, analyze_dumps};

const TIMEOUT: Duration = Duration::from_secs(2);
const SLACK: Duration = Duration::from_secs(1);
/// How long `rel_skipped_collective` waits for the poisoning thread's
/// flight-recorder dump after the caller's error.
const DUMP_WAIT: Duration = Duration::from_secs(5);

/// NCCL's all-reduce only: these scenarios inject faults into NCCL's
/// operations (the one-shot path makes none; `oneshot_stuck_rank` covers
/// its failures).
pub(crate) fn short(ctx: &RankCtx) -> metrale_comm::BackendConfig {
    ctx.config()
        .with_collective_timeout(TIMEOUT)
        .with_fast_path(FastPathPolicy::Never)
        .with_one_shot(OneShotPolicy::Never)
}

/// Resets the emulator's faults when dropped.
pub(crate) struct ResetFaults<'a>(&'a RankCtx);

impl Drop for ResetFaults<'_> {
    fn drop(&mut self) {
        if let Some(emu) = self.0.emu() {
            emu.reset();
        }
    }
}

/// The emulator's fault injection and a guard that clears it when the
/// scenario ends; on GPUs, the skip error of a scenario that needs it.
pub(crate) fn fault_injection(
    ctx: &RankCtx,
) -> anyhow::Result<(&'static EmuControl, ResetFaults<'_>)> {
    let emu = ctx
        .emu()
        .ok_or_else(|| RankCtx::skip("needs the emulator's fault injection"))?;
    Ok((emu, ResetFaults(ctx)))
}

pub(crate) fn all_reduce_ok(ctx: &RankCtx, b: &NcclBackend, salt: u64) -> anyhow::Result<()> {
    let w = ctx.world_size;
    let seed = ctx.shared_seed(&format!("ar-{salt}"))?;
    let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, salt, 1000)).collect();
    let mut buf = DeviceBuffer::from_host(b.context(), &inputs[ctx.rank])?;
    b.all_reduce(buf.view_mut())?;
    b.synchronize()?;
    check(
        "all_reduce",
        &buf.to_host_vec()?,
        &sum_in_rank_order(&inputs),
        super::exact(ctx),
        w,
    )
}

pub(crate) fn expect_timeout(
    what: &str,
    r: Result<(), CommError>,
    took: Duration,
) -> anyhow::Result<std::sync::Arc<metrale_comm::Failure>> {
    let f = match r {
        Err(CommError::Failed(f)) | Err(CommError::Poisoned { cause: f, .. }) => f,
        Err(e) => bail!("{what}: expected a timeout failure, got {e}"),
        Ok(()) => bail!("{what}: completed"),
    };
    ensure!(f.kind.is_timeout(), "{what}: expected a timeout, got {f}");
    ensure!(
        took <= TIMEOUT + SLACK,
        "{what}: error after {took:?}, timeout {TIMEOUT:?}"
    );
    Ok(f)
}

/// A rank skips a collective: its peer times out naming the op and its
/// sequence number, a dump exists, and the analysis names the missing rank.
pub fn skipped_collective(ctx: &RankCtx) -> anyhow::Result<()> {
    let b = ctx.backend("skip", short(ctx))?;
    all_reduce_ok(ctx, &b, 1)?;
    let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), 1000)?;
    if ctx.rank == 1 {
        ctx.step("skipping the second all_reduce");
        ctx.get("skip/verdict")?;
        // Dump what this rank did, as an operator would on a signal.
        let header = metrale_comm::diagnostics::DumpHeader {
            rank: 1,
            world_size: ctx.world_size,
            generation: b.generation(),
            reason: "dumped by the suite".into(),
            first_failed_seq: None,
        };
        b.recorder().dump_json(&ctx.dump_dir(), &header)?;
        ctx.set("skip/dumped", b"1")?;
        b.shutdown()?;
        return Ok(());
    }
    if ctx.rank > 1 {
        ctx.get("skip/verdict")?;
        return Ok(());
    }
    ctx.step("all_reduce that rank 1 skips");
    let t = Instant::now();
    let r = b.all_reduce(buf.view_mut()).and_then(|()| b.synchronize());
    let took = t.elapsed();
    let f = expect_timeout("skipped all_reduce", r, took)?;
    ensure!(
        f.op == "all_reduce",
        "the failure names {} instead of all_reduce",
        f.op
    );
    let seq = b.recorder().last_seq();
    ensure!(
        f.seq == seq,
        "the failure names seq {}, the recorder's last is {seq}",
        f.seq
    );
    ensure!(!b.is_healthy(), "backend healthy after a timeout");
    // The poisoning thread writes the dump after the communicator's
    // abort, which follows the caller's error: on CI's two loaded cores
    // that took more than a second once. Rank 1 hears the verdict either
    // way, so a failure here does not leave it waiting for the store's
    // deadline.
    let until = Instant::now() + DUMP_WAIT;
    let mine = ctx
        .dump_dir()
        .join(metrale_comm::diagnostics::dump_file_name(0, b.generation()));
    while !mine.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    ctx.set("skip/verdict", b"1")?;
    ensure!(
        mine.exists(),
        "no flight-recorder dump at {} within {DUMP_WAIT:?} of the error",
        mine.display()
    );
    ctx.get("skip/dumped")?;
    let analysis = analyze_dumps(&ctx.dump_dir());
    ensure!(
        analysis.contains("rank 1")
            && analysis.contains("all_reduce")
            && analysis.contains(&seq.to_string()),
        "the analysis does not name rank 1, all_reduce and seq {seq}:\n{analysis}"
    );
    b.shutdown().ok();
    Ok(())
}

/// An injected hang (emulator) is caught by the collective deadline.
pub fn injected_hang(ctx: &RankCtx) -> anyhow::Result<()> {
    let (emu, _reset) = fault_injection(ctx)?;
    let b = ctx.backend("hang", short(ctx))?;
    all_reduce_ok(ctx, &b, 2)?;
    // The last rank hangs: rank 1 of 2, rank 7 of 8.
    let hung = ctx.world_size - 1;
    if ctx.rank == hung {
        emu.inject(hung, Fault::Hang, 1)?;
    }
    ctx.barrier("hang injected")?;
    let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), 1000)?;
    ctx.step(format!("all_reduce with rank {hung} hanging"));
    let t = Instant::now();
    let r = b.all_reduce(buf.view_mut()).and_then(|()| b.synchronize());
    expect_timeout("hung all_reduce", r, t.elapsed())?;
    ctx.barrier("hang seen")?;
    b.shutdown().ok();
    Ok(())
}

/// On a blocking communicator, an NCCL call that never returns (emulator:
/// the `stall` fault, as NCCL's connection set-up waiting for a peer) is
/// caught by the watchdog at the deadline, which names the op and its
/// sequence number and aborts the communicator to release the call.
pub fn blocking_stall(ctx: &RankCtx) -> anyhow::Result<()> {
    let (emu, _reset) = fault_injection(ctx)?;
    let b = ctx.backend(
        "stall",
        short(ctx).with_enqueue(metrale_comm::EnqueueMode::Blocking),
    )?;
    all_reduce_ok(ctx, &b, 4)?;
    if ctx.rank == 0 {
        // The next enqueue call stalls.
        emu.inject(0, Fault::Stalls, 1)?;
        let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), 1000)?;
        ctx.step("all_reduce stuck inside NCCL");
        let t = Instant::now();
        let r = b.all_reduce(buf.view_mut());
        let f = expect_timeout("stalled all_reduce", r, t.elapsed())?;
        let seq = b.recorder().last_seq();
        ensure!(
            f.op == "all_reduce" && f.seq == seq,
            "the failure names {} #{} instead of all_reduce #{seq}",
            f.op,
            f.seq
        );
        ensure!(!b.is_healthy(), "backend healthy after a stalled call");
    }
    ctx.barrier("stall seen")?;
    b.shutdown().ok();
    Ok(())
}

/// A blocking backend whose connection set-up at init gets stuck on one
/// rank (emulator: the `stall` fault on that rank's first blocking call):
/// both ranks' construction fails by the init deadline, and nothing of it
/// is left in flight: a default backend built next runs an all-reduce and
/// shuts down promptly (a communicator's teardown waits for its peers'
/// devices to be idle, so a stuck half-built communicator would hold it).
pub fn blocking_connect_stall(ctx: &RankCtx) -> anyhow::Result<()> {
    let (emu, _reset) = fault_injection(ctx)?;
    if ctx.rank == 1 {
        // The first enqueue call on a blocking communicator: connect_now.
        emu.inject(1, Fault::Stalls, 1)?;
    }
    ctx.barrier("stall injected")?;
    let init = Duration::from_secs(2);
    let t = Instant::now();
    let r = ctx.backend(
        "connect-stall",
        short(ctx)
            .with_init_timeout(init)
            .with_enqueue(metrale_comm::EnqueueMode::Blocking),
    );
    let took = t.elapsed();
    ensure!(
        r.is_err(),
        "a blocking backend with a stuck connection was built"
    );
    ensure!(
        took < init + SLACK,
        "construction failed after {took:?}, deadline {init:?}"
    );
    ctx.barrier("stall seen")?;
    let b = ctx.backend("after-stall", short(ctx))?;
    all_reduce_ok(ctx, &b, 5)?;
    ctx.step("shutdown after the stalled construction");
    let t = Instant::now();
    b.shutdown()?;
    let took = t.elapsed();
    ensure!(
        took < TIMEOUT + SLACK,
        "shutdown took {took:?}: work of the failed construction was still in flight"
    );
    Ok(())
}

/// An injected asynchronous error poisons; the poisoned backend refuses
/// 1000 calls, each fast and without calling NCCL.
pub fn async_error_poisons(ctx: &RankCtx) -> anyhow::Result<()> {
    let Some(emu) = ctx.emu() else {
        return poisoned_refusals_on_gpu(ctx);
    };
    let _reset = ResetFaults(ctx);
    let b = ctx.backend("async", short(ctx))?;
    all_reduce_ok(ctx, &b, 3)?;
    if ctx.rank == 0 {
        emu.inject(0, Fault::AsyncError, 1)?;
    }
    ctx.barrier("async injected")?;
    ctx.step("all_reduce with an async error on rank 0");
    let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), 1000)?;
    let r = b.all_reduce(buf.view_mut()).and_then(|()| b.synchronize());
    if ctx.rank != 0 {
        r?;
        b.shutdown()?;
        ctx.barrier("others shut down")?;
        return Ok(());
    }
    let until = Instant::now() + TIMEOUT + SLACK;
    while b.is_healthy() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    ensure!(
        !b.is_healthy(),
        "an asynchronous error did not poison the backend (all_reduce gave {r:?})"
    );
    let f = b.failure().context("poisoned without a failure")?;
    ensure!(
        matches!(f.kind, FailureKind::AsyncError(_)),
        "poisoned by {f}, expected an async error"
    );
    ctx.barrier("others shut down")?;
    // Let the watchdog finish its abort and dump (its NCCL calls are not
    // refusals), then count.
    let dump = ctx
        .dump_dir()
        .join(metrale_comm::diagnostics::dump_file_name(0, b.generation()));
    let until = Instant::now() + TIMEOUT;
    while !dump.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    refuse_1000(ctx, &b, Some((emu, emu.nccl_calls())))?;
    b.shutdown().ok();
    Ok(())
}

/// 1000 calls on a poisoned backend: each refused with `Poisoned`, the 99th
/// percentile under 10 µs, and (given the emulator and its NCCL call count
/// before) no NCCL call made.
fn refuse_1000(
    ctx: &RankCtx,
    b: &NcclBackend,
    nccl_calls: Option<(&crate::EmuControl, u64)>,
) -> anyhow::Result<()> {
    ctx.step("1000 refused calls");
    let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), 1000)?;
    let mut times = Vec::with_capacity(1000);
    for _ in 0..1000 {
        let t = Instant::now();
        let r = b.all_reduce(buf.view_mut());
        times.push(t.elapsed());
        ensure!(
            matches!(r, Err(CommError::Poisoned { .. })),
            "a poisoned backend answered {r:?}"
        );
    }
    if let Some((emu, before)) = nccl_calls {
        let after = emu.nccl_calls();
        ensure!(
            after == before,
            "{} NCCL calls while refusing",
            after - before
        );
    }
    times.sort_unstable();
    let p99 = times[989];
    ensure!(
        p99 < Duration::from_micros(10),
        "refusals: p99 {p99:?} (max {:?}), expected under 10 µs",
        times[999]
    );
    Ok(())
}

fn poisoned_refusals_on_gpu(ctx: &RankCtx) -> anyhow::Result<()> {
    // On GPUs: poison rank 0 with a skipped collective, then time refusals.
    let b = ctx.backend("poison-gpu", short(ctx))?;
    all_reduce_ok(ctx, &b, 4)?;
    if ctx.rank != 0 {
        ctx.get("poison/done")?;
        b.shutdown().ok();
        return Ok(());
    }
    let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), 1000)?;
    let r = b.all_reduce(buf.view_mut()).and_then(|()| b.synchronize());
    ensure!(r.is_err(), "the all_reduce no peer joined completed");
    refuse_1000(ctx, &b, None)?;
    ctx.set("poison/done", b"1")?;
    b.shutdown().ok();
    Ok(())
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// 20 cycles of injected failure, poison, reconnect on all ranks and a
/// correct all-reduce, with device memory and open files flat.
pub fn reconnect_cycles(ctx: &RankCtx) -> anyhow::Result<()> {
    let (emu, _reset) = fault_injection(ctx)?;
    let b = ctx.backend("reconnect", short(ctx))?;
    let mut baseline = None;
    for cycle in 0..20u64 {
        ctx.step(format!("reconnect cycle {cycle}"));
        // Every generation: one correct all_reduce, then the faulty one.
        all_reduce_ok(ctx, &b, 100 + cycle)?;
        if ctx.rank == 0 {
            emu.inject(0, Fault::AsyncError, 1)?;
        }
        ctx.barrier(&format!("inject {cycle}"))?;
        let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), 1000)?;
        let _ = b.all_reduce(buf.view_mut()).and_then(|()| b.synchronize());
        drop(buf);
        if ctx.rank == 0 {
            let until = Instant::now() + TIMEOUT + SLACK;
            while b.is_healthy() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            ensure!(
                !b.is_healthy(),
                "cycle {cycle}: the injected error did not poison"
            );
        }
        ctx.barrier(&format!("poisoned {cycle}"))?;
        b.attempt_reconnect()
            .with_context(|| format!("cycle {cycle}: attempt_reconnect"))?;
        ensure!(b.is_healthy(), "cycle {cycle}: unhealthy after reconnect");
        ctx.barrier(&format!("reconnected {cycle}"))?;
        if cycle == 0 || cycle == 19 {
            let now = (b.context().mem_info()?.0, open_fds());
            match baseline {
                None => baseline = Some(now),
                Some((mem, fds)) => {
                    ensure!(
                        now.0 == mem,
                        "device memory free went from {mem} to {} over 19 cycles",
                        now.0
                    );
                    ensure!(
                        now.1 <= fds + 2,
                        "open files went from {fds} to {} over 19 cycles",
                        now.1
                    );
                }
            }
            ctx.barrier(&format!("measured {cycle}"))?;
        }
    }
    all_reduce_ok(ctx, &b, 999)?;
    b.shutdown()?;
    Ok(())
}

/// A rank that never joins init: the others fail NcclBackend::new by the
/// init deadline.
pub fn init_without_a_rank(ctx: &RankCtx) -> anyhow::Result<()> {
    let init = Duration::from_secs(2);
    let cfg = ctx.config().with_init_timeout(init);
    if ctx.rank == ctx.world_size - 1 {
        ctx.step("not joining");
        ctx.get("nojoin/done")?;
        return Ok(());
    }
    ctx.step("NcclBackend::new without the last rank");
    let t = Instant::now();
    let r = NcclBackend::new(cfg, ctx.rendezvous("nojoin")?);
    let took = t.elapsed();
    ensure!(
        r.is_err(),
        "NcclBackend::new succeeded without the last rank"
    );
    ensure!(
        took <= init + SLACK,
        "NcclBackend::new failed after {took:?}, init deadline {init:?}"
    );
    if ctx.rank == 0 {
        ctx.set("nojoin/done", b"1")?;
    }
    Ok(())
}

/// recv_command_u32 returns promptly when the backend shuts down while it
/// idles, and (emulator) when the backend is poisoned while it idles.
pub fn idle_command_wait(ctx: &RankCtx) -> anyhow::Result<()> {
    let mut cfg = ctx.config();
    cfg.shutdown_timeout = TIMEOUT;
    let b = std::sync::Arc::new(ctx.backend("idle", cfg.clone())?);
    if ctx.rank == 1 {
        let mut cmd = DeviceBuffer::<u32>::alloc(b.context(), 1)?;
        let b2 = b.clone();
        ctx.step("recv_command_u32, shut down after 500 ms");
        let stopper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            let t = Instant::now();
            let r = b2.shutdown();
            (t, r)
        });
        let r = b.recv_command_u32(cmd.view_mut(), 0);
        let returned = Instant::now();
        let (started, _shutdown) = stopper
            .join()
            .map_err(|_| anyhow::anyhow!("stopper panicked"))?;
        ensure!(r.is_err(), "recv_command_u32 returned Ok without a command");
        let took = returned.saturating_duration_since(started);
        ensure!(
            took <= TIMEOUT + SLACK,
            "recv_command_u32 returned {took:?} after shutdown started"
        );
    }
    ctx.barrier("idle shutdown done")?;
    if ctx.rank != 1 {
        b.shutdown().ok();
    }
    let Some(emu) = ctx.emu() else { return Ok(()) };
    let _reset = ResetFaults(ctx);
    let b = ctx.backend("idle-poison", cfg)?;
    if ctx.rank == 1 {
        emu.inject(1, Fault::AsyncError, 1)?;
    }
    ctx.barrier("idle poison injected")?;
    let barrier = b.barrier();
    if ctx.rank == 1 {
        // The injected error follows the barrier's completion: the barrier
        // may see it (while it waits) or not; either way it is that error.
        if let Err(e) = &barrier {
            ensure!(
                e.failure()
                    .is_some_and(|f| matches!(f.kind, metrale_comm::FailureKind::AsyncError(_))),
                "the barrier failed with something else than the injected error: {e}"
            );
        }
    } else {
        barrier?;
    }
    if ctx.rank == 1 {
        let mut cmd = DeviceBuffer::<u32>::alloc(b.context(), 1)?;
        ctx.step("recv_command_u32 while an async error poisons");
        let t = Instant::now();
        let r = b.recv_command_u32(cmd.view_mut(), 0);
        let took = t.elapsed();
        ensure!(r.is_err(), "recv_command_u32 returned Ok without a command");
        ensure!(
            took <= TIMEOUT + SLACK,
            "recv_command_u32 returned {took:?} after the poison"
        );
    }
    ctx.barrier("idle poison done")?;
    b.shutdown().ok();
    Ok(())
}

/// The shutdown deadline of [`sigkill_rank`]'s backend: the one-shot
/// path's release waits that long for the killed rank at its barrier
/// before it leaks the buffers.
const SIGKILL_SHUTDOWN: Duration = Duration::from_secs(3);

/// The body of the SIGKILL scenario's ranks: all_reduce in a loop,
/// alternating NCCL's path (2 MiB) and the one-shot path (64 KiB, where
/// the set-up turned it on); the orchestrator kills rank 1 in either; rank
/// 0 must fail within timeout + 1 s of the last success and shut down
/// within its shutdown deadline (plus room for NCCL's abort).
pub fn sigkill_rank(ctx: &RankCtx) -> anyhow::Result<()> {
    if ctx.mode == crate::Mode::Threads {
        return Err(RankCtx::skip(
            "needs one process per rank (processes or socket mode)",
        ));
    }
    let mut cfg = short(ctx).with_one_shot(crate::ONE_SHOT_TO_1M);
    cfg.shutdown_timeout = SIGKILL_SHUTDOWN;
    let b = ctx.backend("sigkill", cfg)?;
    let mut big = DeviceBuffer::<bf16>::alloc(b.context(), 1 << 20)?;
    let mut small = DeviceBuffer::<bf16>::alloc(b.context(), 32 << 10)?;
    let start = Instant::now();
    let mut last_ok = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_secs(60) {
        ctx.step(format!("all_reduce loop {n}"));
        let buf = if n.is_multiple_of(2) {
            &mut big
        } else {
            &mut small
        };
        let r = b.all_reduce(buf.view_mut()).and_then(|()| b.synchronize());
        match r {
            Ok(()) => {
                last_ok = Instant::now();
                n += 1;
                if n == 10 {
                    ctx.mark(&format!("ready-rank{}", ctx.rank))?;
                }
            }
            Err(e) => {
                let took = last_ok.elapsed();
                ensure!(
                    took <= TIMEOUT + SLACK,
                    "the survivor's error came {took:?} after the last success: {e}"
                );
                println!("survivor error after {took:?}: {e}");
                // Its deadline (the release barrier's wait for the killed
                // rank), and room for NCCL's abort after a lost peer: less
                // than the default deadline it must not fall back to.
                let t = Instant::now();
                b.shutdown().ok();
                ensure!(
                    t.elapsed() <= SIGKILL_SHUTDOWN + 2 * TIMEOUT,
                    "the survivor's shutdown took {:?}",
                    t.elapsed()
                );
                return Ok(());
            }
        }
    }
    bail!("no error within 60 s although a peer was killed")
}

/// The collective deadline of [`reconnect_cycles_gpu`]: short, so that 20
/// induced timeouts stay well under the scenario's time budget.
const GPU_CYCLE_TIMEOUT: Duration = Duration::from_secs(1);

/// Device memory a GPU may report as newly used between the first and the
/// last cycle without it being a leak: the driver hands out device memory
/// in 2 MiB pages, so one page of lazily created state can appear; a leak of
/// one communicator's buffers per cycle would be far larger.
const GPU_MEM_SLACK: usize = 2 << 20;

/// Open files that may appear between the first and the last cycle without
/// it being a leak: a flight-recorder dump the watchdog may still be
/// writing and a rendezvous file being read or written by a peer thread
/// (ranks are threads sharing one descriptor table). A leak of one
/// descriptor per cycle would show as 19.
const FD_SLACK: usize = 3;

/// Rank 0 issues an all_reduce that rank 1 skips: it must time out by the
/// short deadline naming `all_reduce` and the operation's sequence number,
/// and leave the backend poisoned.
fn timed_out_all_reduce(ctx: &RankCtx, b: &NcclBackend, cycle: u64) -> anyhow::Result<()> {
    let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), 1000)?;
    buf.fill_bytes(crate::data::POISON_BYTE)?;
    let seq = b.recorder().last_seq() + 1;
    ctx.step(format!(
        "cycle {cycle}: all_reduce seq {seq} that rank 1 skips"
    ));
    let t = Instant::now();
    let r = b.all_reduce(buf.view_mut()).and_then(|()| b.synchronize());
    let took = t.elapsed();
    let e = match r {
        Ok(()) => bail!("cycle {cycle}: an all_reduce no peer joined completed"),
        Err(e) => e,
    };
    let f = e
        .failure()
        .with_context(|| format!("cycle {cycle}: expected a timeout failure, got {e}"))?;
    ensure!(
        matches!(f.kind, FailureKind::Timeout { .. }),
        "cycle {cycle}: expected a timeout, got {f}"
    );
    ensure!(
        took <= GPU_CYCLE_TIMEOUT + SLACK,
        "cycle {cycle}: error after {took:?}, timeout {GPU_CYCLE_TIMEOUT:?}"
    );
    ensure!(
        f.op == "all_reduce" && f.seq == seq,
        "cycle {cycle}: the failure names {} seq {}, expected all_reduce seq {seq}",
        f.op,
        f.seq
    );
    let msg = e.to_string();
    ensure!(
        msg.contains("all_reduce") && msg.contains(&format!("seq {seq}")),
        "cycle {cycle}: the error does not name all_reduce and seq {seq}: {msg}"
    );
    ensure!(
        !b.is_healthy(),
        "cycle {cycle}: backend healthy after a timeout"
    );
    Ok(())
}

/// A correct all_reduce on random data: the buffer is poisoned, then loaded
/// with this rank's input, and every element of the result is checked
/// against the host reference (which differs from every input element).
fn all_reduce_poisoned_first(ctx: &RankCtx, b: &NcclBackend, salt: u64) -> anyhow::Result<()> {
    let w = ctx.world_size;
    let seed = ctx.shared_seed(&format!("arp-{salt}"))?;
    let inputs: Vec<Vec<bf16>> = (0..w).map(|k| random_vec(seed, k, salt, 1000)).collect();
    let mut buf = DeviceBuffer::<bf16>::alloc(b.context(), 1000)?;
    buf.fill_bytes(crate::data::POISON_BYTE)?;
    ensure!(
        buf.to_host_vec()?.iter().all(|x| x.to_bits() == 0xFFFF),
        "the buffer did not read back poisoned"
    );
    buf.copy_from_host(&inputs[ctx.rank])?;
    b.all_reduce(buf.view_mut())?;
    b.synchronize()?;
    check(
        "all_reduce after reconnect",
        &buf.to_host_vec()?,
        &sum_in_rank_order(&inputs),
        super::exact(ctx),
        w,
    )
}

/// 20 cycles of the GPU way to fail (rank 1 skips an all_reduce, rank 0
/// times out by a 1 s deadline and is poisoned), reconnect on both ranks
/// (the healthy rank 1 is aborted and replaced too) and a correct
/// all_reduce, with device memory and open files flat from the first cycle
/// to the last. Needs no fault injection.
pub fn reconnect_cycles_gpu(ctx: &RankCtx) -> anyhow::Result<()> {
    let cfg = ctx
        .config()
        .with_collective_timeout(GPU_CYCLE_TIMEOUT)
        .with_fast_path(FastPathPolicy::Never);
    let b = ctx.backend("reconnect-gpu", cfg)?;
    all_reduce_poisoned_first(ctx, &b, 200)?;
    let mut baseline = None;
    for cycle in 0..20u64 {
        if ctx.rank == 0 {
            timed_out_all_reduce(ctx, &b, cycle)?;
        } else {
            ctx.step(format!("cycle {cycle}: skipping the all_reduce"));
        }
        ctx.barrier(&format!("gpu poisoned {cycle}"))?;
        ctx.step(format!("cycle {cycle}: attempt_reconnect"));
        let generation = b.generation();
        let stream = b.stream();
        b.attempt_reconnect()
            .with_context(|| format!("cycle {cycle}: attempt_reconnect"))?;
        ensure!(b.is_healthy(), "cycle {cycle}: unhealthy after reconnect");
        ensure!(
            b.stream() == stream,
            "cycle {cycle}: the backend's stream changed across the reconnect"
        );
        ensure!(
            b.generation() == generation + 1,
            "cycle {cycle}: generation went from {generation} to {}",
            b.generation()
        );
        ctx.step(format!("cycle {cycle}: all_reduce after reconnect"));
        all_reduce_poisoned_first(ctx, &b, 300 + cycle)
            .with_context(|| format!("cycle {cycle}"))?;
        ctx.barrier(&format!("gpu checked {cycle}"))?;
        if cycle == 0 || cycle == 19 {
            let now = (b.context().mem_info()?.0, open_fds());
            match baseline {
                None => baseline = Some(now),
                Some((mem, fds)) => {
                    let slack = if ctx.on_gpu() { GPU_MEM_SLACK } else { 0 };
                    ensure!(
                        now.0 + slack >= mem,
                        "device memory free went from {mem} to {} over 19 cycles",
                        now.0
                    );
                    ensure!(
                        now.1 <= fds + FD_SLACK,
                        "open files went from {fds} to {} over 19 cycles",
                        now.1
                    );
                }
            }
            ctx.barrier(&format!("gpu measured {cycle}"))?;
        }
    }
    ensure!(
        b.generation() == 20,
        "generation {} after 20 reconnects",
        b.generation()
    );
    b.shutdown()?;
    Ok(())
}
