//! nccl-safe against the CPU emulator (gpu-emu): ranks are threads of this
//! process, driver and NCCL are `libgpu_emu.so` from the target directory.
//!
//! Invariants: every test sets up the environment through [`setup`] before
//! any library is opened; outputs are poisoned before each run, inputs are
//! random, and every element is compared with a host reference; every wait
//! has a deadline.

use std::sync::{Arc, Barrier, OnceLock};
use std::time::Duration;

use half::bf16;
use nccl_safe::{
    Comm, Context, DeviceBuffer, Error, ReduceOp, Stream, UniqueId, device_count, group,
};
use rand::Rng;

const WAIT: Duration = Duration::from_secs(20);

/// The add kernel (`bf16_add_inplace`, committed PTX) on device 0, its
/// stream, and two buffers of `n` random bf16 values from `range`: `dst`
/// holds `a`, `src` holds `b`.
struct AddKernel {
    ctx: Arc<Context>,
    stream: Stream,
    module: nccl_safe::Module,
    add: nccl_safe::Function,
    a: Vec<bf16>,
    b: Vec<bf16>,
    dst: DeviceBuffer<bf16>,
    src: DeviceBuffer<bf16>,
}

fn add_kernel(n: usize, range: std::ops::Range<f32>) -> AddKernel {
    setup();
    let ptx = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../metrale-comm/kernels/bf16_add.ptx"
    ))
    .unwrap();
    let ctx = Context::new(0).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let module = nccl_safe::Module::load_ptx(&ctx, &ptx).unwrap();
    let add = module.function("bf16_add_inplace").unwrap();
    let mut rng = rand::rng();
    let mut random = || -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(rng.random_range(range.clone())))
            .collect()
    };
    let (a, b) = (random(), random());
    let dst = DeviceBuffer::from_host(&ctx, &a).unwrap();
    let src = DeviceBuffer::from_host(&ctx, &b).unwrap();
    AddKernel {
        ctx,
        stream,
        module,
        add,
        a,
        b,
        dst,
        src,
    }
}

/// Points both libraries at the emulator, once, before any is opened.
fn setup() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let exe = std::env::current_exe().expect("current exe");
        let dir = exe.parent().expect("exe dir");
        let lib = [dir.join("libgpu_emu.so"), dir.join("../libgpu_emu.so")]
            .into_iter()
            .find(|p| p.exists())
            .expect("libgpu_emu.so next to the test binary: build gpu-emu first");
        // SAFETY: runs once, inside the OnceLock that every test passes
        // through before it touches a library, so no other thread of this
        // process reads the environment concurrently.
        unsafe {
            std::env::set_var("METRALE_CUDA_LIBRARY", &lib);
            std::env::set_var("METRALE_NCCL_LIBRARY", &lib);
        }
    });
}

/// Runs `f(rank)` on `n` threads and returns their results in rank order.
fn ranks<R: Send + 'static>(n: usize, f: impl Fn(usize) -> R + Send + Sync + 'static) -> Vec<R> {
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let f = Arc::clone(&f);
            std::thread::spawn(move || f(r))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

fn random_f32(n: usize) -> Vec<f32> {
    let mut rng = rand::rng();
    (0..n).map(|_| rng.random_range(-100.0f32..100.0)).collect()
}

/// Two ranks, each with the communicator `join` makes, all-reduce `n`
/// random f32 into a poisoned buffer; every element must be the sum.
fn two_rank_all_reduce(n: usize, join: fn(&Arc<Context>, &UniqueId, usize) -> Comm) {
    let id = UniqueId::new().unwrap();
    let inputs: Arc<Vec<Vec<f32>>> = Arc::new((0..2).map(|_| random_f32(n)).collect());
    let outputs = {
        let inputs = Arc::clone(&inputs);
        ranks(2, move |rank| {
            let ctx = Context::new(rank).unwrap();
            let stream = Stream::new(&ctx).unwrap();
            let comm = join(&ctx, &id, rank);
            assert_eq!((comm.rank(), comm.count(), comm.device()), (rank, 2, rank));
            let send = DeviceBuffer::from_host(&ctx, &inputs[rank]).unwrap();
            let mut recv = DeviceBuffer::<f32>::alloc(&ctx, n).unwrap();
            recv.fill_bytes(0xff).unwrap();
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &stream)
                .unwrap();
            stream.wait_until_idle(WAIT).unwrap();
            comm.async_error().unwrap();
            recv.to_host_vec().unwrap()
        })
    };
    for out in outputs {
        for (i, got) in out.iter().enumerate() {
            let want = inputs[0][i] + inputs[1][i];
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "element {i}: {got} != {want}"
            );
        }
    }
}

