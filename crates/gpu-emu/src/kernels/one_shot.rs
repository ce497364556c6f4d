//! The host implementation of metrale-comm's one-shot all-reduce kernels
//! (`bf16_one_shot_all_reduce`, `f16_one_shot_all_reduce` and
//! `f32_one_shot_all_reduce` in `crates/metrale-comm/kernels/one_shot.cu`):
//! the same protocol over the same memory layout, with the GPU's
//! arithmetic, so the one-shot path runs across emulated ranks (threads of
//! this process, reaching the peers' buffers by their addresses, or
//! processes, through the IPC mappings of the peers' pages).
//!
//! One launch runs as one block that covers every element. What it keeps
//! from the GPU kernel:
//! - the control block at `ctrl` (136 bytes: peer buffers, the host-pinned
//!   abort and status words, the spin bound, rank, world, slot size, two
//!   lanes of a claim word (owner tag and epoch) and an arrival count, the
//!   `failed` word) is read and written in place;
//! - the push of the (sentinel-replaced) input into slot `rank` of every
//!   peer's buffer, then the wait for every peer's slot in its own buffer,
//!   the f32 sum in rank order (a NaN sum is the GPU's canonical NaN), the
//!   clear back to the sentinel and the rounding to the type (nearest
//!   even; none for f32) into the data;
//! - the lane's owner (a call that finds it held by another records the
//!   concurrent-use status and touches nothing), the epoch that picks the
//!   half, and the bounded spin: past the spin bound, or once the abort
//!   word is set (read only after [`HOST_POLL_AFTER`] of waiting, as the
//!   GPU kernel reads no host memory before), the status is recorded (first
//!   in `failed`, the first wins, then in the host's status word) and the
//!   kernel ends; a kernel that finds `failed` set touches nothing.
//!
//! Invariants: every touch of emulated memory goes through
//! `memory::access`, in short sections (never held while waiting), so a
//! peer's push or a free is never blocked by a waiting kernel; buffers are
//! read and written as atomic 32-bit words, as ranks on other threads touch
//! them at once. A range not allocated when touched is the device's sticky
//! illegal address.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cuda_sys::CUresult;
use half::{bf16, f16};
use metrale_kernel_abi::one_shot::{self as abi, Status};

use crate::cost::{self, CostOp};
use crate::cuda::driver;
use crate::cuda::memory::{self, Span, range_ok};
use crate::cuda::stream::Launcher;

/// The element type of a one-shot kernel: how 16 bytes of it become f32
/// values and back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    Bf16,
    F16,
    F32,
}

impl Elem {
    /// The type whose kernel has the entry name `name`.
    pub(crate) fn by_name(name: &str) -> Option<Elem> {
        [Elem::Bf16, Elem::F16, Elem::F32]
            .into_iter()
            .find(|e| e.name() == name)
    }

    fn name(self) -> &'static str {
        match self {
            Elem::Bf16 => abi::ENTRIES[0].0,
            Elem::F16 => abi::ENTRIES[1].0,
            Elem::F32 => abi::ENTRIES[2].0,
        }
    }

    /// Bytes of one value.
    pub(crate) fn size(self) -> usize {
        match self {
            Elem::Bf16 | Elem::F16 => 2,
            Elem::F32 => 4,
        }
    }

    /// Values per 16-byte unit.
    fn per_unit(self) -> usize {
        16 / self.size()
    }

    /// The values of one word, as f32: two for the 16-bit types (the low
    /// half first), one for f32 (and a 0.0 that nothing reads).
    fn values(self, w: u32) -> [f32; 2] {
        match self {
            Elem::Bf16 => [f32::from_bits(w << 16), f32::from_bits(w & 0xFFFF_0000)],
            Elem::F16 => [
                f16::from_bits(w as u16).to_f32(),
                f16::from_bits((w >> 16) as u16).to_f32(),
            ],
            Elem::F32 => [f32::from_bits(w), 0.0],
        }
    }

    /// The word of the values `v` (laid out as [`Elem::values`] gives
    /// them), rounded to the type to nearest even; a NaN is the GPU's
    /// canonical NaN (its f32 add returns bits `0x7FFF_FFFF` whatever the
    /// operands', where the host's keeps a payload or gives `0xFFC0_0000`),
    /// which rounds to `0x7FFF` in bf16 and f16.
    fn word(self, v: [f32; 2]) -> u32 {
        let v = v.map(|x| {
            if x.is_nan() {
                f32::from_bits(0x7FFF_FFFF)
            } else {
                x
            }
        });
        let pair = |lo: u16, hi: u16| u32::from(lo) | (u32::from(hi) << 16);
        match self {
            Elem::Bf16 => pair(
                bf16::from_f32(v[0]).to_bits(),
                bf16::from_f32(v[1]).to_bits(),
            ),
            Elem::F16 => pair(f16::from_f32(v[0]).to_bits(), f16::from_f32(v[1]).to_bits()),
            Elem::F32 => v[0].to_bits(),
        }
    }
}

