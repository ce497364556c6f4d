//! Integrity scenarios: a backend call returns `Ok` only for work that was
//! done right, and a failure stays a failure. Each reproduces one defect of
//! issue #14 on 2 ranks:
//! - `int_fast_path_streams`: fast-path all-reduces issued on the backend's
//!   stream, a caller stream (`all_reduce_async`) and a replayed graph on a
//!   caller stream (a captured all-reduce takes NCCL's path and overlaps
//!   the others), with no synchronize between, and by four threads of a
//!   rank sharing one backend, all give the exact sum;
//! - `int_mismatch_reported`: an all-reduce the emulator fails (the ranks
//!   pass different sizes) is reported by that call or by `synchronize`,
//!   naming `all_reduce` and its sequence number, and poisons;
//! - `int_shutdown_after_failure`: `shutdown` right after a failed fast-path
//!   all-reduce returns within its timeout and leaves nothing running on
//!   memory it freed or that the caller frees next;
//! - `int_reconnect_aborts_waiters`: a thread waiting in `synchronize` or
//!   idling in `recv_command_u32` while another thread reconnects gets an
//!   error, never `Ok` for work the reconnect aborted;
//! - `int_shutdown_idle_worker`: `shutdown` while another thread idles in
//!   `recv_command_u32` returns promptly, not after its timeout.
//!
//! Invariants: inputs are small non-zero integers, so every sum is exact in
//! bf16 and every element is compared bit for bit; a rank never stops
//! early on a wrong result (it finishes the same calls as its peer and
//! reports everything it saw at the end); every wait has a deadline;
//! scenarios that inject emulator faults skip on GPUs and reset the faults
//! when they end.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use half::bf16;
use metrale_comm::{AllReducePath, CommBackend, CommError, FastPathPolicy, NcclBackend};
use nccl_safe::{Context, DataType, DeviceBuffer, DeviceViewMut, Stream};

use super::reliability::fault_injection;
use super::turns::Turns;
use crate::RankCtx;
use crate::data::{POISON_BYTE, Rng, ints_to_bf16, small_ints};
use crate::emu::Fault;

/// Host waits for work that is expected to complete.
const WAIT: Duration = Duration::from_secs(30);
/// The collective timeout of the scenarios about failures.
const TIMEOUT: Duration = Duration::from_secs(2);
/// How much later than its bound an error may come.
const SLACK: Duration = Duration::from_secs(1);
/// How many wrong buffers a failure lists one by one.
const LISTED: usize = 12;

/// One buffer's input on this rank and the sum over all ranks.
struct Data {
    mine: Vec<i32>,
    sum: Vec<i32>,
}

fn data(ctx: &RankCtx, seed: u64, salt: u64, n: usize) -> Data {
    let inputs: Vec<Vec<i32>> = (0..ctx.world_size)
        .map(|k| small_ints(seed, k, salt, n))
        .collect();
    let mut sum = vec![0i32; n];
    for v in &inputs {
        for (s, x) in sum.iter_mut().zip(v) {
            *s += x;
        }
    }
    Data {
        mine: inputs[ctx.rank].clone(),
        sum,
    }
}

fn upload(c: &Arc<Context>, v: &[i32]) -> anyhow::Result<DeviceBuffer<bf16>> {
    Ok(DeviceBuffer::from_host(c, &ints_to_bf16(v))?)
}

/// `None` when `got` holds `want` exactly, else what is wrong, counting the
/// elements that still hold this rank's `input`.
fn wrong(what: &str, got: &[bf16], want: &[i32], input: &[i32]) -> Option<String> {
    let mut bad = 0usize;
    let mut unreduced = 0usize;
    let mut first = None;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32();
        if g != *w as f32 {
            bad += 1;
            if g == input[i] as f32 {
                unreduced += 1;
            }
            if first.is_none() {
                first = Some((i, g, *w));
            }
        }
    }
    let (i, g, w) = first?;
    Some(format!(
        "{what}: {bad} of {} elements wrong ({unreduced} still hold this rank's input); \
         first at {i}: got {g}, expected {w}",
        got.len()
    ))
}

/// Lists at most [`LISTED`] lines, then how many more there are.
fn listing(lines: &[String]) -> String {
    let mut s = lines
        .iter()
        .take(LISTED)
        .map(|l| format!("\n  {l}"))
        .collect::<String>();
    if lines.len() > LISTED {
        s.push_str(&format!("\n  ... and {} more", lines.len() - LISTED));
    }
    s
}

