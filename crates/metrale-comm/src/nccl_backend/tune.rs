//! The path tuner: at every set-up of a communicator whose `Auto`
//! policies have a path to choose (2-8 ranks of one host with the one-shot
//! path proven, or 2 ranks with the fast path's kernel), it checks every
//! candidate path's result at each size of a ladder (8 B, x4, up to the
//! largest the path may take), times it against NCCL's all-reduce with
//! device events (eagerly, and replayed from a CUDA graph), gathers every
//! rank's figures and decides the table ([`PathTable`]) every rank then
//! holds alike; `Auto` policies consult it (`path`). The cache
//! (`tune_cache`) lets a second start skip the timing, never the checks.
//!
//! Steps, all ranks alike (so the collectives match):
//! 1. exchange every rank's key word; the world key names the cache file;
//! 2. read the file; exchange (hit, checksum): the cache is used only if
//!    every rank read a good file with the same checksum;
//! 3. check each candidate path once per rung on a known pattern, every
//!    element against the exact sum; on a miss, time NCCL's all-reduce and
//!    each candidate per rung and mode (the method of [`crate::timing`]);
//! 4. exchange the checks (and times): each rung keeps the worst time over
//!    the ranks, and a check passes only where it passed on every rank;
//! 5. decide the table; on a miss save the agreed ladder (atomically; a
//!    failed write costs the cache only).
//!
//! Invariants:
//! - Whether the tuner runs, its ladder and its candidates are functions
//!   of what every rank shares (the world size, the agreed one-shot
//!   verdict, the census's settings and hosts), and whether it times is
//!   the agreed cache verdict: every rank makes the same calls.
//! - Every wait is bounded by the set-up's deadline; a step that fails or
//!   does not complete aborts the communicator and fails the set-up, and
//!   a buffer whose work did not finish is leaked, never freed under it.
//!
//! Lock order: runs under the slot lock, as the rest of the set-up; it
//! takes no other lock of the backend.

use std::time::{Duration, Instant};

use half::bf16;
use nccl_safe::{DataType, DeviceBuffer};

use super::path_table::AllReducePath;
use super::path_table::{LaunchMode, PathTable, Rung, TIMED_PATHS, ladder, path_index};
use super::submission::{Capture, Target};
use super::tune_cache::{self, Cached, LocalKey, Miss};
use super::{Inner, Slot};
use crate::backend::Result;
use crate::config::{
    AUTO_FAST_PATH_MAX_BYTES, AUTO_ONE_SHOT_MAX_BYTES, FastPathPolicy, OneShotPolicy,
};
use crate::error::CommError;
use crate::timing::{self, Trials};
use crate::validate::Span;

/// The most rungs a ladder has (8 B x 4^k up to 8 MiB is 11; room for a
/// larger ceiling).
const MAX_RUNGS: usize = 16;
/// A time not measured, in the exchange.
const NOT_TIMED: u64 = u64::MAX;
/// Bytes of one rank's part of the results exchange: per mode, rung and
/// path, a time (8 bytes) and a check (1 byte).
const RESULT_BYTES: usize = 2 * MAX_RUNGS * 3 * 9;

/// What the tuner considers on this communicator.
struct Plan {
    /// Candidates besides NCCL's all-reduce: one-shot, fast path.
    one_shot: bool,
    fast: bool,
    /// The ladder per mode (the graph ladder only where the one-shot path
    /// is a candidate: the fast path is never captured).
    rungs: [Vec<usize>; 2],
}

impl Plan {
    fn candidates(&self, mode: LaunchMode, bytes: usize) -> Vec<AllReducePath> {
        let mut out = Vec::new();
        if self.one_shot && bytes <= AUTO_ONE_SHOT_MAX_BYTES {
            out.push(AllReducePath::OneShot);
        }
        if self.fast && mode == LaunchMode::Eager && bytes <= AUTO_FAST_PATH_MAX_BYTES {
            out.push(AllReducePath::FastPath);
        }
        out
    }
}

