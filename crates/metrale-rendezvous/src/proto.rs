//! c10d TCPStore's wire protocol, the one PyTorch's `torch.distributed.TCPStore`
//! speaks (both of its servers, the libuv one and the legacy one, and its
//! client), written from the protocol's description, not from its code.
//!
//! A query is one byte naming it, then its arguments, with no framing and
//! no length of its own: integers are little-endian (PyTorch writes them in
//! the host's order; every platform it ships for is little-endian), a key
//! or a value is a `u64` byte count then the bytes, a list of keys is a
//! `u64` count then the keys. The first query of every connection is
//! `VALIDATE` with [`VALIDATION_MAGIC`]; PyTorch's client then sends `PING`
//! with a nonce the server echoes. Replies:
//!
//! | query | arguments | reply |
//! |---|---|---|
//! | `VALIDATE` (0) | `u32` magic | none |
//! | `SET` (1) | key, value | none |
//! | `COMPARE_SET` (2) | key, expected, desired | value |
//! | `GET` (3) | key | value |
//! | `ADD` (4) | key, `i64` | `i64` (the new value, stored as decimal text) |
//! | `CHECK` (5) | keys | `u8`: 0 ready, 1 not ready |
//! | `WAIT` (6) | keys | `u8` 0 (`STOP_WAITING`) once all keys exist |
//! | `GETNUMKEYS` (7) | | `i64` |
//! | `DELETE_KEY` (8) | key | `i64` (keys deleted) |
//! | `APPEND` (9) | key, value | none |
//! | `MULTI_GET` (10) | keys | one value per key |
//! | `MULTI_SET` (11) | `u64` count, (key, value) per pair | none |
//! | `CANCEL_WAIT` (12) | | `u8` 1 (`WAIT_CANCELED`), after a `STOP_WAITING` still owed |
//! | `PING` (13) | `u32` nonce | `u32` the nonce |
//! | `QUEUE_PUSH` (14) | key, value | none |
//! | `QUEUE_POP` (15) | key | `i64` queue length before, then the value when it was not 0 |
//! | `QUEUE_LEN` (16) | key | `i64` |
//! | `LIST_KEYS` (17) | | `i64` count, then each key |
//! | `BARRIER` (18) | key, `i64` world size | `u8` 0 (`STOP_WAITING`) once the key's count reaches the world size |
//! | [`query::METRALE_AUTH`] (0xA5, ours) | token | `u8`: 0 accepted, 1 refused, 2 a refusal follows |
//! | [`query::METRALE_HELLO`] (0xA6, ours) | `u32` version | status, `u32` version |
//! | [`query::METRALE_REFUSE`] (0xA7, ours, after `METRALE_HELLO`) | key, a refusal as a value | status |
//!
//! `WAIT` has no timeout on the wire: the client waits as long as it likes
//! and then sends `CANCEL_WAIT`. A `WAIT` is also ended by a `QUEUE_PUSH` to
//! the key (one waiter a push), and a `CHECK` counts a non-empty queue as
//! present, as PyTorch's libuv server does. The protocol has no error
//! reply: PyTorch's server closes the connection on what it cannot parse or
//! apply, and so does ours.
//!
//! This crate's extension, sent only to a store of ours: `METRALE_AUTH`
//! (the token) and `METRALE_HELLO`; a PyTorch server closes the connection
//! on either. After `METRALE_HELLO` every reply on that connection starts
//! with a status byte: [`STATUS_OK`] then the reply as above, or
//! [`STATUS_REFUSED`] then a refusal ([`write_refusal`]: the limit's code,
//! its value, the variable that raises it, the reason), after which the
//! connection stays open if the query was read whole (a refused set's
//! `PING` is still answered) and is closed if it was not. A `WAIT` a
//! refused set will never end
//! gets that refusal in place of its `STOP_WAITING`; `METRALE_REFUSE` hands
//! a refusal a client got to the waits on another key (rank 0 passing a
//! rank's refused barrier key on to the ranks waiting for the barrier).
//!
//! Invariants: every length is checked against a caller-given bound before
//! anything is allocated for it, and a value is allocated as its bytes
//! arrive, never up front; every read is bounded by a deadline for the
//! whole item (not per system call), so a peer sending one byte a second
//! cannot stretch it; nothing here panics on any input.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::limits::{StoreLimit, StoreRefusal};

