//! A CPU emulator of the CUDA driver API and of NCCL, built as a shared
//! library that is loaded in place of `libcuda.so.1` and `libnccl.so.2`
//! (point `METRALE_CUDA_LIBRARY` and `METRALE_NCCL_LIBRARY` at the same
//! `libgpu_emu.so`), so the real stack runs in CI without GPUs.
//!
//! # What is emulated
//! - **Driver**: `cuInit` is required first. `METRALE_EMU_DEVICES` devices
//!   (default 8) named "Metrale emulated GPU", 80 GiB each (a budget, not
//!   reserved), compute capability 9.0, peer access between every pair,
//!   driver version 13000. Primary contexts are retained and released with a
//!   reference count; the current context is per thread.
//! - **Memory**: device memory is host memory (whole pages, at addresses
//!   never reused for device memory in the process) filled with `0xA5` so
//!   unwritten outputs show. Every live allocation is in a
//!   registry; every range a copy, memset, kernel or collective touches must
//!   lie inside one live allocation (`CUDA_ERROR_INVALID_VALUE` or
//!   `ncclInvalidArgument` otherwise). `cuMemGetInfo` reports the bytes
//!   allocated on the current device. Pinned host memory is plain host memory
//!   kept in the same registry.
//! - **Lifetime**: `cuMemFree` and `ncclMemFree` first wait for the work
//!   queued on the allocation's device before the call (every stream, the
//!   legacy one and destroyed ones still draining included; captured work
//!   never launched is not queued), as the driver synchronises: a free under
//!   work that never ends never returns. Work checks its ranges again when
//!   it runs, atomically with the access: memory not allocated then is a
//!   sticky `CUDA_ERROR_ILLEGAL_ADDRESS` on the work's device (every later
//!   synchronise, query, launch, allocation and free of that context returns
//!   it; the last primary-context release clears it), or for NCCL the
//!   communicator's asynchronous `ncclUnhandledCudaError`. The emulator
//!   never reads or writes freed memory.
//! - **Streams**: each created stream is an in-order queue drained by its own
//!   worker thread, so work is asynchronous: `cuStreamQuery` says
//!   `CUDA_ERROR_NOT_READY` while work is pending. Events are markers in the
//!   queue, timed with host clocks (or with the streams' virtual clocks
//!   while a cost is set: see Control API). Stream capture records work instead of
//!   running it; a graph launch enqueues a fresh execution of the recorded
//!   work (a captured collective is a new collective on every replay).
//! - **Kernels**: `cuModuleLoadData` reads the `.entry` names of PTX text;
//!   the project's kernels run on the host with the GPU's arithmetic:
//!   `bf16_add_inplace` (`bf16(f32(dst) + f32(src))`, round to nearest
//!   even) and the one-shot all-reduces of bf16, f16 and f32 (their push,
//!   flag-free wait, rank-order f32 sum, clear and bounded spin over peer
//!   memory; `kernels::one_shot`). `cuLaunchKernelEx` launches as
//!   `cuLaunchKernel` does; of its attributes it reads the cluster
//!   dimensions only, which the fused entries that split a row over a
//!   cluster check against their launch contract (`kernels::fused`);
//!   devices report cluster launch.
//! - **IPC**: `cuIpcGetMemHandle`, `cuIpcOpenMemHandle_v2` and
//!   `cuIpcCloseMemHandle` between processes of this host (the exported
//!   pages are a memfd's, mapped by the other process); a handle opened in
//!   the process that made it is `CUDA_ERROR_INVALID_CONTEXT`, as the
//!   driver answers; opens are counted, a stale handle is refused, and a
//!   free of memory still mapped elsewhere is counted as a violation
//!   (`cuda::ipc`).
//! - **NCCL 2.28.3**: blocking and non-blocking init, split, groups, every
//!   collective and send/recv, all data types but fp8, every built-in
//!   reduction (16-bit floats are added in `f32` and rounded after each add,
//!   in rank order), registration, windows, `ncclMemAlloc`, abort, finalize,
//!   destroy and asynchronous errors.
//! - **Ranks**: threads of one process, or separate processes. The ranks of
//!   a unique id meet in a registry of the process that made the id (its
//!   bootstrap root, which listens on a loopback port named in the id);
//!   when all are threads of that process they share memory directly, and
//!   otherwise every rank joins a mesh of TCP links over loopback that
//!   carry the operations' bytes (`nccl/net`: its module doc gives the wire
//!   format). A peer process that dies (no goodbye on its links) makes the
//!   survivors' work that needs it fail with `ncclRemoteError` as the
//!   asynchronous error; a peer that destroyed or aborted its communicator
//!   leaves them blocked until they abort, as in process.
//! - **Ordering**: each communicator runs its launches (an operation, its
//!   part of a group, its captured operations at each graph launch) in issue
//!   order across every stream, as NCCL 2.28.3's strong stream
//!   (`sharedRes->deviceStream`) orders them: a launch's work first waits
//!   until the communicator's previous launch has completed, so its stream
//!   waits too. Children split from a communicator whose config sets
//!   `splitShare` (or with `NCCL_COMM_SPLIT_SHARE_RESOURCES=1`) share its
//!   order. An abort ends the communicator's queued work unrun, so every
//!   stream it held drains.
//! - **Non-blocking communicators** (`config.blocking = 0`) enqueue in the
//!   background as NCCL 2.28 does: a collective or send/recv outside a
//!   group, and a group end holding their work, return `ncclInProgress`; the
//!   work reaches the stream 0.2 - 2 ms later (the first operation of a
//!   communicator only once every peer has launched its match: lazy
//!   connection), and `ncclCommGetAsyncError` says `ncclInProgress` until
//!   then. Another operation on the communicator before that is
//!   `ncclInvalidUsage` ("previous operation still in progress"), so a stack
//!   that does not wait is caught. Abort drops the pending work.
//!
//! # What is simplified
//! - The NULL stream and `CU_STREAM_LEGACY` / `CU_STREAM_PER_THREAD` are one
//!   legacy queue per device, and every call that enqueues on them waits for
//!   its work before returning: work there is synchronous with the host.
//! - Cross-stream capture is not supported: recording an event on a capturing
//!   stream is a no-op, and waiting on a pending event from a capturing
//!   stream returns `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
//! - Releasing a primary context does not free its allocations.
//! - `cuMemFreeHost` does not wait for queued work; a queued copy that finds
//!   its pinned memory gone is a sticky illegal address.
//! - A group's items on several streams run on their own streams, each
//!   after the communicator's previous launch; NCCL also joins the streams
//!   (the first waits for the others before the kernel, the others for the
//!   kernel after it). Communicators of one `splitShare` family in one
//!   group share the group's place in their order (NCCL launches them one
//!   after another); a `splitShare` child does not share its parent's abort
//!   flag as NCCL's does.
//! - A send is buffered (eager): it completes once its data is posted.
//! - `ncclCommShrink`, `ncclCommInitRankScalable`, `ncclGroupSimulateEnd`
//!   and `ncclRedOpCreatePreMulSum` return `ncclInvalidUsage`.
//! - When a rank aborts, its peers stay blocked in the collective until they
//!   abort too, as with real NCCL.
//! - Across processes: a non-blocking communicator's first operation does
//!   not wait for the peers' matching launches (lazy connection is only
//!   emulated in process); `ncclCommDestroy` does not wait for the peers'
//!   devices (they are another process's); `metrale_emu_inject` acts on
//!   the ranks of the calling process (`METRALE_EMU_FAULTS` is read by
//!   each); the process that made the id must live until every rank has
//!   joined (a rank whose root is gone fails its init at once with
//!   `ncclSystemError`); ranks are on one host (loopback), at most 4096
//!   (more is `ncclInvalidUsage`, "not emulated across processes").
//!
//! # Control API
//! Exported C functions, resolved by the suite from the same library:
//! `metrale_emu_inject(rank, fault, nth) -> int` (1 hang, 2 async error,
//! 3 init fails, 4 never joins init, 5 dies, 6 stalls in the call, 7 the
//! `nth` one-shot kernel writes a wrong first word; `nth`
//! counts from 1, from when the fault is added: the rank's collectives and
//! send/recv on any communicator, at launch, and for a stall the rank's
//! enqueue calls on blocking communicators; each fault fires once), `metrale_emu_reset()` (clears every fault) and
//! `metrale_emu_nccl_calls() -> unsigned long long` (NCCL API calls so far),
//! `metrale_emu_ipc_open_mappings()` and `metrale_emu_ipc_violations()`
//! (this process's IPC mappings of other processes' memory open now; its
//! frees of memory another process still maps, since start).
//! `METRALE_EMU_FAULTS="RANK:KIND@N;..."` (KIND one of `hang`, `async`,
//! `initfail`, `nojoin`, `die`, `stall`, `corrupt`) is read on first use.
//!
//! Emulated time (`cost`): `metrale_emu_set_cost(rank, op, mode, base_ns,
//! ns_per_kib) -> int` (rank a communicator rank, or -1 for every rank; op
//! 1 `ncclAllReduce`, 2 a one-shot all-reduce kernel (its control block's
//! rank), 3 `ncclSend`; mode 0 any launch, 1 eager only, 2 graph replays
//! only; 0, or -1 on a bad argument) says an operation of `bytes` takes
//! `base_ns + ns_per_kib * bytes / 1024` ns (rounded down); a later entry
//! for one `(rank, op, mode)` replaces the earlier, a rank's entry wins
//! over every rank's, then a mode's over any mode's.
//! `metrale_emu_clear_costs()` clears them all.
//! `METRALE_EMU_COSTS="RANK:OP:MODE=BASE_NS+NS_PER_KIB;..."` (RANK a
//! number or `*`, OP `allreduce`, `oneshot` or `send`, MODE `eager`,
//! `graph` or `*`; a malformed entry is ignored with a warning) is read on
//! first use. While a cost is set, every stream has a virtual clock (ns,
//! from 0): an operation run to completion on it advances it by its cost
//! (none without an entry, or when it fails or ends unrun), an event
//! record stamps the event with it, `cuStreamWaitEvent` moves the waiting
//! stream's clock up to the event's stamp, and `cuEventElapsedTime_v2` of
//! two events stamped under one model (no clear between) is the
//! difference of their stamps; with no cost set, events are timed with
//! host clocks.
//!
//! # Layout
//! Laid out like what it emulates; each module's doc gives its own layout:
//! - `cuda/`: the CUDA driver API (`driver`, `stream`, `event`, `graph`,
//!   `memory/`, `ipc`, `errors`);
//! - `kernels/`: the project's kernels and the module and launch entry
//!   points that run them;
//! - `nccl/`: NCCL's API, communicators and groups over two transports,
//!   `world` (ranks in this process) and `net/` (ranks in several
//!   processes) beneath them;
//! - `fault`: fault injection and its control functions; `cost`: the cost
//!   model, the streams' virtual clocks and their control functions; `abi`
//!   (tests only): every export has the signature the bindings expect.
//!
//! This file holds only what every module shares (handle ids and tables,
//! the panic guard, out-parameters) and uses no module of its own. No
//! import circles between the modules of one directory, nor between a
//! module and its own file (`xtask/tests/imports.rs`).
//!
//! # Locks
//! Each module doc states the order of its locks; across modules:
//! `nccl`'s locks come before `cuda`'s (an operation's world or mesh state,
//! then the memory registry), and the memory registry is the innermost
//! lock of the crate. A [`Table`]'s lock and the cost model's are leaves.
//!
//! # Invariants
//! - No panic crosses the C boundary: every exported body runs under
//!   `catch_unwind` and a panic becomes an error code.
//! - Handles are ids from one never-reused counter, looked up in tables, so a
//!   stale or foreign handle is an error, never a dangling dereference.
//! - No lock is held while blocking on another rank except through a
//!   condition variable wait with a short timeout, so abort is prompt; a
//!   socket read or write blocks at most a short tick between checks of
//!   its communicator's abort flag.

