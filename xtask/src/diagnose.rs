//! `cargo xtask diagnose DIR [--generation N]`: reads the flight-recorder
//! dumps of all ranks in DIR and names the first operation they disagree on.
//!
//! The analysis itself is `metrale_comm::diagnostics::analyze` (unit-tested
//! there); this module only finds and parses the `*.json` dumps, picks the
//! generation (the highest present unless `--generation`), and prints.
//! Exit status: 0 when a diagnosis was found and printed, 1 when the dumps
//! are consistent, 2 on usage or I/O errors (including no dumps at all).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use metrale_comm::diagnostics::{Dump, analyze_generation};

const USAGE: &str = "\
usage: cargo xtask diagnose DIR [--generation N]

Reads every *.json flight-recorder dump in DIR (one per rank; written on a
timeout or failure to METRALE_COMM_DUMP_DIR) and prints the ranks found and
missing and the first sequence number at which the ranks disagree, which some
rank never reached, or which timed out or failed.

exit status: 0 a diagnosis was printed, 1 the dumps are consistent,
             2 usage or I/O error
";

#[derive(Debug, PartialEq, Eq)]
struct Args {
    dir: PathBuf,
    generation: Option<u64>,
}

fn parse_args(args: &[String]) -> Result<Option<Args>, String> {
    let mut dir = None;
    let mut generation = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--generation" => {
                let value = it.next().ok_or("--generation needs a value")?;
                generation = Some(
                    value
                        .parse()
                        .map_err(|_| format!("--generation {value:?} is not a number"))?,
                );
            }
            flag if flag.starts_with("--") => return Err(format!("unknown option {flag}")),
            path => {
                if dir.replace(PathBuf::from(path)).is_some() {
                    return Err("only one DIR may be given".to_owned());
                }
            }
        }
    }
    let dir = dir.ok_or("DIR is required")?;
    Ok(Some(Args { dir, generation }))
}

/// Reads every `*.json` in `dir` that parses as a dump; others are skipped
/// with a warning on stderr.
fn load_dumps(dir: &Path) -> std::io::Result<Vec<(PathBuf, Dump)>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json") && p.is_file())
        .collect();
    paths.sort();
    let mut dumps = Vec::new();
    for path in paths {
        let text = std::fs::read_to_string(&path)?;
        match serde_json::from_str::<Dump>(&text) {
            Ok(dump) => dumps.push((path, dump)),
            Err(err) => eprintln!("diagnose: skipping {}: not a dump: {err}", path.display()),
        }
    }
    Ok(dumps)
}

/// Runs the analysis and returns the text to print and the exit status.
fn diagnose(args: &Args) -> Result<(String, i32), String> {
    let loaded =
        load_dumps(&args.dir).map_err(|e| format!("reading {}: {e}", args.dir.display()))?;
    if loaded.is_empty() {
        return Err(format!("no dumps in {}", args.dir.display()));
    }
    let generations: BTreeSet<u64> = loaded.iter().map(|(_, d)| d.header.generation).collect();
    let generation = match args.generation {
        Some(g) if !generations.contains(&g) => {
            return Err(format!(
                "no dump of generation {g} in {} (present: {generations:?})",
                args.dir.display()
            ));
        }
        Some(g) => g,
        None => *generations.last().ok_or("no generation")?,
    };
    let dumps: Vec<Dump> = loaded.iter().map(|(_, d)| d.clone()).collect();
    let analysis = analyze_generation(&dumps, generation);

    let mut out = String::new();
    if generations.len() > 1 {
        out.push_str(&format!("generations present: {generations:?}\n"));
    }
    out.push_str(&analysis.to_string());
    for (path, dump) in loaded
        .iter()
        .filter(|(_, d)| d.header.generation == generation)
    {
        let last = dump.records.last().map_or(0, |r| r.seq);
        let first_failed = dump
            .header
            .first_failed_seq
            .map_or(String::new(), |s| format!(", first failed seq {s}"));
        out.push_str(&format!(
            "  rank {}: last seq {last}{first_failed}, reason: {} ({})\n",
            dump.header.rank,
            dump.header.reason,
            path.file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        ));
    }
    let code = if analysis.found_problem() { 0 } else { 1 };
    Ok((out, code))
}

