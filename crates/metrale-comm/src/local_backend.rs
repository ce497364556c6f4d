//! `LocalBackend`: the [`CommBackend`] of a world of one, so an engine runs
//! unchanged on a single GPU without NCCL.
//!
//! Invariants: a reduction over one rank is the identity, so `all_reduce`
//! and `broadcast` validate their input and do nothing; `all_gather` and
//! `reduce_scatter` copy on the backend's stream (nothing when in place);
//! `all_reduce_add_rms_norm` is the provided one (the identity, then the
//! add + norm kernel on the caller's stream);
//! send and receive have no peer and are [`CommError::Unsupported`]. The
//! arguments of every other operation are checked by the same code as
//! `NcclBackend`'s (`validate`), before the backend's health.
//!
//! Lock order: none nested. `group`, `registered` and `allocations` are
//! leaves, each taken alone for one look-up, insert, removal or clear and
//! never held across another lock (a symmetric allocation removed or
//! cleared is freed under its lock, a driver call).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use nccl_safe::{Context, DeviceBuffer, DeviceView, DeviceViewMut, Stream, StreamRef};
use parking_lot::Mutex;

use crate::backend::{AddKernel, CommBackend, Registration, Result, SymmetricAlloc};
use crate::error::CommError;
use crate::validate::{self, Ranks, Span, check_alloc, check_register};

/// A one-rank backend (see the module docs).
pub struct LocalBackend {
    ctx: Arc<Context>,
    stream: Stream,
    shutdown: AtomicBool,
    /// The thread with a group open, and its depth.
    group: Mutex<Option<(std::thread::ThreadId, usize)>>,
    next_handle: AtomicU64,
    registered: Mutex<HashMap<u64, (u64, usize)>>,
    allocations: Mutex<HashMap<u64, DeviceBuffer<u8>>>,
    /// The add + norm kernels, loaded on first use (set once).
    norm: std::sync::OnceLock<crate::norm::NormKernels>,
}

impl std::fmt::Debug for LocalBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBackend")
            .field("device", &self.ctx.ordinal())
            .finish()
    }
}

impl LocalBackend {
    /// A one-rank backend on `device`.
    pub fn new(device: usize) -> Result<LocalBackend> {
        let setup = |stage| move |e: nccl_safe::Error| CommError::setup(stage, e);
        let ctx = Context::new(device).map_err(setup("CUDA context"))?;
        let stream = Stream::new(&ctx).map_err(setup("stream"))?;
        Ok(LocalBackend {
            ctx,
            stream,
            shutdown: AtomicBool::new(false),
            group: Mutex::new(None),
            next_handle: AtomicU64::new(1),
            registered: Mutex::new(HashMap::new()),
            allocations: Mutex::new(HashMap::new()),
            norm: std::sync::OnceLock::new(),
        })
    }

    /// The CUDA context of the device.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The backend's stream (where copies run).
    pub fn stream(&self) -> StreamRef<'_> {
        self.stream.as_ref()
    }

    fn check(&self, op: &'static str) -> Result<()> {
        if self.shutdown.load(Ordering::Acquire) {
            return Err(CommError::Shutdown { op });
        }
        Ok(())
    }

    /// Copies `bytes` device to device on the backend's stream.
    ///
    /// # Safety
    /// Both ranges are device memory of this context, valid for `bytes`.
    unsafe fn copy(&self, op: &'static str, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if dst == src || bytes == 0 {
            return Ok(());
        }
        let refused = |source| CommError::Refused { op, source };
        self.ctx.make_current().map_err(refused)?;
        let cuda = cuda_sys::cuda().map_err(|e| refused(e.into()))?;
        // SAFETY: both ranges are valid device memory (this function's
        // contract) and the stream is ours.
        let rc = unsafe {
            cuda_sys::call!(
                cuda,
                cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream.raw())
            )
        }
        .map_err(|e| refused(e.into()))?;
        nccl_safe::cuda_check(rc, "cuMemcpyDtoDAsync").map_err(refused)
    }
}

