//! `LocalBackend`: the [`CommBackend`] of a world of one, so an engine runs
//! unchanged on a single GPU without NCCL.
//!
//! Invariants: a reduction over one rank is the identity, so `all_reduce`
//! and `broadcast` validate their input and do nothing; `all_gather` and
//! `reduce_scatter` copy on the backend's stream (nothing when in place);
//! send and receive have no peer and are [`CommError::Unsupported`]. Input is
//! validated exactly as `NcclBackend` validates it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use nccl_safe::{Context, DataType, DeviceBuffer, Stream};
use parking_lot::Mutex;

use crate::backend::{CommBackend, Result};
use crate::error::CommError;
use crate::validate::{check_alloc, check_buffer, check_function, check_rank, check_register};

/// A one-rank backend (see the module docs).
pub struct LocalBackend {
    ctx: Arc<Context>,
    stream: Stream,
    shutdown: AtomicBool,
    group_depth: AtomicUsize,
    next_handle: AtomicU64,
    registered: Mutex<HashMap<u64, (u64, usize)>>,
    allocations: Mutex<HashMap<u64, DeviceBuffer<u8>>>,
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
        let setup = |stage| {
            move |e: nccl_safe::Error| CommError::Setup {
                stage,
                message: e.to_string(),
            }
        };
        let ctx = Context::new(device).map_err(setup("CUDA context"))?;
        let stream = Stream::new(&ctx).map_err(setup("stream"))?;
        Ok(LocalBackend {
            ctx,
            stream,
            shutdown: AtomicBool::new(false),
            group_depth: AtomicUsize::new(0),
            next_handle: AtomicU64::new(1),
            registered: Mutex::new(HashMap::new()),
            allocations: Mutex::new(HashMap::new()),
        })
    }

    /// The CUDA context of the device.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The backend's stream (where copies run).
    pub fn stream(&self) -> u64 {
        self.stream.raw() as u64
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

impl CommBackend for LocalBackend {
    unsafe fn all_reduce(&self, ptr: u64, bytes: usize) -> Result<()> {
        check_buffer("all_reduce", "buffer", ptr, bytes, 2)?;
        self.check("all_reduce")
    }

    unsafe fn all_reduce_async(&self, ptr: u64, bytes: usize, _compute_stream: u64) -> Result<()> {
        check_buffer("all_reduce_async", "buffer", ptr, bytes, 2)?;
        self.check("all_reduce_async")
    }

    unsafe fn register_buffer(&self, ptr: u64, bytes: usize) -> Result<u64> {
        const OP: &str = "register_buffer";
        check_register(OP, ptr, bytes)?;
        self.check(OP)?;
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.registered.lock().insert(handle, (ptr, bytes));
        Ok(handle)
    }

    fn deregister_buffer(&self, handle: u64) -> Result<()> {
        const OP: &str = "deregister_buffer";
        self.check(OP)?;
        match self.registered.lock().remove(&handle) {
            Some(_) => Ok(()),
            None => Err(CommError::UnknownHandle { op: OP, handle }),
        }
    }

    fn symmetric_alloc(&self, bytes: usize) -> Result<u64> {
        const OP: &str = "symmetric_alloc";
        check_alloc(OP, bytes)?;
        self.check(OP)?;
        let buf = DeviceBuffer::<u8>::alloc(&self.ctx, bytes)
            .map_err(|source| CommError::Refused { op: OP, source })?;
        let ptr = buf.device_ptr();
        self.allocations.lock().insert(ptr, buf);
        Ok(ptr)
    }

    fn symmetric_free(&self, ptr: u64) -> Result<()> {
        const OP: &str = "symmetric_free";
        self.check(OP)?;
        match self.allocations.lock().remove(&ptr) {
            Some(_) => Ok(()),
            None => Err(CommError::UnknownHandle {
                op: OP,
                handle: ptr,
            }),
        }
    }

    unsafe fn set_add_kernel(&self, function: u64) -> Result<()> {
        check_function("set_add_kernel", function)?;
        self.check("set_add_kernel")
    }

    unsafe fn all_gather(&self, send_ptr: u64, recv_ptr: u64, bytes: usize) -> Result<()> {
        const OP: &str = "all_gather";
        check_buffer(OP, "send buffer", send_ptr, bytes, 1)?;
        check_buffer(OP, "receive buffer", recv_ptr, bytes, 1)?;
        self.check(OP)?;
        // SAFETY: both buffers hold `bytes` (one rank: the trait's sizes).
        unsafe { self.copy(OP, recv_ptr, send_ptr, bytes) }
    }

    unsafe fn reduce_scatter(
        &self,
        send_ptr: u64,
        recv_ptr: u64,
        recv_bytes: usize,
        dtype: DataType,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        check_buffer(OP, "receive buffer", recv_ptr, recv_bytes, dtype.size())?;
        check_buffer(OP, "send buffer", send_ptr, recv_bytes, dtype.size())?;
        self.check(OP)?;
        // SAFETY: both buffers hold `recv_bytes` (one rank).
        unsafe { self.copy(OP, recv_ptr, send_ptr, recv_bytes) }
    }

    unsafe fn broadcast(&self, ptr: u64, bytes: usize, root: usize) -> Result<()> {
        check_buffer("broadcast", "buffer", ptr, bytes, 1)?;
        check_rank("broadcast", "root", root, 1)?;
        self.check("broadcast")
    }

    unsafe fn recv_command_u32(&self, ptr: u64, root: usize) -> Result<()> {
        const OP: &str = "recv_command_u32";
        check_buffer(OP, "buffer", ptr, 4, 1)?;
        check_rank(OP, "root", root, 1)?;
        Err(CommError::InvalidArgument {
            op: OP,
            reason: "rank 0 is the root: only other ranks receive commands".into(),
        })
    }

    fn barrier(&self) -> Result<()> {
        if self.group_depth.load(Ordering::Acquire) > 0 {
            return Err(CommError::InGroup { op: "barrier" });
        }
        self.check("barrier")
    }

    unsafe fn send_to(
        &self,
        _ptr: u64,
        _bytes: usize,
        _dest_rank: usize,
        _stream: u64,
    ) -> Result<()> {
        Err(CommError::Unsupported {
            op: "send_to",
            reason: "a world of one rank has no peer".into(),
        })
    }

    unsafe fn recv_from(
        &self,
        _ptr: u64,
        _bytes: usize,
        _src_rank: usize,
        _stream: u64,
    ) -> Result<()> {
        Err(CommError::Unsupported {
            op: "recv_from",
            reason: "a world of one rank has no peer".into(),
        })
    }

    fn group_start(&self) -> Result<()> {
        self.check("group_start")?;
        self.group_depth.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    fn group_end(&self) -> Result<()> {
        let ended = self
            .group_depth
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| d.checked_sub(1));
        match ended {
            Ok(_) => Ok(()),
            Err(_) => Err(CommError::InvalidArgument {
                op: "group_end",
                reason: "group_end without group_start".into(),
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
