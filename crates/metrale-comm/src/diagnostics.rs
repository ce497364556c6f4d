//! The collective flight recorder and the cross-rank analysis of its dumps.
//!
//! A [`FlightRecorder`] keeps the most recent submissions of one rank in a
//! fixed-size ring allocated once at construction; [`FlightRecorder::record`]
//! takes one uncontended lock, reads the clock and writes one slot, with no
//! allocation. Sequence numbers start at 1 and grow by one per record, so the
//! slot of sequence `s` is `(s - 1) % capacity` and a slot is valid for `s`
//! only while it still holds `s`.
//!
//! Lock order: a recorder's one lock (`ring`) is a leaf, held only to read
//! or write slots, never across I/O or another lock (a dump copies the ring,
//! then writes). Others take it inside their own: `NcclBackend` under its
//! slot lock to record, the census of backends under the census lock.
//!
//! When something goes wrong, each rank writes its ring to
//! `DIR/metrale-fr-rank{rank}-gen{generation}.json` ([`Dump`]), atomically
//! (temporary file, then rename). [`analyze`] reads the dumps of all ranks and
//! names the first sequence number at which they disagree, which some rank
//! never reached, or which timed out or failed.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{self, Write as _};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// The ring size used by [`FlightRecorder::default`].
pub const DEFAULT_CAPACITY: usize = 4096;

/// Makes temporary dump names unique within the process.
static DUMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The environment variable naming the directory for flight-recorder dumps.
pub const DUMP_DIR_ENV: &str = "METRALE_COMM_DUMP_DIR";

/// Where a recorded submission stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpState {
    /// Submitted to the stream; completion not yet observed.
    Enqueued,
    /// Its completion event fired.
    Completed,
    /// It missed its deadline.
    TimedOut,
    /// The library or the communicator reported an error for it.
    Failed,
}

impl OpState {
    fn as_str(self) -> &'static str {
        match self {
            OpState::Enqueued => "enqueued",
            OpState::Completed => "completed",
            OpState::TimedOut => "timed out",
            OpState::Failed => "failed",
        }
    }
}

/// One recorded submission, in its owned (serialized) form.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpRecord {
    /// Sequence number, 1-based, per recorder.
    pub seq: u64,
    /// Operation name, e.g. `all_reduce`.
    pub op: String,
    /// Element type name, e.g. `bf16`.
    pub dtype: String,
    /// Payload size in bytes.
    pub bytes: usize,
    /// The stream it was enqueued on (an opaque handle value).
    pub stream: u64,
    /// The peer (send/recv) or root (broadcast/reduce), if any.
    pub peer: Option<usize>,
    /// Wall-clock enqueue time, microseconds since the Unix epoch.
    pub enqueued_unix_us: u64,
    /// Current state.
    pub state: OpState,
    /// Microseconds from enqueue to observed completion (set on `Completed`).
    pub completed_after_us: Option<u64>,
}

/// The in-ring form of a record: no heap data, so writing it never allocates.
#[derive(Debug, Clone, Copy)]
struct Slot {
    seq: u64,
    op: &'static str,
    dtype: &'static str,
    bytes: usize,
    stream: u64,
    peer: Option<usize>,
    enqueued_unix_us: u64,
    state: OpState,
    completed_after_us: Option<u64>,
}

impl Slot {
    const EMPTY: Slot = Slot {
        seq: 0,
        op: "",
        dtype: "",
        bytes: 0,
        stream: 0,
        peer: None,
        enqueued_unix_us: 0,
        state: OpState::Enqueued,
        completed_after_us: None,
    };

    fn to_record(self) -> OpRecord {
        OpRecord {
            seq: self.seq,
            op: self.op.to_owned(),
            dtype: self.dtype.to_owned(),
            bytes: self.bytes,
            stream: self.stream,
            peer: self.peer,
            enqueued_unix_us: self.enqueued_unix_us,
            state: self.state,
            completed_after_us: self.completed_after_us,
        }
    }
}

struct Ring {
    slots: Box<[Slot]>,
    last_seq: u64,
}

impl Ring {
    fn index(&self, seq: u64) -> usize {
        // The remainder is below `slots.len()`, which is a `usize`.
        ((seq - 1) % self.slots.len() as u64) as usize
    }

