//! The orchestrator behind `comm-suite run`: runs every scenario in every
//! mode as child processes (so a hung run can be killed), prints a line per
//! scenario as it finishes and a table at the end; plus the child entry
//! points (`comm-suite rank`, `comm-suite threads`).
//!
//! In torchrun mode the child is real `torchrun --no-python`, which starts
//! `comm-suite rank` once per GPU (once per emulated GPU, each rank on the
//! emulator, with `--emulator`); scenarios take the static, `--standalone`
//! and c10d rendezvous in turn. Each rank first builds an `NcclBackend`
//! with `from_env` (the launcher's variables, the agent's store) and meets
//! the others through a `TcpRendezvous` on that store, then runs the
//! scenario as in processes mode.
//!
//! Invariants: every child is killed when its run's deadline passes
//! (torchrun with its whole process group); a child reports its outcome in
//! `result-*` files of its run directory and by exit code (0 pass, 77 skip,
//! anything else fail; under torchrun a skip exits 0, so that torchrun does
//! not stop the other ranks, and the files alone decide); the environment
//! is passed through to children untouched except for the torchrun
//! variables, the suite's own variables and, in socket mode,
//! `NCCL_P2P_DISABLE=1` and `NCCL_SHM_DISABLE=1` (never `NCCL_NVLS_ENABLE`).

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use metrale_comm::rendezvous::{Launch, Launcher, Rendezvous as _, TcpRendezvous};
use metrale_comm::{BackendConfig, CommBackend as _, NcclBackend};

use crate::{EmuControl, Mode, Needs, Outcome, Progress, RankCtx, Scenario, analyze_dumps, merge};

/// The exit code of a skipped child.
pub const SKIP_CODE: i32 = 77;
/// Names the run directory in a child's environment.
pub const DIR_ENV: &str = "METRALE_SUITE_DIR";
/// Names, in a rank's environment, the torchrun rendezvous it runs under.
pub const TORCHRUN_ENV: &str = "METRALE_SUITE_TORCHRUN";
/// torchrun's rendezvous, taken in turn by the scenarios of torchrun mode.
pub const TORCHRUN_RDZV: [&str; 3] = ["static", "standalone", "c10d"];
/// Names, in a rank's environment, how the nodes modes launched it
/// (`torchrun` or `srun`).
pub const NODES_ENV: &str = "METRALE_SUITE_NODES";
/// The emulated hosts of the nodes modes.
pub const NODES: usize = 2;

/// Where torchrun is looked for when `TORCHRUN` is not set.
pub const DEFAULT_TORCHRUN: &str = "/opt/torch/.venv/bin/torchrun";

/// torchrun: `TORCHRUN`, else [`DEFAULT_TORCHRUN`], if it is a file.
pub fn find_torchrun() -> Option<PathBuf> {
    let path = std::env::var_os("TORCHRUN")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_TORCHRUN));
    path.is_file().then_some(path)
}

/// Options of `comm-suite run`.
#[derive(Debug, Clone)]
pub struct Opts {
    /// GPUs to use (default: all).
    pub gpus: Option<usize>,
    /// Modes to run.
    pub modes: Vec<Mode>,
    /// Scenario names (default: all).
    pub scenarios: Option<Vec<String>>,
    /// Deadline of one scenario run.
    pub timeout: Duration,
    /// Run on the emulator instead of GPUs.
    pub emulator: bool,
    /// Repetitions of the SIGKILL scenario.
    pub repeat: usize,
    /// torchrun, for torchrun mode (`None`: that mode is skipped).
    pub torchrun: Option<PathBuf>,
}

fn write_result(dir: &Path, name: &str, out: &Outcome) {
    let text = match out {
        Outcome::Pass => "PASS".to_string(),
        Outcome::Skip(r) => format!("SKIP {r}"),
        Outcome::Fail(m) => format!("FAIL {m}"),
    };
    let _ = std::fs::write(dir.join(name), text);
}

fn exit_code(out: &Outcome) -> i32 {
    match out {
        Outcome::Pass => 0,
        Outcome::Skip(_) => SKIP_CODE,
        Outcome::Fail(_) => 1,
    }
}

