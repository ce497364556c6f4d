//! The one-shot kernels themselves, without NCCL or the backend (through
//! [`crate::one_shot_local::LocalOneShot`]): `k` ranks (2, 3, 4, 5 and 8)
//! simulated on this rank's one device, each with its own receive buffer,
//! control block, pinned flags, data and stream, every control block
//! naming the others' buffers by address (the protocol is the same as
//! between GPUs; only the wires differ). One GPU can run what the
//! backend's set-up cannot (NCCL refuses two ranks on one device):
//! - every size of a 64 KiB slot with odd counts, three calls per size so
//!   both halves and the epochs turn over (the second on data that is not
//!   16-byte aligned), and the graph lane captured once and replayed with
//!   new data;
//! - calls of up to the backend's largest slot (1 MiB), where a thread of
//!   the host's grid has up to four 16-byte units, at 2, 3, 5 and 8 ranks
//!   (each of the kernel's ways of batching its loads from peers, with
//!   fewer peers than its bound and with all of them), aligned and not,
//!   and at 2 ranks replayed;
//! - with the bf16 kernel: a rank that never arrives (every other rank's
//!   kernel gives up on its own clock with the timeout status), the abort
//!   word (every kernel exits with the aborted status), a control block
//!   naming a slot over the kernel's bound (the bad-launch status, nothing
//!   written), and a second call on a lane while one runs there (it
//!   records the concurrent-use status and writes nothing, and the running
//!   call gives up with it);
//! - in every type, the values at the edges of its arithmetic:
//!   infinities, NaNs (whose sum is the GPU's canonical NaN), overflow and
//!   subnormals.
//!
//! Invariants: every element of every rank's output equals the host
//! reference (`kernels::one_shot_sum`) bit for bit, and the elements on
//! either side of it are not written; the inputs are random
//! and include the "not arrived" word (the pair (+0.0, -0.0), the f32
//! -0.0) that the kernel must read as zeros; every wait is bounded.

use std::time::Duration;

use anyhow::Context as _;

use half::{bf16, f16};
use metrale_comm::kernels::{self, OneShotElement, OneShotStatus};
use nccl_safe::{GraphExec, Module};

use crate::RankCtx;
use crate::data::SuiteElem;
use crate::one_shot_local::{LANE_EAGER, LANE_GRAPH, LocalOneShot};

/// Bytes of one slot: small, so that 8 ranks' buffers stay small.
const SLOT_BYTES: usize = 64 << 10;
/// Element counts, and a whole slot of any type.
const SIZES: &[usize] = &[1, 2, 3, 7, 8, 9, 255, 4097, 16_383];
/// The worlds simulated: 2, up to 4 and up to 8 ranks are the kernel's
/// three ways of batching its loads from peers.
const WORLDS: [usize; 5] = [2, 3, 4, 5, 8];
/// Element offsets of the eager calls of each size: the second call's data
/// is not 16-byte aligned.
const OFFSETS: [usize; 3] = [0, 3, 0];
/// Bytes of the large calls' slot: the backend's largest.
const LARGE_SLOT_BYTES: usize = 1 << 20;
/// 16-byte units in one pass of the host's largest grid.
const GRID_UNITS: usize = (kernels::ONE_SHOT_MAX_GRID * kernels::ONE_SHOT_BLOCK) as usize;
/// The kernel's statuses (the ABI's, `metrale_comm::kernels::OneShotStatus`).
const STATUS_TIMEOUT: u32 = OneShotStatus::Timeout as u32;
const STATUS_ABORTED: u32 = OneShotStatus::Aborted as u32;
const STATUS_CONCURRENT: u32 = OneShotStatus::Concurrent as u32;
const STATUS_BAD_LAUNCH: u32 = OneShotStatus::BadLaunch as u32;