/// A correct all-reduce of 4097 elements, checked.
fn reduce_ok(ctx: &RankCtx, b: &NcclBackend, seed: u64, salt: u64) -> anyhow::Result<()> {
    let n = 4097;
    let d = data(ctx, seed, salt, n);
    let mut buf = upload(b.context(), &d.mine)?;
    b.all_reduce(buf.view_mut())
        .and_then(|()| b.synchronize())
        .with_context(|| format!("the all_reduce (salt {salt}) of a healthy backend"))?;
    if let Some(w) = wrong("all_reduce", &buf.to_host_vec()?, &d.sum, &d.mine) {
        anyhow::bail!("{w}");
    }
    Ok(())
}

/// Fast-path all-reduces that overlap: at 3 MiB with the fast path always,
/// `all_reduce(A)` and `all_reduce_async(B)` in both orders, then with a
/// replayed graph of `all_reduce_async(G)` on a third stream; at 2 MiB with
/// the default policy, four threads of each rank sharing one backend, taking
/// turns in an order drawn from the shared seed. No synchronize between the
/// calls of a round; every buffer is checked after the round.
pub fn fast_path_streams(ctx: &RankCtx) -> anyhow::Result<()> {
    const BYTES: usize = 3 << 20;
    const ROUNDS: u64 = 6;
    let n = BYTES / 2;
    let seed = ctx.shared_seed("int-streams")?;
    let cfg = ctx
        .config()
        .with_collective_timeout(Duration::from_secs(10))
        .with_fast_path(FastPathPolicy::Always);
    let b = ctx.backend("int-streams", cfg)?;
    let path = b.all_reduce_path(BYTES);
    ensure!(
        path == AllReducePath::FastPath,
        "all_reduce_path(3 MiB) = {path:?} with FastPathPolicy::Always on 2 ranks"
    );
    let c = b.context().clone();
    let compute = Stream::new(&c)?;
    let mut wrong_bufs = Vec::new();
    let mut checked = 0usize;
    // (part, buffers wrong, buffers checked)
    let mut parts: Vec<(&str, usize, usize)> = Vec::new();
    for round in 0..ROUNDS {
        for sync_first in [true, false] {
            let order = if sync_first {
                "all_reduce(A) then all_reduce_async(B)"
            } else {
                "all_reduce_async(B) then all_reduce(A)"
            };
            let what = format!("round {round}: {order}, 3 MiB, fast path");
            ctx.step(what.clone());
            let salt = round * 4 + sync_first as u64 * 2;
            let (da, db) = (data(ctx, seed, salt, n), data(ctx, seed, salt + 1, n));
            let (mut ba, mut bb) = (upload(&c, &da.mine)?, upload(&c, &db.mine)?);
            let s = compute.as_ref();
            // ba and bb stay alive until the backend and the compute stream
            // are idle below.
            let issued = if sync_first {
                b.all_reduce(ba.view_mut())
                    .and_then(|()| b.all_reduce_async(bb.view_mut(), s))
            } else {
                b.all_reduce_async(bb.view_mut(), s)
                    .and_then(|()| b.all_reduce(ba.view_mut()))
            };
            issued.with_context(|| what.clone())?;
            b.synchronize().with_context(|| what.clone())?;
            compute
                .wait_until_idle(WAIT)
                .with_context(|| what.clone())?;
            checked += 2;
            wrong_bufs.extend(wrong(
                &format!("round {round} ({order}): A"),
                &ba.to_host_vec()?,
                &da.sum,
                &da.mine,
            ));
            wrong_bufs.extend(wrong(
                &format!("round {round} ({order}): B"),
                &bb.to_host_vec()?,
                &db.sum,
                &db.mine,
            ));
        }
    }

    parts.push(("both orders", wrong_bufs.len(), checked));
    let replayer = Stream::new(&c)?;
    let mut g = DeviceBuffer::<bf16>::alloc(&c, n)?;
    ctx.step("capture all_reduce_async(G), 3 MiB, on a third stream");
    replayer.begin_capture()?;
    // The graph keeps g's address: g outlives every replay (it is dropped
    // after the graph, once the replaying stream is idle) and is written
    // only between them.
    let captured = b.all_reduce_async(g.view_mut(), replayer.as_ref());
    let graph = replayer.end_capture()?;
    captured.context("capturing all_reduce_async(G)")?;
    let exec = graph.instantiate()?;
    for round in 0..ROUNDS {
        let what = format!(
            "graph round {round}: replay of all_reduce_async(G), all_reduce(A), all_reduce_async(B)"
        );
        ctx.step(what.clone());
        let salt = 1000 + round * 4;
        let (dg, da, db) = (
            data(ctx, seed, salt, n),
            data(ctx, seed, salt + 1, n),
            data(ctx, seed, salt + 2, n),
        );
        g.copy_from_host(&ints_to_bf16(&dg.mine))?;
        let (mut ba, mut bb) = (upload(&c, &da.mine)?, upload(&c, &db.mine)?);
        exec.launch(&replayer).with_context(|| what.clone())?;
        let issued = b
            .all_reduce(ba.view_mut())
            .and_then(|()| b.all_reduce_async(bb.view_mut(), compute.as_ref()));
        issued.with_context(|| what.clone())?;
        b.synchronize().with_context(|| what.clone())?;
        compute
            .wait_until_idle(WAIT)
            .with_context(|| what.clone())?;
        replayer
            .wait_until_idle(WAIT)
            .with_context(|| what.clone())?;
        checked += 3;
        for (name, buf, d) in [("G (replayed)", &g, &dg), ("A", &ba, &da), ("B", &bb, &db)] {
            wrong_bufs.extend(wrong(
                &format!("graph round {round}: {name}"),
                &buf.to_host_vec()?,
                &d.sum,
                &d.mine,
            ));
        }
    }
    drop(exec);
    drop(graph);
    let (w, k) = (parts[0].1, parts[0].2);
    parts.push(("with a replayed graph", wrong_bufs.len() - w, checked - k));
    let healthy = b.is_healthy();
    b.shutdown()?;

    let (threaded, n_threaded, threads_healthy) = four_threads(ctx, seed)?;
    parts.push(("four threads", threaded.len(), n_threaded));
    checked += n_threaded;
    wrong_bufs.extend(threaded);
    let counts = parts
        .iter()
        .map(|(p, w, n)| format!("{p}: {w} of {n}"))
        .collect::<Vec<_>>()
        .join(", ");
    ensure!(
        wrong_bufs.is_empty(),
        "{} of {checked} buffers wrong after overlapping fast-path all-reduces ({counts}); \
         no call failed, backends {}:{}",
        wrong_bufs.len(),
        if healthy && threads_healthy {
            "healthy"
        } else {
            "poisoned"
        },
        listing(&wrong_bufs)
    );
    Ok(())
}

