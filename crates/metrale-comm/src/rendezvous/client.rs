//! [`StoreClient`]: a c10d TCPStore client (`proto`), for a store of ours
//! and for a launcher's (torchrun's agent store is PyTorch's).
//!
//! A connection starts with `VALIDATE`, then (with a token) `METRALE_AUTH`,
//! then (to a store of ours, [`StoreClient::connect_ours`]) `METRALE_HELLO`,
//! then a `PING`; its echo proves the server is a TCPStore and alive.
//!
//! Invariants:
//! - Every exchange has a deadline: connecting retries with jittered,
//!   doubling backoff (10 ms to 1 s) until the caller's deadline, and a
//!   connection lost in the middle of an idempotent query (set, get, wait,
//!   check, multi-get, multi-set, compare-set, key count, ping) is replaced
//!   and the query sent again within the same deadline. `add`, `append`
//!   and `delete_key` are not sent again once sent.
//! - A `SET`, `MULTI_SET` or `APPEND` is followed by a `PING` on the same
//!   connection: the store answers queries in order, so the echo proves it
//!   applied the set (the protocol has no reply for it); a store of ours
//!   that refused it (full) answers with the nonce's complement.
//! - A wait that reaches its deadline sends `CANCEL_WAIT` and reads the
//!   store's last word, so the connection stays in step; a `STOP_WAITING`
//!   that crossed the cancel means the keys are there.
//! - A connection unused for half of a store's idle limit is replaced before
//!   use (a store of ours closes idle connections), and a query that is
//!   sent only once goes on a connection a `PING` just proved alive.
//! - A store of ours with a token answers the `PING` of a client without
//!   one with the nonce's complement: [`RendezvousError::Unauthorized`].
//! - Replies are bounded (64 MiB a value) and allocated as they arrive.
//! - On a connection that speaks the extension every reply starts with a
//!   status byte; a refusal in its place is
//!   [`RendezvousError::StoreRefused`], which names the limit, its value
//!   and the variable that raises it; the connection stays in step (the
//!   store closes it only after a query it could not read whole, found at
//!   the next use). A store that closes the connection at
//!   `METRALE_HELLO` does not speak the extension (a PyTorch store, or an
//!   older one of ours): the client goes on without it, once.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::limits::StoreRefusal;
use super::proto::{self, Query, WireError, query};
use super::{RendezvousError, TOKEN_ENV};

/// The default limit for a client's non-waiting request.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Replace a connection unused for this long.
const STALE_AFTER: Duration = Duration::from_secs(300);
/// The largest value a reply may carry.
const MAX_REPLY_VALUE: usize = 64 << 20;
/// Connecting within a query's deadline gets at least this long.
const MIN_CONNECT: Duration = Duration::from_secs(1);
/// Connecting again after a store closed the connection at `METRALE_AUTH`.
const AUTH_CLOSED_TRIES: u32 = 3;

/// What went wrong in one exchange.
enum Fail {
    /// The transport failed: reconnect, and send again if idempotent.
    Transport(std::io::Error),
    /// The exchange failed; the connection is out of step: drop it.
    Fatal(RendezvousError),
    /// The exchange failed; the connection is still in step.
    Clean(RendezvousError),
}

fn wire(e: WireError) -> Fail {
    match e {
        WireError::Io(e) => Fail::Transport(e),
        WireError::Malformed(m) => Fail::Fatal(RendezvousError::Protocol(m)),
    }
}

fn transport(e: std::io::Error) -> Fail {
    Fail::Transport(e)
}

struct Live {
    stream: TcpStream,
    used: Instant,
    /// The connection speaks the extension (status bytes, refusals).
    ext: bool,
}

/// No answer to a `WAIT` by its deadline (never a byte the store sends).
const TIMED_OUT: u8 = 0xFF;

/// Whether to ask for the extension.
const EXT_NO: u8 = 0;
const EXT_TRY: u8 = 1;
/// The store closed the connection at `METRALE_HELLO`: not again.
const EXT_REFUSED: u8 = 2;

