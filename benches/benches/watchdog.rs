//! The watchdog's cost per tick against the work in flight (criterion, on
//! the CPU emulator, any machine): a one-rank backend whose first operation
//! the emulator hangs, so every later submission stays in flight behind it;
//! one tick is timed with 10, 1000 and 10 000 operations in flight. The
//! watchdog asks only the oldest event of each stream, so the three should
//! cost the same.
//!
//! Invariants: the hang is injected after the backend is built (blocking
//! communicators run operations at init); the backend's own watchdog
//! thread ticks once a second (the
//! longest interval allowed), so the timed ticks run on this thread alone;
//! the collective timeout is longer than the run, so nothing is poisoned;
//! without the emulator library the bench prints one line and exits 0.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use metrale_comm::{BackendConfig, CommBackend, DeviceBuffer, NcclBackend, UniqueId};

fn in_flight(c: &mut Criterion) {
    let emu = match comm_suite::EmuControl::install() {
        Ok(emu) => emu,
        Err(e) => {
            println!("watchdog bench: skipped: {e}");
            return;
        }
    };
    let id = UniqueId::new().expect("unique id");
    let mut config = BackendConfig::new(0)
        .with_collective_timeout(Duration::from_secs(3600))
        .with_fast_path(metrale_comm::FastPathPolicy::Never);
    config.watchdog_interval = Duration::from_secs(1);
    let backend = NcclBackend::with_unique_id(config, &id, 0, 1).expect("backend");
    // From here on, rank 0's next operation never completes.
    emu.inject(0, comm_suite::emu::Fault::Hang, 1)
        .expect("fault injection");
    let mut buf = DeviceBuffer::<f32>::alloc(backend.context(), 16).expect("buffer");
    let mut group = c.benchmark_group("watchdog_tick");
    for target in [10usize, 1000, 10_000] {
        while backend.watched_for_bench() < target {
            backend.all_reduce(buf.view_mut()).expect("submission");
        }
        group.bench_with_input(BenchmarkId::new("in_flight", target), &target, |b, _| {
            b.iter(|| backend.watchdog_tick_for_bench())
        });
        let watched = backend.watched_for_bench();
        assert!(
            watched >= target,
            "{watched} in flight, expected {target}: the hang did not hold"
        );
        black_box(watched);
    }
    group.finish();
    // The hung operation never completes: abort rather than drain.
    std::mem::forget(buf);
    std::mem::forget(backend);
}

/// The criterion group (in a private module: the macro's function is
/// public and undocumented).
mod group {
    use super::*;
    criterion_group! {
        name = benches;
        config = Criterion::default()
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        targets = in_flight
    }
}
criterion_main!(group::benches);
