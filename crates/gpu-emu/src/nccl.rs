//! The emulated NCCL: communicators, groups, collectives, send/recv,
//! registration, errors and fault injection hooks.
//!
//! Ranks are threads of one process. Communicators of one unique id meet in
//! a process-wide registry; once all ranks have joined they share a
//! [`World`], where collectives meet by sequence number and sends post
//! copies of their data into per-pair mailboxes.
//!
//! Invariants:
//! - A collective's sequence number is taken at launch (the API call, or the
//!   graph launch of captured work), so every rank agrees on matching.
//! - A collective is computed once, by the last rank to arrive, under the
//!   world's lock: every input is read before any output is written
//!   (in-place works), and no output is written once a participant has
//!   aborted, so an aborted rank's buffers are never touched after
//!   `ncclCommAbort` returns.
//! - Waits are condition-variable waits with a short timeout that re-check
//!   the waiter's abort flag, so abort releases them promptly.
//! - Reductions run in rank order; 16-bit floats are computed in `f32` and
//!   rounded after each step, as NCCL's kernels do.
//! - A non-blocking communicator's operations (outside a group, or in a
//!   group whose end holds work of one) are launched at the call but reach
//!   the stream later, from a background thread, after a short random delay
//!   and, for the communicator's first operation, once every peer has
//!   launched its matching operation (NCCL connects lazily). The call
//!   returns `ncclInProgress`, `ncclCommGetAsyncError` says `ncclInProgress`
//!   until the enqueue is done, and any other operation on the communicator
//!   meanwhile is `ncclInvalidUsage`. Abort drops the pending work.
//! - A launched operation counts as in flight until its work runs or is
//!   dropped.
//! - A communicator's launches run in issue order across every stream, as
//!   NCCL's strong stream orders them: a launch (an operation outside a
//!   group, the communicator's part of a group, or its captured operations
//!   at each graph launch) takes the next ticket of the communicator's
//!   [`Chain`] when it is launched, and its work, on whatever stream, first
//!   waits until every earlier ticket is done, so the stream waits too.
//!   Children split from a `splitShare` communicator share its chain. A
//!   ticket is done when its work has run or been dropped (abort drops
//!   pending work; work of an aborted communicator waiting for its turn
//!   ends unrun), so an abort never leaves the chain blocked.
//! - An operation touches its buffers only when it runs, through
//!   `memory::access`, which holds them live from the check to the last
//!   byte: a buffer not allocated then (freed meanwhile) is the
//!   communicator's asynchronous `ncclUnhandledCudaError` ("illegal memory
//!   access") and nothing of that operation is written. An operation that
//!   runs on a device with a sticky CUDA error fails the same way, unrun.
//! - `ncclCommDestroy` returns only once no other communicator has work in
//!   flight on a device of this communicator's peers (NCCL's teardown
//!   unmaps buffers the peers' devices map, which waits for them), or once
//!   this communicator is aborted.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use cuda_sys::cudaStream_t;
use half::{bf16, f16};
use nccl_sys::{
    NCCL_SPLIT_NOCOLOR, ncclComm, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t,
    ncclResult_t, ncclScalarResidence_t, ncclSimInfo_t, ncclUniqueId, ncclWindow_t,
    ncclWindow_vidmem,
};
use parking_lot::{Condvar, Mutex};

use crate::fault::{self, Fault};
use crate::memory::{self, Span, range_ok};
use crate::stream::{self, Launcher, Target, Work};
use crate::{Table, driver, guard, id_to_ptr, new_id, ptr_to_id, put};

const TICK: Duration = Duration::from_millis(20);
/// How often a background enqueue re-checks its peers and abort flags.
const POLL: Duration = Duration::from_millis(1);
const CONFIG_MAGIC: u32 = 0xcafe_beef;
const VERSION: c_int = 22803;

type R<T> = Result<T, ncclResult_t>;

static CALLS: AtomicU64 = AtomicU64::new(0);

/// NCCL API calls so far.
pub(crate) fn calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------- errors

static INTERNED: Mutex<BTreeMap<String, &'static CStr>> = Mutex::new(BTreeMap::new());
static LAST: Mutex<&'static CStr> = Mutex::new(c"");
static ERR_SEQ: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The calling thread's last error, with its place in the error order.
    static THREAD_LAST: std::cell::Cell<Option<(u64, &'static CStr)>> =
        const { std::cell::Cell::new(None) };
}

/// Records `m` as the process's and the calling thread's last error;
/// returns it with its sequence number.
fn record(m: &'static CStr) -> (u64, &'static CStr) {
    let e = (ERR_SEQ.fetch_add(1, Ordering::Relaxed), m);
    *LAST.lock() = m;
    THREAD_LAST.with(|t| t.set(Some(e)));
    e
}

/// A static C string with the text of `s` (each distinct text is kept once).
fn intern(s: &str) -> &'static CStr {
    let mut m = INTERNED.lock();
    if let Some(c) = m.get(s) {
        return c;
    }
    let bytes: Vec<u8> = s.bytes().filter(|b| *b != 0).collect();
    let c: &'static CStr = match std::ffi::CString::new(bytes) {
        Ok(c) => Box::leak(c.into_boxed_c_str()),
        Err(_) => c"",
    };
    m.insert(s.to_owned(), c);
    c
}

/// Records `msg` as the last error and returns `code`.
fn err(code: ncclResult_t, msg: impl AsRef<str>) -> ncclResult_t {
    let m = format!("emulated NCCL: {}", msg.as_ref());
    record(intern(&m));
    code
}

fn fail<T>(code: ncclResult_t, msg: impl AsRef<str>) -> R<T> {
    Err(err(code, msg))
}

fn unimplemented(name: &str) -> ncclResult_t {
    err(
        ncclResult_t::ncclInvalidUsage,
        format!("{name} is not implemented by the emulator"),
    )
}

fn entry(f: impl FnOnce() -> R<ncclResult_t>) -> ncclResult_t {
    CALLS.fetch_add(1, Ordering::Relaxed);
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(c) | Err(c)) => c,
        Err(_) => err(ncclResult_t::ncclInternalError, "internal panic"),
    }
}

/// Writes an out-parameter or fails with `ncclInvalidArgument`.
///
/// # Safety
/// `p` is null or valid for a write.
unsafe fn out<T>(p: *mut T, v: T, what: &str) -> R<()> {
    // SAFETY: `p` is null or valid (this function's contract).
    if unsafe { put(p, v) } {
        Ok(())
    } else {
        fail(ncclResult_t::ncclInvalidArgument, format!("{what} is NULL"))
    }
}

// ---------------------------------------------------------------- data

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dt {
    I8,
    U8,
    I32,
    U32,
    I64,
    U64,
    F16,
    F32,
    F64,
    Bf16,
}

impl Dt {
    fn from_nccl(d: ncclDataType_t) -> R<Dt> {
        Ok(match d.0 {
            0 => Dt::I8,
            1 => Dt::U8,
            2 => Dt::I32,
            3 => Dt::U32,
            4 => Dt::I64,
            5 => Dt::U64,
            6 => Dt::F16,
            7 => Dt::F32,
            8 => Dt::F64,
            9 => Dt::Bf16,
            10 | 11 => {
                return fail(
                    ncclResult_t::ncclInvalidArgument,
                    "fp8 data types are not supported by the emulator",
                );
            }
            other => {
                return fail(
                    ncclResult_t::ncclInvalidArgument,
                    format!("invalid data type {other}"),
                );
            }
        })
    }

    fn size(self) -> usize {
        match self {
            Dt::I8 | Dt::U8 => 1,
            Dt::F16 | Dt::Bf16 => 2,
            Dt::I32 | Dt::U32 | Dt::F32 => 4,
            Dt::I64 | Dt::U64 | Dt::F64 => 8,
        }
    }

    fn is_float(self) -> bool {
        matches!(self, Dt::F16 | Dt::F32 | Dt::F64 | Dt::Bf16)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
}

impl Op {
    fn from_nccl(o: ncclRedOp_t) -> R<Op> {
        Ok(match o.0 {
            0 => Op::Sum,
            1 => Op::Prod,
            2 => Op::Max,
            3 => Op::Min,
            4 => Op::Avg,
            other => {
                return fail(
                    ncclResult_t::ncclInvalidArgument,
                    format!("invalid reduction operation {other}"),
                );
            }
        })
    }
}

/// An element type stored as native-endian bytes.
trait El: Copy {
    fn ld(b: &[u8]) -> Self;
    fn st(self, b: &mut [u8]);
}

macro_rules! el_num {
    ($($t:ty),*) => {$(
        impl El for $t {
            fn ld(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                <$t>::from_ne_bytes(a)
            }
            fn st(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_ne_bytes());
            }
        }
    )*};
}
el_num!(i8, u8, i32, u32, i64, u64, f32, f64);

macro_rules! el_half {
    ($($t:ty),*) => {$(
        impl El for $t {
            fn ld(b: &[u8]) -> Self {
                <$t>::from_bits(u16::ld(b))
            }
            fn st(self, b: &mut [u8]) {
                self.to_bits().st(b)
            }
        }
    )*};
}
impl El for u16 {
    fn ld(b: &[u8]) -> Self {
        u16::from_ne_bytes([b[0], b[1]])
    }
    fn st(self, b: &mut [u8]) {
        b.copy_from_slice(&self.to_ne_bytes());
    }
}
el_half!(f16, bf16);

fn map2<T: El>(acc: &mut [u8], x: &[u8], f: impl Fn(T, T) -> T) {
    let n = std::mem::size_of::<T>();
    for (a, b) in acc.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
        f(T::ld(a), T::ld(b)).st(a);
    }
}

fn map1<T: El>(acc: &mut [u8], f: impl Fn(T) -> T) {
    let n = std::mem::size_of::<T>();
    for a in acc.chunks_exact_mut(n) {
        f(T::ld(a)).st(a);
    }
}