/// A client of a c10d TCPStore. `Send + Sync`: requests are serialized by
/// an internal lock (a wait holds it for its wait).
pub struct StoreClient {
    addr: SocketAddr,
    token: Option<String>,
    io_timeout: Duration,
    nonce: u32,
    ext: AtomicU8,
    conn: Mutex<Option<Live>>,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.addr)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

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

fn sleep_backoff(pause: &mut Duration, deadline: Instant) {
    let left = deadline.saturating_duration_since(Instant::now());
    let jittered = pause.mul_f64(rand::random_range(0.5..1.5));
    std::thread::sleep(jittered.min(left));
    *pause = (*pause * 2).min(Duration::from_secs(1));
}

impl StoreClient {
    /// Connects to the store at `addr`, retrying until `timeout` (rank 0
    /// may start later), and presents `token` when given (a store of ours
    /// with a token requires it; a PyTorch store refuses any).
    pub fn connect(
        addr: SocketAddr,
        token: Option<String>,
        timeout: Duration,
    ) -> Result<StoreClient, RendezvousError> {
        Self::connect_as(addr, token, timeout, EXT_NO)
    }

    /// As [`StoreClient::connect`], to a store this crate serves (rank 0's):
    /// the connection speaks this crate's extension, so that a query the
    /// store refuses at a limit is a [`RendezvousError::StoreRefused`]
    /// naming it. A store that does not speak it (a PyTorch store) is used
    /// without it.
    pub fn connect_ours(
        addr: SocketAddr,
        token: Option<String>,
        timeout: Duration,
    ) -> Result<StoreClient, RendezvousError> {
        Self::connect_as(addr, token, timeout, EXT_TRY)
    }

    fn connect_as(
        addr: SocketAddr,
        token: Option<String>,
        timeout: Duration,
        ext: u8,
    ) -> Result<StoreClient, RendezvousError> {
        let client = StoreClient {
            addr,
            token: token.filter(|t| !t.is_empty()),
            io_timeout: DEFAULT_IO_TIMEOUT,
            nonce: nonce(),
            ext: AtomicU8::new(ext),
            conn: Mutex::new(None),
        };
        let live = client.open(proto::after(timeout))?;
        *client.conn.lock() = Some(live);
        Ok(client)
    }

    /// Another client of the same store and token, with a connection of
    /// its own (so that neither waits behind the other's waits), opened at
    /// its first query.
    pub(crate) fn another(&self) -> StoreClient {
        StoreClient {
            addr: self.addr,
            token: self.token.clone(),
            io_timeout: self.io_timeout,
            nonce: nonce(),
            ext: AtomicU8::new(self.ext.load(Ordering::Acquire)),
            conn: Mutex::new(None),
        }
    }

    /// Whether the client's connection speaks this crate's extension.
    pub fn speaks_extension(&self) -> bool {
        self.conn.lock().as_ref().is_some_and(|l| l.ext)
    }

    fn refused(&self, refusal: StoreRefusal) -> Fail {
        Fail::Fatal(RendezvousError::StoreRefused {
            addr: self.addr,
            refusal,
        })
    }

    /// Reads a reply's status byte (on a connection that speaks the
    /// extension): a refusal in its place is the store's reason.
    fn status(&self, live: &mut Live, deadline: Instant) -> Result<(), Fail> {
        if !live.ext {
            return Ok(());
        }
        match proto::read_u8_by(&mut live.stream, deadline) {
            Ok(proto::STATUS_OK) => Ok(()),
            Ok(proto::STATUS_REFUSED) => {
                let r = proto::read_refusal(&mut live.stream, self.io_deadline()).map_err(wire)?;
                // The store keeps a connection whose query it read whole.
                Err(Fail::Clean(RendezvousError::StoreRefused {
                    addr: self.addr,
                    refusal: r,
                }))
            }
            Ok(other) => Err(Fail::Fatal(RendezvousError::Protocol(format!(
                "a reply's status byte is {other}"
            )))),
            Err(e) => Err(Fail::Transport(e)),
        }
    }

