//! CUDA IPC of device memory (`cuIpcGetMemHandle`, `cuIpcOpenMemHandle_v2`,
//! `cuIpcCloseMemHandle`) between processes of this host.
//!
//! Exporting makes the allocation's pages a shared mapping of a memfd
//! (`memory::share`). Another process opens the handle by mapping the
//! memfd, reached through `/proc/<pid>/fd`, and registers that mapping as
//! device memory of the opening device (`memory::import`), so the kernels
//! and copies of both processes reach the same bytes. What is emulated
//! besides is the bookkeeping the driver does and the order it requires:
//! - a handle opened in the process that made it is
//!   `CUDA_ERROR_INVALID_CONTEXT`, as the driver answers (ranks that are
//!   threads of one process reach each other's memory by address, with
//!   peer access);
//! - a handle names one allocation (its descriptor and a serial number
//!   drawn when it is first exported, which the memfd's header page
//!   repeats), so a handle of memory freed since, even if the descriptor
//!   was reused, is `CUDA_ERROR_INVALID_HANDLE`;
//! - each open is counted per opening device and closed once; a second
//!   open of one handle on a device returns the same address;
//! - freeing an allocation while another process still has it open (the
//!   driver calls that undefined) is counted as a violation (through the
//!   header page's count of opens) and logged, and the free goes ahead;
//!   the other process's mapping keeps the pages.
//!
//! Control functions: `metrale_emu_ipc_open_mappings()` (mappings open
//! now) and `metrale_emu_ipc_violations()` (frees of memory still mapped,
//! since the process started).
//!
//! The count of frees under another process's mapping is kept by
//! `memory`, which makes the free.
//!
//! Invariant: the state's lock is never held while the allocation
//! registry's is taken.

use std::collections::BTreeMap;
use std::ffi::c_uint;

use cuda_sys::ipc::{CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, CUipcMemHandle};
use cuda_sys::{CUdeviceptr, CUresult};
use parking_lot::Mutex;

use super::driver::{check_init, code, current_device};
use super::memory::{self, Export, Imported};
use crate::{guard, put};

const MAGIC: &[u8; 8] = b"EMUIPC02";

/// A mapping of another process's export.
struct Import {
    /// (exporting process, export serial): a second open of the same
    /// handle on the device shares the mapping.
    key: (u32, u64),
    count: u32,
    mapping: Imported,
}

struct State {
    /// (opening device, address here) -> a mapping of another process's
    /// export.
    imports: BTreeMap<(i32, u64), Import>,
}

static STATE: Mutex<State> = Mutex::new(State {
    imports: BTreeMap::new(),
});

/// A handle: the exporting process and its export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Handle {
    pid: u32,
    /// The exporter's emulated host (`host::id`).
    host: u64,
    export: Export,
}

fn encode(h: &Handle) -> CUipcMemHandle {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(MAGIC);
    b[8..12].copy_from_slice(&h.pid.to_le_bytes());
    b[12..16].copy_from_slice(&h.export.fd.to_le_bytes());
    b[24..32].copy_from_slice(&h.export.serial.to_le_bytes());
    b[32..40].copy_from_slice(&(h.export.len as u64).to_le_bytes());
    b[40..48].copy_from_slice(&(h.export.mapped as u64).to_le_bytes());
    b[48..56].copy_from_slice(&h.host.to_le_bytes());
    CUipcMemHandle {
        reserved: b.map(|x| x as std::ffi::c_char),
    }
}

fn decode(h: &CUipcMemHandle) -> Option<Handle> {
    let b = h.reserved.map(|x| x as u8);
    if &b[..8] != MAGIC {
        return None;
    }
    let u32_at = |i: usize| b[i..i + 4].try_into().ok().map(u32::from_le_bytes);
    let u64_at = |i: usize| b[i..i + 8].try_into().ok().map(u64::from_le_bytes);
    Some(Handle {
        pid: u32_at(8)?,
        host: u64_at(48)?,
        export: Export {
            fd: i32::from_le_bytes(b[12..16].try_into().ok()?),
            serial: u64_at(24)?,
            len: usize::try_from(u64_at(32)?).ok()?,
            mapped: usize::try_from(u64_at(40)?).ok()?,
        },
    })
}

