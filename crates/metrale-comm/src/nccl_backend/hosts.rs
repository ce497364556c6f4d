//! Which host each rank runs on, learned over the communicator at every
//! connect (and split): peer memory (the one-shot path's CUDA IPC and peer
//! access) exists only among the ranks of one host, and the 2-rank fast
//! path is for peers that share one, so both turn on only where every rank
//! of the communicator is on this rank's host.
//!
//! A host is known by the hash NCCL uses for the same purpose: the host
//! name and boot id, or `NCCL_HOSTID` when it is set (NCCL's own
//! override), so the backend and NCCL agree on who is local.
//!
//! Invariants: the census runs, or is skipped, alike on every rank (its
//! condition reads only the configuration and the world size, which every
//! rank shares); it is one all-reduce of `world_size` words on the
//! backend's stream, bounded by the init deadline; every rank ends with
//! the same table, so every rank decides the paths alike.

use std::time::Instant;

use nccl_safe::{DataType, DeviceBuffer, ReduceOp};

use super::{Inner, Slot};
use crate::backend::Result;
use crate::config::OneShotPolicy;
use crate::error::CommError;

/// The variable NCCL reads to override the host identity.
pub const HOST_ID_ENV: &str = "NCCL_HOSTID";

/// This machine's identity: a hash of `NCCL_HOSTID` when set, else of the
/// host name and boot id (as NCCL's `getHostHash`).
pub(super) fn host_id() -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    match std::env::var(HOST_ID_ENV).ok().filter(|v| !v.is_empty()) {
        Some(id) => eat(id.as_bytes()),
        None => {
            for f in [
                "/proc/sys/kernel/random/boot_id",
                "/proc/sys/kernel/hostname",
            ] {
                eat(&std::fs::read(f).unwrap_or_default());
            }
        }
    }
    // 0 means "not reported" in the exchange.
    h.max(1)
}

/// Every rank's host, by rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hosts(Vec<u64>);

impl Hosts {
    /// Whether every rank is on one host.
    pub(super) fn one_host(&self) -> bool {
        self.0.windows(2).all(|w| w[0] == w[1])
    }

    /// The ranks of each host, as "ranks 0-1, 2-3" (hosts in order of
    /// their lowest rank).
    pub(super) fn describe(&self) -> String {
        let mut groups: Vec<(u64, Vec<usize>)> = Vec::new();
        for (r, h) in self.0.iter().enumerate() {
            match groups.iter_mut().find(|(g, _)| g == h) {
                Some((_, v)) => v.push(r),
                None => groups.push((*h, vec![r])),
            }
        }
        let ranks = |v: &[usize]| -> String {
            let mut out = Vec::new();
            let mut i = 0;
            while i < v.len() {
                let mut j = i;
                while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
                    j += 1;
                }
                out.push(if i == j {
                    v[i].to_string()
                } else {
                    format!("{}-{}", v[i], v[j])
                });
                i = j + 1;
            }
            out.join(",")
        };
        let parts: Vec<String> = groups.iter().map(|(_, v)| ranks(v)).collect();
        format!("{} hosts (ranks {})", groups.len(), parts.join("; "))
    }
}

impl Inner {
    /// Whether this communicator needs to know its ranks' hosts: a path
    /// that needs one host could be taken.
    fn needs_hosts(&self) -> bool {
        let one_shot = self.config.one_shot != OneShotPolicy::Never && self.world_size >= 2;
        let fast = self.world_size == 2 && self.config.fast_path.max_fast_bytes().is_some();
        one_shot || fast
    }

    /// Learns every rank's host over the slot's (new) communicator, or
    /// forgets them where no path needs them.
    pub(super) fn host_census(&self, slot: &mut Slot) -> Result<()> {
        slot.hosts = None;
        if !self.needs_hosts() {
            return Ok(());
        }
        let deadline = Instant::now() + self.config.init_timeout;
        let mut mine = vec![0u8; 8 * self.world_size];
        mine[8 * self.rank..][..8].copy_from_slice(&host_id().to_le_bytes());
        let all = self.exchange_bytes(slot, &mine, deadline).map_err(|e| {
            self.abort_now("host census");
            CommError::setup("host census", e)
        })?;
        let ids = all
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let hosts = Hosts(ids);
        if !hosts.one_host() {
            tracing::info!(
                rank = self.rank,
                world_size = self.world_size,
                "the ranks span {}: the one-shot and fast paths (peer memory) are off \
                 for this communicator; a group split per host has them",
                hosts.describe()
            );
        }
        slot.hosts = Some(hosts);
        Ok(())
    }

    /// Whether every rank is known to be on this rank's host.
    pub(super) fn one_host(&self, slot: &Slot) -> bool {
        slot.hosts.as_ref().is_some_and(Hosts::one_host)
    }

    /// Every rank's `mine` (zero outside the rank's own part) summed
    /// byte-wise: each rank's part, gathered, over one all-reduce of bytes
    /// on the backend's stream (all-reduces are connected at init, so this
    /// makes no connection inside a blocking call), bounded by `deadline`.
    pub(super) fn exchange_bytes(
        &self,
        slot: &mut Slot,
        mine: &[u8],
        deadline: Instant,
    ) -> nccl_safe::Result<Vec<u8>> {
        let buf = DeviceBuffer::<u8>::from_host(&self.ctx, mine)?;
        let comm = slot.comm("set-up exchange")?;
        let stream = slot.stream.raw();
        // SAFETY: the buffer holds `mine.len()` bytes of this context; our
        // own stream.
        unsafe {
            comm.all_reduce_raw(
                buf.device_ptr(),
                buf.device_ptr(),
                mine.len(),
                DataType::Uint8,
                ReduceOp::Sum,
                stream,
            )?
        };
        slot.stream
            .wait_until_idle(deadline.saturating_duration_since(Instant::now()))?;
        comm.async_error()?;
        buf.to_host_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_described_by_their_rank_ranges() {
        let h = Hosts(vec![7, 7, 9, 9, 7]);
        assert!(!h.one_host());
        assert_eq!(h.describe(), "2 hosts (ranks 0-1,4; 2-3)");
        assert!(Hosts(vec![3, 3, 3]).one_host());
    }
}