/// See the module docs.
pub fn kernel_one_device(ctx: &RankCtx) -> anyhow::Result<()> {
    let c = ctx.context()?;
    let module = Module::load_ptx(
        &c,
        &crate::one_shot_local::ptx_or("METRALE_ONE_SHOT_PTX", kernels::ONE_SHOT_PTX)?,
    )?;
    kernel_of::<bf16>(ctx, &c, &module, true)?;
    kernel_of::<f16>(ctx, &c, &module, false)?;
    kernel_of::<f32>(ctx, &c, &module, false)
}

/// The scenario with `T`'s kernel: sizes, calls and replays, and when
/// `bounds`, the stuck rank, the abort and the second call on a held lane.
fn kernel_of<T: OneShotElement + SuiteElem>(
    ctx: &RankCtx,
    c: &std::sync::Arc<nccl_safe::Context>,
    module: &Module,
    bounds: bool,
) -> anyhow::Result<()> {
    let dtype = T::DATA_TYPE;
    let name = kernels::one_shot_name(dtype).context("a one-shot type")?;
    let f = module.function(name)?;
    let seed = 0x05e1_f00d ^ ctx.rank as u64;
    let whole = SLOT_BYTES / dtype.size();
    let sizes = SIZES.iter().copied().filter(|&n| n < whole).chain([whole]);
    large_calls::<T>(ctx, c, &f, seed)?;
    for k in WORLDS {
        let mut ranks = LocalOneShot::<T>::new(c, k, SLOT_BYTES, Duration::from_secs(20))?;
        ctx.step(format!("{k} ranks, {dtype}, edge values"));
        let inputs = ranks.load((0..k).map(edge_values::<T>).collect())?;
        ranks.launch_all(&f, EDGES.len(), LANE_EAGER)?;
        ranks.wait()?;
        ranks.check("edge values", &inputs)?;
        ctx.step(format!("{k} ranks, {dtype}, eager"));
        eager_calls(
            &mut ranks,
            &f,
            sizes.clone(),
            &OFFSETS,
            seed ^ ((k as u64) << 48),
        )?;
        ctx.step(format!("{k} ranks, {dtype}, captured and replayed"));
        for n in [1, 4097, whole] {
            let execs = (0..k)
                .map(|r| ranks.capture(&f, r, n, 1))
                .collect::<anyhow::Result<Vec<_>>>()?;
            for replay in 0..3u64 {
                let inputs = ranks.fill(seed ^ (replay << 32) ^ 0xa5, n)?;
                for (r, exec) in execs.iter().enumerate() {
                    exec.launch(ranks.stream(r))?;
                }
                ranks.wait()?;
                ranks.check(&format!("replay {replay} of {n} values"), &inputs)?;
            }
            // Eager calls between graphs use the other lane, untouched.
            let inputs = ranks.fill(seed ^ 0x5a, n)?;
            ranks.launch_all(&f, n, LANE_EAGER)?;
            ranks.wait()?;
            ranks.check(&format!("eager after replays, {n} values"), &inputs)?;
        }
        if 2 * k <= HW_QUEUES && crate::one_shot_local::under_sanitizer() {
            eprintln!(
                "{k} ranks, {dtype}: serial graphs replayed at once: skipped under \
                 compute-sanitizer, which does not run the graphs' kernels at once"
            );
            ctx.step(format!(
                "{k} ranks, {dtype}, serial graphs replayed at once: skipped under \
                 compute-sanitizer (it needs the graphs' kernels co-scheduled)"
            ));
        } else if 2 * k <= HW_QUEUES {
            ctx.step(format!(
                "{k} ranks, {dtype}, serial graphs replayed at once"
            ));
            serial_graphs_at_once(&mut ranks, &f, seed ^ 0x5e41)?;
        }
        drop(ranks);
        if !bounds {
            continue;
        }

        ctx.step(format!("{k} ranks, the last never arrives"));
        let ranks = LocalOneShot::<T>::new(c, k, SLOT_BYTES, Duration::from_millis(300))?;
        for r in 0..k - 1 {
            ranks.launch(&f, r, 4097, LANE_EAGER)?;
        }
        ranks.expect_status(STATUS_TIMEOUT, "the kernels' own 300 ms bound")?;
        drop(ranks);

        ctx.step(format!("{k} ranks, aborted while waiting"));
        let ranks = LocalOneShot::<T>::new(c, k, SLOT_BYTES, Duration::from_secs(30))?;
        for r in 0..k - 1 {
            ranks.launch(&f, r, 255, LANE_EAGER)?;
        }
        std::thread::sleep(Duration::from_millis(50));
        for r in 0..k {
            ranks.flags(r).store(0, 1);
        }
        ranks.expect_status(STATUS_ABORTED, "the abort word")?;
        drop(ranks);

        if k == 2 {
            ctx.step("a control block naming a slot over the kernel's bound");
            slot_over_the_bound(c, &f, seed)?;
        }

        // 255 values are one block, 4097 two: the second block finds the
        // lane claimed by its own launch and goes on.
        for lane in [LANE_EAGER, LANE_GRAPH] {
            for n in [255, 4097] {
                ctx.step(format!(
                    "{k} ranks, a second call on held lane {lane}, {n} values"
                ));
                second_call_on_a_held_lane(c, &f, k, lane, n, seed)?;
            }
        }
    }
    Ok(())
}

