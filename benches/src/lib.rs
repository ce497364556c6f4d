//! The metrale-comm benchmarks: the criterion harness of the collectives
//! ([`collectives`], run by `benches/collectives.rs`), the table generator
//! that reads criterion's estimates ([`tables`], the `bench-tables` binary)
//! and the run's plots ([`plots`], SVG beside the tables), and the pieces they share with `gpu-bench` (host time per call) and the
//! CPU benchmarks: the size series, the nccl-tests bandwidth formulas, trial
//! statistics and the crossover analysis of the 2-rank all-reduce paths.
//!
//! The arithmetic here is plain host numbers, so it is unit tested on any
//! machine; the GPU work lives in [`collectives`] and `src/bin/gpu-bench.rs`.
//!
//! Invariants: times are microseconds per operation; bandwidths are GB/s
//! with 1 GB = 1e9 bytes, as in nccl-tests; a [`Sample`] always holds at
//! least one trial; a [`Timing`] is finite and non-negative.

pub mod collectives;
pub mod plots;
pub mod tables;

/// The PTX in the file named by the variable `var`, else `committed` (the
/// PTX built into the binary): how the one-GPU kernel benches
/// (`one_shot_local`, `norm_local`) time kernels compiled with `cargo xtask
/// ptx` against the committed ones on a box without Rust. `bench` names
/// the bench in the line that says which file was loaded.
///
/// # Panics
///
/// When the variable names a file that cannot be read (a bench's set-up
/// fails loudly rather than time the wrong kernels).
pub fn ptx_or(bench: &str, var: &str, committed: &str) -> String {
    match std::env::var_os(var) {
        Some(path) => {
            println!(
                "{bench}: {var}: the kernels from {}",
                path.to_string_lossy()
            );
            std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{var} names {}: {e}", path.to_string_lossy()))
        }
        None => committed.to_owned(),
    }
}

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
    /// Send and receive of the size in each direction (a ring shift).
    SendRecv,
    /// All-to-all; the size counts one rank's whole send array.
    AllToAll,
}

impl Collective {
    /// nccl-tests' bus-bandwidth factor for `ranks` ranks.
    pub fn bus_factor(self, ranks: usize) -> f64 {
        let n = ranks.max(1) as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => {
                (n - 1.0) / n
            }
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
            Collective::AllToAll => "all_to_all",
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

/// A time per operation with its confidence interval, as criterion
/// estimates it: microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// The point estimate.
    pub us: f64,
    /// The interval's lower bound.
    pub lo_us: f64,
    /// The interval's upper bound.
    pub hi_us: f64,
}

impl Timing {
    /// A timing; `None` unless every value is finite and non-negative and
    /// `lo <= point <= hi`.
    pub fn new(us: f64, lo_us: f64, hi_us: f64) -> Option<Timing> {
        let ok = [us, lo_us, hi_us]
            .iter()
            .all(|v| v.is_finite() && *v >= 0.0)
            && lo_us <= us
            && us <= hi_us;
        ok.then_some(Timing { us, lo_us, hi_us })
    }

