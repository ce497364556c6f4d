//! The store server's bounds ([`StoreLimits`]), the variables that set them
//! where rank 0 serves the store, and what a client is told when one is hit
//! ([`StoreRefusal`], [`StoreLimit`]).
//!
//! Invariants: every limit a client can hit has a [`StoreLimit`] kind and a
//! variable ([`StoreLimit::variable`]) that raises it; a refusal names the
//! limit, its value and that variable; [`StoreLimits::for_world`] sizes the
//! connection cap from the world the store serves; a variable that does
//! not parse is an error, never a silent default.

use std::time::Duration;

use super::RendezvousError;

/// The longest a connection may wait on keys.
pub(crate) const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// A limit of the store that a query or a connection can hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreLimit {
    /// Not a configurable limit (an `ADD` that would overflow, an `ADD` on
    /// a key that holds no integer, a store shutting down).
    Other,
    /// Connections served at once ([`StoreLimits::max_connections`]).
    Connections,
    /// Everything clients make the store hold ([`StoreLimits::memory`]).
    Memory,
    /// The longest key ([`StoreLimits::max_key`]).
    Key,
    /// The longest value ([`StoreLimits::max_value`]).
    Value,
    /// The bytes of one query ([`StoreLimits::max_query`]).
    Query,
    /// The keys one query may name ([`StoreLimits::max_keys_per_query`]).
    KeysPerQuery,
    /// The bytes of one reply ([`StoreLimits::max_reply`]).
    Reply,
}

impl StoreLimit {
    /// The wire code of the limit (this crate's extension of the protocol).
    pub(crate) fn code(self) -> u8 {
        match self {
            StoreLimit::Other => 0,
            StoreLimit::Connections => 1,
            StoreLimit::Memory => 2,
            StoreLimit::Key => 3,
            StoreLimit::Value => 4,
            StoreLimit::Query => 5,
            StoreLimit::KeysPerQuery => 6,
            StoreLimit::Reply => 7,
        }
    }

    /// The limit of a wire code; an unknown code (a newer server) is `Other`.
    pub(crate) fn from_code(code: u8) -> StoreLimit {
        match code {
            1 => StoreLimit::Connections,
            2 => StoreLimit::Memory,
            3 => StoreLimit::Key,
            4 => StoreLimit::Value,
            5 => StoreLimit::Query,
            6 => StoreLimit::KeysPerQuery,
            7 => StoreLimit::Reply,
            _ => StoreLimit::Other,
        }
    }

    /// The limit's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            StoreLimit::Other => "other",
            StoreLimit::Connections => "connection",
            StoreLimit::Memory => "memory",
            StoreLimit::Key => "key length",
            StoreLimit::Value => "value length",
            StoreLimit::Query => "query size",
            StoreLimit::KeysPerQuery => "keys-per-query",
            StoreLimit::Reply => "reply size",
        }
    }

    /// The environment variable that raises the limit where rank 0 serves
    /// the store (empty for [`StoreLimit::Other`]).
    pub fn variable(self) -> &'static str {
        match self {
            StoreLimit::Other => "",
            StoreLimit::Connections => "METRALE_STORE_MAX_CONNECTIONS",
            StoreLimit::Memory => "METRALE_STORE_MEMORY",
            StoreLimit::Key => "METRALE_STORE_MAX_KEY",
            StoreLimit::Value => "METRALE_STORE_MAX_VALUE",
            StoreLimit::Query => "METRALE_STORE_MAX_QUERY",
            StoreLimit::KeysPerQuery => "METRALE_STORE_MAX_KEYS_PER_QUERY",
            StoreLimit::Reply => "METRALE_STORE_MAX_REPLY",
        }
    }

    /// Every configurable limit, in the order of the docs.
    pub const ALL: [StoreLimit; 7] = [
        StoreLimit::Connections,
        StoreLimit::Memory,
        StoreLimit::Key,
        StoreLimit::Value,
        StoreLimit::Query,
        StoreLimit::KeysPerQuery,
        StoreLimit::Reply,
    ];
}