/// `acc = acc (op) x`, element-wise.
fn combine(dt: Dt, op: Op, acc: &mut [u8], x: &[u8]) {
    macro_rules! int {
        ($t:ty) => {
            match op {
                Op::Sum | Op::Avg => map2::<$t>(acc, x, |a, b| a.wrapping_add(b)),
                Op::Prod => map2::<$t>(acc, x, |a, b| a.wrapping_mul(b)),
                Op::Max => map2::<$t>(acc, x, |a, b| a.max(b)),
                Op::Min => map2::<$t>(acc, x, |a, b| a.min(b)),
            }
        };
    }
    macro_rules! flt {
        ($t:ty) => {
            match op {
                Op::Sum | Op::Avg => map2::<$t>(acc, x, |a, b| a + b),
                Op::Prod => map2::<$t>(acc, x, |a, b| a * b),
                Op::Max => map2::<$t>(acc, x, |a, b| a.max(b)),
                Op::Min => map2::<$t>(acc, x, |a, b| a.min(b)),
            }
        };
    }
    macro_rules! half {
        ($t:ty) => {
            match op {
                Op::Sum | Op::Avg => {
                    map2::<$t>(acc, x, |a, b| <$t>::from_f32(a.to_f32() + b.to_f32()))
                }
                Op::Prod => map2::<$t>(acc, x, |a, b| <$t>::from_f32(a.to_f32() * b.to_f32())),
                Op::Max => map2::<$t>(acc, x, |a, b| <$t>::from_f32(a.to_f32().max(b.to_f32()))),
                Op::Min => map2::<$t>(acc, x, |a, b| <$t>::from_f32(a.to_f32().min(b.to_f32()))),
            }
        };
    }
    match dt {
        Dt::I8 => int!(i8),
        Dt::U8 => int!(u8),
        Dt::I32 => int!(i32),
        Dt::U32 => int!(u32),
        Dt::I64 => int!(i64),
        Dt::U64 => int!(u64),
        Dt::F32 => flt!(f32),
        Dt::F64 => flt!(f64),
        Dt::F16 => half!(f16),
        Dt::Bf16 => half!(bf16),
    }
}

/// NCCL's average of floats: each input is multiplied by `1/n` (in its own
/// type) before the sum.
fn premul(dt: Dt, x: &mut [u8], n: usize) {
    match dt {
        Dt::F32 => {
            let s = 1.0f32 / n as f32;
            map1::<f32>(x, |a| a * s)
        }
        Dt::F64 => {
            let s = 1.0f64 / n as f64;
            map1::<f64>(x, |a| a * s)
        }
        Dt::F16 => {
            let s = f16::from_f32(1.0 / n as f32).to_f32();
            map1::<f16>(x, |a| f16::from_f32(a.to_f32() * s))
        }
        Dt::Bf16 => {
            let s = bf16::from_f32(1.0 / n as f32).to_f32();
            map1::<bf16>(x, |a| bf16::from_f32(a.to_f32() * s))
        }
        _ => {}
    }
}

/// NCCL's average of integers: the sum divided by `n`.
fn postdiv(dt: Dt, x: &mut [u8], n: usize) {
    let n = n as i128;
    macro_rules! div {
        ($t:ty) => {
            map1::<$t>(x, |a| (a as i128 / n) as $t)
        };
    }
    match dt {
        Dt::I8 => div!(i8),
        Dt::U8 => div!(u8),
        Dt::I32 => div!(i32),
        Dt::U32 => div!(u32),
        Dt::I64 => div!(i64),
        Dt::U64 => div!(u64),
        _ => {}
    }
}

/// Reduces `inputs` in rank order.
fn reduce(dt: Dt, op: Op, inputs: &[Vec<u8>]) -> Vec<u8> {
    let n = inputs.len();
    let avg_f = op == Op::Avg && dt.is_float();
    let mut acc = inputs[0].clone();
    if avg_f {
        premul(dt, &mut acc, n);
    }
    for x in &inputs[1..] {
        if avg_f {
            let mut y = x.clone();
            premul(dt, &mut y, n);
            combine(dt, Op::Sum, &mut acc, &y);
        } else {
            combine(dt, op, &mut acc, x);
        }
    }
    if op == Op::Avg && !dt.is_float() {
        postdiv(dt, &mut acc, n);
    }
    acc
}

// ---------------------------------------------------------------- worlds

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AlltoAll,
    Gather,
    Scatter,
}

impl Kind {
    fn reduces(self) -> bool {
        matches!(self, Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter)
    }

    fn rooted(self) -> bool {
        matches!(
            self,
            Kind::Broadcast | Kind::Reduce | Kind::Gather | Kind::Scatter
        )
    }

    /// (send, recv) sizes in elements for `rank`; 0 when unused.
    fn sizes(self, count: usize, n: usize, is_root: bool) -> Option<(usize, usize)> {
        let nc = count.checked_mul(n)?;
        let root = |v: usize| if is_root { v } else { 0 };
        Some(match self {
            Kind::AllReduce => (count, count),
            Kind::Broadcast => (root(count), count),
            Kind::Reduce => (count, root(count)),
            Kind::AllGather => (count, nc),
            Kind::ReduceScatter => (nc, count),
            Kind::AlltoAll => (nc, nc),
            Kind::Gather => (count, root(nc)),
            Kind::Scatter => (root(nc), count),
        })
    }
}

#[derive(Debug, Clone, Copy)]
struct Desc {
    kind: Kind,
    send: u64,
    recv: u64,
    count: usize,
    dt: Dt,
    op: Op,
    root: usize,
}

struct Slot {
    descs: Vec<Option<Desc>>,
    done: bool,
    error: Option<(ncclResult_t, String)>,
    left: usize,
}

struct Msg {
    data: Vec<u8>,
    count: usize,
    dt: Dt,
}

struct SplitEntry {
    color: i32,
    key: i32,
    comm: Option<Arc<Comm>>,
}

struct WorldSt {
    aborted: Vec<bool>,
    /// The highest collective sequence number each rank has launched.
    launched: Vec<u64>,
    /// Point-to-point operations launched, by (source, destination, is the
    /// send side).
    p2p: BTreeMap<(usize, usize, bool), u64>,
    slots: BTreeMap<u64, Slot>,
    mail: BTreeMap<(usize, usize), VecDeque<Msg>>,
    splits: BTreeMap<u64, Vec<Option<SplitEntry>>>,
}

/// The ranks of one communicator, once all have joined.
struct World {
    n: usize,
    /// Each rank's device.
    devices: Vec<i32>,
    st: Mutex<WorldSt>,
    cv: Condvar,
}

impl World {
    fn new(devices: Vec<i32>) -> Arc<World> {
        let n = devices.len();
        Arc::new(World {
            n,
            devices,
            st: Mutex::new(WorldSt {
                aborted: vec![false; n],
                launched: vec![0; n],
                p2p: BTreeMap::new(),
                slots: BTreeMap::new(),
                mail: BTreeMap::new(),
                splits: BTreeMap::new(),
            }),
            cv: Condvar::new(),
        })
    }
}

type CollErr = (ncclResult_t, String);

fn illegal() -> CollErr {
    (
        ncclResult_t::ncclUnhandledCudaError,
        "illegal memory access: a buffer was freed while an operation used it".into(),
    )
}

/// A copy of `[p, p + len)`, read while the range is held live.
fn read(p: u64, len: usize) -> Result<Vec<u8>, CollErr> {
    let mut v = vec![0u8; len];
    let to = v.as_mut_ptr() as usize as u64;
    // SAFETY: `[p, p + len)` is a live device allocation for the whole copy
    // (`access` holds the registry until it returns) and `v` holds `len`
    // bytes.
    memory::access(&[Span::device(p, len)], || unsafe {
        memory::copy(to, p, len)
    })
    .ok_or_else(illegal)?;
    Ok(v)
}

/// Writes every `(destination, bytes)` pair, all or none: only if every
/// destination is live, held live until the last byte is written.
fn write_all(writes: &[(u64, Vec<u8>)]) -> Result<(), CollErr> {
    let spans: Vec<Span> = writes
        .iter()
        .map(|(p, v)| Span::device(*p, v.len()))
        .collect();
    memory::access(&spans, || {
        for (p, v) in writes {
            // SAFETY: every destination is a live device allocation for the
            // whole loop (`access` holds the registry) and `v` holds the
            // bytes to copy.
            unsafe { memory::copy(*p, v.as_ptr() as usize as u64, v.len()) };
        }
    })
    .ok_or_else(illegal)
}

/// Computes a collective from every rank's descriptor and writes outputs.
fn compute(descs: &[Desc]) -> Result<(), CollErr> {
    let n = descs.len();
    let d0 = descs[0];
    if descs.iter().any(|d| {
        d.kind != d0.kind
            || d.count != d0.count
            || d.dt != d0.dt
            || d.op != d0.op
            || d.root != d0.root
    }) {
        return Err((
            ncclResult_t::ncclInvalidUsage,
            format!("mismatched {:?} arguments across ranks", d0.kind),
        ));
    }
    let b = d0.count * d0.dt.size();
    let root = d0.root;
    let mut writes: Vec<(u64, Vec<u8>)> = Vec::new();
    match d0.kind {
        Kind::AllReduce | Kind::Reduce => {
            let ins = descs
                .iter()
                .map(|d| read(d.send, b))
                .collect::<Result<Vec<_>, _>>()?;
            let acc = reduce(d0.dt, d0.op, &ins);
            if d0.kind == Kind::AllReduce {
                writes.extend(descs.iter().map(|d| (d.recv, acc.clone())));
            } else {
                writes.push((descs[root].recv, acc));
            }
        }
        Kind::Broadcast => {
            let data = read(descs[root].send, b)?;
            writes.extend(descs.iter().map(|d| (d.recv, data.clone())));
        }
        Kind::AllGather | Kind::Gather => {
            let mut all = Vec::with_capacity(b * n);
            for d in descs {
                all.extend(read(d.send, b)?);
            }
            if d0.kind == Kind::AllGather {
                writes.extend(descs.iter().map(|d| (d.recv, all.clone())));
            } else {
                writes.push((descs[root].recv, all));
            }
        }
        Kind::ReduceScatter => {
            let ins = descs
                .iter()
                .map(|d| read(d.send, b * n))
                .collect::<Result<Vec<_>, _>>()?;
            let acc = reduce(d0.dt, d0.op, &ins);
            for (r, d) in descs.iter().enumerate() {
                writes.push((d.recv, acc[r * b..(r + 1) * b].to_vec()));
            }
        }
        Kind::AlltoAll => {
            let ins = descs
                .iter()
                .map(|d| read(d.send, b * n))
                .collect::<Result<Vec<_>, _>>()?;
            for (r, d) in descs.iter().enumerate() {
                let mut o = Vec::with_capacity(b * n);
                for x in &ins {
                    o.extend_from_slice(&x[r * b..(r + 1) * b]);
                }
                writes.push((d.recv, o));
            }
        }
        Kind::Scatter => {
            let all = read(descs[root].send, b * n)?;
            for (r, d) in descs.iter().enumerate() {
                writes.push((d.recv, all[r * b..(r + 1) * b].to_vec()));
            }
        }
    }
    write_all(&writes)
}