fn find(name: &str) -> anyhow::Result<Scenario> {
    crate::scenarios()
        .into_iter()
        .find(|s| s.name == name)
        .with_context(|| format!("no scenario `{name}` (comm-suite list)"))
}

fn emu_if(emulator: bool) -> anyhow::Result<Option<&'static EmuControl>> {
    if emulator {
        Ok(Some(EmuControl::install().map_err(anyhow::Error::msg)?))
    } else {
        Ok(None)
    }
}

/// Under torchrun, before the scenario: rank 0's id reaches every rank
/// through the agent's store, the ranks meet at a barrier there, and an
/// `NcclBackend` built by `from_env` passes an NCCL barrier.
fn torchrun_preflight(ctx: &RankCtx, launch: &Launch) -> anyhow::Result<()> {
    ctx.step("torchrun preflight: the agent's store");
    anyhow::ensure!(
        launch.launcher == Launcher::Torchrun,
        "torchrun mode, but the launcher found is {}",
        launch.launcher.name()
    );
    let rv = TcpRendezvous::from_launch(launch, crate::STORE_TIMEOUT)
        .context("a rendezvous on torchrun's store")?;
    // A generation no backend reaches, so that from_env's generation 0
    // stays fresh in the same namespace.
    let mut made = || Ok(rand::random::<[u8; 128]>());
    let id = rv
        .exchange_id(1 << 40, &mut made, crate::STORE_TIMEOUT)
        .context("an id through torchrun's store")?;
    ctx.all_equal(
        "torchrun-preflight-id",
        u64::from_le_bytes(id[..8].try_into().context("id")?),
    )?;
    rv.barrier("torchrun-preflight", crate::STORE_TIMEOUT)
        .context("a barrier on torchrun's store")?;
    ctx.step("torchrun preflight: NcclBackend::from_env");
    let backend = NcclBackend::from_env(BackendConfig::new).context("NcclBackend::from_env")?;
    anyhow::ensure!(
        backend.config().device == launch.device,
        "from_env chose device {}, the launcher {}",
        backend.config().device,
        launch.device
    );
    backend.barrier().context("an NCCL barrier")?;
    backend.shutdown().context("shutdown")?;
    rv.barrier("torchrun-preflight-done", crate::STORE_TIMEOUT)?;
    Ok(())
}

/// `comm-suite rank --scenario NAME`: one rank of process mode (torchrun's
/// variables), or of torchrun mode (whatever torchrun sets).
pub fn rank_main(name: &str, emulator: bool) -> anyhow::Result<i32> {
    let emu = emu_if(emulator)?;
    let sc = find(name)?;
    let var = |k: &str| -> anyhow::Result<usize> {
        std::env::var(k)
            .with_context(|| format!("{k} is not set"))?
            .parse()
            .with_context(|| format!("{k} is not a number"))
    };
    let under_torchrun = std::env::var_os(TORCHRUN_ENV).is_some();
    let nodes = std::env::var(NODES_ENV).ok();
    let launch = if under_torchrun {
        Some(Launch::from_env().context("reading torchrun's variables")?)
    } else {
        None
    };
    let (rank, world, local) = match (&launch, nodes.as_deref()) {
        (Some(l), _) => (l.rank, l.world_size, l.device),
        (None, Some(_)) => {
            let l = Launch::from_env().context("reading the launcher's variables")?;
            (l.rank, l.world_size, l.device)
        }
        (None, None) => (var("RANK")?, var("WORLD_SIZE")?, var("LOCAL_RANK")?),
    };
    let dir =
        PathBuf::from(std::env::var(DIR_ENV).with_context(|| format!("{DIR_ENV} is not set"))?);
    let mode = if under_torchrun {
        Mode::Torchrun
    } else if nodes.as_deref() == Some("srun") {
        Mode::NodesSrun
    } else if nodes.is_some() {
        Mode::Nodes
    } else if std::env::var("NCCL_P2P_DISABLE").as_deref() == Ok("1") {
        Mode::Socket
    } else {
        Mode::Processes
    };
    let ctx = RankCtx::new(
        sc.name,
        rank,
        world,
        local,
        mode,
        &dir,
        Progress::new(world),
        emu,
    )?;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if let Some(l) = &launch {
            torchrun_preflight(&ctx, l).context("torchrun preflight")?;
        }
        (sc.body)(&ctx)
    }))
    .unwrap_or_else(|_| Err(anyhow::anyhow!("panicked")));
    let out = merge(vec![(rank, r)]);
    if let Outcome::Fail(m) = &out {
        eprintln!("{m}");
    }
    write_result(&dir, &format!("result-rank{rank}"), &out);
    Ok(match out {
        Outcome::Skip(_) if under_torchrun => 0,
        _ => exit_code(&out),
    })
}

