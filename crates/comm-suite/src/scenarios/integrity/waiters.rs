//! Calls in flight across a reconnect or a shutdown: a thread waiting in
//! `synchronize` or idling in `recv_command_u32` gets an error, never `Ok`,
//! when another thread reconnects (`int_reconnect_aborts_waiters`), and a
//! shutdown beside an idle receive is prompt (`int_shutdown_idle_worker`).
//!
//! Invariants: as the parent module's; every waiting thread's result is
//! awaited with a deadline, and a thread still waiting past it is reported,
//! not joined.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use metrale_comm::{CommBackend, CommError, FastPathPolicy, NcclBackend};
use nccl_safe::{DataType, DeviceBuffer, DeviceViewMut};

use super::{SLACK, data, listing, reduce_ok, upload, variant, wrong};
use crate::RankCtx;
use crate::data::POISON_BYTE;

/// What a thread's call returned, and when.
type Returned = (Result<(), CommError>, Instant);

/// Runs `call` on a new thread; its result comes through the receiver.
fn on_thread(
    call: impl FnOnce() -> Result<(), CommError> + Send + 'static,
) -> anyhow::Result<(mpsc::Receiver<Returned>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::Builder::new()
        .name("int-waiter".into())
        .spawn(move || {
            let r = call();
            let _ = tx.send((r, Instant::now()));
        })
        .context("spawning a waiting thread")?;
    Ok((rx, h))
}

/// `recv_command_u32` from root 0 into `cmd` on a new thread.
fn idle_receive(
    b: &Arc<NcclBackend>,
    cmd: &Arc<DeviceBuffer<u32>>,
) -> anyhow::Result<(mpsc::Receiver<Returned>, std::thread::JoinHandle<()>)> {
    let (b, cmd) = (b.clone(), cmd.clone());
    on_thread(move || {
        // SAFETY: cmd is one u32 of this device, kept alive by this thread's
        // clone of the Arc until the call returns; the scenario's thread
        // reads it only after the call returned.
        let view = unsafe { DeviceViewMut::from_raw(cmd.device_ptr(), 1, DataType::Uint32) };
        b.recv_command_u32(view, 0)
    })
}

/// While a thread of rank 0 waits in `synchronize` for an all-reduce rank
/// 1 skipped, both ranks call `attempt_reconnect`: the waiter must get an
/// error, not `Ok`. Then, while a thread of rank 1 idles in
/// `recv_command_u32`, both ranks reconnect without a command sent: the
/// idle thread must get an error, not `Ok`. Both with NCCL's all-reduce and
/// with the fast path; a correct all-reduce follows each reconnect.
pub fn reconnect_aborts_waiters(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("int-reconnect")?;
    let mut symptoms = Vec::new();
    for policy in [FastPathPolicy::Never, FastPathPolicy::Always] {
        let tag = format!("{policy:?}");
        let cfg = ctx
            .config()
            .with_collective_timeout(Duration::from_secs(10))
            .with_fast_path(policy);
        let b = Arc::new(ctx.backend(&format!("int-reconnect-{tag}"), cfg)?);
        reduce_ok(ctx, &b, seed, 1)?;
        let n = 1 << 16;
        if ctx.rank == 0 {
            let d = data(ctx, seed, 2, n);
            let mut buf = upload(b.context(), &d.mine)?;
            ctx.step(format!(
                "{tag}: all_reduce rank 1 skips, synchronize on another thread"
            ));
            // buf is kept past the reconnect, which aborts the work on it.
            b.all_reduce(buf.view_mut())
                .with_context(|| format!("{tag}: the all_reduce rank 1 skips"))?;
            let b2 = b.clone();
            let (rx, waiter) = on_thread(move || b2.synchronize())?;
            std::thread::sleep(Duration::from_millis(300));
            if let Ok((r, _)) = rx.try_recv() {
                symptoms.push(format!(
                    "{tag}: synchronize returned before the reconnect: {r:?}"
                ));
            }
            ctx.set(&format!("int-reconnect/{tag}/waiting"), b"1")?;
            ctx.step(format!("{tag}: attempt_reconnect while synchronize waits"));
            let started = Instant::now();
            let rc = b.attempt_reconnect();
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok((Ok(()), at)) => {
                    let got = buf.to_host_vec()?;
                    let summary = wrong("its buffer", &got, &d.sum, &d.mine)
                        .unwrap_or_else(|| "its buffer holds the sum".into());
                    symptoms.push(format!(
                        "{tag}: synchronize returned Ok {:?} after attempt_reconnect began, for \
                         an all_reduce the peer never joined; {summary}",
                        at.saturating_duration_since(started)
                    ));
                }
                Ok((Err(e), _)) => tracing::debug!("{tag}: the waiter got {e}"),
                Err(_) => symptoms.push(format!(
                    "{tag}: synchronize still waits 5 s after attempt_reconnect began"
                )),
            }
            rc.with_context(|| format!("{tag}: attempt_reconnect on rank 0"))?;
            if waiter.is_finished() {
                let _ = waiter.join();
            }
        } else {
            ctx.step(format!("{tag}: skipping the all_reduce"));
            ctx.get(&format!("int-reconnect/{tag}/waiting"))?;
            b.attempt_reconnect()
                .with_context(|| format!("{tag}: attempt_reconnect on rank 1"))?;
        }
        reduce_ok(ctx, &b, seed, 3).with_context(|| format!("{tag}: after the reconnect"))?;

        if ctx.rank == 1 {
            let mut cmd = DeviceBuffer::<u32>::alloc(b.context(), 1)?;
            cmd.fill_bytes(POISON_BYTE)?;
            let cmd = Arc::new(cmd);
            ctx.step(format!("{tag}: recv_command_u32 on another thread"));
            let (rx, idler) = idle_receive(&b, &cmd)?;
            std::thread::sleep(Duration::from_millis(300));
            if let Ok((r, _)) = rx.try_recv() {
                symptoms.push(format!(
                    "{tag}: recv_command_u32 returned before the reconnect: {r:?}"
                ));
            }
            ctx.set(&format!("int-reconnect/{tag}/idling"), b"1")?;
            ctx.step(format!(
                "{tag}: attempt_reconnect while recv_command_u32 idles"
            ));
            let started = Instant::now();
            let rc = b.attempt_reconnect();
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok((Ok(()), at)) => symptoms.push(format!(
                    "{tag}: recv_command_u32 returned Ok {:?} after attempt_reconnect began, \
                     with no command sent (the buffer holds {:#x})",
                    at.saturating_duration_since(started),
                    cmd.to_host_vec()?[0]
                )),
                Ok((Err(e), _)) => tracing::debug!("{tag}: the idle thread got {e}"),
                Err(_) => symptoms.push(format!(
                    "{tag}: recv_command_u32 still idles 5 s after attempt_reconnect began"
                )),
            }
            rc.with_context(|| format!("{tag}: attempt_reconnect on rank 1"))?;
            if idler.is_finished() {
                let _ = idler.join();
            }
        } else {
            ctx.get(&format!("int-reconnect/{tag}/idling"))?;
            b.attempt_reconnect()
                .with_context(|| format!("{tag}: attempt_reconnect on rank 0"))?;
        }
        reduce_ok(ctx, &b, seed, 4)
            .with_context(|| format!("{tag}: after the second reconnect"))?;
        ctx.barrier(&format!("int-reconnect {tag} done"))?;
        b.shutdown()?;
    }
    ensure!(
        symptoms.is_empty(),
        "calls waiting across attempt_reconnect:{}",
        listing(&symptoms)
    );
    Ok(())
}

