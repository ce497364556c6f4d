//! What a fuzzed program is: its backends, caller streams, threads and
//! steps, and how each is written in a report.
//!
//! Invariants: a program is plain data (no device state), the same on every
//! rank for one seed; a step's `uid` is its index in the generated program
//! and never changes, so it names the step's slots and graphs and salts its
//! data also after the shrinker removed other steps; `Display` writes every
//! field that decides what a step does, so a reported program can be read
//! back by a person and run again from its seed.

use std::fmt;
use std::time::Duration;

use metrale_comm::{BackendConfig, EnqueueMode, FastPathPolicy, OneShotPolicy};
use nccl_safe::DataType;

use crate::RankCtx;
use crate::data::size_name;

/// The collective timeout of the fuzzed backends.
pub(super) const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// The set-up timeout of the fuzzed backends: it bounds the path tuner's
/// timing too, which with the library's trials took a debug emulator at
/// three ranks on CI's two loaded cores over 15 s.
const INIT_TIMEOUT: Duration = Duration::from_secs(60);
/// The shutdown timeout of the fuzzed backends.
pub(super) const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// A backend's fast-path policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Policy {
    Always,
    Never,
    Default,
    /// Always, with a 256 KiB scratch buffer: larger payloads in chunks.
    Chunked,
    /// The one-shot path by its default range (bf16 up to 1 MiB), the fast
    /// path by its default, NCCL above: every path chosen by size.
    OneShot,
    /// The one-shot path at every size (in chunks of its slot above 1 MiB),
    /// no fast path.
    OneShotAlways,
}

impl Policy {
    /// Whether the backend sets up the one-shot path (where the machine
    /// allows it: 2 to 8 ranks with peer access).
    pub fn one_shot(self) -> bool {
        matches!(self, Policy::OneShot | Policy::OneShotAlways)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BackendSpec {
    pub policy: Policy,
    pub blocking: bool,
    /// The backend is a split of a world backend of the same
    /// configuration (every rank, in rank order): a sub-communicator,
    /// which meets its group in the parent's store.
    pub split: bool,
}

impl BackendSpec {
    pub fn config(self, ctx: &RankCtx) -> BackendConfig {
        let (policy, one_shot) = match self.policy {
            Policy::Always | Policy::Chunked => (FastPathPolicy::Always, OneShotPolicy::Never),
            Policy::Never => (FastPathPolicy::Never, OneShotPolicy::Never),
            // The library's default: both paths tuned on the machine.
            Policy::Default => (FastPathPolicy::Auto, OneShotPolicy::Auto),
            Policy::OneShot => (crate::FAST_PATH_WINDOW, crate::ONE_SHOT_TO_1M),
            Policy::OneShotAlways => (FastPathPolicy::Never, OneShotPolicy::Always),
        };
        let mode = if self.blocking {
            EnqueueMode::Blocking
        } else {
            EnqueueMode::NonBlocking
        };
        let mut c = ctx
            .config()
            .with_collective_timeout(COLLECTIVE_TIMEOUT)
            .with_init_timeout(INIT_TIMEOUT)
            .with_fast_path(policy)
            .with_one_shot(one_shot)
            .with_enqueue(mode)
            .with_tune(true)
            // The fused kernel over thread block clusters (off by default)
            // at even ranks of the one-shot-always backends: the cluster
            // entries and ranks that differ in them, among the rest.
            .with_fused_cluster(self.policy == Policy::OneShotAlways && ctx.rank.is_multiple_of(2));
        c.shutdown_timeout = SHUTDOWN_TIMEOUT;
        if self.policy == Policy::Chunked {
            c = c.with_scratch_bytes(256 << 10);
        }
        c
    }
}

impl fmt::Display for BackendSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let policy = match self.policy {
            Policy::Always => "fast path always",
            Policy::Never => "fast path never",
            Policy::Default => "the default: one-shot and fast path where tuned",
            Policy::Chunked => "fast path always, 256 KiB scratch",
            Policy::OneShot => "one-shot up to 1 MiB, fast path by default, NCCL above",
            Policy::OneShotAlways => {
                "one-shot always (chunked past 1 MiB), no fast path, fused kernel over clusters at even ranks"
            }
        };
        let mode = if self.blocking {
            "blocking"
        } else {
            "non-blocking"
        };
        let split = if self.split {
            ", split from a world backend"
        } else {
            ""
        };
        write!(f, "{policy}, {mode}{split}")
    }
}

