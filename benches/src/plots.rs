//! The SVG plots of a benchmark run, drawn by `bench_plot` from the
//! criterion entries [`tables`](crate::tables) reads: for a collectives
//! run, the all-reduce time per call of each path (the
//! `all_reduce_paths` groups: `never` is NCCL, `always` the fast path,
//! `one_shot` the one-shot path; without them the `all_reduce` groups'
//! `ours`) and the bus bandwidth of each NCCL-path collective beside raw
//! NCCL's, one plot per mode; for a `one_shot_local` run, its time per call
//! by size, with a markdown table of the same numbers.
//!
//! Invariants: every point is a criterion estimate of the run (its
//! typical time), nothing is re-measured; a plot with no point is left
//! out, not drawn empty; bandwidths use nccl-tests' formulas with the
//! run's world size.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use bench_plot::{BwSeries, Meta, PathSeries, TunedRange};

use crate::collectives::plan::Op;
use crate::tables::{Entry, RunInfo};
use crate::{busbw_gbs, human_bytes};

/// `2 × NVIDIA H200` from the ranks' GPU names; the world size when the
/// names are missing.
pub fn machine(info: &RunInfo) -> String {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for g in &info.gpus {
        match counts.iter_mut().find(|(n, _)| n == g) {
            Some((_, c)) => *c += 1,
            None => counts.push((g, 1)),
        }
    }
    if counts.is_empty() {
        return format!("{} rank(s)", info.world);
    }
    counts
        .iter()
        .map(|(n, c)| format!("{c} × {n}"))
        .collect::<Vec<_>>()
        .join(" + ")
}

/// The SVG beside `table`: `tables.md` and `busbw-eager` give
/// `tables-busbw-eager.svg`.
pub fn svg_path(table: &Path, name: &str) -> PathBuf {
    let stem = table
        .file_stem()
        .map_or_else(|| "plot".into(), |s| s.to_string_lossy().into_owned());
    table.with_file_name(format!("{stem}-{name}.svg"))
}

/// Per (group, function), the (bytes, µs) points of the entries with a
/// size, in size order.
fn points(entries: &[Entry]) -> BTreeMap<(&str, &str), Vec<(u64, f64)>> {
    let mut out: BTreeMap<(&str, &str), Vec<(u64, f64)>> = BTreeMap::new();
    for e in entries {
        if let Some(b) = e.bytes {
            out.entry((&e.group, &e.function))
                .or_default()
                .push((b as u64, e.time.us));
        }
    }
    for v in out.values_mut() {
        v.sort_by_key(|p| p.0);
    }
    out
}

