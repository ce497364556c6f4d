//! The one-shot all-reduce over peer memory, for the 2 to 8 ranks of one
//! node: every rank pushes its bf16, f16 or f32 input into a buffer of
//! every peer, and every rank adds all contributions itself, in rank order,
//! in f32 (`kernels/one_shot.cu` has the protocol;
//! [`crate::kernels::one_shot_sum`] the arithmetic). One kernel launch per
//! call (per chunk of the slot size), no barrier, no NCCL call.
//!
//! This file holds the path's state, [`OneShot`] (in the slot: the
//! kernels, this generation's buffers and the events that order the lanes)
//! and [`Flags`] (outside it), and its enqueue; `one_shot_setup` sets it
//! up over each new communicator and releases it.
//!
//! Invariants:
//! - Ordering of the buffers, reused across operations (decision 0017):
//!   eager one-shots use lane 0 and are ordered by `eager_done` across
//!   streams (recorded after each, waited for by the next on another
//!   stream); one-shots captured into a graph use lane 1, which eager work
//!   never touches, so a graph replaying beside eager work may overlap it
//!   freely. Lane 1 is ordered by launch, as NCCL orders its own captured
//!   kernels: a graph's first captured one-shot begins with an external
//!   wait on `graph_serial` and every captured one-shot ends with an
//!   external record of it, so at each launch of a graph its one-shots
//!   wait for those of every graph launched before it on this rank, on
//!   whatever stream; a graph's later one-shots are ordered after its
//!   earlier ones by the graph (stream order, or its capture's own fork
//!   event across its streams, one per open capture, so graphs captured
//!   on several threads at once never share one), never by an external
//!   wait, which would wait for the same graph's own records. Graphs replayed
//!   on several streams at once, or from several threads, are correct as
//!   long as every rank launches them in the same order (what NCCL's own
//!   captured collectives need; ranks that launch them in different
//!   orders get wrong sums, as with NCCL). A call that still finds its
//!   lane held by another running call of this rank records the
//!   concurrent-use status, which poisons the backend.
//! - Nothing waits on the host and no kernel argument changes between
//!   replays: the lanes' claim words (owner and epoch) live in device
//!   memory, the abort and status words in pinned memory.
//! - Every spin is bounded: by the collective timeout plus
//!   [`KERNEL_GRACE`] (the kernel's own clock; the watchdog's deadline on
//!   eager work comes first), and by the abort word, which poisoning,
//!   shutdown and reconnect set. A status set by the kernel poisons the
//!   backend when the watchdog or a waiter next looks (before it counts
//!   any completion).
//! - Graphs that captured a one-shot must not be replayed after a
//!   reconnect or shutdown (their control block is gone), as with NCCL's
//!   captured collectives on a destroyed communicator; replays launched
//!   before it are waited for (bounded, through `graph_serial`) before the
//!   release closes any mapping or frees anything, else everything is
//!   leaked.
//!
//! Lock order: [`Flags`] has one lock, a leaf; [`OneShot`] lives in the
//! slot and is used under the slot lock.

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::Duration;

use cuda_sys::CUstream;
use nccl_safe::{Context, DataType, DeviceBuffer, Event, Function, HostWords, IpcMapping, Module};
use parking_lot::Mutex;

use super::submission::{Capture, Target};
use crate::config::OneShotPolicy;
use crate::error::FailureKind;
use crate::kernels;
use crate::validate::Span;

use crate::kernels::OneShotStatus;
pub(super) use crate::kernels::abi::one_shot::{LANE_EAGER, LANE_GRAPH};
/// The largest slot (bytes one rank sends one peer per launch).
const MAX_SLOT_BYTES: usize = 1 << 20;
/// The smallest slot: room for the set-up probe's calls, which span two
/// blocks of every type's kernel.
pub(super) const MIN_SLOT_BYTES: usize = 16 << 10;
/// The sentinel filling every free slot word.
pub(super) const SENTINEL: u32 = kernels::ONE_SHOT_SENTINEL;
/// How much longer than the collective timeout a kernel spins: the
/// watchdog's deadline on eager work comes first (and names the
/// operation); the kernel's own bound ends work no watchdog sees (graph
/// replays).
pub(super) const KERNEL_GRACE: Duration = Duration::from_millis(500);
/// The most ranks the kernel serves.
pub(super) const MAX_RANKS: usize = kernels::abi::one_shot::MAX_RANKS;

