//! Agreeing on verdicts across ranks, and shrinking a failing program.
//!
//! Invariants:
//! - Every run of a program ends with every rank publishing its verdict
//!   through the suite's store under the run's tag and reading everyone's,
//!   so all ranks see the same failures and the same decision to stop
//!   (rank 0's, from its clock and its run count): they run the same
//!   programs in the same order, also while shrinking.
//! - A candidate counts as passing only after [`ATTEMPTS`] passing runs (a
//!   race need not fail every run); shrinking is bounded by
//!   [`SHRINK_LIMIT`] and [`SHRINK_RUNS`].
//! - Shrinking only removes steps, drops unused backends and streams
//!   (renumbering the rest) and moves every step to one thread; it never
//!   changes what a kept step does, since its uid keeps salting its data.

use std::time::{Duration, Instant};

use super::program::{Item, Op, Program};
use super::reference::prepare;
use super::run::run_program;
use crate::RankCtx;

/// How long shrinking a failure may take, and in how many runs.
pub(super) const SHRINK_LIMIT: Duration = Duration::from_secs(40);
const SHRINK_RUNS: usize = 150;
/// Runs of a shrink candidate before it counts as passing.
const ATTEMPTS: usize = 3;

/// Publishes this rank's verdict (and, from rank 0, whether to stop after
/// this run) under `key`; returns every rank's failures and rank 0's stop.
fn agree(
    ctx: &RankCtx,
    key: &str,
    mine: &Result<(), String>,
    stop: bool,
) -> anyhow::Result<(Option<String>, bool)> {
    let mut v = vec![if stop { b'S' } else { b'C' }];
    match mine {
        Ok(()) => v.push(b'P'),
        Err(m) => {
            v.push(b'F');
            v.extend(m.as_bytes());
        }
    }
    ctx.set(&format!("{key}/{}", ctx.rank), &v)?;
    let mut fails = Vec::new();
    let mut stop0 = false;
    for r in 0..ctx.world_size {
        let b = ctx.get(&format!("{key}/{r}"))?;
        anyhow::ensure!(b.len() >= 2, "{key}: rank {r}'s verdict is truncated");
        if r == 0 {
            stop0 = b[0] == b'S';
        }
        if b[1] == b'F' {
            fails.push(format!("rank {r}: {}", String::from_utf8_lossy(&b[2..])));
        }
    }
    Ok(((!fails.is_empty()).then(|| fails.join("\n")), stop0))
}

pub(super) struct Fuzzer<'a> {
    pub ctx: &'a RankCtx,
    pub runs: u64,
}

impl Fuzzer<'_> {
    /// Runs `prog` on every rank: the normalized program, the ranks'
    /// failures, and whether rank 0 says stop (`stop` is this rank's say).
    pub fn run(
        &mut self,
        prog: &Program,
        stop: bool,
    ) -> anyhow::Result<(Program, Option<String>, bool)> {
        let (norm, plan) = prepare(prog, self.ctx.rank);
        let tag = format!("fz-{}", self.runs);
        self.runs += 1;
        self.ctx.step(format!(
            "fuzz run {tag}: seed {:#x}, {} steps",
            norm.seed,
            norm.steps.len()
        ));
        let mine = run_program(self.ctx, &norm, &plan, &tag);
        drop(plan);
        let (fail, stop) = agree(self.ctx, &format!("fuzz/{tag}"), &mine, stop)?;
        Ok((norm, fail, stop))
    }

    /// Whether `cand` fails within [`ATTEMPTS`] runs.
    fn fails(
        &mut self,
        cand: &Program,
        started: Instant,
        runs: &mut usize,
    ) -> anyhow::Result<(Program, Option<String>, bool)> {
        let mut last = None;
        for _ in 0..ATTEMPTS {
            let stop = started.elapsed() >= SHRINK_LIMIT || *runs + 1 >= SHRINK_RUNS;
            let (norm, fail, stop) = self.run(cand, stop)?;
            *runs += 1;
            if fail.is_some() || stop {
                return Ok((norm, fail, stop));
            }
            last = Some(norm);
        }
        Ok((last.unwrap_or_else(|| cand.clone()), None, false))
    }

    /// Removes steps from `best` (halves, quarters, ... single steps) while
    /// it still fails, then drops unused backends and streams, then tries
    /// one thread; bounded by [`SHRINK_LIMIT`] and [`SHRINK_RUNS`] (rank 0's
    /// count decides). Returns the smallest failing program, its failure
    /// and the number of runs.
    pub fn shrink(
        &mut self,
        mut best: Program,
        mut why: String,
    ) -> anyhow::Result<(Program, String, usize)> {
        let started = Instant::now();
        let mut runs = 0usize;
        let mut stopped = false;
        let mut chunk = (best.steps.len() / 2).max(1);
        while !stopped && !best.steps.is_empty() {
            let mut i = 0;
            let mut removed = false;
            while i < best.steps.len() && !stopped {
                let mut cand = best.clone();
                let end = (i + chunk).min(cand.steps.len());
                cand.steps.drain(i..end);
                self.ctx.step(format!(
                    "shrinking seed {:#x}: {} steps, trying without {}..{end}",
                    best.seed,
                    best.steps.len(),
                    i
                ));
                let (norm, fail, stop) = self.fails(&cand, started, &mut runs)?;
                stopped = stop;
                match fail {
                    Some(m) if norm.steps.len() < best.steps.len() => {
                        best = norm;
                        why = m;
                        removed = true;
                    }
                    _ => i += chunk,
                }
            }
            if !removed {
                if chunk == 1 {
                    break;
                }
                chunk = (chunk / 2).max(1);
            }
        }
        if !stopped && let Some(cand) = pruned(&best) {
            let (norm, fail, stop) = self.fails(&cand, started, &mut runs)?;
            stopped = stop;
            if let Some(m) = fail {
                best = norm;
                why = m;
            }
        }
        if !stopped && best.threads > 1 {
            let mut cand = best.clone();
            cand.threads = 1;
            for s in &mut cand.steps {
                s.thread = 0;
            }
            let (norm, fail, _) = self.fails(&cand, started, &mut runs)?;
            if let Some(m) = fail {
                best = norm;
                why = m;
            }
        }
        Ok((best, why, runs))
    }
}

