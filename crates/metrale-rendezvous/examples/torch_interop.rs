//! A Rust process and a PyTorch process sharing one c10d store, either way
//! round: the Rust side serves and `torch.distributed.TCPStore` connects
//! (`serve`), or PyTorch serves and the Rust side connects (`connect`).
//!
//! ```text
//! torch_interop serve [--bind ADDR] [--port P] [--timeout SECS]
//!     serves a store (port 0: a free one), prints "listening PORT", then
//!     runs the exchange below as a client of its own store, and serves
//!     until the torch side has set `torch/bye`
//! torch_interop connect HOST:PORT [--timeout SECS]
//!     connects to a store PyTorch serves (TCPStore(is_master=True)),
//!     runs the exchange, and sets `rust/bye` last
//! ```
//!
//! The exchange (the torch side runs its mirror image,
//! `examples/torch_interop.py`): each side sets its greeting and reads the
//! other's (`get` waits for it); both meet at a barrier made of an `add`
//! and a `wait`; both try `compare_set("leader", "", name)`, exactly one
//! wins and both read the same leader; each pushes a message to the
//! other's queue and pops the one meant for it. The Rust side prints one
//! line per result (`greeting ...`, `leader ...`, `queue ...`) and `ok`
//! at the end; every wait is bounded by `--timeout` (default 30 s). Its
//! keys carry the `/` that PyTorch's client puts before every key ([`key`]).
//!
//! Build: `cargo build --release -p metrale-rendezvous --example
//! torch_interop`. Run both directions against torch:
//! `python3 examples/torch_interop.py target/release/examples/torch_interop`.
//! Exits 0 on success, 1 on a store error, 2 on bad usage.

use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use metrale_rendezvous::{StoreClient, StoreServer};

/// The name PyTorch's `TCPStore` gives `name` on the wire: its client
/// writes every key, and every queue, under a `/` prefix (`keyPrefix_` in
/// c10d's TCPStore), so a Rust process sharing its keys names them so.
fn key(name: &str) -> String {
    format!("/{name}")
}

const USAGE: &str = "usage: torch_interop serve [--bind ADDR] [--port P] [--timeout SECS]
       torch_interop connect HOST:PORT [--timeout SECS]";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match run(&args) {
        Ok(()) => 0,
        Err(e) if e.to_string().starts_with("usage") => {
            eprintln!("torch_interop: {e}");
            2
        }
        Err(e) => {
            eprintln!("torch_interop: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

/// The options after the mode: (`--bind`, `--port`, `--timeout`, the rest).
fn options(args: &[String]) -> anyhow::Result<(String, u16, Duration, Vec<String>)> {
    let (mut bind, mut port, mut timeout) = ("127.0.0.1".to_owned(), 0u16, 30u64);
    let mut rest = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .with_context(|| format!("usage: {a} needs a value"))
        };
        match a.as_str() {
            "--bind" => bind = val()?.clone(),
            "--port" => port = val()?.parse().context("--port")?,
            "--timeout" => timeout = val()?.parse().context("--timeout")?,
            other if other.starts_with("--") => bail!("usage: unknown option {other}\n{USAGE}"),
            other => rest.push(other.to_owned()),
        }
    }
    Ok((bind, port, Duration::from_secs(timeout), rest))
}

fn run(args: &[String]) -> anyhow::Result<()> {
    let Some((mode, rest)) = args.split_first() else {
        bail!("{USAGE}");
    };
    let (bind, port, timeout, rest) = options(rest)?;
    match (mode.as_str(), rest.as_slice()) {
        ("serve", []) => serve(&bind, port, timeout),
        ("connect", [addr]) => connect(addr, timeout),
        _ => bail!("{USAGE}"),
    }
}

/// The Rust side serves; a torch client connects.
fn serve(bind: &str, port: u16, timeout: Duration) -> anyhow::Result<()> {
    let addr = (bind, port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {bind}"))?
        .next()
        .with_context(|| format!("{bind} resolves to nothing"))?;
    // No token: PyTorch's client has no way to present one.
    let server = StoreServer::bind(addr, None).context("serving the store")?;
    let local = server.local_addr();
    println!("listening {}", local.port());
    std::io::stdout().flush()?;
    // A client of its own store, as rank 0 of a job is.
    let store = StoreClient::connect(local, None, timeout).context("connecting to our store")?;
    exchange(&store, timeout)?;
    // Serve until the torch side is through with the store.
    store
        .wait(&[&key("torch/bye")], timeout)
        .context("waiting for torch/bye")?;
    drop(store);
    server.shutdown();
    Ok(())
}

/// PyTorch serves; the Rust side is its client.
fn connect(addr: &str, timeout: Duration) -> anyhow::Result<()> {
    let addr: SocketAddr = addr
        .to_socket_addrs()
        .with_context(|| format!("resolving {addr}"))?
        .next()
        .with_context(|| format!("{addr} resolves to nothing"))?;
    let store = StoreClient::connect(addr, None, timeout)
        .with_context(|| format!("connecting to torch's store at {addr}"))?;
    exchange(&store, timeout)?;
    store.set(&key("rust/bye"), b"1")?;
    Ok(())
}

/// The Rust half of the exchange, printing what it read.
fn exchange(store: &StoreClient, timeout: Duration) -> anyhow::Result<()> {
    store.set(&key("rust/greeting"), b"hello from rust")?;
    let theirs = store
        .get(&key("torch/greeting"), timeout)
        .context("waiting for torch's greeting")?;
    println!("greeting {}", String::from_utf8_lossy(&theirs));

    // A barrier of two: the last to arrive opens it.
    if store.add(&key("arrived"), 1)? == 2 {
        store.set(&key("all_arrived"), b"1")?;
    }
    store
        .wait(&[&key("all_arrived")], timeout)
        .context("the barrier")?;
    println!("barrier passed");

    // Exactly one side's compare_set finds the key absent and wins.
    store.compare_set(&key("leader"), b"", b"rust")?;
    let leader = store.get(&key("leader"), timeout)?;
    ensure!(
        leader == b"rust" || leader == b"torch",
        "leader is {:?}",
        String::from_utf8_lossy(&leader)
    );
    println!("leader {}", String::from_utf8_lossy(&leader));

    store.queue_push(&key("to_torch"), b"job from rust")?;
    let got = store
        .queue_pop(&key("to_rust"), Some(timeout))
        .context("popping to_rust")?
        .context("to_rust was empty after its wait")?;
    println!("queue {}", String::from_utf8_lossy(&got));
    println!("ok");
    std::io::stdout().flush()?;
    Ok(())
}
