//! A small TCP key-value store served by rank 0 (torch's TCPStore idea).
//!
//! The server runs one accept thread (a non-blocking listener polled every
//! few milliseconds, so that shutdown never waits on `accept`) and one thread
//! per connection. Every connection must start with a hello frame carrying
//! the token; with a token configured, anything else is refused with an
//! `UNAUTHORIZED` frame and the connection is closed. A connection that sends
//! anything malformed (bad magic, version, length, truncated frame) is
//! dropped without touching the store or other connections. Every socket
//! read has a timeout: the idle limit before a frame's first byte, a short
//! frame limit for the rest.
//!
//! Waiting gets wait on a condition variable until the key appears, their
//! deadline passes, or the server shuts down; no busy loop. Shutdown sets a
//! flag under the store lock, wakes all waiters, shuts down the read side of
//! every connection (so a blocked read returns at once while a response in
//! flight can still be written) and waits a bounded time for the threads.

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::wire::{self, Frame, WireError, kind};
use super::{RendezvousError, deadline_after};

/// How long the server keeps a connection with no request.
pub const DEFAULT_IDLE_LIMIT: Duration = Duration::from_secs(600);
/// How long a frame may take once its first byte arrived.
const FRAME_LIMIT: Duration = Duration::from_secs(10);
/// How long a new connection has to send its hello.
const HELLO_LIMIT: Duration = Duration::from_secs(10);
/// The accept thread's poll period.
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// How long drop waits for connection threads to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// The most connections served at once; more are closed on accept.
const MAX_CONNECTIONS: usize = 1024;
/// The longest wait a get may ask for.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);
/// The default limit for a client's non-waiting request.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);

struct Data {
    map: HashMap<String, Vec<u8>>,
    shutting_down: bool,
}

struct Shared {
    data: Mutex<Data>,
    changed: Condvar,
    token: Option<String>,
    idle_limit: Duration,
    stop: AtomicBool,
    /// Read-side handles of live connections, for shutdown.
    conns: Mutex<HashMap<u64, TcpStream>>,
    live: Mutex<usize>,
    live_changed: Condvar,
    next_conn: AtomicU64,
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
    /// Binds `addr` (port 0 picks a free port) and starts serving.
    pub fn bind(addr: SocketAddr, token: Option<String>) -> Result<StoreServer, RendezvousError> {
        Self::bind_with_idle_limit(addr, token, DEFAULT_IDLE_LIMIT)
    }