#![allow(non_snake_case)]

#[cfg(test)]
mod abi;
mod cost;
mod cuda;
mod fault;
mod kernels;
mod nccl;

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

pub use fault::Fault;

/// The value a C caller sees for a handle id.
pub(crate) fn id_to_ptr<T>(id: u64) -> *mut T {
    std::ptr::without_provenance_mut(id as usize)
}

/// The handle id behind a C handle.
pub(crate) fn ptr_to_id<T>(p: *const T) -> u64 {
    p as usize as u64
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0x1_0000);

/// A fresh, never reused, non-null handle id.
pub(crate) fn new_id() -> u64 {
    NEXT_ID.fetch_add(0x10, Ordering::Relaxed)
}

/// A table of live objects by handle id. Its lock is held for one map
/// operation at a time and is a leaf: nothing else is locked under it.
pub(crate) struct Table<T> {
    map: Mutex<BTreeMap<u64, Arc<T>>>,
}

impl<T> Table<T> {
    pub(crate) const fn new() -> Self {
        Self {
            map: Mutex::new(BTreeMap::new()),
        }
    }

    /// Stores `v` under a fresh id and returns the id.
    pub(crate) fn insert(&self, v: Arc<T>) -> u64 {
        let id = new_id();
        self.map.lock().insert(id, v);
        id
    }

    /// Stores `v` under `id`.
    pub(crate) fn insert_at(&self, id: u64, v: Arc<T>) {
        self.map.lock().insert(id, v);
    }

    pub(crate) fn get(&self, id: u64) -> Option<Arc<T>> {
        self.map.lock().get(&id).cloned()
    }

    pub(crate) fn remove(&self, id: u64) -> Option<Arc<T>> {
        self.map.lock().remove(&id)
    }

    pub(crate) fn values(&self) -> Vec<Arc<T>> {
        self.map.lock().values().cloned().collect()
    }
}

/// Runs `f`, turning a panic into `on_panic`.
pub(crate) fn guard<R>(on_panic: R, f: impl FnOnce() -> R) -> R {
    std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or(on_panic)
}

/// Writes `v` through `p` when `p` is not null; says whether it wrote.
///
/// # Safety
/// `p` is null or valid for a write of a `T`.
pub(crate) unsafe fn put<T>(p: *mut T, v: T) -> bool {
    if p.is_null() {
        return false;
    }
    // SAFETY: `p` is not null and valid for a write (this function's contract).
    unsafe { p.write_unaligned(v) };
    true
}