    fn slot(&self, seq: u64) -> Option<&Slot> {
        if seq == 0 || seq > self.last_seq {
            return None;
        }
        let slot = &self.slots[self.index(seq)];
        (slot.seq == seq).then_some(slot)
    }
}

/// A fixed-size ring of the most recent submissions of one rank.
///
/// `Send + Sync`; every method takes `&self`.
pub struct FlightRecorder {
    ring: Mutex<Ring>,
}

impl fmt::Debug for FlightRecorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ring = self.ring.lock();
        f.debug_struct("FlightRecorder")
            .field("capacity", &ring.slots.len())
            .field("last_seq", &ring.last_seq)
            .finish()
    }
}

impl Default for FlightRecorder {
    fn default() -> Self {
        Self::new(DEFAULT_CAPACITY)
    }
}

/// Microseconds since the Unix epoch, now.
pub(crate) fn now_unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

impl FlightRecorder {
    /// A recorder keeping the last `capacity` submissions (at least one).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            ring: Mutex::new(Ring {
                slots: vec![Slot::EMPTY; capacity].into_boxed_slice(),
                last_seq: 0,
            }),
        }
    }

    /// The number of submissions the ring keeps.
    pub fn capacity(&self) -> usize {
        self.ring.lock().slots.len()
    }

    /// Records a submission in state `Enqueued` and returns its sequence
    /// number (1, 2, 3, ... per recorder). Does not allocate.
    pub fn record(
        &self,
        op: &'static str,
        dtype: &'static str,
        bytes: usize,
        stream: u64,
        peer: Option<usize>,
    ) -> u64 {
        self.record_at(op, dtype, bytes, stream, peer, now_unix_us())
    }

    /// [`FlightRecorder::record`] with the enqueue time given, in
    /// microseconds since the Unix epoch (a caller that already read a
    /// clock for the submission).
    pub fn record_at(
        &self,
        op: &'static str,
        dtype: &'static str,
        bytes: usize,
        stream: u64,
        peer: Option<usize>,
        enqueued_unix_us: u64,
    ) -> u64 {
        let mut ring = self.ring.lock();
        ring.last_seq += 1;
        let seq = ring.last_seq;
        let index = ring.index(seq);
        ring.slots[index] = Slot {
            seq,
            op,
            dtype,
            bytes,
            stream,
            peer,
            enqueued_unix_us,
            state: OpState::Enqueued,
            completed_after_us: None,
        };
        seq
    }

    /// The op recorded as `seq`, while it is in the ring.
    pub fn op_of(&self, seq: u64) -> Option<&'static str> {
        self.ring.lock().slot(seq).map(|s| s.op)
    }

    /// Sets the state of `seq`; a no-op when `seq` is not (or no longer) in
    /// the ring. `Completed` also sets `completed_after_us`.
    pub fn set_state(&self, seq: u64, state: OpState) {
        let now = if state == OpState::Completed {
            now_unix_us()
        } else {
            0
        };
        let mut ring = self.ring.lock();
        if ring.slot(seq).is_none() {
            return;
        }
        let index = ring.index(seq);
        let slot = &mut ring.slots[index];
        slot.state = state;
        if state == OpState::Completed {
            slot.completed_after_us = Some(now.saturating_sub(slot.enqueued_unix_us));
        }
    }

    /// Marks every one of `seqs` complete under one lock (the watchdog's
    /// batch of completions).
    pub fn set_completed(&self, seqs: impl IntoIterator<Item = u64>) {
        let now = now_unix_us();
        let mut ring = self.ring.lock();
        for seq in seqs {
            if ring.slot(seq).is_none() {
                continue;
            }
            let index = ring.index(seq);
            let slot = &mut ring.slots[index];
            slot.state = OpState::Completed;
            slot.completed_after_us = Some(now.saturating_sub(slot.enqueued_unix_us));
        }
    }

    /// The last sequence number handed out (0 before the first record).
    pub fn last_seq(&self) -> u64 {
        self.ring.lock().last_seq
    }

    /// The record of `seq`, if it is still in the ring.
    pub fn get(&self, seq: u64) -> Option<OpRecord> {
        self.ring.lock().slot(seq).map(|s| s.to_record())
    }

    /// Up to `max` records never seen complete (`Enqueued`, or `TimedOut`:
    /// a timed-out operation still waits on the GPU until its abort),
    /// oldest first.
    pub fn in_flight(&self, max: usize) -> Vec<OpRecord> {
        self.records(max, |s| {
            matches!(s.state, OpState::Enqueued | OpState::TimedOut)
        })
    }

    /// Up to `max` records that `keep`, oldest first; the ring's lock is
    /// held only to copy them.
    fn records(&self, max: usize, keep: impl Fn(&Slot) -> bool) -> Vec<OpRecord> {
        let slots: Vec<Slot> = {
            let ring = self.ring.lock();
            let cap = ring.slots.len() as u64;
            let first = ring.last_seq.saturating_sub(cap) + 1;
            (first..=ring.last_seq)
                .filter_map(|seq| ring.slot(seq).copied())
                .filter(|s| keep(s))
                .take(max)
                .collect()
        };
        slots.into_iter().map(Slot::to_record).collect()
    }

    /// Every record in the ring, oldest first.
    pub fn snapshot(&self) -> Vec<OpRecord> {
        self.records(usize::MAX, |_| true)
    }

    /// Writes `dir/metrale-fr-rank{rank}-gen{generation}.json` (a [`Dump`])
    /// atomically, creating `dir` if needed, and returns the file's path.
    pub fn dump_json(&self, dir: &Path, header: &DumpHeader) -> std::io::Result<PathBuf> {
        let dump = Dump {
            header: header.clone(),
            records: self.snapshot(),
        };
        std::fs::create_dir_all(dir)?;
        let name = dump_file_name(header.rank, header.generation);
        let path = dir.join(&name);
        let unique = DUMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.tmp.{}.{unique}", std::process::id()));
        let json = serde_json::to_vec_pretty(&dump).map_err(std::io::Error::other)?;
        let written = (|| {
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(&json)?;
            file.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        if let Err(err) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(err);
        }
        Ok(path)
    }

    /// The last `n` records, one line each, oldest first (for logs).
    pub fn summary(&self, n: usize) -> String {
        let records = self.snapshot();
        let start = records.len().saturating_sub(n);
        let mut out = String::new();
        for (i, r) in records[start..].iter().enumerate() {
            if i > 0 {
                out.push('\n');
            }
            let _ = write!(
                out,
                "seq {} {} {} {} B stream {:#x}",
                r.seq, r.op, r.dtype, r.bytes, r.stream
            );
            if let Some(peer) = r.peer {
                let _ = write!(out, " peer/root {peer}");
            }
            let _ = write!(out, " {}", r.state.as_str());
            if let Some(us) = r.completed_after_us {
                let _ = write!(out, " after {us} us");
            }
        }
        out
    }
}

