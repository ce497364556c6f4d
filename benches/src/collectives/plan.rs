//! What the collectives benchmark runs: its criterion groups, their sizes
//! and functions, and each case's shape in nccl-tests' size convention.
//!
//! Invariants:
//! - A group is one operation, one mode (eager or CUDA graph replay) and one
//!   size range; its functions are the implementations criterion compares
//!   (`raw` NCCL through nccl-safe and `ours` through the `CommBackend`, or
//!   the all-reduce paths).
//! - Group names are `op/mode/range` (`all_reduce/eager/small`); criterion
//!   ids add `/function/bytes`, where `bytes` is the size an operation
//!   moves in nccl-tests' convention after rounding to whole elements.
//! - Every element is bf16 (the command is one u32, the barrier one f32);
//!   a size that rounds to no element for the world size is left out.
//! - Only operations that take a caller stream can be captured into a
//!   graph through the backend: `all_reduce_async` and send/recv.

use crate::{Collective, size_series};

/// How many operations one captured graph holds (nccl-tests' `-G 20`).
pub const GRAPH_OPS: u64 = 20;

/// One benchmarked operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `all_reduce` on the backend's stream; raw: `ncclAllReduce` in place.
    AllReduce,
    /// `all_reduce_async` ordered with a caller stream.
    AllReduceAsync,
    /// `all_gather`.
    AllGather,
    /// `reduce_scatter`.
    ReduceScatter,
    /// `broadcast` from rank 0, waited for on the host (both sides).
    Broadcast,
    /// A grouped send to the next rank and receive from the previous one.
    SendRecv,
    /// `all_to_all`; raw: `ncclAlltoAll` (NCCL 2.28 and later).
    AllToAll,
    /// `all_to_all_v` with equal counts; raw: the grouped send/recv NCCL
    /// has instead of an all-to-all-v.
    AllToAllV,
    /// `barrier`; raw: a one-f32 all-reduce waited for on the host.
    Barrier,
    /// rank 0's `broadcast` of one u32 met by the others'
    /// `recv_command_u32`; raw: a 4-byte broadcast waited for on the host.
    CommandU32,
}

impl Op {
    /// Every operation, in the order the groups run.
    pub const ALL: [Op; 10] = [
        Op::AllReduce,
        Op::AllReduceAsync,
        Op::AllGather,
        Op::ReduceScatter,
        Op::Broadcast,
        Op::SendRecv,
        Op::AllToAll,
        Op::AllToAllV,
        Op::Barrier,
        Op::CommandU32,
    ];

    /// The name in group ids and tables.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllReduceAsync => "all_reduce_async",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::SendRecv => "send_recv",
            Op::AllToAll => "all_to_all",
            Op::AllToAllV => "all_to_all_v",
            Op::Barrier => "barrier",
            Op::CommandU32 => "command_u32",
        }
    }

    /// The operation named `name`.
    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }

    /// The collective whose bus-bandwidth factor applies; `None` for the
    /// latency-only operations.
    pub fn collective(self) -> Option<Collective> {
        Some(match self {
            Op::AllReduce | Op::AllReduceAsync => Collective::AllReduce,
            Op::AllGather => Collective::AllGather,
            Op::ReduceScatter => Collective::ReduceScatter,
            Op::Broadcast => Collective::Broadcast,
            Op::SendRecv => Collective::SendRecv,
            Op::AllToAll | Op::AllToAllV => Collective::AllToAll,
            Op::Barrier | Op::CommandU32 => return None,
        })
    }

    /// The fewest ranks the backend runs the operation on (it refuses to
    /// send to itself, and the command's root does not receive).
    pub fn min_world(self) -> usize {
        match self {
            Op::SendRecv | Op::CommandU32 => 2,
            _ => 1,
        }
    }

    /// Whether both sides can be captured into a CUDA graph.
    pub fn graphable(self) -> bool {
        matches!(self, Op::AllReduceAsync | Op::SendRecv)
    }

    /// The element counts of one operation of about `bytes` on `world`
    /// ranks; `None` when it rounds to no element.
    pub fn shape(self, bytes: usize, world: usize) -> Option<Shape> {
        let w = world.max(1);
        let (count, moved) = match self {
            Op::AllReduce | Op::AllReduceAsync | Op::Broadcast | Op::SendRecv => {
                (bytes / 2, bytes / 2 * 2)
            }
            // The size is the whole gathered array, the whole input array,
            // or one rank's whole send array; the count is per rank (per
            // peer for all-to-all).
            Op::AllGather | Op::ReduceScatter | Op::AllToAll | Op::AllToAllV => {
                (bytes / (2 * w), bytes / (2 * w) * 2 * w)
            }
            Op::Barrier | Op::CommandU32 => (1, 4),
        };
        (count > 0).then_some(Shape {
            bytes: moved,
            count,
        })
    }
}

/// One operation's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    /// The bytes it moves, nccl-tests' size.
    pub bytes: usize,
    /// Elements: the whole buffer (all-reduce, broadcast, send/recv), one
    /// rank's share (all-gather send, reduce-scatter receive), or one peer's
    /// block (all-to-all).
    pub count: usize,
}