/// For every size of `sizes`, one eager call per offset of `offsets` (the
/// call's values that many elements from aligned), every rank checked;
/// the offset is 0 again after.
/// The hardware work queues a device gives its streams by default
/// (`CUDA_DEVICE_MAX_CONNECTIONS`, 8): streams beyond them share a queue.
/// [`serial_graphs_at_once`] puts `2 k` streams on one device, each
/// holding a graph that waits (on an event, or for its simulated peers);
/// where two of them share a queue, one that waits holds back the other,
/// whose kernels a peer's earlier graph needs: a deadlock of the
/// simulation (one GPU standing in for `k`), which on the H200 timed out
/// every rank at `k` = 5. It runs where every stream has its own queue.
const HW_QUEUES: usize = 8;

/// Two graphs per rank of calls ordered as the backend orders captured
/// one-shots (an external wait on the rank's serial event before a
/// graph's first call, a record after each: decision 0017), replayed at
/// once, one on the
/// rank's stream and one on its second stream, the last rank's first:
/// each launch's calls wait for those launched before on that rank, so no
/// call finds its lane held (no status) and every call sums the previous
/// one's result, bit for bit. (Without the brackets the second graph's
/// first call finds the lane held: `second_call_on_a_held_lane`.)
fn serial_graphs_at_once<T: OneShotElement + SuiteElem>(
    ranks: &mut LocalOneShot<T>,
    f: &nccl_safe::Function,
    seed: u64,
) -> anyhow::Result<()> {
    const CALLS: usize = 3;
    let k = ranks.ranks();
    for n in [1, 4097, ranks.max_elems()] {
        let first: Vec<GraphExec> = (0..k)
            .map(|r| ranks.capture_serial(f, r, n, CALLS))
            .collect::<anyhow::Result<_>>()?;
        let second: Vec<GraphExec> = (0..k)
            .map(|r| ranks.capture_serial(f, r, n, CALLS))
            .collect::<anyhow::Result<_>>()?;
        let inputs = ranks.fill(seed ^ n as u64, n)?;
        for r in (0..k).rev() {
            first[r].launch(ranks.stream(r))?;
            second[r].launch(ranks.second(r))?;
        }
        ranks.wait()?;
        // Every rank holds the same sum after each call: the input of the
        // next is that sum on every rank.
        let mut want = inputs;
        for _ in 1..2 * CALLS {
            let s = kernels::one_shot_sum(&want).map_err(anyhow::Error::msg)?;
            want = vec![s; k];
        }
        ranks.check(
            &format!(
                "{} serial calls of {n} values in two graphs replayed at once",
                2 * CALLS
            ),
            &want,
        )?;
    }
    Ok(())
}

