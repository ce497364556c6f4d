//! The store server's one thread: a `mio` poll loop over the listener and
//! every connection, with the store (`queries::Store`) and the memory
//! budget (`queries::Memory`) it owns.
//!
//! A connection goes through its handshake (`VALIDATE`; with a token,
//! `METRALE_AUTH`, where a `PING` instead gets the nonce's complement),
//! then serves queries; `METRALE_HELLO` turns on the extension's status
//! bytes and refusals (`proto`). A connection accepted past the connection
//! cap, or when memory cannot cover it, is *refusing*: it reads the
//! handshake, tells a client of ours why (`METRALE_AUTH` or
//! `METRALE_HELLO` answered with the refusal) and closes.
//!
//! Invariants:
//! - Bytes are read into one scratch buffer; only the unfinished tail of a
//!   query is kept per connection, charged to memory as its capacity
//!   grows; replies are charged when queued and given back when written.
//!   A connection costs [`CONN_OVERHEAD`] more. A reply's bound is checked
//!   against memory before its query is applied.
//! - A connection with more than [`OUT_HIGH_WATER`] bytes unwritten reads
//!   no more queries until they drain, and one whose bytes cannot be
//!   written for [`StoreLimits::write`] is closed.
//! - Deadlines (handshake, query, idle, write, a refusal's last word) are
//!   checked every [`TICK`]; `poll` never waits longer.
//! - A refusal closes the connection (after the refusal, for a client of
//!   ours; a plain client that refused a whole query may still have a
//!   `PING` answered with the nonce's complement, within a second).
//! - At the cap, the oldest connection in its handshake for at least
//!   [`HANDSHAKE_GRACE`] is closed for the new one; a connection past its
//!   handshake is never evicted.
//! - A panic while handling one connection's event closes that connection
//!   and nothing else.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

use super::frame::{self, Query, Scan, Scanner};
use super::limits::{MAX_WAIT, StoreLimit, StoreLimits, StoreRefusal};
use super::proto;
use super::queries::{ConnId, Memory, REFUSALS_RESERVE, Store, WaitEnd};
use super::server::Shared;

/// The listener's token; connections are `CONN_BASE + slot`.
const LISTENER: Token = Token(0);
/// The waker's token.
pub(super) const WAKER: Token = Token(1);
const CONN_BASE: usize = 2;
/// How often deadlines are checked.
const TICK: Duration = Duration::from_millis(100);
/// What a connection costs beyond its buffers.
const CONN_OVERHEAD: usize = 1024;
/// The scratch buffer a read fills.
const SCRATCH: usize = 64 << 10;
/// Unwritten bytes past which a connection's queries wait.
const OUT_HIGH_WATER: usize = 1 << 20;
/// How long a refused connection may take to hear why.
const REFUSING_GRACE: Duration = Duration::from_secs(1);
/// How long a connection stays in its handshake before it can be evicted.
const HANDSHAKE_GRACE: Duration = Duration::from_secs(1);
/// Connections being refused at once, at most; past it, a connection over
/// the cap is closed at once.
const MAX_REFUSING: usize = 64;
/// A tail kept when its buffer shrinks.
const KEEP_CAPACITY: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    /// Waiting for `VALIDATE`.
    Validate,
    /// Validated; waiting for the token.
    Auth,
    /// Serving queries.
    Ready,
    /// Accepted past a limit: tells a client of ours why, then closes.
    Refusing(StoreRefusal),
    /// A plain client's query was refused whole: a `PING` that follows
    /// gets the nonce's complement, then the connection closes.
    Refused,
}

struct Conn {
    sock: TcpStream,
    peer: SocketAddr,
    stage: Stage,
    ext: bool,
    /// The unfinished tail of a query, and the capacity charged for it.
    tail: Vec<u8>,
    tail_charged: usize,
    scanner: Scanner,
    /// Unwritten reply bytes from `out_pos`, and what they are charged.
    out: Vec<u8>,
    out_pos: usize,
    out_charged: usize,
    accepted: Instant,
    query_started: Option<Instant>,
    last_active: Instant,
    wait_since: Option<Instant>,
    write_stalled: Option<Instant>,
    /// Close once the replies are written.
    close_after_flush: bool,
    /// Bytes may be waiting in the socket (reading stopped early).
    unread: bool,
}

