//! One program on one rank, from its backends to their shutdown: builds the
//! backends and caller streams, runs the threads under the program's
//! deadline, checks everything at the end, and tears down.
//!
//! Invariants:
//! - The program's deadline bounds the threads: when it passes, the turns
//!   are stopped and the backends shut down, which ends every idle wait
//!   (`recv_command_u32`) and every wait inside the backend.
//! - Registrations and symmetric memory go back through their backends
//!   (deregistered before freed); all other memory, and all memory after a
//!   failure, is dropped only after every backend was shut down, so no
//!   device work can still use it.
//! - A shutdown slower than its timeout (plus slack), or a failed shutdown
//!   of a healthy backend, is a failure of the program.
//! - Every rank passes the same teardown barrier, so the ranks start the
//!   next program together.
//! - A split backend's parent (a world backend of its configuration) is
//!   shut down after every program backend, within the same bound.

use std::time::{Duration, Instant};

use metrale_comm::CommBackend;
use nccl_safe::Stream;
use parking_lot::{Condvar, Mutex};

use super::super::turns::Turns;
use super::device::Mem;
use super::exec::{RankState, Run};
use super::program::{COLLECTIVE_TIMEOUT, Program, SHUTDOWN_TIMEOUT};
use super::reference::Plan;
use crate::RankCtx;

/// How long one program may run before its backends are shut down.
pub(super) const PROGRAM_DEADLINE: Duration = Duration::from_secs(25);
/// How much later than its bound a wait may end.
pub(super) const SLACK: Duration = Duration::from_secs(1);
/// Failures listed one by one in a verdict.
const LISTED: usize = 8;

fn summary(fails: &[String]) -> String {
    let mut s = fails
        .iter()
        .take(LISTED)
        .cloned()
        .collect::<Vec<_>>()
        .join("\n  ");
    if fails.len() > LISTED {
        s.push_str(&format!("\n  ... and {} more", fails.len() - LISTED));
    }
    s
}