fn eager_calls<T: OneShotElement + SuiteElem>(
    ranks: &mut LocalOneShot<T>,
    f: &nccl_safe::Function,
    sizes: impl IntoIterator<Item = usize>,
    offsets: &[usize],
    seed: u64,
) -> anyhow::Result<()> {
    for n in sizes {
        for (call, &offset) in offsets.iter().enumerate() {
            ranks.set_offset(offset)?;
            let inputs = ranks.fill(seed ^ ((call as u64) << 40) ^ ((n as u64) << 8), n)?;
            ranks.launch_all(f, n, LANE_EAGER)?;
            ranks.wait()?;
            ranks.check(
                &format!("eager call {call} of {n} values at offset {offset}"),
                &inputs,
            )?;
        }
    }
    ranks.set_offset(0)
}

/// Calls of `T` in a 1 MiB slot at 2, 3, 5 and 8 ranks: counts that give the
/// host grid's threads 2, 3 and 4 units (each with a partial last unit but
/// the whole slot), aligned and not, eager on both halves, and the whole
/// slot captured and replayed at 2 ranks.
fn large_calls<T: OneShotElement + SuiteElem>(
    ctx: &RankCtx,
    c: &std::sync::Arc<nccl_safe::Context>,
    f: &nccl_safe::Function,
    seed: u64,
) -> anyhow::Result<()> {
    let per = 16 / T::DATA_TYPE.size();
    let pass = GRID_UNITS * per;
    for k in [2, 3, 5, 8] {
        ctx.step(format!("{k} ranks, {}, calls of up to 1 MiB", T::DATA_TYPE));
        let mut ranks = LocalOneShot::<T>::new(c, k, LARGE_SLOT_BYTES, Duration::from_secs(20))?;
        let whole = ranks.max_elems();
        let sizes = [pass + 1, 2 * pass + per - 1, 3 * pass + 5, whole - 3, whole];
        eager_calls(&mut ranks, f, sizes, &[0, 1], seed ^ 0x1a7e)?;
        if k == 2 {
            let execs = (0..k)
                .map(|r| ranks.capture(f, r, whole, 2))
                .collect::<anyhow::Result<Vec<_>>>()?;
            for replay in 0..2u64 {
                let inputs = ranks.fill(seed ^ 0x9a7e ^ (replay << 32), whole)?;
                for (r, exec) in execs.iter().enumerate() {
                    exec.launch(ranks.stream(r))?;
                }
                ranks.wait()?;
                // Two calls per replay: the sum of the first call's sums.
                let first = kernels::one_shot_sum(&inputs).map_err(anyhow::Error::msg)?;
                ranks.check(
                    &format!("replay {replay} of two calls of {whole} values"),
                    &vec![first; k],
                )?;
            }
        }
    }
    Ok(())
}

/// Values at the edges of the arithmetic, as (rank 0's, rank 1's) in f32
/// (rounded to the type); ranks past 1 add +0.0.
const EDGES: [(f32, f32); 11] = [
    (f32::INFINITY, f32::NEG_INFINITY), // NaN
    (f32::from_bits(0x7FC0_0001), 1.0), // NaN with a payload
    (f32::from_bits(0xFFC1_0000), 2.0), // a negative NaN
    (f32::INFINITY, 1.0),               // +inf
    (f32::NEG_INFINITY, f32::NEG_INFINITY),
    (65504.0, 65504.0),                // f16: overflows to inf
    (1.0, 1.0 / 2048.0),               // f16: a tie, to even (1.0)
    (1.0, 1.0 / 256.0),                // bf16: a tie, to even (1.0)
    (6.103_515_6e-5, -5.960_464_5e-8), // f16: min normal - min subnormal
    (1e-40, 1e-40),                    // f32 and bf16 subnormals
    (-1.5, 1.5),                       // +0.0
];

