//! Drawing a program from a seed.
//!
//! Invariants: `generate` is a pure function of the seed and the world size
//! (every rank draws the same program); it may draw steps that are not
//! valid where they stand (a release before a sync point, a slot used on
//! two streams), which `reference::prepare` drops or rewrites, so every
//! drawn program runs; payloads in the fast path's default range are drawn
//! at most [`MAX_LARGE`] times per program, to bound its time; every rank
//! sends and receives at least one element in an `all_to_all_v`.

use super::program::{BADS, BackendSpec, Item, On, Op, Policy, Program, Step, Ty};
use crate::data::Rng;

/// The most steps of a program.
const MAX_STEPS: usize = 24;
/// Steps with a payload in the fast path's default range, per program.
const MAX_LARGE: usize = 4;

struct Gen {
    rng: Rng,
    large_left: usize,
}

impl Gen {
    fn below(&mut self, n: usize) -> usize {
        (self.rng.next_u64() % n.max(1) as u64) as usize
    }

    fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }

    /// An element count up to 70000.
    fn small(&mut self) -> usize {
        match self.below(100) {
            0..=44 => 1 + self.below(64),
            45..=74 => 65 + self.below(4032),
            _ => 4097 + self.below(65_904),
        }
    }

    /// An element count, now and then one of the fast path's default
    /// range or just outside it.
    fn n(&mut self) -> usize {
        if self.large_left > 0 && self.chance(1, 6) {
            self.large_left -= 1;
            const LARGE: [usize; 5] = [1 << 20, 3 << 19, 2 << 20, (1 << 20) + 1, (1 << 20) - 1];
            return LARGE[self.below(LARGE.len())];
        }
        self.small()
    }

    /// A type NCCL sums everywhere; bf16 (the only one the fast path
    /// serves) half the time.
    fn reduce_ty(&mut self) -> Ty {
        [Ty::Bf16, Ty::Bf16, Ty::F16, Ty::F32][self.below(4)]
    }

    /// A type to move (all-to-all, broadcast).
    fn move_ty(&mut self) -> Ty {
        [Ty::Bf16, Ty::F16, Ty::F32, Ty::U32][self.below(4)]
    }

    fn pick(&mut self, v: &[u32]) -> Option<u32> {
        (!v.is_empty()).then(|| v[self.below(v.len())])
    }

    /// The counts of an `all_to_all_v`: zero, one, or a small count per
    /// pair, and at least one element from every rank to the next.
    fn counts(&mut self, world: usize) -> Vec<Vec<usize>> {
        let mut c: Vec<Vec<usize>> = (0..world)
            .map(|_| {
                (0..world)
                    .map(|_| match self.below(4) {
                        0 => 0,
                        1 => 1,
                        _ => self.small(),
                    })
                    .collect()
            })
            .collect();
        for (i, row) in c.iter_mut().enumerate() {
            let next = (i + 1) % world;
            row[next] = row[next].max(1);
        }
        c
    }
}

/// What a generated step does, before its operands are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    AllReduce,
    AllReduceAsync,
    AllGather,
    ReduceScatter,
    Broadcast,
    AllToAll,
    AllToAllV,
    Barrier,
    Command,
    SendRecv,
    SendOne,
    Group,
    Alloc,
    Register,
    Deregister,
    Free,
    Capture,
    Replay,
    ReplayAll,
    Synchronize,
    SyncAll,
    Bad,
    AddRmsNorm,
}

/// How often each kind is drawn; point-to-point steps and commands need a
/// peer.
fn weights(world: usize) -> [(Kind, usize); 23] {
    let p2p = usize::from(world > 1);
    [
        (Kind::AllReduce, 14),
        (Kind::AllReduceAsync, 14),
        (Kind::AllGather, 5),
        (Kind::ReduceScatter, 5),
        (Kind::Broadcast, 4),
        (Kind::AllToAll, 3),
        (Kind::AllToAllV, 3),
        (Kind::Barrier, 3),
        (Kind::Command, 2 * p2p),
        (Kind::SendRecv, 5 * p2p),
        (Kind::SendOne, 3 * p2p),
        (Kind::Group, 6),
        (Kind::Alloc, 5),
        (Kind::Register, 3),
        (Kind::Deregister, 2),
        (Kind::Free, 2),
        (Kind::Capture, 3),
        (Kind::Replay, 5),
        (Kind::ReplayAll, 3),
        (Kind::Synchronize, 5),
        (Kind::SyncAll, 5),
        (Kind::Bad, 3),
        (Kind::AddRmsNorm, 4),
    ]
}