/// Four threads per rank share a default-policy backend and call
/// `all_reduce` or `all_reduce_async` (each thread on its own stream) at
/// 2 MiB, taking turns in an order drawn from the shared seed. Returns what
/// was wrong, how many buffers were checked and whether the backend stayed
/// healthy.
fn four_threads(ctx: &RankCtx, seed: u64) -> anyhow::Result<(Vec<String>, usize, bool)> {
    const BYTES: usize = 2 << 20;
    const THREADS: usize = 4;
    const CALLS: usize = 16;
    let n = BYTES / 2;
    let cfg = ctx
        .config()
        .with_collective_timeout(Duration::from_secs(10))
        .with_fast_path(FastPathPolicy::DEFAULT);
    let b = ctx.backend("int-streams-threads", cfg)?;
    let path = b.all_reduce_path(BYTES);
    ensure!(
        path == AllReducePath::FastPath,
        "all_reduce_path(2 MiB) = {path:?} with the default policy on 2 ranks"
    );
    let c = b.context().clone();
    // Turn i: thread order[i] calls all_reduce (asynchronous[i] false) or
    // all_reduce_async on its stream. Every thread takes a turn, and both
    // calls occur.
    let mut rng = Rng::new(seed, 0, 0x7471);
    let order: Vec<usize> = (0..CALLS)
        .map(|i| {
            if i < THREADS {
                i
            } else {
                (rng.next_u64() % THREADS as u64) as usize
            }
        })
        .collect();
    let asynchronous: Vec<bool> = (0..CALLS)
        .map(|i| i == 1 || (i != 0 && rng.next_u64() & 1 == 1))
        .collect();
    let streams = (0..THREADS)
        .map(|_| Stream::new(&c))
        .collect::<Result<Vec<_>, _>>()?;
    let turns = Turns::new();
    let deadline = Instant::now() + WAIT;
    type Issued = (usize, DeviceBuffer<bf16>, Data);
    let results: Vec<anyhow::Result<Vec<Issued>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (b, c, turns, order, asynchronous, stream) =
                    (&b, &c, &turns, &order, &asynchronous, &streams[t]);
                s.spawn(move || -> anyhow::Result<Vec<Issued>> {
                    c.make_current()?;
                    let mut mine = Vec::new();
                    for i in (0..CALLS).filter(|&i| order[i] == t) {
                        turns.wait(i, deadline)?;
                        let call = if asynchronous[i] {
                            "all_reduce_async"
                        } else {
                            "all_reduce"
                        };
                        ctx.step(format!("four threads: turn {i}, thread {t}, {call} 2 MiB"));
                        let issued = (|| -> anyhow::Result<Issued> {
                            let d = data(ctx, seed, 5000 + i as u64, n);
                            let mut buf = upload(c, &d.mine)?;
                            // buf is kept (returned) until the backend and every
                            // stream are idle; the stream is this thread's.
                            if asynchronous[i] {
                                b.all_reduce_async(buf.view_mut(), stream.as_ref())
                            } else {
                                b.all_reduce(buf.view_mut())
                            }
                            .with_context(|| format!("turn {i} (thread {t}): {call}"))?;
                            Ok((i, buf, d))
                        })();
                        match issued {
                            Ok(x) => {
                                mine.push(x);
                                turns.done(i);
                            }
                            Err(e) => {
                                turns.stop();
                                return Err(e);
                            }
                        }
                    }
                    Ok(mine)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a turn-taking thread panicked")))
            })
            .collect()
    });
    ctx.step("four threads: settle");
    b.synchronize().context("four threads: synchronize")?;
    for (t, s) in streams.iter().enumerate() {
        s.wait_until_idle(WAIT)
            .with_context(|| format!("four threads: stream of thread {t}"))?;
    }
    let mut wrong_bufs = Vec::new();
    let mut checked = 0;
    for r in results {
        for (i, buf, d) in r? {
            checked += 1;
            let call = if asynchronous[i] {
                "all_reduce_async"
            } else {
                "all_reduce"
            };
            wrong_bufs.extend(wrong(
                &format!("four threads: turn {i} (thread {}, {call})", order[i]),
                &buf.to_host_vec()?,
                &d.sum,
                &d.mine,
            ));
        }
    }
    let healthy = b.is_healthy();
    b.shutdown()?;
    Ok((wrong_bufs, checked, healthy))
}

