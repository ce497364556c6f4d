//! The emulated CUDA driver through the real bindings: devices, memory,
//! asynchronous streams, events, graph capture and replay, and the bf16 add
//! kernel, each checked against a host reference.

mod common;

use std::ffi::c_void;
use std::time::{Duration, Instant};

use common::*;
use cuda_sys::{CUresult, CUstreamCaptureMode, CUstreamCaptureStatus, call};
use half::bf16;

const PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\
.visible .entry bf16_add_inplace(\n .param .u64 p0,\n .param .u64 p1,\n .param .u64 p2\n)\n{\n ret;\n}\n\
.visible .entry mystery_kernel()\n{\n ret;\n}\n\0";

#[test]
fn devices_and_memory() {
    let c = cuda();
    set_device(1);
    let mut n = 0;
    let mut cc = [0; 2];
    let mut name = [0i8; 64];
    let (mut free0, mut total) = (0usize, 0usize);
    // SAFETY: every out-parameter is valid.
    unsafe {
        ck(call!(c, cuDeviceGetCount(&mut n)).unwrap());
        ck(call!(
            c,
            cuDeviceGetAttribute(
                &mut cc[0],
                cuda_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                1
            )
        )
        .unwrap());
        ck(call!(
            c,
            cuDeviceGetAttribute(
                &mut cc[1],
                cuda_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                1
            )
        )
        .unwrap());
        ck(call!(c, cuDeviceGetName(name.as_mut_ptr(), 64, 1)).unwrap());
        ck(call!(c, cuMemGetInfo_v2(&mut free0, &mut total)).unwrap());
    }
    assert!(n >= 2, "{n}");
    assert_eq!(cc, [9, 0]);
    // SAFETY: cuDeviceGetName wrote a NUL-terminated string.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) };
    assert_eq!(name.to_str().unwrap(), "Metrale emulated GPU");
    assert_eq!(total, 80 << 30);

    // Fresh memory is garbage (0xA5), and every byte reads back as written.
    let p = alloc(4096);
    assert!(download::<u8>(p, 4096).iter().all(|b| *b == 0xA5));
    let data = random_f32(1024);
    upload(p, &data);
    assert_eq!(download::<f32>(p, 1024), data);

    // A range outside the allocation and an unknown pointer are refused.
    let mut out = [0u8; 16];
    // SAFETY: `out` holds 16 bytes; the device range is invalid on purpose.
    let r = unsafe { call!(c, cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), p + 4090, 16)) }.unwrap();
    assert_eq!(r, CUresult::CUDA_ERROR_INVALID_VALUE);
    // SAFETY: plain values.
    let r = unsafe { call!(c, cuMemFree_v2(p + 8)) }.unwrap();
    assert_eq!(r, CUresult::CUDA_ERROR_INVALID_VALUE);

    // The pointer's attributes name the device.
    let mut ord = -1;
    // SAFETY: `ord` is an int out-parameter.
    ck(unsafe {
        call!(
            c,
            cuPointerGetAttribute(
                (&mut ord as *mut i32).cast(),
                cuda_sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                p + 100
            )
        )
    }
    .unwrap());
    assert_eq!(ord, 1);
    free(p);

    // Every error code returned has a name.
    let mut s = std::ptr::null();
    // SAFETY: `s` is a valid out-parameter.
    ck(unsafe { call!(c, cuGetErrorName(CUresult::CUDA_ERROR_NOT_READY, &mut s)) }.unwrap());
    // SAFETY: the name is a static C string.
    let name = unsafe { std::ffi::CStr::from_ptr(s) };
    assert_eq!(name.to_str().unwrap(), "CUDA_ERROR_NOT_READY");
}

#[test]
fn memory_accounting_is_flat_after_free() {
    let c = cuda();
    set_device(5);
    let info = || {
        let (mut f, mut t) = (0usize, 0usize);
        // SAFETY: valid out-parameters.
        ck(unsafe { call!(c, cuMemGetInfo_v2(&mut f, &mut t)) }.unwrap());
        f
    };
    let before = info();
    let p = alloc(1 << 20);
    assert_eq!(before - info(), 1 << 20);
    free(p);
    assert_eq!(info(), before);
}