/// The program of `seed` for `world` ranks.
pub(super) fn generate(seed: u64, world: usize) -> Program {
    let mut g = Gen {
        rng: Rng::new(seed, 0, 0xf022),
        large_left: MAX_LARGE,
    };
    let threads = 1 + g.below(4);
    let backends: Vec<BackendSpec> = (0..1 + g.below(3))
        .map(|_| BackendSpec {
            policy: [
                Policy::Always,
                Policy::Never,
                Policy::Default,
                Policy::Chunked,
                Policy::OneShot,
                Policy::OneShotAlways,
            ][g.below(6)],
            blocking: g.chance(2, 3),
            split: g.chance(1, 4),
        })
        .collect();
    let streams = 1 + g.below(3);
    let len = 3 + g.below(MAX_STEPS - 2);
    let weights = weights(world);
    let total: usize = weights.iter().map(|w| w.1).sum();
    let (mut slots, mut registered, mut graphs) = (Vec::new(), Vec::new(), Vec::new());
    let mut steps = Vec::with_capacity(len);
    for uid in 0..len as u32 {
        let thread = g.below(threads);
        let b = g.below(backends.len());
        let mut x = g.below(total);
        let mut kind = Kind::SyncAll;
        for (k, w) in weights {
            if x < w {
                kind = k;
                break;
            }
            x -= w;
        }
        let stream = g.below(streams);
        let on = match g.pick(&slots) {
            Some(s) if g.chance(1, 2) => On::Slot(s),
            _ => On::Fresh,
        };
        // Slots hold bf16.
        let ty = match on {
            On::Fresh => g.reduce_ty(),
            On::Slot(_) => Ty::Bf16,
        };
        let op = match kind {
            Kind::AllReduce => Op::AllReduce {
                b,
                n: g.n(),
                ty,
                on,
            },
            Kind::AllReduceAsync => Op::AllReduceAsync {
                b,
                n: g.n(),
                ty,
                stream,
                on,
            },
            Kind::AddRmsNorm => Op::AddRmsNorm {
                b,
                hidden: [1, 3, 8, 64, 1000, 4096][g.below(6)],
                tokens: 1 + g.below(8),
                ty: g.reduce_ty(),
                stream,
            },
            Kind::AllGather => Op::AllGather { b, n: g.small() },
            Kind::ReduceScatter => Op::ReduceScatter {
                b,
                n: g.small(),
                ty: g.reduce_ty(),
            },
            Kind::Broadcast => Op::Broadcast {
                b,
                n: g.small(),
                ty: g.move_ty(),
                root: g.below(world),
            },
            Kind::AllToAll => Op::AllToAll {
                b,
                n: g.small(),
                ty: g.move_ty(),
            },
            Kind::AllToAllV => Op::AllToAllV {
                b,
                ty: g.move_ty(),
                counts: g.counts(world),
            },
            Kind::Barrier => Op::Barrier { b },
            Kind::Command => Op::Command {
                b,
                root: g.below(world),
            },
            Kind::SendRecv => Op::SendRecv {
                b,
                n: g.small(),
                stream,
                recv_stream: g.below(streams),
                shift: 1 + g.below(world - 1),
                recv_first: g.chance(1, 2),
            },
            Kind::SendOne => {
                let from = g.below(world);
                Op::SendOne {
                    b,
                    n: g.small(),
                    stream,
                    from,
                    to: (from + 1 + g.below(world - 1)) % world,
                }
            }
            Kind::Group => {
                let items = (0..2 + g.below(3))
                    .map(|_| {
                        let n = g.small();
                        let stream = g.below(streams);
                        match g.below(if world > 1 { 5 } else { 4 }) {
                            0 => Item::AllReduce {
                                n,
                                ty: g.reduce_ty(),
                            },
                            1 => Item::AllReduceAsync {
                                n,
                                ty: g.reduce_ty(),
                                stream,
                            },
                            2 => Item::AllGather { n },
                            3 => Item::ReduceScatter {
                                n,
                                ty: g.reduce_ty(),
                            },
                            _ => Item::SendRecv {
                                n,
                                stream,
                                recv_stream: g.below(streams),
                                shift: 1 + g.below(world - 1),
                                recv_first: g.chance(1, 2),
                            },
                        }
                    })
                    .collect();
                Op::Group { b, items }
            }
            Kind::Register | Kind::Deregister | Kind::Free if slots.is_empty() => {
                slots.push(uid);
                Op::Alloc {
                    n: g.n(),
                    sym: None,
                }
            }
            Kind::Alloc => {
                slots.push(uid);
                Op::Alloc {
                    n: g.n(),
                    sym: g.chance(1, 3).then_some(b),
                }
            }
            Kind::Register => {
                let slot = g.pick(&slots).unwrap_or(0);
                registered.push(slot);
                Op::Register { b, slot }
            }
            Kind::Deregister => Op::Deregister {
                slot: g.pick(&registered).or(g.pick(&slots)).unwrap_or(0),
            },
            Kind::Free => Op::Free {
                slot: g.pick(&slots).unwrap_or(0),
            },
            Kind::Replay if !graphs.is_empty() => Op::Replay {
                graph: g.pick(&graphs).unwrap_or(0),
                refill: g.chance(1, 2),
            },
            Kind::ReplayAll if graphs.len() > 1 => Op::ReplayAll {
                rounds: 1 + g.below(3),
            },
            Kind::Capture | Kind::Replay | Kind::ReplayAll => {
                graphs.push(uid);
                Op::Capture {
                    b,
                    n: g.n(),
                    stream,
                }
            }
            Kind::Synchronize => Op::Synchronize { b },
            Kind::SyncAll => Op::SyncAll,
            Kind::Bad => Op::Bad {
                b,
                bad: BADS[g.below(BADS.len())],
            },
        };
        steps.push(Step { uid, thread, op });
    }
    Program {
        seed,
        world,
        threads,
        backends,
        streams,
        steps,
    }
}
