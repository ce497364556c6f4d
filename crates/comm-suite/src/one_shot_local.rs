//! The one-shot kernels outside the backend: `k` ranks simulated on one
//! device ([`LocalOneShot`], one element type per value), for the `oneshot_kernel_one_device` scenario
//! and the `one_shot_local` benchmark. One GPU can run this where the
//! backend cannot (NCCL refuses two ranks on one device); it shows the
//! protocol and arithmetic on the GPU's memory model, not NVLink.
//!
//! Invariants: the buffers stay allocated until the value is dropped, and
//! dropping it first sets every rank's abort word and waits (bounded) for
//! every stream, so no kernel runs on freed memory;
//! every launch is checked against the kernel's launch contract (`n` within
//! one slot, lane 0 or 1) before it is made; every wait is bounded. A
//! call's values start [`GUARD`] + [`LocalOneShot::offset`] elements into
//! each data buffer, with at least [`GUARD`] guard elements on each side that the kernel
//! must not write (the check reads them too).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use metrale_comm::kernels::{self, OneShotElement};
use nccl_safe::{Context, DeviceBuffer, Event, Function, GraphExec, HostWords, Stream};

use crate::data::{SuiteElem, random_vec};

const WAIT: Duration = Duration::from_secs(60);

/// Whether the process runs under compute-sanitizer: the suite's sanitizer
/// command sets `METRALE_UNDER_SANITIZER=1` (the tool itself injects
/// through `CUDA_INJECTION64_PATH`, also read). The sanitizer runs one
/// kernel at a time, so steps that need kernels of several simulated
/// ranks co-scheduled beyond the first launch skip under it.
pub fn under_sanitizer() -> bool {
    std::env::var_os("METRALE_UNDER_SANITIZER").is_some_and(|v| v != "0")
        || std::env::var("CUDA_INJECTION64_PATH").is_ok_and(|p| p.contains("sanitizer"))
}

/// Whether the separate add + norm kernel launches programmatically
/// ([`launch_separate_norm`]): `METRALE_NORM_PDL=1`, read once. Only with a
/// `METRALE_NORM_PTX` build that waits for the kernel before it (the sm_90
/// variant `add_rms_norm_sm90-pdl.ptx` of `cargo xtask ptx --variants`).
pub fn norm_pdl() -> bool {
    static PDL: OnceLock<bool> = OnceLock::new();
    *PDL.get_or_init(|| std::env::var_os("METRALE_NORM_PDL").is_some_and(|v| v == "1"))
}

/// The separate add + norm kernel's launch for the kernel scenario and the
/// `norm_local` bench: `norm::launch_add_rms_norm`, or its programmatic
/// form where [`norm_pdl`] says.
///
/// # Safety
/// As `norm::launch_add_rms_norm`.
pub unsafe fn launch_separate_norm(
    f: &Function,
    a: metrale_comm::norm::NormArgs,
    s: cuda_sys::CUstream,
) -> nccl_safe::Result<()> {
    use metrale_comm::norm;
    // SAFETY: this function's contract; a programmatic launch only where
    // the user named a build that waits (METRALE_NORM_PDL's contract).
    unsafe {
        if norm_pdl() {
            norm::launch_add_rms_norm_programmatic(f, a, s)
        } else {
            norm::launch_add_rms_norm(f, a, s)
        }
    }
}

/// The PTX of a kernel module for the kernel scenarios: the file `var`
/// names (`METRALE_ONE_SHOT_PTX`, `METRALE_NORM_PTX`: a kernel change
/// compiled by `cargo xtask ptx`, checked on a GPU box by the bundle
/// built before it, as the `one_shot_local` and `norm_local` benches
/// load it), else the committed PTX. Says which it took.
pub fn ptx_or(
    var: &str,
    committed: &'static str,
) -> anyhow::Result<std::borrow::Cow<'static, str>> {
    match std::env::var_os(var) {
        Some(path) => {
            println!("{var}: the kernels from {}", path.to_string_lossy());
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("{var} names {}", path.to_string_lossy()))?;
            Ok(text.into())
        }
        None => Ok(committed.into()),
    }
}

/// The lane of calls captured into graphs.
pub const LANE_GRAPH: u32 = 1;
/// The lane of eager calls.
pub const LANE_EAGER: u32 = 0;
/// Elements of room on each side of a call's values in a data buffer: the
/// most [`LocalOneShot::set_offset`] takes is `GUARD - 1`.
pub const GUARD: usize = 8;
/// The value every guard element holds: no sum of the suite's inputs
/// (at most 8 ranks' values below 8 in magnitude) comes near it.
const GUARD_VALUE: f32 = -1234.5;

