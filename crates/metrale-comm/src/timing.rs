//! The timing method of the path tuner, usable on its own: a steady
//! stream of trials (each a run of eager calls, or one replay of a CUDA
//! graph holding them) enqueued back to back behind one warm-up trial,
//! with a device event recorded between each trial and the next; the
//! median interval between consecutive events, divided by the calls a
//! trial makes, is the time per call. The host waits once, at the end.
//!
//! This reads what a throughput benchmark (criterion's `iter_custom`
//! around a loop of calls) reads: where the host's launches are the
//! bottleneck (eager calls of small payloads) an interval is the host's
//! time to enqueue a trial, where the device is, it is the device's time
//! to run one; the only work added to a trial is one event record.
//! Waiting for the device between trials, or fencing each trial with
//! cross-stream events, would add their cost to every trial.
//!
//! The backend's tuner times each path with it at set-up; the
//! `one_shot_local` benchmark applies it to simulated ranks beside
//! criterion's own figures, to show the two agree.
//!
//! Invariants: the one host wait is bounded by the given timeout; the
//! events belong to the first stream's context and are recorded on the
//! first stream (with several streams, whose work advances together, as
//! the simulated ranks' kernels wait for each other, the first stream's
//! intervals are the calls' rate); before the host waits, every other
//! stream's work is joined to the first stream, so the wait covers it.

use std::sync::Arc;
use std::time::Duration;

use nccl_safe::{Context, Event, Stream};

/// How many trials and how many calls per trial a measurement makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trials {
    /// Trials whose median is taken (after one warm-up trial).
    pub trials: usize,
    /// Calls each trial makes (eager calls, or calls captured into the
    /// replayed graph).
    pub calls: usize,
}

impl Trials {
    /// The tuner's trials for a payload of `bytes`: five trials of 16
    /// calls up to 1 MiB, then three of 4 up to 8 MiB and three of 2
    /// above. A trial stays well above the events' resolution (about 0.5
    /// us) and long enough that what it adds to its calls (one event
    /// record; in graphs, one graph launch, which criterion's graphs of 20
    /// calls spread as thinly) is a small part of it; large calls vary
    /// little between trials.
    pub fn for_bytes(bytes: usize) -> Trials {
        match bytes {
            0..=1_048_576 => Trials {
                trials: 5,
                calls: 16,
            },
            1_048_577..=8_388_608 => Trials {
                trials: 3,
                calls: 4,
            },
            _ => Trials {
                trials: 3,
                calls: 2,
            },
        }
    }
}

/// Device time per call: `trial` enqueues one trial's work on `streams`
/// (the first stream carries the events). One warm-up trial, then
/// `trials.trials` trials back to back, an event recorded on the first
/// stream before each and after the last; the result is the median
/// interval between consecutive events divided by `trials.calls`. The
/// host waits once, for all of it, within `timeout`.
///
/// An error from `trial` or from the driver ends the measurement: work
/// already enqueued is the caller's to wait for.
pub fn time_per_call<E>(
    ctx: &Arc<Context>,
    streams: &[&Stream],
    trials: Trials,
    timeout: Duration,
    mut trial: impl FnMut() -> Result<(), E>,
) -> Result<Duration, E>
where
    E: From<nccl_safe::Error>,
{
    let Some((&first, others)) = streams.split_first() else {
        return Err(nccl_safe::Error::invalid("time_per_call", "no stream").into());
    };
    let marks: Vec<Event> = (0..=trials.trials)
        .map(|_| Event::new(ctx, true))
        .collect::<nccl_safe::Result<_>>()?;
    let joins: Vec<Event> = others
        .iter()
        .map(|_| Event::new(ctx, false))
        .collect::<nccl_safe::Result<_>>()?;
    let done = Event::new(ctx, false)?;
    // The warm-up trial keeps the device busy while the first mark is
    // enqueued behind it, so no interval starts on an idle device waiting
    // for the host.
    trial()?;
    for (i, mark) in marks.iter().enumerate() {
        mark.record(first)?;
        if i < trials.trials {
            trial()?;
        }
    }
    for (s, j) in others.iter().zip(&joins) {
        j.record(s)?;
        first.wait_event(j)?;
    }
    done.record(first)?;
    done.wait_with_deadline(timeout)?;
    let mut samples = Vec::with_capacity(trials.trials);
    for pair in marks.windows(2) {
        samples.push(f64::from(pair[1].elapsed_ms(&pair[0])?));
    }
    Ok(median_per_call(&mut samples, trials.calls))
}

/// The median of `samples_ms` (trial times in milliseconds) divided by
/// `calls`; zero for no samples.
fn median_per_call(samples_ms: &mut [f64], calls: usize) -> Duration {
    if samples_ms.is_empty() {
        return Duration::ZERO;
    }
    samples_ms.sort_by(f64::total_cmp);
    let n = samples_ms.len();
    let mid = if n % 2 == 1 {
        samples_ms[n / 2]
    } else {
        (samples_ms[n / 2 - 1] + samples_ms[n / 2]) / 2.0
    };
    Duration::from_secs_f64((mid.max(0.0) / 1e3) / calls.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_per_call() {
        let mut s = [3.0, 1.0, 2.0];
        assert_eq!(median_per_call(&mut s, 2), Duration::from_micros(1000));
        let mut s = [4.0, 1.0, 2.0, 3.0];
        assert_eq!(median_per_call(&mut s, 1), Duration::from_micros(2500));
        assert_eq!(median_per_call(&mut [], 4), Duration::ZERO);
    }

    #[test]
    fn trials_shrink_with_size() {
        assert_eq!(Trials::for_bytes(8).calls, 16);
        assert_eq!(Trials::for_bytes(1 << 20).calls, 16);
        assert_eq!(Trials::for_bytes(8 << 20).calls, 4);
        assert_eq!(Trials::for_bytes(32 << 20).calls, 2);
    }
}
