//! Fault injection through the emulator's control API: a hang released by
//! abort (peers stay blocked until they abort), an asynchronous error after
//! a correct result, a crashed rank, and a rank that never joins init.
//!
//! Faults are process-wide and keyed by rank, so these tests run one at a
//! time under a lock and reset the faults first.

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;
use cuda_sys::{CUresult, CUstream};
use nccl_sys::{call, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclResult_t};

static SERIAL: Mutex<()> = Mutex::new(());

/// Handles that may cross threads (the test owns them).
#[derive(Clone, Copy)]
struct Rank {
    comm: usize,
    stream: usize,
    send: u64,
    recv: u64,
}

impl Rank {
    fn comm(self) -> ncclComm_t {
        self.comm as ncclComm_t
    }
    fn stream(self) -> CUstream {
        self.stream as CUstream
    }
}

const N: usize = 512;

/// Inits `n` ranks (one thread each) and returns their handles.
fn setup(n: usize) -> Vec<Rank> {
    let id = unique_id();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                s.spawn(move || {
                    set_device(r as i32);
                    let comm = init(n as i32, id, r as i32);
                    let (send, recv) = (alloc(4 * N), alloc(4 * N));
                    Rank {
                        comm: comm as usize,
                        stream: stream() as usize,
                        send,
                        recv,
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Uploads `data` and enqueues an f32 sum all-reduce for rank `r`.
fn all_reduce(r: Rank, data: &[f32]) {
    upload(r.send, data);
    poison(r.recv, 4 * N);
    nck(all_reduce_sum(
        r.send,
        r.recv,
        N,
        ncclDataType_t::ncclFloat32,
        r.comm(),
        r.stream(),
    ));
}

fn wait_ready(s: CUstream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if query(s) == CUresult::CUDA_SUCCESS {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

fn cleanup(ranks: &[Rank]) {
    for r in ranks {
        free(r.send);
        free(r.recv);
        destroy_stream(r.stream());
    }
}

#[test]
fn injected_hang_is_released_by_abort() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    reset();
    set_device(0);
    assert_eq!(inject(0, 1, 1), 0);
    assert_eq!(inject(0, 9, 1), -1, "unknown fault");
    let ranks = setup(2);
    let data: Vec<Vec<f32>> = (0..2).map(|_| random_f32(N)).collect();
    for (r, d) in ranks.iter().zip(&data) {
        all_reduce(*r, d);
    }
    std::thread::sleep(Duration::from_millis(100));
    for r in &ranks {
        assert_eq!(query(r.stream()), CUresult::CUDA_ERROR_NOT_READY);
    }
    let t = Instant::now();
    nck(abort(ranks[0].comm()));
    assert!(
        wait_ready(ranks[0].stream(), Duration::from_millis(500)),
        "hung rank released"
    );
    assert!(t.elapsed() < Duration::from_millis(500));
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        query(ranks[1].stream()),
        CUresult::CUDA_ERROR_NOT_READY,
        "the peer stays blocked"
    );
    assert_eq!(
        download::<u32>(ranks[1].recv, N),
        vec![0x7F7F_7F7F; N],
        "nothing written"
    );
    nck(abort(ranks[1].comm()));
    assert!(wait_ready(ranks[1].stream(), Duration::from_millis(500)));
    assert_eq!(
        abort(ranks[1].comm()),
        ncclResult_t::ncclInvalidUsage,
        "already aborted"
    );
    cleanup(&ranks);
}

#[test]
fn injected_async_error_follows_a_correct_result() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    reset();
    set_device(0);
    assert_eq!(inject(1, 2, 2), 0);
    let ranks = setup(2);
    for round in 1..=2 {
        let data: Vec<Vec<f32>> = (0..2).map(|_| random_f32(N)).collect();
        for (r, d) in ranks.iter().zip(&data) {
            all_reduce(*r, d);
        }
        for (i, r) in ranks.iter().enumerate() {
            sync(r.stream());
            let got = download::<f32>(r.recv, N);
            for j in 0..N {
                assert_eq!(
                    got[j],
                    data[0][j] + data[1][j],
                    "round {round} rank {i} element {j}"
                );
            }
        }
        let want = if round == 2 {
            ncclResult_t::ncclSystemError
        } else {
            ncclResult_t::ncclSuccess
        };
        assert_eq!(async_error(ranks[1].comm()), want, "round {round}");
        assert_eq!(async_error(ranks[0].comm()), ncclResult_t::ncclSuccess);
    }
    let text = last_error(ranks[1].comm());
    assert!(text.contains("injected asynchronous error"), "{text}");
    for r in &ranks {
        nck(abort(r.comm()));
    }
    cleanup(&ranks);
}

#[test]
fn a_dead_rank_fails_every_later_call() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    reset();
    set_device(0);
    assert_eq!(inject(1, 5, 1), 0);
    let ranks = setup(2);
    let data: Vec<Vec<f32>> = (0..2).map(|_| random_f32(N)).collect();
    for (r, d) in ranks.iter().zip(&data) {
        all_reduce(*r, d);
    }
    let mut e = ncclResult_t::ncclSuccess;
    // SAFETY: valid out-parameter.
    let r = unsafe { call!(nccl(), ncclCommGetAsyncError(ranks[1].comm(), &mut e)) }.unwrap();
    assert_eq!(r, ncclResult_t::ncclSystemError);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(query(ranks[0].stream()), CUresult::CUDA_ERROR_NOT_READY);
    assert_eq!(query(ranks[1].stream()), CUresult::CUDA_ERROR_NOT_READY);
    for r in &ranks {
        nck(abort(r.comm()));
        assert!(wait_ready(r.stream(), Duration::from_millis(500)));
    }
    cleanup(&ranks);
}

#[test]
fn a_rank_that_never_joins_keeps_init_pending() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    reset();
    assert_eq!(inject(1, 4, 0), 0);
    assert_eq!(inject(0, 3, 0), 0);
    let id = unique_id();
    set_device(0);
    let mut c: ncclComm_t = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    let r = unsafe { call!(nccl(), ncclCommInitRank(&mut c, 2, id, 0)) }.unwrap();
    assert_eq!(r, ncclResult_t::ncclSystemError, "injected init failure");
    let comms: Vec<usize> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(move || {
                    set_device(r);
                    let mut cfg = ncclConfig_t {
                        size: size_of::<ncclConfig_t>(),
                        magic: 0xcafe_beef,
                        version: 22803,
                        blocking: 0,
                        ..Default::default()
                    };
                    let mut c: ncclComm_t = std::ptr::null_mut();
                    // SAFETY: valid out-parameter and config.
                    let res = unsafe {
                        call!(nccl(), ncclCommInitRankConfig(&mut c, 2, id, r, &mut cfg))
                    }
                    .unwrap();
                    assert_eq!(res, ncclResult_t::ncclInProgress);
                    c as usize
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    std::thread::sleep(Duration::from_millis(80));
    for c in &comms {
        assert_eq!(async_error(*c as ncclComm_t), ncclResult_t::ncclInProgress);
    }
    for c in &comms {
        let t = Instant::now();
        nck(abort(*c as ncclComm_t));
        assert!(t.elapsed() < Duration::from_millis(200));
    }
}
