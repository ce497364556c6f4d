//! The health state of a backend: poisoned (with its first failure), shut
//! down, or reconnecting; and the check every call makes against it.
//!
//! Invariants: the first failure wins (`poison` keeps it until `clear`);
//! `check` reads three atomics on the healthy path and takes no lock, so it
//! costs a few nanoseconds on every submission; a refused call never reaches
//! NCCL. Public so that benchmarks measure the real check.
//!
//! Lock order: the one lock (`failure`) is a leaf, held to read, set or
//! clear the first failure. `poison`'s closure runs under it, so it builds
//! the failure from what the caller already holds and takes no lock
//! (`NcclBackend` asks the census before it poisons).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::error::{CommError, Failure};

/// See the module docs.
#[derive(Debug, Default)]
pub struct Health {
    poisoned: AtomicBool,
    failure: Mutex<Option<Arc<Failure>>>,
    shutdown: AtomicBool,
    reconnecting: AtomicBool,
}

impl Health {
    /// A healthy state.
    pub fn new() -> Health {
        Health::default()
    }

    /// The check every call makes: `Poisoned` (with the first failure),
    /// `Shutdown` or `Reconnecting`, else `Ok`.
    #[inline]
    pub fn check(&self, op: &'static str, rank: usize, world_size: usize) -> Result<(), CommError> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(self.poisoned_error(op, rank, world_size));
        }
        if self.shutdown.load(Ordering::Acquire) {
            return Err(CommError::Shutdown { op });
        }
        if self.reconnecting.load(Ordering::Acquire) {
            return Err(CommError::Reconnecting { op });
        }
        Ok(())
    }

    /// The error refusing `op` on a poisoned backend.
    pub fn poisoned_error(&self, op: &'static str, rank: usize, world_size: usize) -> CommError {
        match self.failure.lock().clone() {
            Some(cause) => CommError::Poisoned {
                op,
                rank,
                world_size,
                cause,
            },
            None => CommError::Reconnecting { op },
        }
    }

    /// Poisons with `failure` unless already poisoned; returns the first
    /// failure and whether it is this one.
    pub fn poison(&self, failure: impl FnOnce() -> Failure) -> (Arc<Failure>, bool) {
        let mut slot = self.failure.lock();
        if let Some(first) = &*slot {
            return (first.clone(), false);
        }
        let f = Arc::new(failure());
        *slot = Some(f.clone());
        self.poisoned.store(true, Ordering::Release);
        (f, true)
    }

    /// Clears the poison (after a reconnect).
    pub fn clear(&self) {
        let mut slot = self.failure.lock();
        *slot = None;
        self.poisoned.store(false, Ordering::Release);
    }

    /// The first failure, if poisoned.
    pub fn failure(&self) -> Option<Arc<Failure>> {
        self.failure.lock().clone()
    }

    /// True once poisoned (until cleared).
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// True once shut down.
    pub fn is_shutdown(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    /// Marks the backend shut down; true for the first call.
    pub fn begin_shutdown(&self) -> bool {
        !self.shutdown.swap(true, Ordering::AcqRel)
    }

    /// Marks a reconnect under way; false when one already is.
    pub fn begin_reconnect(&self) -> bool {
        !self.reconnecting.swap(true, Ordering::AcqRel)
    }

    /// True while a reconnect is under way.
    pub fn is_reconnecting(&self) -> bool {
        self.reconnecting.load(Ordering::Acquire)
    }

    /// Marks the reconnect finished.
    pub fn end_reconnect(&self) {
        self.reconnecting.store(false, Ordering::Release);
    }

    /// Neither poisoned, shut down nor reconnecting.
    pub fn is_healthy(&self) -> bool {
        !(self.is_poisoned() || self.is_shutdown() || self.reconnecting.load(Ordering::Acquire))
    }
}
