//! [`StoreServer`]: a c10d TCPStore server (`proto`), served by rank 0 when
//! no launcher serves a store, and usable by a PyTorch process too.
//!
//! The queries themselves and the kept keys are in `queries`. One accept
//! thread (a non-blocking listener polled every few
//! milliseconds, so that shutdown never waits in `accept`) and one thread
//! per connection, with a small stack.
//!
//! Invariants:
//! - A connection first has [`StoreLimits::handshake`] in all to send
//!   `VALIDATE` (and, with a token, `METRALE_AUTH`): the deadline is on the
//!   whole handshake, so a peer trickling bytes is closed on time. Before
//!   it completes a connection can hold at most the 1 KiB of a token.
//!   With a token, a `PING` in place of `METRALE_AUTH` (a client without
//!   the token, PyTorch's for one) is answered with the complement of its
//!   nonce, which PyTorch's client reports as "Ping failed, invalid value
//!   returned from server", and the connection is closed; anything else is
//!   closed without a word.
//! - Once a query's first byte arrived, the whole query must arrive within
//!   [`StoreLimits::query`]. A connection with no query for
//!   [`StoreLimits::idle`] is closed, unless it waits on keys (at most 24 h).
//! - Lengths are checked before anything is allocated; a value grows as its
//!   bytes arrive. One query holds at most [`StoreLimits::max_query`] bytes;
//!   all queries in flight and all replies not yet written, over every
//!   connection, hold at most [`StoreLimits::in_flight`]; the keys and
//!   values kept hold at most [`StoreLimits::store_bytes`]. Whatever would
//!   pass a limit closes that connection (the protocol has no error reply),
//!   and nothing else; a query read whole and refused (the store is full)
//!   first answers a `PING` that follows with the nonce's complement.
//! - At [`StoreLimits::max_connections`] a new connection evicts one: the
//!   oldest still in its handshake, else the least recently active one not
//!   waiting on keys. New connections are refused only when every other
//!   connection waits on keys. A client of ours reconnects; with a token,
//!   connections that cannot authenticate are always the ones evicted.
//! - A reply is queued, then written by whichever thread holds the
//!   connection's writer (the connection's own, or a setter waking a
//!   waiter), in queue order: a `STOP_WAITING` and a `WAIT_CANCELED` are
//!   never reordered. A write that blocks past [`StoreLimits::write`] closes
//!   the connection; the store lock is never held while writing.
//! - Garbage never panics a thread (and a panic would only end its own
//!   connection); shutdown closes every connection and waits a bounded
//!   time for their threads.

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::RendezvousError;
use super::proto::{self, WireError, query};
use super::queries::{Data, handle};

/// How long the server keeps a connection with no query.
pub const DEFAULT_IDLE_LIMIT: Duration = Duration::from_secs(600);
/// The accept thread's poll period.
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// How long drop waits for connection threads to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// The longest a connection may wait on keys.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);
/// The stack of a connection thread.
const CONN_STACK: usize = 256 << 10;

const STAGE_HANDSHAKE: u8 = 0;
const STAGE_VALIDATED: u8 = 1;
const STAGE_READY: u8 = 2;

/// The server's bounds; [`StoreLimits::default`] gives the values below.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreLimits {
    /// From accept to the end of the handshake (10 s).
    pub handshake: Duration,
    /// From a query's first byte to its last (10 s).
    pub query: Duration,
    /// A connection with no query for this long is closed (600 s).
    pub idle: Duration,
    /// A reply that cannot be written for this long closes its connection (5 s).
    pub write: Duration,
    /// Connections served at once (1024).
    pub max_connections: usize,
    /// The longest key (8 KiB, as PyTorch's libuv server).
    pub max_key: usize,
    /// The longest value (1 MiB).
    pub max_value: usize,
    /// The bytes of keys and values one query may carry (4 MiB).
    pub max_query: usize,
    /// The keys one query may name (65536).
    pub max_keys_per_query: usize,
    /// Queries in flight and replies not yet written, all connections (64 MiB).
    pub in_flight: usize,
    /// Keys and values kept, plus 64 bytes per key (256 MiB).
    pub store_bytes: usize,
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits {
            handshake: Duration::from_secs(10),
            query: Duration::from_secs(10),
            idle: DEFAULT_IDLE_LIMIT,
            write: Duration::from_secs(5),
            max_connections: 1024,
            max_key: 8 << 10,
            max_value: 1 << 20,
            max_query: 4 << 20,
            max_keys_per_query: 1 << 16,
            in_flight: 64 << 20,
            store_bytes: 256 << 20,
        }
    }
}

