//! Which host each rank runs on, and which path settings it has, learned
//! over the communicator at every connect (and split): peer memory (the
//! one-shot path's CUDA IPC and peer access) exists only among the ranks of
//! one host, and the 2-rank fast path is for peers that share one, so both
//! turn on only where every rank of the communicator is on this rank's
//! host. Both paths also need every rank to choose them alike: a rank
//! whose one-shot or fast-path policy (or add kernel) differs from the
//! others' would take another path for the same call, and the calls would
//! not match; so both are off on every rank when the settings differ.
//!
//! A host is known by the hash NCCL uses for the same purpose: the host
//! name and boot id, or `NCCL_HOSTID` when it is set (NCCL's own
//! override), so the backend and NCCL agree on who is local.
//!
//! This file holds the table ([`Hosts`]), this machine's identity and the
//! settings word; the census that fills the table at every connect is
//! `lifecycle`'s (`host_census`).
//!
//! Invariant: every rank of a communicator holds the same table, so every
//! rank decides the paths alike.

/// The variable NCCL reads to override the host identity.
pub const HOST_ID_ENV: &str = "NCCL_HOSTID";

/// This machine's identity: a hash of `NCCL_HOSTID` when set, else of the
/// host name and boot id (as NCCL's `getHostHash`).
pub(super) fn host_id() -> u64 {
    match std::env::var(HOST_ID_ENV).ok().filter(|v| !v.is_empty()) {
        Some(id) => hash(&[id.as_bytes()]),
        None => hash(&[
            &std::fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default(),
            &std::fs::read("/proc/sys/kernel/hostname").unwrap_or_default(),
        ]),
    }
}

/// A word naming what decides a rank's choice of all-reduce path besides
/// the world and the call (its policies, whether it has the add kernel):
/// ranks whose words differ would choose different paths for one call.
pub(super) fn settings_word(settings: &str) -> u64 {
    hash(&[settings.as_bytes()])
}

/// FNV-1a over `parts`, never 0 (0 means "not reported" in the exchange).
pub(super) fn hash(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in parts.iter().flat_map(|p| p.iter()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h.max(1)
}

/// Every rank's host, by rank, and whether the peer-memory paths can
/// serve the communicator (one host, the same settings everywhere).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hosts {
    ids: Vec<u64>,
    /// Why the one-shot and fast paths cannot serve these ranks.
    off: Option<String>,
}

impl Hosts {
    /// The table of ranks `0..`, from each rank's host id and settings
    /// word ([`settings_word`]).
    pub(super) fn new(ids: Vec<u64>, settings: &[u64]) -> Hosts {
        let differ: Vec<usize> = (0..settings.len())
            .filter(|&r| settings[r] != settings[0])
            .collect();
        let mut hosts = Hosts { ids, off: None };
        hosts.off = if !differ.is_empty() {
            Some(format!(
                "rank(s) {} choose paths by other settings than rank 0 (the one-shot and \
                 fast-path policies, METRALE_COMM_ONE_SHOT and METRALE_COMM_FAST_PATH, the \
                 scratch size and the add kernel must agree on every rank)",
                ranges(&differ)
            ))
        } else if !hosts.one_host() {
            Some(format!(
                "the ranks span {} (peer memory exists only within a host: split a group \
                 per host to use the one-shot path)",
                hosts.describe()
            ))
        } else {
            None
        };
        hosts
    }

    /// Whether every rank is on one host.
    pub(super) fn one_host(&self) -> bool {
        self.ids.windows(2).all(|w| w[0] == w[1])
    }

    /// Why the one-shot and fast paths (peer memory, and a choice every
    /// rank makes alike) cannot serve these ranks; `None` when they can.
    pub(super) fn peer_paths_off(&self) -> Option<&str> {
        self.off.as_deref()
    }

    /// The ranks of each host, as "ranks 0-1, 2-3" (hosts in order of
    /// their lowest rank).
    pub(super) fn describe(&self) -> String {
        let mut groups: Vec<(u64, Vec<usize>)> = Vec::new();
        for (r, h) in self.ids.iter().enumerate() {
            match groups.iter_mut().find(|(g, _)| g == h) {
                Some((_, v)) => v.push(r),
                None => groups.push((*h, vec![r])),
            }
        }
        let parts: Vec<String> = groups.iter().map(|(_, v)| ranges(v)).collect();
        format!("{} hosts (ranks {})", groups.len(), parts.join("; "))
    }
}

/// Ascending ranks as ranges: "0-1,4".
fn ranges(v: &[usize]) -> String {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_described_by_their_rank_ranges() {
        let h = Hosts::new(vec![7, 7, 9, 9, 7], &[5; 5]);
        assert!(!h.one_host());
        assert_eq!(h.describe(), "2 hosts (ranks 0-1,4; 2-3)");
        assert!(h.peer_paths_off().unwrap().contains("span 2 hosts"));
        let one = Hosts::new(vec![3, 3, 3], &[5; 3]);
        assert!(one.one_host());
        assert_eq!(one.peer_paths_off(), None);
    }

    #[test]
    fn ranks_with_other_settings_turn_the_peer_paths_off_and_are_named() {
        let h = Hosts::new(vec![3; 5], &[5, 6, 6, 5, 6]);
        assert!(h.one_host());
        let why = h.peer_paths_off().expect("off");
        assert!(why.starts_with("rank(s) 1-2,4 choose paths"), "{why}");
        assert!(why.contains("METRALE_COMM_ONE_SHOT"), "{why}");
        // Settings are named before hosts: either alone turns the paths off.
        let both = Hosts::new(vec![3, 4], &[5, 6]);
        assert!(both.peer_paths_off().unwrap().starts_with("rank(s) 1 "));
        assert_ne!(settings_word("a"), settings_word("b"));
        assert_ne!(settings_word(""), 0);
    }
}
