//! How ranks meet: a PyTorch-compatible c10d TCPStore server and client,
//! the [`Rendezvous`] trait with its TCP, file and fixed-id
//! implementations, and the reading of a launcher's variables (torchrun,
//! Slurm, MPI, Kubeflow). No CUDA and no NCCL: a unique id is plain
//! `[u8; 128]` bytes, and any Rust program can use the store, beside a
//! PyTorch job or without one.
//!
//! [`StoreServer`] serves the store from one thread (an event loop on
//! mio), bounded by [`StoreLimits`]; PyTorch's
//! `torch.distributed.TCPStore(host, port, is_master=False)` (2.4 to 2.11)
//! is a client of it unchanged. [`StoreClient`] speaks the same protocol to
//! our server or to PyTorch's (libuv or legacy). [`TcpRendezvous`] builds
//! unique-id exchange and barriers over a store; [`FileRendezvous`] over
//! a directory shared by the ranks of one machine; [`FixedIdRendezvous`]
//! takes an id given out of band. [`Launch`] reads which launcher started
//! the process; [`rendezvous_from_url`] picks a transport from `env://`,
//! `file:///dir` or `tcp://host:port`. The crate's README has the store's
//! protocol coverage, its limits (and their `METRALE_STORE_*` variables)
//! and the token.
//!
//! # Serving a store, and a client's queries
//!
//! ```
//! use std::time::Duration;
//! use metrale_rendezvous::{StoreClient, StoreServer};
//!
//! # fn main() -> Result<(), metrale_rendezvous::RendezvousError> {
//! // Port 0 picks a free port; no token: PyTorch's clients are welcome.
//! let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), None)?;
//! let addr = server.local_addr();
//! let t = Duration::from_secs(10);
//! // `connect` retries until `t`: the server may start later.
//! let store = StoreClient::connect(addr, None, t)?;
//! store.set("model/step", b"42")?;
//! assert_eq!(store.get("model/step", t)?, b"42"); // waits up to t for the key
//! assert_eq!(store.add("counter", 5)?, 5);
//! assert_eq!(store.add("counter", -2)?, 3);
//! store.wait(&["model/step", "counter"], t)?;
//! assert!(!store.check(&["absent"])?);
//! // compare_set: sets when the key holds `expected` (absent: empty).
//! assert_eq!(store.compare_set("leader", b"", b"me")?, b"me");
//! assert_eq!(store.compare_set("leader", b"", b"you")?, b"me");
//! // Queues: FIFO per key; a pop may wait for a push.
//! store.queue_push("jobs", b"first")?;
//! store.queue_push("jobs", b"second")?;
//! assert_eq!(store.queue_len("jobs")?, 2);
//! assert_eq!(store.queue_pop("jobs", None)?.as_deref(), Some(&b"first"[..]));
//! assert_eq!(store.queue_pop("jobs", Some(t))?.as_deref(), Some(&b"second"[..]));
//! assert_eq!(store.queue_pop("jobs", None)?, None);
//! drop(store);
//! server.shutdown();
//! # Ok(()) }
//! ```
//!
//! # A barrier
//!
//! Each rank is a [`TcpRendezvous`]; here every rank is a client of a store
//! served apart (as a launcher's is). [`TcpRendezvous::new`] makes rank 0
//! serve it instead.
//!
//! ```
//! use std::time::Duration;
//! use metrale_rendezvous::{Rendezvous, StoreServer, TcpRendezvous};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let server = StoreServer::bind("127.0.0.1:0".parse()?, None)?;
//! let addr = server.local_addr();
//! let t = Duration::from_secs(10);
//! let ranks: Vec<_> = (0..3)
//!     .map(|rank| {
//!         std::thread::spawn(move || {
//!             let rv = TcpRendezvous::connect(rank, 3, addr, None, "job-7/", t)?;
//!             rv.barrier("start", t)?; // every rank arrives before any returns
//!             // Rank 0 makes an id (any 128 bytes); every rank gets it.
//!             rv.exchange_id(0, &mut || Ok([7u8; 128]), t)
//!         })
//!     })
//!     .collect();
//! for rank in ranks {
//!     assert_eq!(rank.join().unwrap()?, [7u8; 128]);
//! }
//! server.shutdown();
//! # Ok(()) }
//! ```
//!
//! # Reading a launcher's variables
//!
//! [`Launch::from_env`] reads the process environment;
//! [`Launch::from_lookup`] any lookup, here torchrun's variables:
//!
//! ```
//! use std::collections::HashMap;
//! use metrale_rendezvous::{Launch, Launcher, StoreRole};
//!
//! # fn main() -> Result<(), metrale_rendezvous::RendezvousError> {
//! let env: HashMap<&str, &str> = HashMap::from([
//!     ("RANK", "5"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"),
//!     ("LOCAL_WORLD_SIZE", "4"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500"),
//!     ("TORCHELASTIC_RUN_ID", "job-42"), ("TORCHELASTIC_RESTART_COUNT", "0"),
//!     ("TORCHELASTIC_USE_AGENT_STORE", "True"),
//! ]);
//! let launch = Launch::from_lookup(|v| env.get(v).map(|s| s.to_string()))?;
//! assert_eq!(launch.launcher, Launcher::Torchrun);
//! assert_eq!((launch.rank, launch.world_size, launch.device), (5, 8, 1));
//! assert_eq!(launch.store, StoreRole::Launcher); // torchrun's agent serves it
//! assert_eq!(launch.namespace, "metrale/job-42/attempt_0/");
//! # Ok(()) }
//! ```
//!
//! A PyTorch process and a Rust one sharing a store, either side serving:
//! `examples/torch_interop.rs` and its driver `examples/torch_interop.py`.
//!
//! Invariants: keys are namespaced (`metrale/`, under torchrun
//! `metrale/{run id}/attempt_{restart}/`); the id of generation `g` lives
//! under `{namespace}uid/{g}` and is written once, by rank 0; a barrier name
//! may be reused, each use getting its own keys through a per-name counter
//! that advances identically on every rank; a group's rendezvous
//! ([`Rendezvous::group`]: a sub-communicator's ranks) keeps its keys under
//! `{namespace}group/{name}/` of the same store; every wait is bounded by a
//! caller-given timeout.
//!
//! Lock order: a rendezvous's locks are leaves, never nested:
//! `BarrierCounters`'s is taken alone to number a barrier, a
//! [`StoreClient`]'s for one query (`client`, `tcp`); the store server
//! shares none with its loop (`server`).

