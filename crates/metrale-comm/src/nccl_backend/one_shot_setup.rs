//! The one-shot path's set-up over each new communicator (at
//! construction, at every reconnect, at a split) and its release: this
//! rank's buffers and record, the exchanges of records and verdicts over
//! the communicator, the mapping of every peer's buffer, the probe that
//! proves peer access with a real write and read, and the release in an
//! order that never frees memory a peer or a kernel may use. The path's
//! state and enqueue are in `one_shot`.
//!
//! Set-up, over the new communicator (all ranks take the same steps, so the collectives match):
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
//! - Every rank takes the same collective steps whatever its local outcome
//!   (a rank that cannot take part sends a failed record), so the
//!   exchanges always match; the verdict of every round is the same on
//!   every rank, so the path is on everywhere or nowhere.
//! - Release order (at reconnect and shutdown, poisoned or not): set the
//!   abort word, wait (bounded) for this rank's own one-shot work (eager,
//!   and graph replays launched on any stream), close this rank's
//!   mappings of the peers' buffers, then a host barrier
//!   through the rendezvous' store (every peer has closed its mapping of
//!   this rank's buffer), and only then free. The barrier is host-only: a
//!   kernel waiting for a peer could block that peer's teardown of another
//!   communicator, which waits for this GPU. Without the barrier (a peer
//!   that does not come by the deadline, or the shutdown of a poisoned
//!   backend, which skips it at once: a peer that stopped answering cannot
//!   come) the receive buffer is leaked with a log line rather than freed
//!   under a peer's mapping; the control block and pinned words too if
//!   this rank's own work did not drain. The release returns what it
//!   leaked (`shutdown` reports it). A backend
//!   without a store (a fixed unique id) takes part in the set-up with a
//!   failed record, so the path is off on every rank; a split
//!   sub-communicator meets its group in its parent's store
//!   ([`crate::rendezvous::Rendezvous::group`]). A release owes the
//!   barrier only where every rank's first record was good: otherwise no
//!   rank mapped a peer's buffer, and the buffers are freed at once.
//!
//! Lock order: run under the slot lock; the rendezvous' locks (the release
//! barrier) and the one-shot `Flags` lock are taken under it, never the
//! other way round.

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use half::{bf16, f16};
use nccl_safe::{Context, DataType, DeviceBuffer, HostWords, IpcHandle, IpcMapping};

use super::one_shot::{
    KERNEL_GRACE, LANE_EAGER, LANE_GRAPH, Live, MAX_RANKS, PeerMem, SENTINEL, slot_bytes_for,
};
use super::{Inner, Slot};
use crate::backend::Result;
use crate::config::OneShotPolicy;
use crate::error::{CommError, Leak, LeakKind};
use crate::kernels::{self, OneShotElement};

/// Bytes of one rank's record in the set-up exchanges.
const RECORD_BYTES: usize = 160;
const MAGIC: u32 = 0x4f53_5231;
/// The set-up probe's calls, in order: its lane and type. Both halves of
/// both lanes, and every type's kernel.
const PROBE_ROUNDS: [(u32, DataType); 4] = [
    (LANE_EAGER, DataType::Bfloat16),
    (LANE_EAGER, DataType::Float16),
    (LANE_GRAPH, DataType::Float32),
    (LANE_GRAPH, DataType::Bfloat16),
];

/// One rank's record: what it exports, or its verdict.
#[derive(Clone)]
struct Record {
    ok: bool,
    /// This process among all of the job's (see [`process_id`]).
    process: u64,
    host: u64,
    device: u32,
    recv: u64,
    slot_bytes: u64,
    handle: [u8; 64],
    /// Why it failed (its first 48 bytes are exchanged).
    why: String,
}

impl Default for Record {
    fn default() -> Record {
        Record {
            ok: false,
            process: 0,
            host: 0,
            device: 0,
            recv: 0,
            slot_bytes: 0,
            handle: [0; 64],
            why: String::new(),
        }
    }
}

