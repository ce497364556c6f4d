//! PyTorch's TCPStore bytes against ours, for the operations of [`OPS`]:
//! - captured from a real torch (`fixtures/tcpstore/captured/<server>/`,
//!   `NN-<op>.c2s` and `.s2c`, written by `fixtures/capture_tcpstore.py
//!   capture` for its libuv and legacy servers);
//! - written by hand from PyTorch's source (`fixtures/tcpstore/handmade/
//!   ops.txt`); every message names its set, so a hand-made one says so.
//!
//! Each set is replayed byte for byte against our server, whose replies
//! must equal PyTorch's server's, and served to our client by a fake server
//! that checks every byte our client sends and answers with PyTorch's
//! server's bytes. Our client's own additions are allowed and answered: a
//! `PING` before a query it sends only once and after a set (see
//! `rendezvous::client`). The hand-made set must equal every captured one.
//! A captured set that is absent is skipped with one line.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use metrale_rendezvous::{RendezvousError, StoreClient, StoreServer};

/// The operations, in order; keep equal to `ops()` in capture_tcpstore.py.
const OPS: &[&str] = &[
    "connect",
    "set",
    "get",
    "add",
    "add_negative",
    "check_ready",
    "check_missing",
    "wait_ready",
    "wait_timeout",
    "compare_set_new",
    "compare_set_swap",
    "compare_set_stale",
    "multi_set",
    "multi_get",
    "num_keys",
    "delete_key",
    "append",
    "get_appended",
];

const T: Duration = Duration::from_secs(10);

/// One operation's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Step {
    name: String,
    c2s: Vec<u8>,
    s2c: Vec<u8>,
}

/// A set of steps and where it came from.
struct Fixture {
    source: String,
    steps: Vec<Step>,
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tcpstore")
}

fn without_comment(line: &str) -> &str {
    // A '#' inside a quoted string is not a comment.
    let mut quoted = false;
    for (i, c) in line.char_indices() {
        match c {
            '"' => quoted = !quoted,
            '#' if !quoted => return &line[..i],
            _ => {}
        }
    }
    line
}

/// Parses hex bytes, `"text"`, `u32:N`, `u64:N` and `i64:N` tokens.
fn parse_tokens(text: &str, out: &mut Vec<u8>) -> Result<()> {
    let mut rest = text.trim();
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('"') {
            let end = after.find('"').context("unterminated string")?;
            out.extend_from_slice(&after.as_bytes()[..end]);
            rest = after[end + 1..].trim_start();
            continue;
        }
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        let (token, after) = rest.split_at(end);
        let number = |s: &str| -> Result<i128> {
            Ok(match s.strip_prefix("0x") {
                Some(hex) => i128::from_str_radix(hex, 16)?,
                None => s.parse()?,
            })
        };
        if let Some(n) = token.strip_prefix("u32:") {
            out.extend_from_slice(&u32::try_from(number(n)?)?.to_le_bytes());
        } else if let Some(n) = token.strip_prefix("u64:") {
            out.extend_from_slice(&u64::try_from(number(n)?)?.to_le_bytes());
        } else if let Some(n) = token.strip_prefix("i64:") {
            out.extend_from_slice(&i64::try_from(number(n)?)?.to_le_bytes());
        } else {
            ensure!(token.len() == 2, "bad token {token:?}");
            out.push(u8::from_str_radix(token, 16).with_context(|| format!("bad hex {token:?}"))?);
        }
        rest = after.trim_start();
    }
    Ok(())
}

fn handmade() -> Result<Fixture> {
    let path = fixtures_dir().join("handmade/ops.txt");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let mut steps: Vec<Step> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        let ctx = || format!("{}:{}", path.display(), i + 1);
        if let Some(name) = line.strip_prefix("## ") {
            steps.push(Step {
                name: name.trim().to_owned(),
                c2s: Vec::new(),
                s2c: Vec::new(),
            });
        } else if let Some(bytes) = line.strip_prefix('>') {
            let step = steps.last_mut().with_context(ctx)?;
            parse_tokens(without_comment(bytes), &mut step.c2s).with_context(ctx)?;
        } else if let Some(bytes) = line.strip_prefix('<') {
            let step = steps.last_mut().with_context(ctx)?;
            parse_tokens(without_comment(bytes), &mut step.s2c).with_context(ctx)?;
        } else {
            ensure!(
                without_comment(line).trim().is_empty(),
                "{}: stray text",
                ctx()
            );
        }
    }
    let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
    ensure!(
        names == OPS,
        "hand-made operations {names:?} differ from OPS"
    );
    Ok(Fixture {
        source: "hand-made (from PyTorch's source)".to_owned(),
        steps,
    })
}

fn read_hex_file(path: &Path) -> Result<Vec<u8>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let mut out = Vec::new();
    for line in text.lines() {
        parse_tokens(without_comment(line), &mut out)
            .with_context(|| path.display().to_string())?;
    }
    Ok(out)
}