#[test]
fn two_rank_all_reduce_sums_every_element() {
    setup();
    assert!(device_count().unwrap() >= 2);
    two_rank_all_reduce(1000, |ctx, id, rank| {
        Comm::init_rank(ctx, id, 2, rank).unwrap()
    });
}

#[test]
fn nonblocking_comm_runs_bf16_all_reduce_and_all_gather() {
    setup();
    const N: usize = 257;
    let id = UniqueId::new().unwrap();
    let mut rng = rand::rng();
    let inputs: Arc<Vec<Vec<bf16>>> = Arc::new(
        (0..2)
            .map(|_| {
                (0..N)
                    .map(|_| bf16::from_f32(rng.random_range(-8.0f32..8.0)))
                    .collect()
            })
            .collect(),
    );
    let outputs = {
        let inputs = Arc::clone(&inputs);
        ranks(2, move |rank| {
            let ctx = Context::new(rank).unwrap();
            let stream = Stream::new(&ctx).unwrap();
            let comm = Comm::init_rank_with_deadline(&ctx, &id, 2, rank, WAIT).unwrap();
            assert!(comm.is_nonblocking());
            let send = DeviceBuffer::from_host(&ctx, &inputs[rank]).unwrap();
            let mut sum = DeviceBuffer::<bf16>::alloc(&ctx, N).unwrap();
            sum.fill_bytes(0xff).unwrap();
            let mut gathered = DeviceBuffer::<bf16>::alloc(&ctx, 2 * N).unwrap();
            gathered.fill_bytes(0xff).unwrap();
            comm.all_reduce(&send, &mut sum, ReduceOp::Sum, &stream)
                .unwrap();
            comm.all_gather(&send, &mut gathered, &stream).unwrap();
            stream.wait_until_idle(WAIT).unwrap();
            comm.async_error().unwrap();
            (sum.to_host_vec().unwrap(), gathered.to_host_vec().unwrap())
        })
    };
    for (sum, gathered) in outputs {
        for i in 0..N {
            let want = bf16::from_f32(inputs[0][i].to_f32() + inputs[1][i].to_f32());
            assert_eq!(sum[i].to_bits(), want.to_bits(), "sum element {i}");
            assert_eq!(
                gathered[i].to_bits(),
                inputs[0][i].to_bits(),
                "gather rank 0, {i}"
            );
            assert_eq!(
                gathered[N + i].to_bits(),
                inputs[1][i].to_bits(),
                "gather rank 1, {i}"
            );
        }
    }
}

