//! The emulated driver: initialisation, devices, primary contexts, the
//! per-thread current context, peer access, error names, and each
//! device's sticky error.
//!
//! Invariants:
//! - Nothing but the error-name functions works before `cuInit`.
//! - A context handle is `CTX_BASE + 16 * device`; the current context is a
//!   thread-local device ordinal.
//! - A device's primary context holds at most one sticky error (the first
//!   one, such as `CUDA_ERROR_ILLEGAL_ADDRESS` from work that touched memory
//!   not allocated when it ran). Once set, every later call on that context
//!   (synchronise, query, launch, copy, allocate, free) returns it, and
//!   driver work still queued there is dropped as it is reached, as on a
//!   GPU. It is cleared when the last reference to the primary context is
//!   released (the driver destroys the context then).

use std::cell::Cell;
use std::collections::BTreeSet;
use std::ffi::{c_char, c_int, c_uint};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use cuda_sys::{CUcontext, CUdevice, CUdevice_attribute, CUresult};
use parking_lot::Mutex;

use crate::{guard, id_to_ptr, ptr_to_id, put};

/// Memory of each emulated device: 80 GiB.
pub(crate) const TOTAL_MEM: usize = 80 << 30;
const NAME: &[u8] = b"Metrale emulated GPU";
const CTX_BASE: u64 = 0xC0_0000;
const MAX_DEVICES: i32 = 64;

static INITIALIZED: AtomicBool = AtomicBool::new(false);

/// Each device's sticky error (0: none).
static STICKY: [AtomicU32; MAX_DEVICES as usize] =
    [const { AtomicU32::new(0) }; MAX_DEVICES as usize];

/// Records `error` as `device`'s sticky error, unless it already has one.
pub(crate) fn set_sticky(device: i32, error: CUresult) {
    if let Some(s) = usize::try_from(device).ok().and_then(|d| STICKY.get(d)) {
        let _ = s.compare_exchange(0, error.0, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// `device`'s sticky error, if its context has one.
pub(crate) fn sticky(device: i32) -> Result<(), CUresult> {
    let code = usize::try_from(device)
        .ok()
        .and_then(|d| STICKY.get(d))
        .map_or(0, |s| s.load(Ordering::Acquire));
    if code == 0 {
        Ok(())
    } else {
        Err(CUresult(code))
    }
}

/// The current context's sticky error, if a context is current and has one.
pub(crate) fn current_sticky() -> Result<(), CUresult> {
    current_device().map_or(Ok(()), sticky)
}

thread_local! {
    static CURRENT: Cell<i32> = const { Cell::new(-1) };
}

/// Whether `cuInit` succeeded.
pub(crate) fn initialized() -> bool {
    INITIALIZED.load(Ordering::Acquire)
}

/// The number of emulated devices (`METRALE_EMU_DEVICES`, default 8).
pub(crate) fn device_count() -> i32 {
    static N: OnceLock<i32> = OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("METRALE_EMU_DEVICES")
            .ok()
            .and_then(|v| v.trim().parse::<i32>().ok())
            .map_or(8, |n| n.clamp(0, MAX_DEVICES))
    })
}

fn refcounts() -> &'static [AtomicU32] {
    static R: OnceLock<Vec<AtomicU32>> = OnceLock::new();
    R.get_or_init(|| (0..MAX_DEVICES).map(|_| AtomicU32::new(0)).collect())
}

/// The calling thread's current device, if a context is current.
pub(crate) fn current_device() -> Option<i32> {
    let d = CURRENT.with(Cell::get);
    (d >= 0).then_some(d)
}

fn valid_device(dev: CUdevice) -> bool {
    (0..device_count()).contains(&dev)
}

/// The handle of `dev`'s primary context.
pub(super) fn ctx_handle(dev: i32) -> CUcontext {
    id_to_ptr(CTX_BASE + 16 * dev as u64)
}

fn ctx_device(ctx: CUcontext) -> Option<i32> {
    let id = ptr_to_id(ctx);
    if id < CTX_BASE || !(id - CTX_BASE).is_multiple_of(16) {
        return None;
    }
    let dev = i32::try_from((id - CTX_BASE) / 16).ok()?;
    valid_device(dev).then_some(dev)
}

/// The driver return code of `r`.
pub(crate) fn code(r: Result<(), CUresult>) -> CUresult {
    r.err().unwrap_or(CUresult::CUDA_SUCCESS)
}

