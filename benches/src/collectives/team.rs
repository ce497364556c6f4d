//! Ranks as threads of one process: rank 0 on the caller's thread, which
//! drives criterion, and one worker thread per other rank, which runs
//! exactly the iterations rank 0 asks for.
//!
//! The protocol: rank 0 sends every worker `Run(case, iters)` over its
//! channel, runs the same itself, and collects one reply per worker. Inside
//! a run, every rank meets the others at [`Meet`] right before its timed
//! work, so all start together.
//!
//! Invariants:
//! - Every wait has a deadline: a worker waits [`IDLE`] for its next command,
//!   the meeting waits [`WAIT`], a run's GPU work and rank 0's wait for the
//!   replies wait [`run_deadline`]; a miss is an error, never a hang.
//! - A rank that fails breaks the meeting, so the others fail at once
//!   instead of entering a collective that can never complete, and a rank
//!   already waiting for its GPU stops waiting when the meeting is broken
//!   (it polls [`Meet::is_broken`]).
//! - A failed run is fatal: rank 0 aborts every raw communicator it was
//!   given ([`Team::abort`]) and the process exits; the backends' own
//!   watchdogs bound their operations.
//! - A worker stops when told, when rank 0 goes away (its channel closes),
//!   or at [`IDLE`]; it then shuts its objects down (bounded).

use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use nccl_safe::AbortHandle;
use parking_lot::{Condvar, Mutex};

use super::plan::Case;

/// How long a rank waits at the meeting, and the base of every run's
/// deadline.
pub const WAIT: Duration = Duration::from_secs(120);

/// How long a worker waits for rank 0's next command (criterion analyses
/// and reports between two runs).
pub const IDLE: Duration = Duration::from_secs(600);

/// The deadline of one run of `iters` operations: [`WAIT`] plus 10 ms per
/// operation, above any size's time per operation on the GPUs.
pub fn run_deadline(iters: u64) -> Duration {
    WAIT + Duration::from_millis(10) * u32::try_from(iters).unwrap_or(u32::MAX)
}

/// A barrier of all ranks with a deadline, which a failing rank breaks.
pub struct Meet {
    parties: usize,
    /// (arrived, round, broken)
    state: Mutex<(usize, u64, bool)>,
    cv: Condvar,
}

impl Meet {
    /// A barrier of `parties` ranks.
    pub fn new(parties: usize) -> Meet {
        Meet {
            parties,
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        }
    }

    /// Returns once every rank has arrived; an error when the barrier is
    /// broken or [`WAIT`] passes (which breaks it for the others).
    pub fn wait(&self) -> anyhow::Result<()> {
        let mut s = self.state.lock();
        if s.2 {
            bail!("another rank failed");
        }
        let round = s.1;
        s.0 += 1;
        if s.0 == self.parties {
            s.0 = 0;
            s.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + WAIT;
        while s.1 == round && !s.2 {
            if self.cv.wait_until(&mut s, deadline).timed_out() {
                s.2 = true;
                self.cv.notify_all();
                bail!("the other ranks did not arrive within {WAIT:?}");
            }
        }
        // The round completed, even if a rank failed right after it (this
        // waiter woke late): the meeting itself succeeded.
        if s.1 != round {
            return Ok(());
        }
        bail!("another rank failed");
    }

    /// Breaks the barrier: every present and later wait fails.
    pub fn fail(&self) {
        self.state.lock().2 = true;
        self.cv.notify_all();
    }

    /// Whether a rank has failed.
    pub fn is_broken(&self) -> bool {
        self.state.lock().2
    }
}

/// What one rank does: implemented by the GPU rank, and by test doubles.
pub trait Member: Send + 'static {
    /// Runs `iters` operations of `case` (after meeting the others) and
    /// returns their time.
    fn run(&mut self, case: &Case, iters: u64, meet: &Meet) -> anyhow::Result<Duration>;

