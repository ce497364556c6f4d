//! NCCL's ordering of a communicator's work, as the emulator models it:
//! every launch (an operation, a group, a graph launch's captured
//! operations) runs after the communicator's previously issued launch has
//! completed, whatever streams they are on (NCCL's strong stream,
//! `sharedRes->deviceStream`), children split with `splitShare` share their
//! parent's order, and an abort releases everything queued behind the
//! aborted communicator's work.
//!
//! Streams are held back deterministically: a stream waits on an event
//! recorded behind a [`Gate`]'s recv, released later from the host.

mod common;

use std::ffi::c_void;
use std::time::{Duration, Instant};

use common::*;
use cuda_sys::{CUevent, CUresult, CUstream, CUstreamCaptureMode, call};
use nccl_sys::{ncclComm_t, ncclConfig_t, ncclDataType_t, ncclResult_t};

/// How long held work is watched for running early.
const HELD: Duration = Duration::from_millis(150);
/// How long released work may take to finish.
const SETTLE: Duration = Duration::from_secs(10);

/// A gate on the current device whose recv an event follows: every stream
/// made to [`Hold::hold`] waits until [`Hold::release`].
struct Hold {
    gate: Gate,
    gate_stream: CUstream,
    release_stream: CUstream,
    event: CUevent,
}

impl Hold {
    fn new() -> Self {
        let gate = Gate::new();
        let (gate_stream, release_stream) = (stream(), stream());
        let mut event = std::ptr::null_mut();
        gate.block(gate_stream);
        // SAFETY: valid out-parameter and handles.
        unsafe {
            ck(call!(cuda(), cuEventCreate(&mut event, 0)).unwrap());
            ck(call!(cuda(), cuEventRecord(event, gate_stream)).unwrap());
        }
        Hold {
            gate,
            gate_stream,
            release_stream,
            event,
        }
    }

    /// Makes `s` wait for the release.
    fn hold(&self, s: CUstream) {
        // SAFETY: valid handles.
        ck(unsafe { call!(cuda(), cuStreamWaitEvent(s, self.event, 0)) }.unwrap());
    }

    fn release(&self) {
        self.gate.release(self.release_stream);
        sync(self.gate_stream);
    }
}

/// `ncclSend` / `ncclRecv` of `n` bytes; NCCL's code.
fn p2p(send: bool, buf: u64, n: usize, peer: usize, c: ncclComm_t, s: CUstream) -> ncclResult_t {
    let dt = ncclDataType_t::ncclUint8;
    // SAFETY: the caller's buffer holds `n` bytes; the emulator checks it.
    unsafe {
        if send {
            nccl_sys::call!(
                nccl(),
                ncclSend(buf as *const c_void, n, dt, peer as i32, c, s)
            )
        } else {
            nccl_sys::call!(
                nccl(),
                ncclRecv(buf as *mut c_void, n, dt, peer as i32, c, s)
            )
        }
    }
    .unwrap()
}

fn group_start() {
    // SAFETY: no arguments.
    nck(unsafe { nccl_sys::call!(nccl(), ncclGroupStart()) }.unwrap());
}

fn group_end() -> ncclResult_t {
    // SAFETY: no arguments.
    unsafe { nccl_sys::call!(nccl(), ncclGroupEnd()) }.unwrap()
}

