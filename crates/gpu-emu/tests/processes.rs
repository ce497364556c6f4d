//! Communicators whose ranks are separate processes: this test binary runs
//! itself as the other ranks (`common::procs`). Every operation across
//! three processes
//! against host references (random non-zero data, poisoned outputs, every
//! element checked, payloads past one wire chunk), a split across
//! processes, a peer killed in the middle of a collective (the survivor's
//! work ends with `ncclRemoteError`), a peer that destroyed its
//! communicator (the survivor blocks until it aborts), a fault named by
//! rank in `METRALE_EMU_FAULTS` acting in that rank's process, a cost
//! named by rank in `METRALE_EMU_COSTS` timing that rank's all-reduce in
//! its process (`costs.rs` has the cost model in process), an id
//! whose root process is gone (init fails at once). CUDA IPC between
//! processes is `ipc.rs`.
//!
//! Invariant: every wait for a child or a stream has a deadline, and a
//! child is killed when a test gives up on it.

mod common;

use std::ffi::c_void;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::procs::{ID, ROLE, SEED, child_role, id_hex, id_unhex, spawn, spawn_with, wait_ok};
use common::*;
use cuda_sys::{CUdeviceptr, CUresult, CUstream};
use nccl_sys::{call, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId};
use rand::{Rng, SeedableRng};

const F32: ncclDataType_t = ncclDataType_t::ncclFloat32;

