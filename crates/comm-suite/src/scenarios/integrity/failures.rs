//! A failed collective stays a failure (`int_mismatch_reported`) and a
//! shutdown right after one is prompt and safe (`int_shutdown_after_failure`),
//! both with faults the emulator injects.
//!
//! Invariants: as the parent module's; each scenario holds the fault
//! injection's reset guard for its whole run, so no fault outlives it.

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use metrale_comm::{AllReducePath, CommBackend, CommError, FastPathPolicy};

use super::{SLACK, listing, reduce_ok, upload, variant};
use crate::RankCtx;
use crate::data::small_ints;
use crate::emu::Fault;
use crate::scenarios::reliability::fault_injection;

/// The collective timeout of the scenarios about failures.
const TIMEOUT: Duration = Duration::from_secs(2);

/// The backend configuration of the failure scenarios: the short collective
/// timeout and a given fast-path policy.
fn short(ctx: &RankCtx, policy: FastPathPolicy) -> metrale_comm::BackendConfig {
    ctx.config()
        .with_collective_timeout(TIMEOUT)
        .with_fast_path(policy)
}

/// With NCCL's all-reduce, after one that succeeded, rank 0 reduces 1 MiB
/// while rank 1 reduces 2 MiB; the emulator fails the collective on both.
/// The all_reduce or the synchronize after it must return `Failed` naming
/// `all_reduce` and its sequence number (not the one before, which its
/// caller was told succeeded), by the deadline; the backend is then
/// poisoned by it, refuses the next call with it as the cause, and its
/// dump names it. Twice: with the watchdog's usual interval, and with a
/// 1 s one, so that the watchdog has not yet retired the successful
/// all-reduce when the failure is seen (the waiter names the failure).
pub fn mismatch_reported(ctx: &RankCtx) -> anyhow::Result<()> {
    let (_emu, _reset) = fault_injection(ctx)?;
    mismatch_once(ctx, "int-mismatch", short(ctx, FastPathPolicy::Never))?;
    let mut slow = short(ctx, FastPathPolicy::Never);
    slow.watchdog_interval = Duration::from_secs(1);
    mismatch_once(ctx, "int-mismatch-slow-watchdog", slow)
        .context("with the watchdog ticking once a second")
}

fn mismatch_once(
    ctx: &RankCtx,
    name: &str,
    cfg: metrale_comm::BackendConfig,
) -> anyhow::Result<()> {
    let seed = ctx.shared_seed(name)?;
    let b = ctx.backend(name, cfg)?;
    reduce_ok(ctx, &b, seed, 1)?;
    let n = if ctx.rank == 0 { 1 << 19 } else { 1 << 20 };
    let mine = small_ints(seed, ctx.rank, 2, n);
    let mut buf = upload(b.context(), &mine)?;
    ctx.step("all_reduce of 1 MiB on rank 0, 2 MiB on rank 1");
    let t = Instant::now();
    // buf outlives the backend's shutdown below.
    let issued = b.all_reduce(buf.view_mut());
    let seq = b.recorder().last_seq();
    let r = issued.and_then(|()| b.synchronize());
    let took = t.elapsed();
    let mut symptoms = Vec::new();
    match &r {
        Ok(()) => {
            let got = buf.to_host_vec()?;
            let untouched = got
                .iter()
                .zip(&mine)
                .filter(|(g, x)| g.to_f32() == **x as f32)
                .count();
            symptoms.push(format!(
                "all_reduce (seq {seq}) and synchronize returned Ok after {took:?}, although the \
                 emulator failed the collective (mismatched sizes); the buffer still holds this \
                 rank's input in {untouched} of {n} elements"
            ));
        }
        Err(e) => {
            match e {
                // The all-reduce's own failure, or (when the watchdog saw
                // it first) the refusal of the wait that carries it.
                CommError::Failed(f) | CommError::Poisoned { cause: f, .. }
                    if f.op == "all_reduce" && f.seq == seq => {}
                other => symptoms.push(format!(
                    "expected Failed (or Poisoned by) all_reduce seq {seq}, got {}: {other}",
                    variant(other)
                )),
            }
            let msg = e.to_string();
            if !(msg.contains("all_reduce") && msg.contains(&format!("seq {seq}"))) {
                symptoms.push(format!(
                    "the error does not name all_reduce and seq {seq}: {msg}"
                ));
            }
            if took > TIMEOUT + SLACK {
                symptoms.push(format!("the error came after {took:?}"));
            }
        }
    }
    // The watchdog may see the emulator's error after synchronize: give it
    // the slack, so that the symptoms below are what stays.
    let until = Instant::now() + SLACK;
    while b.is_healthy() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    match b.failure() {
        None => symptoms.push(format!(
            "the backend is still healthy {SLACK:?} after the failed all_reduce"
        )),
        Some(f) if f.op != "all_reduce" || f.seq != seq => symptoms.push(format!(
            "the backend is poisoned by `{f}`, not by all_reduce seq {seq}"
        )),
        Some(_) => {}
    }
    let next = b.barrier();
    match (&r, &next) {
        (Ok(()), Err(e)) => symptoms.push(format!(
            "the error surfaced only on the next call (barrier): {e}"
        )),
        (_, Ok(())) => symptoms.push("the next call (barrier) succeeded".into()),
        (Err(_), Err(_)) => {}
    }
    let dump = ctx
        .dump_dir()
        .join(metrale_comm::diagnostics::dump_file_name(
            ctx.rank,
            b.generation(),
        ));
    let until = Instant::now() + SLACK;
    while !dump.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    match std::fs::read_to_string(&dump) {
        Err(e) => symptoms.push(format!(
            "no flight-recorder dump at {}: {e}",
            dump.display()
        )),
        Ok(text) => {
            let d: metrale_comm::diagnostics::Dump =
                serde_json::from_str(&text).context("parsing the dump")?;
            if !d.header.reason.starts_with("all_reduce") || d.header.first_failed_seq != Some(seq)
            {
                symptoms.push(format!(
                    "the dump names `{}` (first failed seq {:?}) instead of all_reduce seq {seq}",
                    d.header.reason, d.header.first_failed_seq
                ));
            }
        }
    }
    b.shutdown().ok();
    ensure!(
        symptoms.is_empty(),
        "a failed all_reduce (mismatched sizes across ranks) was not reported as such:{}",
        listing(&symptoms)
    );
    Ok(())
}

