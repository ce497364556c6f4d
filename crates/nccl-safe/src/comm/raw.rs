//! Collectives and point-to-point calls on raw device addresses, and the
//! enqueue protocol of non-blocking communicators.
//!
//! Invariant: every count, root, peer, pointer and context is checked before
//! NCCL sees it; every call first waits until earlier work is enqueued.

use cuda_sys::CUstream;

use crate::error::Result;
use crate::memory::DataType;

use super::*;

impl Comm {
    /// `ncclAllReduce` on raw device addresses.
    ///
    /// # Safety
    /// `send` and `recv` are device memory of this communicator's device,
    /// valid for `count` elements of `dtype` until the stream work completes;
    /// `stream` is a live stream of this communicator's context.
    pub unsafe fn all_reduce_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclAllReduce";
        Self::check_ptr(CALL, "send", send, count)?;
        Self::check_ptr(CALL, "recv", recv, count)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointers, counts and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclAllReduce(
                        send as *const _,
                        recv as *mut _,
                        count,
                        dtype.to_raw(),
                        op.to_raw(),
                        comm,
                        stream
                    )
                )
            }
        })
    }

    /// `ncclBroadcast` on raw device addresses (`send` is read on `root`).
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`].
    pub unsafe fn broadcast_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclBroadcast";
        let root = self.check_index(CALL, "root", root)?;
        if root as usize == self.rank {
            Self::check_ptr(CALL, "send", send, count)?;
        }
        Self::check_ptr(CALL, "recv", recv, count)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointers, counts and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclBroadcast(
                        send as *const _,
                        recv as *mut _,
                        count,
                        dtype.to_raw(),
                        root,
                        comm,
                        stream
                    )
                )
            }
        })
    }

    /// `ncclReduce` on raw device addresses (`recv` is written on `root`).
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclReduce";
        let root = self.check_index(CALL, "root", root)?;
        Self::check_ptr(CALL, "send", send, count)?;
        if root as usize == self.rank {
            Self::check_ptr(CALL, "recv", recv, count)?;
        }
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointers, counts and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclReduce(
                        send as *const _,
                        recv as *mut _,
                        count,
                        dtype.to_raw(),
                        op.to_raw(),
                        root,
                        comm,
                        stream
                    )
                )
            }
        })
    }

    /// `ncclAllGather`: `send` holds `send_count` elements, `recv`
    /// `send_count * count()`.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`], with those sizes.
    pub unsafe fn all_gather_raw(
        &self,
        send: u64,
        recv: u64,
        send_count: usize,
        dtype: DataType,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclAllGather";
        Self::check_ptr(CALL, "send", send, send_count)?;
        Self::check_ptr(CALL, "recv", recv, send_count)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointers, counts and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclAllGather(
                        send as *const _,
                        recv as *mut _,
                        send_count,
                        dtype.to_raw(),
                        comm,
                        stream
                    )
                )
            }
        })
    }

    /// `ncclReduceScatter`: `recv` holds `recv_count` elements, `send`
    /// `recv_count * count()`.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`], with those sizes.
    pub unsafe fn reduce_scatter_raw(
        &self,
        send: u64,
        recv: u64,
        recv_count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclReduceScatter";
        Self::check_ptr(CALL, "send", send, recv_count)?;
        Self::check_ptr(CALL, "recv", recv, recv_count)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointers, counts and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclReduceScatter(
                        send as *const _,
                        recv as *mut _,
                        recv_count,
                        dtype.to_raw(),
                        op.to_raw(),
                        comm,
                        stream
                    )
                )
            }
        })
    }

    /// `ncclAlltoAll` (NCCL 2.28+): both buffers hold
    /// `count_per_peer * count()` elements.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`], with those sizes.
    pub unsafe fn all_to_all_raw(
        &self,
        send: u64,
        recv: u64,
        count_per_peer: usize,
        dtype: DataType,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclAlltoAll";
        Self::check_ptr(CALL, "send", send, count_per_peer)?;
        Self::check_ptr(CALL, "recv", recv, count_per_peer)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointers, counts and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclAlltoAll(
                        send as *const _,
                        recv as *mut _,
                        count_per_peer,
                        dtype.to_raw(),
                        comm,
                        stream
                    )
                )
            }
        })
    }

    /// `ncclSend` of `count` elements to `peer`.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`].
    pub unsafe fn send_raw(
        &self,
        ptr: u64,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclSend";
        let peer = self.check_index(CALL, "peer", peer)?;
        Self::check_ptr(CALL, "buffer", ptr, count)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointer, count and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclSend(ptr as *const _, count, dtype.to_raw(), peer, comm, stream)
                )
            }
        })
    }

    /// `ncclRecv` of `count` elements from `peer`.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce_raw`].
    pub unsafe fn recv_raw(
        &self,
        ptr: u64,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: CUstream,
    ) -> Result<()> {
        const CALL: &str = "ncclRecv";
        let peer = self.check_index(CALL, "peer", peer)?;
        Self::check_ptr(CALL, "buffer", ptr, count)?;
        self.enqueue(CALL, |lib, comm| {
            // SAFETY: pointer, count and stream satisfy this function's
            // contract; `comm` is live.
            unsafe {
                nccl_sys::call!(
                    lib,
                    ncclRecv(ptr as *mut _, count, dtype.to_raw(), peer, comm, stream)
                )
            }
        })
    }
}