/// How a peer's buffer is reached; dropping it closes the mapping.
pub(super) enum PeerMem {
    Own,
    /// An IPC mapping, closed on drop.
    Ipc {
        _mapping: IpcMapping,
    },
    /// A rank of this process: its address, with peer access enabled to its
    /// context (kept retained).
    Direct {
        _peer: Arc<Context>,
    },
}

/// The set-up resources of one generation: a record that
/// `one_shot_setup` fills and frees. Only its release frees them, in
/// order; dropped any other way (a shutdown that could not take the slot)
/// the memory is leaked, never freed under a kernel or a peer.
pub(super) struct Live {
    /// This rank's receive buffer (peers map it).
    pub(super) recv: ManuallyDrop<DeviceBuffer<u32>>,
    /// The kernels' control block.
    pub(super) ctrl: ManuallyDrop<DeviceBuffer<u64>>,
    /// The host-pinned abort and status words.
    pub(super) flags: ManuallyDrop<Arc<HostWords>>,
    /// How each rank's buffer is reached, by rank.
    pub(super) peers: Vec<PeerMem>,
    /// Bytes one rank sends one peer per launch.
    pub(super) slot_bytes: usize,
}

/// The kernel of every type the path serves ([`kernels::ONE_SHOT_ENTRIES`])
/// and its fused add + norm variant ([`crate::norm::fused_one_shot_name`]),
/// of one module; where the device launches clusters, also the fused
/// entries that spread a row over a cluster
/// ([`crate::norm::fused_cluster_name`], [`kernels::ONE_SHOT_SM90_PTX`]).
pub(super) struct Kernels {
    by_type: Vec<(DataType, Function, Function)>,
    cluster: Vec<(DataType, Function)>,
}

impl Kernels {
    /// Loads the kernels; the cluster entries only when `cluster` and the
    /// device can launch clusters. A cluster module that does not load
    /// costs the cluster entries only (one log line), never the path.
    fn load(ctx: &Arc<Context>, cluster: bool) -> nccl_safe::Result<Kernels> {
        kernels::check_ptx_abi(kernels::ONE_SHOT_PTX)
            .map_err(|e| nccl_safe::Error::invalid("one-shot kernels", e))?;
        let module = Module::load_ptx(ctx, kernels::ONE_SHOT_PTX)?;
        let by_type = kernels::ONE_SHOT_ENTRIES
            .iter()
            .map(|&(dtype, name)| {
                let fused = crate::norm::fused_one_shot_name(dtype).unwrap_or_default();
                Ok((dtype, module.function(name)?, module.function(fused)?))
            })
            .collect::<nccl_safe::Result<_>>()?;
        let cluster = if cluster {
            match Self::load_cluster(ctx) {
                Ok(c) => {
                    tracing::debug!(
                        device = ctx.ordinal(),
                        loaded = !c.is_empty(),
                        "the fused cluster kernels (METRALE_COMM_FUSED_CLUSTER=on)"
                    );
                    c
                }
                Err(e) => {
                    tracing::warn!(
                        device = ctx.ordinal(),
                        "the fused cluster kernels do not load ({e}); one block takes a row"
                    );
                    Vec::new()
                }
            }
        } else {
            Vec::new()
        };
        Ok(Kernels { by_type, cluster })
    }

    /// The cluster entries, empty where the device cannot launch clusters.
    fn load_cluster(ctx: &Arc<Context>) -> nccl_safe::Result<Vec<(DataType, Function)>> {
        if !nccl_safe::driver::supports_cluster_launch(ctx.ordinal())? {
            return Ok(Vec::new());
        }
        kernels::check_ptx_abi(kernels::ONE_SHOT_SM90_PTX)
            .map_err(|e| nccl_safe::Error::invalid("fused cluster kernels", e))?;
        let module = Module::load_ptx(ctx, kernels::ONE_SHOT_SM90_PTX)?;
        kernels::ONE_SHOT_ENTRIES
            .iter()
            .map(|&(dtype, _)| {
                let name = crate::norm::fused_cluster_name(dtype).unwrap_or_default();
                Ok((dtype, module.function(name)?))
            })
            .collect()
    }

