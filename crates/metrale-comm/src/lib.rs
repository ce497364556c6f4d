//! Tensor-parallel communication for Rust engines over NCCL.
//!
//! The policy layer of the stack: the [`CommBackend`] trait an engine calls
//! (as `dyn CommBackend`), [`NcclBackend`] over one NCCL communicator per
//! rank with the one-shot all-reduce over peer memory (2-8 ranks of a
//! node) and the 2-rank send/recv + add fast path, deadlines on every
//! operation, poisoning, a flight recorder, rendezvous and reconnect, and
//! [`LocalBackend`] for a world of one.
//!
//! Memory crosses the API as typed views ([`DeviceView`], [`DeviceViewMut`]:
//! an address, a length and a [`DataType`]) and streams as borrowed
//! [`StreamRef`]s; owning nccl-safe types give them safely, and a raw
//! address or `CUstream` enters through one `unsafe fn from_raw` each.
//!
//! Two ranks as threads of one process, with a unique id the program
//! shares itself (a launcher's rendezvous does this across processes, see
//! [`NcclBackend::from_env`]). This runs under `cargo test` on the CPU
//! emulator, and on any box with two GPUs:
//!
//! ```
//! use half::bf16;
//! use metrale_comm::{BackendConfig, CommBackend, DeviceBuffer, NcclBackend, UniqueId};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! # if let Ok(p) = std::env::var("METRALE_DOCTEST_EMULATOR") {
//! #     if std::path::Path::new(&p).exists() && std::env::var_os("METRALE_CUDA_LIBRARY").is_none() {
//! #         // SAFETY: set before any thread starts or a library is opened.
//! #         unsafe { std::env::set_var("METRALE_CUDA_LIBRARY", &p); std::env::set_var("METRALE_NCCL_LIBRARY", &p) };
//! #     }
//! # }
//! # match nccl_safe::device_count() {
//! #     Ok(n) if n >= 2 => {}
//! #     other => { eprintln!("skipped: needs 2 GPUs or the emulator ({other:?})"); return Ok(()); }
//! # }
//! let id = UniqueId::new()?;
//! let ranks: Vec<_> = (0..2)
//!     .map(|rank| {
//!         let id = id.clone();
//!         std::thread::spawn(move || -> Result<Vec<bf16>, Box<dyn std::error::Error + Send + Sync>> {
//!             let backend = NcclBackend::with_unique_id(BackendConfig::new(rank), &id, rank, 2)?;
//!             let host = vec![bf16::from_f32(rank as f32 + 1.0); 1024];
//!             let mut x = DeviceBuffer::from_host(backend.context(), &host)?;
//!             backend.all_reduce(x.view_mut())?; // a typed view: no unsafe
//!             backend.synchronize()?;
//!             let sum = x.to_host_vec()?;
//!             backend.shutdown()?;
//!             Ok(sum)
//!         })
//!     })
//!     .collect();
//! for rank in ranks {
//!     let sum = rank.join().expect("rank thread")?;
//!     assert!(sum.iter().all(|v| *v == bf16::from_f32(3.0)));
//! }
//! # Ok(()) }
//! ```
//!
//! Every rank of a launched job builds its backend from the launcher's
//! environment (docs/operations.md, "Launching", has the precedence and a
//! command line per launcher):
//!
//! ```no_run
//! use metrale_comm::{BackendConfig, CommBackend, NcclBackend};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // The launcher's environment (torchrun, Slurm, MPI, Kubeflow); the
//! // device is its local rank (or METRALE_COMM_DEVICE).
//! let backend = NcclBackend::from_env(BackendConfig::new)?;
//! # Ok(()) }
//! ```
//!
//! A single GPU runs the same engine code on [`LocalBackend`], where every
//! reduction is the identity.
//!
//! Invariants: see each module; `docs/architecture.md` names the layers,
//! the contracts between them and which module docs hold the rest.

pub mod backend;
pub mod config;
pub mod diagnostics;
pub mod error;
#[cfg(feature = "bench-internals")]
pub mod health;
#[cfg(not(feature = "bench-internals"))]
mod health;
pub mod kernels;
pub mod local_backend;
pub mod nccl_backend;
pub mod norm;
pub mod timing;
mod validate;

/// The rendezvous: the store server and client, the `Rendezvous` trait and
/// launcher detection (the `metrale-rendezvous` crate).
pub use metrale_rendezvous as rendezvous;

pub use backend::{AddKernel, CommBackend, Group, Registration, Result, SymmetricAlloc};
pub use config::{BackendConfig, EnqueueMode, FastPathPolicy, OneShotPolicy, TuneCache};
pub use error::{CommError, Failure, FailureKind, InFlightElsewhere, Leak, LeakKind, Suspect};
pub use local_backend::LocalBackend;
pub use nccl_backend::{AllReducePath, LaunchMode, NcclBackend, PathRange, PathTable};
pub use nccl_safe::{
    Context, DataType, DeviceBuffer, DeviceView, DeviceViewMut, Error as NcclSafeError, Stream,
    StreamRef, UniqueId,
};
