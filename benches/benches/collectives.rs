//! `cargo bench -p metrale-benches --bench collectives`: the collectives
//! next to raw NCCL as criterion groups; the harness is
//! `metrale_benches::collectives` (see there for the groups, the timing
//! and the environment).
//!
//! Invariant: this file only calls the harness, so the `collectives`
//! binary that the tests run is the same program.

fn main() {
    std::process::exit(metrale_benches::collectives::main());
}
