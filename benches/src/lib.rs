//! Shared pieces of the metrale-comm benchmarks: the size series, the
//! nccl-tests bandwidth formulas, trial statistics, the crossover analysis of
//! the 2-rank all-reduce paths, and the markdown tables.
//!
//! Everything here is plain arithmetic on host numbers, so it is unit tested
//! on any machine; `src/bin/gpu-bench.rs` does the GPU work and
//! `benches/cpu.rs` the criterion benchmarks.
//!
//! Invariants: times are microseconds per operation; bandwidths are GB/s
//! with 1 GB = 1e9 bytes, as in nccl-tests; a [`Sample`] always holds at
//! least one trial.

use std::fmt::Write as _;

/// A collective, for choosing its bus-bandwidth factor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// In-place all-reduce.
    AllReduce,
    /// All-gather; the size counts the whole gathered array.
    AllGather,
    /// Reduce-scatter; the size counts the whole input array.
    ReduceScatter,
    /// Broadcast from one root.
    Broadcast,
    /// Grouped send and receive of the size in each direction.
    SendRecv,
}

impl Collective {
    /// nccl-tests' bus-bandwidth factor for `ranks` ranks.
    pub fn bus_factor(self, ranks: usize) -> f64 {
        let n = ranks.max(1) as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather | Collective::ReduceScatter => (n - 1.0) / n,
            Collective::Broadcast | Collective::SendRecv => 1.0,
        }
    }

    /// The name used in tables.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::Broadcast => "broadcast",
            Collective::SendRecv => "send_recv",
        }
    }
}

/// Algorithm bandwidth in GB/s: `bytes / time`.
pub fn algbw_gbs(bytes: usize, us: f64) -> f64 {
    if us <= 0.0 {
        return 0.0;
    }
    bytes as f64 / (us * 1e-6) / 1e9
}

/// Bus bandwidth in GB/s: algbw times the collective's factor.
pub fn busbw_gbs(op: Collective, ranks: usize, bytes: usize, us: f64) -> f64 {
    algbw_gbs(bytes, us) * op.bus_factor(ranks)
}

/// Sizes from `min` to `max` bytes, each `factor` times the last, with `max`
/// itself always last (so 8 B..1 GiB by 4 ends 128 MiB, 512 MiB, 1 GiB).
pub fn size_series(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let factor = factor.max(2);
    let mut out = Vec::new();
    let mut s = min.max(1);
    while s < max {
        out.push(s);
        match s.checked_mul(factor) {
            Some(n) => s = n,
            None => break,
        }
    }
    out.push(max.max(min.max(1)));
    out.dedup();
    out
}

/// Per-operation times of several trials of one measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    trials_us: Vec<f64>,
}

impl Sample {
    /// A sample of the given per-operation trial times; `None` when empty or
    /// when a time is not a finite non-negative number.
    pub fn new(mut trials_us: Vec<f64>) -> Option<Sample> {
        if trials_us.is_empty() || trials_us.iter().any(|t| !t.is_finite() || *t < 0.0) {
            return None;
        }
        trials_us.sort_by(f64::total_cmp);
        Some(Sample { trials_us })
    }

    /// The median trial.
    pub fn median(&self) -> f64 {
        let v = &self.trials_us;
        let m = v.len() / 2;
        if v.len() % 2 == 1 {
            v[m]
        } else {
            (v[m - 1] + v[m]) / 2.0
        }
    }

    /// The fastest trial.
    pub fn min(&self) -> f64 {
        self.trials_us[0]
    }

    /// The slowest trial.
    pub fn max(&self) -> f64 {
        self.trials_us[self.trials_us.len() - 1]
    }

    /// The spread of the trials relative to the median, `(max - min) /
    /// median`: the noise of this measurement.
    pub fn noise(&self) -> f64 {
        let m = self.median();
        if m <= 0.0 {
            0.0
        } else {
            (self.max() - self.min()) / m
        }
    }
}

/// One size of the all-reduce path comparison.
#[derive(Debug, Clone)]
pub struct PathPoint {
    /// Payload bytes.
    pub bytes: usize,
    /// NCCL's all-reduce (straight through nccl-safe).
    pub nccl: Sample,
    /// The fast path: grouped send/recv plus the bf16 add.
    pub fast: Sample,
}

impl PathPoint {
    /// NCCL time over fast-path time (above 1: the fast path is faster).
    pub fn speedup(&self) -> f64 {
        self.nccl.median() / self.fast.median()
    }

    /// True when the fast path beats NCCL by more than the noise of the two
    /// measurements (the larger of their relative spreads).
    pub fn fast_wins(&self) -> bool {
        let noise = self.nccl.noise().max(self.fast.noise());
        self.speedup() - 1.0 > noise
    }
}

