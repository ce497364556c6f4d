//! One query on a live connection: [`StoreClient::call`] takes the
//! connection lock, replaces a missing or stale connection, and runs the
//! query, reconnecting (and, for an idempotent query, sending it again)
//! after a transport failure, within the query's deadline; the helpers
//! read status bytes, confirm sets with a `PING` and run a wait with its
//! cancel.
//!
//! Invariants:
//! - The connection lock is held for the whole query, waits included, so
//!   the replies on a connection are read in the order of its queries.
//! - After a `Fail::Fatal` or a transport failure the connection is
//!   dropped; after a `Fail::Clean` it is kept and counts as used.
//! - A query sent only once goes on a connection a `PING` just proved
//!   alive, and is not sent again after a transport failure.

use std::time::{Duration, Instant};

use super::super::RendezvousError;
use super::super::proto::{self, Query, query};
use super::connect::sleep_backoff;
use super::{Fail, Live, MAX_REPLY_VALUE, STALE_AFTER, StoreClient, TIMED_OUT, transport, wire};

impl StoreClient {
    /// Reads a reply's status byte (on a connection that speaks the
    /// extension): a refusal in its place is the store's reason.
    pub(super) fn status(&self, live: &mut Live, deadline: Instant) -> Result<(), Fail> {
        if !live.ext {
            return Ok(());
        }
        match proto::read_u8_by(&mut live.stream, deadline) {
            Ok(proto::STATUS_OK) => Ok(()),
            Ok(proto::STATUS_REFUSED) => {
                let r = proto::read_refusal(&mut live.stream, self.io_deadline()).map_err(wire)?;
                // The store keeps a connection whose query it read whole.
                Err(Fail::Clean(RendezvousError::StoreRefused {
                    addr: self.addr,
                    refusal: r,
                }))
            }
            Ok(other) => Err(Fail::Fatal(RendezvousError::Protocol(format!(
                "a reply's status byte is {other}"
            )))),
            Err(e) => Err(Fail::Transport(e)),
        }
    }

    /// Runs `op` on a live connection by `deadline`, reconnecting (and,
    /// when `retry`, running it again) after a transport failure.
    pub(super) fn call<T>(
        &self,
        what: &str,
        deadline: Instant,
        retry: bool,
        mut op: impl FnMut(&mut Live, Instant) -> Result<T, Fail>,
    ) -> Result<T, RendezvousError> {
        let mut guard = self.conn.lock();
        let mut pause = Duration::from_millis(10);
        loop {
            if guard
                .as_ref()
                .is_none_or(|live| live.used.elapsed() >= STALE_AFTER)
            {
                *guard = None;
                *guard = Some(self.open(deadline.max(proto::after(self.min_connect)))?);
            }
            let Some(live) = guard.as_mut() else {
                return Err(RendezvousError::Closed);
            };
            if !retry {
                // A query sent only once goes on a connection just proven
                // alive: the store may have closed an idle one.
                match self.ping_on(live) {
                    Ok(()) => {}
                    Err(Fail::Transport(e)) => {
                        tracing::debug!(error = %e, what, "store connection gone; reconnecting");
                        *guard = None;
                        continue;
                    }
                    Err(Fail::Fatal(e) | Fail::Clean(e)) => {
                        *guard = None;
                        return Err(e);
                    }
                }
            }
            match op(live, deadline) {
                Ok(v) => {
                    live.used = Instant::now();
                    return Ok(v);
                }
                Err(Fail::Clean(e)) => {
                    live.used = Instant::now();
                    return Err(e);
                }
                Err(Fail::Fatal(e)) => {
                    *guard = None;
                    return Err(e);
                }
                Err(Fail::Transport(e)) => {
                    *guard = None;
                    if !retry || Instant::now() >= deadline {
                        return Err(RendezvousError::io(
                            format!("{what} at the store {}", self.addr),
                            e,
                        ));
                    }
                    tracing::debug!(error = %e, what, "store connection lost; sending again");
                    sleep_backoff(&mut pause, deadline);
                }
            }
        }
    }

    pub(super) fn ping_on(&self, live: &mut Live) -> Result<(), Fail> {
        proto::send(
            &mut live.stream,
            Query::new(query::PING).u32(self.nonce).bytes(),
        )
        .map_err(transport)?;
        self.status(live, self.io_deadline())?;
        let echo = proto::read_u32_by(&mut live.stream, self.io_deadline()).map_err(transport)?;
        if echo == self.nonce {
            Ok(())
        } else {
            Err(Fail::Fatal(RendezvousError::Protocol(format!(
                "PING answered {echo:#x}"
            ))))
        }
    }

    pub(super) fn io_deadline(&self) -> Instant {
        proto::after(self.io_timeout)
    }

