//! The table generator on a stored criterion directory:
//! `fixtures/criterion/` is a subset of what criterion 0.7 wrote for a
//! `METRALE_BENCH_QUICK=1` run of the collectives bench on the CPU
//! emulator (2 ranks): `benchmark.json` and `estimates.json` of each
//! benchmark, and the run's `metrale-collectives.json`. Its times are the
//! emulator's, not a measurement; the expected rows below were computed
//! from those files by hand (slope where criterion sampled linearly, the
//! mean under flat sampling). The baseline `main` of the two 4 KiB
//! all-reduce benchmarks is made by hand: every estimate of `new/` times
//! 1.10 (raw) and 1.25 (ours).
//!
//! Invariant: the fixture is read, never written; a test that needs to
//! write copies what it needs into its own temporary directory.

use std::path::{Path, PathBuf};

use metrale_benches::tables::{RunInfo, TunedRun, read_entries, read_run, render};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/criterion")
}

#[test]
fn every_stored_benchmark_is_read_with_its_estimate() {
    let entries = read_entries(&fixture(), 0, None).unwrap();
    assert_eq!(entries.len(), 18);
    let e = entries
        .iter()
        .find(|e| {
            e.group == "all_reduce/eager/small" && e.function == "raw" && e.bytes == Some(4096)
        })
        .unwrap();
    assert_eq!(e.param.as_deref(), Some("4096"));
    // The slope, in µs.
    assert!((e.time.us - 18.177_877).abs() < 1e-5, "{e:?}");
    assert!((e.time.lo_us - 18.056_472).abs() < 1e-5, "{e:?}");
    // Flat sampling: no slope, the mean.
    let e = entries
        .iter()
        .find(|e| e.group == "all_reduce/eager/large" && e.function == "ours")
        .unwrap();
    assert!((e.time.us - 123.992_595).abs() < 1e-5, "{e:?}");
    // A benchmark without a parameter or a throughput.
    let e = entries
        .iter()
        .find(|e| e.group == "barrier/eager" && e.function == "ours")
        .unwrap();
    assert_eq!((e.param.as_deref(), e.bytes), (None, None));
}

#[test]
fn the_tables_carry_criterion_s_numbers() {
    let (info, entries) = read_run(&fixture(), false, None).unwrap();
    assert_eq!(info.world, 2);
    let t = render(&info, &entries, None);
    // 4 KiB all-reduce: raw 18.18 µs, ours 23.65 µs; algbw 4096 B / t;
    // 2 ranks: busbw = algbw; ours/raw busbw = t_raw / t_ours; noise the
    // wider interval (ours: (26.11 - 22.34) / 23.65).
    let row = "| all_reduce | eager | 4 KiB | 18.18 | 23.65 | +5.47 | 0.23 | 0.23 | 0.17 | 0.17 | 0.769 | 16.0 |";
    assert!(t.contains(row), "{t}");
    assert!(
        t.contains("| all_reduce | eager | 64 KiB | 119.90 | 123.99 | +4.10 |"),
        "{t}"
    );
    assert!(
        t.contains("| send_recv | graph | 8 B | 9.02 | 19.76 |"),
        "{t}"
    );
    assert!(
        t.contains("| barrier | eager | 80.87 | 32.37 | -48.50 |"),
        "{t}"
    );
    // Sizes ascend within an operation.
    let small = t.find("| all_reduce | eager | 8 B |").unwrap();
    let large = t.find("| all_reduce | eager | 64 KiB |").unwrap();
    assert!(small < large, "{t}");
    // The paths: NCCL/fast = never / always; default vs the best path (this
    // fixture predates the one-shot column).
    assert!(
        t.contains("| 64 KiB | 160.09 | 123.94 | 237.84 | - | 126.83 | 0.521 | - | +2.3% | 0.52 |"),
        "{t}"
    );
    assert!(t.contains("METRALE_COMM_FAST_PATH=never"), "{t}");
    assert!(t.contains("METRALE_BENCH_QUICK"), "{t}");
}

