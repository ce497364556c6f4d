//! Hostile clients against the store server: random garbage, 4 GiB length
//! prefixes, hundreds of idle connections, a client sending one byte a
//! second, oversized handshakes and sets past the store's limit. Each test
//! checks that a legitimate rank is still served quickly and that the
//! server's memory (`StoreServer::stats`) stays bounded. Loopback only.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use metrale_rendezvous::{RendezvousError, StoreClient, StoreLimits, StoreServer};
use rand::Rng;

const T: Duration = Duration::from_secs(10);
const VALIDATE: [u8; 5] = [0, 0xCE, 0xF7, 0x85, 0x3C];
/// A legitimate rank's query is answered within this, whatever else goes on.
const QUICK: Duration = Duration::from_secs(1);

fn loopback0() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn blob(v: &mut Vec<u8>, b: &[u8]) {
    v.extend_from_slice(&(b.len() as u64).to_le_bytes());
    v.extend_from_slice(b);
}

/// A legitimate rank: a round of set, wait and get, timed.
fn rank_round(c: &StoreClient, i: usize) -> Result<Duration> {
    let start = Instant::now();
    let key = format!("legit/{i}");
    c.set(&key, b"ok")?;
    c.wait(&[&key], T)?;
    ensure!(c.get(&key, T)? == b"ok");
    Ok(start.elapsed())
}

/// Waits until the server holds no connection but `keep` and no bytes in
/// flight.
fn settles(server: &StoreServer, keep: usize) -> Result<()> {
    let deadline = Instant::now() + T;
    loop {
        let s = server.stats();
        if s.connections <= keep && s.in_flight_bytes == 0 {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the server did not settle: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether the server closed `s` (it reads end of stream or a reset)
/// within `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let _ = s.set_read_timeout(Some(within));
    let mut sink = [0u8; 64];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                );
            }
        }
    }
}

fn garbage(rng: &mut impl Rng) -> Vec<u8> {
    let mut out = Vec::new();
    if rng.random_bool(0.8) {
        out.extend_from_slice(&VALIDATE);
    }
    for _ in 0..rng.random_range(1..8) {
        let kind: u8 = if rng.random_bool(0.7) {
            rng.random_range(0..16)
        } else {
            rng.random()
        };
        out.push(kind);
        match rng.random_range(0..4) {
            0 => {
                let mut key = format!("junk/{}", rng.random::<u16>()).into_bytes();
                if rng.random_bool(0.3) {
                    key.truncate(rng.random_range(0..key.len()));
                }
                blob(&mut out, &key);
                let len = rng.random_range(0..256);
                let v: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                blob(&mut out, &v);
            }
            1 => out.extend_from_slice(&rng.random::<u64>().to_le_bytes()),
            2 => out.extend((0..rng.random_range(0..64)).map(|_| rng.random::<u8>())),
            _ => {}
        }
    }
    if rng.random_bool(0.3) {
        out.truncate(rng.random_range(0..out.len()));
    }
    out
}

