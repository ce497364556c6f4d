//! Failure: refusing work on an unusable backend, poisoning it with its
//! first failure, and the error each caller gets.
//!
//! Invariants:
//! - A refused call (bad arguments, seen by NCCL or the driver before
//!   anything is enqueued: [`is_refusal`]) never poisons; any other failure
//!   of an enqueue poisons with that submission's op and sequence number.
//! - Poisoning keeps the first failure (`Health`), and only the first sets
//!   the one-shot abort word, aborts the communicator (through the abort
//!   handle, without the slot lock) and dumps the flight recorder; a
//!   timeout's failure lists what the process's other backends have in
//!   flight (`census`), and names the rank that stopped answering where a
//!   census through the store shows it (`suspect`, bounded by
//!   [`CENSUS_WAIT`]); a store that fails mid-census names rank 0, its
//!   host, only where the census read no other census' verdict and no
//!   report of rank 0's (`judge_census`).
//! - Every later call is refused with the first failure: `Failed` for the
//!   submission that failed, `Poisoned` naming it for every other.
//!
//! Lock order: `abort` is taken alone (a leaf); the flight recorder's and
//! `Health`'s locks are leaves; the census lock is taken with no lock of
//! the backend held.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use nccl_safe::NcclCode;

use super::Inner;
use super::submission::Ticket;
use crate::backend::Result;
use crate::diagnostics::{DumpHeader, OpState};
use crate::error::{CommError, Failure, FailureKind, Suspect};

/// How long a timeout's census waits for the other ranks' reports.
const CENSUS_WAIT: Duration = Duration::from_millis(150);
/// How much longer the poisoning thread waits for the census' answer: a
/// store that answers, slowly (its process or the machine loaded), must
/// not read as a silent one, which would name rank 0. A frozen store ends
/// the census by its own wait (its connection and set are bounded by it),
/// a gone one at once, so this is spent only on a slow one; with
/// [`CENSUS_WAIT`] it keeps a timeout's error within 0.35 s of the timeout.
const CENSUS_SLACK: Duration = Duration::from_millis(200);

/// Errors NCCL or the driver return for the call's own arguments, before
/// anything is enqueued: they do not poison.
pub(super) fn is_refusal(e: &nccl_safe::Error) -> bool {
    match e {
        nccl_safe::Error::InvalidArgument { .. } | nccl_safe::Error::Load(_) => true,
        nccl_safe::Error::Nccl(n) => {
            matches!(n.code, NcclCode::InvalidArgument | NcclCode::InvalidUsage)
        }
        nccl_safe::Error::Cuda(c) => {
            c.code == cuda_sys::CUresult::CUDA_ERROR_INVALID_VALUE.0 as i32
        }
        _ => false,
    }
}

impl Inner {
    /// Refuses work when shut down, reconnecting or poisoned.
    #[inline]
    pub(super) fn check_usable(&self, op: &'static str) -> Result<()> {
        self.health.check(op, self.rank, self.world_size)
    }

    /// Poisons the backend with its first failure (later calls return the
    /// first), aborts the communicator, dumps the flight recorder.
    pub(super) fn poison(&self, op: &'static str, seq: u64, kind: FailureKind) -> Arc<Failure> {
        let state = if kind.is_timeout() {
            OpState::TimedOut
        } else {
            OpState::Failed
        };
        let elsewhere = if kind.is_timeout() && !self.health.is_poisoned() {
            self.census.in_flight_elsewhere()
        } else {
            Vec::new()
        };
        let suspect = if kind.is_timeout() && !self.health.is_poisoned() {
            self.suspect()
        } else {
            None
        };
        let (failure, first) = self.health.poison(|| Failure {
            op,
            seq,
            rank: self.rank,
            world_size: self.world_size,
            generation: self.generation.load(Ordering::Acquire),
            kind,
            backend: self.census.id(),
            elsewhere,
            suspect,
        });
        if !first {
            return failure;
        }
        self.recorder.set_state(seq, state);
        self.one_shot_flags.abort();
        if let Some(handle) = self.abort.lock().as_ref()
            && let Err(e) = handle.abort()
        {
            tracing::warn!(
                rank = self.rank,
                "aborting the poisoned communicator failed: {e}"
            );
        }
        tracing::error!(
            rank = self.rank,
            world_size = self.world_size,
            "communicator poisoned: {failure}\nrecent operations:\n{}",
            self.recorder.summary(16)
        );
        if let Some(dir) = &self.config.dump_dir {
            let header = DumpHeader {
                rank: self.rank,
                world_size: self.world_size,
                generation: failure.generation,
                reason: failure.to_string(),
                first_failed_seq: Some(seq),
            };
            match self.recorder.dump_json(dir, &header) {
                Ok(path) => tracing::error!(
                    rank = self.rank,
                    "flight recorder dumped to {}",
                    path.display()
                ),
                Err(e) => tracing::warn!(rank = self.rank, "flight recorder dump failed: {e}"),
            }
        }
        failure
    }

