//! [`TcpRendezvous`]: rank agreement through a c10d TCPStore.
//!
//! The store is a launcher's (torchrun's agent's: every rank is a client)
//! or rank 0's own [`StoreServer`], bound on the wildcard address of the
//! master's family so that every host reaches it; rank 0 then talks to it
//! through a loopback client like every other rank. Every key starts with
//! the rendezvous's namespace. The id of generation `g` is set once by
//! rank 0 under `{ns}uid/{g}`; the others wait for it (`WAIT`, then `GET`).
//! A barrier sets `{ns}barrier/{name}/{n}/{rank}` and waits for every
//! rank's key in one `WAIT`: only idempotent queries, so a client may send
//! them again after a lost connection. Rank 0 must keep its rendezvous
//! alive while others use its store (end with a barrier before dropping it).
//! A group's rendezvous ([`Rendezvous::group`]) is a client of the same
//! store on a connection of its own (opened at its first query), under
//! `{ns}group/{name}/`; rank 0's store lives until its rendezvous and
//! every group made from it are gone.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::client::{StoreClient, reachable};
use super::launcher::{Launch, Launcher, StoreRole, bind_addr};
use super::server::StoreServer;
use super::{
    BarrierCounters, ID_LEN, Rendezvous, RendezvousError, TOKEN_ENV, check_rank, exchange_id_via,
    group_namespace, uid_key,
};

/// The namespace of a rendezvous that names none.
const DEFAULT_NAMESPACE: &str = "metrale/";

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
        let serve = (rank == 0).then_some(addr);
        Self::build(
            rank,
            world_size,
            serve,
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
        Self::build(rank, world_size, None, addr, token, namespace, timeout)
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
                let serve = (rank == 0).then(|| bind_addr(master));
                let token = launch.token.clone();
                Self::build(
                    rank,
                    world,
                    serve,
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

    /// Rank `rank` of `world_size`, serving a store on `serve` when given
    /// and connecting to `addr` otherwise; keys under `namespace`.
    pub(crate) fn build(
        rank: usize,
        world_size: usize,
        serve: Option<SocketAddr>,
        addr: SocketAddr,
        token: Option<String>,
        namespace: &str,
        timeout: Duration,
    ) -> Result<Self, RendezvousError> {
        check_rank(rank, world_size).map_err(|e| RendezvousError::BadSpec(e.to_string()))?;
        let (server, connect_to) = match serve {
            Some(bind) => {
                let server = StoreServer::bind(bind, token.clone())?;
                let local = reachable(server.local_addr());
                (Some(Arc::new(server)), local)
            }
            None => (None, addr),
        };
        let client = StoreClient::connect(connect_to, token, timeout)?;
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

    /// The store client, for callers that need raw keys.
    pub fn client(&self) -> &StoreClient {
        &self.client
    }

    /// The prefix of every key this rendezvous writes.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
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
        exchange_id_via(
            self.rank,
            uid_key(&self.namespace, generation),
            make,
            |k, v| self.client.set(k, v),
            |k| self.client.get(k, timeout),
        )
    }

    fn barrier(&self, name: &str, timeout: Duration) -> Result<(), RendezvousError> {
        let start = Instant::now();
        let n = self.barriers.next(name);
        let base = format!("{}barrier/{name}/{n}", self.namespace);
        self.client.set(&format!("{base}/{}", self.rank), b"1")?;
        let keys: Vec<String> = (0..self.world_size)
            .map(|r| format!("{base}/{r}"))
            .collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let left = timeout.saturating_sub(start.elapsed());
        self.client.wait(&keys, left).map_err(|e| match e {
            RendezvousError::Timeout { .. } => RendezvousError::Timeout {
                key: format!("{base}/* ({} ranks)", self.world_size),
                after: timeout,
            },
            other => other,
        })
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
