//! The one-shot all-reduce over peer memory, for the 2 to 8 ranks of one
//! node: every rank pushes its bf16, f16 or f32 input into a buffer of
//! every peer, and every rank adds all contributions itself, in rank order,
//! in f32 (`kernels/one_shot.cu` has the protocol;
//! [`crate::kernels::one_shot_sum`] the arithmetic). One kernel launch per
//! call (per chunk of the slot size), no barrier, no NCCL call.
//!
//! Set-up, at construction and at every reconnect, over the new
//! communicator (all ranks take the same steps, so the collectives match):
//! 1. allocate this rank's receive buffer (2 lanes x 2 halves x `world`
//!    slots, filled with the sentinel), its 136-byte control block and 2
//!    host-pinned words (abort, status), and export the buffer's IPC handle;
//! 2. exchange a record (handle, address, process, host, slot size) with an
//!    all-reduce of bytes (all-reduces are connected at init, so this makes
//!    no connection inside a blocking call);
//! 3. map every peer's buffer: `cuIpcOpenMemHandle`, or where the driver
//!    refuses a handle of this very process, the peer's address with
//!    `cuCtxEnablePeerAccess`; exchange how that went;
//! 4. prove it: run the kernels on both halves of both lanes with a known
//!    pattern, every type's kernel at least once, and check every element
//!    on the host (a real write to and read from every peer), then exchange
//!    the verdicts. The path is on only if every rank succeeded; otherwise
//!    it is off on every rank, and each rank logs which rank failed and
//!    why.
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
//!   earlier ones by the graph (stream order, or `graph_fork` across its
//!   streams), never by an external wait, which would wait for the same
//!   graph's own records. Graphs replayed
//!   on several streams at once, or from several threads, are correct as
//!   long as every rank launches them in the same order (what NCCL's own
//!   captured collectives need). A call that still finds its lane held by
//!   another running call records the concurrent-use status, which
//!   poisons the backend, instead of corrupting a sum.
//! - Nothing waits on the host and no kernel argument changes between
//!   replays: the lanes' claim words (owner and epoch) live in device
//!   memory, the abort and status words in pinned memory.
//! - Every spin is bounded: by the collective timeout plus
//!   [`KERNEL_GRACE`] (the kernel's own clock; the watchdog's deadline on
//!   eager work comes first), and by the abort word, which poisoning,
//!   shutdown and reconnect set. A status set by the kernel poisons the
//!   backend when the watchdog or a waiter next looks (before it counts
//!   any completion).
//! - Release order (at reconnect and shutdown, poisoned or not): set the
//!   abort word, wait (bounded) for this rank's own one-shot work, close
//!   this rank's mappings of the peers' buffers, then a host barrier
//!   through the rendezvous' store (every peer has closed its mapping of
//!   this rank's buffer), and only then free. The barrier is host-only: a
//!   kernel waiting for a peer could block that peer's teardown of another
//!   communicator, which waits for this GPU. Without the barrier (a peer
//!   that does not come by the deadline) the receive buffer is leaked with
//!   a log line rather than freed under a peer's mapping; the control block
//!   and pinned words too if this rank's own work did not drain. A backend
//!   without a store (a fixed unique id) takes part in the set-up with a
//!   failed record, so the path is off on every rank; a split
//!   sub-communicator meets its group in its parent's store
//!   ([`crate::rendezvous::Rendezvous::group`]). A release owes the
//!   barrier only where every rank's first record was good: otherwise no
//!   rank mapped a peer's buffer, and the buffers are freed at once.
//! - Graphs that captured a one-shot must not be replayed after a
//!   reconnect or shutdown (their control block is gone), as with NCCL's
//!   captured collectives on a destroyed communicator.

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_sys::CUstream;
use nccl_safe::{Context, DataType, DeviceBuffer, Event, Function, HostWords, IpcMapping, Module};

use super::{Inner, Slot};
use crate::config::OneShotPolicy;
use crate::error::FailureKind;
use crate::kernels;

mod setup;

use crate::kernels::OneShotStatus;
use crate::kernels::abi::one_shot::{LANE_EAGER, LANE_GRAPH};
/// The largest slot (bytes one rank sends one peer per launch).
const MAX_SLOT_BYTES: usize = 1 << 20;
/// The smallest slot: room for the set-up probe's calls, which span two
/// blocks of every type's kernel.
const MIN_SLOT_BYTES: usize = 16 << 10;
/// The sentinel filling every free slot word.
const SENTINEL: u32 = kernels::ONE_SHOT_SENTINEL;
/// How much longer than the collective timeout a kernel spins: the
/// watchdog's deadline on eager work comes first (and names the
/// operation); the kernel's own bound ends work no watchdog sees (graph
/// replays).
const KERNEL_GRACE: Duration = Duration::from_millis(500);
/// The most ranks the kernel serves.
const MAX_RANKS: usize = kernels::abi::one_shot::MAX_RANKS;