/// The crossover of a sweep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crossover {
    /// Every size where the fast path wins beyond the noise.
    pub winning_sizes: Vec<usize>,
    /// The longest run of consecutive winning sizes, as `(min, max)` bytes;
    /// `None` when the fast path never wins.
    pub range: Option<(usize, usize)>,
}

impl Crossover {
    /// Analyses points sorted by size.
    pub fn from_points(points: &[PathPoint]) -> Crossover {
        let winning_sizes = points
            .iter()
            .filter(|p| p.fast_wins())
            .map(|p| p.bytes)
            .collect();
        let mut best: Option<(usize, usize, usize)> = None;
        let mut run: Option<(usize, usize, usize)> = None;
        for p in points {
            if p.fast_wins() {
                run = Some(match run {
                    Some((lo, _, n)) => (lo, p.bytes, n + 1),
                    None => (p.bytes, p.bytes, 1),
                });
                if let Some(r) = run
                    && best.is_none_or(|b| r.2 > b.2)
                {
                    best = Some(r);
                }
            } else {
                run = None;
            }
        }
        Crossover {
            winning_sizes,
            range: best.map(|(lo, hi, _)| (lo, hi)),
        }
    }

    /// The `METRALE_COMM_FAST_PATH` value this crossover recommends.
    pub fn policy_string(&self) -> String {
        match self.range {
            Some((lo, hi)) => format!("{}-{}", policy_bytes(lo), policy_bytes(hi)),
            None => "never".to_owned(),
        }
    }
}

/// A byte count as `FastPathPolicy::parse` reads it (`K`, `M`, `G` suffixes
/// when exact).
pub fn policy_bytes(b: usize) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", b >> shift);
        }
    }
    b.to_string()
}

/// A byte count for tables: `8 B`, `32 KiB`, `1 GiB`.
pub fn human_bytes(b: usize) -> String {
    for (shift, suffix) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{} {suffix}", b >> shift);
        }
    }
    format!("{b} B")
}

/// One row of the side-by-side table: an operation at one size, ours next to
/// raw NCCL in the same run.
#[derive(Debug, Clone)]
pub struct OpRow {
    /// The collective.
    pub op: Collective,
    /// `eager` or `graph`.
    pub mode: &'static str,
    /// Size in nccl-tests' convention.
    pub bytes: usize,
    /// Straight through nccl-safe.
    pub raw: Sample,
    /// Through the `CommBackend`.
    pub ours: Sample,
}

/// The side-by-side markdown table.
pub fn ops_table(rows: &[OpRow], ranks: usize) -> String {
    let mut s = String::new();
    s.push_str(
        "| op | mode | bytes | NCCL µs | ours µs | ours - NCCL µs | NCCL busbw GB/s | ours busbw GB/s | busbw ratio | noise % |\n",
    );
    s.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in rows {
        let (t_raw, t_ours) = (r.raw.median(), r.ours.median());
        let (b_raw, b_ours) = (
            busbw_gbs(r.op, ranks, r.bytes, t_raw),
            busbw_gbs(r.op, ranks, r.bytes, t_ours),
        );
        let ratio = if b_raw > 0.0 { b_ours / b_raw } else { 0.0 };
        let noise = 100.0 * r.raw.noise().max(r.ours.noise());
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.2} | {:.2} | {:+.2} | {:.2} | {:.2} | {:.3} | {:.1} |",
            r.op.name(),
            r.mode,
            human_bytes(r.bytes),
            t_raw,
            t_ours,
            t_ours - t_raw,
            b_raw,
            b_ours,
            ratio,
            noise
        );
    }
    s
}

/// One size of the all-reduce path table.
#[derive(Debug, Clone)]
pub struct PathRow {
    /// `eager` or `graph`.
    pub mode: &'static str,
    /// The two paths, raw NCCL and the fast path.
    pub point: PathPoint,
    /// The backend's automatic choice (default policy).
    pub auto: Sample,
    /// Which path the automatic choice took.
    pub auto_path: &'static str,
    /// The one-shot path over peer memory (`OneShotPolicy::Always`), when
    /// its set-up proved peer access.
    pub one_shot: Option<Sample>,
}

