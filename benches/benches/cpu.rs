//! CPU benchmarks (criterion) of the host-side cost `NcclBackend` adds to
//! every submission and wait, runnable on any machine:
//!
//! - `submission/health_check+record`: what the submitting thread pays on
//!   every operation before NCCL is called: the backend's real health check
//!   (`metrale_comm::health::Health::check`) and a flight-recorder entry. The
//!   target is at most 100 ns median.
//! - `completion/set_state`: what the watchdog thread pays when it sees the
//!   operation complete (off the submitting thread).
//! - `refusal/poisoned`: the refusal of a poisoned backend (the real check,
//!   building and dropping `CommError::Poisoned` with the first failure).
//! - `wait/poll_complete` and `wait/poll_not_ready`: one iteration of the
//!   deadline poll loop against an already-complete condition, and one
//!   not-ready iteration (deadline check plus the first backoff step, a
//!   `yield_now`). The loop is private to `nccl_backend.rs`; these rebuild
//!   it from the same atomics; the driver's event query is not included.
//!
//! Invariant: measurement time is kept short (2 s per bench) so the whole
//! run takes well under a minute.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use metrale_comm::diagnostics::{FlightRecorder, OpState};
use metrale_comm::health::Health;
use metrale_comm::{CommError, Failure, FailureKind};

fn submission(c: &mut Criterion) {
    let health = Health::new();
    let recorder = FlightRecorder::new(4096);
    c.bench_function("submission/health_check+record", |b| {
        b.iter(|| {
            let ok = health.check(black_box("all_reduce"), 0, 2).is_ok();
            let seq = recorder.record(
                black_box("all_reduce"),
                "bf16",
                black_box(1 << 20),
                black_box(0x1234),
                None,
            );
            black_box((ok, seq))
        })
    });
    let last = recorder.last_seq();
    c.bench_function("completion/set_state", |b| {
        b.iter(|| recorder.set_state(black_box(last), OpState::Completed))
    });
    // The recorder really recorded: the last entry is there and complete.
    let entry = recorder.get(last).expect("last entry in the ring");
    assert_eq!(entry.state, OpState::Completed);
    assert_eq!(entry.bytes, 1 << 20);
}

fn refusal(c: &mut Criterion) {
    let health = Health::new();
    health.poison(|| Failure {
        op: "all_reduce",
        seq: 7,
        rank: 0,
        world_size: 2,
        generation: 0,
        kind: FailureKind::Timeout {
            after: Duration::from_secs(60),
        },
        backend: 1,
        elsewhere: Vec::new(),
        suspect: None,
    });
    c.bench_function("refusal/poisoned", |b| {
        b.iter(|| black_box(health.check(black_box("all_reduce"), 0, 2).is_err()))
    });
    assert!(matches!(
        health.check("all_gather", 0, 2),
        Err(CommError::Poisoned { cause, .. }) if cause.seq == 7
    ));
}

fn wait_poll(c: &mut Criterion) {
    let poisoned = AtomicBool::new(false);
    let shutdown = AtomicBool::new(false);
    let done = AtomicBool::new(true);
    let timeout = Duration::from_secs(60);
    c.bench_function("wait/poll_complete", |b| {
        b.iter(|| {
            let deadline = Instant::now() + timeout;
            loop {
                if poisoned.load(Ordering::Acquire) {
                    break false;
                }
                if done.load(Ordering::Acquire) {
                    break true;
                }
                if shutdown.load(Ordering::Acquire) || Instant::now() >= deadline {
                    break false;
                }
                std::thread::yield_now();
            }
        })
    });
    let pending = AtomicBool::new(false);
    c.bench_function("wait/poll_not_ready", |b| {
        let deadline = Instant::now() + timeout;
        b.iter(|| {
            let ready = pending.load(Ordering::Acquire);
            let expired = shutdown.load(Ordering::Acquire) || Instant::now() >= deadline;
            if !ready && !expired {
                std::thread::yield_now();
            }
            black_box((ready, expired))
        })
    });
}

fn config() -> Criterion {
    Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(50)
}

/// The criterion group (in a private module: the macro's function is
/// public and undocumented).
mod group {
    use super::*;
    criterion_group! {
        name = benches;
        config = config();
        targets = submission, refusal, wait_poll
    }
}
criterion_main!(group::benches);
