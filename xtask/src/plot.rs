//! `cargo xtask plot`: plots of tables already written, through
//! `bench_plot`. `plot store FILE` draws the store's time to barrier from
//! a store table (`OUT/store-bench.md` of the store bundle, ours beside
//! PyTorch's, or `store-bench table`'s output saved to a file) into the SVG
//! beside it; `plot docs [--check]` redraws the committed plots of
//! `docs/benchmarks.md` from the tables there ([`DOCS`]).
//!
//! Invariants: every point is a number of the table read; a cell holding
//! several runs (`0.26 s, 0.23 s, 0.28 s`, `2.89 / 2.89`) is drawn at
//! their median; a row that failed has no point. `--check` writes nothing
//! and fails when a committed plot differs from its table.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use bench_plot::{Meta, PathSeries, StoreSeries};

const HELP: &str = "\
usage: cargo xtask plot store FILE [--out SVG] [--machine TEXT] [--date YYYY-MM-DD]
       cargo xtask plot docs [--check]

store: the time to barrier against the ranks, one line per server, from the
markdown table in FILE (the store bundle's OUT/store-bench.md, or
`store-bench table` saved to a file); the SVG goes beside FILE (FILE with
.svg) unless --out. The title's machine is --machine, else OUT/machine.txt
beside FILE (cores, torch), and its date --date, else FILE's.
docs: redraws docs/plots/*.svg from the tables of docs/benchmarks.md
(--check: fail if a committed plot is stale, write nothing).
";

/// A committed plot: its file under `docs/plots/`, the table of
/// `docs/benchmarks.md` it draws (the first whose header starts with
/// `header` and whose text holds `holding`), how, and its title's words.
struct DocPlot {
    file: &'static str,
    header: &'static str,
    holding: &'static str,
    kind: Kind,
    machine: &'static str,
    date: &'static str,
}

#[derive(Clone, Copy)]
enum Kind {
    /// `| ranks | server | time to barrier | ...`.
    Store,
    /// `| ranks | graphs | 8 B | 1 KiB | ...`: one-shot time per call.
    OneShotLocal,
}

/// The committed plots.
const DOCS: [DocPlot; 2] = [
    DocPlot {
        file: "store-vs-pytorch.svg",
        header: "| ranks | server | time to barrier",
        holding: "PyTorch",
        kind: Kind::Store,
        machine: "16 CPU cores, torch 2.11.0+cu130, somaxconn 65535",
        date: "2026-12-07",
    },
    DocPlot {
        file: "one-shot-local-graph-order.svg",
        header: "| ranks | graphs |",
        holding: "serial",
        kind: Kind::OneShotLocal,
        machine: "1 × NVIDIA H200, one-shot kernel, ranks simulated",
        date: "2026-12-02",
    },
];

/// Runs the subcommand.
pub fn run(args: &[String]) -> anyhow::Result<i32> {
    match args.first().map(String::as_str) {
        Some("store") => store(&args[1..]),
        Some("docs") => docs(crate::check_flag(
            &args[1..],
            "cargo xtask plot docs [--check]",
        )?),
        Some("--help" | "-h") => {
            print!("{HELP}");
            Ok(0)
        }
        _ => {
            eprint!("{HELP}");
            Ok(2)
        }
    }
}

fn store(args: &[String]) -> anyhow::Result<i32> {
    let mut file: Option<PathBuf> = None;
    let (mut out, mut machine, mut date) = (None, None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .with_context(|| format!("{a} needs a value"))
        };
        match a.as_str() {
            "--out" => out = Some(PathBuf::from(val()?)),
            "--machine" => machine = Some(val()?),
            "--date" => date = Some(val()?),
            s if s.starts_with('-') || file.is_some() => {
                eprint!("plot: unexpected `{s}`\n{HELP}");
                return Ok(2);
            }
            s => file = Some(s.into()),
        }
    }
    let file = file.context("plot store needs a FILE")?;
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let meta = Meta {
        machine: machine.unwrap_or_else(|| machine_of(&file)),
        date: match date {
            Some(d) => d,
            None => {
                let t = std::fs::metadata(&file)?.modified()?;
                let secs = t.duration_since(std::time::UNIX_EPOCH)?.as_secs();
                bench_plot::date_utc(secs)
            }
        },
    };
    let table = tables(&text)
        .into_iter()
        .find(|t| t.header.iter().any(|h| h == "time to barrier"))
        .with_context(|| format!("no store table in {}", file.display()))?;
    let svg = bench_plot::store_barrier(&meta, &store_series(&table)?)?;
    let out = out.unwrap_or_else(|| file.with_extension("svg"));
    std::fs::write(&out, svg).with_context(|| format!("writing {}", out.display()))?;
    println!("plot: wrote {}", out.display());
    Ok(0)
}

/// The machine from the store bundle's `machine.txt` beside `file`: its
/// core count (the line `nproc` wrote) and torch's version.
fn machine_of(file: &Path) -> String {
    let text = file
        .parent()
        .map(|d| d.join("machine.txt"))
        .and_then(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_default();
    let cores = text
        .lines()
        .find(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()));
    let torch = text.lines().find(|l| l.starts_with("torch "));
    match (cores, torch) {
        (Some(c), Some(t)) => format!("{c} CPU cores, {t}"),
        (Some(c), None) => format!("{c} CPU cores"),
        (None, Some(t)) => t.to_owned(),
        (None, None) => "machine not recorded".to_owned(),
    }
}

fn docs(check: bool) -> anyhow::Result<i32> {
    let root = crate::workspace_root();
    let text = std::fs::read_to_string(root.join("docs/benchmarks.md"))?;
    let all = tables(&text);
    let mut stale = false;
    for d in &DOCS {
        let table = all
            .iter()
            .find(|t| t.header_line.starts_with(d.header) && t.text.contains(d.holding))
            .with_context(|| format!("docs/benchmarks.md: no table `{}...`", d.header))?;
        let meta = Meta {
            machine: d.machine.into(),
            date: d.date.into(),
        };
        let svg = match d.kind {
            Kind::Store => bench_plot::store_barrier(&meta, &store_series(table)?)?,
            Kind::OneShotLocal => {
                bench_plot::all_reduce_time(&meta, &one_shot_series(table)?, &[])?
            }
        };
        let rel = format!("docs/plots/{}", d.file);
        stale |= crate::update_generated("plot", &root, &rel, &svg, check)?;
    }
    Ok(if check && stale { 1 } else { 0 })
}

/// A markdown table: its header cells and its rows' cells.
struct Table {
    header_line: String,
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    text: String,
}

fn cells(line: &str) -> Vec<String> {
    let t = line.trim().trim_start_matches('|').trim_end_matches('|');
    t.split('|').map(|c| c.trim().to_owned()).collect()
}

/// Every table in `text`: runs of lines starting with `|`, the second the
/// separator.
fn tables(text: &str) -> Vec<Table> {
    let mut out = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let starts = |j: usize| {
            lines
                .get(j)
                .is_some_and(|l| l.trim_start().starts_with('|'))
        };
        if starts(i) && lines.get(i + 1).is_some_and(|l| l.contains("---")) {
            let mut j = i + 2;
            while starts(j) {
                j += 1;
            }
            out.push(Table {
                header_line: lines[i].trim().to_owned(),
                header: cells(lines[i]),
                rows: lines[i + 2..j].iter().map(|l| cells(l)).collect(),
                text: lines[i..j].join("\n"),
            });
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// The median of the numbers in a cell (`0.26 s, 0.23 s`, `2.89 / 2.89`);
/// `None` when it holds none (`-`, `failed: ...`).
fn median(cell: &str) -> Option<f64> {
    if cell.starts_with("failed") {
        return None;
    }
    let mut v: Vec<f64> = cell
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|s| s.parse().ok())
        .collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => None,
        n if n % 2 == 1 => Some(v[n / 2]),
        n => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

fn column(t: &Table, name: &str) -> Option<usize> {
    t.header.iter().position(|h| h == name)
}

/// One series per server (`metrale` where the table has no server column).
fn store_series(t: &Table) -> anyhow::Result<Vec<StoreSeries>> {
    let ranks = column(t, "ranks").context("no `ranks` column")?;
    let time = column(t, "time to barrier").context("no `time to barrier` column")?;
    let server = column(t, "server");
    let mut out: Vec<StoreSeries> = Vec::new();
    for row in &t.rows {
        let n: u64 = row
            .get(ranks)
            .and_then(|c| c.replace(',', "").parse().ok())
            .with_context(|| format!("ranks in {row:?}"))?;
        let name = server.and_then(|s| row.get(s)).map_or("metrale", |s| s);
        let Some(secs) = row.get(time).and_then(|c| median(c)) else {
            continue;
        };
        match out.iter_mut().find(|s| s.server == name) {
            Some(s) => s.points.push((n, secs)),
            None => out.push(StoreSeries {
                server: name.to_owned(),
                points: vec![(n, secs)],
            }),
        }
    }
    if out.is_empty() {
        bail!("no time to barrier in the table");
    }
    Ok(out)
}

/// `8 B`, `16 KiB`, `1 MiB` as bytes.
fn bytes(cell: &str) -> Option<u64> {
    let (n, unit) = cell.split_once(' ')?;
    let n: u64 = n.parse().ok()?;
    let shift = match unit {
        "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        _ => return None,
    };
    Some(n << shift)
}

/// One series per row of `| ranks | graphs | sizes... |`: the path is the
/// ranks, the mode the graphs' kind.
fn one_shot_series(t: &Table) -> anyhow::Result<Vec<PathSeries>> {
    let sizes: Vec<(usize, u64)> = t
        .header
        .iter()
        .enumerate()
        .filter_map(|(i, h)| Some((i, bytes(h)?)))
        .collect();
    if sizes.is_empty() {
        bail!("no size columns in `{}`", t.header_line);
    }
    Ok(t.rows
        .iter()
        .map(|row| PathSeries {
            path: format!("one-shot, {} ranks", row[0]),
            mode: format!("graph ({})", row.get(1).map_or("", |s| s)),
            points: sizes
                .iter()
                .filter_map(|&(i, b)| Some((b, median(row.get(i)?)?)))
                .collect(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_tables_of_every_writer_are_read() {
        let bundle = "| ranks | server | time to barrier | peak RSS (before the ranks) | threads | fds |\n\
                      |---|---|---|---|---|---|\n\
                      | 1024 | metrale | 0.17 s | 4 MiB (3 MiB) | 3 | 1032 |\n\
                      | 1024 | torch 2.11.0 libuv | 0.20 s | 498 MiB (496 MiB) | 18 | 1039 |\n\
                      | 4096 | metrale | 0.42 s | 8 MiB (3 MiB) | 3 | 4104 |\n\
                      | 4096 | torch 2.11.0 libuv | failed: ['boom'] | 0 MiB (0 MiB) | 1 | 2 |\n\
                      \n{\"ranks\": 1024}\n";
        let s = store_series(&tables(bundle)[0]).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].server, "metrale");
        assert_eq!(s[0].points, vec![(1024, 0.17), (4096, 0.42)]);
        assert_eq!(s[1].points, vec![(1024, 0.20)]);
        let ours = "| ranks | time to barrier | peak RSS (before the ranks) | threads | fds |\n\
                    |---|---|---|---|---|\n\
                    | 16384 | 0.26 s, 6.78 s, 5.31 s | 21 MiB (3 MiB) | 3 | 16394 |\n";
        let s = store_series(&tables(ours)[0]).unwrap();
        assert_eq!(s[0].server, "metrale");
        assert_eq!(s[0].points, vec![(16384, 5.31)]);
    }

    #[test]
    fn one_shot_rows_become_series_by_size() {
        let t = "| ranks | graphs | 8 B | 1 KiB | 1 MiB |\n|---|---|---:|---:|---:|\n\
                 | 2 | plain | 2.58 | 2.48 / 2.50 | - |\n";
        let s = one_shot_series(&tables(t)[0]).unwrap();
        assert_eq!(s[0].path, "one-shot, 2 ranks");
        assert_eq!(s[0].mode, "graph (plain)");
        assert_eq!(s[0].points, vec![(8, 2.58), (1024, 2.49)]);
    }

    #[test]
    fn the_committed_plots_draw_from_the_docs() {
        let text =
            std::fs::read_to_string(crate::workspace_root().join("docs/benchmarks.md")).unwrap();
        let all = tables(&text);
        for d in &DOCS {
            assert!(
                all.iter()
                    .any(|t| t.header_line.starts_with(d.header) && t.text.contains(d.holding)),
                "docs/benchmarks.md has the table of {}",
                d.file
            );
        }
    }
}