impl Inner {
    /// Decides the slot's path table over its (new) communicator, or
    /// leaves none where nothing is to be tuned.
    pub(super) fn tune(&self, slot: &mut Slot) -> Result<()> {
        slot.tuned = None;
        let Some(plan) = self.tune_plan(slot) else {
            return Ok(());
        };
        let started = Instant::now();
        let deadline = started + self.config.init_timeout;
        let fail = |stage: &'static str, e: nccl_safe::Error| {
            self.abort_now("path tuner");
            CommError::setup(stage, e)
        };
        // 1-2: the key, and whether every rank has the same good table.
        let local = LocalKey::of(
            self.config.device,
            self.settings_word(slot),
            self.config.enqueue,
        );
        let words = self
            .gather_words(slot, &[local.word()], deadline)
            .map_err(|e| fail("path tuner key exchange", e))?;
        let world_key = tune_cache::world_key(&words.iter().map(|w| w[0]).collect::<Vec<_>>());
        let file = tune_cache::directory(&self.config.tune_cache)
            .map(|d| tune_cache::file_of(&d, world_key));
        let cached = file
            .as_ref()
            .and_then(|f| match tune_cache::load(f, world_key) {
                Ok(c) => Some(c),
                Err(Miss::Absent) => None,
                Err(Miss::Unusable(why)) => {
                    tracing::warn!(
                        rank = self.rank,
                        file = %f.display(),
                        "path tuner: ignoring the cached table: {why}"
                    );
                    None
                }
            });
        let mine = cached.as_ref().map_or([0, 0], |c| [1, c.checksum]);
        let verdicts = self
            .gather_words(slot, &mine, deadline)
            .map_err(|e| fail("path tuner cache exchange", e))?;
        let hit = verdicts.iter().all(|v| v[0] == 1 && v[1] == mine[1]);
        if cached.is_some() && !hit {
            tracing::info!(
                rank = self.rank,
                "path tuner: the ranks' cached tables differ; timing again"
            );
        }
        // 3-4: check (and on a miss, time), then agree. A hit checks each
        // cached range's ends (the same rungs on every rank: the tables
        // agree); a miss checks every candidate at every rung.
        let recheck = cached
            .as_ref()
            .filter(|_| hit)
            .map(|c| range_ends(&PathTable::decide(c.eager.clone(), c.graph.clone(), true)));
        let measured = self
            .tune_measure(slot, &plan, recheck.as_deref(), deadline)
            .map_err(|e| fail("path tuner", e))?;
        let all = self
            .exchange_bytes(
                slot,
                &encode(self.rank, self.world_size, &measured),
                deadline,
            )
            .map_err(|e| fail("path tuner results exchange", e))?;
        let agreed = agree(&plan, &all, self.world_size);
        let table = match (hit, cached) {
            (true, Some(Cached { eager, graph, .. })) => PathTable::decide(
                with_checks(eager, &agreed[0]),
                with_checks(graph, &agreed[1]),
                true,
            ),
            _ => {
                let [eager, graph] = agreed;
                if let Some(f) = &file
                    && let Err(e) = tune_cache::save(f, world_key, &local, &eager, &graph)
                {
                    tracing::warn!(
                        rank = self.rank,
                        file = %f.display(),
                        "path tuner: the table is not cached: {e}"
                    );
                }
                PathTable::decide(eager, graph, false)
            }
        };
        self.log_table(&table, started.elapsed());
        slot.tuned = Some(table);
        Ok(())
    }

    /// What to tune, or `None`: tuning on, and an `Auto` policy with a
    /// path that can serve this communicator.
    fn tune_plan(&self, slot: &Slot) -> Option<Plan> {
        let one_shot = self.config.one_shot == OneShotPolicy::Auto && slot.one_shot.is_on();
        let fast = self.config.fast_path == FastPathPolicy::Auto
            && self.world_size == 2
            && slot.fast.has_kernel()
            && slot
                .hosts
                .as_ref()
                .is_some_and(|h| h.peer_paths_off().is_none());
        if !self.config.tune || !(one_shot || fast) {
            return None;
        }
        let top = if fast {
            AUTO_FAST_PATH_MAX_BYTES
        } else {
            AUTO_ONE_SHOT_MAX_BYTES
        };
        let graph = if one_shot {
            ladder(AUTO_ONE_SHOT_MAX_BYTES)
        } else {
            Vec::new()
        };
        Some(Plan {
            one_shot,
            fast,
            rungs: [ladder(top), graph],
        })
    }

    /// This rank's checks and, unless `recheck` names what to check (a
    /// cache hit: no timing), its times: per mode, per rung, per path.
    /// Without `recheck` every candidate is checked at every eager rung; a
    /// check not made counts as passed (a hit keeps the cached verdict).
    fn tune_measure(
        &self,
        slot: &mut Slot,
        plan: &Plan,
        recheck: Option<&[(usize, AllReducePath)]>,
        deadline: Instant,
    ) -> nccl_safe::Result<[Vec<Rung>; 2]> {
        let time = recheck.is_none();
        let mut out: [Vec<Rung>; 2] = [Vec::new(), Vec::new()];
        for mode in LaunchMode::ALL {
            for &bytes in &plan.rungs[mode.index()] {
                let candidates = plan.candidates(mode, bytes);
                let mut rung = Rung {
                    bytes,
                    ns: [None; 3],
                    checked: [true; 3],
                };
                let check: Vec<AllReducePath> = candidates
                    .iter()
                    .copied()
                    .filter(|&p| {
                        mode == LaunchMode::Eager && recheck.is_none_or(|r| r.contains(&(bytes, p)))
                    })
                    .collect();
                if check.is_empty() && !time {
                    out[mode.index()].push(rung);
                    continue;
                }
                let mut buf = DeviceBuffer::<bf16>::alloc(&self.ctx, bytes / 2)?;
                let mut measure = || -> nccl_safe::Result<()> {
                    for &path in &check {
                        rung.checked[path_index(path)] =
                            self.tune_check(slot, path, &mut buf, deadline)?;
                    }
                    if time {
                        for &path in std::iter::once(&AllReducePath::Nccl).chain(&candidates) {
                            let t = self.tune_time(slot, path, mode, &buf, deadline)?;
                            // Whole nanoseconds: what the cache keeps exactly.
                            rung.ns[path_index(path)] = Some((t.as_secs_f64() * 1e9).round());
                        }
                    }
                    Ok(())
                };
                if let Err(e) = measure() {
                    // Work on the buffer may still wait for a peer: a free
                    // would wait for the whole device, past the deadline,
                    // before the caller's abort could end it.
                    tracing::warn!(
                        rank = self.rank,
                        bytes,
                        "path tuner failed ({e}): its buffer is leaked, not freed under it"
                    );
                    std::mem::forget(buf);
                    return Err(e);
                }
                out[mode.index()].push(rung);
            }
        }
        // The graph ladder's checks are the eager ones' (the same kernel;
        // the set-up probe ran the graph lane).
        let eager = out[0].clone();
        for r in &mut out[1] {
            if let Some(e) = eager.iter().find(|e| e.bytes == r.bytes) {
                r.checked = e.checked;
            }
        }
        Ok(out)
    }

    /// Runs `path` once on a known pattern in `buf` and checks every
    /// element against the exact sum over the ranks.
    fn tune_check(
        &self,
        slot: &mut Slot,
        path: AllReducePath,
        buf: &mut DeviceBuffer<bf16>,
        deadline: Instant,
    ) -> nccl_safe::Result<bool> {
        let n = buf.len();
        let salt = path_index(path) + n;
        buf.copy_from_host(&pattern(self.rank, n, salt))?;
        let target = Target {
            stream: slot.stream.raw(),
            capture: Capture::Eager,
        };
        self.enqueue_on(slot, path, span_of(buf), target)?;
        slot.stream
            .wait_until_idle(deadline.saturating_duration_since(Instant::now()))?;
        let got = buf.to_host_vec()?;
        // The inputs repeat every PERIOD elements, and so does the sum.
        let want: Vec<u16> = (0..PERIOD)
            .map(|i| {
                let sum = (0..self.world_size).map(|r| value(r, i, salt)).sum::<f32>();
                bf16::from_f32(sum).to_bits()
            })
            .collect();
        let bad = got
            .iter()
            .zip(want.iter().cycle())
            .position(|(g, w)| g.to_bits() != *w);
        if let Some(i) = bad {
            tracing::warn!(
                rank = self.rank,
                bytes = n * 2,
                "path tuner: {path:?} gave element {i} = {}, expected {}; the path is \
                 not taken at this size",
                got[i],
                bf16::from_bits(want[i % PERIOD])
            );
        }
        Ok(bad.is_none())
    }

    /// The device time per call of `path` on `buf` in `mode`.
    fn tune_time(
        &self,
        slot: &mut Slot,
        path: AllReducePath,
        mode: LaunchMode,
        buf: &DeviceBuffer<bf16>,
        deadline: Instant,
    ) -> nccl_safe::Result<Duration> {
        let trials = self
            .config
            .tune_trials
            .unwrap_or_else(|| Trials::for_bytes(buf.len() * 2));
        let left = || deadline.saturating_duration_since(Instant::now());
        let span = span_of(buf);
        let stream = slot.stream.raw();
        let ctx = self.ctx.clone();
        // SAFETY: the slot's own stream, which lives as long as the backend
        // and so outlives this measurement.
        let own = unsafe { nccl_safe::Stream::borrowed(&ctx, stream) };
        match mode {
            LaunchMode::Eager => timing::time_per_call(&ctx, &[&own], trials, left(), || {
                let target = Target {
                    stream,
                    capture: Capture::Eager,
                };
                for _ in 0..trials.calls {
                    self.enqueue_on(slot, path, span, target)?;
                }
                Ok(())
            }),
            LaunchMode::Graph => {
                slot.stream.begin_capture()?;
                let target = Target {
                    stream,
                    capture: Capture::Graph,
                };
                let captured: nccl_safe::Result<()> =
                    (0..trials.calls).try_for_each(|_| self.enqueue_on(slot, path, span, target));
                // The capture ends whatever happened, so the stream is
                // usable again.
                let graph = slot.stream.end_capture();
                captured?;
                let exec = graph?.instantiate()?;
                timing::time_per_call(&ctx, &[&own], trials, left(), || exec.launch(&own))
            }
        }
    }

    /// The census's settings word of this rank.
    fn settings_word(&self, slot: &Slot) -> u64 {
        super::hosts::settings_word(&self.settings(slot))
    }

    fn log_table(&self, table: &PathTable, took: Duration) {
        for mode in LaunchMode::ALL {
            for r in table.ranges(mode) {
                let rungs = table.rungs(mode);
                let at = |b: usize, p: AllReducePath| {
                    rungs
                        .iter()
                        .find(|x| x.bytes == b)
                        .and_then(|x| x.time_ns(p))
                        .map_or(f64::NAN, |t| t / 1e3)
                };
                tracing::info!(
                    rank = self.rank,
                    world_size = self.world_size,
                    "all-reduce path ({mode}): {:?} for {}..={} bytes ({:.2} us against \
                     NCCL's {:.2} us at {} bytes)",
                    r.path,
                    r.min_bytes,
                    r.max_bytes,
                    at(r.max_bytes, r.path),
                    at(r.max_bytes, AllReducePath::Nccl),
                    r.max_bytes
                );
            }
            if table.ranges(mode).is_empty() && !table.rungs(mode).is_empty() {
                tracing::info!(
                    rank = self.rank,
                    "all-reduce path ({mode}): NCCL's at every size (no path beat it by the \
                     margin)"
                );
            }
        }
        tracing::info!(
            rank = self.rank,
            world_size = self.world_size,
            cached = table.from_cache(),
            took_ms = took.as_secs_f64() * 1e3,
            "path tuner done{}",
            if table.from_cache() {
                " (timing skipped: the cached table of this machine and job)"
            } else {
                ""
            }
        );
    }
}