/// Polls `ncclCommGetAsyncError` until it leaves `ncclInProgress` (5 s).
fn settle(c: ncclComm_t) -> ncclResult_t {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let e = async_error(c);
        if e != ncclResult_t::ncclInProgress {
            return e;
        }
        assert!(Instant::now() < deadline, "still in progress");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Asserts an enqueue call's code: success, or for a non-blocking
/// communicator in progress, then settled.
#[track_caller]
fn enqueued(r: ncclResult_t, c: ncclComm_t, blocking: bool) {
    if blocking {
        nck(r);
    } else {
        assert_eq!(r, ncclResult_t::ncclInProgress);
        nck(settle(c));
    }
}

fn config(blocking: bool, split_share: bool) -> ncclConfig_t {
    ncclConfig_t {
        size: size_of::<ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22803,
        blocking: i32::from(blocking),
        splitShare: i32::from(split_share),
        ..Default::default()
    }
}

/// Both ranks of a communicator on `devs`, initialised from this thread in
/// one group with `cfg`.
fn pair(devs: [i32; 2], cfg: ncclConfig_t) -> [ncclComm_t; 2] {
    let id = unique_id();
    let mut comms = [std::ptr::null_mut(); 2];
    group_start();
    for (r, c) in comms.iter_mut().enumerate() {
        set_device(devs[r]);
        let mut cfg = cfg;
        // SAFETY: valid out-parameter and config.
        let res = unsafe {
            nccl_sys::call!(nccl(), ncclCommInitRankConfig(c, 2, id, r as i32, &mut cfg))
        }
        .unwrap();
        nck(res);
    }
    let r = group_end();
    assert!(
        r == ncclResult_t::ncclSuccess || (cfg.blocking == 0 && r == ncclResult_t::ncclInProgress),
        "{r:?}"
    );
    for c in comms {
        nck(settle(c));
    }
    comms
}

/// Both ranks of a communicator on `devs`; a non-blocking one has made
/// its first exchange (its first operation waits for its peer's matching
/// one, NCCL's lazy connection), so later work is not held back by it.
fn connected(devs: [i32; 2], blocking: bool) -> [ncclComm_t; 2] {
    if blocking {
        let c = init_all(&devs);
        return [c[0], c[1]];
    }
    let c = pair(devs, config(false, false));
    let bufs: Vec<_> = devs
        .iter()
        .map(|&d| {
            set_device(d);
            (alloc(8), alloc(8), stream())
        })
        .collect();
    for r in 0..2 {
        set_device(devs[r]);
        let (send, recv, s) = bufs[r];
        group_start();
        nck(p2p(false, recv, 8, 1 - r, c[r], s));
        nck(p2p(true, send, 8, 1 - r, c[r], s));
        assert_eq!(group_end(), ncclResult_t::ncclInProgress);
    }
    for (r, (_, _, s)) in bufs.into_iter().enumerate() {
        nck(settle(c[r]));
        sync(s);
    }
    c
}

/// Each rank issues a send of A (24 bytes) on a held stream 1, then on
/// stream 2 a group sending B (86 bytes) and receiving A, then a recv of B.
/// NCCL runs each rank's three launches in issue order, so stream 2 waits
/// for stream 1 and every recv matches the send of its size; run in the
/// order the streams would allow, the first recv would meet B.
fn issue_order_across_streams(devs: [i32; 2], blocking: bool) {
    const A: usize = 24;
    const B: usize = 86;
    let comms = connected(devs, blocking);
    set_device(devs[0]);
    let hold = Hold::new();
    struct Rank {
        s1: CUstream,
        s2: CUstream,
        a: u64,
        b: u64,
        got_a: u64,
        got_b: u64,
        data_a: Vec<u8>,
        data_b: Vec<u8>,
    }
    let bytes = |n: usize| -> Vec<u8> { (0..n).map(|_| rand::random_range(1..=255u8)).collect() };
    let ranks: Vec<Rank> = (0..2)
        .map(|r| {
            set_device(devs[r]);
            let (data_a, data_b) = (bytes(A), bytes(B));
            let (a, b, got_a, got_b) = (alloc(A), alloc(B), alloc(A), alloc(B));
            upload(a, &data_a);
            upload(b, &data_b);
            poison(got_a, A);
            poison(got_b, B);
            let (s1, s2) = (stream(), stream());
            hold.hold(s1);
            Rank {
                s1,
                s2,
                a,
                b,
                got_a,
                got_b,
                data_a,
                data_b,
            }
        })
        .collect();
    for (r, k) in ranks.iter().enumerate() {
        set_device(devs[r]);
        enqueued(p2p(true, k.a, A, 1 - r, comms[r], k.s1), comms[r], blocking);
    }
    for (r, k) in ranks.iter().enumerate() {
        set_device(devs[r]);
        group_start();
        nck(p2p(true, k.b, B, 1 - r, comms[r], k.s2));
        nck(p2p(false, k.got_a, A, 1 - r, comms[r], k.s2));
        enqueued(group_end(), comms[r], blocking);
        enqueued(
            p2p(false, k.got_b, B, 1 - r, comms[r], k.s2),
            comms[r],
            blocking,
        );
    }
    std::thread::sleep(HELD);
    for (r, k) in ranks.iter().enumerate() {
        assert_eq!(
            query(k.s2),
            CUresult::CUDA_ERROR_NOT_READY,
            "rank {r}: stream 2 ran ahead of the communicator's earlier send on held stream 1"
        );
    }
    hold.release();
    for (r, k) in ranks.iter().enumerate() {
        sync(k.s1);
        sync(k.s2);
        assert_eq!(
            async_error(comms[r]),
            ncclResult_t::ncclSuccess,
            "rank {r}: {}",
            last_error(comms[r])
        );
    }
    for (r, k) in ranks.iter().enumerate() {
        let peer = &ranks[1 - r];
        assert_eq!(download::<u8>(k.got_a, A), peer.data_a, "rank {r}: A");
        assert_eq!(download::<u8>(k.got_b, B), peer.data_b, "rank {r}: B");
    }
    for (r, k) in ranks.into_iter().enumerate() {
        set_device(devs[r]);
        destroy_stream(k.s1);
        destroy_stream(k.s2);
    }
    for c in comms {
        nck(destroy(c));
    }
}

#[test]
fn send_recv_match_in_issue_order_across_streams() {
    issue_order_across_streams([0, 1], true);
}

#[test]
fn non_blocking_send_recv_match_in_issue_order_across_streams() {
    issue_order_across_streams([2, 3], false);
}

/// Random bytes, none zero.
fn bytes(n: usize) -> Vec<u8> {
    (0..n).map(|_| rand::random_range(1..=255u8)).collect()
}

/// In one group each rank sends X (24 bytes) on held stream 1, receives
/// on stream 2, sends Z (86 bytes) on stream 2 and receives on stream 1:
/// its send and receive to the one peer sit on both streams. NCCL posts a
/// group's operations to a peer in call order and makes the group's
/// streams wait for each other, so nothing of the group runs before the
/// release, and each receive gets the send of its place (X first, then
/// Z) whichever stream ran first.
fn group_same_peer_on_two_streams(devs: [i32; 2], blocking: bool) {
    const X: usize = 24;
    const Z: usize = 86;
    let comms = connected(devs, blocking);
    set_device(devs[0]);
    let hold = Hold::new();
    let mut ranks = Vec::new();
    for r in 0..2 {
        set_device(devs[r]);
        let (data_x, data_z) = (bytes(X), bytes(Z));
        let (x, z, got_x, got_z) = (alloc(X), alloc(Z), alloc(X), alloc(Z));
        upload(x, &data_x);
        upload(z, &data_z);
        poison(got_x, X);
        poison(got_z, Z);
        let (s1, s2) = (stream(), stream());
        hold.hold(s1);
        ranks.push((s1, s2, got_x, got_z, data_x, data_z));
        group_start();
        nck(p2p(true, x, X, 1 - r, comms[r], s1));
        nck(p2p(false, got_x, X, 1 - r, comms[r], s2));
        nck(p2p(true, z, Z, 1 - r, comms[r], s2));
        nck(p2p(false, got_z, Z, 1 - r, comms[r], s1));
        enqueued(group_end(), comms[r], blocking);
    }
    std::thread::sleep(HELD);
    for (r, k) in ranks.iter().enumerate() {
        assert_eq!(
            query(k.1),
            CUresult::CUDA_ERROR_NOT_READY,
            "rank {r}: the group's part on stream 2 ran before held stream 1 reached the group"
        );
        assert_eq!(download::<u8>(k.2, X), vec![0x7F; X], "rank {r}: X early");
    }
    hold.release();
    for (r, (s1, s2, got_x, got_z, _, _)) in ranks.iter().enumerate() {
        sync_within(*s1, SETTLE);
        sync_within(*s2, SETTLE);
        assert_eq!(
            async_error(comms[r]),
            ncclResult_t::ncclSuccess,
            "rank {r}: {}",
            last_error(comms[r])
        );
        let peer = &ranks[1 - r];
        assert_eq!(download::<u8>(*got_x, X), peer.4, "rank {r}: X");
        assert_eq!(download::<u8>(*got_z, Z), peer.5, "rank {r}: Z");
    }
    for (r, (s1, s2, ..)) in ranks.into_iter().enumerate() {
        set_device(devs[r]);
        destroy_stream(s1);
        destroy_stream(s2);
    }
    for c in comms {
        nck(destroy(c));
    }
}

#[test]
fn a_groups_send_and_recv_to_one_peer_on_two_streams_match_in_call_order() {
    group_same_peer_on_two_streams([0, 1], true);
}

#[test]
fn non_blocking_groups_send_and_recv_to_one_peer_on_two_streams_match_in_call_order() {
    group_same_peer_on_two_streams([2, 3], false);
}

/// `k` point-to-point operations per rank between the ranks of `comms`,
/// each on a stream drawn at random (independently on each rank) from
/// three, with sizes drawn per place: rank 0's `i`-th send and rank 1's
/// `i`-th receive have the same size, and no two neighbours do, so a
/// receive matched out of call order fails or gets the wrong bytes. In
/// one group, sends and receives interleave; outside groups, rank 0 sends
/// everything then receives, rank 1 the other way round (each operation
/// its own launch).
fn random_p2p_on_streams(devs: [i32; 2], blocking: bool, grouped: bool, k: usize) {
    let comms = connected(devs, blocking);
    // The sizes of the messages 0 -> 1 and 1 -> 0, by place.
    let sizes: [Vec<usize>; 2] = std::array::from_fn(|_| {
        let mut v: Vec<usize> = Vec::new();
        while v.len() < k {
            let n = rand::random_range(1..64usize) * 4;
            if v.last() != Some(&n) {
                v.push(n);
            }
        }
        v
    });
    struct Side {
        streams: [CUstream; 3],
        sends: Vec<(u64, Vec<u8>)>,
        recvs: Vec<u64>,
    }
    let sides: Vec<Side> = (0..2)
        .map(|r| {
            set_device(devs[r]);
            let sends = sizes[r]
                .iter()
                .map(|&n| {
                    let (p, d) = (alloc(n), bytes(n));
                    upload(p, &d);
                    (p, d)
                })
                .collect();
            let recvs = sizes[1 - r]
                .iter()
                .map(|&n| {
                    let p = alloc(n);
                    poison(p, n);
                    p
                })
                .collect();
            Side {
                streams: [stream(), stream(), stream()],
                sends,
                recvs,
            }
        })
        .collect();
    let pick = |sd: &Side| sd.streams[rand::random_range(0..3usize)];
    for (r, sd) in sides.iter().enumerate() {
        set_device(devs[r]);
        let c = comms[r];
        let send = |i: usize| p2p(true, sd.sends[i].0, sizes[r][i], 1 - r, c, pick(sd));
        let recv = |i: usize| p2p(false, sd.recvs[i], sizes[1 - r][i], 1 - r, c, pick(sd));
        if grouped {
            group_start();
            for i in 0..k {
                if rand::random_bool(0.5) {
                    nck(send(i));
                    nck(recv(i));
                } else {
                    nck(recv(i));
                    nck(send(i));
                }
            }
            enqueued(group_end(), c, blocking);
        } else {
            for step in 0..2 * k {
                let (i, is_send) = (step % k, (step < k) == (r == 0));
                enqueued(if is_send { send(i) } else { recv(i) }, c, blocking);
            }
        }
    }
    for (r, sd) in sides.iter().enumerate() {
        set_device(devs[r]);
        for s in sd.streams {
            sync_within(s, SETTLE);
        }
        assert_eq!(
            async_error(comms[r]),
            ncclResult_t::ncclSuccess,
            "rank {r}: {}",
            last_error(comms[r])
        );
        for (i, p) in sd.recvs.iter().enumerate() {
            let want = &sides[1 - r].sends[i].1;
            assert_eq!(
                &download::<u8>(*p, want.len()),
                want,
                "rank {r}, receive {i}"
            );
        }
    }
    for (r, sd) in sides.into_iter().enumerate() {
        set_device(devs[r]);
        for s in sd.streams {
            destroy_stream(s);
        }
    }
    for c in comms {
        nck(destroy(c));
    }
}

#[test]
fn random_grouped_send_recv_on_three_streams_match_in_call_order() {
    for _ in 0..5 {
        random_p2p_on_streams([4, 5], true, true, 12);
    }
    random_p2p_on_streams([4, 5], false, true, 12);
}

#[test]
fn random_eager_send_recv_on_three_streams_match_in_call_order() {
    for _ in 0..3 {
        random_p2p_on_streams([6, 7], true, false, 12);
    }
    random_p2p_on_streams([6, 7], false, false, 12);
}

/// An in-place f32 sum all-reduce of `n` values on each rank's stream;
/// returns each rank's buffer, uploaded from `data`.
fn all_reduce_each(
    devs: [i32; 2],
    comms: [ncclComm_t; 2],
    streams: [CUstream; 2],
    data: &[Vec<f32>; 2],
) -> [u64; 2] {
    let n = data[0].len();
    let mut bufs = [0; 2];
    for r in 0..2 {
        set_device(devs[r]);
        bufs[r] = alloc(4 * n);
        upload(bufs[r], &data[r]);
        nck(all_reduce_sum(
            bufs[r],
            bufs[r],
            n,
            ncclDataType_t::ncclFloat32,
            comms[r],
            streams[r],
        ));
    }
    bufs
}

fn sum(data: &[Vec<f32>; 2]) -> Vec<f32> {
    (0..data[0].len())
        .map(|i| data[0][i] + data[1][i])
        .collect()
}

/// Both ranks' children of `parent`, split (one color) from this thread in
/// one group with the parent's config.
fn split(devs: [i32; 2], parent: [ncclComm_t; 2]) -> [ncclComm_t; 2] {
    let mut child = [std::ptr::null_mut(); 2];
    group_start();
    for r in 0..2 {
        set_device(devs[r]);
        // SAFETY: valid out-parameter; a null config copies the parent's.
        nck(unsafe {
            nccl_sys::call!(
                nccl(),
                ncclCommSplit(parent[r], 0, 0, &mut child[r], std::ptr::null_mut())
            )
        }
        .unwrap());
    }
    nck(group_end());
    child
}

/// A child split from a `splitShare` parent uses the parent's strong
/// stream: its work waits for the parent's earlier work on another stream.
/// A child of a parent without `splitShare` has its own and runs at once.
#[test]
fn a_split_share_child_runs_after_its_parents_earlier_work() {
    const DEVS: [i32; 2] = [4, 5];
    const N: usize = 97;
    let shared = pair(DEVS, config(true, true));
    let own = pair(DEVS, config(true, false));
    let shared_child = split(DEVS, shared);
    let own_child = split(DEVS, own);
    set_device(DEVS[0]);
    let hold = Hold::new();
    let mut streams = Vec::new();
    for d in DEVS {
        set_device(d);
        let s: [CUstream; 4] = [stream(), stream(), stream(), stream()];
        hold.hold(s[0]);
        hold.hold(s[2]);
        streams.push(s);
    }
    let on = |i: usize| [streams[0][i], streams[1][i]];
    let data: Vec<[Vec<f32>; 2]> = (0..4).map(|_| [random_f32(N), random_f32(N)]).collect();
    // Parents on held streams, children on free ones.
    let parent_buf = all_reduce_each(DEVS, shared, on(0), &data[0]);
    let child_buf = all_reduce_each(DEVS, shared_child, on(1), &data[1]);
    let own_parent_buf = all_reduce_each(DEVS, own, on(2), &data[2]);
    let own_child_buf = all_reduce_each(DEVS, own_child, on(3), &data[3]);
    std::thread::sleep(HELD);
    for r in 0..2 {
        assert_eq!(
            query(on(1)[r]),
            CUresult::CUDA_ERROR_NOT_READY,
            "rank {r}: the splitShare child ran before its parent's earlier work"
        );
        set_device(DEVS[r]);
        sync(on(3)[r]);
        assert_eq!(
            download::<f32>(own_child_buf[r], N),
            sum(&data[3]),
            "rank {r}: the child with its own resources"
        );
    }
    hold.release();
    for r in 0..2 {
        set_device(DEVS[r]);
        for s in &streams[r] {
            sync(*s);
        }
        assert_eq!(download::<f32>(parent_buf[r], N), sum(&data[0]));
        assert_eq!(download::<f32>(child_buf[r], N), sum(&data[1]));
        assert_eq!(download::<f32>(own_parent_buf[r], N), sum(&data[2]));
    }
    for c in [shared_child, own_child, shared, own] {
        for h in c {
            nck(destroy(h));
        }
    }
}

/// A group holding a `splitShare` parent's and child's exchanges on one
/// stream is one launch on their shared order: the group's sends and recvs
/// of both communicators run together, not the child's after the parent's
/// (which, in the group's single task with sends first, would wait for the
/// parent's recv queued behind the child's send).
#[test]
fn a_group_of_a_split_share_family_runs_as_one_launch() {
    const DEVS: [i32; 2] = [4, 5];
    const N: usize = 40;
    let parent = pair(DEVS, config(true, true));
    let child = split(DEVS, parent);
    let bytes = || -> Vec<u8> { (0..N).map(|_| rand::random_range(1..=255u8)).collect() };
    let data: Vec<[Vec<u8>; 2]> = (0..2).map(|_| [bytes(), bytes()]).collect();
    let mut ranks = Vec::new();
    for r in 0..2 {
        set_device(DEVS[r]);
        let s = stream();
        let mut got = Vec::new();
        group_start();
        for (k, c) in [parent[r], child[r]].into_iter().enumerate() {
            let (send, recv) = (alloc(N), alloc(N));
            upload(send, &data[r][k]);
            poison(recv, N);
            nck(p2p(false, recv, N, 1 - r, c, s));
            nck(p2p(true, send, N, 1 - r, c, s));
            got.push(recv);
        }
        nck(group_end());
        ranks.push((s, got));
    }
    for (r, (s, got)) in ranks.iter().enumerate() {
        set_device(DEVS[r]);
        let deadline = Instant::now() + Duration::from_secs(5);
        while query(*s) != CUresult::CUDA_SUCCESS {
            assert!(Instant::now() < deadline, "rank {r}: the group never ran");
            std::thread::sleep(Duration::from_millis(1));
        }
        for (k, p) in got.iter().enumerate() {
            assert_eq!(download::<u8>(*p, N), data[1 - r][k], "rank {r}, comm {k}");
        }
    }
    for c in [child, parent] {
        for h in c {
            nck(destroy(h));
        }
    }
}

/// Captured NCCL work takes its place in the communicator's order when the
/// graph is launched (NCCL's graph mixing): a graph launched after an eager
/// operation on a held stream waits for it.
#[test]
fn a_graph_launch_runs_after_the_communicators_earlier_eager_work() {
    const DEVS: [i32; 2] = [6, 7];
    const N: usize = 131;
    let c = init_all(&DEVS);
    let comms = [c[0], c[1]];
    let graph_data = [random_f32(N), random_f32(N)];
    let mut execs = Vec::new();
    let mut graph_bufs = [0; 2];
    let mut streams = Vec::new();
    for r in 0..2 {
        set_device(DEVS[r]);
        let s: [CUstream; 3] = [stream(), stream(), stream()];
        graph_bufs[r] = alloc(4 * N);
        upload(graph_bufs[r], &graph_data[r]);
        let (mut graph, mut exec) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid handles and out-parameters.
        unsafe {
            ck(call!(
                cuda(),
                cuStreamBeginCapture_v2(s[2], CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            )
            .unwrap());
        }
        nck(all_reduce_sum(
            graph_bufs[r],
            graph_bufs[r],
            N,
            ncclDataType_t::ncclFloat32,
            comms[r],
            s[2],
        ));
        // SAFETY: valid handles and out-parameters.
        unsafe {
            ck(call!(cuda(), cuStreamEndCapture(s[2], &mut graph)).unwrap());
            ck(call!(cuda(), cuGraphInstantiateWithFlags(&mut exec, graph, 0)).unwrap());
        }
        execs.push((graph, exec));
        streams.push(s);
    }
    set_device(DEVS[0]);
    let hold = Hold::new();
    let eager_data = [random_f32(N), random_f32(N)];
    for s in &streams {
        hold.hold(s[0]);
    }
    let eager_bufs = all_reduce_each(DEVS, comms, [streams[0][0], streams[1][0]], &eager_data);
    for r in 0..2 {
        set_device(DEVS[r]);
        // SAFETY: valid handles.
        ck(unsafe { call!(cuda(), cuGraphLaunch(execs[r].1, streams[r][1])) }.unwrap());
    }
    std::thread::sleep(HELD);
    for (r, s) in streams.iter().enumerate() {
        assert_eq!(
            query(s[1]),
            CUresult::CUDA_ERROR_NOT_READY,
            "rank {r}: the graph's collective ran before the earlier eager one"
        );
    }
    hold.release();
    for r in 0..2 {
        set_device(DEVS[r]);
        sync(streams[r][0]);
        sync(streams[r][1]);
        assert_eq!(download::<f32>(eager_bufs[r], N), sum(&eager_data));
        assert_eq!(download::<f32>(graph_bufs[r], N), sum(&graph_data));
        // SAFETY: valid handles.
        unsafe {
            ck(call!(cuda(), cuGraphExecDestroy(execs[r].1)).unwrap());
            ck(call!(cuda(), cuGraphDestroy(execs[r].0)).unwrap());
        }
    }
    for c in comms {
        nck(destroy(c));
    }
}

/// An abort ends every queued operation of the communicator, unrun and
/// writing nothing, so every stream it held drains: a recv that is never
/// matched, and behind it in the communicator's order a send and an
/// all-reduce on other streams.
#[test]
fn abort_drains_every_queued_operation_of_the_communicator() {
    const DEVS: [i32; 2] = [0, 1];
    const N: usize = 64;
    let c = init_all(&DEVS);
    set_device(DEVS[0]);
    let s: [CUstream; 3] = [stream(), stream(), stream()];
    let (got, send, out) = (alloc(4 * N), alloc(4 * N), alloc(4 * N));
    poison(got, 4 * N);
    upload(send, &random_f32(N));
    poison(out, 4 * N);
    nck(p2p(false, got, 4 * N, 1, c[0], s[0]));
    nck(p2p(true, send, 4 * N, 1, c[0], s[1]));
    nck(all_reduce_sum(
        send,
        out,
        N,
        ncclDataType_t::ncclFloat32,
        c[0],
        s[2],
    ));
    std::thread::sleep(HELD);
    for (i, st) in s.iter().enumerate() {
        assert_eq!(query(*st), CUresult::CUDA_ERROR_NOT_READY, "stream {i}");
    }
    nck(abort(c[0]));
    let deadline = Instant::now() + Duration::from_secs(2);
    for (i, st) in s.iter().enumerate() {
        while query(*st) != CUresult::CUDA_SUCCESS {
            assert!(Instant::now() < deadline, "stream {i} never drained");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert!(download::<u8>(got, 4 * N).iter().all(|b| *b == 0x7F));
    assert!(download::<u8>(out, 4 * N).iter().all(|b| *b == 0x7F));
    // The send behind the aborted recv never ran: the peer has nothing to
    // receive, and it tears down without waiting.
    set_device(DEVS[1]);
    let (peer_got, ps) = (alloc(4 * N), stream());
    poison(peer_got, 4 * N);
    nck(p2p(false, peer_got, 4 * N, 0, c[1], ps));
    std::thread::sleep(HELD);
    assert_eq!(
        query(ps),
        CUresult::CUDA_ERROR_NOT_READY,
        "nothing was sent"
    );
    nck(abort(c[1]));
    sync(ps);
    assert!(download::<u8>(peer_got, 4 * N).iter().all(|b| *b == 0x7F));
    destroy_stream(ps);
    set_device(DEVS[0]);
    for st in s {
        destroy_stream(st);
    }
}