/// `cuIpcGetMemHandle`: `dptr` must be the start of a live device
/// allocation of this process; its pages become shareable (`memory::share`).
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
            if handle.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            let export = memory::share(dptr)?;
            let h = encode(&Handle {
                pid: std::process::id(),
                host: super::host::id(),
                export,
            });
            // SAFETY: `handle` is non-null and valid (this function's contract).
            unsafe { put(handle, h) };
            Ok(())
        })())
    })
}

/// `cuIpcOpenMemHandle_v2`, counted as open by the current device:
/// another process's export is mapped here (`memory::import`), once per
/// device and handle (a second open returns the same address), as the
/// driver does; a handle of this process is `CUDA_ERROR_INVALID_CONTEXT`,
/// one exported on another emulated host (`host`) `CUDA_ERROR_INVALID_VALUE`.
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
            let h = decode(&handle).ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
            if h.host != super::host::id() {
                // A handle exported on another host names memory this
                // machine cannot reach.
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            if h.pid == std::process::id() {
                // As the driver answers (measured on an H200): the exporter
                // reaches its own memory by its address.
                return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
            }
            let addr = open_foreign(dev, &h)?;
            // SAFETY: `pdptr` is non-null and valid (this function's contract).
            unsafe { put(pdptr, addr) };
            Ok(())
        })())
    })
}

/// Opens another process's export on `dev`.
fn open_foreign(dev: i32, h: &Handle) -> Result<u64, CUresult> {
    let key = (h.pid, h.export.serial);
    {
        let mut st = STATE.lock();
        if let Some(i) = st
            .imports
            .iter_mut()
            .find(|((d, _), i)| *d == dev && i.key == key)
            .map(|(_, i)| i)
        {
            i.count += 1;
            return Ok(i.mapping.addr);
        }
    }
    // Mapped without this module's lock (the registry's comes first); two
    // threads opening one handle at once each map it.
    let mapping = memory::import(h.pid, h.export, dev)?;
    STATE.lock().imports.insert(
        (dev, mapping.addr),
        Import {
            key,
            count: 1,
            mapping,
        },
    );
    Ok(mapping.addr)
}

/// `cuIpcCloseMemHandle`: releases one open of `dptr` by the current
/// device (the last one unmaps it); `CUDA_ERROR_INVALID_VALUE` when it
/// has none.
#[unsafe(no_mangle)]
pub extern "C" fn cuIpcCloseMemHandle(dptr: CUdeviceptr) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let dev = current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            let mut st = STATE.lock();
            let i = st
                .imports
                .get_mut(&(dev, dptr))
                .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
            i.count -= 1;
            if i.count > 0 {
                return Ok(());
            }
            let gone = st.imports.remove(&(dev, dptr));
            drop(st);
            if let Some(i) = gone {
                memory::unimport(i.mapping);
            }
            Ok(())
        })())
    })
}

/// The number of IPC mappings open now, every device and count included.
#[unsafe(no_mangle)]
pub extern "C" fn metrale_emu_ipc_open_mappings() -> u64 {
    guard(u64::MAX, || {
        STATE
            .lock()
            .imports
            .values()
            .map(|i| u64::from(i.count))
            .sum()
    })
}

/// Frees of device memory that another context still had open through IPC,
/// since the process started.
#[unsafe(no_mangle)]
pub extern "C" fn metrale_emu_ipc_violations() -> u64 {
    memory::ipc_violations()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip() {
        let h = Handle {
            pid: 7,
            host: 0xABCD,
            export: Export {
                fd: 9,
                serial: 3,
                len: 5000,
                mapped: 8192,
            },
        };
        let enc = encode(&h);
        assert_eq!(decode(&enc), Some(h));
        let mut bad = enc;
        bad.reserved[0] = 0;
        assert_eq!(decode(&bad), None);
    }
}
