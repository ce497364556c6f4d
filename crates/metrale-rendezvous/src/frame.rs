//! The server's reading of queries from bytes as they arrive: [`Scanner`]
//! finds where a query ends (checking every length and count against the
//! limits as soon as its prefix is in, before anything is allocated for
//! it), and [`parse`] turns a complete query into a [`Query`].
//!
//! Invariants: the scanner is resumable (it never looks at a byte twice,
//! so a 4 MiB query arriving a byte at a time costs linear time); a length
//! over its bound is a refusal naming the limit, found from the length's
//! 8 bytes alone; [`parse`] reads only a frame the scanner accepted.

use super::limits::{StoreLimit, StoreLimits, StoreRefusal};
use super::proto::{MAX_TOKEN, query};

/// One query, parsed.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Query {
    Validate(u32),
    Ping(u32),
    Set(Vec<u8>, Vec<u8>),
    Append(Vec<u8>, Vec<u8>),
    QueuePush(Vec<u8>, Vec<u8>),
    CompareSet(Vec<u8>, Vec<u8>, Vec<u8>),
    Get(Vec<u8>),
    DeleteKey(Vec<u8>),
    QueuePop(Vec<u8>),
    QueueLen(Vec<u8>),
    Add(Vec<u8>, i64),
    Barrier(Vec<u8>, i64),
    Check(Vec<Vec<u8>>),
    Wait(Vec<Vec<u8>>),
    MultiGet(Vec<Vec<u8>>),
    MultiSet(Vec<(Vec<u8>, Vec<u8>)>),
    GetNumKeys,
    CancelWait,
    ListKeys,
    Auth(Vec<u8>),
    Hello(u32),
    /// This crate's `METRALE_REFUSE`: a key and a refusal (as bytes).
    Refuse(Vec<u8>, Vec<u8>),
}

/// A field of a query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    /// 4 bytes.
    U32,
    /// 8 bytes.
    U64,
    Key,
    Value,
    Token,
}

/// The fields of a query type: a head, then (for lists) a `u64` count and
/// that many items.
fn shape(kind: u8) -> Option<(&'static [Field], Option<&'static [Field]>)> {
    use Field::*;
    Some(match kind {
        query::VALIDATE | query::PING | query::METRALE_HELLO => (&[U32], None),
        query::SET | query::APPEND | query::QUEUE_PUSH | query::METRALE_REFUSE => {
            (&[Key, Value], None)
        }
        query::COMPARE_SET => (&[Key, Value, Value], None),
        query::GET | query::DELETE_KEY | query::QUEUE_POP | query::QUEUE_LEN => (&[Key], None),
        query::ADD | query::BARRIER => (&[Key, U64], None),
        query::CHECK | query::WAIT | query::MULTI_GET => (&[], Some(&[Key])),
        query::MULTI_SET => (&[], Some(&[Key, Value])),
        query::GETNUMKEYS | query::CANCEL_WAIT | query::LIST_KEYS => (&[], None),
        query::METRALE_AUTH => (&[Token], None),
        _ => return None,
    })
}

/// Whether a query of type `kind` may come before the handshake is
/// through: `VALIDATE`, `PING` (a client without the token learns so from
/// its answer), `METRALE_AUTH` and `METRALE_HELLO`.
pub(super) fn handshake_query(kind: u8) -> bool {
    matches!(
        kind,
        query::VALIDATE | query::PING | query::METRALE_AUTH | query::METRALE_HELLO
    )
}

/// What the scanner found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Scan {
    /// More bytes are needed.
    Incomplete,
    /// The query is the first `n` bytes.
    Complete(usize),
    /// The query breaks a limit (the reason names it).
    Refused(StoreRefusal),
    /// The bytes are not a query of the protocol.
    Garbage(String),
}

/// Where a query's scan stands; reset for each query.
#[derive(Debug, Default)]
pub(super) struct Scanner {
    /// Bytes of the query accepted so far.
    pos: usize,
    /// The next field of the head, or of the current item.
    field: usize,
    /// Items still to come (`None`: in the head, or no list).
    items_left: Option<u64>,
    /// Bytes of keys and values so far.
    payload: usize,
}