// The kernels' ABI, from its one definition (`metrale-kernel-abi`).
const SENTINEL: u32 = abi::SENTINEL;
pub(super) const CTRL_BYTES: usize = abi::CTRL_BYTES;
pub(super) const OFF_FLAGS: u64 = abi::OFF_FLAGS as u64;
const OFF_TIMEOUT: u64 = abi::OFF_TIMEOUT_NS as u64;
const OFF_RANK: u64 = abi::OFF_RANK as u64;
const OFF_WORLD: u64 = abi::OFF_WORLD as u64;
const OFF_SLOT: u64 = abi::OFF_SLOT_BYTES as u64;
const OFF_LANES: u64 = abi::OFF_LANE as u64;
const OFF_FAILED: u64 = abi::OFF_FAILED as u64;
/// How long a call waits before it reads the host's abort word.
const HOST_POLL_AFTER: Duration = Duration::from_nanos(abi::HOST_POLL_AFTER_NS);
const LANE_BYTES: u64 = abi::LANE_BYTES as u64;
/// The epoch's bits of a claim word.
const EPOCH_MASK: u64 = (1 << abi::EPOCH_BITS) - 1;
const MAX_RANKS: usize = abi::MAX_RANKS;
/// The largest slot a launch may name (the kernel's offsets in a receive
/// buffer are 32-bit).
const MAX_SLOT: u64 = abi::MAX_SLOT_BYTES as u64;

const STATUS_TIMEOUT: u32 = Status::Timeout as u32;
const STATUS_ABORTED: u32 = Status::Aborted as u32;
const STATUS_CONCURRENT: u32 = Status::Concurrent as u32;
pub(super) const STATUS_BAD_LAUNCH: u32 = Status::BadLaunch as u32;

/// Launch numbers (the GPU's `%gridid`), from which owner tags are made.
pub(super) static LAUNCHES: AtomicU64 = AtomicU64::new(1);

/// The word of emulated memory at `addr`.
///
/// # Safety
/// `addr` is 4-byte aligned and lies inside memory held live by the
/// enclosing `memory::access`.
unsafe fn word<'a>(addr: u64) -> &'a AtomicU32 {
    // SAFETY: this function's contract.
    unsafe { AtomicU32::from_ptr(addr as usize as *mut u32) }
}

/// The 64-bit word of emulated memory at `addr`.
///
/// # Safety
/// As for [`word`], 8-byte aligned.
pub(super) unsafe fn word64<'a>(addr: u64) -> &'a AtomicU64 {
    // SAFETY: this function's contract.
    unsafe { AtomicU64::from_ptr(addr as usize as *mut u64) }
}

/// The control block's fixed part.
struct Ctrl {
    peer: [u64; MAX_RANKS],
    flags: u64,
    timeout: Duration,
    rank: usize,
    world: usize,
    slot: u64,
}

