//! Normalization and the host reference: which steps of a program are
//! valid where they stand, and what every buffer of this rank holds first
//! and must hold at the next sync point.
//!
//! Invariants:
//! - [`prepare`] is deterministic and the same on every rank (it reads only
//!   the program), and idempotent: a normalized program normalizes to
//!   itself, also after the shrinker removed steps from it.
//! - A normalized program never races with itself: a slot is reduced again
//!   only on the stream that last used it or after a point where everything
//!   was synchronized, and is deregistered or freed only after such a
//!   point; operands exist and indices are in range. Graphs replay on the
//!   streams they were captured on, several at once.
//! - Inputs are small integers (`data::small_ints`, shifted to be positive
//!   for u32); a slot or graph buffer is reduced again in place only while
//!   every sum stays exactly representable in bf16 in any order of
//!   addition, so every expected value is exact and checked bit for bit.

use std::collections::HashMap;

use half::bf16;

use super::program::{Item, On, Op, Program, Step, Ty};
use crate::data::small_ints;

/// A buffer a step allocates: its type, length, what this rank writes into
/// it first (`None`: the poison pattern) and what it must hold at the next
/// sync point (`None`: nothing checked).
pub(super) struct BufPlan {
    pub ty: Ty,
    pub len: usize,
    pub init: Option<Vec<i32>>,
    pub want: Option<Vec<i32>>,
    /// What the buffer holds after the step when it is not whole numbers
    /// (the add + norm's output), compared instead of `want`.
    pub want_f64: Option<Vec<f64>>,
    pub role: &'static str,
}

/// What one step does on this rank.
#[derive(Default)]
pub(super) struct StepPlan {
    pub bufs: Vec<BufPlan>,
    /// A replay's fresh data.
    pub refill: Option<Vec<i32>>,
    /// A `ReplayAll`'s fresh data: (graph, round, this rank's values).
    pub refills: Vec<(u32, usize, Vec<i32>)>,
    /// At a sync point: what each slot and graph buffer holds.
    pub slots: Vec<(u32, Vec<i32>)>,
    pub graphs: Vec<(u32, Vec<i32>)>,
}

/// What every step does on this rank, and what the buffers hold at the end.
pub(super) struct Plan {
    pub steps: Vec<StepPlan>,
    pub end: StepPlan,
}

/// Which stream last used a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    Own(usize),
    Stream(usize),
}

struct SlotModel {
    n: usize,
    reg: bool,
    last: Option<Key>,
    /// Every rank's values.
    vals: Vec<Vec<i32>>,
}

struct GraphModel {
    vals: Vec<Vec<i32>>,
}

/// `rank`'s `n` values of step `uid`, role `role`, as type `ty` holds them
/// (positive for u32, so that no value is the poison pattern's).
fn rank_inputs(p: &Program, rank: usize, uid: u32, role: u64, n: usize, ty: Ty) -> Vec<i32> {
    let v = small_ints(p.seed, rank, (uid as u64) << 8 | role, n);
    match ty {
        Ty::U32 => v.into_iter().map(|x| x + 9).collect(),
        _ => v,
    }
}

/// Every rank's data of step `uid`, role `role`.
fn inputs(p: &Program, uid: u32, role: u64, n: usize, ty: Ty) -> Vec<Vec<i32>> {
    (0..p.world)
        .map(|r| rank_inputs(p, r, uid, role, n, ty))
        .collect()
}

fn sum(vals: &[Vec<i32>]) -> Vec<i32> {
    let mut s = vals[0].clone();
    for v in &vals[1..] {
        for (a, b) in s.iter_mut().zip(v) {
            *a += b;
        }
    }
    s
}

fn exact_bf16(v: i64) -> bool {
    let f = v as f32;
    v.abs() <= 1 << 24 && bf16::from_f32(f).to_f32() == f
}