/// Runs `prog` (normalized) with `plan` on this rank: `Err` lists what
/// went wrong.
pub(super) fn run_program(
    ctx: &RankCtx,
    prog: &Program,
    plan: &Plan,
    tag: &str,
) -> Result<(), String> {
    let mut backends = Vec::with_capacity(prog.backends.len());
    // The world backends that split ones were split from, shut down after
    // them.
    let mut parents = Vec::new();
    for (k, spec) in prog.backends.iter().enumerate() {
        let built = ctx
            .backend(&format!("{tag}-b{k}"), spec.config(ctx))
            .and_then(|b| {
                if !spec.split {
                    return Ok(b);
                }
                let child = b.split_backend(Some(0), ctx.rank)?;
                parents.push(b);
                child.ok_or_else(|| anyhow::anyhow!("a split with a color returned none"))
            });
        match built {
            Ok(b) => {
                // The emulator's ranks (threads or processes) can always
                // set the one-shot path up: a fuzzed program that asks for
                // it runs it there (on GPUs NCCL stands in where it is off).
                let must = spec.policy.one_shot() && !ctx.on_gpu() && (2..=8).contains(&prog.world);
                if must && let Some(why) = b.one_shot_unavailable() {
                    return Err(format!(
                        "b{k}: the one-shot path is off on the emulator: {why}"
                    ));
                }
                backends.push(b)
            }
            Err(e) => return Err(format!("building b{k}: {e:#}")),
        }
    }
    let c = backends[0].context().clone();
    let mut streams = Vec::with_capacity(prog.streams);
    for _ in 0..prog.streams {
        match Stream::new(&c) {
            Ok(s) => streams.push(s),
            Err(e) => return Err(format!("creating a caller stream: {e}")),
        }
    }
    let run = Run {
        ctx,
        prog,
        plan,
        backends: &backends,
        streams: &streams,
        c: &c,
        st: Mutex::new(RankState::default()),
        turns: Turns::new(),
        deadline: Instant::now() + PROGRAM_DEADLINE,
    };
    let mut fails = Vec::new();
    let finished = (Mutex::new(0usize), Condvar::new());
    let mut timed_out = false;
    std::thread::scope(|s| {
        for t in 0..prog.threads {
            let (run, finished) = (&run, &finished);
            let spawned = std::thread::Builder::new()
                .name(format!("fuzz-r{}-t{t}", ctx.rank))
                .spawn_scoped(s, move || {
                    run.worker(t);
                    *finished.0.lock() += 1;
                    finished.1.notify_all();
                });
            if let Err(e) = spawned {
                fails.push(format!("spawning thread {t}: {e}"));
                run.turns.stop();
                *finished.0.lock() += 1;
            }
        }
        let mut done = finished.0.lock();
        while *done < prog.threads {
            if finished
                .1
                .wait_until(&mut done, run.deadline + SLACK)
                .timed_out()
            {
                break;
            }
        }
        if *done < prog.threads {
            drop(done);
            timed_out = true;
            let at = run.turns.current();
            let label = if at < prog.steps.len() {
                run.label(at)
            } else {
                "the end".into()
            };
            fails.push(format!(
                "the program did not finish within {PROGRAM_DEADLINE:?}: step {}/{} ({label}) \
                 still runs; shutting the backends down",
                at + 1,
                prog.steps.len()
            ));
            run.turns.stop();
            for b in backends.iter().chain(&parents) {
                let _ = b.shutdown();
            }
        }
    });
    let mut st = std::mem::take(&mut *run.st.lock());
    if !timed_out {
        run.sync_all(&mut st, &plan.end, "at the end");
        for (k, b) in backends.iter().enumerate() {
            if let Some(f) = b.failure() {
                st.failures
                    .push(format!("at the end: b{k} is poisoned by {f}"));
            }
        }
    }
    fails.append(&mut st.failures);
    // Registrations and symmetric memory go back through their backends.
    let mut uids: Vec<u32> = st.slots.keys().copied().collect();
    uids.sort_unstable();
    for uid in uids {
        let Some(m) = st.slots.remove(&uid) else {
            continue;
        };
        if let Some((b, h)) = m.handle
            && let Err(e) = backends[b].deregister_buffer(h)
            && fails.is_empty()
        {
            fails.push(format!("teardown: deregister_buffer of slot #{uid}: {e}"));
        }
        match m.mem {
            Mem::Sym { b, alloc } => {
                if let Err(e) = backends[b].symmetric_free(alloc)
                    && fails.is_empty()
                {
                    fails.push(format!("teardown: symmetric_free of slot #{uid}: {e}"));
                }
            }
            mem => st.retired.push(mem),
        }
    }
    if let Err(e) = ctx.barrier(&format!("{tag}/teardown")) {
        fails.push(format!("teardown: {e:#}"));
    }
    for (k, b) in backends.iter().enumerate() {
        // Work still running on the backend's stream is left to finish
        // first (shutdown drains it too, but a slow drain would then count
        // as a slow shutdown and hide this program's own failure).
        if !timed_out {
            // SAFETY: `stream()` borrows the backend's own stream, which
            // lives as long as the backend; the wrapper does not destroy it.
            let own = unsafe { Stream::borrowed(&c, b.stream().as_raw()) };
            if let Err(e) = own.wait_until_idle(2 * COLLECTIVE_TIMEOUT)
                && fails.is_empty()
            {
                fails.push(format!("teardown: b{k}'s stream did not go idle: {e}"));
            }
        }
        let healthy = b.is_healthy();
        let t = Instant::now();
        let r = b.shutdown();
        let took = t.elapsed();
        if took > SHUTDOWN_TIMEOUT + SLACK {
            fails.push(format!("teardown: b{k} shutdown took {took:?}: {r:?}"));
        } else if let Err(e) = r
            && healthy
        {
            fails.push(format!("teardown: b{k} shutdown of a healthy backend: {e}"));
        }
    }
    for (k, p) in parents.iter().enumerate() {
        let t = Instant::now();
        let r = p.shutdown();
        let took = t.elapsed();
        if took > SHUTDOWN_TIMEOUT + SLACK || r.is_err() {
            fails.push(format!(
                "teardown: the {k}th split's parent: shutdown took {took:?}: {r:?}"
            ));
        }
    }
    drop(run);
    drop(st);
    drop(streams);
    drop(backends);
    if fails.is_empty() {
        Ok(())
    } else {
        Err(summary(&fails))
    }
}
