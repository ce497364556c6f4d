//! Tests of the c10d TCPStore client and server against each other
//! (queries, waits, tokens, retries, shutdown), of the TCP and file
//! rendezvous with four ranks as threads (namespaces, wildcard bind, a taken
//! port), and of the environment and URL parsing. Loopback addresses only.
//! Hostile clients are in `store_abuse.rs`, launchers in `launchers.rs`,
//! PyTorch's bytes in `tcpstore_fixtures.rs`.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use metrale_comm::rendezvous::{
    EnvConfig, FileRendezvous, ID_LEN, Launch, Rendezvous, RendezvousError, RendezvousSpec,
    StoreClient, StoreServer, TcpRendezvous, rendezvous_from_url,
};
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    move |k| map.get(k).cloned()
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

fn random_id() -> [u8; ID_LEN] {
    let mut id = [0u8; ID_LEN];
    rand::rng().fill(&mut id[..]);
    id
}

/// What one rank thread hands back: its ids per generation and its rendezvous.
type RankOutcome = (Vec<[u8; ID_LEN]>, Box<dyn Rendezvous>);

/// Every rank exchanges ids for several generations and passes barriers;
/// checks that every rank got rank 0's id of each generation.
fn drive_ranks(ranks: Vec<Box<dyn Rendezvous>>) -> Result<()> {
    const GENERATIONS: u64 = 4;
    let world = ranks.len();
    let arrived = Arc::new(AtomicUsize::new(0));
    let made = Arc::new(parking_lot::Mutex::new(HashMap::<u64, [u8; ID_LEN]>::new()));
    let threads: Vec<_> = ranks
        .into_iter()
        .map(|rdzv| {
            let arrived = Arc::clone(&arrived);
            let made = Arc::clone(&made);
            std::thread::spawn(move || -> Result<RankOutcome> {
                let mut ids = Vec::new();
                for generation in 0..GENERATIONS {
                    let mut make = || {
                        let id = random_id();
                        made.lock().insert(generation, id);
                        Ok(id)
                    };
                    ids.push(rdzv.exchange_id(generation, &mut make, T)?);
                    // The same barrier name, reused: nobody leaves before all arrive.
                    arrived.fetch_add(1, Ordering::SeqCst);
                    rdzv.barrier("step", T)?;
                    let seen = arrived.load(Ordering::SeqCst);
                    let expected = world * (generation as usize + 1);
                    ensure!(
                        seen >= expected,
                        "rank {} left early: {seen} < {expected}",
                        rdzv.rank()
                    );
                    rdzv.barrier("after-step", T)?;
                }
                rdzv.barrier("end", T)?;
                Ok((ids, rdzv))
            })
        })
        .collect();
    let mut results = Vec::new();
    for t in threads {
        results.push(t.join().expect("rank panicked")?);
    }
    let made = made.lock();
    assert_eq!(
        made.len(),
        GENERATIONS as usize,
        "rank 0 made one id per generation"
    );
    for (ids, rdzv) in &results {
        for (generation, id) in ids.iter().enumerate() {
            assert_eq!(
                id,
                &made[&(generation as u64)],
                "rank {} generation {generation}",
                rdzv.rank()
            );
        }
    }
    for g in 1..GENERATIONS {
        assert_ne!(made[&g], made[&(g - 1)]);
    }
    Ok(())
}

/// Four TCP rendezvous with a token, rank 0 serving the store.
fn tcp_four_ranks() -> Result<Vec<Box<dyn Rendezvous>>> {
    let token = Some("tok".to_owned());
    let rank0 = TcpRendezvous::new(0, 4, loopback0(), token.clone(), T)?;
    let addr = rank0.local_addr().context("rank 0 serves")?;
    let mut ranks: Vec<Box<dyn Rendezvous>> = vec![Box::new(rank0)];
    for rank in 1..4 {
        ranks.push(Box::new(TcpRendezvous::new(
            rank,
            4,
            addr,
            token.clone(),
            T,
        )?));
    }
    Ok(ranks)
}

#[test]
fn tcp_rendezvous_four_ranks() -> Result<()> {
    drive_ranks(tcp_four_ranks()?)?;
    // Nobody listens on the discard port: connecting gives up at the deadline.
    let unreachable = SocketAddr::from(([127, 0, 0, 1], 9));
    assert!(TcpRendezvous::new(1, 4, unreachable, None, Duration::from_millis(50)).is_err());
    Ok(())
}

