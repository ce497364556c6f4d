//! The tuner's cache: the ladder every rank agreed on, saved per machine
//! under a key naming everything that decides it, so that a second start
//! of the same job on the same machine skips the timing (never the
//! correctness checks).
//!
//! The key ([`LocalKey`], one per rank, combined over the ranks into the
//! world key at set-up): the library's version, a hash of the kernels'
//! PTX, the GPU's model and compute capability, the driver's and NCCL's
//! versions, the device's PCI bus id and its peer access to every device
//! the process sees (by bus id), and the settings word (policies, scratch
//! size, add kernel). The world key adds the world size and every rank's
//! key in rank order.
//!
//! Invariants:
//! - A file is written whole to a temporary name beside its final one and
//!   renamed over it, so a reader sees an old file or a new one, never a
//!   part; a failed write costs the cache only (one log line), never the
//!   start.
//! - A file is used only if it parses, names this world key, and its
//!   checksum (FNV-1a over its key and ladder) matches; anything else
//!   (another key, truncated, corrupt, hand-edited, unreadable) is ignored
//!   with one log line, and the ranks tune again.
//!
//! This file holds no lock; its only I/O is the cache file's.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::hosts::hash;
use super::path_table::Rung;
use crate::config::TuneCache;
use crate::kernels;

/// The file format's version: a file of another format is ignored.
const FORMAT: u32 = 1;

/// What decides this rank's measurements, as text (for a person reading
/// the cache file) and as a word (exchanged with the peers).
#[derive(Debug, Clone)]
pub(super) struct LocalKey {
    pub(super) text: String,
}

impl LocalKey {
    /// This rank's key on `device` with `settings` (the census's settings
    /// word). A driver query that fails is named in the key as failed, so
    /// such a key never matches a healthy one's file.
    pub(super) fn of(device: usize, settings: u64) -> LocalKey {
        let info = nccl_safe::device_info(device)
            .map(|i| {
                format!(
                    "{} cc {}.{}",
                    i.name, i.compute_capability.0, i.compute_capability.1
                )
            })
            .unwrap_or_else(|e| format!("unknown ({e})"));
        let bus = nccl_safe::pci_bus_id(device).unwrap_or_else(|e| format!("unknown ({e})"));
        let driver =
            nccl_safe::driver_version().map_or_else(|e| format!("? ({e})"), |v| v.to_string());
        let nccl =
            nccl_sys::nccl().map_or_else(|e| format!("? ({e})"), |l| l.version().to_string());
        let peers = peer_row(device);
        let kernels = hash(&[
            kernels::ONE_SHOT_PTX.as_bytes(),
            kernels::BF16_ADD_PTX.as_bytes(),
        ]);
        LocalKey {
            text: format!(
                "metrale-comm {}; kernels {kernels:016x}; gpu {info}; bus {bus}; driver {driver}; \
                 nccl {nccl}; peers {peers}; settings {settings:016x}",
                env!("CARGO_PKG_VERSION")
            ),
        }
    }

    /// The key as one word.
    pub(super) fn word(&self) -> u64 {
        hash(&[self.text.as_bytes()])
    }
}