/// The plots of a collectives run, as (name, SVG): `all-reduce` and
/// `busbw-{mode}` for each mode with collectives; `tuned` are the tuner's
/// ranges to shade on the all-reduce plot.
pub fn collectives(
    info: &RunInfo,
    entries: &[Entry],
    tuned: &[TunedRange<'_>],
) -> anyhow::Result<Vec<(String, String)>> {
    let meta = Meta {
        machine: machine(info),
        date: bench_plot::date_utc(info.started_unix),
    };
    let pts = points(entries);
    let mut out = Vec::new();
    let mut paths: Vec<PathSeries> = Vec::new();
    for mode in ["eager", "graph"] {
        let group = format!("all_reduce_paths/{mode}");
        for (function, path) in [
            ("never", "NCCL"),
            ("always", "fast path"),
            ("one_shot", "one-shot"),
        ] {
            if let Some(p) = pts.get(&(group.as_str(), function)) {
                paths.push(PathSeries {
                    path: path.into(),
                    mode: mode.into(),
                    points: p.clone(),
                });
            }
        }
    }
    if paths.is_empty() {
        for mode in ["eager", "graph"] {
            let mut p: Vec<(u64, f64)> = pts
                .iter()
                .filter(|((g, f), _)| *f == "ours" && g.starts_with(&format!("all_reduce/{mode}/")))
                .flat_map(|(_, v)| v.iter().copied())
                .collect();
            p.sort_by_key(|p| p.0);
            if !p.is_empty() {
                paths.push(PathSeries {
                    path: "NCCL".into(),
                    mode: mode.into(),
                    points: p,
                });
            }
        }
    }
    if !paths.is_empty() {
        out.push((
            "all-reduce".to_owned(),
            bench_plot::all_reduce_time(&meta, &paths, tuned)?,
        ));
    }
    for mode in ["eager", "graph"] {
        let mut bw = Vec::new();
        for op in Op::ALL {
            // all_reduce_async and all_to_all_v repeat all_reduce's and
            // all_to_all's bandwidth.
            let Some(coll) = op.collective() else {
                continue;
            };
            if matches!(op, Op::AllReduceAsync | Op::AllToAllV) {
                continue;
            }
            for (function, source) in [("ours", "ours"), ("raw", "raw NCCL")] {
                let p: Vec<(u64, f64)> = pts
                    .iter()
                    .filter(|((g, f), _)| {
                        *f == function && g.starts_with(&format!("{}/{mode}/", op.name()))
                    })
                    .flat_map(|(_, v)| v.iter())
                    .map(|&(b, us)| (b, busbw_gbs(coll, info.world, b as usize, us)))
                    .collect();
                if !p.is_empty() {
                    bw.push(BwSeries {
                        collective: op.name().into(),
                        source: source.into(),
                        points: p,
                    });
                }
            }
        }
        // One rank moves nothing over the bus: no point is placeable.
        if !bw.is_empty() && info.world > 1 {
            let svg = bench_plot::bus_bandwidth(
                &Meta {
                    machine: format!("{}, {mode}", meta.machine),
                    date: meta.date.clone(),
                },
                &bw,
            )?;
            out.push((format!("busbw-{mode}"), svg));
        }
    }
    Ok(out)
}

/// A `one_shot_local` run's table (markdown) and plot (SVG), from its
/// entries (`one_shot_local/{mode}/k{k}`); `None` when the run has none.
pub fn one_shot_local(
    entries: &[Entry],
    machine: &str,
    date: &str,
) -> anyhow::Result<Option<(String, String)>> {
    let mut series: BTreeMap<&str, Vec<(u64, f64)>> = BTreeMap::new();
    for ((group, _), p) in points(entries) {
        if group.starts_with("one_shot_local/") {
            series.entry(group).or_default().extend(p);
        }
    }
    if series.is_empty() {
        return Ok(None);
    }
    let mut sizes: Vec<u64> = series.values().flatten().map(|p| p.0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut md = format!(
        "# The one-shot kernel on one GPU, ranks simulated\n\n{machine}, {date}. \
         Criterion's estimate per call, µs.\n\n| group |"
    );
    for s in &sizes {
        let _ = write!(md, " {} |", human_bytes(*s as usize));
    }
    md.push_str("\n|---|");
    md.push_str(&"---:|".repeat(sizes.len()));
    md.push('\n');
    let mut plot = Vec::new();
    for (group, mut p) in series {
        p.sort_by_key(|p| p.0);
        let _ = write!(md, "| {group} |");
        for s in &sizes {
            match p.iter().find(|q| q.0 == *s) {
                Some(q) => {
                    let _ = write!(md, " {:.2} |", q.1);
                }
                None => md.push_str(" - |"),
            }
        }
        md.push('\n');
        // `one_shot_local/graph_serial/k4`: colour by ranks, dash by mode.
        let mut parts = group.split('/').skip(1);
        let (mode, k) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        plot.push(PathSeries {
            path: format!("one-shot, {} ranks", k.trim_start_matches('k')),
            mode: mode.to_owned(),
            points: p,
        });
    }
    let svg = bench_plot::all_reduce_time(
        &Meta {
            machine: format!("{machine}, one-shot kernel, ranks simulated"),
            date: date.to_owned(),
        },
        &plot,
        &[],
    )?;
    Ok(Some((md, svg)))
}