/// An element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ty {
    Bf16,
    F16,
    F32,
    U32,
}

impl Ty {
    pub fn data_type(self) -> DataType {
        match self {
            Ty::Bf16 => DataType::Bfloat16,
            Ty::F16 => DataType::Float16,
            Ty::F32 => DataType::Float32,
            Ty::U32 => DataType::Uint32,
        }
    }

    pub fn size(self) -> usize {
        self.data_type().size()
    }

    pub fn name(self) -> &'static str {
        match self {
            Ty::Bf16 => "bf16",
            Ty::F16 => "f16",
            Ty::F32 => "f32",
            Ty::U32 => "u32",
        }
    }
}

/// A send/recv pair's two calls, in call order, with their streams.
fn pair_calls(shift: usize, stream: usize, recv_stream: usize, recv_first: bool) -> String {
    let send = format!("send_to r+{shift} on s{stream}");
    let recv = format!("recv_from r-{shift} on s{recv_stream}");
    if recv_first {
        format!("{recv}, {send}")
    } else {
        format!("{send}, {recv}")
    }
}

pub(super) fn elems(n: usize, ty: Ty) -> String {
    format!("{n} {} ({})", ty.name(), size_name(n * ty.size()))
}

/// The operand of an in-place all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum On {
    /// A buffer of its own, with fresh data.
    Fresh,
    /// The (bf16) buffer allocated by step `uid`.
    Slot(u32),
}

/// A call that must be refused with a typed error, leaving the backend
/// healthy. 0.1's odd byte counts and double frees of a raw handle cannot
/// be written with the 0.2 API; their place is taken by views whose types
/// or lengths do not match and by handles rebuilt (`from_raw`) after they
/// were released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bad {
    /// `all_reduce` of a bf16 view at an odd address.
    Misaligned,
    /// `all_reduce` of fp8 (not summed portably).
    Fp8Sum,
    /// `all_gather` from bf16 into f16.
    TypesDiffer,
    /// `reduce_scatter` whose send view is one element longer than
    /// `world_size` times the receive view.
    LengthMismatch,
    /// `all_to_all_v` whose counts add up to more than the send view.
    CountsPastBuffer,
    /// `recv_command_u32` into two u32s.
    CommandSize,
    SendToSelf,
    RootOutOfRange,
    /// `deregister_buffer` of a handle never handed out.
    UnknownHandle,
    /// `deregister_buffer` of a registration rebuilt from the raw value of
    /// one already released.
    ReleasedRegistration,
    /// `symmetric_free` of an allocation rebuilt from the address of one
    /// already freed.
    FreedSymmetric,
    SyncInGroup,
    GroupEndAlone,
}

/// Every bad input, in the order `generate` draws from.
pub(super) const BADS: [Bad; 13] = [
    Bad::Misaligned,
    Bad::Fp8Sum,
    Bad::TypesDiffer,
    Bad::LengthMismatch,
    Bad::CountsPastBuffer,
    Bad::CommandSize,
    Bad::SendToSelf,
    Bad::RootOutOfRange,
    Bad::UnknownHandle,
    Bad::ReleasedRegistration,
    Bad::FreedSymmetric,
    Bad::SyncInGroup,
    Bad::GroupEndAlone,
];

/// An asynchronous operation inside a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Item {
    AllReduce {
        n: usize,
        ty: Ty,
    },
    AllReduceAsync {
        n: usize,
        ty: Ty,
        stream: usize,
    },
    AllGather {
        n: usize,
    },
    ReduceScatter {
        n: usize,
        ty: Ty,
    },
    /// Send to rank `r + shift` on s`stream`, receive from `r - shift` on
    /// s`recv_stream`, the receive called first if `recv_first`.
    SendRecv {
        n: usize,
        stream: usize,
        recv_stream: usize,
        shift: usize,
        recv_first: bool,
    },
}

