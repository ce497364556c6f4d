//! The collectives bench as a binary: the same harness as `cargo bench
//! --bench collectives` (`metrale_benches::collectives`), for the tests and
//! for running it outside cargo; it takes criterion's command line.
//!
//! Invariant: this file only calls the harness.

fn main() {
    std::process::exit(metrale_benches::collectives::main());
}
