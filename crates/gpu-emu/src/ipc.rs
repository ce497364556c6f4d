//! CUDA IPC of device memory (`cuIpcGetMemHandle`, `cuIpcOpenMemHandle_v2`,
//! `cuIpcCloseMemHandle`) for ranks that are threads of this process.
//!
//! Device memory is host memory of the process, so opening a handle returns
//! the exporter's own address; what is emulated is the bookkeeping the
//! driver does and the order it requires:
//! - a handle names one allocation (its address and a serial number drawn
//!   when it is first exported), so a handle of memory freed since, even if
//!   the address was reused, is `CUDA_ERROR_INVALID_HANDLE`;
//! - a handle opens only in the process that made it (the emulator cannot
//!   map another process's memory): elsewhere `CUDA_ERROR_INVALID_HANDLE`;
//! - each open is counted per opening device and closed once;
//! - freeing an allocation while another context still has it open (the
//!   driver calls that undefined) is counted as a violation and logged, and
//!   the free goes ahead, so the importer's later access is a sticky
//!   illegal address as a real fault would be.
//!
//! Control functions: `metrale_emu_ipc_open_mappings()` (mappings open
//! now) and `metrale_emu_ipc_violations()` (frees of memory still mapped,
//! since the process started).
//!
//! Invariant: the state's lock is taken after the allocation registry's,
//! never before it.

use std::collections::BTreeMap;
use std::ffi::c_uint;
use std::sync::atomic::{AtomicU64, Ordering};

use cuda_sys::ipc::{CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, CUipcMemHandle};
use cuda_sys::{CUdeviceptr, CUresult};
use parking_lot::Mutex;

use crate::driver::{check_init, code, current_device};
use crate::{guard, memory, put};

const MAGIC: &[u8; 8] = b"EMUIPC01";

struct State {
    /// Exported allocation start -> its serial number.
    exported: BTreeMap<u64, u64>,
    /// (opening device, allocation start) -> open count.
    open: BTreeMap<(i32, u64), u32>,
    next_serial: u64,
}

static STATE: Mutex<State> = Mutex::new(State {
    exported: BTreeMap::new(),
    open: BTreeMap::new(),
    next_serial: 1,
});

static VIOLATIONS: AtomicU64 = AtomicU64::new(0);

/// Called by the allocation registry when device memory at `start` is
/// freed (with the registry's write lock held).
pub(crate) fn freed(start: u64) {
    let mut st = STATE.lock();
    st.exported.remove(&start);
    let holders: Vec<i32> = st
        .open
        .keys()
        .filter(|(_, s)| *s == start)
        .map(|(d, _)| *d)
        .collect();
    drop(st);
    if !holders.is_empty() {
        VIOLATIONS.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            start,
            ?holders,
            "emulated cuMemFree of memory other contexts still have open through \
             cuIpcOpenMemHandle (undefined in the driver): close the mappings first"
        );
    }
}

fn encode(pid: u32, start: u64, serial: u64) -> CUipcMemHandle {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(MAGIC);
    b[8..12].copy_from_slice(&pid.to_le_bytes());
    b[16..24].copy_from_slice(&start.to_le_bytes());
    b[24..32].copy_from_slice(&serial.to_le_bytes());
    CUipcMemHandle {
        reserved: b.map(|x| x as std::ffi::c_char),
    }
}

fn decode(h: &CUipcMemHandle) -> Option<(u32, u64, u64)> {
    let b = h.reserved.map(|x| x as u8);
    if &b[..8] != MAGIC {
        return None;
    }
    let pid = u32::from_le_bytes(b[8..12].try_into().ok()?);
    let start = u64::from_le_bytes(b[16..24].try_into().ok()?);
    let serial = u64::from_le_bytes(b[24..32].try_into().ok()?);
    Some((pid, start, serial))
}

/// `cuIpcGetMemHandle`: `dptr` must be the start of a live device
/// allocation.
///
/// # Safety
/// `handle` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetMemHandle(
    handle: *mut CUipcMemHandle,
    dptr: CUdeviceptr,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            match memory::find(dptr) {
                Some((start, _, Some(_))) if start == dptr => {}
                _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
            }
            let serial = {
                let mut st = STATE.lock();
                let next = st.next_serial;
                let serial = *st.exported.entry(dptr).or_insert(next);
                if serial == next {
                    st.next_serial += 1;
                }
                serial
            };
            let h = encode(std::process::id(), dptr, serial);
            // SAFETY: `handle` is null or valid (this function's contract).
            if unsafe { put(handle, h) } {
                Ok(())
            } else {
                Err(CUresult::CUDA_ERROR_INVALID_VALUE)
            }
        })())
    })
}

/// `cuIpcOpenMemHandle_v2`: the exporter's address, counted as open by the
/// current device.
///
/// # Safety
/// `pdptr` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    pdptr: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    flags: c_uint,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let dev = current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            if pdptr.is_null() || flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            let (pid, start, serial) =
                decode(&handle).ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
            if pid != std::process::id() {
                tracing::warn!(
                    pid,
                    "emulated IPC handles open only in the process that made them"
                );
                return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
            }
            let mut st = STATE.lock();
            if st.exported.get(&start) != Some(&serial) {
                return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
            }
            *st.open.entry((dev, start)).or_insert(0) += 1;
            drop(st);
            // SAFETY: `pdptr` is non-null and valid (this function's contract).
            unsafe { put(pdptr, start) };
            Ok(())
        })())
    })
}

/// `cuIpcCloseMemHandle`: releases one open of `dptr` by the current
/// device; `CUDA_ERROR_INVALID_VALUE` when it has none.
#[unsafe(no_mangle)]
pub extern "C" fn cuIpcCloseMemHandle(dptr: CUdeviceptr) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let dev = current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            let mut st = STATE.lock();
            let n = st
                .open
                .get_mut(&(dev, dptr))
                .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
            *n -= 1;
            if *n == 0 {
                st.open.remove(&(dev, dptr));
            }
            Ok(())
        })())
    })
}

/// The number of IPC mappings open now, every device and count included.
#[unsafe(no_mangle)]
pub extern "C" fn metrale_emu_ipc_open_mappings() -> u64 {
    guard(u64::MAX, || {
        STATE.lock().open.values().map(|n| u64::from(*n)).sum()
    })
}

/// Frees of device memory that another context still had open through IPC,
/// since the process started.
#[unsafe(no_mangle)]
pub extern "C" fn metrale_emu_ipc_violations() -> u64 {
    VIOLATIONS.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip() {
        let h = encode(7, 0x1000, 3);
        assert_eq!(decode(&h), Some((7, 0x1000, 3)));
        let mut bad = h;
        bad.reserved[0] = 0;
        assert_eq!(decode(&bad), None);
    }
}