impl Record {
    fn failed(why: impl Into<String>) -> Record {
        Record {
            why: why.into(),
            ..Record::default()
        }
    }

    fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = u8::from(self.ok);
        b[12..16].copy_from_slice(&self.device.to_le_bytes());
        b[16..24].copy_from_slice(&self.host.to_le_bytes());
        b[24..32].copy_from_slice(&self.recv.to_le_bytes());
        b[32..40].copy_from_slice(&self.slot_bytes.to_le_bytes());
        b[40..104].copy_from_slice(&self.handle);
        b[104..112].copy_from_slice(&self.process.to_le_bytes());
        let why = self.why.as_bytes();
        let n = why.len().min(RECORD_BYTES - 112);
        b[112..112 + n].copy_from_slice(&why[..n]);
        b
    }

    fn decode(b: &[u8]) -> Record {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        if b.len() < RECORD_BYTES || u32_at(0) != MAGIC {
            return Record::failed("no record (a rank without the one-shot set-up)");
        }
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[40..104]);
        let why = String::from_utf8_lossy(&b[112..RECORD_BYTES])
            .trim_end_matches('\0')
            .to_string();
        Record {
            ok: b[4] == 1,
            process: u64_at(104),
            device: u32_at(12),
            host: u64_at(16),
            recv: u64_at(24),
            slot_bytes: u64_at(32),
            handle,
            why,
        }
    }
}

/// The summary of a round of verdicts, `Ok` when every rank succeeded.
fn verdicts(records: &[Record]) -> std::result::Result<(), String> {
    let bad: Vec<String> = records
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.ok)
        .map(|(rank, r)| format!("rank {rank}: {}", r.why))
        .collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(bad.join("; "))
    }
}

/// Elements of one probe call of `dtype`: odd, and a little over one
/// block of the kernel (8 KiB), so that two blocks take part.
fn probe_elems(dtype: DataType) -> usize {
    8192 / dtype.size() + 3
}

/// The probe's input of `rank` for `round`: the sentinel word first (the
/// pair (+0.0, -0.0), or the f32 -0.0), then small values whose sums are
/// exact.
fn probe_input<T: OneShotElement>(rank: usize, round: usize) -> Vec<T> {
    let per_word = 4 / T::DATA_TYPE.size();
    (0..probe_elems(T::DATA_TYPE))
        .map(|i| match i {
            _ if i + 1 == per_word => T::from_f32(-0.0),
            _ if i < per_word => T::from_f32(0.0),
            _ => T::from_f32((rank + 1) as f32 * 0.25 + ((i + round) % 13) as f32 - 6.0),
        })
        .collect()
}

/// This process's identity among all of the job's: its id with a random
/// word drawn once per process. A process id alone repeats across
/// containers (each has its own PID namespace) that share a host id, and
/// taking a peer in another container for this process would map its
/// address here.
fn process_id() -> u64 {
    use std::hash::BuildHasher;
    static ID: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ID.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(std::process::id()))
}

/// How one call of the probe went.
enum Round {
    Ok,
    /// A wrong result: this rank pushed, so the later calls still run (the
    /// peers' calls need its pushes).
    Wrong(String),
    /// The call did not run here (no input buffer, no launch), did not
    /// complete, or its kernel stopped: the probe ends (a peer waiting for
    /// this rank's push stops by its own bound).
    Stopped(String),
}

