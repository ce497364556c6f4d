//! The nccl-tests-style tables of a collectives run, printed from
//! criterion's own estimates: `<dir>/<group>/<function>/<param>/new/`
//! holds `benchmark.json` (the ids and the throughput) and
//! `estimates.json` (the times) for each benchmark, and `<dir>/`
//! [`RUN_INFO`] what the run was (its world size, NCCL, GPUs, start).
//!
//! Invariants:
//! - Every number printed comes from those files; nothing is re-measured.
//! - The time of a benchmark is criterion's typical estimate, the one its
//!   report prints: the slope when it sampled linearly, else the mean, with
//!   its confidence interval; the noise column is the interval's width over
//!   the point, the larger of the compared functions'.
//! - Sizes are the throughput bytes criterion was given (nccl-tests'
//!   convention); bandwidths use nccl-tests' formulas with the run's world
//!   size.
//! - By default only benchmarks written since the run began are read, so a
//!   directory that also holds older runs prints the latest one.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};

use crate::collectives::plan::Op;
use crate::{PathKind, PathPoint, Timing, algbw_gbs, busbw_gbs, crossover_summary, human_bytes};

/// The file, in criterion's directory, that says what the run was.
pub const RUN_INFO: &str = "metrale-collectives.json";

/// What a collectives run was, written when it starts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    /// Ranks, one GPU each.
    pub world: usize,
    /// The GPUs' names, by rank.
    pub gpus: Vec<String>,
    /// The NCCL library's version.
    pub nccl: String,
    /// The backends' enqueue mode.
    pub enqueue: String,
    /// Whether the smoke-test sizes and times were used.
    pub quick: bool,
    /// Seconds since the Unix epoch when the run began.
    pub started_unix: u64,
    /// The ranges the default backend's path tuner chose (none at one
    /// rank, or in a file of a run before the tuner).
    #[serde(default)]
    pub tuned: Vec<TunedRun>,
}

/// One range the path tuner chose: the sizes, both ends included, that
/// take `path` (the all-reduce plot's name: `one-shot`, `fast path`) in
/// `mode` (`eager`, `graph`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TunedRun {
    /// The smallest payload, bytes.
    pub min_bytes: u64,
    /// The largest payload, bytes.
    pub max_bytes: u64,
    /// The path.
    pub path: String,
    /// The launch mode.
    pub mode: String,
}

impl TunedRun {
    /// The plot's form of the range.
    pub fn as_plot(&self) -> bench_plot::TunedRange<'_> {
        (self.min_bytes, self.max_bytes, &self.path, &self.mode)
    }
}

impl RunInfo {
    /// Seconds since the Unix epoch now.
    pub fn now_unix() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    }

    /// Writes the file into `dir`.
    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(RUN_INFO);
        std::fs::write(&path, serde_json::to_string_pretty(self)?)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// Reads the file from `dir`.
    pub fn read(dir: &Path) -> anyhow::Result<RunInfo> {
        let path = dir.join(RUN_INFO);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
}

/// The directory criterion writes to, found as criterion finds it:
/// `CRITERION_HOME`, else `CARGO_TARGET_DIR/criterion`, else the target
/// directory `cargo metadata` names (under cargo), else `target/criterion`.
pub fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    if let Some(target) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(target).join("criterion");
    }
    let from_cargo = std::env::var_os("CARGO").and_then(|cargo| {
        let out = std::process::Command::new(cargo)
            .args(["metadata", "--format-version", "1", "--no-deps"])
            .output()
            .ok()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        Some(PathBuf::from(v.get("target_directory")?.as_str()?))
    });
    match from_cargo {
        Some(target) => target.join("criterion"),
        None => PathBuf::from("target/criterion"),
    }
}

#[derive(Deserialize)]
struct Interval {
    lower_bound: f64,
    upper_bound: f64,
}

#[derive(Deserialize)]
struct Estimate {
    confidence_interval: Interval,
    point_estimate: f64,
}

#[derive(Deserialize)]
struct Estimates {
    mean: Estimate,
    slope: Option<Estimate>,
}

#[derive(Deserialize)]
struct BenchmarkJson {
    group_id: String,
    function_id: Option<String>,
    value_str: Option<String>,
    throughput: Option<serde_json::Value>,
}

/// One benchmark's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Criterion's group id (`all_reduce/eager/small`).
    pub group: String,
    /// The function (`raw`, `ours`, ...).
    pub function: String,
    /// The parameter, when there is one.
    pub param: Option<String>,
    /// The throughput bytes, when there are.
    pub bytes: Option<usize>,
    /// Criterion's typical estimate per iteration.
    pub time: Timing,
    /// The same estimate in the baseline read beside it, if any.
    pub base: Option<Timing>,
}