mod client;
mod event_loop;
mod file;
mod fixed;
mod frame;
mod launcher;
mod limits;
pub mod nodelist;
mod proto;
mod queries;
mod server;
mod tcp;

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use client::{DEFAULT_IO_TIMEOUT, StoreClient};
pub use file::FileRendezvous;
pub use fixed::FixedIdRendezvous;
pub use launcher::{DEFAULT_PORT, DEVICE_ENV, Launch, LaunchError, Launcher, StoreRole};
pub use limits::{StoreLimit, StoreLimits, StoreRefusal};
pub use server::{DEFAULT_IDLE_LIMIT, StoreServer, StoreStats};
pub use tcp::TcpRendezvous;

/// The length of an NCCL unique id.
pub const ID_LEN: usize = 128;

/// The environment variable holding the store's shared secret.
pub const TOKEN_ENV: &str = "METRALE_STORE_TOKEN";

/// Why a rendezvous step failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// A wait ended before `key` appeared.
    #[error("rendezvous timed out after {after:?} waiting for {key}")]
    Timeout {
        /// What was awaited.
        key: String,
        /// The wait's length.
        after: Duration,
    },
    /// A transport or file-system failure.
    #[error("rendezvous i/o error {context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The store this client had reached refused or reset a connection:
    /// its process is gone (rank 0's, when rank 0 serves it). Every store
    /// wait ends with this at once rather than retry until its deadline.
    #[error("the store at {addr} is gone ({source}): its process exited or was killed")]
    StoreGone {
        /// The store's address.
        addr: std::net::SocketAddr,
        /// The refusal or reset.
        #[source]
        source: std::io::Error,
    },
    /// The peer sent something this build does not understand.
    #[error("rendezvous protocol error: {0}")]
    Protocol(String),
    /// The store refused the token.
    #[error("the store refused this client's token (check {TOKEN_ENV})")]
    Unauthorized,
    /// An environment variable is missing or invalid.
    #[error("bad environment variable {var}: {reason}")]
    BadEnv {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A rendezvous URL or argument is invalid.
    #[error("bad rendezvous spec: {0}")]
    BadSpec(String),
    /// The store is shutting down.
    #[error("the rendezvous store is closed")]
    Closed,
    /// Rank 0 could not create the unique id (its message).
    #[error("creating the unique id failed: {0}")]
    MakeId(String),
    /// The store's port is taken.
    #[error("the store's address {addr} is already in use: {holder}; {hint}")]
    AddressInUse {
        /// The address rank 0 tried to bind.
        addr: SocketAddr,
        /// Who answers there, as far as a probe could tell.
        holder: String,
        /// What to do.
        hint: String,
    },
    /// What was asked needs something this rendezvous does not have (a
    /// store, for a fixed unique id).
    #[error("unsupported by this rendezvous: {0}")]
    Unsupported(String),
    /// The launcher's variables are missing or contradictory.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// A store of ours refused a query or this client's connection, at one
    /// of its limits ([`StoreRefusal::limit`]) or for another reason
    /// (an `ADD` that would overflow, say).
    #[error("the store at {addr} refused: {refusal}")]
    StoreRefused {
        /// The store's address.
        addr: SocketAddr,
        /// What the store said.
        refusal: StoreRefusal,
    },
    /// The store failed during a [`Rendezvous::census`], after this rank's
    /// own report was set: what the census had read before it failed.
    #[error("the store failed during census `{name}`: {source}")]
    CensusCut {
        /// The census' name.
        name: String,
        /// What it had read.
        so_far: CensusSoFar,
        /// How the store failed.
        #[source]
        source: Box<RendezvousError>,
    },
}