impl fmt::Display for Item {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Item::AllReduce { n, ty } => write!(f, "all_reduce {}", elems(*n, *ty)),
            Item::AllReduceAsync { n, ty, stream } => {
                write!(f, "all_reduce_async {} on s{stream}", elems(*n, *ty))
            }
            Item::AllGather { n } => write!(f, "all_gather {} per rank", elems(*n, Ty::Bf16)),
            Item::ReduceScatter { n, ty } => {
                write!(f, "reduce_scatter {} per rank", elems(*n, *ty))
            }
            Item::SendRecv {
                n,
                stream,
                recv_stream,
                shift,
                recv_first,
            } => write!(
                f,
                "{} {}",
                pair_calls(*shift, *stream, *recv_stream, *recv_first),
                elems(*n, Ty::Bf16)
            ),
        }
    }
}

/// One step of a program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Op {
    AllReduce {
        b: usize,
        n: usize,
        ty: Ty,
        on: On,
    },
    AllReduceAsync {
        b: usize,
        n: usize,
        ty: Ty,
        stream: usize,
        on: On,
    },
    /// `all_reduce_add_rms_norm` of `tokens` rows of `hidden` values on
    /// caller stream `stream` (fresh x, residual and weight).
    AddRmsNorm {
        b: usize,
        hidden: usize,
        tokens: usize,
        ty: Ty,
        stream: usize,
    },
    AllGather {
        b: usize,
        n: usize,
    },
    ReduceScatter {
        b: usize,
        n: usize,
        ty: Ty,
    },
    Broadcast {
        b: usize,
        n: usize,
        ty: Ty,
        root: usize,
    },
    /// Equal blocks of `n` elements per peer.
    AllToAll {
        b: usize,
        n: usize,
        ty: Ty,
    },
    /// `counts[i][j]` elements go from rank `i` to rank `j`.
    AllToAllV {
        b: usize,
        ty: Ty,
        counts: Vec<Vec<usize>>,
    },
    Barrier {
        b: usize,
    },
    /// The root broadcasts one u32; the others take it with
    /// `recv_command_u32`.
    Command {
        b: usize,
        root: usize,
    },
    /// Grouped: send to rank `r + shift` on s`stream`, receive from
    /// `r - shift` on s`recv_stream`, the receive called first if
    /// `recv_first`.
    SendRecv {
        b: usize,
        n: usize,
        stream: usize,
        recv_stream: usize,
        shift: usize,
        recv_first: bool,
    },
    /// Rank `from` sends, rank `to` receives; the others do nothing.
    SendOne {
        b: usize,
        n: usize,
        stream: usize,
        from: usize,
        to: usize,
    },
    Group {
        b: usize,
        items: Vec<Item>,
    },
    /// A bf16 buffer later steps name by this step's uid: device memory, or
    /// `symmetric_alloc` of backend `sym`.
    Alloc {
        n: usize,
        sym: Option<usize>,
    },
    Register {
        b: usize,
        slot: u32,
    },
    Deregister {
        slot: u32,
    },
    Free {
        slot: u32,
    },
    /// Captures `all_reduce_async` of a bf16 buffer of its own on a caller
    /// stream into a graph named by this step's uid.
    Capture {
        b: usize,
        n: usize,
        stream: usize,
    },
    /// Launches a graph on its stream, with fresh data or on its last result.
    Replay {
        graph: u32,
        refill: bool,
    },
    /// `rounds` times, launches every graph captured so far, each on its
    /// own stream, back to back (several graphs in flight at once, as an
    /// engine replays prefill and decode graphs or two micro-batches);
    /// a graph whose sum would no longer be exact gets fresh data first.
    ReplayAll {
        rounds: usize,
    },
    Synchronize {
        b: usize,
    },
    /// Every backend synchronized and every caller stream idle, then every
    /// buffer checked.
    SyncAll,
    Bad {
        b: usize,
        bad: Bad,
    },
}

