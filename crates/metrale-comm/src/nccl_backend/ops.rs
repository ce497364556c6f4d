//! The trait's operations on an `NcclBackend`: argument checks, then one
//! submission each (`submit`), with the waits the trait promises.
//!
//! Invariants: every check runs before anything is submitted; an empty
//! operation submits nothing but still refuses on an unusable backend;
//! collectives run on the backend's own stream; `all_reduce_async`, send
//! and receive on the caller's stream, which orders them with the caller's
//! work without an event between streams.

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use cuda_sys::CUstream;
use nccl_safe::{Comm, DataType, DeviceView, DeviceViewMut, ReduceOp, StreamRef, SymmetricBuffer};

use super::NcclBackend;
use super::submission::{Submission, Ticket, Wait};
use crate::backend::{AddKernel, CommBackend, Registration, Result, SymmetricAlloc};
use crate::error::CommError;
use crate::validate::{self, Ranks, Span, check_alloc, check_register};

/// Which way a point-to-point operation goes.
#[derive(Clone, Copy)]
enum Direction {
    Send,
    Recv,
}

impl NcclBackend {
    /// A collective on the backend's own stream that waits for nothing.
    fn collective(
        &self,
        sub: Submission,
        enqueue: impl FnOnce(&Comm, CUstream) -> nccl_safe::Result<()>,
    ) -> Result<()> {
        self.inner
            .submit(sub, |_, slot, at| enqueue(slot.comm(sub.op)?, at.stream))?;
        Ok(())
    }

    /// This rank and its world, for the argument checks.
    fn ranks(&self) -> Ranks {
        Ranks {
            rank: self.inner.rank,
            size: self.inner.world_size,
        }
    }

    /// A broadcast from `root` of the checked view `s`, waited for on the
    /// host as `wait` says: with the collective deadline (`Wait::Ticket`),
    /// or idle, with none, for `recv_command_u32` (`Wait::Idle`).
    fn broadcast_wait(&self, op: &'static str, s: Span, root: usize, wait: Wait) -> Result<()> {
        let inner = &*self.inner;
        let idle = wait == Wait::Idle;
        self.refuse_in_own_group(op)?;
        if s.len == 0 {
            return inner.check_usable(op);
        }
        let sub = Submission::of(op, &s).with_peer(root).awaited(wait);
        let ticket = inner.submit(sub, |_, slot, at| {
            let comm = slot
                .comm
                .as_mut()
                .ok_or(nccl_safe::Error::Aborted { call: op })?;
            // An idle receive waits for the root with no deadline, also
            // while NCCL connects to it; shutdown or a failure aborts the
            // communicator, which ends the wait.
            let saved = comm.enqueue_deadline();
            if idle {
                comm.set_enqueue_deadline(None);
            }
            // SAFETY: the view is valid for `len` elements of its type (its
            // contract); our stream.
            let r = unsafe { comm.broadcast_raw(s.ptr, s.ptr, s.len, s.dtype, root, at.stream) };
            comm.set_enqueue_deadline(saved);
            r
        })?;
        let Some(ticket) = ticket else {
            return Ok(());
        };
        if idle {
            *inner.idle_pending.lock() = Some(ticket.event.clone());
        }
        let r = inner.wait(op, &ticket);
        if idle && r.is_ok() {
            inner.idle_pending.lock().take();
        }
        r
    }

    fn refuse_in_own_group(&self, op: &'static str) -> Result<()> {
        let slot = self.inner.slot.lock();
        self.inner.refuse_in_group(&slot, op)
    }

    /// Send or receive on the caller's stream.
    fn p2p(
        &self,
        op: &'static str,
        s: Span,
        peer: usize,
        stream: StreamRef<'_>,
        dir: Direction,
    ) -> Result<()> {
        let inner = &*self.inner;
        let verb = match dir {
            Direction::Send => "send to",
            Direction::Recv => "receive from",
        };
        validate::point_to_point(op, s, peer, self.ranks(), verb)?;
        if s.len == 0 {
            return inner.check_usable(op);
        }
        let sub = Submission::of(op, &s).on(stream).with_peer(peer);
        inner.submit(sub, |_, slot, at| {
            let comm = slot.comm(op)?;
            // SAFETY: the view is valid for `len` elements (its contract)
            // and the stream is live (the `StreamRef`'s).
            unsafe {
                match dir {
                    Direction::Send => comm.send_raw(s.ptr, s.len, s.dtype, peer, at.stream),
                    Direction::Recv => comm.recv_raw(s.ptr, s.len, s.dtype, peer, at.stream),
                }
            }
        })?;
        Ok(())
    }

