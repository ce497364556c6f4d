//! Driver initialisation, device queries, and [`Context`], which retains a
//! device's primary context.
//!
//! Invariants:
//! - `cuInit` runs at most once per process; its outcome is kept.
//! - A [`Context`] holds one retain of its device's primary context and
//!   releases it exactly once, on drop.
//! - Device ordinals are checked against `cuDeviceGetCount` before use.

use std::ffi::c_char;
use std::sync::{Arc, OnceLock};

use cuda_sys::{CUcontext, CUdevice, CUdevice_attribute, CUresult};

use crate::error::{Error, Result, c_string, cuda_check, cuda_lib};

/// Initialises the driver (`cuInit(0)`) once per process; later calls return
/// the first outcome.
pub fn init() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: cuInit takes a flags word and has no pointer arguments.
        unsafe { cu!(cuInit(0)) }
    })
    .clone()
}

/// The driver's version code (`13000` for CUDA 13.0).
pub fn driver_version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: writes one int through a valid pointer.
    unsafe { cu!(cuDriverGetVersion(&mut v)) }?;
    Ok(v)
}

/// The number of devices the driver sees.
pub fn device_count() -> Result<usize> {
    init()?;
    let mut n = 0;
    // SAFETY: writes one int through a valid pointer.
    unsafe { cu!(cuDeviceGetCount(&mut n)) }?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Checks `ordinal` against the device count and returns its `CUdevice`.
pub(crate) fn device_handle(ordinal: usize, call: &'static str) -> Result<CUdevice> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::invalid(
            call,
            format!("device {ordinal} does not exist ({count} devices)"),
        ));
    }
    let mut dev: CUdevice = 0;
    // The check above keeps `ordinal` below the device count, an i32.
    let ord = ordinal as i32;
    // SAFETY: writes one CUdevice through a valid pointer.
    unsafe { cu!(cuDeviceGet(&mut dev, ord)) }?;
    Ok(dev)
}

/// What the driver reports about one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device ordinal.
    pub ordinal: usize,
    /// The device's name.
    pub name: String,
    /// Total device memory in bytes.
    pub total_memory: usize,
    /// (major, minor) compute capability.
    pub compute_capability: (i32, i32),
}

fn attribute(dev: CUdevice, attr: CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: writes one int through a valid pointer; `dev` is a device handle.
    unsafe { cu!(cuDeviceGetAttribute(&mut v, attr, dev)) }?;
    Ok(v)
}

/// Name, memory and compute capability of device `ordinal`.
pub fn device_info(ordinal: usize) -> Result<DeviceInfo> {
    let dev = device_handle(ordinal, "device_info")?;
    let mut buf = [0 as c_char; 256];
    // SAFETY: the driver writes at most `len` bytes, NUL included, into `buf`.
    unsafe { cu!(cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev)) }?;
    // Guarantee termination even if the driver filled the buffer.
    buf[buf.len() - 1] = 0;
    // SAFETY: `buf` is NUL-terminated and outlives the call.
    let name = unsafe { c_string(buf.as_ptr()) }.unwrap_or_default();
    let mut total = 0usize;
    // SAFETY: writes one size_t through a valid pointer.
    unsafe { cu!(cuDeviceTotalMem_v2(&mut total, dev)) }?;
    let major = attribute(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
    )?;
    let minor = attribute(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    )?;
    Ok(DeviceInfo {
        ordinal,
        name,
        total_memory: total,
        compute_capability: (major, minor),
    })
}

/// Whether device `ordinal` can launch thread block clusters
/// ([`Function::launch_cluster`](crate::Function::launch_cluster)): it
/// reports `CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH` (compute capability 9.0 and
/// newer) and the driver exports `cuLaunchKernelEx`. A driver too old for
/// either (CUDA before 11.8, which answers the attribute with
/// `CUDA_ERROR_INVALID_VALUE`) gives `false`.
pub fn supports_cluster_launch(ordinal: usize) -> Result<bool> {
    let dev = device_handle(ordinal, "supports_cluster_launch")?;
    let lib = cuda_lib()?;
    if lib.cuLaunchKernelEx.is_err() {
        return Ok(false);
    }
    let mut v = 0;
    // SAFETY: writes one int through a valid pointer; `dev` is a device handle.
    let rc = unsafe {
        cuda_sys::call!(
            lib,
            cuDeviceGetAttribute(
                &mut v,
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH,
                dev
            )
        )
    }?;
    if rc == CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(false);
    }
    cuda_check(rc, "cuDeviceGetAttribute")?;
    Ok(v != 0)
}

