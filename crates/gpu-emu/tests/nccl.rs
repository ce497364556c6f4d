//! The emulated NCCL through the real bindings, ranks as threads: collectives
//! against host references (random non-zero data, poisoned outputs, every
//! element checked), grouped send/recv, non-blocking init with a missing
//! rank, registration and argument checks, and the background enqueue of
//! non-blocking communicators (`ncclInProgress`, lazy connection, refusal of
//! calls while pending, abort of a pending enqueue), and a destroy waiting
//! for work in flight on a peer's device. No faults are injected here.

mod common;

use std::ffi::c_void;
use std::time::{Duration, Instant};

use common::*;
use cuda_sys::CUresult;
use half::bf16;
use nccl_sys::{
    call, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId,
};

/// Runs `f(rank)` on `n` threads, each with its own device current.
fn ranks(n: usize, f: impl Fn(usize) + Sync) {
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

#[test]
fn all_reduce_bf16_two_ranks_matches_the_host() {
    const N: usize = 4099;
    let id = unique_id();
    let inputs: Vec<Vec<bf16>> = (0..2)
        .map(|_| random_f32(N).into_iter().map(bf16::from_f32).collect())
        .collect();
    let want: Vec<bf16> = (0..N)
        .map(|i| bf16::from_f32(inputs[0][i].to_f32() + inputs[1][i].to_f32()))
        .collect();
    ranks(2, |r| {
        let comm = init(2, id, r as i32);
        let s = stream();
        let (send, recv) = (alloc(2 * N), alloc(2 * N));
        upload(send, &inputs[r]);
        poison(recv, 2 * N);
        nck(all_reduce_sum(
            send,
            recv,
            N,
            ncclDataType_t::ncclBfloat16,
            comm,
            s,
        ));
        sync(s);
        let got = download::<bf16>(recv, N);
        for i in 0..N {
            assert_eq!(got[i].to_bits(), want[i].to_bits(), "rank {r} element {i}");
        }
        // In place: the output replaces the input.
        upload(recv, &inputs[r]);
        nck(all_reduce_sum(
            recv,
            recv,
            N,
            ncclDataType_t::ncclBfloat16,
            comm,
            s,
        ));
        sync(s);
        assert_eq!(download::<bf16>(recv, N), want, "in place, rank {r}");
        nck(destroy(comm));
        destroy_stream(s);
        free(send);
        free(recv);
    });
}

#[test]
fn all_gather_and_reduce_scatter_three_ranks() {
    const C: usize = 33;
    let id = unique_id();
    let inputs: Vec<Vec<f32>> = (0..3).map(|_| random_f32(3 * C)).collect();
    ranks(3, |r| {
        let comm = init(3, id, r as i32);
        let s = stream();
        let (send, recv) = (alloc(4 * 3 * C), alloc(4 * 3 * C));
        upload(send, &inputs[r]);
        poison(recv, 4 * 3 * C);
        // SAFETY: `send` holds C f32 for the gather, 3C for the scatter;
        // `recv` holds 3C.
        unsafe {
            nck(call!(
                nccl(),
                ncclAllGather(
                    send as *const c_void,
                    recv as *mut c_void,
                    C,
                    ncclDataType_t::ncclFloat32,
                    comm,
                    s
                )
            )
            .unwrap());
        }
        sync(s);
        let got = download::<f32>(recv, 3 * C);
        for (j, x) in got.iter().enumerate() {
            assert_eq!(*x, inputs[j / C][j % C], "all-gather rank {r} element {j}");
        }
        poison(recv, 4 * 3 * C);
        // SAFETY: as above.
        unsafe {
            nck(call!(
                nccl(),
                ncclReduceScatter(
                    send as *const c_void,
                    recv as *mut c_void,
                    C,
                    ncclDataType_t::ncclFloat32,
                    ncclRedOp_t::ncclMax,
                    comm,
                    s
                )
            )
            .unwrap());
        }
        sync(s);
        let got = download::<f32>(recv, C);
        for (j, x) in got.iter().enumerate() {
            let k = r * C + j;
            let want = inputs[0][k].max(inputs[1][k]).max(inputs[2][k]);
            assert_eq!(*x, want, "reduce-scatter rank {r} element {j}");
        }
        nck(destroy(comm));
        destroy_stream(s);
    });
}

#[test]
fn grouped_send_recv_pair_does_not_deadlock() {
    const N: usize = 777;
    let id = unique_id();
    let inputs: Vec<Vec<f32>> = (0..2).map(|_| random_f32(N)).collect();
    ranks(2, |r| {
        let comm = init(2, id, r as i32);
        let s = stream();
        let (send, recv) = (alloc(4 * N), alloc(4 * N));
        upload(send, &inputs[r]);
        poison(recv, 4 * N);
        let peer = 1 - r as i32;
        // SAFETY: both buffers hold N f32.
        unsafe {
            nck(call!(nccl(), ncclGroupStart()).unwrap());
            // The recv is posted first on purpose: the group runs sends first.
            nck(call!(
                nccl(),
                ncclRecv(
                    recv as *mut c_void,
                    N,
                    ncclDataType_t::ncclFloat32,
                    peer,
                    comm,
                    s
                )
            )
            .unwrap());
            nck(call!(
                nccl(),
                ncclSend(
                    send as *const c_void,
                    N,
                    ncclDataType_t::ncclFloat32,
                    peer,
                    comm,
                    s
                )
            )
            .unwrap());
            nck(call!(nccl(), ncclGroupEnd()).unwrap());
        }
        sync(s);
        assert_eq!(download::<f32>(recv, N), inputs[1 - r], "rank {r}");
        nck(destroy(comm));
        destroy_stream(s);
    });
    // SAFETY: no arguments.
    let r = unsafe { call!(nccl(), ncclGroupEnd()) }.unwrap();
    assert_eq!(r, ncclResult_t::ncclInvalidUsage, "end without start");
}

fn nonblocking_config() -> ncclConfig_t {
    ncclConfig_t {
        size: size_of::<ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22803,
        blocking: 0,
        ..Default::default()
    }
}

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

#[test]
fn bad_arguments_are_refused() {
    set_device(3);
    let mut comm: ncclComm_t = std::ptr::null_mut();
    let id = unique_id();
    let mut bad = nonblocking_config();
    bad.magic = 0;
    // SAFETY: valid out-parameters and config.
    unsafe {
        assert_eq!(
            call!(nccl(), ncclCommInitRank(&mut comm, 0, id, 0)).unwrap(),
            ncclResult_t::ncclInvalidArgument
        );
        assert_eq!(
            call!(nccl(), ncclCommInitRank(&mut comm, 2, id, 2)).unwrap(),
            ncclResult_t::ncclInvalidArgument
        );
        assert_eq!(
            call!(
                nccl(),
                ncclCommInitRankConfig(&mut comm, 1, id, 0, &mut bad)
            )
            .unwrap(),
            ncclResult_t::ncclInvalidArgument
        );
    }
    assert!(last_error(std::ptr::null_mut()).contains("magic"));
    let comm = init(1, unique_id(), 0);
    let buf = alloc(64);
    let s = stream();
    // SAFETY: the buffer holds 64 bytes; the counts overrun it on purpose.
    unsafe {
        let r = all_reduce_sum(buf, buf, 17, ncclDataType_t::ncclFloat32, comm, s);
        assert_eq!(r, ncclResult_t::ncclInvalidArgument);
        let r = call!(
            nccl(),
            ncclBroadcast(
                buf as *const c_void,
                buf as *mut c_void,
                4,
                ncclDataType_t::ncclFloat32,
                1,
                comm,
                s
            )
        )
        .unwrap();
        assert_eq!(r, ncclResult_t::ncclInvalidArgument, "root out of range");
        let r = all_reduce_sum(buf, buf, 4, ncclDataType_t::ncclFloat8e4m3, comm, s);
        assert_eq!(r, ncclResult_t::ncclInvalidArgument, "fp8");
        // A count of zero is a no-op, even with a null buffer.
        let r = all_reduce_sum(0, 0, 0, ncclDataType_t::ncclFloat32, comm, s);
        assert_eq!(r, ncclResult_t::ncclSuccess);
    }
    nck(destroy(comm));
    destroy_stream(s);
    free(buf);
}

#[test]
fn register_then_deregister_twice_is_an_error() {
    set_device(4);
    let comm = init(1, unique_id(), 0);
    let buf = alloc(4096);
    let (mut h1, mut h2) = (std::ptr::null_mut(), std::ptr::null_mut());
    let calls_before = nccl_calls();
    // SAFETY: valid out-parameters; the buffer holds 4096 bytes.
    unsafe {
        nck(call!(
            nccl(),
            ncclCommRegister(comm, buf as *mut c_void, 4096, &mut h1)
        )
        .unwrap());
        nck(call!(
            nccl(),
            ncclCommRegister(comm, buf as *mut c_void, 1024, &mut h2)
        )
        .unwrap());
        assert!(!h1.is_null() && h1 != h2);
        let r = call!(
            nccl(),
            ncclCommRegister(comm, buf as *mut c_void, 4097, &mut h2)
        )
        .unwrap();
        assert_eq!(r, ncclResult_t::ncclInvalidArgument, "past the allocation");
        nck(call!(nccl(), ncclCommDeregister(comm, h1)).unwrap());
        let r = call!(nccl(), ncclCommDeregister(comm, h1)).unwrap();
        assert_eq!(r, ncclResult_t::ncclInvalidArgument, "deregistered twice");
        nck(call!(nccl(), ncclCommDeregister(comm, h2)).unwrap());
    }
    assert!(nccl_calls() >= calls_before + 6);
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-parameter; the pointer freed twice on purpose.
    unsafe {
        nck(call!(nccl(), ncclMemAlloc(&mut p, 1 << 16)).unwrap());
        nck(call!(nccl(), ncclMemFree(p)).unwrap());
        assert_eq!(
            call!(nccl(), ncclMemFree(p)).unwrap(),
            ncclResult_t::ncclInvalidArgument
        );
    }
    nck(destroy(comm));
    free(buf);
}

#[test]
fn split_by_parity() {
    let id: ncclUniqueId = unique_id();
    let inputs: Vec<Vec<i32>> = (0..4)
        .map(|r: i32| (0..64).map(|i| r * 1000 + i + 1).collect())
        .collect();
    ranks(4, |r| {
        let parent = init(4, id, r as i32);
        let mut child: ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-parameter; null config inherits the parent's.
        nck(unsafe {
            call!(
                nccl(),
                ncclCommSplit(
                    parent,
                    (r % 2) as i32,
                    -(r as i32),
                    &mut child,
                    std::ptr::null_mut()
                )
            )
        }
        .unwrap());
        let (mut n, mut me) = (0, -1);
        // SAFETY: valid out-parameters.
        unsafe {
            nck(call!(nccl(), ncclCommCount(child, &mut n)).unwrap());
            nck(call!(nccl(), ncclCommUserRank(child, &mut me)).unwrap());
        }
        // Keys are -rank: the higher parent rank comes first.
        assert_eq!((n, me), (2, if r >= 2 { 0 } else { 1 }));
        let s = stream();
        let (send, recv) = (alloc(256), alloc(256));
        upload(send, &inputs[r]);
        poison(recv, 256);
        nck(all_reduce_sum(
            send,
            recv,
            64,
            ncclDataType_t::ncclInt32,
            child,
            s,
        ));
        sync(s);
        let got = download::<i32>(recv, 64);
        for i in 0..64 {
            assert_eq!(
                got[i],
                inputs[r % 2][i] + inputs[r % 2 + 2][i],
                "rank {r} element {i}"
            );
        }
        nck(destroy(child));
        nck(destroy(parent));
        destroy_stream(s);
    });
}

// ------------------------------------------------ non-blocking enqueue

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

/// NCCL's teardown unmaps buffers that the peers' devices map: a destroy
/// does not return while another communicator has work in flight on a
/// peer's device, and returns once that work has run. (Devices 6 and 7,
/// which no other test of this file uses.)
#[test]
fn destroy_waits_for_work_in_flight_on_a_peer_device() {
    const DEVS: [i32; 2] = [6, 7];
    const N: usize = 611;
    let (a, b) = (unique_id(), unique_id());
    let issued = std::sync::Barrier::new(2);
    let data: Vec<Vec<f32>> = (0..2).map(|_| random_f32(N)).collect();
    let want: Vec<f32> = (0..N).map(|i| data[0][i] + data[1][i]).collect();
    std::thread::scope(|s| {
        for r in 0..2 {
            let (issued, data, want) = (&issued, &data, &want);
            s.spawn(move || {
                set_device(DEVS[r]);
                let ca = init(2, a, r as i32);
                let cb = init(2, b, r as i32);
                let st = stream();
                let (send, recv) = (alloc(4 * N), alloc(4 * N));
                upload(send, &data[r]);
                poison(recv, 4 * N);
                let reduce = || {
                    nck(all_reduce_sum(
                        send,
                        recv,
                        N,
                        ncclDataType_t::ncclFloat32,
                        cb,
                        st,
                    ))
                };
                if r == 0 {
                    // In flight on device 6 until rank 1 issues its side.
                    reduce();
                    issued.wait();
                } else {
                    issued.wait();
                    let (tx, rx) = std::sync::mpsc::channel();
                    let ca = ca as usize;
                    std::thread::spawn(move || {
                        let _ = tx.send(destroy(ca as ncclComm_t));
                    });
                    std::thread::sleep(Duration::from_millis(300));
                    assert!(
                        rx.try_recv().is_err(),
                        "destroy returned while the peer's device had work in flight"
                    );
                    reduce();
                    let rc = rx
                        .recv_timeout(Duration::from_secs(5))
                        .expect("destroy did not return once the peer's work ran");
                    assert_eq!(rc, ncclResult_t::ncclSuccess);
                }
                sync(st);
                assert_eq!(download::<f32>(recv, N), *want);
                if r == 0 {
                    assert_eq!(destroy(ca), ncclResult_t::ncclSuccess);
                }
                assert_eq!(destroy(cb), ncclResult_t::ncclSuccess);
                free(send);
                free(recv);
                destroy_stream(st);
            });
        }
    });
}
