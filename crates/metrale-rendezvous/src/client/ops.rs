//! The public query API of [`StoreClient`]: one method per query kind,
//! each naming whether it may be sent again after a connection loss
//! (`retry` of [`StoreClient::call`]).
//!
//! Invariants: `add`, `append`, `delete_key`, `queue_push` and `queue_pop`
//! are sent once (`retry` false); every other query is idempotent and may
//! be sent again within its deadline. A set-like query (`set`,
//! `multi_set`, `append`, `queue_push`) is confirmed by a `PING`.

use std::time::{Duration, Instant};

use super::super::RendezvousError;
use super::super::limits::StoreRefusal;
use super::super::proto::{self, Query, query};
use super::{Fail, StoreClient, transport};

impl StoreClient {
    /// Sets `key` to `value`, waking every wait on it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        self.set_by(key, value, self.io_deadline())
    }

    /// [`StoreClient::set`] done by `deadline` (or the I/O timeout, if
    /// sooner), sending again on a lost connection until then.
    pub fn set_by(
        &self,
        key: &str,
        value: &[u8],
        deadline: Instant,
    ) -> Result<(), RendezvousError> {
        let q = Query::new(query::SET).blob(key.as_bytes()).blob(value);
        let deadline = deadline.min(self.io_deadline());
        self.call("set", deadline, true, |live, deadline| {
            self.send_confirmed(live, &q, deadline)
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
            self.send_confirmed(live, &q, self.io_deadline())
        })
    }

    /// Appends `value` to `key` (creating it). Not sent again after a
    /// connection loss.
    pub fn append(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        let q = Query::new(query::APPEND).blob(key.as_bytes()).blob(value);
        self.call("append", self.io_deadline(), false, |live, _| {
            self.send_confirmed(live, &q, self.io_deadline())
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
            self.send_confirmed(live, &q, self.io_deadline())
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