/// What the server holds now (for operators and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreStats {
    /// Connections open (evicted ones still closing included).
    pub connections: usize,
    /// Connections evicted at the connection limit so far.
    pub evictions: u64,
    /// Bytes of queries in flight and of replies not yet written.
    pub in_flight_bytes: usize,
    /// Bytes counted against [`StoreLimits::store_bytes`].
    pub store_bytes: usize,
    /// Keys kept.
    pub keys: usize,
}

/// A byte budget shared by all connections.
#[derive(Debug)]
struct Budget {
    used: AtomicUsize,
    cap: usize,
}

impl Budget {
    fn try_take(&self, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|v| *v <= self.cap)
            })
            .is_ok()
    }

    fn give(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

/// The bytes one query holds, given back when it is done.
pub(super) struct Charge<'a> {
    budget: &'a Budget,
    taken: usize,
    limit: usize,
}

impl Charge<'_> {
    pub(super) fn take(&mut self, n: usize) -> Result<(), WireError> {
        if self.taken.saturating_add(n) > self.limit {
            return Err(WireError::Malformed(format!(
                "query of more than {} bytes",
                self.limit
            )));
        }
        if !self.budget.try_take(n) {
            return Err(WireError::Malformed(
                "the store's in-flight memory limit is reached".to_owned(),
            ));
        }
        self.taken += n;
        Ok(())
    }
}

impl Drop for Charge<'_> {
    fn drop(&mut self) {
        self.budget.give(self.taken);
    }
}

/// One client connection, shared by its thread, the registry and waits.
pub(super) struct Conn {
    pub(super) id: u64,
    peer: SocketAddr,
    socket: TcpStream,
    writer: Mutex<TcpStream>,
    out: Mutex<Vec<u8>>,
    out_cap: usize,
    budget: Arc<Budget>,
    accepted: Instant,
    accepted_ms: u64,
    stage: AtomicU8,
    last_ms: AtomicU64,
    pub(super) waiting: AtomicBool,
    closing: AtomicBool,
}

impl Conn {
    /// Queues reply bytes; a backlog over its cap closes the connection.
    pub(super) fn push(&self, bytes: &[u8]) {
        if self.closing.load(Ordering::Acquire) {
            return;
        }
        let mut out = self.out.lock();
        if out.len() + bytes.len() > self.out_cap || !self.budget.try_take(bytes.len()) {
            drop(out);
            tracing::debug!(peer = %self.peer, "store reply backlog over its limit; closing");
            self.kill();
            return;
        }
        out.extend_from_slice(bytes);
    }

    /// Writes the queued bytes unless another thread is writing them (which
    /// then writes these too: it checks the queue after letting go).
    pub(super) fn flush(&self) {
        loop {
            let Some(mut writer) = self.writer.try_lock() else {
                return;
            };
            loop {
                let chunk = std::mem::take(&mut *self.out.lock());
                if chunk.is_empty() {
                    break;
                }
                let written = proto::send(&mut writer, &chunk);
                self.budget.give(chunk.len());
                if let Err(e) = written {
                    drop(writer);
                    tracing::debug!(peer = %self.peer, error = %e, "store reply not written; closing");
                    self.kill();
                    return;
                }
            }
            drop(writer);
            if self.out.lock().is_empty() {
                return;
            }
        }
    }

