//! The multi-rank integration suite of metrale-comm: one set of scenarios,
//! written once against the public APIs of `nccl-safe` and `metrale-comm`,
//! run on the CPU emulator by `cargo test` (ranks as threads, and as
//! processes through the orchestrator) and on GPUs by `cargo xtask
//! gpu-test` (ranks as threads, as processes, or as processes over NCCL's
//! socket transport).
//!
//! Invariants:
//! - A scenario body runs once per rank with a [`RankCtx`]; it returns `Ok`
//!   only after checking every output element against a host reference.
//! - Every host wait in the suite has a deadline: rank threads are joined
//!   with a timeout ([`run_threads`]), rank processes are killed by the
//!   orchestrator when the run's deadline passes.
//! - Each scenario run gets a fresh directory (store, rendezvous, flight
//!   recorder dumps), so runs never share state through the file system.
//! - Scenarios that inject emulator faults reset them when they finish;
//!   scenarios run one after another, never concurrently.

pub mod data;
pub mod dead_peer;
pub mod emu;
pub mod one_shot_local;
pub mod orchestrator;
pub mod scenarios;
pub mod tune_report;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use metrale_comm::rendezvous::{FileRendezvous, Rendezvous};
use parking_lot::Mutex;

pub use emu::EmuControl;

/// How the ranks of a scenario run are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Every rank a thread of one process; device = rank.
    Threads,
    /// One process per rank (torchrun's environment).
    Processes,
    /// Processes with NCCL's peer-to-peer and shared-memory transports off.
    Socket,
    /// One process per rank, started by real `torchrun --no-python`
    /// (static, `--standalone` and c10d rendezvous in turn); each rank
    /// first meets the others through torchrun's agent store.
    Torchrun,
    /// One process per rank, the ranks split over two emulated hosts
    /// (`NCCL_HOSTID` per host, the identity NCCL and the backend use),
    /// with the variables torchrun sets on each node of a 2-node job
    /// (`RANK`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, ...).
    /// Only scenarios that need several hosts run here.
    Nodes,
    /// As [`Mode::Nodes`], with the variables srun sets instead
    /// (`SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NODEID`, ...).
    NodesSrun,
}

impl Mode {
    /// The mode's name on the command line and in tables.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Threads => "threads",
            Mode::Processes => "processes",
            Mode::Socket => "socket",
            Mode::Torchrun => "torchrun",
            Mode::Nodes => "nodes",
            Mode::NodesSrun => "nodes-srun",
        }
    }

    /// Whether the mode spreads the ranks over several emulated hosts.
    pub fn multi_host(self) -> bool {
        matches!(self, Mode::Nodes | Mode::NodesSrun)
    }

    /// Parses a mode name.
    pub fn parse(s: &str) -> anyhow::Result<Mode> {
        match s.trim() {
            "threads" => Ok(Mode::Threads),
            "processes" => Ok(Mode::Processes),
            "socket" => Ok(Mode::Socket),
            "torchrun" => Ok(Mode::Torchrun),
            "nodes" => Ok(Mode::Nodes),
            "nodes-srun" => Ok(Mode::NodesSrun),
            other => anyhow::bail!(
                "unknown mode `{other}` (threads, processes, socket, torchrun, nodes, nodes-srun)"
            ),
        }
    }
}

/// What a scenario needs beyond the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// Runs anywhere.
    Nothing,
    /// The emulator's fault injection (skipped on GPUs).
    EmulatorFaults,
    /// One process per rank that the orchestrator can SIGKILL (GPUs,
    /// processes and socket modes).
    Processes,
    /// One process per rank (processes and socket modes), all ranks on
    /// device 0: runs at its fewest ranks on any box with a GPU.
    SharedDevice,
    /// Ranks on two hosts (the nodes modes): an even world of at least 2.
    Hosts,
}

/// One scenario of the suite.
#[derive(Clone)]
pub struct Scenario {
    /// Its name (`comm-suite run --scenarios NAME`).
    pub name: &'static str,
    /// What it checks, one line.
    pub about: &'static str,
    /// The fewest ranks it runs with.
    pub min_ranks: usize,
    /// The most ranks it runs with (`None`: every GPU).
    pub max_ranks: Option<usize>,
    /// The world sizes it runs with on the emulator.
    pub emu_worlds: &'static [usize],
    /// What it needs.
    pub needs: Needs,
    /// The body, run once per rank.
    pub body: fn(&RankCtx) -> anyhow::Result<()>,
}