    /// The server's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    fn open(&self, deadline: Instant) -> Result<Live, RendezvousError> {
        let mut pause = Duration::from_millis(10);
        let mut auth_closed = 0;
        loop {
            let err = match self.try_open(deadline) {
                Ok(live) => return Ok(live),
                Err(Fail::Fatal(e) | Fail::Clean(e)) => return Err(e),
                Err(Fail::Transport(e)) => e,
            };
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
            .max(now + Duration::from_secs(1))
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

    /// Runs `op` on a live connection by `deadline`, reconnecting (and,
    /// when `retry`, running it again) after a transport failure.
    fn call<T>(
        &self,
        what: &str,
        deadline: Instant,
        retry: bool,
        mut op: impl FnMut(&mut Live, Instant) -> Result<T, Fail>,
    ) -> Result<T, RendezvousError> {
        let mut guard = self.conn.lock();
        let mut pause = Duration::from_millis(10);
        loop {
            if guard
                .as_ref()
                .is_none_or(|live| live.used.elapsed() >= STALE_AFTER)
            {
                *guard = None;
                *guard = Some(self.open(deadline.max(proto::after(MIN_CONNECT)))?);
            }
            let Some(live) = guard.as_mut() else {
                return Err(RendezvousError::Closed);
            };
            if !retry {
                // A query sent only once goes on a connection just proven
                // alive: the store may have closed an idle one.
                match self.ping_on(live) {
                    Ok(()) => {}
                    Err(Fail::Transport(e)) => {
                        tracing::debug!(error = %e, what, "store connection gone; reconnecting");
                        *guard = None;
                        continue;
                    }
                    Err(Fail::Fatal(e) | Fail::Clean(e)) => {
                        *guard = None;
                        return Err(e);
                    }
                }
            }
            match op(live, deadline) {
                Ok(v) => {
                    live.used = Instant::now();
                    return Ok(v);
                }
                Err(Fail::Clean(e)) => {
                    live.used = Instant::now();
                    return Err(e);
                }
                Err(Fail::Fatal(e)) => {
                    *guard = None;
                    return Err(e);
                }
                Err(Fail::Transport(e)) => {
                    *guard = None;
                    if !retry || Instant::now() >= deadline {
                        return Err(RendezvousError::io(
                            format!("{what} at the store {}", self.addr),
                            e,
                        ));
                    }
                    tracing::debug!(error = %e, what, "store connection lost; sending again");
                    sleep_backoff(&mut pause, deadline);
                }
            }
        }
    }

    fn ping_on(&self, live: &mut Live) -> Result<(), Fail> {
        proto::send(
            &mut live.stream,
            Query::new(query::PING).u32(self.nonce).bytes(),
        )
        .map_err(transport)?;
        self.status(live, self.io_deadline())?;
        let echo = proto::read_u32_by(&mut live.stream, self.io_deadline()).map_err(transport)?;
        if echo == self.nonce {
            Ok(())
        } else {
            Err(Fail::Fatal(RendezvousError::Protocol(format!(
                "PING answered {echo:#x}"
            ))))
        }
    }

    fn io_deadline(&self) -> Instant {
        proto::after(self.io_timeout)
    }

    /// Sends `q` and a `PING`; the echo proves the store applied `q`.
    fn send_confirmed(&self, live: &mut Live, q: &Query) -> Result<(), Fail> {
        let mut bytes = q.bytes().to_vec();
        bytes.extend_from_slice(Query::new(query::PING).u32(self.nonce).bytes());
        proto::send(&mut live.stream, &bytes).map_err(transport)?;
        if let Err(refused) = self.status(live, self.io_deadline()) {
            // A refused set has no reply of its own: its refusal comes in
            // place of the PING's, which still follows on a connection
            // the store keeps.
            let Fail::Clean(e) = refused else {
                return Err(refused);
            };
            let in_step = self.status(live, self.io_deadline()).is_ok()
                && proto::read_u32_by(&mut live.stream, self.io_deadline())
                    .is_ok_and(|echo| echo == self.nonce);
            return Err(if in_step {
                Fail::Clean(e)
            } else {
                Fail::Fatal(e)
            });
        }
        let echo = proto::read_u32_by(&mut live.stream, self.io_deadline()).map_err(transport)?;
        if echo == !self.nonce {
            return Err(Fail::Fatal(RendezvousError::Protocol(format!(
                "the store at {} refused the query: it is full or the value is over its \
                 limit (see the store's log)",
                self.addr
            ))));
        }
        if echo != self.nonce {
            return Err(Fail::Fatal(RendezvousError::Protocol(format!(
                "PING answered {echo:#x}, not this client's nonce"
            ))));
        }
        Ok(())
    }

    /// Sends `q` and reads its reply's status byte.
    fn ask(&self, live: &mut Live, q: &Query) -> Result<(), Fail> {
        proto::send(&mut live.stream, q.bytes()).map_err(transport)?;
        self.status(live, self.io_deadline())
    }

    fn read_value(&self, live: &mut Live) -> Result<Vec<u8>, Fail> {
        let deadline = self.io_deadline();
        let len = proto::read_len_by(&mut live.stream, deadline, MAX_REPLY_VALUE, "value")
            .map_err(wire)?;
        proto::read_blob_by(&mut live.stream, deadline, len, |_| Ok(())).map_err(wire)
    }

    fn read_i64(&self, live: &mut Live) -> Result<i64, Fail> {
        let v = proto::read_u64_by(&mut live.stream, self.io_deadline()).map_err(transport)?;
        Ok(v as i64)
    }

    /// Waits on `keys` until `deadline` on one connection (see the module
    /// docs for the cancel).
    fn wait_on(
        &self,
        live: &mut Live,
        keys: &[&str],
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(), Fail> {
        proto::send(&mut live.stream, Query::new(query::WAIT).keys(keys).bytes())
            .map_err(transport)?;
        // The status byte (when the connection has one) and the answer
        // arrive together, whenever the wait ends.
        let first = proto::read_u8_by(&mut live.stream, deadline);
        let answer = match (live.ext, first) {
            (true, Ok(proto::STATUS_OK)) => {
                proto::read_u8_by(&mut live.stream, self.io_deadline()).map_err(transport)?
            }
            (true, Ok(proto::STATUS_REFUSED)) => {
                let r = proto::read_refusal(&mut live.stream, self.io_deadline()).map_err(wire)?;
                return Err(Fail::Clean(RendezvousError::StoreRefused {
                    addr: self.addr,
                    refusal: r,
                }));
            }
            (_, Ok(b)) => b,
            (_, Err(e)) if e.kind() == std::io::ErrorKind::TimedOut => TIMED_OUT,
            (_, Err(e)) => return Err(transport(e)),
        };
        match answer {
            proto::STOP_WAITING => return Ok(()),
            TIMED_OUT => {}
            other => {
                return Err(Fail::Fatal(RendezvousError::Protocol(format!(
                    "WAIT answered {other}"
                ))));
            }
        }
        let timed_out = || RendezvousError::Timeout {
            key: keys.join(", "),
            after: timeout,
        };
        proto::send(&mut live.stream, Query::new(query::CANCEL_WAIT).bytes())
            .map_err(|_| Fail::Fatal(timed_out()))?;
        // Either WAIT_CANCELED, or a STOP_WAITING that crossed the cancel
        // and then WAIT_CANCELED.
        let read_answer = |live: &mut Live| -> Result<u8, Fail> {
            self.status(live, self.io_deadline())?;
            proto::read_u8_by(&mut live.stream, self.io_deadline())
                .map_err(|_| Fail::Fatal(timed_out()))
        };
        match read_answer(live)? {
            proto::WAIT_CANCELED => Err(Fail::Clean(timed_out())),
            proto::STOP_WAITING => {
                read_answer(live)?;
                Ok(())
            }
            other => Err(Fail::Fatal(RendezvousError::Protocol(format!(
                "CANCEL_WAIT answered {other}"
            )))),
        }
    }

    /// Sets `key` to `value`, waking every wait on it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        let q = Query::new(query::SET).blob(key.as_bytes()).blob(value);
        self.call("set", self.io_deadline(), true, |live, _| {
            self.send_confirmed(live, &q)
        })
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, RendezvousError> {
        let deadline = proto::after(timeout);
        self.call("get", deadline, true, |live, deadline| {
            self.wait_on(live, &[key], deadline, timeout)?;
            self.ask(live, &Query::new(query::GET).blob(key.as_bytes()))?;
            self.read_value(live)
        })
    }

    /// Waits up to `timeout` until every key of `keys` exists.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), RendezvousError> {
        let deadline = proto::after(timeout);
        self.call("wait", deadline, true, |live, deadline| {
            self.wait_on(live, keys, deadline, timeout)
        })
    }

    /// Whether every key of `keys` exists now (a non-empty queue counts).
    pub fn check(&self, keys: &[&str]) -> Result<bool, RendezvousError> {
        let q = Query::new(query::CHECK).keys(keys);
        self.call("check", self.io_deadline(), true, |live, _| {
            self.ask(live, &q)?;
            match proto::read_u8_by(&mut live.stream, self.io_deadline()).map_err(transport)? {
                proto::CHECK_READY => Ok(true),
                proto::CHECK_NOT_READY => Ok(false),
                other => Err(Fail::Fatal(RendezvousError::Protocol(format!(
                    "CHECK answered {other}"
                )))),
            }
        })
    }

    /// Adds `delta` to the counter `key` (absent counts as 0) and returns
    /// the new value; atomic across clients. Not sent again after a
    /// connection loss. A store of ours refuses an `ADD` that would
    /// overflow (PyTorch's wraps).
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, RendezvousError> {
        let q = Query::new(query::ADD).blob(key.as_bytes()).i64(delta);
        self.call("add", self.io_deadline(), false, |live, _| {
            self.ask(live, &q)?;
            self.read_i64(live)
        })
    }

    /// Sets `key` to `desired` if it holds `expected` (or is absent and
    /// `expected` is empty); returns what `key` holds afterwards (PyTorch's
    /// semantics: `expected` itself when the key is absent and `expected`
    /// is not empty).
    pub fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, RendezvousError> {
        let q = Query::new(query::COMPARE_SET)
            .blob(key.as_bytes())
            .blob(expected)
            .blob(desired);
        self.call("compare_set", self.io_deadline(), true, |live, _| {
            self.ask(live, &q)?;
            self.read_value(live)
        })
    }

    /// The values of `keys`, waiting up to `timeout` for all of them.
    pub fn multi_get(
        &self,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, RendezvousError> {
        let deadline = proto::after(timeout);
        self.call("multi_get", deadline, true, |live, deadline| {
            self.wait_on(live, keys, deadline, timeout)?;
            self.ask(live, &Query::new(query::MULTI_GET).keys(keys))?;
            keys.iter().map(|_| self.read_value(live)).collect()
        })
    }

    /// Sets every `(key, value)` pair, or (refused) none.
    pub fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), RendezvousError> {
        let mut q = Query::new(query::MULTI_SET).u64(pairs.len() as u64);
        for (k, v) in pairs {
            q = q.blob(k.as_bytes()).blob(v);
        }
        self.call("multi_set", self.io_deadline(), true, |live, _| {
            self.send_confirmed(live, &q)
        })
    }

    /// Appends `value` to `key` (creating it). Not sent again after a
    /// connection loss.
    pub fn append(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        let q = Query::new(query::APPEND).blob(key.as_bytes()).blob(value);
        self.call("append", self.io_deadline(), false, |live, _| {
            self.send_confirmed(live, &q)
        })
    }

    /// Deletes `key`; whether it existed. Not sent again after a
    /// connection loss.
    pub fn delete_key(&self, key: &str) -> Result<bool, RendezvousError> {
        let q = Query::new(query::DELETE_KEY).blob(key.as_bytes());
        self.call("delete_key", self.io_deadline(), false, |live, _| {
            self.ask(live, &q)?;
            Ok(self.read_i64(live)? == 1)
        })
    }

    /// The number of keys the store holds (queues not counted).
    pub fn num_keys(&self) -> Result<i64, RendezvousError> {
        self.call("num_keys", self.io_deadline(), true, |live, _| {
            self.ask(live, &Query::new(query::GETNUMKEYS))?;
            self.read_i64(live)
        })
    }

    /// Every key the store holds (queues not listed), as PyTorch's
    /// `LIST_KEYS` answers (`/`-prefixed where PyTorch's Python client set
    /// them).
    pub fn list_keys(&self) -> Result<Vec<String>, RendezvousError> {
        self.call("list_keys", self.io_deadline(), true, |live, _| {
            self.ask(live, &Query::new(query::LIST_KEYS))?;
            let n = self.read_i64(live)?;
            let n = usize::try_from(n).map_err(|_| {
                Fail::Fatal(RendezvousError::Protocol(format!(
                    "LIST_KEYS answered {n} keys"
                )))
            })?;
            (0..n)
                .map(|_| Ok(String::from_utf8_lossy(&self.read_value(live)?).into_owned()))
                .collect()
        })
    }

    /// Appends `value` to the queue `key`, ending one wait on it. Not sent
    /// again after a connection loss.
    pub fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        let q = Query::new(query::QUEUE_PUSH)
            .blob(key.as_bytes())
            .blob(value);
        self.call("queue_push", self.io_deadline(), false, |live, _| {
            self.send_confirmed(live, &q)
        })
    }

