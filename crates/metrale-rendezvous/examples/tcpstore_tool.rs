//! A command-line face of the crate's c10d TCPStore server and client, for
//! checking them against PyTorch's (`tests/fixtures/capture_tcpstore.py
//! interop`, metrale-comm's `tests/fixtures/gpu_box.sh`).
//!
//! ```text
//! tcpstore_tool serve [--bind ADDR] [--port P] [--token T] [--seconds N] [--world N]
//!     prints "listening PORT", then serves until stdin closes or N seconds pass,
//!     with the limits rank 0 would serve a world of N ranks with (default 1)
//!     and the METRALE_STORE_* variables
//! tcpstore_tool client HOST:PORT [--token T] [--timeout SECS] OP...
//!     OP: set KEY VALUE | get KEY | add KEY N | check K1,K2 | wait K1,K2
//!         | cas KEY EXPECTED DESIRED | multi_get K1,K2 | multi_set K1=V1,K2=V2
//!         | append KEY VALUE | delete KEY | num_keys | ping
//!     prints one line per OP (values as UTF-8, lists joined by ",")
//! ```
//!
//! Build: `cargo build --release -p metrale-rendezvous --example tcpstore_tool`.
//! Exits 0 on success, 1 on a store error, 2 on bad usage.

use std::io::{BufRead, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::Context;
use metrale_rendezvous::{StoreClient, StoreLimits, StoreServer};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match run(&args) {
        Ok(()) => 0,
        Err(e) if e.downcast_ref::<Usage>().is_some() => {
            eprintln!("tcpstore_tool: {e}");
            2
        }
        Err(e) => {
            eprintln!("tcpstore_tool: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

#[derive(Debug)]
struct Usage(String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (see the file's docs for the usage)", self.0)
    }
}

impl std::error::Error for Usage {}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Usage(msg.into()))
}

fn run(args: &[String]) -> anyhow::Result<()> {
    match args.split_first() {
        Some((cmd, rest)) if cmd == "serve" => serve(rest),
        Some((cmd, rest)) if cmd == "client" => client(rest),
        _ => Err(usage("expected `serve` or `client`")),
    }
}

fn serve(args: &[String]) -> anyhow::Result<()> {
    let (mut bind, mut port, mut token, mut seconds) = ("0.0.0.0".to_owned(), 0u16, None, None);
    let mut world = 1usize;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| usage(format!("{a} needs a value")));
        match a.as_str() {
            "--bind" => bind = val()?.clone(),
            "--port" => port = val()?.parse().context("--port")?,
            "--token" => token = Some(val()?.clone()),
            "--seconds" => seconds = Some(val()?.parse::<u64>().context("--seconds")?),
            "--world" => world = val()?.parse().context("--world")?,
            other => return Err(usage(format!("unknown option {other}"))),
        }
    }
    let addr: SocketAddr = format!("{bind}:{port}").parse().context("--bind/--port")?;
    let server = StoreServer::bind_with(addr, token, StoreLimits::from_env(world)?)?;
    println!("listening {}", server.local_addr().port());
    std::io::stdout().flush()?;
    let until = seconds.map(|s| Instant::now() + Duration::from_secs(s));
    match until {
        Some(t) => std::thread::sleep(t.saturating_duration_since(Instant::now())),
        None => {
            // Serve until whoever started us closes our stdin.
            let mut line = String::new();
            while std::io::stdin().lock().read_line(&mut line)? > 0 {
                line.clear();
            }
        }
    }
    server.shutdown();
    Ok(())
}

fn client(args: &[String]) -> anyhow::Result<()> {
    let Some((target, mut rest)) = args.split_first() else {
        return Err(usage("client needs HOST:PORT"));
    };
    let (mut token, mut timeout) = (None, Duration::from_secs(30));
    while let Some((flag, after)) = rest.split_first() {
        match flag.as_str() {
            "--token" | "--timeout" => {
                let (v, after) = after
                    .split_first()
                    .ok_or_else(|| usage(format!("{flag} needs a value")))?;
                if flag == "--token" {
                    token = Some(v.clone());
                } else {
                    timeout = Duration::from_secs_f64(v.parse().context("--timeout")?);
                }
                rest = after;
            }
            _ => break,
        }
    }
    let addr = target
        .to_socket_addrs()
        .with_context(|| format!("resolving {target}"))?
        .next()
        .with_context(|| format!("{target} resolves to nothing"))?;
    let c = StoreClient::connect(addr, token, timeout)?;
    let list = |s: &str| -> Vec<String> { s.split(',').map(str::to_owned).collect() };
    let mut out = std::io::stdout().lock();
    let mut it = rest.iter();
    let mut next = |what: &str| {
        it.next()
            .cloned()
            .ok_or_else(|| usage(format!("{what} needs more arguments")))
    };
    loop {
        let op = match next("") {
            Ok(op) => op,
            Err(_) => break,
        };
        let line = match op.as_str() {
            "set" => {
                let (k, v) = (next("set")?, next("set")?);
                c.set(&k, v.as_bytes())?;
                "ok".to_owned()
            }
            "append" => {
                let (k, v) = (next("append")?, next("append")?);
                c.append(&k, v.as_bytes())?;
                "ok".to_owned()
            }
            "get" => String::from_utf8_lossy(&c.get(&next("get")?, timeout)?).into_owned(),
            "add" => {
                let k = next("add")?;
                c.add(&k, next("add")?.parse().context("add N")?)?
                    .to_string()
            }
            "check" | "wait" | "multi_get" => {
                let keys = list(&next(&op)?);
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                match op.as_str() {
                    "check" => c.check(&keys)?.to_string(),
                    "wait" => {
                        c.wait(&keys, timeout)?;
                        "ok".to_owned()
                    }
                    _ => c
                        .multi_get(&keys, timeout)?
                        .iter()
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                        .collect::<Vec<_>>()
                        .join(","),
                }
            }
            "multi_set" => {
                let pairs = list(&next("multi_set")?);
                let pairs: Vec<(&str, &[u8])> = pairs
                    .iter()
                    .map(|p| {
                        p.split_once('=')
                            .map(|(k, v)| (k, v.as_bytes()))
                            .ok_or_else(|| usage(format!("multi_set: {p:?} is not K=V")))
                    })
                    .collect::<anyhow::Result<_>>()?;
                c.multi_set(&pairs)?;
                "ok".to_owned()
            }
            "cas" => {
                let (k, e, d) = (next("cas")?, next("cas")?, next("cas")?);
                String::from_utf8_lossy(&c.compare_set(&k, e.as_bytes(), d.as_bytes())?)
                    .into_owned()
            }
            "delete" => c.delete_key(&next("delete")?)?.to_string(),
            "num_keys" => c.num_keys()?.to_string(),
            "ping" => {
                c.ping()?;
                "ok".to_owned()
            }
            other => return Err(usage(format!("unknown op {other}"))),
        };
        writeln!(out, "{line}")?;
    }
    Ok(())
}
