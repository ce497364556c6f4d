//! The emulated CUDA driver API, one module per part of the driver.
//!
//! # Layout
//! Lowest first; a module uses only modules of earlier lines
//! (`xtask/tests/imports.rs` checks that no import circles back):
//! - `errors` (result names and descriptions), `host` (the emulated host a
//!   process runs on: `NCCL_HOSTID`);
//! - `driver` (init, devices, primary contexts, the current context, peer
//!   access, each device's sticky error);
//! - `stream` (in-order queues with a worker thread each, the legacy
//!   streams, device-wide waits);
//! - `event` (markers in a queue), `graph` (capture, graphs, their
//!   launches), `memory` (the allocation registry, copies and memsets);
//! - `ipc` (CUDA IPC between processes, over `memory`'s exports).
//!
//! Nothing here knows NCCL or a kernel: `nccl` and `kernels` enqueue work
//! as `stream::Launcher`s and touch memory through `memory::access`.
//!
//! # Locks
//! The legacy streams' table, then the list of running streams
//! (`stream`); `ipc`'s state and the memory registry are never held
//! together; every other lock here is a leaf, and the memory registry is
//! the innermost lock of the crate (`memory`).

pub(crate) mod driver;
mod errors;
pub(crate) mod event;
pub(crate) mod graph;
mod host;
pub(crate) mod ipc;
pub(crate) mod memory;
pub(crate) mod stream;
