//! Turn taking for scenarios in which several threads of one rank share one
//! backend: every call gets a global turn number, the same on every rank,
//! so the threads interleave differently from run to run but every rank
//! issues the identical sequence of calls.
//!
//! Invariants: turn `i` starts only after turns `0..i` of this rank have
//! finished; every wait has a deadline; once stopped, every waiting thread
//! returns at once with an error.

use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// The turn counter of one rank.
#[derive(Debug, Default)]
pub struct Turns {
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct State {
    next: usize,
    stopped: bool,
}

impl Turns {
    /// A counter at turn 0.
    pub fn new() -> Turns {
        Turns::default()
    }

    /// Waits until turn `i` is next, at most until `deadline`.
    pub fn wait(&self, i: usize, deadline: Instant) -> anyhow::Result<()> {
        let mut st = self.state.lock();
        loop {
            if st.stopped {
                anyhow::bail!("turn {i}: the turns were stopped (at turn {})", st.next);
            }
            if st.next == i {
                return Ok(());
            }
            anyhow::ensure!(
                st.next < i,
                "turn {i} was skipped (the counter is at {})",
                st.next
            );
            if self.cv.wait_until(&mut st, deadline).timed_out() && st.next != i {
                anyhow::bail!(
                    "turn {i}: still waiting at the deadline; turn {} has not finished",
                    st.next
                );
            }
        }
    }

    /// Ends turn `i`: turn `i + 1` may start.
    pub fn done(&self, i: usize) {
        let mut st = self.state.lock();
        if st.next == i {
            st.next = i + 1;
        }
        self.cv.notify_all();
    }

    /// Makes every present and future wait return an error.
    pub fn stop(&self) {
        self.state.lock().stopped = true;
        self.cv.notify_all();
    }

    /// The turn that runs now or next.
    pub fn current(&self) -> usize {
        self.state.lock().next
    }
}
