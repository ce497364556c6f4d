//! Tests of the TCP and file rendezvous with four ranks as threads (id
//! exchange over generations, reused barrier names, groups meeting apart,
//! make errors and timeouts), of rank 0's wildcard bind and the taken-port
//! error, of torchrun's per-attempt namespaces, and of `rendezvous_from_url`.
//! Loopback addresses only. The store client and server are tested in
//! `store_client.rs`, the URL and environment parsing in
//! `rendezvous_config.rs`, launchers in `launchers.rs`.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use metrale_rendezvous::{
    FileRendezvous, ID_LEN, Launch, Rendezvous, RendezvousError, StoreServer, TcpRendezvous,
    rendezvous_from_url,
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
/// A census of four ranks where rank 2 never reports: every rank that
/// does sees exactly the others that did, and one census where all four
/// report sees all four.
#[test]
fn tcp_census_names_the_rank_that_did_not_report() -> Result<()> {
    let ranks = tcp_four_ranks()?;
    let wait = Duration::from_millis(300);
    let seen: Vec<Result<Vec<bool>, RendezvousError>> = std::thread::scope(|s| {
        let joins: Vec<_> = ranks
            .iter()
            .enumerate()
            .filter(|&(r, _)| r != 2)
            .map(|(_, rv)| s.spawn(move || rv.census("lonely", wait)))
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("a census thread"))
            .collect()
    });
    for got in seen {
        assert_eq!(got?, vec![true, true, false, true]);
    }
    let all: Vec<Result<Vec<bool>, RendezvousError>> = std::thread::scope(|s| {
        let joins: Vec<_> = ranks
            .iter()
            .map(|rv| s.spawn(move || rv.census("everyone", T)))
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("a census thread"))
            .collect()
    });
    for got in all {
        assert_eq!(got?, vec![true; 4]);
    }
    Ok(())
}

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