/// The typical estimate in `dir/estimates.json`, µs.
fn read_estimate(dir: &Path) -> anyhow::Result<Timing> {
    let p = dir.join("estimates.json");
    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    let est: Estimates =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
    let typical = est.slope.as_ref().unwrap_or(&est.mean);
    // Criterion's times are nanoseconds.
    Timing::new(
        typical.point_estimate / 1e3,
        typical.confidence_interval.lower_bound / 1e3,
        typical.confidence_interval.upper_bound / 1e3,
    )
    .with_context(|| format!("{}: an estimate out of order", p.display()))
}

/// Reads one `new/` directory, and the baseline `baseline` beside it.
fn read_entry(new: &Path, baseline: Option<&str>) -> anyhow::Result<Entry> {
    let p = new.join("benchmark.json");
    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    let id: BenchmarkJson =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
    let time = read_estimate(new)?;
    let base = match (baseline, new.parent()) {
        (Some(name), Some(up)) if up.join(name).join("estimates.json").is_file() => {
            Some(read_estimate(&up.join(name))?)
        }
        _ => None,
    };
    // `{"Bytes": n}` or `{"BytesDecimal": n}`.
    let bytes = id.throughput.as_ref().and_then(|t| {
        ["BytesDecimal", "Bytes"]
            .iter()
            .find_map(|k| t.get(k)?.as_u64())
            .map(|b| b as usize)
    });
    let (function, param) = match id.function_id {
        Some(f) => (f, id.value_str),
        None => (id.value_str.unwrap_or_default(), None),
    };
    Ok(Entry {
        group: id.group_id,
        function,
        param,
        bytes,
        time,
        base,
    })
}

/// Every benchmark under `dir` whose `new/benchmark.json` was written at
/// or after `since` (seconds since the epoch; 0 reads all), sorted by id,
/// with its estimate in the saved baseline `baseline` where there is one.
pub fn read_entries(dir: &Path, since: u64, baseline: Option<&str>) -> anyhow::Result<Vec<Entry>> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(list) = std::fs::read_dir(&d) else {
            continue;
        };
        for item in list.flatten() {
            let p = item.path();
            if !p.is_dir() {
                continue;
            }
            if p.file_name().is_some_and(|n| n == "new") && p.join("benchmark.json").is_file() {
                let written = std::fs::metadata(p.join("benchmark.json"))
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_secs());
                if written >= since {
                    found.push(read_entry(&p, baseline)?);
                }
            } else {
                stack.push(p);
            }
        }
    }
    found.sort_by(|a, b| {
        (&a.group, a.bytes, &a.param, &a.function).cmp(&(&b.group, b.bytes, &b.param, &b.function))
    });
    Ok(found)
}

/// Reads the run in `dir`: its [`RunInfo`] and the benchmarks written since
/// it began (all of them with `all`), each with its estimate in the saved
/// baseline `baseline` (criterion's `--baseline NAME`) where there is one.
pub fn read_run(
    dir: &Path,
    all: bool,
    baseline: Option<&str>,
) -> anyhow::Result<(RunInfo, Vec<Entry>)> {
    let info = RunInfo::read(dir)?;
    let since = if all {
        0
    } else {
        info.started_unix.saturating_sub(1)
    };
    let entries = read_entries(dir, since, baseline)?;
    if entries.is_empty() {
        bail!("no criterion results under {} for this run", dir.display());
    }
    Ok((info, entries))
}

/// The results of one size of a group: function name to timing.
type Row = BTreeMap<String, Timing>;

/// Groups entries by group, then size (bytes, or 0 without a throughput).
fn by_group(entries: &[Entry]) -> BTreeMap<String, BTreeMap<usize, Row>> {
    let mut out: BTreeMap<String, BTreeMap<usize, Row>> = BTreeMap::new();
    for e in entries {
        out.entry(e.group.clone())
            .or_default()
            .entry(e.bytes.unwrap_or(0))
            .or_default()
            .insert(e.function.clone(), e.time);
    }
    out
}

fn noise(ts: &[Option<&Timing>]) -> f64 {
    100.0 * ts.iter().flatten().map(|t| t.noise()).fold(0.0, f64::max)
}

fn us(t: Option<&Timing>) -> String {
    t.map_or("-".into(), |t| format!("{:.2}", t.us))
}