#[test]
fn tcp_rendezvous_reports_make_errors_and_barrier_timeouts() -> Result<()> {
    let rank0 = TcpRendezvous::new(0, 2, loopback0(), None, T)?;
    let addr = rank0.local_addr().context("rank 0 serves")?;
    let rank1 = TcpRendezvous::new(1, 2, addr, None, T)?;
    let r0 = rank0.exchange_id(7, &mut || Err("no device".to_owned()), T);
    assert!(
        matches!(r0, Err(RendezvousError::MakeId(ref m)) if m == "no device"),
        "{r0:?}"
    );
    let r1 = rank1.exchange_id(7, &mut || panic!("only rank 0 makes ids"), T);
    assert!(
        matches!(r1, Err(RendezvousError::MakeId(ref m)) if m.contains("no device")),
        "{r1:?}"
    );
    let start = Instant::now();
    let lonely = rank1.barrier("lonely", Duration::from_millis(150));
    assert!(
        matches!(lonely, Err(RendezvousError::Timeout { .. })),
        "{lonely:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(3));
    // Rank 1 waiting for an id that never comes times out too.
    let missing = rank1.exchange_id(8, &mut || panic!("only rank 0"), Duration::from_millis(100));
    assert!(
        matches!(missing, Err(RendezvousError::Timeout { .. })),
        "{missing:?}"
    );
    Ok(())
}

/// The variables of plain `env://` for `rank` of `world` on `port`.
fn env_vars(rank: usize, world: usize, port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("MASTER_ADDR", "localhost".to_owned()),
        ("MASTER_PORT", port.to_string()),
    ]
}

fn launch_of(vars: &[(&str, String)]) -> Result<Launch> {
    let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Ok(Launch::from_lookup(lookup(&pairs))?)
}

#[test]
fn rank0_binds_the_wildcard_and_a_taken_port_is_explained() -> Result<()> {
    let port = free_port();
    let rank0 = TcpRendezvous::from_launch(&launch_of(&env_vars(0, 2, port))?, T)?;
    let bound = rank0.local_addr().context("rank 0 serves")?;
    assert!(bound.ip().is_unspecified(), "bound on {bound}");
    assert_eq!(bound.port(), port);
    let rank1 = TcpRendezvous::from_launch(&launch_of(&env_vars(1, 2, port))?, T)?;
    assert!(rank1.local_addr().is_none());
    let id = random_id();
    let t = std::thread::spawn(move || rank1.exchange_id(0, &mut || panic!("rank 1"), T));
    assert_eq!(rank0.exchange_id(0, &mut || Ok(id), T)?, id);
    assert_eq!(t.join().expect("rank 1")?, id);

    // The port is taken by a store (rank 0 above): the error says so.
    match TcpRendezvous::from_launch(&launch_of(&env_vars(0, 2, port))?, T) {
        Err(e @ RendezvousError::AddressInUse { .. }) => {
            let text = e.to_string();
            assert!(text.contains("c10d TCPStore answers"), "{text}");
            assert!(text.contains("MASTER_PORT"), "{text}");
        }
        other => bail!("expected AddressInUse, got {other:?}"),
    }
    // Taken by something else, under torchrun without the agent store.
    let other = TcpListener::bind("0.0.0.0:0")?;
    let taken = other.local_addr()?.port();
    let mut torchrun = env_vars(0, 2, taken);
    torchrun.extend([
        ("LOCAL_WORLD_SIZE", "2".to_owned()),
        ("TORCHELASTIC_RUN_ID", "job".to_owned()),
        ("TORCHELASTIC_USE_AGENT_STORE", "False".to_owned()),
    ]);
    match TcpRendezvous::from_launch(&launch_of(&torchrun)?, T) {
        Err(e @ RendezvousError::AddressInUse { .. }) => {
            let text = e.to_string();
            assert!(text.contains("another program listens"), "{text}");
            assert!(text.contains("TORCHELASTIC_USE_AGENT_STORE=True"), "{text}");
        }
        other => bail!("expected AddressInUse, got {other:?}"),
    }
    Ok(())
}