#[test]
fn streams_are_asynchronous_and_events_follow_them() {
    let c = cuda();
    set_device(0);
    let b = Gate::new();
    let (s, s2, s3) = (stream(), stream(), stream());
    let (mut start, mut end, mut untimed) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    // SAFETY: valid out-parameters and handles.
    unsafe {
        ck(call!(c, cuEventCreate(&mut start, 0)).unwrap());
        ck(call!(c, cuEventCreate(&mut end, 0)).unwrap());
        ck(call!(c, cuEventCreate(&mut untimed, 2)).unwrap());
        assert_eq!(
            call!(c, cuEventQuery(end)).unwrap(),
            CUresult::CUDA_SUCCESS,
            "never recorded"
        );
        ck(call!(c, cuEventRecord(start, s)).unwrap());
    }
    let dst = b.block(s);
    // SAFETY: valid handles.
    unsafe {
        ck(call!(c, cuEventRecord(end, s)).unwrap());
        ck(call!(c, cuEventRecord(untimed, s)).unwrap());
        ck(call!(c, cuStreamWaitEvent(s3, end, 0)).unwrap());
    }
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(query(s), CUresult::CUDA_ERROR_NOT_READY);
    assert_eq!(
        query(s3),
        CUresult::CUDA_ERROR_NOT_READY,
        "waits for the event"
    );
    // SAFETY: valid handles.
    unsafe {
        assert_eq!(
            call!(c, cuEventQuery(end)).unwrap(),
            CUresult::CUDA_ERROR_NOT_READY
        );
        let mut ms = 0f32;
        assert_eq!(
            call!(c, cuEventElapsedTime_v2(&mut ms, start, end)).unwrap(),
            CUresult::CUDA_ERROR_NOT_READY
        );
    }
    assert_eq!(
        download::<u32>(dst, 256),
        vec![0x7F7F_7F7F; 256],
        "nothing ran yet"
    );
    b.release(s2);
    // SAFETY: valid handle.
    ck(unsafe { call!(c, cuEventSynchronize(end)) }.unwrap());
    sync(s);
    sync(s3);
    assert_eq!(query(s), CUresult::CUDA_SUCCESS);
    assert_eq!(query(s3), CUresult::CUDA_SUCCESS);
    assert_eq!(download::<f32>(dst, 256), b.data);
    let mut ms = 0f32;
    // SAFETY: valid handles and out-parameter.
    unsafe {
        ck(call!(c, cuEventElapsedTime_v2(&mut ms, start, end)).unwrap());
        assert_eq!(
            call!(c, cuEventElapsedTime_v2(&mut ms, start, untimed)).unwrap(),
            CUresult::CUDA_ERROR_INVALID_HANDLE
        );
    }
    assert!(
        ms >= 50.0 && f64::from(ms) <= t0.elapsed().as_secs_f64() * 1e3 + 50.0,
        "{ms}"
    );
    // Destroying a stream with pending work lets it finish.
    let dst2 = b.block(s);
    destroy_stream(s);
    b.release(s2);
    sync(s2);
    let deadline = Instant::now() + Duration::from_secs(5);
    while download::<f32>(dst2, 256) != b.data {
        assert!(Instant::now() < deadline, "destroyed stream never drained");
        std::thread::sleep(Duration::from_millis(5));
    }
    destroy_stream(s2);
    destroy_stream(s3);
}

fn bf16_random(n: usize) -> Vec<bf16> {
    random_f32(n).into_iter().map(bf16::from_f32).collect()
}

#[test]
fn graph_capture_replays_the_kernel() {
    let c = cuda();
    set_device(2);
    let mut m = std::ptr::null_mut();
    let mut f = std::ptr::null_mut();
    let mut missing = std::ptr::null_mut();
    // SAFETY: valid out-parameters; PTX is NUL-terminated.
    unsafe {
        ck(call!(c, cuModuleLoadData(&mut m, PTX.as_ptr().cast())).unwrap());
        ck(call!(
            c,
            cuModuleGetFunction(&mut f, m, c"bf16_add_inplace".as_ptr())
        )
        .unwrap());
        assert_eq!(
            call!(c, cuModuleGetFunction(&mut missing, m, c"nope".as_ptr())).unwrap(),
            CUresult::CUDA_ERROR_NOT_FOUND
        );
        assert_eq!(
            call!(
                c,
                cuModuleGetFunction(&mut missing, m, c"mystery_kernel".as_ptr())
            )
            .unwrap(),
            CUresult::CUDA_ERROR_NOT_FOUND
        );
    }
    const N: usize = 1000;
    let (d0, s0) = (bf16_random(N), bf16_random(N));
    let (dst, src) = (alloc(2 * N), alloc(2 * N));
    upload(dst, &d0);
    upload(src, &s0);
    let s = stream();
    let (mut dp, mut sp, mut n) = (dst, src, N as u64);
    let mut params = [
        (&mut dp as *mut u64).cast::<c_void>(),
        (&mut sp as *mut u64).cast::<c_void>(),
        (&mut n as *mut u64).cast::<c_void>(),
    ];
    let mut graph = std::ptr::null_mut();
    let mut exec = std::ptr::null_mut();
    let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: valid handles, params point at the three argument values.
    unsafe {
        ck(call!(
            c,
            cuStreamBeginCapture_v2(s, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        )
        .unwrap());
        ck(call!(c, cuStreamIsCapturing(s, &mut status)).unwrap());
        assert_eq!(
            status,
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
        );
        ck(call!(
            c,
            cuLaunchKernel(
                f,
                4,
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
        .unwrap());
        assert_eq!(
            call!(c, cuStreamSynchronize(s)).unwrap(),
            CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        assert_eq!(
            call!(c, cuStreamQuery(s)).unwrap(),
            CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        ck(call!(c, cuStreamEndCapture(s, &mut graph)).unwrap());
    }
    assert_eq!(download::<bf16>(dst, N), d0, "capture runs nothing");
    // SAFETY: valid handles.
    unsafe {
        ck(call!(c, cuGraphInstantiateWithFlags(&mut exec, graph, 0)).unwrap());
        ck(call!(c, cuGraphLaunch(exec, s)).unwrap());
        ck(call!(c, cuGraphLaunch(exec, s)).unwrap());
    }
    sync(s);
    let got = download::<bf16>(dst, N);
    for i in 0..N {
        let once = bf16::from_f32(d0[i].to_f32() + s0[i].to_f32());
        let twice = bf16::from_f32(once.to_f32() + s0[i].to_f32());
        assert_eq!(got[i].to_bits(), twice.to_bits(), "element {i}");
    }
    // A kernel over a range past the allocation is refused at launch.
    // SAFETY: as above, with an out-of-range count written through the
    // parameter pointer.
    unsafe {
        params[2].cast::<u64>().write(N as u64 + 1);
        assert_eq!(
            call!(
                c,
                cuLaunchKernel(
                    f,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    s,
                    params.as_mut_ptr(),
                    std::ptr::null_mut()
                )
            )
            .unwrap(),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        ck(call!(c, cuGraphExecDestroy(exec)).unwrap());
        ck(call!(c, cuGraphDestroy(graph)).unwrap());
        ck(call!(c, cuModuleUnload(m)).unwrap());
    }
    destroy_stream(s);
    free(dst);
    free(src);
}