/// The all-reduce path table.
pub fn paths_table(rows: &[PathRow], ranks: usize) -> String {
    let mut s = String::new();
    s.push_str(
        "| mode | bytes | NCCL µs | fast path µs | one-shot µs | auto µs | auto took | fast/NCCL speedup | one-shot/NCCL speedup | auto vs best | auto busbw GB/s | noise % |\n",
    );
    s.push_str("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|\n");
    for r in rows {
        let p = &r.point;
        let one = r.one_shot.as_ref().map(Sample::median);
        let best = p
            .nccl
            .median()
            .min(p.fast.median())
            .min(one.unwrap_or(f64::INFINITY));
        let auto = r.auto.median();
        let noise = 100.0
            * p.nccl
                .noise()
                .max(p.fast.noise())
                .max(r.auto.noise())
                .max(r.one_shot.as_ref().map_or(0.0, Sample::noise));
        let one_point = r.one_shot.clone().map(|fast| PathPoint {
            bytes: p.bytes,
            nccl: p.nccl.clone(),
            fast,
        });
        let _ = writeln!(
            s,
            "| {} | {} | {:.2} | {:.2} | {} | {:.2} | {} | {:.3}{} | {} | {:+.1}% | {:.2} | {:.1} |",
            r.mode,
            human_bytes(p.bytes),
            p.nccl.median(),
            p.fast.median(),
            one.map_or("-".to_owned(), |t| format!("{t:.2}")),
            auto,
            r.auto_path,
            p.speedup(),
            if p.fast_wins() { " (wins)" } else { "" },
            one_point.map_or("-".to_owned(), |o| format!(
                "{:.3}{}",
                o.speedup(),
                if o.fast_wins() { " (wins)" } else { "" }
            )),
            100.0 * (auto / best - 1.0),
            busbw_gbs(Collective::AllReduce, ranks, p.bytes, auto),
            noise
        );
    }
    s
}

/// The `--crossover` summary of the one-shot path for one mode: `points`
/// hold the one-shot times in `fast`. Its recommendation is a
/// `METRALE_COMM_ONE_SHOT` value.
pub fn one_shot_crossover_summary(mode: &str, points: &[PathPoint]) -> String {
    let c = Crossover::from_points(points);
    let sizes: Vec<String> = c.winning_sizes.iter().map(|b| human_bytes(*b)).collect();
    format!(
        "- {mode}: the one-shot path beats NCCL beyond the noise at {}\n  recommended: \
         `METRALE_COMM_ONE_SHOT={}`\n",
        if sizes.is_empty() {
            "no size".to_owned()
        } else {
            sizes.join(", ")
        },
        c.policy_string()
    )
}