/// What a [`Rendezvous::census`] had read when its store failed
/// ([`RendezvousError::CensusCut`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CensusSoFar {
    /// The ranks seen to have reported (`arrived[r]`), this rank included.
    /// A rank not seen may have reported after the last look.
    pub arrived: Vec<bool>,
    /// Another rank's verdict, read before the store failed.
    pub verdict: Option<CensusVerdict>,
}

/// The verdict a census publishes when it ends at its deadline with ranks
/// missing, for a census of the same name that the store fails before
/// it ends ([`CensusSoFar::verdict`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CensusVerdict {
    /// The rank whose census it is.
    pub by: usize,
    /// The ranks that census did not see report, in rank order.
    pub missing: Vec<usize>,
}

impl CensusSoFar {
    /// What a census had read: the ranks seen and another rank's verdict.
    pub fn new(arrived: Vec<bool>, verdict: Option<CensusVerdict>) -> Self {
        CensusSoFar { arrived, verdict }
    }
}

impl CensusVerdict {
    /// A verdict of rank `by` that ranks `missing` did not report.
    pub fn new(by: usize, missing: Vec<usize>) -> Self {
        CensusVerdict { by, missing }
    }

    /// The verdict's value in the store: `BY:M1,M2,...`.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let missing: Vec<String> = self.missing.iter().map(usize::to_string).collect();
        format!("{}:{}", self.by, missing.join(",")).into_bytes()
    }

    /// The verdict a store's value holds, if it is one of `world_size`
    /// ranks.
    pub(crate) fn decode(value: &[u8], world_size: usize) -> Option<Self> {
        let text = std::str::from_utf8(value).ok()?;
        let (by, missing) = text.split_once(':')?;
        let rank = |s: &str| s.parse::<usize>().ok().filter(|&r| r < world_size);
        let by = rank(by)?;
        let missing = missing
            .split(',')
            .filter(|s| !s.is_empty())
            .map(rank)
            .collect::<Option<Vec<usize>>>()?;
        Some(CensusVerdict { by, missing })
    }
}

