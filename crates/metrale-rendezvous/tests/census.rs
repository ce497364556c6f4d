//! Tests of `Rendezvous::census` over a store served in-process: the
//! verdict a census publishes when it ends with ranks missing, and what a
//! census keeps when its store stops serving at a chosen point (after
//! another census' verdict, after nothing), each within its deadline.
//! Loopback addresses only.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use metrale_rendezvous::{
    CensusVerdict, Rendezvous, RendezvousError, StoreClient, StoreServer, TcpRendezvous,
};

const T: Duration = Duration::from_secs(10);
const NS: &str = "census-test/";

fn serve() -> Result<(StoreServer, SocketAddr)> {
    let server = StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), None)?;
    let addr = server.local_addr();
    Ok((server, addr))
}

fn rank(rank: usize, world: usize, addr: SocketAddr) -> Result<TcpRendezvous> {
    Ok(TcpRendezvous::connect(rank, world, addr, None, NS, T)?)
}

/// Waits (bounded) until `key` is in the store at `addr`.
fn wait_for(addr: SocketAddr, key: &str) -> Result<()> {
    StoreClient::connect(addr, None, T)?.wait(&[key], T)?;
    Ok(())
}

/// Three of four ranks take a census: each sees the same three, returns
/// within its wait and a quarter (and a margin for a loaded machine), and
/// a verdict naming rank 3 is left in the store.
#[test]
fn a_census_ending_with_ranks_missing_publishes_its_verdict() -> Result<()> {
    let (_server, addr) = serve()?;
    let ranks: Vec<TcpRendezvous> = (0..3).map(|r| rank(r, 4, addr)).collect::<Result<_>>()?;
    let wait = Duration::from_millis(200);
    let start = Instant::now();
    let seen: Vec<Result<Vec<bool>, RendezvousError>> = std::thread::scope(|s| {
        let joins: Vec<_> = ranks
            .iter()
            .map(|rv| s.spawn(move || rv.census("three", wait)))
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("a census thread"))
            .collect()
    });
    ensure!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    for got in seen {
        assert_eq!(got?, vec![true, true, true, false]);
    }
    let store = StoreClient::connect(addr, None, T)?;
    let value = store.get(&format!("{NS}census/three/verdict"), T)?;
    let text = String::from_utf8(value)?;
    let (by, missing) = text.split_once(':').context("a verdict")?;
    ensure!(by.parse::<usize>()? < 3, "{text}");
    assert_eq!(missing, "3");
    Ok(())
}

/// Rank 0's census ends (ranks 1-3 missing) and publishes its verdict;
/// rank 1's census, started later, reads it and rank 0's report, and then
/// the store stops: rank 1's census ends at once with both, not with a
/// bare store error.
#[test]
fn a_store_gone_after_rank_0s_verdict_keeps_what_was_read() -> Result<()> {
    let (server, addr) = serve()?;
    let rank0 = rank(0, 4, addr)?;
    let rank1 = rank(1, 4, addr)?;
    assert_eq!(
        rank0.census("timeout 0", Duration::from_millis(50))?,
        vec![true, false, false, false]
    );
    let start = Instant::now();
    let late = std::thread::spawn(move || rank1.census("timeout 0", T));
    wait_for(addr, &format!("{NS}census/timeout 0/1"))?;
    // The census reads every key it waits for right after its own set,
    // and polls every 10 ms; this leaves it many polls.
    std::thread::sleep(Duration::from_millis(300));
    server.shutdown();
    let got = late.join().expect("the census thread");
    ensure!(start.elapsed() < T / 2, "{:?}", start.elapsed());
    match got {
        Err(RendezvousError::CensusCut { name, so_far, .. }) => {
            assert_eq!(name, "timeout 0");
            assert_eq!(so_far.arrived, vec![true, true, false, false]);
            assert_eq!(so_far.verdict, Some(CensusVerdict::new(0, vec![1, 2, 3])));
        }
        other => bail!("expected a census cut, got {other:?}"),
    }
    Ok(())
}

/// A census that read no other rank's report nor verdict before its
/// store stopped ends at once, cut with nothing learned but its own.
#[test]
fn a_store_gone_before_anything_was_read_leaves_nothing() -> Result<()> {
    let (server, addr) = serve()?;
    let rank2 = rank(2, 4, addr)?;
    let start = Instant::now();
    let lonely = std::thread::spawn(move || rank2.census("timeout 0", T));
    wait_for(addr, &format!("{NS}census/timeout 0/2"))?;
    std::thread::sleep(Duration::from_millis(100));
    server.shutdown();
    let got = lonely.join().expect("the census thread");
    ensure!(start.elapsed() < T / 2, "{:?}", start.elapsed());
    match got {
        Err(RendezvousError::CensusCut { so_far, .. }) => {
            assert_eq!(so_far.arrived, vec![false, false, true, false]);
            assert_eq!(so_far.verdict, None);
        }
        other => bail!("expected a census cut, got {other:?}"),
    }
    Ok(())
}

/// A store gone before this rank's report is set is the store's own
/// error (nothing was read), within the census' wait.
#[test]
fn a_store_gone_before_the_census_is_a_plain_error_within_its_wait() -> Result<()> {
    let (server, addr) = serve()?;
    let rank1 = rank(1, 2, addr)?;
    server.shutdown();
    let wait = Duration::from_millis(300);
    let start = Instant::now();
    let got = rank1.census("timeout 0", wait);
    ensure!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    match got {
        Err(RendezvousError::CensusCut { .. }) | Ok(_) => bail!("{got:?}"),
        Err(_) => Ok(()),
    }
}