/// The magic number of `VALIDATE`, PyTorch's `validationMagicNumber`.
pub(crate) const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// Query type bytes (PyTorch's `QueryType`, whose numbering only ever grew
/// at the end).
pub(crate) mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MULTI_SET: u8 = 11;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
    pub const QUEUE_PUSH: u8 = 14;
    pub const QUEUE_POP: u8 = 15;
    pub const QUEUE_LEN: u8 = 16;
    pub const LIST_KEYS: u8 = 17;
    pub const BARRIER: u8 = 18;
    /// This crate's extension: the `METRALE_STORE_TOKEN` proof, the first
    /// query after `VALIDATE` on a store of ours that has a token. Far
    /// from PyTorch's numbers, which end at 18 (`BARRIER`).
    pub const METRALE_AUTH: u8 = 0xA5;
    /// This crate's extension: a client of ours asks for status bytes and
    /// refusals (the module docs).
    pub const METRALE_HELLO: u8 = 0xA6;
    /// This crate's extension: ends every wait on a key with a refusal.
    pub const METRALE_REFUSE: u8 = 0xA7;
}

/// `CHECK`'s replies.
pub(crate) const CHECK_READY: u8 = 0;
pub(crate) const CHECK_NOT_READY: u8 = 1;
/// `WAIT`'s and `CANCEL_WAIT`'s replies.
pub(crate) const STOP_WAITING: u8 = 0;
pub(crate) const WAIT_CANCELED: u8 = 1;
/// `METRALE_AUTH`'s replies.
pub(crate) const AUTH_OK: u8 = 0;
pub(crate) const AUTH_REFUSED: u8 = 1;
/// `METRALE_AUTH`'s reply when the store refuses the connection at a limit:
/// a refusal follows.
pub(crate) const AUTH_LIMIT: u8 = 2;
/// The status bytes of the extension.
pub(crate) const STATUS_OK: u8 = 0;
pub(crate) const STATUS_REFUSED: u8 = 1;
/// The extension's version, sent with `METRALE_HELLO`.
pub(crate) const EXT_VERSION: u32 = 1;
/// The longest variable name and reason a client reads in a refusal.
const MAX_REFUSAL_TEXT: usize = 4096;

/// The longest token accepted.
pub(crate) const MAX_TOKEN: usize = 1024;

/// Why an item could not be read.
#[derive(Debug)]
pub(crate) enum WireError {
    /// The transport failed, including end of stream and a passed deadline
    /// (`ErrorKind::TimedOut`).
    Io(std::io::Error),
    /// The bytes break the protocol or a bound.
    Malformed(String),
}

impl From<std::io::Error> for WireError {
    fn from(err: std::io::Error) -> Self {
        WireError::Io(err)
    }
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Io(e) => write!(f, "i/o: {e}"),
            WireError::Malformed(m) => f.write_str(m),
        }
    }
}

/// Builds one query for the client; nothing is sent until [`Query::bytes`]
/// is written in one piece.
#[derive(Debug, Clone)]
pub(crate) struct Query(Vec<u8>);

impl Query {
    pub(crate) fn new(kind: u8) -> Query {
        let mut v = Vec::with_capacity(64);
        v.push(kind);
        Query(v)
    }

    pub(crate) fn u32(mut self, v: u32) -> Query {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn u64(mut self, v: u64) -> Query {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn i64(mut self, v: i64) -> Query {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// A key or a value: its length, then its bytes.
    pub(crate) fn blob(mut self, bytes: &[u8]) -> Query {
        self.0
            .extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        self.0.extend_from_slice(bytes);
        self
    }

    /// A list of keys: the count, then each key.
    pub(crate) fn keys(mut self, keys: &[&str]) -> Query {
        self = self.u64(keys.len() as u64);
        for k in keys {
            self = self.blob(k.as_bytes());
        }
        self
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// The instant `d` from now, saturating (a huge `d` is "a very long time").
pub(crate) fn after(d: Duration) -> Instant {
    super::deadline_after(d)
}

/// Fills `buf` from `stream` by `deadline`, whatever the pace of the peer.
pub(crate) fn read_exact_by(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "deadline passed while reading",
            ));
        }
        stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        match stream.read(&mut buf[done..]) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection",
                ));
            }
            Ok(n) => done += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::Interrupted
                        | std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(crate) fn read_u8_by(stream: &mut TcpStream, deadline: Instant) -> std::io::Result<u8> {
    let mut b = [0u8; 1];
    read_exact_by(stream, &mut b, deadline)?;
    Ok(b[0])
}

pub(crate) fn read_u32_by(stream: &mut TcpStream, deadline: Instant) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    read_exact_by(stream, &mut b, deadline)?;
    Ok(u32::from_le_bytes(b))
}

pub(crate) fn read_u64_by(stream: &mut TcpStream, deadline: Instant) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    read_exact_by(stream, &mut b, deadline)?;
    Ok(u64::from_le_bytes(b))
}

