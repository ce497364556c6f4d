//! The cost model through the real bindings: with costs set
//! (`metrale_emu_set_cost`), work timed between two events takes exactly
//! its cost in emulated time: eager all-reduces on each rank (K launches,
//! K times the cost), a replayed graph of all-reduces its graph-mode cost,
//! per-rank entries over every rank's, a one-shot kernel, grouped sends, a
//! cross-stream wait that takes the later clock, none for an operation an
//! abort ends unrun; clearing the costs gives host-clock timings again.
//! Results are checked against host references.
//!
//! The model is process-wide: the tests take one lock and clear the costs
//! on entry and exit.

mod common;

use std::ffi::c_void;
use std::sync::{Barrier, Mutex, MutexGuard};

use common::*;
use cuda_sys::{CUevent, CUstream, CUstreamCaptureMode};
use metrale_kernel_abi::one_shot as abi;
use nccl_sys::{ncclComm_t, ncclDataType_t};

const ALL_REDUCE: i32 = 1;
const ONE_SHOT: i32 = 2;
const SEND: i32 = 3;
const ANY: i32 = 0;
const EAGER: i32 = 1;
const GRAPH: i32 = 2;

/// Serialises the tests (the model is the process's) and clears the costs
/// on entry and on exit.
struct Serial(#[allow(dead_code)] MutexGuard<'static, ()>);

fn serial() -> Serial {
    static LOCK: Mutex<()> = Mutex::new(());
    let g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    clear_costs();
    Serial(g)
}

impl Drop for Serial {
    fn drop(&mut self) {
        clear_costs();
    }
}

/// `metrale_emu_set_cost`, asserted successful.
fn set_cost(rank: i32, op: i32, mode: i32, base_ns: u64, ns_per_kib: u64) {
    assert_eq!(try_set_cost(rank, op, mode, base_ns, ns_per_kib), 0);
}

fn try_set_cost(rank: i32, op: i32, mode: i32, base_ns: u64, ns_per_kib: u64) -> i32 {
    // SAFETY: the symbol has this signature (docs/architecture.md).
    unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn(i32, i32, i32, u64, u64) -> i32> =
            control().get(b"metrale_emu_set_cost\0").unwrap();
        f(rank, op, mode, base_ns, ns_per_kib)
    }
}

/// `metrale_emu_clear_costs`.
fn clear_costs() {
    // SAFETY: the symbol has this signature (docs/architecture.md).
    unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn()> =
            control().get(b"metrale_emu_clear_costs\0").unwrap();
        f()
    }
}

fn event() -> CUevent {
    let mut e = std::ptr::null_mut();
    // SAFETY: `e` is a valid out-parameter.
    ck(unsafe { cuda_sys::call!(cuda(), cuEventCreate(&mut e, 0)) }.unwrap());
    e
}

fn record(e: CUevent, s: CUstream) {
    // SAFETY: handles made by this test.
    ck(unsafe { cuda_sys::call!(cuda(), cuEventRecord(e, s)) }.unwrap());
}

fn wait_event(s: CUstream, e: CUevent) {
    // SAFETY: handles made by this test.
    ck(unsafe { cuda_sys::call!(cuda(), cuStreamWaitEvent(s, e, 0)) }.unwrap());
}

/// Milliseconds from `a` to `b`, once both are complete.
fn elapsed(a: CUevent, b: CUevent) -> f32 {
    let mut ms = f32::NAN;
    // SAFETY: handles made by this test; `ms` is a valid out-parameter.
    unsafe {
        ck(cuda_sys::call!(cuda(), cuEventSynchronize(b)).unwrap());
        ck(cuda_sys::call!(cuda(), cuEventElapsedTime_v2(&mut ms, a, b)).unwrap());
    }
    ms
}

fn destroy_event(e: CUevent) {
    // SAFETY: a handle made by this test.
    ck(unsafe { cuda_sys::call!(cuda(), cuEventDestroy_v2(e)) }.unwrap());
}

