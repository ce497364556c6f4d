//! [`TcpRendezvous`]: rank agreement through a c10d TCPStore.
//!
//! The store is a launcher's (torchrun's agent's: every rank is a client)
//! or rank 0's own [`StoreServer`], bound on the wildcard address of the
//! master's family so that every host reaches it; rank 0 then talks to it
//! through a loopback client like every other rank. Every key starts with
//! the rendezvous's namespace. The id of generation `g` is set once by
//! rank 0 under `{ns}uid/{g}`; the others wait for it (`WAIT`, then `GET`).
//! A barrier sets `{ns}barrier/{name}/{n}/{rank}`; rank 0 waits for every
//! rank's key (one `WAIT` for up to [`BARRIER_CHUNK`] keys) and then sets
//! `{ns}barrier/{name}/{n}/done`, which every other rank waits for (a
//! refusal of a rank's key rank 0 passes on to them, on a store of ours,
//! `StoreClient::pass_refusal`): each
//! rank sends O(1) bytes and the store holds O(world) waits (a `WAIT` of
//! every key by every rank was O(world²)). A census sets
//! `{ns}census/{name}/{rank}` and polls the ranks' keys it has not seen
//! and `{ns}census/{name}/verdict`, which a census that ends at its
//! deadline with ranks missing sets (`BY:M1,M2`); a store that fails
//! after this rank's key is set ends it with what it read
//! ([`RendezvousError::CensusCut`]). Only idempotent queries, so a
//! client may send them again after a lost connection. Rank 0 must keep
//! its rendezvous alive while others use its store (end with a barrier
//! before dropping it).
//!
//! Where rank 0 serves the store, it serves it with
//! [`StoreLimits::from_env`] for the world (the connection cap follows the
//! world size), and every rank's client speaks this crate's extension
//! ([`StoreClient::connect_ours`]), so that a limit the store hits is a
//! [`RendezvousError::StoreRefused`] at every rank it affects.
//! A group's rendezvous ([`Rendezvous::group`]) is a client of the same
//! store on a connection of its own (opened at its first query), under
//! `{ns}group/{name}/`; rank 0's store lives until its rendezvous and
//! every group made from it are gone.
//!
//! Lock order: none nested. A [`TcpRendezvous`] has two locks, its barrier
//! counters (taken alone to number a barrier, released before any query)
//! and its client's connection lock (held for one query, `StoreClient`);
//! neither is held while the other is taken. A backend may hold its own
//! locks while it calls a rendezvous; a rendezvous never calls a backend.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::client::{StoreClient, reachable};
use super::launcher::{Launch, Launcher, StoreRole, bind_addr};
use super::limits::StoreLimits;
use super::server::{StoreServer, StoreStats};
use super::{
    BarrierCounters, CensusSoFar, CensusVerdict, ID_LEN, Rendezvous, RendezvousError, TOKEN_ENV,
    check_rank, exchange_id_via, group_namespace, uid_key,
};

/// The namespace of a rendezvous that names none.
const DEFAULT_NAMESPACE: &str = "metrale/";
/// The keys of one `WAIT` of rank 0's at a barrier (PyTorch's libuv server
/// takes 131072, ours [`StoreLimits::max_keys_per_query`]).
pub(crate) const BARRIER_CHUNK: usize = 16384;

/// What a barrier's keys hold once set (`done` too, when every rank came).
const BARRIER_PASSED: &[u8] = b"1";
/// Who serves the store a rendezvous uses, and how.
#[derive(Debug, Clone)]
pub(crate) enum Serving {
    /// A launcher (torchrun's agent): a PyTorch store.
    Launcher,
    /// Rank 0, with these limits (`None`: [`StoreLimits::from_env`]); this
    /// rank binds it when it carries the address.
    Rank0 {
        bind: Option<SocketAddr>,
        limits: Option<StoreLimits>,
    },
}

/// Rank agreement over a c10d TCPStore.
#[derive(Debug)]
pub struct TcpRendezvous {
    rank: usize,
    world_size: usize,
    namespace: String,
    client: StoreClient,
    server: Option<Arc<StoreServer>>,
    barriers: BarrierCounters,
}