/// `comm-suite threads --world N --scenario NAME`: all ranks as threads of
/// this process.
pub fn threads_main(
    name: &str,
    world: usize,
    timeout: Duration,
    emulator: bool,
) -> anyhow::Result<i32> {
    let emu = emu_if(emulator)?;
    let sc = find(name)?;
    let dir =
        PathBuf::from(std::env::var(DIR_ENV).with_context(|| format!("{DIR_ENV} is not set"))?);
    let out = crate::run_threads_in(&sc, world, timeout, emu, &dir);
    if let Outcome::Fail(m) = &out {
        eprintln!("{m}");
    }
    write_result(&dir, "result-threads", &out);
    Ok(exit_code(&out))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(29_500)
}

pub(crate) fn spawn_ranks(
    sc: &Scenario,
    world: usize,
    mode: Mode,
    dir: &Path,
    emulator: bool,
    env: &[(&str, String)],
) -> anyhow::Result<Vec<Child>> {
    let exe = std::env::current_exe()?;
    let port = free_port();
    let mut kids = Vec::new();
    for rank in 0..world {
        let mut cmd = Command::new(&exe);
        cmd.args(["rank", "--scenario", sc.name]);
        if emulator {
            cmd.arg("--emulator");
        }
        if mode.multi_host() {
            node_env(&mut cmd, mode, rank, world, emulator);
        } else {
            cmd.env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string());
        }
        cmd.env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env(DIR_ENV, dir)
            .env("METRALE_COMM_DUMP_DIR", dir.join("dumps"))
            .envs(env.iter().map(|(k, v)| (k, v)));
        if mode == Mode::NodesSrun {
            // Under srun the store's host comes from the step's node list.
            cmd.env_remove("MASTER_ADDR");
        }
        if mode == Mode::Socket {
            cmd.env("NCCL_P2P_DISABLE", "1")
                .env("NCCL_SHM_DISABLE", "1");
        }
        kids.push(
            cmd.spawn()
                .with_context(|| format!("spawning rank {rank}"))?,
        );
    }
    Ok(kids)
}

/// The environment of `rank` of `world` in a nodes mode: [`NODES`] hosts
/// of `world / NODES` ranks, rank `r` on host `r / per` as local rank
/// `r % per`, each host named by `NCCL_HOSTID`, with the variables
/// torchrun (`Mode::Nodes`, a static rendezvous, rank 0 serving the store)
/// or srun (`Mode::NodesSrun`) sets on a node of a multi-node job. On GPUs
/// the ranks of both emulated hosts share the box's devices:
/// `METRALE_COMM_DEVICE` spreads them, one rank a GPU.
fn node_env(cmd: &mut Command, mode: Mode, rank: usize, world: usize, emulator: bool) {
    let per = world / NODES;
    let (node, local) = (rank / per, rank % per);
    cmd.env("NCCL_HOSTID", format!("comm-suite-node-{node}"))
        .env(
            NODES_ENV,
            if mode == Mode::NodesSrun {
                "srun"
            } else {
                "torchrun"
            },
        );
    if !emulator {
        cmd.env(metrale_comm::rendezvous::DEVICE_ENV, rank.to_string());
    }
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", TORCHRUN_ENV] {
        cmd.env_remove(k);
    }
    if mode == Mode::NodesSrun {
        let nodelist = "localhost";
        cmd.env("SLURM_PROCID", rank.to_string())
            .env("SLURM_NTASKS", world.to_string())
            .env("SLURM_LOCALID", local.to_string())
            .env("SLURM_NODEID", node.to_string())
            .env("SLURM_NNODES", NODES.to_string())
            .env("SLURM_NTASKS_PER_NODE", per.to_string())
            .env("SLURM_JOB_ID", "4242")
            .env("SLURM_STEP_ID", "0")
            .env("SLURM_JOB_NODELIST", nodelist)
            .env("SLURM_STEP_NODELIST", nodelist);
    } else {
        cmd.env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", per.to_string())
            .env("GROUP_RANK", node.to_string())
            .env("GROUP_WORLD_SIZE", NODES.to_string())
            .env("ROLE_RANK", rank.to_string())
            .env("ROLE_WORLD_SIZE", world.to_string())
            .env("TORCHELASTIC_RUN_ID", "comm-suite-nodes")
            .env("TORCHELASTIC_RESTART_COUNT", "0")
            .env("TORCHELASTIC_USE_AGENT_STORE", "False");
    }
}