impl std::fmt::Debug for Scenario {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scenario")
            .field("name", &self.name)
            .finish()
    }
}

impl Scenario {
    /// The world size for a box of `gpus` GPUs, or why it cannot run.
    pub fn world_for(&self, gpus: usize) -> Result<usize, String> {
        let w = self.max_ranks.map_or(gpus, |m| m.min(gpus));
        if w < self.min_ranks {
            Err(format!("needs {} GPUs, {gpus} available", self.min_ranks))
        } else {
            Ok(w)
        }
    }
}

/// The registry: every scenario of the suite.
pub fn scenarios() -> Vec<Scenario> {
    scenarios::all()
}

/// The outcome of one scenario run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank passed.
    Pass,
    /// Skipped, with the reason.
    Skip(String),
    /// Failed, with what each failing rank said.
    Fail(String),
}

impl Outcome {
    /// The outcome of a run from its ranks' failures and skip reason: any
    /// failure fails it, else a skip skips it.
    pub fn from_ranks(fails: Vec<String>, skip: Option<String>) -> Outcome {
        if !fails.is_empty() {
            Outcome::Fail(fails.join("\n"))
        } else if let Some(s) = skip {
            Outcome::Skip(s)
        } else {
            Outcome::Pass
        }
    }

    /// `PASS`, `SKIP` or `FAIL`.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Pass => "PASS",
            Outcome::Skip(_) => "SKIP",
            Outcome::Fail(_) => "FAIL",
        }
    }
}

/// The error a body returns to skip (see [`RankCtx::skip`]).
#[derive(Debug)]
pub struct Skipped(pub String);

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "skipped: {}", self.0)
    }
}

impl std::error::Error for Skipped {}

/// Where each rank of a run is, shared by the rank threads of one process
/// and mirrored to `status-rank{R}` files for the orchestrator.
#[derive(Debug, Default)]
pub struct Progress {
    steps: Mutex<Vec<String>>,
}

impl Progress {
    /// A tracker for `world` ranks.
    pub fn new(world: usize) -> Arc<Progress> {
        Arc::new(Progress {
            steps: Mutex::new(vec!["not started".to_string(); world]),
        })
    }

    /// The last step of every rank.
    pub fn snapshot(&self) -> Vec<String> {
        self.steps.lock().clone()
    }

    fn set(&self, rank: usize, step: String) {
        if let Some(s) = self.steps.lock().get_mut(rank) {
            *s = step;
        }
    }
}

/// The suite's fast-path policy unless a scenario names another: the
/// 2-4 MiB window measured on 2 GPUs over NVLink (decision 0004), so a
/// scenario's paths do not depend on the tuner's timing of the machine.
pub const FAST_PATH_WINDOW: metrale_comm::FastPathPolicy = metrale_comm::FastPathPolicy::Range {
    min_bytes: 2 << 20,
    max_bytes: 4 << 20,
};
/// The path tuner's trials on the emulator: one trial of two calls at
/// every size (after its warm-up trial). The default ladder's medians of
/// up to 5 x 16 calls took over the suite's 30 s set-up at four rank
/// processes of a debug emulator on CI's two loaded cores; the emulator's
/// times decide nothing a scenario checks (`tune_choice` injects exact
/// costs), and on GPUs the suite keeps the library's trials.
pub const EMU_TUNE_TRIALS: metrale_comm::timing::Trials = metrale_comm::timing::Trials {
    trials: 1,
    calls: 2,
};
/// The suite's one-shot policy unless a scenario names another.
pub const ONE_SHOT_OFF: metrale_comm::OneShotPolicy = metrale_comm::OneShotPolicy::Never;
/// The one-shot path up to its largest slot (1 MiB), for the scenarios
/// that exercise it by size.
pub const ONE_SHOT_TO_1M: metrale_comm::OneShotPolicy = metrale_comm::OneShotPolicy::Range {
    min_bytes: 0,
    max_bytes: 1 << 20,
};

/// The tuner's cache of the suite's backends: one directory for every
/// scenario run of this machine (`$TMPDIR/metrale-comm-suite-tune`), so
/// each configuration is timed once.
pub fn tune_cache_dir() -> PathBuf {
    std::env::temp_dir().join("metrale-comm-suite-tune")
}

/// Everything a scenario body gets for one rank.
#[derive(Debug)]
pub struct RankCtx {
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// The CUDA device of this rank.
    pub device: usize,
    /// The layout of the run.
    pub mode: Mode,
    /// The scenario's name.
    pub scenario: &'static str,
    run_dir: PathBuf,
    store: FileRendezvous,
    progress: Arc<Progress>,
    emu: Option<&'static EmuControl>,
    counter: AtomicU64,
}