impl std::fmt::Display for StoreLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a store of ours refused a query or a connection, as its client is
/// told (this crate's extension; a PyTorch client sees its connection
/// closed, as PyTorch's own server does on an error).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreRefusal {
    /// The limit hit ([`StoreLimit::Other`] when no limit is to blame).
    pub limit: StoreLimit,
    /// The limit's value (bytes, keys or connections; 0 for `Other`).
    pub value: u64,
    /// The variable that raises it, where rank 0 serves the store.
    pub variable: String,
    /// What was refused, in words.
    pub detail: String,
}

impl StoreRefusal {
    /// A refusal at `limit` of `value`.
    pub(crate) fn limit(limit: StoreLimit, value: usize, detail: impl Into<String>) -> Self {
        StoreRefusal {
            limit,
            value: value as u64,
            variable: limit.variable().to_owned(),
            detail: detail.into(),
        }
    }

    /// A refusal that no limit explains.
    pub(crate) fn other(detail: impl Into<String>) -> Self {
        StoreRefusal {
            limit: StoreLimit::Other,
            value: 0,
            variable: String::new(),
            detail: detail.into(),
        }
    }
}

impl std::fmt::Display for StoreRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.limit == StoreLimit::Other {
            return f.write_str(&self.detail);
        }
        let unit = match self.limit {
            StoreLimit::Connections => " connections",
            StoreLimit::KeysPerQuery => " keys",
            _ => " bytes",
        };
        write!(
            f,
            "{}: the store's {} limit is {}{unit}; set {} on the rank that serves the store \
             (rank 0) to raise it",
            self.detail,
            self.limit.name(),
            self.value,
            self.variable
        )
    }
}

/// The server's bounds; [`StoreLimits::default`] gives the values below,
/// [`StoreLimits::for_world`] the ones rank 0 serves a world with.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreLimits {
    /// From accept to the end of the handshake (10 s).
    pub handshake: Duration,
    /// From a query's first byte to its last (10 s).
    pub query: Duration,
    /// A connection with no query for this long is closed, unless it waits
    /// on keys (then at most 24 h) (600 s).
    pub idle: Duration,
    /// A reply that cannot be written for this long closes its connection (5 s).
    pub write: Duration,
    /// Connections served at once (1024; for a world, `2 x world + 64`,
    /// at least 1024). At the cap, the oldest connection still in its
    /// handshake for a second or more is closed for the new one; else the
    /// new one is refused.
    pub max_connections: usize,
    /// The longest key (8 KiB, as PyTorch's libuv server).
    pub max_key: usize,
    /// The longest value (1 MiB).
    pub max_value: usize,
    /// The bytes of keys and values one query may carry (4 MiB).
    pub max_query: usize,
    /// The keys one query may name (65536).
    pub max_keys_per_query: usize,
    /// The bytes of one reply (64 MiB); a reply's size is known before it
    /// is built.
    pub max_reply: usize,
    /// Everything clients make the store hold, together (512 MiB): keys and
    /// values kept (+64 bytes a key), queued values (+32 bytes each),
    /// pending waits and their keys (+64 bytes a wait, +48 a key), partial
    /// queries, replies not yet written, refusals kept for later waiters,
    /// and 1 KiB a connection (which pays for its first 256 bytes of
    /// unwritten replies: a small reply is never refused).
    pub memory: usize,
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits {
            handshake: Duration::from_secs(10),
            query: Duration::from_secs(10),
            idle: Duration::from_secs(600),
            write: Duration::from_secs(5),
            max_connections: 1024,
            max_key: 8 << 10,
            max_value: 1 << 20,
            max_query: 4 << 20,
            max_keys_per_query: 1 << 16,
            max_reply: 64 << 20,
            memory: 512 << 20,
        }
    }
}

impl StoreLimits {
    /// The defaults for a store serving `world_size` ranks: a connection
    /// cap of `2 x world_size + 64` (each rank holds one connection, and
    /// one more for each sub-communicator group in use), at least 1024.
    pub fn for_world(world_size: usize) -> StoreLimits {
        StoreLimits {
            max_connections: world_size.saturating_mul(2).saturating_add(64).max(1024),
            ..StoreLimits::default()
        }
    }