/// What to do about a taken store port, in general.
pub(crate) const ADDRESS_IN_USE_HINT: &str = "if a launcher serves a store there (torchrun's \
    agent does, and says so with TORCHELASTIC_USE_AGENT_STORE=True), every rank must be its \
    client; otherwise another job holds the port: choose another MASTER_PORT or stop that job";

impl RendezvousError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        RendezvousError::Io {
            context: context.into(),
            source,
        }
    }
}

/// Rank agreement used by `NcclBackend`.
pub trait Rendezvous: Send + Sync + std::fmt::Debug {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// Rank 0 calls `make` to create a fresh id and publishes it under
    /// `generation`; every rank returns the same bytes. Waits at most
    /// `timeout`. A generation must not be reused within one store.
    fn exchange_id(
        &self,
        generation: u64,
        make: &mut dyn FnMut() -> Result<[u8; ID_LEN], String>,
        timeout: Duration,
    ) -> Result<[u8; ID_LEN], RendezvousError>;
    /// All ranks arrive at `name` before any returns; bounded by `timeout`.
    fn barrier(&self, name: &str, timeout: Duration) -> Result<(), RendezvousError>;
    /// A census of who arrived: this rank sets `name`, then waits until
    /// every rank has or `timeout` passes, and says which ranks had
    /// (`arrived[r]`). Ranks that meet no barrier (one that stopped
    /// answering) show as absent. A census that ends at its deadline with
    /// ranks missing publishes that as its verdict ([`CensusVerdict`]; one
    /// more set, bounded by a quarter of `timeout`), and a census reads the
    /// verdicts of the same name's other censuses as it waits: a store
    /// that fails after this rank's report was set ends the census with
    /// [`RendezvousError::CensusCut`], carrying the ranks seen so far and
    /// any verdict read, so that the caller keeps what it learned (the
    /// store's host leaving after its own census is not the rank that
    /// stopped answering). Returns within `timeout` and a quarter. Without
    /// a store: `Unsupported`.
    fn census(&self, name: &str, timeout: Duration) -> Result<Vec<bool>, RendezvousError> {
        let _ = timeout;
        Err(RendezvousError::Unsupported(format!(
            "census `{name}`: this rendezvous has no store to meet in"
        )))
    }
    /// Whether [`Rendezvous::barrier`] can meet at all (a store behind it).
    fn has_store(&self) -> bool {
        true
    }
    /// A rendezvous for a group of `size` of these ranks, this rank being
    /// the group's rank `member` (a sub-communicator's ranks): its ids and
    /// barriers live in the same store, under keys of the group's own,
    /// named by `name` (no `/`), which every member passes and no other
    /// group of this rendezvous uses; it keeps the store alive while it
    /// lives, and makes no I/O until it is used. A rendezvous with no store
    /// to meet in answers [`RendezvousError::Unsupported`].
    fn group(
        &self,
        name: &str,
        member: usize,
        size: usize,
    ) -> Result<Box<dyn Rendezvous>, RendezvousError> {
        let _ = (member, size);
        Err(RendezvousError::Unsupported(format!(
            "group `{name}`: this rendezvous has no store to meet in"
        )))
    }
}

/// The namespace of the group `name` under `namespace`, after checking
/// that `member` is one of its `size` ranks.
pub(crate) fn group_namespace(
    namespace: &str,
    name: &str,
    member: usize,
    size: usize,
) -> Result<String, RendezvousError> {
    if size == 0 || member >= size {
        return Err(RendezvousError::BadSpec(format!(
            "group `{name}`: member {member} of {size}"
        )));
    }
    if name.is_empty() || name.contains('/') {
        return Err(RendezvousError::BadSpec(format!(
            "group `{name}`: a group's name is not empty and has no `/`"
        )));
    }
    Ok(format!("{namespace}group/{name}/"))
}

/// The instant `timeout` from now, saturating instead of overflowing (a
/// `Duration::MAX` timeout means "a very long time", never a panic).
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

