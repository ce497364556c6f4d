//! The one-shot kernel itself, without NCCL or the backend: `k` ranks (2, 4
//! and 8) simulated on this rank's one device, each with its own receive
//! buffer, control block, pinned flags, data and stream, every control
//! block naming the others' buffers by address (the protocol is the same
//! as between GPUs; only the wires differ). One GPU can run what the
//! backend's set-up cannot (NCCL refuses two ranks on one device): every
//! size of one slot with odd counts, three calls per size so both halves
//! and the epochs turn over, the graph lane captured once and replayed
//! with new data, a rank that never arrives (every other rank's kernel
//! gives up on its own clock with the timeout status) and the abort word
//! (every kernel exits with the aborted status).
//!
//! Invariants: every element of every rank's output equals the host
//! reference (`kernels::one_shot_sum`) bit for bit; the inputs are random
//! and include the "not arrived" pair (+0.0, -0.0) that the kernel must
//! read as zeros; every wait is bounded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use half::bf16;
use metrale_comm::kernels;
use nccl_safe::{Context, DeviceBuffer, Function, GraphExec, HostWords, Module, Stream};

use crate::RankCtx;
use crate::data::random_vec;

const WAIT: Duration = Duration::from_secs(60);
/// Bytes of one slot: small, so that 8 ranks' buffers stay small.
const SLOT_BYTES: usize = 64 << 10;
/// Element counts, up to a whole slot.
const SIZES: &[usize] = &[1, 2, 3, 7, 8, 9, 255, 4097, 16_383, SLOT_BYTES / 2];
const LANE_EAGER: u32 = 0;
const LANE_GRAPH: u32 = 1;
/// The kernel's statuses (`OS_STATUS_*` in `bf16_one_shot.cu`).
const STATUS_TIMEOUT: u32 = 1;
const STATUS_ABORTED: u32 = 2;

/// `k` simulated ranks on one device.
struct Ranks {
    k: usize,
    _recv: Vec<DeviceBuffer<u32>>,
    ctrl: Vec<DeviceBuffer<u64>>,
    flags: Vec<HostWords>,
    data: Vec<DeviceBuffer<bf16>>,
    streams: Vec<Stream>,
}

impl Ranks {
    fn new(c: &Arc<Context>, k: usize, timeout: Duration) -> anyhow::Result<Ranks> {
        let mut recv = Vec::with_capacity(k);
        for _ in 0..k {
            let mut b = DeviceBuffer::<u32>::alloc(c, kernels::one_shot_recv_words(k, SLOT_BYTES))?;
            nccl_safe::fill_words(&mut b, kernels::ONE_SHOT_SENTINEL)?;
            recv.push(b);
        }
        let addrs: Vec<u64> = recv.iter().map(DeviceBuffer::device_ptr).collect();
        let mut ctrl = Vec::with_capacity(k);
        let mut flags = Vec::with_capacity(k);
        let mut data = Vec::with_capacity(k);
        let mut streams = Vec::with_capacity(k);
        for r in 0..k {
            let f = HostWords::alloc(c, 2)?;
            let words = kernels::one_shot_ctrl(
                &addrs,
                f.device_ptr(),
                u64::try_from(timeout.as_nanos())?,
                r,
                SLOT_BYTES,
            )
            .context("control block")?;
            ctrl.push(DeviceBuffer::from_host(c, &words)?);
            flags.push(f);
            data.push(DeviceBuffer::<bf16>::alloc(c, SLOT_BYTES / 2)?);
            streams.push(Stream::new(c)?);
        }
        Ok(Ranks {
            k,
            _recv: recv,
            ctrl,
            flags,
            data,
            streams,
        })
    }

    /// Random inputs of `n` elements for every rank (one pair of them the
    /// "not arrived" word), copied into the data buffers.
    fn fill(&mut self, seed: u64, n: usize) -> anyhow::Result<Vec<Vec<bf16>>> {
        let mut inputs = Vec::with_capacity(self.k);
        for r in 0..self.k {
            let mut v: Vec<bf16> = random_vec(seed, r, n as u64, n);
            if n >= 4 && r % 2 == 1 {
                v[2] = bf16::from_bits(0x0000);
                v[3] = bf16::from_bits(0x8000);
            }
            self.data[r].copy_prefix_from_host(&v)?;
            inputs.push(v);
        }
        Ok(inputs)
    }