/// Asserts `ms` is `ns` nanoseconds, within f32 rounding.
#[track_caller]
fn assert_ns(ms: f32, ns: u64, what: &str) {
    let want = ns as f64 / 1e6;
    assert!(
        (f64::from(ms) - want).abs() <= want * 1e-6 + 1e-9,
        "{what}: {ms} ms, want {want} ms"
    );
}

/// The elementwise f32 sum of `inputs`, added in rank order.
fn host_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
    (0..inputs[0].len())
        .map(|i| inputs.iter().fold(0.0f32, |a, v| a + v[i]))
        .collect()
}

/// An out-of-place f32 all-reduce of `n` values on `s`.
fn all_reduce(send: u64, recv: u64, n: usize, comm: ncclComm_t, s: CUstream) {
    nck(all_reduce_sum(
        send,
        recv,
        n,
        ncclDataType_t::ncclFloat32,
        comm,
        s,
    ));
}

#[test]
fn eager_all_reduces_take_their_cost_per_rank() {
    let _s = serial();
    const N: usize = 4096; // 16 KiB
    // Every rank, eager: 10 us + 100 ns a KiB. Rank 1, any mode: 40 us
    // (a rank's entry wins over every rank's, even a mode's).
    set_cost(-1, ALL_REDUCE, EAGER, 10_000, 100);
    set_cost(1, ALL_REDUCE, ANY, 40_000, 0);
    // A graph-only entry does not apply to eager launches.
    set_cost(-1, ALL_REDUCE, GRAPH, 1, 0);
    let id = unique_id();
    let inputs: Vec<Vec<f32>> = (0..3).map(|_| random_f32(N)).collect();
    let sum = host_sum(&inputs);
    ranks(3, |r| {
        let comm = init(3, id, r as i32);
        let s = stream();
        let (send, recv) = (alloc(4 * N), alloc(4 * N));
        upload(send, &inputs[r]);
        poison(recv, 4 * N);
        let (a, b) = (event(), event());
        record(a, s);
        all_reduce(send, recv, N, comm, s);
        record(b, s);
        let cost = if r == 1 { 40_000 } else { 10_000 + 100 * 16 };
        assert_ns(elapsed(a, b), cost, &format!("rank {r}, one launch"));
        assert_eq!(download::<f32>(recv, N), sum, "rank {r}");
        record(a, s);
        for _ in 0..5 {
            all_reduce(send, recv, N, comm, s);
        }
        record(b, s);
        assert_ns(elapsed(a, b), 5 * cost, &format!("rank {r}, five launches"));
        // Nothing between the events: no time.
        record(a, s);
        record(b, s);
        assert_ns(elapsed(a, b), 0, &format!("rank {r}, nothing"));
        destroy_event(a);
        destroy_event(b);
        nck(destroy(comm));
        destroy_stream(s);
        free(send);
        free(recv);
    });
}