/// `Rendezvous::exchange_id` over a key-value store: rank 0 publishes the id
/// it makes (or why it could not) under the generation's key; the others
/// wait for that key.
pub(crate) fn exchange_id_via(
    rank: usize,
    key: String,
    make: &mut dyn FnMut() -> Result<[u8; ID_LEN], String>,
    set: impl FnOnce(&str, &[u8]) -> Result<(), RendezvousError>,
    get: impl FnOnce(&str) -> Result<Vec<u8>, RendezvousError>,
) -> Result<[u8; ID_LEN], RendezvousError> {
    if rank == 0 {
        let made = make();
        set(&key, &encode_uid(&made))?;
        return made.map_err(RendezvousError::MakeId);
    }
    decode_uid(&get(&key)?)
}

/// The key of generation `generation`'s unique id under `namespace`.
pub(crate) fn uid_key(namespace: &str, generation: u64) -> String {
    format!("{namespace}uid/{generation}")
}

/// Encodes rank 0's outcome: tag 0 and the id, or tag 1 and the error.
pub(crate) fn encode_uid(made: &Result<[u8; ID_LEN], String>) -> Vec<u8> {
    match made {
        Ok(id) => {
            let mut v = Vec::with_capacity(1 + ID_LEN);
            v.push(0);
            v.extend_from_slice(id);
            v
        }
        Err(msg) => {
            let mut v = vec![1];
            v.extend_from_slice(msg.as_bytes());
            v
        }
    }
}

/// Decodes what [`encode_uid`] wrote.
pub(crate) fn decode_uid(bytes: &[u8]) -> Result<[u8; ID_LEN], RendezvousError> {
    match bytes.split_first() {
        Some((0, id)) => id.try_into().map_err(|_| {
            RendezvousError::Protocol(format!(
                "unique id of {} bytes, expected {ID_LEN}",
                id.len()
            ))
        }),
        Some((1, msg)) => Err(RendezvousError::MakeId(format!(
            "rank 0: {}",
            String::from_utf8_lossy(msg)
        ))),
        _ => Err(RendezvousError::Protocol(
            "malformed unique-id record".to_owned(),
        )),
    }
}

/// The plain `env://` variables, read without launcher detection (see
/// [`Launch`] for that).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvConfig {
    /// `RANK`.
    pub rank: usize,
    /// `WORLD_SIZE`.
    pub world_size: usize,
    /// `LOCAL_RANK` (defaults to `RANK`, right for one machine).
    pub local_rank: usize,
    /// `MASTER_ADDR`.
    pub master_addr: String,
    /// `MASTER_PORT`.
    pub master_port: u16,
}

