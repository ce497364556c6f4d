//! The `CommBackend` trait: what an engine calls to communicate.
//!
//! It keeps the seed's operations and their meaning. Device memory is passed
//! as raw device addresses (`u64`, a `CUdeviceptr`) and byte counts, streams
//! as raw `CUstream` handles (`u64`): the engine owns its tensors and streams.
//! Methods that trust such addresses or streams are `unsafe fn`; each says
//! what the caller guarantees.
//!
//! Invariants every implementation keeps:
//! - Bad input (sizes that are not whole elements, null or misaligned
//!   addresses, a root or peer out of range, sending to oneself, unknown
//!   handles, a second free) is a [`CommError::InvalidArgument`] or
//!   [`CommError::UnknownHandle`] and leaves a healthy backend healthy.
//! - A poisoned backend refuses every call with [`CommError::Poisoned`],
//!   carrying the first failure, without calling NCCL.
//! - No host wait is unbounded, except `recv_command_u32`, which idles until
//!   the root sends but returns promptly when the backend fails or shuts
//!   down.

use crate::error::CommError;
use nccl_safe::DataType;

/// The result of a backend call.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// Multi-GPU communication for one rank of a tensor-parallel group.
///
/// Object safe, `Send + Sync`: an engine holds it as `Arc<dyn CommBackend>`
/// and may call it from several threads. Calls from several threads are
/// serialised inside the backend (NCCL forbids concurrent calls on one
/// communicator). `group_start`, the operations of the group and `group_end`
/// must come from one thread.
pub trait CommBackend: Send + Sync {
    /// Sums `bytes` of bf16 in place across all ranks, on the backend's own
    /// stream. Returns once the work is enqueued; `synchronize` waits for it.
    ///
    /// # Safety
    /// `ptr` is a device address on this backend's GPU, valid for `bytes`
    /// bytes until the operation completes, and nothing else writes it
    /// meanwhile.
    unsafe fn all_reduce(&self, ptr: u64, bytes: usize) -> Result<()>;

    /// Like [`CommBackend::all_reduce`], ordered with the caller's
    /// `compute_stream`: the reduction starts after the work already queued
    /// on `compute_stream`, and later work on `compute_stream` starts after
    /// the reduction. Under CUDA graph capture of `compute_stream`, the
    /// reduction is captured on it and nothing waits on the host.
    ///
    /// # Safety
    /// As for `all_reduce`; `compute_stream` is a live stream of this
    /// backend's context.
    unsafe fn all_reduce_async(&self, ptr: u64, bytes: usize, compute_stream: u64) -> Result<()>;

    /// Registers a device buffer with the communicator (`ncclCommRegister`)
    /// and returns a handle for `deregister_buffer`.
    ///
    /// # Safety
    /// `ptr` is a device allocation of this backend's GPU, valid for `bytes`
    /// bytes until the handle is deregistered or the backend is dropped.
    unsafe fn register_buffer(&self, ptr: u64, bytes: usize) -> Result<u64>;

    /// Deregisters a handle from `register_buffer`, once: the handle is
    /// forgotten, and a second call is [`CommError::UnknownHandle`].
    fn deregister_buffer(&self, handle: u64) -> Result<()>;

    /// Allocates `bytes` of device memory suited to NCCL's symmetric and
    /// registered algorithms (`ncclMemAlloc`); freed by `symmetric_free` or
    /// when the backend is dropped.
    fn symmetric_alloc(&self, bytes: usize) -> Result<u64>;

    /// Frees memory from `symmetric_alloc`, once.
    fn symmetric_free(&self, ptr: u64) -> Result<()>;

    /// Replaces the bf16 add kernel of the 2-rank fast path with the
    /// engine's own. `function` is a `CUfunction`.
    ///
    /// # Safety
    /// `function` is a live `CUfunction` of this backend's context, with the
    /// parameters `(bf16* dst, const bf16* src, unsigned long long n)`, that
    /// computes `dst[i] += src[i]` for `i < n`, and stays loaded while the
    /// backend may launch it.
    unsafe fn set_add_kernel(&self, function: u64) -> Result<()>;

