//! The store server's one thread: a `mio` poll loop over the listener and
//! every connection, with the store (`queries::Store`) and the memory
//! budget (`queries::Memory`) it owns. `io` reads and writes a
//! connection's bytes; `answer` answers its queries and refusals.
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
//!   grows; replies are charged when queued (past the [`PREPAID_OUT`]
//!   bytes a connection's [`CONN_OVERHEAD`] pays for) and given back when
//!   written. A reply's bound is checked against memory before its query
//!   is applied.
//! - A connection with more than [`OUT_HIGH_WATER`] bytes unwritten reads
//!   no more queries until they drain, and one whose replies cannot be
//!   written, or drain slower than `io::MIN_DRAIN_RATE`, for
//!   [`StoreLimits::write`] is closed.
//! - Deadlines (handshake, query, idle, write, a refusal's last word) are
//!   checked every [`TICK`]; `poll` never waits longer.
//! - A client of ours is told every refusal, and keeps its connection
//!   unless the query was not read whole; a plain client's connection is
//!   closed (one whose set was refused whole may still have a `PING`
//!   answered with the nonce's complement, within a second).
//! - At the cap, the oldest connection in its handshake for at least
//!   [`HANDSHAKE_GRACE`] is closed for the new one; a connection past its
//!   handshake is never evicted.
//! - One turn of the loop reads at most [`READ_BUDGET`] bytes of each
//!   connection (one read of the scratch buffer); one with more waiting
//!   is resumed the next turn, after every other ready connection,
//!   accepting and the deadlines, so one client sending without pause
//!   cannot keep the loop from the others.
//! - Before its handshake is through a connection may send only the
//!   handshake's queries (`frame::handshake_query`); anything else closes
//!   it, so a client without the token makes the store hold nothing but
//!   its connection and a token's bytes.
//! - A panic while handling one connection (its events, its admission,
//!   its resumption) closes that connection and nothing else.
//!
//! Lock order: there are no locks here. The loop thread owns the
//! connections, the store and the memory budget, and shares only
//! `server::Shared` (atomics) with the server's handle.

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

use super::frame::Scanner;
use super::limits::{MAX_WAIT, StoreLimit, StoreLimits, StoreRefusal};
use super::queries::{Memory, REFUSALS_RESERVE, Store};
use super::server::Shared;

/// The listener's token; connections are `CONN_BASE + slot`.
mod answer;
mod io;

use io::{Conn, Stage};