fn parse_var<T: std::str::FromStr>(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<T, RendezvousError>
where
    T::Err: std::fmt::Display,
{
    let raw = get(var).ok_or_else(|| RendezvousError::BadEnv {
        var,
        reason: "not set".to_owned(),
    })?;
    raw.trim().parse().map_err(|e| RendezvousError::BadEnv {
        var,
        reason: format!("{raw:?}: {e}"),
    })
}

/// Reads `RANK` and `WORLD_SIZE` and checks `rank < world_size`.
fn rank_and_world(
    get: &impl Fn(&str) -> Option<String>,
) -> Result<(usize, usize), RendezvousError> {
    let rank: usize = parse_var(get, "RANK")?;
    let world_size: usize = parse_var(get, "WORLD_SIZE")?;
    check_rank(rank, world_size)?;
    Ok((rank, world_size))
}

fn check_rank(rank: usize, world_size: usize) -> Result<(), RendezvousError> {
    if world_size == 0 {
        return Err(RendezvousError::BadEnv {
            var: "WORLD_SIZE",
            reason: "must be at least 1".to_owned(),
        });
    }
    if rank >= world_size {
        return Err(RendezvousError::BadEnv {
            var: "RANK",
            reason: format!("{rank} is not below WORLD_SIZE {world_size}"),
        });
    }
    Ok(())
}

impl EnvConfig {
    /// Reads the process environment.
    pub fn from_env() -> Result<EnvConfig, RendezvousError> {
        Self::from_lookup(|var| std::env::var(var).ok())
    }

    /// Reads the variables through `get` (testable without the environment).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<EnvConfig, RendezvousError> {
        let (rank, world_size) = rank_and_world(&get)?;
        let local_rank = match get("LOCAL_RANK") {
            Some(_) => parse_var(&get, "LOCAL_RANK")?,
            None => rank,
        };
        if local_rank >= world_size {
            return Err(RendezvousError::BadEnv {
                var: "LOCAL_RANK",
                reason: format!("{local_rank} is not below WORLD_SIZE {world_size}"),
            });
        }
        let master_addr = get("MASTER_ADDR")
            .map(|a| a.trim().to_owned())
            .filter(|a| !a.is_empty())
            .ok_or_else(|| RendezvousError::BadEnv {
                var: "MASTER_ADDR",
                reason: "not set".to_owned(),
            })?;
        let master_port: u16 = parse_var(&get, "MASTER_PORT")?;
        if master_port == 0 {
            return Err(RendezvousError::BadEnv {
                var: "MASTER_PORT",
                reason: "must not be 0".to_owned(),
            });
        }
        Ok(EnvConfig {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        })
    }

    /// Resolves `MASTER_ADDR:MASTER_PORT` (the first address found).
    pub fn master_socket_addr(&self) -> Result<SocketAddr, RendezvousError> {
        resolve(&self.master_addr, self.master_port)
    }
}

pub(crate) fn resolve(host: &str, port: u16) -> Result<SocketAddr, RendezvousError> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (host, port)
        .to_socket_addrs()
        .map_err(|e| RendezvousError::io(format!("resolving {host}:{port}"), e))?
        .next()
        .ok_or_else(|| RendezvousError::BadSpec(format!("{host}:{port} resolves to nothing")))
}

fn token_from_env() -> Option<String> {
    std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty())
}

/// A parsed rendezvous URL (see [`rendezvous_from_url`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RendezvousSpec {
    /// `env://`: the launcher's variables ([`Launch`]).
    Env,
    /// `file:///abs/dir[?rank=R&world_size=W]`.
    File {
        /// The shared directory.
        dir: PathBuf,
        /// Rank from the query, else `RANK`.
        rank: Option<usize>,
        /// World size from the query, else `WORLD_SIZE`.
        world_size: Option<usize>,
    },
    /// `tcp://host:port[?rank=R&world_size=W]`.
    Tcp {
        /// The host (name or address).
        host: String,
        /// The port.
        port: u16,
        /// Rank from the query, else `RANK`.
        rank: Option<usize>,
        /// World size from the query, else `WORLD_SIZE`.
        world_size: Option<usize>,
    },
}

fn parse_query(query: &str) -> Result<(Option<usize>, Option<usize>), RendezvousError> {
    let (mut rank, mut world) = (None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| RendezvousError::BadSpec(format!("query item {pair:?} has no '='")))?;
        let n: usize = v
            .parse()
            .map_err(|_| RendezvousError::BadSpec(format!("{k}={v:?} is not a number")))?;
        match k {
            "rank" => rank = Some(n),
            "world_size" => world = Some(n),
            other => {
                return Err(RendezvousError::BadSpec(format!(
                    "unknown query key {other:?}"
                )));
            }
        }
    }
    Ok((rank, world))
}