/// Under torchrun the agent serves the store; a restarted job (the next
/// restart count) never reads the previous attempt's id.
#[test]
fn torchrun_attempts_are_namespaced() -> Result<()> {
    let agent = StoreServer::bind(loopback0(), None)?;
    let port = agent.local_addr().port();
    let attempt = |rank: usize, restart: u32| -> Result<TcpRendezvous> {
        let mut vars = env_vars(rank, 2, port);
        vars[3].1 = "127.0.0.1".to_owned();
        vars.extend([
            ("LOCAL_WORLD_SIZE", "2".to_owned()),
            ("TORCHELASTIC_RUN_ID", "run-7".to_owned()),
            ("TORCHELASTIC_RESTART_COUNT", restart.to_string()),
            ("TORCHELASTIC_USE_AGENT_STORE", "True".to_owned()),
        ]);
        Ok(TcpRendezvous::from_launch(&launch_of(&vars)?, T)?)
    };
    let first = attempt(0, 0)?;
    assert!(
        first.local_addr().is_none(),
        "rank 0 is a client of the agent"
    );
    assert_eq!(first.namespace(), "metrale/run-7/attempt_0/");
    let old_id = random_id();
    assert_eq!(first.exchange_id(0, &mut || Ok(old_id), T)?, old_id);
    drop(first);
    // Attempt 1: rank 1 arrives first and must wait for attempt 1's id.
    let rank1 = attempt(1, 1)?;
    let early = rank1.exchange_id(0, &mut || panic!("rank 1"), Duration::from_millis(200));
    assert!(
        matches!(early, Err(RendezvousError::Timeout { .. })),
        "{early:?}"
    );
    let new_id = random_id();
    let t = std::thread::spawn(move || rank1.exchange_id(0, &mut || panic!("rank 1"), T));
    let rank0 = attempt(0, 1)?;
    assert_eq!(rank0.exchange_id(0, &mut || Ok(new_id), T)?, new_id);
    assert_eq!(t.join().expect("rank 1")?, new_id);
    assert_ne!(old_id, new_id);
    Ok(())
}

/// Four file rendezvous in `dir`.
fn file_four_ranks(dir: &std::path::Path) -> Result<Vec<Box<dyn Rendezvous>>> {
    (0..4)
        .map(|rank| Ok(Box::new(FileRendezvous::new(rank, 4, dir.to_path_buf())?) as _))
        .collect()
}

