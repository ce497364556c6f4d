//! What the store keeps and how each query changes it: [`Store`] holds the
//! keys, the queues, the pending waits and the refusals kept for later
//! waiters, and [`Store::apply`] answers one parsed query, as PyTorch's
//! libuv server answers it.
//!
//! Invariants:
//! - Every byte kept here is charged to the one [`Memory`] budget before it
//!   is kept, and given back when it goes; a query that would pass the
//!   budget, or build a reply over [`StoreLimits::max_reply`] (its size is
//!   computed first), is refused and changes nothing.
//! - A refused set-like query (set, append, multi-set, compare-set, add,
//!   queue push) changes nothing, ends the waits on every key it names
//!   with its refusal, and the refusal is kept (at most
//!   [`MAX_REFUSED_KEYS`] keys) so that a later wait on such a key gets it
//!   too, until the key is set or deleted.
//! - PyTorch's semantics where its servers agree, and the libuv server's
//!   otherwise: a `GET` or `MULTI_GET` of an absent key answers an empty
//!   value; a compare-set of an absent key with a non-empty expected value
//!   answers that value and sets nothing; a `CHECK` or `WAIT` counts a
//!   non-empty queue as present; a `QUEUE_PUSH` ends one wait on its key.
//!   Where this server differs it says so: an `ADD` that would overflow
//!   is refused (PyTorch's servers wrap), and a compare-set that sets
//!   nothing wakes nobody.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::rc::Rc;

use super::frame::Query;
use super::limits::{StoreLimit, StoreLimits, StoreRefusal};
use super::proto;

/// What one kept key costs beyond its bytes: its table slot at the
/// table's usual load, and two allocations with the allocator's rounding
/// (measured: 7.9 million 3-byte keys with empty values grew the process
/// by about 139 bytes each).
const ENTRY_OVERHEAD: usize = 144;
/// What one queued value costs beyond its bytes.
const QUEUE_ITEM_OVERHEAD: usize = 48;
/// What one pending wait costs, and each of its keys beyond its bytes: the
/// key's shared copy, its slot in the waiters' table and in the wait's
/// list (measured: about 170 bytes for each 3-byte key).
const WAIT_OVERHEAD: usize = 128;
const WAIT_KEY_OVERHEAD: usize = 168;
/// A table is shrunk when it holds fewer than a quarter of its capacity,
/// past this many slots, so memory given back to the budget is given back
/// to the system too.
const SHRINK_ABOVE: usize = 1024;
/// Refusals kept for later waiters, at most, and the bytes set aside for
/// them when the server starts (each is a key's hash and a shared reason
/// of at most [`MAX_REFUSAL_DETAIL`] bytes).
pub(super) const MAX_REFUSED_KEYS: usize = 1024;
pub(super) const REFUSALS_RESERVE: usize = MAX_REFUSED_KEYS * 512;
const MAX_REFUSAL_DETAIL: usize = 256;

/// A connection's handle in the store (its slot in the server).
pub(super) type ConnId = usize;

/// The one byte budget of everything clients make the server hold.
#[derive(Debug)]
pub(super) struct Memory {
    pub(super) used: usize,
    pub(super) cap: usize,
}

impl Memory {
    /// Takes `n` bytes, or refuses (naming `what`) and takes nothing.
    pub(super) fn take(
        &mut self,
        n: usize,
        what: impl FnOnce() -> String,
    ) -> Result<(), StoreRefusal> {
        match self.used.checked_add(n) {
            Some(total) if total <= self.cap => {
                self.used = total;
                Ok(())
            }
            _ => Err(self.refusal(what())),
        }
    }

    /// Whether `n` more bytes fit, without taking them.
    pub(super) fn fits(&self, n: usize, what: impl FnOnce() -> String) -> Result<(), StoreRefusal> {
        match self.used.checked_add(n) {
            Some(total) if total <= self.cap => Ok(()),
            _ => Err(self.refusal(what())),
        }
    }

    pub(super) fn give(&mut self, n: usize) {
        self.used = self.used.saturating_sub(n);
    }

    pub(super) fn refusal(&self, what: String) -> StoreRefusal {
        StoreRefusal::limit(
            StoreLimit::Memory,
            self.cap,
            format!("{what} does not fit ({} bytes in use)", self.used),
        )
    }
}