    /// The kernel for `dtype`, `None` for a type the path does not serve.
    pub(super) fn of(&self, dtype: DataType) -> Option<&Function> {
        self.by_type
            .iter()
            .find(|(t, ..)| *t == dtype)
            .map(|(_, f, _)| f)
    }

    /// The fused add + norm kernel for `dtype`.
    fn fused(&self, dtype: DataType) -> Option<&Function> {
        self.by_type
            .iter()
            .find(|(t, ..)| *t == dtype)
            .map(|(.., f)| f)
    }

    /// The fused cluster kernel for `dtype`, where loaded.
    fn fused_cluster(&self, dtype: DataType) -> Option<&Function> {
        self.cluster
            .iter()
            .find(|(t, _)| *t == dtype)
            .map(|(_, f)| f)
    }
}

/// The one-shot path's state, in the slot.
pub(super) struct OneShot {
    kernels: Option<Kernels>,
    live: Option<Live>,
    /// Every rank proved the path: it is on.
    on: bool,
    /// Why it is off.
    off: String,
    /// The generation whose set-up exchanged good records from every rank
    /// (so peers may map this rank's buffer): its release owes the
    /// peers a barrier.
    exchanged: Option<u64>,
    /// Recorded after every eager one-shot (see the module docs).
    eager_done: Event,
    eager_stream: Option<CUstream>,
    /// The graph lane's order across graphs: a graph's first captured
    /// one-shot waits for it, and every captured one-shot records it, as
    /// external events, so replays run in launch order (NCCL's strong
    /// stream does the same for its captured kernels).
    graph_serial: Event,
    /// The captures with a one-shot, newest last (at most
    /// [`MAX_OPEN_CAPTURES`]): each one's last one-shot stream and its own
    /// event ordering its later one-shots after its earlier ones, so
    /// captures on several threads at once never share one.
    captures: Vec<OpenCapture>,
    /// A one-shot was captured since the last release: graphs holding it
    /// may be replaying.
    graphs_captured: bool,
}

/// The captures whose one-shot order is kept at once; past it the oldest
/// entry (almost surely a capture long ended) is reused.
const MAX_OPEN_CAPTURES: usize = 64;

/// A capture that holds a one-shot.
struct OpenCapture {
    /// Its capture sequence id.
    id: u64,
    /// The stream of its last one-shot.
    stream: CUstream,
    /// Recorded after its last one-shot and waited for by a later one on
    /// another of its streams (capture-internal: a graph edge, no node at
    /// replay).
    fork: Event,
}

impl OneShot {
    pub(super) fn new(ctx: &Arc<Context>) -> nccl_safe::Result<OneShot> {
        Ok(OneShot {
            kernels: None,
            live: None,
            on: false,
            off: "not set up".to_string(),
            exchanged: None,
            eager_done: Event::new(ctx, false)?,
            eager_stream: None,
            graph_serial: Event::new(ctx, false)?,
            captures: Vec::new(),
            graphs_captured: false,
        })
    }

    /// The kernels, loaded on first use (backends whose policy or world
    /// size rules the path out never JIT-compile them).
    /// `cluster`: load the fused cluster entries where the device can
    /// launch them ([`crate::BackendConfig::fused_cluster`]).
    pub(super) fn load_kernels(
        &mut self,
        ctx: &Arc<Context>,
        cluster: bool,
    ) -> nccl_safe::Result<()> {
        if self.kernels.is_none() {
            self.kernels = Some(Kernels::load(ctx, cluster)?);
        }
        Ok(())
    }

    /// Whether the path is on (set up and proven on every rank).
    pub(super) fn is_on(&self) -> bool {
        self.on
    }

