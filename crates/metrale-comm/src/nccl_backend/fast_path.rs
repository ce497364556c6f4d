//! The 2-rank fast path: a grouped send/recv of the whole buffer into the
//! scratch buffer, then the bf16 add kernel, chunk by chunk. [`FastPath`]
//! owns what it needs: the add kernel, the scratch buffer, and the event
//! and stream that order the scratch buffer's reuse. When it is taken is
//! `path`'s choice.
//!
//! Invariants:
//! - The scratch buffer is allocated once, at its final size (at
//!   construction or `set_add_kernel`), never under capture, and freed only
//!   after the teardown drained the work that uses it.
//! - Its reuse is ordered: every fast path records `scratch_free` after its
//!   last add, and a fast path on another stream waits for it first (NCCL
//!   orders its own kernels by issue, not the add kernel behind them).
//! - It lives in the slot, so every use is under the slot lock.

use std::sync::Arc;
use std::time::Duration;

use cuda_sys::CUstream;
use half::bf16;
use nccl_safe::{Comm, Context, DataType, DeviceBuffer, Event, Module};

use crate::backend::AddKernel;
use crate::config::BackendConfig;
use crate::kernels;
use crate::validate::Span;

/// The fast path's kernel and scratch buffer.
pub(super) struct FastPath {
    /// The add kernel; `None` turns the fast path off.
    kernel: Option<AddKernel>,
    scratch: Option<DeviceBuffer<bf16>>,
    /// Recorded after the last fast-path kernel that reads `scratch`.
    scratch_free: Event,
    /// The stream `scratch_free` was last recorded on; `None` before the
    /// first use.
    scratch_stream: Option<CUstream>,
}

// SAFETY: the raw stream in `scratch_stream` is only compared and passed to
// the driver under the slot lock, which every use of a `FastPath` holds;
// every other field is Send.
unsafe impl Send for FastPath {}

impl FastPath {
    /// The fast path with the bundled add kernel (off, with a log line,
    /// where it does not load), and no scratch buffer yet.
    pub(super) fn new(ctx: &Arc<Context>) -> nccl_safe::Result<FastPath> {
        let kernel = match Module::load_ptx(ctx, kernels::BF16_ADD_PTX)
            .and_then(|m| m.function(kernels::BF16_ADD_NAME))
        {
            Ok(f) => Some(AddKernel::new(f)),
            Err(e) => {
                tracing::warn!("bundled bf16 add kernel unavailable, fast path off: {e}");
                None
            }
        };
        Ok(FastPath {
            kernel,
            scratch: None,
            scratch_free: Event::new(ctx, false)?,
            scratch_stream: None,
        })
    }

    /// Whether it has an add kernel.
    pub(super) fn has_kernel(&self) -> bool {
        self.kernel.is_some()
    }

    /// Replaces the add kernel.
    pub(super) fn set_kernel(&mut self, kernel: AddKernel) {
        self.kernel = Some(kernel);
    }

    /// Allocates the scratch buffer once, at its final size: the configured
    /// scratch capacity, capped by the largest payload the policy sends down
    /// the fast path; nothing where the path cannot run (`world_size` other
    /// than 2, no kernel, a policy that never takes it).
    pub(super) fn ensure_scratch(
        &mut self,
        ctx: &Arc<Context>,
        world_size: usize,
        config: &BackendConfig,
    ) -> nccl_safe::Result<()> {
        if self.scratch.is_some() || world_size != 2 || self.kernel.is_none() {
            return Ok(());
        }
        let Some(max) = config.fast_path.max_fast_bytes() else {
            return Ok(());
        };
        let elems = (config.scratch_bytes.min(max) / 2).max(1);
        self.scratch = Some(DeviceBuffer::alloc(ctx, elems)?);
        Ok(())
    }

    /// Enqueues the fast path for the bf16 `span` on `stream`, with `peer`
    /// over `comm`: for each chunk that fits the scratch buffer, a grouped
    /// send/recv, then the add.
    pub(super) fn enqueue(
        &mut self,
        ctx: &Arc<Context>,
        comm: &Comm,
        peer: usize,
        span: Span,
        stream: CUstream,
    ) -> nccl_safe::Result<()> {
        let (scratch, chunk_elems) = self
            .scratch
            .as_ref()
            .map(|s| (s.device_ptr(), s.len()))
            .ok_or_else(|| nccl_safe::Error::invalid("fast path", "no scratch buffer"))?;
        let kernel = self
            .kernel
            .as_ref()
            .map(|k| k.raw())
            .ok_or_else(|| nccl_safe::Error::invalid("fast path", "no add kernel"))?;
        if span.dtype != DataType::Bfloat16 {
            return Err(nccl_safe::Error::invalid(
                "fast path",
                format!("{} is not bf16", span.dtype),
            ));
        }
        if self.scratch_stream.is_some_and(|last| last != stream) {
            // SAFETY: `stream` is ours or the caller's live stream of this
            // context (a `StreamRef`); the event is ours.
            unsafe { self.scratch_free.wait_raw(stream)? };
        }
        for chunk in span.chunks(chunk_elems) {
            nccl_safe::group(|| {
                // SAFETY: `chunk` lies inside the caller's view and `scratch`
                // holds at least `chunk.len` elements; both are device
                // memory of this context; the stream is live.
                unsafe {
                    comm.send_raw(chunk.ptr, chunk.len, DataType::Bfloat16, peer, stream)?;
                    comm.recv_raw(scratch, chunk.len, DataType::Bfloat16, peer, stream)
                }
            })?;
            // On a non-blocking communicator the group may still be being
            // enqueued: the add must come after the receive on the stream.
            comm.wait_ready()?;
            // SAFETY: the kernel has the documented add signature (bundled,
            // or the engine's under `AddKernel::from_raw`'s contract) and
            // both ranges hold `chunk.len` bf16 elements.
            unsafe {
                kernels::launch_add(ctx, kernel, chunk.ptr, scratch, chunk.len as u64, stream)?
            };
        }
        // SAFETY: as above.
        unsafe { self.scratch_free.record_raw(stream)? };
        self.scratch_stream = Some(stream);
        Ok(())
    }

    /// Waits up to `within` for the last fast path's work (possibly on a
    /// caller's stream).
    pub(super) fn drain(&self, within: Duration) -> nccl_safe::Result<()> {
        if self.scratch_stream.is_some() {
            self.scratch_free.wait_with_deadline(within)?;
        }
        Ok(())
    }

    /// Frees the scratch buffer (its work drained).
    pub(super) fn free(&mut self) {
        self.scratch = None;
    }

    /// Leaks the scratch buffer (its work cannot be proven finished);
    /// whether there was one.
    pub(super) fn leak(&mut self) -> bool {
        let scratch = self.scratch.take();
        let had = scratch.is_some();
        std::mem::forget(scratch);
        had
    }
}