/// `k` ranks of the one-shot kernel of `T` simulated on one device: each
/// has its own receive buffer, control block, pinned flags (abort, status),
/// data buffer of one slot (and guards) and stream, and every control block
/// names the others' buffers by address; one side stream runs a second call
/// of any rank beside its first.
pub struct LocalOneShot<T: OneShotElement> {
    k: usize,
    slot_bytes: usize,
    offset: usize,
    _recv: Vec<DeviceBuffer<u32>>,
    ctrl: Vec<DeviceBuffer<u64>>,
    flags: Vec<HostWords>,
    data: Vec<DeviceBuffer<T>>,
    streams: Vec<Stream>,
    side: Stream,
    /// Per rank: a second stream, and the graph lane's serial event (what
    /// the backend brackets every captured one-shot with).
    second: Vec<Stream>,
    serial: Vec<Event>,
}

impl<T: OneShotElement> Drop for LocalOneShot<T> {
    fn drop(&mut self) {
        for f in &self.flags {
            f.store(0, 1);
        }
        for (r, s) in self.streams.iter().enumerate() {
            if let Err(e) = s.wait_until_idle(WAIT) {
                tracing::error!("rank {r}'s one-shot kernels did not end before the free: {e}");
            }
        }
        if let Err(e) = self.side.wait_until_idle(WAIT) {
            tracing::error!("the side stream's one-shot kernels did not end before the free: {e}");
        }
        for (r, s) in self.second.iter().enumerate() {
            if let Err(e) = s.wait_until_idle(WAIT) {
                tracing::error!("rank {r}'s second stream did not drain before the free: {e}");
            }
        }
    }
}

