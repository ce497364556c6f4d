//! Emulated time: a cost model that says how long each kind of operation
//! takes, and the virtual clocks of the streams that run them, so a
//! timing made with events (`cuEventElapsedTime_v2`) gives figures a test
//! chose, the same on every run.
//!
//! A cost entry is `(rank, op, mode) -> base_ns + ns_per_kib * bytes /
//! 1024` (integer nanoseconds, rounded down). `rank` is a communicator
//! rank (for the one-shot kernel, its control block's rank) or every rank;
//! `op` is an NCCL all-reduce, a one-shot all-reduce kernel or an NCCL
//! send (bytes: the bytes reduced or sent); `mode` is any launch, eager
//! launches only, or graph replays only (work run by `cuGraphLaunch`).
//! Filled by `metrale_emu_set_cost` and by `METRALE_EMU_COSTS` (read on
//! first use), emptied by `metrale_emu_clear_costs`.
//!
//! Invariants:
//! - The model is active while at least one entry is set; while it is not,
//!   nothing here changes what the emulator does (events are timed with
//!   host clocks).
//! - Each stream's worker thread holds that stream's virtual clock (ns,
//!   from 0), thread-local: every piece of a stream's work runs on its
//!   worker, a graph launch's on the launching stream's. An operation
//!   advances it by its cost once it has run to completion (after its wait
//!   for its peers); work that ends unrun or fails charges nothing.
//! - A [`Stamp`] is the clock read while the model is active, with the
//!   model's epoch (a new one at each clear), so two stamps are compared
//!   only when taken under one model.
//! - For one `(rank, op, mode)` a later entry replaces the earlier; a
//!   lookup takes the most specific entry: a rank's over every rank's
//!   first, then a mode's over any mode's.
//!
//! The model's lock is a leaf, taken with no other lock held.

use std::cell::Cell;

use parking_lot::Mutex;

use crate::guard;

/// The operations a cost can be set for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CostOp {
    /// `ncclAllReduce`.
    AllReduce,
    /// A one-shot all-reduce kernel (any element type).
    OneShot,
    /// `ncclSend`.
    Send,
}

impl CostOp {
    fn from_code(code: i32) -> Option<Self> {
        Some(match code {
            1 => CostOp::AllReduce,
            2 => CostOp::OneShot,
            3 => CostOp::Send,
            _ => return None,
        })
    }

    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "allreduce" => CostOp::AllReduce,
            "oneshot" => CostOp::OneShot,
            "send" => CostOp::Send,
            _ => return None,
        })
    }
}

/// Which launches an entry applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Any,
    Eager,
    Graph,
}

impl Mode {
    fn from_code(code: i32) -> Option<Self> {
        Some(match code {
            0 => Mode::Any,
            1 => Mode::Eager,
            2 => Mode::Graph,
            _ => return None,
        })
    }

    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "*" => Mode::Any,
            "eager" => Mode::Eager,
            "graph" => Mode::Graph,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    /// `None`: every rank.
    rank: Option<u32>,
    op: CostOp,
    mode: Mode,
    base_ns: u64,
    ns_per_kib: u64,
}

impl Entry {
    fn cost(&self, bytes: usize) -> u64 {
        let v = u128::from(self.base_ns) + u128::from(self.ns_per_kib) * bytes as u128 / 1024;
        u64::try_from(v).unwrap_or(u64::MAX)
    }
}

struct Model {
    entries: Vec<Entry>,
    /// Counts clears: stamps of different epochs are never compared.
    epoch: u64,
}

impl Model {
    fn set(&mut self, e: Entry) {
        self.entries
            .retain(|o| (o.rank, o.op, o.mode) != (e.rank, e.op, e.mode));
        self.entries.push(e);
    }

    /// The most specific entry for `op` run by `rank`, in graph mode or not.
    fn lookup(&self, op: CostOp, rank: u32, graph: bool) -> Option<&Entry> {
        let wanted = if graph { Mode::Graph } else { Mode::Eager };
        self.entries
            .iter()
            .filter(|e| e.op == op)
            .filter(|e| e.rank.is_none_or(|r| r == rank))
            .filter(|e| e.mode == Mode::Any || e.mode == wanted)
            .max_by_key(|e| (e.rank.is_some(), e.mode != Mode::Any))
    }
}

/// `None` until the environment has been read.
static MODEL: Mutex<Option<Model>> = Mutex::new(None);

thread_local! {
    /// The virtual clock of the stream whose worker this thread is.
    static CLOCK: Cell<u64> = const { Cell::new(0) };
    /// Whether this thread runs a graph launch's work now.
    static IN_GRAPH: Cell<bool> = const { Cell::new(false) };
}

/// A stream's virtual clock as an event records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    epoch: u64,
    ns: u64,
}

