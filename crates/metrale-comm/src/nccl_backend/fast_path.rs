//! The 2-rank fast path (a grouped send/recv of the whole buffer into the
//! scratch buffer, then the bf16 add kernel, chunk by chunk), the choice
//! between the one-shot path (`one_shot`), it and NCCL's all-reduce, and
//! its scratch buffer.
//!
//! Invariants:
//! - The choice, in order: the one-shot path (bf16, f16 or f32, on, a size
//!   inside its policy, outside a group and registered or symmetric
//!   memory; graph capture allowed), then the fast path, then NCCL's
//!   all-reduce. Every input of the choice is the same on every rank
//!   (configuration, world size, the set-up's agreed verdict), so every
//!   rank takes one path.
//! - The fast path runs only for bf16 on 2 ranks of one host (`hosts`)
//!   with an add kernel, for a size inside the policy, outside a group,
//!   registered or symmetric memory, and graph capture.
//! - The scratch buffer is allocated once, at its final size (at
//!   construction or `set_add_kernel`), never under capture, and freed only
//!   after the teardown drained the work that uses it.
//! - Its reuse is ordered: every fast path records `scratch_free` after its
//!   last add, and a fast path on another stream waits for it first.

use cuda_sys::CUstream;
use nccl_safe::{DataType, DeviceBuffer, ReduceOp};

use super::{Inner, Slot};
use crate::kernels;

/// Which algorithm an all-reduce takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AllReducePath {
    /// NCCL's all-reduce.
    Nccl,
    /// Grouped send/recv into the scratch buffer, then the bf16 add kernel.
    FastPath,
    /// Every rank pushes its input into every peer's buffer and sums them
    /// all (bf16, f16 and f32; 2 to 8 ranks of one node, peer access
    /// proven at set-up).
    OneShot,
}

impl Inner {
    /// The all-reduce path for `bytes` of `dtype` at `ptr` (`None`: an
    /// address outside registered and symmetric memory). Work captured
    /// into a CUDA graph (`captured`) takes the one-shot path (its own
    /// lane) or NCCL's all-reduce, never the fast path: the scratch buffer
    /// is ordered between eager users by an event, which a replayed graph
    /// cannot wait for.
    pub(super) fn choose_path(
        &self,
        slot: &Slot,
        ptr: Option<u64>,
        bytes: usize,
        dtype: DataType,
        captured: bool,
    ) -> AllReducePath {
        let outside_registered = !ptr.is_some_and(|p| slot.in_registered_memory(p, bytes));
        if kernels::one_shot_name(dtype).is_some()
            && slot.one_shot.is_on()
            && self.config.one_shot.takes(bytes)
            && !self.in_group(slot)
            && outside_registered
        {
            return AllReducePath::OneShot;
        }
        if self.world_size == 2
            && dtype == DataType::Bfloat16
            && self.one_host(slot)
            && !captured
            && !self.in_group(slot)
            && slot.kernel.is_some()
            && self.config.fast_path.takes_fast_path(bytes)
            && outside_registered
        {
            AllReducePath::FastPath
        } else {
            AllReducePath::Nccl
        }
    }

    /// Allocates the fast path's scratch buffer once, at its final size:
    /// the configured scratch capacity, capped by the largest payload the
    /// policy sends down the fast path.
    pub(super) fn ensure_scratch(&self, slot: &mut Slot) -> nccl_safe::Result<()> {
        if slot.scratch.is_some() || self.world_size != 2 || slot.kernel.is_none() {
            return Ok(());
        }
        let Some(max) = self.config.fast_path.max_fast_bytes() else {
            return Ok(());
        };
        let elems = (self.config.scratch_bytes.min(max) / 2).max(1);
        slot.scratch = Some(DeviceBuffer::alloc(&self.ctx, elems)?);
        Ok(())
    }

    /// Enqueues the 2-rank fast path on `stream`: for each chunk that fits
    /// the scratch buffer, a grouped send/recv with the peer, then the add.
    fn fast_path(
        &self,
        slot: &mut Slot,
        ptr: u64,
        elems: usize,
        stream: CUstream,
    ) -> nccl_safe::Result<()> {
        self.ensure_scratch(slot)?;
        let (scratch, chunk_elems) = slot
            .scratch
            .as_ref()
            .map(|s| (s.device_ptr(), s.len()))
            .ok_or_else(|| nccl_safe::Error::invalid("fast path", "no scratch buffer"))?;
        let kernel = slot
            .kernel
            .as_ref()
            .map(|k| k.raw())
            .ok_or_else(|| nccl_safe::Error::invalid("fast path", "no add kernel"))?;
        let comm = slot.comm("fast path")?;
        let peer = 1 - self.rank;
        if slot.scratch_stream.is_some_and(|last| last != stream) {
            // SAFETY: `stream` is ours or the caller's live stream of this
            // context (a `StreamRef`); the event is ours.
            unsafe { slot.scratch_free.wait_raw(stream)? };
        }
        let mut off = 0usize;
        while off < elems {
            let len = chunk_elems.min(elems - off);
            let chunk = ptr + (off * 2) as u64;
            nccl_safe::group(|| {
                // SAFETY: `chunk` lies inside the caller's view and `scratch`
                // holds at least `len` elements; both are device memory of
                // this context; the stream is live.
                unsafe {
                    comm.send_raw(chunk, len, DataType::Bfloat16, peer, stream)?;
                    comm.recv_raw(scratch, len, DataType::Bfloat16, peer, stream)
                }
            })?;
            // On a non-blocking communicator the group may still be being
            // enqueued: the add must come after the receive on the stream.
            comm.wait_ready()?;
            // SAFETY: the kernel has the documented add signature (bundled,
            // or the engine's under `AddKernel::from_raw`'s contract) and
            // both ranges hold `len` bf16 elements.
            unsafe { kernels::launch_add(&self.ctx, kernel, chunk, scratch, len as u64, stream)? };
            off += len;
        }
        // SAFETY: as above.
        unsafe { slot.scratch_free.record_raw(stream)? };
        slot.scratch_stream = Some(stream);
        Ok(())
    }

    /// Enqueues a sum all-reduce (either path) of `elems` of `dtype` in
    /// place at `ptr` on `stream`, which is being captured into a graph
    /// when `captured`.
    pub(super) fn all_reduce_on(
        &self,
        slot: &mut Slot,
        (ptr, elems, dtype): (u64, usize, DataType),
        stream: CUstream,
        captured: bool,
    ) -> nccl_safe::Result<()> {
        let bytes = elems * dtype.size();
        match self.choose_path(slot, Some(ptr), bytes, dtype, captured) {
            AllReducePath::FastPath => self.fast_path(slot, ptr, elems, stream),
            AllReducePath::OneShot => {
                self.one_shot_all_reduce(slot, (ptr, elems, dtype), stream, captured)
            }
            AllReducePath::Nccl => {
                let comm = slot.comm("all_reduce")?;
                // SAFETY: `ptr` is valid for `elems` of `dtype` (the view's
                // contract) on this context; the stream is live.
                unsafe { comm.all_reduce_raw(ptr, ptr, elems, dtype, ReduceOp::Sum, stream) }
            }
        }
    }
}