/// torchrun in its own process group, running `comm-suite rank` on
/// `world` GPUs (emulated ones with `emulator`) with the rendezvous `rdzv`.
fn spawn_torchrun(
    sc: &Scenario,
    world: usize,
    dir: &Path,
    torchrun: &Path,
    rdzv: &str,
    emulator: bool,
) -> anyhow::Result<Child> {
    let port = free_port();
    let mut cmd = Command::new(torchrun);
    cmd.arg("--no-python")
        .arg(format!("--nproc-per-node={world}"));
    match rdzv {
        "static" => cmd.args([
            "--nnodes=1".to_owned(),
            "--rdzv-backend=static".to_owned(),
            "--master-addr=127.0.0.1".to_owned(),
            format!("--master-port={port}"),
        ]),
        "standalone" => cmd.arg("--standalone"),
        _ => cmd.args([
            "--nnodes=1".to_owned(),
            "--rdzv-backend=c10d".to_owned(),
            format!("--rdzv-endpoint=127.0.0.1:{port}"),
            format!("--rdzv-id=comm-suite-{}", sc.name),
        ]),
    };
    cmd.arg(std::env::current_exe()?)
        .args(["rank", "--scenario", sc.name]);
    if emulator {
        cmd.arg("--emulator");
    }
    cmd.env(DIR_ENV, dir)
        .env("METRALE_COMM_DUMP_DIR", dir.join("dumps"))
        .env(TORCHRUN_ENV, rdzv)
        .process_group(0);
    cmd.spawn()
        .with_context(|| format!("spawning {}", torchrun.display()))
}

/// Kills torchrun and every rank it started (its process group).
fn kill_group(kid: &mut Child) {
    if let Ok(pid) = libc::pid_t::try_from(kid.id()) {
        // SAFETY: kill takes a pid and a signal number; `-pid` names the
        // process group our child leads (spawned with process_group(0)),
        // and the child is not yet waited for, so its pid is not reused.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
    }
    let _ = kid.wait();
}

/// torchrun's outcome from the ranks' result files and its exit code.
fn collect_torchrun(dir: &Path, world: usize, code: i32) -> Outcome {
    let mut fails = Vec::new();
    let mut skip = None;
    for r in 0..world {
        match std::fs::read_to_string(dir.join(format!("result-rank{r}"))) {
            Ok(t) if t == "PASS" => {}
            Ok(t) if t.starts_with("SKIP ") => skip = Some(t["SKIP ".len()..].to_string()),
            Ok(t) => fails.push(t.trim_start_matches("FAIL ").to_string()),
            Err(_) => fails.push(format!(
                "rank {r} wrote no result (torchrun exited {code}; it stops every rank once one fails)"
            )),
        }
    }
    if fails.is_empty() && code != 0 {
        fails.push(format!("torchrun exited {code}"));
    }
    Outcome::from_ranks(fails, skip)
}

pub(crate) fn kill_all(kids: &mut [Child]) {
    for k in kids.iter_mut() {
        let _ = k.kill();
        let _ = k.wait();
    }
}