    /// Grouped send/recv of per-peer blocks on the backend's stream.
    fn exchange_blocks(
        &self,
        op: &'static str,
        (send, send_counts): (Span, &[usize]),
        (recv, recv_counts): (Span, &[usize]),
    ) -> Result<()> {
        let inner = &*self.inner;
        let (me, esz) = (inner.rank, send.dtype.size());
        let sub = Submission::of(op, &send);
        let send_counts = send_counts.to_vec();
        let recv_counts = recv_counts.to_vec();
        self.collective(sub, |comm, stream| {
            nccl_safe::group(|| {
                let (mut so, mut ro) = (0usize, 0usize);
                for peer in 0..send_counts.len() {
                    let (sc, rc) = (send_counts[peer], recv_counts[peer]);
                    let (sp, rp) = (send.ptr + (so * esz) as u64, recv.ptr + (ro * esz) as u64);
                    if peer == me {
                        if sc != rc {
                            return Err(nccl_safe::Error::invalid(
                                op,
                                format!("this rank sends itself {sc} elements but receives {rc}"),
                            ));
                        }
                        if sc > 0 {
                            // SAFETY: both blocks lie inside the views (the
                            // counts were checked against their lengths).
                            unsafe {
                                nccl_safe::copy_device_async(
                                    comm.context(),
                                    rp,
                                    sp,
                                    sc * esz,
                                    stream,
                                )?
                            };
                        }
                    } else {
                        // SAFETY: as above; the stream is ours.
                        unsafe {
                            if sc > 0 {
                                comm.send_raw(sp, sc, send.dtype, peer, stream)?;
                            }
                            if rc > 0 {
                                comm.recv_raw(rp, rc, recv.dtype, peer, stream)?;
                            }
                        }
                    }
                    so += sc;
                    ro += rc;
                }
                Ok(())
            })?;
            comm.wait_ready()
        })
    }
}

impl CommBackend for NcclBackend {
    fn all_reduce(&self, buf: DeviceViewMut<'_>) -> Result<()> {
        const OP: &str = "all_reduce";
        let s = Span::from(&buf);
        validate::all_reduce(OP, s)?;
        if s.len == 0 {
            return self.inner.check_usable(OP);
        }
        let sub = Submission::of(OP, &s);
        self.inner
            .submit(sub, |inner, slot, at| inner.all_reduce_on(slot, s, at))?;
        Ok(())
    }

    fn all_reduce_async(
        &self,
        buf: DeviceViewMut<'_>,
        compute_stream: StreamRef<'_>,
    ) -> Result<()> {
        const OP: &str = "all_reduce_async";
        let s = Span::from(&buf);
        validate::all_reduce(OP, s)?;
        if s.len == 0 {
            return self.inner.check_usable(OP);
        }
        // On the caller's stream: the reduction starts after the work queued
        // there and later work there starts after it, with no event between
        // streams; under capture it is captured there and not watched.
        let sub = Submission::of(OP, &s).on(compute_stream);
        self.inner
            .submit(sub, |inner, slot, at| inner.all_reduce_on(slot, s, at))?;
        Ok(())
    }

    fn all_reduce_add_rms_norm(
        &self,
        x: DeviceViewMut<'_>,
        residual: DeviceViewMut<'_>,
        weight: DeviceView<'_>,
        eps: f32,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        const OP: &str = "all_reduce_add_rms_norm";
        let s = Span::from(&x);
        let args = validate::add_rms_norm(OP, s, Span::from(&residual), Span::from(&weight), eps)?;
        if args.rows == 0 {
            return self.inner.check_usable(OP);
        }
        let norm = self.add_rms_norm_kernels()?;
        let kernel = norm
            .of(args.dtype)
            .ok_or_else(|| CommError::InvalidArgument {
                op: OP,
                reason: format!("no add + norm kernel for {}", args.dtype),
            })?;
        // One submission: the path the all-reduce would take decides; on
        // the one-shot path one fused kernel does both, elsewhere the
        // all-reduce is followed on the same stream by the add + norm
        // kernel (what the trait's provided implementation does).
        let sub = Submission::of(OP, &s).on(stream);
        self.inner.submit(sub, |inner, slot, at| {
            let path = inner.choose_path(
                slot,
                super::path::Memory::At(s.ptr),
                s.bytes(),
                s.dtype,
                at.capture,
            );
            if path == super::AllReducePath::OneShot && slot.one_shot.fused_rows(&args).is_some() {
                return slot.one_shot.enqueue_fused(&inner.ctx, args, at);
            }
            inner.all_reduce_on(slot, s, at)?;
            // SAFETY: the views hold `rows * hidden` and `hidden` values
            // (checked; their contracts); the kernel is of this context; the
            // stream is the caller's live stream.
            unsafe { crate::norm::launch_add_rms_norm(kernel, args, at.stream) }
        })?;
        Ok(())
    }

