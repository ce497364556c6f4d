//! Opening a connection to the store: the handshake (`VALIDATE`, then
//! `METRALE_AUTH` with a token, `METRALE_HELLO` when asking for the
//! extension, then a `PING`), sent in one write and read back in order;
//! the jittered, doubling backoff between tries until the caller's
//! deadline; and `describe_holder`, which says who answers on a taken
//! port.
//!
//! Invariants:
//! - The handshake's replies are read by the caller's deadline clamped to
//!   between 1 s and the client's I/O limit from the connect.
//! - A close at `METRALE_AUTH` is a transport error of kind
//!   `ConnectionAborted` (after a few such, a PyTorch store: an error
//!   naming the token variable); a close at `METRALE_HELLO` is one of kind
//!   `Unsupported` (the store does not speak the extension: it is not
//!   asked again). Every other transport failure is retried until the
//!   deadline; any other failure (a refusal, a wrong token, a peer that is
//!   not a TCPStore) is final.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::super::limits::StoreRefusal;
use super::super::proto::{self, Query, query};
use super::super::{RendezvousError, TOKEN_ENV};
use super::{AUTH_CLOSED_TRIES, EXT_REFUSED, EXT_TRY, Fail, Live, StoreClient, transport, wire};

/// The loopback address of `addr`'s family when `addr` is a wildcard.
pub(crate) fn reachable(addr: SocketAddr) -> SocketAddr {
    let mut a = addr;
    if a.ip().is_unspecified() {
        a.set_ip(match a.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    a
}

/// Says who answers on `addr`, for an "address in use" error.
pub(crate) fn describe_holder(addr: SocketAddr) -> String {
    let target = reachable(addr);
    let Ok(mut s) = TcpStream::connect_timeout(&target, Duration::from_millis(500)) else {
        return "nothing answers on it from this host (a socket still closing, or a \
                listener of the other address family)"
            .to_owned();
    };
    let nonce: u32 = rand::random();
    let mut q = Query::new(query::VALIDATE)
        .u32(proto::VALIDATION_MAGIC)
        .bytes()
        .to_vec();
    q.extend_from_slice(Query::new(query::PING).u32(nonce).bytes());
    let deadline = proto::after(Duration::from_secs(1));
    let answers = s.set_write_timeout(Some(Duration::from_secs(1))).is_ok()
        && proto::send(&mut s, &q).is_ok()
        && proto::read_u32_by(&mut s, deadline).is_ok_and(|echo| echo == nonce);
    if answers {
        "a c10d TCPStore answers on it (torchrun's agent, a PyTorch rank 0, or the rank 0 \
         of another job)"
            .to_owned()
    } else {
        "another program listens on it (it does not answer as a c10d TCPStore)".to_owned()
    }
}

pub(super) fn sleep_backoff(pause: &mut Duration, deadline: Instant) {
    let left = deadline.saturating_duration_since(Instant::now());
    let jittered = pause.mul_f64(rand::random_range(0.5..1.5));
    std::thread::sleep(jittered.min(left));
    *pause = (*pause * 2).min(Duration::from_secs(1));
}

impl StoreClient {
    fn refused(&self, refusal: StoreRefusal) -> Fail {
        Fail::Fatal(RendezvousError::StoreRefused {
            addr: self.addr,
            refusal,
        })
    }

    pub(super) fn open(&self, deadline: Instant) -> Result<Live, RendezvousError> {
        let mut pause = Duration::from_millis(10);
        let mut auth_closed = 0;
        loop {
            let err = match self.try_open(deadline) {
                Ok(live) => {
                    self.reached.store(true, Ordering::Release);
                    return Ok(live);
                }
                Err(Fail::Fatal(e) | Fail::Clean(e)) => return Err(e),
                Err(Fail::Transport(e)) => e,
            };
            if self.reached.load(Ordering::Acquire)
                && matches!(
                    err.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset
                )
            {
                return Err(RendezvousError::StoreGone {
                    addr: self.addr,
                    source: err,
                });
            }
            if err.kind() == std::io::ErrorKind::Unsupported {
                tracing::debug!(addr = %self.addr, "the store does not speak this crate's extension; going on without it");
                self.ext.store(EXT_REFUSED, Ordering::Release);
                continue;
            }
            if err.kind() == std::io::ErrorKind::ConnectionAborted {
                auth_closed += 1;
                if auth_closed >= AUTH_CLOSED_TRIES {
                    return Err(RendezvousError::Protocol(format!(
                        "the store at {} closes the connection at this client's \
                         {TOKEN_ENV} proof: it is a PyTorch store (torchrun's agent \
                         store, for one), which has no authentication; unset \
                         {TOKEN_ENV} for it",
                        self.addr
                    )));
                }
            }
            tracing::trace!(addr = %self.addr, error = %err, "store not reachable yet");
            if Instant::now() >= deadline {
                return Err(RendezvousError::io(
                    format!(
                        "connecting to the store at {} (gave up at the deadline)",
                        self.addr
                    ),
                    err,
                ));
            }
            sleep_backoff(&mut pause, deadline);
        }
    }

    fn try_open(&self, deadline: Instant) -> Result<Live, Fail> {
        let now = Instant::now();
        let budget = deadline
            .saturating_duration_since(now)
            .clamp(Duration::from_millis(10), Duration::from_secs(5));
        let mut stream = TcpStream::connect_timeout(&self.addr, budget).map_err(transport)?;
        stream.set_nodelay(true).map_err(transport)?;
        stream
            .set_write_timeout(Some(self.io_timeout))
            .map_err(transport)?;
        let shake = deadline
            .max(now + self.min_connect)
            .min(now + self.io_timeout);
        let mut q = Query::new(query::VALIDATE)
            .u32(proto::VALIDATION_MAGIC)
            .bytes()
            .to_vec();
        if let Some(token) = &self.token {
            q.extend_from_slice(
                Query::new(query::METRALE_AUTH)
                    .blob(token.as_bytes())
                    .bytes(),
            );
        }
        let hello = self.ext.load(Ordering::Acquire) == EXT_TRY;
        if hello {
            q.extend_from_slice(
                Query::new(query::METRALE_HELLO)
                    .u32(proto::EXT_VERSION)
                    .bytes(),
            );
        }
        q.extend_from_slice(Query::new(query::PING).u32(self.nonce).bytes());
        proto::send(&mut stream, &q).map_err(transport)?;
        if self.token.is_some() {
            match proto::read_u8_by(&mut stream, shake) {
                Ok(proto::AUTH_OK) => {}
                Ok(proto::AUTH_REFUSED) => return Err(Fail::Fatal(RendezvousError::Unauthorized)),
                Ok(proto::AUTH_LIMIT) => {
                    let r = proto::read_refusal(&mut stream, shake).map_err(wire)?;
                    return Err(self.refused(r));
                }
                Ok(other) => {
                    return Err(Fail::Fatal(RendezvousError::Protocol(format!(
                        "METRALE_AUTH answered {other}"
                    ))));
                }
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return Err(transport(e)),
                Err(e) => {
                    return Err(Fail::Transport(std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        format!("closed at the token proof: {e}"),
                    )));
                }
            }
        }
        let mut live = Live {
            stream,
            used: Instant::now(),
            ext: false,
        };
        if hello {
            match proto::read_u8_by(&mut live.stream, shake) {
                Ok(proto::STATUS_OK) => {
                    proto::read_u32_by(&mut live.stream, shake).map_err(transport)?;
                    live.ext = true;
                }
                Ok(proto::STATUS_REFUSED) => {
                    let r = proto::read_refusal(&mut live.stream, shake).map_err(wire)?;
                    return Err(self.refused(r));
                }
                Ok(other) => {
                    return Err(Fail::Fatal(RendezvousError::Protocol(format!(
                        "METRALE_HELLO answered {other}"
                    ))));
                }
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return Err(transport(e)),
                Err(e) => {
                    return Err(Fail::Transport(std::io::Error::new(
                        std::io::ErrorKind::Unsupported,
                        format!("closed at METRALE_HELLO: {e}"),
                    )));
                }
            }
        }
        self.status(&mut live, shake)?;
        let echo = proto::read_u32_by(&mut live.stream, shake).map_err(transport)?;
        if self.token.is_none() && echo == !self.nonce {
            // A store of ours with a token says so this way.
            return Err(Fail::Fatal(RendezvousError::Unauthorized));
        }
        if echo != self.nonce {
            return Err(Fail::Fatal(RendezvousError::Protocol(format!(
                "PING answered {echo:#x}, not this client's nonce: the peer is not a c10d TCPStore"
            ))));
        }
        live.used = Instant::now();
        Ok(live)
    }
}
