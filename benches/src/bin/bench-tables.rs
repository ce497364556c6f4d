//! `bench-tables [DIR] [--out FILE] [--all] [--baseline NAME]`: the nccl-tests-style tables
//! of the last collectives run, from criterion's estimates under DIR
//! (default: criterion's directory, found as criterion finds it).
//!
//! With `--out FILE` the run's plots go beside FILE as SVG
//! (`metrale_benches::plots`): `FILE-all-reduce.svg`, the all-reduce time
//! per path, and `FILE-busbw-{eager,graph}.svg`, the bus bandwidth beside
//! raw NCCL's (FILE's extension dropped).
//!
//! Invariant: it reads criterion's files and writes markdown and SVG; it
//! measures nothing (`metrale_benches::tables`).

use std::path::PathBuf;

use anyhow::{Context as _, bail};

const HELP: &str = "\
usage: bench-tables [DIR] [--out FILE] [--all] [--baseline NAME]

Prints the tables of the last `collectives` run from criterion's estimates
under DIR (default: $CRITERION_HOME, else the cargo target's criterion/).
--out FILE also writes them to FILE, and the run's plots beside it
(FILE-all-reduce.svg, FILE-busbw-eager.svg, FILE-busbw-graph.svg); --all reads every benchmark in DIR,
not only those of the last run; --baseline NAME adds each benchmark's
change against criterion's saved baseline NAME.
";

fn main() {
    match run() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("bench-tables: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run() -> anyhow::Result<i32> {
    let mut dir: Option<PathBuf> = None;
    let mut out: Option<PathBuf> = None;
    let mut all = false;
    let mut baseline: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--help" | "-h" => {
                print!("{HELP}");
                return Ok(0);
            }
            "--out" => out = Some(args.next().context("--out needs a file")?.into()),
            "--all" => all = true,
            "--baseline" => baseline = Some(args.next().context("--baseline needs a name")?),
            s if s.starts_with('-') => {
                eprint!("bench-tables: unknown option `{s}`\n{HELP}");
                return Ok(2);
            }
            s if dir.is_none() => dir = Some(s.into()),
            s => bail!("one directory only (got `{s}` too)"),
        }
    }
    let dir = dir.unwrap_or_else(metrale_benches::tables::criterion_dir);
    let (info, entries) = metrale_benches::tables::read_run(&dir, all, baseline.as_deref())?;
    let text = metrale_benches::tables::render(&info, &entries, baseline.as_deref());
    print!("{text}");
    if let Some(out) = out {
        std::fs::write(&out, &text).with_context(|| format!("writing {}", out.display()))?;
        let tuned: Vec<_> = info.tuned.iter().map(|t| t.as_plot()).collect();
        for (name, svg) in metrale_benches::plots::collectives(&info, &entries, &tuned)? {
            let path = metrale_benches::plots::svg_path(&out, &name);
            std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("bench-tables: wrote {}", path.display());
        }
    }
    Ok(0)
}