    /// Takes the first value of the queue `key`: with `wait`, waits up to
    /// that long for one (a [`RendezvousError::Timeout`] after it);
    /// without, `None` when the queue is empty. Not sent again after a
    /// connection loss.
    pub fn queue_pop(
        &self,
        key: &str,
        wait: Option<Duration>,
    ) -> Result<Option<Vec<u8>>, RendezvousError> {
        if let Some(timeout) = wait {
            self.wait(&[key], timeout)?;
        }
        let q = Query::new(query::QUEUE_POP).blob(key.as_bytes());
        self.call("queue_pop", self.io_deadline(), false, |live, _| {
            self.ask(live, &q)?;
            if self.read_i64(live)? > 0 {
                Ok(Some(self.read_value(live)?))
            } else {
                Ok(None)
            }
        })
    }

    /// The length of the queue `key` (0 when it has none).
    pub fn queue_len(&self, key: &str) -> Result<i64, RendezvousError> {
        let q = Query::new(query::QUEUE_LEN).blob(key.as_bytes());
        self.call("queue_len", self.io_deadline(), true, |live, _| {
            self.ask(live, &q)?;
            self.read_i64(live)
        })
    }

    /// Ends every wait on `key` with `refusal` (which this client got),
    /// where the store speaks this crate's extension; elsewhere nothing.
    pub(crate) fn pass_refusal(
        &self,
        key: &str,
        refusal: &StoreRefusal,
    ) -> Result<(), RendezvousError> {
        let q = Query::new(query::METRALE_REFUSE)
            .blob(key.as_bytes())
            .blob(&proto::refusal_bytes(refusal));
        self.call("pass_refusal", self.io_deadline(), true, |live, _| {
            if live.ext { self.ask(live, &q) } else { Ok(()) }
        })
    }

    /// A round trip to the store.
    pub fn ping(&self) -> Result<(), RendezvousError> {
        self.call("ping", self.io_deadline(), true, |live, _| {
            self.ping_on(live)
        })
    }
}

/// A nonce whose complement never looks like a reply's small length or a
/// status byte followed by the nonce.
fn nonce() -> u32 {
    rand::random::<u32>() | 1
}