#[test]
fn garbage_never_stops_the_store() -> Result<()> {
    let server = StoreServer::bind(loopback0(), None)?;
    let addr = server.local_addr();
    let rank = StoreClient::connect(addr, None, T)?;
    rank.set("keep", b"safe")?;
    let done = Arc::new(AtomicBool::new(false));
    let conns = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (done, conns) = (Arc::clone(&done), Arc::clone(&conns));
            std::thread::spawn(move || -> Result<()> {
                let mut rng = rand::rng();
                while !done.load(Ordering::SeqCst) {
                    let mut s = TcpStream::connect(addr).context("connect")?;
                    s.set_read_timeout(Some(Duration::from_millis(300)))?;
                    // The server may close early: write errors are expected.
                    let _ = s.write_all(&garbage(&mut rng));
                    let _ = s.shutdown(Shutdown::Write);
                    let mut sink = Vec::new();
                    let _ = s.read_to_end(&mut sink);
                    conns.fetch_add(1, Ordering::SeqCst);
                }
                Ok(())
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for i in 0..200 {
        slowest = slowest.max(rank_round(&rank, i)?);
    }
    while conns.load(Ordering::SeqCst) < 2000 {
        slowest = slowest.max(rank_round(&rank, 0)?);
    }
    done.store(true, Ordering::SeqCst);
    for w in workers {
        w.join().expect("worker panicked")?;
    }
    assert!(slowest < QUICK, "a legitimate round took {slowest:?}");
    assert_eq!(rank.get("keep", T)?, b"safe");
    let fresh = StoreClient::connect(addr, None, T)?;
    fresh.set("fresh", b"ok")?;
    assert_eq!(fresh.get("fresh", T)?, b"ok");
    settles(&server, 2)?;
    Ok(())
}

#[test]
fn huge_length_prefixes_are_refused_before_allocating() -> Result<()> {
    let server = StoreServer::bind(loopback0(), None)?;
    let addr = server.local_addr();
    let four_gib = 1u64 << 32;
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut q = VALIDATE.to_vec();
    q.push(1);
    q.extend_from_slice(&four_gib.to_le_bytes());
    cases.push(("a 4 GiB key", q));
    let mut q = VALIDATE.to_vec();
    q.push(1);
    blob(&mut q, b"k");
    q.extend_from_slice(&four_gib.to_le_bytes());
    cases.push(("a 4 GiB value", q));
    let mut q = VALIDATE.to_vec();
    q.push(6);
    q.extend_from_slice(&four_gib.to_le_bytes());
    cases.push(("a WAIT on 4 Gi keys", q));
    let mut q = VALIDATE.to_vec();
    q.push(11);
    q.extend_from_slice(&u64::MAX.to_le_bytes());
    cases.push(("a MULTI_SET of 2^64-1 pairs", q));
    let mut q = VALIDATE.to_vec();
    q.push(1);
    blob(&mut q, b"k");
    q.extend_from_slice(&((1u64 << 20) + 1).to_le_bytes());
    cases.push(("a value one byte over 1 MiB", q));
    for (what, bytes) in &cases {
        let mut s = TcpStream::connect(addr)?;
        s.write_all(bytes)?;
        assert!(closed_within(&mut s, QUICK), "{what}: not closed at once");
        let stats = server.stats();
        assert!(stats.in_flight_bytes < 1 << 16, "{what}: {stats:?}");
    }
    // A value of exactly the limit is fine.
    let c = StoreClient::connect(addr, None, T)?;
    c.set("big", &vec![7u8; 1 << 20])?;
    assert_eq!(c.get("big", T)?.len(), 1 << 20);
    // So is a token prefix on a store with a token: 4 GiB is refused.
    let guarded = StoreServer::bind(loopback0(), Some("tok".to_owned()))?;
    let mut s = TcpStream::connect(guarded.local_addr())?;
    let mut q = VALIDATE.to_vec();
    q.push(0xA5);
    q.extend_from_slice(&four_gib.to_le_bytes());
    s.write_all(&q)?;
    assert!(closed_within(&mut s, QUICK));
    settles(&server, 1)?;
    Ok(())
}

#[test]
fn idle_connections_never_lock_out_the_ranks() -> Result<()> {
    // 500 idle connections, half of them validated, on the default limits.
    let server = StoreServer::bind(loopback0(), None)?;
    let addr = server.local_addr();
    let mut idle = Vec::new();
    for i in 0..500 {
        let mut s = TcpStream::connect(addr)?;
        if i % 2 == 0 {
            s.write_all(&VALIDATE)?;
        }
        idle.push(s);
    }
    let start = Instant::now();
    let ranks: Vec<StoreClient> = (0..4)
        .map(|_| StoreClient::connect(addr, None, T))
        .collect::<Result<_, _>>()?;
    for (i, r) in ranks.iter().enumerate() {
        rank_round(r, i)?;
    }
    assert!(start.elapsed() < 2 * QUICK, "{:?}", start.elapsed());
    drop(idle);
    drop(ranks);
    settles(&server, 0)?;

    // Past the connection limit: connections still in their handshake
    // after a second go, oldest first, and the ranks get in; a connection
    // past its handshake is never evicted.
    let mut limits = StoreLimits::default();
    limits.max_connections = 64;
    let server = StoreServer::bind_with(loopback0(), None, limits)?;
    let addr = server.local_addr();
    let mut idle = Vec::new();
    for i in 0..300 {
        let mut s = TcpStream::connect(addr)?;
        if i % 8 == 0 {
            s.write_all(&VALIDATE)?;
        }
        idle.push(s);
    }
    std::thread::sleep(Duration::from_millis(1100));
    let start = Instant::now();
    let ranks: Vec<StoreClient> = (0..4)
        .map(|_| StoreClient::connect(addr, None, T))
        .collect::<Result<_, _>>()?;
    for (i, r) in ranks.iter().enumerate() {
        rank_round(r, i)?;
    }
    assert!(start.elapsed() < 2 * QUICK, "{:?}", start.elapsed());
    let stats = server.stats();
    assert!(stats.evictions >= 4, "{stats:?}");
    assert!(stats.connections <= 64 + 64, "{stats:?}");
    // More idle connections: the ranks keep their connections.
    for _ in 0..100 {
        idle.push(TcpStream::connect(addr)?);
    }
    for (i, r) in ranks.iter().enumerate() {
        rank_round(r, i)?;
    }
    Ok(())
}

#[test]
fn one_byte_a_second_is_cut_off() -> Result<()> {
    let mut limits = StoreLimits::default();
    limits.handshake = Duration::from_secs(2);
    limits.query = Duration::from_secs(2);
    let server = StoreServer::bind_with(loopback0(), None, limits)?;
    let addr = server.local_addr();
    let trickle = |prefix: Vec<u8>, body: Vec<u8>| {
        std::thread::spawn(move || -> Result<Duration> {
            let mut s = TcpStream::connect(addr)?;
            s.write_all(&prefix)?;
            let start = Instant::now();
            for b in body {
                if s.write_all(&[b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_secs(1));
                if closed_within(&mut s, Duration::from_millis(1)) {
                    break;
                }
            }
            ensure!(closed_within(&mut s, T), "never closed");
            Ok(start.elapsed())
        })
    };
    // A handshake at one byte a second: 5 bytes would take 5 s.
    let slow_hello = trickle(Vec::new(), VALIDATE.to_vec());
    // A query at one byte a second after a quick handshake.
    let mut set = vec![1];
    blob(&mut set, b"slow/key");
    blob(&mut set, b"value");
    let slow_query = trickle(VALIDATE.to_vec(), set);
    let rank = StoreClient::connect(addr, None, T)?;
    let mut slowest = Duration::ZERO;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        slowest = slowest.max(rank_round(&rank, 0)?);
    }
    let hello_took = slow_hello.join().expect("slow hello")?;
    let query_took = slow_query.join().expect("slow query")?;
    assert!(
        hello_took < Duration::from_secs(4),
        "handshake lasted {hello_took:?}"
    );
    assert!(
        query_took < Duration::from_secs(4),
        "query lasted {query_took:?}"
    );
    assert!(slowest < QUICK, "{slowest:?}");
    assert!(!rank.check(&["slow/key"])?, "the slow set never landed");
    Ok(())
}

#[test]
fn memory_stays_bounded() -> Result<()> {
    // 300 clients without the token, each announcing a 1 MiB token: each
    // is closed at its length, holding nothing.
    let server = StoreServer::bind(loopback0(), Some("s3cret".to_owned()))?;
    let addr = server.local_addr();
    let mut held = Vec::new();
    for _ in 0..300 {
        let mut s = TcpStream::connect(addr)?;
        let mut q = VALIDATE.to_vec();
        q.push(0xA5);
        q.extend_from_slice(&(1u64 << 20).to_le_bytes());
        q.extend_from_slice(&[0u8; 1024]);
        let _ = s.write_all(&q);
        held.push(s);
    }
    let deadline = Instant::now() + T;
    while server.stats().connections > 0 {
        ensure!(Instant::now() < deadline, "{:?}", server.stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(server.stats().in_flight_bytes, 0);
    drop(held);

    // Authenticated sets past the store's memory are refused, and say so
    // (a set holds its partial query and then its value: 2 MiB a set of
    // 1 MiB while it is applied, besides the 512 KiB set aside for
    // refusals).
    let mut limits = StoreLimits::default();
    limits.memory = 5 << 20;
    let server = StoreServer::bind_with(loopback0(), Some("s3cret".to_owned()), limits)?;
    let c = StoreClient::connect(server.local_addr(), Some("s3cret".to_owned()), T)?;
    let value = vec![1u8; 1 << 20];
    let mut stored = 0;
    let refused = loop {
        match c.set(&format!("v{stored}"), &value) {
            Ok(()) => stored += 1,
            Err(e) => break e,
        }
        ensure!(stored < 10, "the store took {stored} MiB");
    };
    assert_eq!(stored, 3, "{refused}");
    assert!(
        matches!(&refused, RendezvousError::Protocol(m) if m.contains("refused")),
        "{refused:?}"
    );
    assert!(server.stats().store_bytes <= 4 << 20);
    // Queries in flight share the budget: of four half-sent 1 MiB values,
    // those over it are closed.
    let mut partial = Vec::new();
    for i in 0..4 {
        let mut s = TcpStream::connect(server.local_addr())?;
        let mut q = VALIDATE.to_vec();
        q.push(0xA5);
        blob(&mut q, b"s3cret");
        q.push(1);
        blob(&mut q, format!("p{i}").as_bytes());
        q.extend_from_slice(&(1u64 << 20).to_le_bytes());
        q.extend_from_slice(&vec![0u8; 900 << 10]);
        let _ = s.write_all(&q);
        partial.push(s);
        assert!(server.stats().in_flight_bytes <= 3 << 20);
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        server.stats().in_flight_bytes <= 3 << 20,
        "{:?}",
        server.stats()
    );
    // The rank is still served.
    assert!(c.check(&["v0", "v1", "v2"])?);
    assert!(rank_round(&c, 0)? < QUICK);
    drop(partial);
    settles(&server, 1)?;
    Ok(())
}

#[test]
fn a_client_that_reads_late_gets_every_reply() -> Result<()> {
    // 64 GETs of a 1 MiB value sent at once, read only afterwards: the
    // server stops taking queries while 1 MiB of replies waits, and
    // serves the rest as the client reads.
    let server = StoreServer::bind(loopback0(), None)?;
    let addr = server.local_addr();
    let c = StoreClient::connect(addr, None, T)?;
    let value: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    c.set("big", &value)?;
    let mut q = VALIDATE.to_vec();
    for _ in 0..64 {
        q.push(3);
        blob(&mut q, b"big");
    }
    let mut s = TcpStream::connect(addr)?;
    s.write_all(&q)?;
    std::thread::sleep(Duration::from_millis(300));
    let held = server.stats().in_flight_bytes;
    assert!(held < 8 << 20, "{held} bytes of replies held");
    s.set_read_timeout(Some(T))?;
    for i in 0..64 {
        let mut len = [0u8; 8];
        s.read_exact(&mut len)
            .with_context(|| format!("reply {i}"))?;
        assert_eq!(u64::from_le_bytes(len), 1 << 20);
        let mut got = vec![0u8; 1 << 20];
        s.read_exact(&mut got)?;
        assert!(got == value, "reply {i} differs");
    }
    settles(&server, 2)?;
    Ok(())
}