fn with<R>(f: impl FnOnce(&mut Model) -> R) -> R {
    let mut g = MODEL.lock();
    let m = g.get_or_insert_with(|| Model {
        entries: parse_env(),
        epoch: 0,
    });
    f(m)
}

fn parse_env() -> Vec<Entry> {
    let Ok(spec) = std::env::var("METRALE_EMU_COSTS") else {
        return Vec::new();
    };
    parse_spec(&spec)
}

fn parse_spec(spec: &str) -> Vec<Entry> {
    let mut m = Model {
        entries: Vec::new(),
        epoch: 0,
    };
    for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        match parse_item(item) {
            Some(e) => m.set(e),
            None => tracing::warn!(item, "METRALE_EMU_COSTS: ignoring a malformed entry"),
        }
    }
    m.entries
}

/// `RANK:OP:MODE=BASE_NS+NS_PER_KIB`, RANK a number or `*`, OP
/// `allreduce|oneshot|send`, MODE `eager|graph|*`.
fn parse_item(item: &str) -> Option<Entry> {
    let (key, value) = item.split_once('=')?;
    let mut key = key.split(':').map(str::trim);
    let (rank, op, mode) = (key.next()?, key.next()?, key.next()?);
    if key.next().is_some() {
        return None;
    }
    let rank = match rank {
        "*" => None,
        r => Some(r.parse::<u32>().ok()?),
    };
    let (base, per) = value.split_once('+')?;
    Some(Entry {
        rank,
        op: CostOp::from_name(op)?,
        mode: Mode::from_name(mode)?,
        base_ns: base.trim().parse().ok()?,
        ns_per_kib: per.trim().parse().ok()?,
    })
}

/// Sets a cost; 0 on success, -1 on a bad argument.
pub(crate) fn set(rank: i32, op: i32, mode: i32, base_ns: u64, ns_per_kib: u64) -> i32 {
    let (Some(op), Some(mode)) = (CostOp::from_code(op), Mode::from_code(mode)) else {
        return -1;
    };
    let rank = match rank {
        -1 => None,
        r => match u32::try_from(r) {
            Ok(r) => Some(r),
            Err(_) => return -1,
        },
    };
    with(|m| {
        m.set(Entry {
            rank,
            op,
            mode,
            base_ns,
            ns_per_kib,
        })
    });
    0
}

/// Clears every cost (the environment is not read again); stamps taken
/// before are never compared with later ones.
pub(crate) fn clear() {
    with(|m| {
        m.entries.clear();
        m.epoch += 1;
    });
}

/// The model's epoch while it is active.
fn active_epoch() -> Option<u64> {
    with(|m| (!m.entries.is_empty()).then_some(m.epoch))
}

/// Whether at least one cost is set.
pub(crate) fn active() -> bool {
    active_epoch().is_some()
}

/// Advances this stream's clock by the cost of `op` of `bytes` run by
/// `rank`; call it once the operation has run to completion.
pub(crate) fn charge(op: CostOp, rank: usize, bytes: usize) {
    let graph = IN_GRAPH.get();
    let Ok(rank) = u32::try_from(rank) else {
        return;
    };
    let ns = with(|m| m.lookup(op, rank, graph).map(|e| e.cost(bytes)));
    if let Some(ns) = ns {
        CLOCK.set(CLOCK.get().saturating_add(ns));
    }
}

/// This stream's clock, while the model is active.
pub(crate) fn stamp() -> Option<Stamp> {
    active_epoch().map(|epoch| Stamp {
        epoch,
        ns: CLOCK.get(),
    })
}

/// Moves this stream's clock up to `s` (a wait for an event stamped `s`),
/// when `s` was taken under the model active now.
pub(crate) fn merge(s: Option<Stamp>) {
    if let (Some(s), Some(epoch)) = (s, active_epoch())
        && s.epoch == epoch
    {
        CLOCK.set(CLOCK.get().max(s.ns));
    }
}

/// Milliseconds from `a` to `b`, when both were taken under one model.
pub(crate) fn elapsed_ms(a: Option<Stamp>, b: Option<Stamp>) -> Option<f32> {
    let (a, b) = (a?, b?);
    (a.epoch == b.epoch).then(|| ((b.ns as f64 - a.ns as f64) / 1e6) as f32)
}

/// Runs `f` as a graph launch's work: operations in it are charged their
/// graph-mode costs.
pub(crate) fn in_graph<R>(f: impl FnOnce() -> R) -> R {
    let was = IN_GRAPH.replace(true);
    let r = f();
    IN_GRAPH.set(was);
    r
}

