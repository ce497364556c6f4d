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

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use cuda_sys::{CUdeviceptr, CUresult, CUstream};
use parking_lot::RwLock;

use super::driver::{self, TOTAL_MEM, check_init, code};
use super::stream::{self, Launcher};
use crate::{guard, put};

const ALIGN: usize = 256;
const GARBAGE: u8 = 0xA5;
/// The first bytes of an export's header page.
const SHARE_MAGIC: u64 = u64::from_le_bytes(*b"EMUSHM01");

/// How an allocation's bytes are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backing {
    /// Pinned host memory, from `std::alloc`.
    Heap,
    /// Device memory: `mapped` bytes (whole pages) of a private anonymous
    /// mapping.
    Private { mapped: usize },
    /// Exported device memory: the same pages, a shared mapping of the
    /// memfd `fd`, whose page after the data is the export's [`Header`]
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
struct Alloc {
    len: usize,
    /// `None` for pinned host memory.
    device: Option<i32>,
    backing: Backing,
}

impl Alloc {
    /// What another process needs to map it, once exported.
    fn export(&self) -> Option<Export> {
        match self.backing {
            Backing::Shared {
                mapped, fd, serial, ..
            } => Some(Export {
                fd,
                serial,
                len: self.len,
                mapped,
            }),
            _ => None,
        }
    }
}

/// The page after an export's data, shared by the exporter and every
/// process that maps it: who made it, and how many mappings other
/// processes hold.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    serial: AtomicU64,
    pid: AtomicU32,
    /// Open mappings in other processes.
    opens: AtomicU32,
}

/// The export's header at `addr`.
///
/// # Safety
/// `addr` is a live mapping of an export's header page.
unsafe fn header<'a>(addr: u64) -> &'a Header {
    // SAFETY: this function's contract; the page is zeroed or written by
    // `share`, and every field is an atomic.
    unsafe { &*(addr as usize as *const Header) }
}

