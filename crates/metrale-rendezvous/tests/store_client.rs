//! Tests of the c10d TCPStore client ([`StoreClient`]) and server
//! ([`StoreServer`]) against each other: queries from many threads, waits
//! and their timeouts, every query kind, tokens, a store without this
//! crate's extension, shutdown, connect retries, idle connections and
//! huge timeouts. Loopback addresses only. Hostile clients are in
//! `store_abuse.rs`, the store's limits in `store_limits.rs`, PyTorch's
//! bytes in `tcpstore_fixtures.rs`, the rendezvous over the store in
//! `rendezvous.rs`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use metrale_rendezvous::{FileRendezvous, Rendezvous, RendezvousError, StoreClient, StoreServer};
use rand::Rng;

const T: Duration = Duration::from_secs(10);

fn loopback0() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn temp_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!("metrale-rdzv-{tag}-{}-{nanos}", std::process::id()))
}

/// `VALIDATE` with PyTorch's magic number, as raw bytes.
const VALIDATE: [u8; 5] = [0, 0xCE, 0xF7, 0x85, 0x3C];

/// A raw query: the type byte, then length-prefixed blobs.
fn raw_query(kind: u8, blobs: &[&[u8]]) -> Vec<u8> {
    let mut v = vec![kind];
    for b in blobs {
        v.extend_from_slice(&(b.len() as u64).to_le_bytes());
        v.extend_from_slice(b);
    }
    v
}

fn random_bytes(rng: &mut impl Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    v
}