#[test]
fn a_saved_baseline_is_compared_benchmark_by_benchmark() {
    let (info, entries) = read_run(&fixture(), false, Some("main")).unwrap();
    let with_base: Vec<_> = entries.iter().filter(|e| e.base.is_some()).collect();
    assert_eq!(with_base.len(), 2);
    let t = render(&info, &entries, Some("main"));
    // 1 / 1.10 - 1 = -9.1%, 1 / 1.25 - 1 = -20.0%, ours less raw -10.9.
    assert!(
        t.contains("| all_reduce/eager/small | 4 KiB | -9.1 | -20.0 | -10.9 | - | - | - |"),
        "{t}"
    );
    let (info, entries) = read_run(&fixture(), false, Some("nonexistent")).unwrap();
    assert!(entries.iter().all(|e| e.base.is_none()));
    let t = render(&info, &entries, Some("nonexistent"));
    assert!(
        t.contains("no benchmark of this run is in the baseline"),
        "{t}"
    );
}

#[test]
fn only_the_last_run_is_read_unless_all_is_asked() {
    assert!(read_entries(&fixture(), u64::MAX, None).unwrap().is_empty());
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tables-last-run");
    let _ = std::fs::remove_dir_all(&dir);
    // A run that began after the stored benchmarks were written finds none
    // of them; `--all` reads them anyway.
    let later = RunInfo {
        started_unix: u64::MAX / 2,
        ..RunInfo::read(&fixture()).unwrap()
    };
    copy_dir(&fixture(), &dir);
    later.write(&dir).unwrap();
    assert_eq!(RunInfo::read(&dir).unwrap(), later);
    assert!(read_run(&dir, false, None).is_err());
    assert_eq!(read_run(&dir, true, None).unwrap().1.len(), 18);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// Runs `bench-tables DIR --out OUT`, which must succeed.
fn bench_tables(dir: &Path, out: &Path) {
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_bench-tables"))
        .arg(dir)
        .arg("--out")
        .arg(out)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn bench_tables_writes_the_run_s_plots_beside_its_table() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tables-plots");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("tables.md");
    bench_tables(&fixture(), &out);
    assert!(out.is_file());
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    // The paths group of the fixture (eager): NCCL (`never`) and the fast
    // path (`always`); the machine is the run's GPUs.
    let svg = read("tables-all-reduce.svg");
    for want in [
        "NCCL, eager",
        "fast path, eager",
        "2 × Metrale emulated GPU",
        "(µs, log scale)",
    ] {
        assert!(svg.contains(want), "all-reduce plot: {want}");
    }
    // Bus bandwidth: the eager all-reduce, the graph send/recv.
    let svg = read("tables-busbw-eager.svg");
    for want in ["all_reduce, ours", "all_reduce, raw NCCL", "(GB/s"] {
        assert!(svg.contains(want), "eager bandwidth plot: {want}");
    }
    let svg = read("tables-busbw-graph.svg");
    assert!(svg.contains("send_recv, ours") && svg.contains("send_recv, raw NCCL"));
    assert!(!svg.contains("all_reduce, ours"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run whose default backend was tuned records the tuner's ranges in
/// its run file, and `bench-tables` shades them on the all-reduce plot; a
/// run file from before the tuner reads with none. (The fixture's path
/// sweep has 64 and 128 KiB; a band outside the data is clipped away.)
#[test]
fn the_tuner_s_ranges_of_a_run_are_shaded_on_its_all_reduce_plot() {
    assert!(RunInfo::read(&fixture()).unwrap().tuned.is_empty());
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tables-tuned");
    let _ = std::fs::remove_dir_all(&dir);
    copy_dir(&fixture(), &dir);
    let tuned = vec![
        TunedRun {
            min_bytes: 96 << 10,
            max_bytes: 128 << 10,
            path: "fast path".into(),
            mode: "eager".into(),
        },
        TunedRun {
            min_bytes: 64 << 10,
            max_bytes: 80 << 10,
            path: "one-shot".into(),
            mode: "graph".into(),
        },
    ];
    let info = RunInfo {
        tuned: tuned.clone(),
        ..RunInfo::read(&fixture()).unwrap()
    };
    info.write(&dir).unwrap();
    assert_eq!(RunInfo::read(&dir).unwrap().tuned, tuned);
    bench_tables(&dir, &dir.join("tables.md"));
    let svg = std::fs::read_to_string(dir.join("tables-all-reduce.svg")).unwrap();
    for want in [
        "tuned: fast path, eager",
        "tuned: one-shot, graph",
        "NCCL, eager",
    ] {
        assert!(svg.contains(want), "all-reduce plot: {want}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
