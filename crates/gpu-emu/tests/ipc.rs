//! CUDA IPC between processes: this test binary runs itself as the other
//! process (`common::procs`). The same bytes both ways, a second open
//! sharing the mapping, stale handles and the exporter's own refused, a
//! free under another process's mapping counted.
//!
//! Invariant: every wait for a child has a deadline, and a child is killed
//! when a test gives up on it.

mod common;

use std::time::{Duration, Instant};

use common::procs::{hex, spawn_with, unhex, wait_ok};
use common::*;
use cuda_sys::ipc::{CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, CUipcMemHandle};
use cuda_sys::{CUdeviceptr, CUresult};
use nccl_sys::{call, ncclUniqueId};
use rand::{Rng, SeedableRng};

/// The IPC test's handles (hex) and the file the holder creates.
const HANDLES: &str = "GPU_EMU_PROC_HANDLES";
const READY: &str = "GPU_EMU_PROC_READY";
/// Bytes of the IPC test's buffer: not a whole number of pages.
const IPC_BYTES: usize = 3 * 4096 + 1000;

/// What a child process does.
#[test]
fn child() {
    let Some((role, _, _, _, seed)) = common::procs::child_role() else {
        return;
    };
    match role.as_str() {
        "ipc" | "ipc_hold" => ipc_child(&role, seed),
        other => panic!("unknown role {other}"),
    }
}

/// A handle from [`hex`]'s text.
fn handle_unhex(s: &str) -> CUipcMemHandle {
    let mut h = CUipcMemHandle { reserved: [0; 64] };
    unhex(s, &mut h.reserved);
    h
}

fn ipc_export(p: CUdeviceptr) -> CUipcMemHandle {
    let mut h = CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: `h` is a valid out-parameter.
    ck(unsafe { call!(cuda_sys::ipc::ipc().unwrap(), cuIpcGetMemHandle(&mut h, p)) }.unwrap());
    h
}

fn ipc_open(h: CUipcMemHandle) -> Result<CUdeviceptr, CUresult> {
    let mut p = 0;
    // SAFETY: `p` is a valid out-parameter.
    let rc = unsafe {
        call!(
            cuda_sys::ipc::ipc().unwrap(),
            cuIpcOpenMemHandle_v2(&mut p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        )
    }
    .unwrap();
    if rc == CUresult::CUDA_SUCCESS {
        Ok(p)
    } else {
        Err(rc)
    }
}

fn ipc_close(p: CUdeviceptr) -> CUresult {
    // SAFETY: plain value.
    unsafe { call!(cuda_sys::ipc::ipc().unwrap(), cuIpcCloseMemHandle(p)) }.unwrap()
}

/// The IPC test's data: random non-zero bytes of `seed`.
fn ipc_data(seed: u64, salt: u64) -> Vec<u8> {
    let mut g = rand::rngs::StdRng::seed_from_u64(seed ^ salt);
    (0..IPC_BYTES).map(|_| g.random_range(1..=255u8)).collect()
}

/// The IPC test's other process: `ipc` opens the parent's export (twice,
/// one mapping), checks its bytes, writes the second half, tries a stale
/// handle, and closes; `ipc_hold` opens it, says so with a file, and waits
/// to be killed.
fn ipc_child(role: &str, seed: u64) {
    set_device(1);
    let hs: Vec<CUipcMemHandle> = std::env::var(HANDLES)
        .expect("handles")
        .split(',')
        .map(handle_unhex)
        .collect();
    let p = ipc_open(hs[0]).expect("open the parent's export");
    if role == "ipc_hold" {
        std::fs::write(std::env::var(READY).expect("ready file"), b"1").expect("ready");
        std::thread::sleep(Duration::from_secs(60));
        std::process::exit(3);
    }
    assert_eq!(ipc_open(hs[0]), Ok(p), "a second open shares the mapping");
    assert_eq!(ipc_open_mappings(), 2);
    let want = ipc_data(seed, 1);
    assert_eq!(download::<u8>(p, IPC_BYTES), want, "the exporter's bytes");
    let half = IPC_BYTES / 2;
    upload(p + half as u64, &ipc_data(seed, 2)[half..]);
    assert_eq!(
        ipc_open(hs[1]),
        Err(CUresult::CUDA_ERROR_INVALID_HANDLE),
        "a handle of memory freed since"
    );
    // Past its end: the mapping has the allocation's length.
    assert_eq!(
        try_upload(p + IPC_BYTES as u64 - 4, &[0u8; 8]),
        CUresult::CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(
        try_free(p),
        CUresult::CUDA_ERROR_INVALID_VALUE,
        "not ours to free"
    );
    ck(ipc_close(p));
    assert_eq!(ipc_open_mappings(), 1);
    ck(ipc_close(p));
    assert_eq!(ipc_open_mappings(), 0);
    assert_eq!(ipc_close(p), CUresult::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(ipc_violations(), 0);
}

#[test]
fn ipc_maps_the_same_bytes_in_another_process() {
    set_device(0);
    let seed: u64 = rand::random();
    let a = alloc(IPC_BYTES);
    upload(a, &ipc_data(seed, 1));
    let h = ipc_export(a);
    assert_eq!(ipc_export(a), h, "one export per allocation");
    assert_eq!(
        ipc_open(h),
        Err(CUresult::CUDA_ERROR_INVALID_CONTEXT),
        "the driver opens no handle in the process that made it"
    );
    let gone = alloc(4096);
    let stale = ipc_export(gone);
    free(gone);
    let handles = format!("{},{}", hex(&h.reserved), hex(&stale.reserved));
    let id = ncclUniqueId::default();
    let mut kid = spawn_with("ipc", 1, 2, &id, seed, &[(HANDLES, handles.as_str())]);
    wait_ok(&mut kid, Duration::from_secs(30));
    let half = IPC_BYTES / 2;
    let got = download::<u8>(a, IPC_BYTES);
    assert_eq!(
        got[..half],
        ipc_data(seed, 1)[..half],
        "the first half is ours"
    );
    assert_eq!(got[half..], ipc_data(seed, 2)[half..], "the child's writes");

    // A free while another process holds a mapping is counted.
    let ready = std::env::temp_dir().join(format!("gpu-emu-ipc-ready-{}", std::process::id()));
    let _ = std::fs::remove_file(&ready);
    let mut holder = spawn_with(
        "ipc_hold",
        1,
        2,
        &id,
        seed,
        &[
            (HANDLES, handles.as_str()),
            (READY, ready.to_str().expect("path")),
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        if Instant::now() > deadline || holder.try_wait().expect("try_wait").is_some() {
            let _ = holder.kill();
            panic!("the holder did not map the export");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let before = ipc_violations();
    free(a);
    assert_eq!(ipc_violations(), before + 1);
    let _ = holder.kill();
    let _ = holder.wait();
    let _ = std::fs::remove_file(&ready);
}
