//! Without a CUDA driver `cargo xtask gpu-test` and `cargo xtask bench`
//! print one line on stderr, nothing on stdout, and exit 2; gpu-test's line
//! points at `cargo test --workspace`. The driver is made missing by
//! pointing `METRALE_CUDA_LIBRARY` at a path that does not exist, so this
//! holds on a GPU box too.
//!
//! Invariant: nothing here builds or runs the suite; the refusal comes
//! before any build.

use std::process::Command;

/// Runs the xtask binary with `args` and no driver; returns (exit code,
/// stdout, stderr).
fn without_driver(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .env("METRALE_CUDA_LIBRARY", "/nonexistent/metrale-no-driver.so")
        .output()
        .expect("run xtask");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn gpu_test_refuses_in_one_line_with_exit_2() {
    for args in [&["gpu-test"][..], &["gpu-test", "--modes", "threads"]] {
        let (code, stdout, stderr) = without_driver(args);
        assert_eq!(code, Some(2), "{args:?}: stderr {stderr:?}");
        assert!(stdout.is_empty(), "{args:?}: stdout {stdout:?}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: stderr {stderr:?}");
        assert!(
            stderr.starts_with("gpu-test: no CUDA driver found")
                && stderr.contains("cargo test --workspace"),
            "{args:?}: stderr {stderr:?}"
        );
    }
}

#[test]
fn bench_refuses_in_one_line_with_exit_2() {
    let (code, stdout, stderr) = without_driver(&["bench"]);
    assert_eq!(code, Some(2), "stderr {stderr:?}");
    assert!(stdout.is_empty(), "stdout {stdout:?}");
    assert_eq!(stderr.lines().count(), 1, "stderr {stderr:?}");
    assert!(
        stderr.starts_with("bench: no CUDA driver found"),
        "stderr {stderr:?}"
    );
}
