//! What the store loop answers a connection: the handshake (`VALIDATE`,
//! the token, `METRALE_HELLO`), a query past it (applied to the store,
//! its reply queued, the waits it ends told), and refusals.
//!
//! Invariants: a client that speaks the extension is told every refusal,
//! and its connection stays open unless the query was not read whole (the
//! stream is then out of step); a plain client's connection is closed, and
//! one whose set was refused whole may have one `PING` answered with the
//! nonce's complement first;
//! a refused set-like query ends the waits on the keys it names; a reply's
//! bound is checked against memory before its query is applied.

use std::time::Instant;

use super::super::frame::Query;
use super::super::limits::{StoreLimit, StoreRefusal};
use super::super::proto;
use super::super::queries::{ConnId, WaitEnd};
use super::io::Stage;
use super::{Loop, PREPAID_OUT};

/// What a refusal refuses, which decides whether the connection stays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    /// A query not read whole (over a bound, or past memory): the stream
    /// is out of step, the connection closes.
    Frame,
    /// A query read whole; a plain client's `PING` after it gets the
    /// nonce's complement when `answer_ping` (a set, which has no reply).
    Whole { answer_ping: bool },
    /// A wait a refused set ended.
    Wait,
}

impl Loop {
    /// Refuses the connection's query (or ends its wait with a refusal):
    /// a client that speaks the extension is told why.
    pub(super) fn refuse(&mut self, slot: usize, r: StoreRefusal, how: Refusal) {
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
            // A query read whole, or a wait, leaves the stream in step.
            if how == Refusal::Frame
                && let Some(c) = self.conn(slot)
            {
                c.close_after_flush = true;
            }
            self.flush(slot);
            return;
        }
        match how {
            Refusal::Whole { answer_ping: true } => {
                if let Some(c) = self.conn(slot) {
                    c.stage = Stage::Refused;
                    c.accepted = Instant::now();
                }
            }
            _ => self.close(slot),
        }
    }

    /// Refuses a query that was not read whole (over a bound, or past
    /// memory), ending the waits on the keys it names.
    pub(super) fn refuse_set(&mut self, slot: usize, r: StoreRefusal, keys: Vec<Vec<u8>>) {
        let ready = self.conn(slot).is_some_and(|c| c.stage == Stage::Ready);
        if ready && !keys.is_empty() {
            let (r, ended) = self.store.refuse_keys(r, keys);
            self.end_waits(ended);
            self.refuse(slot, r, Refusal::Frame);
        } else {
            self.refuse(slot, r, Refusal::Frame);
        }
    }

    pub(super) fn serve_query(&mut self, slot: usize, q: Query) {
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
            (Stage::Ready, Query::Refuse(key, refusal)) => {
                let ext = self.conn(slot).is_some_and(|c| c.ext);
                let Some(mut r) = proto::refusal_from_bytes(&refusal).filter(|_| ext) else {
                    self.close(slot);
                    return;
                };
                // Kept for later waiters: the variable is the limit's own
                // (never the client's text), the detail is cut short by
                // `refuse_keys`.
                r.variable = r.limit.variable().to_string();
                let (_, ended) = self.store.refuse_keys(r, [key]);
                self.end_waits(ended);
                (vec![proto::STATUS_OK], false)
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
        self.flush_soon(slot);
    }

    /// A query of a connection past its handshake.
    pub(super) fn apply(&mut self, slot: usize, q: Query) {
        // A plain client learns of a refused set from the PING it sends
        // after it; a query with a reply is refused by closing.
        let answer_ping = matches!(
            q,
            Query::Set(..) | Query::Append(..) | Query::MultiSet(_) | Query::QueuePush(..)
        );
        let bound = self.store.reply_bound(&q);
        let pending = self.conn(slot).map_or(0, |c| c.pending_out());
        // The status byte of the extension counts too.
        let prepaid = pending + bound < PREPAID_OUT;
        if !prepaid && self.mem.used.saturating_add(bound) > self.mem.cap {
            let r = self.mem.refusal(format!("a reply of up to {bound} bytes"));
            self.refuse(slot, r, Refusal::Whole { answer_ping });
            return;
        }
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
                self.flush_soon(slot);
                self.end_waits(out.ended);
            }
            Err((r, ended)) => {
                self.end_waits(ended);
                self.refuse(slot, r, Refusal::Whole { answer_ping });
            }
        }
    }

    pub(super) fn end_waits(&mut self, ended: Vec<(ConnId, WaitEnd)>) {
        for (id, end) in ended {
            match end {
                WaitEnd::Ready => {
                    if let Some(c) = self.conn(id) {
                        c.wait_since = None;
                        c.last_active = Instant::now();
                    }
                    self.reply(id, &[proto::STOP_WAITING]);
                    self.flush_soon(id);
                }
                WaitEnd::Refused(r) => {
                    // One refusal per wait: a set naming two of its keys
                    // (or a wait naming one key twice) ends it once.
                    if !self.store.is_waiting(id) {
                        continue;
                    }
                    self.store.cancel(id, &mut self.mem);
                    self.refuse(id, (*r).clone(), Refusal::Wait);
                }
            }
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
