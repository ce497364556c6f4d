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
//!   and graph capture), then NCCL's all-reduce. An `Auto` policy's size
//!   is inside it where the tuned table (`path_table`, by launch mode:
//!   eager or captured) gives that path; with no table, nowhere.
//! - Every input of the choice is the same on every rank, so every rank
//!   takes one path: the world size, the set-up's agreed verdicts, the
//!   payload's size and type, the tuned table (the same on every rank,
//!   `path_table`), and the settings, which the census at every
//!   connect compares (ranks whose policies, scratch size or add kernel
//!   differ get neither peer-memory path, on every rank). Work captured
//!   into a graph never takes the fast path, whose scratch buffer is
//!   ordered between eager users by an event a replayed graph cannot wait
//!   for.

use nccl_safe::{DataType, ReduceOp};

use super::path_table::{AllReducePath, LaunchMode, PathTable};
use super::submission::{Capture, Target};
use super::{Inner, NcclBackend, Slot};
use crate::config::{FastPathPolicy, OneShotPolicy};
use crate::kernels;
use crate::validate::Span;

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

    /// Which path an all-reduce of `dtype` captured into a CUDA graph takes
    /// for `bytes` in ordinary device memory (the one-shot path or NCCL's;
    /// never the fast path).
    pub fn all_reduce_path_captured(
        &self,
        dtype: nccl_safe::DataType,
        bytes: usize,
    ) -> AllReducePath {
        let slot = self.inner.slot.lock();
        self.inner
            .choose_path(&slot, Memory::Ordinary, bytes, dtype, Capture::Graph)
    }

    /// The table the tuner decided at the latest set-up (construction,
    /// reconnect or split): the size ranges each path takes, eagerly and in
    /// graphs, with the times measured (or read from the cache). `None`
    /// where nothing was tuned: one rank, ranks on several hosts or with
    /// settings that differ, tuning off, or no `Auto` policy with a path
    /// to choose. The `Auto` policies take NCCL's all-reduce then.
    pub fn path_table(&self) -> Option<PathTable> {
        self.inner.slot.lock().tuned.clone()
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
        let mode = match capture {
            Capture::Eager => LaunchMode::Eager,
            Capture::Graph => LaunchMode::Graph,
        };
        let tuned = |path: AllReducePath| {
            slot.tuned
                .as_ref()
                .is_some_and(|t| t.path(mode, bytes) == path)
        };
        let one_shot_takes = match self.config.one_shot {
            OneShotPolicy::Auto => tuned(AllReducePath::OneShot),
            policy => policy.takes(bytes),
        };
        if kernels::one_shot_name(dtype).is_some()
            && slot.one_shot.is_on()
            && one_shot_takes
            && !self.in_group(slot)
            && outside_registered
        {
            return AllReducePath::OneShot;
        }
        let fast_takes = match self.config.fast_path {
            FastPathPolicy::Auto => tuned(AllReducePath::FastPath),
            policy => policy.takes_fast_path(bytes),
        };
        if self.world_size == 2
            && dtype == DataType::Bfloat16
            && slot
                .hosts
                .as_ref()
                .is_some_and(|h| h.peer_paths_off().is_none())
            && capture == Capture::Eager
            && !self.in_group(slot)
            && slot.fast.has_kernel()
            && fast_takes
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
        let path = self.choose_path(slot, memory, span.bytes(), span.dtype, target.capture);
        self.enqueue_on(slot, path, span, target)
    }

    /// Enqueues a sum all-reduce of `span` in place on `path` (the choice's,
    /// or the tuner's, which times each path), at `target`.
    pub(super) fn enqueue_on(
        &self,
        slot: &mut Slot,
        path: AllReducePath,
        span: Span,
        target: Target,
    ) -> nccl_safe::Result<()> {
        match path {
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