#[test]
fn set_get_add_across_threads() -> Result<()> {
    let server = StoreServer::bind(loopback0(), None)?;
    let addr = server.local_addr();
    let client = Arc::new(StoreClient::connect(addr, None, T)?);
    let mut rng = rand::rng();
    let values: Vec<Vec<u8>> = (0..8)
        .map(|_| {
            let len = rng.random_range(1..5000);
            random_bytes(&mut rng, len)
        })
        .collect();
    let values = Arc::new(values);
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let values = Arc::clone(&values);
            let shared = Arc::clone(&client);
            std::thread::spawn(move || -> Result<()> {
                // Half the threads share one client, half have their own.
                let own;
                let c: &StoreClient = if i % 2 == 0 {
                    &shared
                } else {
                    own = StoreClient::connect(addr, None, T)?;
                    &own
                };
                for _ in 0..100 {
                    c.add("counter", 1)?;
                }
                c.set(&format!("k{i}"), &values[i])?;
                // Read a neighbour's key, waiting for it to appear.
                let j = (i + 1) % 8;
                let got = c.get(&format!("k{j}"), T)?;
                ensure!(got == values[j], "thread {i} read a wrong value for k{j}");
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread panicked")?;
    }
    assert_eq!(client.add("counter", 0)?, 800);
    assert_eq!(client.add("counter", -801)?, -1);
    assert_eq!(client.get("counter", T)?, b"-1");
    for (i, v) in values.iter().enumerate() {
        assert_eq!(&client.get(&format!("k{i}"), T)?, v);
    }
    // Overwrite, empty value.
    client.set("k0", b"")?;
    assert_eq!(client.get("k0", T)?, b"");
    // A non-counter key refuses add (the store closes that connection, as
    // PyTorch's does) without harming the store; the client reconnects.
    client.set("text", b"abc")?;
    assert!(client.add("text", 1).is_err());
    assert_eq!(client.get("text", T)?, b"abc");
    Ok(())
}

#[test]
fn get_waits_for_a_later_set_and_times_out() -> Result<()> {
    let server = StoreServer::bind(loopback0(), None)?;
    let addr = server.local_addr();
    let waiter = std::thread::spawn(move || -> Result<(Vec<u8>, Duration)> {
        let c = StoreClient::connect(addr, None, T)?;
        let start = Instant::now();
        let v = c.get("late", T)?;
        Ok((v, start.elapsed()))
    });
    std::thread::sleep(Duration::from_millis(100));
    let c = StoreClient::connect(addr, None, T)?;
    c.set("late", b"\x07\x01value")?;
    let (v, waited) = waiter.join().expect("waiter")?;
    assert_eq!(v, b"\x07\x01value");
    assert!(waited >= Duration::from_millis(50), "{waited:?}");

    let start = Instant::now();
    match c.get("never", Duration::from_millis(150)) {
        Err(RendezvousError::Timeout { key, after }) => {
            assert_eq!(key, "never");
            assert_eq!(after, Duration::from_millis(150));
        }
        other => bail!("expected a timeout, got {other:?}"),
    }
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(140) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // The connection is still usable after a timeout.
    assert_eq!(c.get("late", T)?, b"\x07\x01value");
    Ok(())
}

#[test]
fn every_query_kind() -> Result<()> {
    let server = StoreServer::bind(loopback0(), None)?;
    let c = StoreClient::connect(server.local_addr(), None, T)?;
    c.ping()?;
    assert!(!c.check(&["a", "b"])?);
    c.multi_set(&[("a", b"1"), ("b", b"22")])?;
    assert!(c.check(&["a", "b"])?);
    assert!(c.check(&[])?);
    c.wait(&["a", "b"], T)?;
    assert_eq!(
        c.multi_get(&["b", "a"], T)?,
        vec![b"22".to_vec(), b"1".to_vec()]
    );
    // compare_set, with PyTorch's semantics.
    assert_eq!(c.compare_set("cas", b"", b"first")?, b"first");
    assert_eq!(c.compare_set("cas", b"first", b"second")?, b"second");
    assert_eq!(c.compare_set("cas", b"first", b"third")?, b"second");
    assert_eq!(c.compare_set("absent", b"x", b"y")?, b"x");
    assert!(!c.check(&["absent"])?);
    c.append("cas", b"-more")?;
    c.append("fresh", b"new")?;
    assert_eq!(c.get("cas", T)?, b"second-more");
    assert_eq!(c.get("fresh", T)?, b"new");
    assert_eq!(c.num_keys()?, 4);
    assert!(c.delete_key("fresh")?);
    assert!(!c.delete_key("fresh")?);
    assert_eq!(c.num_keys()?, 3);
    // A multi-key wait ends when the last key appears.
    let addr = server.local_addr();
    let waiter = std::thread::spawn(move || -> Result<Duration> {
        let w = StoreClient::connect(addr, None, T)?;
        let start = Instant::now();
        w.wait(&["a", "late1", "late2"], T)?;
        Ok(start.elapsed())
    });
    std::thread::sleep(Duration::from_millis(100));
    c.set("late1", b"")?;
    std::thread::sleep(Duration::from_millis(100));
    c.set("late2", b"")?;
    let waited = waiter.join().expect("waiter")?;
    assert!(waited >= Duration::from_millis(150), "{waited:?}");
    let stats = server.stats();
    assert_eq!(stats.keys, 5);
    Ok(())
}

#[test]
fn token_is_required_when_configured() -> Result<()> {
    let server = StoreServer::bind(loopback0(), Some("s3cret".to_owned()))?;
    let addr = server.local_addr();
    // Refused at once, not after the connect timeout.
    let start = Instant::now();
    assert!(matches!(
        StoreClient::connect(addr, None, T),
        Err(RendezvousError::Unauthorized)
    ));
    assert!(matches!(
        StoreClient::connect(addr, Some("wrong".to_owned()), T),
        Err(RendezvousError::Unauthorized)
    ));
    assert!(start.elapsed() < Duration::from_secs(3));
    // A raw connection that validates and skips the token can do nothing.
    let mut raw = TcpStream::connect(addr)?;
    raw.set_read_timeout(Some(T))?;
    raw.write_all(&VALIDATE)?;
    raw.write_all(&raw_query(1, &[b"stolen", b"x"]))?;
    let mut reply = Vec::new();
    let _ = raw.read_to_end(&mut reply);
    assert!(reply.is_empty(), "closed without a word: {reply:?}");
    // PyTorch's client pings first: the nonce comes back complemented.
    let mut raw = TcpStream::connect(addr)?;
    raw.set_read_timeout(Some(T))?;
    raw.write_all(&VALIDATE)?;
    raw.write_all(&[13, 0x78, 0x56, 0x34, 0x12])?;
    let mut echo = [0u8; 4];
    raw.read_exact(&mut echo)?;
    assert_eq!(u32::from_le_bytes(echo), !0x1234_5678u32);

    let good = StoreClient::connect(addr, Some("s3cret".to_owned()), T)?;
    assert!(!good.check(&["stolen"])?);
    good.set("ok", b"1")?;
    assert_eq!(good.get("ok", T)?, b"1");
    // A store without a token accepts a client that has one.
    let open = StoreServer::bind(loopback0(), None)?;
    let c = StoreClient::connect(open.local_addr(), Some("any".to_owned()), T)?;
    c.set("k", b"v")?;
    assert_eq!(c.get("k", T)?, b"v");
    // The extension with a token: the right one gets it, none is refused.
    let ours = StoreClient::connect_ours(addr, Some("s3cret".to_owned()), T)?;
    assert!(ours.speaks_extension());
    assert_eq!(ours.get("ok", T)?, b"1");
    assert!(matches!(
        StoreClient::connect_ours(addr, None, T),
        Err(RendezvousError::Unauthorized)
    ));
    Ok(())
}

/// A store that closes the connection at `METRALE_HELLO` (as PyTorch's
/// does at any query it does not know), then answers plain `PING`s.
fn store_without_the_extension() -> Result<(SocketAddr, std::thread::JoinHandle<Result<()>>)> {
    let listener = TcpListener::bind(loopback0())?;
    let addr = listener.local_addr()?;
    let t = std::thread::spawn(move || -> Result<()> {
        let (mut first, _) = listener.accept()?;
        let mut hello = [0u8; 10];
        first.read_exact(&mut hello)?;
        ensure!(hello[..5] == VALIDATE && hello[5] == 0xA6, "{hello:02x?}");
        drop(first);
        let (mut s, _) = listener.accept()?;
        s.set_read_timeout(Some(T))?;
        let mut q = [0u8; 5];
        s.read_exact(&mut q)?;
        ensure!(q == VALIDATE, "{q:02x?}");
        for _ in 0..2 {
            s.read_exact(&mut q)?;
            ensure!(q[0] == 13, "a PING, not {q:02x?}");
            s.write_all(&q[1..])?;
        }
        Ok(())
    });
    Ok((addr, t))
}

#[test]
fn a_store_without_the_extension_is_used_without_it() -> Result<()> {
    let (addr, fake) = store_without_the_extension()?;
    let c = StoreClient::connect_ours(addr, None, T)?;
    assert!(!c.speaks_extension());
    c.ping()?;
    fake.join().expect("fake store")?;
    // Against a store of ours it is spoken.
    let server = StoreServer::bind(loopback0(), None)?;
    let c = StoreClient::connect_ours(server.local_addr(), None, T)?;
    assert!(c.speaks_extension());
    c.set("k", b"v")?;
    assert_eq!(c.multi_get(&["k"], T)?, vec![b"v".to_vec()]);
    assert!(!c.check(&["absent"])?);
    assert_eq!(c.compare_set("k", b"v", b"w")?, b"w");
    assert_eq!(c.add("n", 2)?, 2);
    assert!(c.delete_key("n")?);
    assert_eq!(c.num_keys()?, 1);
    assert!(matches!(
        c.wait(&["late"], Duration::from_millis(100)),
        Err(RendezvousError::Timeout { .. })
    ));
    c.queue_push("q", b"1")?;
    assert_eq!(c.queue_pop("q", None)?, Some(b"1".to_vec()));
    assert_eq!(c.list_keys()?, ["k"]);
    Ok(())
}

#[test]
fn server_drop_does_not_hang() -> Result<()> {
    let server = StoreServer::bind(loopback0(), None)?;
    let addr = server.local_addr();
    let _idle = StoreClient::connect(addr, None, T)?;
    // A raw connection stuck mid-query.
    let mut half = TcpStream::connect(addr)?;
    half.write_all(&VALIDATE)?;
    half.write_all(&raw_query(1, &[b"key"])[..5])?;
    // A client blocked in a long get.
    let c = StoreClient::connect(addr, None, T)?;
    let waiter = std::thread::spawn(move || c.get("never", Duration::from_secs(2)));
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    server.shutdown();
    let took = start.elapsed();
    assert!(took < Duration::from_secs(3), "shutdown took {took:?}");
    // The waiting get tries to reconnect (the store may come back) and ends
    // with an error at its deadline.
    let result = waiter.join().expect("waiter");
    assert!(result.is_err(), "{result:?}");
    assert!(start.elapsed() < Duration::from_secs(5));
    Ok(())
}

#[test]
fn connect_retries_until_the_server_starts() -> Result<()> {
    // Find a free port, release it, and start the server there a bit later.
    let addr = StoreServer::bind(loopback0(), None)?.local_addr();
    let starter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        StoreServer::bind(addr, None)
    });
    let c = StoreClient::connect(addr, None, T)?;
    let server = starter.join().expect("starter")?;
    c.set("a", b"b")?;
    assert_eq!(c.get("a", T)?, b"b");
    drop(server);
    // With nobody listening, connect gives up at its deadline.
    let start = Instant::now();
    assert!(StoreClient::connect(addr, None, Duration::from_millis(200)).is_err());
    assert!(start.elapsed() < Duration::from_secs(3));
    Ok(())
}

#[test]
fn idle_connections_are_replaced_and_huge_timeouts_do_not_overflow() -> Result<()> {
    let server = StoreServer::bind_with_idle_limit(loopback0(), None, Duration::from_millis(100))?;
    // A validated raw connection that sends nothing is closed as idle.
    let mut raw = TcpStream::connect(server.local_addr())?;
    raw.write_all(&VALIDATE)?;
    raw.set_read_timeout(Some(T))?;
    let start = Instant::now();
    assert_eq!(raw.read(&mut [0u8; 1])?, 0, "closed");
    assert!(start.elapsed() < Duration::from_secs(3));
    let c = StoreClient::connect(server.local_addr(), None, Duration::MAX)?;
    c.set("k", b"v1")?;
    // The server drops the connection as idle; the client reconnects.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(c.get("k", Duration::MAX)?, b"v1");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(c.add("n", 3)?, 3);
    assert_eq!(c.add("n", 4)?, 7, "add is applied exactly once per call");
    let dir = temp_dir("huge");
    let f = FileRendezvous::new(0, 1, dir.clone())?;
    f.set("x", b"y")?;
    assert_eq!(f.get("x", Duration::MAX)?, b"y");
    f.barrier("b", Duration::MAX)?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
