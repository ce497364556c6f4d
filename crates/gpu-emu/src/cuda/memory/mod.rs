//! Emulated device memory and pinned host memory: a registry of live
//! allocations, and the driver's allocation, copy and memset entry points.
//!
//! Invariants:
//! - Every allocation is host memory of this process, filled with `0xA5`,
//!   and recorded as `start -> (len, device, backing)` until freed. Pinned
//!   host memory comes from `std::alloc`, 256-byte aligned. Device memory
//!   is a private anonymous mapping of whole pages, at an address the
//!   process never used for device memory before (so work on freed memory
//!   never finds a new allocation there); once exported through
//!   CUDA IPC ([`share`]) the same pages are a shared mapping of a memfd,
//!   so another rank process can map them ([`import`]): a mapping of
//!   another process's export is registered here too, on the importing
//!   device, until `cuIpcCloseMemHandle` ([`unimport`]); it is not this
//!   process's allocation (`cuMemFree` refuses it, `cuMemGetInfo` does not
//!   count it).
//! - Every device-side range is checked against the registry before it is
//!   touched: a range must lie inside one live allocation. Work that runs
//!   later (on a stream) checks again when it runs, through [`access`],
//!   which holds the registry's read lock from the check to the end of the
//!   access: a free (and an export's remapping) takes the write lock, so it
//!   can never release or move memory between the check and the access,
//!   and the emulator never reads or writes freed host memory.
//! - A free of device memory first waits for the work queued on the
//!   allocation's device before the free (every stream of the device, the
//!   legacy stream and destroyed streams still draining included), as the
//!   driver's `cuMemFree` synchronises; work captured into a graph and not
//!   launched is not queued and is not waited for. Driver work that still
//!   finds its memory gone when it runs (it ran on another device, or the
//!   memory is pinned host memory) sets its device's sticky
//!   `CUDA_ERROR_ILLEGAL_ADDRESS`.
//! - The bytes in use per device are the sum of its own live allocations.
//!
//! # Locks
//! The registry's lock ([`access`] holds its read side) is the innermost
//! lock of the emulator: work takes it under its world's or mesh's lock
//! (an NCCL operation's reads and writes), and nothing else is locked
//! while it is held. An `access` closure must not call into the registry
//! (allocate, free, look up): the lock is fair and not re-entrant, so a
//! nested read waits behind a waiting free. A free waits for the device's
//! streams without holding it. `cuda::ipc`'s state is never held while it
//! is taken.
//!
//! # Layout
//! `pages` (the host pages: placement, mappings, an export's header page),
//! `registry` (the allocations, [`access`], allocation and free), `export`
//! (the pages of an allocation shared with another process, and mappings
//! of another process's), `allocate` (`cuMemAlloc`, `cuMemFree`, ...,
//! `cuPointerGetAttribute`) and `copy` (`cuMemcpy*`, `cuMemset*`).

pub(crate) mod allocate;
pub(crate) mod copy;
mod export;
mod pages;
mod registry;

pub(crate) use copy::copy;
pub(crate) use export::{Export, Imported, import, share, unimport};
pub(crate) use registry::{Span, access, alloc, free, illegal_address, ipc_violations, range_ok};