impl Inner {
    /// Sets the path up over the slot's (new) communicator, after releasing
    /// the previous generation's buffers (a reconnect). A rank-local
    /// problem turns the path off on every rank; an exchange that fails or
    /// does not complete by the init deadline fails the set-up.
    pub(super) fn one_shot_setup(&self, slot: &mut Slot) -> Result<()> {
        let deadline = Instant::now() + self.config.init_timeout;
        let earlier = self.one_shot_release(slot, deadline);
        slot.leaked.extend(earlier);
        slot.one_shot.begin_setup();
        let policy = self.config.one_shot;
        let off = if policy == OneShotPolicy::Never {
            Some("the one-shot policy is `never`".to_string())
        } else if !(2..=MAX_RANKS).contains(&self.world_size) {
            Some(format!(
                "{} ranks (the one-shot path serves 2 to 8)",
                self.world_size
            ))
        } else {
            slot.hosts
                .as_ref()
                .and_then(|h| h.peer_paths_off())
                .map(str::to_string)
        };
        if let Some(off) = off {
            slot.one_shot.turn_off(off);
            return Ok(());
        }
        let slot_bytes = slot_bytes_for(policy);
        // Whether a store is there can differ between ranks (a split whose
        // group could not reach the parent's store): a rank without one
        // takes part with a failed record, so the exchanges match.
        let prepared = match self.store {
            None => Err("no rendezvous store".to_string()),
            Some(_) => self.one_shot_prepare(slot, slot_bytes),
        };
        let mut mine = match prepared {
            Ok((live, record)) => {
                slot.one_shot.set_live(live);
                record
            }
            Err(why) => Record::failed(why),
        };
        mine.ok = mine.why.is_empty();
        // Exchange 1: what every rank exports.
        let records = self.one_shot_exchange(slot, &mine, deadline)?;
        // A peer maps this rank's buffer only once every record is good:
        // only then does the release owe the peers a barrier. Otherwise no
        // rank maps anything, and this rank's buffers go now.
        if records.iter().all(|r| r.ok) {
            slot.one_shot
                .set_exchanged(self.generation.load(Ordering::Acquire));
        } else {
            let now = self.one_shot_release(slot, deadline);
            slot.leaked.extend(now);
        }
        let mut verdict = match verdicts(&records) {
            Ok(()) => self.one_shot_map(slot, &records),
            Err(why) => Err(format!("set-up failed ({why})")),
        };
        // Exchange 2: whether every rank mapped every peer.
        if records.iter().all(|r| r.ok) {
            let round = self.one_shot_exchange(slot, &verdict_record(&verdict), deadline)?;
            verdict = verdicts(&round).map_err(|why| format!("mapping failed ({why})"));
            if verdict.is_ok() {
                let probed = self.one_shot_probe(slot, deadline)?;
                let round = self.one_shot_exchange(slot, &verdict_record(&probed), deadline)?;
                verdict = verdicts(&round).map_err(|why| format!("the probe failed ({why})"));
            }
        }
        match verdict {
            Ok(()) => {
                match slot.one_shot.turn_on() {
                    Some(words) => self.one_shot_flags.set(words),
                    None => self.one_shot_flags.clear(),
                }
                tracing::info!(
                    rank = self.rank,
                    world_size = self.world_size,
                    slot_bytes,
                    "one-shot all-reduce on: peer access proven to every rank"
                );
            }
            Err(why) => {
                tracing::warn!(
                    rank = self.rank,
                    world_size = self.world_size,
                    "one-shot all-reduce off: {why}"
                );
                slot.one_shot.turn_off(why);
            }
        }
        Ok(())
    }