impl Scanner {
    /// Continues the scan of the query at the start of `buf`.
    pub(super) fn scan(&mut self, buf: &[u8], limits: &StoreLimits) -> Scan {
        let Some(&kind) = buf.first() else {
            return Scan::Incomplete;
        };
        let Some((head, list)) = shape(kind) else {
            return Scan::Garbage(format!("query type {kind} is not served here"));
        };
        if self.pos == 0 {
            self.pos = 1;
        }
        loop {
            let field = match self.items_left {
                None if self.field < head.len() => head[self.field],
                None => match list {
                    None => return Scan::Complete(self.pos),
                    Some(_) => {
                        let Some(count) = read_u64(buf, self.pos) else {
                            return Scan::Incomplete;
                        };
                        if count > limits.max_keys_per_query as u64 {
                            return Scan::Refused(StoreRefusal::limit(
                                StoreLimit::KeysPerQuery,
                                limits.max_keys_per_query,
                                format!("a query naming {count} keys"),
                            ));
                        }
                        self.pos += 8;
                        self.items_left = Some(count);
                        self.field = 0;
                        continue;
                    }
                },
                Some(0) => return Scan::Complete(self.pos),
                Some(_) => {
                    let item = list.unwrap_or(&[]);
                    item[self.field.min(item.len().saturating_sub(1))]
                }
            };
            let Some(advance) = self.field_len(buf, field, limits) else {
                return Scan::Incomplete;
            };
            let advance = match advance {
                Ok(n) => n,
                Err(refusal) => return refusal,
            };
            self.pos += advance;
            self.field += 1;
            if let (Some(left), Some(item)) = (self.items_left.as_mut(), list)
                && self.field == item.len()
            {
                *left -= 1;
                self.field = 0;
            }
        }
    }

    /// The bytes `field` takes at the scan position, once they are all in
    /// `buf`; a length over its bound is refused at once.
    fn field_len(
        &mut self,
        buf: &[u8],
        field: Field,
        limits: &StoreLimits,
    ) -> Option<Result<usize, Scan>> {
        let fixed = match field {
            Field::U32 => Some(4),
            Field::U64 => Some(8),
            _ => None,
        };
        if let Some(n) = fixed {
            return (buf.len() >= self.pos + n).then_some(Ok(n));
        }
        let len = read_u64(buf, self.pos)?;
        let (max, limit, what) = match field {
            Field::Key => (limits.max_key, StoreLimit::Key, "key"),
            Field::Value => (limits.max_value, StoreLimit::Value, "value"),
            _ => (MAX_TOKEN, StoreLimit::Other, "token"),
        };
        if len > max as u64 {
            let detail = format!("a {what} of {len} bytes");
            return Some(Err(if limit == StoreLimit::Other {
                Scan::Garbage(format!("{detail} (at most {max})"))
            } else {
                Scan::Refused(StoreRefusal::limit(limit, max, detail))
            }));
        }
        let len = len as usize;
        if field != Field::Token {
            let payload = self.payload + len;
            if payload > limits.max_query {
                return Some(Err(Scan::Refused(StoreRefusal::limit(
                    StoreLimit::Query,
                    limits.max_query,
                    format!("a query of more than {payload} bytes of keys and values"),
                ))));
            }
            // Counted once the length is in, so a partial frame's bound
            // holds before its bytes arrive.
            self.payload = payload;
        }
        // Only advance over a whole blob; count its payload once.
        if buf.len() < self.pos + 8 + len {
            if field != Field::Token {
                self.payload -= len;
            }
            return None;
        }
        Some(Ok(8 + len))
    }
}

fn read_u64(buf: &[u8], at: usize) -> Option<u64> {
    let bytes: [u8; 8] = buf.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(bytes))
}

/// The keys a set-like query (set, append, queue push, compare-set, add,
/// multi-set) names in `buf`, the start of its frame, as far as they are
/// there whole: the keys whose waits a refusal of it must end.
pub(super) fn keys_named(buf: &[u8]) -> Vec<Vec<u8>> {
    let Some((&kind, rest)) = buf.split_first() else {
        return Vec::new();
    };
    let mut c = Cursor(rest);
    match kind {
        query::SET | query::APPEND | query::QUEUE_PUSH | query::COMPARE_SET | query::ADD => {
            c.blob().into_iter().collect()
        }
        query::MULTI_SET => {
            let mut keys = Vec::new();
            let Some(n) = c.u64() else {
                return keys;
            };
            for _ in 0..n {
                let Some(k) = c.blob() else { break };
                keys.push(k);
                if c.blob().is_none() {
                    break;
                }
            }
            keys
        }
        _ => Vec::new(),
    }
}