/// How long the suite's own store waits (barriers, key exchange).
pub const STORE_TIMEOUT: Duration = Duration::from_secs(90);

impl RankCtx {
    /// Builds the context of `rank` for a run in `run_dir`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        scenario: &'static str,
        rank: usize,
        world_size: usize,
        device: usize,
        mode: Mode,
        run_dir: &Path,
        progress: Arc<Progress>,
        emu: Option<&'static EmuControl>,
    ) -> anyhow::Result<RankCtx> {
        let store = FileRendezvous::new(rank, world_size, run_dir.join("store"))
            .context("opening the suite's store")?;
        Ok(RankCtx {
            rank,
            world_size,
            device,
            mode,
            scenario,
            run_dir: run_dir.to_path_buf(),
            store,
            progress,
            emu,
            counter: AtomicU64::new(0),
        })
    }

    /// Records where this rank is (shown when a run hangs).
    pub fn step(&self, what: impl Into<String>) {
        let what = what.into();
        let line = format!(
            "rank {}: scenario {} step '{what}'",
            self.rank, self.scenario
        );
        tracing::debug!("{line}");
        let _ = std::fs::write(
            self.run_dir.join(format!("status-rank{}", self.rank)),
            &line,
        );
        self.progress.set(self.rank, what);
    }

    /// All ranks reach `name` before any returns (through the suite's store,
    /// outside NCCL), bounded by [`STORE_TIMEOUT`].
    pub fn barrier(&self, name: &str) -> anyhow::Result<()> {
        self.store
            .barrier(name, STORE_TIMEOUT)
            .with_context(|| format!("suite barrier `{name}`"))
    }

    /// Publishes `value` under `key` for the other ranks.
    pub fn set(&self, key: &str, value: &[u8]) -> anyhow::Result<()> {
        self.store
            .set(key, value)
            .with_context(|| format!("store set `{key}`"))
    }

    /// Waits (bounded) for `key`.
    pub fn get(&self, key: &str) -> anyhow::Result<Vec<u8>> {
        self.store
            .get(key, STORE_TIMEOUT)
            .with_context(|| format!("store get `{key}`"))
    }

    /// A value rank 0 draws and every rank returns (a data seed).
    pub fn shared_seed(&self, key: &str) -> anyhow::Result<u64> {
        let key = format!("seed/{key}");
        if self.rank == 0 {
            let seed: u64 = rand::random();
            self.set(&key, &seed.to_le_bytes())?;
        }
        let b = self.get(&key)?;
        Ok(u64::from_le_bytes(b[..8].try_into().context("seed size")?))
    }

    /// Rank 0 makes an NCCL unique id; every rank returns it.
    pub fn unique_id(&self, key: &str) -> anyhow::Result<nccl_safe::UniqueId> {
        let key = format!("uid/{key}");
        if self.rank == 0 {
            let id = nccl_safe::UniqueId::new().context("ncclGetUniqueId")?;
            self.set(&key, id.as_bytes())?;
        }
        let b = self.get(&key)?;
        nccl_safe::UniqueId::from_bytes(&b).context("unique id from the store")
    }

    /// Checks that every rank computed the same `value` under `key`.
    pub fn all_equal(&self, key: &str, value: u64) -> anyhow::Result<()> {
        self.set(&format!("eq/{key}/{}", self.rank), &value.to_le_bytes())?;
        for r in 0..self.world_size {
            let b = self.get(&format!("eq/{key}/{r}"))?;
            let v = u64::from_le_bytes(b[..8].try_into().context("value size")?);
            anyhow::ensure!(
                v == value,
                "{key}: rank {r} has {v:#x}, rank {} has {value:#x}",
                self.rank
            );
        }
        Ok(())
    }

    /// A fresh rendezvous for one backend; every rank passes the same `name`.
    pub fn rendezvous(&self, name: &str) -> anyhow::Result<Box<dyn Rendezvous>> {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let dir = self.run_dir.join("rdzv").join(format!("{name}-{n}"));
        Ok(Box::new(
            FileRendezvous::new(self.rank, self.world_size, dir).context("rendezvous")?,
        ))
    }

    /// Creates the marker file `name` in the run directory (for the
    /// orchestrator).
    pub fn mark(&self, name: &str) -> anyhow::Result<()> {
        std::fs::write(self.run_dir.join(name), b"1").with_context(|| format!("marker {name}"))
    }

    /// Where flight-recorder dumps of this run go.
    pub fn dump_dir(&self) -> PathBuf {
        self.run_dir.join("dumps")
    }

    /// A backend configuration for this rank: its device, the run's dump
    /// directory, 30 s collective and init deadlines, the paths pinned
    /// ([`ONE_SHOT_OFF`], [`FAST_PATH_WINDOW`]: a scenario states the
    /// paths it checks; the tuned default is the fuzzer's and
    /// `tune_choice`'s), the tuner's cache in the suite's own directory
    /// ([`tune_cache_dir`]), on the emulator the tuner's trials at
    /// [`EMU_TUNE_TRIALS`], and the enqueue mode from
    /// `METRALE_COMM_ENQUEUE` when set (so the whole suite can run on
    /// non-blocking communicators; the default is the library's,
    /// blocking).
    pub fn config(&self) -> metrale_comm::BackendConfig {
        // Pinned: a scenario's settings are what it checks, so only the
        // enqueue mode below comes from the environment.
        let mut c = metrale_comm::BackendConfig::new(self.device)
            .with_collective_timeout(Duration::from_secs(30))
            .with_init_timeout(Duration::from_secs(30))
            .with_dump_dir(self.dump_dir())
            .with_one_shot(ONE_SHOT_OFF)
            .with_fast_path(FAST_PATH_WINDOW)
            .with_tune_cache(metrale_comm::TuneCache::Dir(tune_cache_dir()))
            .without_env_overrides();
        if self.emu.is_some() {
            c = c.with_tune_trials(EMU_TUNE_TRIALS);
        }
        match std::env::var("METRALE_COMM_ENQUEUE") {
            Ok(m) => match metrale_comm::EnqueueMode::parse(&m) {
                Ok(mode) => c.with_enqueue(mode),
                Err(e) => {
                    eprintln!("comm-suite: ignoring METRALE_COMM_ENQUEUE: {e}");
                    c
                }
            },
            Err(_) => c,
        }
    }

    /// Builds an `NcclBackend` with `config` and a fresh rendezvous.
    pub fn backend(
        &self,
        name: &str,
        config: metrale_comm::BackendConfig,
    ) -> anyhow::Result<metrale_comm::NcclBackend> {
        self.step(format!("NcclBackend::new `{name}`"));
        let rdzv = self.rendezvous(name)?;
        metrale_comm::NcclBackend::new(config, rdzv)
            .with_context(|| format!("NcclBackend::new `{name}` on rank {}", self.rank))
    }

    /// This rank's device context.
    pub fn context(&self) -> anyhow::Result<Arc<nccl_safe::Context>> {
        nccl_safe::Context::new(self.device)
            .with_context(|| format!("context of device {}", self.device))
    }

    /// The emulator's control functions, when running on the emulator.
    pub fn emu(&self) -> Option<&'static EmuControl> {
        self.emu
    }

    /// True on real GPUs.
    pub fn on_gpu(&self) -> bool {
        self.emu.is_none()
    }

    /// The error a body returns to skip with `reason`.
    pub fn skip(reason: impl Into<String>) -> anyhow::Error {
        anyhow::Error::new(Skipped(reason.into()))
    }
}

