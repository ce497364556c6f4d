//! The queries a [`super::server::StoreServer`] answers, and the keys it
//! keeps: [`Data`] (the map, its byte count against the store's limit, and
//! who waits on which key) and [`handle`], which reads one query's
//! arguments and answers it.
//!
//! Invariants: a query's arguments are read whole, within its deadline and
//! its memory charge, before the store lock is taken; nothing is written
//! to a socket while the lock is held (replies are queued, and a woken
//! waiter's `STOP_WAITING` is queued under the lock, in order, then
//! flushed after); a query that would pass the store's limit changes
//! nothing and is refused (`WireError::Refused`); PyTorch's semantics are
//! kept where its two servers agree (a `GET` of an absent key answers an
//! empty value, as the libuv server does; a compare-set of an absent key
//! with a non-empty expected value answers that value and sets nothing).

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::proto::{self, WireError, query};
use super::server::{Charge, Conn, Shared};

/// What one kept key costs beyond its bytes, for the store's limit.
const ENTRY_OVERHEAD: usize = 64;

pub(super) struct Waiting {
    remaining: usize,
    keys: Vec<Vec<u8>>,
    conn: Arc<Conn>,
}

#[derive(Default)]
pub(super) struct Data {
    pub(super) map: HashMap<Vec<u8>, Vec<u8>>,
    pub(super) bytes: usize,
    waiters: HashMap<Vec<u8>, Vec<u64>>,
    waiting: HashMap<u64, Waiting>,
}

fn entry_size(key: &[u8], value: &[u8]) -> usize {
    key.len() + value.len() + ENTRY_OVERHEAD
}

impl Data {
    /// Stores `value` under `key` within `cap`; returns the connections
    /// whose wait it ended (their `STOP_WAITING` is queued, not written).
    pub(super) fn put(
        &mut self,
        key: Vec<u8>,
        value: Vec<u8>,
        cap: usize,
    ) -> Result<Vec<Arc<Conn>>, String> {
        let old = self.map.get(&key).map_or(0, |v| entry_size(&key, v));
        let total = self.bytes - old + entry_size(&key, &value);
        if total > cap {
            return Err(format!(
                "the store is full: a set of {} bytes would pass its limit of {cap} bytes",
                value.len()
            ));
        }
        self.bytes = total;
        let woken = self.wake(&key);
        self.map.insert(key, value);
        Ok(woken)
    }

    pub(super) fn remove(&mut self, key: &[u8]) -> bool {
        match self.map.remove(key) {
            Some(v) => {
                self.bytes -= entry_size(key, &v);
                true
            }
            None => false,
        }
    }

    pub(super) fn wake(&mut self, key: &[u8]) -> Vec<Arc<Conn>> {
        let mut woken = Vec::new();
        for id in self.waiters.remove(key).unwrap_or_default() {
            let done = match self.waiting.get_mut(&id) {
                Some(w) => {
                    w.remaining = w.remaining.saturating_sub(1);
                    w.remaining == 0
                }
                None => false,
            };
            if done && let Some(w) = self.waiting.remove(&id) {
                w.conn.waiting.store(false, Ordering::Release);
                w.conn.push(&[proto::STOP_WAITING]);
                woken.push(w.conn);
            }
        }
        woken
    }

    pub(super) fn cancel(&mut self, id: u64) {
        if let Some(w) = self.waiting.remove(&id) {
            w.conn.waiting.store(false, Ordering::Release);
            for k in &w.keys {
                if let Some(ids) = self.waiters.get_mut(k) {
                    ids.retain(|x| *x != id);
                    if ids.is_empty() {
                        self.waiters.remove(k);
                    }
                }
            }
        }
    }
}

fn blob_reply(out: &mut Vec<u8>, value: &[u8]) {
    out.extend_from_slice(&(value.len() as u64).to_le_bytes());
    out.extend_from_slice(value);
}