#[test]
fn file_rendezvous_four_ranks() -> Result<()> {
    let dir = temp_dir("file");
    drive_ranks(file_four_ranks(&dir)?)?;
    let lonely = FileRendezvous::new(1, 2, dir.join("lonely"))?;
    let start = Instant::now();
    assert!(matches!(
        lonely.barrier("b", Duration::from_millis(100)),
        Err(RendezvousError::Timeout { .. })
    ));
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(FileRendezvous::new(4, 4, dir.clone()).is_err());
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Groups of four ranks (`world`, in rank order): the even and the odd
/// ranks, every rank in reverse order, and the reversed group's pairs (a
/// group's group). Every group and the world exchange ids of the same
/// generations and pass barriers of the same names at once, each meeting
/// only its own members (a shared key would hand some rank another
/// group's id); then, with every world rendezvous gone (rank 0's served
/// the store), the reversed group still meets. A member outside its group,
/// and an empty name or one with a `/`, are bad specs.
fn groups_meet_apart(world: Vec<Box<dyn Rendezvous>>) -> Result<()> {
    let n = world.len();
    let mut parity: [Vec<Box<dyn Rendezvous>>; 2] = Default::default();
    let mut reversed: Vec<Box<dyn Rendezvous>> = Vec::new();
    for rv in world.iter().rev() {
        let r = rv.rank();
        parity[r % 2].push(rv.group(&format!("parity {}", r % 2), r / 2, n / 2)?);
        reversed.push(rv.group("reversed", n - 1 - r, n)?);
    }
    for (name, member, size) in [("outside", 2, 2), ("a/b", 0, 2), ("", 0, 2)] {
        assert!(matches!(
            world[0].group(name, member, size),
            Err(RendezvousError::BadSpec(_))
        ));
    }
    let mut pairs: [Vec<Box<dyn Rendezvous>>; 2] = Default::default();
    for (m, rv) in reversed.iter().enumerate() {
        assert_eq!((rv.rank(), rv.world_size()), (m, n));
        pairs[m / 2].push(rv.group(&format!("pair {}", m / 2), m % 2, 2)?);
    }
    let [even, odd] = parity;
    let [first, second] = pairs;
    let drivers: Vec<_> = [world, even, odd, first, second]
        .into_iter()
        .map(|ranks| std::thread::spawn(move || drive_ranks(ranks)))
        .collect();
    for d in drivers {
        d.join().expect("a driver panicked")?;
    }
    drive_ranks(reversed)
}

#[test]
fn tcp_groups_meet_apart_and_keep_the_store() -> Result<()> {
    groups_meet_apart(tcp_four_ranks()?)
}

#[test]
fn file_groups_meet_apart() -> Result<()> {
    let dir = temp_dir("file-groups");
    groups_meet_apart(file_four_ranks(&dir)?)?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn url_rendezvous_tcp_and_file() -> Result<()> {
    let rank0 = TcpRendezvous::new(0, 2, loopback0(), None, T)?;
    let port = rank0.local_addr().context("serves")?.port();
    let rank1 = rendezvous_from_url(&format!("tcp://127.0.0.1:{port}?rank=1&world_size=2"), T)?;
    assert_eq!((rank1.rank(), rank1.world_size()), (1, 2));
    let id = random_id();
    let t = std::thread::spawn(move || rank1.exchange_id(0, &mut || panic!("rank 1"), T));
    assert_eq!(rank0.exchange_id(0, &mut || Ok(id), T)?, id);
    assert_eq!(t.join().expect("rank 1")?, id);

    let dir = temp_dir("url");
    let url = format!("file://{}?rank=0&world_size=1", dir.display());
    let solo = rendezvous_from_url(&url, T)?;
    assert_eq!(solo.exchange_id(3, &mut || Ok(id), T)?, id);
    solo.barrier("x", T)?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn url_parsing() {
    assert_eq!(
        RendezvousSpec::parse("env://").ok(),
        Some(RendezvousSpec::Env)
    );
    assert_eq!(
        RendezvousSpec::parse("file:///tmp/x?world_size=3").ok(),
        Some(RendezvousSpec::File {
            dir: PathBuf::from("/tmp/x"),
            rank: None,
            world_size: Some(3)
        })
    );
    assert_eq!(
        RendezvousSpec::parse("tcp://localhost:29500?rank=2&world_size=4").ok(),
        Some(RendezvousSpec::Tcp {
            host: "localhost".to_owned(),
            port: 29500,
            rank: Some(2),
            world_size: Some(4)
        })
    );
    for bad in [
        "",
        "http://x:1",
        "env://x",
        "file://relative",
        "tcp://host",
        "tcp://host:0",
        "tcp://:80",
        "tcp://h:99999",
        "tcp://h:1?rank=x",
        "tcp://h:1?color=3",
    ] {
        assert!(
            matches!(RendezvousSpec::parse(bad), Err(RendezvousError::BadSpec(_))),
            "{bad:?} must be refused"
        );
    }
    assert!(matches!(
        rendezvous_from_url("file:///tmp/x?rank=4&world_size=4", T),
        Err(RendezvousError::BadEnv { var: "RANK", .. })
    ));
}

#[test]
fn env_config_parsing() {
    let full = [
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let cfg = EnvConfig::from_lookup(lookup(&full)).expect("valid");
    assert_eq!(
        cfg,
        EnvConfig {
            rank: 2,
            world_size: 4,
            local_rank: 1,
            master_addr: "127.0.0.1".to_owned(),
            master_port: 29500
        }
    );
    assert_eq!(
        cfg.master_socket_addr().expect("resolves"),
        SocketAddr::from(([127, 0, 0, 1], 29500))
    );
    // LOCAL_RANK defaults to RANK.
    let no_local: Vec<_> = full
        .iter()
        .copied()
        .filter(|(k, _)| *k != "LOCAL_RANK")
        .collect();
    assert_eq!(
        EnvConfig::from_lookup(lookup(&no_local))
            .expect("valid")
            .local_rank,
        2
    );

    let with = |var: &str, value: Option<&str>| {
        let vars: Vec<(&str, &str)> = full
            .iter()
            .copied()
            .filter(|(k, _)| *k != var)
            .chain(value.map(|v| (var, v)))
            .collect();
        EnvConfig::from_lookup(lookup(&vars))
    };
    let cases: [(&str, Option<&str>, &str); 10] = [
        ("RANK", None, "RANK"),
        ("WORLD_SIZE", None, "WORLD_SIZE"),
        ("MASTER_ADDR", None, "MASTER_ADDR"),
        ("MASTER_ADDR", Some(""), "MASTER_ADDR"),
        ("MASTER_PORT", None, "MASTER_PORT"),
        ("RANK", Some("two"), "RANK"),
        ("MASTER_PORT", Some("70000"), "MASTER_PORT"),
        ("MASTER_PORT", Some("0"), "MASTER_PORT"),
        ("RANK", Some("4"), "RANK"),
        ("WORLD_SIZE", Some("0"), "WORLD_SIZE"),
    ];
    for (var, value, expected) in cases {
        match with(var, value) {
            Err(RendezvousError::BadEnv { var: got, reason }) => {
                assert_eq!(got, expected, "{var}={value:?}: {reason}");
            }
            other => panic!("{var}={value:?}: expected BadEnv, got {other:?}"),
        }
    }
    assert!(matches!(
        with("LOCAL_RANK", Some("-1")),
        Err(RendezvousError::BadEnv {
            var: "LOCAL_RANK",
            ..
        })
    ));
}