// ---------------------------------------------------------------- comms

struct CommSt {
    rank: i32,
    nranks: i32,
    world: Option<Arc<World>>,
    async_err: Option<ncclResult_t>,
    last: Option<(u64, &'static CStr)>,
    inflight: u64,
    /// Background enqueues of a non-blocking communicator not yet done.
    pending: u32,
    finalizing: bool,
    regs: BTreeSet<u64>,
    wins: BTreeSet<u64>,
}

/// A communicator's strong stream, NCCL's `sharedRes->deviceStream`:
/// every launch of the communicator (an operation outside a group, or the
/// communicator's part of a group, eager or replayed from a graph) takes
/// the next ticket when it is launched, and its work, on whatever stream,
/// first waits until every earlier ticket is done. NCCL 2.28.3 makes the
/// launch stream wait on the strong stream before each kernel and advances
/// the strong stream to the kernel's completion after it (`src/enqueue.cc`,
/// `ncclLaunchPrepare` and `ncclLaunchFinish`), so a communicator's work
/// runs in issue order across streams. Communicators split with
/// `splitShare` share their parent's chain (`commAlloc` in `src/init.cc`
/// reuses `parent->sharedRes`).
struct Chain {
    st: Mutex<ChainSt>,
    cv: Condvar,
}

struct ChainSt {
    /// The next ticket to hand out.
    next: u64,
    /// Every ticket below this one is done.
    done_below: u64,
    /// Tickets at or above `done_below` that are done (out of order: one
    /// dropped by an abort before an earlier one ran).
    done: BTreeSet<u64>,
}

impl Chain {
    fn new() -> Arc<Chain> {
        Arc::new(Chain {
            st: Mutex::new(ChainSt {
                next: 0,
                done_below: 0,
                done: BTreeSet::new(),
            }),
            cv: Condvar::new(),
        })
    }

    /// The next place in the chain; it is done when the ticket is dropped.
    fn take(self: &Arc<Self>) -> Arc<Ticket> {
        let mut st = self.st.lock();
        let n = st.next;
        st.next += 1;
        Arc::new(Ticket {
            chain: self.clone(),
            n,
        })
    }

    fn complete(&self, n: u64) {
        let mut st = self.st.lock();
        st.done.insert(n);
        loop {
            let next = st.done_below;
            if !st.done.remove(&next) {
                break;
            }
            st.done_below += 1;
        }
        self.cv.notify_all();
    }

    fn wake(&self) {
        let _st = self.st.lock();
        self.cv.notify_all();
    }
}

/// A launch's place in its communicator's chain, shared by the launch's
/// work items; done (and the chain advances) when the last is dropped,
/// whether it ran or was dropped unrun.
struct Ticket {
    chain: Arc<Chain>,
    n: u64,
}

impl Ticket {
    /// Waits until every earlier launch on the chain is done; false when
    /// `comm` is aborted first.
    fn wait_turn(&self, comm: &Comm) -> bool {
        let mut st = self.chain.st.lock();
        while st.done_below < self.n {
            if comm.aborted() {
                return false;
            }
            self.chain.cv.wait_for(&mut st, TICK);
        }
        true
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.chain.complete(self.n);
    }
}

/// The parts of an `ncclConfig_t` the emulator uses.
#[derive(Debug, Clone, Copy)]
struct Cfg {
    blocking: bool,
    /// `splitShare`: children split from this communicator share its
    /// resources (its strong stream among them).
    split_share: bool,
}

/// One rank's communicator.
struct Comm {
    id: u64,
    device: i32,
    blocking: bool,
    /// Children split from it share its chain (`config.splitShare`).
    split_share: bool,
    /// Its strong stream; shared with the parent when split with
    /// `splitShare`.
    chain: Arc<Chain>,
    /// Never joined (`nojoin` fault): its operations block until abort.
    ghost: bool,
    aborted: AtomicBool,
    /// Crashed (`die` fault): every call fails with `ncclSystemError`.
    dead: AtomicBool,
    seq: AtomicU64,
    split_seq: AtomicU64,
    /// Children of a split still waiting for their peers: aborting this
    /// communicator aborts them too (NCCL's `childAbortFlag`).
    splitting: Mutex<Vec<Arc<Comm>>>,
    /// A non-blocking communicator's first operation has been enqueued
    /// (NCCL connects lazily at first use).
    connected: AtomicBool,
    st: Mutex<CommSt>,
    cv: Condvar,
}

impl Comm {
    fn new(
        device: i32,
        cfg: Cfg,
        chain: Arc<Chain>,
        ghost: bool,
        rank: i32,
        nranks: i32,
    ) -> Arc<Comm> {
        Arc::new(Comm {
            id: new_id(),
            device,
            blocking: cfg.blocking,
            split_share: cfg.split_share,
            chain,
            ghost,
            aborted: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            seq: AtomicU64::new(0),
            split_seq: AtomicU64::new(0),
            splitting: Mutex::new(Vec::new()),
            connected: AtomicBool::new(false),
            st: Mutex::new(CommSt {
                rank,
                nranks,
                world: None,
                async_err: None,
                last: None,
                inflight: 0,
                pending: 0,
                finalizing: false,
                regs: BTreeSet::new(),
                wins: BTreeSet::new(),
            }),
            cv: Condvar::new(),
        })
    }

    fn handle(&self) -> ncclComm_t {
        id_to_ptr::<ncclComm>(self.id)
    }

    fn aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    fn set_world(&self, rank: i32, nranks: i32, w: Arc<World>) {
        let mut st = self.st.lock();
        st.rank = rank;
        st.nranks = nranks;
        st.world = Some(w);
        self.cv.notify_all();
    }

    fn set_async(&self, code: ncclResult_t, msg: &str) {
        let m = record(intern(&format!("emulated NCCL: {msg}")));
        let mut st = self.st.lock();
        st.async_err.get_or_insert(code);
        st.last = Some(m);
    }

    /// Counts an enqueue call of a blocking communicator; at an injected
    /// `stall` it waits for an abort and then fails, as a blocking NCCL
    /// call stuck in connection set-up does.
    fn enqueue_call(&self) -> R<()> {
        if !self.blocking {
            return Ok(());
        }
        let rank = self.st.lock().rank;
        if fault::take_stall(rank) {
            self.wait_aborted();
            return fail(
                ncclResult_t::ncclInternalError,
                "connection set-up abandoned: the communicator was aborted",
            );
        }
        Ok(())
    }

    fn wait_aborted(&self) {
        let mut st = self.st.lock();
        while !self.aborted() {
            self.cv.wait_for(&mut st, TICK);
        }
    }

    fn wait_ready(&self) {
        let mut st = self.st.lock();
        while st.world.is_none() && !self.aborted() {
            self.cv.wait_for(&mut st, TICK);
        }
    }

    /// (rank, nranks, world) of a ready communicator.
    fn ready(&self) -> R<(usize, usize, Option<Arc<World>>)> {
        let st = self.st.lock();
        if st.world.is_none() && !self.ghost {
            return fail(
                ncclResult_t::ncclInvalidArgument,
                "attempt to use a communicator before its initialization completed",
            );
        }
        Ok((st.rank as usize, st.nranks as usize, st.world.clone()))
    }

