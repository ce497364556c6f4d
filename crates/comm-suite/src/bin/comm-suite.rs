//! `comm-suite`: the suite's one binary. `list` prints the scenarios; `run`
//! is the orchestrator (what `cargo xtask gpu-test` and the bundle's run.sh
//! call); `rank` and `threads` are the child entry points it spawns;
//! `tune` prints the path tuner's table on this machine.
//!
//! Invariant: exits 0 only when nothing failed; 2 on usage errors.

use std::time::Duration;

use comm_suite::Mode;
use comm_suite::orchestrator::{self, Opts};

const USAGE: &str = "\
usage: comm-suite list
       comm-suite run [--gpus N] [--modes threads,processes,socket,torchrun,nodes,nodes-srun] [--scenarios a,b]
                      [--timeout SECS] [--repeat N] [--emulator] [--torchrun PATH]
           (torchrun mode: --torchrun, else TORCHRUN, else /opt/torch/.venv/bin/torchrun)
       comm-suite rank --scenario NAME [--emulator]         (one rank; torchrun env)
       comm-suite threads --world N --scenario NAME [--timeout SECS] [--emulator]
       comm-suite tune [--gpus N] [--emulator]     (the path tuner's table and its set-up cost)
";

fn main() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match real_main(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("comm-suite: {e:#}");
            2
        }
    };
    std::process::exit(code);
}

fn real_main(args: &[String]) -> anyhow::Result<i32> {
    let Some((cmd, rest)) = args.split_first() else {
        eprint!("{USAGE}");
        return Ok(2);
    };
    let mut opts = Opts {
        gpus: None,
        modes: vec![Mode::Threads, Mode::Processes, Mode::Socket],
        scenarios: None,
        timeout: Duration::from_secs(120),
        emulator: false,
        repeat: 3,
        torchrun: orchestrator::find_torchrun(),
    };
    let mut scenario = None;
    let mut world = 2usize;
    let mut it = rest.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .ok_or_else(|| anyhow::anyhow!("{a} needs a value"))
        };
        match a.as_str() {
            "--gpus" => opts.gpus = Some(val()?.parse()?),
            "--modes" => {
                opts.modes = val()?
                    .split(',')
                    .map(Mode::parse)
                    .collect::<anyhow::Result<_>>()?
            }
            "--scenarios" => {
                opts.scenarios = Some(val()?.split(',').map(|s| s.trim().to_string()).collect())
            }
            "--timeout" => opts.timeout = Duration::from_secs(val()?.parse()?),
            "--repeat" => opts.repeat = val()?.parse()?,
            "--torchrun" => {
                let path = std::path::PathBuf::from(val()?);
                opts.torchrun = path.is_file().then_some(path);
            }
            "--scenario" => scenario = Some(val()?.clone()),
            "--world" => world = val()?.parse()?,
            "--emulator" => opts.emulator = true,
            "--help" | "-h" => {
                print!("{USAGE}");
                return Ok(0);
            }
            other => anyhow::bail!("unknown option `{other}`\n{USAGE}"),
        }
    }
    match cmd.as_str() {
        "list" => {
            for s in comm_suite::scenarios() {
                let ranks = match s.max_ranks {
                    Some(m) if m == s.min_ranks => format!("{m}"),
                    Some(m) => format!("{}-{m}", s.min_ranks),
                    None => format!("{}+", s.min_ranks),
                };
                println!(
                    "{:<28} ranks {:<4} {:?}  {}",
                    s.name, ranks, s.needs, s.about
                );
            }
            Ok(0)
        }
        "run" => orchestrator::run(&opts),
        "tune" => comm_suite::tune_report::run(opts.gpus, opts.emulator),
        "rank" => orchestrator::rank_main(
            &scenario.ok_or_else(|| anyhow::anyhow!("rank needs --scenario"))?,
            opts.emulator,
        ),
        "threads" => orchestrator::threads_main(
            &scenario.ok_or_else(|| anyhow::anyhow!("threads needs --scenario"))?,
            world,
            opts.timeout,
            opts.emulator,
        ),
        other => anyhow::bail!("unknown command `{other}`\n{USAGE}"),
    }
}