impl TcpRendezvous {
    /// Rank 0 binds a store on `addr` (as given) and connects to it; other
    /// ranks connect to `addr`, retrying until `timeout`. Keys live under
    /// `metrale/`.
    pub fn new(
        rank: usize,
        world_size: usize,
        addr: SocketAddr,
        token: Option<String>,
        timeout: Duration,
    ) -> Result<Self, RendezvousError> {
        let serving = Serving::Rank0 {
            bind: (rank == 0).then_some(addr),
            limits: None,
        };
        Self::build(
            rank,
            world_size,
            serving,
            addr,
            token,
            DEFAULT_NAMESPACE,
            timeout,
        )
    }

    /// As [`TcpRendezvous::new`], rank 0 serving with `limits` instead of
    /// [`StoreLimits::from_env`] (other ranks ignore them).
    pub fn with_limits(
        rank: usize,
        world_size: usize,
        addr: SocketAddr,
        token: Option<String>,
        limits: StoreLimits,
        timeout: Duration,
    ) -> Result<Self, RendezvousError> {
        let serving = Serving::Rank0 {
            bind: (rank == 0).then_some(addr),
            limits: Some(limits),
        };
        Self::build(
            rank,
            world_size,
            serving,
            addr,
            token,
            DEFAULT_NAMESPACE,
            timeout,
        )
    }

    /// Every rank, rank 0 included, is a client of the store at `addr`
    /// that someone else serves (a launcher's); keys live under
    /// `namespace`.
    pub fn connect(
        rank: usize,
        world_size: usize,
        addr: SocketAddr,
        token: Option<String>,
        namespace: &str,
        timeout: Duration,
    ) -> Result<Self, RendezvousError> {
        Self::build(
            rank,
            world_size,
            Serving::Launcher,
            addr,
            token,
            namespace,
            timeout,
        )
    }

    /// The rendezvous `launch` describes: a client of the launcher's store,
    /// or rank 0's own store on the wildcard address and the master port.
    pub fn from_launch(launch: &Launch, timeout: Duration) -> Result<Self, RendezvousError> {
        let master = launch.master_socket_addr()?;
        let (rank, world) = (launch.rank, launch.world_size);
        match launch.store {
            StoreRole::Launcher => {
                if launch.token.is_some() {
                    tracing::warn!(
                        "{TOKEN_ENV} is not used: the store is the launcher's, a PyTorch \
                         store without authentication"
                    );
                }
                Self::connect(rank, world, master, None, &launch.namespace, timeout)
            }
            StoreRole::Rank0 => {
                let serving = Serving::Rank0 {
                    bind: (rank == 0).then(|| bind_addr(master)),
                    limits: None,
                };
                let token = launch.token.clone();
                Self::build(
                    rank,
                    world,
                    serving,
                    master,
                    token,
                    &launch.namespace,
                    timeout,
                )
                .map_err(|e| match e {
                    RendezvousError::AddressInUse { addr, holder, hint }
                        if launch.launcher == Launcher::Torchrun =>
                    {
                        RendezvousError::AddressInUse {
                            addr,
                            holder,
                            hint: format!(
                                "this rank runs under torchrun without \
                                     TORCHELASTIC_USE_AGENT_STORE=True, so rank 0 serves the \
                                     store itself, and torchrun's agent may already serve \
                                     one on this port: use a torchrun that sets \
                                     TORCHELASTIC_USE_AGENT_STORE=True (PyTorch 2.x does) \
                                     or give the job a free MASTER_PORT ({hint})"
                            ),
                        }
                    }
                    other => other,
                })
            }
        }
    }

    /// Rank `rank` of `world_size`, serving a store where `serving` says
    /// so and connecting to `addr` otherwise; keys under `namespace`.
    pub(crate) fn build(
        rank: usize,
        world_size: usize,
        serving: Serving,
        addr: SocketAddr,
        token: Option<String>,
        namespace: &str,
        timeout: Duration,
    ) -> Result<Self, RendezvousError> {
        check_rank(rank, world_size).map_err(|e| RendezvousError::BadSpec(e.to_string()))?;
        let (server, connect_to, ours) = match serving {
            Serving::Rank0 {
                bind: Some(bind),
                limits,
            } => {
                let limits = match limits {
                    Some(l) => l,
                    None => StoreLimits::from_env(world_size)?,
                };
                let server = StoreServer::bind_with(bind, token.clone(), limits)?;
                warn_if_accept_queue_short(world_size);
                let local = reachable(server.local_addr());
                (Some(Arc::new(server)), local, true)
            }
            Serving::Rank0 { bind: None, .. } => (None, addr, true),
            Serving::Launcher => (None, addr, false),
        };
        let client = if ours {
            StoreClient::connect_ours(connect_to, token, timeout)?
        } else {
            StoreClient::connect(connect_to, token, timeout)?
        };
        tracing::debug!(rank, world_size, addr = %connect_to, namespace, "tcp rendezvous connected");
        Ok(TcpRendezvous {
            rank,
            world_size,
            namespace: namespace.to_owned(),
            client,
            server,
            barriers: BarrierCounters::default(),
        })
    }

