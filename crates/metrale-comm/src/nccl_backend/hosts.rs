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
//! This file holds the table ([`Hosts`]) and this machine's identity; the
//! census that fills the table at every connect is `lifecycle`'s
//! (`host_census`).
//!
//! Invariant: every rank of a communicator holds the same table, so every
//! rank decides the paths alike.

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
    /// The hosts of ranks `0..`, by their ids.
    pub(super) fn new(ids: Vec<u64>) -> Hosts {
        Hosts(ids)
    }

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