/// How a wait ended.
#[derive(Debug, Clone)]
pub(super) enum WaitEnd {
    /// Every key is there: `STOP_WAITING`.
    Ready,
    /// A set the wait needed was refused.
    Refused(Rc<StoreRefusal>),
}

/// What a query did: the reply to its sender (without the status byte of
/// the extension), and the waits it ended.
#[derive(Debug, Default)]
pub(super) struct Outcome {
    /// The reply; `None` for queries without one.
    pub(super) reply: Option<Vec<u8>>,
    /// Connections whose wait ended, and how.
    pub(super) ended: Vec<(ConnId, WaitEnd)>,
    /// The sender now waits (its `STOP_WAITING` comes later).
    pub(super) waiting: bool,
}

struct Wait {
    remaining: usize,
    /// The keys not yet there, each at the place its waiter entry names
    /// (`None` once there): an arrival finds its key at once, so a wait
    /// on n keys costs O(n) in all, not O(n^2).
    keys: Vec<Option<Rc<[u8]>>>,
    charge: usize,
}

/// The keys, queues, waits and kept refusals.
#[derive(Default)]
pub(super) struct Store {
    map: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// Who waits on a key, with the key's place in their wait's list.
    waiters: HashMap<Rc<[u8]>, Vec<(ConnId, usize)>>,
    waits: HashMap<ConnId, Wait>,
    /// Kept refusals, by the hash of their key (no key bytes are kept).
    refused: HashMap<u64, Rc<StoreRefusal>>,
    refused_order: VecDeque<u64>,
    hasher: RandomState,
    /// Bytes of keys and values charged (for stats).
    pub(super) kept_bytes: usize,
}

/// Shrinks `table` once it holds under a quarter of its capacity.
fn shrink<K: std::hash::Hash + Eq, V>(table: &mut HashMap<K, V>) {
    if table.capacity() > SHRINK_ABOVE && table.len() < table.capacity() / 4 {
        table.shrink_to(table.len() * 2);
    }
}

fn entry_size(key: &[u8], value: &[u8]) -> usize {
    key.len() + value.len() + ENTRY_OVERHEAD
}

fn blob_reply(out: &mut Vec<u8>, value: &[u8]) {
    out.extend_from_slice(&(value.len() as u64).to_le_bytes());
    out.extend_from_slice(value);
}

fn i64_reply(v: i64) -> Option<Vec<u8>> {
    Some(v.to_le_bytes().to_vec())
}

fn show(key: &[u8]) -> String {
    let text = String::from_utf8_lossy(&key[..key.len().min(200)]);
    if key.len() > 200 {
        format!("`{text}...`")
    } else {
        format!("`{text}`")
    }
}

impl Store {
    /// Keys kept.
    pub(super) fn keys(&self) -> usize {
        self.map.len()
    }

    /// The most reply bytes `q` can queue (before the extension's status
    /// byte), so that memory is checked before it is applied; a reply
    /// built from many keys (`MULTI_GET`, `LIST_KEYS`) is checked in
    /// [`Store::apply`] once its size is known.
    pub(super) fn reply_bound(&self, q: &Query) -> usize {
        let len = |k: &[u8]| self.map.get(k).map_or(0, Vec::len);
        match q {
            Query::Get(k) => 8 + len(k),
            Query::CompareSet(k, e, d) => 8 + len(k).max(e.len()).max(d.len()),
            Query::QueuePop(k) => {
                16 + self
                    .queues
                    .get(k)
                    .and_then(|q| q.front())
                    .map_or(0, Vec::len)
            }
            _ => 64,
        }
    }

    /// Connections with a pending wait.
    pub(super) fn waiting(&self) -> usize {
        self.waits.len()
    }

    /// Whether `conn` has a pending wait.
    pub(super) fn is_waiting(&self, conn: ConnId) -> bool {
        self.waits.contains_key(&conn)
    }

