//! Emulated device memory and pinned host memory: a registry of live
//! allocations, and the driver's allocation, copy and memset entry points.
//!
//! Invariants:
//! - Every allocation is host memory from `std::alloc`, 256-byte aligned,
//!   filled with `0xA5`, and recorded as `start -> (len, device)` until freed.
//! - Every device-side range is checked against the registry before it is
//!   touched: a range must lie inside one live allocation. Work that runs
//!   later (on a stream) checks again when it runs, through [`access`],
//!   which holds the registry's read lock from the check to the end of the
//!   access: a free takes the write lock, so it can never release memory
//!   between the check and the access, and the emulator never reads or
//!   writes freed host memory.
//! - A free of device memory first waits for the work queued on the
//!   allocation's device before the free (every stream of the device, the
//!   legacy stream and destroyed streams still draining included), as the
//!   driver's `cuMemFree` synchronises; work captured into a graph and not
//!   launched is not queued and is not waited for. Driver work that still
//!   finds its memory gone when it runs (it ran on another device, or the
//!   memory is pinned host memory) sets its device's sticky
//!   `CUDA_ERROR_ILLEGAL_ADDRESS`.
//! - The bytes in use per device are the sum of its live allocations.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Arc;

use cuda_sys::{CUdeviceptr, CUresult, CUstream};
use parking_lot::RwLock;

use crate::driver::{self, TOTAL_MEM, check_init, code};
use crate::stream::{self, Launcher};
use crate::{guard, put};

const ALIGN: usize = 256;
const GARBAGE: u8 = 0xA5;

#[derive(Debug, Clone, Copy)]
struct Alloc {
    len: usize,
    /// `None` for pinned host memory.
    device: Option<i32>,
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
    let layout =
        Layout::from_size_align(len, ALIGN).map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
    let mut reg = REG.write();
    if let Some(d) = device {
        let used = reg.used.get(&d).copied().unwrap_or(0);
        if used.saturating_add(len) > TOTAL_MEM {
            return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
    }
    // SAFETY: `layout` has a non-zero size.
    let p = unsafe { std::alloc::alloc(layout) };
    if p.is_null() {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    // SAFETY: `p` was just allocated with `len` bytes.
    unsafe { std::ptr::write_bytes(p, GARBAGE, len) };
    let start = p as usize as u64;
    reg.map.insert(start, Alloc { len, device });
    if let Some(d) = device {
        *reg.used.entry(d).or_insert(0) += len;
    }
    Ok(start)
}

/// Frees the allocation that starts at `ptr`, if it is of the given kind
/// (device memory when `device` is true, pinned host memory otherwise).
/// Device memory is freed once the work queued on its device before the
/// call has run (which never happens under a kernel that never ends, as
/// with the driver); a device with a sticky error refuses with it.
pub(crate) fn free(ptr: u64, device: bool) -> Result<(), CUresult> {
    let kind = REG.read().map.get(&ptr).map(|a| a.device);
    let dev = match kind {
        Some(d) if d.is_some() == device => d,
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    };
    if let Some(d) = dev {
        driver::sticky(d)?;
        stream::quiesce(d);
    }
    let mut reg = REG.write();
    match reg.map.get(&ptr) {
        Some(a) if a.device.is_some() == device => {}
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
    if a.device.is_some() {
        crate::ipc::freed(ptr);
    }
    let layout = Layout::from_size_align(a.len, ALIGN).map_err(|_| CUresult::CUDA_ERROR_UNKNOWN)?;
    // SAFETY: `ptr` was allocated by `alloc` with this layout and has just
    // been removed from the registry, so it is freed exactly once; the write
    // lock is still held, so no `access` is touching it.
    unsafe { std::alloc::dealloc(ptr as usize as *mut u8, layout) };
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