/// Turns the per-rank results into one outcome.
pub fn merge(results: Vec<(usize, anyhow::Result<()>)>) -> Outcome {
    let mut fails = Vec::new();
    let mut skip = None;
    for (rank, r) in results {
        match r {
            Ok(()) => {}
            Err(e) => match e.downcast_ref::<Skipped>() {
                Some(s) => skip = Some(s.0.clone()),
                None => fails.push(format!("rank {rank}: {e:#}")),
            },
        }
    }
    Outcome::from_ranks(fails, skip)
}

static RUN_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh, empty directory for one scenario run.
pub fn fresh_run_dir(scenario: &str) -> anyhow::Result<PathBuf> {
    let n = RUN_COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!(
        "comm-suite-{}-{n}-{nanos:x}-{scenario}",
        std::process::id()
    ));
    std::fs::create_dir_all(dir.join("dumps"))
        .with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// What the flight-recorder dumps in `dir` say, for a hang report.
pub fn analyze_dumps(dir: &Path) -> String {
    let mut dumps = Vec::new();
    let mut paths = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "json") {
                if let Ok(text) = std::fs::read_to_string(&p)
                    && let Ok(d) = serde_json::from_str::<metrale_comm::diagnostics::Dump>(&text)
                {
                    dumps.push(d);
                }
                paths.push(p.display().to_string());
            }
        }
    }
    if paths.is_empty() {
        return format!("no flight-recorder dumps in {}", dir.display());
    }
    format!(
        "flight-recorder dumps: {}\n{}",
        paths.join(", "),
        metrale_comm::diagnostics::analyze(&dumps)
    )
}