    fn present(&self, key: &[u8]) -> bool {
        self.map.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// Answers `q` from `conn`; `Err` refuses it (and it changed nothing,
    /// except for the waits a refused set ends, which the error carries).
    pub(super) fn apply(
        &mut self,
        conn: ConnId,
        q: Query,
        limits: &StoreLimits,
        mem: &mut Memory,
    ) -> Result<Outcome, (StoreRefusal, Vec<(ConnId, WaitEnd)>)> {
        let mut out = Outcome::default();
        let plain = |r: StoreRefusal| (r, Vec::new());
        match q {
            Query::Ping(nonce) => out.reply = Some(nonce.to_le_bytes().to_vec()),
            Query::Set(key, value) => {
                self.put_all(vec![(key, value)], mem, &mut out)?;
            }
            Query::MultiSet(pairs) => self.put_all(pairs, mem, &mut out)?,
            Query::Append(key, value) => {
                let joined = match self.map.get(&key) {
                    Some(old) if old.len() + value.len() > limits.max_value => {
                        let r = StoreRefusal::limit(
                            StoreLimit::Value,
                            limits.max_value,
                            format!(
                                "an append to {} making a value of {} bytes",
                                show(&key),
                                old.len() + value.len()
                            ),
                        );
                        return Err(self.refuse_keys(r, [key]));
                    }
                    Some(old) => [old.as_slice(), &value].concat(),
                    None => value,
                };
                self.put_all(vec![(key, joined)], mem, &mut out)?;
            }
            Query::CompareSet(key, expected, desired) => {
                let mut reply = Vec::new();
                match self.map.get(&key) {
                    None if !expected.is_empty() => blob_reply(&mut reply, &expected),
                    Some(current) if *current != expected => blob_reply(&mut reply, current),
                    _ => {
                        blob_reply(&mut reply, &desired);
                        self.put_all(vec![(key, desired)], mem, &mut out)?;
                    }
                }
                out.reply = Some(reply);
            }
            Query::Get(key) => {
                let mut reply = Vec::new();
                blob_reply(&mut reply, self.map.get(&key).map_or(&[][..], |v| v));
                out.reply = Some(reply);
            }
            Query::Add(key, delta) => {
                let current = match self.map.get(&key) {
                    None => 0,
                    Some(v) => proto::parse_counter(v).ok_or_else(|| {
                        self.refuse_keys(
                            StoreRefusal::other(format!(
                                "ADD on {}, which holds no integer",
                                show(&key)
                            )),
                            [key.clone()],
                        )
                    })?,
                };
                let Some(next) = current.checked_add(delta) else {
                    let r = StoreRefusal::other(format!(
                        "ADD of {delta} to {} at {} would overflow a 64-bit integer",
                        current,
                        show(&key)
                    ));
                    return Err(self.refuse_keys(r, [key]));
                };
                self.put_all(vec![(key, next.to_string().into_bytes())], mem, &mut out)?;
                out.reply = i64_reply(next);
            }
            Query::Check(keys) => {
                let ready = keys.iter().all(|k| self.present(k));
                out.reply = Some(vec![if ready {
                    proto::CHECK_READY
                } else {
                    proto::CHECK_NOT_READY
                }]);
            }
            Query::Wait(keys) => self.wait(conn, keys, mem, &mut out).map_err(plain)?,
            Query::MultiGet(keys) => {
                let size = keys.iter().fold(0usize, |acc, k| {
                    acc.saturating_add(8 + self.map.get(k).map_or(0, Vec::len))
                });
                if size > limits.max_reply {
                    return Err(plain(StoreRefusal::limit(
                        StoreLimit::Reply,
                        limits.max_reply,
                        format!(
                            "a MULTI_GET of {} keys, whose reply is {size} bytes",
                            keys.len()
                        ),
                    )));
                }
                mem.fits(size, || format!("a MULTI_GET reply of {size} bytes"))
                    .map_err(plain)?;
                let mut reply = Vec::with_capacity(size);
                for k in &keys {
                    blob_reply(&mut reply, self.map.get(k).map_or(&[][..], |v| v));
                }
                out.reply = Some(reply);
            }
            Query::GetNumKeys => out.reply = i64_reply(self.map.len() as i64),
            Query::DeleteKey(key) => {
                self.forget_refusal(&key);
                let removed = self.remove(&key, mem);
                out.reply = i64_reply(i64::from(removed));
            }
            Query::CancelWait => {
                self.cancel(conn, mem);
                out.reply = Some(vec![proto::WAIT_CANCELED]);
            }
            Query::QueuePush(key, value) => {
                let cost = key.len() + value.len() + QUEUE_ITEM_OVERHEAD;
                if let Err(r) = mem.take(cost, || format!("a QUEUE_PUSH of {} bytes", value.len()))
                {
                    return Err(self.refuse_keys(r, [key]));
                }
                self.kept_bytes += cost;
                self.forget_refusal(&key);
                self.queues.entry(key.clone()).or_default().push_back(value);
                self.wake_one(&key, mem, &mut out);
            }
            Query::QueuePop(key) => {
                let mut reply = Vec::new();
                let queue = self.queues.get_mut(&key);
                let len = queue.as_ref().map_or(0, |q| q.len());
                reply.extend_from_slice(&(len as i64).to_le_bytes());
                if let Some(q) = queue
                    && let Some(value) = q.pop_front()
                {
                    let cost = key.len() + value.len() + QUEUE_ITEM_OVERHEAD;
                    mem.give(cost);
                    self.kept_bytes -= cost;
                    blob_reply(&mut reply, &value);
                    if q.is_empty() {
                        self.queues.remove(&key);
                    }
                }
                out.reply = Some(reply);
            }
            Query::QueueLen(key) => {
                out.reply = i64_reply(self.queues.get(&key).map_or(0, |q| q.len() as i64));
            }
            Query::ListKeys => {
                let size = self
                    .map
                    .keys()
                    .fold(8usize, |acc, k| acc.saturating_add(8 + k.len()));
                if size > limits.max_reply {
                    return Err(plain(StoreRefusal::limit(
                        StoreLimit::Reply,
                        limits.max_reply,
                        format!(
                            "a LIST_KEYS of {} keys, whose reply is {size} bytes",
                            self.map.len()
                        ),
                    )));
                }
                mem.fits(size, || format!("a LIST_KEYS reply of {size} bytes"))
                    .map_err(plain)?;
                let mut reply = Vec::with_capacity(size);
                reply.extend_from_slice(&(self.map.len() as i64).to_le_bytes());
                for k in self.map.keys() {
                    blob_reply(&mut reply, k);
                }
                out.reply = Some(reply);
            }
            Query::Barrier(key, world) => self.barrier(conn, key, world, mem, &mut out)?,
            Query::Validate(_) | Query::Auth(_) | Query::Hello(_) | Query::Refuse(..) => {
                // The handshake's queries, handled by the server before a
                // connection gets here.
                return Err(plain(StoreRefusal::other(
                    "a handshake query after the handshake".to_owned(),
                )));
            }
        }
        Ok(out)
    }

    /// Stores every pair, or none: the memory they need is checked first.
    fn put_all(
        &mut self,
        pairs: Vec<(Vec<u8>, Vec<u8>)>,
        mem: &mut Memory,
        out: &mut Outcome,
    ) -> Result<(), (StoreRefusal, Vec<(ConnId, WaitEnd)>)> {
        // The net change, with a key named twice counted at its last value.
        let mut last: HashMap<&[u8], usize> = HashMap::new();
        for (k, v) in &pairs {
            last.insert(k, entry_size(k, v));
        }
        let (mut grow, mut shrink) = (0usize, 0usize);
        for (k, new) in &last {
            let old = self.map.get(*k).map_or(0, |v| entry_size(k, v));
            grow += new.saturating_sub(old);
            shrink += old.saturating_sub(*new);
        }
        drop(last);
        if grow > shrink {
            let need = grow - shrink;
            let what = || {
                if pairs.len() == 1 {
                    format!(
                        "a set of {} bytes at {}",
                        pairs[0].1.len(),
                        show(&pairs[0].0)
                    )
                } else {
                    format!("a MULTI_SET of {} keys ({need} bytes more)", pairs.len())
                }
            };
            if let Err(r) = mem.take(need, what) {
                return Err(self.refuse_keys(r, pairs.into_iter().map(|(k, _)| k)));
            }
            self.kept_bytes += need;
        } else {
            mem.give(shrink - grow);
            self.kept_bytes -= shrink - grow;
        }
        for (key, value) in pairs {
            self.forget_refusal(&key);
            self.wake_all(&key, mem, out);
            self.map.insert(key, value);
        }
        Ok(())
    }

    fn remove(&mut self, key: &[u8], mem: &mut Memory) -> bool {
        match self.map.remove(key) {
            Some(v) => {
                let size = entry_size(key, &v);
                mem.give(size);
                self.kept_bytes -= size;
                shrink(&mut self.map);
                true
            }
            None => false,
        }
    }

    /// Keeps `r` for every key of a refused query and ends their waits.
    pub(super) fn refuse_keys(
        &mut self,
        r: StoreRefusal,
        keys: impl IntoIterator<Item = Vec<u8>>,
    ) -> (StoreRefusal, Vec<(ConnId, WaitEnd)>) {
        const ELSEWHERE: &str = " (refused at another client's set)";
        let mut detail = if r.detail.ends_with(ELSEWHERE) {
            r.detail.clone()
        } else {
            format!("{}{ELSEWHERE}", r.detail)
        };
        if detail.len() > MAX_REFUSAL_DETAIL {
            let mut end = MAX_REFUSAL_DETAIL;
            while !detail.is_char_boundary(end) {
                end -= 1;
            }
            detail.truncate(end);
        }
        let shared = Rc::new(StoreRefusal {
            detail,
            ..r.clone()
        });
        let mut ended = Vec::new();
        for key in keys {
            for &(id, _) in self.waiters.get(key.as_slice()).into_iter().flatten() {
                ended.push((id, WaitEnd::Refused(Rc::clone(&shared))));
            }
            let h = self.hasher.hash_one(&key);
            if self.refused.insert(h, Rc::clone(&shared)).is_none() {
                self.refused_order.push_back(h);
                if self.refused_order.len() > MAX_REFUSED_KEYS
                    && let Some(old) = self.refused_order.pop_front()
                {
                    self.refused.remove(&old);
                }
            }
        }
        (r, ended)
    }

    fn forget_refusal(&mut self, key: &[u8]) {
        if self.refused.is_empty() {
            return;
        }
        let h = self.hasher.hash_one(key);
        if self.refused.remove(&h).is_some() {
            self.refused_order.retain(|k| *k != h);
        }
    }

    /// Registers `conn`'s wait on the keys not present, or answers at once.
    fn wait(
        &mut self,
        conn: ConnId,
        keys: Vec<Vec<u8>>,
        mem: &mut Memory,
        out: &mut Outcome,
    ) -> Result<(), StoreRefusal> {
        if self.waits.contains_key(&conn) {
            return Err(StoreRefusal::other("a second WAIT while one is pending"));
        }
        let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !self.present(k)).collect();
        if missing.is_empty() {
            out.reply = Some(vec![proto::STOP_WAITING]);
            return Ok(());
        }
        if !self.refused.is_empty()
            && let Some(r) = missing
                .iter()
                .find_map(|k| self.refused.get(&self.hasher.hash_one(k)))
        {
            return Err((**r).clone());
        }
        let charge = missing
            .iter()
            .fold(WAIT_OVERHEAD, |acc, k| acc + k.len() + WAIT_KEY_OVERHEAD);
        mem.take(charge, || {
            format!("a WAIT on {} keys ({charge} bytes)", missing.len())
        })?;
        let keys: Vec<Rc<[u8]>> = missing.into_iter().map(Rc::from).collect();
        for (at, k) in keys.iter().enumerate() {
            self.waiters
                .entry(Rc::clone(k))
                .or_default()
                .push((conn, at));
        }
        let keys: Vec<Option<Rc<[u8]>>> = keys.into_iter().map(Some).collect();
        self.waits.insert(
            conn,
            Wait {
                remaining: keys.len(),
                keys,
                charge,
            },
        );
        out.waiting = true;
        Ok(())
    }

