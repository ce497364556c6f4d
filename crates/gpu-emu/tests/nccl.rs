//! The emulated NCCL through the real bindings, ranks as threads, on
//! blocking communicators: collectives against host references (random
//! non-zero data, poisoned outputs, every element checked), grouped
//! send/recv, registration and argument checks, split, and a destroy
//! waiting for work in flight on a peer's device. Non-blocking
//! communicators are `nonblocking.rs`. No faults are injected here.

mod common;

use std::ffi::c_void;
use std::time::Duration;

use common::*;
use half::bf16;
use nccl_sys::{call, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId};

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