    /// As [`StoreServer::bind`], closing connections idle for `idle_limit`.
    pub fn bind_with_idle_limit(
        addr: SocketAddr,
        token: Option<String>,
        idle_limit: Duration,
    ) -> Result<StoreServer, RendezvousError> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| RendezvousError::io(format!("binding the store on {addr}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| RendezvousError::io("reading the store's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| RendezvousError::io("configuring the store's listener", e))?;
        let shared = Arc::new(Shared {
            data: Mutex::new(Data {
                map: HashMap::new(),
                shutting_down: false,
            }),
            changed: Condvar::new(),
            token: token.filter(|t| !t.is_empty()),
            idle_limit: idle_limit.max(Duration::from_millis(10)),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            live: Mutex::new(0),
            live_changed: Condvar::new(),
            next_conn: AtomicU64::new(0),
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

    /// Stops the server (the same as dropping it).
    pub fn shutdown(self) {
        drop(self);
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let mut data = self.shared.data.lock();
            data.shutting_down = true;
        }
        self.shared.changed.notify_all();
        if let Some(accept) = self.accept.take()
            && accept.join().is_err()
        {
            tracing::error!("the store's accept thread panicked");
        }
        for stream in self.shared.conns.lock().values() {
            // Errors mean the peer already closed; nothing to do.
            let _ = stream.shutdown(Shutdown::Read);
        }
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        let mut live = self.shared.live.lock();
        while *live > 0 {
            if self
                .shared
                .live_changed
                .wait_until(&mut live, deadline)
                .timed_out()
            {
                tracing::warn!(
                    connections = *live,
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
                if let Err(err) = start_connection(stream, peer, &shared) {
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

fn start_connection(
    stream: TcpStream,
    peer: SocketAddr,
    shared: &Arc<Shared>,
) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(FRAME_LIMIT))?;
    {
        let mut live = shared.live.lock();
        if *live >= MAX_CONNECTIONS {
            return Err(std::io::Error::other("too many connections"));
        }
        *live += 1;
    }
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let registered = stream.try_clone().map(|clone| {
        shared.conns.lock().insert(id, clone);
    });
    let conn_shared = Arc::clone(shared);
    let spawned = registered.and_then(|()| {
        std::thread::Builder::new()
            .name("metrale-store-conn".to_owned())
            .spawn(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    serve_connection(stream, &conn_shared)
                }));
                match result {
                    Ok(Ok(())) => tracing::trace!(%peer, "store connection closed"),
                    Ok(Err(reason)) => {
                        tracing::debug!(%peer, %reason, "store connection dropped")
                    }
                    Err(_) => tracing::error!(%peer, "store connection handler panicked"),
                }
                conn_shared.conns.lock().remove(&id);
                *conn_shared.live.lock() -= 1;
                conn_shared.live_changed.notify_all();
            })
    });
    if let Err(err) = spawned {
        shared.conns.lock().remove(&id);
        *shared.live.lock() -= 1;
        shared.live_changed.notify_all();
        return Err(err);
    }
    Ok(())
}

/// Compares without an early exit on the first differing byte.
fn token_matches(expected: &[u8], got: &[u8]) -> bool {
    if expected.len() != got.len() {
        return false;
    }
    expected
        .iter()
        .zip(got)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

/// Serves one connection until it closes; `Err` carries why it was dropped.
fn serve_connection(mut stream: TcpStream, shared: &Shared) -> Result<(), String> {
    let describe = |e: WireError| match e {
        WireError::Io(e) => format!("i/o: {e}"),
        WireError::Malformed(m) => m,
    };
    let reply = |stream: &mut TcpStream, kind: u8, payload: &[u8]| {
        wire::write_frame(stream, kind, payload).map_err(|e| format!("writing a reply: {e}"))
    };

    stream
        .set_read_timeout(Some(HELLO_LIMIT))
        .map_err(|e| e.to_string())?;
    let hello = wire::read_frame(&mut stream).map_err(describe)?;
    if hello.kind != kind::HELLO {
        let _ = reply(&mut stream, kind::UNAUTHORIZED, b"expected a hello frame");
        return Err("first frame is not a hello".to_owned());
    }
    if let Some(token) = &shared.token
        && !token_matches(token.as_bytes(), &hello.payload)
    {
        let _ = reply(&mut stream, kind::UNAUTHORIZED, b"bad token");
        return Err("refused: bad token".to_owned());
    }
    let idle_ms = u64::try_from(shared.idle_limit.as_millis()).unwrap_or(u64::MAX);
    reply(&mut stream, kind::OK, &idle_ms.to_be_bytes())?;

    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        stream
            .set_read_timeout(Some(shared.idle_limit))
            .map_err(|e| e.to_string())?;
        let (frame_kind, len) = match wire::read_header(&mut stream) {
            Ok(header) => header,
            Err(WireError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(());
            }
            // Idle or broken: close without a reply, which a client sending a
            // request at this moment could mistake for its response.
            Err(WireError::Io(e)) => return Err(format!("idle or broken: {e}")),
            Err(e) => {
                let message = describe(e);
                let _ = reply(&mut stream, kind::ERROR, message.as_bytes());
                return Err(message);
            }
        };
        stream
            .set_read_timeout(Some(FRAME_LIMIT))
            .map_err(|e| e.to_string())?;
        let payload = wire::read_payload(&mut stream, len).map_err(describe)?;
        match handle_request(
            shared,
            &Frame {
                kind: frame_kind,
                payload,
            },
        ) {
            Ok((kind, payload)) => reply(&mut stream, kind, &payload)?,
            Err(e) => {
                let message = describe(e);
                let _ = reply(&mut stream, kind::ERROR, message.as_bytes());
                return Err(message);
            }
        }
    }
}

fn handle_request(shared: &Shared, frame: &Frame) -> Result<(u8, Vec<u8>), WireError> {
    match frame.kind {
        kind::SET => {
            let (key, value) = wire::take_key(&frame.payload)?;
            let mut data = shared.data.lock();
            data.map.insert(key, value.to_vec());
            drop(data);
            shared.changed.notify_all();
            Ok((kind::OK, Vec::new()))
        }
        kind::GET => {
            let (key, rest) = wire::take_key(&frame.payload)?;
            let wait = Duration::from_millis(wire::take_u64(rest)?).min(MAX_WAIT);
            let deadline = deadline_after(wait);
            let mut data = shared.data.lock();
            loop {
                if let Some(value) = data.map.get(&key) {
                    return Ok((kind::OK, value.clone()));
                }
                if data.shutting_down {
                    return Ok((kind::CLOSED, Vec::new()));
                }
                if shared.changed.wait_until(&mut data, deadline).timed_out() {
                    return Ok(match data.map.get(&key) {
                        Some(value) => (kind::OK, value.clone()),
                        None => (kind::TIMEOUT, Vec::new()),
                    });
                }
            }
        }
        kind::ADD => {
            let (key, rest) = wire::take_key(&frame.payload)?;
            // The bit pattern is the two's-complement delta.
            let delta = wire::take_u64(rest)? as i64;
            let mut data = shared.data.lock();
            let current = match data.map.get(&key) {
                None => 0,
                Some(bytes) => std::str::from_utf8(bytes)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| {
                        WireError::Malformed(format!("key {key:?} does not hold a counter"))
                    })?,
            };
            let next = current.wrapping_add(delta);
            data.map.insert(key, next.to_string().into_bytes());
            drop(data);
            shared.changed.notify_all();
            Ok((kind::OK, next.to_be_bytes().to_vec()))
        }
        other => Err(WireError::Malformed(format!(
            "unexpected frame kind {other:#x}"
        ))),
    }
}

struct Conn {
    stream: TcpStream,
    /// When the server would drop this connection as idle, minus a margin.
    fresh_until: Instant,
    idle_limit: Duration,
}

/// A client of a [`StoreServer`]. `Send + Sync`: requests are serialized by
/// an internal lock (a waiting get holds it for its wait).
///
/// A connection the server may have closed as idle is replaced before use;
/// a set or get that fails on the transport is retried once on a new
/// connection (add is not, since it is not idempotent).
pub struct StoreClient {
    addr: SocketAddr,
    token: Option<String>,
    io_timeout: Duration,
    conn: Mutex<Option<Conn>>,
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
    /// Connects to the server at `addr`, retrying until `timeout` (rank 0
    /// may start later), and presents `token`. `Unauthorized` if refused.
    pub fn connect(
        addr: SocketAddr,
        token: Option<String>,
        timeout: Duration,
    ) -> Result<StoreClient, RendezvousError> {
        let client = StoreClient {
            addr,
            token,
            io_timeout: DEFAULT_IO_TIMEOUT,
            conn: Mutex::new(None),
        };
        let conn = client.open(deadline_after(timeout))?;
        *client.conn.lock() = Some(conn);
        Ok(client)
    }

    /// The server's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    fn open(&self, deadline: Instant) -> Result<Conn, RendezvousError> {
        let mut last_err: Option<std::io::Error> = None;
        let mut pause = Duration::from_millis(5);
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(match last_err {
                    Some(e) => RendezvousError::io(
                        format!("connecting to the store at {} (gave up)", self.addr),
                        e,
                    ),
                    None => RendezvousError::Timeout {
                        key: format!("connect {}", self.addr),
                        after: Duration::ZERO,
                    },
                });
            }
            let budget = (deadline - now).min(Duration::from_secs(5));
            match TcpStream::connect_timeout(&self.addr, budget) {
                Ok(stream) => return self.hello(stream, deadline),
                Err(e) => {
                    tracing::trace!(addr = %self.addr, error = %e, "store not reachable yet");
                    last_err = Some(e);
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }

    fn hello(&self, mut stream: TcpStream, deadline: Instant) -> Result<Conn, RendezvousError> {
        let ctx = |what: &str| format!("{what} the store at {}", self.addr);
        stream
            .set_nodelay(true)
            .map_err(|e| RendezvousError::io(ctx("configuring"), e))?;
        let limit = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(100), self.io_timeout);
        stream
            .set_read_timeout(Some(limit))
            .and_then(|()| stream.set_write_timeout(Some(limit)))
            .map_err(|e| RendezvousError::io(ctx("configuring"), e))?;
        let token = self.token.as_deref().unwrap_or("").as_bytes();
        wire::write_frame(&mut stream, kind::HELLO, token)
            .map_err(|e| RendezvousError::io(ctx("greeting"), e))?;
        let reply = wire::read_frame(&mut stream).map_err(|e| wire_error(e, &ctx("greeting")))?;
        match reply.kind {
            kind::OK => {
                let idle_ms =
                    wire::take_u64(&reply.payload).map_err(|e| wire_error(e, &ctx("greeting")))?;
                let idle_limit = Duration::from_millis(idle_ms);
                Ok(Conn {
                    stream,
                    fresh_until: deadline_after(idle_limit / 2),
                    idle_limit,
                })
            }
            kind::UNAUTHORIZED => Err(RendezvousError::Unauthorized),
            kind::CLOSED => Err(RendezvousError::Closed),
            other => Err(unexpected(other, &reply.payload)),
        }
    }

    /// One request/response exchange. `retry` allows one more attempt on a
    /// new connection after a transport failure.
    fn request(
        &self,
        kind_byte: u8,
        payload: &[u8],
        wait: Duration,
        retry: bool,
    ) -> Result<Frame, RendezvousError> {
        let mut guard = self.conn.lock();
        let mut attempts = if retry { 2 } else { 1 };
        loop {
            attempts -= 1;
            if guard
                .as_ref()
                .is_none_or(|c| Instant::now() >= c.fresh_until)
            {
                *guard = None;
                *guard = Some(self.open(deadline_after(self.io_timeout))?);
            }
            let Some(conn) = guard.as_mut() else {
                return Err(RendezvousError::Closed);
            };
            let result = (|| {
                let limit = self.io_timeout + wait;
                conn.stream.set_read_timeout(Some(limit))?;
                conn.stream.set_write_timeout(Some(self.io_timeout))?;
                wire::write_frame(&mut conn.stream, kind_byte, payload)?;
                wire::read_frame(&mut conn.stream).map_err(|e| match e {
                    WireError::Io(e) => e,
                    WireError::Malformed(m) => {
                        std::io::Error::new(std::io::ErrorKind::InvalidData, m)
                    }
                })
            })();
            match result {
                Ok(frame) => {
                    conn.fresh_until = deadline_after(conn.idle_limit / 2);
                    if frame.kind == kind::ERROR || frame.kind == kind::CLOSED {
                        *guard = None;
                    }
                    return Ok(frame);
                }
                Err(e) => {
                    *guard = None;
                    if attempts == 0 || e.kind() == std::io::ErrorKind::InvalidData {
                        return Err(RendezvousError::io(
                            format!("talking to the store at {}", self.addr),
                            e,
                        ));
                    }
                    tracing::debug!(error = %e, "store connection lost; reconnecting");
                }
            }
        }
    }

    /// Sets `key` to `value`, waking every get waiting on it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        let mut payload = Vec::with_capacity(2 + key.len() + value.len());
        wire::put_key(&mut payload, key).map_err(|e| RendezvousError::io("encoding a set", e))?;
        payload.extend_from_slice(value);
        let reply = self.request(kind::SET, &payload, Duration::ZERO, true)?;
        match reply.kind {
            kind::OK => Ok(()),
            other => Err(reply_error(other, &reply.payload)),
        }
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, RendezvousError> {
        let wait = timeout.min(MAX_WAIT);
        let mut payload = Vec::with_capacity(10 + key.len());
        wire::put_key(&mut payload, key).map_err(|e| RendezvousError::io("encoding a get", e))?;
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        payload.extend_from_slice(&wait_ms.to_be_bytes());
        let reply = self.request(kind::GET, &payload, wait, true)?;
        match reply.kind {
            kind::OK => Ok(reply.payload),
            kind::TIMEOUT => Err(RendezvousError::Timeout {
                key: key.to_owned(),
                after: timeout,
            }),
            other => Err(reply_error(other, &reply.payload)),
        }
    }

    /// Adds `delta` to the counter `key` (absent counts as 0) and returns
    /// the new value; atomic across clients.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, RendezvousError> {
        let mut payload = Vec::with_capacity(10 + key.len());
        wire::put_key(&mut payload, key).map_err(|e| RendezvousError::io("encoding an add", e))?;
        payload.extend_from_slice(&delta.to_be_bytes());
        let reply = self.request(kind::ADD, &payload, Duration::ZERO, false)?;
        match reply.kind {
            kind::OK => {
                let bytes: [u8; 8] = reply.payload.as_slice().try_into().map_err(|_| {
                    RendezvousError::Protocol("add reply is not an 8-byte integer".to_owned())
                })?;
                Ok(i64::from_be_bytes(bytes))
            }
            other => Err(reply_error(other, &reply.payload)),
        }
    }
}

fn wire_error(e: WireError, context: &str) -> RendezvousError {
    match e {
        WireError::Io(e) => RendezvousError::io(context.to_owned(), e),
        WireError::Malformed(m) => RendezvousError::Protocol(format!("{context}: {m}")),
    }
}

fn unexpected(kind_byte: u8, payload: &[u8]) -> RendezvousError {
    RendezvousError::Protocol(format!(
        "unexpected reply kind {kind_byte:#x}: {}",
        String::from_utf8_lossy(payload)
    ))
}

fn reply_error(kind_byte: u8, payload: &[u8]) -> RendezvousError {
    match kind_byte {
        kind::UNAUTHORIZED => RendezvousError::Unauthorized,
        kind::CLOSED => RendezvousError::Closed,
        kind::ERROR => {
            RendezvousError::Protocol(format!("store: {}", String::from_utf8_lossy(payload)))
        }
        other => unexpected(other, payload),
    }
}