fn on_name(on: On) -> String {
    match on {
        On::Fresh => String::new(),
        On::Slot(s) => format!(" in place on slot #{s}"),
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::AllReduce { b, n, ty, on } => {
                write!(f, "b{b} all_reduce {}{}", elems(*n, *ty), on_name(*on))
            }
            Op::AllReduceAsync {
                b,
                n,
                ty,
                stream,
                on,
            } => write!(
                f,
                "b{b} all_reduce_async {} on s{stream}{}",
                elems(*n, *ty),
                on_name(*on)
            ),
            Op::AddRmsNorm {
                b,
                hidden,
                tokens,
                ty,
                stream,
            } => write!(
                f,
                "b{b} all_reduce_add_rms_norm {tokens} x {} on s{stream}",
                elems(*hidden, *ty)
            ),
            Op::AllGather { b, n } => {
                write!(f, "b{b} all_gather {} per rank", elems(*n, Ty::Bf16))
            }
            Op::ReduceScatter { b, n, ty } => {
                write!(f, "b{b} reduce_scatter {} per rank", elems(*n, *ty))
            }
            Op::Broadcast { b, n, ty, root } => {
                write!(f, "b{b} broadcast {} from rank {root}", elems(*n, *ty))
            }
            Op::AllToAll { b, n, ty } => {
                write!(f, "b{b} all_to_all {} per peer", elems(*n, *ty))
            }
            Op::AllToAllV { b, ty, counts } => {
                write!(
                    f,
                    "b{b} all_to_all_v {}, counts [rank][peer] {counts:?}",
                    ty.name()
                )
            }
            Op::Barrier { b } => write!(f, "b{b} barrier"),
            Op::Command { b, root } => write!(
                f,
                "b{b} command: broadcast from rank {root}, recv_command_u32 elsewhere"
            ),
            Op::SendRecv {
                b,
                n,
                stream,
                recv_stream,
                shift,
                recv_first,
            } => write!(
                f,
                "b{b} group({}) {}",
                pair_calls(*shift, *stream, *recv_stream, *recv_first),
                elems(*n, Ty::Bf16)
            ),
            Op::SendOne {
                b,
                n,
                stream,
                from,
                to,
            } => write!(
                f,
                "b{b} send_to/recv_from rank {from} -> rank {to} {} on s{stream}",
                elems(*n, Ty::Bf16)
            ),
            Op::Group { b, items } => {
                write!(f, "b{b} group_start; ")?;
                for it in items {
                    write!(f, "{it}; ")?;
                }
                write!(f, "group_end")
            }
            Op::Alloc { n, sym: None } => write!(f, "slot: device buffer {}", elems(*n, Ty::Bf16)),
            Op::Alloc { n, sym: Some(b) } => {
                write!(f, "slot: b{b} symmetric_alloc {}", elems(*n, Ty::Bf16))
            }
            Op::Register { b, slot } => write!(f, "b{b} register_buffer slot #{slot}"),
            Op::Deregister { slot } => write!(f, "deregister_buffer slot #{slot}"),
            Op::Free { slot } => write!(f, "free slot #{slot}"),
            Op::Capture { b, n, stream } => write!(
                f,
                "graph: capture b{b} all_reduce_async {} on s{stream}",
                elems(*n, Ty::Bf16)
            ),
            Op::Replay { graph, refill } => write!(
                f,
                "launch graph #{graph}{}",
                if *refill {
                    " on fresh data"
                } else {
                    " on its last result"
                }
            ),
            Op::ReplayAll { rounds } => write!(
                f,
                "launch every graph, each on its own stream, {rounds} time(s) back to back"
            ),
            Op::Synchronize { b } => write!(f, "b{b} synchronize"),
            Op::SyncAll => write!(f, "synchronize everything, check every buffer"),
            Op::Bad { b, bad } => write!(f, "b{b} bad input {bad:?}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Step {
    /// Its index in the generated program; names slots and graphs and salts
    /// its data, so removing other steps changes nothing about it.
    pub uid: u32,
    pub thread: usize,
    pub op: Op,
}

/// A program: what every rank runs for one seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    pub(super) seed: u64,
    pub(super) world: usize,
    pub(super) threads: usize,
    pub(super) backends: Vec<BackendSpec>,
    pub(super) streams: usize,
    pub(super) steps: Vec<Step>,
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "seed {:#x}, world {}, {} thread(s) per rank, caller streams s0..s{}, {} step(s)",
            self.seed,
            self.world,
            self.threads,
            self.streams - 1,
            self.steps.len()
        )?;
        for (k, b) in self.backends.iter().enumerate() {
            write!(f, "\n  b{k}: {b}")?;
        }
        for s in &self.steps {
            write!(f, "\n  #{:<3} t{} {}", s.uid, s.thread, s.op)?;
        }
        Ok(())
    }
}