    /// Why the path is off, `None` when it is on.
    pub(super) fn why_off(&self) -> Option<&str> {
        (!self.on).then_some(self.off.as_str())
    }

    /// The loaded kernel for `dtype`, if any.
    pub(super) fn kernel(&self, dtype: DataType) -> Option<&Function> {
        self.kernels.as_ref().and_then(|k| k.of(dtype))
    }

    /// Starts a set-up: the path is off and no stream's work is ordered
    /// any more (a new communicator's calls start afresh).
    pub(super) fn begin_setup(&mut self) {
        self.on = false;
        self.eager_stream = None;
        self.captures.clear();
    }

    /// Keeps this generation's set-up resources.
    pub(super) fn set_live(&mut self, live: Live) {
        self.live = Some(live);
    }

    /// This generation's set-up resources, if any.
    pub(super) fn live(&self) -> Option<&Live> {
        self.live.as_ref()
    }

    /// The same, to fill in.
    pub(super) fn live_mut(&mut self) -> Option<&mut Live> {
        self.live.as_mut()
    }

    /// Notes that every rank's first record of `generation` was good: peers
    /// may map this rank's buffer, so its release owes them a barrier.
    pub(super) fn set_exchanged(&mut self, generation: u64) {
        self.exchanged = Some(generation);
    }

    /// Turns the path on (every rank proved it); the words to publish.
    pub(super) fn turn_on(&mut self) -> Option<Arc<HostWords>> {
        self.on = true;
        self.off.clear();
        self.live.as_ref().map(|l| Arc::clone(&l.flags))
    }

    /// Keeps the path off, saying why.
    pub(super) fn turn_off(&mut self, why: String) {
        self.on = false;
        self.off = why;
    }

    /// Turns the path off for a release: the generation whose release owes
    /// the peers a barrier, if any, and the resources to release.
    pub(super) fn take_for_release(&mut self) -> (Option<u64>, Option<Live>) {
        self.on = false;
        (self.exchanged.take(), self.live.take())
    }

    /// Waits up to `within` for this rank's last eager one-shot; whether
    /// it finished (or there was none).
    pub(super) fn drain_eager(&mut self, within: Duration) -> bool {
        self.eager_stream.take().is_none() || self.eager_done.wait_with_deadline(within).is_ok()
    }

    /// Waits up to `within` for the one-shots of every graph launched so
    /// far on this rank, on whatever stream (each records `graph_serial`
    /// at its end, and each waits for the ones launched before it, so the
    /// last record is the last to complete); whether they finished.
    pub(super) fn drain_graphs(&mut self, within: Duration) -> bool {
        !std::mem::take(&mut self.graphs_captured)
            || self.graph_serial.wait_with_deadline(within).is_ok()
    }

    /// Enqueues a one-shot all-reduce of `span` at `target` (lane 1 when
    /// captured), in chunks of the slot size.
    pub(super) fn enqueue(
        &mut self,
        ctx: &Arc<Context>,
        span: Span,
        target: Target,
    ) -> nccl_safe::Result<()> {
        let dtype = span.dtype;
        let kernel = self.kernel(dtype).cloned();
        let (Some(live), Some(kernel), true) = (self.live.as_ref(), kernel, self.on) else {
            return Err(nccl_safe::Error::invalid(
                "one-shot all-reduce",
                format!("the path is off for {dtype}"),
            ));
        };
        let (ctrl, chunk) = (live.ctrl.device_ptr(), live.slot_bytes / dtype.size());
        self.ordered(ctx, target, |lane, stream| {
            for piece in span.chunks(chunk) {
                // SAFETY: `kernel` is `dtype`'s; the piece lies inside the
                // caller's view of `dtype` values on this context; `ctrl` is
                // this rank's set-up control block, which lives until the
                // release waited for this work.
                unsafe {
                    kernels::launch_one_shot(
                        &kernel,
                        ctrl,
                        piece.ptr,
                        (piece.len, dtype),
                        lane,
                        stream,
                    )?
                };
            }
            Ok(())
        })
    }