/// Calls `b` on every backend index and `s` on every caller-stream index
/// that `op` names.
fn each_ref(op: &mut Op, b: &mut impl FnMut(&mut usize), s: &mut impl FnMut(&mut usize)) {
    match op {
        Op::AllReduce { b: x, .. }
        | Op::AllGather { b: x, .. }
        | Op::ReduceScatter { b: x, .. }
        | Op::Broadcast { b: x, .. }
        | Op::AllToAll { b: x, .. }
        | Op::AllToAllV { b: x, .. }
        | Op::Barrier { b: x }
        | Op::Command { b: x, .. }
        | Op::Register { b: x, .. }
        | Op::Synchronize { b: x }
        | Op::Bad { b: x, .. } => b(x),
        Op::SendRecv {
            b: x,
            stream,
            recv_stream,
            ..
        } => {
            b(x);
            s(stream);
            s(recv_stream);
        }
        Op::AllReduceAsync { b: x, stream, .. }
        | Op::AddRmsNorm { b: x, stream, .. }
        | Op::SendOne { b: x, stream, .. }
        | Op::Capture { b: x, stream, .. } => {
            b(x);
            s(stream);
        }
        Op::Group { b: x, items } => {
            b(x);
            for it in items {
                match it {
                    Item::AllReduceAsync { stream, .. } => s(stream),
                    Item::SendRecv {
                        stream,
                        recv_stream,
                        ..
                    } => {
                        s(stream);
                        s(recv_stream);
                    }
                    _ => {}
                }
            }
        }
        Op::Alloc { sym: Some(x), .. } => b(x),
        Op::Alloc { sym: None, .. }
        | Op::Deregister { .. }
        | Op::Free { .. }
        | Op::Replay { .. }
        | Op::ReplayAll { .. }
        | Op::SyncAll => {}
    }
}

/// `prog` without the backends and caller streams no step uses (the rest
/// renumbered), or `None` when it uses them all.
pub(super) fn pruned(prog: &Program) -> Option<Program> {
    let mut used_b = vec![false; prog.backends.len()];
    let mut used_s = vec![false; prog.streams];
    // Bad inputs send on stream 0; the context comes from backend 0.
    used_s[0] = true;
    let mut out = prog.clone();
    for st in &mut out.steps {
        each_ref(&mut st.op, &mut |x| used_b[*x] = true, &mut |x| {
            used_s[*x] = true
        });
    }
    if used_b.iter().all(|u| *u) && used_s.iter().all(|u| *u) {
        return None;
    }
    if !used_b.iter().any(|u| *u) {
        used_b[0] = true;
    }
    let renumber = |used: &[bool]| -> Vec<usize> {
        let mut next = 0;
        used.iter()
            .map(|&u| {
                let k = next;
                next += u as usize;
                k
            })
            .collect()
    };
    let (mb, ms) = (renumber(&used_b), renumber(&used_s));
    out.backends = prog
        .backends
        .iter()
        .zip(&used_b)
        .filter(|(_, u)| **u)
        .map(|(b, _)| *b)
        .collect();
    out.streams = used_s.iter().filter(|u| **u).count();
    for st in &mut out.steps {
        each_ref(&mut st.op, &mut |x| *x = mb[*x], &mut |x| *x = ms[*x]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::super::program::{BackendSpec, On, Policy, Step, Ty};
    use super::*;

    #[test]
    fn pruning_drops_unused_backends_and_streams() {
        let spec = BackendSpec {
            policy: Policy::Never,
            blocking: true,
            split: false,
        };
        let p = Program {
            seed: 1,
            world: 2,
            threads: 1,
            backends: vec![spec; 3],
            streams: 3,
            steps: vec![Step {
                uid: 4,
                thread: 0,
                op: Op::AllReduceAsync {
                    b: 2,
                    n: 8,
                    ty: Ty::F16,
                    stream: 2,
                    on: On::Fresh,
                },
            }],
        };
        let q = pruned(&p).expect("b0, b1 and s1 are unused");
        assert_eq!((q.backends.len(), q.streams), (1, 2));
        assert_eq!(
            q.steps[0].op,
            Op::AllReduceAsync {
                b: 0,
                n: 8,
                ty: Ty::F16,
                stream: 1,
                on: On::Fresh
            }
        );
        assert!(pruned(&q).is_none());
    }
}