    fn add_rms_norm_kernels(&self) -> Result<&crate::norm::NormKernels> {
        crate::norm::kernels_in(&self.inner.norm, &self.inner.ctx)
    }

    unsafe fn register_buffer(&self, buf: DeviceView<'_>) -> Result<Registration> {
        const OP: &str = "register_buffer";
        let s = Span::from(&buf);
        check_register(OP, s)?;
        self.inner.check_usable(OP)?;
        let mut slot = self.inner.lock_slot(OP)?;
        let comm = slot.comm.as_ref().ok_or(CommError::Shutdown { op: OP })?;
        // SAFETY: the view is one device allocation that stays allocated
        // until deregistered (this function's contract).
        let handle = unsafe { comm.register_raw(s.ptr, s.bytes()) }
            .map_err(|source| CommError::Refused { op: OP, source })?;
        let handle = handle as u64;
        slot.registered.insert(handle, (s.ptr, s.bytes()));
        // SAFETY: a fresh handle, returned once.
        Ok(unsafe { Registration::from_raw(handle) })
    }

    fn deregister_buffer(&self, registration: Registration) -> Result<()> {
        const OP: &str = "deregister_buffer";
        let handle = registration.as_raw();
        self.inner.check_usable(OP)?;
        let mut slot = self.inner.lock_slot(OP)?;
        if slot.registered.remove(&handle).is_none() {
            return Err(CommError::UnknownHandle { op: OP, handle });
        }
        let comm = slot.comm.as_ref().ok_or(CommError::Shutdown { op: OP })?;
        // SAFETY: `handle` came from `register_raw` on this communicator and
        // was just removed from the map, so it is deregistered once.
        unsafe { comm.deregister_raw(handle as *mut c_void) }
            .map_err(|source| CommError::Refused { op: OP, source })
    }

    fn symmetric_alloc(&self, bytes: usize) -> Result<SymmetricAlloc> {
        const OP: &str = "symmetric_alloc";
        check_alloc(OP, bytes)?;
        self.inner.check_usable(OP)?;
        let buf = SymmetricBuffer::alloc(&self.inner.ctx, bytes)
            .map_err(|source| CommError::Refused { op: OP, source })?;
        let ptr = buf.device_ptr();
        self.inner.slot.lock().symmetric.insert(ptr, buf);
        // SAFETY: a fresh allocation, handed out once.
        Ok(unsafe { SymmetricAlloc::from_raw(ptr, bytes) })
    }

    fn symmetric_free(&self, alloc: SymmetricAlloc) -> Result<()> {
        // Freeing memory does not touch the communicator: allowed when
        // poisoned, so an engine can always release what it holds.
        const OP: &str = "symmetric_free";
        if self.inner.health.is_shutdown() {
            return Err(CommError::Shutdown { op: OP });
        }
        let ptr = alloc.ptr();
        let buf = self.inner.slot.lock().symmetric.remove(&ptr);
        match buf {
            Some(buf) => {
                drop(buf);
                Ok(())
            }
            None => Err(CommError::UnknownHandle {
                op: OP,
                handle: ptr,
            }),
        }
    }

    fn set_add_kernel(&self, kernel: AddKernel) -> Result<()> {
        const OP: &str = "set_add_kernel";
        validate::add_kernel(OP, &kernel)?;
        self.inner.check_usable(OP)?;
        let inner = &*self.inner;
        let mut slot = inner.lock_slot(OP)?;
        slot.fast.set_kernel(kernel);
        slot.fast
            .ensure_scratch(&inner.ctx, inner.world_size, &inner.config)
            .map_err(|source| CommError::Refused { op: OP, source })?;
        drop(slot);
        tracing::info!(rank = self.inner.rank, "bf16 add kernel replaced");
        Ok(())
    }

    fn all_gather(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>) -> Result<()> {
        const OP: &str = "all_gather";
        let (s, r) = (Span::from(&send), Span::from(&recv));
        validate::all_gather(OP, s, r, self.inner.world_size)?;
        if s.len == 0 {
            return self.inner.check_usable(OP);
        }
        self.collective(Submission::of(OP, &s), |comm, st| {
            // SAFETY: the views hold `len` and `len * world_size` elements
            // (checked); our stream.
            unsafe { comm.all_gather_raw(s.ptr, r.ptr, s.len, s.dtype, st) }
        })
    }

    fn reduce_scatter(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let (s, r) = (Span::from(&send), Span::from(&recv));
        validate::reduce_scatter(OP, s, r, self.inner.world_size)?;
        if r.len == 0 {
            return self.inner.check_usable(OP);
        }
        self.collective(Submission::of(OP, &r), |comm, st| {
            // SAFETY: sizes checked against the views; our stream.
            unsafe { comm.reduce_scatter_raw(s.ptr, r.ptr, r.len, r.dtype, ReduceOp::Sum, st) }
        })
    }