impl Conn {
    fn pending_out(&self) -> usize {
        self.out.len() - self.out_pos
    }

    fn in_handshake(&self) -> bool {
        matches!(self.stage, Stage::Validate | Stage::Auth)
    }
}

struct Loop {
    poll: Poll,
    listener: TcpListener,
    shared: Arc<Shared>,
    limits: StoreLimits,
    token: Option<String>,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    open: usize,
    refusing: usize,
    store: Store,
    mem: Memory,
    scratch: Vec<u8>,
    evictions: u64,
    refusals: u64,
    /// Bytes charged for tails and unwritten replies, all connections.
    io_charged: usize,
    accept_paused_until: Option<Instant>,
    /// Connections whose reading stopped early, to resume.
    resume: VecDeque<usize>,
}

/// Runs the loop until the server is stopped.
pub(super) fn run(
    poll: Poll,
    listener: TcpListener,
    shared: Arc<Shared>,
    limits: StoreLimits,
    token: Option<String>,
) {
    let mut listener = listener;
    if let Err(e) = poll
        .registry()
        .register(&mut listener, LISTENER, Interest::READABLE)
    {
        tracing::error!(error = %e, "the store could not watch its listener; it serves nothing");
        return;
    }
    shared
        .stats
        .max_connections
        .store(limits.max_connections, Ordering::Release);
    let mut lp = Loop {
        poll,
        listener,
        shared,
        mem: Memory {
            used: REFUSALS_RESERVE.min(limits.memory),
            cap: limits.memory,
        },
        limits,
        token,
        conns: Vec::new(),
        free: Vec::new(),
        open: 0,
        refusing: 0,
        store: Store::default(),
        scratch: vec![0u8; SCRATCH],
        evictions: 0,
        refusals: 0,
        io_charged: 0,
        accept_paused_until: None,
        resume: VecDeque::new(),
    };
    lp.serve();
    lp.shut();
}