impl LocalBackend {
    /// True when the calling thread has a group open.
    fn in_own_group(&self) -> bool {
        self.group
            .lock()
            .is_some_and(|(owner, _)| owner == std::thread::current().id())
    }

    /// The one rank of the one-rank world, for the argument checks.
    const RANKS: Ranks = Ranks { rank: 0, size: 1 };
}

impl CommBackend for LocalBackend {
    fn all_reduce(&self, buf: DeviceViewMut<'_>) -> Result<()> {
        validate::all_reduce("all_reduce", Span::from(&buf))?;
        self.check("all_reduce")
    }

    fn all_reduce_async(&self, buf: DeviceViewMut<'_>, _compute: StreamRef<'_>) -> Result<()> {
        validate::all_reduce("all_reduce_async", Span::from(&buf))?;
        self.check("all_reduce_async")
    }

    fn add_rms_norm_kernels(&self) -> Result<&crate::norm::NormKernels> {
        self.check("all_reduce_add_rms_norm")?;
        crate::norm::kernels_in(&self.norm, &self.ctx)
    }

    unsafe fn register_buffer(&self, buf: DeviceView<'_>) -> Result<Registration> {
        const OP: &str = "register_buffer";
        let s = Span::from(&buf);
        check_register(OP, s)?;
        self.check(OP)?;
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.registered.lock().insert(handle, (s.ptr, s.bytes()));
        // SAFETY: a fresh handle, returned once.
        Ok(unsafe { Registration::from_raw(handle) })
    }

    fn deregister_buffer(&self, registration: Registration) -> Result<()> {
        const OP: &str = "deregister_buffer";
        self.check(OP)?;
        let handle = registration.as_raw();
        match self.registered.lock().remove(&handle) {
            Some(_) => Ok(()),
            None => Err(CommError::UnknownHandle { op: OP, handle }),
        }
    }

    fn symmetric_alloc(&self, bytes: usize) -> Result<SymmetricAlloc> {
        const OP: &str = "symmetric_alloc";
        check_alloc(OP, bytes)?;
        self.check(OP)?;
        let buf = DeviceBuffer::<u8>::alloc(&self.ctx, bytes)
            .map_err(|source| CommError::Refused { op: OP, source })?;
        let ptr = buf.device_ptr();
        self.allocations.lock().insert(ptr, buf);
        // SAFETY: a fresh allocation, handed out once.
        Ok(unsafe { SymmetricAlloc::from_raw(ptr, bytes) })
    }

    fn symmetric_free(&self, alloc: SymmetricAlloc) -> Result<()> {
        const OP: &str = "symmetric_free";
        self.check(OP)?;
        let ptr = alloc.ptr();
        match self.allocations.lock().remove(&ptr) {
            Some(_) => Ok(()),
            None => Err(CommError::UnknownHandle {
                op: OP,
                handle: ptr,
            }),
        }
    }

    fn set_add_kernel(&self, kernel: AddKernel) -> Result<()> {
        validate::add_kernel("set_add_kernel", &kernel)?;
        self.check("set_add_kernel")
    }

    fn all_gather(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>) -> Result<()> {
        const OP: &str = "all_gather";
        let (s, r) = (Span::from(&send), Span::from(&recv));
        validate::all_gather(OP, s, r, 1)?;
        self.check(OP)?;
        // SAFETY: both views hold `s.bytes()` (one rank: equal lengths,
        // checked) on this context.
        unsafe { self.copy(OP, r.ptr, s.ptr, s.bytes()) }
    }

    fn reduce_scatter(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let (s, r) = (Span::from(&send), Span::from(&recv));
        validate::reduce_scatter(OP, s, r, 1)?;
        self.check(OP)?;
        // SAFETY: as in all_gather.
        unsafe { self.copy(OP, r.ptr, s.ptr, s.bytes()) }
    }

    fn broadcast(&self, buf: DeviceViewMut<'_>, root: usize) -> Result<()> {
        validate::broadcast("broadcast", Span::from(&buf), root, 1)?;
        self.check("broadcast")
    }

