//! Fast-path all-reduces that overlap (`int_fast_path_streams`): on the
//! backend's stream, a caller stream and a replayed graph with no
//! synchronize between, and from four threads of a rank sharing one
//! backend.
//!
//! Invariants: as the parent module's; every buffer of a round is checked
//! after the round, and a rank finishes every round before it reports.

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use half::bf16;
use metrale_comm::{AllReducePath, CommBackend, FastPathPolicy};
use nccl_safe::{DeviceBuffer, Stream};

use super::{Data, data, listing, upload, wrong};
use crate::RankCtx;
use crate::data::{Rng, ints_to_bf16};
use crate::scenarios::turns::Turns;

/// Host waits for work that is expected to complete.
const WAIT: Duration = Duration::from_secs(30);

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
        .with_fast_path(crate::FAST_PATH_WINDOW);
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