/// `CUDA_ERROR_NOT_INITIALIZED` until `cuInit` has run.
pub(crate) fn check_init() -> Result<(), CUresult> {
    if initialized() {
        Ok(())
    } else {
        Err(CUresult::CUDA_ERROR_NOT_INITIALIZED)
    }
}

fn check_dev(dev: CUdevice) -> Result<(), CUresult> {
    check_init()?;
    if valid_device(dev) {
        Ok(())
    } else {
        Err(CUresult::CUDA_ERROR_INVALID_DEVICE)
    }
}

/// Writes `v` to an out-parameter, or fails with `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `p` is null or valid for a write.
pub(super) unsafe fn out<T>(p: *mut T, v: T) -> Result<(), CUresult> {
    // SAFETY: `p` is null or valid (this function's contract).
    if unsafe { put(p, v) } {
        Ok(())
    } else {
        Err(CUresult::CUDA_ERROR_INVALID_VALUE)
    }
}

/// Copies `s` with a NUL into a C buffer of `len` bytes, truncating.
///
/// # Safety
/// `buf` is null or valid for `len` bytes of writes.
unsafe fn out_str(buf: *mut c_char, len: c_int, s: &[u8]) -> Result<(), CUresult> {
    if buf.is_null() || len <= 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let n = s.len().min(len as usize - 1);
    // SAFETY: `buf` holds `len > n` bytes (this function's contract).
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
    Ok(())
}

/// `cuGetErrorString`: a static description of `error`.
///
/// # Safety
/// `p_str` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, p_str: *mut *const c_char) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        let found = super::errors::lookup(error.0);
        let s = found.map_or(std::ptr::null(), |(_, s)| s.as_ptr());
        // SAFETY: `p_str` is null or valid (this function's contract).
        match unsafe { out(p_str, s) } {
            Ok(()) if found.is_some() => CUresult::CUDA_SUCCESS,
            _ => CUresult::CUDA_ERROR_INVALID_VALUE,
        }
    })
}

/// `cuGetErrorName`: the static name of `error`.
///
/// # Safety
/// `p_str` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, p_str: *mut *const c_char) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        let found = super::errors::lookup(error.0);
        let s = found.map_or(std::ptr::null(), |(n, _)| n.as_ptr());
        // SAFETY: `p_str` is null or valid (this function's contract).
        match unsafe { out(p_str, s) } {
            Ok(()) if found.is_some() => CUresult::CUDA_SUCCESS,
            _ => CUresult::CUDA_ERROR_INVALID_VALUE,
        }
    })
}

/// `cuInit`: flags must be 0.
#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        if flags != 0 {
            return CUresult::CUDA_ERROR_INVALID_VALUE;
        }
        if device_count() == 0 {
            return CUresult::CUDA_ERROR_NO_DEVICE;
        }
        INITIALIZED.store(true, Ordering::Release);
        CUresult::CUDA_SUCCESS
    })
}

/// `cuDriverGetVersion`: 13000.
///
/// # Safety
/// `v` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        // SAFETY: `v` is null or valid (this function's contract).
        let r = unsafe { out(v, 13000) };
        code(r)
    })
}

/// `cuDeviceGet`.
///
/// # Safety
/// `device` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        // SAFETY: `device` is null or valid (this function's contract).
        code(check_dev(ordinal).and_then(|_| unsafe { out(device, ordinal) }))
    })
}

/// `cuDeviceGetCount`.
///
/// # Safety
/// `count` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        // SAFETY: `count` is null or valid (this function's contract).
        code(check_init().and_then(|_| unsafe { out(count, device_count()) }))
    })
}

/// `cuDeviceGetName`: "Metrale emulated GPU".
///
/// # Safety
/// `name` is null or valid for `len` bytes of writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        // SAFETY: `name` is null or valid for `len` bytes (this function's contract).
        code(check_dev(dev).and_then(|_| unsafe { out_str(name, len, NAME) }))
    })
}

/// `cuDeviceGetPCIBusId`: a distinct bus per device.
///
/// # Safety
/// `bus_id` is null or valid for `len` bytes of writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(
    bus_id: *mut c_char,
    len: c_int,
    dev: CUdevice,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        let s = format!("00000000:{:02X}:00.0", 0x18 + dev);
        // SAFETY: `bus_id` is null or valid for `len` bytes (this function's contract).
        code(check_dev(dev).and_then(|_| unsafe { out_str(bus_id, len, s.as_bytes()) }))
    })
}

