//! The tuned path table: which all-reduce path each payload size takes on
//! this machine, eagerly and in CUDA graphs, decided from the times every
//! rank measured at set-up (`tune`) or read back from the cache
//! (`tune_cache`).
//!
//! Invariants:
//! - The decision is a pure function of the measured [`Rung`]s, which
//!   every rank holds alike (the worst time over the ranks, and a check
//!   that passed only if it passed on every rank), so every rank holds the
//!   same table and takes the same path for one call.
//! - A path wins a rung only if every rank's check passed there and its
//!   time beats NCCL's all-reduce by the margin ([`MARGIN_FRACTION`] and
//!   [`MARGIN_NS`], both) in that mode; otherwise NCCL's all-reduce takes
//!   the rung ("in doubt, NCCL").
//! - Each path has at most one range per mode, contiguous: its longest run
//!   of won rungs (the smaller sizes on a tie). The range runs from its
//!   first rung to its last; below the first rung of the ladder it
//!   extends to 0 bytes, and nowhere else past a measured rung, so a size
//!   between a won rung and a lost one takes NCCL. The fast path never
//!   appears in the graph table (captured work never takes it).
//!
//! This file holds no lock and calls no driver.

use std::fmt;

use super::path::AllReducePath;

/// How much faster than NCCL's all-reduce, as a fraction of NCCL's time,
/// a path must be at a size to take it there.
pub const MARGIN_FRACTION: f64 = 0.05;
/// How much faster than NCCL's all-reduce, in nanoseconds, a path must be
/// at a size to take it there (below this, the difference is within a
/// launch's jitter).
pub const MARGIN_NS: f64 = 300.0;

/// How an all-reduce is launched: the tuner times each mode on its own,
/// since a CUDA graph's replay costs each path differently from an eager
/// launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LaunchMode {
    /// Enqueued by the call, in stream order.
    Eager,
    /// Captured into a CUDA graph and replayed.
    Graph,
}

impl LaunchMode {
    /// Both modes, in the table's order.
    pub const ALL: [LaunchMode; 2] = [LaunchMode::Eager, LaunchMode::Graph];

    pub(super) fn index(self) -> usize {
        match self {
            LaunchMode::Eager => 0,
            LaunchMode::Graph => 1,
        }
    }
}

impl fmt::Display for LaunchMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LaunchMode::Eager => "eager",
            LaunchMode::Graph => "graph",
        })
    }
}

/// The paths the tuner times, in the order of a [`Rung`]'s times.
pub const TIMED_PATHS: [AllReducePath; 3] = [
    AllReducePath::Nccl,
    AllReducePath::OneShot,
    AllReducePath::FastPath,
];

/// The index of `path` in [`TIMED_PATHS`].
pub(super) fn path_index(path: AllReducePath) -> usize {
    match path {
        AllReducePath::Nccl => 0,
        AllReducePath::OneShot => 1,
        AllReducePath::FastPath => 2,
    }
}

/// What was measured at one size of the ladder, for one mode: the worst
/// median time over the ranks per path (`None`: not a candidate there),
/// and whether every rank's check of the path passed at that size.
#[derive(Debug, Clone, PartialEq)]
pub struct Rung {
    /// The payload size, in bytes (bf16 elements, 2 bytes each).
    pub bytes: usize,
    /// Nanoseconds per call, by path in [`TIMED_PATHS`] order: the largest
    /// of the ranks' medians.
    pub ns: [Option<f64>; 3],
    /// Whether every rank's check of the path's result passed, by path
    /// (NCCL's own all-reduce is the reference and is never checked).
    pub checked: [bool; 3],
}

impl Rung {
    /// The time of `path` here, if it was timed.
    pub fn time_ns(&self, path: AllReducePath) -> Option<f64> {
        self.ns[path_index(path)]
    }

    /// The path this rung is won by: the fastest checked path that beats
    /// NCCL's all-reduce by the margin, else NCCL's.
    pub fn winner(&self) -> AllReducePath {
        let Some(nccl) = self.time_ns(AllReducePath::Nccl) else {
            return AllReducePath::Nccl;
        };
        let bar = (nccl * (1.0 - MARGIN_FRACTION)).min(nccl - MARGIN_NS);
        TIMED_PATHS[1..]
            .iter()
            .filter(|&&p| self.checked[path_index(p)])
            .filter_map(|&p| self.time_ns(p).map(|t| (p, t)))
            .filter(|&(_, t)| t.is_finite() && t <= bar)
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(AllReducePath::Nccl, |(p, _)| p)
    }
}