/// Runs `scenario` with `world` ranks as threads of this process, each rank
/// on device `rank`, and waits at most `timeout` for all of them. On expiry
/// the outcome is a failure saying where every rank was (the rank threads
/// are left behind: the caller should not reuse the process for work that
/// could collide with them).
pub fn run_threads(
    scenario: &Scenario,
    world: usize,
    timeout: Duration,
    emu: Option<&'static EmuControl>,
) -> Outcome {
    let run_dir = match fresh_run_dir(scenario.name) {
        Ok(d) => d,
        Err(e) => return Outcome::Fail(format!("{e:#}")),
    };
    let out = run_threads_in(scenario, world, timeout, emu, &run_dir);
    if let Outcome::Fail(_) = out {
        eprintln!(
            "comm-suite: {} kept at {}",
            scenario.name,
            run_dir.display()
        );
    }
    if !matches!(out, Outcome::Fail(_)) {
        let _ = std::fs::remove_dir_all(&run_dir);
    }
    out
}

/// [`run_threads`] in a given run directory.
pub fn run_threads_in(
    scenario: &Scenario,
    world: usize,
    timeout: Duration,
    emu: Option<&'static EmuControl>,
    run_dir: &Path,
) -> Outcome {
    if scenario.needs == Needs::Hosts {
        return Outcome::Skip("needs ranks on two hosts: the nodes and nodes-srun modes".into());
    }
    let progress = Progress::new(world);
    let (tx, rx) = std::sync::mpsc::channel();
    for rank in 0..world {
        let ctx = match RankCtx::new(
            scenario.name,
            rank,
            world,
            rank,
            Mode::Threads,
            run_dir,
            progress.clone(),
            emu,
        ) {
            Ok(c) => c,
            Err(e) => return Outcome::Fail(format!("{e:#}")),
        };
        let body = scenario.body;
        let tx = tx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("rank{rank}"))
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&ctx)))
                    .unwrap_or_else(|p| {
                        let msg = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        Err(anyhow::anyhow!("panicked: {msg}"))
                    });
                let _ = tx.send((rank, r));
            });
        if let Err(e) = spawned {
            return Outcome::Fail(format!("spawning rank {rank}: {e}"));
        }
    }
    drop(tx);
    let deadline = Instant::now() + timeout;
    let mut results = Vec::new();
    while results.len() < world {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(r) => results.push(r),
            Err(_) => {
                let done: Vec<usize> = results.iter().map(|(r, _)| *r).collect();
                let mut msg = format!(
                    "{} did not finish within {timeout:?}; where the ranks are:",
                    scenario.name
                );
                for (r, step) in progress.snapshot().into_iter().enumerate() {
                    let state = if done.contains(&r) {
                        "finished"
                    } else {
                        "HUNG"
                    };
                    msg.push_str(&format!("\n  rank {r} ({state}): {step}"));
                }
                for (r, res) in &results {
                    if let Err(e) = res {
                        msg.push_str(&format!("\n  rank {r} error: {e:#}"));
                    }
                }
                msg.push('\n');
                msg.push_str(&analyze_dumps(&run_dir.join("dumps")));
                if let Some(emu) = emu {
                    emu.reset();
                }
                return Outcome::Fail(msg);
            }
        }
    }
    results.sort_by_key(|(r, _)| *r);
    merge(results)
}

/// One row of the results table: the scenario and one cell per column.
pub type Row = (String, Vec<Option<(Outcome, Duration)>>);

/// Formats the results table: scenario x column, `PASS 1.2s`.
pub fn table(columns: &[String], rows: &[Row]) -> String {
    let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(8).max(8);
    let mut s = format!("{:w0$}", "scenario");
    for c in columns {
        s.push_str(&format!(" | {c:>14}"));
    }
    s.push('\n');
    s.push_str(&"-".repeat(w0 + columns.len() * 17));
    s.push('\n');
    for (name, cells) in rows {
        s.push_str(&format!("{name:w0$}"));
        for c in cells {
            let cell = match c {
                Some((o, d)) => format!("{} {:.1}s", o.label(), d.as_secs_f64()),
                None => "-".to_string(),
            };
            s.push_str(&format!(" | {cell:>14}"));
        }
        s.push('\n');
    }
    s
}