/// Rank `r`'s input of the edge values in `T`.
fn edge_values<T: OneShotElement>(r: usize) -> Vec<T> {
    EDGES
        .iter()
        .map(|&(a, b)| {
            T::from_f32(match r {
                0 => a,
                1 => b,
                _ => 0.0,
            })
        })
        .collect()
}

/// Rank 0's control block names a slot 16 bytes over the kernel's bound
/// (`kernels::ONE_SHOT_MAX_SLOT_BYTES`): its call records the bad-launch
/// status and writes nothing; no other rank launches.
fn slot_over_the_bound(
    c: &std::sync::Arc<nccl_safe::Context>,
    f: &nccl_safe::Function,
    seed: u64,
) -> anyhow::Result<()> {
    let mut ranks = LocalOneShot::<bf16>::new(c, 2, SLOT_BYTES, Duration::from_secs(30))?;
    let inputs = ranks.fill(seed ^ 0x0b0b, 255)?;
    ranks.set_ctrl_slot(0, (kernels::ONE_SHOT_MAX_SLOT_BYTES + 16) as u64)?;
    ranks.launch(f, 0, 255, LANE_EAGER)?;
    anyhow::ensure!(ranks.wait().is_err(), "a slot over the bound set no status");
    let status = [ranks.flags(0).load(1), ranks.flags(1).load(1)];
    anyhow::ensure!(
        status == [STATUS_BAD_LAUNCH, 0],
        "statuses {status:?}, want [{STATUS_BAD_LAUNCH}, 0]"
    );
    let got = ranks.output(0)?;
    if let Some(i) = (0..255).find(|&i| got[i].to_bits() != inputs[0][i].to_bits()) {
        anyhow::bail!("element {i} was written under a refused launch");
    }
    Ok(())
}

/// Rank 0 of `k` starts a call on `lane` that waits (no peer launches),
/// then a second call on the same lane from another stream: the second
/// finds the lane claimed, records the concurrent-use status and touches
/// nothing; the first sees the status and gives up; no rank's data is
/// written.
fn second_call_on_a_held_lane(
    c: &std::sync::Arc<nccl_safe::Context>,
    f: &nccl_safe::Function,
    k: usize,
    lane: u32,
    n: usize,
    seed: u64,
) -> anyhow::Result<()> {
    let mut ranks = LocalOneShot::<bf16>::new(c, k, SLOT_BYTES, Duration::from_secs(30))?;
    let inputs = ranks.fill(seed ^ 0xc0c0 ^ u64::from(lane), n)?;
    ranks.launch(f, 0, n, lane)?;
    std::thread::sleep(Duration::from_millis(50));
    ranks.launch_side(f, 0, n, lane)?;
    let t = std::time::Instant::now();
    let waited = ranks.wait();
    let took = t.elapsed();
    anyhow::ensure!(
        waited.is_err(),
        "{k} ranks, lane {lane}, {n} values: a second call on a held lane set no status"
    );
    let status: Vec<u32> = (0..k).map(|r| ranks.flags(r).load(1)).collect();
    anyhow::ensure!(
        status[0] == STATUS_CONCURRENT && status[1..].iter().all(|&s| s == 0),
        "{k} ranks, lane {lane}, {n} values: statuses {status:?}, want [{STATUS_CONCURRENT}, 0, ...]"
    );
    anyhow::ensure!(
        took < Duration::from_secs(20),
        "{k} ranks, lane {lane}: the calls took {took:?} to end"
    );
    for (r, want) in inputs.iter().enumerate() {
        let got = ranks.output(r)?;
        if let Some(i) = (0..n).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            anyhow::bail!(
                "{k} ranks, lane {lane}: rank {r}'s element {i} was written ({:#06x}, was {:#06x})",
                got[i].to_bits(),
                want[i].to_bits()
            );
        }
    }
    Ok(())
}
