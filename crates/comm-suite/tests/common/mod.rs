//! The suite on the CPU emulator, shared by the test binaries that run it:
//! scenarios in threads mode at their emulator world sizes, one after
//! another (the emulator is process-global), each guarded by a deadline.
//!
//! Invariant: [`run_suite`] fails on any failed scenario and prints the
//! table and the counts either way.

use std::time::{Duration, Instant};

use comm_suite::{EmuControl, Outcome, run_threads, scenarios};

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
            let out = run_threads(&sc, w, Duration::from_secs(120), Some(emu));
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
