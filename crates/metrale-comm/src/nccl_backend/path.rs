//! The choice of all-reduce path, and the enqueue of an all-reduce on the
//! one chosen: the one-shot path (`one_shot`), the 2-rank fast path
//! (`fast_path`) or NCCL's all-reduce.
//!
//! Invariants:
//! - The choice, in order: the one-shot path (bf16, f16 or f32, on, a size
//!   inside its policy, outside a group and registered or symmetric
//!   memory; graph capture allowed), then the fast path (bf16 on 2 ranks
//!   of one host whose settings agree (`hosts`) with an add kernel, a size
//!   inside its policy, outside a group, registered or symmetric memory
//!   and graph capture), then NCCL's all-reduce.
//! - Every input of the choice is the same on every rank, so every rank
//!   takes one path: the world size, the set-up's agreed verdicts, the
//!   payload's size and type, and the settings, which the census at every
//!   connect compares (ranks whose policies, scratch size or add kernel
//!   differ get neither peer-memory path, on every rank). Work captured
//!   into a graph never takes the fast path, whose scratch buffer is
//!   ordered between eager users by an event a replayed graph cannot wait
//!   for.

use nccl_safe::{DataType, ReduceOp};

use super::submission::{Capture, Target};
use super::{Inner, NcclBackend, Slot};
use crate::kernels;
use crate::validate::Span;

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

/// Where an all-reduce's payload lies, for the choice.
#[derive(Clone, Copy)]
pub(super) enum Memory {
    /// At this address (registered or symmetric memory takes NCCL's path).
    At(u64),
    /// In ordinary device memory (the question `all_reduce_path` answers).
    Ordinary,
}

impl NcclBackend {
    /// Which path an eager bf16 `all_reduce` takes now for `bytes` in
    /// ordinary device memory: [`NcclBackend::all_reduce_path_of`] for
    /// bf16.
    pub fn all_reduce_path(&self, bytes: usize) -> AllReducePath {
        self.all_reduce_path_of(nccl_safe::DataType::Bfloat16, bytes)
    }

    /// Which path an eager `all_reduce` of `dtype` takes now for `bytes` in
    /// ordinary device memory. Buffers in registered or symmetric memory
    /// always take NCCL's all-reduce, and so do types other than bf16, f16
    /// and f32 (the one-shot path's) and, on the fast path, other than
    /// bf16; work captured into a CUDA graph takes the one-shot path or
    /// NCCL's.
    pub fn all_reduce_path_of(&self, dtype: nccl_safe::DataType, bytes: usize) -> AllReducePath {
        let slot = self.inner.slot.lock();
        self.inner
            .choose_path(&slot, Memory::Ordinary, bytes, dtype, Capture::Eager)
    }
}

impl Inner {
    /// The all-reduce path for `bytes` of `dtype` in `memory`, enqueued as
    /// `capture` says.
    pub(super) fn choose_path(
        &self,
        slot: &Slot,
        memory: Memory,
        bytes: usize,
        dtype: DataType,
        capture: Capture,
    ) -> AllReducePath {
        let outside_registered = match memory {
            Memory::At(p) => !slot.in_registered_memory(p, bytes),
            Memory::Ordinary => true,
        };
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
            && slot
                .hosts
                .as_ref()
                .is_some_and(|h| h.peer_paths_off().is_none())
            && capture == Capture::Eager
            && !self.in_group(slot)
            && slot.fast.has_kernel()
            && self.config.fast_path.takes_fast_path(bytes)
            && outside_registered
        {
            AllReducePath::FastPath
        } else {
            AllReducePath::Nccl
        }
    }

    /// Enqueues a sum all-reduce of `span` in place on the path chosen for
    /// it, at `target`.
    pub(super) fn all_reduce_on(
        &self,
        slot: &mut Slot,
        span: Span,
        target: Target,
    ) -> nccl_safe::Result<()> {
        let memory = Memory::At(span.ptr);
        match self.choose_path(slot, memory, span.bytes(), span.dtype, target.capture) {
            AllReducePath::FastPath => {
                let Slot { comm, fast, .. } = slot;
                let comm = comm
                    .as_ref()
                    .ok_or(nccl_safe::Error::Aborted { call: "fast path" })?;
                fast.ensure_scratch(&self.ctx, self.world_size, &self.config)?;
                fast.enqueue(&self.ctx, comm, 1 - self.rank, span, target.stream)
            }
            AllReducePath::OneShot => slot.one_shot.enqueue(&self.ctx, span, target),
            AllReducePath::Nccl => {
                let comm = slot.comm("all_reduce")?;
                // SAFETY: `span` is valid for its elements (the view's
                // contract) on this context; the stream is live.
                unsafe {
                    comm.all_reduce_raw(
                        span.ptr,
                        span.ptr,
                        span.len,
                        span.dtype,
                        ReduceOp::Sum,
                        target.stream,
                    )
                }
            }
        }
    }
}