    /// Refuses a call while an earlier background enqueue of this
    /// (non-blocking) communicator is pending: the user must first poll
    /// `ncclCommGetAsyncError` until it leaves `ncclInProgress`.
    fn idle(&self) -> R<()> {
        if self.st.lock().pending > 0 {
            return fail(
                ncclResult_t::ncclInvalidUsage,
                "previous operation still in progress (non-blocking communicator)",
            );
        }
        Ok(())
    }
}

/// Counts one in-flight operation of a communicator until dropped.
struct Inflight(Arc<Comm>);

impl Drop for Inflight {
    fn drop(&mut self) {
        let mut st = self.0.st.lock();
        st.inflight = st.inflight.saturating_sub(1);
        self.0.cv.notify_all();
    }
}

static COMMS: Table<Comm> = Table::new();
static ABORTED: Mutex<BTreeSet<u64>> = Mutex::new(BTreeSet::new());

struct Pending {
    nranks: i32,
    members: Vec<Option<Arc<Comm>>>,
}

static PENDING: Mutex<BTreeMap<[u8; 128], Pending>> = Mutex::new(BTreeMap::new());

fn lookup_any(h: ncclComm_t) -> R<Arc<Comm>> {
    if h.is_null() {
        return fail(ncclResult_t::ncclInvalidArgument, "comm is NULL");
    }
    let id = ptr_to_id(h);
    if let Some(c) = COMMS.get(id) {
        return Ok(c);
    }
    if ABORTED.lock().contains(&id) {
        fail(
            ncclResult_t::ncclInvalidUsage,
            "communicator was aborted (ncclCommAbort frees it)",
        )
    } else {
        fail(ncclResult_t::ncclInvalidArgument, "unknown communicator")
    }
}

fn lookup(h: ncclComm_t) -> R<Arc<Comm>> {
    let c = lookup_any(h)?;
    if c.dead.load(Ordering::Acquire) {
        return fail(
            ncclResult_t::ncclSystemError,
            "communicator crashed (injected fault)",
        );
    }
    Ok(c)
}

fn key_of(id: &ncclUniqueId) -> [u8; 128] {
    id.internal.map(|c| c as u8)
}

/// Adds `comm` to the ranks of `key`; the last to join completes the world.
fn join(key: [u8; 128], nranks: i32, rank: i32, comm: &Arc<Comm>) -> R<()> {
    let mut p = PENDING.lock();
    let e = p.entry(key).or_insert_with(|| Pending {
        nranks,
        members: vec![None; nranks as usize],
    });
    if e.nranks != nranks {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("nranks {nranks} differs from {} of other ranks", e.nranks),
        );
    }
    let slot = &mut e.members[rank as usize];
    if slot.is_some() {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("rank {rank} joined twice"),
        );
    }
    *slot = Some(comm.clone());
    if e.members.iter().all(Option::is_some) {
        let members = p.remove(&key).map(|e| e.members).unwrap_or_default();
        let w = World::new(
            members
                .iter()
                .map(|m| m.as_ref().map_or(-1, |m| m.device))
                .collect(),
        );
        for (r, m) in members.into_iter().enumerate() {
            if let Some(m) = m {
                m.set_world(r as i32, nranks, w.clone());
            }
        }
    }
    Ok(())
}

fn unjoin(comm: &Arc<Comm>) {
    let mut p = PENDING.lock();
    p.retain(|_, e| {
        for m in e.members.iter_mut() {
            if m.as_ref().is_some_and(|x| Arc::ptr_eq(x, comm)) {
                *m = None;
            }
        }
        e.members.iter().any(Option::is_some)
    });
}

/// `NCCL_COMM_SPLIT_SHARE_RESOURCES`, which overrides every config's
/// `splitShare` when set (`parseCommConfig` in NCCL's `src/init.cc`).
fn split_share_env() -> Option<bool> {
    let v = std::env::var("NCCL_COMM_SPLIT_SHARE_RESOURCES").ok()?;
    v.trim().parse::<i32>().ok().map(|n| n == 1)
}

/// The config's blocking mode and `splitShare`, from an optional config;
/// `default` for a null one (a split's null config copies the parent's).
///
/// # Safety
/// `cfg` is null or points to a config of at least `cfg.size` bytes.
unsafe fn parse_config(cfg: *const ncclConfig_t, default: Cfg) -> R<Cfg> {
    if cfg.is_null() {
        return Ok(default);
    }
    // SAFETY: `cfg` points to a config (this function's contract); its
    // leading `size` and `magic` fields are present in every version.
    let (size, magic) = unsafe { ((*cfg).size, (*cfg).magic) };
    if magic != CONFIG_MAGIC {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("config magic {magic:#x} is not 0xcafebeef: use NCCL_CONFIG_INITIALIZER"),
        );
    }
    if !(20..=4096).contains(&size) {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("config size {size} is invalid"),
        );
    }
    // SAFETY: the config holds at least 20 bytes, so `blocking` is present.
    let b = unsafe { (*cfg).blocking };
    let share_end = std::mem::offset_of!(ncclConfig_t, splitShare) + size_of::<c_int>();
    let share = if size >= share_end {
        // SAFETY: the config holds `size` bytes, past `splitShare`.
        unsafe { (*cfg).splitShare }
    } else {
        i32::MIN
    };
    Ok(Cfg {
        blocking: b == i32::MIN || b != 0,
        split_share: split_share_env().unwrap_or(share == 1),
    })
}

/// The config of a communicator made by an init call.
///
/// # Safety
/// As [`parse_config`].
unsafe fn init_config(cfg: *const ncclConfig_t) -> R<Cfg> {
    let default = Cfg {
        blocking: true,
        split_share: split_share_env().unwrap_or(false),
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { parse_config(cfg, default) }
}

// ---------------------------------------------------------------- groups

struct GroupItem {
    target: Target,
    is_send: bool,
    comm: Arc<Comm>,
    body: Arc<Body>,
}

#[derive(Default)]
struct Grp {
    depth: u32,
    items: Vec<GroupItem>,
    inits: Vec<Arc<Comm>>,
    err: Option<ncclResult_t>,
}

thread_local! {
    static GROUP: RefCell<Grp> = RefCell::new(Grp::default());
}

fn in_group() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

/// Records a failure of a grouped call so that the group end reports it.
fn grouped<T>(r: R<T>) -> R<T> {
    if let Err(e) = &r {
        GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.depth > 0 && g.err.is_none() {
                g.err = Some(*e);
            }
        });
    }
    r
}

fn group_end() -> R<ncclResult_t> {
    let taken = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return None;
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Some(None);
        }
        Some(Some((
            std::mem::take(&mut g.items),
            std::mem::take(&mut g.inits),
            g.err.take(),
        )))
    });
    let (items, inits, gerr) = match taken {
        None => {
            return fail(
                ncclResult_t::ncclInvalidUsage,
                "ncclGroupEnd without ncclGroupStart",
            );
        }
        Some(None) => return Ok(ncclResult_t::ncclSuccess),
        Some(Some(t)) => t,
    };
    if let Some(e) = gerr {
        return Err(e);
    }
    let mut involved: Vec<&Arc<Comm>> = Vec::new();
    for it in &items {
        if !involved.iter().any(|c| Arc::ptr_eq(c, &it.comm)) {
            involved.push(&it.comm);
        }
    }
    for c in involved {
        c.enqueue_call()?;
    }
    // One task per stream, sends first, streams in order of first use.
    let mut per: Vec<(Target, Vec<GroupItem>)> = Vec::new();
    for it in items {
        match per
            .iter_mut()
            .find(|(t, _)| Arc::ptr_eq(&t.stream, &it.target.stream))
        {
            Some((_, v)) => v.push(it),
            None => {
                let t = Target {
                    stream: it.target.stream.clone(),
                    sync: it.target.sync,
                };
                per.push((t, vec![it]));
            }
        }
    }
    for (_, v) in per.iter_mut() {
        v.sort_by_key(|it| !it.is_send);
    }
    let deferred = per
        .iter()
        .any(|(t, v)| !t.stream.capturing() && v.iter().any(|it| !it.comm.blocking));
    let mut result = ncclResult_t::ncclSuccess;
    // The group is one launch per communicator: its items on every stream
    // share one ticket of the communicator's chain (one per chain, see
    // `Tickets`). Work recorded on a capturing stream takes its tickets at
    // each graph launch instead.
    let mut tickets = Tickets::default();
    let recorded = |t: &Target, v: Vec<GroupItem>| {
        let items = v.into_iter().map(|it| (it.comm, it.body)).collect();
        stream::enqueue(t, group_launcher(items));
    };
    if deferred {
        let mut job = Job::default();
        for (t, v) in per {
            if t.stream.capturing() {
                recorded(&t, v);
                continue;
            }
            let mut works = Vec::with_capacity(v.len());
            for it in v {
                let (w, need) = launch(&it.comm, &it.body, tickets.of(&it.comm));
                job.add_comm(&it.comm, need);
                works.push((it.comm, w));
            }
            job.items.push((t, works));
        }
        drop(tickets);
        defer(job);
        result = ncclResult_t::ncclInProgress;
    } else {
        let mut waits = Vec::new();
        for (t, v) in per {
            if t.stream.capturing() {
                recorded(&t, v);
                continue;
            }
            let works = v
                .iter()
                .map(|it| launch(&it.comm, &it.body, tickets.of(&it.comm)).0)
                .collect();
            stream::push_launched(&t, sequence(works));
            if t.sync {
                waits.push(t.stream);
            }
        }
        drop(tickets);
        for s in waits {
            s.wait_idle().map_err(|e| {
                err(
                    ncclResult_t::ncclUnhandledCudaError,
                    format!("stream error {}", e.0),
                )
            })?;
        }
    }
    for c in inits {
        if c.blocking {
            c.wait_ready();
        } else if c.st.lock().world.is_none() {
            result = ncclResult_t::ncclInProgress;
        }
    }
    Ok(result)
}

// ---------------------------------------------------------------- operations

enum Body {
    Coll(Desc),
    Send {
        peer: usize,
        buf: u64,
        count: usize,
        dt: Dt,
    },
    Recv {
        peer: usize,
        buf: u64,
        count: usize,
        dt: Dt,
    },
}

/// The tickets of one group launch, one per chain: communicators that
/// share a chain (a `splitShare` family) share the group's ticket, so the
/// group's items, which run in one task per stream with sends first, never
/// wait for one another through the chain. (NCCL launches such
/// communicators' kernels one after another; in one task that order
/// would make a send wait for a recv queued behind it.)
#[derive(Default)]
struct Tickets(Vec<Arc<Ticket>>);

impl Tickets {
    /// The ticket of `comm`'s chain in this launch, taken at its first use.
    fn of(&mut self, comm: &Arc<Comm>) -> Arc<Ticket> {
        if let Some(t) = self.0.iter().find(|t| Arc::ptr_eq(&t.chain, &comm.chain)) {
            return t.clone();
        }
        let t = comm.chain.take();
        self.0.push(t.clone());
        t
    }
}

/// Work items run in order as one task.
fn sequence(works: Vec<Work>) -> Work {
    Box::new(move || {
        for w in works {
            w();
        }
    })
}