/// The name of `e`'s variant, for messages about the wrong kind of error.
fn variant(e: &CommError) -> &'static str {
    match e {
        CommError::InvalidArgument { .. } => "InvalidArgument",
        CommError::UnknownHandle { .. } => "UnknownHandle",
        CommError::InGroup { .. } => "InGroup",
        CommError::Poisoned { .. } => "Poisoned",
        CommError::Failed(_) => "Failed",
        CommError::Refused { .. } => "Refused",
        CommError::Shutdown { .. } => "Shutdown",
        CommError::Reconnecting { .. } => "Reconnecting",
        CommError::Aborted { .. } => "Aborted",
        CommError::GroupBusy { .. } => "GroupBusy",
        CommError::Thread { .. } => "Thread",
        CommError::Unsupported { .. } => "Unsupported",
        CommError::Setup { .. } => "Setup",
        CommError::Rendezvous(_) => "Rendezvous",
        CommError::Config(_) => "Config",
        _ => "another error",
    }
}

/// The backend configuration of the failure scenarios: the short collective
/// timeout and a given fast-path policy.
fn short(ctx: &RankCtx, policy: FastPathPolicy) -> metrale_comm::BackendConfig {
    ctx.config()
        .with_collective_timeout(TIMEOUT)
        .with_fast_path(policy)
}

