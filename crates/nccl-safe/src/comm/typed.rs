//! Collectives on typed [`DeviceBuffer`]s: lengths, element types and
//! contexts are checked, then the raw calls run.
//!
//! Invariant: a typed call never reaches NCCL with a length or context that
//! does not match its buffers.

use crate::error::Result;
use crate::memory::{DeviceBuffer, Element};
use crate::stream::Stream;

use super::*;

impl Comm {
    /// All-reduce: `recv[i] = op over ranks of send[i]`; equal lengths.
    pub fn all_reduce<T: Element>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "all_reduce";
        self.check_typed(CALL, &[send, recv], stream)?;
        Self::check_same_len(CALL, send.len(), recv.len())?;
        // SAFETY: both buffers are live device memory of this communicator's
        // context with `len` elements; the stream belongs to the same context.
        unsafe {
            self.all_reduce_raw(
                send.device_ptr(),
                recv.device_ptr(),
                send.len(),
                T::DATA_TYPE,
                op,
                stream.raw(),
            )
        }
    }

    /// In-place all-reduce.
    pub fn all_reduce_in_place<T: Element>(
        &self,
        buf: &mut DeviceBuffer<T>,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        self.check_typed("all_reduce_in_place", &[buf], stream)?;
        // SAFETY: the buffer is live device memory of this communicator's
        // context; the stream belongs to the same context.
        unsafe {
            self.all_reduce_raw(
                buf.device_ptr(),
                buf.device_ptr(),
                buf.len(),
                T::DATA_TYPE,
                op,
                stream.raw(),
            )
        }
    }

    /// Broadcast from `root`'s `send` into every rank's `recv`; equal lengths.
    pub fn broadcast<T: Element>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "broadcast";
        self.check_typed(CALL, &[send, recv], stream)?;
        self.check_index(CALL, "root", root)?;
        Self::check_same_len(CALL, send.len(), recv.len())?;
        // SAFETY: as in all_reduce.
        unsafe {
            self.broadcast_raw(
                send.device_ptr(),
                recv.device_ptr(),
                send.len(),
                T::DATA_TYPE,
                root,
                stream.raw(),
            )
        }
    }

    /// In-place broadcast from `root`.
    pub fn broadcast_in_place<T: Element>(
        &self,
        buf: &mut DeviceBuffer<T>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "broadcast_in_place";
        self.check_typed(CALL, &[buf], stream)?;
        self.check_index(CALL, "root", root)?;
        // SAFETY: as in all_reduce_in_place.
        unsafe {
            self.broadcast_raw(
                buf.device_ptr(),
                buf.device_ptr(),
                buf.len(),
                T::DATA_TYPE,
                root,
                stream.raw(),
            )
        }
    }

    /// Reduce into `root`'s `recv`; equal lengths on every rank.
    pub fn reduce<T: Element>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        op: ReduceOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "reduce";
        self.check_typed(CALL, &[send, recv], stream)?;
        self.check_index(CALL, "root", root)?;
        Self::check_same_len(CALL, send.len(), recv.len())?;
        // SAFETY: as in all_reduce.
        unsafe {
            self.reduce_raw(
                send.device_ptr(),
                recv.device_ptr(),
                send.len(),
                T::DATA_TYPE,
                op,
                root,
                stream.raw(),
            )
        }
    }

    /// All-gather: `recv.len() == send.len() * count()`, rank-major.
    pub fn all_gather<T: Element>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "all_gather";
        self.check_typed(CALL, &[send, recv], stream)?;
        if send.len().checked_mul(self.count) != Some(recv.len()) {
            return Err(Self::len_mismatch(
                CALL,
                format!(
                    "recv has {} elements, expected send {} x {} ranks",
                    recv.len(),
                    send.len(),
                    self.count
                ),
            ));
        }
        // SAFETY: as in all_reduce, with recv holding send.len() * count().
        unsafe {
            self.all_gather_raw(
                send.device_ptr(),
                recv.device_ptr(),
                send.len(),
                T::DATA_TYPE,
                stream.raw(),
            )
        }
    }

    /// Reduce-scatter: `send.len() == recv.len() * count()`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "reduce_scatter";
        self.check_typed(CALL, &[send, recv], stream)?;
        if recv.len().checked_mul(self.count) != Some(send.len()) {
            return Err(Self::len_mismatch(
                CALL,
                format!(
                    "send has {} elements, expected recv {} x {} ranks",
                    send.len(),
                    recv.len(),
                    self.count
                ),
            ));
        }
        // SAFETY: as in all_reduce, with send holding recv.len() * count().
        unsafe {
            self.reduce_scatter_raw(
                send.device_ptr(),
                recv.device_ptr(),
                recv.len(),
                T::DATA_TYPE,
                op,
                stream.raw(),
            )
        }
    }

    /// All-to-all (NCCL 2.28+): equal lengths, a multiple of `count()`;
    /// block `j` of `send` goes to rank `j`.
    pub fn all_to_all<T: Element>(
        &self,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "all_to_all";
        self.check_typed(CALL, &[send, recv], stream)?;
        if send.len() != recv.len() || !send.len().is_multiple_of(self.count.max(1)) {
            return Err(Self::len_mismatch(
                CALL,
                format!(
                    "send has {} elements, recv {}; both must be equal multiples of {} ranks",
                    send.len(),
                    recv.len(),
                    self.count
                ),
            ));
        }
        // SAFETY: as in all_reduce.
        unsafe {
            self.all_to_all_raw(
                send.device_ptr(),
                recv.device_ptr(),
                send.len() / self.count.max(1),
                T::DATA_TYPE,
                stream.raw(),
            )
        }
    }

    /// Sends the whole buffer to `peer` (pair with the peer's [`Comm::recv`],
    /// usually inside a [`crate::Group`]).
    pub fn send<T: Element>(
        &self,
        buf: &DeviceBuffer<T>,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "send";
        self.check_typed(CALL, &[buf], stream)?;
        self.check_index(CALL, "peer", peer)?;
        // SAFETY: as in all_reduce.
        unsafe {
            self.send_raw(
                buf.device_ptr(),
                buf.len(),
                T::DATA_TYPE,
                peer,
                stream.raw(),
            )
        }
    }

    /// Receives the whole buffer from `peer`.
    pub fn recv<T: Element>(
        &self,
        buf: &mut DeviceBuffer<T>,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        const CALL: &str = "recv";
        self.check_typed(CALL, &[buf], stream)?;
        self.check_index(CALL, "peer", peer)?;
        // SAFETY: as in all_reduce.
        unsafe {
            self.recv_raw(
                buf.device_ptr(),
                buf.len(),
                T::DATA_TYPE,
                peer,
                stream.raw(),
            )
        }
    }
}