    /// Poisons for a failed call of `op`/`seq` and returns its error.
    pub(super) fn fail(&self, op: &'static str, seq: u64, e: nccl_safe::Error) -> CommError {
        CommError::Failed(self.poison(op, seq, FailureKind::from_call(e)))
    }

    /// The error for a submission whose communicator was aborted before the
    /// submission was seen complete: its buffers hold no result.
    pub(super) fn aborted(&self, op: &'static str, ticket: &Ticket) -> CommError {
        if self.health.is_poisoned() {
            return self.own_or_poisoned(op, ticket.seq);
        }
        if self.health.is_shutdown() {
            return CommError::Shutdown { op };
        }
        if self.health.is_reconnecting() {
            return CommError::Reconnecting { op };
        }
        CommError::Aborted {
            op,
            seq: ticket.seq,
            generation: ticket.generation,
        }
    }

    /// After a timeout: the rank that stopped answering, from a census of
    /// the ranks that report the same timeout through the store within
    /// [`CENSUS_WAIT`] (the census runs on a thread of its own, so a store
    /// that does not answer costs no more than that); [`judge_census`]
    /// reads its answer.
    fn suspect(&self) -> Option<Suspect> {
        let store = self.store.clone()?;
        let name = format!("timeout {}", self.generation.load(Ordering::Acquire));
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name(format!("metrale-census-r{}", self.rank))
            .spawn(move || {
                let _ = tx.send(store.census(&name, CENSUS_WAIT));
            });
        if spawned.is_err() {
            return None;
        }
        judge_census(
            self.rank,
            rx.recv_timeout(CENSUS_WAIT + CENSUS_SLACK)
                .map_err(|_| format!("did not answer within {CENSUS_WAIT:?}")),
        )
    }

    /// `Failed` when `seq` itself is the first failure, else `Poisoned`.
    pub(super) fn own_or_poisoned(&self, op: &'static str, seq: u64) -> CommError {
        match self.health.failure() {
            Some(f) if f.seq == seq => CommError::Failed(f),
            Some(cause) => CommError::Poisoned {
                op,
                rank: self.rank,
                world_size: self.world_size,
                cause,
            },
            None => CommError::Reconnecting { op },
        }
    }

    /// The oldest watched submission of this generation that has a deadline.
    pub(super) fn oldest_pending(&self) -> Option<(&'static str, u64)> {
        let generation = self.generation.load(Ordering::Acquire);
        self.watch.oldest_with_deadline(generation)
    }
}

/// The suspect a timeout's census names on rank `rank`: `answer` is the
/// census' result, or why the poisoning thread has none.
///
/// - A census that ended names the first rank that did not report.
/// - A census whose store failed after this rank reported
///   (`CensusCut`) keeps what it read: another census' verdict names the
///   first rank it missed that this census did not see either; else,
///   where rank 0 had reported the timeout (so it was answering when the
///   timeout struck), the first rank not seen. Either says that the store
///   went away during the census.
/// - Otherwise a store that failed or did not answer names rank 0, which
///   serves it (no suspect on rank 0 itself).
fn judge_census(
    rank: usize,
    answer: std::result::Result<
        std::result::Result<Vec<bool>, crate::rendezvous::RendezvousError>,
        String,
    >,
) -> Option<Suspect> {
    use crate::rendezvous::RendezvousError;
    let store_silent = |why: String| {
        (rank != 0).then(|| Suspect {
            rank: 0,
            evidence: format!("the store, which rank 0 serves, {why}"),
        })
    };
    match answer {
        Ok(Ok(arrived)) => {
            let missing = not_seen(&arrived, rank);
            let &first = missing.first()?;
            Some(Suspect {
                rank: first,
                evidence: format!(
                    "ranks {missing:?} did not report this timeout within {CENSUS_WAIT:?}"
                ),
            })
        }
        Ok(Err(RendezvousError::Unsupported(_))) => None,
        Ok(Err(RendezvousError::CensusCut { so_far, source, .. })) => {
            let arrived = &so_far.arrived;
            let seen = |r: usize| r == rank || arrived.get(r).copied().unwrap_or(false);
            if let Some(v) = &so_far.verdict {
                let missing: Vec<usize> = v.missing.iter().copied().filter(|&r| !seen(r)).collect();
                if let Some(&first) = missing.first() {
                    return Some(Suspect {
                        rank: first,
                        evidence: format!(
                            "rank {}'s census of this timeout did not see ranks {missing:?} \
                             report it within its wait (the store, which rank 0 serves, went \
                             away during this rank's census: {source})",
                            v.by
                        ),
                    });
                }
            }
            let missing = not_seen(arrived, rank);
            match missing.first() {
                Some(&first) if rank != 0 && seen(0) => Some(Suspect {
                    rank: first,
                    evidence: format!(
                        "ranks {missing:?} had not reported this timeout when the store, which \
                         rank 0 serves, went away during the census ({source}); rank 0 had \
                         reported it"
                    ),
                }),
                _ => store_silent(format!("failed the census: {source}")),
            }
        }
        Ok(Err(e)) => store_silent(format!("failed the census: {e}")),
        Err(why) => store_silent(why),
    }
}