    /// PyTorch's `BARRIER`: counts arrivals under `key` (decimal text, as
    /// `ADD` keeps it) and ends every wait on it once `world` arrived.
    fn barrier(
        &mut self,
        conn: ConnId,
        key: Vec<u8>,
        world: i64,
        mem: &mut Memory,
        out: &mut Outcome,
    ) -> Result<(), (StoreRefusal, Vec<(ConnId, WaitEnd)>)> {
        if self.waits.contains_key(&conn) {
            return Err((
                StoreRefusal::other("a BARRIER while a wait is pending"),
                Vec::new(),
            ));
        }
        let count = match self.map.get(&key) {
            None => 1,
            Some(v) => proto::parse_counter(v)
                .and_then(|c| c.checked_add(1))
                .ok_or_else(|| {
                    (
                        StoreRefusal::other(format!(
                            "BARRIER on {}, which holds no count",
                            show(&key)
                        )),
                        Vec::new(),
                    )
                })?,
        };
        let value = count.to_string().into_bytes();
        let old = self.map.get(&key).map_or(0, |v| entry_size(&key, v));
        let new = entry_size(&key, &value);
        let wait_charge = WAIT_OVERHEAD + key.len() + WAIT_KEY_OVERHEAD;
        // The value can shrink (a count kept with leading zeros or blanks,
        // as `ADD` accepts it): what it no longer takes is given back.
        let need = new.saturating_sub(old) + if count >= world { 0 } else { wait_charge };
        mem.take(need, || format!("a BARRIER at {}", show(&key)))
            .map_err(|r| (r, Vec::new()))?;
        mem.give(old.saturating_sub(new));
        self.kept_bytes = (self.kept_bytes + new).saturating_sub(old);
        self.map.insert(key.clone(), value);
        if count >= world {
            self.wake_all(&key, mem, out);
            out.reply = Some(vec![proto::STOP_WAITING]);
        } else {
            let key: Rc<[u8]> = Rc::from(key);
            self.waiters
                .entry(Rc::clone(&key))
                .or_default()
                .push((conn, 0));
            self.waits.insert(
                conn,
                Wait {
                    remaining: 1,
                    keys: vec![Some(key)],
                    charge: wait_charge,
                },
            );
            out.waiting = true;
        }
        Ok(())
    }

