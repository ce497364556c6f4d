//! A dead or frozen peer (`rel_dead_peer`, orchestrated by
//! `crate::dead_peer`): ranks run checked all-reduces in a loop on NCCL's
//! path, the one-shot path, or the path the tuned defaults (`Auto`) take
//! for the size; the orchestrator SIGSTOPs or SIGKILLs one
//! rank (0, which serves the store, or the last). Each survivor must fail
//! within the collective timeout + 0.5 s of a SIGSTOP or 100 ms of a
//! SIGKILL, with an error naming the failed rank, and shut down within
//! 1 s, reporting any leak; a SIGSTOPped rank, continued after the
//! survivors left, must fail and shut down too. No all-reduce that
//! returned `Ok` may hold a wrong element. Rank 0 serves the store in
//! which the survivors' census names the rank that stopped answering; a
//! store gone mid-census leaves a survivor only what its census read
//! before (rank 0's verdict or report; with neither it names rank 0,
//! `metrale_comm`'s failure path): a surviving rank 0 therefore keeps its
//! backend, and the store, until every other survivor has its error
//! (bounded), as a launcher's store outlives the ranks' diagnoses, so
//! that a survivor whose timeout fires later than rank 0's census ends
//! (a loaded machine) still gets a whole census.
//!
//! Invariants: the case comes from [`CASE_ENV`] (set by the
//! orchestrator); the signal's wall-clock time from the run directory's
//! `signalled-at` file, written just before the signal; each rank writes
//! what it measured to `timing-rank{r}`.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail, ensure};
use metrale_comm::{CommBackend, CommError, FastPathPolicy, OneShotPolicy, TuneCache};
use nccl_safe::DeviceBuffer;

use metrale_comm::rendezvous::TcpRendezvous;

use crate::RankCtx;

/// The variable naming the case: `PATH,SIGNAL,VICTIM` (`nccl` or
/// `oneshot`, `stop` or `kill`, a rank).
pub const CASE_ENV: &str = "METRALE_SUITE_DEAD_PEER";
/// The collective timeout of the case.
pub const TIMEOUT: Duration = Duration::from_secs(2);
/// A survivor's error after a SIGSTOP: the timeout + 0.5 s.
pub const STOP_BOUND: Duration = Duration::from_millis(2500);
/// A survivor's error after a SIGKILL.
pub const KILL_BOUND: Duration = Duration::from_millis(100);
/// A survivor's (or a continued rank's) shutdown.
pub const SHUTDOWN_BOUND: Duration = Duration::from_secs(1);
/// The iteration after which a rank marks itself ready for the signal.
pub const READY_AT: u64 = 20;
/// Elements per all-reduce.
const N: usize = 4096;

/// The all-reduce path of a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CasePath {
    /// NCCL's all-reduce (`OneShotPolicy::Never`, `FastPathPolicy::Never`).
    Nccl,
    /// The one-shot path at every size (`OneShotPolicy::Always`).
    OneShot,
    /// The defaults, `Auto` policies tuned at set-up (uncached): the
    /// tuner may take NCCL's path or the one-shot path for the size.
    Auto,
}

impl CasePath {
    /// Every path, in the order the cases run.
    pub const ALL: [CasePath; 3] = [CasePath::Nccl, CasePath::OneShot, CasePath::Auto];

    fn spell(self) -> &'static str {
        match self {
            CasePath::Nccl => "nccl",
            CasePath::OneShot => "oneshot",
            CasePath::Auto => "auto",
        }
    }
}

/// One case of the scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Case {
    /// The all-reduce path.
    pub path: CasePath,
    /// SIGKILL rather than SIGSTOP.
    pub kill: bool,
    /// The rank signalled.
    pub victim: usize,
}

impl Case {
    /// The case as [`CASE_ENV`] spells it.
    pub fn spell(&self) -> String {
        format!(
            "{},{},{}",
            self.path.spell(),
            if self.kill { "kill" } else { "stop" },
            self.victim
        )
    }

    /// Parses [`Case::spell`]'s text.
    pub fn parse(s: &str) -> anyhow::Result<Case> {
        let p: Vec<&str> = s.split(',').collect();
        ensure!(p.len() == 3, "{CASE_ENV}={s}: want PATH,SIGNAL,VICTIM");
        Ok(Case {
            path: match CasePath::ALL.into_iter().find(|q| q.spell() == p[0]) {
                Some(q) => q,
                None => bail!("{CASE_ENV}: unknown path {}", p[0]),
            },
            kill: match p[1] {
                "kill" => true,
                "stop" => false,
                o => bail!("{CASE_ENV}: unknown signal {o}"),
            },
            victim: p[2].parse().context("the victim rank")?,
        })
    }
}

/// Microseconds since the epoch (the orchestrator's clock is the same).
pub fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

/// Input element `k` of `rank` at iteration `i`: small integers, so every
/// sum is exact in f32.
fn input(rank: usize, i: u64, k: usize) -> f32 {
    ((rank + 1) * (k % 7 + 1) + (i % 5) as usize) as f32
}

/// Whether `e` names rank `r` as the one that failed.
fn names(e: &CommError, r: usize) -> bool {
    let text = e.to_string();
    text.contains(&format!("rank {r} (process"))
        || e.failure()
            .and_then(|f| f.suspect.as_ref())
            .is_some_and(|s| s.rank == r)
}

