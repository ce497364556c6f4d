//! The store's limits, one test per failure seen at cluster scale and
//! under abuse (the store at d5d2009 failed each of them): a huge
//! `MULTI_GET`, a world past the old connection cap, a thread per waiting
//! client, waits counted against no limit, a half-applied `MULTI_SET`, a
//! full store that only rank 0 heard about, `ADD` wrapping, and PyTorch
//! 2.11's newer queries. Loopback only; other hostile clients are in
//! `store_abuse.rs`, the 16,384-rank world in `store_scale.rs`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use metrale_rendezvous::{
    ID_LEN, Rendezvous, RendezvousError, StoreClient, StoreLimit, StoreLimits, StoreServer,
    TcpRendezvous,
};

const T: Duration = Duration::from_secs(20);
const VALIDATE: [u8; 5] = [0, 0xCE, 0xF7, 0x85, 0x3C];

fn loopback0() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn blob(v: &mut Vec<u8>, b: &[u8]) {
    v.extend_from_slice(&(b.len() as u64).to_le_bytes());
    v.extend_from_slice(b);
}

/// A query naming `keys` (`CHECK`, `WAIT`, `MULTI_GET`).
fn keys_query(kind: u8, keys: &[&[u8]]) -> Vec<u8> {
    let mut q = vec![kind];
    q.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for k in keys {
        blob(&mut q, k);
    }
    q
}

/// This process's resident memory, from /proc.
fn rss_bytes() -> Result<usize> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("no VmRSS")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kib << 10)
}

/// Threads of this process whose name starts with `prefix`.
fn threads_named(prefix: &str) -> Result<usize> {
    let mut n = 0;
    for task in std::fs::read_dir("/proc/self/task")? {
        let comm = std::fs::read_to_string(task?.path().join("comm")).unwrap_or_default();
        if comm.starts_with(prefix) {
            n += 1;
        }
    }
    Ok(n)
}

/// Reads until the server closes `s` (end of stream or a reset) within
/// `within`; what it sent first.
fn read_until_closed(s: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let _ = s.set_read_timeout(Some(left));
        match s.read(&mut buf) {
            Ok(0) => return Some(got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return None;
            }
            Err(_) => return Some(got),
        }
    }
}

fn refusal_of(e: &RendezvousError) -> Option<StoreLimit> {
    match e {
        RendezvousError::StoreRefused { refusal, .. } => Some(refusal.limit),
        _ => None,
    }
}

/// Runs one rank's exchange and two barriers in each of `world` threads
/// (rank 0 serving the store on `addr`, built by `make`); every rank's id.
fn run_world(
    world: usize,
    make: impl Fn(usize) -> Result<TcpRendezvous, RendezvousError> + Send + Sync + 'static,
) -> Result<Vec<[u8; ID_LEN]>> {
    let make = Arc::new(make);
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let make = Arc::clone(&make);
            std::thread::Builder::new()
                .stack_size(256 << 10)
                .spawn(move || -> Result<([u8; ID_LEN], TcpRendezvous)> {
                    let rv = make(rank).with_context(|| format!("rank {rank}: connect"))?;
                    let mut id = || Ok([7u8; ID_LEN]);
                    let got = rv
                        .exchange_id(0, &mut id, T)
                        .with_context(|| format!("rank {rank}: id"))?;
                    rv.barrier("first", T)
                        .with_context(|| format!("rank {rank}: barrier"))?;
                    rv.barrier("last", T)
                        .with_context(|| format!("rank {rank}: last barrier"))?;
                    Ok((got, rv))
                })
                .expect("spawn a rank")
        })
        .collect();
    // Every rendezvous, rank 0's store with it, lives until every rank is
    // through: rank 0 passes the last barrier once every rank has arrived,
    // which can be before a rank has sent the wait that hears of it.
    let results: Vec<_> = threads
        .into_iter()
        .map(|t| t.join().expect("rank thread panicked"))
        .collect();
    results.into_iter().map(|r| r.map(|(id, _rv)| id)).collect()
}