#[test]
fn a_replayed_graph_takes_the_graph_cost() {
    let _s = serial();
    const N: usize = 2560; // 10 KiB
    const K: u64 = 4;
    set_cost(-1, ALL_REDUCE, EAGER, 5_000, 0);
    set_cost(-1, ALL_REDUCE, GRAPH, 2_000, 10);
    let graph_cost = 2_000 + 10 * 10;
    let id = unique_id();
    let inputs: Vec<Vec<f32>> = (0..2).map(|_| random_f32(N)).collect();
    let sum = host_sum(&inputs);
    ranks(2, |r| {
        let c = cuda();
        let comm = init(2, id, r as i32);
        let s = stream();
        let (send, recv) = (alloc(4 * N), alloc(4 * N));
        upload(send, &inputs[r]);
        poison(recv, 4 * N);
        let (mut graph, mut exec) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: handles made by this test; valid out-parameters.
        unsafe {
            ck(cuda_sys::call!(
                c,
                cuStreamBeginCapture_v2(s, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            )
            .unwrap());
            for _ in 0..K {
                all_reduce(send, recv, N, comm, s);
            }
            ck(cuda_sys::call!(c, cuStreamEndCapture(s, &mut graph)).unwrap());
            ck(cuda_sys::call!(c, cuGraphInstantiateWithFlags(&mut exec, graph, 0)).unwrap());
        }
        let (a, b) = (event(), event());
        record(a, s);
        // SAFETY: handles made by this test.
        ck(unsafe { cuda_sys::call!(c, cuGraphLaunch(exec, s)) }.unwrap());
        record(b, s);
        assert_ns(
            elapsed(a, b),
            K * graph_cost,
            &format!("rank {r}, one replay"),
        );
        assert_eq!(download::<f32>(recv, N), sum, "rank {r}");
        poison(recv, 4 * N);
        record(a, s);
        for _ in 0..2 {
            // SAFETY: handles made by this test.
            ck(unsafe { cuda_sys::call!(c, cuGraphLaunch(exec, s)) }.unwrap());
        }
        record(b, s);
        assert_ns(elapsed(a, b), 2 * K * graph_cost, &format!("rank {r}, two"));
        assert_eq!(download::<f32>(recv, N), sum, "rank {r}, replayed");
        // The same operation launched eagerly takes the eager cost.
        record(a, s);
        all_reduce(send, recv, N, comm, s);
        record(b, s);
        assert_ns(elapsed(a, b), 5_000, &format!("rank {r}, eager"));
        // SAFETY: handles made by this test.
        unsafe {
            ck(cuda_sys::call!(c, cuGraphExecDestroy(exec)).unwrap());
            ck(cuda_sys::call!(c, cuGraphDestroy(graph)).unwrap());
        }
        destroy_event(a);
        destroy_event(b);
        nck(destroy(comm));
        destroy_stream(s);
        free(send);
        free(recv);
    });
}

#[test]
fn grouped_sends_are_charged_by_their_bytes() {
    let _s = serial();
    const N: usize = 2048; // 8 KiB
    set_cost(-1, SEND, ANY, 2_500, 64);
    let id = unique_id();
    let inputs: Vec<Vec<f32>> = (0..2).map(|_| random_f32(N)).collect();
    ranks(2, |r| {
        let comm = init(2, id, r as i32);
        let s = stream();
        let (send, recv) = (alloc(4 * N), alloc(4 * N));
        upload(send, &inputs[r]);
        poison(recv, 4 * N);
        let peer = 1 - r as i32;
        let (a, b) = (event(), event());
        record(a, s);
        // SAFETY: both buffers hold N f32.
        unsafe {
            nck(nccl_sys::call!(nccl(), ncclGroupStart()).unwrap());
            nck(nccl_sys::call!(
                nccl(),
                ncclRecv(
                    recv as *mut c_void,
                    N,
                    ncclDataType_t::ncclFloat32,
                    peer,
                    comm,
                    s
                )
            )
            .unwrap());
            nck(nccl_sys::call!(
                nccl(),
                ncclSend(
                    send as *const c_void,
                    N,
                    ncclDataType_t::ncclFloat32,
                    peer,
                    comm,
                    s
                )
            )
            .unwrap());
            nck(nccl_sys::call!(nccl(), ncclGroupEnd()).unwrap());
        }
        record(b, s);
        assert_ns(elapsed(a, b), 2_500 + 64 * 8, &format!("rank {r}"));
        assert_eq!(download::<f32>(recv, N), inputs[1 - r], "rank {r}");
        destroy_event(a);
        destroy_event(b);
        nck(destroy(comm));
        destroy_stream(s);
        free(send);
        free(recv);
    });
}

const ONE_SHOT_PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\
.visible .entry f32_one_shot_all_reduce(\n .param .u64 p0,\n .param .u64 p1,\n .param .u64 p2,\n .param .u32 p3\n)\n{\n ret;\n}\n\0";

#[test]
fn a_one_shot_kernel_is_charged_by_its_control_block_rank() {
    let _s = serial();
    const N: usize = 1000; // 4000 bytes
    const SLOT: usize = 4096;
    set_cost(-1, ONE_SHOT, ANY, 7_000, 30);
    set_cost(1, ONE_SHOT, EAGER, 9_000, 0);
    // An NCCL entry does not apply to the kernel.
    set_cost(-1, ALL_REDUCE, ANY, 1_000_000, 0);
    let want = [7_000 + 30 * 4000 / 1024, 9_000];
    let inputs: Vec<Vec<f32>> = (0..2).map(|_| random_f32(N)).collect();
    let sum = host_sum(&inputs);
    let rbufs: Vec<Mutex<u64>> = (0..2).map(|_| Mutex::new(0)).collect();
    let met = Barrier::new(2);
    ranks(2, |r| {
        let c = cuda();
        let (mut m, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid out-parameters; the PTX is NUL-terminated.
        unsafe {
            ck(cuda_sys::call!(c, cuModuleLoadData(&mut m, ONE_SHOT_PTX.as_ptr().cast())).unwrap());
            ck(cuda_sys::call!(
                c,
                cuModuleGetFunction(&mut f, m, c"f32_one_shot_all_reduce".as_ptr())
            )
            .unwrap());
        }
        let rbytes = abi::LANES * abi::HALVES * 2 * SLOT;
        let rbuf = alloc(rbytes);
        // SAFETY: `rbuf` holds `rbytes` bytes.
        ck(unsafe { cuda_sys::call!(c, cuMemsetD32_v2(rbuf, abi::SENTINEL, rbytes / 4)) }.unwrap());
        let mut flags: *mut c_void = std::ptr::null_mut();
        // SAFETY: `flags` is a valid out-parameter; the 8 bytes are then
        // this thread's to write.
        unsafe {
            ck(cuda_sys::call!(c, cuMemAllocHost_v2(&mut flags, 8)).unwrap());
            flags.cast::<u8>().write_bytes(0, 8);
        }
        *rbufs[r].lock().unwrap() = rbuf;
        met.wait();
        let mut ctrl = abi::Ctrl {
            flags: flags as u64,
            timeout_ns: 10_000_000_000,
            rank: r as u32,
            world: 2,
            slot_bytes: SLOT as u64,
            ..Default::default()
        };
        for (p, b) in rbufs.iter().enumerate() {
            ctrl.peer[p] = *b.lock().unwrap();
        }
        let dctrl = alloc(abi::CTRL_BYTES);
        upload(dctrl, &[ctrl]);
        let data = alloc(4 * N);
        upload(data, &inputs[r]);
        let s = stream();
        let (a, b) = (event(), event());
        let (mut pc, mut pd, mut pn, mut pl) = (dctrl, data, N as u64, abi::LANE_EAGER);
        let mut params = [
            (&mut pc as *mut u64).cast::<c_void>(),
            (&mut pd as *mut u64).cast::<c_void>(),
            (&mut pn as *mut u64).cast::<c_void>(),
            (&mut pl as *mut u32).cast::<c_void>(),
        ];
        record(a, s);
        // SAFETY: `params` points at the four arguments.
        ck(unsafe {
            cuda_sys::call!(
                c,
                cuLaunchKernel(
                    f,
                    1,
                    1,
                    1,
                    256,
                    1,
                    1,
                    0,
                    s,
                    params.as_mut_ptr(),
                    std::ptr::null_mut()
                )
            )
        }
        .unwrap());
        record(b, s);
        assert_ns(elapsed(a, b), want[r], &format!("rank {r}"));
        assert_eq!(download::<f32>(data, N), sum, "rank {r}");
        // SAFETY: `flags` holds the two words.
        let status = unsafe { flags.cast::<u32>().add(1).read_volatile() };
        assert_eq!(status, 0, "rank {r}: no status recorded");
        met.wait();
        destroy_event(a);
        destroy_event(b);
        destroy_stream(s);
        free(data);
        free(dctrl);
        free(rbuf);
        // SAFETY: `flags` came from cuMemAllocHost_v2; both ranks are done.
        unsafe {
            ck(cuda_sys::call!(c, cuMemFreeHost(flags)).unwrap());
            ck(cuda_sys::call!(c, cuModuleUnload(m)).unwrap());
        }
    });
}

#[test]
fn a_cross_stream_wait_takes_the_later_clock() {
    let _s = serial();
    const N: usize = 256;
    set_cost(0, ALL_REDUCE, ANY, 1_000_000, 0);
    set_device(0);
    let comm = init(1, unique_id(), 0);
    let (send, recv) = (alloc(4 * N), alloc(4 * N));
    let input = random_f32(N);
    upload(send, &input);
    // Fresh streams: both clocks start at 0.
    let (s1, s2, s3) = (stream(), stream(), stream());
    let (a, b, c, d) = (event(), event(), event(), event());
    record(a, s1);
    for _ in 0..3 {
        all_reduce(send, recv, N, comm, s1);
    }
    record(b, s1);
    // s2 is behind b (at 0 ms): the wait takes it to 3 ms.
    wait_event(s2, b);
    record(c, s2);
    assert_ns(elapsed(a, c), 3_000_000, "a stream behind the event");
    // s3 is ahead of b (5 ms): the wait leaves it there; b is complete
    // before the wait is issued.
    for _ in 0..5 {
        all_reduce(send, recv, N, comm, s3);
    }
    sync(s1);
    wait_event(s3, b);
    record(d, s3);
    assert_ns(elapsed(a, d), 5_000_000, "a stream ahead of the event");
    assert_eq!(
        download::<f32>(recv, N),
        input,
        "one rank: the sum is the input"
    );
    for e in [a, b, c, d] {
        destroy_event(e);
    }
    nck(destroy(comm));
    for s in [s1, s2, s3] {
        destroy_stream(s);
    }
    free(send);
    free(recv);
}

#[test]
fn clearing_the_costs_restores_host_clock_timing() {
    let _s = serial();
    const N: usize = 256;
    assert_eq!(try_set_cost(-2, ALL_REDUCE, ANY, 1, 0), -1);
    assert_eq!(try_set_cost(0, 4, ANY, 1, 0), -1);
    assert_eq!(try_set_cost(0, ALL_REDUCE, 3, 1, 0), -1);
    // One second an all-reduce: far above what the host takes.
    set_cost(-1, ALL_REDUCE, ANY, 1_000_000_000, 0);
    set_device(1);
    let comm = init(1, unique_id(), 0);
    let (send, recv) = (alloc(4 * N), alloc(4 * N));
    upload(send, &random_f32(N));
    let s = stream();
    let (a, b, x) = (event(), event(), event());
    record(a, s);
    all_reduce(send, recv, N, comm, s);
    record(b, s);
    assert_ns(elapsed(a, b), 1_000_000_000, "with the cost set");
    record(x, s);
    clear_costs();
    // A stamp from before the clear is never compared with one after.
    record(b, s);
    let mixed = elapsed(x, b);
    assert!((0.0..1_000.0).contains(&mixed), "mixed stamps: {mixed} ms");
    record(a, s);
    all_reduce(send, recv, N, comm, s);
    record(b, s);
    let host = elapsed(a, b);
    assert!(
        (0.0..1_000.0).contains(&host),
        "host-clock timing after the clear: {host} ms"
    );
    for e in [a, b, x] {
        destroy_event(e);
    }
    nck(destroy(comm));
    destroy_stream(s);
    free(send);
    free(recv);
}

#[test]
fn an_operation_ended_unrun_by_an_abort_charges_nothing() {
    let _s = serial();
    const N: usize = 256;
    set_cost(-1, ALL_REDUCE, ANY, 1_000_000, 0);
    set_device(2);
    let comm = init(1, unique_id(), 0);
    let (send, recv) = (alloc(4 * N), alloc(4 * N));
    upload(send, &random_f32(N));
    poison(recv, 4 * N);
    let s = stream();
    let (a, b) = (event(), event());
    // The rank's next operation hangs until the abort ends it unrun.
    assert_eq!(inject(0, 1, 1), 0);
    record(a, s);
    all_reduce(send, recv, N, comm, s);
    record(b, s);
    nck(abort(comm));
    sync_within(s, std::time::Duration::from_secs(5));
    assert_ns(elapsed(a, b), 0, "an aborted all-reduce");
    assert!(
        download::<u32>(recv, N).iter().all(|&w| w == 0x7f7f_7f7f),
        "nothing was written"
    );
    reset();
    destroy_event(a);
    destroy_event(b);
    destroy_stream(s);
    free(send);
    free(recv);
}