#[test]
fn grouped_send_recv_ring_moves_every_element() {
    setup();
    const R: usize = 3;
    const N: usize = 100;
    let id = UniqueId::new().unwrap();
    let mut rng = rand::rng();
    let inputs: Arc<Vec<Vec<i64>>> = Arc::new(
        (0..R)
            .map(|_| (0..N).map(|_| rng.random()).collect())
            .collect(),
    );
    let outputs = {
        let inputs = Arc::clone(&inputs);
        ranks(R, move |rank| {
            let ctx = Context::new(rank).unwrap();
            let stream = Stream::new(&ctx).unwrap();
            let comm = Comm::init_rank(&ctx, &id, R, rank).unwrap();
            let send = DeviceBuffer::from_host(&ctx, &inputs[rank]).unwrap();
            let mut recv = DeviceBuffer::<i64>::alloc(&ctx, N).unwrap();
            recv.fill_bytes(0xa5).unwrap();
            group(|| {
                comm.send(&send, (rank + 1) % R, &stream)?;
                comm.recv(&mut recv, (rank + R - 1) % R, &stream)
            })
            .unwrap();
            stream.wait_until_idle(WAIT).unwrap();
            recv.to_host_vec().unwrap()
        })
    };
    for (rank, out) in outputs.iter().enumerate() {
        assert_eq!(out, &inputs[(rank + R - 1) % R], "rank {rank}");
    }
}

#[test]
fn arguments_are_checked_and_abort_refuses_later_calls() {
    setup();
    let id = UniqueId::new().unwrap();
    ranks(2, move |rank| {
        let ctx = Context::new(rank).unwrap();
        let other = Context::new(1 - rank).unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let comm = Comm::init_rank(&ctx, &id, 2, rank).unwrap();
        let a = DeviceBuffer::<f32>::from_host(&ctx, &random_f32(8)).unwrap();
        let mut b = DeviceBuffer::<f32>::alloc(&ctx, 9).unwrap();
        let mut foreign = DeviceBuffer::<f32>::alloc(&other, 8).unwrap();
        let invalid = |r: nccl_safe::Result<()>| {
            let e = r.unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        };
        invalid(comm.all_reduce(&a, &mut b, ReduceOp::Sum, &stream));
        invalid(comm.all_gather(&a, &mut b, &stream));
        invalid(comm.broadcast_in_place(&mut b, 2, &stream));
        invalid(comm.send(&a, 5, &stream));
        invalid(comm.all_reduce(&a, &mut foreign, ReduceOp::Sum, &stream));
        // SAFETY: a null pointer with a non-zero count is refused before NCCL.
        invalid(unsafe {
            comm.all_reduce_raw(
                0,
                0,
                4,
                nccl_safe::DataType::Float32,
                ReduceOp::Sum,
                stream.raw(),
            )
        });
        // Each rank aborts alone: nothing was enqueued, so no peer waits.
        let handle = comm.abort_handle();
        assert!(!handle.is_aborted());
        handle.abort().unwrap();
        handle.abort().unwrap();
        comm.abort().unwrap();
        assert!(comm.is_aborted() && handle.is_aborted());
        let e = comm
            .all_reduce(&a, &mut foreign, ReduceOp::Sum, &stream)
            .unwrap_err();
        assert!(matches!(e, Error::Aborted { .. }), "{e}");
        let e = comm.async_error().unwrap_err();
        assert!(matches!(e, Error::Aborted { .. }), "{e}");
        drop(comm);
        handle.abort().unwrap();
    });
}

#[test]
fn init_misses_its_deadline_when_a_rank_never_joins() {
    setup();
    let id = UniqueId::new().unwrap();
    let ctx = Context::new(0).unwrap();
    let after = Duration::from_millis(300);
    let e = Comm::init_rank_with_deadline(&ctx, &id, 2, 0, after).unwrap_err();
    match e {
        Error::Timeout { what, after: a } => {
            assert_eq!(what, "communicator init");
            assert_eq!(a, after);
        }
        other => panic!("expected a timeout, got {other}"),
    }
}

#[test]
fn into_blocking_keeps_ranks_and_sums_every_element() {
    setup();
    two_rank_all_reduce(333, |ctx, id, rank| {
        let parent = Comm::init_rank_with_deadline(ctx, id, 2, rank, WAIT).unwrap();
        let comm = parent.into_blocking(WAIT).unwrap();
        assert!(!comm.is_nonblocking());
        comm
    });
}

