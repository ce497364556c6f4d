//! The orchestrator behind `comm-suite run`: runs every scenario in every
//! mode as child processes (so a hung run can be killed), prints a line per
//! scenario as it finishes and a table at the end; plus the child entry
//! points (`comm-suite rank`, `comm-suite threads`).
//!
//! Invariants: every child is killed when its run's deadline passes; a
//! child reports its outcome in `result-*` files of its run directory and by
//! exit code (0 pass, 77 skip, anything else fail); the environment is
//! passed through to children untouched except for the torchrun variables,
//! the suite's own variables and, in socket mode, `NCCL_P2P_DISABLE=1` and
//! `NCCL_SHM_DISABLE=1` (never `NCCL_NVLS_ENABLE`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::Context as _;

use crate::{EmuControl, Mode, Needs, Outcome, Progress, RankCtx, Scenario, analyze_dumps, merge};

/// The exit code of a skipped child.
pub const SKIP_CODE: i32 = 77;
/// Names the run directory in a child's environment.
pub const DIR_ENV: &str = "METRALE_SUITE_DIR";

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

/// `comm-suite rank --scenario NAME`: one rank of process mode, from
/// torchrun's variables.
pub fn rank_main(name: &str, emulator: bool) -> anyhow::Result<i32> {
    let emu = emu_if(emulator)?;
    let sc = find(name)?;
    let var = |k: &str| -> anyhow::Result<usize> {
        std::env::var(k)
            .with_context(|| format!("{k} is not set"))?
            .parse()
            .with_context(|| format!("{k} is not a number"))
    };
    let (rank, world, local) = (var("RANK")?, var("WORLD_SIZE")?, var("LOCAL_RANK")?);
    let dir =
        PathBuf::from(std::env::var(DIR_ENV).with_context(|| format!("{DIR_ENV} is not set"))?);
    let mode = if std::env::var("NCCL_P2P_DISABLE").as_deref() == Ok("1") {
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
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (sc.body)(&ctx)))
        .unwrap_or_else(|_| Err(anyhow::anyhow!("panicked")));
    let out = merge(vec![(rank, r)]);
    if let Outcome::Fail(m) = &out {
        eprintln!("{m}");
    }
    write_result(&dir, &format!("result-rank{rank}"), &out);
    Ok(exit_code(&out))
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

fn spawn_ranks(
    sc: &Scenario,
    world: usize,
    mode: Mode,
    dir: &Path,
    emulator: bool,
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
        cmd.env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env(DIR_ENV, dir)
            .env("METRALE_COMM_DUMP_DIR", dir.join("dumps"));
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

fn kill_all(kids: &mut [Child]) {
    for k in kids.iter_mut() {
        let _ = k.kill();
        let _ = k.wait();
    }
}

/// Waits for every child until `deadline`; `None` when it passed.
fn wait_all(kids: &mut [Child], deadline: Instant) -> Option<Vec<i32>> {
    let mut codes = vec![None; kids.len()];
    loop {
        for (i, k) in kids.iter_mut().enumerate() {
            if codes[i].is_none()
                && let Ok(Some(st)) = k.try_wait()
            {
                codes[i] = Some(st.code().unwrap_or(-1));
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

fn hang_report(sc: &Scenario, dir: &Path, world: usize, timeout: Duration) -> String {
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

fn collect(dir: &Path, files: &[String], codes: &[i32]) -> Outcome {
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

/// Runs one scenario in one mode as child processes, with the deadline.
pub fn run_one(sc: &Scenario, world: usize, mode: Mode, opts: &Opts) -> anyhow::Result<Outcome> {
    let dir = crate::fresh_run_dir(sc.name)?;
    let deadline = Instant::now() + opts.timeout;
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
            spawn_ranks(sc, world, mode, &dir, opts.emulator)?,
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
    let mut kids = spawn_ranks(sc, 2, mode, &dir, opts.emulator)?;
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
        opts.modes.iter().map(|m| m.name()).collect::<Vec<_>>(),
        if emu.is_some() {
            "emulated GPUs"
        } else {
            "GPU(s)"
        }
    );
    let mut rows: Vec<crate::Row> = selected
        .iter()
        .map(|s| (s.name.to_string(), vec![None; opts.modes.len()]))
        .collect();
    let mut failed = 0;
    for (mi, &mode) in opts.modes.iter().enumerate() {
        for (si, sc) in selected.iter().enumerate() {
            let t = Instant::now();
            let out = run_cell(sc, mode, gpus, opts)?;
            let took = t.elapsed();
            println!(
                "[{:>9}] {:<28} {} {:.1}s",
                mode.name(),
                sc.name,
                out.label(),
                took.as_secs_f64()
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
    let cols: Vec<String> = opts.modes.iter().map(|m| m.name().to_string()).collect();
    println!("\n{}", crate::table(&cols, &rows));
    println!("comm-suite: {failed} failure(s)");
    Ok(if failed == 0 { 0 } else { 1 })
}

fn run_cell(sc: &Scenario, mode: Mode, gpus: usize, opts: &Opts) -> anyhow::Result<Outcome> {
    if opts.emulator && mode == Mode::Socket {
        return Ok(Outcome::Skip(
            "the emulator has no transports to turn off: socket mode is its processes mode".into(),
        ));
    }
    if sc.needs == Needs::EmulatorFaults && !opts.emulator {
        return Ok(Outcome::Skip("needs the emulator's fault injection".into()));
    }
    if sc.needs == Needs::Processes {
        if mode == Mode::Threads {
            return Ok(Outcome::Skip("needs one process per rank".into()));
        }
        if gpus < 2 {
            return Ok(Outcome::Skip(format!("needs 2 GPUs, {gpus} available")));
        }
        for i in 0..opts.repeat.max(1) {
            let out = run_sigkill(sc, mode, opts)?;
            if let Outcome::Fail(m) = out {
                return Ok(Outcome::Fail(format!("repetition {i}: {m}")));
            }
        }
        return Ok(Outcome::Pass);
    }
    let world = match sc.world_for(gpus) {
        Ok(w) => w,
        Err(why) => return Ok(Outcome::Skip(why)),
    };
    run_one(sc, world, mode, opts)
}
