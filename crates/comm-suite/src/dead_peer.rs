//! The orchestration of `rel_dead_peer` (processes mode): for each case
//! (NCCL's path, the one-shot path and the tuned defaults; SIGSTOP and
//! SIGKILL; of rank 0, which serves the store, and of the last rank) it
//! starts the ranks, signals the victim once every rank is past its warm-up, bounds each
//! survivor's exit (its error bound + 2 s), then continues a SIGSTOPped
//! victim and bounds its exit (3 s). The bounds on the error and the
//! shutdown are the ranks' own (`scenarios::dead_peer`); each rank's
//! measurements are printed.
//!
//! Invariants: every child is killed (and reaped) on every path out; a
//! stopped victim is continued before it is killed, so nothing is left
//! stopped.

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use crate::orchestrator::{Opts, collect, hang_report, kill_all, spawn_ranks, wait_all};
use crate::scenarios::dead_peer::{CASE_ENV, Case, CasePath, KILL_BOUND, STOP_BOUND, now_us};
use crate::{Mode, Outcome, Scenario};

/// How long a survivor may take from its error to its exit.
const EXIT_BOUND: Duration = Duration::from_secs(2);
/// How long a continued victim may take to fail and exit.
const CONTINUED_BOUND: Duration = Duration::from_secs(3);

/// Every case at `world` ranks.
pub fn cases(world: usize) -> Vec<Case> {
    let mut v = Vec::new();
    for path in CasePath::ALL {
        for kill in [false, true] {
            for victim in [world - 1, 0] {
                v.push(Case { path, kill, victim });
            }
        }
    }
    v
}

fn signal(kid: &Child, sig: libc::c_int) -> anyhow::Result<()> {
    let pid = kid.id() as libc::pid_t;
    // SAFETY: kill takes a pid and a signal number; the pid is our own
    // child, not yet waited for, so it cannot have been reused.
    let rc = unsafe { libc::kill(pid, sig) };
    anyhow::ensure!(rc == 0, "kill({pid}, {sig}) failed");
    Ok(())
}

/// Every case at the world `sc` gets on `gpus`, `opts.repeat` times each.
pub fn run_all(sc: &Scenario, mode: Mode, world: usize, opts: &Opts) -> anyhow::Result<Outcome> {
    for case in cases(world) {
        for i in 0..opts.repeat.max(1) {
            let out = run_case(sc, mode, world, case, opts)?;
            if let Outcome::Fail(m) = out {
                return Ok(Outcome::Fail(format!(
                    "case {} at {world} ranks, repetition {i}: {m}",
                    case.spell()
                )));
            }
        }
    }
    Ok(Outcome::Pass)
}

/// One run of one case.
pub fn run_case(
    sc: &Scenario,
    mode: Mode,
    world: usize,
    case: Case,
    opts: &Opts,
) -> anyhow::Result<Outcome> {
    let dir = crate::fresh_run_dir(sc.name)?;
    let env = [(CASE_ENV, case.spell())];
    let mut kids = spawn_ranks(sc, world, mode, &dir, opts.emulator, &env)?;
    let out = drive(sc, world, case, opts, &dir, &mut kids);
    // Nothing stays stopped or running, whatever happened. A victim
    // already reaped is not signalled: its pid may be another process's.
    if !case.kill && matches!(kids[case.victim].try_wait(), Ok(None)) {
        let _ = signal(&kids[case.victim], libc::SIGCONT);
    }
    kill_all(&mut kids);
    let out = out?;
    let timings: Vec<String> = (0..world)
        .filter_map(|r| std::fs::read_to_string(dir.join(format!("timing-rank{r}"))).ok())
        .collect();
    println!("    {} x{world}: {}", case.spell(), timings.join("; "));
    if matches!(out, Outcome::Fail(_)) {
        eprintln!("comm-suite: run directory kept: {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(out)
}

fn drive(
    sc: &Scenario,
    world: usize,
    case: Case,
    opts: &Opts,
    dir: &Path,
    kids: &mut [Child],
) -> anyhow::Result<Outcome> {
    let deadline = Instant::now() + opts.timeout;
    while !(0..world).all(|r| dir.join(format!("ready-rank{r}")).exists()) {
        if Instant::now() >= deadline
            || kids.iter_mut().any(|k| matches!(k.try_wait(), Ok(Some(_))))
        {
            return Ok(Outcome::Fail(format!(
                "ranks did not reach the all_reduce loop\n{}",
                hang_report(sc, dir, world, opts.timeout)
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::fs::write(dir.join("signalled-at"), now_us().to_string())?;
    let sig = if case.kill {
        libc::SIGKILL
    } else {
        libc::SIGSTOP
    };
    signal(&kids[case.victim], sig)?;
    let signalled = Instant::now();
    let bound = if case.kill { KILL_BOUND } else { STOP_BOUND };
    let limit = bound + EXIT_BOUND;
    let survivors: Vec<usize> = (0..world).filter(|&r| r != case.victim).collect();
    let mut codes = vec![0; world];
    for &r in &survivors {
        let Some(c) = wait_all(std::slice::from_mut(&mut kids[r]), signalled + limit) else {
            return Ok(Outcome::Fail(format!(
                "survivor rank {r} did not exit within {limit:?} of the signal\n{}",
                hang_report(sc, dir, world, limit)
            )));
        };
        codes[r] = c[0];
    }
    let left = signalled.elapsed();
    let files: Vec<String> = survivors
        .iter()
        .map(|r| format!("result-rank{r}"))
        .collect();
    let sc_codes: Vec<i32> = survivors.iter().map(|&r| codes[r]).collect();
    if let Outcome::Fail(m) = collect(dir, &files, &sc_codes) {
        return Ok(Outcome::Fail(format!(
            "survivors (left after {left:?}): {m}"
        )));
    }
    if case.kill {
        return Ok(Outcome::Pass);
    }
    signal(&kids[case.victim], libc::SIGCONT)?;
    let continued = Instant::now();
    let Some(c) = wait_all(
        std::slice::from_mut(&mut kids[case.victim]),
        continued + CONTINUED_BOUND,
    ) else {
        return Ok(Outcome::Fail(format!(
            "the continued rank {} did not exit within {CONTINUED_BOUND:?}\n{}",
            case.victim,
            hang_report(sc, dir, world, CONTINUED_BOUND)
        )));
    };
    let exited = continued.elapsed();
    match collect(dir, &[format!("result-rank{}", case.victim)], &c) {
        Outcome::Fail(m) => Ok(Outcome::Fail(format!(
            "the continued rank (exited {exited:?} after SIGCONT): {m}"
        ))),
        _ => {
            println!(
                "    {} x{world}: survivors out {:.0} ms after the signal, the continued rank {:.0} ms after SIGCONT",
                case.spell(),
                left.as_secs_f64() * 1e3,
                exited.as_secs_f64() * 1e3
            );
            Ok(Outcome::Pass)
        }
    }
}