    /// Step 1: this rank's buffers and record; `Err` says why it cannot
    /// take part.
    fn one_shot_prepare(
        &self,
        slot: &mut Slot,
        slot_bytes: usize,
    ) -> std::result::Result<(Live, Record), String> {
        if let Err(e) = slot
            .one_shot
            .load_kernels(&self.ctx, self.config.fused_cluster)
        {
            return Err(format!("the one-shot kernels do not load: {e}"));
        }
        // Captured one-shots are ordered by external events in the capture
        // (decision 0017): a driver without them has no graph lane.
        match cuda_sys::cuda() {
            Ok(lib) if lib.cuEventRecordWithFlags.is_err() => {
                return Err("the driver has no cuEventRecordWithFlags (CUDA 11.1)".into());
            }
            Ok(lib) if lib.cuStreamGetCaptureInfo_v3.is_err() => {
                return Err("the driver has no cuStreamGetCaptureInfo_v3 (CUDA 12.3)".into());
            }
            Ok(_) => {}
            Err(e) => return Err(format!("the CUDA driver: {e}")),
        }
        let dev = self.config.device;
        match nccl_safe::unified_addressing(dev) {
            Ok(true) => {}
            Ok(false) => return Err(format!("device {dev} has no unified addressing")),
            Err(e) => return Err(format!("unified addressing: {e}")),
        }
        let words = kernels::one_shot_recv_words(self.world_size, slot_bytes);
        let step = |what: &str, e: nccl_safe::Error| format!("{what}: {e}");
        let mut recv =
            DeviceBuffer::<u32>::alloc(&self.ctx, words).map_err(|e| step("buffer", e))?;
        nccl_safe::fill_words(&mut recv, SENTINEL).map_err(|e| step("buffer fill", e))?;
        let handle = nccl_safe::ipc_handle(&recv).map_err(|e| step("cuIpcGetMemHandle", e))?;
        let ctrl = DeviceBuffer::<u64>::alloc(&self.ctx, kernels::ONE_SHOT_CTRL_WORDS)
            .map_err(|e| step("control block", e))?;
        let flags = HostWords::alloc(&self.ctx, 2).map_err(|e| step("pinned flags", e))?;
        let record = Record {
            ok: true,
            process: process_id(),
            host: super::hosts::host_id(),
            device: dev as u32,
            recv: recv.device_ptr(),
            slot_bytes: slot_bytes as u64,
            handle: handle.0,
            why: String::new(),
        };
        let live = Live {
            recv: ManuallyDrop::new(recv),
            ctrl: ManuallyDrop::new(ctrl),
            flags: ManuallyDrop::new(Arc::new(flags)),
            peers: Vec::new(),
            slot_bytes,
        };
        Ok((live, record))
    }

    /// Step 3: maps every peer's buffer and writes the control block.
    fn one_shot_map(&self, slot: &mut Slot, records: &[Record]) -> std::result::Result<(), String> {
        let me = &records[self.rank];
        let live = slot.one_shot.live_mut().ok_or("no buffers")?;
        let mut addrs = [0u64; 8];
        let mut peers = Vec::with_capacity(records.len());
        for (p, r) in records.iter().enumerate() {
            if r.slot_bytes != me.slot_bytes {
                return Err(format!(
                    "rank {p} has {}-byte slots, this rank {} (the one-shot policy differs)",
                    r.slot_bytes, me.slot_bytes
                ));
            }
            if p == self.rank {
                addrs[p] = live.recv.device_ptr();
                peers.push(PeerMem::Own);
                continue;
            }
            if r.host != me.host {
                return Err(format!("rank {p} runs on another machine"));
            }
            match IpcMapping::open(&self.ctx, &IpcHandle(r.handle)) {
                Ok(m) => {
                    addrs[p] = m.device_ptr();
                    peers.push(PeerMem::Ipc { _mapping: m });
                }
                Err(ipc) if r.process == me.process => {
                    // The driver opens no handle of this very process: reach
                    // the peer's address directly.
                    let peer = Context::new(r.device as usize)
                        .and_then(|c| nccl_safe::enable_peer_access(&self.ctx, &c).map(|()| c))
                        .map_err(|e| {
                            format!("rank {p}: cuIpcOpenMemHandle: {ipc}; peer access: {e}")
                        })?;
                    addrs[p] = r.recv;
                    peers.push(PeerMem::Direct { _peer: peer });
                }
                Err(e) => return Err(format!("rank {p}: cuIpcOpenMemHandle: {e}")),
            }
        }
        live.peers = peers;
        let bound = self.config.collective_timeout + KERNEL_GRACE;
        let ctrl = kernels::one_shot_ctrl(
            &addrs[..records.len()],
            live.flags.device_ptr(),
            u64::try_from(bound.as_nanos()).unwrap_or(u64::MAX),
            self.rank,
            live.slot_bytes,
        )
        .ok_or("a world outside 2 to 8 ranks")?;
        live.ctrl
            .copy_from_host(&ctrl)
            .map_err(|e| format!("control block: {e}"))
    }