/// How a peer's buffer is reached; dropping it closes the mapping.
enum PeerMem {
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

/// The set-up resources of one generation. Only `one_shot_release` frees
/// them, in order; dropped any other way (a shutdown that could not take
/// the slot) the memory is leaked, never freed under a kernel or a peer.
struct Live {
    recv: ManuallyDrop<DeviceBuffer<u32>>,
    ctrl: ManuallyDrop<DeviceBuffer<u64>>,
    flags: ManuallyDrop<Arc<HostWords>>,
    peers: Vec<PeerMem>,
    slot_bytes: usize,
}

/// The kernel of every type the path serves ([`kernels::ONE_SHOT_ENTRIES`]),
/// of one module.
struct Kernels(Vec<(DataType, Function)>);

impl Kernels {
    fn load(ctx: &Arc<Context>) -> nccl_safe::Result<Kernels> {
        kernels::check_ptx_abi(kernels::ONE_SHOT_PTX)
            .map_err(|e| nccl_safe::Error::invalid("one-shot kernels", e))?;
        let module = Module::load_ptx(ctx, kernels::ONE_SHOT_PTX)?;
        kernels::ONE_SHOT_ENTRIES
            .iter()
            .map(|&(dtype, name)| Ok((dtype, module.function(name)?)))
            .collect::<nccl_safe::Result<_>>()
            .map(Kernels)
    }