/// The markdown tables of a run; with `baseline`, also each benchmark's
/// change against it.
pub fn render(info: &RunInfo, entries: &[Entry], baseline: Option<&str>) -> String {
    let w = info.world;
    let groups = by_group(entries);
    let mut s = String::from("# Collectives: CommBackend next to raw NCCL\n\n");
    let _ = writeln!(
        s,
        "{w} rank(s) as threads of one process ({}), NCCL {}, backends EnqueueMode::{}{}. \
         Times are criterion's estimates per operation (slope, or mean under flat sampling); \
         noise is the width of criterion's 95% interval over the estimate, the larger of the \
         functions compared; busbw uses nccl-tests' formulas for {w} rank(s); every ratio is \
         within this run.\n",
        if info.gpus.is_empty() {
            "no GPU names".to_owned()
        } else {
            info.gpus.join(", ")
        },
        info.nccl,
        info.enqueue,
        if info.quick {
            " (METRALE_BENCH_QUICK: smoke-test sizes and times, not a measurement)"
        } else {
            ""
        }
    );
    let mut ops = String::new();
    let mut latency = String::new();
    let mut other = String::new();
    // Rows in the order of the plan: operation, eager before graph, size.
    let mut rows: Vec<(usize, bool, usize, &str, &Row)> = Vec::new();
    for (name, sizes) in &groups {
        let mut parts = name.split('/');
        let Some(i) = parts
            .next()
            .and_then(|o| Op::ALL.iter().position(|op| op.name() == o))
        else {
            continue;
        };
        let mode = parts.next().unwrap_or("");
        for (&bytes, row) in sizes {
            rows.push((i, mode == "graph", bytes, mode, row));
        }
    }
    rows.sort_by_key(|r| (r.0, r.1, r.2));
    for (i, _, bytes, mode, row) in rows {
        let op = Op::ALL[i];
        let (raw, ours) = (row.get("raw"), row.get("ours"));
        let Some(coll) = op.collective() else {
            let _ = writeln!(
                latency,
                "| {} | {mode} | {} | {} | {} | {:.1} |",
                op.name(),
                us(raw),
                us(ours),
                diff(raw, ours),
                noise(&[raw, ours])
            );
            continue;
        };
        let bw = |t: Option<&Timing>, bus: bool| {
            t.map_or("-".into(), |t| {
                let v = if bus {
                    busbw_gbs(coll, w, bytes, t.us)
                } else {
                    algbw_gbs(bytes, t.us)
                };
                format!("{v:.2}")
            })
        };
        let ratio = match (raw, ours) {
            (Some(r), Some(o)) if o.us > 0.0 => format!("{:.3}", r.us / o.us),
            _ => "-".into(),
        };
        let _ = writeln!(
            ops,
            "| {} | {mode} | {} | {} | {} | {} | {} | {} | {} | {} | {ratio} | {:.1} |",
            op.name(),
            human_bytes(bytes),
            us(raw),
            us(ours),
            diff(raw, ours),
            bw(raw, false),
            bw(raw, true),
            bw(ours, false),
            bw(ours, true),
            noise(&[raw, ours])
        );
    }
    // Per path group (eager, graph): its table rows and its crossover
    // points against the fast path and the one-shot path.
    let mut path_groups: Vec<PathTable> = Vec::new();
    for (name, sizes) in &groups {
        if let Some(mode) = name.strip_prefix("all_reduce_paths/") {
            let mut g = PathTable {
                mode: mode.to_owned(),
                rows: String::new(),
                fast: Vec::new(),
                one_shot: Vec::new(),
            };
            for (&bytes, row) in sizes {
                let t = |f: &str| row.get(f);
                let (never, always, one, auto) =
                    (t("never"), t("always"), t("one_shot"), t("default"));
                if let Some(n) = never {
                    if let Some(a) = always {
                        g.fast.push(PathPoint {
                            bytes,
                            nccl: *n,
                            fast: *a,
                        });
                    }
                    if let Some(o) = one {
                        g.one_shot.push(PathPoint {
                            bytes,
                            nccl: *n,
                            fast: *o,
                        });
                    }
                }
                let best = [never, always, one]
                    .into_iter()
                    .flatten()
                    .map(|t| t.us)
                    .reduce(f64::min);
                let ratio = |other: Option<&Timing>| match (never, other) {
                    (Some(n), Some(o)) if o.us > 0.0 => format!("{:.3}", n.us / o.us),
                    _ => "-".into(),
                };
                let _ = writeln!(
                    g.rows,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} |",
                    human_bytes(bytes),
                    us(t("raw")),
                    us(never),
                    us(always),
                    us(one),
                    us(auto),
                    ratio(always),
                    ratio(one),
                    match (auto, best) {
                        (Some(d), Some(b)) if b > 0.0 =>
                            format!("{:+.1}%", 100.0 * (d.us / b - 1.0)),
                        _ => "-".into(),
                    },
                    auto.map_or("-".into(), |d| format!(
                        "{:.2}",
                        busbw_gbs(crate::Collective::AllReduce, w, bytes, d.us)
                    )),
                    noise(&[t("raw"), never, always, one, auto])
                );
            }
            path_groups.push(g);
        } else if name.split('/').next().and_then(Op::from_name).is_none() {
            for row in sizes.values() {
                for (f, t) in row {
                    let id = if f.is_empty() {
                        name.clone()
                    } else {
                        format!("{name}/{f}")
                    };
                    let _ = writeln!(other, "| {id} | {:.4} | {:.1} |", t.us, 100.0 * t.noise());
                }
            }
        }
    }
    if !ops.is_empty() {
        s.push_str("## Collectives, ours / raw\n\n");
        s.push_str(
            "| op | mode | bytes | raw µs | ours µs | ours - raw µs | raw algbw GB/s | raw busbw GB/s | ours algbw GB/s | ours busbw GB/s | ours/raw busbw | noise % |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        s.push_str(&ops);
        s.push('\n');
    }
    if !latency.is_empty() {
        s.push_str("## Host-waited operations\n\n");
        s.push_str(
            "| op | mode | raw µs | ours µs | ours - raw µs | noise % |\n|---|---|---:|---:|---:|---:|\n",
        );
        s.push_str(&latency);
        s.push('\n');
    }
    for g in &path_groups {
        let _ = write!(
            s,
            "## {w}-rank all-reduce paths, {}\n\n\
             `never` is the backend's NCCL path, `always` the fast path (send/recv + add, 2 ranks, \
             eager only), `one_shot` the one-shot path, `default` the default configuration; \
             `NCCL/fast` is never / always and `NCCL/one-shot` never / one_shot (above 1: that \
             path wins); `default vs best` compares with the best of the paths.\n\n\
             | bytes | raw µs | never µs | always µs | one_shot µs | default µs | NCCL/fast | NCCL/one-shot | default vs best | default busbw GB/s | noise % |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            g.mode
        );
        s.push_str(&g.rows);
        s.push_str("\n### Crossover\n\n");
        if !g.fast.is_empty() {
            s.push_str(&crossover_summary(&g.mode, PathKind::Fast, &g.fast));
        }
        if !g.one_shot.is_empty() {
            s.push_str(&crossover_summary(&g.mode, PathKind::OneShot, &g.one_shot));
        }
        s.push('\n');
    }
    if !other.is_empty() {
        s.push_str("## Other benchmarks\n\n| id | µs | noise % |\n|---|---:|---:|\n");
        s.push_str(&other);
        s.push('\n');
    }
    if let Some(name) = baseline {
        s.push_str(&changes(name, &groups_with_base(entries)));
    }
    s
}