/// With NCCL's all-reduce, after one that succeeded, rank 0 reduces 1 MiB
/// while rank 1 reduces 2 MiB; the emulator fails the collective on both.
/// The all_reduce or the synchronize after it must return `Failed` naming
/// `all_reduce` and its sequence number (not the one before, which its
/// caller was told succeeded), by the deadline; the backend is then
/// poisoned by it, refuses the next call with it as the cause, and its
/// dump names it. Twice: with the watchdog's usual interval, and with a
/// 1 s one, so that the watchdog has not yet retired the successful
/// all-reduce when the failure is seen (the waiter names the failure).
pub fn mismatch_reported(ctx: &RankCtx) -> anyhow::Result<()> {
    let (_emu, _reset) = fault_injection(ctx)?;
    mismatch_once(ctx, "int-mismatch", short(ctx, FastPathPolicy::Never))?;
    let mut slow = short(ctx, FastPathPolicy::Never);
    slow.watchdog_interval = Duration::from_secs(1);
    mismatch_once(ctx, "int-mismatch-slow-watchdog", slow)
        .context("with the watchdog ticking once a second")
}

fn mismatch_once(
    ctx: &RankCtx,
    name: &str,
    cfg: metrale_comm::BackendConfig,
) -> anyhow::Result<()> {
    let seed = ctx.shared_seed(name)?;
    let b = ctx.backend(name, cfg)?;
    reduce_ok(ctx, &b, seed, 1)?;
    let n = if ctx.rank == 0 { 1 << 19 } else { 1 << 20 };
    let mine = small_ints(seed, ctx.rank, 2, n);
    let mut buf = upload(b.context(), &mine)?;
    ctx.step("all_reduce of 1 MiB on rank 0, 2 MiB on rank 1");
    let t = Instant::now();
    // buf outlives the backend's shutdown below.
    let issued = b.all_reduce(buf.view_mut());
    let seq = b.recorder().last_seq();
    let r = issued.and_then(|()| b.synchronize());
    let took = t.elapsed();
    let mut symptoms = Vec::new();
    match &r {
        Ok(()) => {
            let got = buf.to_host_vec()?;
            let untouched = got
                .iter()
                .zip(&mine)
                .filter(|(g, x)| g.to_f32() == **x as f32)
                .count();
            symptoms.push(format!(
                "all_reduce (seq {seq}) and synchronize returned Ok after {took:?}, although the \
                 emulator failed the collective (mismatched sizes); the buffer still holds this \
                 rank's input in {untouched} of {n} elements"
            ));
        }
        Err(e) => {
            match e {
                // The all-reduce's own failure, or (when the watchdog saw
                // it first) the refusal of the wait that carries it.
                CommError::Failed(f) | CommError::Poisoned { cause: f, .. }
                    if f.op == "all_reduce" && f.seq == seq => {}
                other => symptoms.push(format!(
                    "expected Failed (or Poisoned by) all_reduce seq {seq}, got {}: {other}",
                    variant(other)
                )),
            }
            let msg = e.to_string();
            if !(msg.contains("all_reduce") && msg.contains(&format!("seq {seq}"))) {
                symptoms.push(format!(
                    "the error does not name all_reduce and seq {seq}: {msg}"
                ));
            }
            if took > TIMEOUT + SLACK {
                symptoms.push(format!("the error came after {took:?}"));
            }
        }
    }
    // The watchdog may see the emulator's error after synchronize: give it
    // the slack, so that the symptoms below are what stays.
    let until = Instant::now() + SLACK;
    while b.is_healthy() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    match b.failure() {
        None => symptoms.push(format!(
            "the backend is still healthy {SLACK:?} after the failed all_reduce"
        )),
        Some(f) if f.op != "all_reduce" || f.seq != seq => symptoms.push(format!(
            "the backend is poisoned by `{f}`, not by all_reduce seq {seq}"
        )),
        Some(_) => {}
    }
    let next = b.barrier();
    match (&r, &next) {
        (Ok(()), Err(e)) => symptoms.push(format!(
            "the error surfaced only on the next call (barrier): {e}"
        )),
        (_, Ok(())) => symptoms.push("the next call (barrier) succeeded".into()),
        (Err(_), Err(_)) => {}
    }
    let dump = ctx
        .dump_dir()
        .join(metrale_comm::diagnostics::dump_file_name(
            ctx.rank,
            b.generation(),
        ));
    let until = Instant::now() + SLACK;
    while !dump.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    match std::fs::read_to_string(&dump) {
        Err(e) => symptoms.push(format!(
            "no flight-recorder dump at {}: {e}",
            dump.display()
        )),
        Ok(text) => {
            let d: metrale_comm::diagnostics::Dump =
                serde_json::from_str(&text).context("parsing the dump")?;
            if !d.header.reason.starts_with("all_reduce") || d.header.first_failed_seq != Some(seq)
            {
                symptoms.push(format!(
                    "the dump names `{}` (first failed seq {:?}) instead of all_reduce seq {seq}",
                    d.header.reason, d.header.first_failed_seq
                ));
            }
        }
    }
    b.shutdown().ok();
    ensure!(
        symptoms.is_empty(),
        "a failed all_reduce (mismatched sizes across ranks) was not reported as such:{}",
        listing(&symptoms)
    );
    Ok(())
}