/// The rungs at the ends of every range of `table` (either mode), with
/// their path: what a cache hit checks again.
fn range_ends(table: &PathTable) -> Vec<(usize, AllReducePath)> {
    let mut out = Vec::new();
    for mode in LaunchMode::ALL {
        let rungs = table.rungs(mode);
        for r in table.ranges(mode) {
            if let Some(first) = rungs.iter().find(|x| x.bytes >= r.min_bytes.max(1)) {
                out.push((first.bytes, r.path));
            }
            out.push((r.max_bytes, r.path));
        }
    }
    out.sort_unstable_by_key(|&(b, p)| (b, path_index(p)));
    out.dedup();
    out
}

/// The span of a whole bf16 buffer.
fn span_of(buf: &DeviceBuffer<bf16>) -> Span {
    Span {
        ptr: buf.device_ptr(),
        len: buf.len(),
        dtype: DataType::Bfloat16,
    }
}

/// The period of the check inputs, in elements.
const PERIOD: usize = 15;

/// Rank `rank`'s check input at element `i`: small integers, so that every
/// sum over up to 8 ranks is exact in bf16 (the same in every path's
/// arithmetic), repeating every [`PERIOD`] elements.
fn value(rank: usize, i: usize, salt: usize) -> f32 {
    ((i * 7 + rank * 3 + salt) % PERIOD) as f32 - 7.0
}

