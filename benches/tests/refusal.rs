//! Without a CUDA driver the collectives bench prints one line on stdout
//! and exits 0, before criterion starts, so `cargo bench --workspace`
//! passes on a machine without GPUs. The driver is made missing by pointing
//! `METRALE_CUDA_LIBRARY` at a path that does not exist, so this holds on a
//! GPU box too.
//!
//! Invariant: the binary run is `collectives`, the same harness as `cargo
//! bench --bench collectives`.

use std::process::Command;

#[test]
fn without_a_driver_the_bench_says_so_in_one_line_and_exits_0() {
    for args in [&["--bench"][..], &[][..], &["--bench", "all_reduce/"][..]] {
        let out = Command::new(env!("CARGO_BIN_EXE_collectives"))
            .args(args)
            .env("METRALE_CUDA_LIBRARY", "/nonexistent/metrale-no-driver.so")
            .env_remove("METRALE_BENCH_GPUS")
            .output()
            .expect("run the bench");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {stdout:?} {stderr:?}"
        );
        assert_eq!(stdout.lines().count(), 1, "{args:?}: {stdout:?}");
        assert!(
            stdout.starts_with("collectives: no CUDA driver (")
                && stdout.trim_end().ends_with("nothing to measure"),
            "{args:?}: {stdout:?}"
        );
        assert!(stderr.is_empty(), "{args:?}: {stderr:?}");
    }
}
