//! The emulated CUDA driver API.
//!
//! # Layout
//! `errors` (result names), `driver` (init, devices, primary contexts),
//! `stream` (streams, events, graphs), `memory` (the allocation registry,
//! copies and memsets), `ipc` (CUDA IPC between processes).

pub(crate) mod driver;
mod errors;
pub(crate) mod event;
pub(crate) mod graph;
pub(crate) mod ipc;
pub(crate) mod memory;
pub(crate) mod stream;