    fn recv_command_u32(&self, buf: DeviceViewMut<'_>, root: usize) -> Result<()> {
        const OP: &str = "recv_command_u32";
        // The one rank is every command's root: this always refuses.
        validate::command(OP, Span::from(&buf), root, Self::RANKS)?;
        self.check(OP)
    }

    fn barrier(&self) -> Result<()> {
        if self.in_own_group() {
            return Err(CommError::InGroup { op: "barrier" });
        }
        self.check("barrier")
    }

    fn send_to(&self, _buf: DeviceView<'_>, _dest: usize, _stream: StreamRef<'_>) -> Result<()> {
        Err(CommError::Unsupported {
            op: "send_to",
            reason: "a world of one rank has no peer".into(),
        })
    }

    fn recv_from(
        &self,
        _buf: DeviceViewMut<'_>,
        _src: usize,
        _stream: StreamRef<'_>,
    ) -> Result<()> {
        Err(CommError::Unsupported {
            op: "recv_from",
            reason: "a world of one rank has no peer".into(),
        })
    }

    fn all_to_all(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>) -> Result<()> {
        const OP: &str = "all_to_all";
        let (s, r) = (Span::from(&send), Span::from(&recv));
        validate::all_to_all(OP, s, r, 1)?;
        self.check(OP)?;
        // SAFETY: as in all_gather.
        unsafe { self.copy(OP, r.ptr, s.ptr, s.bytes()) }
    }

    fn all_to_all_v(
        &self,
        send: DeviceView<'_>,
        send_counts: &[usize],
        recv: DeviceViewMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        const OP: &str = "all_to_all_v";
        let (s, r) = (Span::from(&send), Span::from(&recv));
        validate::all_to_all_v(OP, (s, send_counts), (r, recv_counts), Self::RANKS)?;
        self.check(OP)?;
        // SAFETY: `send_counts[0]` elements fit both views (checked).
        unsafe { self.copy(OP, r.ptr, s.ptr, send_counts[0] * s.dtype.size()) }
    }

    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Box<dyn CommBackend>>> {
        validate::split("split", color, key)?;
        self.check("split")?;
        match color {
            None => Ok(None),
            Some(_) => Ok(Some(Box::new(LocalBackend::new(self.ctx.ordinal())?))),
        }
    }

    fn group_start(&self) -> Result<()> {
        self.check("group_start")?;
        let me = std::thread::current().id();
        let mut group = self.group.lock();
        match group.as_mut() {
            Some((owner, depth)) if *owner == me => *depth += 1,
            Some(_) => {
                return Err(CommError::GroupBusy {
                    op: "group_start",
                    waited: std::time::Duration::ZERO,
                });
            }
            None => *group = Some((me, 1)),
        }
        Ok(())
    }

    fn group_end(&self) -> Result<()> {
        let me = std::thread::current().id();
        let mut group = self.group.lock();
        match group.as_mut() {
            Some((owner, depth)) if *owner == me => {
                *depth -= 1;
                if *depth == 0 {
                    *group = None;
                }
                Ok(())
            }
            _ => Err(CommError::InvalidArgument {
                op: "group_end",
                reason: "group_end without group_start on this thread".into(),
            }),
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.check("synchronize")?;
        self.stream
            .wait_until_idle(crate::config::DEFAULT_COLLECTIVE_TIMEOUT)
            .map_err(|source| CommError::Refused {
                op: "synchronize",
                source,
            })
    }

    fn is_healthy(&self) -> bool {
        !self.shutdown.load(Ordering::Acquire)
    }

    fn attempt_reconnect(&self) -> Result<()> {
        self.check("attempt_reconnect")
    }

    fn shutdown(&self) -> Result<()> {
        if self.shutdown.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let drained = self
            .stream
            .wait_until_idle(crate::config::DEFAULT_COLLECTIVE_TIMEOUT);
        self.registered.lock().clear();
        self.allocations.lock().clear();
        drained.map_err(|source| CommError::Refused {
            op: "shutdown",
            source,
        })
    }

    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }
}