/// # Safety
/// `ctrl` holds a live, 8-byte aligned control block.
unsafe fn read_ctrl(ctrl: u64) -> Ctrl {
    // SAFETY: every offset lies inside the 136-byte block (this function's
    // contract), aligned for its width.
    unsafe {
        let mut peer = [0u64; MAX_RANKS];
        for (i, p) in peer.iter_mut().enumerate() {
            *p = word64(ctrl + 8 * i as u64).load(Ordering::Acquire);
        }
        Ctrl {
            peer,
            flags: word64(ctrl + OFF_FLAGS).load(Ordering::Acquire),
            timeout: Duration::from_nanos(word64(ctrl + OFF_TIMEOUT).load(Ordering::Acquire)),
            rank: word(ctrl + OFF_RANK).load(Ordering::Acquire) as usize,
            world: word(ctrl + OFF_WORLD).load(Ordering::Acquire) as usize,
            slot: word64(ctrl + OFF_SLOT).load(Ordering::Acquire),
        }
    }
}

/// The word (+0.0, -0.0) read as (+0.0, +0.0), as the pusher writes it.
fn canon(w: u32) -> u32 {
    if w == SENTINEL { 0 } else { w }
}

/// Unit `u` of `data` (its elements `per * u .. per * (u + 1)`, `per` the
/// values of `e` in 16 bytes) as four words; elements past `n` are +0.0.
///
/// # Safety
/// `data` holds `n` values of `e`.
unsafe fn load_unit(e: Elem, data: u64, n: usize, u: usize) -> [u32; 4] {
    let per = e.per_unit();
    let mut w = [0u32; 4];
    for k in (0..per).take_while(|k| per * u + k < n) {
        let at = (data + (e.size() * (per * u + k)) as u64) as usize;
        // SAFETY: the element lies below `n` (this function's contract);
        // unaligned reads keep odd addresses sound.
        unsafe {
            if e.size() == 2 {
                w[k / 2] |= u32::from((at as *const u16).read_unaligned()) << (16 * (k % 2));
            } else {
                w[k] = (at as *const u32).read_unaligned();
            }
        }
    }
    w
}

/// Writes the elements of `w` below `n` to unit `u` of `data`.
///
/// # Safety
/// `data` holds `n` values of `e`.
unsafe fn store_unit(e: Elem, data: u64, n: usize, u: usize, w: [u32; 4]) {
    let per = e.per_unit();
    for k in (0..per).take_while(|k| per * u + k < n) {
        let at = (data + (e.size() * (per * u + k)) as u64) as usize;
        // SAFETY: the element lies below `n` (this function's contract).
        unsafe {
            if e.size() == 2 {
                (at as *mut u16).write_unaligned((w[k / 2] >> (16 * (k % 2))) as u16);
            } else {
                (at as *mut u32).write_unaligned(w[k]);
            }
        }
    }
}