impl RendezvousSpec {
    /// Parses `env://`, `file:///abs/dir` or `tcp://host:port`, each
    /// optionally followed by `?rank=R&world_size=W` (not for `env://`).
    pub fn parse(url: &str) -> Result<RendezvousSpec, RendezvousError> {
        let (base, query) = match url.split_once('?') {
            Some((b, q)) => (b, Some(q)),
            None => (url, None),
        };
        let (rank, world_size) = parse_query(query.unwrap_or(""))?;
        if let Some(rest) = base.strip_prefix("env://") {
            if !rest.is_empty() || query.is_some() {
                return Err(RendezvousError::BadSpec(format!(
                    "{url:?}: env:// takes nothing after it"
                )));
            }
            Ok(RendezvousSpec::Env)
        } else if let Some(path) = base.strip_prefix("file://") {
            if !path.starts_with('/') || path.len() < 2 {
                return Err(RendezvousError::BadSpec(format!(
                    "{url:?}: file:// needs an absolute directory, e.g. file:///tmp/rdzv"
                )));
            }
            Ok(RendezvousSpec::File {
                dir: PathBuf::from(path),
                rank,
                world_size,
            })
        } else if let Some(hostport) = base.strip_prefix("tcp://") {
            let (host, port) = hostport.rsplit_once(':').ok_or_else(|| {
                RendezvousError::BadSpec(format!("{url:?}: tcp:// needs host:port"))
            })?;
            let port: u16 = port
                .parse()
                .map_err(|_| RendezvousError::BadSpec(format!("{url:?}: bad port {port:?}")))?;
            if host.is_empty() || port == 0 {
                return Err(RendezvousError::BadSpec(format!(
                    "{url:?}: tcp:// needs a host and a non-zero port"
                )));
            }
            Ok(RendezvousSpec::Tcp {
                host: host.to_owned(),
                port,
                rank,
                world_size,
            })
        } else {
            Err(RendezvousError::BadSpec(format!(
                "{url:?}: expected env://, file:///dir or tcp://host:port"
            )))
        }
    }
}

fn rank_world_or_env(
    rank: Option<usize>,
    world_size: Option<usize>,
) -> Result<(usize, usize), RendezvousError> {
    let env = |var: &str| std::env::var(var).ok();
    let rank = match rank {
        Some(r) => r,
        None => parse_var(&env, "RANK")?,
    };
    let world_size = match world_size {
        Some(w) => w,
        None => parse_var(&env, "WORLD_SIZE")?,
    };
    check_rank(rank, world_size)?;
    Ok((rank, world_size))
}

/// Builds the rendezvous named by `url`: `env://` (the launcher's variables,
/// [`Launch`], and `METRALE_STORE_TOKEN`), `file:///abs/dir` or
/// `tcp://host:port` (rank 0 serves on that port, on every address; rank and
/// world size from `?rank=R&world_size=W`, else `RANK` and `WORLD_SIZE`).
/// `timeout` bounds connecting to the store.
pub fn rendezvous_from_url(
    url: &str,
    timeout: Duration,
) -> Result<Box<dyn Rendezvous>, RendezvousError> {
    match RendezvousSpec::parse(url)? {
        RendezvousSpec::Env => Ok(Box::new(TcpRendezvous::from_launch(
            &Launch::from_env()?,
            timeout,
        )?)),
        RendezvousSpec::File {
            dir,
            rank,
            world_size,
        } => {
            let (rank, world_size) = rank_world_or_env(rank, world_size)?;
            Ok(Box::new(FileRendezvous::new(rank, world_size, dir)?))
        }
        RendezvousSpec::Tcp {
            host,
            port,
            rank,
            world_size,
        } => {
            let (rank, world_size) = rank_world_or_env(rank, world_size)?;
            let addr = resolve(&host, port)?;
            // Rank 0 serves on every address of the host's family, as env:// does.
            let serving = tcp::Serving::Rank0 {
                bind: (rank == 0).then(|| launcher::bind_addr(addr)),
                limits: None,
            };
            Ok(Box::new(TcpRendezvous::build(
                rank,
                world_size,
                serving,
                addr,
                token_from_env(),
                "metrale/",
                timeout,
            )?))
        }
    }
}

/// Per-name barrier counters: each use of a name gets the next number, the
/// same on every rank because every rank passes the same barriers in order.
#[derive(Debug, Default)]
pub(crate) struct BarrierCounters(parking_lot::Mutex<std::collections::HashMap<String, u64>>);

impl BarrierCounters {
    pub(crate) fn next(&self, name: &str) -> u64 {
        let mut map = self.0.lock();
        let n = map.entry(name.to_owned()).or_insert(0);
        *n += 1;
        *n
    }
}