    /// The kernel for `dtype`, `None` for a type the path does not serve.
    fn of(&self, dtype: DataType) -> Option<&Function> {
        self.0.iter().find(|(t, _)| *t == dtype).map(|(_, f)| f)
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
    /// Orders a graph's later one-shots after its earlier ones when they
    /// sit on other streams of the same capture (a capture-internal
    /// record and wait: a graph edge, no node at replay).
    graph_fork: Event,
    /// The capture (id) and stream of the last captured one-shot.
    last_capture: Option<(u64, CUstream)>,
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
            graph_fork: Event::new(ctx, false)?,
            last_capture: None,
        })
    }

    /// The kernels, loaded on first use (backends whose policy or world
    /// size rules the path out never JIT-compile them).
    fn load_kernels(&mut self, ctx: &Arc<Context>) -> nccl_safe::Result<()> {
        if self.kernels.is_none() {
            self.kernels = Some(Kernels::load(ctx)?);
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
}

/// The slot size for a policy: its largest payload, in whole 16-byte
/// units, within [`MIN_SLOT_BYTES`]..=[`MAX_SLOT_BYTES`].
fn slot_bytes_for(policy: OneShotPolicy) -> usize {
    let max = policy.max_bytes().unwrap_or(0);
    max.min(MAX_SLOT_BYTES)
        .next_multiple_of(16)
        .clamp(MIN_SLOT_BYTES, MAX_SLOT_BYTES)
}

impl Inner {
    /// The kernel's status, as a failure to poison with: `None` when the
    /// path is off, all is well, or the kernel only saw the abort that a
    /// failure, shutdown or reconnect set.
    pub(super) fn one_shot_failure(&self) -> Option<FailureKind> {
        let code = self
            .one_shot_flags
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
    pub(super) fn one_shot_abort(&self) {
        if let Some(f) = self.one_shot_flags.lock().as_ref() {
            f.store(kernels::abi::one_shot::FLAG_ABORT, 1);
        }
    }

    /// Enqueues a one-shot all-reduce of `elems` values of `dtype` at `ptr`
    /// on `stream` (lane 1 when `captured`), in chunks of the slot size.
    pub(super) fn one_shot_all_reduce(
        &self,
        slot: &mut Slot,
        (ptr, elems, dtype): (u64, usize, DataType),
        stream: CUstream,
        captured: bool,
    ) -> nccl_safe::Result<()> {
        let os = &mut slot.one_shot;
        let kernel = os.kernels.as_ref().and_then(|k| k.of(dtype)).cloned();
        let (Some(live), Some(kernel), true) = (os.live.as_ref(), kernel, os.on) else {
            return Err(nccl_safe::Error::invalid(
                "one-shot all-reduce",
                format!("the path is off for {dtype}"),
            ));
        };
        let size = dtype.size();
        let (ctrl, chunk) = (live.ctrl.device_ptr(), live.slot_bytes / size);
        let lane = if captured { LANE_GRAPH } else { LANE_EAGER };
        if captured {
            // SAFETY: `stream` is the caller's live stream of this context
            // (a `StreamRef`), capturing.
            let id = unsafe { nccl_safe::Stream::capture_id_raw(&self.ctx, stream)? };
            match os.last_capture {
                // A later one-shot of the same graph: ordered after the
                // earlier ones by the graph itself (stream order, or an
                // edge from the earlier one's stream). An external wait
                // here would wait for this very graph's own records.
                Some((last, s)) if Some(last) == id => {
                    if s != stream {
                        // SAFETY: both streams are capturing into this
                        // graph; the event is ours.
                        unsafe { os.graph_fork.wait_raw(stream)? };
                    }
                }
                // A graph's first one-shot: it waits, at each launch, for
                // the one-shots of every graph launched before it.
                // SAFETY: as above; the event is ours and outlives every
                // graph that may replay this (a graph must not be replayed
                // after the backend's release, as its control block).
                _ => unsafe { os.graph_serial.wait_external_raw(stream)? },
            }
            os.last_capture = id.map(|id| (id, stream));
        } else if os.eager_stream.is_some_and(|s| s != stream) {
            // SAFETY: `stream` is ours or the caller's live stream of this
            // context (a `StreamRef`); the event is ours.
            unsafe { os.eager_done.wait_raw(stream)? };
        }
        let mut off = 0usize;
        while off < elems {
            let len = chunk.min(elems - off);
            let at = ptr + (off * size) as u64;
            // SAFETY: `kernel` is `dtype`'s; the range lies inside the
            // caller's view of `dtype` values on this context; `ctrl` is
            // this rank's set-up control block, which lives until the
            // release waited for this work.
            unsafe { kernels::launch_one_shot(&kernel, ctrl, at, (len, dtype), lane, stream)? };
            off += len;
        }
        if captured {
            // SAFETY: as above.
            unsafe {
                os.graph_serial.record_external_raw(stream)?;
                os.graph_fork.record_raw(stream)?;
            }
        } else {
            // SAFETY: as above.
            unsafe { os.eager_done.record_raw(stream)? };
            os.eager_stream = Some(stream);
        }
        Ok(())
    }

    /// Releases this generation's one-shot buffers in the order the module
    /// docs give, bounded by `deadline`; what cannot be freed in that order
    /// is leaked with a log line (never freed under a peer's mapping or this
    /// rank's own work).
    pub(super) fn one_shot_release(&self, slot: &mut Slot, deadline: Instant) {
        slot.one_shot.on = false;
        let owed = slot.one_shot.exchanged.take();
        let mut live = slot.one_shot.live.take();
        self.one_shot_flags.lock().take();
        if let Some(l) = &live {
            l.flags.store(kernels::abi::one_shot::FLAG_ABORT, 1);
        }
        let left = || deadline.saturating_duration_since(Instant::now());
        let drained = slot.one_shot.eager_stream.take().is_none()
            || slot.one_shot.eager_done.wait_with_deadline(left()).is_ok();
        if let Some(l) = live.as_mut() {
            drop(std::mem::take(&mut l.peers));
        }
        // Every rank that took part in the exchange meets here, its own
        // mappings closed: a host barrier through the rendezvous' store, so
        // no kernel waits for a peer that may be tearing down another
        // communicator (whose teardown waits for this GPU).
        let unmapped = match (owed, self.store.as_ref()) {
            (None, _) => true,
            (Some(generation), Some(rv)) => {
                match rv.barrier(&format!("one-shot release {generation}"), left()) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(
                            rank = self.rank,
                            "one-shot release: the peers did not all release: {e}"
                        );
                        false
                    }
                }
            }
            (Some(_), None) => false,
        };
        let Some(mut live) = live else { return };
        let bytes = live.recv.bytes();
        if !drained {
            tracing::error!(
                rank = self.rank,
                bytes,
                "one-shot release: this rank's own one-shot work did not drain; \
                 leaking its buffers"
            );
            return;
        }
        // SAFETY: this rank's own work on the control block and the pinned
        // words drained; each is dropped once, here.
        unsafe {
            ManuallyDrop::drop(&mut live.ctrl);
            ManuallyDrop::drop(&mut live.flags);
        }
        if unmapped {
            // SAFETY: every peer closed its mapping (the barrier) and this
            // rank's own work on the buffer drained; it is dropped once.
            unsafe { ManuallyDrop::drop(&mut live.recv) };
        } else {
            tracing::warn!(
                rank = self.rank,
                bytes,
                "one-shot release: peers may still map this rank's buffer; leaking it \
                 rather than freeing it under them"
            );
        }
    }

    /// Leaks this generation's one-shot buffers (shutdown, when the work
    /// that uses them cannot be proven finished).
    pub(super) fn one_shot_leak(&self, slot: &mut Slot) {
        slot.one_shot.on = false;
        self.one_shot_abort();
        self.one_shot_flags.lock().take();
        if let Some(live) = slot.one_shot.live.take() {
            // Dropping `Live` frees nothing (every allocation in it is
            // `ManuallyDrop`); the mappings of the peers' buffers stay too.
            tracing::error!(
                rank = self.rank,
                bytes = live.recv.bytes(),
                "leaking the one-shot buffers"
            );
            std::mem::forget(live);
        }
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
        // Every probe call fits the smallest slot.
        for (dtype, _) in kernels::ONE_SHOT_ENTRIES {
            assert!(setup::probe_elems(dtype) * dtype.size() <= MIN_SLOT_BYTES);
        }
    }
}