    /// [`StoreLimits::for_world`], then the `METRALE_STORE_*` variables
    /// read through `get` ([`StoreLimit::variable`]; sizes take K, M and G
    /// suffixes).
    pub fn from_lookup(
        world_size: usize,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<StoreLimits, RendezvousError> {
        let mut limits = StoreLimits::for_world(world_size);
        for limit in StoreLimit::ALL {
            let var = limit.variable();
            let Some(raw) = get(var)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
            else {
                continue;
            };
            let bad = |reason: String| RendezvousError::BadEnv { var, reason };
            let n = parse_size(&raw).ok_or_else(|| {
                bad(format!(
                    "{raw:?} is not a number (K, M and G suffixes are accepted)"
                ))
            })?;
            if n == 0 {
                return Err(bad("must be at least 1".to_owned()));
            }
            let slot = match limit {
                StoreLimit::Connections => &mut limits.max_connections,
                StoreLimit::Memory => &mut limits.memory,
                StoreLimit::Key => &mut limits.max_key,
                StoreLimit::Value => &mut limits.max_value,
                StoreLimit::Query => &mut limits.max_query,
                StoreLimit::KeysPerQuery => &mut limits.max_keys_per_query,
                StoreLimit::Reply => &mut limits.max_reply,
                StoreLimit::Other => continue,
            };
            *slot = n;
        }
        Ok(limits)
    }

    /// [`StoreLimits::from_lookup`] on the process environment.
    pub fn from_env(world_size: usize) -> Result<StoreLimits, RendezvousError> {
        Self::from_lookup(world_size, |var| std::env::var(var).ok())
    }

    /// The limits with every floor applied (what a server actually uses).
    pub(crate) fn floored(mut self) -> StoreLimits {
        self.idle = self.idle.max(Duration::from_millis(10));
        self.handshake = self.handshake.max(Duration::from_millis(10));
        self.query = self.query.max(Duration::from_millis(10));
        self.write = self.write.max(Duration::from_millis(10));
        self.max_connections = self.max_connections.max(1);
        self.max_key = self.max_key.max(1);
        self.max_keys_per_query = self.max_keys_per_query.max(1);
        self.max_query = self.max_query.max(self.max_key);
        self.max_reply = self.max_reply.max(64);
        self
    }
}

/// A byte count with an optional K, M or G suffix (powers of 1024).
fn parse_size(raw: &str) -> Option<usize> {
    let s = raw.trim();
    let (digits, shift) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 10),
        b'M' | b'm' => (&s[..s.len() - 1], 20),
        b'G' | b'g' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    let n: usize = digits.trim().parse().ok()?;
    n.checked_mul(1usize << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_set_the_limits_and_the_cap_follows_the_world() {
        assert_eq!(StoreLimits::for_world(1).max_connections, 1024);
        assert_eq!(StoreLimits::for_world(16384).max_connections, 32832);
        let vars = [
            ("METRALE_STORE_MAX_CONNECTIONS", "5000"),
            ("METRALE_STORE_MEMORY", "2G"),
            ("METRALE_STORE_MAX_VALUE", "4m"),
        ];
        let get = |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned())
        };
        let l = StoreLimits::from_lookup(8, get).unwrap();
        assert_eq!(l.max_connections, 5000);
        assert_eq!(l.memory, 2 << 30);
        assert_eq!(l.max_value, 4 << 20);
        assert_eq!(l.max_key, 8 << 10);
        let bad = StoreLimits::from_lookup(8, |k| {
            (k == "METRALE_STORE_MEMORY").then(|| "lots".to_owned())
        });
        assert!(
            matches!(&bad, Err(RendezvousError::BadEnv { var, .. }) if *var == "METRALE_STORE_MEMORY"),
            "{bad:?}"
        );
        for l in StoreLimit::ALL {
            assert_eq!(StoreLimit::from_code(l.code()), l);
            assert!(l.variable().starts_with("METRALE_STORE_"));
        }
        let r = StoreRefusal::limit(StoreLimit::Reply, 64 << 20, "a MULTI_GET reply of 1 GiB");
        let text = r.to_string();
        assert!(
            text.contains("67108864") && text.contains("METRALE_STORE_MAX_REPLY"),
            "{text}"
        );
    }
}
