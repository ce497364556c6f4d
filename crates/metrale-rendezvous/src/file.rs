//! [`FileRendezvous`]: rank agreement through a directory on one machine.
//!
//! A key is a file in the directory, its name the key with every byte
//! outside `[A-Za-z0-9._-]` written as `%XX`. A set writes a temporary file
//! (named by rank, process and a counter, so writers never collide) and
//! renames it over the key, so a reader sees either nothing or the whole
//! value. A get polls for the file (2 ms sleeps) until its deadline. A
//! barrier writes one file per rank and waits for all of them. Keys live
//! under `metrale/`, a group's ([`Rendezvous::group`]) under
//! `metrale/group/{name}/` in the same directory. The directory
//! must be fresh for each job: stale files of an earlier job would be read
//! as this job's.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{
    BarrierCounters, ID_LEN, Rendezvous, RendezvousError, check_rank, deadline_after,
    exchange_id_via, group_namespace, uid_key,
};

const POLL: Duration = Duration::from_millis(2);

/// Rank agreement through files in a shared directory.
#[derive(Debug)]
pub struct FileRendezvous {
    rank: usize,
    world_size: usize,
    dir: PathBuf,
    /// The prefix of every key.
    namespace: String,
    barriers: BarrierCounters,
}

/// Makes temporary file names unique within the process.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn file_name(key: &str) -> String {
    let mut name = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-' {
            name.push(char::from(b));
        } else {
            name.push_str(&format!("%{b:02X}"));
        }
    }
    name
}

impl FileRendezvous {
    /// Uses `dir` (created if missing) for `rank` of `world_size`.
    pub fn new(rank: usize, world_size: usize, dir: PathBuf) -> Result<Self, RendezvousError> {
        check_rank(rank, world_size).map_err(|e| RendezvousError::BadSpec(e.to_string()))?;
        std::fs::create_dir_all(&dir)
            .map_err(|e| RendezvousError::io(format!("creating {}", dir.display()), e))?;
        Ok(FileRendezvous {
            rank,
            world_size,
            dir,
            namespace: "metrale/".to_owned(),
            barriers: BarrierCounters::default(),
        })
    }

    /// The shared directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `key` atomically (temporary file, then rename).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        let path = self.dir.join(file_name(key));
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .dir
            .join(format!(".tmp.{}.{}.{n}", self.rank, std::process::id()));
        let written = (|| {
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(value)?;
            file.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        written.map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            RendezvousError::io(format!("writing {}", path.display()), e)
        })
    }

    /// Reads `key`, polling until it exists or `timeout` passes.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, RendezvousError> {
        let path = self.dir.join(file_name(key));
        let deadline = deadline_after(timeout);
        loop {
            match std::fs::read(&path) {
                Ok(bytes) => return Ok(bytes),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(RendezvousError::io(
                        format!("reading {}", path.display()),
                        e,
                    ));
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RendezvousError::Timeout {
                    key: key.to_owned(),
                    after: timeout,
                });
            }
            std::thread::sleep(POLL.min(deadline - now));
        }
    }
}

impl Rendezvous for FileRendezvous {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn exchange_id(
        &self,
        generation: u64,
        make: &mut dyn FnMut() -> Result<[u8; ID_LEN], String>,
        timeout: Duration,
    ) -> Result<[u8; ID_LEN], RendezvousError> {
        exchange_id_via(
            self.rank,
            uid_key(&self.namespace, generation),
            make,
            |k, v| self.set(k, v),
            |k| self.get(k, timeout),
        )
    }

    fn barrier(&self, name: &str, timeout: Duration) -> Result<(), RendezvousError> {
        let deadline = deadline_after(timeout);
        let n = self.barriers.next(name);
        let base = format!("{}barrier/{name}/{n}", self.namespace);
        self.set(&format!("{base}/rank{}", self.rank), b"1")?;
        for r in 0..self.world_size {
            let left = deadline.saturating_duration_since(Instant::now());
            self.get(&format!("{base}/rank{r}"), left)
                .map_err(|e| match e {
                    RendezvousError::Timeout { key, .. } => RendezvousError::Timeout {
                        key,
                        after: timeout,
                    },
                    other => other,
                })?;
        }
        Ok(())
    }

    fn group(
        &self,
        name: &str,
        member: usize,
        size: usize,
    ) -> Result<Box<dyn Rendezvous>, RendezvousError> {
        Ok(Box::new(FileRendezvous {
            rank: member,
            world_size: size,
            dir: self.dir.clone(),
            namespace: group_namespace(&self.namespace, name, member, size)?,
            barriers: BarrierCounters::default(),
        }))
    }
}