/// The launch of the one-shot kernel of `e`, `(ctrl, data, n, lane)`, on a
/// stream of device `dev`: the ranges are checked now, and again when it
/// runs.
pub(crate) fn launcher(
    e: Elem,
    (ctrl, data, n, lane): (u64, u64, u64, u32),
    dev: i32,
) -> Result<Launcher, CUresult> {
    let n = usize::try_from(n).map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let bytes = n
        .checked_mul(e.size())
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if !ctrl.is_multiple_of(8) || !range_ok(ctrl, CTRL_BYTES, true) || !range_ok(data, bytes, true)
    {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    Ok(Arc::new(move || {
        let tag = tag(LAUNCHES.fetch_add(1, Ordering::Relaxed));
        Box::new(move || {
            if driver::sticky(dev).is_err() {
                return;
            }
            if run(e, (ctrl, data, n, lane), tag).is_none() {
                memory::illegal_address(dev, e.name(), data, bytes);
            }
        })
    }))
}

/// What one pass over the arrived data found.
enum Pass {
    Done,
    Waiting,
}

/// Word `i` of the host-pinned flags at `flags` (0: abort, 1: status).
fn flag(flags: u64, i: u64) -> Option<u32> {
    memory::access(&[Span::any(flags, 8)], || {
        // SAFETY: the span holds both words for the load; aligned.
        unsafe { word(flags + 4 * i) }.load(Ordering::Acquire)
    })
}

/// Records `code` as the status unless one is recorded already: in the
/// control block's `failed` word (the first wins), then in the host's
/// status word.
pub(super) fn fail(ctrl: u64, flags: u64, code: u32) -> Option<()> {
    let first = memory::access(&[Span::device(ctrl, CTRL_BYTES)], || {
        // SAFETY: the span holds the control block; `failed` is aligned.
        let failed = unsafe { word(ctrl + OFF_FAILED) };
        failed
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    })?;
    if !first {
        return Some(());
    }
    memory::access(&[Span::any(flags, 8)], || {
        // SAFETY: the span holds both words for the store; aligned.
        unsafe { word(flags + 4 * abi::FLAG_STATUS as u64) }.store(code, Ordering::Release);
    })
}

/// The control block's `failed` word.
fn failed(ctrl: u64) -> Option<u32> {
    memory::access(&[Span::device(ctrl, CTRL_BYTES)], || {
        // SAFETY: the span holds the control block; `failed` is aligned.
        unsafe { word(ctrl + OFF_FAILED) }.load(Ordering::Acquire)
    })
}

/// A launch's owner tag (`os_tag`, [`abi::owner_tag`]).
pub(super) fn tag(launch: u64) -> u64 {
    abi::owner_tag(launch)
}

/// One execution; `None` when memory it needed was not allocated,
/// `Some(true)` when the call completed (`false`: it recorded a status or
/// found one).
pub(super) fn run(
    e: Elem,
    (ctrl, data, n, lane): (u64, u64, usize, u32),
    tag: u64,
) -> Option<bool> {
    let t0 = Instant::now();
    let ctrl_span = Span::device(ctrl, CTRL_BYTES);
    // SAFETY: the span holds the control block for the read.
    let c = memory::access(&[ctrl_span], || unsafe { read_ctrl(ctrl) })?;
    let fail = |code| fail(ctrl, c.flags, code).map(|()| false);
    let slot = c.slot;
    if lane as usize >= abi::LANES
        || !(2..=MAX_RANKS).contains(&c.world)
        || c.rank >= c.world
        || n == 0
        || e.size()
            .checked_mul(n)
            .is_none_or(|bytes| bytes as u64 > slot)
        || slot > MAX_SLOT
        || !slot.is_multiple_of(16)
    {
        return fail(STATUS_BAD_LAUNCH);
    }
    if failed(ctrl)? != 0 {
        return Some(false);
    }
    let lane_at = ctrl + OFF_LANES + LANE_BYTES * u64::from(lane);
    // The claim (`one_shot.cu`): an OR of the launch's tag that finds
    // no tag there (the emulator runs a launch's blocks as one, so none of
    // them finds its own launch's tag).
    // SAFETY: the lane's claim word (owner tag << 8 | epoch mod 256) lies
    // inside the control block, which the span holds.
    let taken = memory::access(&[ctrl_span], || unsafe {
        let old = word64(lane_at).fetch_or(tag << abi::EPOCH_BITS, Ordering::AcqRel);
        (old >> abi::EPOCH_BITS == 0).then_some((old & EPOCH_MASK) as u32)
    })?;
    let Some(epoch) = taken else {
        return fail(STATUS_CONCURRENT);
    };
    let (world, rank) = (c.world, c.rank);
    let half = u64::from(epoch & 1);
    let region = (u64::from(lane) * abi::HALVES as u64 + half) * world as u64 * slot;
    let units = n.div_ceil(e.per_unit());
    let used = units * 16;
    let data_span = Span::device(data, e.size() * n);

    // 1. Push into slot `rank` of every peer.
    let mut push = vec![data_span];
    push.extend(
        (0..world)
            .filter(|&p| p != rank)
            .map(|p| Span::device(c.peer[p] + region + rank as u64 * slot, used)),
    );
    memory::access(&push, || {
        for u in 0..units {
            // SAFETY: `data` holds `n` values (the span).
            let v = unsafe { load_unit(e, data, n, u) }.map(canon);
            for p in (0..world).filter(|&p| p != rank) {
                let at = c.peer[p] + region + rank as u64 * slot + 16 * u as u64;
                for (j, w) in v.iter().enumerate() {
                    // SAFETY: inside the peer's slot (the span), aligned.
                    unsafe { word(at + 4 * j as u64) }.store(*w, Ordering::Release);
                }
            }
        }
    })?;

    // 2-3. Wait, add in rank order, clear, round.
    let mine = c.peer[rank] + region;
    let mut wait = vec![data_span];
    wait.extend(
        (0..world)
            .filter(|&p| p != rank)
            .map(|p| Span::device(mine + p as u64 * slot, used)),
    );
    let mut u = 0usize;
    let mut tries = 0u32;
    loop {
        let pass = memory::access(&wait, || {
            while u < units {
                let at = |p: usize, j: usize| mine + p as u64 * slot + 16 * u as u64 + 4 * j as u64;
                for p in (0..world).filter(|&p| p != rank) {
                    for j in 0..4 {
                        // SAFETY: inside this rank's own slot `p` (the span), aligned.
                        let w = unsafe { word(at(p, j)) };
                        if w.load(Ordering::Acquire) == SENTINEL {
                            return Pass::Waiting;
                        }
                    }
                }
                let mut acc = [[0f32; 2]; 4];
                for p in 0..world {
                    let mut v = [0u32; 4];
                    if p == rank {
                        // SAFETY: `data` holds `n` values (the span).
                        v = unsafe { load_unit(e, data, n, u) }.map(canon);
                    } else {
                        for (j, x) in v.iter_mut().enumerate() {
                            // SAFETY: as above; the word is cleared as it is read.
                            let w = unsafe { word(at(p, j)) };
                            *x = w.swap(SENTINEL, Ordering::AcqRel);
                        }
                    }
                    for (a, w) in acc.iter_mut().zip(v) {
                        let x = e.values(w);
                        if p == 0 {
                            *a = x;
                        } else {
                            a[0] += x[0];
                            a[1] += x[1];
                        }
                    }
                }
                let out = acc.map(|a| e.word(a));
                // SAFETY: `data` holds `n` values (the span).
                unsafe { store_unit(e, data, n, u, out) };
                u += 1;
            }
            Pass::Done
        })?;
        if let Pass::Done = pass {
            break;
        }
        if failed(ctrl)? != 0 {
            return Some(false);
        }
        if t0.elapsed() > HOST_POLL_AFTER && flag(c.flags, abi::FLAG_ABORT as u64)? != 0 {
            return fail(STATUS_ABORTED);
        }
        if t0.elapsed() > c.timeout {
            return fail(STATUS_TIMEOUT);
        }
        tries += 1;
        if tries < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(u64::from(tries.min(1000))));
        }
    }

    // An injected corruption (`fault::Fault::Corrupt`): the first word of
    // the result is wrong, as from a GPU whose peer memory misbehaves.
    if crate::fault::take_corrupt(rank as i32) {
        memory::access(&[data_span], || {
            // SAFETY: `data` holds `n` values (the span).
            let mut w = unsafe { load_unit(e, data, n, 0) };
            w[0] ^= 0x0001_0001;
            // SAFETY: as above.
            unsafe { store_unit(e, data, n, 0, w) };
        })?;
    }

    // 4. Free the lane at the next epoch, in one store.
    // SAFETY: the lane lies inside the control block (the span).
    memory::access(&[ctrl_span], || unsafe {
        word64(lane_at).store(u64::from(epoch + 1) & EPOCH_MASK, Ordering::Release);
    })?;
    cost::charge(CostOp::OneShot, rank, e.size() * n);
    Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_tag_is_zero_nor_the_or_of_two_others() {
        let launches = [
            0u64,
            1,
            2,
            3,
            4,
            7,
            0xFFF_FFFF,
            0x1000_0000,
            0x1234_5678_9abc,
        ];
        for &a in &launches {
            assert_eq!(tag(a).count_ones(), 28, "tag of {a}");
            assert!(tag(a) >> 56 == 0, "the tag fits above an 8-bit epoch");
            for &b in &launches {
                if a % (1 << 28) != b % (1 << 28) {
                    assert!((tag(a) | tag(b)).count_ones() > 28, "{a} | {b}");
                }
            }
        }
    }

    #[test]
    fn units_round_trip_and_pad_with_zero() {
        let v: Vec<u16> = (1..=11).collect();
        let p = v.as_ptr() as usize as u64;
        for e in [Elem::Bf16, Elem::F16] {
            // SAFETY: `v` holds 11 values.
            let (a, b) = unsafe { (load_unit(e, p, 11, 0), load_unit(e, p, 11, 1)) };
            assert_eq!(a[0], 1 | (2 << 16));
            assert_eq!(b, [9 | (10 << 16), 11, 0, 0]);
            let mut out = vec![0u16; 11];
            let q = out.as_mut_ptr() as usize as u64;
            // SAFETY: `out` holds 11 values.
            unsafe { store_unit(e, q, 11, 1, b) };
            assert_eq!(&out[8..], &[9, 10, 11]);
            assert!(out[..8].iter().all(|&x| x == 0));
        }
        let v: Vec<u32> = (1..=6).collect();
        let p = v.as_ptr() as usize as u64;
        // SAFETY: `v` holds 6 values.
        let (a, b) = unsafe { (load_unit(Elem::F32, p, 6, 0), load_unit(Elem::F32, p, 6, 1)) };
        assert_eq!((a, b), ([1, 2, 3, 4], [5, 6, 0, 0]));
        let mut out = vec![0u32; 6];
        let q = out.as_mut_ptr() as usize as u64;
        // SAFETY: `out` holds 6 values.
        unsafe { store_unit(Elem::F32, q, 6, 1, b) };
        assert_eq!(out, [0, 0, 0, 0, 5, 6]);
    }

    #[test]
    fn the_sentinel_word_reads_as_zero() {
        assert_eq!(canon(SENTINEL), 0);
        assert_eq!(canon(0x8000), 0x8000);
        for e in [Elem::Bf16, Elem::F16] {
            assert_eq!(e.word(e.values(0x3f80_4000)), 0x3f80_4000, "{e:?}");
        }
        assert_eq!(Elem::F32.word(Elem::F32.values(0x3f80_4001)), 0x3f80_4001);
        assert_eq!(Elem::F16.values(0x3c00_3800), [0.5, 1.0]);
        // Rounded to nearest even: f16 1 + 2^-11 is a tie, to 1.0.
        assert_eq!(Elem::F16.word([1.0 + 1.0 / 2048.0, 0.0]), 0x3c00);
        for e in [Elem::Bf16, Elem::F16, Elem::F32] {
            assert_eq!(Elem::by_name(e.name()), Some(e));
        }
        assert_eq!(Elem::by_name("bf16_add_inplace"), None);
        // NaNs come out as the GPU's canonical NaN, in every type.
        let nan = f32::INFINITY + f32::NEG_INFINITY;
        assert_eq!(Elem::F32.word([nan, 0.0]), 0x7FFF_FFFF);
        assert_eq!(Elem::Bf16.word([nan, 1.0]), 0x3F80_7FFF);
        assert_eq!(
            Elem::F16.word([f32::from_bits(0xFFC0_0001), 1.0]),
            0x3C00_7FFF
        );
    }
}