fn pattern(rank: usize, n: usize, salt: usize) -> Vec<bf16> {
    let period: Vec<bf16> = (0..PERIOD)
        .map(|i| bf16::from_f32(value(rank, i, salt)))
        .collect();
    period.iter().copied().cycle().take(n).collect()
}

/// This rank's part of the results exchange.
fn encode(rank: usize, world: usize, measured: &[Vec<Rung>; 2]) -> Vec<u8> {
    let mut out = vec![0u8; RESULT_BYTES * world];
    let part = &mut out[rank * RESULT_BYTES..][..RESULT_BYTES];
    for (m, rungs) in measured.iter().enumerate() {
        for (i, r) in rungs.iter().enumerate().take(MAX_RUNGS) {
            for p in 0..3 {
                let at = ((m * MAX_RUNGS + i) * 3 + p) * 9;
                let bits = r.ns[p].map_or(NOT_TIMED, f64::to_bits);
                part[at..at + 8].copy_from_slice(&bits.to_le_bytes());
                part[at + 8] = u8::from(r.checked[p]);
            }
        }
    }
    out
}

/// The agreed ladder from every rank's part: per rung and path, the worst
/// time (none if a rank did not time it) and a check that passed on every
/// rank.
fn agree(plan: &Plan, all: &[u8], world: usize) -> [Vec<Rung>; 2] {
    let mut out: [Vec<Rung>; 2] = [Vec::new(), Vec::new()];
    for mode in LaunchMode::ALL {
        let m = mode.index();
        for (i, &bytes) in plan.rungs[m].iter().enumerate().take(MAX_RUNGS) {
            let mut rung = Rung {
                bytes,
                ns: [None; 3],
                checked: [true; 3],
            };
            for p in 0..TIMED_PATHS.len() {
                let mut worst: Option<f64> = Some(0.0);
                for r in 0..world {
                    let at = r * RESULT_BYTES + ((m * MAX_RUNGS + i) * 3 + p) * 9;
                    let bits = u64::from_le_bytes(all[at..at + 8].try_into().expect("8 bytes"));
                    worst = match (worst, bits) {
                        (_, NOT_TIMED) | (None, _) => None,
                        (Some(w), b) => Some(w.max(f64::from_bits(b))),
                    };
                    rung.checked[p] &= all[at + 8] == 1;
                }
                rung.ns[p] = worst;
            }
            out[m].push(rung);
        }
    }
    out
}

