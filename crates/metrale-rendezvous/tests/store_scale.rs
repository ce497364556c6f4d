//! A rendezvous of 16,384 ranks through rank 0's store, on loopback.
//!
//! Every rank is a real [`TcpRendezvous`] (the `env://` path's rendezvous
//! where rank 0 serves the store): rank 0 in this process, which serves
//! the store; ranks 1 to 16,383 as threads of four helper processes (this
//! test binary run again, told its ranks by [`HELPER_ENV`]), so that no
//! process needs more file descriptors than the limit gives (rank 0's
//! holds one per rank). Each rank connects, receives rank 0's unique id
//! (`exchange_id`), and passes two barriers; rank 0 checks that its store
//! held every connection on one thread.

use std::net::{SocketAddr, TcpListener};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use metrale_rendezvous::{ID_LEN, Rendezvous, TcpRendezvous};

const WORLD: usize = 16384;
const HELPERS: usize = 4;
/// The helper role: `FROM:TO:PORT:ID_HEX` (ranks FROM..TO).
const HELPER_ENV: &str = "METRALE_STORE_SCALE_HELPER";
const T: Duration = Duration::from_secs(120);
const TEST_NAME: &str = "a_rendezvous_of_16384_ranks_through_rank_0s_store";

fn hex(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<[u8; ID_LEN]> {
    ensure!(s.len() == 2 * ID_LEN, "id of {} hex digits", s.len());
    let mut id = [0u8; ID_LEN];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)?;
    }
    Ok(id)
}

/// One rank's part: the id, then the barriers.
fn rank(rank: usize, addr: SocketAddr, want: [u8; ID_LEN]) -> Result<()> {
    let rv = TcpRendezvous::new(rank, WORLD, addr, None, T)
        .with_context(|| format!("rank {rank}: connect"))?;
    let mut not_rank0 = || Err("only rank 0 makes the id".to_owned());
    let got = rv
        .exchange_id(0, &mut not_rank0, T)
        .with_context(|| format!("rank {rank}: id"))?;
    ensure!(got == want, "rank {rank}: another id");
    rv.barrier("first", T)
        .with_context(|| format!("rank {rank}: barrier"))?;
    rv.barrier("last", T)
        .with_context(|| format!("rank {rank}: last barrier"))?;
    Ok(())
}

/// The helper role: ranks `from..to` as threads.
fn helper(spec: &str) -> Result<()> {
    let parts: Vec<&str> = spec.split(':').collect();
    ensure!(parts.len() == 4, "bad {HELPER_ENV}={spec}");
    let (from, to): (usize, usize) = (parts[0].parse()?, parts[1].parse()?);
    let addr = SocketAddr::from(([127, 0, 0, 1], parts[2].parse::<u16>()?));
    let want = unhex(parts[3])?;
    let threads: Vec<_> = (from..to)
        .map(|r| {
            std::thread::Builder::new()
                .stack_size(128 << 10)
                .spawn(move || rank(r, addr, want))
                .context("spawning a rank thread")
        })
        .collect::<Result<_>>()?;
    let mut failed = Vec::new();
    for t in threads {
        if let Err(e) = t.join().expect("rank thread panicked") {
            failed.push(format!("{e:#}"));
        }
    }
    if !failed.is_empty() {
        bail!(
            "{} of {} ranks failed; first: {}",
            failed.len(),
            to - from,
            failed[0]
        );
    }
    Ok(())
}

#[test]
fn a_rendezvous_of_16384_ranks_through_rank_0s_store() -> Result<()> {
    if let Ok(spec) = std::env::var(HELPER_ENV) {
        return helper(&spec);
    }
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let id: [u8; ID_LEN] = rand::random();
    let start = Instant::now();
    let rank0 = TcpRendezvous::new(0, WORLD, addr, None, T)?;
    let per = (WORLD - 1).div_ceil(HELPERS);
    let mut kids = Vec::new();
    for h in 0..HELPERS {
        let from = 1 + h * per;
        let to = (from + per).min(WORLD);
        kids.push(
            Command::new(std::env::current_exe()?)
                .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
                .env(HELPER_ENV, format!("{from}:{to}:{port}:{}", hex(&id)))
                .spawn()
                .context("spawning a helper")?,
        );
    }
    let mut make = || Ok(id);
    let result = (|| -> Result<()> {
        ensure!(rank0.exchange_id(0, &mut make, T)? == id);
        rank0.barrier("first", T)?;
        let met = start.elapsed();
        let stats = rank0.store_stats().context("rank 0 serves")?;
        ensure!(
            stats.connections >= WORLD,
            "{} connections at the barrier: {stats:?}",
            stats.connections
        );
        rank0.barrier("last", T)?;
        println!("{WORLD} ranks: id and barrier in {met:?}; store at the barrier: {stats:?}");
        Ok(())
    })();
    let mut helpers_ok = true;
    for mut k in kids {
        if result.is_err() {
            let _ = k.kill();
        }
        helpers_ok &= k.wait().is_ok_and(|s| s.success());
    }
    result?;
    ensure!(helpers_ok, "a helper's ranks failed (its output above)");
    // One thread served them all.
    let threads = std::fs::read_dir("/proc/self/task")?
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.starts_with("metrale-store"))
        .count();
    ensure!(threads == 1, "{threads} store threads");
    Ok(())
}
