//! The suite on the CPU emulator, shared by the test binaries that run it:
//! scenarios in threads mode at their emulator world sizes, one after
//! another (the emulator is process-global), each guarded by a deadline.
//! Scenarios whose failure can crash the process run in a child process
//! (`comm-suite threads`), so that a crash fails that scenario only.
//!
//! Invariants: [`run_suite`] fails on any failed scenario and prints the
//! table and the counts either way; a child is killed when its deadline
//! (plus a grace period for its own hang report) passes.

use std::os::unix::process::ExitStatusExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use comm_suite::orchestrator::{DIR_ENV, SKIP_CODE};
use comm_suite::scenarios::fuzz;
use comm_suite::{EmuControl, Outcome, Scenario, analyze_dumps, run_threads, scenarios};

/// The deadline of one scenario run.
const DEADLINE: Duration = Duration::from_secs(120);

/// Scenarios run in a child process: on a backend with the defects they
/// are about (issue #14), their failure can be a use after free on the
/// emulated device, which kills the process.
const IN_A_CHILD: &[&str] = &[
    "int_fast_path_streams",
    "int_mismatch_reported",
    "int_shutdown_after_failure",
    "int_reconnect_aborts_waiters",
    "int_shutdown_idle_worker",
    "fuzz_schedules",
];

/// The deadline of the path tuner's scenario: each of its set-ups times
/// the whole ladder, which on the emulator is memory copies on the CPU
/// (worlds 2-4 took 78-111 s and more than 120 s in CI's lanes on 2 cores).
const TUNE_DEADLINE: Duration = Duration::from_secs(300);

/// The deadline of `name`'s run: the fuzzer's grows with its time budget
/// (`METRALE_FUZZ_SECS`); the tuner's is [`TUNE_DEADLINE`].
fn deadline(name: &str) -> Duration {
    match name {
        "fuzz_schedules" => DEADLINE.max(fuzz::run_limit()),
        "tune_choice" => TUNE_DEADLINE,
        _ => DEADLINE,
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGABRT => "SIGABRT",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        _ => "signal",
    }
}

/// Where each rank of a run in `dir` was, the tail of the child's output
/// and the flight-recorder analysis.
fn post_mortem(dir: &Path, world: usize) -> String {
    let mut msg = String::from("where the ranks were:");
    for r in 0..world {
        let st = std::fs::read_to_string(dir.join(format!("status-rank{r}")))
            .unwrap_or_else(|_| format!("rank {r}: no status"));
        msg.push_str(&format!("\n  {st}"));
    }
    let log = std::fs::read_to_string(dir.join("child.log")).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    msg.push_str("\nthe child's last output:");
    for l in &lines[lines.len().saturating_sub(30)..] {
        msg.push_str(&format!("\n  | {l}"));
    }
    msg.push('\n');
    msg.push_str(&analyze_dumps(&dir.join("dumps")));
    msg
}

