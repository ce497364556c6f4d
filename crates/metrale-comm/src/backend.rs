//! The `CommBackend` trait: what an engine calls to communicate, and the
//! typed handles its methods take and return.
//!
//! Memory is passed as [`DeviceView`] / [`DeviceViewMut`] (an address, a
//! length in elements and their [`DataType`]), streams as [`StreamRef`]
//! (borrowed, like std's `BorrowedFd`), the add kernel as an [`AddKernel`],
//! and registrations and symmetric allocations as the owning handles
//! [`Registration`] and [`SymmetricAlloc`]. Each raw form enters through
//! one `unsafe fn from_raw` that states its contract once, so the
//! operations themselves are safe. Misuse that compiled with raw integers
//! does not compile now:
//!
//! ```compile_fail
//! # use metrale_comm::{CommBackend, Registration};
//! fn misuse(b: &dyn CommBackend, reg: Registration) {
//!     b.symmetric_free(reg); // a registration where an allocation belongs
//! }
//! ```
//!
//! ```compile_fail
//! # use metrale_comm::{CommBackend, DeviceViewMut, StreamRef};
//! fn misuse(b: &dyn CommBackend, buf: DeviceViewMut<'_>, s: StreamRef<'_>) {
//!     b.all_reduce_async(s, buf); // a stream where memory belongs
//! }
//! ```
//!
//! ```compile_fail
//! # use metrale_comm::{CommBackend, Registration};
//! fn twice(b: &dyn CommBackend, reg: Registration) {
//!     b.deregister_buffer(reg).ok();
//!     b.deregister_buffer(reg).ok(); // a handle is released once
//! }
//! ```
//!
//! Invariants every implementation keeps:
//! - Bad input (a view whose type the operation does not take, mismatched
//!   lengths or types, null or misaligned addresses, a root or peer out of
//!   range, sending to oneself, a handle of another backend) is a
//!   [`CommError::InvalidArgument`] or [`CommError::UnknownHandle`] and
//!   leaves a healthy backend healthy.
//! - A poisoned backend refuses every call with [`CommError::Poisoned`],
//!   carrying the first failure, without calling NCCL.
//! - No host wait is unbounded, except `recv_command_u32`, which idles until
//!   the root sends but returns promptly when the backend fails or shuts
//!   down.
//! - A group belongs to the thread that opened it: other threads' calls wait
//!   (bounded by the collective timeout) until it ends, and never see it.

use std::fmt;
use std::marker::PhantomData;

use nccl_safe::{DataType, DeviceView, DeviceViewMut, Function, StreamRef};

use crate::error::CommError;