/// Rank 0, a survivor, serving the store (with `b`, which its caller
/// still holds): waits until every other survivor has written its
/// timing, so has its error and its census through the store is over, or
/// until the case's bound + [`SHUTDOWN_BOUND`] after the signal (the
/// orchestrator bounds a survivor's exit 1 s later).
fn keep_the_store(ctx: &RankCtx, case: Case, signalled: u128) {
    let bound = if case.kill { KILL_BOUND } else { STOP_BOUND };
    let until = signalled + (bound + SHUTDOWN_BOUND).as_micros();
    let dir = ctx.dump_dir();
    let others: Vec<usize> = (1..ctx.world_size).filter(|&r| r != case.victim).collect();
    while now_us() < until
        && !others
            .iter()
            .all(|r| dir.with_file_name(format!("timing-rank{r}")).exists())
    {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The rank body: see the module docs.
pub fn dead_peer(ctx: &RankCtx) -> anyhow::Result<()> {
    if ctx.mode == crate::Mode::Threads {
        return Err(RankCtx::skip("needs one process per rank"));
    }
    let case = Case::parse(&std::env::var(CASE_ENV).with_context(|| {
        format!("{CASE_ENV} is not set (the orchestrator runs this scenario)")
    })?)?;
    let (one_shot, fast) = match case.path {
        CasePath::Nccl => (OneShotPolicy::Never, FastPathPolicy::Never),
        CasePath::OneShot => (OneShotPolicy::Always, FastPathPolicy::Never),
        CasePath::Auto => (OneShotPolicy::Auto, FastPathPolicy::Auto),
    };
    let cfg = ctx
        .config()
        .with_collective_timeout(TIMEOUT)
        .with_fast_path(fast)
        .with_one_shot(one_shot)
        .with_tune_cache(TuneCache::Off);
    // As a user would: rank 0 serves the store at MASTER_ADDR:MASTER_PORT.
    let addr: std::net::SocketAddr = format!(
        "{}:{}",
        std::env::var("MASTER_ADDR").context("MASTER_ADDR")?,
        std::env::var("MASTER_PORT").context("MASTER_PORT")?
    )
    .parse()
    .context("MASTER_ADDR:MASTER_PORT")?;
    ctx.step("the store at MASTER_ADDR");
    let rdzv = TcpRendezvous::new(
        ctx.rank,
        ctx.world_size,
        addr,
        None,
        Duration::from_secs(30),
    )?;
    let b = metrale_comm::NcclBackend::new(cfg, Box::new(rdzv))?;
    let mut buf = DeviceBuffer::<f32>::alloc(b.context(), N)?;
    let w = ctx.world_size;
    let took_path = b.all_reduce_path_of(nccl_safe::DataType::Float32, N * 4);
    let start = Instant::now();
    let mut i = 0u64;
    let err = loop {
        ensure!(
            start.elapsed() < Duration::from_secs(60),
            "no error within 60 s"
        );
        ctx.step(format!("all_reduce {i}"));
        let host: Vec<f32> = (0..N).map(|k| input(ctx.rank, i, k)).collect();
        buf.copy_from_host(&host)?;
        match b.all_reduce(buf.view_mut()).and_then(|()| b.synchronize()) {
            Ok(()) => {
                let out = buf.to_host_vec()?;
                for (k, v) in out.iter().enumerate() {
                    let want: f32 = (0..w).map(|r| input(r, i, k)).sum();
                    ensure!(
                        *v == want,
                        "all_reduce {i} returned Ok with element {k} = {v}, not {want}"
                    );
                }
                i += 1;
                if i == READY_AT {
                    ctx.mark(&format!("ready-rank{}", ctx.rank))?;
                }
            }
            Err(e) => break e,
        }
    };
    let seen = now_us();
    let signalled: u128 = std::fs::read_to_string(ctx.dump_dir().with_file_name("signalled-at"))
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .with_context(|| format!("an error before the signal: {err}"))?;
    let latency = Duration::from_micros(seen.saturating_sub(signalled) as u64);
    let t = Instant::now();
    let shut = b.shutdown();
    let took = t.elapsed();
    let leaked = match &shut {
        Ok(()) => "nothing".to_string(),
        Err(CommError::Leaked { leaks, .. }) => leaks
            .iter()
            .map(|l| format!("{:?}", l.what))
            .collect::<Vec<_>>()
            .join("+"),
        Err(e) => format!("error: {e}"),
    };
    let line = format!(
        "rank {} ({}, {took_path:?}): error {:.1} ms after the signal, shutdown {:.1} ms, leaked {leaked}",
        ctx.rank,
        if ctx.rank == case.victim {
            "continued"
        } else {
            "survivor"
        },
        latency.as_secs_f64() * 1e3,
        took.as_secs_f64() * 1e3,
    );
    std::fs::write(
        ctx.dump_dir()
            .with_file_name(format!("timing-rank{}", ctx.rank)),
        &line,
    )?;
    if ctx.rank == 0 && case.victim != 0 {
        keep_the_store(ctx, case, signalled);
    }
    ensure!(
        took <= SHUTDOWN_BOUND,
        "{line}: shutdown took more than {SHUTDOWN_BOUND:?}"
    );
    if let Err(e) = &shut {
        ensure!(
            matches!(e, CommError::Leaked { .. }),
            "{line}: shutdown failed otherwise than by a leak: {e}"
        );
    }
    if ctx.rank == case.victim {
        // Continued after the survivors left: it fails on its own (the
        // orchestrator bounds its exit).
        return Ok(());
    }
    let bound = if case.kill { KILL_BOUND } else { STOP_BOUND };
    ensure!(
        latency <= bound,
        "{line}: the error came later than {bound:?}: {err}"
    );
    ensure!(
        names(&err, case.victim),
        "{line}: the error does not name rank {}: {err}",
        case.victim
    );
    Ok(())
}
