//! Scenarios on the `CommBackend` layer: every operation on random data
//! against a host reference, both all-reduce paths, sync and async, graph
//! capture replay, barriers, bad inputs, `LocalBackend`, the engine flow.
//! One file per part:
//! - `sweep`: the all-reduce sweep over both paths, and the same on
//!   blocking communicators;
//! - `operations`: every other operation, registration, symmetric memory,
//!   the engine's add kernel, barriers;
//! - `graph`: a captured all-reduce replayed;
//! - `bad_inputs`: the typed refusals, and calls after shutdown;
//! - `engine`: how an engine builds and drives a backend (`LocalBackend`,
//!   the command flow, a fixed unique id).
//!
//! Invariants: device buffers are poisoned (or overwritten with fresh
//! random data) before every operation and every element is checked.

use std::time::Duration;

mod bad_inputs;
mod engine;
mod graph;
mod operations;
mod sweep;

pub use bad_inputs::bad_inputs;
pub use engine::{engine_flow, fixed_unique_id, local_backend};
pub use graph::graph_replay;
pub use operations::{barrier_waits, every_operation};
pub use sweep::{all_reduce_sweep, blocking_enqueue};

/// Host waits for work that is expected to complete.
const WAIT: Duration = Duration::from_secs(60);