    /// The address rank 0's store listens on (`None` where this rank
    /// serves nothing).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.server.as_deref().map(StoreServer::local_addr)
    }

    /// What rank 0's store holds now (`None` where this rank serves
    /// nothing).
    pub fn store_stats(&self) -> Option<StoreStats> {
        self.server.as_deref().map(StoreServer::stats)
    }

    /// The store client, for callers that need raw keys.
    pub fn client(&self) -> &StoreClient {
        &self.client
    }

    /// The prefix of every key this rendezvous writes.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
}

impl TcpRendezvous {
    /// Which rank of `keys` (a barrier's) has not arrived, found with a
    /// binary search of `CHECK`s, for a timeout's message.
    fn first_missing(&self, keys: &[&str]) -> String {
        let (mut lo, mut hi) = (0usize, keys.len());
        // Invariant: keys[..lo] are all there, keys[..hi] are not.
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            match self.client.check(&keys[..mid]) {
                Ok(true) => lo = mid,
                Ok(false) => hi = mid,
                Err(_) => return "which ranks are missing is unknown".to_owned(),
            }
        }
        match keys.get(lo) {
            Some(k) => format!("the first missing is {k}"),
            None => "every rank's key is there".to_owned(),
        }
    }
}

/// Another census' verdict under `key`, if one is there and reads as one.
fn read_verdict(
    client: &StoreClient,
    key: &str,
    world_size: usize,
    deadline: Instant,
    grace: Duration,
) -> Result<Option<CensusVerdict>, RendezvousError> {
    if !client.check(&[key])? {
        return Ok(None);
    }
    // The key is there: the get does not wait for it, but may take its
    // round trip up to `grace` past the census' deadline.
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(grace);
    let value = client.get(key, left)?;
    Ok(CensusVerdict::decode(&value, world_size))
}

