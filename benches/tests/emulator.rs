//! The collectives bench end to end on the CPU emulator (crates/gpu-emu,
//! loaded as the driver and NCCL through `METRALE_CUDA_LIBRARY` and
//! `METRALE_NCCL_LIBRARY`): two emulated GPUs, `METRALE_BENCH_QUICK=1`
//! (smoke-test sizes and times), criterion writing into a temporary
//! directory, then the tables from what it wrote. About 10 s.
//!
//! Invariants: every planned group, function and size leaves criterion's
//! estimates behind; a world of one runs in criterion's test mode; asking
//! for more GPUs than there are is one line and exit 0; the run file
//! holds the default backend's tuned ranges. Nothing here judges the
//! emulator's times.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use metrale_benches::collectives::plan::{Caps, Sizes, groups};
use metrale_benches::tables::{read_run, render};

/// The emulator library cargo built for this test (a dev-dependency).
fn emulator() -> PathBuf {
    let exe = Path::new(env!("CARGO_BIN_EXE_collectives"));
    let dir = exe.parent().expect("the binary's directory");
    [dir.join("libgpu_emu.so"), dir.join("deps/libgpu_emu.so")]
        .into_iter()
        .find(|p| p.is_file())
        .expect("libgpu_emu.so beside the binary (cargo builds gpu-emu for this test)")
}

fn bench(devices: usize, criterion_home: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let emu = emulator();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_collectives"));
    cmd.args(args)
        .env("METRALE_CUDA_LIBRARY", &emu)
        .env("METRALE_NCCL_LIBRARY", &emu)
        .env("METRALE_EMU_DEVICES", devices.to_string())
        .env("METRALE_BENCH_QUICK", "1")
        .env("CRITERION_HOME", criterion_home)
        .env_remove("METRALE_BENCH_GPUS")
        .env_remove("METRALE_BENCH_ENQUEUE")
        .env_remove("METRALE_COMM_FAST_PATH");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run the bench")
}

fn tmp(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn two_emulated_gpus_run_every_group_and_the_tables_read_them() {
    let home = tmp("emu-criterion-2");
    // The default backend's tuner gets a cache of its own, empty: its
    // table is timed in this run, not read from an earlier one.
    let cache = tmp("emu-criterion-2-cache");
    let out = bench(
        2,
        &home,
        &[("XDG_CACHE_HOME", cache.to_str().expect("a UTF-8 path"))],
        &["--bench"],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.starts_with("collectives: 2 rank(s) on "), "{stdout}");
    let (info, entries) = read_run(&home, false, None).unwrap();
    assert_eq!((info.world, info.quick), (2, true));
    // What the tuner chose depends on this machine's times (the choice
    // itself is `tune_choice`'s to test, under injected costs); the run
    // file holds it as ranges of the ladder, one-shot up to 1 MiB in
    // either mode, the fast path eagerly up to 8 MiB.
    for t in &info.tuned {
        let most = match (t.path.as_str(), t.mode.as_str()) {
            ("one-shot", "eager" | "graph") => 1 << 20,
            ("fast path", "eager") => 8 << 20,
            _ => panic!("an unexpected tuned range: {t:?}"),
        };
        assert!(t.min_bytes <= t.max_bytes && t.max_bytes <= most, "{t:?}");
    }
    eprintln!("the default backend's tuned ranges: {:?}", info.tuned);
    let caps = Caps {
        world: 2,
        nccl_all_to_all: true,
    };
    let mut want = 0;
    for g in groups(caps, &Sizes::quick()) {
        for shape in &g.shapes {
            for (function, _) in &g.functions {
                want += 1;
                let found = entries.iter().any(|e| {
                    e.group == g.name
                        && &e.function == function
                        && (e.bytes == Some(shape.bytes) || g.op.collective().is_none())
                });
                assert!(
                    found,
                    "no estimate for {}/{function}/{}",
                    g.name, shape.bytes
                );
            }
        }
    }
    assert_eq!(entries.len(), want);
    let t = render(&info, &entries, None);
    for section in [
        "## Collectives, ours / raw",
        "| all_to_all_v | eager | 4 KiB |",
        "| send_recv | graph | 64 KiB |",
        "## Host-waited operations",
        "| command_u32 | eager |",
        "## 2-rank all-reduce paths, eager",
        "## 2-rank all-reduce paths, graph",
        "recommended: `METRALE_COMM_FAST_PATH=",
        "recommended: `METRALE_COMM_ONE_SHOT=",
    ] {
        assert!(t.contains(section), "{section}:\n{t}");
    }
    std::fs::remove_dir_all(&home).unwrap();
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn one_emulated_gpu_runs_the_one_rank_groups_in_test_mode() {
    let home = tmp("emu-criterion-1");
    // Without `--bench`, criterion runs each benchmark once.
    let out = bench(1, &home, &[], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("Testing all_reduce_async/graph/small/ours/8"),
        "{stdout}"
    );
    assert!(stdout.contains("Testing barrier/eager/ours"), "{stdout}");
    assert!(!stdout.contains("send_recv"), "{stdout}");
    assert!(!stdout.contains("all_reduce_paths"), "{stdout}");
    let _ = std::fs::remove_dir_all(&home);
}

#[test]
fn asking_for_more_gpus_than_there_are_is_one_line_and_exit_0() {
    let home = tmp("emu-criterion-needs");
    let out = bench(1, &home, &[("METRALE_BENCH_GPUS", "2")], &["--bench"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert_eq!(
        stdout,
        "collectives: needs 2 GPU(s), 1 visible; nothing to measure\n"
    );
    assert!(!home.exists());
}