    /// Step 4: both halves of both lanes, every element checked. `Err` of
    /// the outer result: the stream stayed stuck even after the abort.
    fn one_shot_probe(
        &self,
        slot: &mut Slot,
        deadline: Instant,
    ) -> Result<std::result::Result<(), String>> {
        // Every round runs even after a wrong result, so that the peers'
        // rounds find this rank's pushes; a round that did not run here or
        // did not complete ends the probe (the abort word makes later rounds
        // no-ops).
        let mut first: std::result::Result<(), String> = Ok(());
        for (round, (lane, dtype)) in PROBE_ROUNDS.into_iter().enumerate() {
            let r = match dtype {
                DataType::Float16 => self.one_shot_probe_round::<f16>(slot, round, lane, deadline),
                DataType::Float32 => self.one_shot_probe_round::<f32>(slot, round, lane, deadline),
                _ => self.one_shot_probe_round::<bf16>(slot, round, lane, deadline),
            }?;
            let (result, go_on) = match r {
                Round::Ok => (Ok(()), true),
                Round::Wrong(why) => (Err(why), true),
                Round::Stopped(why) => (Err(why), false),
            };
            if first.is_ok() {
                first = result.map_err(|why| format!("{why} ({dtype}, lane {lane})"));
            }
            if !go_on {
                break;
            }
        }
        Ok(first)
    }

    /// One call of the probe on `T`'s kernel, on lane `lane`, checked
    /// element by element.
    fn one_shot_probe_round<T: OneShotElement>(
        &self,
        slot: &mut Slot,
        round: usize,
        lane: u32,
        deadline: Instant,
    ) -> Result<Round> {
        let stream = slot.stream.raw();
        let budget = || {
            deadline
                .saturating_duration_since(Instant::now())
                .min(self.config.collective_timeout)
        };
        let n = probe_elems(T::DATA_TYPE);
        let inputs: Vec<Vec<T>> = (0..self.world_size)
            .map(|r| probe_input(r, round))
            .collect();
        let want = kernels::one_shot_sum(&inputs).unwrap_or_default();
        let buf = match DeviceBuffer::<T>::from_host(&self.ctx, &inputs[self.rank]) {
            Ok(b) => b,
            Err(e) => return Ok(Round::Stopped(format!("probe input: {e}"))),
        };
        let os = &slot.one_shot;
        let (Some(live), Some(kernel)) = (os.live(), os.kernel(T::DATA_TYPE)) else {
            return Ok(Round::Stopped("no buffers".into()));
        };
        // SAFETY: `kernel` is `T`'s; the probe buffer holds `n` values of
        // `T` of this context; the control block is set up; our own stream.
        let launched = unsafe {
            kernels::launch_one_shot(
                kernel,
                live.ctrl.device_ptr(),
                buf.device_ptr(),
                (n, T::DATA_TYPE),
                lane,
                stream,
            )
        };
        if let Err(e) = launched {
            return Ok(Round::Stopped(format!("probe launch: {e}")));
        }
        if slot.stream.wait_until_idle(budget()).is_err() {
            live.flags.store(0, 1);
            if let Err(e) = slot.stream.wait_until_idle(self.config.collective_timeout) {
                // The kernel may still run on the buffer: leak it rather
                // than free it under the kernel.
                std::mem::forget(buf);
                return Err(CommError::setup("one-shot probe (after its abort)", e));
            }
            return Ok(Round::Stopped(
                "the probe did not complete: a peer's pushes never landed".into(),
            ));
        }
        if let s @ 1.. = live.flags.load(1) {
            return Ok(Round::Stopped(format!(
                "the probe kernel stopped with status {s}"
            )));
        }
        let got = match buf.to_host_vec() {
            Ok(got) => got,
            Err(e) => return Ok(Round::Wrong(format!("probe result: {e}"))),
        };
        Ok(
            match (0..n).find(|&i| got[i].to_bits32() != want[i].to_bits32()) {
                Some(i) => Round::Wrong(format!(
                    "probe element {i} is {:#x}, expected {:#x}",
                    got[i].to_bits32(),
                    want[i].to_bits32()
                )),
                None => Round::Ok,
            },
        )
    }

