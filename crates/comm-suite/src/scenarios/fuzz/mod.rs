//! `fuzz_schedules`: a schedule fuzzer over every `CommBackend` operation.
//!
//! Each program is drawn from a seed: 1-3 backends (the fast path always,
//! never, by default, or always in small chunks; the one-shot path by its
//! default range beside the fast path's, or at every size; blocking or
//! non-blocking communicators; a world backend or one split from it,
//! every rank in rank order), 1-3 caller streams, 1-4 threads per rank
//! sharing the backends, and a list of steps: `all_reduce` and
//! `all_reduce_async` on a caller stream (bf16, f16, f32), `all_gather`,
//! `reduce_scatter`, `broadcast`, `all_to_all`, `all_to_all_v`, `barrier`,
//! a command (`broadcast` / `recv_command_u32`), `send_to`/`recv_from` on
//! caller streams (a grouped ring shift, or one pair), `group_start`/`group_end`
//! around asynchronous operations, `register_buffer`/`deregister_buffer`,
//! `symmetric_alloc`/`symmetric_free` buffers used as operands, graph
//! capture of `all_reduce_async` on a caller stream and its replays,
//! `synchronize`, bad inputs, and sync points that check every buffer.
//! Every rank derives the same program from the shared seed and issues the
//! same calls in the same order.
//!
//! The parts, by concern:
//! - [`program`]: what a program is, and how it is written in a report;
//! - [`generate`]: drawing a program from a seed;
//! - [`reference`]: normalization and the host reference of every buffer;
//! - [`device`]: the buffers' device memory and views;
//! - [`exec`] and [`bad`]: running the steps on one rank;
//! - [`run`]: one program on one rank, deadline and teardown included;
//! - [`shrink`]: agreeing on verdicts across ranks, and shrinking;
//! - this module: the time budget, the seeds, and the report.
//!
//! Invariants:
//! - Outputs are filled with the poison pattern before use and compared
//!   bit for bit with an exact host reference (`reference`).
//! - Every wait has a deadline: turns, backends (short collective and
//!   shutdown timeouts), and each program (`run::PROGRAM_DEADLINE`, after
//!   which its backends are shut down); [`run_limit`] bounds a whole run.
//! - Ranks agree through the suite's store on every verdict and on when to
//!   stop (rank 0's clock), so they run the same programs in the same
//!   order, also while shrinking.
//! - The time budget is `METRALE_FUZZ_SECS` (default [`DEFAULT_SECS`] per
//!   run, so that the three world sizes of `cargo test` take about a
//!   minute); `METRALE_FUZZ_SEED` runs that one seed again and again for
//!   the budget (a race need not fail every run). Rank 0 prints the seeds
//!   it runs; a failing seed is shrunk, and the seed, its program and the
//!   smallest failing program are reported with the command that re-runs
//!   it.

mod bad;
mod device;
mod exec;
mod generate;
mod program;
mod reference;
mod run;
mod shrink;

use std::time::{Duration, Instant};

use anyhow::Context as _;

use crate::RankCtx;
pub use program::Program;
use run::{PROGRAM_DEADLINE, SLACK};
use shrink::{Fuzzer, SHRINK_LIMIT};

/// The time budget of one run, in seconds.
pub const SECS_ENV: &str = "METRALE_FUZZ_SECS";
/// One seed to run (decimal or `0x` hex) instead of a range.
pub const SEED_ENV: &str = "METRALE_FUZZ_SEED";
/// The budget of one run when `METRALE_FUZZ_SECS` is not set.
pub const DEFAULT_SECS: f64 = 18.0;