#[test]
fn into_blocking_times_out_when_a_peer_never_comes() {
    setup();
    let id = UniqueId::new().unwrap();
    let after = Duration::from_millis(300);
    let results = ranks(2, move |rank| {
        let ctx = Context::new(rank).unwrap();
        let parent = Comm::init_rank_with_deadline(&ctx, &id, 2, rank, WAIT).unwrap();
        if rank == 1 {
            // Joined the parent, never goes on; outlives rank 0's deadline.
            std::thread::sleep(after * 3);
            drop(parent);
            return None;
        }
        let start = std::time::Instant::now();
        let e = parent.into_blocking(after).unwrap_err();
        Some((e, start.elapsed()))
    });
    let (e, took) = results[0].as_ref().expect("rank 0 result");
    match e {
        Error::Timeout { what, after: a } => {
            assert_eq!(*what, "blocking communicator init");
            assert_eq!(*a, after);
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(took < &(after + Duration::from_secs(1)), "took {took:?}");
}

#[test]
fn abort_releases_a_blocking_split_waiting_for_a_peer() {
    setup();
    let id = UniqueId::new().unwrap();
    let results = ranks(2, move |rank| {
        let ctx = Context::new(rank).unwrap();
        let comm = Comm::init_rank(&ctx, &id, 2, rank).unwrap();
        if rank == 1 {
            // Never splits; outlives rank 0's abort.
            std::thread::sleep(Duration::from_secs(1));
            return None;
        }
        let abort = comm.abort_handle();
        let (tx, rx) = std::sync::mpsc::channel();
        // The split runs on its own thread so that a split the abort does
        // not release fails this test instead of hanging it.
        std::thread::spawn(move || {
            let r = comm.split(Some(0), 0).map(|c| c.is_some());
            let _ = tx.send(r);
        });
        std::thread::sleep(Duration::from_millis(200));
        abort.abort().unwrap();
        Some(rx.recv_timeout(Duration::from_secs(5)))
    });
    match results[0].as_ref().expect("rank 0 result") {
        Ok(r) => assert!(
            r.is_err(),
            "the split returned {r:?} after its parent's abort"
        ),
        Err(_) => panic!("the abort did not release the split within 5 s"),
    }
}

#[test]
fn split_groups_ranks_by_color() {
    split_by_color(false);
}

/// A non-blocking parent's split: NCCL hands the child over only after the
/// call returned (the emulator does so too), and `split` waits for it.
#[test]
fn split_of_a_non_blocking_communicator_groups_ranks_by_color() {
    split_by_color(true);
}

/// Ranks 0 and 2 form one communicator, rank 1 another, rank 3 sits out;
/// each child reduces with `Max` and is checked.
fn split_by_color(nonblocking: bool) {
    setup();
    const R: usize = 4;
    let id = UniqueId::new().unwrap();
    let barrier = Arc::new(Barrier::new(R));
    let inputs: Arc<Vec<Vec<i32>>> = Arc::new(
        (0..R)
            .map(|_| {
                (0..16)
                    .map(|_| rand::rng().random_range(-1000..1000))
                    .collect()
            })
            .collect(),
    );
    let outputs = {
        let inputs = Arc::clone(&inputs);
        ranks(R, move |rank| {
            let ctx = Context::new(rank).unwrap();
            let stream = Stream::new(&ctx).unwrap();
            let comm = if nonblocking {
                Comm::init_rank_with_deadline(&ctx, &id, R, rank, WAIT).unwrap()
            } else {
                Comm::init_rank(&ctx, &id, R, rank).unwrap()
            };
            // Ranks 0 and 2 form one communicator; rank 3 sits out.
            let color = match rank {
                3 => None,
                r => Some((r % 2) as i32),
            };
            let child = comm.split(color, rank as i32).unwrap();
            barrier.wait();
            let Some(child) = child else {
                assert_eq!(rank, 3);
                return None;
            };
            let mut buf = DeviceBuffer::from_host(&ctx, &inputs[rank]).unwrap();
            child
                .all_reduce_in_place(&mut buf, ReduceOp::Max, &stream)
                .unwrap();
            stream.wait_until_idle(WAIT).unwrap();
            Some((child.rank(), child.count(), buf.to_host_vec().unwrap()))
        })
    };
    assert!(outputs[3].is_none());
    let (r0, n0, v0) = outputs[0].clone().unwrap();
    let (r2, n2, v2) = outputs[2].clone().unwrap();
    let (r1, n1, v1) = outputs[1].clone().unwrap();
    assert_eq!((r0, n0, r2, n2, r1, n1), (0, 2, 1, 2, 0, 1));
    for i in 0..16 {
        assert_eq!(v0[i], inputs[0][i].max(inputs[2][i]), "element {i}");
        assert_eq!(v2[i], v0[i], "element {i}");
        assert_eq!(v1[i], inputs[1][i], "element {i}");
    }
}

#[test]
fn kernel_launch_events_and_graph_replay() {
    const N: usize = 300;
    let AddKernel {
        ctx,
        stream,
        module,
        add,
        a,
        b,
        dst,
        src,
    } = add_kernel(N, -4.0..4.0);
    assert!(module.function("no_such_kernel").is_err());
    let (mut p_dst, mut p_src, mut n) = (dst.device_ptr(), src.device_ptr(), N as u64);
    let launch = |s: &Stream, p_dst: &mut u64, p_src: &mut u64, n: &mut u64| {
        let mut params = [
            (p_dst as *mut u64).cast(),
            (p_src as *mut u64).cast(),
            (n as *mut u64).cast(),
        ];
        // SAFETY: three u64 parameters matching the kernel's signature; both
        // buffers hold N bf16 values and outlive the stream work.
        unsafe { add.launch((2, 1, 1), (256, 1, 1), 0, s.raw(), &mut params) }.unwrap();
    };
    let start = nccl_safe::Event::new(&ctx, true).unwrap();
    let end = nccl_safe::Event::new(&ctx, true).unwrap();
    start.record(&stream).unwrap();
    launch(&stream, &mut p_dst, &mut p_src, &mut n);
    end.record(&stream).unwrap();
    end.wait_with_deadline(WAIT).unwrap();
    assert!(end.query().unwrap());
    assert!(end.elapsed_ms(&start).unwrap() >= 0.0);
    let once = dst.to_host_vec().unwrap();
    for i in 0..N {
        let want = bf16::from_f32(a[i].to_f32() + b[i].to_f32());
        assert_eq!(once[i].to_bits(), want.to_bits(), "element {i}");
    }
    // Capture one more add and replay it twice.
    stream.begin_capture().unwrap();
    assert!(stream.is_capturing().unwrap());
    launch(&stream, &mut p_dst, &mut p_src, &mut n);
    let graph = stream.end_capture().unwrap();
    assert!(!stream.is_capturing().unwrap());
    let exec = graph.instantiate().unwrap();
    exec.launch(&stream).unwrap();
    exec.launch(&stream).unwrap();
    stream.wait_until_idle(WAIT).unwrap();
    let thrice = dst.to_host_vec().unwrap();
    for i in 0..N {
        let mut want = once[i];
        for _ in 0..2 {
            want = bf16::from_f32(want.to_f32() + b[i].to_f32());
        }
        assert_eq!(thrice[i].to_bits(), want.to_bits(), "element {i}");
    }
}

#[test]
fn cluster_launch_checks_its_dimensions_then_runs() {
    const N: usize = 500;
    let AddKernel {
        stream,
        add,
        a,
        b,
        dst,
        src,
        ..
    } = add_kernel(N, 0.5..4.0);
    assert!(nccl_safe::supports_cluster_launch(0).unwrap());
    assert!(matches!(
        nccl_safe::supports_cluster_launch(1 << 20),
        Err(Error::InvalidArgument { .. })
    ));
    let (mut p_dst, mut p_src, mut n) = (dst.device_ptr(), src.device_ptr(), N as u64);
    let mut params = [
        (&raw mut p_dst).cast(),
        (&raw mut p_src).cast(),
        (&raw mut n).cast(),
    ];
    for (grid, cluster) in [(4, 0), (4, 3), (18, 9), (6, 4)] {
        // SAFETY: three u64 parameters matching the kernel's signature; both
        // buffers hold N bf16 values and outlive the stream work.
        let r = unsafe {
            add.launch_cluster(
                (grid, 1, 1),
                (128, 1, 1),
                cluster,
                0,
                stream.raw(),
                &mut params,
            )
        };
        assert!(
            matches!(r, Err(Error::InvalidArgument { .. })),
            "grid {grid}, cluster {cluster}: {r:?}"
        );
    }
    stream.wait_until_idle(WAIT).unwrap();
    let untouched = dst.to_host_vec().unwrap();
    assert!(
        untouched
            .iter()
            .zip(&a)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "a refused launch ran"
    );
    // SAFETY: as above.
    unsafe { add.launch_cluster((4, 1, 1), (128, 1, 1), 2, 0, stream.raw(), &mut params) }.unwrap();
    stream.wait_until_idle(WAIT).unwrap();
    let sum = dst.to_host_vec().unwrap();
    for i in 0..N {
        let want = bf16::from_f32(a[i].to_f32() + b[i].to_f32());
        assert_eq!(sum[i].to_bits(), want.to_bits(), "element {i}");
    }
}

#[test]
fn programmatic_launches_run_in_stream_order_eagerly_and_in_graphs() {
    const N: usize = 700;
    let AddKernel {
        stream,
        add,
        a,
        b,
        dst,
        src,
        ..
    } = add_kernel(N, 0.5..4.0);
    let (mut p_dst, mut p_src, mut n) = (dst.device_ptr(), src.device_ptr(), N as u64);
    let mut params = [
        (&raw mut p_dst).cast(),
        (&raw mut p_src).cast(),
        (&raw mut n).cast(),
    ];
    // Each add reads what the one before it wrote: a plain launch, then
    // two programmatic ones.
    let three = |params: &mut [*mut std::ffi::c_void; 3]| {
        // SAFETY: three u64 parameters matching the kernel's signature; both
        // buffers hold N bf16 values and outlive the stream work. The kernel
        // does not wait for the launch before it (`griddepcontrol.wait`);
        // the emulator runs every launch of a stream in order, which is
        // what this test checks.
        unsafe {
            add.launch((3, 1, 1), (128, 1, 1), 0, stream.raw(), params)
                .unwrap();
            for _ in 0..2 {
                add.launch_programmatic((3, 1, 1), (128, 1, 1), 0, stream.raw(), params)
                    .unwrap();
            }
        }
    };
    let adds = |from: &[bf16], times: usize| -> Vec<u16> {
        from.iter()
            .zip(&b)
            .map(|(x, y)| {
                let mut v = *x;
                for _ in 0..times {
                    v = bf16::from_f32(v.to_f32() + y.to_f32());
                }
                v.to_bits()
            })
            .collect()
    };
    three(&mut params);
    stream.wait_until_idle(WAIT).unwrap();
    let eager = dst.to_host_vec().unwrap();
    let want = adds(&a, 3);
    for i in 0..N {
        assert_eq!(eager[i].to_bits(), want[i], "eager, element {i}");
    }
    stream.begin_capture().unwrap();
    three(&mut params);
    let exec = stream.end_capture().unwrap().instantiate().unwrap();
    exec.launch(&stream).unwrap();
    exec.launch(&stream).unwrap();
    stream.wait_until_idle(WAIT).unwrap();
    let replayed = dst.to_host_vec().unwrap();
    let want = adds(&eager, 6);
    for i in 0..N {
        assert_eq!(replayed[i].to_bits(), want[i], "replayed, element {i}");
    }
}