    /// Every rank's record, by an all-reduce sum of bytes (each rank writes
    /// only its own 128 bytes) on the backend's stream, waited for until
    /// `deadline`. A failure or timeout aborts the communicator.
    fn one_shot_exchange(
        &self,
        slot: &mut Slot,
        mine: &Record,
        deadline: Instant,
    ) -> Result<Vec<Record>> {
        let w = self.world_size;
        let mut host = vec![0u8; w * RECORD_BYTES];
        host[self.rank * RECORD_BYTES..][..RECORD_BYTES].copy_from_slice(&mine.encode());
        let out = self.exchange_bytes(slot, &host, deadline).map_err(|e| {
            self.abort_now("one-shot set-up");
            CommError::setup("one-shot set-up exchange", e)
        })?;
        Ok(out.chunks(RECORD_BYTES).map(Record::decode).collect())
    }
}

impl Inner {
    /// Releases this generation's one-shot buffers in the order the module
    /// docs give, bounded by `deadline`; what cannot be freed in that order
    /// is leaked with a log line (never freed under a peer's mapping or this
    /// rank's own work) and returned. A shutdown of a poisoned backend
    /// skips the barrier at once: its peers failed or will fail too, and
    /// one that stopped answering cannot come.
    pub(super) fn one_shot_release(&self, slot: &mut Slot, deadline: Instant) -> Vec<Leak> {
        let (owed, mut live) = slot.one_shot.take_for_release();
        self.one_shot_flags.clear();
        let mut leaks = Vec::new();
        if let Some(l) = &live {
            l.flags.store(kernels::abi::one_shot::FLAG_ABORT, 1);
        }
        let left = || deadline.saturating_duration_since(Instant::now());
        // Eager one-shots, and graph replays launched before now on any
        // stream (the abort word ends those that wait for a peer).
        let eager = slot.one_shot.drain_eager(left());
        let drained = slot.one_shot.drain_graphs(left()) && eager;
        if let Some(l) = live.as_mut() {
            let peers = std::mem::take(&mut l.peers);
            if drained {
                drop(peers);
            } else if !peers.is_empty() {
                // A kernel of this rank may still push through them.
                std::mem::forget(peers);
                leaks.push(Leak::new(
                    LeakKind::OneShotPeerMappings,
                    0,
                    "this rank's own one-shot work did not drain",
                ));
            }
        }
        let failed = self.health.is_shutdown() && self.health.is_poisoned();
        // Every rank that took part in the exchange meets here, its own
        // mappings closed: a host barrier through the rendezvous' store, so
        // no kernel waits for a peer that may be tearing down another
        // communicator (whose teardown waits for this GPU). A rank whose
        // own work did not drain keeps its mappings and does not come, so
        // its peers keep their buffers too; nor does a failed rank's
        // shutdown wait for peers that may be gone.
        let unmapped = match (owed, self.store.as_ref()) {
            (None, _) => Ok(()),
            (Some(_), _) if !drained => Err("this rank's own one-shot work did not drain".into()),
            (Some(_), _) if failed => Err(format!(
                "the communicator failed ({}): the release barrier is skipped, so peers may \
                 still map it",
                self.health
                    .failure()
                    .map_or_else(|| "poisoned".to_string(), |f| f.to_string())
            )),
            (Some(generation), Some(rv)) => rv
                .barrier(&format!("one-shot release {generation}"), left())
                .map_err(|e| {
                    tracing::warn!(
                        rank = self.rank,
                        "one-shot release: the peers did not all release: {e}"
                    );
                    format!("the peers did not all come to the release barrier: {e}")
                }),
            (Some(_), None) => Err("no store to meet the peers in".into()),
        };
        let Some(mut live) = live else { return leaks };
        let bytes = live.recv.bytes();
        if !drained {
            tracing::error!(
                rank = self.rank,
                bytes,
                "one-shot release: this rank's own one-shot work did not drain; \
                 leaking its buffers"
            );
            let why = "this rank's own one-shot work did not drain";
            leaks.push(Leak::new(LeakKind::OneShotReceiveBuffer, bytes, why));
            leaks.push(Leak::new(
                LeakKind::OneShotControlBlock,
                live.ctrl.bytes(),
                why,
            ));
            return leaks;
        }
        // SAFETY: this rank's own work on the control block and the pinned
        // words drained; each is dropped once, here.
        unsafe {
            ManuallyDrop::drop(&mut live.ctrl);
            ManuallyDrop::drop(&mut live.flags);
        }
        match unmapped {
            // SAFETY: every peer closed its mapping (the barrier) and this
            // rank's own work on the buffer drained; it is dropped once.
            Ok(()) => unsafe { ManuallyDrop::drop(&mut live.recv) },
            Err(why) => {
                tracing::warn!(
                    rank = self.rank,
                    bytes,
                    "one-shot release: peers may still map this rank's buffer ({why}); \
                     leaking it rather than freeing it under them"
                );
                leaks.push(Leak::new(LeakKind::OneShotReceiveBuffer, bytes, why));
            }
        }
        leaks
    }