/// A range of payload sizes one path takes, in one mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathRange {
    /// The path.
    pub path: AllReducePath,
    /// The smallest payload, in bytes, that takes it.
    pub min_bytes: usize,
    /// The largest payload, in bytes, that takes it.
    pub max_bytes: usize,
}

impl PathRange {
    /// Whether `bytes` lies in the range.
    pub fn contains(&self, bytes: usize) -> bool {
        (self.min_bytes..=self.max_bytes).contains(&bytes)
    }
}

/// The tuned choice of all-reduce path by size, per launch mode, with the
/// times it was decided from: what [`crate::NcclBackend::path_table`]
/// returns. Sizes outside every range take NCCL's all-reduce.
#[derive(Debug, Clone, PartialEq)]
pub struct PathTable {
    /// The measured ladder, per mode ([`LaunchMode::ALL`] order).
    rungs: [Vec<Rung>; 2],
    /// The ranges, per mode, decided from `rungs`.
    ranges: [Vec<PathRange>; 2],
    /// Whether the table came from the cache rather than from timing now.
    from_cache: bool,
}

impl PathTable {
    /// Decides the table from the ladder measured in each mode.
    pub fn decide(eager: Vec<Rung>, graph: Vec<Rung>, from_cache: bool) -> PathTable {
        let ranges = [ranges_of(&eager), ranges_of(&graph)];
        PathTable {
            rungs: [eager, graph],
            ranges,
            from_cache,
        }
    }

    /// The ranges that take a path other than NCCL's in `mode`.
    pub fn ranges(&self, mode: LaunchMode) -> &[PathRange] {
        &self.ranges[mode.index()]
    }

    /// The ladder measured in `mode`.
    pub fn rungs(&self, mode: LaunchMode) -> &[Rung] {
        &self.rungs[mode.index()]
    }

    /// Whether the table was read from the cache (the timing was skipped).
    pub fn from_cache(&self) -> bool {
        self.from_cache
    }

    /// The path a payload of `bytes` takes in `mode` by this table.
    pub fn path(&self, mode: LaunchMode, bytes: usize) -> AllReducePath {
        self.ranges(mode)
            .iter()
            .find(|r| r.contains(bytes))
            .map_or(AllReducePath::Nccl, |r| r.path)
    }
}

impl fmt::Display for PathTable {
    /// The table in nccl-tests-like columns: size, then each path's time
    /// per call in microseconds, then the path taken, per mode.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let us = |t: Option<f64>| t.map_or_else(|| "-".to_string(), |t| format!("{:.2}", t / 1e3));
        for mode in LaunchMode::ALL {
            writeln!(
                f,
                "# {mode}{}",
                if self.from_cache { " (cached)" } else { "" }
            )?;
            writeln!(
                f,
                "{:>12} {:>10} {:>12} {:>12} {:>12}  path",
                "size(B)", "count", "nccl(us)", "one-shot(us)", "fast(us)"
            )?;
            for rung in self.rungs(mode) {
                let mark = |p: AllReducePath| {
                    if rung.time_ns(p).is_some()
                        && !rung.checked[path_index(p)]
                        && p != AllReducePath::Nccl
                    {
                        "!"
                    } else {
                        ""
                    }
                };
                writeln!(
                    f,
                    "{:>12} {:>10} {:>12} {:>11}{:1} {:>11}{:1}  {:?}",
                    rung.bytes,
                    rung.bytes / 2,
                    us(rung.time_ns(AllReducePath::Nccl)),
                    us(rung.time_ns(AllReducePath::OneShot)),
                    mark(AllReducePath::OneShot),
                    us(rung.time_ns(AllReducePath::FastPath)),
                    mark(AllReducePath::FastPath),
                    self.path(mode, rung.bytes),
                )?;
            }
        }
        Ok(())
    }
}

/// The ranges decided from one mode's ladder: each path's longest run of
/// won rungs.
fn ranges_of(rungs: &[Rung]) -> Vec<PathRange> {
    let winners: Vec<AllReducePath> = rungs.iter().map(Rung::winner).collect();
    let mut out = Vec::new();
    for path in &TIMED_PATHS[1..] {
        let mut best: Option<(usize, usize)> = None;
        let mut i = 0;
        while i < winners.len() {
            if winners[i] != *path {
                i += 1;
                continue;
            }
            let start = i;
            while i < winners.len() && winners[i] == *path {
                i += 1;
            }
            if best.is_none_or(|(s, e)| i - start > e - s) {
                best = Some((start, i));
            }
        }
        if let Some((s, e)) = best {
            out.push(PathRange {
                path: *path,
                min_bytes: if s == 0 { 0 } else { rungs[s].bytes },
                max_bytes: rungs[e - 1].bytes,
            });
        }
    }
    out.sort_by_key(|r| r.min_bytes);
    out
}

