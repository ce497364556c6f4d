//! Running a normalized program's steps on one rank: the threads take
//! turns, each step allocates its buffers from the plan, makes its calls
//! and queues its buffers for the next sync point, where they are checked
//! against the host reference.
//!
//! Invariants:
//! - Step `i` is the rank's turn `i`, taken by the step's thread
//!   (`super::super::turns`), so every rank issues the same calls in the
//!   same order whatever the interleaving of its threads; a thread waits
//!   for its turn at most until the program's deadline.
//! - A buffer is passed to a call only as a view of memory this rank state
//!   owns, and stays owned (pending, a slot, a graph, or retired) until a
//!   sync point proved its work finished or the backends were shut down.
//! - Outputs are checked only after every backend synchronized and every
//!   caller stream went idle; after a failure, buffers are no longer
//!   checked (their work may not have run) but still kept.
//! - A panic in a step is caught and reported as that step's failure.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use metrale_comm::{CommBackend, CommError, NcclBackend, Registration};
use nccl_safe::{Context, DeviceView, DeviceViewMut, Graph, GraphExec, Stream, StreamRef};
use parking_lot::Mutex;

use super::super::turns::Turns;
use super::device::{Mem, device, pair, write_sym};
use super::program::{COLLECTIVE_TIMEOUT, Item, On, Op, Program, Step};
use super::reference::{NORM_EPS, Plan, StepPlan, compare, compare_f64};
use crate::RankCtx;
use crate::data::size_name;

/// A buffer to check at the next sync point (`want: None`: only kept alive).
pub(super) struct Pending {
    pub what: String,
    pub mem: Mem,
    pub want: Option<Vec<i32>>,
    /// As `want`, for values that need not be whole.
    pub want_f64: Option<Vec<f64>>,
}

pub(super) struct SlotMem {
    pub mem: Mem,
    /// The backend it is registered with, and the registration.
    pub handle: Option<(usize, Registration)>,
}

pub(super) struct GraphMem {
    exec: GraphExec,
    _graph: Graph,
    stream: usize,
    mem: Mem,
}

#[derive(Default)]
pub(super) struct RankState {
    pub pending: Vec<Pending>,
    pub slots: HashMap<u32, SlotMem>,
    pub graphs: HashMap<u32, GraphMem>,
    pub failures: Vec<String>,
    /// Memory kept until the backends are shut down: after a failure,
    /// work may still use it.
    pub retired: Vec<Mem>,
}

/// One program on this rank.
pub(super) struct Run<'a> {
    pub ctx: &'a RankCtx,
    pub prog: &'a Program,
    pub plan: &'a Plan,
    pub backends: &'a [NcclBackend],
    pub streams: &'a [Stream],
    pub c: &'a Arc<Context>,
    pub st: Mutex<RankState>,
    pub turns: Turns,
    pub deadline: Instant,
}

/// The memory of slot `s`.
fn slot(st: &mut RankState, s: u32) -> anyhow::Result<&mut Mem> {
    st.slots
        .get_mut(&s)
        .map(|m| &mut m.mem)
        .with_context(|| format!("slot #{s} does not exist on this rank"))
}

/// `r`, or its error, led by `what` unless the error names it already.
/// A send (view, destination, stream) and a receive (view, source,
/// stream), called in that order or the receive first: the first error.
fn send_recv(
    be: &NcclBackend,
    (send, to, s): (DeviceView<'_>, usize, StreamRef<'_>),
    (recv, from, rs): (DeviceViewMut<'_>, usize, StreamRef<'_>),
    recv_first: bool,
) -> Result<(), CommError> {
    if recv_first {
        be.recv_from(recv, from, rs)
            .and_then(|()| be.send_to(send, to, s))
    } else {
        be.send_to(send, to, s)
            .and_then(|()| be.recv_from(recv, from, rs))
    }
}