/// The `--crossover` summary for one mode.
pub fn crossover_summary(mode: &str, points: &[PathPoint]) -> String {
    let c = Crossover::from_points(points);
    let sizes: Vec<String> = c.winning_sizes.iter().map(|b| human_bytes(*b)).collect();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "- {mode}: the fast path beats NCCL beyond the noise at {}",
        if sizes.is_empty() {
            "no size".to_owned()
        } else {
            sizes.join(", ")
        }
    );
    let _ = writeln!(
        s,
        "  recommended: `METRALE_COMM_FAST_PATH={}`{}",
        c.policy_string(),
        match c.range {
            Some((lo, hi)) =>
                format!(" (FastPathPolicy::Range {{ min_bytes: {lo}, max_bytes: {hi} }})"),
            None => " (FastPathPolicy::Never)".to_owned(),
        }
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(v: &[f64]) -> Sample {
        Sample::new(v.to_vec()).unwrap()
    }

    #[test]
    fn formulas_match_nccl_tests() {
        // 1 GiB in 3280 µs: 327.4 GB/s algbw; all-reduce on 2 ranks busbw = algbw.
        let alg = algbw_gbs(1 << 30, 3280.0);
        assert!((alg - 327.36).abs() < 0.01, "{alg}");
        assert!((busbw_gbs(Collective::AllReduce, 2, 1 << 30, 3280.0) - alg).abs() < 1e-9);
        // 8 ranks: all-reduce 2*7/8, all-gather 7/8, broadcast and send/recv 1.
        assert!((Collective::AllReduce.bus_factor(8) - 1.75).abs() < 1e-12);
        assert!((Collective::AllGather.bus_factor(8) - 0.875).abs() < 1e-12);
        assert!((Collective::ReduceScatter.bus_factor(4) - 0.75).abs() < 1e-12);
        assert_eq!(Collective::Broadcast.bus_factor(8), 1.0);
        assert_eq!(Collective::SendRecv.bus_factor(2), 1.0);
        assert_eq!(algbw_gbs(100, 0.0), 0.0);
    }

    #[test]
    fn size_series_covers_the_range_and_ends_at_max() {
        let s = size_series(8, 1 << 30, 4);
        assert_eq!(s[0], 8);
        assert_eq!(s[1], 32);
        assert_eq!(*s.last().unwrap(), 1 << 30);
        assert_eq!(s[s.len() - 2], 512 << 20);
        assert!(s.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(size_series(1 << 20, 1 << 20, 2), vec![1 << 20]);
        assert_eq!(size_series(1 << 20, 16 << 20, 2).len(), 5);
    }

    #[test]
    fn sample_statistics() {
        let s = sample(&[5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!(s.median(), 3.0);
        assert_eq!(s.min(), 1.0);
        assert_eq!(s.max(), 5.0);
        assert!((s.noise() - 4.0 / 3.0).abs() < 1e-12);
        assert_eq!(sample(&[1.0, 3.0]).median(), 2.0);
        assert!(Sample::new(vec![]).is_none());
        assert!(Sample::new(vec![1.0, f64::NAN]).is_none());
        assert!(Sample::new(vec![-1.0]).is_none());
    }

    fn point(bytes: usize, nccl: f64, fast: f64) -> PathPoint {
        PathPoint {
            bytes,
            nccl: sample(&[nccl * 0.99, nccl, nccl * 1.01]),
            fast: sample(&[fast * 0.99, fast, fast * 1.01]),
        }
    }

    #[test]
    fn crossover_takes_the_longest_winning_run_beyond_noise() {
        // Anchor-like graph numbers: send/recv + add wins from 1 to 16 MiB.
        let pts = vec![
            point(256 << 10, 9.0, 12.0),
            point(512 << 10, 10.8, 11.5),
            point(1 << 20, 18.0, 15.0),
            point(4 << 20, 33.0, 25.0),
            point(16 << 20, 80.0, 70.0),
            point(64 << 20, 250.0, 260.0),
            // A lone win beyond a loss is a shorter run.
            point(256 << 20, 900.0, 850.0),
        ];
        let c = Crossover::from_points(&pts);
        assert_eq!(c.winning_sizes, vec![1 << 20, 4 << 20, 16 << 20, 256 << 20]);
        assert_eq!(c.range, Some((1 << 20, 16 << 20)));
        assert_eq!(c.policy_string(), "1M-16M");
        // A 1% win inside 2% noise is no win.
        assert!(!point(1 << 20, 10.1, 10.0).fast_wins());
        let none = Crossover::from_points(&[point(8, 5.0, 6.0)]);
        assert_eq!(none.range, None);
        assert_eq!(none.policy_string(), "never");
    }

    #[test]
    fn policy_strings_parse_back() {
        for b in [8usize, 1000, 4 << 10, 3 << 20, 1 << 30] {
            let s = format!("{}-{}", policy_bytes(b), policy_bytes(b));
            let p = metrale_comm::FastPathPolicy::parse(&s).unwrap();
            assert_eq!(
                p,
                metrale_comm::FastPathPolicy::Range {
                    min_bytes: b,
                    max_bytes: b
                },
                "{s}"
            );
        }
        assert_eq!(human_bytes(8), "8 B");
        assert_eq!(human_bytes(32 << 10), "32 KiB");
        assert_eq!(human_bytes(1 << 30), "1 GiB");
    }

    #[test]
    fn tables_have_one_line_per_row_and_the_right_numbers() {
        let rows = vec![OpRow {
            op: Collective::AllGather,
            mode: "eager",
            bytes: 1 << 30,
            raw: sample(&[4000.0]),
            ours: sample(&[4100.0]),
        }];
        let t = ops_table(&rows, 2);
        assert_eq!(t.lines().count(), 3);
        // algbw 268.4 GB/s, all-gather busbw on 2 ranks = half.
        assert!(t.contains("| 134.22 |"), "{t}");
        assert!(t.contains("+100.00"), "{t}");
        let prow = vec![PathRow {
            mode: "graph",
            point: point(1 << 20, 20.0, 16.0),
            auto: sample(&[16.0]),
            auto_path: "fast path",
            one_shot: None,
        }];
        let t = paths_table(&prow, 2);
        assert!(t.contains("1.250 (wins)"), "{t}");
        assert!(t.contains("+0.0%"), "{t}");
        let prow = vec![PathRow {
            one_shot: Some(sample(&[8.0])),
            auto: sample(&[8.0]),
            auto_path: "one-shot",
            ..prow[0].clone()
        }];
        let t = paths_table(&prow, 2);
        assert!(t.contains("| 8.00 |") && t.contains("2.500 (wins)"), "{t}");
        let s = one_shot_crossover_summary("graph", &[point(8 << 10, 10.0, 4.0)]);
        assert!(s.contains("METRALE_COMM_ONE_SHOT=8K-8K"), "{s}");
        let s = crossover_summary("graph", &[prow[0].point.clone()]);
        assert!(s.contains("METRALE_COMM_FAST_PATH=1M-1M"), "{s}");
    }
}