    /// Closes the socket both ways; the connection's thread then ends.
    fn kill(&self) {
        if !self.closing.swap(true, Ordering::AcqRel) {
            // An error means the peer is already gone.
            let _ = self.socket.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.budget.give(self.out.get_mut().len());
    }
}

pub(super) struct Shared {
    pub(super) limits: StoreLimits,
    pub(super) token: Option<String>,
    epoch: Instant,
    stop: AtomicBool,
    pub(super) data: Mutex<Data>,
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    conns_changed: Condvar,
    next_conn: AtomicU64,
    evictions: AtomicU64,
    budget: Arc<Budget>,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// The store server. Dropping it (or [`StoreServer::shutdown`]) stops it
/// within a bounded time.
pub struct StoreServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .field("token", &self.shared.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving; with a
    /// `token`, only clients presenting it get past the handshake.
    pub fn bind(addr: SocketAddr, token: Option<String>) -> Result<StoreServer, RendezvousError> {
        Self::bind_with(addr, token, StoreLimits::default())
    }

    /// As [`StoreServer::bind`], closing connections idle for `idle_limit`.
    pub fn bind_with_idle_limit(
        addr: SocketAddr,
        token: Option<String>,
        idle_limit: Duration,
    ) -> Result<StoreServer, RendezvousError> {
        let limits = StoreLimits {
            idle: idle_limit,
            ..StoreLimits::default()
        };
        Self::bind_with(addr, token, limits)
    }

    /// As [`StoreServer::bind`], with `limits`.
    pub fn bind_with(
        addr: SocketAddr,
        token: Option<String>,
        limits: StoreLimits,
    ) -> Result<StoreServer, RendezvousError> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AddrInUse {
                RendezvousError::AddressInUse {
                    addr,
                    holder: super::client::describe_holder(addr),
                    hint: super::ADDRESS_IN_USE_HINT.to_owned(),
                }
            } else {
                RendezvousError::io(format!("binding the store on {addr}"), e)
            }
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| RendezvousError::io("reading the store's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| RendezvousError::io("configuring the store's listener", e))?;
        let mut limits = limits;
        limits.idle = limits.idle.max(Duration::from_millis(10));
        limits.max_connections = limits.max_connections.max(1);
        let shared = Arc::new(Shared {
            budget: Arc::new(Budget {
                used: AtomicUsize::new(0),
                cap: limits.in_flight,
            }),
            limits,
            token: token.filter(|t| !t.is_empty()),
            epoch: Instant::now(),
            stop: AtomicBool::new(false),
            data: Mutex::new(Data::default()),
            conns: Mutex::new(HashMap::new()),
            conns_changed: Condvar::new(),
            next_conn: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        });
        let accept_shared = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("metrale-store-accept".to_owned())
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|e| RendezvousError::io("spawning the store's accept thread", e))?;
        tracing::debug!(addr = %local, "store server listening");
        Ok(StoreServer {
            shared,
            addr: local,
            accept: Some(accept),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the server holds now.
    pub fn stats(&self) -> StoreStats {
        let (store_bytes, keys) = {
            let data = self.shared.data.lock();
            (data.bytes, data.map.len())
        };
        StoreStats {
            connections: self.shared.conns.lock().len(),
            evictions: self.shared.evictions.load(Ordering::Relaxed),
            in_flight_bytes: self.shared.budget.used.load(Ordering::Acquire),
            store_bytes,
            keys,
        }
    }

    /// Stops the server (the same as dropping it).
    pub fn shutdown(self) {
        drop(self);
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(accept) = self.accept.take()
            && accept.join().is_err()
        {
            tracing::error!("the store's accept thread panicked");
        }
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        let mut conns = self.shared.conns.lock();
        for conn in conns.values() {
            conn.kill();
        }
        while !conns.is_empty() {
            if self
                .shared
                .conns_changed
                .wait_until(&mut conns, deadline)
                .timed_out()
            {
                tracing::warn!(
                    connections = conns.len(),
                    "store connections still open after shutdown grace"
                );
                break;
            }
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                if let Err(err) = admit(stream, peer, &shared) {
                    tracing::warn!(%peer, error = %err, "store connection not started");
                }
            }
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(ACCEPT_POLL);
            }
            Err(err) => {
                tracing::debug!(error = %err, "store accept failed");
                std::thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

/// The connection to evict for a new one: the oldest still in its
/// handshake, else the least recently active one that waits on nothing.
fn victim(conns: &HashMap<u64, Arc<Conn>>) -> Option<Arc<Conn>> {
    let open = || {
        conns
            .values()
            .filter(|c| !c.closing.load(Ordering::Acquire))
    };
    open()
        .filter(|c| c.stage.load(Ordering::Acquire) < STAGE_READY)
        .min_by_key(|c| (c.stage.load(Ordering::Acquire), c.accepted_ms))
        .or_else(|| {
            open()
                .filter(|c| !c.waiting.load(Ordering::Acquire))
                .min_by_key(|c| c.last_ms.load(Ordering::Acquire))
        })
        .cloned()
}

fn admit(stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>) -> std::io::Result<()> {
    let limits = &shared.limits;
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(limits.write.max(Duration::from_millis(1))))?;
    let now_ms = shared.now_ms();
    let conn = Arc::new(Conn {
        id: shared.next_conn.fetch_add(1, Ordering::Relaxed),
        peer,
        socket: stream.try_clone()?,
        writer: Mutex::new(stream.try_clone()?),
        out: Mutex::new(Vec::new()),
        out_cap: limits.max_query.max(2 * limits.max_value).max(1 << 20),
        budget: Arc::clone(&shared.budget),
        accepted: Instant::now(),
        accepted_ms: now_ms,
        stage: AtomicU8::new(STAGE_HANDSHAKE),
        last_ms: AtomicU64::new(now_ms),
        waiting: AtomicBool::new(false),
        closing: AtomicBool::new(false),
    });
    {
        let mut conns = shared.conns.lock();
        let open = conns
            .values()
            .filter(|c| !c.closing.load(Ordering::Acquire))
            .count();
        if open >= limits.max_connections {
            match victim(&conns) {
                Some(v) => {
                    tracing::debug!(evicted = %v.peer, %peer, "store at its connection limit: evicting");
                    shared.evictions.fetch_add(1, Ordering::Relaxed);
                    v.kill();
                }
                None => {
                    tracing::warn!(%peer, "store at its connection limit, every connection waiting: refused");
                    conn.kill();
                    return Ok(());
                }
            }
        }
        conns.insert(conn.id, Arc::clone(&conn));
    }
    let thread_shared = Arc::clone(shared);
    let thread_conn = Arc::clone(&conn);
    let spawned = std::thread::Builder::new()
        .name("metrale-store-conn".to_owned())
        .stack_size(CONN_STACK)
        .spawn(move || {
            let (shared, conn) = (thread_shared, thread_conn);
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                serve(&shared, &conn, stream)
            }));
            match result {
                Ok(Ok(())) => tracing::trace!(peer = %conn.peer, "store connection closed"),
                Ok(Err(reason)) => {
                    tracing::debug!(peer = %conn.peer, %reason, "store connection dropped")
                }
                Err(_) => tracing::error!(peer = %conn.peer, "store connection handler panicked"),
            }
            retire(&shared, &conn);
        });
    if let Err(err) = spawned {
        retire(shared, &conn);
        return Err(err);
    }
    Ok(())
}

fn retire(shared: &Shared, conn: &Arc<Conn>) {
    shared.data.lock().cancel(conn.id);
    conn.kill();
    shared.conns.lock().remove(&conn.id);
    shared.conns_changed.notify_all();
}

/// Compares without an early exit on the first differing byte.
fn token_matches(expected: &[u8], got: &[u8]) -> bool {
    expected.len() == got.len()
        && expected
            .iter()
            .zip(got)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

fn io_reason(what: &str) -> impl Fn(std::io::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// `VALIDATE`, then (with a token) `METRALE_AUTH`, all by one deadline.
fn handshake(shared: &Shared, conn: &Conn, rd: &mut TcpStream) -> Result<(), String> {
    let deadline = conn
        .accepted
        .checked_add(shared.limits.handshake)
        .unwrap_or_else(|| proto::after(shared.limits.handshake));
    let kind = proto::read_u8_by(rd, deadline).map_err(io_reason("no VALIDATE"))?;
    if kind != query::VALIDATE {
        return Err(format!("first query is {kind}, not VALIDATE"));
    }
    let magic = proto::read_u32_by(rd, deadline).map_err(io_reason("VALIDATE"))?;
    if magic != proto::VALIDATION_MAGIC {
        return Err(format!("VALIDATE with a wrong magic number {magic:#x}"));
    }
    conn.stage.store(STAGE_VALIDATED, Ordering::Release);
    if let Some(token) = &shared.token {
        let kind = proto::read_u8_by(rd, deadline).map_err(io_reason("no METRALE_AUTH"))?;
        if kind == query::PING {
            // A client without the token (PyTorch's, or ours without
            // METRALE_STORE_TOKEN): the complement of its nonce tells it.
            // Ours stops; PyTorch's 2.11 client retries until its timeout.
            let nonce = proto::read_u32_by(rd, deadline).map_err(io_reason("PING"))?;
            conn.push(&(!nonce).to_le_bytes());
            conn.flush();
            return Err("refused: a client without the token".to_owned());
        }
        if kind != query::METRALE_AUTH {
            return Err(format!(
                "query {kind} before METRALE_AUTH on a store with a token"
            ));
        }
        let len = proto::read_len_by(rd, deadline, proto::MAX_TOKEN, "token")
            .map_err(|e| e.to_string())?;
        let got = proto::read_blob_by(rd, deadline, len, |_| Ok(())).map_err(|e| e.to_string())?;
        if !token_matches(token.as_bytes(), &got) {
            conn.push(&[proto::AUTH_REFUSED]);
            conn.flush();
            return Err("refused: wrong token".to_owned());
        }
        conn.push(&[proto::AUTH_OK]);
        conn.flush();
    }
    conn.stage.store(STAGE_READY, Ordering::Release);
    Ok(())
}

/// Serves one connection until it closes; `Err` says why it was dropped.
fn serve(shared: &Shared, conn: &Arc<Conn>, mut rd: TcpStream) -> Result<(), String> {
    handshake(shared, conn, &mut rd)?;
    let limits = &shared.limits;
    let mut idle_until = proto::after(limits.idle);
    let mut wait_since: Option<Instant> = None;
    loop {
        if shared.stop.load(Ordering::SeqCst) || conn.closing.load(Ordering::Acquire) {
            return Ok(());
        }
        let kind = match proto::read_u8_by(&mut rd, idle_until) {
            Ok(kind) => kind,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                if conn.waiting.load(Ordering::Acquire)
                    && wait_since.is_some_and(|s| s.elapsed() < MAX_WAIT)
                {
                    idle_until = proto::after(limits.idle);
                    continue;
                }
                return Err(format!("idle for {:?}", limits.idle));
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(format!("broken: {e}")),
        };
        conn.last_ms.store(shared.now_ms(), Ordering::Release);
        let deadline = proto::after(limits.query);
        let mut charge = Charge {
            budget: &shared.budget,
            taken: 0,
            limit: limits.max_query,
        };
        match handle(shared, conn, &mut rd, kind, deadline, &mut charge) {
            Ok(()) => {}
            Err(WireError::Refused(why)) => {
                drop(charge);
                conn.flush();
                return refuse(conn, &mut rd, why);
            }
            Err(e) => return Err(e.to_string()),
        }
        drop(charge);
        conn.flush();
        if conn.waiting.load(Ordering::Acquire) {
            wait_since.get_or_insert_with(Instant::now);
        } else {
            wait_since = None;
        }
        idle_until = proto::after(limits.idle);
    }
}

/// After a query read whole and refused: a `PING` that follows (our
/// client confirms every set with one) gets the nonce's complement, which
/// says so; then the connection closes.
fn refuse(conn: &Conn, rd: &mut TcpStream, why: String) -> Result<(), String> {
    let deadline = proto::after(Duration::from_secs(1));
    if let Ok(query::PING) = proto::read_u8_by(rd, deadline)
        && let Ok(nonce) = proto::read_u32_by(rd, deadline)
    {
        conn.push(&(!nonce).to_le_bytes());
        conn.flush();
    }
    Err(format!("refused: {why}"))
}