/// Ten times: a fast-path all-reduce of 16 MiB whose receive on rank 0
/// fails (the emulator's asynchronous error at the receive), then
/// `shutdown` at once, then the caller frees its buffer. Shutdown returns
/// within its timeout (`Ok` or a typed error) and the process survives: no
/// add kernel still runs on the scratch buffer shutdown freed, nor on the
/// caller's buffer.
pub fn shutdown_after_failure(ctx: &RankCtx) -> anyhow::Result<()> {
    const ITERATIONS: usize = 10;
    const BYTES: usize = 16 << 20;
    let (emu, _reset) = fault_injection(ctx)?;
    let seed = ctx.shared_seed("int-uaf")?;
    let shutdown_timeout = Duration::from_secs(5);
    let mut symptoms = Vec::new();
    for it in 0..ITERATIONS {
        let mut cfg = short(ctx, FastPathPolicy::Always);
        cfg.shutdown_timeout = shutdown_timeout;
        let b = ctx.backend(&format!("int-uaf-{it}"), cfg)?;
        ensure!(
            b.all_reduce_path(BYTES) == AllReducePath::FastPath,
            "16 MiB does not take the fast path"
        );
        reduce_ok(ctx, &b, seed, it as u64)?;
        if ctx.rank == 0 {
            // The fast path's operations are a send, then the receive.
            emu.inject(0, Fault::AsyncError, 2)?;
        }
        ctx.barrier(&format!("int-uaf injected {it}"))?;
        let n = BYTES / 2;
        let mut buf = upload(b.context(), &small_ints(seed, ctx.rank, 100 + it as u64, n))?;
        ctx.step(format!(
            "iteration {it}: fast-path all_reduce 16 MiB, receive fails on rank 0"
        ));
        // buf is freed only after shutdown returned, which must leave no work
        // on it.
        let r = b.all_reduce(buf.view_mut()).and_then(|()| b.synchronize());
        if ctx.rank == 0 && r.is_ok() {
            let until = Instant::now() + TIMEOUT + SLACK;
            while b.is_healthy() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        ctx.step(format!("iteration {it}: shutdown after the failure"));
        let t = Instant::now();
        let shut = b.shutdown();
        let took = t.elapsed();
        if took > shutdown_timeout + SLACK {
            symptoms.push(format!(
                "iteration {it}: shutdown took {took:?} (timeout {shutdown_timeout:?}): {shut:?}"
            ));
        }
        tracing::debug!(rank = ctx.rank, it, "shutdown after failure: {shut:?}");
        drop(buf);
        // An add kernel still running on freed memory faults here.
        std::thread::sleep(Duration::from_millis(100));
        drop(b);
        ctx.barrier(&format!("int-uaf done {it}"))?;
    }
    ensure!(
        symptoms.is_empty(),
        "shutdown after a failed fast-path all-reduce:{}",
        listing(&symptoms)
    );
    Ok(())
}