/// The dump file name of `rank` for `generation`.
pub fn dump_file_name(rank: usize, generation: u64) -> String {
    format!("metrale-fr-rank{rank}-gen{generation}.json")
}

/// What a dump file says about the rank that wrote it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DumpHeader {
    /// The writer's rank.
    pub rank: usize,
    /// The number of ranks of the communicator.
    pub world_size: usize,
    /// The communicator generation (incremented on every reconnect).
    pub generation: u64,
    /// Why the dump was written.
    pub reason: String,
    /// The first sequence number that timed out or failed, if known.
    pub first_failed_seq: Option<u64>,
}

/// The shape of a dump file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dump {
    /// Who wrote it and why.
    pub header: DumpHeader,
    /// The ring, oldest first.
    pub records: Vec<OpRecord>,
}

/// Why [`analyze`] singled out a sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FindingKind {
    /// Some rank's last sequence number is smaller.
    NeverReached,
    /// Ranks recorded different operations (op, dtype, bytes or peer/root).
    Mismatch,
    /// Every rank reached it, and at least one timed out in it.
    TimedOut,
    /// Every rank reached it, and at least one failed in it.
    Failed,
}

/// The first problem [`analyze`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The sequence number.
    pub seq: u64,
    /// The main reason.
    pub kind: FindingKind,
    /// Ranks whose last sequence number is below `seq`.
    pub never_reached: Vec<usize>,
    /// Ranks whose record differs from the lowest rank's record.
    pub mismatched: Vec<usize>,
    /// Ranks in which it timed out.
    pub timed_out: Vec<usize>,
    /// Ranks in which it failed.
    pub failed: Vec<usize>,
    /// Ranks in which it is still enqueued.
    pub enqueued: Vec<usize>,
    /// A one-line human description, e.g. `rank 1 never reached seq 7
    /// (all_reduce bf16 8192 B); rank 0 timed out in it`.
    pub description: String,
}

