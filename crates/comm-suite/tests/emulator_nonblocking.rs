//! The suite on the CPU emulator on non-blocking communicators
//! (`METRALE_COMM_ENQUEUE=nonblocking`, which every scenario's backend
//! configuration applies): every scenario whose code depends on the enqueue
//! mode. `emulator.rs` runs them in the default mode, blocking. Those that
//! pin their mode, and nccl-safe's own scenarios, run the same code as in
//! `emulator.rs` and are left out here.
//!
//! Invariant: this binary holds one test, which sets the environment before
//! it starts any thread.

mod common;

/// Scenarios that do not read the enqueue mode from the environment.
const SAME_IN_EVERY_MODE: &[&str] = &[
    "backend_all_reduce_sweep",
    "backend_every_operation",
    "backend_blocking_enqueue",
    "rel_blocking_stall",
    "rel_blocking_connect_stall",
    // Draws each backend's enqueue mode from its seed.
    "fuzz_schedules",
];

#[test]
fn every_mode_dependent_scenario_on_non_blocking_communicators() {
    // SAFETY: the only test of this binary sets it before it starts any
    // thread; the harness's other threads do not read the environment.
    unsafe { std::env::set_var("METRALE_COMM_ENQUEUE", "nonblocking") };
    common::run_suite("emulator, non-blocking", |name| {
        !name.starts_with("safe_") && !SAME_IN_EVERY_MODE.contains(&name)
    });
}
