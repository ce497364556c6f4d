//! External events in captured graphs, as NCCL uses them to order a
//! communicator's captured work after its earlier launches: a record with
//! `CU_EVENT_RECORD_EXTERNAL` captured into a graph records the event at
//! each launch; a wait with `CU_EVENT_WAIT_EXTERNAL` waits, at each launch,
//! for the event's latest record as of that launch. So graphs that begin
//! with such a wait and end with such a record run one after another in
//! launch order, whatever streams they are launched on, and eager work
//! that waits for the event after a launch waits for that graph.
//!
//! Streams are held back deterministically by a [`Gate`] captured into the
//! first graph: its recv waits until the test releases it.

mod common;

use std::time::Duration;

use common::*;
use cuda_sys::{CUevent, CUgraphExec, CUresult, CUstream, CUstreamCaptureMode, call};

/// How long held work is watched for running early.
const HELD: Duration = Duration::from_millis(150);
const SETTLE: Duration = Duration::from_secs(10);
const EXTERNAL: u32 = 1;

fn event() -> CUevent {
    let mut e = std::ptr::null_mut();
    // SAFETY: valid out-parameter.
    ck(unsafe { call!(cuda(), cuEventCreate(&mut e, 0)) }.unwrap());
    e
}

fn record_external(e: CUevent, s: CUstream) -> CUresult {
    // SAFETY: valid handles.
    unsafe { call!(cuda(), cuEventRecordWithFlags(e, s, EXTERNAL)) }.unwrap()
}

fn wait_external(s: CUstream, e: CUevent) -> CUresult {
    // SAFETY: valid handles.
    unsafe { call!(cuda(), cuStreamWaitEvent(s, e, EXTERNAL)) }.unwrap()
}

/// Captures on `s`: an external wait for `e`, `body`, an external record
/// of `e`; returns the instantiated graph.
fn serial_graph(s: CUstream, e: CUevent, body: impl FnOnce(CUstream)) -> CUgraphExec {
    let (mut graph, mut exec) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid handles and out-parameters.
    unsafe {
        ck(call!(
            cuda(),
            cuStreamBeginCapture_v2(s, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        )
        .unwrap());
    }
    ck(wait_external(s, e));
    body(s);
    ck(record_external(e, s));
    // SAFETY: valid handles and out-parameters.
    unsafe {
        ck(call!(cuda(), cuStreamEndCapture(s, &mut graph)).unwrap());
        ck(call!(cuda(), cuGraphInstantiateWithFlags(&mut exec, graph, 0)).unwrap());
        ck(call!(cuda(), cuGraphDestroy(graph)).unwrap());
    }
    exec
}

fn launch(exec: CUgraphExec, s: CUstream) {
    // SAFETY: valid handles.
    ck(unsafe { call!(cuda(), cuGraphLaunch(exec, s)) }.unwrap());
}

/// Graph 1 holds a gated recv, graph 2 a fill; both are serialised by one
/// event. Launched 1 then 2 on two streams, 2 waits for 1 (and eager work
/// that waits on the event after both launches waits for both); launched
/// 2 then 1, 2 runs at once. Every launch, also the second of each graph,
/// takes the record it waits for when it is launched.
#[test]
fn external_waits_order_graph_launches_by_launch_order() {
    set_device(0);
    let gate = Gate::new();
    let serial = event();
    let (s1, s2, s3, rs) = (stream(), stream(), stream(), stream());
    let marker = alloc(64);
    let g1 = serial_graph(s1, serial, |s| {
        gate.block(s);
    });
    let g2 = serial_graph(s2, serial, |s| {
        // SAFETY: `marker` holds 64 bytes.
        ck(unsafe { call!(cuda(), cuMemsetD8Async(marker, 0x5A, 64, s)) }.unwrap());
    });
    for round in 0..2 {
        poison(marker, 64);
        launch(g1, s1);
        launch(g2, s2);
        ck(wait_external(s3, serial));
        std::thread::sleep(HELD);
        assert_eq!(
            query(s2),
            CUresult::CUDA_ERROR_NOT_READY,
            "round {round}: graph 2 ran before graph 1, launched first, was done"
        );
        assert_eq!(
            query(s3),
            CUresult::CUDA_ERROR_NOT_READY,
            "round {round}: eager"
        );
        assert_eq!(download::<u8>(marker, 64), vec![0x7F; 64], "round {round}");
        gate.release(rs);
        for s in [s1, s2, s3, rs] {
            sync_within(s, SETTLE);
        }
        assert_eq!(download::<u8>(marker, 64), vec![0x5A; 64], "round {round}");
    }
    // Graph 2 first: nothing is recorded ahead of it, so it runs at once
    // while graph 1 waits for it, then for its gate.
    poison(marker, 64);
    launch(g2, s2);
    launch(g1, s1);
    sync_within(s2, SETTLE);
    assert_eq!(download::<u8>(marker, 64), vec![0x5A; 64]);
    std::thread::sleep(HELD);
    assert_eq!(query(s1), CUresult::CUDA_ERROR_NOT_READY, "graph 1's gate");
    gate.release(rs);
    sync_within(s1, SETTLE);
    sync_within(rs, SETTLE);
    // SAFETY: valid handles.
    unsafe {
        ck(call!(cuda(), cuGraphExecDestroy(g1)).unwrap());
        ck(call!(cuda(), cuGraphExecDestroy(g2)).unwrap());
        ck(call!(cuda(), cuEventDestroy_v2(serial)).unwrap());
    }
    for s in [s1, s2, s3, rs] {
        destroy_stream(s);
    }
}

/// Outside capture the flags change nothing: an external record is a
/// record, an external wait a wait; unknown flags are refused.
#[test]
fn external_flags_outside_capture_are_plain_records_and_waits() {
    set_device(1);
    let gate = Gate::new();
    let e = event();
    let (s1, s2, rs) = (stream(), stream(), stream());
    gate.block(s1);
    ck(record_external(e, s1));
    ck(wait_external(s2, e));
    std::thread::sleep(HELD);
    assert_eq!(query(s2), CUresult::CUDA_ERROR_NOT_READY);
    gate.release(rs);
    sync_within(s2, SETTLE);
    // SAFETY: valid handles.
    let bad = unsafe { call!(cuda(), cuEventRecordWithFlags(e, s1, 0x4)) }.unwrap();
    assert_eq!(bad, CUresult::CUDA_ERROR_INVALID_VALUE);
    // SAFETY: valid handles.
    let bad = unsafe { call!(cuda(), cuStreamWaitEvent(s1, e, 0x4)) }.unwrap();
    assert_eq!(bad, CUresult::CUDA_ERROR_INVALID_VALUE);
    for s in [s1, s2, rs] {
        sync_within(s, SETTLE);
        destroy_stream(s);
    }
}