/// `cuDeviceTotalMem_v2`: 80 GiB.
///
/// # Safety
/// `bytes` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        // SAFETY: `bytes` is null or valid (this function's contract).
        code(check_dev(dev).and_then(|_| unsafe { out(bytes, TOTAL_MEM) }))
    })
}

fn attribute(a: CUdevice_attribute, dev: CUdevice) -> Option<c_int> {
    type A = CUdevice_attribute;
    Some(match a {
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => 9,
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => 0,
        A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => 132,
        A::CU_DEVICE_ATTRIBUTE_WARP_SIZE => 32,
        A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK => 1024,
        A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X | A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y => 1024,
        A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z => 64,
        A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X => i32::MAX,
        A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y | A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z => 65535,
        A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING
        | A::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH
        | A::CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS
        | A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY
        | A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY => 1,
        A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID => 0x18 + dev,
        A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID | A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID => 0,
        A::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT => 2,
        A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE => 1_980_000,
        A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE => 2_619_000,
        A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH => 6144,
        A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE => 50 << 20,
        other if (1..=150).contains(&other.0) => 0,
        _ => return None,
    })
}

/// `cuDeviceGetAttribute`: compute capability 9.0 and plausible H100-class
/// values (cluster launch supported); other known attributes read 0.
///
/// # Safety
/// `pi` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    pi: *mut c_int,
    attrib: CUdevice_attribute,
    dev: CUdevice,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_dev(dev)?;
            let v = attribute(attrib, dev).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
            // SAFETY: `pi` is null or valid (this function's contract).
            unsafe { out(pi, v) }
        })())
    })
}

/// `cuDeviceCanAccessPeer`: every distinct pair can.
///
/// # Safety
/// `can` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    can: *mut c_int,
    dev: CUdevice,
    peer: CUdevice,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_dev(dev)?;
            check_dev(peer)?;
            // SAFETY: `can` is null or valid (this function's contract).
            unsafe { out(can, c_int::from(dev != peer)) }
        })())
    })
}

static PEERS: Mutex<BTreeSet<(i32, i32)>> = Mutex::new(BTreeSet::new());

/// `cuCtxEnablePeerAccess`: from the current context to `peer`.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxEnablePeerAccess(peer: CUcontext, flags: c_uint) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let cur = current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            let p = ctx_device(peer).ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            if flags != 0 {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            if p == cur {
                return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
            }
            if !PEERS.lock().insert((cur, p)) {
                return Err(CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
            }
            Ok(())
        })())
    })
}

/// `cuDevicePrimaryCtxRetain`: counts a reference.
///
/// # Safety
/// `pctx` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_dev(dev)?;
            // SAFETY: `pctx` is null or valid (this function's contract).
            unsafe { out(pctx, ctx_handle(dev)) }?;
            refcounts()[dev as usize].fetch_add(1, Ordering::AcqRel);
            Ok(())
        })())
    })
}

/// `cuDevicePrimaryCtxRelease_v2`: drops a reference; releasing one never
/// retained is `CUDA_ERROR_INVALID_CONTEXT`. The last release clears the
/// context's sticky error.
#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_dev(dev)?;
            let before = refcounts()[dev as usize]
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .map_err(|_| CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            if before == 1 {
                // The last reference: the driver destroys the context, and
                // its sticky error with it.
                STICKY[dev as usize].store(0, Ordering::Release);
            }
            Ok(())
        })())
    })
}

/// `cuCtxSetCurrent`: per thread; null unsets.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let dev = if ctx.is_null() {
                -1
            } else {
                ctx_device(ctx).ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?
            };
            CURRENT.with(|c| c.set(dev));
            Ok(())
        })())
    })
}

/// `cuCtxGetCurrent`: null when none is current.
///
/// # Safety
/// `pctx` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let c = current_device().map_or(std::ptr::null_mut(), ctx_handle);
            // SAFETY: `pctx` is null or valid (this function's contract).
            unsafe { out(pctx, c) }
        })())
    })
}

/// `cuCtxGetDevice`: the current context's device.
///
/// # Safety
/// `device` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let d = current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            // SAFETY: `device` is null or valid (this function's contract).
            unsafe { out(device, d) }
        })())
    })
}
