//! Helpers shared by the emulator's integration tests: open the built
//! `libgpu_emu.so` through cuda-sys / nccl-sys exactly as the stack does, and
//! small wrappers for contexts, memory, streams and communicators, ranks
//! as threads ([`ranks`]); `procs` runs ranks as processes.
//!
//! Invariant: every call checks its return code, so a helper never hides an
//! error.

#![allow(dead_code)]

pub mod procs;

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::OnceLock;

use cuda_sys::{CUcontext, CUdeviceptr, CUresult, CUstream, Cuda};
use nccl_sys::{Nccl, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId};

/// `target/debug/deps/libgpu_emu.so`, next to the test binary.
pub fn libpath() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent().expect("deps dir").join("libgpu_emu.so")
}

/// The emulator opened as the CUDA driver, initialised.
pub fn cuda() -> &'static Cuda {
    static INIT: OnceLock<()> = OnceLock::new();
    INIT.get_or_init(|| {
        let p = libpath();
        assert!(p.exists(), "{} is missing", p.display());
        // SAFETY: set once, before the libraries are opened, under the
        // OnceLock; no other thread of this test binary reads these two
        // variables concurrently (they are only read when opening).
        unsafe {
            std::env::set_var(cuda_sys::LIBRARY_ENV, &p);
            std::env::set_var(nccl_sys::LIBRARY_ENV, &p);
        }
        let c = cuda_sys::cuda().expect("open the emulator as libcuda");
        // SAFETY: cuInit takes a flags word.
        ck(unsafe { cuda_sys::call!(c, cuInit(0)) }.unwrap());
    });
    cuda_sys::cuda().expect("driver")
}

/// The emulator opened as NCCL.
pub fn nccl() -> &'static Nccl {
    cuda();
    nccl_sys::nccl().expect("open the emulator as libnccl")
}

/// The emulator's control functions.
pub fn control() -> &'static libloading::Library {
    static LIB: OnceLock<libloading::Library> = OnceLock::new();
    LIB.get_or_init(|| {
        cuda();
        // SAFETY: the library is the emulator, already loaded by `cuda()`.
        unsafe { libloading::Library::new(libpath()) }.expect("open emulator")
    })
}

/// `metrale_emu_inject`.
pub fn inject(rank: i32, fault: i32, nth: u64) -> i32 {
    // SAFETY: the symbol has this signature (docs/architecture.md).
    unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn(i32, i32, u64) -> i32> =
            control().get(b"metrale_emu_inject\0").unwrap();
        f(rank, fault, nth)
    }
}

/// `metrale_emu_reset`.
pub fn reset() {
    // SAFETY: the symbol has this signature (docs/architecture.md).
    unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn()> =
            control().get(b"metrale_emu_reset\0").unwrap();
        f()
    }
}

/// `metrale_emu_nccl_calls`.
pub fn nccl_calls() -> u64 {
    // SAFETY: the symbol has this signature (docs/architecture.md).
    unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn() -> u64> =
            control().get(b"metrale_emu_nccl_calls\0").unwrap();
        f()
    }
}

/// `metrale_emu_ipc_open_mappings`.
pub fn ipc_open_mappings() -> u64 {
    // SAFETY: the symbol has this signature (docs/architecture.md).
    unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn() -> u64> =
            control().get(b"metrale_emu_ipc_open_mappings\0").unwrap();
        f()
    }
}

/// `metrale_emu_ipc_violations`.
pub fn ipc_violations() -> u64 {
    // SAFETY: the symbol has this signature (docs/architecture.md).
    unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn() -> u64> =
            control().get(b"metrale_emu_ipc_violations\0").unwrap();
        f()
    }
}

/// Asserts a driver call succeeded.
#[track_caller]
pub fn ck(r: CUresult) {
    assert_eq!(r, CUresult::CUDA_SUCCESS);
}

/// Asserts an NCCL call succeeded.
#[track_caller]
pub fn nck(r: ncclResult_t) {
    assert_eq!(r, ncclResult_t::ncclSuccess);
}

/// Makes `dev`'s primary context current on this thread.
pub fn set_device(dev: i32) -> CUcontext {
    let c = cuda();
    let mut ctx = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-parameter.
    unsafe {
        ck(cuda_sys::call!(c, cuDevicePrimaryCtxRetain(&mut ctx, dev)).unwrap());
        ck(cuda_sys::call!(c, cuCtxSetCurrent(ctx)).unwrap());
    }
    ctx
}

/// Device memory of `bytes` on the current device.
pub fn alloc(bytes: usize) -> CUdeviceptr {
    let mut p = 0;
    // SAFETY: `p` is a valid out-parameter.
    ck(unsafe { cuda_sys::call!(cuda(), cuMemAlloc_v2(&mut p, bytes)) }.unwrap());
    p
}