/// The captured sets present; prints one line for each one absent.
fn captured() -> Result<Vec<Fixture>> {
    let mut sets = Vec::new();
    for server in ["libuv", "legacy"] {
        let dir = fixtures_dir().join("captured").join(server);
        let files: Vec<(String, PathBuf, PathBuf)> = OPS
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let stem = dir.join(format!("{:02}-{name}", i + 1));
                (
                    (*name).to_owned(),
                    stem.with_extension("c2s"),
                    stem.with_extension("s2c"),
                )
            })
            .collect();
        if let Some((_, missing, _)) = files.iter().find(|(_, c, s)| !c.is_file() || !s.is_file()) {
            println!(
                "skipped: captured {server} fixtures absent ({} missing; run capture_tcpstore.py)",
                missing.display()
            );
            continue;
        }
        let steps = files
            .iter()
            .map(|(name, c, s)| {
                Ok(Step {
                    name: name.clone(),
                    c2s: read_hex_file(c)?,
                    s2c: read_hex_file(s)?,
                })
            })
            .collect::<Result<_>>()?;
        sets.push(Fixture {
            source: format!("captured from torch, {server} server"),
            steps,
        });
    }
    Ok(sets)
}

fn all_fixtures() -> Result<Vec<Fixture>> {
    let mut all = vec![handmade()?];
    all.extend(captured()?);
    Ok(all)
}

/// The connect step's nonce: bytes 6..10 of what the client sends and all
/// of the reply; masked where two sets are compared.
fn masked(step: &Step) -> Step {
    let mut s = step.clone();
    if s.name == "connect" && s.c2s.len() == 10 && s.s2c.len() == 4 {
        s.c2s[6..10].fill(0);
        s.s2c.fill(0);
    }
    s
}

#[test]
fn handmade_fixtures_match_captured() -> Result<()> {
    let hand = handmade()?;
    for set in captured()? {
        for (h, c) in hand.steps.iter().zip(&set.steps) {
            assert_eq!(masked(h), masked(c), "{}: op {}", set.source, c.name);
        }
    }
    Ok(())
}

#[test]
fn pytorch_client_bytes_replayed_against_our_server() -> Result<()> {
    for set in all_fixtures()? {
        let server = StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), None)?;
        let mut s = TcpStream::connect(server.local_addr())?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        for step in &set.steps {
            s.write_all(&step.c2s)?;
            let mut got = vec![0u8; step.s2c.len()];
            s.read_exact(&mut got)
                .with_context(|| format!("{}: op {}: reading our reply", set.source, step.name))?;
            assert_eq!(
                got, step.s2c,
                "{}: op {}: our server's reply",
                set.source, step.name
            );
        }
        // Nothing more comes back.
        s.set_read_timeout(Some(Duration::from_millis(200)))?;
        let extra = s.read(&mut [0u8; 16]);
        assert!(
            matches!(&extra, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
            "{}: our server sent more: {extra:?}",
            set.source
        );
    }
    Ok(())
}

/// One query of a step and the reply PyTorch's server gave it.
struct Exchange {
    query: Vec<u8>,
    reply: Vec<u8>,
}

fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8]> {
    ensure!(b.len() >= n, "truncated");
    let (head, tail) = b.split_at(n);
    *b = tail;
    Ok(head)
}

fn take_u64(b: &mut &[u8]) -> Result<usize> {
    let bytes: [u8; 8] = take(b, 8)?.try_into()?;
    Ok(usize::try_from(u64::from_le_bytes(bytes))?)
}

fn take_blob(b: &mut &[u8]) -> Result<()> {
    let n = take_u64(b)?;
    take(b, n)?;
    Ok(())
}

/// Splits a step into its queries and their replies (by query type).
fn exchanges(step: &Step) -> Result<Vec<Exchange>> {
    let mut queries: Vec<(u8, Vec<u8>, usize)> = Vec::new();
    let mut c = step.c2s.as_slice();
    while !c.is_empty() {
        let start = c;
        let kind = take(&mut c, 1)?[0];
        let mut count = 0;
        match kind {
            0 | 13 => {
                take(&mut c, 4)?;
            }
            1 | 9 => (0..2).try_for_each(|_| take_blob(&mut c))?,
            2 => (0..3).try_for_each(|_| take_blob(&mut c))?,
            3 | 8 => take_blob(&mut c)?,
            4 => {
                take_blob(&mut c)?;
                take(&mut c, 8)?;
            }
            5 | 6 | 10 => {
                count = take_u64(&mut c)?;
                (0..count).try_for_each(|_| take_blob(&mut c))?;
            }
            11 => {
                let n = take_u64(&mut c)?;
                (0..2 * n).try_for_each(|_| take_blob(&mut c))?;
            }
            7 | 12 => {}
            other => bail!("{}: unknown query type {other}", step.name),
        }
        queries.push((kind, start[..start.len() - c.len()].to_vec(), count));
    }
    let mut s = step.s2c.as_slice();
    let mut out = Vec::new();
    for (i, (kind, query, count)) in queries.iter().enumerate() {
        let before = s;
        match kind {
            13 => {
                take(&mut s, 4)?;
            }
            5 | 12 => {
                take(&mut s, 1)?;
            }
            // A WAIT followed by its cancel got no answer.
            6 if queries.get(i + 1).is_some_and(|q| q.0 == 12) => {}
            6 => {
                take(&mut s, 1)?;
            }
            4 | 7 | 8 => {
                take(&mut s, 8)?;
            }
            2 | 3 => take_blob(&mut s)?,
            10 => (0..*count).try_for_each(|_| take_blob(&mut s))?,
            _ => {}
        }
        out.push(Exchange {
            query: query.clone(),
            reply: before[..before.len() - s.len()].to_vec(),
        });
    }
    ensure!(s.is_empty(), "{}: reply bytes left over", step.name);
    Ok(out)
}