/// Whether the sum of `vals` is exact in bf16 in every order of addition:
/// all partial sums are small, or every rank holds the same value `s` and
/// every `k * s` is exact.
pub(super) fn exact_sum(vals: &[Vec<i32>]) -> bool {
    let w = vals.len();
    (0..vals[0].len()).all(|i| {
        let abs: i64 = vals.iter().map(|v| (v[i] as i64).abs()).sum();
        if abs <= 256 {
            return true;
        }
        let s = vals[0][i] as i64;
        vals.iter().all(|v| v[i] as i64 == s) && (1..=w as i64).all(|k| exact_bf16(k * s))
    })
}

fn fresh(ty: Ty, mine: Vec<i32>, want: Vec<i32>, role: &'static str) -> BufPlan {
    BufPlan {
        ty,
        len: mine.len(),
        init: Some(mine),
        want: Some(want),
        want_f64: None,
        role,
    }
}

fn poisoned(ty: Ty, want: Vec<i32>, role: &'static str) -> BufPlan {
    BufPlan {
        ty,
        len: want.len(),
        init: None,
        want: Some(want),
        want_f64: None,
        role,
    }
}

/// The buffer of a fresh all-reduce.
fn plan_reduce(p: &Program, rank: usize, uid: u32, role: u64, n: usize, ty: Ty) -> BufPlan {
    let v = inputs(p, uid, role, n, ty);
    let s = sum(&v);
    fresh(ty, v[rank].clone(), s, "buffer")
}

/// The epsilon of the fuzzed add + norm steps.
pub(super) const NORM_EPS: f32 = 1e-5;

/// x (every rank's small integers, whose sum is exact on every path), the
/// residual (the same on every rank) and the weight; the outputs from
/// `metrale_comm::norm::add_rms_norm_reference` in the type.
fn plan_norm(
    p: &Program,
    rank: usize,
    uid: u32,
    (hidden, tokens): (usize, usize),
    ty: Ty,
) -> [BufPlan; 3] {
    let n = hidden * tokens;
    let v = inputs(p, uid, 0, n, ty);
    let s = sum(&v);
    let res = rank_inputs(p, 0, uid, 1, n, ty);
    let w: Vec<i32> = rank_inputs(p, 0, uid, 2, hidden, ty)
        .into_iter()
        .map(|x| if x == 0 { 1 } else { x })
        .collect();
    let (x_want, r_want) = match ty {
        Ty::F16 => norm_in::<half::f16>(&s, &res, &w),
        Ty::F32 => norm_in::<f32>(&s, &res, &w),
        _ => norm_in::<bf16>(&s, &res, &w),
    };
    let with = |mine: Vec<i32>, want: Vec<f64>, role| BufPlan {
        ty,
        len: mine.len(),
        init: Some(mine),
        want: None,
        want_f64: Some(want),
        role,
    };
    [
        with(v[rank].clone(), x_want, "x"),
        with(res, r_want, "residual"),
        fresh(ty, w.clone(), w, "weight"),
    ]
}

fn norm_in<T: metrale_comm::kernels::OneShotElement>(
    s: &[i32],
    res: &[i32],
    w: &[i32],
) -> (Vec<f64>, Vec<f64>) {
    let t = |v: &[i32]| -> Vec<T> { v.iter().map(|&x| T::from_f32(x as f32)).collect() };
    let mut r = t(res);
    let x = metrale_comm::norm::add_rms_norm_reference(&t(s), &mut r, &t(w), NORM_EPS);
    let f = |v: Vec<T>| v.into_iter().map(|x| f64::from(x.to_f32())).collect();
    (f(x), f(r))
}

fn plan_gather(p: &Program, rank: usize, uid: u32, role: u64, n: usize) -> [BufPlan; 2] {
    let v = inputs(p, uid, role, n, Ty::Bf16);
    [
        fresh(Ty::Bf16, v[rank].clone(), v[rank].clone(), "send buffer"),
        poisoned(Ty::Bf16, v.concat(), "receive buffer"),
    ]
}

fn plan_scatter(p: &Program, rank: usize, uid: u32, role: u64, n: usize, ty: Ty) -> [BufPlan; 2] {
    let v = inputs(p, uid, role, n * p.world, ty);
    let s = sum(&v);
    [
        fresh(ty, v[rank].clone(), v[rank].clone(), "send buffer"),
        poisoned(ty, s[rank * n..(rank + 1) * n].to_vec(), "receive buffer"),
    ]
}