/// The fuzzing time of one run: `METRALE_FUZZ_SECS`, else
/// [`DEFAULT_SECS`].
pub fn budget() -> Duration {
    std::env::var(SECS_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| *s > 0.0 && *s <= 86_400.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(Duration::from_secs_f64(DEFAULT_SECS))
}

/// The longest one run of the scenario takes: the budget, shrinking, and
/// two programs that miss their deadline with slow teardowns.
pub fn run_limit() -> Duration {
    let program = PROGRAM_DEADLINE + 6 * (program::SHUTDOWN_TIMEOUT + SLACK);
    budget() + SHRINK_LIMIT + 2 * program + Duration::from_secs(30)
}

fn seed_from_env() -> anyhow::Result<Option<u64>> {
    let Ok(v) = std::env::var(SEED_ENV) else {
        return Ok(None);
    };
    let v = v.trim();
    let parsed = match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    parsed
        .map(Some)
        .with_context(|| format!("{SEED_ENV}=`{v}` is not a seed (decimal or 0x hex)"))
}

/// One line to stderr, unbuffered, outside the test harness's capture.
fn report(line: &str) {
    let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{line}\n").as_bytes());
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The scenario: random programs from consecutive seeds for the time
/// budget, every rank running each; the first failing seed is shrunk and
/// reported with its program and the smallest failing one.
pub fn schedules(ctx: &RankCtx) -> anyhow::Result<()> {
    let budget = budget();
    let fixed = seed_from_env()?;
    let base = match fixed {
        Some(s) => s,
        None => ctx.shared_seed("fuzz")?,
    };
    let (w, name) = (ctx.world_size, ctx.scenario);
    if ctx.rank == 0 {
        match fixed {
            Some(s) => report(&format!(
                "{name}: world {w}: seed {s:#x} ({SEED_ENV}), again and again for {:.0} s",
                budget.as_secs_f64()
            )),
            None => report(&format!(
                "{name}: world {w}: seeds {base:#x} and up, for {:.0} s ({SECS_ENV}); \
                 re-run one with {SEED_ENV}=SEED",
                budget.as_secs_f64()
            )),
        }
    }
    let started = Instant::now();
    let mut fz = Fuzzer { ctx, runs: 0 };
    let mut count = 0u64;
    loop {
        // A fixed seed runs again and again: a race need not fail every run.
        let seed = match fixed {
            Some(s) => s,
            None => base.wrapping_add(count),
        };
        let prog = generate::generate(seed, w);
        let stop = started.elapsed() >= budget;
        let (norm, fail, stop) = fz.run(&prog, stop)?;
        count += 1;
        if let Some(why) = fail {
            if ctx.rank == 0 {
                report(&format!(
                    "{name}: world {w}: seed {seed:#x} fails after {count} program(s); shrinking"
                ));
            }
            let (small, small_why, runs) = fz.shrink(norm.clone(), why.clone())?;
            let which = match fixed {
                Some(_) => format!("run {count} of it"),
                None => format!("program {count} of the run from {base:#x}"),
            };
            let msg = format!(
                "seed {seed:#x} (world {w}, {which}) fails:\n{}\n\
                 its program:\n{}\n\
                 shrunk from {} to {} step(s) in {runs} run(s); the smallest failing program:\n{}\n\
                 which fails with:\n{}\n\
                 re-run: {SEED_ENV}={seed:#x} COMM_SUITE_SCENARIOS={name} \
                 cargo test -p comm-suite --test emulator",
                indent(&why),
                indent(&norm.to_string()),
                norm.steps.len(),
                small.steps.len(),
                indent(&small.to_string()),
                indent(&small_why)
            );
            if ctx.rank != 0 {
                anyhow::bail!(
                    "seed {seed:#x} (world {w}) fails; rank 0 reports its program and the \
                     smallest failing one"
                );
            }
            report(&format!(
                "{name}: world {w}: seed {seed:#x} shrunk to {} step(s)",
                small.steps.len()
            ));
            anyhow::bail!(msg);
        }
        if stop {
            break;
        }
    }
    if ctx.rank == 0 {
        let seeds = match fixed {
            Some(s) => format!("all seed {s:#x}"),
            None => format!("seeds {base:#x} to {:#x}", base.wrapping_add(count - 1)),
        };
        report(&format!(
            "{name}: world {w}: {count} program(s) passed ({seeds}) in {:.1} s",
            started.elapsed().as_secs_f64()
        ));
    }
    Ok(())
}
