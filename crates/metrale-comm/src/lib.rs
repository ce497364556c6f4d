//! Tensor-parallel communication for Rust engines over NCCL.
//!
//! Placeholder while the layers land.

pub mod diagnostics;
pub mod rendezvous;