/// A cursor over a frame the scanner accepted.
struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn blob(&mut self) -> Option<Vec<u8>> {
        let n = usize::try_from(self.u64()?).ok()?;
        Some(self.take(n)?.to_vec())
    }

    fn list(&mut self) -> Option<Vec<Vec<u8>>> {
        let n = usize::try_from(self.u64()?).ok()?;
        (0..n).map(|_| self.blob()).collect()
    }
}

/// The query in `frame` (a whole frame the scanner accepted).
pub(super) fn parse(frame: &[u8]) -> Option<Query> {
    let (&kind, rest) = frame.split_first()?;
    let mut c = Cursor(rest);
    let q = match kind {
        query::VALIDATE => Query::Validate(c.u32()?),
        query::PING => Query::Ping(c.u32()?),
        query::METRALE_HELLO => Query::Hello(c.u32()?),
        query::SET => Query::Set(c.blob()?, c.blob()?),
        query::APPEND => Query::Append(c.blob()?, c.blob()?),
        query::QUEUE_PUSH => Query::QueuePush(c.blob()?, c.blob()?),
        query::COMPARE_SET => Query::CompareSet(c.blob()?, c.blob()?, c.blob()?),
        query::GET => Query::Get(c.blob()?),
        query::DELETE_KEY => Query::DeleteKey(c.blob()?),
        query::QUEUE_POP => Query::QueuePop(c.blob()?),
        query::QUEUE_LEN => Query::QueueLen(c.blob()?),
        query::ADD => Query::Add(c.blob()?, c.u64()? as i64),
        query::BARRIER => Query::Barrier(c.blob()?, c.u64()? as i64),
        query::CHECK => Query::Check(c.list()?),
        query::WAIT => Query::Wait(c.list()?),
        query::MULTI_GET => Query::MultiGet(c.list()?),
        query::MULTI_SET => {
            let n = usize::try_from(c.u64()?).ok()?;
            let pairs = (0..n)
                .map(|_| Some((c.blob()?, c.blob()?)))
                .collect::<Option<Vec<_>>>()?;
            Query::MultiSet(pairs)
        }
        query::GETNUMKEYS => Query::GetNumKeys,
        query::CANCEL_WAIT => Query::CancelWait,
        query::LIST_KEYS => Query::ListKeys,
        query::METRALE_AUTH => Query::Auth(c.blob()?),
        query::METRALE_REFUSE => Query::Refuse(c.blob()?, c.blob()?),
        _ => return None,
    };
    c.0.is_empty().then_some(q)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(v: &mut Vec<u8>, b: &[u8]) {
        v.extend_from_slice(&(b.len() as u64).to_le_bytes());
        v.extend_from_slice(b);
    }

    #[test]
    fn a_query_scanned_a_byte_at_a_time_is_the_query() {
        let limits = StoreLimits::default();
        let mut frame = vec![query::MULTI_SET];
        frame.extend_from_slice(&2u64.to_le_bytes());
        for (k, v) in [(&b"a"[..], &b"1"[..]), (b"bb", b"")] {
            blob(&mut frame, k);
            blob(&mut frame, v);
        }
        let mut s = Scanner::default();
        for end in 0..frame.len() {
            assert_eq!(s.scan(&frame[..end], &limits), Scan::Incomplete, "{end}");
        }
        assert_eq!(s.scan(&frame, &limits), Scan::Complete(frame.len()));
        assert_eq!(
            parse(&frame),
            Some(Query::MultiSet(vec![
                (b"a".to_vec(), b"1".to_vec()),
                (b"bb".to_vec(), Vec::new())
            ]))
        );
        // A 4 GiB value is refused from its length alone.
        let mut frame = vec![query::SET];
        blob(&mut frame, b"k");
        frame.extend_from_slice(&(1u64 << 32).to_le_bytes());
        match Scanner::default().scan(&frame, &limits) {
            Scan::Refused(r) => assert_eq!(r.limit, StoreLimit::Value),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            Scanner::default().scan(&[200], &limits),
            Scan::Garbage(_)
        ));
        let mut wait = vec![query::WAIT];
        wait.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            Scanner::default().scan(&wait, &limits),
            Scan::Refused(StoreRefusal {
                limit: StoreLimit::KeysPerQuery,
                ..
            })
        ));
    }
}