/// Runs the subcommand; returns the process exit status.
pub fn run(args: &[String]) -> anyhow::Result<i32> {
    let parsed = match parse_args(args) {
        Ok(Some(parsed)) => parsed,
        Ok(None) => {
            print!("{USAGE}");
            return Ok(0);
        }
        Err(err) => {
            eprintln!("diagnose: {err}");
            eprint!("{USAGE}");
            return Ok(2);
        }
    };
    match diagnose(&parsed) {
        Ok((text, code)) => {
            print!("{text}");
            Ok(code)
        }
        Err(err) => {
            eprintln!("diagnose: {err}");
            Ok(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_comm::diagnostics::{DumpHeader, FlightRecorder, OpState};

    fn temp_dir(tag: &str) -> PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        std::env::temp_dir().join(format!(
            "metrale-xtask-diag-{tag}-{}-{nanos}",
            std::process::id()
        ))
    }

    fn header(rank: usize, generation: u64) -> DumpHeader {
        DumpHeader {
            rank,
            world_size: 3,
            generation,
            reason: "deadline".to_owned(),
            first_failed_seq: None,
        }
    }

    fn args(dir: &Path, generation: Option<u64>) -> Args {
        Args {
            dir: dir.to_path_buf(),
            generation,
        }
    }

    #[test]
    fn parses_arguments() {
        let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            parse_args(&s(&["/d", "--generation", "3"])),
            Ok(Some(Args {
                dir: PathBuf::from("/d"),
                generation: Some(3)
            }))
        );
        assert_eq!(parse_args(&s(&["--help"])), Ok(None));
        assert!(parse_args(&s(&[])).is_err());
        assert!(parse_args(&s(&["/d", "--generation"])).is_err());
        assert!(parse_args(&s(&["/d", "--generation", "x"])).is_err());
        assert!(parse_args(&s(&["/d", "/e"])).is_err());
        assert!(parse_args(&s(&["/d", "--bogus"])).is_err());
    }

    #[test]
    fn diagnoses_a_rank_that_stopped_early() {
        let dir = temp_dir("early");
        // Generation 1: ranks 0 and 1 dumped; rank 1 stopped before seq 7; rank 2 missing.
        for (rank, n) in [(0usize, 7u64), (1, 6)] {
            let rec = FlightRecorder::new(16);
            for _ in 0..n {
                let seq = rec.record("all_reduce", "bf16", 8192, 1, None);
                rec.set_state(seq, OpState::Completed);
            }
            if rank == 0 {
                rec.set_state(7, OpState::TimedOut);
            }
            rec.dump_json(&dir, &header(rank, 1)).expect("dump");
        }
        // Generation 0 is consistent.
        for rank in 0..3 {
            let rec = FlightRecorder::new(16);
            rec.record("broadcast", "u8", 128, 1, Some(0));
            rec.dump_json(&dir, &header(rank, 0)).expect("dump");
        }
        std::fs::write(dir.join("notes.json"), "{\"unrelated\": true}").expect("write");

        let (text, code) = diagnose(&args(&dir, None)).expect("diagnose");
        assert_eq!(code, 0, "{text}");
        assert!(text.contains("missing dumps: rank 2"), "{text}");
        assert!(
            text.contains(
                "rank 1 never reached seq 7 (all_reduce bf16 8192 B); rank 0 timed out in it"
            ),
            "{text}"
        );
        let (text, code) = diagnose(&args(&dir, Some(0))).expect("diagnose");
        assert_eq!(code, 1, "{text}");
        assert!(diagnose(&args(&dir, Some(5))).is_err());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn empty_or_missing_directory_is_an_error() {
        let dir = temp_dir("empty");
        assert!(diagnose(&args(&dir, None)).is_err());
        std::fs::create_dir_all(&dir).expect("mkdir");
        assert!(diagnose(&args(&dir, None)).is_err());
        let code = run(&[dir.display().to_string()]).expect("run");
        assert_eq!(code, 2);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
