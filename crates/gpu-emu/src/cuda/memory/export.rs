//! Exports of device memory to other processes (the memory side of CUDA
//! IPC, driven by `cuda::ipc`): an exported allocation's pages become a
//! shared mapping of a memfd, which another process maps through
//! `/proc/<pid>/fd` and registers as its own device memory.
//!
//! Invariants: an allocation is exported at most once (later calls return
//! the same export) and its pages move under the registry's write lock,
//! contents kept, so no access sees the move; an export is named by its
//! descriptor and a serial number that its header page repeats, so a stale
//! handle is refused; an import is off the registry before it is unmapped.

use std::sync::atomic::{AtomicU64, Ordering};

use cuda_sys::CUresult;

use super::pages::{SHARE_MAGIC, header, map, page, unmap};
use super::registry::{Alloc, Backing, REG};

/// Serial numbers of exports, unique in this process.
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

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