impl<T: OneShotElement + SuiteElem> LocalOneShot<T> {
    /// `k` ranks (2 to 8) with slots of `slot_bytes` (a multiple of 16);
    /// a spinning thread gives up after `timeout`.
    pub fn new(
        c: &Arc<Context>,
        k: usize,
        slot_bytes: usize,
        timeout: Duration,
    ) -> anyhow::Result<LocalOneShot<T>> {
        ensure!(
            (2..=8).contains(&k) && slot_bytes > 0 && slot_bytes.is_multiple_of(16),
            "{k} ranks with {slot_bytes}-byte slots"
        );
        let mut recv = Vec::with_capacity(k);
        for _ in 0..k {
            let mut b = DeviceBuffer::<u32>::alloc(c, kernels::one_shot_recv_words(k, slot_bytes))?;
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
                slot_bytes,
            )
            .context("control block")?;
            ctrl.push(DeviceBuffer::from_host(c, &words)?);
            flags.push(f);
            data.push(DeviceBuffer::<T>::alloc(
                c,
                slot_bytes / T::DATA_TYPE.size() + 3 * GUARD,
            )?);
            streams.push(Stream::new(c)?);
        }
        let second = (0..k).map(|_| Stream::new(c)).collect::<Result<_, _>>()?;
        let serial = (0..k)
            .map(|_| Event::new(c, false))
            .collect::<Result<_, _>>()?;
        Ok(LocalOneShot {
            k,
            slot_bytes,
            offset: 0,
            _recv: recv,
            ctrl,
            flags,
            data,
            streams,
            side: Stream::new(c)?,
            second,
            serial,
        })
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.k
    }

    /// The largest call, in elements.
    pub fn max_elems(&self) -> usize {
        self.slot_bytes / T::DATA_TYPE.size()
    }

    /// Where a call's values start in every data buffer, in elements: 0
    /// (16-byte aligned) unless [`LocalOneShot::set_offset`] said otherwise,
    /// after [`GUARD`] guard elements.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Makes later loads, launches and checks put a call's values
    /// `offset` elements (less than [`GUARD`]) after the leading guards of
    /// every data buffer: an offset that is not a multiple of 16 bytes is a
    /// misaligned call.
    pub fn set_offset(&mut self, offset: usize) -> anyhow::Result<()> {
        ensure!(offset < GUARD, "offset {offset} of at most {}", GUARD - 1);
        self.offset = offset;
        Ok(())
    }

    /// Where a call's values start in a data buffer, in elements.
    fn lead(&self) -> usize {
        GUARD + self.offset
    }

    fn guard() -> T {
        T::from_f32(GUARD_VALUE)
    }

    /// Rewrites the slot size in rank `r`'s control block (the receive
    /// buffers keep their size): a launch must then refuse any slot larger
    /// than the kernel's bound before it touches a buffer.
    pub fn set_ctrl_slot(&mut self, r: usize, slot_bytes: u64) -> anyhow::Result<()> {
        ensure!(r < self.k, "rank {r} of {}", self.k);
        self.streams[r].wait_until_idle(WAIT)?;
        let mut words = self.ctrl[r].to_host_vec()?;
        words[11] = slot_bytes;
        self.ctrl[r].copy_prefix_from_host(&words)?;
        Ok(())
    }

    /// Rank `r`'s control block's device address.
    pub fn ctrl_ptr(&self, r: usize) -> u64 {
        self.ctrl[r].device_ptr()
    }

    /// The device address of rank `r`'s call data (after the guards and
    /// the offset): [`LocalOneShot::max_elems`] values.
    pub fn data_ptr(&self, r: usize) -> u64 {
        self.data[r].device_ptr() + (self.lead() * T::DATA_TYPE.size()) as u64
    }

    /// Rank `r`'s stream.
    pub fn stream(&self, r: usize) -> &Stream {
        &self.streams[r]
    }

    /// Rank `r`'s pinned words: 0 abort (set it to 1 to end every kernel),
    /// 1 the status a kernel records.
    pub fn flags(&self, r: usize) -> &HostWords {
        &self.flags[r]
    }

    /// Random inputs of `n` elements for every rank (the word at byte 8 of
    /// odd ranks' the "not arrived" word: the pair (+0.0, -0.0), or the f32
    /// -0.0), copied into the data buffers.
    pub fn fill(&mut self, seed: u64, n: usize) -> anyhow::Result<Vec<Vec<T>>> {
        let mut inputs = Vec::with_capacity(self.k);
        let per_word = 4 / T::DATA_TYPE.size();
        let at = 8 / T::DATA_TYPE.size();
        for r in 0..self.k {
            let mut v: Vec<T> = random_vec(seed, r, n as u64, n);
            if n >= at + per_word && r % 2 == 1 {
                for (k, x) in v[at..at + per_word].iter_mut().enumerate() {
                    *x = T::from_f32(if k + 1 == per_word { -0.0 } else { 0.0 });
                }
            }
            inputs.push(v);
        }
        self.load(inputs)
    }

    /// Copies `inputs[r]` (one per rank, at most [`LocalOneShot::max_elems`]
    /// each) into rank `r`'s data buffer at the offset, between guard
    /// elements; returns them.
    pub fn load(&mut self, inputs: Vec<Vec<T>>) -> anyhow::Result<Vec<Vec<T>>> {
        ensure!(
            inputs.len() == self.k,
            "{} inputs for {} ranks",
            inputs.len(),
            self.k
        );
        let (max, lead) = (self.max_elems(), self.lead());
        for (d, v) in self.data.iter_mut().zip(&inputs) {
            ensure!(v.len() <= max, "{} values in one slot", v.len());
            let mut host = vec![Self::guard(); lead];
            host.extend_from_slice(v);
            host.extend(std::iter::repeat_n(Self::guard(), GUARD));
            d.copy_prefix_from_host(&host)?;
        }
        Ok(inputs)
    }

    /// Launches rank `r`'s kernel (`f`, the one-shot entry point of `T` in
    /// this context) on `n <= max_elems()` values on its stream.
    pub fn launch(&self, f: &Function, r: usize, n: usize, lane: u32) -> anyhow::Result<()> {
        self.launch_on(f, r, n, lane, &self.streams[r])
    }

    /// As [`LocalOneShot::launch`], on the value's side stream instead of
    /// the rank's own: a second call on a lane while one runs there is how
    /// the kernel's concurrent-use status is reached.
    pub fn launch_side(&self, f: &Function, r: usize, n: usize, lane: u32) -> anyhow::Result<()> {
        self.launch_on(f, r, n, lane, &self.side)
    }

    fn launch_on(
        &self,
        f: &Function,
        r: usize,
        n: usize,
        lane: u32,
        stream: &Stream,
    ) -> anyhow::Result<()> {
        ensure!(
            r < self.k && (1..=self.max_elems()).contains(&n) && lane < 2,
            "rank {r}, {n} values, lane {lane}"
        );
        // SAFETY: `f` is the one-shot entry point of `T` in this context
        // (this function's contract); `ctrl` is this rank's control block, laid
        // out by `one_shot_ctrl`, naming live receive buffers of this
        // context; `data` from the call's start (after the leading guards
        // and the offset) holds at least `n` values (one slot's worth and
        // the trailing guards); all stay allocated
        // until `self` is dropped, after every stream (the side stream
        // too) is idle.
        unsafe {
            kernels::launch_one_shot(
                f,
                self.ctrl[r].device_ptr(),
                self.data[r].device_ptr() + (self.lead() * T::DATA_TYPE.size()) as u64,
                (n, T::DATA_TYPE),
                lane,
                stream.raw(),
            )
        }?;
        Ok(())
    }

    /// Launches every rank's kernel, rank order.
    pub fn launch_all(&self, f: &Function, n: usize, lane: u32) -> anyhow::Result<()> {
        (0..self.k).try_for_each(|r| self.launch(f, r, n, lane))
    }

    /// Waits for every rank's streams and the side stream; fails if any
    /// kernel set a status.
    pub fn wait(&self) -> anyhow::Result<()> {
        self.side.wait_until_idle(WAIT)?;
        for s in &self.second {
            s.wait_until_idle(WAIT)?;
        }
        for s in &self.streams {
            s.wait_until_idle(WAIT)?;
        }
        let statuses: Vec<u32> = self.flags.iter().map(|f| f.load(1)).collect();
        ensure!(
            statuses.iter().all(|&s| s == 0),
            "the kernels set statuses {statuses:?} (by rank; 1 timeout, 2 aborted, 3 concurrent \
             use, 4 bad launch)"
        );
        Ok(())
    }

    /// Rank `r`'s data buffer from the offset on, on the host.
    pub fn output(&self, r: usize) -> anyhow::Result<Vec<T>> {
        let mut v = self.data[r].to_host_vec()?;
        v.drain(..self.lead());
        Ok(v)
    }

    /// Checks every rank's first `n` values against the reference of
    /// `inputs` (what [`LocalOneShot::fill`] returned), bit for bit.
    pub fn check(&self, what: &str, inputs: &[Vec<T>]) -> anyhow::Result<()> {
        let n = inputs[0].len();
        let want = kernels::one_shot_sum(inputs).map_err(anyhow::Error::msg)?;
        let guard = Self::guard().to_bits32();
        for r in 0..self.k {
            let all = self.data[r].to_host_vec()?;
            let (before, got) = all.split_at(self.lead());
            // The guards before the values (at -(GUARD + offset)..0 from the
            // call's first element) and after them (n..n + GUARD).
            let written = before
                .iter()
                .enumerate()
                .map(|(i, x)| (i as isize - before.len() as isize, x))
                .chain(
                    got[n..n + GUARD]
                        .iter()
                        .enumerate()
                        .map(|(i, x)| ((n + i) as isize, x)),
                )
                .find(|(_, x)| x.to_bits32() != guard);
            if let Some((at, x)) = written {
                bail!(
                    "{what}, {} {} ranks, rank {r}: the guard at element {at} of a call of {n} \
                     values at offset {} was written ({x:?})",
                    self.k,
                    T::DATA_TYPE,
                    self.offset
                );
            }
            if let Some(i) = (0..n).find(|&i| got[i].to_bits32() != want[i].to_bits32()) {
                bail!(
                    "{what}, {} {} ranks, rank {r}: element {i} of {n} is {:?} (bits {:#x}), want {:?} ({:#x})",
                    self.k,
                    T::DATA_TYPE,
                    got[i],
                    got[i].to_bits32(),
                    want[i],
                    want[i].to_bits32()
                );
            }
        }
        Ok(())
    }

    /// Waits for every stream, then checks that every rank but the last
    /// (which never launched) ended with `status`, within 20 s of `what`.
    pub fn expect_status(&self, status: u32, what: &str) -> anyhow::Result<()> {
        let t = Instant::now();
        self.side.wait_until_idle(WAIT)?;
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

    /// `calls` calls of rank `r`'s kernel on lane 1, captured into a graph
    /// on its stream.
    pub fn capture(
        &self,
        f: &Function,
        r: usize,
        n: usize,
        calls: usize,
    ) -> anyhow::Result<GraphExec> {
        self.capture_with(f, r, n, calls, false)
    }

    /// As [`LocalOneShot::capture`], the calls ordered as the backend
    /// orders captured one-shots (decision 0017): an external wait on the
    /// rank's serial event before the first, an external record of it
    /// after each, so at each launch the graph's calls wait for those of
    /// the rank's graphs launched before it, on any stream.
    pub fn capture_serial(
        &self,
        f: &Function,
        r: usize,
        n: usize,
        calls: usize,
    ) -> anyhow::Result<GraphExec> {
        self.capture_with(f, r, n, calls, true)
    }

    fn capture_with(
        &self,
        f: &Function,
        r: usize,
        n: usize,
        calls: usize,
        serial: bool,
    ) -> anyhow::Result<GraphExec> {
        let s = &self.streams[r];
        s.begin_capture()?;
        let launched = (0..calls).try_for_each(|call| {
            if serial && call == 0 {
                // SAFETY: the stream is rank `r`'s, of this context and
                // capturing; the event lives as long as `self`, which
                // outlives its graphs' launches (dropping `self` waits for
                // every stream).
                unsafe { self.serial[r].wait_external_raw(s.raw()) }?;
            }
            self.launch(f, r, n, LANE_GRAPH)?;
            if serial {
                // SAFETY: as above.
                unsafe { self.serial[r].record_external_raw(s.raw()) }?;
            }
            anyhow::Ok(())
        });
        let graph = s.end_capture()?;
        launched?;
        Ok(graph.instantiate()?)
    }

    /// Rank `r`'s second stream (graphs of the rank replayed beside those
    /// on its own).
    pub fn second(&self, r: usize) -> &Stream {
        &self.second[r]
    }
}