/// A launcher of `body` for the stream (immediate launch or capture): each
/// launch takes the next ticket of the communicator's chain.
fn launcher(comm: Arc<Comm>, body: Arc<Body>) -> Launcher {
    Arc::new(move || launch(&comm, &body, comm.chain.take()).0)
}

/// A launcher of a group's items on one capturing stream: each launch (each
/// graph launch) takes one ticket per chain for all its items.
fn group_launcher(items: Vec<(Arc<Comm>, Arc<Body>)>) -> Launcher {
    Arc::new(move || {
        let mut tickets = Tickets::default();
        let works = items
            .iter()
            .map(|(c, b)| launch(c, b, tickets.of(c)).0)
            .collect();
        sequence(works)
    })
}

/// What a non-blocking communicator's first operation waits for before it
/// is enqueued: its peers' matching launches.
enum Need {
    /// Never satisfied: the communicator has no world (it never joined).
    Never,
    /// Every rank launched collective `seq`.
    Coll { world: Arc<World>, seq: u64 },
    /// At least `k` launches on the `(src, dst, send side)` counter.
    P2p {
        world: Arc<World>,
        key: (usize, usize, bool),
        k: u64,
    },
}

impl Need {
    fn met(&self) -> bool {
        match self {
            Need::Never => false,
            Need::Coll { world, seq } => world.st.lock().launched.iter().all(|s| s >= seq),
            Need::P2p { world, key, k } => world.st.lock().p2p.get(key).copied().unwrap_or(0) >= *k,
        }
    }
}

/// Launches `body` now as part of the launch holding `ticket`: takes its
/// sequence number, registers the launch with the world (for lazy
/// connection), takes its fault, counts it in flight until its work runs or
/// is dropped, and returns the work with what a first operation waits for.
/// The work first waits for its turn on the communicator's chain; aborted
/// meanwhile, it ends without touching memory.
fn launch(comm: &Arc<Comm>, body: &Arc<Body>, ticket: Arc<Ticket>) -> (Work, Need) {
    let seq = match **body {
        Body::Coll(_) => comm.seq.fetch_add(1, Ordering::AcqRel) + 1,
        _ => 0,
    };
    let (rank, world) = {
        let mut st = comm.st.lock();
        st.inflight += 1;
        (st.rank, st.world.clone())
    };
    let g = Inflight(comm.clone());
    let need = match world {
        None => Need::Never,
        Some(world) => {
            let r = rank as usize;
            let need = {
                let mut ws = world.st.lock();
                match **body {
                    Body::Coll(_) => {
                        if let Some(l) = ws.launched.get_mut(r) {
                            *l = (*l).max(seq);
                        }
                        None
                    }
                    Body::Send { peer, .. } => {
                        let c = ws.p2p.entry((r, peer, true)).or_default();
                        *c += 1;
                        Some(((r, peer, false), *c))
                    }
                    Body::Recv { peer, .. } => {
                        let c = ws.p2p.entry((peer, r, false)).or_default();
                        *c += 1;
                        Some(((peer, r, true), *c))
                    }
                }
            };
            match need {
                None => Need::Coll { world, seq },
                Some((key, k)) => Need::P2p { world, key, k },
            }
        }
    };
    let f = fault::take_op(rank);
    if f == Some(Fault::Die) {
        comm.dead.store(true, Ordering::Release);
    }
    let comm = comm.clone();
    let body = body.clone();
    let work: Work = Box::new(move || {
        let _g = g;
        if ticket.wait_turn(&comm) {
            run(&comm, seq, f, &body);
        }
        drop(ticket);
    });
    (work, need)
}

/// Launched work and the communicator it belongs to.
type CommWork = (Arc<Comm>, Work);

/// Work of non-blocking communicators that NCCL's background thread
/// enqueues later.
#[derive(Default)]
struct Job {
    /// Per stream, in call order: each communicator's launched work.
    items: Vec<(Target, Vec<CommWork>)>,
    /// The non-blocking communicators involved, each once.
    comms: Vec<Arc<Comm>>,
    /// What first operations wait for, by communicator.
    needs: Vec<(Arc<Comm>, Need)>,
}

impl Job {
    /// Notes `comm`'s part in the job; a not yet connected non-blocking
    /// communicator's operation waits for `need`.
    fn add_comm(&mut self, comm: &Arc<Comm>, need: Need) {
        if comm.blocking {
            return;
        }
        if !self.comms.iter().any(|c| Arc::ptr_eq(c, comm)) {
            self.comms.push(comm.clone());
        }
        if !comm.connected.load(Ordering::Acquire) {
            self.needs.push((comm.clone(), need));
        }
    }
}

/// Marks `comms` as no longer pending (and connected).
fn finish(comms: &[Arc<Comm>]) {
    for c in comms {
        c.connected.store(true, Ordering::Release);
        let mut st = c.st.lock();
        st.pending = st.pending.saturating_sub(1);
        c.cv.notify_all();
    }
}

/// Hands `job` to a background thread that enqueues it after a short
/// random delay and, for first operations, once the peers' matching
/// operations are launched; until then its communicators are pending.
/// Work of a communicator aborted meanwhile is dropped, not enqueued.
fn defer(job: Job) {
    for c in &job.comms {
        c.st.lock().pending += 1;
    }
    let comms = job.comms.clone();
    let spawned = std::thread::Builder::new()
        .name("emu-nccl-enqueue".into())
        .spawn(move || {
            use rand::Rng;
            let delay = rand::rng().random_range(200..2000);
            std::thread::sleep(Duration::from_micros(delay));
            loop {
                let waiting = job.needs.iter().any(|(c, n)| !c.aborted() && !n.met());
                if !waiting || job.comms.iter().all(|c| c.aborted()) {
                    break;
                }
                std::thread::sleep(POLL);
            }
            for (t, works) in job.items {
                let works: Vec<Work> = works
                    .into_iter()
                    .filter(|(c, _)| !c.aborted())
                    .map(|(_, w)| w)
                    .collect();
                if !works.is_empty() {
                    stream::push_launched(&t, sequence(works));
                }
            }
            finish(&job.comms);
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "could not start the emulated NCCL enqueue thread");
        for c in &comms {
            c.set_async(
                ncclResult_t::ncclSystemError,
                "could not start the background enqueue thread",
            );
        }
        finish(&comms);
    }
}

fn run(comm: &Arc<Comm>, seq: u64, f: Option<Fault>, body: &Body) {
    if matches!(f, Some(Fault::Hang | Fault::Die)) {
        comm.wait_aborted();
        return;
    }
    if driver::sticky(comm.device).is_err() {
        // The context is broken: NCCL's kernel cannot run, and NCCL reports
        // the CUDA error; the peers wait for this rank, as on GPUs.
        comm.set_async(
            ncclResult_t::ncclUnhandledCudaError,
            "the device has a sticky CUDA error (work touched memory that is not allocated)",
        );
        return;
    }
    let (rank, world) = {
        let st = comm.st.lock();
        (st.rank as usize, st.world.clone())
    };
    let Some(world) = world else {
        comm.wait_aborted();
        return;
    };
    let outcome = match body {
        Body::Coll(d) => run_coll(&world, rank, seq, *d),
        Body::Send {
            peer,
            buf,
            count,
            dt,
        } => run_send(&world, rank, *peer, *buf, *count, *dt),
        Body::Recv {
            peer,
            buf,
            count,
            dt,
        } => run_recv(&world, rank, *peer, *buf, *count, *dt),
    };
    match outcome {
        Some(Ok(())) if f == Some(Fault::Async) => {
            comm.set_async(ncclResult_t::ncclSystemError, "injected asynchronous error");
        }
        Some(Err((code, msg))) => comm.set_async(code, &msg),
        _ => {}
    }
}

/// `None` when the rank aborted before the collective completed.
fn run_coll(w: &World, r: usize, seq: u64, d: Desc) -> Option<Result<(), CollErr>> {
    let n = w.n;
    let mut st = w.st.lock();
    if st.aborted[r] {
        return None;
    }
    let any_aborted = st.aborted.iter().any(|a| *a);
    let slot = st.slots.entry(seq).or_insert_with(|| Slot {
        descs: vec![None; n],
        done: false,
        error: None,
        left: 0,
    });
    slot.descs[r] = Some(d);
    if !slot.done && !any_aborted && slot.descs.iter().all(Option::is_some) {
        let descs: Vec<Desc> = slot.descs.iter().flatten().copied().collect();
        slot.error = compute(&descs).err();
        slot.done = true;
        w.cv.notify_all();
    }
    loop {
        let aborted = st.aborted[r];
        let slot = st.slots.get_mut(&seq)?;
        if slot.done {
            slot.left += 1;
            let e = slot.error.clone();
            if slot.left == n {
                st.slots.remove(&seq);
            }
            return Some(e.map_or(Ok(()), Err));
        }
        if aborted {
            return None;
        }
        w.cv.wait_for(&mut st, TICK);
    }
}

fn run_send(
    w: &World,
    r: usize,
    peer: usize,
    buf: u64,
    count: usize,
    dt: Dt,
) -> Option<Result<(), CollErr>> {
    let mut st = w.st.lock();
    if st.aborted[r] {
        return None;
    }
    let data = match read(buf, count * dt.size()) {
        Ok(d) => d,
        Err(e) => return Some(Err(e)),
    };
    st.mail
        .entry((r, peer))
        .or_default()
        .push_back(Msg { data, count, dt });
    w.cv.notify_all();
    Some(Ok(()))
}

fn run_recv(
    w: &World,
    r: usize,
    peer: usize,
    buf: u64,
    count: usize,
    dt: Dt,
) -> Option<Result<(), CollErr>> {
    let mut st = w.st.lock();
    let m = loop {
        if st.aborted[r] {
            return None;
        }
        if let Some(m) = st.mail.get_mut(&(peer, r)).and_then(VecDeque::pop_front) {
            break m;
        }
        w.cv.wait_for(&mut st, TICK);
    };
    if m.count != count || m.dt != dt {
        return Some(Err((
            ncclResult_t::ncclInvalidUsage,
            format!(
                "recv of {count} {dt:?} from rank {peer} matched a send of {} {:?}",
                m.count, m.dt
            ),
        )));
    }
    Some(write_all(&[(buf, m.data)]))
}