/// Eager launches, or replays of a captured graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Each operation issued from the host.
    Eager,
    /// [`GRAPH_OPS`] operations captured once, the graph replayed.
    Graph,
}

impl Mode {
    /// The name in group ids.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Eager => "eager",
            Mode::Graph => "graph",
        }
    }
}

/// Which backend's fast-path policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// `FastPathPolicy::Never`: NCCL's all-reduce; the backend every
    /// operation group measures as `ours`.
    Never,
    /// `FastPathPolicy::Always`: send/recv plus the add kernel (2 ranks).
    Always,
    /// `FastPathPolicy::DEFAULT`: the automatic choice.
    Default,
    /// `OneShotPolicy::Always` (with `FastPathPolicy::Never`): the one-shot
    /// all-reduce over peer memory (2 to 8 ranks).
    OneShot,
}

/// Who issues the operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Impl {
    /// nccl-safe's raw calls on a blocking communicator.
    Raw,
    /// A `NcclBackend` with this policy.
    Backend(Policy),
}

/// One benchmark: everything a rank needs to issue it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Case {
    /// The operation.
    pub op: Op,
    /// Eager or graph replay.
    pub mode: Mode,
    /// Raw NCCL or a backend.
    pub imp: Impl,
    /// Its size.
    pub shape: Shape,
}

/// How criterion samples a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Range {
    /// 8 B to 512 KiB: linear sampling (criterion's slope).
    Small,
    /// 2 MiB to 1 GiB: flat sampling, fewer samples.
    Large,
    /// The all-reduce path sweep by factor 2 (eager and graph): linear
    /// sampling.
    Paths,
    /// One fixed size (barrier, command): linear sampling.
    Fixed,
}

impl Range {
    fn name(self) -> &'static str {
        match self {
            Range::Small => "small",
            Range::Large => "large",
            Range::Paths | Range::Fixed => "",
        }
    }
}

/// One criterion benchmark group.
#[derive(Debug, Clone)]
pub struct Group {
    /// `op/mode/range`, or `all_reduce_paths/eager`.
    pub name: String,
    /// The operation.
    pub op: Op,
    /// Eager or graph replay.
    pub mode: Mode,
    /// How it is sampled.
    pub range: Range,
    /// The shapes, smallest first (one for the fixed-size operations).
    pub shapes: Vec<Shape>,
    /// The function names and who issues them.
    pub functions: Vec<(&'static str, Impl)>,
}

impl Group {
    /// The case of function `imp` at `shape`.
    pub fn case(&self, imp: Impl, shape: Shape) -> Case {
        Case {
            op: self.op,
            mode: self.mode,
            imp,
            shape,
        }
    }
}

/// The sizes of each range.
#[derive(Debug, Clone)]
pub struct Sizes {
    /// [`Range::Small`].
    pub small: Vec<usize>,
    /// [`Range::Large`].
    pub large: Vec<usize>,
    /// [`Range::Paths`].
    pub paths: Vec<usize>,
}

impl Sizes {
    /// nccl-tests' sweep, 8 B to 1 GiB by factor 4, split at 1 MiB; the
    /// paths by factor 2 from 8 B to 64 MiB (the one-shot sizes and the
    /// fast path's range).
    pub fn full() -> Sizes {
        Sizes {
            small: size_series(8, 512 << 10, 4),
            large: size_series(2 << 20, 1 << 30, 4),
            paths: size_series(8, 64 << 20, 2),
        }
    }

    /// A smoke test's sizes (`METRALE_BENCH_QUICK=1`).
    pub fn quick() -> Sizes {
        Sizes {
            small: vec![8, 4 << 10],
            large: vec![64 << 10],
            paths: vec![8, 64 << 10, 128 << 10],
        }
    }

    /// The largest size of any range.
    pub fn max(&self) -> usize {
        self.small
            .iter()
            .chain(&self.large)
            .chain(&self.paths)
            .copied()
            .max()
            .unwrap_or(8)
    }
}

/// What this machine can run.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// Ranks (one GPU each).
    pub world: usize,
    /// The NCCL library has `ncclAlltoAll` (2.28 and later).
    pub nccl_all_to_all: bool,
}

