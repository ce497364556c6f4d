//! [`TcpRendezvous`]: rank agreement through the TCP store.
//!
//! Rank 0 binds a [`StoreServer`] on the master address and talks to it
//! through a loopback client like every other rank. The id of generation `g`
//! is set once by rank 0 under `metrale/uid/{g}`; the others wait for it with
//! a store-side get. A barrier adds 1 to `metrale/barrier/{name}/{n}/count`;
//! the rank whose add reaches the world size sets `.../done`, which every
//! rank awaits. Rank 0 must keep its rendezvous alive while others use the
//! store (end with a barrier before dropping it).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use super::store::{StoreClient, StoreServer};
use super::{BarrierCounters, ID_LEN, Rendezvous, RendezvousError, check_rank, exchange_id_via};

/// Rank agreement over a [`StoreServer`] hosted by rank 0.
#[derive(Debug)]
pub struct TcpRendezvous {
    rank: usize,
    world_size: usize,
    client: StoreClient,
    server: Option<StoreServer>,
    barriers: BarrierCounters,
}

impl TcpRendezvous {
    /// Rank 0 binds the store on `addr` and connects to it; other ranks
    /// connect to `addr`, retrying until `timeout`.
    pub fn new(
        rank: usize,
        world_size: usize,
        addr: SocketAddr,
        token: Option<String>,
        timeout: Duration,
    ) -> Result<Self, RendezvousError> {
        check_rank(rank, world_size).map_err(|e| RendezvousError::BadSpec(e.to_string()))?;
        let (server, connect_to) = if rank == 0 {
            let server = StoreServer::bind(addr, token.clone())?;
            let mut local = server.local_addr();
            if local.ip().is_unspecified() {
                local.set_ip(match local.ip() {
                    IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                    IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
                });
            }
            (Some(server), local)
        } else {
            (None, addr)
        };
        let client = StoreClient::connect(connect_to, token, timeout)?;
        tracing::debug!(rank, world_size, addr = %connect_to, "tcp rendezvous connected");
        Ok(TcpRendezvous {
            rank,
            world_size,
            client,
            server,
            barriers: BarrierCounters::default(),
        })
    }

    /// The address rank 0's store listens on (`None` on other ranks).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(StoreServer::local_addr)
    }

    /// The store client, for callers that need raw keys.
    pub fn client(&self) -> &StoreClient {
        &self.client
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
            generation,
            make,
            |k, v| self.client.set(k, v),
            |k| self.client.get(k, timeout),
        )
    }

    fn barrier(&self, name: &str, timeout: Duration) -> Result<(), RendezvousError> {
        let start = Instant::now();
        let n = self.barriers.next(name);
        let base = format!("metrale/barrier/{name}/{n}");
        let arrived = self.client.add(&format!("{base}/count"), 1)?;
        let world = i64::try_from(self.world_size).unwrap_or(i64::MAX);
        if arrived == world {
            self.client.set(&format!("{base}/done"), b"1")?;
        } else if arrived > world {
            return Err(RendezvousError::Protocol(format!(
                "barrier {name:?} #{n}: {arrived} arrivals for world size {world}"
            )));
        }
        let left = timeout.saturating_sub(start.elapsed());
        self.client
            .get(&format!("{base}/done"), left)
            .map(|_| ())
            .map_err(|e| match e {
                RendezvousError::Timeout { key, .. } => RendezvousError::Timeout {
                    key,
                    after: timeout,
                },
                other => other,
            })
    }
}
