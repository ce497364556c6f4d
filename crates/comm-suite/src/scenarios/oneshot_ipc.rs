//! The bf16 one-shot kernel between rank processes that share one device, each
//! rank's receive buffer mapped into the others with CUDA IPC (nccl-safe's
//! `ipc_handle` and `IpcMapping`), without NCCL: what the backend's set-up
//! does in processes and torchrun modes (export, exchange, map, push
//! through the mapping, close before the exporter frees), on one GPU,
//! where the backend itself cannot run (NCCL refuses two ranks on one
//! device). Every size of one slot with odd counts, three calls per size
//! (both halves, the epochs turning over), the graph lane captured once
//! and replayed with new inputs, then the release order: this rank's
//! stream idle, its mappings closed, a barrier, and only then the free.
//! The driver's answer to opening a handle in the process that made it
//! (the backend's set-up counts on a refusal there) is printed.
//!
//! Invariants: every element of every rank's output equals the host
//! reference (`data::one_shot_reference`) bit for bit, the rest of its
//! poisoned buffer is untouched, and every rank's output is bit-identical
//! to the others'; on the emulator the run ends
//! with no IPC mapping open and no free of mapped memory, in every rank's
//! process; every wait is bounded.

use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use half::bf16;
use metrale_comm::kernels;
use nccl_safe::{
    Context, DeviceBuffer, Function, HostWords, IpcHandle, IpcMapping, Module, Stream, fill_words,
    ipc_handle,
};

use crate::RankCtx;
use crate::data::{POISON_BYTE, check, hash, one_shot_reference, random_vec};
use crate::one_shot_local::{LANE_EAGER, LANE_GRAPH};

/// Bytes of one slot.
const SLOT_BYTES: usize = 64 << 10;
/// Element counts, up to a whole slot.
const SIZES: &[usize] = &[1, 2, 3, 7, 9, 255, 4097, 16_383, SLOT_BYTES / 2];
/// How long a kernel waits for its peers: the rank processes are not in
/// step, so a peer may start seconds late on a loaded machine.
const KERNEL_BOUND: Duration = Duration::from_secs(20);
const WAIT: Duration = Duration::from_secs(60);

/// Rank `k`'s input of `n` values for call `salt`: random, with the "not
/// arrived" pair (+0.0, -0.0) on odd ranks.
fn input(seed: u64, k: usize, salt: u64, n: usize) -> Vec<bf16> {
    let mut v: Vec<bf16> = random_vec(seed, k, salt, n);
    if n >= 4 && k % 2 == 1 {
        v[2] = bf16::from_bits(0x0000);
        v[3] = bf16::from_bits(0x8000);
    }
    v
}

/// This rank's part: its buffers, the peers' mappings and its stream.
struct Rank {
    f: Function,
    stream: Stream,
    data: DeviceBuffer<bf16>,
    ctrl: DeviceBuffer<u64>,
    flags: HostWords,
    maps: Vec<IpcMapping>,
    _recv: DeviceBuffer<u32>,
}

impl Rank {
    /// Launches the kernel on this rank's `n` values on `lane`.
    fn launch(&self, n: usize, lane: u32) -> anyhow::Result<()> {
        ensure!(
            (1..=SLOT_BYTES / 2).contains(&n) && lane < 2,
            "{n} values, lane {lane}"
        );
        // SAFETY: `f` is the bf16 one-shot entry point of this context; `ctrl`
        // is this rank's control block, laid out by `one_shot_ctrl`, naming
        // this rank's receive buffer and the peers' buffers mapped here;
        // `data` holds a slot of values; all stay allocated (and mapped)
        // until the stream is idle (`release`).
        unsafe {
            kernels::launch_one_shot(
                &self.f,
                self.ctrl.device_ptr(),
                self.data.device_ptr(),
                (n, nccl_safe::DataType::Bfloat16),
                lane,
                self.stream.raw(),
            )
        }?;
        Ok(())
    }

    /// Waits for the stream; fails if the kernel set a status.
    fn wait(&self) -> anyhow::Result<()> {
        self.stream.wait_until_idle(WAIT)?;
        let status = self.flags.load(1);
        ensure!(status == 0, "the kernel set status {status}");
        Ok(())
    }
}

/// Poisons this rank's whole data buffer, then writes its input of call
/// `salt` over the first `n` values.
fn fill(ctx: &RankCtx, me: &mut Rank, seed: u64, salt: u64, n: usize) -> anyhow::Result<()> {
    me.data.fill_bytes(POISON_BYTE)?;
    me.data
        .copy_prefix_from_host(&input(seed, ctx.rank, salt, n))?;
    Ok(())
}