    /// The interval's width relative to the point, `(hi - lo) / point`: the
    /// noise of this measurement.
    pub fn noise(&self) -> f64 {
        if self.us <= 0.0 {
            0.0
        } else {
            (self.hi_us - self.lo_us) / self.us
        }
    }
}

/// One size of the all-reduce path comparison: NCCL against one other path
/// (the fast path or the one-shot path).
#[derive(Debug, Clone)]
pub struct PathPoint {
    /// Payload bytes.
    pub bytes: usize,
    /// NCCL's all-reduce.
    pub nccl: Timing,
    /// The other path: the fast path (grouped send/recv plus the bf16 add)
    /// or the one-shot path.
    pub fast: Timing,
}

impl PathPoint {
    /// NCCL time over fast-path time (above 1: the fast path is faster).
    pub fn speedup(&self) -> f64 {
        self.nccl.us / self.fast.us
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

/// Which path a crossover is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathKind {
    /// The 2-rank send/recv + add path (`METRALE_COMM_FAST_PATH`).
    Fast,
    /// The one-shot path (`METRALE_COMM_ONE_SHOT`).
    OneShot,
}

impl PathKind {
    fn words(self) -> (&'static str, &'static str, &'static str) {
        match self {
            PathKind::Fast => ("the fast path", "METRALE_COMM_FAST_PATH", "FastPathPolicy"),
            PathKind::OneShot => (
                "the one-shot path",
                "METRALE_COMM_ONE_SHOT",
                "OneShotPolicy",
            ),
        }
    }
}

/// The crossover summary of one all-reduce path sweep: the sizes where
/// `path` wins beyond the noise and the recommended policy.
pub fn crossover_summary(mode: &str, path: PathKind, points: &[PathPoint]) -> String {
    let (name, env, ty) = path.words();
    let c = Crossover::from_points(points);
    let sizes: Vec<String> = c.winning_sizes.iter().map(|b| human_bytes(*b)).collect();
    let mut s = format!(
        "- {mode}: {name} beats NCCL beyond the noise at {}\n",
        if sizes.is_empty() {
            "no size".to_owned()
        } else {
            sizes.join(", ")
        }
    );
    s.push_str(&format!(
        "  recommended: `{env}={}`{}\n",
        c.policy_string(),
        match c.range {
            Some((lo, hi)) => format!(" ({ty}::Range {{ min_bytes: {lo}, max_bytes: {hi} }})"),
            None => format!(" ({ty}::Never)"),
        }
    ));
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
        assert!((Collective::AllToAll.bus_factor(2) - 0.5).abs() < 1e-12);
        assert_eq!(Collective::Broadcast.bus_factor(8), 1.0);
        assert_eq!(Collective::SendRecv.bus_factor(2), 1.0);
        // One rank moves nothing over the bus.
        assert_eq!(Collective::AllReduce.bus_factor(1), 0.0);
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

    #[test]
    fn timing_checks_its_interval() {
        let t = Timing::new(10.0, 9.0, 12.0).unwrap();
        assert!((t.noise() - 0.3).abs() < 1e-12);
        assert!(Timing::new(10.0, 11.0, 12.0).is_none());
        assert!(Timing::new(f64::NAN, 0.0, 1.0).is_none());
        assert!(Timing::new(-1.0, -2.0, 0.0).is_none());
        assert_eq!(Timing::new(0.0, 0.0, 0.0).unwrap().noise(), 0.0);
    }

    fn point(bytes: usize, nccl: f64, fast: f64) -> PathPoint {
        let t = |us: f64| Timing::new(us, us * 0.995, us * 1.005).unwrap();
        PathPoint {
            bytes,
            nccl: t(nccl),
            fast: t(fast),
        }
    }

    #[test]
    fn crossover_takes_the_longest_winning_run_beyond_noise() {
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
        // A 0.5% win inside 1% noise is no win.
        assert!(!point(1 << 20, 10.05, 10.0).fast_wins());
        let none = Crossover::from_points(&[point(8, 5.0, 6.0)]);
        assert_eq!(none.range, None);
        assert_eq!(none.policy_string(), "never");
        let s = crossover_summary("eager", PathKind::Fast, &pts);
        assert!(s.contains("METRALE_COMM_FAST_PATH=1M-16M"), "{s}");
        let s = crossover_summary("graph", PathKind::OneShot, &pts);
        assert!(s.contains("one-shot path beats NCCL"), "{s}");
        assert!(s.contains("METRALE_COMM_ONE_SHOT=1M-16M"), "{s}");
        assert!(s.contains("OneShotPolicy::Range"), "{s}");
        assert!(s.contains("1 MiB, 4 MiB, 16 MiB, 256 MiB"), "{s}");
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
}