    /// Launches rank `r`'s kernel on its stream.
    fn launch(&self, f: &Function, r: usize, n: usize, lane: u32) -> anyhow::Result<()> {
        let (grid, block) = kernels::one_shot_launch_config(n as u64);
        let (mut ctrl, mut data, mut n, mut lane) = (
            self.ctrl[r].device_ptr(),
            self.data[r].device_ptr(),
            n as u64,
            lane,
        );
        let mut params = [
            (&mut ctrl as *mut u64).cast(),
            (&mut data as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
            (&mut lane as *mut u32).cast(),
        ];
        // SAFETY: the parameters match the kernel's (ctrl, data, n, lane);
        // `ctrl` is this rank's control block, naming live receive buffers
        // of this context; `data` holds at least `n` values; all stay
        // allocated until `self` is dropped, after every stream is idle.
        unsafe { f.launch(grid, block, 0, self.streams[r].raw(), &mut params) }?;
        Ok(())
    }

    /// Waits for every rank's stream; fails if any kernel set a status.
    fn wait(&self) -> anyhow::Result<()> {
        for s in &self.streams {
            s.wait_until_idle(WAIT)?;
        }
        for (r, f) in self.flags.iter().enumerate() {
            ensure!(
                f.load(1) == 0,
                "rank {r}: the kernel set status {}",
                f.load(1)
            );
        }
        Ok(())
    }

    /// Checks every rank's first `n` values against the reference.
    fn check(&self, what: &str, inputs: &[Vec<bf16>]) -> anyhow::Result<()> {
        let n = inputs[0].len();
        let want = kernels::one_shot_sum(inputs).map_err(anyhow::Error::msg)?;
        for r in 0..self.k {
            let got = self.data[r].to_host_vec()?;
            if let Some(i) = (0..n).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                bail!(
                    "{what}, {} ranks, rank {r}: element {i} of {n} is {} (bits {:#06x}), want {} ({:#06x})",
                    self.k,
                    got[i],
                    got[i].to_bits(),
                    want[i],
                    want[i].to_bits()
                );
            }
        }
        Ok(())
    }

    /// Waits for every stream, then checks that every rank but the last
    /// (which never launched) ended with `status`, within 20 s of `what`.
    fn expect_status(&self, status: u32, what: &str) -> anyhow::Result<()> {
        let t = Instant::now();
        for s in &self.streams {
            s.wait_until_idle(WAIT)?;
        }
        let took = t.elapsed();
        for r in 0..self.k - 1 {
            let st = self.flags[r].load(1);
            ensure!(
                st == status,
                "{} ranks, rank {r} after {what}: status {st}, want {status}",
                self.k
            );
        }
        ensure!(
            took < Duration::from_secs(20),
            "{what} took {took:?} to end the kernels"
        );
        Ok(())
    }

    /// Rank `r`'s kernel on lane 1, captured into a graph on its stream.
    fn capture(&self, f: &Function, r: usize, n: usize) -> anyhow::Result<GraphExec> {
        let s = &self.streams[r];
        s.begin_capture()?;
        let launched = self.launch(f, r, n, LANE_GRAPH);
        let graph = s.end_capture()?;
        launched?;
        Ok(graph.instantiate()?)
    }
}

/// See the module docs.
pub fn kernel_one_device(ctx: &RankCtx) -> anyhow::Result<()> {
    let c = ctx.context()?;
    let module = Module::load_ptx(&c, kernels::BF16_ONE_SHOT_PTX)?;
    let f = module.function(kernels::BF16_ONE_SHOT_NAME)?;
    let seed = 0x05e1_f00d ^ ctx.rank as u64;
    for k in [2, 4, 8] {
        let mut ranks = Ranks::new(&c, k, Duration::from_secs(20))?;
        ctx.step(format!("{k} ranks, eager"));
        for &n in SIZES {
            for call in 0..3u64 {
                let inputs = ranks.fill(seed ^ (call << 40) ^ ((k as u64) << 48), n)?;
                for r in 0..k {
                    ranks.launch(&f, r, n, LANE_EAGER)?;
                }
                ranks.wait()?;
                ranks.check(&format!("eager call {call} of {n} values"), &inputs)?;
            }
        }
        ctx.step(format!("{k} ranks, captured and replayed"));
        for n in [1, 4097, SLOT_BYTES / 2] {
            let execs = (0..k)
                .map(|r| ranks.capture(&f, r, n))
                .collect::<anyhow::Result<Vec<_>>>()?;
            for replay in 0..3u64 {
                let inputs = ranks.fill(seed ^ (replay << 32) ^ 0xa5, n)?;
                for (r, exec) in execs.iter().enumerate() {
                    exec.launch(&ranks.streams[r])?;
                }
                ranks.wait()?;
                ranks.check(&format!("replay {replay} of {n} values"), &inputs)?;
            }
            // Eager calls between graphs use the other lane, untouched.
            let inputs = ranks.fill(seed ^ 0x5a, n)?;
            for r in 0..k {
                ranks.launch(&f, r, n, LANE_EAGER)?;
            }
            ranks.wait()?;
            ranks.check(&format!("eager after replays, {n} values"), &inputs)?;
        }
        drop(ranks);

        ctx.step(format!("{k} ranks, the last never arrives"));
        let ranks = Ranks::new(&c, k, Duration::from_millis(300))?;
        for r in 0..k - 1 {
            ranks.launch(&f, r, 4097, LANE_EAGER)?;
        }
        ranks.expect_status(STATUS_TIMEOUT, "the kernels' own 300 ms bound")?;
        drop(ranks);

        ctx.step(format!("{k} ranks, aborted while waiting"));
        let ranks = Ranks::new(&c, k, Duration::from_secs(30))?;
        for r in 0..k - 1 {
            ranks.launch(&f, r, 255, LANE_EAGER)?;
        }
        std::thread::sleep(Duration::from_millis(50));
        for fl in &ranks.flags {
            fl.store(0, 1);
        }
        ranks.expect_status(STATUS_ABORTED, "the abort word")?;
    }
    Ok(())
}
