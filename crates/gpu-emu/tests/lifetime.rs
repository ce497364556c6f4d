//! Device memory lifetime, as the driver enforces it: a free waits for the
//! work queued on the allocation's device before it (created, destroyed
//! and legacy streams; not work captured and never launched), and work that
//! finds its memory gone when it runs is a deterministic error (a sticky
//! `CUDA_ERROR_ILLEGAL_ADDRESS` for driver work, the communicator's
//! asynchronous error for NCCL), never a read of freed memory.
//!
//! Each test that breaks a context uses its own device: a sticky error
//! breaks its device's context for the rest of this process. A free waits
//! for every stream of its device, so tests that share a device (0 and 1)
//! only hold their streams briefly. Device 7 only holds memory that work
//! on the other devices uses, so frees there never wait for queued work.

mod common;

use std::ffi::c_void;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use cuda_sys::{CUresult, CUstream, CUstreamCaptureMode, call};
use half::bf16;
use nccl_sys::{ncclDataType_t, ncclResult_t};

/// The device that only holds memory.
const MEM_DEV: i32 = 7;

/// How long a free that should wait is given to return early anyway.
const HELD: Duration = Duration::from_millis(300);

/// Frees `p` on a helper thread (with `dev` current) and hands back the
/// code.
fn free_in_background(dev: i32, p: u64) -> mpsc::Receiver<CUresult> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        set_device(dev);
        let _ = tx.send(try_free(p));
    });
    rx
}

/// Asserts that what `rx` reports has not come within [`HELD`], then that
/// it comes within 5 s after `release` runs, and returns it.
fn held_until<T>(rx: &mpsc::Receiver<T>, what: &str, release: impl FnOnce()) -> T {
    assert!(
        rx.recv_timeout(HELD).is_err(),
        "{what} returned while earlier work was still queued on its device"
    );
    release();
    rx.recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| panic!("{what} did not return once the queued work ran"))
}

const PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\
.visible .entry bf16_add_inplace(\n .param .u64 p0,\n .param .u64 p1,\n .param .u64 p2\n)\n{\n ret;\n}\n\0";