/// While a thread of rank 1 idles in `recv_command_u32`, rank 1 shuts down:
/// shutdown returns in under a fifth of its 5 s timeout and does not report
/// a drain that timed out; the idle thread gets an error at once. Rank 0
/// shuts down after, as promptly.
pub fn shutdown_idle_worker(ctx: &RankCtx) -> anyhow::Result<()> {
    let shutdown_timeout = Duration::from_secs(5);
    let prompt = shutdown_timeout / 5;
    let seed = ctx.shared_seed("int-idle")?;
    let mut cfg = ctx.config();
    cfg.shutdown_timeout = shutdown_timeout;
    let b = Arc::new(ctx.backend("int-idle", cfg)?);
    reduce_ok(ctx, &b, seed, 1)?;
    let mut symptoms = Vec::new();
    if ctx.rank == 1 {
        let mut cmd = DeviceBuffer::<u32>::alloc(b.context(), 1)?;
        cmd.fill_bytes(POISON_BYTE)?;
        let cmd = Arc::new(cmd);
        ctx.step("recv_command_u32 on another thread, then shutdown");
        let (rx, idler) = idle_receive(&b, &cmd)?;
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let shut = b.shutdown();
        let took = t.elapsed();
        if took > prompt {
            symptoms.push(format!(
                "shutdown took {took:?} (timeout {shutdown_timeout:?}) while another thread \
                 idled in recv_command_u32"
            ));
        }
        if let Err(e) = &shut {
            symptoms.push(format!(
                "shutdown returned {} although nothing but the idle receive was in flight: {e}",
                variant(e)
            ));
        }
        match rx.recv_timeout(SLACK) {
            Ok((Ok(()), _)) => symptoms.push(format!(
                "recv_command_u32 returned Ok with no command sent (the buffer holds {:#x})",
                cmd.to_host_vec()?[0]
            )),
            Ok((Err(e), _)) => tracing::debug!("the idle thread got {e}"),
            Err(_) => symptoms.push(format!(
                "recv_command_u32 still idles {SLACK:?} after shutdown returned"
            )),
        }
        if idler.is_finished() {
            let _ = idler.join();
        }
        ctx.set("int-idle/shut", b"1")?;
    } else {
        ctx.step("waiting for rank 1's shutdown");
        ctx.get("int-idle/shut")?;
        let t = Instant::now();
        let shut = b.shutdown();
        let took = t.elapsed();
        if took > prompt || shut.is_err() {
            symptoms.push(format!(
                "the root's shutdown after its peer's took {took:?}: {shut:?}"
            ));
        }
    }
    ensure!(
        symptoms.is_empty(),
        "shutdown with a thread idling in recv_command_u32:{}",
        listing(&symptoms)
    );
    Ok(())
}