    /// Sends `q` and a `PING`; the echo proves the store applied `q`.
    /// The replies are read by `deadline`.
    pub(super) fn send_confirmed(
        &self,
        live: &mut Live,
        q: &Query,
        deadline: Instant,
    ) -> Result<(), Fail> {
        let mut bytes = q.bytes().to_vec();
        bytes.extend_from_slice(Query::new(query::PING).u32(self.nonce).bytes());
        proto::send(&mut live.stream, &bytes).map_err(transport)?;
        if let Err(refused) = self.status(live, deadline) {
            // A refused set has no reply of its own: its refusal comes in
            // place of the PING's, which still follows on a connection
            // the store keeps.
            let Fail::Clean(e) = refused else {
                return Err(refused);
            };
            let in_step = self.status(live, deadline).is_ok()
                && proto::read_u32_by(&mut live.stream, deadline)
                    .is_ok_and(|echo| echo == self.nonce);
            return Err(if in_step {
                Fail::Clean(e)
            } else {
                Fail::Fatal(e)
            });
        }
        let echo = proto::read_u32_by(&mut live.stream, deadline).map_err(transport)?;
        if echo == !self.nonce {
            return Err(Fail::Fatal(RendezvousError::Protocol(format!(
                "the store at {} refused the query: it is full or the value is over its \
                 limit (see the store's log)",
                self.addr
            ))));
        }
        if echo != self.nonce {
            return Err(Fail::Fatal(RendezvousError::Protocol(format!(
                "PING answered {echo:#x}, not this client's nonce"
            ))));
        }
        Ok(())
    }

    /// Sends `q` and reads its reply's status byte.
    pub(super) fn ask(&self, live: &mut Live, q: &Query) -> Result<(), Fail> {
        proto::send(&mut live.stream, q.bytes()).map_err(transport)?;
        self.status(live, self.io_deadline())
    }

    pub(super) fn read_value(&self, live: &mut Live) -> Result<Vec<u8>, Fail> {
        let deadline = self.io_deadline();
        let len = proto::read_len_by(&mut live.stream, deadline, MAX_REPLY_VALUE, "value")
            .map_err(wire)?;
        proto::read_blob_by(&mut live.stream, deadline, len, |_| Ok(())).map_err(wire)
    }

    pub(super) fn read_i64(&self, live: &mut Live) -> Result<i64, Fail> {
        let v = proto::read_u64_by(&mut live.stream, self.io_deadline()).map_err(transport)?;
        Ok(v as i64)
    }

    /// Waits on `keys` until `deadline` on one connection (see the module
    /// docs for the cancel).
    pub(super) fn wait_on(
        &self,
        live: &mut Live,
        keys: &[&str],
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(), Fail> {
        proto::send(&mut live.stream, Query::new(query::WAIT).keys(keys).bytes())
            .map_err(transport)?;
        // The status byte (when the connection has one) and the answer
        // arrive together, whenever the wait ends.
        let first = proto::read_u8_by(&mut live.stream, deadline);
        let answer = match (live.ext, first) {
            (true, Ok(proto::STATUS_OK)) => {
                proto::read_u8_by(&mut live.stream, self.io_deadline()).map_err(transport)?
            }
            (true, Ok(proto::STATUS_REFUSED)) => {
                let r = proto::read_refusal(&mut live.stream, self.io_deadline()).map_err(wire)?;
                return Err(Fail::Clean(RendezvousError::StoreRefused {
                    addr: self.addr,
                    refusal: r,
                }));
            }
            (_, Ok(b)) => b,
            (_, Err(e)) if e.kind() == std::io::ErrorKind::TimedOut => TIMED_OUT,
            (_, Err(e)) => return Err(transport(e)),
        };
        match answer {
            proto::STOP_WAITING => return Ok(()),
            TIMED_OUT => {}
            other => {
                return Err(Fail::Fatal(RendezvousError::Protocol(format!(
                    "WAIT answered {other}"
                ))));
            }
        }
        let timed_out = || RendezvousError::Timeout {
            key: keys.join(", "),
            after: timeout,
        };
        proto::send(&mut live.stream, Query::new(query::CANCEL_WAIT).bytes())
            .map_err(|_| Fail::Fatal(timed_out()))?;
        // Either WAIT_CANCELED, or a STOP_WAITING that crossed the cancel
        // and then WAIT_CANCELED.
        let read_answer = |live: &mut Live| -> Result<u8, Fail> {
            self.status(live, self.io_deadline())?;
            proto::read_u8_by(&mut live.stream, self.io_deadline())
                .map_err(|_| Fail::Fatal(timed_out()))
        };
        match read_answer(live)? {
            proto::WAIT_CANCELED => Err(Fail::Clean(timed_out())),
            proto::STOP_WAITING => {
                read_answer(live)?;
                Ok(())
            }
            other => Err(Fail::Fatal(RendezvousError::Protocol(format!(
                "CANCEL_WAIT answered {other}"
            )))),
        }
    }
}