/// The result of [`analyze`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Analysis {
    /// The generation analysed (`None` when there were no dumps).
    pub generation: Option<u64>,
    /// The world size the dumps declare (the largest, if they disagree).
    pub world_size: usize,
    /// Ranks with a dump, ascending.
    pub ranks_found: Vec<usize>,
    /// Ranks below `world_size` without a dump, ascending.
    pub ranks_missing: Vec<usize>,
    /// Oddities of the dumps themselves (duplicates, inconsistent headers).
    pub notes: Vec<String>,
    /// The first problem, if any.
    pub finding: Option<Finding>,
}

impl Analysis {
    /// True when there is something to report: a missing rank or a finding.
    pub fn found_problem(&self) -> bool {
        !self.ranks_missing.is_empty() || self.finding.is_some()
    }
}

fn rank_list(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}", list.join(","))
}

impl fmt::Display for Analysis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(generation) = self.generation else {
            return writeln!(f, "no dumps");
        };
        writeln!(
            f,
            "generation {generation}, world size {}: found {}",
            self.world_size,
            rank_list(&self.ranks_found)
        )?;
        if !self.ranks_missing.is_empty() {
            writeln!(f, "missing dumps: {}", rank_list(&self.ranks_missing))?;
        }
        for note in &self.notes {
            writeln!(f, "note: {note}")?;
        }
        match &self.finding {
            Some(finding) => writeln!(f, "{}", finding.description),
            None => writeln!(f, "the dumps agree: no divergence, timeout or failure"),
        }
    }
}

/// Point-to-point operations legitimately differ across ranks (send on one,
/// recv on the other, each naming the other as peer); they are not compared.
fn is_point_to_point(op: &str) -> bool {
    matches!(op, "send" | "recv")
}

fn describe(r: &OpRecord) -> String {
    let mut s = format!("{} {} {} B", r.op, r.dtype, r.bytes);
    if let Some(peer) = r.peer {
        let _ = write!(s, " peer/root {peer}");
    }
    s
}

type Signature<'a> = (&'a str, &'a str, usize, Option<usize>);

fn signature(r: &OpRecord) -> Signature<'_> {
    (&r.op, &r.dtype, r.bytes, r.peer)
}

/// Analyses the dumps of the highest generation present.
pub fn analyze(dumps: &[Dump]) -> Analysis {
    match dumps.iter().map(|d| d.header.generation).max() {
        Some(generation) => analyze_generation(dumps, generation),
        None => Analysis::default(),
    }
}

/// Analyses the dumps of `generation` (other generations are ignored).
pub fn analyze_generation(dumps: &[Dump], generation: u64) -> Analysis {
    let selected: Vec<&Dump> = dumps
        .iter()
        .filter(|d| d.header.generation == generation)
        .collect();
    let mut analysis = Analysis {
        generation: Some(generation),
        ..Analysis::default()
    };
    if selected.is_empty() {
        analysis
            .notes
            .push(format!("no dump of generation {generation}"));
        return analysis;
    }
    let world_size = selected
        .iter()
        .map(|d| d.header.world_size)
        .max()
        .unwrap_or(0);
    if selected.iter().any(|d| d.header.world_size != world_size) {
        analysis
            .notes
            .push("the dumps declare different world sizes".to_owned());
    }
    analysis.world_size = world_size;

    // One dump per rank: the one with the highest last sequence number.
    let mut by_rank: BTreeMap<usize, &Dump> = BTreeMap::new();
    for dump in selected {
        let rank = dump.header.rank;
        if rank >= world_size {
            analysis.notes.push(format!(
                "rank {rank} is outside world size {world_size}; ignored"
            ));
            continue;
        }
        let last = |d: &Dump| d.records.iter().map(|r| r.seq).max().unwrap_or(0);
        match by_rank.get(&rank) {
            Some(prev) => {
                analysis
                    .notes
                    .push(format!("rank {rank} has several dumps; using the longest"));
                if last(dump) > last(prev) {
                    by_rank.insert(rank, dump);
                }
            }
            None => {
                by_rank.insert(rank, dump);
            }
        }
    }
    analysis.ranks_found = by_rank.keys().copied().collect();
    analysis.ranks_missing = (0..world_size)
        .filter(|r| !by_rank.contains_key(r))
        .collect();
    analysis.finding = first_finding(&by_rank);
    analysis
}

