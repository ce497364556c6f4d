//! The host pages behind emulated device memory: placement at addresses
//! never used for device memory before, `mmap` / `munmap`, and the header
//! page an export shares with the processes that map it.
//!
//! Invariants: an address range is handed out at most once in the
//! process (a freed allocation's pages are never placed again), followed
//! by an unmapped guard page; every field of a header is an atomic, as
//! processes read and write it at once.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use cuda_sys::CUresult;

/// The first bytes of an export's header page.
pub(super) const SHARE_MAGIC: u64 = u64::from_le_bytes(*b"EMUSHM01");

/// The page after an export's data, shared by the exporter and every
/// process that maps it: who made it, and how many mappings other
/// processes hold.
#[repr(C)]
pub(super) struct Header {
    pub(super) magic: AtomicU64,
    pub(super) serial: AtomicU64,
    pub(super) pid: AtomicU32,
    /// Open mappings in other processes.
    pub(super) opens: AtomicU32,
}

/// The export's header at `addr`.
///
/// # Safety
/// `addr` is a live mapping of an export's header page.
pub(super) unsafe fn header<'a>(addr: u64) -> &'a Header {
    // SAFETY: this function's contract; the page is zeroed or written by
    // `share`, and every field is an atomic.
    unsafe { &*(addr as usize as *const Header) }
}

/// The system's page size.
pub(super) fn page() -> usize {
    // SAFETY: `sysconf` has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// `mmap`, `None` on failure.
///
/// # Safety
/// As `mmap(2)`: a `MAP_FIXED` address must be a mapping of device memory.
pub(super) unsafe fn map(addr: u64, len: usize, flags: i32, fd: i32, off: usize) -> Option<u64> {
    // SAFETY: this function's contract.
    let p = unsafe {
        libc::mmap(
            addr as usize as *mut c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            libc::off_t::try_from(off).ok()?,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as usize as u64)
}

/// The next address [`fresh_pages`] tries.
static NEXT_VA: AtomicU64 = AtomicU64::new(VA_FIRST);
/// Where device memory is placed: addresses that nothing else of the
/// process uses, each handed out once.
const VA_FIRST: u64 = 0x2000_0000_0000;
const VA_END: u64 = 0x6000_0000_0000;

/// A private anonymous mapping of `mapped` bytes (whole pages) at an
/// address this process has never used for device memory, followed by an
/// unmapped guard page: a freed allocation's address is not handed out
/// again (so work on freed memory is always caught), which the kernel's
/// own placement does at once. Past the range (never in practice), or
/// where something else sits, the kernel places it.
pub(super) fn fresh_pages(mapped: usize) -> Result<u64, CUresult> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    let step = (mapped + page()) as u64;
    for _ in 0..16 {
        let at = NEXT_VA.fetch_add(step, Ordering::Relaxed);
        if at.saturating_add(step) > VA_END {
            break;
        }
        // SAFETY: `MAP_FIXED_NOREPLACE` maps only where nothing is mapped.
        if let Some(p) = unsafe { map(at, mapped, flags | libc::MAP_FIXED_NOREPLACE, -1, 0) } {
            if p == at {
                return Ok(p);
            }
            // An old kernel that took the address as a hint only.
            // SAFETY: the mapping just made, not used.
            unsafe { unmap(p, mapped) };
        }
    }
    // SAFETY: a fresh anonymous mapping, placed by the kernel.
    unsafe { map(0, mapped, flags, -1, 0) }.ok_or(CUresult::CUDA_ERROR_OUT_OF_MEMORY)
}

/// `munmap`, logging a failure.
///
/// # Safety
/// `[addr, addr + len)` is a mapping of device memory, not touched again.
pub(super) unsafe fn unmap(addr: u64, len: usize) {
    // SAFETY: this function's contract.
    if unsafe { libc::munmap(addr as usize as *mut c_void, len) } != 0 {
        tracing::error!(
            addr,
            len,
            "emulated memory: munmap failed: {}",
            std::io::Error::last_os_error()
        );
    }
}
