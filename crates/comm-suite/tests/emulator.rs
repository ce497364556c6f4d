//! The suite on the CPU emulator, inside `cargo test`: every scenario, in
//! the library's default enqueue mode, blocking (or in
//! `METRALE_COMM_ENQUEUE`'s).

mod common;

#[test]
fn every_scenario_on_the_emulator() {
    common::run_suite("emulator", |_| true);
}