/// `device`'s peer access to every device this process sees, by bus id.
fn peer_row(device: usize) -> String {
    let count = nccl_safe::device_count().unwrap_or(0);
    (0..count)
        .filter(|&d| d != device)
        .map(|d| {
            let bus = nccl_safe::pci_bus_id(d).unwrap_or_default();
            let p2p = nccl_safe::can_access_peer(device, d).unwrap_or(false);
            format!("{bus}={}", u8::from(p2p))
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The world key: the world size and every rank's key word in rank order.
pub(super) fn world_key(words: &[u64]) -> u64 {
    let mut bytes = (words.len() as u64).to_le_bytes().to_vec();
    for w in words {
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    hash(&[&bytes])
}

/// The directory the cache lives in, if any: the configured one, else
/// `$XDG_CACHE_HOME/metrale-comm`, else `$HOME/.cache/metrale-comm`.
pub(super) fn directory(cache: &TuneCache) -> Option<PathBuf> {
    match cache {
        TuneCache::Off => None,
        TuneCache::Dir(d) => Some(d.clone()),
        TuneCache::Default => std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME")
                    .filter(|v| !v.is_empty())
                    .map(|h| PathBuf::from(h).join(".cache"))
            })
            .map(|d| d.join("metrale-comm")),
    }
}

/// The file of `world_key` in `dir`.
pub(super) fn file_of(dir: &Path, world_key: u64) -> PathBuf {
    dir.join(format!("all-reduce-paths-{world_key:016x}.json"))
}

/// One rung as stored: times in whole nanoseconds (the tuner measures
/// them so), which JSON carries exactly.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct StoredRung {
    bytes: usize,
    ns: [Option<u64>; 3],
    checked: [bool; 3],
}

/// The file's content.
#[derive(Debug, Serialize, Deserialize)]
struct File {
    format: u32,
    world_key: String,
    /// This rank's key, for a person reading the file.
    local_key: String,
    eager: Vec<StoredRung>,
    graph: Vec<StoredRung>,
    checksum: String,
}

fn stored(rungs: &[Rung]) -> Vec<StoredRung> {
    rungs
        .iter()
        .map(|r| StoredRung {
            bytes: r.bytes,
            ns: r.ns.map(|t| t.map(|t| t.round().max(0.0) as u64)),
            checked: r.checked,
        })
        .collect()
}

fn rungs_of(stored: &[StoredRung]) -> Vec<Rung> {
    stored
        .iter()
        .map(|r| Rung {
            bytes: r.bytes,
            ns: r.ns.map(|t| t.map(|t| t as f64)),
            checked: r.checked,
        })
        .collect()
}

/// The checksum of a file's key and ladder.
fn checksum(world_key: &str, eager: &[StoredRung], graph: &[StoredRung]) -> u64 {
    let body = serde_json::to_vec(&(FORMAT, world_key, eager, graph)).unwrap_or_default();
    hash(&[&body])
}

/// A ladder read from the cache, with its checksum (which the ranks
/// compare).
pub(super) struct Cached {
    pub(super) eager: Vec<Rung>,
    pub(super) graph: Vec<Rung>,
    pub(super) checksum: u64,
}

/// Why a cache file was not used.
#[derive(Debug)]
pub(super) enum Miss {
    /// There is no file (a first start): not worth a warning.
    Absent,
    /// There is one, and it cannot be used, for this reason.
    Unusable(String),
}

/// Reads the ladder of `world_key` from `path`.
pub(super) fn load(path: &Path, world_key: u64) -> Result<Cached, Miss> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Miss::Absent),
        Err(e) => return Err(Miss::Unusable(format!("unreadable: {e}"))),
    };
    let file: File = serde_json::from_slice(&text)
        .map_err(|e| Miss::Unusable(format!("not a cache file (truncated or corrupt): {e}")))?;
    if file.format != FORMAT {
        return Err(Miss::Unusable(format!(
            "format {}, not {FORMAT}",
            file.format
        )));
    }
    let key = format!("{world_key:016x}");
    if file.world_key != key {
        return Err(Miss::Unusable(format!(
            "it is the table of key {}, not {key}",
            file.world_key
        )));
    }
    let sum = checksum(&file.world_key, &file.eager, &file.graph);
    if file.checksum != format!("{sum:016x}") {
        return Err(Miss::Unusable(
            "its checksum does not match its content (edited or damaged)".into(),
        ));
    }
    Ok(Cached {
        eager: rungs_of(&file.eager),
        graph: rungs_of(&file.graph),
        checksum: sum,
    })
}

/// Writes the ladder to `path` atomically (a temporary file, then a
/// rename), creating its directory; returns the checksum written.
pub(super) fn save(
    path: &Path,
    world_key: u64,
    local: &LocalKey,
    eager: &[Rung],
    graph: &[Rung],
) -> std::io::Result<u64> {
    let world_key = format!("{world_key:016x}");
    let (eager, graph) = (stored(eager), stored(graph));
    let sum = checksum(&world_key, &eager, &graph);
    let file = File {
        format: FORMAT,
        world_key,
        local_key: local.text.clone(),
        eager,
        graph,
        checksum: format!("{sum:016x}"),
    };
    let body = serde_json::to_vec_pretty(&file).map_err(std::io::Error::other)?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!(
        "tmp.{}.{:x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    let written = std::fs::write(&tmp, &body).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map(|()| sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ladder() -> Vec<Rung> {
        vec![
            Rung {
                bytes: 8,
                ns: [Some(10_001.0), Some(4_000.0), None],
                checked: [true, true, false],
            },
            Rung {
                bytes: 32,
                ns: [Some(11_000.0), Some(4_100.0), Some(1.0)],
                checked: [true, true, true],
            },
        ]
    }

    fn scratch_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "metrale-tune-cache-{name}-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_saved_ladder_reads_back_exactly() {
        let dir = scratch_dir("roundtrip");
        let path = file_of(&dir, 42);
        let key = LocalKey { text: "k".into() };
        let sum = save(&path, 42, &key, &ladder(), &ladder()[..1]).unwrap();
        let Ok(c) = load(&path, 42) else {
            panic!("a miss")
        };
        assert_eq!((c.eager, c.graph), (ladder(), ladder()[..1].to_vec()));
        assert_eq!(c.checksum, sum);
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary file is left");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn foreign_truncated_edited_and_absent_files_are_misses() {
        let dir = scratch_dir("misses");
        let path = file_of(&dir, 7);
        assert!(matches!(load(&path, 7), Err(Miss::Absent)));
        save(&path, 7, &LocalKey { text: "k".into() }, &ladder(), &[]).unwrap();
        assert!(matches!(load(&path, 8), Err(Miss::Unusable(m)) if m.contains("key")));
        let good = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, &good[..good.len() / 2]).unwrap();
        assert!(matches!(load(&path, 7), Err(Miss::Unusable(m)) if m.contains("corrupt")));
        std::fs::write(&path, good.replace("4000", "3000")).unwrap();
        assert!(matches!(load(&path, 7), Err(Miss::Unusable(m)) if m.contains("checksum")));
        std::fs::write(&path, &good).unwrap();
        assert!(load(&path, 7).is_ok());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_world_key_depends_on_every_rank_and_the_order() {
        assert_ne!(world_key(&[1, 2]), world_key(&[2, 1]));
        assert_ne!(world_key(&[1, 2]), world_key(&[1, 2, 2]));
        assert_eq!(world_key(&[1, 2]), world_key(&[1, 2]));
    }
}