fn plan_shift(
    p: &Program,
    rank: usize,
    uid: u32,
    role: u64,
    n: usize,
    shift: usize,
) -> [BufPlan; 2] {
    let v = inputs(p, uid, role, n, Ty::Bf16);
    let from = (rank + p.world - shift) % p.world;
    [
        fresh(Ty::Bf16, v[rank].clone(), v[rank].clone(), "send buffer"),
        poisoned(Ty::Bf16, v[from].clone(), "receive buffer"),
    ]
}

/// Block `j` of rank `i`'s send buffer goes to rank `j`: this rank receives
/// block `rank` of every rank's, in rank order.
fn plan_all_to_all(p: &Program, rank: usize, uid: u32, n: usize, ty: Ty) -> [BufPlan; 2] {
    let v = inputs(p, uid, 0, n * p.world, ty);
    let want = v
        .iter()
        .flat_map(|x| x[rank * n..(rank + 1) * n].to_vec())
        .collect();
    [
        fresh(ty, v[rank].clone(), v[rank].clone(), "send buffer"),
        poisoned(ty, want, "receive buffer"),
    ]
}

/// Rank `i` sends `counts[i][j]` elements to rank `j` from its `j`-th
/// block (blocks packed in rank order); this rank receives `counts[i][rank]`
/// from each rank `i`, packed in rank order.
fn plan_all_to_all_v(
    p: &Program,
    rank: usize,
    uid: u32,
    ty: Ty,
    counts: &[Vec<usize>],
) -> [BufPlan; 2] {
    let sent: Vec<Vec<i32>> = counts
        .iter()
        .enumerate()
        .map(|(i, row)| rank_inputs(p, i, uid, 0, row.iter().sum(), ty))
        .collect();
    let mut want = Vec::new();
    for (i, row) in counts.iter().enumerate() {
        let off: usize = row[..rank].iter().sum();
        want.extend_from_slice(&sent[i][off..off + row[rank]]);
    }
    let mine = sent[rank].clone();
    [
        fresh(ty, mine.clone(), mine, "send buffer"),
        poisoned(ty, want, "receive buffer"),
    ]
}