/// Frees device memory.
pub fn free(p: CUdeviceptr) {
    // SAFETY: `p` came from `alloc`.
    ck(unsafe { cuda_sys::call!(cuda(), cuMemFree_v2(p)) }.unwrap());
}

/// Copies `data` to the device.
pub fn upload<T: Copy>(dst: CUdeviceptr, data: &[T]) {
    ck(try_upload(dst, data));
}

/// `cuMemcpyHtoD_v2` of `data`'s code.
pub fn try_upload<T: Copy>(dst: CUdeviceptr, data: &[T]) -> CUresult {
    // SAFETY: `data` is valid for its size in bytes; the emulator checks
    // `dst` against its allocations.
    unsafe {
        cuda_sys::call!(
            cuda(),
            cuMemcpyHtoD_v2(dst, data.as_ptr().cast::<c_void>(), size_of_val(data))
        )
    }
    .unwrap()
}

/// Copies `n` values from the device.
pub fn download<T: Copy + Default>(src: CUdeviceptr, n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    // SAFETY: `v` is valid for its size in bytes.
    ck(unsafe {
        cuda_sys::call!(
            cuda(),
            cuMemcpyDtoH_v2(v.as_mut_ptr().cast::<c_void>(), src, size_of_val(&v[..]))
        )
    }
    .unwrap());
    v
}

/// `cuMemFree_v2`'s code.
pub fn try_free(p: CUdeviceptr) -> CUresult {
    // SAFETY: plain values; the emulator checks `p` against its allocations.
    unsafe { cuda_sys::call!(cuda(), cuMemFree_v2(p)) }.unwrap()
}

/// Fills device memory with a poison byte.
pub fn poison(p: CUdeviceptr, bytes: usize) {
    // SAFETY: plain values.
    ck(unsafe { cuda_sys::call!(cuda(), cuMemsetD8_v2(p, 0x7F, bytes)) }.unwrap());
}

/// A new stream of the current device.
pub fn stream() -> CUstream {
    let mut s = std::ptr::null_mut();
    // SAFETY: `s` is a valid out-parameter.
    ck(unsafe { cuda_sys::call!(cuda(), cuStreamCreate(&mut s, 0)) }.unwrap());
    s
}

/// `cuStreamQuery`.
pub fn query(s: CUstream) -> CUresult {
    // SAFETY: `s` is a stream handle.
    unsafe { cuda_sys::call!(cuda(), cuStreamQuery(s)) }.unwrap()
}

/// `cuStreamSynchronize`, asserted successful.
pub fn sync(s: CUstream) {
    // SAFETY: `s` is a stream handle.
    ck(unsafe { cuda_sys::call!(cuda(), cuStreamSynchronize(s)) }.unwrap());
}