/// The sizes the tuner measures up to `max_bytes`: 8 bytes, then x4, and
/// `max_bytes` itself when the steps pass it by.
pub(super) fn ladder(max_bytes: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = 8usize;
    while s <= max_bytes {
        out.push(s);
        s = s.saturating_mul(4);
    }
    if max_bytes >= 8 && out.last() != Some(&max_bytes) {
        out.push(max_bytes);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use AllReducePath::{FastPath, Nccl, OneShot};

    fn rung(bytes: usize, nccl: f64, one: Option<f64>, fast: Option<f64>) -> Rung {
        Rung {
            bytes,
            ns: [Some(nccl), one, fast],
            checked: [true, one.is_some(), fast.is_some()],
        }
    }

    #[test]
    fn the_ladder_steps_by_four_and_ends_at_the_largest() {
        assert_eq!(ladder(1 << 20).first(), Some(&8));
        assert_eq!(ladder(1 << 20).last(), Some(&(1 << 20)));
        assert_eq!(ladder(512), vec![8, 32, 128, 512]);
        assert_eq!(ladder(1000), vec![8, 32, 128, 512, 1000]);
        assert!(ladder(4).is_empty());
    }

    #[test]
    fn a_path_wins_only_by_the_margin_in_both_terms() {
        // 5 % of 100 us is 5 us: 95.1 us is not enough.
        assert_eq!(rung(8, 100_000.0, Some(95_100.0), None).winner(), Nccl);
        assert_eq!(rung(8, 100_000.0, Some(94_900.0), None).winner(), OneShot);
        // 0.3 us dominates at 4 us: 3.75 us (6 % faster) is not enough.
        assert_eq!(rung(8, 4_000.0, Some(3_750.0), None).winner(), Nccl);
        assert_eq!(rung(8, 4_000.0, Some(3_650.0), None).winner(), OneShot);
        // The fastest of the paths that clear the bar.
        assert_eq!(
            rung(8, 10_000.0, Some(8_000.0), Some(7_000.0)).winner(),
            FastPath
        );
        // A failed check never wins, however fast.
        let mut r = rung(8, 10_000.0, Some(1_000.0), None);
        r.checked[1] = false;
        assert_eq!(r.winner(), Nccl);
        // A path that was not timed never wins; a NaN never wins.
        assert_eq!(rung(8, 10_000.0, None, None).winner(), Nccl);
        assert_eq!(rung(8, 10_000.0, Some(f64::NAN), None).winner(), Nccl);
    }

    #[test]
    fn ranges_are_the_longest_contiguous_runs() {
        let rungs = vec![
            rung(8, 10e3, Some(4e3), Some(20e3)),
            rung(32, 10e3, Some(4e3), Some(20e3)),
            rung(128, 10e3, Some(4e3), Some(20e3)),
            rung(512, 10e3, Some(12e3), Some(20e3)),
            rung(2048, 10e3, Some(4e3), Some(20e3)), // a lone win: not taken
            rung(8192, 10e3, None, Some(5e3)),
            rung(32768, 10e3, None, Some(5e3)),
            rung(131072, 10e3, None, Some(11e3)),
        ];
        let t = PathTable::decide(rungs, Vec::new(), false);
        assert_eq!(
            t.ranges(LaunchMode::Eager),
            &[
                PathRange {
                    path: OneShot,
                    min_bytes: 0,
                    max_bytes: 128
                },
                PathRange {
                    path: FastPath,
                    min_bytes: 8192,
                    max_bytes: 32768
                }
            ]
        );
        assert_eq!(t.path(LaunchMode::Eager, 2), OneShot);
        assert_eq!(t.path(LaunchMode::Eager, 128), OneShot);
        assert_eq!(
            t.path(LaunchMode::Eager, 130),
            Nccl,
            "between a win and a loss"
        );
        assert_eq!(t.path(LaunchMode::Eager, 2048), Nccl);
        assert_eq!(t.path(LaunchMode::Eager, 8000), Nccl);
        assert_eq!(t.path(LaunchMode::Eager, 20000), FastPath);
        assert_eq!(t.path(LaunchMode::Eager, 32770), Nccl);
        assert_eq!(t.path(LaunchMode::Graph, 8), Nccl, "no graph ladder");
        let shown = t.to_string();
        assert!(
            shown.contains("# eager") && shown.contains("OneShot"),
            "{shown}"
        );
    }
}