/// Launches (or groups) an operation of `comm` on `stream`. A
/// non-blocking communicator's operation outside a group is enqueued in the
/// background: `ncclInProgress`.
fn submit_op(comm: &Arc<Comm>, stream: cudaStream_t, is_send: bool, body: Body) -> R<ncclResult_t> {
    let target = stream::resolve(stream, Some(comm.device)).map_err(|e| {
        err(
            ncclResult_t::ncclInvalidArgument,
            format!("invalid stream (CUDA error {})", e.0),
        )
    })?;
    let body = Arc::new(body);
    if in_group() {
        GROUP.with(|g| {
            g.borrow_mut().items.push(GroupItem {
                target,
                is_send,
                comm: comm.clone(),
                body,
            })
        });
        return Ok(ncclResult_t::ncclSuccess);
    }
    comm.enqueue_call()?;
    if !comm.blocking && !target.stream.capturing() {
        let (w, need) = launch(comm, &body, comm.chain.take());
        let mut job = Job::default();
        job.add_comm(comm, need);
        job.items.push((target, vec![(comm.clone(), w)]));
        defer(job);
        return Ok(ncclResult_t::ncclInProgress);
    }
    stream::submit(&target, launcher(comm.clone(), body)).map_err(|e| {
        err(
            ncclResult_t::ncclUnhandledCudaError,
            format!("stream error {}", e.0),
        )
    })?;
    Ok(ncclResult_t::ncclSuccess)
}

fn check_buf(p: u64, elems: usize, esz: usize, what: &str) -> R<()> {
    let Some(len) = elems.checked_mul(esz) else {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("{what}: size overflows"),
        );
    };
    if len > 0 && !range_ok(p, len, true) {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("{what} {p:#x} is not inside a live device allocation of {len} bytes"),
        );
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn coll(
    kind: Kind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dt: ncclDataType_t,
    op: ncclRedOp_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry(|| {
        grouped((|| {
            let c = lookup(comm)?;
            let (rank, n, _) = c.ready()?;
            c.idle()?;
            let dt = Dt::from_nccl(dt)?;
            let op = if kind.reduces() {
                Op::from_nccl(op)?
            } else {
                Op::Sum
            };
            let root = if kind.rooted() {
                if root < 0 || root as usize >= n {
                    return fail(
                        ncclResult_t::ncclInvalidArgument,
                        format!("root {root} is out of range for {n} ranks"),
                    );
                }
                root as usize
            } else {
                0
            };
            if count == 0 {
                return Ok(ncclResult_t::ncclSuccess);
            }
            let Some((sn, rn)) = kind.sizes(count, n, rank == root) else {
                return fail(ncclResult_t::ncclInvalidArgument, "count overflows");
            };
            let (s, r) = (send as usize as u64, recv as usize as u64);
            check_buf(s, sn, dt.size(), "sendbuff")?;
            check_buf(r, rn, dt.size(), "recvbuff")?;
            let d = Desc {
                kind,
                send: s,
                recv: r,
                count,
                dt,
                op,
                root,
            };
            submit_op(&c, stream, false, Body::Coll(d))
        })())
    })
}

fn p2p(
    is_send: bool,
    buf: u64,
    count: usize,
    dt: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry(|| {
        grouped((|| {
            let c = lookup(comm)?;
            let (_, n, _) = c.ready()?;
            c.idle()?;
            let dt = Dt::from_nccl(dt)?;
            if peer < 0 || peer as usize >= n {
                return fail(
                    ncclResult_t::ncclInvalidArgument,
                    format!("peer {peer} is out of range for {n} ranks"),
                );
            }
            if count == 0 {
                return Ok(ncclResult_t::ncclSuccess);
            }
            check_buf(
                buf,
                count,
                dt.size(),
                if is_send { "sendbuff" } else { "recvbuff" },
            )?;
            let peer = peer as usize;
            let body = if is_send {
                Body::Send {
                    peer,
                    buf,
                    count,
                    dt,
                }
            } else {
                Body::Recv {
                    peer,
                    buf,
                    count,
                    dt,
                }
            };
            submit_op(&c, stream, is_send, body)
        })())
    })
}

// ---------------------------------------------------------------- exports

/// `ncclGetVersion`: 22803.
///
/// # Safety
/// `version` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    entry(|| {
        // SAFETY: `version` is null or valid (this function's contract).
        unsafe { out(version, VERSION, "version") }?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclGetUniqueId`: 128 random bytes.
///
/// # Safety
/// `id` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut ncclUniqueId) -> ncclResult_t {
    entry(|| {
        use rand::Rng;
        let mut bytes = [0u8; 128];
        rand::rng().fill(&mut bytes[..]);
        let v = ncclUniqueId {
            internal: bytes.map(|b| b as c_char),
        };
        // SAFETY: `id` is null or valid (this function's contract).
        unsafe { out(id, v, "uniqueId") }?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// Shared body of the rank inits.
///
/// # Safety
/// `out_comm` is null or valid for a write; `cfg` is null or a valid config.
unsafe fn init_rank(
    out_comm: *mut ncclComm_t,
    nranks: c_int,
    id: &ncclUniqueId,
    rank: c_int,
    cfg: *const ncclConfig_t,
) -> R<ncclResult_t> {
    if out_comm.is_null() {
        return fail(ncclResult_t::ncclInvalidArgument, "comm is NULL");
    }
    // SAFETY: `cfg` is null or a valid config (this function's contract).
    let cfg = unsafe { init_config(cfg) }?;
    let blocking = cfg.blocking;
    if nranks < 1 {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("invalid nranks {nranks}"),
        );
    }
    if rank < 0 || rank >= nranks {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("rank {rank} is out of range for {nranks} ranks"),
        );
    }
    let f = fault::take_init(rank);
    if f == Some(Fault::InitFail) {
        return fail(ncclResult_t::ncclSystemError, "injected init failure");
    }
    let ghost = f == Some(Fault::NoJoin);
    let device = driver::current_device().unwrap_or(0);
    let comm = Comm::new(device, cfg, Chain::new(), ghost, rank, nranks);
    if !ghost {
        join(key_of(id), nranks, rank, &comm)?;
    }
    COMMS.insert_at(comm.id, comm.clone());
    // SAFETY: `out_comm` is non-null and valid (this function's contract).
    unsafe { put(out_comm, comm.handle()) };
    if in_group() {
        GROUP.with(|g| g.borrow_mut().inits.push(comm.clone()));
        return Ok(ncclResult_t::ncclSuccess);
    }
    if !blocking {
        return Ok(ncclResult_t::ncclInProgress);
    }
    if !ghost {
        comm.wait_ready();
    }
    Ok(ncclResult_t::ncclSuccess)
}

/// `ncclCommInitRank`: blocking init of one rank.
///
/// # Safety
/// `comm` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut ncclComm_t,
    nranks: c_int,
    comm_id: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    entry(|| {
        // SAFETY: `comm` is null or valid (this function's contract).
        grouped(unsafe { init_rank(comm, nranks, &comm_id, rank, std::ptr::null()) })
    })
}

/// `ncclCommInitRankConfig`: init of one rank; `config.blocking = 0` makes
/// it non-blocking.
///
/// # Safety
/// `comm` is null or valid for a write; `config` is null or a valid config.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    comm_id: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    entry(|| {
        // SAFETY: forwarded from this function's contract.
        grouped(unsafe { init_rank(comm, nranks, &comm_id, rank, config) })
    })
}

/// `ncclCommInitAll`: `ndev` ranks of one communicator in this thread.
///
/// # Safety
/// `comms` is null or valid for `ndev` writes; `devlist` is null or valid
/// for `ndev` reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut ncclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> ncclResult_t {
    entry(|| {
        if comms.is_null() {
            return fail(ncclResult_t::ncclInvalidArgument, "comms is NULL");
        }
        if ndev < 1 {
            return fail(
                ncclResult_t::ncclInvalidArgument,
                format!("invalid ndev {ndev}"),
            );
        }
        let mut devs = Vec::new();
        for i in 0..ndev as usize {
            let d = if devlist.is_null() {
                i as c_int
            } else {
                // SAFETY: `devlist` holds `ndev` ints (this function's contract).
                unsafe { *devlist.add(i) }
            };
            if d < 0 || d >= driver::device_count() {
                return fail(
                    ncclResult_t::ncclInvalidArgument,
                    format!("invalid device {d}"),
                );
            }
            devs.push(d);
        }
        use rand::Rng;
        let mut key = [0u8; 128];
        rand::rng().fill(&mut key[..]);
        for (i, d) in devs.into_iter().enumerate() {
            // SAFETY: a null config.
            let cfg = unsafe { init_config(std::ptr::null()) }?;
            let c = Comm::new(d, cfg, Chain::new(), false, i as c_int, ndev);
            join(key, ndev, i as c_int, &c)?;
            COMMS.insert_at(c.id, c.clone());
            // SAFETY: `comms` holds `ndev` slots (this function's contract).
            unsafe { put(comms.add(i), c.handle()) };
        }
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommSplit`: a collective over the parent; ranks of one color form a
/// communicator ordered by (key, parent rank).
///
/// # Safety
/// `newcomm` is null or valid for a write; `config` is null or a valid
/// config.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommSplit(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    entry(|| {
        grouped((|| {
            let parent = lookup(comm)?;
            let (rank, n, world) = parent.ready()?;
            parent.idle()?;
            let Some(world) = world else {
                return fail(
                    ncclResult_t::ncclInvalidUsage,
                    "split of a communicator that never joined",
                );
            };
            if newcomm.is_null() {
                return fail(ncclResult_t::ncclInvalidArgument, "newcomm is NULL");
            }
            let inherited = Cfg {
                blocking: parent.blocking,
                split_share: parent.split_share,
            };
            // SAFETY: `config` is null or valid (this function's contract).
            let cfg = unsafe { parse_config(config, inherited) }?;
            let blocking = cfg.blocking;
            // The parent's `splitShare` decides (`comm->shareResources` in
            // NCCL's `ncclCommSplit`): the child uses the parent's strong
            // stream, so their work is ordered as one communicator's.
            let chain = if parent.split_share {
                parent.chain.clone()
            } else {
                Chain::new()
            };
            if color < 0 && color != NCCL_SPLIT_NOCOLOR {
                return fail(
                    ncclResult_t::ncclInvalidArgument,
                    format!("invalid color {color}"),
                );
            }
            let child = (color != NCCL_SPLIT_NOCOLOR)
                .then(|| Comm::new(parent.device, cfg, chain, false, -1, -1));
            let h = child.as_ref().map_or(std::ptr::null_mut(), |c| c.handle());
            if let Some(c) = &child {
                COMMS.insert_at(c.id, c.clone());
            }
            // SAFETY: `newcomm` is non-null and valid (this function's contract).
            unsafe { put(newcomm, h) };
            let seq = parent.split_seq.fetch_add(1, Ordering::AcqRel) + 1;
            {
                let mut st = world.st.lock();
                let entries = st
                    .splits
                    .entry(seq)
                    .or_insert_with(|| std::iter::repeat_with(|| None).take(n).collect());
                entries[rank] = Some(SplitEntry {
                    color,
                    key,
                    comm: child.clone(),
                });
                if entries.iter().all(Option::is_some) {
                    let entries: Vec<SplitEntry> = st
                        .splits
                        .remove(&seq)
                        .unwrap_or_default()
                        .into_iter()
                        .flatten()
                        .collect();
                    let mut by_color: BTreeMap<i32, Vec<(i32, usize, Arc<Comm>)>> = BTreeMap::new();
                    for (r, e) in entries.into_iter().enumerate() {
                        if let Some(c) = e.comm {
                            by_color.entry(e.color).or_default().push((e.key, r, c));
                        }
                    }
                    for (_, mut members) in by_color {
                        members.sort_by_key(|(k, r, _)| (*k, *r));
                        let w = World::new(members.iter().map(|(_, _, c)| c.device).collect());
                        let len = members.len() as i32;
                        for (i, (_, _, c)) in members.into_iter().enumerate() {
                            c.set_world(i as i32, len, w.clone());
                        }
                    }
                }
            }
            let Some(child) = child else {
                return Ok(ncclResult_t::ncclSuccess);
            };
            if in_group() {
                GROUP.with(|g| g.borrow_mut().inits.push(child));
                return Ok(ncclResult_t::ncclSuccess);
            }
            if !blocking {
                return Ok(ncclResult_t::ncclInProgress);
            }
            parent.splitting.lock().push(child.clone());
            child.wait_ready();
            parent.splitting.lock().retain(|c| c.id != child.id);
            if child.aborted() {
                return fail(
                    ncclResult_t::ncclInternalError,
                    "split abandoned: the parent communicator was aborted",
                );
            }
            Ok(ncclResult_t::ncclSuccess)
        })())
    })
}