/// The ranks `arrived` does not show, but for `rank` itself.
fn not_seen(arrived: &[bool], rank: usize) -> Vec<usize> {
    arrived
        .iter()
        .enumerate()
        .filter(|&(r, a)| !a && r != rank)
        .map(|(r, _)| r)
        .collect()
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;
    use crate::rendezvous::{CensusSoFar, CensusVerdict, RendezvousError};

    fn gone() -> RendezvousError {
        RendezvousError::StoreGone {
            addr: "127.0.0.1:29500".parse().expect("an address"),
            source: io::Error::from(io::ErrorKind::ConnectionRefused),
        }
    }

    fn cut(arrived: Vec<bool>, verdict: Option<CensusVerdict>) -> RendezvousError {
        RendezvousError::CensusCut {
            name: "timeout 0".to_owned(),
            so_far: CensusSoFar::new(arrived, verdict),
            source: Box::new(gone()),
        }
    }

    #[test]
    fn a_census_that_ended_names_the_first_rank_missing() {
        let s = judge_census(1, Ok(Ok(vec![true, true, false, false]))).expect("a suspect");
        assert_eq!(s.rank, 2);
        assert_eq!(judge_census(1, Ok(Ok(vec![true; 4]))), None);
    }

    /// Rank 0 published its verdict naming rank 3, then left with its
    /// store: the slower survivor names rank 3, and says the store went.
    #[test]
    fn a_verdict_read_before_the_store_went_names_its_rank() {
        let verdict = CensusVerdict::new(0, vec![3]);
        let s = judge_census(
            1,
            Ok(Err(cut(vec![false, true, false, false], Some(verdict)))),
        )
        .expect("a suspect");
        assert_eq!(s.rank, 3, "{}", s.evidence);
        assert!(s.evidence.contains("rank 0's census"), "{}", s.evidence);
        assert!(s.evidence.contains("went away"), "{}", s.evidence);
    }

    /// A verdict's ranks that this census saw report are not named.
    #[test]
    fn a_verdict_yields_to_what_this_census_saw() {
        let verdict = CensusVerdict::new(2, vec![1, 3]);
        let s = judge_census(
            0,
            Ok(Err(cut(vec![true, true, true, false], Some(verdict)))),
        )
        .expect("a suspect");
        assert_eq!(s.rank, 3);
    }

    /// Rank 0 had reported the timeout (its key was read) before the
    /// store went: the first rank not seen is named, not rank 0.
    #[test]
    fn rank_0_seen_reporting_is_not_blamed_for_its_store() {
        let s =
            judge_census(1, Ok(Err(cut(vec![true, true, true, false], None)))).expect("a suspect");
        assert_eq!(s.rank, 3, "{}", s.evidence);
        assert!(
            s.evidence.contains("rank 0 had reported it"),
            "{}",
            s.evidence
        );
    }

    /// A census that learned nothing before the store went blames rank 0,
    /// with the store's error, as before.
    #[test]
    fn a_census_that_learned_nothing_blames_rank_0() {
        let s = judge_census(2, Ok(Err(cut(vec![false, false, true, false], None))))
            .expect("a suspect");
        assert_eq!(s.rank, 0);
        assert!(
            s.evidence
                .starts_with("the store, which rank 0 serves, failed the census: "),
            "{}",
            s.evidence
        );
        let s = judge_census(2, Ok(Err(gone()))).expect("a suspect");
        assert_eq!(s.rank, 0);
        let s = judge_census(2, Err("did not answer within 150ms".to_owned())).expect("a suspect");
        assert_eq!(s.rank, 0);
        // Rank 0 names no one for its own store.
        assert_eq!(judge_census(0, Ok(Err(cut(vec![true, false], None)))), None);
        assert_eq!(
            judge_census(1, Ok(Err(RendezvousError::Unsupported(String::new())))),
            None
        );
    }
}