/// A cached ladder with today's agreed checks: a path whose check failed
/// now is not taken, whatever the cache says.
fn with_checks(cached: Vec<Rung>, now: &[Rung]) -> Vec<Rung> {
    cached
        .into_iter()
        .map(|mut r| {
            let today = now.iter().find(|n| n.bytes == r.bytes);
            for p in 0..3 {
                r.checked[p] &= today.is_some_and(|n| n.checked[p]);
            }
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exchange_keeps_the_worst_time_and_every_ranks_check() {
        let plan = Plan {
            one_shot: true,
            fast: false,
            rungs: [vec![8, 32], vec![]],
        };
        let rank = |nccl: f64, one: f64, ok: bool| {
            [
                vec![
                    Rung {
                        bytes: 8,
                        ns: [Some(nccl), Some(one), None],
                        checked: [true, ok, false],
                    },
                    Rung {
                        bytes: 32,
                        ns: [Some(nccl), Some(one), None],
                        checked: [true, true, false],
                    },
                ],
                vec![],
            ]
        };
        let a = encode(0, 2, &rank(10.0, 3.0, true));
        let b = encode(1, 2, &rank(12.0, 2.0, false));
        let sum: Vec<u8> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let [eager, graph] = agree(&plan, &sum, 2);
        assert!(graph.is_empty());
        assert_eq!(eager[0].ns, [Some(12.0), Some(3.0), None]);
        assert_eq!(eager[0].checked, [true, false, false]);
        assert_eq!(eager[1].checked, [true, true, false]);
    }

    #[test]
    fn check_patterns_sum_exactly_in_bf16() {
        for i in 0..64 {
            let s: f32 = (0..8).map(|r| value(r, i, 3)).sum();
            assert_eq!(bf16::from_f32(s).to_f32(), s);
        }
    }

    #[test]
    fn the_largest_ladder_fits_the_exchange() {
        assert!(ladder(AUTO_FAST_PATH_MAX_BYTES).len() <= MAX_RUNGS);
    }
}