/// The groups to run, in order.
pub fn groups(caps: Caps, sizes: &Sizes) -> Vec<Group> {
    let w = caps.world;
    let ours = ("ours", Impl::Backend(Policy::Never));
    let raw = ("raw", Impl::Raw);
    let shapes = |op: Op, list: &[usize]| -> Vec<Shape> {
        let mut v: Vec<Shape> = list.iter().filter_map(|&b| op.shape(b, w)).collect();
        v.dedup();
        v
    };
    let mut out = Vec::new();
    for op in Op::ALL {
        if w < op.min_world() {
            continue;
        }
        let mut functions = vec![raw, ours];
        if op == Op::AllToAll && !caps.nccl_all_to_all {
            functions.remove(0);
        }
        if matches!(op, Op::Barrier | Op::CommandU32) {
            out.push(Group {
                name: format!("{}/eager", op.name()),
                op,
                mode: Mode::Eager,
                range: Range::Fixed,
                shapes: shapes(op, &[4]),
                functions,
            });
            continue;
        }
        for mode in [Mode::Eager, Mode::Graph] {
            if mode == Mode::Graph && !op.graphable() {
                continue;
            }
            for (range, list) in [(Range::Small, &sizes.small), (Range::Large, &sizes.large)] {
                let shapes = shapes(op, list);
                if shapes.is_empty() {
                    continue;
                }
                out.push(Group {
                    name: format!("{}/{}/{}", op.name(), mode.name(), range.name()),
                    op,
                    mode,
                    range,
                    shapes,
                    functions: functions.clone(),
                });
            }
        }
    }
    // The path sweep: NCCL, the one-shot path (2 to 8 ranks), the fast path
    // (2 ranks, eager only: captured all-reduces take NCCL) and the default.
    if w >= 2 {
        let one_shot = ("one_shot", Impl::Backend(Policy::OneShot));
        let never = ("never", Impl::Backend(Policy::Never));
        let default = ("default", Impl::Backend(Policy::Default));
        let mut eager = vec![raw, never];
        if w == 2 {
            eager.push(("always", Impl::Backend(Policy::Always)));
        }
        eager.extend([one_shot, default]);
        out.push(Group {
            name: "all_reduce_paths/eager".into(),
            op: Op::AllReduce,
            mode: Mode::Eager,
            range: Range::Paths,
            shapes: shapes(Op::AllReduce, &sizes.paths),
            functions: eager,
        });
        out.push(Group {
            name: "all_reduce_paths/graph".into(),
            op: Op::AllReduceAsync,
            mode: Mode::Graph,
            range: Range::Paths,
            shapes: shapes(Op::AllReduceAsync, &sizes.paths),
            functions: vec![raw, never, one_shot, default],
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(caps: Caps) -> Vec<String> {
        groups(caps, &Sizes::full())
            .into_iter()
            .map(|g| g.name)
            .collect()
    }

    #[test]
    fn shapes_follow_nccl_tests() {
        let s = Op::AllReduce.shape(1 << 20, 2).unwrap();
        assert_eq!((s.bytes, s.count), (1 << 20, 1 << 19));
        // All-gather: the whole gathered array; one rank sends a share.
        let s = Op::AllGather.shape(1 << 20, 4).unwrap();
        assert_eq!((s.bytes, s.count), (1 << 20, 1 << 17));
        // 8 B over 8 ranks rounds to no bf16 element.
        assert_eq!(Op::ReduceScatter.shape(8, 8), None);
        // 40 B over 8 ranks: 2 elements each, 32 B moved.
        assert_eq!(Op::AllToAll.shape(40, 8).unwrap().bytes, 32);
        assert_eq!(Op::Barrier.shape(0, 2).unwrap().bytes, 4);
    }

    #[test]
    fn one_gpu_runs_what_a_world_of_one_can() {
        let one = names(Caps {
            world: 1,
            nccl_all_to_all: true,
        });
        assert!(one.contains(&"all_reduce/eager/small".to_owned()));
        assert!(one.contains(&"all_reduce_async/graph/large".to_owned()));
        assert!(one.contains(&"barrier/eager".to_owned()));
        assert!(!one.iter().any(|n| n.starts_with("send_recv")));
        assert!(!one.iter().any(|n| n.starts_with("command_u32")));
        assert!(!one.iter().any(|n| n.starts_with("all_reduce_paths")));
        let two = names(Caps {
            world: 2,
            nccl_all_to_all: true,
        });
        assert!(two.contains(&"send_recv/graph/small".to_owned()));
        assert!(two.contains(&"all_reduce_paths/eager".to_owned()));
        assert!(two.contains(&"all_reduce_paths/graph".to_owned()));
        assert!(two.contains(&"command_u32/eager".to_owned()));
        // Graph replay only where the backend takes a caller stream.
        assert!(!two.iter().any(|n| n.starts_with("all_gather/graph")));
        // send_recv eager and graph, small and large; the command; the paths
        // eager and graph.
        assert_eq!(two.len(), one.len() + 4 + 1 + 2);
    }

    #[test]
    fn all_to_all_without_ncclalltoall_measures_ours_only() {
        let g = groups(
            Caps {
                world: 2,
                nccl_all_to_all: false,
            },
            &Sizes::quick(),
        );
        let a2a = g.iter().find(|g| g.op == Op::AllToAll).unwrap();
        assert_eq!(a2a.functions.len(), 1);
        assert_eq!(a2a.functions[0].0, "ours");
        assert!(
            g.iter()
                .all(|g| g.shapes.windows(2).all(|w| w[0].bytes < w[1].bytes))
        );
    }

    #[test]
    fn a_full_run_is_as_long_as_docs_benchmarks_says() {
        // docs/benchmarks.md times a full run from these counts.
        let count = |world| -> usize {
            groups(
                Caps {
                    world,
                    nccl_all_to_all: true,
                },
                &Sizes::full(),
            )
            .iter()
            .map(|g| g.shapes.len() * g.functions.len())
            .sum()
        };
        assert_eq!(count(1), 242);
        assert_eq!(count(2), 520);
    }
}
