//! The timing method of the path tuner, usable on its own: device events
//! around one trial's work (a run of eager calls, or one replay of a CUDA
//! graph holding them), each trial enqueued right behind an unmeasured
//! lead-in trial (so the device never idles inside the measurement
//! waiting for the host's launch, as it does not in a steady stream of
//! calls), one warm-up trial, then the median over the trials, divided by
//! the calls a trial makes.
//!
//! The backend's tuner times each path with it at set-up; the
//! `one_shot_local` benchmark applies it to simulated ranks beside
//! criterion's own figures, to show the two agree.
//!
//! Invariants: every host wait is bounded by the given timeout; the events
//! belong to the first stream's context; work on the other streams is
//! ordered after the start event and before the end event (each waits for
//! the start, and the first stream waits for each one's end), so a trial
//! spans every stream's work.

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
    /// The tuner's trials for a payload of `bytes`: five trials of 8 calls
    /// up to 64 KiB, five of 4 up to 1 MiB, then three of 2 up to 8 MiB
    /// and three of 1 above (a trial always well above the events'
    /// resolution of about 0.5 us; large calls vary little between
    /// trials).
    pub fn for_bytes(bytes: usize) -> Trials {
        match bytes {
            0..=65_536 => Trials {
                trials: 5,
                calls: 8,
            },
            65_537..=1_048_576 => Trials {
                trials: 5,
                calls: 4,
            },
            1_048_577..=8_388_608 => Trials {
                trials: 3,
                calls: 2,
            },
            _ => Trials {
                trials: 3,
                calls: 1,
            },
        }
    }
}

/// Device time per call: `trial` enqueues one trial's work on `streams`
/// (the first stream carries the events); each measured trial follows an
/// unmeasured lead-in trial with no host wait between them; the first
/// pair warms up, then `trials.trials` pairs are measured between a start
/// and an end event; the result is the median trial divided by
/// `trials.calls`. Each trial's events are
/// waited for within `timeout`.
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
    let start = Event::new(ctx, true)?;
    let end = Event::new(ctx, true)?;
    let joins: Vec<Event> = others
        .iter()
        .map(|_| Event::new(ctx, false))
        .collect::<nccl_safe::Result<_>>()?;
    let mut samples = Vec::with_capacity(trials.trials);
    for i in 0..=trials.trials {
        // A lead-in trial keeps the device busy while the measured one is
        // enqueued, so the start event runs when the measured work is
        // already queued behind it: a trial's time is its work's, not the
        // host's launch latency (which a steady stream of calls hides).
        trial()?;
        start.record(first)?;
        for s in others {
            s.wait_event(&start)?;
        }
        trial()?;
        for (s, j) in others.iter().zip(&joins) {
            j.record(s)?;
            first.wait_event(j)?;
        }
        end.record(first)?;
        end.wait_with_deadline(timeout)?;
        if i > 0 {
            samples.push(f64::from(end.elapsed_ms(&start)?));
        }
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
        assert_eq!(Trials::for_bytes(8).calls, 8);
        assert_eq!(Trials::for_bytes(1 << 20).calls, 4);
        assert_eq!(Trials::for_bytes(8 << 20).calls, 2);
        assert_eq!(Trials::for_bytes(32 << 20).calls, 1);
    }
}