/// The system's page size.
fn page() -> usize {
    // SAFETY: `sysconf` has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// `mmap`, `None` on failure.
///
/// # Safety
/// As `mmap(2)`: a `MAP_FIXED` address must be a mapping this module owns.
unsafe fn map(addr: u64, len: usize, flags: i32, fd: i32, off: usize) -> Option<u64> {
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
fn fresh_pages(mapped: usize) -> Result<u64, CUresult> {
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
/// `[addr, addr + len)` is a mapping this module owns, not touched again.
unsafe fn unmap(addr: u64, len: usize) {
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

struct Registry {
    map: BTreeMap<u64, Alloc>,
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

static REG: RwLock<Registry> = RwLock::new(Registry {
    map: BTreeMap::new(),
    used: BTreeMap::new(),
});

/// Serial numbers of exports, unique in this process.
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

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
                super::ipc::violation(ptr, opens);
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

/// What another process needs to map an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Export {
    /// The memfd holding the pages, in the exporting process.
    pub(crate) fd: i32,
    /// Unique in the exporting process.
    pub(crate) serial: u64,
    /// The allocation's length.
    pub(crate) len: usize,
    /// The mapped bytes (whole pages; the header page follows them).
    pub(crate) mapped: usize,
}

/// Makes the device allocation that starts at `start` mappable by other
/// processes (once; later calls return the same export): its pages become
/// a shared mapping of a memfd at the same address, contents kept, under
/// the registry's write lock so no access sees the move.
pub(crate) fn share(start: u64) -> Result<Export, CUresult> {
    let mut reg = REG.write();
    let a = reg
        .map
        .get_mut(&start)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if let Some(e) = a.export() {
        return Ok(e);
    }
    let Backing::Private { mapped } = a.backing else {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    };
    let pg = page();
    let oom = |what: &str| {
        tracing::error!(
            start,
            "emulated cuIpcGetMemHandle: {what}: {}",
            std::io::Error::last_os_error()
        );
        CUresult::CUDA_ERROR_OUT_OF_MEMORY
    };
    // SAFETY: the name is a C string; the flags are valid.
    let fd = unsafe { libc::memfd_create(c"metrale-emu-ipc".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(oom("memfd_create"));
    }
    let total = mapped + pg;
    let fail = |what: &str| {
        let e = oom(what);
        // SAFETY: `fd` is ours and not used after.
        unsafe { libc::close(fd) };
        e
    };
    let Ok(size) = libc::off_t::try_from(total) else {
        return Err(fail("size"));
    };
    // SAFETY: `fd` is a fresh memfd of ours.
    if unsafe { libc::ftruncate(fd, size) } != 0 {
        return Err(fail("ftruncate"));
    }
    // SAFETY: a fresh shared mapping of the memfd, placed by the kernel.
    let Some(tmp) = (unsafe { map(0, total, libc::MAP_SHARED, fd, 0) }) else {
        return Err(fail("mmap"));
    };
    let serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
    // SAFETY: `tmp` maps `total` bytes of the memfd, and `start` the
    // allocation's `mapped` bytes; the write lock keeps every access out
    // while the pages move. The second `map` replaces the private pages at
    // `start` (a mapping this module owns) with the memfd's, which now hold
    // the same bytes; then only the header page of `tmp` stays mapped.
    unsafe {
        std::ptr::copy_nonoverlapping(start as usize as *const u8, tmp as usize as *mut u8, mapped);
        let h = header(tmp + mapped as u64);
        h.serial.store(serial, Ordering::Relaxed);
        h.pid.store(std::process::id(), Ordering::Relaxed);
        h.magic.store(SHARE_MAGIC, Ordering::Release);
        if map(start, mapped, libc::MAP_SHARED | libc::MAP_FIXED, fd, 0) != Some(start) {
            unmap(tmp, total);
            return Err(fail("mmap at the allocation"));
        }
        unmap(tmp, mapped);
    }
    a.backing = Backing::Shared {
        mapped,
        fd,
        header: tmp + mapped as u64,
        serial,
    };
    a.export().ok_or(CUresult::CUDA_ERROR_UNKNOWN)
}

/// A mapping of another process's export: its data (registered on the
/// importing device) and its header page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Imported {
    /// Where the data is mapped here.
    pub(crate) addr: u64,
    mapped: usize,
    header: u64,
}

/// Maps the export `e` of process `pid` on `device`: opens the exporter's
/// memfd through `/proc`, checks the header names that export, maps the
/// data and registers it. `CUDA_ERROR_INVALID_HANDLE` when the export is
/// gone (or its descriptor now names something else).
pub(crate) fn import(pid: u32, e: Export, device: i32) -> Result<Imported, CUresult> {
    use std::os::fd::AsRawFd as _;
    let invalid = |why: &str| {
        tracing::warn!(
            pid,
            fd = e.fd,
            serial = e.serial,
            "emulated cuIpcOpenMemHandle: {why}"
        );
        CUresult::CUDA_ERROR_INVALID_HANDLE
    };
    let pg = page();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/{pid}/fd/{}", e.fd))
        .map_err(|err| invalid(&format!("the exporter's memory is gone ({err})")))?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    if !e.mapped.is_multiple_of(pg) || e.len > e.mapped || size != (e.mapped + pg) as u64 {
        return Err(invalid("not an export of that size"));
    }
    let fd = file.as_raw_fd();
    // SAFETY: a fresh shared mapping of the exporter's memfd (its size
    // checked), placed by the kernel.
    let h = unsafe { map(0, pg, libc::MAP_SHARED, fd, e.mapped) }
        .ok_or_else(|| invalid("mmap of its header"))?;
    // SAFETY: `h` maps the export's header page.
    let hd = unsafe { header(h) };
    if hd.magic.load(Ordering::Acquire) != SHARE_MAGIC
        || hd.serial.load(Ordering::Acquire) != e.serial
        || hd.pid.load(Ordering::Acquire) != pid
    {
        // SAFETY: mapped just above, not used after.
        unsafe { unmap(h, pg) };
        return Err(invalid("a different export (the handle is stale)"));
    }
    // SAFETY: as for the header, the data pages.
    let Some(addr) = (unsafe { map(0, e.mapped, libc::MAP_SHARED, fd, 0) }) else {
        // SAFETY: mapped just above, not used after.
        unsafe { unmap(h, pg) };
        return Err(invalid("mmap of its data"));
    };
    drop(file);
    hd.opens.fetch_add(1, Ordering::AcqRel);
    REG.write().map.insert(
        addr,
        Alloc {
            len: e.len,
            device: Some(device),
            backing: Backing::Imported { mapped: e.mapped },
        },
    );
    Ok(Imported {
        addr,
        mapped: e.mapped,
        header: h,
    })
}

/// Unmaps an [`import`]: off the registry first (under its write lock, so
/// no access is in flight), then the pages, then one open less in the
/// export's header.
pub(crate) fn unimport(m: Imported) {
    REG.write().map.remove(&m.addr);
    // SAFETY: `m` is an import this module mapped, now off the registry
    // (no access can reach it) and unmapped once, here.
    unsafe {
        unmap(m.addr, m.mapped);
        header(m.header).opens.fetch_sub(1, Ordering::AcqRel);
        unmap(m.header, page());
    }
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

/// Copies `len` bytes (ranges may overlap).
///
/// # Safety
/// Both ranges are valid for `len` bytes.
pub(crate) unsafe fn copy(dst: u64, src: u64, len: usize) {
    if len == 0 {
        return;
    }
    // SAFETY: both ranges are valid (this function's contract); `copy` allows
    // overlap.
    unsafe { std::ptr::copy(src as usize as *const u8, dst as usize as *mut u8, len) };
}

/// A copy between host and device: validates device ranges now, and
/// enqueues the copy on `stream` (or copies now when `stream` is `None`).
/// Registered ranges (device memory, and pinned host memory) are checked
/// again when the copy runs, atomically with the copy.
fn memcpy(
    dst: u64,
    src: u64,
    len: usize,
    dst_dev: bool,
    src_dev: bool,
    stream: Option<CUstream>,
) -> CUresult {
    code((|| {
        check_init()?;
        if len == 0 {
            return Ok(());
        }
        if (dst_dev && !range_ok(dst, len, false)) || (src_dev && !range_ok(src, len, false)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        if dst == 0 || src == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // Device memory, or pinned host memory: in the registry, checked
        // when touched. Pageable host memory is the caller's.
        let dst_reg = dst_dev || range_ok(dst, len, false);
        let src_reg = src_dev || range_ok(src, len, false);
        let spans = move |from_staged: bool| {
            let mut v = Vec::with_capacity(2);
            if dst_reg {
                v.push(Span::any(dst, len));
            }
            if src_reg && !from_staged {
                v.push(Span::any(src, len));
            }
            v
        };
        let Some(stream) = stream else {
            driver::current_sticky()?;
            // SAFETY: registered ranges are live for the whole copy (checked
            // under the registry lock `access` holds); pageable host ranges
            // are the caller's (the C function's contract).
            return access(&spans(false), || unsafe { copy(dst, src, len) })
                .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE);
        };
        let target = stream::resolve(stream, None)?;
        let dev = target.stream.device();
        driver::sticky(dev)?;
        // A pageable host source is staged at launch, as CUDA does; a pinned
        // one is read when the copy runs.
        let staged = !src_reg;
        let l: Launcher = Arc::new(move || {
            let data: Option<Vec<u8>> = staged.then(|| {
                let mut v = vec![0u8; len];
                // SAFETY: the caller keeps the host source valid until the
                // call that launches the copy returns (CUDA's contract).
                unsafe { copy(v.as_mut_ptr() as usize as u64, src, len) };
                v
            });
            Box::new(move || {
                if driver::sticky(dev).is_err() {
                    return;
                }
                let from = data.as_ref().map_or(src, |v| v.as_ptr() as usize as u64);
                // SAFETY: registered ranges are live for the whole copy
                // (checked under the lock `access` holds); a staged source
                // is `data`; pageable host ranges are kept valid by the
                // caller until the stream reaches the copy (CUDA's contract
                // for asynchronous copies).
                let done = access(&spans(staged), || unsafe { copy(dst, from, len) });
                if done.is_none() {
                    illegal_address(dev, "copy", dst, len);
                }
            })
        });
        let pageable_dst = !dst_reg;
        stream::submit(&target, l)?;
        if pageable_dst && !target.stream.capturing() {
            // A copy to pageable memory returns once done, as in CUDA.
            target.stream.wait_idle()?;
            driver::sticky(dev)?;
        }
        Ok(())
    })())
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

fn memset(dst: u64, pattern: Vec<u8>, n: usize, stream: Option<CUstream>) -> CUresult {
    code((|| {
        check_init()?;
        let w = pattern.len();
        let len = n.checked_mul(w).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        if len == 0 {
            return Ok(());
        }
        if !range_ok(dst, len, false) || !dst.is_multiple_of(w as u64) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let fill = move || {
            if let [b] = pattern[..] {
                // SAFETY: `[dst, dst + n)` is a live allocation for the whole
                // call (the caller holds it through `access`).
                unsafe { std::ptr::write_bytes(dst as usize as *mut u8, b, n) };
                return;
            }
            // SAFETY: `[dst, dst + n * w)` is a live allocation for the whole
            // call (the caller holds it through `access`) and nothing else
            // holds a reference into it.
            let out = unsafe { std::slice::from_raw_parts_mut(dst as usize as *mut u8, len) };
            for chunk in out.chunks_exact_mut(w) {
                chunk.copy_from_slice(&pattern);
            }
        };
        let span = [Span::any(dst, len)];
        match stream {
            None => {
                driver::current_sticky()?;
                access(&span, fill).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
            }
            Some(s) => {
                let target = stream::resolve(s, None)?;
                let dev = target.stream.device();
                driver::sticky(dev)?;
                let fill = Arc::new(fill);
                stream::submit(
                    &target,
                    Arc::new(move || {
                        let fill = fill.clone();
                        Box::new(move || {
                            if driver::sticky(dev).is_err() {
                                return;
                            }
                            if access(&span, || fill()).is_none() {
                                illegal_address(dev, "memset", dst, len);
                            }
                        })
                    }),
                )
            }
        }
    })())
}

/// `cuMemGetInfo_v2`: free and total bytes of the current device.
///
/// # Safety
/// `free` and `total` are null or valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let dev = driver::current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            if free.is_null() || total.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: both pointers are non-null and valid (this function's
            // contract).
            unsafe {
                put(free, TOTAL_MEM - used(dev).min(TOTAL_MEM));
                put(total, TOTAL_MEM);
            }
            Ok(())
        })())
    })
}