/// Waits until `s` has no pending work (5 s deadline) and returns its
/// state.
fn drained(s: CUstream) -> CUresult {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let q = query(s);
        if q != CUresult::CUDA_ERROR_NOT_READY {
            return q;
        }
        assert!(Instant::now() < deadline, "the stream did not drain");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Rank `k`'s input: `len` random non-zero f32 from the shared seed.
fn input(seed: u64, k: usize, len: usize) -> Vec<f32> {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed ^ (k as u64 + 1).wrapping_mul(0x9e37_79b9));
    (0..len)
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

/// Element-wise sums in rank order, as NCCL's (and the emulator's) f32
/// reduction adds.
fn sum(parts: &[&[f32]]) -> Vec<f32> {
    let mut acc = parts[0].to_vec();
    for p in &parts[1..] {
        for (a, b) in acc.iter_mut().zip(p.iter()) {
            *a += *b;
        }
    }
    acc
}

/// Joins rank `r` of `n`; rank 0 through a non-blocking init polled to
/// completion.
fn join(n: usize, id: ncclUniqueId, r: usize) -> ncclComm_t {
    if r != 0 {
        return init(n as i32, id, r as i32);
    }
    let mut c = std::ptr::null_mut();
    let mut cfg = nonblocking_config();
    // SAFETY: valid out-parameter and config.
    let rc = unsafe {
        call!(
            nccl(),
            ncclCommInitRankConfig(&mut c, n as i32, id, 0, &mut cfg)
        )
    }
    .unwrap();
    assert_eq!(rc, ncclResult_t::ncclInProgress);
    let deadline = Instant::now() + Duration::from_secs(20);
    while async_error(c) == ncclResult_t::ncclInProgress {
        assert!(
            Instant::now() < deadline,
            "non-blocking init did not finish"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    nck(async_error(c));
    c
}

/// Settles a non-blocking communicator's enqueue (a no-op on a blocking
/// one).
fn settle(c: ncclComm_t, rc: ncclResult_t) {
    if rc == ncclResult_t::ncclInProgress {
        let deadline = Instant::now() + Duration::from_secs(10);
        while async_error(c) == ncclResult_t::ncclInProgress {
            assert!(Instant::now() < deadline, "enqueue did not finish");
            std::thread::sleep(Duration::from_micros(200));
        }
        nck(async_error(c));
    } else {
        nck(rc);
    }
}

/// Waits until `c` leaves `ncclInProgress`, whatever the call returned
/// (`rc`, which must not be an error).
fn settle_all(c: ncclComm_t, rc: ncclResult_t) {
    if rc != ncclResult_t::ncclInProgress {
        nck(rc);
    }
    settle(c, ncclResult_t::ncclInProgress);
}

/// A collective through a raw call, settled.
fn run(c: ncclComm_t, f: impl FnOnce() -> ncclResult_t) {
    settle(c, f());
}

/// Device buffers of `elems` f32: the send side holding `data`, the recv
/// side poisoned.
fn buffers(data: &[f32], elems: usize) -> (CUdeviceptr, CUdeviceptr) {
    let (send, recv) = (alloc(4 * data.len().max(1)), alloc(4 * elems.max(1)));
    upload(send, data);
    poison(recv, 4 * elems.max(1));
    (send, recv)
}

#[track_caller]
fn check(what: &str, r: usize, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length on rank {r}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: rank {r} element {i}");
    }
}

/// Every collective, a send/recv ring and a split, as rank `r` of `n`.
fn every_operation(r: usize, n: usize, id: ncclUniqueId, seed: u64) {
    set_device(r as i32);
    let comm = join(n, id, r);
    let s = stream();
    // Payloads past one wire chunk (1 MiB).
    const E: usize = 300_007;
    let ins: Vec<Vec<f32>> = (0..n).map(|k| input(seed, k, E * n)).collect();
    let mine = &ins[r];
    let blocks = |k: usize, j: usize| &ins[k][j * E..(j + 1) * E];

    // all_reduce, in rank order.
    let (send, recv) = buffers(&mine[..E], E);
    // SAFETY: both buffers hold E f32 (the emulator checks them anyway).
    run(comm, || unsafe {
        call!(
            nccl(),
            ncclAllReduce(
                send as *const c_void,
                recv as *mut c_void,
                E,
                F32,
                ncclRedOp_t::ncclSum,
                comm,
                s
            )
        )
        .unwrap()
    });
    sync(s);
    let parts: Vec<&[f32]> = (0..n).map(|k| blocks(k, 0)).collect();
    check("all_reduce", r, &download::<f32>(recv, E), &sum(&parts));
    free(send);
    free(recv);

    // broadcast from the last rank, reduce to rank 0.
    let root = n - 1;
    let (send, recv) = buffers(&mine[..E], E);
    // SAFETY: as above.
    run(comm, || unsafe {
        call!(
            nccl(),
            ncclBroadcast(
                send as *const c_void,
                recv as *mut c_void,
                E,
                F32,
                root as i32,
                comm,
                s
            )
        )
        .unwrap()
    });
    sync(s);
    check("broadcast", r, &download::<f32>(recv, E), blocks(root, 0));
    poison(recv, 4 * E);
    // SAFETY: as above.
    run(comm, || unsafe {
        call!(
            nccl(),
            ncclReduce(
                send as *const c_void,
                recv as *mut c_void,
                E,
                F32,
                ncclRedOp_t::ncclSum,
                0,
                comm,
                s
            )
        )
        .unwrap()
    });
    sync(s);
    if r == 0 {
        check("reduce", r, &download::<f32>(recv, E), &sum(&parts));
    }
    free(send);
    free(recv);

    // all_gather, reduce_scatter, all_to_all.
    let (send, recv) = buffers(mine, E * n);
    // SAFETY: `send` holds E * n f32, `recv` E * n.
    run(comm, || unsafe {
        call!(
            nccl(),
            ncclAllGather(send as *const c_void, recv as *mut c_void, E, F32, comm, s)
        )
        .unwrap()
    });
    sync(s);
    let gathered: Vec<f32> = (0..n).flat_map(|k| blocks(k, 0).to_vec()).collect();
    check("all_gather", r, &download::<f32>(recv, E * n), &gathered);
    poison(recv, 4 * E * n);
    // SAFETY: as above.
    run(comm, || unsafe {
        call!(
            nccl(),
            ncclReduceScatter(
                send as *const c_void,
                recv as *mut c_void,
                E,
                F32,
                ncclRedOp_t::ncclSum,
                comm,
                s
            )
        )
        .unwrap()
    });
    sync(s);
    let mine_parts: Vec<&[f32]> = (0..n).map(|k| blocks(k, r)).collect();
    check(
        "reduce_scatter",
        r,
        &download::<f32>(recv, E),
        &sum(&mine_parts),
    );
    poison(recv, 4 * E * n);
    // SAFETY: as above.
    run(comm, || unsafe {
        call!(
            nccl(),
            ncclAlltoAll(send as *const c_void, recv as *mut c_void, E, F32, comm, s)
        )
        .unwrap()
    });
    sync(s);
    let a2a: Vec<f32> = (0..n).flat_map(|k| blocks(k, r).to_vec()).collect();
    check("all_to_all", r, &download::<f32>(recv, E * n), &a2a);
    free(send);
    free(recv);

    // A send/recv ring in one group.
    let (to, from) = ((r + 1) % n, (r + n - 1) % n);
    let (send, recv) = buffers(&mine[..E], E);
    // SAFETY: takes no arguments.
    nck(unsafe { call!(nccl(), ncclGroupStart()) }.unwrap());
    // SAFETY: both buffers hold E f32.
    unsafe {
        nck(call!(
            nccl(),
            ncclSend(send as *const c_void, E, F32, to as i32, comm, s)
        )
        .unwrap());
        nck(call!(
            nccl(),
            ncclRecv(recv as *mut c_void, E, F32, from as i32, comm, s)
        )
        .unwrap());
    }
    // SAFETY: takes no arguments.
    settle(comm, unsafe { call!(nccl(), ncclGroupEnd()) }.unwrap());
    sync(s);
    check(
        "send/recv ring",
        r,
        &download::<f32>(recv, E),
        blocks(from, 0),
    );
    free(send);
    free(recv);

    // One group whose sends to `to` and receives from `from` sit on two
    // streams, each stream holding a send and a receive: every receive
    // gets the send of its place in the calls (a long one first, then a
    // short one), whichever stream runs first.
    let s2 = stream();
    const SHORT: usize = 1001;
    let (long_send, long_recv) = buffers(&mine[..E], E);
    let (short_send, short_recv) = buffers(&mine[E..E + SHORT], SHORT);
    // SAFETY: takes no arguments.
    nck(unsafe { call!(nccl(), ncclGroupStart()) }.unwrap());
    // SAFETY: each buffer holds the count of f32 named with it.
    unsafe {
        nck(call!(
            nccl(),
            ncclSend(long_send as *const c_void, E, F32, to as i32, comm, s)
        )
        .unwrap());
        nck(call!(
            nccl(),
            ncclRecv(long_recv as *mut c_void, E, F32, from as i32, comm, s2)
        )
        .unwrap());
        nck(call!(
            nccl(),
            ncclSend(short_send as *const c_void, SHORT, F32, to as i32, comm, s2)
        )
        .unwrap());
        nck(call!(
            nccl(),
            ncclRecv(short_recv as *mut c_void, SHORT, F32, from as i32, comm, s)
        )
        .unwrap());
    }
    // SAFETY: takes no arguments.
    settle(comm, unsafe { call!(nccl(), ncclGroupEnd()) }.unwrap());
    sync(s);
    sync(s2);
    check(
        "send/recv to one peer on two streams, long",
        r,
        &download::<f32>(long_recv, E),
        blocks(from, 0),
    );
    check(
        "send/recv to one peer on two streams, short",
        r,
        &download::<f32>(short_recv, SHORT),
        &ins[from][E..E + SHORT],
    );
    for p in [long_send, long_recv, short_send, short_recv] {
        free(p);
    }
    destroy_stream(s2);

    // A split by parity, keys reversed; an all_reduce on the child.
    let mut child: ncclComm_t = std::ptr::null_mut();
    // SAFETY: valid out-parameter; a null config inherits the parent's.
    let rc = unsafe {
        call!(
            nccl(),
            ncclCommSplit(
                comm,
                (r % 2) as i32,
                -(r as i32),
                &mut child,
                std::ptr::null_mut()
            )
        )
    }
    .unwrap();
    // A non-blocking parent's split returns before the child exists (as
    // NCCL 2.28's does): it is there once the parent leaves ncclInProgress.
    settle_all(comm, rc);
    assert!(!child.is_null(), "rank {r}: the split left no communicator");
    settle_all(child, ncclResult_t::ncclInProgress);
    let members: Vec<usize> = (0..n).filter(|k| k % 2 == r % 2).collect();
    let (mut cn, mut me) = (0, -1);
    // SAFETY: valid out-parameters.
    unsafe {
        nck(call!(nccl(), ncclCommCount(child, &mut cn)).unwrap());
        nck(call!(nccl(), ncclCommUserRank(child, &mut me)).unwrap());
    }
    let want_me = members.iter().rev().position(|&k| k == r).unwrap();
    assert_eq!(
        (cn as usize, me as usize),
        (members.len(), want_me),
        "split of rank {r}"
    );
    let (send, recv) = buffers(&mine[..E], E);
    // SAFETY: both buffers hold E f32.
    run(child, || unsafe {
        call!(
            nccl(),
            ncclAllReduce(
                send as *const c_void,
                recv as *mut c_void,
                E,
                F32,
                ncclRedOp_t::ncclSum,
                child,
                s
            )
        )
        .unwrap()
    });
    sync(s);
    let in_order: Vec<&[f32]> = members.iter().rev().map(|&k| blocks(k, 0)).collect();
    check(
        "all_reduce on the split",
        r,
        &download::<f32>(recv, E),
        &sum(&in_order),
    );
    free(send);
    free(recv);
    nck(destroy(child));
    nck(destroy(comm));
    destroy_stream(s);
}

/// One checked all_reduce of rank `r` of two.
fn one_all_reduce(comm: ncclComm_t, s: CUstream, r: usize, seed: u64) {
    let ins: Vec<Vec<f32>> = (0..2).map(|k| input(seed, k, 1000)).collect();
    let (send, recv) = buffers(&ins[r], 1000);
    nck(all_reduce_sum(send, recv, 1000, F32, comm, s));
    sync(s);
    check(
        "all_reduce",
        r,
        &download::<f32>(recv, 1000),
        &sum(&[&ins[0], &ins[1]]),
    );
    free(send);
    free(recv);
}

/// What a child process does.
#[test]
fn child() {
    let Some((role, rank, n, id, seed)) = child_role() else {
        return;
    };
    match role.as_str() {
        "every" => every_operation(rank, n, id, seed),
        "killed" | "leaves" => {
            set_device(rank as i32);
            let comm = init(n as i32, id, rank as i32);
            let s = stream();
            one_all_reduce(comm, s, rank, seed);
            if role == "leaves" {
                nck(destroy(comm));
                return;
            }
            // Waits to be killed by the parent.
            std::thread::sleep(Duration::from_secs(60));
            std::process::exit(3);
        }
        "async_fault" => {
            // METRALE_EMU_FAULTS names this rank: its operation completes,
            // then its communicator reports the error.
            set_device(rank as i32);
            let comm = init(n as i32, id, rank as i32);
            let s = stream();
            one_all_reduce(comm, s, rank, seed);
            assert_eq!(async_error(comm), ncclResult_t::ncclSystemError);
            assert!(
                last_error(comm).contains("injected"),
                "{}",
                last_error(comm)
            );
            nck(abort(comm));
        }
        "costs_env" => {
            // METRALE_EMU_COSTS names this rank: its all-reduce takes
            // 123.456 us between two events, eagerly.
            set_device(rank as i32);
            let comm = init(n as i32, id, rank as i32);
            let s = stream();
            let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
            let mut ms = f32::NAN;
            // SAFETY: valid out-parameters and handles made here.
            unsafe {
                let c = cuda();
                ck(cuda_sys::call!(c, cuEventCreate(&mut a, 0)).unwrap());
                ck(cuda_sys::call!(c, cuEventCreate(&mut b, 0)).unwrap());
                ck(cuda_sys::call!(c, cuEventRecord(a, s)).unwrap());
                one_all_reduce(comm, s, rank, seed);
                ck(cuda_sys::call!(c, cuEventRecord(b, s)).unwrap());
                ck(cuda_sys::call!(c, cuEventSynchronize(b)).unwrap());
                ck(cuda_sys::call!(c, cuEventElapsedTime_v2(&mut ms, a, b)).unwrap());
            }
            assert!((ms - 0.123_456).abs() < 1e-7, "{ms} ms");
            nck(destroy(comm));
        }
        "make_id" => {
            cuda();
            println!("ID={}", id_hex(&unique_id()));
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn three_processes_run_every_operation() {
    let id = unique_id();
    let seed: u64 = rand::random();
    let mut kids: Vec<Child> = (1..3).map(|r| spawn("every", r, 3, &id, seed)).collect();
    every_operation(0, 3, id, seed);
    for k in &mut kids {
        wait_ok(k, Duration::from_secs(60));
    }
}

#[test]
fn a_rank_killed_mid_collective_is_a_remote_error_on_the_survivor() {
    set_device(0);
    let id = unique_id();
    let seed: u64 = rand::random();
    let mut kid = spawn("killed", 1, 2, &id, seed);
    let comm = init(2, id, 0);
    let s = stream();
    one_all_reduce(comm, s, 0, seed);
    // An all_reduce the peer never joins: it waits for the peer...
    let (send, recv) = buffers(&[1.0; 64], 64);
    nck(all_reduce_sum(send, recv, 64, F32, comm, s));
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(query(s), CUresult::CUDA_ERROR_NOT_READY);
    assert_eq!(async_error(comm), ncclResult_t::ncclSuccess);
    // ...until the peer is killed: then it ends with a remote error.
    kid.kill().expect("SIGKILL the peer");
    let _ = kid.wait();
    let t = Instant::now();
    assert_eq!(drained(s), CUresult::CUDA_SUCCESS);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(async_error(comm), ncclResult_t::ncclRemoteError);
    let text = last_error(comm);
    assert!(
        text.contains("rank 1") && text.contains("exited or was killed"),
        "{text}"
    );
    // Nothing was written, and the survivor tears down normally.
    assert!(download::<u32>(recv, 64).iter().all(|&w| w == 0x7f7f_7f7f));
    nck(abort(comm));
    destroy_stream(s);
    free(send);
    free(recv);
}

#[test]
fn a_peer_that_destroyed_its_communicator_blocks_the_survivor_until_abort() {
    set_device(0);
    let id = unique_id();
    let seed: u64 = rand::random();
    let mut kid = spawn("leaves", 1, 2, &id, seed);
    let comm = init(2, id, 0);
    let s = stream();
    one_all_reduce(comm, s, 0, seed);
    wait_ok(&mut kid, Duration::from_secs(30));
    let (send, recv) = buffers(&[1.0; 64], 64);
    nck(all_reduce_sum(send, recv, 64, F32, comm, s));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        query(s),
        CUresult::CUDA_ERROR_NOT_READY,
        "blocked, as on GPUs"
    );
    assert_eq!(async_error(comm), ncclResult_t::ncclSuccess);
    let t = Instant::now();
    nck(abort(comm));
    assert_eq!(drained(s), CUresult::CUDA_SUCCESS);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "took {:?}",
        t.elapsed()
    );
    assert!(download::<u32>(recv, 64).iter().all(|&w| w == 0x7f7f_7f7f));
    destroy_stream(s);
    free(send);
    free(recv);
}

#[test]
fn faults_by_rank_from_the_environment_act_in_the_rank_process() {
    set_device(0);
    let id = unique_id();
    let seed: u64 = rand::random();
    let faults = [("METRALE_EMU_FAULTS", "1:async@1")];
    let mut kid = spawn_with("async_fault", 1, 2, &id, seed, &faults);
    let comm = init(2, id, 0);
    let s = stream();
    one_all_reduce(comm, s, 0, seed);
    wait_ok(&mut kid, Duration::from_secs(30));
    assert_eq!(
        async_error(comm),
        ncclResult_t::ncclSuccess,
        "rank 0 has no fault"
    );
    nck(abort(comm));
    destroy_stream(s);
}

#[test]
fn costs_by_rank_from_the_environment_act_in_the_rank_process() {
    set_device(0);
    let id = unique_id();
    let seed: u64 = rand::random();
    let costs = [(
        "METRALE_EMU_COSTS",
        "1:allreduce:eager=123456+0; *:allreduce:graph=1+0; 0:oneshot:*=5+5; junk",
    )];
    let mut kid = spawn_with("costs_env", 1, 2, &id, seed, &costs);
    let comm = init(2, id, 0);
    let s = stream();
    one_all_reduce(comm, s, 0, seed);
    wait_ok(&mut kid, Duration::from_secs(30));
    nck(destroy(comm));
    destroy_stream(s);
}

#[test]
fn an_id_whose_root_process_exited_fails_init_at_once() {
    set_device(0);
    let out = Command::new(std::env::current_exe().expect("current exe"))
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env(ROLE, "make_id:0:1")
        .env(ID, id_hex(&ncclUniqueId::default()))
        .env(SEED, "0")
        .output()
        .expect("running the id maker");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let at = text.find("ID=").expect("the id") + 3;
    let id = id_unhex(&text[at..at + 256]);
    let t = Instant::now();
    let mut c = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    let rc = unsafe { call!(nccl(), ncclCommInitRank(&mut c, 2, id, 1)) }.unwrap();
    assert_eq!(rc, ncclResult_t::ncclSystemError);
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    let text = last_error(std::ptr::null_mut());
    assert!(text.contains("cannot be reached"), "{text}");
    if !c.is_null() {
        nck(abort(c));
    }
}