/// The add kernel, loaded in the current context.
fn add_kernel() -> cuda_sys::CUfunction {
    let (mut m, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid out-parameters; the PTX is NUL-terminated.
    unsafe {
        ck(call!(cuda(), cuModuleLoadData(&mut m, PTX.as_ptr().cast())).unwrap());
        ck(call!(
            cuda(),
            cuModuleGetFunction(&mut f, m, c"bf16_add_inplace".as_ptr())
        )
        .unwrap());
    }
    f
}

/// `bf16_add_inplace(dst, src, n)` on `s`; the launch's code.
fn launch_add(f: cuda_sys::CUfunction, dst: u64, src: u64, n: usize, s: CUstream) -> CUresult {
    let (mut d, mut x, mut n) = (dst, src, n as u64);
    let mut params = [
        (&mut d as *mut u64).cast::<c_void>(),
        (&mut x as *mut u64).cast::<c_void>(),
        (&mut n as *mut u64).cast::<c_void>(),
    ];
    // SAFETY: `params` points at the three argument values, alive for the
    // call; the emulator checks the buffers against its allocations.
    unsafe {
        call!(
            cuda(),
            cuLaunchKernel(
                f,
                1,
                1,
                1,
                256,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
                std::ptr::null_mut()
            )
        )
    }
    .unwrap()
}

fn stream_sync(s: CUstream) -> CUresult {
    // SAFETY: `s` is a stream handle.
    unsafe { call!(cuda(), cuStreamSynchronize(s)) }.unwrap()
}

fn ctx_sync() -> CUresult {
    // SAFETY: no arguments.
    unsafe { call!(cuda(), cuCtxSynchronize()) }.unwrap()
}

/// After driver work on the current device touched freed memory: every
/// later sync, query, launch and allocation there reports the sticky error.
fn assert_sticky(s: CUstream) {
    const ILLEGAL: CUresult = CUresult::CUDA_ERROR_ILLEGAL_ADDRESS;
    assert_eq!(stream_sync(s), ILLEGAL, "cuStreamSynchronize");
    assert_eq!(query(s), ILLEGAL, "cuStreamQuery");
    assert_eq!(ctx_sync(), ILLEGAL, "cuCtxSynchronize");
    let (mut p, mut ev) = (0, std::ptr::null_mut());
    // SAFETY: valid out-parameters and handles.
    unsafe {
        let r = call!(cuda(), cuMemAlloc_v2(&mut p, 64)).unwrap();
        assert_eq!(r, ILLEGAL, "cuMemAlloc after the fault");
        ck(call!(cuda(), cuEventCreate(&mut ev, 0)).unwrap());
        let r = call!(cuda(), cuEventRecord(ev, s)).unwrap();
        assert_eq!(r, ILLEGAL, "an event record after the fault");
    }
}

#[test]
fn cu_mem_free_waits_for_the_work_queued_on_its_device() {
    const DEV: i32 = 0;
    set_device(DEV);
    let g = Gate::new();
    let (s, s2) = (stream(), stream());

    // A created stream.
    let dst = g.block(s);
    let rx = free_in_background(DEV, alloc(4096));
    let r = held_until(&rx, "cuMemFree", || g.release(s2));
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    assert_eq!(
        query(s),
        CUresult::CUDA_SUCCESS,
        "the queued work ran first"
    );
    assert_eq!(download::<f32>(dst, 256), g.data);

    // A destroyed stream that still drains.
    let s3 = stream();
    let dst = g.block(s3);
    destroy_stream(s3);
    let rx = free_in_background(DEV, alloc(4096));
    let r = held_until(&rx, "cuMemFree", || g.release(s2));
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    assert_eq!(download::<f32>(dst, 256), g.data);

    // The legacy stream, held by another thread inside a recv on it.
    std::thread::scope(|sc| {
        let g = &g;
        let blocked = sc.spawn(move || {
            set_device(DEV);
            g.block(std::ptr::null_mut())
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        while query(std::ptr::null_mut()) == CUresult::CUDA_SUCCESS {
            assert!(Instant::now() < deadline, "the legacy recv never queued");
            std::thread::sleep(Duration::from_millis(1));
        }
        let rx = free_in_background(DEV, alloc(4096));
        let r = held_until(&rx, "cuMemFree", || g.release(s2));
        assert_eq!(r, CUresult::CUDA_SUCCESS);
        let dst = blocked.join().unwrap();
        assert_eq!(download::<f32>(dst, 256), g.data);
    });
    sync(s2);
    destroy_stream(s);
    destroy_stream(s2);
}

#[test]
fn nccl_mem_free_waits_too_and_captured_work_is_not_waited_for() {
    const DEV: i32 = 1;
    set_device(DEV);
    let g = Gate::new();
    let (s, s2) = (stream(), stream());

    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    nck(unsafe { nccl_sys::call!(nccl(), ncclMemAlloc(&mut p, 4096)) }.unwrap());
    let dst = g.block(s);
    let (tx, rx) = mpsc::channel();
    let addr = p as usize;
    std::thread::spawn(move || {
        // SAFETY: `addr` came from ncclMemAlloc and is freed once.
        let r = unsafe { nccl_sys::call!(nccl(), ncclMemFree(addr as *mut c_void)) }.unwrap();
        let _ = tx.send(r);
    });
    let r = held_until(&rx, "ncclMemFree", || g.release(s2));
    assert_eq!(r, ncclResult_t::ncclSuccess);
    assert_eq!(download::<f32>(dst, 256), g.data);

    // Work captured into a graph and never launched is not queued.
    // SAFETY: `s` is a stream handle.
    ck(unsafe {
        call!(
            cuda(),
            cuStreamBeginCapture_v2(s, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        )
    }
    .unwrap());
    g.block(s);
    let rx = free_in_background(DEV, alloc(4096));
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(5)),
        Ok(CUresult::CUDA_SUCCESS),
        "a free waited for captured work that was never launched"
    );
    let mut graph = std::ptr::null_mut();
    // SAFETY: valid handle and out-parameter.
    unsafe {
        ck(call!(cuda(), cuStreamEndCapture(s, &mut graph)).unwrap());
        ck(call!(cuda(), cuGraphDestroy(graph)).unwrap());
    }
    sync(s);
    destroy_stream(s);
    destroy_stream(s2);
}

#[test]
fn a_kernel_on_freed_memory_is_a_sticky_illegal_address() {
    const DEV: i32 = 2;
    const N: usize = 1000;
    set_device(MEM_DEV);
    let d0: Vec<bf16> = random_f32(N).into_iter().map(bf16::from_f32).collect();
    let (dst, src) = (alloc(2 * N), alloc(2 * N));
    upload(dst, &d0);
    upload(src, &d0);
    set_device(DEV);
    let f = add_kernel();
    let g = Gate::new();
    let (s, s2) = (stream(), stream());
    g.block(s);
    ck(launch_add(f, dst, src, N, s));
    set_device(MEM_DEV);
    // Nothing is queued on the memory's device, so the free is immediate.
    assert_eq!(try_free(src), CUresult::CUDA_SUCCESS);
    set_device(DEV);
    g.release(s2);
    assert_sticky(s);
    assert_eq!(
        launch_add(f, dst, dst, N, s2),
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
    );
    set_device(MEM_DEV);
    assert_eq!(ctx_sync(), CUresult::CUDA_SUCCESS, "other devices are fine");
    assert_eq!(download::<bf16>(dst, N), d0, "the kernel wrote nothing");
    free(dst);
}

#[test]
fn an_async_copy_on_freed_memory_is_a_sticky_illegal_address() {
    const DEV: i32 = 3;
    set_device(MEM_DEV);
    let data = random_f32(256);
    let (dst, src) = (alloc(1024), alloc(1024));
    upload(src, &data);
    poison(dst, 1024);
    set_device(DEV);
    let g = Gate::new();
    let (s, s2) = (stream(), stream());
    g.block(s);
    // SAFETY: both ranges hold 1024 bytes at launch.
    ck(unsafe { call!(cuda(), cuMemcpyDtoDAsync_v2(dst, src, 1024, s)) }.unwrap());
    set_device(MEM_DEV);
    assert_eq!(try_free(src), CUresult::CUDA_SUCCESS);
    set_device(DEV);
    g.release(s2);
    assert_sticky(s);
    set_device(MEM_DEV);
    assert!(
        download::<u8>(dst, 1024).iter().all(|b| *b == 0x7F),
        "the copy wrote nothing"
    );
    free(dst);
}

#[test]
fn a_memset_on_freed_memory_is_a_sticky_illegal_address() {
    const DEV: i32 = 4;
    set_device(MEM_DEV);
    let dst = alloc(1024);
    set_device(DEV);
    let g = Gate::new();
    let (s, s2) = (stream(), stream());
    g.block(s);
    // SAFETY: plain values; `dst` holds 256 words at launch.
    ck(unsafe { call!(cuda(), cuMemsetD32Async(dst, 0x1234_5678, 256, s)) }.unwrap());
    set_device(MEM_DEV);
    assert_eq!(try_free(dst), CUresult::CUDA_SUCCESS);
    set_device(DEV);
    g.release(s2);
    assert_sticky(s);
}

#[test]
fn a_collective_on_freed_memory_is_an_asynchronous_error() {
    const DEV: i32 = 5;
    const N: usize = 256;
    set_device(MEM_DEV);
    let (send, recv) = (alloc(4 * N), alloc(4 * N));
    upload(send, &random_f32(N));
    poison(recv, 4 * N);
    set_device(DEV);
    let comm = init(1, unique_id(), 0);
    let g = Gate::new();
    let (s, s2) = (stream(), stream());
    g.block(s);
    nck(all_reduce_sum(
        send,
        recv,
        N,
        ncclDataType_t::ncclFloat32,
        comm,
        s,
    ));
    set_device(MEM_DEV);
    assert_eq!(try_free(send), CUresult::CUDA_SUCCESS);
    set_device(DEV);
    g.release(s2);
    sync(s);
    assert_eq!(async_error(comm), ncclResult_t::ncclUnhandledCudaError);
    assert!(
        last_error(comm).contains("illegal memory access"),
        "{}",
        last_error(comm)
    );
    set_device(MEM_DEV);
    assert!(
        download::<u8>(recv, 4 * N).iter().all(|b| *b == 0x7F),
        "nothing written"
    );
    free(recv);
    set_device(DEV);
    nck(abort(comm));
}

/// A free that races a kernel already running on another device's stream
/// over the memory: the kernel holds the memory from its check to its end,
/// so the free waits for it, and the process never reads freed, unmapped
/// memory. The buffers are large enough that the allocator maps and unmaps
/// them.
#[test]
fn a_free_racing_a_running_kernel_never_reads_freed_memory() {
    const DEV: i32 = 6;
    const N: usize = 64 << 20;
    const ONE_PAIR: u32 = 0x3F80_3F80;
    const TWO: u16 = 0x4000;
    set_device(MEM_DEV);
    let (dst, src) = (alloc(2 * N), alloc(2 * N));
    // SAFETY: plain values; both buffers hold N / 2 words.
    unsafe {
        ck(call!(cuda(), cuMemsetD32_v2(dst, ONE_PAIR, N / 2)).unwrap());
        ck(call!(cuda(), cuMemsetD32_v2(src, ONE_PAIR, N / 2)).unwrap());
    }
    set_device(DEV);
    let f = add_kernel();
    let s = stream();
    ck(launch_add(f, dst, src, N, s));
    set_device(MEM_DEV);
    let deadline = Instant::now() + Duration::from_secs(10);
    while download::<u16>(dst, 1)[0] != TWO {
        assert!(Instant::now() < deadline, "the kernel never started");
    }
    // The kernel holds the memory from its check on: the free waits for it.
    assert_eq!(try_free(src), CUresult::CUDA_SUCCESS);
    assert_eq!(
        download::<u16>(dst + 2 * (N as u64 - 1), 1)[0],
        TWO,
        "the kernel ran to its end before the free returned"
    );
    set_device(DEV);
    assert_eq!(stream_sync(s), CUresult::CUDA_SUCCESS);
    set_device(MEM_DEV);
    free(dst);
}

/// The backend's shutdown after a failed fast path: a receive into the
/// scratch buffer that never completes, the add kernel queued behind it on
/// the same stream, an abort that ends the receive (so the kernel runs),
/// and a free of the scratch buffer while the kernel still reads it. The
/// free waits for the kernel, queued on its device before the free, and
/// the process never reads freed memory. (Device 1, whose other test
/// frees only once its own work has run.)
#[test]
fn a_shutdown_free_of_the_scratch_waits_for_the_add_kernel_behind_a_failed_recv() {
    const DEVS: [i32; 2] = [1, 0];
    const N: usize = 64 << 20;
    const ONE_PAIR: u32 = 0x3F80_3F80;
    const TWO: u16 = 0x4000;
    let c = init_all(&DEVS);
    set_device(DEVS[0]);
    let f = add_kernel();
    let s = stream();
    let (dst, scratch) = (alloc(2 * N), alloc(2 * N));
    // SAFETY: plain values; both buffers hold N / 2 words.
    unsafe {
        ck(call!(cuda(), cuMemsetD32_v2(dst, ONE_PAIR, N / 2)).unwrap());
        ck(call!(cuda(), cuMemsetD32_v2(scratch, ONE_PAIR, N / 2)).unwrap());
    }
    // SAFETY: `scratch` holds N bf16.
    nck(unsafe {
        nccl_sys::call!(
            nccl(),
            ncclRecv(
                scratch as *mut c_void,
                N,
                ncclDataType_t::ncclBfloat16,
                1,
                c[0],
                s
            )
        )
    }
    .unwrap());
    ck(launch_add(f, dst, scratch, N, s));
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        query(s),
        CUresult::CUDA_ERROR_NOT_READY,
        "the peer never sends"
    );
    nck(abort(c[0]));
    let deadline = Instant::now() + Duration::from_secs(10);
    while download::<u16>(dst, 1)[0] != TWO {
        assert!(Instant::now() < deadline, "the add kernel never started");
    }
    assert_eq!(try_free(scratch), CUresult::CUDA_SUCCESS);
    assert_eq!(
        download::<u16>(dst + 2 * (N as u64 - 1), 1)[0],
        TWO,
        "the kernel ran to its end before the free returned"
    );
    assert_eq!(query(s), CUresult::CUDA_SUCCESS);
    free(dst);
    destroy_stream(s);
    nck(abort(c[1]));
}