/// Ten times: a fast-path all-reduce of 16 MiB whose receive on rank 0
/// fails (the emulator's asynchronous error at the receive), then
/// `shutdown` at once, then the caller frees its buffer. Shutdown returns
/// within its timeout (`Ok` or a typed error) and the process survives: no
/// add kernel still runs on the scratch buffer shutdown freed, nor on the
/// caller's buffer.
pub fn shutdown_after_failure(ctx: &RankCtx) -> anyhow::Result<()> {
    const ITERATIONS: usize = 10;
    const BYTES: usize = 16 << 20;
    let (emu, _reset) = fault_injection(ctx)?;
    let seed = ctx.shared_seed("int-uaf")?;
    let shutdown_timeout = Duration::from_secs(5);
    let mut symptoms = Vec::new();
    for it in 0..ITERATIONS {
        let mut cfg = short(ctx, FastPathPolicy::Always);
        cfg.shutdown_timeout = shutdown_timeout;
        let b = ctx.backend(&format!("int-uaf-{it}"), cfg)?;
        ensure!(
            b.all_reduce_path(BYTES) == AllReducePath::FastPath,
            "16 MiB does not take the fast path"
        );
        reduce_ok(ctx, &b, seed, it as u64)?;
        if ctx.rank == 0 {
            // The fast path's operations are a send, then the receive.
            emu.inject(0, Fault::AsyncError, 2)?;
        }
        ctx.barrier(&format!("int-uaf injected {it}"))?;
        let n = BYTES / 2;
        let mut buf = upload(b.context(), &small_ints(seed, ctx.rank, 100 + it as u64, n))?;
        ctx.step(format!(
            "iteration {it}: fast-path all_reduce 16 MiB, receive fails on rank 0"
        ));
        // buf is freed only after shutdown returned, which must leave no work
        // on it.
        let r = b.all_reduce(buf.view_mut()).and_then(|()| b.synchronize());
        if ctx.rank == 0 && r.is_ok() {
            let until = Instant::now() + TIMEOUT + SLACK;
            while b.is_healthy() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        ctx.step(format!("iteration {it}: shutdown after the failure"));
        let t = Instant::now();
        let shut = b.shutdown();
        let took = t.elapsed();
        if took > shutdown_timeout + SLACK {
            symptoms.push(format!(
                "iteration {it}: shutdown took {took:?} (timeout {shutdown_timeout:?}): {shut:?}"
            ));
        }
        tracing::debug!(rank = ctx.rank, it, "shutdown after failure: {shut:?}");
        drop(buf);
        // An add kernel still running on freed memory faults here.
        std::thread::sleep(Duration::from_millis(100));
        drop(b);
        ctx.barrier(&format!("int-uaf done {it}"))?;
    }
    ensure!(
        symptoms.is_empty(),
        "shutdown after a failed fast-path all-reduce:{}",
        listing(&symptoms)
    );
    Ok(())
}

/// What a thread's call returned, and when.
type Returned = (Result<(), CommError>, Instant);

/// Runs `call` on a new thread; its result comes through the receiver.
fn on_thread(
    call: impl FnOnce() -> Result<(), CommError> + Send + 'static,
) -> anyhow::Result<(mpsc::Receiver<Returned>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::Builder::new()
        .name("int-waiter".into())
        .spawn(move || {
            let r = call();
            let _ = tx.send((r, Instant::now()));
        })
        .context("spawning a waiting thread")?;
    Ok((rx, h))
}

/// `recv_command_u32` from root 0 into `cmd` on a new thread.
fn idle_receive(
    b: &Arc<NcclBackend>,
    cmd: &Arc<DeviceBuffer<u32>>,
) -> anyhow::Result<(mpsc::Receiver<Returned>, std::thread::JoinHandle<()>)> {
    let (b, cmd) = (b.clone(), cmd.clone());
    on_thread(move || {
        // SAFETY: cmd is one u32 of this device, kept alive by this thread's
        // clone of the Arc until the call returns; the scenario's thread
        // reads it only after the call returned.
        let view = unsafe { DeviceViewMut::from_raw(cmd.device_ptr(), 1, DataType::Uint32) };
        b.recv_command_u32(view, 0)
    })
}

/// While a thread of rank 0 waits in `synchronize` for an all-reduce rank
/// 1 skipped, both ranks call `attempt_reconnect`: the waiter must get an
/// error, not `Ok`. Then, while a thread of rank 1 idles in
/// `recv_command_u32`, both ranks reconnect without a command sent: the
/// idle thread must get an error, not `Ok`. Both with NCCL's all-reduce and
/// with the fast path; a correct all-reduce follows each reconnect.
pub fn reconnect_aborts_waiters(ctx: &RankCtx) -> anyhow::Result<()> {
    let seed = ctx.shared_seed("int-reconnect")?;
    let mut symptoms = Vec::new();
    for policy in [FastPathPolicy::Never, FastPathPolicy::Always] {
        let tag = format!("{policy:?}");
        let cfg = ctx
            .config()
            .with_collective_timeout(Duration::from_secs(10))
            .with_fast_path(policy);
        let b = Arc::new(ctx.backend(&format!("int-reconnect-{tag}"), cfg)?);
        reduce_ok(ctx, &b, seed, 1)?;
        let n = 1 << 16;
        if ctx.rank == 0 {
            let d = data(ctx, seed, 2, n);
            let mut buf = upload(b.context(), &d.mine)?;
            ctx.step(format!(
                "{tag}: all_reduce rank 1 skips, synchronize on another thread"
            ));
            // buf is kept past the reconnect, which aborts the work on it.
            b.all_reduce(buf.view_mut())
                .with_context(|| format!("{tag}: the all_reduce rank 1 skips"))?;
            let b2 = b.clone();
            let (rx, waiter) = on_thread(move || b2.synchronize())?;
            std::thread::sleep(Duration::from_millis(300));
            if let Ok((r, _)) = rx.try_recv() {
                symptoms.push(format!(
                    "{tag}: synchronize returned before the reconnect: {r:?}"
                ));
            }
            ctx.set(&format!("int-reconnect/{tag}/waiting"), b"1")?;
            ctx.step(format!("{tag}: attempt_reconnect while synchronize waits"));
            let started = Instant::now();
            let rc = b.attempt_reconnect();
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok((Ok(()), at)) => {
                    let got = buf.to_host_vec()?;
                    let summary = wrong("its buffer", &got, &d.sum, &d.mine)
                        .unwrap_or_else(|| "its buffer holds the sum".into());
                    symptoms.push(format!(
                        "{tag}: synchronize returned Ok {:?} after attempt_reconnect began, for \
                         an all_reduce the peer never joined; {summary}",
                        at.saturating_duration_since(started)
                    ));
                }
                Ok((Err(e), _)) => tracing::debug!("{tag}: the waiter got {e}"),
                Err(_) => symptoms.push(format!(
                    "{tag}: synchronize still waits 5 s after attempt_reconnect began"
                )),
            }
            rc.with_context(|| format!("{tag}: attempt_reconnect on rank 0"))?;
            if waiter.is_finished() {
                let _ = waiter.join();
            }
        } else {
            ctx.step(format!("{tag}: skipping the all_reduce"));
            ctx.get(&format!("int-reconnect/{tag}/waiting"))?;
            b.attempt_reconnect()
                .with_context(|| format!("{tag}: attempt_reconnect on rank 1"))?;
        }
        reduce_ok(ctx, &b, seed, 3).with_context(|| format!("{tag}: after the reconnect"))?;

        if ctx.rank == 1 {
            let mut cmd = DeviceBuffer::<u32>::alloc(b.context(), 1)?;
            cmd.fill_bytes(POISON_BYTE)?;
            let cmd = Arc::new(cmd);
            ctx.step(format!("{tag}: recv_command_u32 on another thread"));
            let (rx, idler) = idle_receive(&b, &cmd)?;
            std::thread::sleep(Duration::from_millis(300));
            if let Ok((r, _)) = rx.try_recv() {
                symptoms.push(format!(
                    "{tag}: recv_command_u32 returned before the reconnect: {r:?}"
                ));
            }
            ctx.set(&format!("int-reconnect/{tag}/idling"), b"1")?;
            ctx.step(format!(
                "{tag}: attempt_reconnect while recv_command_u32 idles"
            ));
            let started = Instant::now();
            let rc = b.attempt_reconnect();
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok((Ok(()), at)) => symptoms.push(format!(
                    "{tag}: recv_command_u32 returned Ok {:?} after attempt_reconnect began, \
                     with no command sent (the buffer holds {:#x})",
                    at.saturating_duration_since(started),
                    cmd.to_host_vec()?[0]
                )),
                Ok((Err(e), _)) => tracing::debug!("{tag}: the idle thread got {e}"),
                Err(_) => symptoms.push(format!(
                    "{tag}: recv_command_u32 still idles 5 s after attempt_reconnect began"
                )),
            }
            rc.with_context(|| format!("{tag}: attempt_reconnect on rank 1"))?;
            if idler.is_finished() {
                let _ = idler.join();
            }
        } else {
            ctx.get(&format!("int-reconnect/{tag}/idling"))?;
            b.attempt_reconnect()
                .with_context(|| format!("{tag}: attempt_reconnect on rank 0"))?;
        }
        reduce_ok(ctx, &b, seed, 4)
            .with_context(|| format!("{tag}: after the second reconnect"))?;
        ctx.barrier(&format!("int-reconnect {tag} done"))?;
        b.shutdown()?;
    }
    ensure!(
        symptoms.is_empty(),
        "calls waiting across attempt_reconnect:{}",
        listing(&symptoms)
    );
    Ok(())
}