/// Reads one query's arguments (its type byte is read) and answers it.
pub(super) fn handle(
    shared: &Shared,
    conn: &Arc<Conn>,
    rd: &mut TcpStream,
    kind: u8,
    deadline: Instant,
    charge: &mut Charge<'_>,
) -> Result<(), WireError> {
    let limits = &shared.limits;
    let cap = limits.store_bytes;
    let mut blob = |rd: &mut TcpStream, max: usize, what: &str| -> Result<Vec<u8>, WireError> {
        let len = proto::read_len_by(rd, deadline, max, what)?;
        proto::read_blob_by(rd, deadline, len, |n| charge.take(n))
    };
    let full = |e: String| WireError::Refused(e);
    let flush_all = |woken: Vec<Arc<Conn>>| woken.iter().for_each(|c| c.flush());
    match kind {
        query::PING => {
            let nonce = proto::read_u32_by(rd, deadline)?;
            conn.push(&nonce.to_le_bytes());
        }
        query::SET | query::APPEND => {
            let key = blob(rd, limits.max_key, "key")?;
            let value = blob(rd, limits.max_value, "value")?;
            let mut data = shared.data.lock();
            let value = match (kind, data.map.get(&key)) {
                (query::APPEND, Some(old)) => {
                    if old.len() + value.len() > limits.max_value {
                        return Err(full(format!(
                            "append past the value limit of {} bytes",
                            limits.max_value
                        )));
                    }
                    [old.as_slice(), &value].concat()
                }
                _ => value,
            };
            let woken = data.put(key, value, cap).map_err(full)?;
            drop(data);
            flush_all(woken);
        }
        query::COMPARE_SET => {
            let key = blob(rd, limits.max_key, "key")?;
            let expected = blob(rd, limits.max_value, "value")?;
            let desired = blob(rd, limits.max_value, "value")?;
            let mut out = Vec::new();
            let mut data = shared.data.lock();
            let woken = match data.map.get(&key) {
                None if !expected.is_empty() => {
                    blob_reply(&mut out, &expected);
                    Vec::new()
                }
                Some(current) if *current != expected => {
                    blob_reply(&mut out, current);
                    Vec::new()
                }
                _ => {
                    blob_reply(&mut out, &desired);
                    data.put(key, desired, cap).map_err(full)?
                }
            };
            drop(data);
            conn.push(&out);
            flush_all(woken);
        }
        query::GET => {
            let key = blob(rd, limits.max_key, "key")?;
            let mut out = Vec::new();
            blob_reply(
                &mut out,
                shared.data.lock().map.get(&key).map_or(&[][..], |v| v),
            );
            conn.push(&out);
        }
        query::ADD => {
            let key = blob(rd, limits.max_key, "key")?;
            let delta = proto::read_u64_by(rd, deadline)? as i64;
            let mut data = shared.data.lock();
            let current = match data.map.get(&key) {
                None => 0,
                Some(v) => proto::parse_counter(v).ok_or_else(|| {
                    WireError::Refused("ADD on a key that holds no integer".to_owned())
                })?,
            };
            let next = current.wrapping_add(delta);
            let woken = data
                .put(key, next.to_string().into_bytes(), cap)
                .map_err(full)?;
            drop(data);
            conn.push(&next.to_le_bytes());
            flush_all(woken);
        }
        query::CHECK | query::WAIT | query::MULTI_GET => {
            let count = proto::read_len_by(rd, deadline, limits.max_keys_per_query, "key count")?;
            let mut keys = Vec::with_capacity(count.min(1024));
            for _ in 0..count {
                keys.push(blob(rd, limits.max_key, "key")?);
            }
            let mut data = shared.data.lock();
            match kind {
                query::CHECK => {
                    let ready = keys.iter().all(|k| data.map.contains_key(k));
                    conn.push(&[if ready {
                        proto::CHECK_READY
                    } else {
                        proto::CHECK_NOT_READY
                    }]);
                }
                query::MULTI_GET => {
                    let mut out = Vec::new();
                    for k in &keys {
                        blob_reply(&mut out, data.map.get(k).map_or(&[][..], |v| v));
                    }
                    drop(data);
                    conn.push(&out);
                }
                _ => {
                    if data.waiting.contains_key(&conn.id) {
                        return Err(WireError::Malformed(
                            "a second WAIT while one is pending".to_owned(),
                        ));
                    }
                    keys.retain(|k| !data.map.contains_key(k));
                    if keys.is_empty() {
                        conn.push(&[proto::STOP_WAITING]);
                    } else {
                        for k in &keys {
                            data.waiters.entry(k.clone()).or_default().push(conn.id);
                        }
                        conn.waiting.store(true, Ordering::Release);
                        let waiting = Waiting {
                            remaining: keys.len(),
                            keys,
                            conn: Arc::clone(conn),
                        };
                        data.waiting.insert(conn.id, waiting);
                    }
                }
            }
        }
        query::GETNUMKEYS => {
            let n = shared.data.lock().map.len() as i64;
            conn.push(&n.to_le_bytes());
        }
        query::DELETE_KEY => {
            let key = blob(rd, limits.max_key, "key")?;
            let removed = i64::from(shared.data.lock().remove(&key));
            conn.push(&removed.to_le_bytes());
        }
        query::MULTI_SET => {
            let count = proto::read_len_by(rd, deadline, limits.max_keys_per_query, "key count")?;
            let mut pairs = Vec::with_capacity(count.min(1024));
            for _ in 0..count {
                let key = blob(rd, limits.max_key, "key")?;
                pairs.push((key, blob(rd, limits.max_value, "value")?));
            }
            let mut woken = Vec::new();
            let mut data = shared.data.lock();
            for (key, value) in pairs {
                woken.extend(data.put(key, value, cap).map_err(full)?);
            }
            drop(data);
            flush_all(woken);
        }
        query::METRALE_AUTH if shared.token.is_none() => {
            // A store without a token accepts any: a client with one
            // still connects, as it did before tokens were checked here.
            blob(rd, proto::MAX_TOKEN, "token")?;
            conn.push(&[proto::AUTH_OK]);
        }
        query::CANCEL_WAIT => {
            let mut data = shared.data.lock();
            data.cancel(conn.id);
            conn.push(&[proto::WAIT_CANCELED]);
        }
        other => {
            return Err(WireError::Malformed(format!(
                "query type {other} is not served here"
            )));
        }
    }
    Ok(())
}