/// `ncclCommShrink`: not implemented.
///
/// # Safety
/// No pointer is used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommShrink(
    _comm: ncclComm_t,
    _exclude: *mut c_int,
    _count: c_int,
    _newcomm: *mut ncclComm_t,
    _config: *mut ncclConfig_t,
    _flags: c_int,
) -> ncclResult_t {
    entry(|| Err(unimplemented("ncclCommShrink")))
}

/// `ncclCommInitRankScalable`: not implemented.
///
/// # Safety
/// No pointer is used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    _newcomm: *mut ncclComm_t,
    _nranks: c_int,
    _myrank: c_int,
    _n_id: c_int,
    _ids: *mut ncclUniqueId,
    _config: *mut ncclConfig_t,
) -> ncclResult_t {
    entry(|| Err(unimplemented("ncclCommInitRankScalable")))
}

/// `ncclGroupSimulateEnd`: not implemented.
///
/// # Safety
/// No pointer is used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGroupSimulateEnd(_sim: *mut ncclSimInfo_t) -> ncclResult_t {
    entry(|| Err(unimplemented("ncclGroupSimulateEnd")))
}

/// `ncclRedOpCreatePreMulSum`: not implemented.
///
/// # Safety
/// No pointer is used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    _op: *mut ncclRedOp_t,
    _scalar: *mut c_void,
    _dt: ncclDataType_t,
    _residence: ncclScalarResidence_t,
    _comm: ncclComm_t,
) -> ncclResult_t {
    entry(|| Err(unimplemented("ncclRedOpCreatePreMulSum")))
}

/// `ncclRedOpDestroy`: no custom operation exists, so always an error.
#[unsafe(no_mangle)]
pub extern "C" fn ncclRedOpDestroy(op: ncclRedOp_t, comm: ncclComm_t) -> ncclResult_t {
    entry(|| {
        lookup(comm)?;
        if op.0 < 5 {
            fail(
                ncclResult_t::ncclInvalidArgument,
                "cannot destroy a built-in reduction operation",
            )
        } else {
            fail(
                ncclResult_t::ncclInvalidArgument,
                format!("unknown reduction operation {}", op.0),
            )
        }
    })
}