/// Normalizes `prog` (every step valid: operands exist and are ordered,
/// releases come after a sync point, every in-place sum is exact) and
/// plans this rank's data. Deterministic and the same on every rank.
pub(super) fn prepare(prog: &Program, rank: usize) -> (Program, Plan) {
    let w = prog.world;
    let mut out = Program {
        steps: Vec::with_capacity(prog.steps.len()),
        ..prog.clone()
    };
    let mut plans = Vec::with_capacity(prog.steps.len());
    let mut slots: HashMap<u32, SlotModel> = HashMap::new();
    let mut graphs: HashMap<u32, GraphModel> = HashMap::new();
    let nb = prog.backends.len();
    let ns = prog.streams;
    for step in &prog.steps {
        let uid = step.uid;
        let mut op = step.op.clone();
        let mut plan = StepPlan::default();
        let keep = match &mut op {
            Op::AllReduce { b, n, ty, on } | Op::AllReduceAsync { b, n, ty, on, .. } => 'reduce: {
                let key = match step.op {
                    Op::AllReduceAsync { stream, .. } => Key::Stream(stream),
                    _ => Key::Own(*b),
                };
                if *b >= nb || matches!(key, Key::Stream(s) if s >= ns) {
                    break 'reduce false;
                }
                if let On::Slot(s) = *on {
                    match slots.get_mut(&s) {
                        Some(m) if m.last.is_none_or(|k| k == key) && exact_sum(&m.vals) => {
                            let s = sum(&m.vals);
                            m.vals = vec![s; w];
                            m.last = Some(key);
                            *n = m.n;
                            *ty = Ty::Bf16;
                        }
                        _ => *on = On::Fresh,
                    }
                }
                if *on == On::Fresh {
                    if *ty == Ty::U32 {
                        *ty = Ty::Bf16;
                    }
                    plan.bufs.push(plan_reduce(prog, rank, uid, 0, *n, *ty));
                }
                true
            }
            Op::AddRmsNorm {
                b,
                hidden,
                tokens,
                ty,
                stream,
            } => {
                if *ty == Ty::U32 {
                    *ty = Ty::Bf16;
                }
                plan.bufs
                    .extend(plan_norm(prog, rank, uid, (*hidden, *tokens), *ty));
                *b < nb && *stream < ns
            }
            Op::AllGather { b, n } => {
                plan.bufs.extend(plan_gather(prog, rank, uid, 0, *n));
                *b < nb
            }
            Op::ReduceScatter { b, n, ty } => {
                plan.bufs.extend(plan_scatter(prog, rank, uid, 0, *n, *ty));
                *b < nb && *ty != Ty::U32
            }
            Op::Broadcast { b, n, ty, root } => {
                let v = inputs(prog, uid, 0, *n, *ty);
                let want = v[(*root).min(w - 1)].clone();
                plan.bufs.push(if rank == *root {
                    fresh(*ty, want.clone(), want, "buffer")
                } else {
                    poisoned(*ty, want, "buffer")
                });
                *b < nb && *root < w
            }
            Op::AllToAll { b, n, ty } => {
                plan.bufs.extend(plan_all_to_all(prog, rank, uid, *n, *ty));
                *b < nb
            }
            Op::AllToAllV { b, ty, counts } => {
                let square = counts.len() == w && counts.iter().all(|r| r.len() == w);
                if square {
                    plan.bufs
                        .extend(plan_all_to_all_v(prog, rank, uid, *ty, counts));
                }
                *b < nb && square
            }
            Op::Barrier { b } | Op::Synchronize { b } => {
                if *b < nb && matches!(step.op, Op::Synchronize { .. }) {
                    for m in slots.values_mut() {
                        if m.last == Some(Key::Own(*b)) {
                            m.last = None;
                        }
                    }
                }
                *b < nb
            }
            Op::Command { b, root } => {
                let value =
                    ((prog.seed ^ (uid as u64).wrapping_mul(0x9E37)) as i32 & 0x7fff_ffff) | 1;
                plan.bufs.push(if rank == *root {
                    fresh(Ty::U32, vec![value], vec![value], "command")
                } else {
                    poisoned(Ty::U32, vec![value], "command")
                });
                *b < nb && *root < w && w > 1
            }
            Op::SendRecv {
                b,
                n,
                stream,
                recv_stream,
                shift,
                ..
            } => {
                let ok =
                    *b < nb && *stream < ns && *recv_stream < ns && w > 1 && (1..w).contains(shift);
                if ok {
                    plan.bufs.extend(plan_shift(prog, rank, uid, 0, *n, *shift));
                }
                ok
            }
            Op::SendOne {
                b,
                n,
                stream,
                from,
                to,
            } => {
                let ok = *b < nb && *stream < ns && *from < w && *to < w && from != to;
                let v = inputs(prog, uid, 0, *n, Ty::Bf16);
                if ok && rank == *from {
                    let mine = v[rank].clone();
                    plan.bufs
                        .push(fresh(Ty::Bf16, mine.clone(), mine, "send buffer"));
                } else if ok && rank == *to {
                    plan.bufs
                        .push(poisoned(Ty::Bf16, v[*from].clone(), "receive buffer"));
                }
                ok
            }
            Op::Group { b, items } => {
                items.retain(|it| match it {
                    Item::AllReduceAsync { stream, ty, .. } => *stream < ns && *ty != Ty::U32,
                    Item::AllReduce { ty, .. } | Item::ReduceScatter { ty, .. } => *ty != Ty::U32,
                    Item::SendRecv {
                        stream,
                        recv_stream,
                        shift,
                        ..
                    } => *stream < ns && *recv_stream < ns && w > 1 && (1..w).contains(shift),
                    Item::AllGather { .. } => true,
                });
                for (k, it) in items.iter().enumerate() {
                    let role = k as u64;
                    match it {
                        Item::AllReduce { n, ty } | Item::AllReduceAsync { n, ty, .. } => {
                            plan.bufs.push(plan_reduce(prog, rank, uid, role, *n, *ty))
                        }
                        Item::AllGather { n } => {
                            plan.bufs.extend(plan_gather(prog, rank, uid, role, *n))
                        }
                        Item::ReduceScatter { n, ty } => plan
                            .bufs
                            .extend(plan_scatter(prog, rank, uid, role, *n, *ty)),
                        Item::SendRecv { n, shift, .. } => plan
                            .bufs
                            .extend(plan_shift(prog, rank, uid, role, *n, *shift)),
                    }
                }
                *b < nb && !items.is_empty()
            }
            Op::Alloc { n, sym } => 'alloc: {
                if sym.is_some_and(|b| b >= nb) {
                    break 'alloc false;
                }
                let vals = inputs(prog, uid, 0, *n, Ty::Bf16);
                plan.bufs.push(BufPlan {
                    ty: Ty::Bf16,
                    len: *n,
                    init: Some(vals[rank].clone()),
                    want: None,
                    want_f64: None,
                    role: "slot",
                });
                slots.insert(
                    uid,
                    SlotModel {
                        n: *n,
                        reg: false,
                        last: None,
                        vals,
                    },
                );
                true
            }
            Op::Register { b, slot } => match slots.get_mut(slot) {
                Some(m) if !m.reg && *b < nb => {
                    m.reg = true;
                    true
                }
                _ => false,
            },
            Op::Deregister { slot } => match slots.get_mut(slot) {
                Some(m) if m.reg && m.last.is_none() => {
                    m.reg = false;
                    true
                }
                _ => false,
            },
            Op::Free { slot } => match slots.get(slot) {
                Some(m) if !m.reg && m.last.is_none() => {
                    slots.remove(slot);
                    true
                }
                _ => false,
            },
            Op::Capture { b, n, stream } => 'capture: {
                if *b >= nb || *stream >= ns {
                    break 'capture false;
                }
                let vals = inputs(prog, uid, 0, *n, Ty::Bf16);
                plan.bufs.push(BufPlan {
                    ty: Ty::Bf16,
                    len: *n,
                    init: Some(vals[rank].clone()),
                    want: None,
                    want_f64: None,
                    role: "graph buffer",
                });
                graphs.insert(uid, GraphModel { vals });
                true
            }
            Op::Replay { graph, refill } => match graphs.get_mut(graph) {
                // Graphs replay on their capture streams, so graphs
                // captured on several streams run at once, one-shots
                // inside included (the backend orders those by launch).
                Some(g) => {
                    if !*refill && !exact_sum(&g.vals) {
                        *refill = true;
                    }
                    if *refill {
                        g.vals = inputs(prog, uid, 0, g.vals[0].len(), Ty::Bf16);
                        plan.refill = Some(g.vals[rank].clone());
                    }
                    g.vals = vec![sum(&g.vals); w];
                    true
                }
                None => false,
            },
            Op::ReplayAll { rounds } => {
                let mut ids: Vec<u32> = graphs.keys().copied().collect();
                ids.sort_unstable();
                for round in 0..*rounds {
                    for id in &ids {
                        let g = graphs.get_mut(id).expect("a listed graph");
                        if !exact_sum(&g.vals) {
                            let salt = uid << 4 | round as u32;
                            g.vals = inputs(prog, salt, u64::from(*id), g.vals[0].len(), Ty::Bf16);
                            plan.refills.push((*id, round, g.vals[rank].clone()));
                        }
                        g.vals = vec![sum(&g.vals); w];
                    }
                }
                !ids.is_empty()
            }
            Op::SyncAll => {
                for m in slots.values_mut() {
                    m.last = None;
                }
                snapshot(&slots, &graphs, rank, &mut plan);
                true
            }
            Op::Bad { b, .. } => *b < nb,
        };
        if keep {
            out.steps.push(Step {
                uid,
                thread: step.thread.min(prog.threads - 1),
                op,
            });
            plans.push(plan);
        }
    }
    let mut end = StepPlan::default();
    snapshot(&slots, &graphs, rank, &mut end);
    (out, Plan { steps: plans, end })
}