/// The PCI bus id of device `ordinal` (`DDDDDDDD:BB:DD.F`), which names a
/// device across processes whatever their visible-device lists.
pub fn pci_bus_id(ordinal: usize) -> Result<String> {
    let dev = device_handle(ordinal, "pci_bus_id")?;
    let mut buf = [0 as c_char; 64];
    // SAFETY: the driver writes at most `len` bytes, NUL included, into `buf`.
    unsafe { cu!(cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev)) }?;
    buf[buf.len() - 1] = 0;
    // SAFETY: `buf` is NUL-terminated and outlives the call.
    Ok(unsafe { c_string(buf.as_ptr()) }.unwrap_or_default())
}

/// Whether device `a` can access device `b`'s memory directly.
pub fn can_access_peer(a: usize, b: usize) -> Result<bool> {
    let da = device_handle(a, "can_access_peer")?;
    let db = device_handle(b, "can_access_peer")?;
    let mut v = 0;
    // SAFETY: writes one int through a valid pointer; both are device handles.
    unsafe { cu!(cuDeviceCanAccessPeer(&mut v, da, db)) }?;
    Ok(v != 0)
}

/// A retained primary context of one device.
///
/// Invariant: `raw` is the primary context of `dev`, retained once by this
/// value and released once by its drop.
#[derive(Debug)]
pub struct Context {
    raw: CUcontext,
    dev: CUdevice,
    ordinal: usize,
}

// SAFETY: a CUcontext is a process-wide handle that the driver lets any
// thread make current and use; this type only reads the handle.
unsafe impl Send for Context {}
// SAFETY: as for Send; no method mutates the value, and the driver
// synchronises concurrent use of one context internally.
unsafe impl Sync for Context {}

impl Context {
    /// Retains device `ordinal`'s primary context (initialising the driver
    /// first).
    pub fn new(ordinal: usize) -> Result<Arc<Context>> {
        init()?;
        let dev = device_handle(ordinal, "Context::new")?;
        let mut raw: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle through a valid pointer.
        unsafe { cu!(cuDevicePrimaryCtxRetain(&mut raw, dev)) }?;
        Ok(Arc::new(Context { raw, dev, ordinal }))
    }

    /// Makes this context current on the calling thread (nothing when it
    /// already is).
    pub fn make_current(&self) -> Result<()> {
        let mut cur: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle through a valid pointer.
        unsafe { cu!(cuCtxGetCurrent(&mut cur)) }?;
        if cur == self.raw {
            return Ok(());
        }
        // SAFETY: `self.raw` is a retained, live primary context.
        unsafe { cu!(cuCtxSetCurrent(self.raw)) }
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The raw context handle (still owned by this value).
    pub fn raw(&self) -> CUcontext {
        self.raw
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.make_current()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two size_t through valid pointers; the context is current.
        unsafe { cu!(cuMemGetInfo_v2(&mut free, &mut total)) }?;
        Ok((free, total))
    }

    /// Waits for all work in this context (`cuCtxSynchronize`).
    pub fn synchronize(&self) -> Result<()> {
        self.make_current()?;
        // SAFETY: no arguments; the context is current.
        unsafe { cu!(cuCtxSynchronize()) }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let dev = self.dev;
        let release = || -> Result<()> {
            // SAFETY: this value holds one retain of `dev`'s primary context,
            // released here once.
            unsafe { cu!(cuDevicePrimaryCtxRelease_v2(dev)) }
        };
        if let Err(e) = release() {
            tracing::error!(device = self.ordinal, error = %e, "releasing the primary context failed");
        }
    }
}