/// Runs `sc` with `world` ranks as threads of a child `comm-suite threads`
/// process on the emulator. Lines of the child's output that begin with the
/// scenario's name (its report lines) are passed on to stderr.
fn run_in_child(sc: &Scenario, world: usize, timeout: Duration) -> Outcome {
    let dir = match comm_suite::fresh_run_dir(sc.name) {
        Ok(d) => d,
        Err(e) => return Outcome::Fail(format!("{e:#}")),
    };
    let log = match std::fs::File::create(dir.join("child.log")) {
        Ok(f) => f,
        Err(e) => return Outcome::Fail(format!("creating the child's log: {e}")),
    };
    let err = match log.try_clone() {
        Ok(f) => f,
        Err(e) => return Outcome::Fail(format!("the child's log: {e}")),
    };
    let spawned = Command::new(env!("CARGO_BIN_EXE_comm-suite"))
        .args([
            "threads",
            "--world",
            &world.to_string(),
            "--scenario",
            sc.name,
        ])
        .args(["--timeout", &timeout.as_secs().to_string(), "--emulator"])
        .env(DIR_ENV, &dir)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => return Outcome::Fail(format!("spawning comm-suite threads: {e}")),
    };
    // The child enforces the deadline itself and reports where its ranks
    // were; it is killed if it cannot.
    let kill_at = Instant::now() + timeout + Duration::from_secs(15);
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if Instant::now() < kill_at => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Err(e) => return Outcome::Fail(format!("waiting for the child: {e}")),
        }
    };
    let result = std::fs::read_to_string(dir.join("result-threads")).unwrap_or_default();
    let out = match status {
        None => Outcome::Fail(format!(
            "the child did not exit within {timeout:?}; killed. {}",
            post_mortem(&dir, world)
        )),
        Some(st) => match (st.code(), st.signal()) {
            (Some(0), _) => Outcome::Pass,
            (Some(SKIP_CODE), _) => Outcome::Skip(result.trim_start_matches("SKIP ").to_string()),
            (Some(_), _) if !result.is_empty() => {
                Outcome::Fail(result.trim_start_matches("FAIL ").to_string())
            }
            (Some(c), _) => Outcome::Fail(format!(
                "the child exited with {c} and no result. {}",
                post_mortem(&dir, world)
            )),
            (None, sig) => {
                let sig = sig.unwrap_or(0);
                Outcome::Fail(format!(
                    "the process crashed: killed by signal {sig} ({}). {}",
                    signal_name(sig),
                    post_mortem(&dir, world)
                ))
            }
        },
    };
    let report: String = std::fs::read_to_string(dir.join("child.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with(sc.name))
        .map(|l| format!("{l}\n"))
        .collect();
    let _ = std::io::Write::write_all(&mut std::io::stderr(), report.as_bytes());
    if matches!(out, Outcome::Fail(_)) {
        eprintln!("comm-suite: {} kept at {}", sc.name, dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    out
}

/// Runs every scenario `include` accepts (and `COMM_SUITE_SCENARIOS`
/// names, when set); `label` names the run in the table and the count.
pub fn run_suite(label: &str, include: impl Fn(&str) -> bool) {
    let emu = EmuControl::install().expect("the emulator library");
    let only = std::env::var("COMM_SUITE_SCENARIOS").ok();
    let mut rows = Vec::new();
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    let mut failures = Vec::new();
    let total = Instant::now();
    for sc in scenarios() {
        if !include(sc.name) {
            continue;
        }
        if let Some(only) = &only
            && !only.split(',').any(|n| n == sc.name)
        {
            continue;
        }
        let worlds: Vec<usize> = if sc.emu_worlds.is_empty() {
            vec![2]
        } else {
            sc.emu_worlds.to_vec()
        };
        for w in worlds {
            let t = Instant::now();
            let timeout = deadline(sc.name);
            let out = if IN_A_CHILD.contains(&sc.name) {
                run_in_child(&sc, w, timeout)
            } else {
                run_threads(&sc, w, timeout, Some(emu))
            };
            let took = t.elapsed();
            let name = format!("{} (w={w})", sc.name);
            println!("{name:<40} {} {:.1}s", out.label(), took.as_secs_f64());
            match &out {
                Outcome::Pass => passed += 1,
                Outcome::Skip(r) => {
                    println!("    skipped: {r}");
                    skipped += 1
                }
                Outcome::Fail(m) => {
                    println!("    {}", m.replace('\n', "\n    "));
                    failures.push(format!("{name}: {m}"));
                    failed += 1
                }
            }
            rows.push((name, vec![Some((out, took))]));
        }
    }
    // Written to stderr directly, not through `println!`, so the table and
    // the count show in `cargo test` output even when the test passes (the
    // test harness captures only the print macros).
    let summary = format!(
        "\n{}\ncomm-suite on the {label}: {} scenarios, {passed} passed, {failed} failed, {skipped} skipped ({:.0}s)\n",
        comm_suite::table(&[label.to_string()], &rows),
        rows.len(),
        total.elapsed().as_secs_f64()
    );
    let _ = std::io::Write::write_all(&mut std::io::stderr(), summary.as_bytes());
    assert!(
        failures.is_empty(),
        "failed scenarios:\n{}",
        failures.join("\n")
    );
}
