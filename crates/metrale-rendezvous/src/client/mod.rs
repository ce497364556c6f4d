//! [`StoreClient`]: a c10d TCPStore client (`proto`), for a store of ours
//! and for a launcher's (torchrun's agent store is PyTorch's).
//!
//! A connection starts with `VALIDATE`, then (with a token) `METRALE_AUTH`,
//! then (to a store of ours, [`StoreClient::connect_ours`]) `METRALE_HELLO`,
//! then a `PING`; its echo proves the server is a TCPStore and alive.
//!
//! Invariants:
//! - Every exchange has a deadline: connecting retries with jittered,
//!   doubling backoff (10 ms to 1 s) until the caller's deadline (until a
//!   connection was once opened: then a refused or reset connection is
//!   [`RendezvousError::StoreGone`] at once, the store's process gone), and a
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
//!
//! Lock order: a client's one lock (`conn`, its connection) is a leaf, held
//! for a whole query, waits and reconnects included (`exchange`), and no
//! other lock is taken under it; a client that must not wait behind
//! another's waits has a connection of its own (`another`).
//!
//! Parts: `connect` opens a connection (the handshake, the backoff),
//! `exchange` runs one query on a live connection (the retry loop, status
//! bytes, confirmed sets, the wait and its cancel), and `ops` is the public
//! query API, one method per query kind.

mod connect;
mod exchange;
mod ops;

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::RendezvousError;
use super::proto::{self, WireError};

pub(crate) use connect::{describe_holder, reachable};

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
    /// A connection was opened once: the store was up, so a refused or
    /// reset connection now means it is gone (no retry).
    reached: AtomicBool,
    /// The least time a (re)connection and its handshake get, whatever
    /// the query's deadline.
    min_connect: Duration,
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
            reached: AtomicBool::new(false),
            min_connect: MIN_CONNECT,
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
            reached: AtomicBool::new(self.reached.load(Ordering::Acquire)),
            min_connect: self.min_connect,
            conn: Mutex::new(None),
        }
    }

    /// [`StoreClient::another`] whose connection, too, is bounded by each
    /// query's deadline (not given at least [`MIN_CONNECT`]): for a short
    /// query that must end by its deadline on a frozen store (a census).
    pub(crate) fn another_within_deadlines(&self) -> StoreClient {
        StoreClient {
            min_connect: Duration::ZERO,
            ..self.another()
        }
    }

    /// Whether the client's connection speaks this crate's extension.
    pub fn speaks_extension(&self) -> bool {
        self.conn.lock().as_ref().is_some_and(|l| l.ext)
    }

    /// The server's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// A nonce whose complement never looks like a reply's small length or a
/// status byte followed by the nonce.
fn nonce() -> u32 {
    rand::random::<u32>() | 1
}