    fn broadcast(&self, buf: DeviceViewMut<'_>, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        let s = Span::from(&buf);
        validate::broadcast(OP, s, root, self.inner.world_size)?;
        self.broadcast_wait(OP, s, root, Wait::Ticket)
    }

    fn recv_command_u32(&self, buf: DeviceViewMut<'_>, root: usize) -> Result<()> {
        const OP: &str = "recv_command_u32";
        let s = Span::from(&buf);
        validate::command(OP, s, root, self.ranks())?;
        self.broadcast_wait(OP, s, root, Wait::Idle)
    }

    fn barrier(&self) -> Result<()> {
        const OP: &str = "barrier";
        let inner = &*self.inner;
        self.refuse_in_own_group(OP)?;
        let sub = Submission::sized(OP, DataType::Float32, 4).awaited(Wait::Ticket);
        let ticket = inner.submit(sub, |_, slot, at| {
            let comm = slot.comm(OP)?;
            let p = slot.barrier_elem.device_ptr();
            // SAFETY: one f32 of our own buffer; our stream.
            unsafe { comm.all_reduce_raw(p, p, 1, DataType::Float32, ReduceOp::Max, at.stream) }
        })?;
        match ticket {
            Some(ticket) => inner.wait(OP, &ticket),
            None => Ok(()),
        }
    }

    fn send_to(&self, buf: DeviceView<'_>, dest_rank: usize, stream: StreamRef<'_>) -> Result<()> {
        self.p2p(
            "send_to",
            Span::from(&buf),
            dest_rank,
            stream,
            Direction::Send,
        )
    }

    fn recv_from(
        &self,
        buf: DeviceViewMut<'_>,
        src_rank: usize,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        self.p2p(
            "recv_from",
            Span::from(&buf),
            src_rank,
            stream,
            Direction::Recv,
        )
    }

    fn all_to_all(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>) -> Result<()> {
        const OP: &str = "all_to_all";
        let w = self.inner.world_size;
        let (s, r) = (Span::from(&send), Span::from(&recv));
        validate::all_to_all(OP, s, r, w)?;
        if s.len == 0 {
            return self.inner.check_usable(OP);
        }
        let counts = vec![s.len / w; w];
        self.exchange_blocks(OP, (s, &counts), (r, &counts))
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
        validate::all_to_all_v(OP, (s, send_counts), (r, recv_counts), self.ranks())?;
        if send_counts.iter().chain(recv_counts).all(|&c| c == 0) {
            return self.inner.check_usable(OP);
        }
        self.exchange_blocks(OP, (s, send_counts), (r, recv_counts))
    }

    fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Box<dyn CommBackend>>> {
        Ok(self
            .split_backend(color, key)?
            .map(|b| Box::new(b) as Box<dyn CommBackend>))
    }

    fn group_start(&self) -> Result<()> {
        self.inner.group_start()
    }

    fn group_end(&self) -> Result<()> {
        self.inner.group_end()
    }

    fn synchronize(&self) -> Result<()> {
        const OP: &str = "synchronize";
        let inner = &*self.inner;
        inner.check_usable(OP)?;
        let seq = inner.recorder.last_seq();
        let tickets = {
            let slot = inner.lock_slot(OP)?;
            inner.refuse_in_group(&slot, OP)?;
            inner.check_usable(OP)?;
            let comm = slot
                .comm
                .as_ref()
                .map(Comm::abort_handle)
                .ok_or(CommError::Shutdown { op: OP })?;
            let generation = inner.generation.load(Ordering::Acquire);
            let event = inner.take_event()?;
            event
                .record(&slot.stream)
                .map_err(|source| CommError::Refused { op: OP, source })?;
            // The work on callers' streams (all_reduce_async, send, receive):
            // the newest watched event of each such stream.
            let mut events = vec![(slot.stream.raw() as usize, event)];
            events.extend(inner.watch.newest_events());
            events
                .into_iter()
                .map(|(stream, event)| Ticket {
                    seq,
                    event,
                    generation,
                    comm: comm.clone(),
                    stream,
                    wait: Wait::Ticket,
                })
                .collect::<Vec<_>>()
        };
        for ticket in &tickets {
            inner.wait(OP, ticket)?;
        }
        inner.watch.recycle(tickets.into_iter().map(|t| t.event));
        Ok(())
    }

    fn is_healthy(&self) -> bool {
        self.inner.health.is_healthy()
    }

    fn attempt_reconnect(&self) -> Result<()> {
        self.reconnect()
    }

    fn shutdown(&self) -> Result<()> {
        self.shut_down()
    }

    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world_size(&self) -> usize {
        self.inner.world_size
    }
}