/// `cuMemAlloc_v2`: device memory on the current context's device.
///
/// # Safety
/// `dptr` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let dev = driver::current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            if dptr.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            driver::sticky(dev)?;
            let p = alloc(Some(dev), bytesize)?;
            // SAFETY: `dptr` is non-null and valid (this function's contract).
            unsafe { put(dptr, p) };
            Ok(())
        })())
    })
}

/// `cuMemFree_v2`: frees device memory once the work queued on its device
/// before the call has run (the driver's implicit synchronisation); an
/// unknown pointer is `CUDA_ERROR_INVALID_VALUE`, a device with a sticky
/// error returns it.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code(check_init().and_then(|_| free(dptr, true)))
    })
}

/// `cuMemAllocHost_v2`: pinned host memory (plain host memory here).
///
/// # Safety
/// `pp` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            driver::current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            if pp.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            let p = alloc(None, bytesize)?;
            // SAFETY: `pp` is non-null and valid (this function's contract).
            unsafe { put(pp, p as usize as *mut c_void) };
            Ok(())
        })())
    })
}

/// `cuMemFreeHost`: frees pinned host memory at once (queued copies that
/// still use it find it gone when they run: a sticky illegal address).
///
/// # Safety
/// None beyond the C API's: `p` is only compared with the registry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code(check_init().and_then(|_| free(p as usize as u64, false)))
    })
}