    /// The raw communicator's abort handle, for [`Team::abort`].
    fn abort_handle(&self) -> Option<AbortHandle>;

    /// Releases the rank's objects (bounded).
    fn shutdown(self);
}

enum Cmd {
    Run(Case, u64),
    Stop,
}

enum Reply {
    /// Set up; the raw communicator's abort handle.
    Ready(Option<AbortHandle>),
    /// A run's time, or why it failed.
    Ran(Result<Duration, String>),
}

struct Worker {
    rank: usize,
    tx: Sender<Cmd>,
    rx: Receiver<Reply>,
    thread: std::thread::JoinHandle<()>,
}

/// Rank 0's view of all ranks.
pub struct Team<M: Member> {
    rank0: Option<M>,
    workers: Vec<Worker>,
    meet: Arc<Meet>,
    aborts: Vec<AbortHandle>,
}

impl<M: Member> Team<M> {
    /// Builds every rank at once: `make(rank)` on a worker thread for ranks
    /// 1.., and on this thread for rank 0; waits (bounded by `setup`) for
    /// every rank to be ready.
    pub fn start(
        world: usize,
        setup: Duration,
        make: impl Fn(usize) -> anyhow::Result<M> + Send + Sync + Clone + 'static,
    ) -> anyhow::Result<Team<M>> {
        let meet = Arc::new(Meet::new(world.max(1)));
        let mut workers = Vec::new();
        for rank in 1..world {
            let (tx, cmd_rx) = mpsc::channel::<Cmd>();
            let (reply_tx, rx) = mpsc::channel::<Reply>();
            let (make, meet) = (make.clone(), Arc::clone(&meet));
            let thread = std::thread::Builder::new()
                .name(format!("bench-rank-{rank}"))
                .spawn(move || worker(rank, make, &meet, &cmd_rx, &reply_tx))
                .context("spawning a rank thread")?;
            workers.push(Worker {
                rank,
                tx,
                rx,
                thread,
            });
        }
        let rank0 = make(0).context("rank 0");
        if rank0.is_err() {
            meet.fail();
        }
        let mut aborts: Vec<AbortHandle> = Vec::new();
        let mut errors = Vec::new();
        let deadline = Instant::now() + setup;
        for w in &workers {
            let left = deadline.saturating_duration_since(Instant::now());
            match w.rx.recv_timeout(left) {
                Ok(Reply::Ready(handle)) => aborts.extend(handle),
                Ok(Reply::Ran(Err(e))) => errors.push(format!("rank {}: {e}", w.rank)),
                Ok(Reply::Ran(Ok(_))) => errors.push(format!("rank {}: out of turn", w.rank)),
                Err(_) => errors.push(format!("rank {}: not ready within {setup:?}", w.rank)),
            }
        }
        let rank0 = match rank0 {
            Ok(r) if errors.is_empty() => r,
            Ok(r) => {
                meet.fail();
                r.shutdown();
                bail!("{}", errors.join("; "));
            }
            Err(e) => {
                errors.insert(0, format!("{e:#}"));
                bail!("{}", errors.join("; "));
            }
        };
        aborts.extend(rank0.abort_handle());
        Ok(Team {
            rank0: Some(rank0),
            workers,
            meet,
            aborts,
        })
    }

