//! The registry of live allocations (device memory, pinned host memory,
//! and mappings of other processes' exports), allocation and free, and
//! [`access`], through which all work touches emulated memory.
//!
//! Invariants: see the module doc of `memory`. The registry's lock is
//! taken last: nothing else is locked while it is held, and an `access`
//! closure only reads and writes memory.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use cuda_sys::CUresult;
use parking_lot::RwLock;

use super::pages::{fresh_pages, header, page, unmap};
use crate::cuda::driver::{self, TOTAL_MEM};
use crate::cuda::stream;

const ALIGN: usize = 256;
const GARBAGE: u8 = 0xA5;

/// How an allocation's bytes are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Backing {
    /// Pinned host memory, from `std::alloc`.
    Heap,
    /// Device memory: `mapped` bytes (whole pages) of a private anonymous
    /// mapping.
    Private { mapped: usize },
    /// Exported device memory: the same pages, a shared mapping of the
    /// memfd `fd`, whose page after the data is the export's header
    /// (mapped at `header`).
    Shared {
        mapped: usize,
        fd: i32,
        header: u64,
        serial: u64,
    },
    /// Another process's export, mapped here (`mapped` bytes).
    Imported { mapped: usize },
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Alloc {
    pub(super) len: usize,
    /// `None` for pinned host memory.
    pub(super) device: Option<i32>,
    pub(super) backing: Backing,
}

/// The live allocations, by start address, and the bytes in use per device.
pub(super) struct Registry {
    pub(super) map: BTreeMap<u64, Alloc>,
    used: BTreeMap<i32, usize>,
}

impl Registry {
    /// The live allocation containing `ptr`: (start, len, device).
    fn find(&self, ptr: u64) -> Option<(u64, usize, Option<i32>)> {
        let (&start, a) = self.map.range(..=ptr).next_back()?;
        (ptr - start < a.len as u64).then_some((start, a.len, a.device))
    }

    /// Whether `s` lies inside one live allocation.
    fn holds(&self, s: &Span) -> bool {
        if s.len == 0 {
            return true;
        }
        match self.find(s.ptr) {
            Some((start, alen, dev)) => {
                (!s.device_only || dev.is_some())
                    && (s.ptr - start)
                        .checked_add(s.len as u64)
                        .is_some_and(|end| end <= alen as u64)
            }
            None => false,
        }
    }
}

pub(super) static REG: RwLock<Registry> = RwLock::new(Registry {
    map: BTreeMap::new(),
    used: BTreeMap::new(),
});

/// A range of registered memory that work touches.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    /// The first byte.
    pub(crate) ptr: u64,
    /// The length in bytes (an empty span always holds).
    pub(crate) len: usize,
    /// The range must be device memory (not pinned host memory).
    pub(crate) device_only: bool,
}

impl Span {
    /// A span of device memory.
    pub(crate) fn device(ptr: u64, len: usize) -> Self {
        Span {
            ptr,
            len,
            device_only: true,
        }
    }

    /// A span of device or pinned host memory.
    pub(crate) fn any(ptr: u64, len: usize) -> Self {
        Span {
            ptr,
            len,
            device_only: false,
        }
    }
}

/// Runs `f` if every span lies inside a live allocation, holding the
/// registry's read lock until `f` returns, so no free can release them
/// meanwhile; `None` (and `f` does not run) otherwise. `f` must not call
/// into the registry (allocate, free, look up): the lock is fair and not
/// re-entrant.
pub(crate) fn access<R>(spans: &[Span], f: impl FnOnce() -> R) -> Option<R> {
    let reg = REG.read();
    if !spans.iter().all(|s| reg.holds(s)) {
        return None;
    }
    let r = f();
    drop(reg);
    Some(r)
}

