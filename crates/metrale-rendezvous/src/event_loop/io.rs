//! The store loop's socket I/O for one connection: reading into the
//! shared scratch buffer and keeping only an unfinished query's tail
//! (charged to memory by its capacity), queuing replies (charged when
//! queued, given back when written), and writing them without blocking.
//!
//! Invariants: a connection with more than [`OUT_HIGH_WATER`] bytes
//! unwritten reads no more until they drain (it is resumed then), and one
//! whose replies drain slower than [`MIN_DRAIN_RATE`] is closed at the
//! write deadline; one turn of the loop reads at most [`READ_BUDGET`]
//! bytes of a connection, which sits in the resume queue at most once;
//! before its handshake a connection may send only the handshake's
//! queries; a tail or a reply never holds memory the budget did not
//! grant; nothing here blocks.

use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::time::Instant;

use mio::net::TcpStream;

use super::super::frame::{self, Scan, Scanner};
use super::super::limits::StoreRefusal;
use super::super::proto;
use super::{KEEP_CAPACITY, Loop, OUT_HIGH_WATER, PREPAID_OUT, READ_BUDGET};

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Stage {
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

pub(super) struct Conn {
    pub(super) sock: TcpStream,
    pub(super) peer: SocketAddr,
    pub(super) stage: Stage,
    pub(super) ext: bool,
    /// The unfinished tail of a query, and the capacity charged for it.
    pub(super) tail: Vec<u8>,
    pub(super) tail_charged: usize,
    pub(super) scanner: Scanner,
    /// Unwritten reply bytes from `out_pos`, and what they are charged.
    pub(super) out: Vec<u8>,
    pub(super) out_pos: usize,
    pub(super) out_charged: usize,
    pub(super) accepted: Instant,
    pub(super) query_started: Option<Instant>,
    pub(super) last_active: Instant,
    pub(super) wait_since: Option<Instant>,
    pub(super) write_stalled: Option<Instant>,
    /// Bytes written since `write_stalled` was set: a reply that drains
    /// too slowly stays stalled ([`Loop::flush`]).
    pub(super) stall_written: usize,
    /// Close once the replies are written.
    pub(super) close_after_flush: bool,
    /// Bytes may be waiting in the socket (reading stopped early).
    pub(super) unread: bool,
    /// In the loop's resume queue (at most once: a client that sends
    /// without pause would otherwise be queued once per reply).
    pub(super) queued: bool,
}

/// The slowest a client may read its replies once a write would block:
/// slower, and it is closed at the write deadline.
pub(super) const MIN_DRAIN_RATE: usize = 1 << 20;

/// The bytes a stalled connection must read within the write deadline.
fn drain_step(write: std::time::Duration) -> usize {
    ((write.as_secs_f64() * MIN_DRAIN_RATE as f64) as usize).max(64 << 10)
}

impl Conn {
    pub(super) fn pending_out(&self) -> usize {
        self.out.len() - self.out_pos
    }

    pub(super) fn in_handshake(&self) -> bool {
        matches!(self.stage, Stage::Validate | Stage::Auth)
    }
}

impl Loop {
    /// Reads what the socket has and serves every whole query in it.
    /// At most [`READ_BUDGET`] bytes per turn of the loop: the rest waits
    /// for the next turn (the connection is resumed), so one client that
    /// sends without pause never keeps the loop from the others, from
    /// accepting and from its deadlines.
    ///
    /// A read that fills less than the scratch buffer emptied the socket:
    /// bytes that come after it raise a new readiness event, so it is not
    /// followed by a read that would block, unless `to_the_end` (the peer
    /// closed or failed: its end is read now, as no event will follow).
    pub(super) fn read(&mut self, slot: usize, to_the_end: bool) {
        let mut budget = READ_BUDGET;
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
            if budget == 0 {
                c.unread = true;
                if !std::mem::replace(&mut c.queued, true) {
                    self.resume.push_back(slot);
                }
                return;
            }
            match c.sock.read(&mut self.scratch) {
                Ok(0) => {
                    self.close(slot);
                    return;
                }
                Ok(n) => {
                    budget = budget.saturating_sub(n);
                    let emptied = n < self.scratch.len() && !to_the_end;
                    let buf = std::mem::take(&mut self.scratch);
                    let go_on = self.take_bytes(slot, &buf[..n]);
                    self.scratch = buf;
                    if !go_on {
                        return;
                    }
                    if emptied {
                        if let Some(c) = self.conn(slot) {
                            c.unread = false;
                        }
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
    /// must read no more for now. Their replies are written together, in
    /// one write, once they are all queued.
    pub(super) fn take_bytes(&mut self, slot: usize, bytes: &[u8]) -> bool {
        let outer = self.deferred.replace(slot);
        let go_on = self.take_bytes_now(slot, bytes);
        self.deferred = outer;
        if self.conn(slot).is_some_and(|c| c.pending_out() > 0) {
            self.flush(slot);
        }
        go_on && self.conn(slot).is_some()
    }

    fn take_bytes_now(&mut self, slot: usize, bytes: &[u8]) -> bool {
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
            // Before its handshake is through, a connection may send only
            // the handshake's queries: nothing it sends is kept or charged
            // beyond a token's length.
            if c.stage != Stage::Ready && !frame::handshake_query(view[0]) {
                tracing::debug!(peer = %c.peer, kind = view[0], "store query before the handshake; closing");
                self.close(slot);
                return false;
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
                let keys = self.conn(slot).map_or_else(Vec::new, |c| {
                    c.tail_charged = charged;
                    frame::keys_named(&c.tail)
                });
                self.refuse_set(slot, r, keys);
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
    pub(super) fn push(&mut self, slot: usize, bytes: &[u8]) {
        let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        if c.out_pos > 0 && c.out_pos == c.out.len() {
            c.out.clear();
            c.out_pos = 0;
        }
        c.out.extend_from_slice(bytes);
        // The first PREPAID_OUT bytes are paid by the connection's overhead.
        let charged = c.out.capacity().saturating_sub(PREPAID_OUT);
        let grown = charged.saturating_sub(c.out_charged);
        c.out_charged = charged.max(c.out_charged);
        self.mem.used += grown;
        self.io_charged += grown;
    }

    /// A reply to the connection's query, with its status byte when the
    /// connection speaks the extension.
    pub(super) fn reply(&mut self, slot: usize, bytes: &[u8]) {
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

    /// Writes what is queued, unless the connection's queries are being
    /// served ([`Loop::take_bytes`] writes their replies once, after).
    pub(super) fn flush_soon(&mut self, slot: usize) {
        if self.deferred != Some(slot) {
            self.flush(slot);
        }
    }

    /// Writes what is queued; closes a connection that asked to close once
    /// written (a stalled one is closed at the tick).
    pub(super) fn flush(&mut self, slot: usize) {
        self.publish_light();
        let drain_step = drain_step(self.limits.write);
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
                    // A stall ends when the client has read what the write
                    // deadline's worth of MIN_DRAIN_RATE comes to, not at
                    // any progress: a client reading a byte at a time
                    // cannot hold its replies' memory for ever.
                    c.stall_written += n;
                    if c.stall_written >= drain_step {
                        c.write_stalled = None;
                        c.stall_written = 0;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if c.write_stalled.is_none() {
                        c.write_stalled = Some(Instant::now());
                        c.stall_written = 0;
                    }
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
        c.stall_written = 0;
        c.out = Vec::new();
        c.out_pos = 0;
        let give = c.out_charged;
        c.out_charged = 0;
        let (close, resume) = (c.close_after_flush, c.unread && !c.queued);
        c.queued |= resume;
        self.mem.give(give);
        self.io_charged -= give;
        if close {
            self.close(slot);
        } else if resume {
            self.resume.push_back(slot);
        }
    }
}