/// Checks this rank's output of call `salt` (the values past `n` still
/// poisoned) and its bit-identity with the other ranks'.
fn check_call(ctx: &RankCtx, me: &Rank, seed: u64, salt: u64, n: usize) -> anyhow::Result<()> {
    let all = me.data.to_host_vec()?;
    let poison = u16::from_ne_bytes([POISON_BYTE; 2]);
    if let Some(i) = (n..all.len()).find(|&i| all[i].to_bits() != poison) {
        bail!("call {salt:#x} of {n} values wrote element {i}, past its end");
    }
    let got = &all[..n];
    let want = one_shot_reference(ctx.world_size, |k| input(seed, k, salt, n));
    let what = format!("call {salt:#x} of {n} values");
    check(&what, got, &want, true, ctx.world_size)?;
    ctx.all_equal(&format!("oneshot-ipc/{salt:#x}"), hash(got))
}

/// See the module docs.
pub fn ipc_one_device(ctx: &RankCtx) -> anyhow::Result<()> {
    if ctx.mode == crate::Mode::Threads {
        return Err(RankCtx::skip(
            "needs one process per rank (the driver opens no IPC handle in the process that made it)",
        ));
    }
    let w = ctx.world_size;
    let c = Context::new(0).context("context of device 0")?;
    let seed = ctx.shared_seed("oneshot-ipc")?;
    let module = Module::load_ptx(&c, kernels::ONE_SHOT_PTX)?;
    let f = module.function(kernels::BF16_ONE_SHOT_NAME)?;

    ctx.step("export, exchange and map the receive buffers");
    let mut recv = DeviceBuffer::<u32>::alloc(&c, kernels::one_shot_recv_words(w, SLOT_BYTES))?;
    fill_words(&mut recv, kernels::ONE_SHOT_SENTINEL)?;
    let handle = ipc_handle(&recv)?;
    ctx.set(&format!("oneshot-ipc/handle/{}", ctx.rank), &handle.0)?;
    match IpcMapping::open(&c, &handle) {
        Ok(m) => eprintln!(
            "oneshot_ipc_one_device: rank {}: the driver opened a handle of its own \
             process (at {:#x}; the exporter's address is {:#x})",
            ctx.rank,
            m.device_ptr(),
            recv.device_ptr()
        ),
        Err(e) => eprintln!(
            "oneshot_ipc_one_device: rank {}: the driver refuses a handle of its own process: {e}",
            ctx.rank
        ),
    }
    let mut maps = Vec::with_capacity(w - 1);
    let mut addrs = Vec::with_capacity(w);
    for r in 0..w {
        if r == ctx.rank {
            addrs.push(recv.device_ptr());
            continue;
        }
        let b = ctx.get(&format!("oneshot-ipc/handle/{r}"))?;
        let h: [u8; 64] = b
            .get(..64)
            .and_then(|s| s.try_into().ok())
            .context("a 64-byte handle")?;
        let m = IpcMapping::open(&c, &IpcHandle(h))
            .with_context(|| format!("opening rank {r}'s IPC handle"))?;
        addrs.push(m.device_ptr());
        maps.push(m);
    }
    let flags = HostWords::alloc(&c, 2)?;
    let words = kernels::one_shot_ctrl(
        &addrs,
        flags.device_ptr(),
        u64::try_from(KERNEL_BOUND.as_nanos())?,
        ctx.rank,
        SLOT_BYTES,
    )
    .context("control block")?;
    let mut me = Rank {
        f,
        stream: Stream::new(&c)?,
        data: DeviceBuffer::<bf16>::alloc(&c, SLOT_BYTES / 2)?,
        ctrl: DeviceBuffer::from_host(&c, &words)?,
        flags,
        maps,
        _recv: recv,
    };

    ctx.step("every size, eager, three calls each");
    for (i, &n) in SIZES.iter().enumerate() {
        for call in 0..3u64 {
            let salt = (i as u64) << 8 | call;
            fill(ctx, &mut me, seed, salt, n)?;
            me.launch(n, LANE_EAGER)?;
            me.wait()
                .with_context(|| format!("{n} values, call {call}"))?;
            check_call(ctx, &me, seed, salt, n)?;
        }
    }

    ctx.step("the graph lane, captured once and replayed");
    for n in [1, 4097, SLOT_BYTES / 2] {
        me.stream.begin_capture()?;
        let launched = me.launch(n, LANE_GRAPH);
        let graph = me.stream.end_capture()?;
        launched?;
        let exec = graph.instantiate()?;
        for replay in 0..3u64 {
            let salt = 1 << 40 | (n as u64) << 8 | replay;
            fill(ctx, &mut me, seed, salt, n)?;
            exec.launch(&me.stream)?;
            me.wait()
                .with_context(|| format!("replay {replay} of {n} values"))?;
            check_call(ctx, &me, seed, salt, n)?;
        }
        // An eager call between the graphs, on the other lane.
        let salt = 2 << 40 | (n as u64) << 8;
        fill(ctx, &mut me, seed, salt, n)?;
        me.launch(n, LANE_EAGER)?;
        me.wait()?;
        check_call(ctx, &me, seed, salt, n)?;
    }

    ctx.step("release: idle, unmap, barrier, free");
    me.stream.wait_until_idle(WAIT)?;
    drop(std::mem::take(&mut me.maps));
    ctx.barrier("oneshot-ipc: every mapping closed")?;
    drop(me);
    super::oneshot::no_mapping_left(ctx, "oneshot-ipc")
}