/// While a thread of rank 1 idles in `recv_command_u32`, rank 1 shuts down:
/// shutdown returns in under a fifth of its 5 s timeout and does not report
/// a drain that timed out; the idle thread gets an error at once. Rank 0
/// shuts down after, as promptly.
pub fn shutdown_idle_worker(ctx: &RankCtx) -> anyhow::Result<()> {
    let shutdown_timeout = Duration::from_secs(5);
    let prompt = shutdown_timeout / 5;
    let seed = ctx.shared_seed("int-idle")?;
    let mut cfg = ctx.config();
    cfg.shutdown_timeout = shutdown_timeout;
    let b = Arc::new(ctx.backend("int-idle", cfg)?);
    reduce_ok(ctx, &b, seed, 1)?;
    let mut symptoms = Vec::new();
    if ctx.rank == 1 {
        let mut cmd = DeviceBuffer::<u32>::alloc(b.context(), 1)?;
        cmd.fill_bytes(POISON_BYTE)?;
        let cmd = Arc::new(cmd);
        ctx.step("recv_command_u32 on another thread, then shutdown");
        let (rx, idler) = idle_receive(&b, &cmd)?;
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let shut = b.shutdown();
        let took = t.elapsed();
        if took > prompt {
            symptoms.push(format!(
                "shutdown took {took:?} (timeout {shutdown_timeout:?}) while another thread \
                 idled in recv_command_u32"
            ));
        }
        if let Err(e) = &shut {
            symptoms.push(format!(
                "shutdown returned {} although nothing but the idle receive was in flight: {e}",
                variant(e)
            ));
        }
        match rx.recv_timeout(SLACK) {
            Ok((Ok(()), _)) => symptoms.push(format!(
                "recv_command_u32 returned Ok with no command sent (the buffer holds {:#x})",
                cmd.to_host_vec()?[0]
            )),
            Ok((Err(e), _)) => tracing::debug!("the idle thread got {e}"),
            Err(_) => symptoms.push(format!(
                "recv_command_u32 still idles {SLACK:?} after shutdown returned"
            )),
        }
        if idler.is_finished() {
            let _ = idler.join();
        }
        ctx.set("int-idle/shut", b"1")?;
    } else {
        ctx.step("waiting for rank 1's shutdown");
        ctx.get("int-idle/shut")?;
        let t = Instant::now();
        let shut = b.shutdown();
        let took = t.elapsed();
        if took > prompt || shut.is_err() {
            symptoms.push(format!(
                "the root's shutdown after its peer's took {took:?}: {shut:?}"
            ));
        }
    }
    ensure!(
        symptoms.is_empty(),
        "shutdown with a thread idling in recv_command_u32:{}",
        listing(&symptoms)
    );
    Ok(())
}