fn first_finding(by_rank: &BTreeMap<usize, &Dump>) -> Option<Finding> {
    struct RankView<'a> {
        rank: usize,
        last: u64,
        records: BTreeMap<u64, &'a OpRecord>,
    }
    let views: Vec<RankView<'_>> = by_rank
        .iter()
        .map(|(&rank, dump)| {
            let records: BTreeMap<u64, &OpRecord> =
                dump.records.iter().map(|r| (r.seq, r)).collect();
            let last = records.keys().next_back().copied().unwrap_or(0);
            RankView {
                rank,
                last,
                records,
            }
        })
        .collect();
    let hi = views.iter().map(|v| v.last).max()?;
    // Candidates: every recorded sequence number, and the one after each
    // rank's last (where that rank stopped).
    let mut candidates: BTreeSet<u64> = views
        .iter()
        .flat_map(|v| v.records.keys().copied())
        .collect();
    candidates.extend(views.iter().filter(|v| v.last < hi).map(|v| v.last + 1));

    for seq in candidates {
        let never_reached: Vec<usize> = views
            .iter()
            .filter(|v| v.last < seq)
            .map(|v| v.rank)
            .collect();
        let have: Vec<(usize, &OpRecord)> = views
            .iter()
            .filter_map(|v| v.records.get(&seq).map(|r| (v.rank, *r)))
            .collect();
        let with_state = |state: OpState| -> Vec<usize> {
            have.iter()
                .filter(|(_, r)| r.state == state)
                .map(|(rank, _)| *rank)
                .collect()
        };
        let timed_out = with_state(OpState::TimedOut);
        let failed = with_state(OpState::Failed);
        let enqueued = with_state(OpState::Enqueued);

        let mismatched: Vec<usize> = match have.first() {
            Some((_, reference)) if !have.iter().all(|(_, r)| is_point_to_point(&r.op)) => have
                .iter()
                .filter(|(_, r)| signature(r) != signature(reference))
                .map(|(rank, _)| *rank)
                .collect(),
            _ => Vec::new(),
        };

        let kind = if !never_reached.is_empty() {
            FindingKind::NeverReached
        } else if !mismatched.is_empty() {
            FindingKind::Mismatch
        } else if !timed_out.is_empty() {
            FindingKind::TimedOut
        } else if !failed.is_empty() {
            FindingKind::Failed
        } else {
            continue;
        };

        let what = match have.first() {
            Some((_, r)) => describe(r),
            None => "evicted from every ring".to_owned(),
        };
        let mut description = match kind {
            FindingKind::NeverReached => {
                format!(
                    "{} never reached seq {seq} ({what})",
                    rank_list(&never_reached)
                )
            }
            FindingKind::Mismatch => {
                let mut groups: BTreeMap<Signature<'_>, Vec<usize>> = BTreeMap::new();
                for (rank, r) in &have {
                    groups.entry(signature(r)).or_default().push(*rank);
                }
                let parts: Vec<String> = groups
                    .values()
                    .map(|ranks| {
                        let r = have
                            .iter()
                            .find(|(rank, _)| *rank == ranks[0])
                            .map(|(_, r)| describe(r))
                            .unwrap_or_default();
                        format!("{} {r}", rank_list(ranks))
                    })
                    .collect();
                format!("ranks disagree at seq {seq}: {}", parts.join("; "))
            }
            FindingKind::TimedOut | FindingKind::Failed => {
                format!("seq {seq} ({what})")
            }
        };
        if !timed_out.is_empty() {
            let _ = write!(description, "; {} timed out in it", rank_list(&timed_out));
        }
        if !failed.is_empty() {
            let _ = write!(description, "; {} failed in it", rank_list(&failed));
        }
        if !enqueued.is_empty() {
            let _ = write!(
                description,
                "; {} still enqueued in it",
                rank_list(&enqueued)
            );
        }
        return Some(Finding {
            seq,
            kind,
            never_reached,
            mismatched,
            timed_out,
            failed,
            enqueued,
            description,
        });
    }
    None
}