/// The result of a backend call.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// Multi-GPU communication for one rank of a tensor-parallel group.
///
/// Object safe, `Send + Sync`: an engine holds it as `Arc<dyn CommBackend>`
/// and may call it from several threads. Calls from several threads are
/// serialised inside the backend (NCCL forbids concurrent calls on one
/// communicator); every rank must issue the same operations in the same
/// order. Reductions are sums.
pub trait CommBackend: Send + Sync {
    /// Sums `buf` in place across all ranks, on the backend's own stream.
    /// Takes every type NCCL reduces (bf16, f16, f32, ...); the 2-rank fast
    /// path serves bf16. Returns once the work is enqueued; `synchronize`
    /// waits for it.
    fn all_reduce(&self, buf: DeviceViewMut<'_>) -> Result<()>;

    /// Like [`CommBackend::all_reduce`], ordered with the caller's
    /// `compute_stream`: the reduction starts after the work already queued
    /// on `compute_stream`, and later work on `compute_stream` starts after
    /// the reduction (it runs on that stream). Under CUDA graph capture of
    /// `compute_stream`, the reduction is captured on it and nothing waits
    /// on the host. `synchronize` also waits for it.
    fn all_reduce_async(&self, buf: DeviceViewMut<'_>, compute_stream: StreamRef<'_>)
    -> Result<()>;

    /// The residual add + RMSNorm of a tensor-parallel layer after its
    /// all-reduce, on the caller's `stream` (ordered as
    /// [`CommBackend::all_reduce_async`]): `residual <- all_reduce(x) +
    /// residual`, then `x <- rms_norm(residual) * weight`, row by row over
    /// `hidden` = `weight`'s length, in f32 (the arithmetic of
    /// [`crate::norm`]). `x` and `residual` hold `tokens x hidden` values
    /// of bf16, f16 or f32, `weight` `hidden` of the same type; `hidden` is
    /// 1 to [`crate::norm::MAX_HIDDEN`]; `eps` finite and positive. Every
    /// rank's outputs are bit-identical.
    ///
    /// Provided: the all-reduce, then the add + norm kernel of
    /// [`CommBackend::add_rms_norm_kernels`]
    /// ([`crate::norm::all_reduce_then_norm`]); `NcclBackend` does both in
    /// one kernel on its one-shot path.
    fn all_reduce_add_rms_norm(
        &self,
        x: DeviceViewMut<'_>,
        residual: DeviceViewMut<'_>,
        weight: DeviceView<'_>,
        eps: f32,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        crate::norm::all_reduce_then_norm(self, x, residual, weight, eps, stream)
    }

    /// The add + norm kernels of this backend's context (loaded on first
    /// use), for [`CommBackend::all_reduce_add_rms_norm`]. Provided:
    /// [`CommError::Unsupported`].
    fn add_rms_norm_kernels(&self) -> Result<&crate::norm::NormKernels> {
        Err(CommError::Unsupported {
            op: "all_reduce_add_rms_norm",
            reason: "this backend has no add + norm kernels".into(),
        })
    }

    /// Registers device memory with the communicator (`ncclCommRegister`).
    ///
    /// # Safety
    /// The memory of `buf` is one device allocation that stays allocated
    /// until the registration is released (`deregister_buffer`, a
    /// reconnect, or the backend's shutdown).
    unsafe fn register_buffer(&self, buf: DeviceView<'_>) -> Result<Registration>;

    /// Releases a registration from `register_buffer`.
    fn deregister_buffer(&self, registration: Registration) -> Result<()>;

    /// Allocates `bytes` of device memory suited to NCCL's symmetric and
    /// registered algorithms (`ncclMemAlloc`); freed by `symmetric_free` or
    /// at shutdown.
    fn symmetric_alloc(&self, bytes: usize) -> Result<SymmetricAlloc>;

    /// Frees memory from `symmetric_alloc`.
    fn symmetric_free(&self, alloc: SymmetricAlloc) -> Result<()>;

    /// Replaces the bf16 add kernel of the 2-rank fast path.
    fn set_add_kernel(&self, kernel: AddKernel) -> Result<()>;

    /// Gathers `send` from every rank into `recv` (`world_size` times its
    /// length, rank order, the same type), on the backend's stream. Moves
    /// any type, fp8 included.
    fn all_gather(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>) -> Result<()>;

    /// Sums `send` (`world_size` times `recv`'s length, the same type)
    /// across ranks and leaves this rank's share in `recv`, on the backend's
    /// stream.
    fn reduce_scatter(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>) -> Result<()>;

    /// Copies `buf` from `root` to every rank, and waits for it with the
    /// collective deadline.
    fn broadcast(&self, buf: DeviceViewMut<'_>, root: usize) -> Result<()>;

    /// On a non-root rank: waits, with no deadline, until `root` broadcasts
    /// the next command into `buf` (one `u32`). Returns an error promptly if
    /// the communicator fails, is reconnected, or the backend shuts down.
    fn recv_command_u32(&self, buf: DeviceViewMut<'_>, root: usize) -> Result<()>;

    /// Returns once every rank has entered the barrier (a one-element
    /// all-reduce, waited for with the collective deadline).
    fn barrier(&self) -> Result<()>;

    /// Sends `buf` to `dest_rank` on `stream`.
    fn send_to(&self, buf: DeviceView<'_>, dest_rank: usize, stream: StreamRef<'_>) -> Result<()>;

    /// Receives into `buf` from `src_rank` on `stream`.
    fn recv_from(
        &self,
        buf: DeviceViewMut<'_>,
        src_rank: usize,
        stream: StreamRef<'_>,
    ) -> Result<()>;

    /// All-to-all with equal counts, on the backend's stream: `send` and
    /// `recv` hold `world_size` equal blocks; block `j` of `send` goes to
    /// rank `j`, and block `i` of `recv` comes from rank `i`.
    fn all_to_all(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>) -> Result<()>;

    /// All-to-all with per-peer counts (expert parallelism), on the
    /// backend's stream: `send_counts[j]` elements go to rank `j` from the
    /// `j`-th block of `send` (blocks packed in rank order), and
    /// `recv_counts[i]` elements from rank `i` land in the `i`-th block of
    /// `recv`. Every rank's `send_counts[j]` must equal rank `j`'s
    /// `recv_counts[i]`.
    fn all_to_all_v(
        &self,
        send: DeviceView<'_>,
        send_counts: &[usize],
        recv: DeviceViewMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()>;

    /// Splits the ranks into sub-groups (every rank calls it): ranks with
    /// the same `color` form a new backend, ordered by `key` then rank; each
    /// is a full backend with its own deadlines, poisoning and flight
    /// recorder. `None` takes part without joining and returns `Ok(None)`.
    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Box<dyn CommBackend>>>;

    /// Starts a group on the calling thread: its operations until
    /// `group_end` are launched together. Operations that wait for
    /// completion are refused inside a group ([`CommError::InGroup`]). The
    /// [`Group`] guard pairs the two calls.
    fn group_start(&self) -> Result<()>;

    /// Ends the calling thread's group and launches its operations.
    fn group_end(&self) -> Result<()>;

    /// Waits, with the collective deadline, until all work the backend has
    /// enqueued is complete: on its own stream, and its operations on
    /// callers' streams (`all_reduce_async`, `send_to`, `recv_from`).
    fn synchronize(&self) -> Result<()>;

    /// False once the backend is poisoned or shut down.
    fn is_healthy(&self) -> bool;

    /// Aborts the communicator and builds a new one with the other ranks
    /// (all ranks must call it). Clears the poison on success.
    fn attempt_reconnect(&self) -> Result<()>;

    /// Waits (bounded) for enqueued work, releases the communicator and
    /// everything the backend allocated. Later calls get
    /// [`CommError::Shutdown`]. Idempotent. `Ok` means everything was
    /// released; [`CommError::Leaked`] names what was left allocated and
    /// why (memory a peer may still map after a peer's failure, work that
    /// did not drain). After a failure (the backend poisoned) it does not
    /// wait for peers and returns within about a second.
    fn shutdown(&self) -> Result<()>;

    /// This rank.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world_size(&self) -> usize;
}

/// A buffer registered with a backend's communicator. Released once, by
/// [`CommBackend::deregister_buffer`]; it is neither `Copy` nor `Clone`.
#[derive(PartialEq, Eq, Hash)]
pub struct Registration {
    raw: u64,
}

impl Registration {
    /// A handle from the raw value `as_raw` returned.
    ///
    /// # Safety
    /// `raw` came from [`Registration::as_raw`] of a handle that was then
    /// forgotten, so that this is the only handle for it.
    pub unsafe fn from_raw(raw: u64) -> Registration {
        Registration { raw }
    }

    /// The raw value (NCCL's registration handle).
    pub fn as_raw(&self) -> u64 {
        self.raw
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Registration({:#x})", self.raw)
    }
}

/// Device memory from [`CommBackend::symmetric_alloc`]. Freed once, by
/// [`CommBackend::symmetric_free`] (or at shutdown); views borrow it, so it
/// cannot be freed while one is in use.
#[derive(PartialEq, Eq, Hash)]
pub struct SymmetricAlloc {
    ptr: u64,
    bytes: usize,
}

impl SymmetricAlloc {
    /// A handle from the raw address and size `ptr()` and `bytes()`
    /// returned.
    ///
    /// # Safety
    /// `ptr` and `bytes` came from a handle that was then forgotten, so that
    /// this is the only handle for the allocation.
    pub unsafe fn from_raw(ptr: u64, bytes: usize) -> SymmetricAlloc {
        SymmetricAlloc { ptr, bytes }
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The memory as `bytes / dtype.size()` elements of `dtype`.
    pub fn view(&self, dtype: DataType) -> DeviceView<'_> {
        // SAFETY: the allocation is device memory of `bytes` bytes that
        // stays allocated while this borrow lives (it is freed only by
        // consuming the handle).
        unsafe { DeviceView::from_raw(self.ptr, self.bytes / dtype.size(), dtype) }
    }

    /// The memory as `bytes / dtype.size()` writable elements of `dtype`.
    pub fn view_mut(&mut self, dtype: DataType) -> DeviceViewMut<'_> {
        // SAFETY: as in `view`; the exclusive borrow makes this the only
        // view.
        unsafe { DeviceViewMut::from_raw(self.ptr, self.bytes / dtype.size(), dtype) }
    }
}

impl fmt::Debug for SymmetricAlloc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SymmetricAlloc({:#x}, {} bytes)", self.ptr, self.bytes)
    }
}

/// The fast path's bf16 add kernel: `dst[i] = bf16(f32(dst[i]) +
/// f32(src[i]))` for `i < n`, with parameters `(bf16* dst, const bf16* src,
/// unsigned long long n)`.
pub struct AddKernel(pub(crate) KernelSource);

pub(crate) enum KernelSource {
    /// A loaded function; it keeps its module loaded.
    Owned(Function),
    /// A `CUfunction` the engine vouches for.
    Raw(cuda_sys::CUfunction),
}

// SAFETY: a CUfunction may be launched from any thread; `from_raw`'s
// contract keeps it loaded while the backend holds it.
unsafe impl Send for KernelSource {}
// SAFETY: as above; launching does not mutate the handle.
unsafe impl Sync for KernelSource {}

impl AddKernel {
    /// A kernel loaded through nccl-safe (it keeps its module loaded).
    pub fn new(function: Function) -> AddKernel {
        AddKernel(KernelSource::Owned(function))
    }

    /// An engine's own kernel.
    ///
    /// # Safety
    /// `function` is a `CUfunction` of the backend's context with the
    /// parameters and arithmetic in the type's docs, and stays loaded until
    /// the backend is shut down or its kernel replaced.
    pub unsafe fn from_raw(function: cuda_sys::CUfunction) -> AddKernel {
        AddKernel(KernelSource::Raw(function))
    }

    pub(crate) fn raw(&self) -> cuda_sys::CUfunction {
        match &self.0 {
            KernelSource::Owned(f) => f.raw(),
            KernelSource::Raw(f) => *f,
        }
    }
}

impl fmt::Debug for AddKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AddKernel({:p})", self.raw())
    }
}

/// A group on the calling thread: [`CommBackend::group_start`] when made,
/// [`CommBackend::group_end`] by [`Group::end`] or on drop (which logs a
/// failure). Not `Send`: a group belongs to the thread that opened it.
///
/// ```no_run
/// # use metrale_comm::{CommBackend, Group};
/// # fn f(b: &dyn CommBackend, x: nccl_safe::DeviceView<'_>, y: nccl_safe::DeviceViewMut<'_>,
/// #      s: nccl_safe::StreamRef<'_>) -> metrale_comm::Result<()> {
/// let group = Group::start(b)?;
/// b.send_to(x, 1, s)?;
/// b.recv_from(y, 1, s)?;
/// group.end()?; // both launched together
/// # Ok(()) }
/// ```
pub struct Group<'a> {
    backend: &'a dyn CommBackend,
    open: bool,
    _thread_bound: PhantomData<*const ()>,
}

impl<'a> Group<'a> {
    /// Starts a group on `backend`.
    pub fn start(backend: &'a dyn CommBackend) -> Result<Group<'a>> {
        backend.group_start()?;
        Ok(Group {
            backend,
            open: true,
            _thread_bound: PhantomData,
        })
    }

    /// Ends the group, launching its operations.
    pub fn end(mut self) -> Result<()> {
        self.open = false;
        self.backend.group_end()
    }
}

impl Drop for Group<'_> {
    fn drop(&mut self) {
        if self.open
            && let Err(e) = self.backend.group_end()
        {
            tracing::warn!("ending a group on drop failed: {e}");
        }
    }
}

impl fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group").field("open", &self.open).finish()
    }
}