/// `ncclCommFinalize`: flushes the communicator's work (non-blocking
/// communicators report `ncclInProgress` while work is pending).
#[unsafe(no_mangle)]
pub extern "C" fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
    entry(|| {
        let c = lookup(comm)?;
        c.idle()?;
        let mut st = c.st.lock();
        st.finalizing = true;
        if !c.blocking {
            return Ok(if st.inflight > 0 {
                ncclResult_t::ncclInProgress
            } else {
                ncclResult_t::ncclSuccess
            });
        }
        while st.inflight > 0 && !c.aborted() {
            c.cv.wait_for(&mut st, TICK);
        }
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommDestroy`: waits for the communicator's work, then for the
/// peers' devices to be idle, then frees it. After an abort the handle is
/// already freed: `ncclInvalidUsage`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
    entry(|| {
        let c = lookup(comm)?;
        {
            let mut st = c.st.lock();
            while st.inflight > 0 && !c.aborted() {
                c.cv.wait_for(&mut st, TICK);
            }
        }
        wait_peer_devices_idle(&c);
        COMMS.remove(c.id);
        if c.st.lock().world.is_none() {
            unjoin(&c);
        }
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// NCCL's teardown unmaps the buffers this rank shares with its peers'
/// devices, which waits for those devices: while another communicator has
/// work in flight on a peer's device (work that may be waiting for this
/// rank), the destroy does not return, until this communicator is aborted.
fn wait_peer_devices_idle(c: &Comm) {
    let Some(world) = c.st.lock().world.clone() else {
        return;
    };
    let peers: BTreeSet<i32> = world
        .devices
        .iter()
        .copied()
        .filter(|&d| d >= 0 && d != c.device)
        .collect();
    while !c.aborted() {
        let busy = COMMS
            .values()
            .iter()
            .any(|o| o.id != c.id && peers.contains(&o.device) && o.st.lock().inflight > 0);
        if !busy {
            return;
        }
        std::thread::sleep(TICK);
    }
}

/// `ncclCommAbort`: frees the communicator at once and releases its
/// blocked work promptly; peers stay blocked until they abort.
#[unsafe(no_mangle)]
pub extern "C" fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
    entry(|| {
        let c = lookup_any(comm)?;
        COMMS.remove(c.id);
        ABORTED.lock().insert(c.id);
        c.aborted.store(true, Ordering::Release);
        // Its work waiting for a turn on the chain ends now, unrun.
        c.chain.wake();
        for child in c.splitting.lock().drain(..) {
            child.aborted.store(true, Ordering::Release);
            let _st = child.st.lock();
            child.cv.notify_all();
        }
        let (rank, world) = {
            let st = c.st.lock();
            c.cv.notify_all();
            (st.rank, st.world.clone())
        };
        match world {
            Some(w) => {
                let mut st = w.st.lock();
                if let Some(a) = st.aborted.get_mut(rank as usize) {
                    *a = true;
                }
                w.cv.notify_all();
            }
            None => unjoin(&c),
        }
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommGetAsyncError`: the first asynchronous error, `ncclInProgress`
/// while init, a background enqueue or a non-blocking finalize is pending,
/// else `ncclSuccess`.
///
/// # Safety
/// `async_error` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommGetAsyncError(
    comm: ncclComm_t,
    async_error: *mut ncclResult_t,
) -> ncclResult_t {
    entry(|| {
        let c = lookup(comm)?;
        let v = {
            let st = c.st.lock();
            if let Some(e) = st.async_err {
                e
            } else if (st.world.is_none() && !(c.ghost && c.blocking))
                || st.pending > 0
                || (st.finalizing && st.inflight > 0)
            {
                ncclResult_t::ncclInProgress
            } else {
                ncclResult_t::ncclSuccess
            }
        };
        // SAFETY: `async_error` is null or valid (this function's contract).
        unsafe { out(async_error, v, "asyncError") }?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommCount`.
///
/// # Safety
/// `count` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t {
    entry(|| {
        let (_, n, _) = lookup(comm)?.ready()?;
        // SAFETY: `count` is null or valid (this function's contract).
        unsafe { out(count, n as c_int, "count") }?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommCuDevice`.
///
/// # Safety
/// `device` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    entry(|| {
        let c = lookup(comm)?;
        c.ready()?;
        // SAFETY: `device` is null or valid (this function's contract).
        unsafe { out(device, c.device, "device") }?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommUserRank`.
///
/// # Safety
/// `rank` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
    entry(|| {
        let (r, _, _) = lookup(comm)?.ready()?;
        // SAFETY: `rank` is null or valid (this function's contract).
        unsafe { out(rank, r as c_int, "rank") }?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

fn register(comm: ncclComm_t, buff: u64, size: usize, window: bool) -> R<u64> {
    let c = lookup(comm)?;
    c.ready()?;
    c.idle()?;
    if size == 0 || !range_ok(buff, size, true) {
        return fail(
            ncclResult_t::ncclInvalidArgument,
            format!("buffer {buff:#x} of {size} bytes is not inside a live device allocation"),
        );
    }
    let id = new_id();
    let mut st = c.st.lock();
    if window {
        st.wins.insert(id);
    } else {
        st.regs.insert(id);
    }
    Ok(id)
}

fn deregister(comm: ncclComm_t, id: u64, window: bool) -> R<ncclResult_t> {
    let c = lookup(comm)?;
    let mut st = c.st.lock();
    let removed = if window {
        st.wins.remove(&id)
    } else {
        st.regs.remove(&id)
    };
    if removed {
        Ok(ncclResult_t::ncclSuccess)
    } else {
        fail(
            ncclResult_t::ncclInvalidArgument,
            format!("handle {id:#x} is not registered with this communicator"),
        )
    }
}

/// `ncclCommRegister`: a unique handle for a live device buffer.
///
/// # Safety
/// `handle` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    entry(|| {
        if handle.is_null() {
            return fail(ncclResult_t::ncclInvalidArgument, "handle is NULL");
        }
        let id = register(comm, buff as usize as u64, size, false)?;
        // SAFETY: `handle` is non-null and valid (this function's contract).
        unsafe { put(handle, id_to_ptr::<c_void>(id)) };
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommDeregister`: an unknown or already deregistered handle is
/// `ncclInvalidArgument`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    entry(|| deregister(comm, ptr_to_id(handle), false))
}

/// `ncclCommWindowRegister`.
///
/// # Safety
/// `win` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommWindowRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    _flags: c_int,
) -> ncclResult_t {
    entry(|| {
        if win.is_null() {
            return fail(ncclResult_t::ncclInvalidArgument, "win is NULL");
        }
        let id = register(comm, buff as usize as u64, size, true)?;
        // SAFETY: `win` is non-null and valid (this function's contract).
        unsafe { put(win, id_to_ptr::<ncclWindow_vidmem>(id)) };
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclCommWindowDeregister`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) -> ncclResult_t {
    entry(|| deregister(comm, ptr_to_id(win), true))
}

/// `ncclMemAlloc`: device memory on the current device.
///
/// # Safety
/// `ptr` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    entry(|| {
        if ptr.is_null() {
            return fail(ncclResult_t::ncclInvalidArgument, "ptr is NULL");
        }
        if size == 0 {
            return fail(ncclResult_t::ncclInvalidArgument, "size is 0");
        }
        let dev = driver::current_device().unwrap_or(0);
        let p = memory::alloc(Some(dev), size).map_err(|e| {
            err(
                ncclResult_t::ncclUnhandledCudaError,
                format!("allocation of {size} bytes failed (CUDA error {})", e.0),
            )
        })?;
        // SAFETY: `ptr` is non-null and valid (this function's contract).
        unsafe { put(ptr, p as usize as *mut c_void) };
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclMemFree`: frees as `cuMemFree` does (NCCL's `cudaFree` or cuMem
/// unmap on the pointer's device), once the work queued on that device
/// before the call has run; an unknown pointer is `ncclInvalidArgument`, a
/// device with a sticky CUDA error `ncclUnhandledCudaError`.
///
/// # Safety
/// None: `ptr` is only compared with the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    entry(|| {
        if ptr.is_null() {
            return Ok(ncclResult_t::ncclSuccess);
        }
        memory::free(ptr as usize as u64, true).map_err(|e| {
            if e == cuda_sys::CUresult::CUDA_ERROR_INVALID_VALUE {
                err(
                    ncclResult_t::ncclInvalidArgument,
                    format!("{ptr:p} was not allocated by ncclMemAlloc"),
                )
            } else {
                err(
                    ncclResult_t::ncclUnhandledCudaError,
                    format!("freeing {ptr:p} failed (CUDA error {})", e.0),
                )
            }
        })?;
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclGetErrorString`: NCCL's static texts.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
    CALLS.fetch_add(1, Ordering::Relaxed);
    let s: &'static CStr = match result.0 {
        0 => c"no error",
        1 => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        2 => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3 => c"internal error - please report this issue to the NCCL developers",
        4 => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        5 => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

/// `ncclGetLastError`: the newer of the communicator's last asynchronous
/// error and the calling thread's last error, else the process's; a static
/// NUL-terminated string.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
    CALLS.fetch_add(1, Ordering::Relaxed);
    guard(c"".as_ptr(), || {
        let own = (!comm.is_null())
            .then(|| COMMS.get(ptr_to_id(comm)))
            .flatten()
            .and_then(|c| c.st.lock().last);
        let mine = THREAD_LAST.with(std::cell::Cell::get);
        let newest = match (own, mine) {
            (Some(a), Some(b)) => Some(if a.0 > b.0 { a } else { b }),
            (a, b) => a.or(b),
        };
        newest.map_or_else(|| *LAST.lock(), |(_, m)| m).as_ptr()
    })
}

/// `ncclGroupStart`: groups nest per thread.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGroupStart() -> ncclResult_t {
    entry(|| {
        GROUP.with(|g| g.borrow_mut().depth += 1);
        Ok(ncclResult_t::ncclSuccess)
    })
}

/// `ncclGroupEnd`: the outermost end launches the group, one task per
/// stream with sends first; with work of a non-blocking communicator the
/// tasks are enqueued in the background and the end is `ncclInProgress`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGroupEnd() -> ncclResult_t {
    entry(group_end)
}

/// `ncclAllReduce`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::AllReduce,
        sendbuff,
        recvbuff,
        count,
        datatype,
        op,
        0,
        comm,
        stream,
    )
}

/// `ncclBroadcast`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::Broadcast,
        sendbuff,
        recvbuff,
        count,
        datatype,
        ncclRedOp_t::ncclSum,
        root,
        comm,
        stream,
    )
}

/// `ncclBcast`: in-place broadcast.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBcast(
    buff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::Broadcast,
        buff,
        buff,
        count,
        datatype,
        ncclRedOp_t::ncclSum,
        root,
        comm,
        stream,
    )
}

/// `ncclReduce`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::Reduce,
        sendbuff,
        recvbuff,
        count,
        datatype,
        op,
        root,
        comm,
        stream,
    )
}

/// `ncclAllGather`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::AllGather,
        sendbuff,
        recvbuff,
        sendcount,
        datatype,
        ncclRedOp_t::ncclSum,
        0,
        comm,
        stream,
    )
}

/// `ncclReduceScatter`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::ReduceScatter,
        sendbuff,
        recvbuff,
        recvcount,
        datatype,
        op,
        0,
        comm,
        stream,
    )
}

/// `ncclAlltoAll`: `count` elements to and from each peer.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::AlltoAll,
        sendbuff,
        recvbuff,
        count,
        datatype,
        ncclRedOp_t::ncclSum,
        0,
        comm,
        stream,
    )
}

/// `ncclGather`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::Gather,
        sendbuff,
        recvbuff,
        count,
        datatype,
        ncclRedOp_t::ncclSum,
        root,
        comm,
        stream,
    )
}

/// `ncclScatter`.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    coll(
        Kind::Scatter,
        sendbuff,
        recvbuff,
        count,
        datatype,
        ncclRedOp_t::ncclSum,
        root,
        comm,
        stream,
    )
}

/// `ncclSend`: posts a copy of the data for `peer` when the stream runs it.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    p2p(
        true,
        sendbuff as usize as u64,
        count,
        datatype,
        peer,
        comm,
        stream,
    )
}

/// `ncclRecv`: blocks its stream until the matching send's data is there.
///
/// # Safety
/// Buffers are only used after they are checked against the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    p2p(
        false,
        recvbuff as usize as u64,
        count,
        datatype,
        peer,
        comm,
        stream,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: El>(v: &[T]) -> Vec<u8> {
        let n = std::mem::size_of::<T>();
        let mut out = vec![0u8; std::mem::size_of_val(v)];
        for (x, b) in v.iter().zip(out.chunks_exact_mut(n)) {
            x.st(b);
        }
        out
    }

    #[test]
    fn bf16_sum_rounds_after_each_add() {
        let a = [bf16::from_f32(1.0), bf16::from_f32(3.5)];
        let b = [bf16::from_bits(0x3b80), bf16::from_f32(-0.125)];
        let c = [bf16::from_bits(0x3b80), bf16::from_f32(7.0)];
        let got = reduce(Dt::Bf16, Op::Sum, &[bytes(&a), bytes(&b), bytes(&c)]);
        for i in 0..2 {
            let ab = bf16::from_f32(a[i].to_f32() + b[i].to_f32());
            let want = bf16::from_f32(ab.to_f32() + c[i].to_f32());
            assert_eq!(bf16::ld(&got[2 * i..2 * i + 2]).to_bits(), want.to_bits());
        }
    }

    #[test]
    fn integer_ops() {
        let a = bytes(&[5i32, -7, 100]);
        let b = bytes(&[3i32, 2, -50]);
        let check = |op, want: [i32; 3]| {
            let got = reduce(Dt::I32, op, &[a.clone(), b.clone()]);
            for (i, w) in want.iter().enumerate() {
                assert_eq!(i32::ld(&got[4 * i..4 * i + 4]), *w, "{op:?}");
            }
        };
        check(Op::Sum, [8, -5, 50]);
        check(Op::Prod, [15, -14, -5000]);
        check(Op::Max, [5, 2, 100]);
        check(Op::Min, [3, -7, -50]);
        check(Op::Avg, [4, -2, 25]);
    }
}