    /// How many rows of `args` one fused launch takes (its slot's worth),
    /// `None` when the fused kernel cannot take them (the path off, rows
    /// larger than a slot, or rows and addresses not 16-byte aligned).
    pub(super) fn fused_rows(&self, args: &crate::norm::NormArgs) -> Option<usize> {
        let live = self.live.as_ref().filter(|_| self.on)?;
        self.kernels.as_ref()?.fused(args.dtype)?;
        let per = live.slot_bytes / (args.hidden * args.dtype.size());
        (args.fusable() && per > 0).then_some(per)
    }

    /// Enqueues the fused one-shot all-reduce + add + norm of `args` at
    /// `target`, one launch per slot's worth of rows; the caller checked
    /// [`OneShot::fused_rows`].
    pub(super) fn enqueue_fused(
        &mut self,
        ctx: &Arc<Context>,
        args: crate::norm::NormArgs,
        target: Target,
    ) -> nccl_safe::Result<()> {
        let kernel = self
            .kernels
            .as_ref()
            .and_then(|k| k.fused(args.dtype))
            .cloned();
        let cluster = self
            .kernels
            .as_ref()
            .and_then(|k| k.fused_cluster(args.dtype))
            .cloned();
        let (Some(per), Some(live), Some(kernel)) =
            (self.fused_rows(&args), self.live.as_ref(), kernel)
        else {
            return Err(nccl_safe::Error::invalid(
                "fused one-shot all-reduce",
                format!("the path cannot take these rows of {}", args.dtype),
            ));
        };
        let ctrl = live.ctrl.device_ptr();
        self.ordered(ctx, target, |lane, stream| {
            for first in (0..args.rows).step_by(per) {
                let piece = args.rows(first, per.min(args.rows - first));
                let spread = crate::norm::fused_cluster_size(piece.hidden, piece.rows, piece.dtype);
                match &cluster {
                    // SAFETY: as below; `c` is the cluster entry of the type,
                    // loaded only where the device launches clusters.
                    Some(c) if spread > 1 => unsafe {
                        crate::norm::launch_fused_cluster(c, ctrl, piece, lane, stream)?
                    },
                    // SAFETY: `kernel` is the fused entry of the type; the
                    // rows lie inside the caller's checked views on this
                    // context and fill at most one slot; `ctrl` as in
                    // `enqueue`.
                    _ => unsafe { crate::norm::launch_fused(&kernel, ctrl, piece, lane, stream)? },
                }
            }
            Ok(())
        })
    }

    /// Runs `launch(lane, stream)` ordered with this rank's other one-shots
    /// (see the module docs): lane 1 and the graph order when `target` is
    /// captured, lane 0 and `eager_done` otherwise.
    fn ordered(
        &mut self,
        ctx: &Arc<Context>,
        target: Target,
        launch: impl FnOnce(u32, CUstream) -> nccl_safe::Result<()>,
    ) -> nccl_safe::Result<()> {
        let stream = target.stream;
        let captured = target.capture == Capture::Graph;
        let lane = if captured { LANE_GRAPH } else { LANE_EAGER };
        let mut open = None;
        if captured {
            // SAFETY: `stream` is the caller's live stream of this context
            // (a `StreamRef`), capturing.
            let Some(id) = (unsafe { nccl_safe::Stream::capture_id_raw(ctx, stream)? }) else {
                // An invalidated capture: nothing is enqueued, and the
                // capture fails at its end anyway.
                return Err(nccl_safe::Error::invalid(
                    "one-shot all-reduce",
                    "the stream's capture is invalidated",
                ));
            };
            let at = match self.captures.iter().position(|c| c.id == id) {
                // A later one-shot of the same graph: ordered after the
                // earlier ones by the graph itself (stream order, or an
                // edge from the earlier one's stream). An external wait
                // here would wait for this very graph's own records.
                Some(at) => {
                    let c = &self.captures[at];
                    if c.stream != stream {
                        // SAFETY: both streams are capturing into this
                        // graph; the event is this capture's.
                        unsafe { c.fork.wait_raw(stream)? };
                    }
                    at
                }
                // A graph's first one-shot: it waits, at each launch, for
                // the one-shots of every graph launched before it.
                None => {
                    // SAFETY: as above; the event is ours and outlives
                    // every graph that may replay this (a graph must not
                    // be replayed after the backend's release, as its
                    // control block).
                    unsafe { self.graph_serial.wait_external_raw(stream)? };
                    let fork = if self.captures.len() >= MAX_OPEN_CAPTURES {
                        self.captures.remove(0).fork
                    } else {
                        Event::new(ctx, false)?
                    };
                    self.captures.push(OpenCapture { id, stream, fork });
                    self.captures.len() - 1
                }
            };
            open = Some(at);
        } else if self.eager_stream.is_some_and(|s| s != stream) {
            // SAFETY: `stream` is ours or the caller's live stream of this
            // context (a `StreamRef`); the event is ours.
            unsafe { self.eager_done.wait_raw(stream)? };
        }
        launch(lane, stream)?;
        if let Some(at) = open {
            self.graphs_captured = true;
            let c = &mut self.captures[at];
            c.stream = stream;
            // SAFETY: as above.
            unsafe {
                self.graph_serial.record_external_raw(stream)?;
                c.fork.record_raw(stream)?;
            }
        } else {
            // SAFETY: as above.
            unsafe { self.eager_done.record_raw(stream)? };
            self.eager_stream = Some(stream);
        }
        Ok(())
    }
}