/// One all-reduce path group's rendering: its rows and crossover points.
struct PathTable {
    mode: String,
    rows: String,
    fast: Vec<PathPoint>,
    one_shot: Vec<PathPoint>,
}

/// Per group and size, each function's estimate now and in the baseline.
type BaseRows = BTreeMap<(String, usize), BTreeMap<String, (Timing, Timing)>>;

fn groups_with_base(entries: &[Entry]) -> BaseRows {
    let mut out = BaseRows::new();
    for e in entries {
        if let Some(b) = e.base {
            out.entry((e.group.clone(), e.bytes.unwrap_or(0)))
                .or_default()
                .insert(e.function.clone(), (e.time, b));
        }
    }
    out
}

/// The change of every benchmark against the baseline `name`; raw NCCL's
/// change is the machine's drift between the two runs, so `ours - raw` is
/// the code's share.
fn changes(name: &str, rows: &BaseRows) -> String {
    let mut s = format!(
        "## Against baseline `{name}` (criterion's --baseline)\n\n\
         Change of each estimate, % (negative: faster now); `ours - raw` is ours' change \
         less raw NCCL's, the same box's drift between the runs.\n\n\
         | group | bytes | raw % | ours % | ours - raw | never % | always % | default % |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    if rows.is_empty() {
        s.push_str("| (no benchmark of this run is in the baseline) | | | | | | | |\n");
    }
    let pct = |r: Option<&(Timing, Timing)>| r.map(|(now, base)| 100.0 * (now.us / base.us - 1.0));
    let cell = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:+.1}"));
    for ((group, bytes), row) in rows {
        let (raw, ours) = (pct(row.get("raw")), pct(row.get("ours")));
        let _ = writeln!(
            s,
            "| {group} | {} | {} | {} | {} | {} | {} | {} |",
            if *bytes == 0 {
                "-".into()
            } else {
                human_bytes(*bytes)
            },
            cell(raw),
            cell(ours),
            cell(raw.zip(ours).map(|(r, o)| o - r)),
            cell(pct(row.get("never"))),
            cell(pct(row.get("always"))),
            cell(pct(row.get("default"))),
        );
    }
    s.push('\n');
    s
}

fn diff(raw: Option<&Timing>, ours: Option<&Timing>) -> String {
    match (raw, ours) {
        (Some(r), Some(o)) => format!("{:+.2}", o.us - r.us),
        _ => "-".into(),
    }
}
