//! A rendezvous that is only a unique id the caller distributed itself (the
//! engine's own control plane, a config file): no store, no network.
//!
//! Invariant: it can agree on generation 0 only; a reconnect needs a fresh id
//! that all ranks learn, which this rendezvous cannot provide, so later
//! generations and barriers are refused with `RendezvousError::BadSpec`,
//! and groups with `RendezvousError::Unsupported`.

use std::time::Duration;

use super::{ID_LEN, Rendezvous, RendezvousError, check_rank};

/// See the module docs.
#[derive(Clone)]
pub struct FixedIdRendezvous {
    rank: usize,
    world_size: usize,
    id: [u8; ID_LEN],
}

impl std::fmt::Debug for FixedIdRendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FixedIdRendezvous")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

impl FixedIdRendezvous {
    /// Rank `rank` of `world_size`, all ranks holding the same `id` (the
    /// bytes of an NCCL unique id that rank 0 created).
    pub fn new(rank: usize, world_size: usize, id: [u8; ID_LEN]) -> Result<Self, RendezvousError> {
        check_rank(rank, world_size)?;
        Ok(Self {
            rank,
            world_size,
            id,
        })
    }
}

impl Rendezvous for FixedIdRendezvous {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn exchange_id(
        &self,
        generation: u64,
        _make: &mut dyn FnMut() -> Result<[u8; ID_LEN], String>,
        _timeout: Duration,
    ) -> Result<[u8; ID_LEN], RendezvousError> {
        if generation == 0 {
            Ok(self.id)
        } else {
            Err(RendezvousError::BadSpec(
                "a fixed unique id cannot agree on a new one: reconnecting needs env://, \
                 file:// or another Rendezvous"
                    .into(),
            ))
        }
    }

    fn barrier(&self, name: &str, _timeout: Duration) -> Result<(), RendezvousError> {
        Err(RendezvousError::BadSpec(format!(
            "barrier `{name}`: a fixed unique id has no store to meet in"
        )))
    }

    fn has_store(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_zero_only() {
        let id = [7u8; ID_LEN];
        let rv = FixedIdRendezvous::new(1, 2, id).unwrap();
        let mut make = || -> Result<[u8; ID_LEN], String> { panic!("rank 1 never makes an id") };
        assert_eq!(rv.exchange_id(0, &mut make, Duration::ZERO).unwrap(), id);
        assert!(matches!(
            rv.exchange_id(1, &mut make, Duration::ZERO),
            Err(RendezvousError::BadSpec(_))
        ));
        assert!(rv.barrier("b", Duration::ZERO).is_err());
        assert!(matches!(
            rv.group("g", 0, 1),
            Err(RendezvousError::Unsupported(_))
        ));
        assert!(FixedIdRendezvous::new(2, 2, id).is_err());
    }
}