impl Rendezvous for TcpRendezvous {
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
        let deadline = Instant::now() + timeout;
        exchange_id_via(
            self.rank,
            uid_key(&self.namespace, generation),
            make,
            |k, v| self.client.set_by(k, v, deadline),
            |k| self.client.get(k, timeout),
        )
    }

    fn census(&self, name: &str, timeout: Duration) -> Result<Vec<bool>, RendezvousError> {
        // A connection of its own (a frozen store must not hold the shared
        // client's lock past this census), opened within the census' time,
        // so that a frozen store ends the census by its deadline.
        let deadline = Instant::now() + timeout;
        let client = self.client.another_within_deadlines();
        let base = format!("{}census/{name}", self.namespace);
        client.set_by(&format!("{base}/{}", self.rank), BARRIER_PASSED, deadline)?;
        let keys: Vec<String> = (0..self.world_size)
            .map(|r| format!("{base}/{r}"))
            .collect();
        let verdict_key = format!("{base}/verdict");
        let mut arrived = vec![false; self.world_size];
        arrived[self.rank] = true;
        let mut verdict: Option<CensusVerdict> = None;
        // From here on a failing store ends the census with what it read.
        let cut =
            |arrived: &[bool], verdict: &Option<CensusVerdict>, e| RendezvousError::CensusCut {
                name: name.to_owned(),
                so_far: CensusSoFar::new(arrived.to_vec(), verdict.clone()),
                source: Box::new(e),
            };
        loop {
            // A key once set stays: only the ranks not yet seen are asked
            // again, so a poll costs one round trip per missing rank (and
            // one for another census' verdict, until there is one), and
            // the last one ends soon after the deadline on a slow store.
            for (r, k) in keys.iter().enumerate() {
                if !arrived[r] {
                    arrived[r] = client
                        .check(&[k.as_str()])
                        .map_err(|e| cut(&arrived, &verdict, e))?;
                }
            }
            if verdict.is_none() {
                verdict = read_verdict(
                    &client,
                    &verdict_key,
                    self.world_size,
                    deadline,
                    timeout / 4,
                )
                .map_err(|e| cut(&arrived, &verdict, e))?;
            }
            let now = Instant::now();
            if arrived.iter().all(|a| *a) {
                return Ok(arrived);
            }
            if now >= deadline {
                let missing: Vec<usize> = (0..self.world_size).filter(|&r| !arrived[r]).collect();
                let mine = CensusVerdict::new(self.rank, missing);
                // Best effort: the verdict serves only a census the store
                // fails before it ends.
                if let Err(e) = client.set_by(&verdict_key, &mine.encode(), now + timeout / 4) {
                    tracing::debug!(
                        rank = self.rank,
                        "census `{name}`: publishing its verdict failed: {e}"
                    );
                }
                return Ok(arrived);
            }
            std::thread::sleep(Duration::from_millis(10).min(deadline - now));
        }
    }

    fn barrier(&self, name: &str, timeout: Duration) -> Result<(), RendezvousError> {
        let start = Instant::now();
        let left = || timeout.saturating_sub(start.elapsed());
        let n = self.barriers.next(name);
        let base = format!("{}barrier/{name}/{n}", self.namespace);
        let deadline = start + timeout;
        // A set that runs out of the barrier's time is the barrier's
        // timeout, whatever the transport said.
        let late = |key: &str, e: RendezvousError| match e {
            RendezvousError::Io { .. } if Instant::now() >= deadline => RendezvousError::Timeout {
                key: format!("the store's answer to the set of {key}"),
                after: timeout,
            },
            other => other,
        };
        let mine = format!("{base}/{}", self.rank);
        self.client
            .set_by(&mine, BARRIER_PASSED, deadline)
            .map_err(|e| late(&mine, e))?;
        let done = format!("{base}/done");
        if self.rank != 0 {
            return self.client.wait(&[&done], left()).map_err(|e| match e {
                RendezvousError::Timeout { .. } => RendezvousError::Timeout {
                    key: format!(
                        "{done} (rank 0 sets it once all {} ranks set {base}/RANK)",
                        self.world_size
                    ),
                    after: timeout,
                },
                other => other,
            });
        }
        let keys: Vec<String> = (0..self.world_size)
            .map(|r| format!("{base}/{r}"))
            .collect();
        for chunk in keys.chunks(BARRIER_CHUNK) {
            let chunk: Vec<&str> = chunk.iter().map(String::as_str).collect();
            if let Err(e) = self.client.wait(&chunk, left()) {
                return Err(match e {
                    RendezvousError::Timeout { .. } => RendezvousError::Timeout {
                        key: format!(
                            "{base}/* ({} ranks; {})",
                            self.world_size,
                            self.first_missing(&chunk)
                        ),
                        after: timeout,
                    },
                    RendezvousError::StoreRefused { addr, refusal } => {
                        // A rank's key was refused: the ranks waiting for
                        // `done` hear it too (from a store of ours).
                        let _ = self.client.pass_refusal(&done, &refusal);
                        RendezvousError::StoreRefused { addr, refusal }
                    }
                    other => other,
                });
            }
        }
        self.client
            .set_by(&done, BARRIER_PASSED, deadline)
            .map_err(|e| late(&done, e))
    }

    fn group(
        &self,
        name: &str,
        member: usize,
        size: usize,
    ) -> Result<Box<dyn Rendezvous>, RendezvousError> {
        let namespace = group_namespace(&self.namespace, name, member, size)?;
        Ok(Box::new(TcpRendezvous {
            rank: member,
            world_size: size,
            namespace,
            client: self.client.another(),
            server: self.server.clone(),
            barriers: BarrierCounters::default(),
        }))
    }
}

/// Logs a warning where the kernel's accept queue (`net.core.somaxconn`)
/// holds fewer connections than the world may open at once: past it the
/// kernel drops a connecting rank's SYN, which costs that rank 1 s (then
/// 3 s) before it tries again (store-bench at 16,384 ranks on one host:
/// thousands of drops at somaxconn 4096, none at 65535). Outside Linux, or
/// where the value cannot be read, nothing is said.
fn warn_if_accept_queue_short(world_size: usize) {
    let Some(queue) = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
    else {
        return;
    };
    if world_size > queue {
        tracing::warn!(
            world_size,
            somaxconn = queue,
            "the store's accept queue holds {queue} connections (net.core.somaxconn) \
             and {world_size} ranks may connect at once: a rank the kernel drops \
             waits 1-3 s to try again; raise it on this host \
             (sysctl -w net.core.somaxconn={world_size}) for a faster rendezvous"
        );
    }
}