/// Waits for every child until `deadline`; `None` when it passed.
pub(crate) fn wait_all(kids: &mut [Child], deadline: Instant) -> Option<Vec<i32>> {
    let mut codes = vec![None; kids.len()];
    loop {
        for (i, k) in kids.iter_mut().enumerate() {
            if codes[i].is_none()
                && let Ok(Some(st)) = k.try_wait()
            {
                // A child a signal ended reads as minus the signal's number.
                codes[i] = Some(st.code().unwrap_or_else(|| {
                    -std::os::unix::process::ExitStatusExt::signal(&st).unwrap_or(1)
                }));
            }
        }
        if codes.iter().all(Option::is_some) {
            return Some(codes.into_iter().map(|c| c.unwrap_or(-1)).collect());
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(crate) fn hang_report(sc: &Scenario, dir: &Path, world: usize, timeout: Duration) -> String {
    let mut msg = format!(
        "{} did not finish within {timeout:?}; killed every rank. Where they were:",
        sc.name
    );
    for r in 0..world {
        let st = std::fs::read_to_string(dir.join(format!("status-rank{r}")))
            .unwrap_or_else(|_| format!("rank {r}: no status"));
        msg.push_str(&format!("\n  {st}"));
    }
    msg.push('\n');
    msg.push_str(&analyze_dumps(&dir.join("dumps")));
    msg
}

pub(crate) fn collect(dir: &Path, files: &[String], codes: &[i32]) -> Outcome {
    let mut fails = Vec::new();
    let mut skip = None;
    for (f, code) in files.iter().zip(codes) {
        let text = std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        match *code {
            0 => {}
            SKIP_CODE => skip = Some(text.trim_start_matches("SKIP ").to_string()),
            c => fails.push(format!(
                "{f} (exit {c}): {}",
                text.trim_start_matches("FAIL ")
            )),
        }
    }
    Outcome::from_ranks(fails, skip)
}

/// Runs one scenario in one mode as child processes, with the deadline;
/// `rdzv` is torchrun's rendezvous in torchrun mode.
pub fn run_one(
    sc: &Scenario,
    world: usize,
    mode: Mode,
    opts: &Opts,
    rdzv: &str,
) -> anyhow::Result<Outcome> {
    let dir = crate::fresh_run_dir(sc.name)?;
    let deadline = Instant::now() + opts.timeout;
    if mode == Mode::Torchrun {
        let torchrun = opts
            .torchrun
            .as_deref()
            .context("torchrun mode without torchrun")?;
        let mut kid = spawn_torchrun(sc, world, &dir, torchrun, rdzv, opts.emulator)?;
        let out = match wait_all(std::slice::from_mut(&mut kid), deadline) {
            Some(codes) => collect_torchrun(&dir, world, codes[0]),
            None => {
                kill_group(&mut kid);
                Outcome::Fail(hang_report(sc, &dir, world, opts.timeout))
            }
        };
        if matches!(out, Outcome::Fail(_)) {
            eprintln!("comm-suite: run directory kept: {}", dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&dir);
        }
        return Ok(out);
    }
    let (mut kids, files) = if mode == Mode::Threads {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args([
            "threads",
            "--world",
            &world.to_string(),
            "--scenario",
            sc.name,
        ])
        .args(["--timeout", &opts.timeout.as_secs().to_string()])
        .env(DIR_ENV, &dir);
        if opts.emulator {
            cmd.arg("--emulator");
        }
        (
            vec![cmd.spawn().context("spawning the threads child")?],
            vec!["result-threads".to_string()],
        )
    } else {
        (
            spawn_ranks(sc, world, mode, &dir, opts.emulator, &[])?,
            (0..world).map(|r| format!("result-rank{r}")).collect(),
        )
    };
    // The threads child enforces the deadline itself and reports where the
    // ranks were; the orchestrator kills it a little later if it cannot.
    let grace = if mode == Mode::Threads {
        Duration::from_secs(10)
    } else {
        Duration::ZERO
    };
    let out = match wait_all(&mut kids, deadline + grace) {
        Some(codes) => collect(&dir, &files, &codes),
        None => {
            kill_all(&mut kids);
            Outcome::Fail(hang_report(sc, &dir, world, opts.timeout))
        }
    };
    if matches!(out, Outcome::Fail(_)) {
        eprintln!("comm-suite: run directory kept: {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(out)
}

/// The SIGKILL scenario: two rank processes all-reduce in a loop; rank 1 is
/// killed; rank 0 must exit cleanly within its timeout + 1 s (+ shutdown).
pub fn run_sigkill(sc: &Scenario, mode: Mode, opts: &Opts) -> anyhow::Result<Outcome> {
    let dir = crate::fresh_run_dir(sc.name)?;
    let mut kids = spawn_ranks(sc, 2, mode, &dir, opts.emulator, &[])?;
    let deadline = Instant::now() + opts.timeout;
    while !dir.join("ready-rank1").exists() {
        if Instant::now() >= deadline
            || kids.iter_mut().any(|k| matches!(k.try_wait(), Ok(Some(_))))
        {
            kill_all(&mut kids);
            return Ok(Outcome::Fail(format!(
                "ranks did not reach the all_reduce loop\n{}",
                hang_report(sc, &dir, 2, opts.timeout)
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let pid = kids[1].id() as libc::pid_t;
    // SAFETY: kill takes a pid and a signal number; the pid is our own
    // child, not yet waited for, so it cannot have been reused.
    let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
    let killed = Instant::now();
    anyhow::ensure!(rc == 0, "kill({pid}, SIGKILL) failed");
    let _ = kids[1].wait();
    // The survivor: its collective timeout (2 s) + 1 s, plus shutdown.
    let limit = Duration::from_secs(3) + Duration::from_secs(10);
    let mut survivor = vec![kids.remove(0)];
    let out = match wait_all(&mut survivor, killed + limit) {
        None => {
            kill_all(&mut survivor);
            Outcome::Fail(format!(
                "the survivor did not exit within {limit:?} of the kill\n{}",
                hang_report(sc, &dir, 2, limit)
            ))
        }
        Some(codes) => {
            let took = killed.elapsed();
            match collect(&dir, &["result-rank0".to_string()], &codes) {
                Outcome::Pass => Outcome::Pass,
                other => Outcome::Fail(format!("survivor after {took:?}: {other:?}")),
            }
        }
    };
    if !matches!(out, Outcome::Fail(_)) {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(out)
}

/// `comm-suite run`: every selected scenario in every selected mode, a line
/// per result, the table; returns the exit code (1 on any failure).
pub fn run(opts: &Opts) -> anyhow::Result<i32> {
    let emu = emu_if(opts.emulator)?;
    let gpus = match opts.gpus {
        Some(n) => n,
        None if emu.is_some() => 2,
        None => nccl_safe::device_count().context("counting GPUs through the CUDA driver")?,
    };
    let mut modes = opts.modes.clone();
    if modes.contains(&Mode::Torchrun) && opts.torchrun.is_none() {
        println!(
            "comm-suite: torchrun mode skipped: no torchrun (set TORCHRUN, or install {DEFAULT_TORCHRUN})"
        );
        modes.retain(|m| *m != Mode::Torchrun);
    }
    let all = crate::scenarios();
    let selected: Vec<&Scenario> = match &opts.scenarios {
        None => all.iter().collect(),
        Some(names) => {
            for n in names {
                find(n)?;
            }
            all.iter()
                .filter(|s| names.iter().any(|n| n == s.name))
                .collect()
        }
    };
    println!(
        "comm-suite: {} scenario(s), modes {:?}, {gpus} {}",
        selected.len(),
        modes.iter().map(|m| m.name()).collect::<Vec<_>>(),
        if emu.is_some() {
            "emulated GPUs"
        } else {
            "GPU(s)"
        }
    );
    let mut rows: Vec<crate::Row> = selected
        .iter()
        .map(|s| (s.name.to_string(), vec![None; modes.len()]))
        .collect();
    let mut failed = 0;
    for (mi, &mode) in modes.iter().enumerate() {
        for (si, sc) in selected.iter().enumerate() {
            let rdzv = TORCHRUN_RDZV[si % TORCHRUN_RDZV.len()];
            let t = Instant::now();
            let out = run_cell(sc, mode, gpus, opts, rdzv)?;
            let took = t.elapsed();
            println!(
                "[{:>9}] {:<28} {} {:.1}s{}",
                mode.name(),
                sc.name,
                out.label(),
                took.as_secs_f64(),
                if mode == Mode::Torchrun {
                    format!(" (torchrun {rdzv} rendezvous)")
                } else {
                    String::new()
                }
            );
            match &out {
                Outcome::Fail(m) => {
                    failed += 1;
                    for line in m.lines() {
                        println!("    {line}");
                    }
                }
                Outcome::Skip(r) => println!("    skipped: {r}"),
                Outcome::Pass => {}
            }
            rows[si].1[mi] = Some((out, took));
        }
    }
    let cols: Vec<String> = modes.iter().map(|m| m.name().to_string()).collect();
    println!("\n{}", crate::table(&cols, &rows));
    println!("comm-suite: {failed} failure(s)");
    Ok(if failed == 0 { 0 } else { 1 })
}

fn run_cell(
    sc: &Scenario,
    mode: Mode,
    gpus: usize,
    opts: &Opts,
    rdzv: &str,
) -> anyhow::Result<Outcome> {
    if opts.emulator && mode == Mode::Socket {
        return Ok(Outcome::Skip(
            "the emulator has no transports to turn off: socket mode is its processes mode".into(),
        ));
    }
    if sc.needs == Needs::Hosts {
        if !mode.multi_host() {
            return Ok(Outcome::Skip(
                "needs ranks on two hosts: the nodes and nodes-srun modes".into(),
            ));
        }
        let world = match sc.world_for(gpus) {
            Ok(w) if opts.emulator || w <= gpus => w - w % NODES,
            Ok(_) | Err(_) => 0,
        };
        if world < NODES {
            return Ok(Outcome::Skip(format!(
                "needs {NODES} GPUs, {gpus} available"
            )));
        }
        return run_one(sc, world, mode, opts, rdzv);
    }
    if mode.multi_host() {
        return Ok(Outcome::Skip(
            "runs on one host (the nodes modes run the multi-host scenarios)".into(),
        ));
    }
    if sc.needs == Needs::EmulatorFaults && !opts.emulator {
        return Ok(Outcome::Skip("needs the emulator's fault injection".into()));
    }
    if sc.needs == Needs::Processes {
        if mode == Mode::Threads {
            return Ok(Outcome::Skip("needs one process per rank".into()));
        }
        if mode == Mode::Torchrun {
            return Ok(Outcome::Skip(
                "kills a rank it started itself; torchrun owns the ranks here".into(),
            ));
        }
        if gpus < 2 {
            return Ok(Outcome::Skip(format!("needs 2 GPUs, {gpus} available")));
        }
        if sc.name == crate::scenarios::DEAD_PEER {
            return match sc.world_for(gpus) {
                Ok(world) => crate::dead_peer::run_all(sc, mode, world, opts),
                Err(why) => Ok(Outcome::Skip(why)),
            };
        }
        for i in 0..opts.repeat.max(1) {
            let out = run_sigkill(sc, mode, opts)?;
            if let Outcome::Fail(m) = out {
                return Ok(Outcome::Fail(format!("repetition {i}: {m}")));
            }
        }
        return Ok(Outcome::Pass);
    }
    if sc.needs == Needs::SharedDevice {
        if mode == Mode::Threads {
            return Ok(Outcome::Skip(
                "needs one process per rank (the driver opens no IPC handle in the process that made it)"
                    .into(),
            ));
        }
        if mode == Mode::Torchrun {
            return Ok(Outcome::Skip(
                "torchrun's preflight builds an NCCL backend, which needs a GPU per rank".into(),
            ));
        }
        if gpus == 0 {
            return Ok(Outcome::Skip("needs a GPU".into()));
        }
        return run_one(sc, sc.min_ranks, mode, opts, rdzv);
    }
    let world = match sc.world_for(gpus) {
        Ok(w) => w,
        Err(why) => return Ok(Outcome::Skip(why)),
    };
    run_one(sc, world, mode, opts, rdzv)
}