/// Polls `s` until its work has run, asserted successful within `within`.
#[track_caller]
pub fn sync_within(s: CUstream, within: std::time::Duration) {
    let deadline = std::time::Instant::now() + within;
    loop {
        match query(s) {
            CUresult::CUDA_ERROR_NOT_READY => {}
            r => return ck(r),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the stream's work did not finish within {within:?}"
        );
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// `cuStreamDestroy_v2`, asserted successful.
pub fn destroy_stream(s: CUstream) {
    // SAFETY: `s` is a stream handle.
    ck(unsafe { cuda_sys::call!(cuda(), cuStreamDestroy_v2(s)) }.unwrap());
}

/// A fresh unique id.
pub fn unique_id() -> ncclUniqueId {
    let mut id = ncclUniqueId::default();
    // SAFETY: `id` is a valid out-parameter.
    nck(unsafe { nccl_sys::call!(nccl(), ncclGetUniqueId(&mut id)) }.unwrap());
    id
}

/// Blocking init of `rank` of `n`.
pub fn init(n: i32, id: ncclUniqueId, rank: i32) -> ncclComm_t {
    let mut c = std::ptr::null_mut();
    // SAFETY: `c` is a valid out-parameter.
    nck(unsafe { nccl_sys::call!(nccl(), ncclCommInitRank(&mut c, n, id, rank)) }.unwrap());
    c
}

/// `ncclCommGetAsyncError`'s value.
pub fn async_error(c: ncclComm_t) -> ncclResult_t {
    let mut e = ncclResult_t::ncclSuccess;
    // SAFETY: `e` is a valid out-parameter.
    nck(unsafe { nccl_sys::call!(nccl(), ncclCommGetAsyncError(c, &mut e)) }.unwrap());
    e
}

/// `ncclCommAbort`.
pub fn abort(c: ncclComm_t) -> ncclResult_t {
    // SAFETY: `c` is a communicator handle.
    unsafe { nccl_sys::call!(nccl(), ncclCommAbort(c)) }.unwrap()
}

/// `ncclCommDestroy`.
pub fn destroy(c: ncclComm_t) -> ncclResult_t {
    // SAFETY: `c` is a communicator handle.
    unsafe { nccl_sys::call!(nccl(), ncclCommDestroy(c)) }.unwrap()
}

/// `ncclAllReduce` (sum) of `n` elements of `dt`, returning NCCL's code.
/// The emulator checks both addresses against its allocations, so a bad
/// one is an error code, not undefined behaviour.
pub fn all_reduce_sum(
    send: CUdeviceptr,
    recv: CUdeviceptr,
    n: usize,
    dt: ncclDataType_t,
    c: ncclComm_t,
    s: CUstream,
) -> ncclResult_t {
    // SAFETY: the emulator validates `send` and `recv` against its live
    // allocations before it touches them.
    unsafe {
        nccl_sys::call!(
            nccl(),
            ncclAllReduce(
                send as *const c_void,
                recv as *mut c_void,
                n,
                dt,
                ncclRedOp_t::ncclSum,
                c,
                s
            )
        )
    }
    .unwrap()
}

/// The last-error text of `c`.
pub fn last_error(c: ncclComm_t) -> String {
    // SAFETY: the emulator returns a static NUL-terminated string.
    unsafe {
        let p = nccl_sys::call!(nccl(), ncclGetLastError(c)).unwrap();
        std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// Random non-zero f32 values in [-8, 8].
pub fn random_f32(n: usize) -> Vec<f32> {
    use rand::Rng;
    let mut r = rand::rng();
    (0..n)
        .map(|_| {
            loop {
                let v: f32 = r.random_range(-8.0..8.0);
                if v != 0.0 {
                    break v;
                }
            }
        })
        .collect()
}

/// `ncclCommInitAll` over `devs`: one blocking communicator per device, all
/// driven from this thread.
pub fn init_all(devs: &[i32]) -> Vec<ncclComm_t> {
    let mut comms = vec![std::ptr::null_mut(); devs.len()];
    // SAFETY: `comms` and `devs` hold `devs.len()` entries.
    nck(unsafe {
        nccl_sys::call!(
            nccl(),
            ncclCommInitAll(comms.as_mut_ptr(), devs.len() as i32, devs.as_ptr())
        )
    }
    .unwrap());
    comms
}

/// A deterministic way to keep a stream busy: a recv on rank 0 of a
/// two-rank communicator that waits until rank 1's send is issued. The two
/// ranks are distinct communicators, so the recv and the send are on
/// separate chains: NCCL runs one communicator's work in issue order, so a
/// recv and its matching send on one communicator would wait for each
/// other.
pub struct Gate {
    /// The two communicators' handles (plain ids, so a gate crosses threads).
    comms: [usize; 2],
    buf: CUdeviceptr,
    /// What every released recv receives.
    pub data: Vec<f32>,
}

impl Gate {
    /// A gate on the current device (both ranks).
    pub fn new() -> Self {
        let mut dev = -1;
        // SAFETY: `dev` is a valid out-parameter.
        ck(unsafe { cuda_sys::call!(cuda(), cuCtxGetDevice(&mut dev)) }.unwrap());
        let c = init_all(&[dev, dev]);
        let data = random_f32(256);
        let buf = alloc(1024);
        upload(buf, &data);
        Gate {
            comms: [c[0] as usize, c[1] as usize],
            buf,
            data,
        }
    }

    /// Enqueues on `s` a recv that waits for [`Gate::release`]; returns its
    /// (poisoned) buffer.
    pub fn block(&self, s: CUstream) -> CUdeviceptr {
        let dst = alloc(1024);
        poison(dst, 1024);
        // SAFETY: `dst` holds 256 f32.
        nck(unsafe {
            nccl_sys::call!(
                nccl(),
                ncclRecv(
                    dst as *mut c_void,
                    256,
                    ncclDataType_t::ncclFloat32,
                    1,
                    self.comms[0] as ncclComm_t,
                    s
                )
            )
        }
        .unwrap());
        dst
    }

    /// Enqueues on `s` the send that releases the oldest blocked recv.
    pub fn release(&self, s: CUstream) {
        // SAFETY: `buf` holds 256 f32.
        nck(unsafe {
            nccl_sys::call!(
                nccl(),
                ncclSend(
                    self.buf as *const c_void,
                    256,
                    ncclDataType_t::ncclFloat32,
                    0,
                    self.comms[1] as ncclComm_t,
                    s
                )
            )
        }
        .unwrap());
    }
}

/// Runs `f(rank)` on `n` threads, each with its own device current.
pub fn ranks(n: usize, f: impl Fn(usize) + Sync) {
    std::thread::scope(|s| {
        for r in 0..n {
            let f = &f;
            s.spawn(move || {
                set_device(r as i32);
                f(r)
            });
        }
    });
}

/// A config of a non-blocking communicator (`blocking = 0`).
pub fn nonblocking_config() -> nccl_sys::ncclConfig_t {
    nccl_sys::ncclConfig_t {
        size: size_of::<nccl_sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22803,
        blocking: 0,
        ..Default::default()
    }
}