/// The slot size for a policy: its largest payload, in whole 16-byte
/// units, within [`MIN_SLOT_BYTES`]..=[`MAX_SLOT_BYTES`].
pub(super) fn slot_bytes_for(policy: OneShotPolicy) -> usize {
    let max = policy.max_bytes().unwrap_or(0);
    max.min(MAX_SLOT_BYTES)
        .next_multiple_of(16)
        .clamp(MIN_SLOT_BYTES, MAX_SLOT_BYTES)
}

/// The one-shot path's host-pinned abort and status words while it is on:
/// kept outside the slot, so that the watchdog reads the status and
/// poisoning sets the abort without the slot lock. Its one lock is a leaf.
#[derive(Default)]
pub(super) struct Flags(Mutex<Option<Arc<HostWords>>>);

impl Flags {
    /// The kernel's status, as a failure to poison with: `None` when the
    /// path is off, all is well, or the kernel only saw the abort that a
    /// failure, shutdown or reconnect set.
    pub(super) fn failure(&self) -> Option<FailureKind> {
        let code = self
            .0
            .lock()
            .as_ref()
            .map(|f| f.load(kernels::abi::one_shot::FLAG_STATUS))?;
        match OneShotStatus::from_code(code) {
            None if code == 0 => None,
            None => Some(FailureKind::CallFailed(nccl_safe::Error::invalid(
                "one-shot all-reduce",
                format!("the kernel recorded an unknown status {code}"),
            ))),
            Some(OneShotStatus::Aborted) => None,
            Some(status) => Some(FailureKind::OneShot { status }),
        }
    }

    /// Sets the abort word: every one-shot kernel of this rank stops
    /// waiting and exits (its output is not a sum).
    pub(super) fn abort(&self) {
        if let Some(f) = self.0.lock().as_ref() {
            f.store(kernels::abi::one_shot::FLAG_ABORT, 1);
        }
    }

    /// Publishes the words of a path just turned on.
    pub(super) fn set(&self, words: Arc<HostWords>) {
        *self.0.lock() = Some(words);
    }

    /// Forgets the words (the path is off).
    pub(super) fn clear(&self) {
        self.0.lock().take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_policy_within_bounds() {
        assert_eq!(slot_bytes_for(OneShotPolicy::DEFAULT), 1 << 20);
        assert_eq!(slot_bytes_for(OneShotPolicy::Always), 1 << 20);
        let small = OneShotPolicy::Range {
            min_bytes: 0,
            max_bytes: 1000,
        };
        assert_eq!(slot_bytes_for(small), MIN_SLOT_BYTES);
        let odd = OneShotPolicy::Range {
            min_bytes: 0,
            max_bytes: 100_001,
        };
        assert_eq!(slot_bytes_for(odd), 100_016);
    }
}