pub(super) fn call(what: &str, r: Result<(), CommError>) -> anyhow::Result<()> {
    r.map_err(|e| {
        let m = e.to_string();
        if m.starts_with(what) {
            anyhow::anyhow!(m)
        } else {
            anyhow::anyhow!("{what}: {m}")
        }
    })
}

impl Run<'_> {
    pub fn label(&self, i: usize) -> String {
        let s = &self.prog.steps[i];
        format!("#{} t{} {}", s.uid, s.thread, s.op)
    }

    /// Takes this thread's turns in order.
    pub fn worker(&self, t: usize) {
        if let Err(e) = self.c.make_current() {
            self.st
                .lock()
                .failures
                .push(format!("thread {t}: make_current: {e}"));
            self.turns.stop();
            return;
        }
        let n = self.prog.steps.len();
        for i in (0..n).filter(|&i| self.prog.steps[i].thread == t) {
            if let Err(e) = self.turns.wait(i, self.deadline) {
                self.st.lock().failures.push(format!("thread {t}: {e:#}"));
                return;
            }
            let label = self.label(i);
            self.ctx.step(format!(
                "fuzz seed {:#x}: step {}/{n}: {label}",
                self.prog.seed,
                i + 1
            ));
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.exec(i)))
                .unwrap_or_else(|p| {
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    Err(anyhow::anyhow!("panicked: {msg}"))
                });
            if let Err(e) = r {
                self.st.lock().failures.push(format!("{label}: {e:#}"));
            }
            self.turns.done(i);
        }
    }

    /// Runs step `i`: allocates its buffers, makes its calls, queues its
    /// checks. An `Err` is a call that failed.
    fn exec(&self, i: usize) -> anyhow::Result<()> {
        let step = &self.prog.steps[i];
        let plan = &self.plan.steps[i];
        let mut st = self.st.lock();
        let label = self.label(i);
        if let Op::SyncAll = step.op {
            self.sync_all(&mut st, plan, &label);
            return Ok(());
        }
        let mut mems = Vec::with_capacity(plan.bufs.len());
        if !matches!(step.op, Op::Alloc { sym: Some(_), .. }) {
            for bp in &plan.bufs {
                mems.push(device(self.c, bp)?);
            }
        }
        let r = self.issue(&mut st, step, plan, &mut mems);
        let ok = r.is_ok() && st.failures.is_empty();
        for (m, bp) in mems.into_iter().zip(&plan.bufs) {
            st.pending.push(Pending {
                what: format!("{label}: {}", bp.role),
                mem: m,
                want: if ok { bp.want.clone() } else { None },
                want_f64: if ok { bp.want_f64.clone() } else { None },
            });
        }
        r
    }

    /// The calls of one step. Buffers left in `mems` are kept until the
    /// next sync point.
    fn issue(
        &self,
        st: &mut RankState,
        step: &Step,
        plan: &StepPlan,
        mems: &mut Vec<Mem>,
    ) -> anyhow::Result<()> {
        let rank = self.ctx.rank;
        let w = self.prog.world;
        let stream = |s: usize| self.streams[s].as_ref();
        // Every view below is of memory the rank state owns until a sync
        // point or the teardown after shutdown; every stream is one of this
        // program's, alive as long.
        match &step.op {
            Op::AllReduce { b, on, .. } => {
                let buf = match on {
                    On::Fresh => mems[0].view_mut(),
                    On::Slot(s) => slot(st, *s)?.view_mut(),
                };
                call("all_reduce", self.backends[*b].all_reduce(buf))
            }
            Op::AllReduceAsync {
                b, stream: s, on, ..
            } => {
                let buf = match on {
                    On::Fresh => mems[0].view_mut(),
                    On::Slot(x) => slot(st, *x)?.view_mut(),
                };
                call(
                    "all_reduce_async",
                    self.backends[*b].all_reduce_async(buf, stream(*s)),
                )
            }
            Op::AddRmsNorm { b, stream: s, .. } => {
                let (x, rest) = mems.split_at_mut(1);
                let (r, w) = rest.split_at_mut(1);
                call(
                    "all_reduce_add_rms_norm",
                    self.backends[*b].all_reduce_add_rms_norm(
                        x[0].view_mut(),
                        r[0].view_mut(),
                        w[0].view(),
                        NORM_EPS,
                        stream(*s),
                    ),
                )
            }
            Op::AllGather { b, .. } => {
                let (send, recv) = pair(mems, 0);
                call("all_gather", self.backends[*b].all_gather(send, recv))
            }
            Op::ReduceScatter { b, .. } => {
                let (send, recv) = pair(mems, 0);
                call(
                    "reduce_scatter",
                    self.backends[*b].reduce_scatter(send, recv),
                )
            }
            Op::Broadcast { b, root, .. } => call(
                "broadcast",
                self.backends[*b].broadcast(mems[0].view_mut(), *root),
            ),
            Op::AllToAll { b, .. } => {
                let (send, recv) = pair(mems, 0);
                call("all_to_all", self.backends[*b].all_to_all(send, recv))
            }
            Op::AllToAllV { b, counts, .. } => {
                let send_counts = counts[rank].clone();
                let recv_counts: Vec<usize> = counts.iter().map(|row| row[rank]).collect();
                let (send, recv) = pair(mems, 0);
                call(
                    "all_to_all_v",
                    self.backends[*b].all_to_all_v(send, &send_counts, recv, &recv_counts),
                )
            }
            Op::Barrier { b } => call("barrier", self.backends[*b].barrier()),
            Op::Command { b, root } => {
                let be = &self.backends[*b];
                if rank == *root {
                    call(
                        "broadcast (command)",
                        be.broadcast(mems[0].view_mut(), *root),
                    )
                } else {
                    call(
                        "recv_command_u32",
                        be.recv_command_u32(mems[0].view_mut(), *root),
                    )
                }
            }
            Op::SendRecv {
                b,
                stream: s,
                recv_stream: rs,
                shift,
                recv_first,
                ..
            } => {
                let be = &self.backends[*b];
                let (to, from) = ((rank + shift) % w, (rank + w - shift) % w);
                call("group_start", be.group_start())?;
                let (send, recv) = pair(mems, 0);
                let r = send_recv(
                    be,
                    (send, to, stream(*s)),
                    (recv, from, stream(*rs)),
                    *recv_first,
                );
                let end = be.group_end();
                call("send_to/recv_from", r)?;
                call("group_end", end)
            }
            Op::SendOne {
                b,
                stream: s,
                from,
                to,
                ..
            } => {
                let be = &self.backends[*b];
                if rank == *from {
                    call("send_to", be.send_to(mems[0].view(), *to, stream(*s)))
                } else if rank == *to {
                    call(
                        "recv_from",
                        be.recv_from(mems[0].view_mut(), *from, stream(*s)),
                    )
                } else {
                    Ok(())
                }
            }
            Op::Group { b, items } => self.group(*b, items, mems),
            Op::Alloc { n, sym } => {
                let init = plan.bufs[0].init.as_deref().unwrap_or(&[]);
                let mem = match sym {
                    Some(b) => {
                        let mut alloc = self.backends[*b].symmetric_alloc(2 * n).map_err(|e| {
                            anyhow::anyhow!("symmetric_alloc {}: {e}", size_name(2 * n))
                        })?;
                        if let Err(e) = write_sym(self.c, &mut alloc, init) {
                            st.retired.push(Mem::Sym { b: *b, alloc });
                            return Err(e);
                        }
                        Mem::Sym { b: *b, alloc }
                    }
                    None => mems.remove(0),
                };
                st.slots.insert(step.uid, SlotMem { mem, handle: None });
                Ok(())
            }
            Op::Register { b, slot: s } => {
                let view = slot(st, *s)?.view();
                // SAFETY: the slot's memory is one allocation that stays
                // allocated until it is deregistered (a later step, or the
                // teardown, which deregisters before it frees).
                let h = unsafe { self.backends[*b].register_buffer(view) }
                    .map_err(|e| anyhow::anyhow!("register_buffer: {e}"))?;
                if let Some(m) = st.slots.get_mut(s) {
                    m.handle = Some((*b, h));
                }
                Ok(())
            }
            Op::Deregister { slot } => {
                let handle = st.slots.get_mut(slot).and_then(|m| m.handle.take());
                let (b, h) = handle.with_context(|| format!("slot #{slot} is not registered"))?;
                call("deregister_buffer", self.backends[b].deregister_buffer(h))
            }
            Op::Free { slot } => {
                let m = st
                    .slots
                    .remove(slot)
                    .with_context(|| format!("slot #{slot} does not exist on this rank"))?;
                match m.mem {
                    Mem::Sym { b, alloc } => {
                        call("symmetric_free", self.backends[b].symmetric_free(alloc))
                    }
                    mem if st.failures.is_empty() => {
                        drop(mem);
                        Ok(())
                    }
                    mem => {
                        st.retired.push(mem);
                        Ok(())
                    }
                }
            }
            Op::Capture { b, stream: s, .. } => {
                let mut m = mems.remove(0);
                let sm = &self.streams[*s];
                let captured = (|| -> anyhow::Result<(Graph, GraphExec)> {
                    sm.begin_capture()?;
                    // The graph keeps the buffer's address: the buffer lives
                    // as long as the graph.
                    let r = self.backends[*b].all_reduce_async(m.view_mut(), sm.as_ref());
                    let g = sm.end_capture();
                    call("all_reduce_async under capture", r)?;
                    let g = g?;
                    let exec = g.instantiate()?;
                    Ok((g, exec))
                })();
                match captured {
                    Ok((g, exec)) => {
                        st.graphs.insert(
                            step.uid,
                            GraphMem {
                                exec,
                                _graph: g,
                                stream: *s,
                                mem: m,
                            },
                        );
                        Ok(())
                    }
                    Err(e) => {
                        st.retired.push(m);
                        Err(e)
                    }
                }
            }
            Op::Replay { graph, .. } => {
                let g = st
                    .graphs
                    .get_mut(graph)
                    .with_context(|| format!("graph #{graph} was not captured on this rank"))?;
                let sm = &self.streams[g.stream];
                if let Some(v) = &plan.refill {
                    sm.wait_until_idle(COLLECTIVE_TIMEOUT)
                        .context("the graph's stream before a refill")?;
                    g.mem.refill(self.c, v)?;
                }
                g.exec.launch(sm).context("GraphExec::launch")
            }
            Op::ReplayAll { rounds } => {
                let mut ids: Vec<u32> = st.graphs.keys().copied().collect();
                ids.sort_unstable();
                for round in 0..*rounds {
                    for (id, _, v) in plan.refills.iter().filter(|r| r.1 == round) {
                        let g = st
                            .graphs
                            .get_mut(id)
                            .with_context(|| format!("graph #{id} was not captured here"))?;
                        self.streams[g.stream]
                            .wait_until_idle(COLLECTIVE_TIMEOUT)
                            .context("a graph's stream before a refill")?;
                        g.mem.refill(self.c, v)?;
                    }
                    for id in &ids {
                        let g = &st.graphs[id];
                        g.exec
                            .launch(&self.streams[g.stream])
                            .with_context(|| format!("GraphExec::launch of graph #{id}"))?;
                    }
                }
                Ok(())
            }
            Op::Synchronize { b } => call("synchronize", self.backends[*b].synchronize()),
            Op::Bad { b, bad } => self.bad(*b, *bad),
            Op::SyncAll => Ok(()),
        }
    }

    fn group(&self, b: usize, items: &[Item], mems: &mut [Mem]) -> anyhow::Result<()> {
        let be = &self.backends[b];
        let rank = self.ctx.rank;
        let w = self.prog.world;
        call("group_start", be.group_start())?;
        let mut k = 0;
        let mut first = None;
        for it in items {
            let s = |x: usize| self.streams[x].as_ref();
            let r = match it {
                Item::AllReduce { .. } => be.all_reduce(mems[k].view_mut()),
                Item::AllReduceAsync { stream, .. } => {
                    be.all_reduce_async(mems[k].view_mut(), s(*stream))
                }
                Item::AllGather { .. } => {
                    let (send, recv) = pair(mems, k);
                    be.all_gather(send, recv)
                }
                Item::ReduceScatter { .. } => {
                    let (send, recv) = pair(mems, k);
                    be.reduce_scatter(send, recv)
                }
                Item::SendRecv {
                    stream,
                    recv_stream,
                    shift,
                    recv_first,
                    ..
                } => {
                    let (to, from) = ((rank + shift) % w, (rank + w - shift) % w);
                    let (send, recv) = pair(mems, k);
                    send_recv(
                        be,
                        (send, to, s(*stream)),
                        (recv, from, s(*recv_stream)),
                        *recv_first,
                    )
                }
            };
            k += match it {
                Item::AllReduce { .. } | Item::AllReduceAsync { .. } => 1,
                _ => 2,
            };
            if let Err(e) = r {
                first.get_or_insert(format!("{it} in a group: {e}"));
            }
        }
        let end = be.group_end();
        if let Some(e) = first {
            anyhow::bail!("{e}");
        }
        call("group_end", end)
    }

    /// Synchronizes every backend and caller stream, then checks every
    /// pending buffer, slot and graph buffer against `plan`.
    pub fn sync_all(&self, st: &mut RankState, plan: &StepPlan, what: &str) {
        let mut settled = true;
        for (k, b) in self.backends.iter().enumerate() {
            if let Err(e) = b.synchronize() {
                st.failures.push(format!("{what}: b{k} synchronize: {e}"));
                settled = false;
            }
        }
        for (k, s) in self.streams.iter().enumerate() {
            if let Err(e) = s.wait_until_idle(2 * COLLECTIVE_TIMEOUT) {
                st.failures
                    .push(format!("{what}: caller stream s{k} did not go idle: {e}"));
                settled = false;
            }
        }
        let pending = std::mem::take(&mut st.pending);
        for p in pending {
            if settled && let Some(want) = &p.want {
                match p.mem.read(self.c) {
                    Ok(got) => st.failures.extend(compare(&p.what, &got, want)),
                    Err(e) => st.failures.push(format!("{}: reading back: {e:#}", p.what)),
                }
            }
            if settled && let Some(want) = &p.want_f64 {
                match p.mem.read(self.c) {
                    Ok(got) => st.failures.extend(compare_f64(&p.what, &got, want)),
                    Err(e) => st.failures.push(format!("{}: reading back: {e:#}", p.what)),
                }
            }
            if st.failures.is_empty() {
                drop(p.mem);
            } else {
                st.retired.push(p.mem);
            }
        }
        if !settled {
            return;
        }
        for (uid, want) in &plan.slots {
            let Some(m) = st.slots.get(uid) else { continue };
            match m.mem.read(self.c) {
                Ok(got) => {
                    let found = compare(&format!("{what}: slot #{uid}"), &got, want);
                    st.failures.extend(found);
                }
                Err(e) => st.failures.push(format!("{what}: slot #{uid}: {e:#}")),
            }
        }
        for (uid, want) in &plan.graphs {
            let Some(g) = st.graphs.get(uid) else {
                continue;
            };
            match g.mem.read(self.c) {
                Ok(got) => {
                    let found = compare(&format!("{what}: graph #{uid}'s buffer"), &got, want);
                    st.failures.extend(found);
                }
                Err(e) => st.failures.push(format!("{what}: graph #{uid}: {e:#}")),
            }
        }
    }
}