const LISTENER: Token = Token(0);
/// The waker's token.
pub(super) const WAKER: Token = Token(1);
const CONN_BASE: usize = 2;
/// How often deadlines are checked.
const TICK: Duration = Duration::from_millis(100);
/// What a connection costs beyond its buffers; it covers its first
/// [`PREPAID_OUT`] bytes of unwritten replies.
const CONN_OVERHEAD: usize = 1024;
/// Unwritten reply bytes a connection's overhead pays for: a small reply
/// (a `PING`'s echo, a `WAIT`'s answer) is never refused for memory.
pub(super) const PREPAID_OUT: usize = 256;
/// The scratch buffer a read fills.
const SCRATCH: usize = 64 << 10;
/// Unwritten bytes past which a connection's queries wait.
pub(super) const OUT_HIGH_WATER: usize = 1 << 20;
/// How long a refused connection may take to hear why.
const REFUSING_GRACE: Duration = Duration::from_secs(1);
/// How long a connection stays in its handshake before it can be evicted.
const HANDSHAKE_GRACE: Duration = Duration::from_secs(1);
/// Connections being refused at once, at most; past it, a connection over
/// the cap is closed at once.
const MAX_REFUSING: usize = 64;
/// How long a connection being refused may stay silent before a new one
/// to refuse takes its place (when [`MAX_REFUSING`] are being refused).
const SILENT_REFUSING: Duration = Duration::from_millis(100);
/// Bytes one connection may have read in one turn of the loop.
pub(super) const READ_BUDGET: usize = SCRATCH;
/// A tail kept when its buffer shrinks.
pub(super) const KEEP_CAPACITY: usize = 4096;

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
    /// The connection whose queries are being served: its replies are
    /// written once they are all queued (`io::Loop::take_bytes`).
    deferred: Option<usize>,
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
        deferred: None,
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
            // Connections left with bytes to read are served next turn,
            // after everyone else's events: no sleep while they wait.
            let timeout = if self.resume.is_empty() {
                next_tick.saturating_duration_since(Instant::now())
            } else {
                Duration::ZERO
            };
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
                        self.guarded(slot, |lp| {
                            if ev.is_writable() || ev.is_write_closed() {
                                lp.flush(slot);
                            }
                            let end = ev.is_read_closed() || ev.is_error();
                            if ev.is_readable() || end {
                                lp.read(slot, end);
                            }
                        });
                    }
                }
            }
            // This turn's resumed connections; those they push back wait
            // for the next turn.
            for slot in std::mem::take(&mut self.resume) {
                let ready = self.conn(slot).is_some_and(|c| {
                    c.queued = false;
                    c.unread && c.pending_out() <= OUT_HIGH_WATER
                });
                // The queries already in the tail first: the client may
                // have sent them all and be waiting for their replies.
                if ready {
                    self.guarded(slot, |lp| {
                        if lp.take_bytes(slot, &[]) {
                            lp.read(slot, true);
                        }
                    });
                }
            }
            if Instant::now() >= next_tick {
                self.tick();
                next_tick = Instant::now() + TICK;
            }
            self.publish();
        }
    }

    /// Runs `f` on connection `slot`'s behalf: a panic in it closes that
    /// connection and nothing else.
    fn guarded(&mut self, slot: usize, f: impl FnOnce(&mut Loop)) {
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut *self)));
        if ok.is_err() {
            tracing::error!("store connection handler panicked; closing it");
            self.deferred = None;
            // The scratch buffer may have been taken out.
            if self.scratch.len() != SCRATCH {
                self.scratch = vec![0u8; SCRATCH];
            }
            self.close(slot);
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
            if self.refusing >= MAX_REFUSING && !self.drop_silent_refusing(now) {
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
            stall_written: 0,
            close_after_flush: false,
            unread: true,
            queued: false,
        });
        // Bytes may already be there (edge-triggered: no event for them).
        self.guarded(slot, |lp| lp.read(slot, true));
    }

    /// The slot of the oldest connection (by acceptance) for which `pick`
    /// holds.
    fn oldest(&self, pick: impl Fn(&Conn) -> bool) -> Option<usize> {
        self.conns
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().filter(|c| pick(c)).map(|c| (i, c.accepted)))
            .min_by_key(|&(_, accepted)| accepted)
            .map(|(i, _)| i)
    }

    /// Closes the oldest connection being refused that has sent nothing for
    /// [`SILENT_REFUSING`] (a client of ours asks at once, so a silent one
    /// is not listening), making room to tell a new one why; whether there
    /// was one.
    fn drop_silent_refusing(&mut self, now: Instant) -> bool {
        let victim = self.oldest(|c| {
            matches!(c.stage, Stage::Refusing(_))
                && c.last_active == c.accepted
                && now.duration_since(c.accepted) >= SILENT_REFUSING
        });
        victim.inspect(|&i| self.close(i)).is_some()
    }

    /// Closes the oldest connection in its handshake for at least the
    /// grace, for a new one; whether there was one.
    fn evict_one(&mut self, now: Instant) -> bool {
        let victim =
            self.oldest(|c| c.in_handshake() && now.duration_since(c.accepted) >= HANDSHAKE_GRACE);
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

    /// The numbers a client may look at right after its reply.
    fn publish_light(&self) {
        let s = &self.shared.stats;
        s.keys.store(self.store.keys(), Ordering::Release);
        s.store_bytes
            .store(self.store.kept_bytes, Ordering::Release);
        s.memory.store(self.mem.used, Ordering::Release);
        s.refusals.store(self.refusals, Ordering::Release);
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