/// `cuMemcpyHtoD_v2`: synchronous copy.
///
/// # Safety
/// `src` is valid for `n` bytes of reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memcpy(dst, src as usize as u64, n, true, false, None)
    })
}

/// `cuMemcpyDtoH_v2`: synchronous copy.
///
/// # Safety
/// `dst` is valid for `n` bytes of writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memcpy(dst as usize as u64, src, n, false, true, None)
    })
}

/// `cuMemcpyDtoD_v2`: synchronous copy.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memcpy(dst, src, n, true, true, None)
    })
}

/// `cuMemcpyHtoDAsync_v2`: copy enqueued on `stream`.
///
/// # Safety
/// `src` is valid for `n` bytes of reads until the copy runs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    stream: CUstream,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memcpy(dst, src as usize as u64, n, true, false, Some(stream))
    })
}

/// `cuMemcpyDtoHAsync_v2`: copy enqueued on `stream`.
///
/// # Safety
/// `dst` is valid for `n` bytes of writes until the copy runs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    stream: CUstream,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memcpy(dst as usize as u64, src, n, false, true, Some(stream))
    })
}

/// `cuMemcpyDtoDAsync_v2`: copy enqueued on `stream`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    stream: CUstream,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memcpy(dst, src, n, true, true, Some(stream))
    })
}

/// `cuMemsetD8_v2`: synchronous memset of bytes.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, uc: u8, n: usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memset(dst, vec![uc], n, None)
    })
}

/// `cuMemsetD32_v2`: synchronous memset of 32-bit words.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD32_v2(dst: CUdeviceptr, ui: u32, n: usize) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memset(dst, ui.to_ne_bytes().to_vec(), n, None)
    })
}

/// `cuMemsetD8Async`: memset of bytes enqueued on `stream`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8Async(
    dst: CUdeviceptr,
    uc: u8,
    n: usize,
    stream: CUstream,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memset(dst, vec![uc], n, Some(stream))
    })
}

/// `cuMemsetD32Async`: memset of 32-bit words enqueued on `stream`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD32Async(
    dst: CUdeviceptr,
    ui: u32,
    n: usize,
    stream: CUstream,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        memset(dst, ui.to_ne_bytes().to_vec(), n, Some(stream))
    })
}