    /// Ends, for every wait on `key`, that key's part; a wait with no key
    /// left ends.
    fn wake_all(&mut self, key: &[u8], mem: &mut Memory, out: &mut Outcome) {
        let Some(ids) = self.waiters.remove(key) else {
            return;
        };
        for (id, at) in ids {
            self.satisfy(id, at, mem, out);
        }
        shrink(&mut self.waiters);
        shrink(&mut self.waits);
    }

    /// A queue push: ends the first wait on `key` that it completes.
    fn wake_one(&mut self, key: &[u8], mem: &mut Memory, out: &mut Outcome) {
        let Some(ids) = self.waiters.get_mut(key) else {
            return;
        };
        let ids = std::mem::take(ids);
        let mut rest = Vec::new();
        let mut done = false;
        for (id, at) in ids {
            if done {
                rest.push((id, at));
                continue;
            }
            done = self.satisfy(id, at, mem, out);
        }
        if rest.is_empty() {
            self.waiters.remove(key);
        } else if let Some(slot) = self.waiters.get_mut(key) {
            *slot = rest;
        }
    }

    /// Marks the key at `at` of `id`'s wait as there; returns whether the
    /// wait ended.
    fn satisfy(&mut self, id: ConnId, at: usize, mem: &mut Memory, out: &mut Outcome) -> bool {
        let Some(w) = self.waits.get_mut(&id) else {
            return false;
        };
        if w.keys.get_mut(at).and_then(Option::take).is_some() {
            w.remaining = w.remaining.saturating_sub(1);
        }
        if w.remaining > 0 {
            return false;
        }
        if let Some(w) = self.waits.remove(&id) {
            mem.give(w.charge);
        }
        out.ended.push((id, WaitEnd::Ready));
        true
    }

    /// Drops `conn`'s wait, if any (a cancel, or the connection closing).
    pub(super) fn cancel(&mut self, conn: ConnId, mem: &mut Memory) {
        let Some(w) = self.waits.remove(&conn) else {
            return;
        };
        mem.give(w.charge);
        for k in w.keys.iter().flatten() {
            if let Some(ids) = self.waiters.get_mut(&**k) {
                ids.retain(|x| x.0 != conn);
                if ids.is_empty() {
                    self.waiters.remove(&**k);
                }
            }
        }
        shrink(&mut self.waiters);
        shrink(&mut self.waits);
    }
}