impl Loop {
    fn serve(&mut self) {
        let mut events = Events::with_capacity(1024);
        let mut next_tick = Instant::now() + TICK;
        loop {
            if self.shared.stop.load(Ordering::SeqCst) {
                return;
            }
            let timeout = next_tick.saturating_duration_since(Instant::now());
            if let Err(e) = self.poll.poll(&mut events, Some(timeout))
                && e.kind() != ErrorKind::Interrupted
            {
                tracing::error!(error = %e, "the store's poll failed; it stops serving");
                return;
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept_all(),
                    WAKER => {}
                    Token(t) => {
                        let slot = t - CONN_BASE;
                        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            if ev.is_writable() || ev.is_write_closed() {
                                self.flush(slot);
                            }
                            if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                                self.read(slot);
                            }
                        }));
                        if ok.is_err() {
                            tracing::error!("store connection handler panicked; closing it");
                            self.close(slot);
                        }
                    }
                }
            }
            while let Some(slot) = self.resume.pop_front() {
                if self.conns.get(slot).is_some_and(|c| {
                    c.as_ref()
                        .is_some_and(|c| c.unread && c.pending_out() <= OUT_HIGH_WATER)
                }) {
                    self.read(slot);
                }
            }
            if Instant::now() >= next_tick {
                self.tick();
                next_tick = Instant::now() + TICK;
            }
            self.publish();
        }
    }

    fn shut(&mut self) {
        for slot in 0..self.conns.len() {
            if self.conns[slot].is_some() {
                self.close(slot);
            }
        }
        self.publish();
    }

    fn publish(&self) {
        let s = &self.shared.stats;
        s.connections
            .store(self.open + self.refusing, Ordering::Release);
        s.evictions.store(self.evictions, Ordering::Release);
        s.in_flight.store(self.io_charged, Ordering::Release);
        s.waiting.store(self.store.waiting(), Ordering::Release);
        self.publish_light();
    }

    fn accept_all(&mut self) {
        if self.accept_paused_until.is_some_and(|t| Instant::now() < t) {
            return;
        }
        self.accept_paused_until = None;
        loop {
            match self.listener.accept() {
                Ok((sock, peer)) => self.admit(sock, peer),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors, most likely: the backlog keeps the
                    // rest until the next tick.
                    tracing::warn!(error = %e, "the store cannot accept now; retrying shortly");
                    self.accept_paused_until = Some(Instant::now() + TICK);
                    return;
                }
            }
        }
    }

    fn admit(&mut self, mut sock: TcpStream, peer: SocketAddr) {
        let now = Instant::now();
        let mut stage = Stage::Validate;
        if self.open >= self.limits.max_connections && !self.evict_one(now) {
            stage = Stage::Refusing(StoreRefusal::limit(
                StoreLimit::Connections,
                self.limits.max_connections,
                format!(
                    "a connection from {peer}, with {} open and past their handshake",
                    self.open
                ),
            ));
        }
        if stage == Stage::Validate
            && let Err(r) = self
                .mem
                .take(CONN_OVERHEAD, || format!("a connection from {peer}"))
        {
            stage = Stage::Refusing(r);
        }
        if matches!(stage, Stage::Refusing(_)) {
            self.refusals += 1;
            if self.refusing >= MAX_REFUSING {
                tracing::warn!(%peer, "store refusing too many connections: closed without a word");
                return;
            }
            tracing::warn!(%peer, "store at a limit: refusing a connection");
        }
        let _ = sock.set_nodelay(true);
        let slot = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        if let Err(e) = self.poll.registry().register(
            &mut sock,
            Token(CONN_BASE + slot),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            tracing::warn!(%peer, error = %e, "store connection not watched; closed");
            if stage == Stage::Validate {
                self.mem.give(CONN_OVERHEAD);
            }
            self.free.push(slot);
            return;
        }
        if matches!(stage, Stage::Refusing(_)) {
            self.refusing += 1;
        } else {
            self.open += 1;
        }
        self.conns[slot] = Some(Conn {
            sock,
            peer,
            stage,
            ext: false,
            tail: Vec::new(),
            tail_charged: 0,
            scanner: Scanner::default(),
            out: Vec::new(),
            out_pos: 0,
            out_charged: 0,
            accepted: now,
            query_started: None,
            last_active: now,
            wait_since: None,
            write_stalled: None,
            close_after_flush: false,
            unread: true,
        });
        // Bytes may already be there (edge-triggered: no event for them).
        self.read(slot);
    }

    /// Closes the oldest connection in its handshake for at least the
    /// grace, for a new one; whether there was one.
    fn evict_one(&mut self, now: Instant) -> bool {
        let victim = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().map(|c| (i, c)))
            .filter(|(_, c)| c.in_handshake() && now.duration_since(c.accepted) >= HANDSHAKE_GRACE)
            .min_by_key(|(_, c)| c.accepted)
            .map(|(i, _)| i);
        match victim {
            Some(i) => {
                tracing::debug!(
                    "store at its connection limit: closing the oldest connection in its handshake"
                );
                self.evictions += 1;
                self.close(i);
                true
            }
            None => false,
        }
    }

    fn close(&mut self, slot: usize) {
        let Some(mut c) = self.conns.get_mut(slot).and_then(Option::take) else {
            return;
        };
        self.store.cancel(slot, &mut self.mem);
        self.mem.give(c.tail_charged + c.out_charged);
        self.io_charged -= c.tail_charged + c.out_charged;
        if matches!(c.stage, Stage::Refusing(_)) {
            self.refusing -= 1;
        } else {
            self.open -= 1;
            self.mem.give(CONN_OVERHEAD);
        }
        let _ = self.poll.registry().deregister(&mut c.sock);
        tracing::trace!(peer = %c.peer, "store connection closed");
        self.free.push(slot);
    }

    fn conn(&mut self, slot: usize) -> Option<&mut Conn> {
        self.conns.get_mut(slot).and_then(Option::as_mut)
    }

    /// Reads what the socket has and serves every whole query in it.
    fn read(&mut self, slot: usize) {
        loop {
            let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
                return;
            };
            if c.close_after_flush {
                return;
            }
            if c.pending_out() > OUT_HIGH_WATER {
                c.unread = true;
                return;
            }
            match c.sock.read(&mut self.scratch) {
                Ok(0) => {
                    self.close(slot);
                    return;
                }
                Ok(n) => {
                    let buf = std::mem::take(&mut self.scratch);
                    let go_on = self.take_bytes(slot, &buf[..n]);
                    self.scratch = buf;
                    if !go_on {
                        return;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    c.unread = false;
                    return;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    self.close(slot);
                    return;
                }
            }
        }
    }

    /// Serves the queries in `bytes` (after the connection's tail); keeps
    /// an unfinished one. Returns false once the connection is closed or
    /// must read no more for now.
    fn take_bytes(&mut self, slot: usize, bytes: &[u8]) -> bool {
        let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
            return false;
        };
        c.last_active = Instant::now();
        let mut data = std::mem::take(&mut c.tail);
        let charged = c.tail_charged;
        let from_tail = !data.is_empty();
        if from_tail {
            // Exact growth: the capacity is what is charged.
            data.reserve_exact(bytes.len());
            data.extend_from_slice(bytes);
        }
        let mut at = 0;
        let go_on = loop {
            let view: &[u8] = if from_tail { &data[at..] } else { &bytes[at..] };
            if view.is_empty() {
                break true;
            }
            let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
                return false;
            };
            if c.close_after_flush {
                break false;
            }
            if c.pending_out() > OUT_HIGH_WATER {
                // The rest waits in the tail until the replies drain.
                c.unread = true;
                break false;
            }
            match c.scanner.scan(view, &self.limits) {
                Scan::Incomplete => break true,
                Scan::Complete(n) => {
                    c.scanner = Scanner::default();
                    c.query_started = None;
                    let q = frame::parse(&view[..n]);
                    at += n;
                    match q {
                        Some(q) => self.serve_query(slot, q),
                        None => {
                            self.close(slot);
                            return false;
                        }
                    }
                }
                Scan::Refused(r) => {
                    let keys = frame::keys_named(view);
                    self.refuse_set(slot, r, keys);
                    return false;
                }
                Scan::Garbage(why) => {
                    tracing::debug!(peer = %c.peer, %why, "store connection dropped");
                    self.close(slot);
                    return false;
                }
            }
        };
        let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
            return false;
        };
        // Keep the unfinished tail, charging its capacity.
        let mut tail = if from_tail {
            data.drain(..at);
            data
        } else {
            bytes[at..].to_vec()
        };
        if tail.capacity() > KEEP_CAPACITY && tail.len() < tail.capacity() / 4 {
            tail.shrink_to(tail.len().max(KEEP_CAPACITY));
        }
        if tail.is_empty() {
            c.query_started = None;
        } else if c.query_started.is_none() {
            c.query_started = Some(Instant::now());
        }
        let cap = if tail.is_empty() { 0 } else { tail.capacity() };
        if tail.is_empty() {
            tail = Vec::new();
        }
        c.tail = tail;
        c.tail_charged = cap;
        let peer = c.peer;
        if cap > charged {
            let grown = cap - charged;
            if let Err(r) = self.mem.take(grown, || {
                format!("a partial query of {cap} bytes from {peer}")
            }) {
                if let Some(c) = self.conn(slot) {
                    c.tail_charged = charged;
                }
                self.refuse(slot, r, false);
                return false;
            }
            self.io_charged += grown;
        } else {
            self.mem.give(charged - cap);
            self.io_charged -= charged - cap;
        }
        go_on
    }

    /// Queues reply bytes (charged; their bound was checked before).
    fn push(&mut self, slot: usize, bytes: &[u8]) {
        let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        if c.out_pos > 0 && c.out_pos == c.out.len() {
            c.out.clear();
            c.out_pos = 0;
        }
        let before = c.out.capacity();
        c.out.extend_from_slice(bytes);
        let grown = c.out.capacity().saturating_sub(before);
        c.out_charged += grown;
        self.mem.used += grown;
        self.io_charged += grown;
    }

    /// A reply to the connection's query, with its status byte when the
    /// connection speaks the extension.
    fn reply(&mut self, slot: usize, bytes: &[u8]) {
        let ext = self.conn(slot).is_some_and(|c| c.ext);
        if ext {
            let mut v = Vec::with_capacity(bytes.len() + 1);
            v.push(proto::STATUS_OK);
            v.extend_from_slice(bytes);
            self.push(slot, &v);
        } else {
            self.push(slot, bytes);
        }
    }

    /// Writes what is queued; closes a connection that asked to close once
    /// written (a stalled one is closed at the tick).
    fn flush(&mut self, slot: usize) {
        self.publish_light();
        let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        while c.pending_out() > 0 {
            match c.sock.write(&c.out[c.out_pos..]) {
                Ok(0) => {
                    self.close(slot);
                    return;
                }
                Ok(n) => {
                    c.out_pos += n;
                    c.write_stalled = None;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    c.write_stalled.get_or_insert_with(Instant::now);
                    return;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    self.close(slot);
                    return;
                }
            }
        }
        c.write_stalled = None;
        c.out = Vec::new();
        c.out_pos = 0;
        let give = c.out_charged;
        c.out_charged = 0;
        let (close, resume) = (c.close_after_flush, c.unread);
        self.mem.give(give);
        self.io_charged -= give;
        if close {
            self.close(slot);
        } else if resume {
            self.resume.push_back(slot);
        }
    }

    /// The numbers a client may look at right after its reply.
    fn publish_light(&self) {
        let s = &self.shared.stats;
        s.keys.store(self.store.keys(), Ordering::Release);
        s.store_bytes
            .store(self.store.kept_bytes, Ordering::Release);
        s.memory.store(self.mem.used, Ordering::Release);
        s.refusals.store(self.refusals, Ordering::Release);
    }

    /// Refuses the connection's query (or the connection): a client of
    /// ours is told why; `whole` says the query was read to its end (a
    /// plain client may then have a `PING` answered).
    fn refuse(&mut self, slot: usize, r: StoreRefusal, whole: bool) {
        self.refusals += 1;
        let Some(c) = self.conn(slot) else {
            return;
        };
        let (peer, ext) = (c.peer, c.ext);
        if matches!(r.limit, StoreLimit::Connections | StoreLimit::Memory) {
            tracing::warn!(%peer, refusal = %r, "store refused a query");
        } else {
            tracing::debug!(%peer, refusal = %r, "store refused a query");
        }
        if ext {
            let mut v = vec![proto::STATUS_REFUSED];
            proto::write_refusal(&mut v, &r);
            self.push(slot, &v);
            if let Some(c) = self.conn(slot) {
                c.close_after_flush = true;
            }
            self.flush(slot);
        } else if whole {
            if let Some(c) = self.conn(slot) {
                c.stage = Stage::Refused;
                c.accepted = Instant::now();
            }
        } else {
            self.close(slot);
        }
    }

    /// Refuses a query that was not read whole (over a bound, or past
    /// memory), ending the waits on the keys it names.
    fn refuse_set(&mut self, slot: usize, r: StoreRefusal, keys: Vec<Vec<u8>>) {
        let ready = self.conn(slot).is_some_and(|c| c.stage == Stage::Ready);
        if ready && !keys.is_empty() {
            let (r, ended) = self.store.refuse_keys(r, keys);
            self.end_waits(ended);
            self.refuse(slot, r, false);
        } else {
            self.refuse(slot, r, false);
        }
    }

    fn serve_query(&mut self, slot: usize, q: Query) {
        let Some(stage) = self.conn(slot).map(|c| c.stage.clone()) else {
            return;
        };
        // What to queue, and whether to close once it is written.
        let (bytes, close): (Vec<u8>, bool) = match (stage, q) {
            (Stage::Validate | Stage::Refusing(_), Query::Validate(magic))
                if magic == proto::VALIDATION_MAGIC =>
            {
                let next = if self.token.is_some() {
                    Stage::Auth
                } else {
                    Stage::Ready
                };
                if let Some(c) = self.conn(slot)
                    && c.stage == Stage::Validate
                {
                    c.stage = next;
                }
                return;
            }
            (Stage::Auth, Query::Auth(got)) => {
                let ok = self
                    .token
                    .as_ref()
                    .is_some_and(|t| token_matches(t.as_bytes(), &got));
                if ok && let Some(c) = self.conn(slot) {
                    c.stage = Stage::Ready;
                }
                if ok {
                    (vec![proto::AUTH_OK], false)
                } else {
                    (vec![proto::AUTH_REFUSED], true)
                }
            }
            // A client without the token (PyTorch's), or a plain client
            // whose query was refused: the complement tells it.
            (Stage::Auth | Stage::Refused, Query::Ping(nonce)) => {
                ((!nonce).to_le_bytes().to_vec(), true)
            }
            // A store without a token accepts any.
            (Stage::Ready, Query::Auth(_)) if self.token.is_none() => (vec![proto::AUTH_OK], false),
            (Stage::Refusing(r), Query::Auth(_)) => {
                let mut v = vec![proto::AUTH_LIMIT];
                proto::write_refusal(&mut v, &r);
                (v, true)
            }
            (Stage::Refusing(r), Query::Hello(_)) => {
                let mut v = vec![proto::STATUS_REFUSED];
                proto::write_refusal(&mut v, &r);
                (v, true)
            }
            (Stage::Ready, Query::Hello(_)) => {
                if let Some(c) = self.conn(slot) {
                    c.ext = true;
                }
                let mut v = vec![proto::STATUS_OK];
                v.extend_from_slice(&proto::EXT_VERSION.to_le_bytes());
                (v, false)
            }
            (Stage::Ready, q) => {
                self.apply(slot, q);
                return;
            }
            (_, _) => {
                self.close(slot);
                return;
            }
        };
        self.push(slot, &bytes);
        if close && let Some(c) = self.conn(slot) {
            c.close_after_flush = true;
        }
        self.flush(slot);
    }

    /// A query of a connection past its handshake.
    fn apply(&mut self, slot: usize, q: Query) {
        let bound = self.store.reply_bound(&q);
        if self.mem.used.saturating_add(bound) > self.mem.cap {
            let r = self.mem.refusal(format!("a reply of up to {bound} bytes"));
            self.refuse(slot, r, true);
            return;
        }
        // A plain client learns of a refused set from the PING it sends
        // after it; a query with a reply is refused by closing.
        let no_reply = matches!(
            q,
            Query::Set(..) | Query::Append(..) | Query::MultiSet(_) | Query::QueuePush(..)
        );
        let result = self.store.apply(slot, q, &self.limits, &mut self.mem);
        match result {
            Ok(out) => {
                if let Some(reply) = out.reply {
                    self.reply(slot, &reply);
                }
                if out.waiting
                    && let Some(c) = self.conn(slot)
                {
                    c.wait_since = Some(Instant::now());
                }
                self.flush(slot);
                self.end_waits(out.ended);
            }
            Err((r, ended)) => {
                self.end_waits(ended);
                self.refuse(slot, r, no_reply);
            }
        }
    }

    fn end_waits(&mut self, ended: Vec<(ConnId, WaitEnd)>) {
        for (id, end) in ended {
            match end {
                WaitEnd::Ready => {
                    if let Some(c) = self.conn(id) {
                        c.wait_since = None;
                        c.last_active = Instant::now();
                    }
                    self.reply(id, &[proto::STOP_WAITING]);
                    self.flush(id);
                }
                WaitEnd::Refused(r) => {
                    self.store.cancel(id, &mut self.mem);
                    self.refuse(id, (*r).clone(), false);
                }
            }
        }
    }

    /// Closes connections past a deadline.
    fn tick(&mut self) {
        let now = Instant::now();
        if self.accept_paused_until.is_some_and(|t| now >= t) {
            self.accept_all();
        }
        let l = &self.limits;
        let mut late = Vec::new();
        for (slot, c) in self.conns.iter().enumerate() {
            let Some(c) = c else { continue };
            let since = |t: Instant| now.saturating_duration_since(t);
            let over = match &c.stage {
                Stage::Validate | Stage::Auth => since(c.accepted) > l.handshake,
                Stage::Refusing(_) | Stage::Refused => {
                    since(c.accepted) > REFUSING_GRACE.min(l.handshake)
                }
                Stage::Ready => {
                    let waiting = self.store.is_waiting(slot);
                    c.query_started.is_some_and(|t| since(t) > l.query)
                        || (!waiting && since(c.last_active) > l.idle)
                        || c.wait_since.is_some_and(|t| waiting && since(t) > MAX_WAIT)
                }
            };
            if over || c.write_stalled.is_some_and(|t| since(t) > l.write) {
                late.push(slot);
            }
        }
        for slot in late {
            if let Some(c) = self.conn(slot) {
                tracing::debug!(peer = %c.peer, "store connection past a deadline; closing");
            }
            self.close(slot);
        }
    }
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
