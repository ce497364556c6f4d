//! Fault injection: a process-wide list of faults keyed by rank, filled by
//! `metrale_emu_inject` and by `METRALE_EMU_FAULTS` (read on first use).
//!
//! Invariants: each fault fires once and is then removed; every count starts
//! when the fault is added (for `METRALE_EMU_FAULTS`, at first use), so what
//! a communicator did before (its init's own operations included) does not
//! shift it. Operation faults count the collectives and send/recv launched
//! by communicators of that rank, on any communicator, at launch; a `stall`
//! counts the rank's enqueue calls on blocking communicators (a collective,
//! a send/recv, or a group end with work), taken in the call; a `corrupt`
//! counts the rank's one-shot kernels, taken when one completes. The list's
//! lock is a leaf, taken with no other lock held (at an init, a launch,
//! an enqueue call).
//!
//! Control functions: `metrale_emu_inject(rank, fault, nth)` and
//! `metrale_emu_reset()`.

use parking_lot::Mutex;

use crate::guard;

/// A fault the emulator can inject into one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The rank's `nth` operation from when the fault is added never
    /// completes (until it is aborted).
    Hang,
    /// The rank's `nth` operation completes, then its communicator reports
    /// `ncclSystemError` asynchronously.
    Async,
    /// The rank's next init returns `ncclSystemError`.
    InitFail,
    /// The rank's next init never registers: its peers never finish init.
    NoJoin,
    /// At the rank's `nth` operation its communicator behaves as crashed.
    Die,
    /// The `nth` enqueue call on a blocking communicator, counted from when
    /// the fault is added, does not return until the communicator is aborted (as NCCL's connection set-up at
    /// first use waits for a peer that never comes), then fails.
    Stall,
    /// The rank's `nth` one-shot all-reduce kernel, counted from when the
    /// fault is added, writes a wrong first word of its result (a GPU whose
    /// peer memory misbehaves): what the backend's checks must catch.
    Corrupt,
}

impl Fault {
    fn from_code(code: i32) -> Option<Self> {
        Some(match code {
            1 => Fault::Hang,
            2 => Fault::Async,
            3 => Fault::InitFail,
            4 => Fault::NoJoin,
            5 => Fault::Die,
            6 => Fault::Stall,
            7 => Fault::Corrupt,
            _ => return None,
        })
    }

    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "hang" => Fault::Hang,
            "async" => Fault::Async,
            "initfail" => Fault::InitFail,
            "nojoin" => Fault::NoJoin,
            "die" => Fault::Die,
            "stall" => Fault::Stall,
            "corrupt" => Fault::Corrupt,
            _ => return None,
        })
    }

    fn is_init(self) -> bool {
        matches!(self, Fault::InitFail | Fault::NoJoin)
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    rank: i32,
    fault: Fault,
    nth: u64,
}

/// `None` until the environment has been read.
static FAULTS: Mutex<Option<Vec<Entry>>> = Mutex::new(None);

fn parse_env() -> Vec<Entry> {
    let Ok(spec) = std::env::var("METRALE_EMU_FAULTS") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        match parse_item(item) {
            Some(e) => out.push(e),
            None => tracing::warn!(item, "METRALE_EMU_FAULTS: ignoring a malformed entry"),
        }
    }
    out
}

fn parse_item(item: &str) -> Option<Entry> {
    let (rank, rest) = item.split_once(':')?;
    let rank: i32 = rank.trim().parse().ok()?;
    let (kind, nth) = match rest.split_once('@') {
        Some((k, n)) => (k.trim(), n.trim().parse().ok()?),
        None => (rest.trim(), 1),
    };
    let fault = Fault::from_name(kind)?;
    (rank >= 0 && (fault.is_init() || nth >= 1)).then_some(Entry { rank, fault, nth })
}

fn with<R>(f: impl FnOnce(&mut Vec<Entry>) -> R) -> R {
    let mut g = FAULTS.lock();
    let list = g.get_or_insert_with(parse_env);
    f(list)
}

/// Adds a fault; 0 on success, -1 on a bad argument.
pub(crate) fn inject(rank: i32, fault: i32, nth: u64) -> i32 {
    let Some(fault) = Fault::from_code(fault) else {
        return -1;
    };
    if rank < 0 || (!fault.is_init() && nth == 0) {
        return -1;
    }
    with(|l| l.push(Entry { rank, fault, nth }));
    0
}

/// Clears every fault (the environment is not read again).
pub(crate) fn reset() {
    *FAULTS.lock() = Some(Vec::new());
}

/// Counts one event against the first fault `matches` accepts: that fault
/// (now gone) at its `nth` event since it was added.
fn count_down(matches: impl Fn(&Entry) -> bool) -> Option<Fault> {
    with(|l| {
        let i = l.iter().position(matches)?;
        if l[i].nth > 1 {
            l[i].nth -= 1;
            return None;
        }
        Some(l.remove(i).fault)
    })
}

/// Counts one operation launched by `rank` against its first operation
/// fault: the fault (now gone) at the `nth` operation since it was added.
pub(crate) fn take_op(rank: i32) -> Option<Fault> {
    count_down(|e| {
        e.rank == rank && !e.fault.is_init() && !matches!(e.fault, Fault::Stall | Fault::Corrupt)
    })
}

/// Counts one one-shot kernel of `rank` against its corruption fault:
/// true (and the fault is gone) at the `nth` kernel since it was added.
pub(crate) fn take_corrupt(rank: i32) -> bool {
    count_down(|e| e.rank == rank && e.fault == Fault::Corrupt).is_some()
}

/// Takes the init fault for `rank`, if any.
pub(crate) fn take_init(rank: i32) -> Option<Fault> {
    with(|l| {
        let i = l.iter().position(|e| e.rank == rank && e.fault.is_init())?;
        Some(l.remove(i).fault)
    })
}

/// Counts one enqueue call of a blocking communicator of `rank` against
/// its stall fault: true (and the fault is gone) at the `nth` call since
/// the fault was added.
pub(crate) fn take_stall(rank: i32) -> bool {
    count_down(|e| e.rank == rank && e.fault == Fault::Stall).is_some()
}

/// Injects a fault; see [`Fault`]. Returns 0, or -1 on a bad argument.
#[unsafe(no_mangle)]
pub extern "C" fn metrale_emu_inject(rank: i32, fault: i32, nth: u64) -> i32 {
    guard(-1, || inject(rank, fault, nth))
}

/// Clears every injected fault.
#[unsafe(no_mangle)]
pub extern "C" fn metrale_emu_reset() {
    guard((), reset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_items() {
        let e = parse_item("3:hang@2").unwrap();
        assert_eq!((e.rank, e.fault, e.nth), (3, Fault::Hang, 2));
        let e = parse_item("0:nojoin").unwrap();
        assert_eq!(e.fault, Fault::NoJoin);
        assert!(parse_item("x:hang@1").is_none());
        assert!(parse_item("1:boom@1").is_none());
        assert!(parse_item("1:die@0").is_none());
        let e = parse_item("1:stall@2").unwrap();
        assert_eq!((e.rank, e.fault, e.nth), (1, Fault::Stall, 2));
    }

    #[test]
    fn operation_faults_count_from_injection() {
        // A rank no other test uses: the list is process-wide.
        const R: i32 = 9_999;
        assert_eq!(inject(R, 1, 2), 0);
        assert_eq!(take_op(R), None);
        assert_eq!(take_op(R), Some(Fault::Hang));
        assert_eq!(take_op(R), None, "fires once");
    }
}