/// Sets how long an operation takes in emulated time: `rank` a
/// communicator rank or -1 for every rank; `op` 1 NCCL all-reduce, 2
/// one-shot all-reduce kernel, 3 NCCL send; `mode` 0 any launch, 1 eager
/// only, 2 graph replays only; the cost of `bytes` is `base_ns +
/// ns_per_kib * bytes / 1024` ns. Returns 0, or -1 on a bad argument.
#[unsafe(no_mangle)]
pub extern "C" fn metrale_emu_set_cost(
    rank: i32,
    op: i32,
    mode: i32,
    base_ns: u64,
    ns_per_kib: u64,
) -> i32 {
    guard(-1, || set(rank, op, mode, base_ns, ns_per_kib))
}

/// Clears every cost: events are timed with host clocks again.
#[unsafe(no_mangle)]
pub extern "C" fn metrale_emu_clear_costs() {
    guard((), clear)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_items() {
        let e = parse_item("3:allreduce:eager=1000+20").unwrap();
        assert_eq!(
            e,
            Entry {
                rank: Some(3),
                op: CostOp::AllReduce,
                mode: Mode::Eager,
                base_ns: 1000,
                ns_per_kib: 20
            }
        );
        let e = parse_item(" * : oneshot : * = 5 + 0 ").unwrap();
        assert_eq!((e.rank, e.op, e.mode), (None, CostOp::OneShot, Mode::Any));
        assert_eq!((e.base_ns, e.ns_per_kib), (5, 0));
        let e = parse_item("0:send:graph=7+1").unwrap();
        assert_eq!((e.op, e.mode), (CostOp::Send, Mode::Graph));
        for bad in [
            "",
            "x:allreduce:*=1+1",
            "-1:allreduce:*=1+1",
            "0:reduce:*=1+1",
            "0:allreduce:lazy=1+1",
            "0:allreduce=1+1",
            "0:allreduce:*:x=1+1",
            "0:allreduce:*=1",
            "0:allreduce:*=a+1",
            "0:allreduce:*=1+-1",
            "0:allreduce:*",
        ] {
            assert_eq!(parse_item(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_spec_skips_malformed_items_and_later_entries_replace() {
        let v = parse_spec("0:allreduce:*=1+0; junk ;;0:allreduce:*=2+0;*:send:eager=3+4");
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].base_ns, 2);
        assert_eq!(
            (v[1].rank, v[1].op, v[1].ns_per_kib),
            (None, CostOp::Send, 4)
        );
    }

    #[test]
    fn cost_rounds_down() {
        let e = parse_item("*:allreduce:*=100+3").unwrap();
        assert_eq!(e.cost(0), 100);
        assert_eq!(e.cost(1023), 100 + 3 * 1023 / 1024);
        assert_eq!(e.cost(1024), 103);
        assert_eq!(e.cost(1536), 104);
        let big = parse_item("*:allreduce:*=18446744073709551615+1000").unwrap();
        assert_eq!(big.cost(1 << 30), u64::MAX);
    }

    #[test]
    fn the_most_specific_entry_wins() {
        let mut m = Model {
            entries: parse_spec(
                "*:allreduce:*=1+0;*:allreduce:graph=2+0;1:allreduce:*=3+0;2:allreduce:eager=4+0;2:oneshot:*=9+0",
            ),
            epoch: 0,
        };
        let base = |m: &Model, r, g| m.lookup(CostOp::AllReduce, r, g).map(|e| e.base_ns);
        assert_eq!(base(&m, 0, false), Some(1));
        assert_eq!(base(&m, 0, true), Some(2));
        assert_eq!(
            base(&m, 1, false),
            Some(3),
            "a rank's entry over every rank's"
        );
        assert_eq!(base(&m, 1, true), Some(3), "the rank first, then the mode");
        assert_eq!(base(&m, 2, false), Some(4));
        assert_eq!(base(&m, 2, true), Some(2));
        assert_eq!(m.lookup(CostOp::Send, 0, false), None);
        m.set(parse_item("*:allreduce:*=5+0").unwrap());
        assert_eq!(base(&m, 0, false), Some(5), "a later entry replaces");
        assert_eq!(m.entries.len(), 5);
    }

    #[test]
    fn set_refuses_bad_arguments() {
        assert_eq!(set(-2, 1, 0, 1, 1), -1);
        assert_eq!(set(0, 0, 0, 1, 1), -1);
        assert_eq!(set(0, 4, 0, 1, 1), -1);
        assert_eq!(set(0, 1, 3, 1, 1), -1);
        assert_eq!(set(0, 1, -1, 1, 1), -1);
    }

    #[test]
    fn stamps_of_different_models_are_not_compared() {
        let a = Some(Stamp { epoch: 1, ns: 10 });
        let b = Some(Stamp {
            epoch: 1,
            ns: 1_500_010,
        });
        assert_eq!(elapsed_ms(a, b), Some(1.5));
        assert_eq!(elapsed_ms(b, a), Some(-1.5));
        assert_eq!(elapsed_ms(a, Some(Stamp { epoch: 2, ns: 0 })), None);
        assert_eq!(elapsed_ms(a, None), None);
    }
}