fn read_n(s: &mut TcpStream, n: usize) -> Result<Vec<u8>> {
    let mut v = vec![0u8; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

/// Serves `set` to one client: checks each query, answers with PyTorch's
/// server's reply; answers our client's extra PINGs.
fn fake_server(listener: TcpListener, set: &[Vec<Exchange>], names: &[String]) -> Result<()> {
    let (mut s, _) = listener.accept()?;
    s.set_read_timeout(Some(T))?;
    for (exchanges, name) in set.iter().zip(names) {
        for ex in exchanges {
            let mut first = read_n(&mut s, 1)?;
            while first[0] == 13 && ex.query[0] != 13 {
                let nonce = read_n(&mut s, 4)?;
                s.write_all(&nonce)?;
                first = read_n(&mut s, 1)?;
            }
            let mut got = first;
            got.extend(read_n(&mut s, ex.query.len() - 1)?);
            if ex.query[0] == 13 {
                // The nonce is the client's own; echo it.
                ensure!(got[0] == 13, "op {name}: expected a PING, got {got:02x?}");
                s.write_all(&got[1..5])?;
                continue;
            }
            ensure!(
                got == ex.query,
                "op {name}: our client sent {got:02x?}, PyTorch's client {:02x?}",
                ex.query
            );
            s.write_all(&ex.reply)?;
        }
    }
    Ok(())
}

/// Runs OPS with our client against `addr`, checking each result.
fn run_our_client(addr: SocketAddr) -> Result<()> {
    let mut client = None;
    for &op in OPS {
        if op == "connect" {
            client = Some(StoreClient::connect(addr, None, T)?);
            continue;
        }
        let c = client.as_ref().context("connected")?;
        let ctx = || format!("op {op}");
        match op {
            "set" => c.set("/metrale/key", b"value-1").with_context(ctx)?,
            "get" => ensure!(c.get("/metrale/key", T)? == b"value-1", "{op}"),
            "add" => ensure!(c.add("/metrale/counter", 5)? == 5, "{op}"),
            "add_negative" => ensure!(c.add("/metrale/counter", -2)? == 3, "{op}"),
            "check_ready" => ensure!(c.check(&["/metrale/key", "/metrale/counter"])?, "{op}"),
            "check_missing" => ensure!(!c.check(&["/metrale/key", "/metrale/absent"])?, "{op}"),
            "wait_ready" => c.wait(&["/metrale/key"], T).with_context(ctx)?,
            "wait_timeout" => {
                let r = c.wait(&["/metrale/late"], Duration::from_millis(200));
                ensure!(
                    matches!(r, Err(RendezvousError::Timeout { .. })),
                    "{op}: {r:?}"
                );
            }
            "compare_set_new" => ensure!(c.compare_set("/metrale/cas", b"", b"first")? == b"first"),
            "compare_set_swap" => {
                ensure!(c.compare_set("/metrale/cas", b"first", b"second")? == b"second")
            }
            "compare_set_stale" => {
                ensure!(c.compare_set("/metrale/cas", b"first", b"third")? == b"second")
            }
            "multi_set" => c
                .multi_set(&[("/metrale/m1", b"a"), ("/metrale/m2", b"bb")])
                .with_context(ctx)?,
            "multi_get" => ensure!(
                c.multi_get(&["/metrale/m1", "/metrale/m2"], T)? == [b"a".to_vec(), b"bb".to_vec()]
            ),
            "num_keys" => ensure!(c.num_keys()? == 5, "{op}"),
            "delete_key" => ensure!(c.delete_key("/metrale/m2")?, "{op}"),
            "append" => c.append("/metrale/key", b"-more").with_context(ctx)?,
            "get_appended" => ensure!(c.get("/metrale/key", T)? == b"value-1-more", "{op}"),
            other => bail!("no client action for {other}"),
        }
    }
    Ok(())
}

#[test]
fn our_client_sends_pytorchs_bytes_and_reads_pytorchs_replies() -> Result<()> {
    for set in all_fixtures()? {
        let split: Vec<Vec<Exchange>> = set
            .steps
            .iter()
            .map(exchanges)
            .collect::<Result<_>>()
            .with_context(|| set.source.clone())?;
        let names: Vec<String> = set.steps.iter().map(|s| s.name.clone()).collect();
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let server = std::thread::spawn(move || fake_server(listener, &split, &names));
        let ours = run_our_client(addr);
        let theirs = server.join().expect("fake server");
        theirs.with_context(|| format!("{}: the bytes of our client", set.source))?;
        ours.with_context(|| format!("{}: our client's results", set.source))?;
    }
    Ok(())
}
