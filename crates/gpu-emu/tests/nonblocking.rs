//! The emulated NCCL's non-blocking communicators through the real
//! bindings: init with a missing rank, init completing once every rank
//! joins, and the background enqueue (`ncclInProgress`, lazy connection,
//! a kernel ordered after a group only once polled, refusal of calls
//! while an enqueue is pending, abort of a pending enqueue). No faults are
//! injected here.

mod common;

use std::ffi::c_void;
use std::time::{Duration, Instant};

use common::*;
use cuda_sys::CUresult;
use half::bf16;
use nccl_sys::{call, ncclComm_t, ncclDataType_t, ncclResult_t};

#[test]
fn nonblocking_init_with_a_missing_rank_then_abort() {
    set_device(0);
    let id = unique_id();
    let mut cfg = nonblocking_config();
    let mut comm: ncclComm_t = std::ptr::null_mut();
    // SAFETY: valid out-parameter and config.
    let r = unsafe {
        call!(
            nccl(),
            ncclCommInitRankConfig(&mut comm, 2, id, 0, &mut cfg)
        )
    }
    .unwrap();
    assert_eq!(r, ncclResult_t::ncclInProgress);
    assert!(!comm.is_null());
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(async_error(comm), ncclResult_t::ncclInProgress);
    let buf = alloc(64);
    let s = stream();
    let r = all_reduce_sum(buf, buf, 16, ncclDataType_t::ncclFloat32, comm, s);
    assert_eq!(
        r,
        ncclResult_t::ncclInvalidArgument,
        "used before init completed"
    );
    let t = Instant::now();
    nck(abort(comm));
    assert!(t.elapsed() < Duration::from_millis(200));
    let mut e = ncclResult_t::ncclSuccess;
    // SAFETY: valid out-parameter; the handle is stale on purpose.
    let r = unsafe { call!(nccl(), ncclCommGetAsyncError(comm, &mut e)) }.unwrap();
    assert_ne!(
        r,
        ncclResult_t::ncclSuccess,
        "the handle was freed by abort"
    );
    assert_eq!(destroy(comm), ncclResult_t::ncclInvalidUsage);
    destroy_stream(s);
    free(buf);
}