#[test]
fn a_multi_get_of_64_gib_is_refused_before_its_reply_is_built() -> Result<()> {
    let server = StoreServer::bind(loopback0(), None)?;
    let addr = server.local_addr();
    let c = StoreClient::connect(addr, None, T)?;
    c.set("big", &vec![7u8; 1 << 20])?;
    let before = rss_bytes()?;
    // 65,536 times the 1 MiB key: a 720 KB query asking for a 64 GiB reply.
    let keys = vec![&b"big"[..]; 1 << 16];
    let mut q = VALIDATE.to_vec();
    q.extend_from_slice(&keys_query(10, &keys));
    let mut s = TcpStream::connect(addr)?;
    s.write_all(&q)?;
    // Refused: the connection closes (as PyTorch's server closes on an
    // error), and no reply byte comes.
    let got = read_until_closed(&mut s, Duration::from_secs(5)).context("not closed")?;
    assert!(got.is_empty(), "{} reply bytes", got.len());
    let grown = rss_bytes()?.saturating_sub(before);
    assert!(grown < 256 << 20, "the server grew by {grown} bytes");
    assert_eq!(c.get("big", T)?.len(), 1 << 20);
    // A client of ours (rank 0's own) is told which limit, and the value.
    let rv = TcpRendezvous::new(0, 1, loopback0(), None, T)?;
    rv.client().set("big", &vec![7u8; 1 << 20])?;
    let err = rv
        .client()
        .multi_get(&vec!["big"; 1 << 16], T)
        .expect_err("a 64 GiB reply");
    assert_eq!(refusal_of(&err), Some(StoreLimit::Reply), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("METRALE_STORE_MAX_REPLY") && text.contains(&(64u64 << 20).to_string()),
        "{text}"
    );
    // The client reconnects and is served.
    assert_eq!(rv.client().get("big", T)?.len(), 1 << 20);
    Ok(())
}

#[test]
fn a_world_of_1100_ranks_meets_and_the_connection_cap_is_named() -> Result<()> {
    // 1,100 ranks through rank 0's store, default limits: the cap follows
    // the world (at d5d2009 it was 1,024, and no rank passed).
    let world = 1100;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let start = Instant::now();
    let ids = run_world(world, move |rank| {
        TcpRendezvous::new(rank, world, addr, None, T)
    })?;
    assert!(ids.iter().all(|id| *id == [7u8; ID_LEN]));
    println!("{world} ranks: id and barrier in {:?}", start.elapsed());
    // At a cap, a client is refused with the cap, its value and its
    // variable: never a token complaint, never an evicted rank.
    let token = Some("s3cret".to_owned());
    let mut limits = StoreLimits::default();
    limits.max_connections = 8;
    let server = StoreServer::bind_with(loopback0(), token.clone(), limits)?;
    let addr = server.local_addr();
    let held: Vec<StoreClient> = (0..8)
        .map(|_| StoreClient::connect(addr, token.clone(), T))
        .collect::<Result<_, _>>()?;
    let err = StoreClient::connect(addr, token.clone(), T).expect_err("a ninth connection");
    let text = err.to_string();
    assert!(
        text.contains("METRALE_STORE_MAX_CONNECTIONS") && text.contains(" 8 connections"),
        "{text}"
    );
    assert!(!text.contains(metrale_rendezvous::TOKEN_ENV), "{text}");
    assert_eq!(refusal_of(&err), Some(StoreLimit::Connections), "{err}");
    for (i, c) in held.iter().enumerate() {
        c.set(&format!("held/{i}"), b"1")?;
    }
    Ok(())
}