/// Allocates `len` bytes on `device` (or pinned host memory for `None`).
pub(crate) fn alloc(device: Option<i32>, len: usize) -> Result<u64, CUresult> {
    if len == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let mut reg = REG.write();
    let (start, backing) = match device {
        Some(d) => {
            let used = reg.used.get(&d).copied().unwrap_or(0);
            if used.saturating_add(len) > TOTAL_MEM {
                return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
            }
            let mapped = len
                .checked_next_multiple_of(page())
                .ok_or(CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
            (fresh_pages(mapped)?, Backing::Private { mapped })
        }
        None => {
            let layout = Layout::from_size_align(len, ALIGN)
                .map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
            // SAFETY: `layout` has a non-zero size.
            let p = unsafe { std::alloc::alloc(layout) };
            if p.is_null() {
                return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
            }
            (p as usize as u64, Backing::Heap)
        }
    };
    // SAFETY: `start` was just allocated with at least `len` bytes.
    unsafe { std::ptr::write_bytes(start as usize as *mut u8, GARBAGE, len) };
    reg.map.insert(
        start,
        Alloc {
            len,
            device,
            backing,
        },
    );
    if let Some(d) = device {
        *reg.used.entry(d).or_insert(0) += len;
    }
    Ok(start)
}

/// Frees the allocation that starts at `ptr`, if it is of the given kind
/// (device memory when `device` is true, pinned host memory otherwise;
/// never another process's export mapped here). Device memory is freed
/// once the work queued on its device before the call has run (which
/// never happens under a kernel that never ends, as with the driver); a
/// device with a sticky error refuses with it.
pub(crate) fn free(ptr: u64, device: bool) -> Result<(), CUresult> {
    let ours =
        |a: &Alloc| a.device.is_some() == device && !matches!(a.backing, Backing::Imported { .. });
    let dev = match REG.read().map.get(&ptr) {
        Some(a) if ours(a) => a.device,
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    };
    if let Some(d) = dev {
        driver::sticky(d)?;
        stream::quiesce(d);
    }
    let mut reg = REG.write();
    match reg.map.get(&ptr) {
        Some(a) if ours(a) => {}
        // Freed by another thread meanwhile.
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
    let a = reg
        .map
        .remove(&ptr)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if let Some(d) = a.device
        && let Some(u) = reg.used.get_mut(&d)
    {
        *u = u.saturating_sub(a.len);
    }
    match a.backing {
        Backing::Heap => {
            let layout =
                Layout::from_size_align(a.len, ALIGN).map_err(|_| CUresult::CUDA_ERROR_UNKNOWN)?;
            // SAFETY: `ptr` was allocated by `alloc` with this layout and has
            // just been removed from the registry, so it is freed exactly
            // once; the write lock is still held, so no `access` is touching
            // it.
            unsafe { std::alloc::dealloc(ptr as usize as *mut u8, layout) };
        }
        Backing::Private { mapped } => {
            // SAFETY: as above, for the mapping `alloc` made.
            unsafe { unmap(ptr, mapped) };
        }
        Backing::Shared {
            mapped,
            fd,
            header: h,
            ..
        } => {
            // SAFETY: the header page stays mapped until just below.
            let opens = unsafe { header(h) }.opens.load(Ordering::Acquire);
            if opens > 0 {
                violation(ptr, opens);
            }
            // SAFETY: as above, for the shared mapping `share` made and its
            // header page; `fd` is the export's memfd, closed once here
            // (another process's mapping keeps the pages alive).
            unsafe {
                unmap(ptr, mapped);
                unmap(h, page());
                libc::close(fd);
            }
        }
        // Not ours: refused above, under this same lock.
        Backing::Imported { .. } => {}
    }
    drop(reg);
    Ok(())
}

/// The live allocation containing `ptr`: (start, len, device).
pub(crate) fn find(ptr: u64) -> Option<(u64, usize, Option<i32>)> {
    REG.read().find(ptr)
}

/// Whether `[ptr, ptr + len)` lies inside one live allocation (of device
/// memory when `device_only`). An empty range is always fine. A check
/// only: work that touches the range later goes through [`access`].
pub(crate) fn range_ok(ptr: u64, len: usize, device_only: bool) -> bool {
    REG.read().holds(&Span {
        ptr,
        len,
        device_only,
    })
}

/// Bytes allocated on `device`.
pub(crate) fn used(device: i32) -> usize {
    REG.read().used.get(&device).copied().unwrap_or(0)
}

/// Driver work on `dev` found its memory gone when it ran: the context's
/// sticky illegal-address error, as a GPU reports a fault.
pub(crate) fn illegal_address(dev: i32, what: &str, ptr: u64, len: usize) {
    tracing::error!(
        device = dev,
        ptr,
        len,
        "emulated {what} touched memory that is not allocated: CUDA_ERROR_ILLEGAL_ADDRESS"
    );
    driver::set_sticky(dev, CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
}

static VIOLATIONS: AtomicU64 = AtomicU64::new(0);

/// Counts and logs a free of device memory at `start` that `opens`
/// mappings in other processes still hold.
fn violation(start: u64, opens: u32) {
    VIOLATIONS.fetch_add(1, Ordering::Relaxed);
    tracing::error!(
        start,
        opens,
        "emulated cuMemFree of memory other processes still have open through \
         cuIpcOpenMemHandle (undefined in the driver): close the mappings first"
    );
}

/// Frees of device memory that other processes still had mapped, since
/// the process started.
pub(crate) fn ipc_violations() -> u64 {
    VIOLATIONS.load(Ordering::Relaxed)
}