#[test]
fn nonblocking_init_completes_when_all_join() {
    let id = unique_id();
    ranks(2, |r| {
        let mut cfg = nonblocking_config();
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-parameter and config.
        let res = unsafe {
            call!(
                nccl(),
                ncclCommInitRankConfig(&mut comm, 2, id, r as i32, &mut cfg)
            )
        }
        .unwrap();
        assert_eq!(res, ncclResult_t::ncclInProgress);
        let deadline = Instant::now() + Duration::from_secs(5);
        while async_error(comm) == ncclResult_t::ncclInProgress {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(async_error(comm), ncclResult_t::ncclSuccess);
        let (mut n, mut me) = (0, -1);
        // SAFETY: valid out-parameters.
        unsafe {
            nck(call!(nccl(), ncclCommCount(comm, &mut n)).unwrap());
            nck(call!(nccl(), ncclCommUserRank(comm, &mut me)).unwrap());
        }
        assert_eq!((n, me), (2, r as i32));
        nck(destroy(comm));
    });
}

const ADD_PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\
.visible .entry bf16_add_inplace(\n .param .u64 p0,\n .param .u64 p1,\n .param .u64 p2\n)\n{\n ret;\n}\n\0";

/// Polls `ncclCommGetAsyncError` until it leaves `ncclInProgress` (5 s
/// deadline) and returns its value.
fn settle(c: ncclComm_t) -> ncclResult_t {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let e = async_error(c);
        if e != ncclResult_t::ncclInProgress {
            return e;
        }
        assert!(
            Instant::now() < deadline,
            "still in progress at the deadline"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Both ranks of a fresh non-blocking communicator, driven from this
/// thread (rank r on device r), initialised.
fn nonblocking_pair() -> [ncclComm_t; 2] {
    let id = unique_id();
    let mut comms = [std::ptr::null_mut(); 2];
    for (r, c) in comms.iter_mut().enumerate() {
        set_device(r as i32);
        let mut cfg = nonblocking_config();
        // SAFETY: valid out-parameter and config.
        let res =
            unsafe { call!(nccl(), ncclCommInitRankConfig(c, 2, id, r as i32, &mut cfg)) }.unwrap();
        assert_eq!(res, ncclResult_t::ncclInProgress);
    }
    for c in comms {
        nck(settle(c));
    }
    comms
}

/// A grouped send to and recv from the peer of `n` bf16.
fn grouped_exchange(
    send: u64,
    recv: u64,
    n: usize,
    peer: i32,
    c: ncclComm_t,
    s: cuda_sys::CUstream,
) -> ncclResult_t {
    // SAFETY: the caller's buffers hold `n` bf16.
    unsafe {
        nck(call!(nccl(), ncclGroupStart()).unwrap());
        nck(call!(
            nccl(),
            ncclRecv(
                recv as *mut c_void,
                n,
                ncclDataType_t::ncclBfloat16,
                peer,
                c,
                s
            )
        )
        .unwrap());
        nck(call!(
            nccl(),
            ncclSend(
                send as *const c_void,
                n,
                ncclDataType_t::ncclBfloat16,
                peer,
                c,
                s
            )
        )
        .unwrap());
        call!(nccl(), ncclGroupEnd()).unwrap()
    }
}

/// Launches `bf16_add_inplace(dst, src, n)` on `s`.
fn launch_add(f: cuda_sys::CUfunction, dst: u64, src: u64, n: usize, s: cuda_sys::CUstream) {
    let (mut d, mut x, mut n) = (dst, src, n as u64);
    let mut params = [
        (&mut d as *mut u64).cast::<c_void>(),
        (&mut x as *mut u64).cast::<c_void>(),
        (&mut n as *mut u64).cast::<c_void>(),
    ];
    // SAFETY: `params` points at the three argument values, alive for the
    // call; the kernel's buffers hold `n` bf16.
    ck(unsafe {
        cuda_sys::call!(
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
    .unwrap());
}

#[test]
fn nonblocking_all_reduce_is_enqueued_in_the_background() {
    const N: usize = 1031;
    let comms = nonblocking_pair();
    let inputs: Vec<Vec<f32>> = (0..2).map(|_| random_f32(N)).collect();
    let mut bufs = Vec::new();
    for (r, input) in inputs.iter().enumerate() {
        set_device(r as i32);
        let (s, send, recv) = (stream(), alloc(4 * N), alloc(4 * N));
        upload(send, input);
        poison(recv, 4 * N);
        bufs.push((s, send, recv));
    }
    // Settles both communicators, then checks every element of both outputs.
    let settle_and_check = |what: &str, want: &dyn Fn(usize) -> f32| {
        for c in comms {
            nck(settle(c));
        }
        for &(s, _, recv) in &bufs {
            sync(s);
            for (i, got) in download::<f32>(recv, N).into_iter().enumerate() {
                assert_eq!(got, want(i), "{what}element {i}");
            }
        }
    };
    // The first collective waits for the peer (lazy connection).
    let (s0, send0, recv0) = bufs[0];
    assert_eq!(
        all_reduce_sum(send0, recv0, N, ncclDataType_t::ncclFloat32, comms[0], s0),
        ncclResult_t::ncclInProgress
    );
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(async_error(comms[0]), ncclResult_t::ncclInProgress);
    assert_eq!(query(s0), CUresult::CUDA_SUCCESS, "not on the stream yet");
    assert!(download::<u8>(recv0, 4 * N).iter().all(|b| *b == 0x7F));
    let (s1, send1, recv1) = bufs[1];
    assert_eq!(
        all_reduce_sum(send1, recv1, N, ncclDataType_t::ncclFloat32, comms[1], s1),
        ncclResult_t::ncclInProgress
    );
    settle_and_check("", &|i| inputs[0][i] + inputs[1][i]);
    // Connected now: later collectives only get the short delay; in place.
    for (r, &(s, _, recv)) in bufs.iter().enumerate() {
        upload(recv, &inputs[1 - r]);
        assert_eq!(
            all_reduce_sum(recv, recv, N, ncclDataType_t::ncclFloat32, comms[r], s),
            ncclResult_t::ncclInProgress
        );
    }
    settle_and_check("in place, ", &|i| inputs[1][i] + inputs[0][i]);
    for (c, (s, send, recv)) in comms.into_iter().zip(bufs) {
        nck(destroy(c));
        destroy_stream(s);
        free(send);
        free(recv);
    }
}

#[test]
fn grouped_send_recv_then_kernel_only_after_polling() {
    const N: usize = 613;
    let comms = nonblocking_pair();
    set_device(0);
    let (mut m, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid out-parameters; the PTX is NUL-terminated.
    unsafe {
        ck(cuda_sys::call!(cuda(), cuModuleLoadData(&mut m, ADD_PTX.as_ptr().cast())).unwrap());
        ck(cuda_sys::call!(
            cuda(),
            cuModuleGetFunction(&mut f, m, c"bf16_add_inplace".as_ptr())
        )
        .unwrap());
    }
    let rnd = || -> Vec<bf16> { random_f32(N).into_iter().map(bf16::from_f32).collect() };
    let sends: Vec<Vec<bf16>> = (0..2).map(|_| rnd()).collect();
    let dsts: Vec<Vec<bf16>> = (0..2).map(|_| rnd()).collect();
    let mut bufs = Vec::new();
    for r in 0..2 {
        set_device(r as i32);
        let (s, send, recv, dst) = (stream(), alloc(2 * N), alloc(2 * N), alloc(2 * N));
        upload(send, &sends[r]);
        upload(dst, &dsts[r]);
        poison(recv, 2 * N);
        bufs.push((s, send, recv, dst));
    }
    let add = |a: bf16, b: bf16| bf16::from_f32(a.to_f32() + b.to_f32());
    // The bug this emulates: a kernel launched before the enqueue finished
    // runs ahead of the receive (deterministic here: the peer has not
    // called yet, so the first exchange cannot be enqueued).
    let (s0, send0, recv0, dst0) = bufs[0];
    assert_eq!(
        grouped_exchange(send0, recv0, N, 1, comms[0], s0),
        ncclResult_t::ncclInProgress
    );
    launch_add(f, dst0, recv0, N, s0);
    sync(s0);
    let poisoned = bf16::from_bits(0x7F7F);
    let got = download::<bf16>(dst0, N);
    for i in 0..N {
        assert_eq!(
            got[i].to_bits(),
            add(dsts[0][i], poisoned).to_bits(),
            "early kernel, element {i}"
        );
    }
    let (s1, send1, recv1, _) = bufs[1];
    assert_eq!(
        grouped_exchange(send1, recv1, N, 0, comms[1], s1),
        ncclResult_t::ncclInProgress
    );
    for c in comms {
        nck(settle(c));
    }
    for r in 0..2 {
        let (s, _, recv, dst) = bufs[r];
        sync(s);
        assert_eq!(
            download::<bf16>(recv, N),
            sends[1 - r],
            "first exchange, rank {r}"
        );
        upload(dst, &dsts[r]);
        poison(recv, 2 * N);
    }
    // The correct use: poll until enqueued, then launch on the same stream.
    for r in 0..2 {
        let (s, send, recv, _) = bufs[r];
        assert_eq!(
            grouped_exchange(send, recv, N, 1 - r as i32, comms[r], s),
            ncclResult_t::ncclInProgress
        );
    }
    for r in 0..2 {
        let (s, _, recv, dst) = bufs[r];
        nck(settle(comms[r]));
        launch_add(f, dst, recv, N, s);
    }
    for r in 0..2 {
        let (s, _, _, dst) = bufs[r];
        sync(s);
        let got = download::<bf16>(dst, N);
        for i in 0..N {
            assert_eq!(
                got[i].to_bits(),
                add(dsts[r][i], sends[1 - r][i]).to_bits(),
                "rank {r} element {i}"
            );
        }
    }
    // SAFETY: the module came from cuModuleLoadData.
    ck(unsafe { cuda_sys::call!(cuda(), cuModuleUnload(m)) }.unwrap());
    for (c, (s, send, recv, dst)) in comms.into_iter().zip(bufs) {
        nck(destroy(c));
        destroy_stream(s);
        free(send);
        free(recv);
        free(dst);
    }
}

#[test]
fn a_call_during_a_pending_enqueue_is_refused_and_abort_releases_it() {
    const N: usize = 256;
    let comms = nonblocking_pair();
    set_device(0);
    let s = stream();
    let buf = alloc(4 * N);
    poison(buf, 4 * N);
    // SAFETY: the buffer holds N f32.
    let r = unsafe {
        call!(
            nccl(),
            ncclRecv(
                buf as *mut c_void,
                N,
                ncclDataType_t::ncclFloat32,
                1,
                comms[0],
                s
            )
        )
    }
    .unwrap();
    assert_eq!(r, ncclResult_t::ncclInProgress);
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(
        async_error(comms[0]),
        ncclResult_t::ncclInProgress,
        "the peer never sends"
    );
    assert_eq!(query(s), CUresult::CUDA_SUCCESS, "not on the stream yet");
    assert_eq!(
        all_reduce_sum(buf, buf, N, ncclDataType_t::ncclFloat32, comms[0], s),
        ncclResult_t::ncclInvalidUsage,
        "a call while the previous one is pending"
    );
    assert!(
        last_error(comms[0]).contains("previous operation still in progress"),
        "{}",
        last_error(comms[0])
    );
    // SAFETY: plain handle.
    let r = unsafe { call!(nccl(), ncclCommFinalize(comms[0])) }.unwrap();
    assert_eq!(r, ncclResult_t::ncclInvalidUsage, "finalize while pending");
    let t = Instant::now();
    nck(abort(comms[0]));
    assert!(t.elapsed() < Duration::from_millis(200));
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(
        query(s),
        CUresult::CUDA_SUCCESS,
        "the pending work was dropped"
    );
    assert!(
        download::<u8>(buf, 4 * N).iter().all(|b| *b == 0x7F),
        "the buffer is untouched"
    );
    // The peer, idle, still destroys cleanly.
    nck(destroy(comms[1]));
    destroy_stream(s);
    free(buf);
}