/// Reads a length prefix and checks it against `max` before anything is
/// allocated for it.
pub(crate) fn read_len_by(
    stream: &mut TcpStream,
    deadline: Instant,
    max: usize,
    what: &str,
) -> Result<usize, WireError> {
    let len = read_u64_by(stream, deadline)?;
    match usize::try_from(len) {
        Ok(n) if n <= max => Ok(n),
        _ => Err(WireError::Malformed(format!(
            "{what} of {len} bytes exceeds the limit of {max}"
        ))),
    }
}

/// The size of the pieces a value is read in: memory follows the bytes
/// that actually arrived.
pub(crate) const CHUNK: usize = 64 << 10;

/// Reads `len` bytes (already checked against a bound) by `deadline`,
/// growing the buffer a chunk at a time; `grow(n)` is asked before each
/// chunk of `n` bytes and may refuse it.
pub(crate) fn read_blob_by(
    stream: &mut TcpStream,
    deadline: Instant,
    len: usize,
    mut grow: impl FnMut(usize) -> Result<(), WireError>,
) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(len.min(CHUNK));
    while out.len() < len {
        let n = (len - out.len()).min(CHUNK);
        grow(n)?;
        let start = out.len();
        out.resize(start + n, 0);
        read_exact_by(stream, &mut out[start..], deadline)?;
    }
    Ok(out)
}

/// Writes `bytes` in one call with the stream's write timeout.
pub(crate) fn send(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    stream.write_all(bytes)?;
    stream.flush()
}

/// Appends a refusal (after its [`STATUS_REFUSED`] or [`AUTH_LIMIT`] byte):
/// the limit's code, its value, the variable, the reason.
pub(crate) fn write_refusal(out: &mut Vec<u8>, r: &StoreRefusal) {
    out.push(r.limit.code());
    out.extend_from_slice(&r.value.to_le_bytes());
    for text in [&r.variable, &r.detail] {
        let bytes = &text.as_bytes()[..text.len().min(MAX_REFUSAL_TEXT)];
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(bytes);
    }
}

/// A refusal as the value of `METRALE_REFUSE`.
pub(crate) fn refusal_bytes(r: &StoreRefusal) -> Vec<u8> {
    let mut v = Vec::new();
    write_refusal(&mut v, r);
    v
}

/// The refusal in `bytes` (as [`refusal_bytes`] wrote it), if it is one.
pub(crate) fn refusal_from_bytes(bytes: &[u8]) -> Option<StoreRefusal> {
    let (&code, rest) = bytes.split_first()?;
    let value = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
    let mut rest = &rest[8..];
    let mut text = || -> Option<String> {
        let len = usize::try_from(u64::from_le_bytes(rest.get(..8)?.try_into().ok()?)).ok()?;
        let end = len.checked_add(8)?;
        let t = rest.get(8..end)?;
        rest = &rest[end..];
        Some(String::from_utf8_lossy(t).into_owned())
    };
    let variable = text()?;
    let detail = text()?;
    Some(StoreRefusal {
        limit: StoreLimit::from_code(code),
        value,
        variable,
        detail,
    })
}

/// Reads what [`write_refusal`] wrote, by `deadline`.
pub(crate) fn read_refusal(
    stream: &mut TcpStream,
    deadline: Instant,
) -> Result<StoreRefusal, WireError> {
    let code = read_u8_by(stream, deadline)?;
    let value = read_u64_by(stream, deadline)?;
    let mut text = || -> Result<String, WireError> {
        let len = read_len_by(stream, deadline, MAX_REFUSAL_TEXT, "refusal text")?;
        let bytes = read_blob_by(stream, deadline, len, |_| Ok(()))?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    let variable = text()?;
    let detail = text()?;
    Ok(StoreRefusal {
        limit: StoreLimit::from_code(code),
        value,
        variable,
        detail,
    })
}

/// Parses what `ADD` keeps under a key: decimal text, as PyTorch writes it.
pub(crate) fn parse_counter(bytes: &[u8]) -> Option<i64> {
    std::str::from_utf8(bytes).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_encode_as_pytorch_does() {
        let q = Query::new(query::SET).blob(b"k").blob(b"vv");
        assert_eq!(
            q.bytes(),
            [
                1, 1, 0, 0, 0, 0, 0, 0, 0, b'k', 2, 0, 0, 0, 0, 0, 0, 0, b'v', b'v'
            ]
        );
        let q = Query::new(query::VALIDATE).u32(VALIDATION_MAGIC);
        assert_eq!(q.bytes(), [0, 0xCE, 0xF7, 0x85, 0x3C]);
        let q = Query::new(query::WAIT).keys(&["a", "b"]);
        assert_eq!(q.bytes().len(), 1 + 8 + 2 * 9);
        assert_eq!(parse_counter(b"-12"), Some(-12));
        assert_eq!(parse_counter(b"x"), None);
    }
}
