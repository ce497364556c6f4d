//! Tensor-parallel communication for Rust engines over NCCL.
//!
//! The policy layer of the stack: the [`CommBackend`] trait an engine calls
//! (as `dyn CommBackend`), [`NcclBackend`] over one NCCL communicator per
//! rank with the 2-rank send/recv + add fast path, deadlines on every
//! operation, poisoning, a flight recorder, rendezvous and reconnect, and
//! [`LocalBackend`] for a world of one.
//!
//! ```no_run
//! use metrale_comm::{BackendConfig, CommBackend, NcclBackend};
//! // The launcher's environment (torchrun, Slurm, MPI, ...); the device is its local rank.
//! let backend = NcclBackend::from_env(BackendConfig::new)?;
//! # let (ptr, bytes) = (0u64, 0usize);
//! // SAFETY: `ptr` is a device buffer of `bytes` bytes on this rank's GPU.
//! unsafe { backend.all_reduce(ptr, bytes)? };
//! backend.synchronize()?;
//! # Ok::<(), metrale_comm::CommError>(())
//! ```
//!
//! Invariants: see each module; `docs/architecture.md` gathers them.

pub mod backend;
pub mod config;
pub mod diagnostics;
pub mod error;
pub mod health;
pub mod kernels;
pub mod local_backend;
pub mod nccl_backend;
pub mod rendezvous;
mod validate;

pub use backend::CommBackend;
pub use config::{BackendConfig, EnqueueMode, FastPathPolicy};
pub use error::{CommError, Failure, FailureKind};
pub use local_backend::LocalBackend;
pub use nccl_backend::{AllReducePath, NcclBackend};
pub use nccl_safe::DataType;