    /// Rank 0 (built on this thread), until the team stops.
    pub fn rank0(&self) -> Option<&M> {
        self.rank0.as_ref()
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `iters` operations of `case` on every rank; rank 0's time.
    pub fn time(&mut self, case: &Case, iters: u64) -> anyhow::Result<Duration> {
        for w in &self.workers {
            w.tx.send(Cmd::Run(*case, iters))
                .map_err(|_| anyhow!("rank {} has stopped", w.rank))?;
        }
        let rank0 = self.rank0.as_mut().context("the team has stopped")?;
        let mine = rank0.run(case, iters, &self.meet);
        if mine.is_err() {
            self.meet.fail();
        }
        let deadline = Instant::now() + run_deadline(iters) + Duration::from_secs(30);
        let mut errors = Vec::new();
        for w in &self.workers {
            let left = deadline.saturating_duration_since(Instant::now());
            match w.rx.recv_timeout(left) {
                Ok(Reply::Ran(Ok(_))) => {}
                Ok(Reply::Ran(Err(e))) => errors.push(format!("rank {}: {e}", w.rank)),
                Ok(Reply::Ready(_)) => errors.push(format!("rank {}: out of turn", w.rank)),
                Err(RecvTimeoutError::Timeout) => {
                    self.meet.fail();
                    errors.push(format!("rank {}: no reply within the deadline", w.rank))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    errors.push(format!("rank {}: stopped", w.rank))
                }
            }
        }
        match mine {
            Ok(d) if errors.is_empty() => Ok(d),
            Ok(_) => bail!("{case:?}: {}", errors.join("; ")),
            Err(e) => {
                errors.insert(0, format!("rank 0: {e:#}"));
                bail!("{case:?}: {}", errors.join("; "))
            }
        }
    }

    /// Aborts every rank's raw communicator (for a fatal error: the process
    /// exits next).
    pub fn abort(&self) {
        self.meet.fail();
        for a in &self.aborts {
            if let Err(e) = a.abort() {
                tracing::warn!("aborting a communicator: {e}");
            }
        }
    }

    /// Stops the workers and shuts every rank down, waiting at most
    /// `deadline` for the workers.
    pub fn stop(mut self, deadline: Duration) -> anyhow::Result<()> {
        for w in &self.workers {
            let _ = w.tx.send(Cmd::Stop);
        }
        if let Some(r) = self.rank0.take() {
            r.shutdown();
        }
        let end = Instant::now() + deadline;
        for w in std::mem::take(&mut self.workers) {
            while !w.thread.is_finished() {
                if Instant::now() >= end {
                    bail!("rank {} did not stop within {deadline:?}", w.rank);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            w.thread
                .join()
                .map_err(|_| anyhow!("rank {} panicked", w.rank))?;
        }
        Ok(())
    }
}

fn worker<M: Member>(
    rank: usize,
    make: impl Fn(usize) -> anyhow::Result<M>,
    meet: &Meet,
    cmds: &Receiver<Cmd>,
    replies: &Sender<Reply>,
) {
    let mut member = match make(rank) {
        Ok(m) => {
            let _ = replies.send(Reply::Ready(m.abort_handle()));
            m
        }
        Err(e) => {
            meet.fail();
            let _ = replies.send(Reply::Ran(Err(format!("{e:#}"))));
            return;
        }
    };
    loop {
        match cmds.recv_timeout(IDLE) {
            Ok(Cmd::Run(case, iters)) => {
                let r = member.run(&case, iters, meet);
                let failed = r.is_err();
                if failed {
                    meet.fail();
                }
                let _ = replies.send(Reply::Ran(r.map_err(|e| format!("{e:#}"))));
                if failed {
                    break;
                }
            }
            Ok(Cmd::Stop) | Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {
                tracing::warn!(rank, "no command within {IDLE:?}; stopping");
                meet.fail();
                break;
            }
        }
    }
    member.shutdown();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::plan::{Impl, Mode, Op};

    /// A rank without a GPU: meets the others, then "waits for its GPU"
    /// until `hang_at`'s run is given up (another rank failed), or fails
    /// before the meeting at `fail_at`.
    struct Fake {
        rank: usize,
        fail_at: Option<(usize, u64)>,
        hang_at: Option<(usize, u64)>,
        after_meet_fail: Option<(usize, u64)>,
    }

    impl Member for Fake {
        fn run(&mut self, _: &Case, iters: u64, meet: &Meet) -> anyhow::Result<Duration> {
            if self.fail_at == Some((self.rank, iters)) {
                bail!("injected failure");
            }
            meet.wait()?;
            if self.after_meet_fail == Some((self.rank, iters)) {
                bail!("failed inside the collective");
            }
            if self.hang_at == Some((self.rank, iters)) {
                let end = Instant::now() + Duration::from_secs(20);
                while !meet.is_broken() {
                    assert!(Instant::now() < end, "rank {} left waiting", self.rank);
                    std::thread::sleep(Duration::from_millis(1));
                }
                bail!("gave up: another rank failed");
            }
            Ok(Duration::from_micros(iters * (self.rank as u64 + 1)))
        }

        fn abort_handle(&self) -> Option<AbortHandle> {
            None
        }

        fn shutdown(self) {}
    }

    fn case() -> Case {
        Case {
            op: Op::AllReduce,
            mode: Mode::Eager,
            imp: Impl::Raw,
            shape: Op::AllReduce.shape(8, 1).unwrap(),
        }
    }

    fn team(
        world: usize,
        fail_at: Option<(usize, u64)>,
        hang_at: Option<(usize, u64)>,
        after_meet_fail: Option<(usize, u64)>,
    ) -> Team<Fake> {
        Team::start(world, Duration::from_secs(5), move |rank| {
            Ok(Fake {
                rank,
                fail_at,
                hang_at,
                after_meet_fail,
            })
        })
        .unwrap()
    }

    #[test]
    fn every_rank_runs_what_rank_0_asks_and_rank_0_reports_its_time() {
        let mut t = team(3, None, None, None);
        assert_eq!(t.world(), 3);
        for iters in [1, 2, 4, 1000] {
            assert_eq!(
                t.time(&case(), iters).unwrap(),
                Duration::from_micros(iters)
            );
        }
        t.stop(Duration::from_secs(5)).unwrap();
        let mut one = team(1, None, None, None);
        assert_eq!(one.time(&case(), 5).unwrap(), Duration::from_micros(5));
        one.stop(Duration::from_secs(1)).unwrap();
    }

    #[test]
    fn a_worker_failing_before_the_meeting_fails_the_run_at_once() {
        let mut t = team(3, Some((2, 7)), Some((1, 7)), None);
        let start = Instant::now();
        let e = t.time(&case(), 7).unwrap_err().to_string();
        assert!(e.contains("rank 2: injected failure"), "{e}");
        assert!(e.contains("rank 0: another rank failed"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(10));
        // The failed worker has stopped; the next run says so.
        assert!(t.time(&case(), 1).is_err());
        // Rank 1 stopped too (its run failed), so stop does not wait.
        t.stop(Duration::from_secs(5)).unwrap();
    }

    #[test]
    fn rank_0_failing_inside_a_run_releases_a_rank_waiting_for_its_gpu() {
        let mut t = team(2, None, Some((1, 3)), Some((0, 3)));
        let e = t.time(&case(), 3).unwrap_err().to_string();
        assert!(e.contains("rank 0: failed inside the collective"), "{e}");
        assert!(e.contains("rank 1: gave up"), "{e}");
        t.stop(Duration::from_secs(5)).unwrap();
    }

    #[test]
    fn a_failed_setup_is_reported_and_no_rank_waits() {
        let r = Team::start(3, Duration::from_secs(5), |rank| {
            if rank == 1 {
                bail!("no such GPU");
            }
            Ok(Fake {
                rank,
                fail_at: None,
                hang_at: None,
                after_meet_fail: None,
            })
        });
        let e = r.err().unwrap().to_string();
        assert!(e.contains("rank 1: no such GPU"), "{e}");
    }

    #[test]
    fn a_worker_stops_when_rank_0_goes_away() {
        let mut t = team(2, None, None, None);
        let w = t.workers.pop().unwrap();
        drop(t);
        // Rank 0's end of the channel closes: the worker's wait ends.
        drop(w.tx);
        let end = Instant::now() + Duration::from_secs(5);
        while !w.thread.is_finished() {
            assert!(Instant::now() < end, "the worker still waits");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