#[test]
fn waiting_clients_hold_no_thread_each() -> Result<()> {
    let mut limits = StoreLimits::default();
    limits.max_connections = 2048;
    let server = StoreServer::bind_with(loopback0(), None, limits)?;
    let addr = server.local_addr();
    let mut waiting = Vec::new();
    for i in 0..1100 {
        let mut s = TcpStream::connect(addr)?;
        let mut q = VALIDATE.to_vec();
        q.extend_from_slice(&keys_query(6, &[format!("never/{i}").as_bytes()]));
        s.write_all(&q)?;
        waiting.push(s);
    }
    let deadline = Instant::now() + T;
    while server.stats().connections < 1100 {
        ensure!(Instant::now() < deadline, "{:?}", server.stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    // Other tests of this binary run servers too: one thread each.
    let threads = threads_named("metrale-store")?;
    assert!(
        threads < 32,
        "{threads} store threads for 1,100 waiting clients"
    );
    // A rank is still served at once.
    let c = StoreClient::connect(addr, None, T)?;
    let start = Instant::now();
    c.set("never/7", b"x")?;
    c.wait(&["never/7"], T)?;
    assert!(start.elapsed() < Duration::from_secs(1));
    // The waiter on it was woken.
    let mut one = [0u8; 1];
    waiting[7].set_read_timeout(Some(T))?;
    waiting[7].read_exact(&mut one)?;
    assert_eq!(one[0], 0, "STOP_WAITING");
    Ok(())
}

#[test]
fn pending_waits_count_against_the_memory_limit() -> Result<()> {
    // 154 clients each waiting on 512 keys of 8 KiB (4 MiB of keys each):
    // at d5d2009 the process grew by 1.25 GiB outside every limit.
    let mut limits = StoreLimits::default();
    limits.memory = 32 << 20;
    let server = StoreServer::bind_with(loopback0(), None, limits)?;
    let addr = server.local_addr();
    let before = rss_bytes()?;
    let keys: Vec<Vec<u8>> = (0..512)
        .map(|k| {
            let mut key = format!("wait/{k}/").into_bytes();
            key.resize(8 << 10, b'k');
            key
        })
        .collect();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let mut q = VALIDATE.to_vec();
    q.extend_from_slice(&keys_query(6, &refs));
    let mut conns = Vec::new();
    for _ in 0..154 {
        let mut s = TcpStream::connect(addr)?;
        // The server may close a refused one before it has it all.
        let _ = s.write_all(&q);
        conns.push(s);
    }
    // Those past the budget are refused (closed); the rest wait.
    let mut closed = 0;
    for s in &mut conns {
        if read_until_closed(s, Duration::from_millis(20)).is_some() {
            closed += 1;
        }
    }
    assert!(closed >= 140, "{closed} of 154 waits refused");
    let grown = rss_bytes()?.saturating_sub(before);
    assert!(grown < 160 << 20, "the server grew by {grown} bytes");
    // A rank of ours that waits now is told which limit.
    let c = StoreClient::connect_ours(addr, None, T)?;
    let keys: Vec<String> = (0..512)
        .map(|k| format!("ours/{k}/{}", "k".repeat(8000)))
        .collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let err = c.wait(&refs, T).expect_err("a wait past the budget");
    assert_eq!(refusal_of(&err), Some(StoreLimit::Memory), "{err}");
    assert!(err.to_string().contains("METRALE_STORE_MEMORY"), "{err}");
    Ok(())
}

/// Fills `c`'s store with 1 MiB values until one is refused; how many.
fn fill(c: &StoreClient) -> Result<usize> {
    let value = vec![1u8; 1 << 20];
    for n in 0..64 {
        if c.set(&format!("fill/{n}"), &value).is_err() {
            return Ok(n);
        }
    }
    bail!("the store took 64 MiB")
}

#[test]
fn a_refused_multi_set_changes_nothing_and_ends_the_waits_it_must() -> Result<()> {
    let mut limits = StoreLimits::default();
    limits.memory = 4 << 20;
    let server = StoreServer::bind_with(loopback0(), None, limits)?;
    let addr = server.local_addr();
    let setter = StoreClient::connect_ours(addr, None, T)?;
    ensure!(fill(&setter)? >= 1);
    let waiter = std::thread::spawn(move || -> Result<(Result<(), RendezvousError>, Duration)> {
        let c = StoreClient::connect_ours(addr, None, T)?;
        let start = Instant::now();
        Ok((c.wait(&["first"], T), start.elapsed()))
    });
    std::thread::sleep(Duration::from_millis(200));
    // A small first pair and a second one past the store's memory.
    let big = vec![2u8; 1 << 20];
    let err = setter
        .multi_set(&[("first", b"1"), ("second", &big)])
        .expect_err("a multi-set past the store's memory");
    assert_eq!(refusal_of(&err), Some(StoreLimit::Memory), "{err}");
    let checker = StoreClient::connect(addr, None, T)?;
    assert!(
        !checker.check(&["first"])?,
        "the refused multi-set stored its first pair"
    );
    let (waited, took) = waiter.join().expect("waiter")?;
    let e = waited.expect_err("the waiter of a refused key");
    assert_eq!(refusal_of(&e), Some(StoreLimit::Memory), "{e}");
    assert!(
        took < Duration::from_secs(3),
        "the waiter heard after {took:?}"
    );
    Ok(())
}

#[test]
fn a_full_store_is_a_typed_error_at_every_rank() -> Result<()> {
    let mut limits = StoreLimits::default();
    limits.memory = 4 << 20;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let rank0 = TcpRendezvous::with_limits(0, 4, addr, None, limits, T)?;
    // Ranks 1 and 2 wait for the id; then the store fills up.
    let waiting: Vec<_> = (1..3)
        .map(|rank| {
            std::thread::spawn(
                move || -> Result<(Result<[u8; ID_LEN], RendezvousError>, Duration)> {
                    let rv = TcpRendezvous::new(rank, 4, addr, None, T)?;
                    let start = Instant::now();
                    let mut not_rank0 = || Err("not rank 0".to_owned());
                    Ok((rv.exchange_id(0, &mut not_rank0, T), start.elapsed()))
                },
            )
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let filler = StoreClient::connect_ours(addr, None, T)?;
    ensure!(fill(&filler)? >= 1);
    // Rank 0's id does not fit (as a 1 MiB id would not): it is told which
    // limit, and so is every rank waiting for the id, at once.
    let err = rank0
        .client()
        .set(&format!("{}uid/0", rank0.namespace()), &vec![0u8; 1 << 20])
        .expect_err("the store is full");
    assert_eq!(refusal_of(&err), Some(StoreLimit::Memory), "{err}");
    for t in waiting {
        let (got, took) = t.join().expect("rank")?;
        let e = got.expect_err("a refused id");
        assert_eq!(refusal_of(&e), Some(StoreLimit::Memory), "{e}");
        assert!(e.to_string().contains("METRALE_STORE_MEMORY"), "{e}");
        assert!(took < Duration::from_secs(3), "heard after {took:?}");
    }
    // A rank that comes later hears it too, at once.
    let start = Instant::now();
    let e = match TcpRendezvous::new(3, 4, addr, None, T) {
        Err(e) => e,
        Ok(late) => {
            let mut not_rank0 = || Err("not rank 0".to_owned());
            late.exchange_id(0, &mut not_rank0, T)
                .expect_err("a refused id")
        }
    };
    assert_eq!(refusal_of(&e), Some(StoreLimit::Memory), "{e}");
    assert!(start.elapsed() < Duration::from_secs(3));
    Ok(())
}

#[test]
fn a_barrier_key_refused_is_a_typed_error_at_every_rank() -> Result<()> {
    // Ranks 0 and 1 are at the barrier; the store fills; rank 2's key is
    // refused: every rank hears the refusal, none times out.
    let cap = 4 << 20;
    let mut limits = StoreLimits::default();
    limits.memory = cap;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let rank0 = Arc::new(TcpRendezvous::with_limits(0, 3, addr, None, limits, T)?);
    let rank1 = Arc::new(TcpRendezvous::new(1, 3, addr, None, T)?);
    let rank2 = TcpRendezvous::new(2, 3, addr, None, T)?;
    let at = |rv: Arc<TcpRendezvous>| {
        std::thread::spawn(move || {
            let start = Instant::now();
            (rv.barrier("b", T), start.elapsed())
        })
    };
    let (w0, w1) = (at(Arc::clone(&rank0)), at(rank1));
    std::thread::sleep(Duration::from_millis(300));
    let filler = StoreClient::connect_ours(addr, None, T)?;
    ensure!(fill(&filler)? >= 1);
    drop(filler);
    std::thread::sleep(Duration::from_millis(200));
    // Rank 2's own sets, on its open connection, leave 80 bytes: its
    // barrier key (86 bytes with its overhead) does not fit.
    let mut i = 0;
    loop {
        rank2.client().ping()?;
        let used = rank0.store_stats().context("rank 0 serves")?.memory_bytes;
        let free = cap.saturating_sub(used);
        let key = format!("pad/{i:04}");
        let overhead = key.len() + 64;
        ensure!(free >= 80 + overhead, "{free} bytes free");
        let len = if free < 4096 {
            free - 80 - overhead
        } else {
            ((free - 2048) / 2).min(16 << 10)
        };
        rank2.client().set(&key, &vec![0u8; len])?;
        i += 1;
        if free < 4096 {
            break;
        }
    }
    let e2 = rank2
        .barrier("b", T)
        .expect_err("rank 2's key does not fit");
    assert_eq!(refusal_of(&e2), Some(StoreLimit::Memory), "{e2}");
    for (rank, w) in [(0, w0), (1, w1)] {
        let (r, took) = w.join().expect("rank");
        let e = r.expect_err("a refused barrier");
        assert_eq!(refusal_of(&e), Some(StoreLimit::Memory), "rank {rank}: {e}");
        assert!(
            e.to_string().contains("METRALE_STORE_MEMORY"),
            "rank {rank}: {e}"
        );
        assert!(
            took < Duration::from_secs(5),
            "rank {rank} heard after {took:?}"
        );
    }
    Ok(())
}

#[test]
fn add_overflow_is_an_error_not_a_wrap() -> Result<()> {
    let server = StoreServer::bind(loopback0(), None)?;
    let c = StoreClient::connect(server.local_addr(), None, T)?;
    c.set("n", i64::MAX.to_string().as_bytes())?;
    let r = c.add("n", 1);
    assert!(r.is_err(), "i64::MAX + 1 answered {r:?}");
    assert_eq!(c.get("n", T)?, i64::MAX.to_string().as_bytes());
    assert_eq!(c.add("n", -1)?, i64::MAX - 1);
    c.set("m", i64::MIN.to_string().as_bytes())?;
    assert!(c.add("m", -1).is_err());
    // A client of ours is told why.
    let rv = TcpRendezvous::new(0, 1, loopback0(), None, T)?;
    rv.client().set("n", i64::MAX.to_string().as_bytes())?;
    let e = rv.client().add("n", 1).expect_err("overflow");
    assert!(e.to_string().contains("overflow"), "{e}");
    Ok(())
}

/// One query's bytes and the reply PyTorch 2.11's libuv server gives it
/// (written from its source: `TCPStoreLibUvBackend.cpp`'s
/// `parse_queue_push_command` and the others, the client's `TCPStore.cpp`).
fn exchange(s: &mut TcpStream, query: &[u8], reply_len: usize) -> Result<Vec<u8>> {
    s.write_all(query)?;
    let mut got = vec![0u8; reply_len];
    s.read_exact(&mut got)
        .with_context(|| format!("the reply to query type {}", query[0]))?;
    Ok(got)
}

#[test]
fn pytorch_2_11_queries_are_answered_as_its_server_answers() -> Result<()> {
    let server = StoreServer::bind(loopback0(), None)?;
    let mut s = TcpStream::connect(server.local_addr())?;
    s.set_read_timeout(Some(T))?;
    s.write_all(&VALIDATE)?;
    let one = |key: &str| {
        let mut v = Vec::new();
        blob(&mut v, key.as_bytes());
        v
    };
    let with = |kind: u8, body: &[u8]| [&[kind][..], body].concat();
    // SET two keys (no reply), then LIST_KEYS: an i64 count, then each key.
    let mut set = with(1, &one("/a"));
    blob(&mut set, b"1");
    s.write_all(&set)?;
    let mut set = with(1, &one("/bb"));
    blob(&mut set, b"22");
    s.write_all(&set)?;
    let got = exchange(&mut s, &[17], 8 + 2 * 8 + 2 + 3)?;
    assert_eq!(&got[..8], &2i64.to_le_bytes());
    let first_len = usize::from(got[8]);
    let mut listed = vec![
        got[8..16 + first_len].to_vec(),
        got[16 + first_len..].to_vec(),
    ];
    listed.sort();
    assert_eq!(listed, vec![one("/a"), one("/bb")]);
    // QUEUE_PUSH (no reply) twice, QUEUE_LEN, QUEUE_POP: the length before
    // the pop, then the value.
    for v in [&b"first"[..], b"second"] {
        let mut push = with(14, &one("/q"));
        blob(&mut push, v);
        s.write_all(&push)?;
    }
    assert_eq!(
        exchange(&mut s, &with(16, &one("/q")), 8)?,
        2i64.to_le_bytes()
    );
    let mut want = 2i64.to_le_bytes().to_vec();
    blob(&mut want, b"first");
    assert_eq!(exchange(&mut s, &with(15, &one("/q")), want.len())?, want);
    // A queue with an item counts as present for CHECK and WAIT.
    assert_eq!(exchange(&mut s, &keys_query(5, &[b"/q"]), 1)?, [0]);
    assert_eq!(exchange(&mut s, &keys_query(6, &[b"/q"]), 1)?, [0]);
    let mut want = 1i64.to_le_bytes().to_vec();
    blob(&mut want, b"second");
    assert_eq!(exchange(&mut s, &with(15, &one("/q")), want.len())?, want);
    // Empty: 0, and no value (PyTorch's client raises DistQueueEmptyError).
    assert_eq!(
        exchange(&mut s, &with(15, &one("/q")), 8)?,
        0i64.to_le_bytes()
    );
    assert_eq!(
        exchange(&mut s, &with(16, &one("/q")), 8)?,
        0i64.to_le_bytes()
    );
    assert_eq!(exchange(&mut s, &keys_query(5, &[b"/q"]), 1)?, [1]);
    // A blocking pop is a WAIT on the queue's key: a push ends it.
    let mut other = TcpStream::connect(server.local_addr())?;
    other.write_all(&VALIDATE)?;
    s.write_all(&keys_query(6, &[b"/q"]))?;
    let mut push = with(14, &one("/q"));
    blob(&mut push, b"third");
    other.write_all(&push)?;
    let mut stop = [9u8; 1];
    s.read_exact(&mut stop)?;
    assert_eq!(stop, [0]);
    // BARRIER (PyTorch's, key and world size): the last arrival and every
    // earlier one get STOP_WAITING.
    let mut barrier = with(18, &one("/bar"));
    barrier.extend_from_slice(&2i64.to_le_bytes());
    other.write_all(&barrier)?;
    let got = exchange(&mut s, &barrier, 1)?;
    assert_eq!(got, [0]);
    other.set_read_timeout(Some(T))?;
    other.read_exact(&mut stop)?;
    assert_eq!(stop, [0]);
    // The connection is still in step: PING echoes.
    assert_eq!(
        exchange(&mut s, &[13, 1, 2, 3, 4], 4)?,
        [1, 2, 3, 4],
        "still served"
    );
    // Our client's side of the same queries.
    let c = StoreClient::connect(server.local_addr(), None, T)?;
    c.queue_push("/q2", b"v")?;
    assert_eq!(c.queue_len("/q2")?, 1);
    assert_eq!(c.queue_pop("/q2", Some(T))?, Some(b"v".to_vec()));
    assert_eq!(c.queue_pop("/q2", None)?, None);
    let mut keys = c.list_keys()?;
    keys.sort();
    assert_eq!(keys, ["/a", "/bar", "/bb"]);
    Ok(())
}