    /// Gathers `bytes` from every rank into `recv_ptr` (`bytes * world_size`
    /// bytes, rank order), on the backend's stream.
    ///
    /// # Safety
    /// `send_ptr` is valid for `bytes`, `recv_ptr` for `bytes * world_size`,
    /// both device memory of this backend's GPU, until the operation
    /// completes.
    unsafe fn all_gather(&self, send_ptr: u64, recv_ptr: u64, bytes: usize) -> Result<()>;

    /// Sums `recv_bytes * world_size` bytes of `dtype` elements across ranks
    /// and leaves this rank's `recv_bytes` share in `recv_ptr`, on the
    /// backend's stream.
    ///
    /// # Safety
    /// `send_ptr` is valid for `recv_bytes * world_size`, `recv_ptr` for
    /// `recv_bytes`, both device memory of this backend's GPU, until the
    /// operation completes.
    unsafe fn reduce_scatter(
        &self,
        send_ptr: u64,
        recv_ptr: u64,
        recv_bytes: usize,
        dtype: DataType,
    ) -> Result<()>;

    /// Copies `bytes` at `ptr` from `root` to every rank, and waits for it
    /// with the collective deadline.
    ///
    /// # Safety
    /// `ptr` is device memory of this backend's GPU, valid for `bytes`.
    unsafe fn broadcast(&self, ptr: u64, bytes: usize, root: usize) -> Result<()>;

    /// On a non-root rank: waits, with no deadline, until `root` broadcasts
    /// the next 4-byte command into `ptr`. Returns an error promptly if the
    /// communicator fails or the backend shuts down.
    ///
    /// # Safety
    /// `ptr` is device memory of this backend's GPU, valid for 4 bytes.
    unsafe fn recv_command_u32(&self, ptr: u64, root: usize) -> Result<()>;

    /// Returns once every rank has entered the barrier (a one-element
    /// all-reduce, waited for with the collective deadline).
    fn barrier(&self) -> Result<()>;

    /// Sends `bytes` at `ptr` to `dest_rank` on `stream`.
    ///
    /// # Safety
    /// `ptr` is device memory of this backend's GPU valid for `bytes` until
    /// the send completes; `stream` is a live stream of this backend's
    /// context.
    unsafe fn send_to(&self, ptr: u64, bytes: usize, dest_rank: usize, stream: u64) -> Result<()>;

    /// Receives `bytes` from `src_rank` into `ptr` on `stream`.
    ///
    /// # Safety
    /// As for `send_to`.
    unsafe fn recv_from(&self, ptr: u64, bytes: usize, src_rank: usize, stream: u64) -> Result<()>;

    /// Starts a group: the operations until `group_end` are launched
    /// together. Operations that wait for completion are refused inside a
    /// group ([`CommError::InGroup`]).
    fn group_start(&self) -> Result<()>;

    /// Ends the group started by `group_start` and launches its operations.
    fn group_end(&self) -> Result<()>;

    /// Waits, with the collective deadline, until all work the backend has
    /// enqueued on its own streams is complete.
    fn synchronize(&self) -> Result<()>;

    /// False once the backend is poisoned or shut down.
    fn is_healthy(&self) -> bool;

    /// Aborts the communicator and builds a new one with the other ranks
    /// (all ranks must call it). Clears the poison on success.
    fn attempt_reconnect(&self) -> Result<()>;

    /// Waits (bounded) for enqueued work, releases the communicator and
    /// everything the backend allocated. Later calls get
    /// [`CommError::Shutdown`]. Idempotent.
    fn shutdown(&self) -> Result<()>;

    /// This rank.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world_size(&self) -> usize;
}