fn snapshot(
    slots: &HashMap<u32, SlotModel>,
    graphs: &HashMap<u32, GraphModel>,
    rank: usize,
    plan: &mut StepPlan,
) {
    let mut s: Vec<_> = slots
        .iter()
        .map(|(k, m)| (*k, m.vals[rank].clone()))
        .collect();
    s.sort_by_key(|x| x.0);
    let mut g: Vec<_> = graphs
        .iter()
        .map(|(k, m)| (*k, m.vals[rank].clone()))
        .collect();
    g.sort_by_key(|x| x.0);
    plan.slots = s;
    plan.graphs = g;
}

/// `None` when `got` equals `want` element for element, else what is
/// wrong (how many elements, how many still hold the poison pattern, the
/// first).
/// [`compare`] against values that need not be whole.
pub(super) fn compare_f64(what: &str, got: &[f64], want: &[f64]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!(
            "{what}: {} elements read, {} expected",
            got.len(),
            want.len()
        ));
    }
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    let &i = bad.first()?;
    Some(format!(
        "{what}: {} of {} elements wrong; first at {i}: got {}, expected {}",
        bad.len(),
        got.len(),
        got[i],
        want[i]
    ))
}

pub(super) fn compare(what: &str, got: &[f64], want: &[i32]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!(
            "{what}: {} elements read, {} expected",
            got.len(),
            want.len()
        ));
    }
    let mut bad = 0usize;
    let mut poisoned = 0usize;
    let mut first = None;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if *g != *w as f64 {
            bad += 1;
            if g.is_nan() || *g == u32::MAX as f64 {
                poisoned += 1;
            }
            first.get_or_insert((i, *g, *w));
        }
    }
    let (i, g, w) = first?;
    Some(format!(
        "{what}: {bad} of {} elements wrong ({poisoned} still poisoned); first at {i}: got {g}, \
         expected {w}",
        got.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::super::generate::generate;
    use super::*;

    #[test]
    fn programs_are_deterministic_and_normalize_to_themselves() {
        for seed in 0..50u64 {
            for world in [1, 2, 3] {
                let p = generate(seed, world);
                assert_eq!(p, generate(seed, world));
                let (a, _) = prepare(&p, 0);
                let (b, _) = prepare(&a, world - 1);
                assert_eq!(a, b, "seed {seed} world {world}");
                assert!(!a.steps.is_empty() || p.steps.is_empty());
            }
        }
    }

    #[test]
    fn in_place_sums_stay_exact() {
        let same = vec![vec![96, 96, 96]; 3];
        assert!(exact_sum(&same));
        let big = vec![vec![200], vec![57], vec![1]];
        assert!(!exact_sum(&big));
        assert!(exact_sum(&[vec![8; 4], vec![-8; 4]]));
        assert!(!exact_sum(&[vec![257 * 3], vec![257 * 3]]));
    }

    #[test]
    fn all_to_all_v_references_agree_across_ranks() {
        let p = Program {
            seed: 9,
            world: 3,
            threads: 1,
            backends: Vec::new(),
            streams: 1,
            steps: Vec::new(),
        };
        let counts = vec![vec![0, 2, 1], vec![3, 0, 1], vec![1, 1, 0]];
        let plans: Vec<_> = (0..3)
            .map(|r| plan_all_to_all_v(&p, r, 5, Ty::F32, &counts))
            .collect();
        for (r, [_, recv]) in plans.iter().enumerate() {
            let want = recv.want.as_ref().unwrap();
            let mut k = 0;
            for (i, [send, _]) in plans.iter().enumerate() {
                let off: usize = counts[i][..r].iter().sum();
                let sent = send.init.as_ref().unwrap();
                assert_eq!(&want[k..k + counts[i][r]], &sent[off..off + counts[i][r]]);
                k += counts[i][r];
            }
            assert_eq!(k, want.len());
        }
    }

    #[test]
    fn u32_data_is_positive() {
        let p = Program {
            seed: 1,
            world: 2,
            threads: 1,
            backends: Vec::new(),
            streams: 1,
            steps: Vec::new(),
        };
        assert!(
            rank_inputs(&p, 1, 2, 0, 1000, Ty::U32)
                .iter()
                .all(|&x| x > 0)
        );
    }
}