    /// Leaks this generation's one-shot buffers (shutdown, when the work
    /// that uses them cannot be proven finished), and says what it leaked.
    pub(super) fn one_shot_leak(&self, slot: &mut Slot, why: &str) -> Vec<Leak> {
        self.one_shot_flags.abort();
        self.one_shot_flags.clear();
        let mut leaks = Vec::new();
        if let (_, Some(live)) = slot.one_shot.take_for_release() {
            // Dropping `Live` frees nothing (every allocation in it is
            // `ManuallyDrop`); the mappings of the peers' buffers stay too.
            tracing::error!(
                rank = self.rank,
                bytes = live.recv.bytes(),
                "leaking the one-shot buffers"
            );
            leaks.push(Leak::new(
                LeakKind::OneShotReceiveBuffer,
                live.recv.bytes(),
                why,
            ));
            leaks.push(Leak::new(
                LeakKind::OneShotControlBlock,
                live.ctrl.bytes(),
                why,
            ));
            if !live.peers.is_empty() {
                leaks.push(Leak::new(LeakKind::OneShotPeerMappings, 0, why));
            }
            std::mem::forget(live);
        }
        leaks
    }
}

/// A verdict as a record.
fn verdict_record(v: &std::result::Result<(), String>) -> Record {
    match v {
        Ok(()) => Record {
            ok: true,
            ..Record::default()
        },
        Err(why) => Record::failed(why.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_probe_call_fits_the_smallest_slot() {
        for (dtype, _) in kernels::ONE_SHOT_ENTRIES {
            assert!(probe_elems(dtype) * dtype.size() <= super::super::one_shot::MIN_SLOT_BYTES);
        }
    }

    #[test]
    fn records_round_trip() {
        let r = Record {
            ok: true,
            process: 42,
            host: 7,
            device: 3,
            recv: 0x1000,
            slot_bytes: 1 << 20,
            handle: [9; 64],
            why: "a reason".into(),
        };
        let d = Record::decode(&r.encode());
        assert!(d.ok);
        assert_eq!((d.process, d.host, d.device, d.recv), (42, 7, 3, 0x1000));
        assert_eq!(
            (d.slot_bytes, d.handle, d.why.as_str()),
            (1 << 20, [9; 64], "a reason")
        );
        assert!(!Record::decode(&[0u8; RECORD_BYTES]).ok);
    }

    #[test]
    fn the_process_id_is_stable_and_not_the_bare_pid() {
        assert_eq!(process_id(), process_id());
        assert_ne!(process_id(), u64::from(std::process::id()));
    }

    #[test]
    fn verdicts_name_every_failed_rank() {
        let ok = Record {
            ok: true,
            ..Record::default()
        };
        assert!(verdicts(&[ok.clone(), ok.clone()]).is_ok());
        let why = verdicts(&[ok, Record::failed("no peer access")]).unwrap_err();
        assert_eq!(why, "rank 1: no peer access");
    }
}
