//! The fused one-shot + add + norm entries that split a row over a thread
//! block cluster (`*_one_shot_add_rms_norm_cluster`), launched through the
//! real bindings: on two ranks (threads, a device each), for bf16, f16 and
//! f32, a `cuLaunchKernelEx` launch with a cluster dimension, and a plain
//! `cuLaunchKernel` one (a cluster of one), give the fused entry's x and
//! residual bit for bit, and the host reference's (the one-shot sum, then
//! `metrale_kernel_abi::norm::row`); a launch that breaks the cluster
//! contract records the bad-launch status and writes nothing; the devices
//! report cluster launch.
//!
//! The PTX is a stand-in that declares the entries (the emulator knows
//! them by name), as `one_shot_sm90.ptx` and `one_shot.ptx` do.

mod common;

use std::ffi::{CString, c_void};
use std::sync::{Barrier, Mutex};

use common::*;
use cuda_sys::{
    CUdevice_attribute, CUdeviceptr, CUfunction, CUlaunchAttribute, CUlaunchAttributeID,
    CUlaunchConfig, CUmodule, CUresult, CUstream,
};
use half::{bf16, f16};
use metrale_kernel_abi::norm as nabi;
use metrale_kernel_abi::one_shot as abi;
use rand::Rng;

const EPS: f32 = 1e-5;
const BAD_LAUNCH: u32 = abi::Status::BadLaunch as u32;

/// An element type of the entries, by its index in the ABI's lists.
#[derive(Debug, Clone, Copy)]
enum Ty {
    Bf16,
    F16,
    F32,
}

impl Ty {
    const ALL: [Ty; 3] = [Ty::Bf16, Ty::F16, Ty::F32];

    fn index(self) -> usize {
        self as usize
    }

    fn size(self) -> usize {
        match self {
            Ty::Bf16 | Ty::F16 => 2,
            Ty::F32 => 4,
        }
    }

    fn fused(self) -> &'static str {
        nabi::FUSED_ENTRIES[self.index()].0
    }

    fn cluster(self) -> &'static str {
        nabi::FUSED_CLUSTER_ENTRIES[self.index()].0
    }

    /// The value of bits `b`.
    fn value(self, b: u32) -> f32 {
        match self {
            Ty::Bf16 => bf16::from_bits(b as u16).to_f32(),
            Ty::F16 => f16::from_bits(b as u16).to_f32(),
            Ty::F32 => f32::from_bits(b),
        }
    }

    /// The bits of `v` rounded to the type (nearest even).
    fn bits(self, v: f32) -> u32 {
        match self {
            Ty::Bf16 => u32::from(bf16::from_f32(v).to_bits()),
            Ty::F16 => u32::from(f16::from_f32(v).to_bits()),
            Ty::F32 => v.to_bits(),
        }
    }

    /// Values (as bits) in device layout.
    fn bytes(self, v: &[u32]) -> Vec<u8> {
        v.iter()
            .flat_map(|&b| b.to_le_bytes()[..self.size()].to_vec())
            .collect()
    }

    /// Device bytes as values (bits).
    fn unbytes(self, b: &[u8]) -> Vec<u32> {
        b.chunks(self.size())
            .map(|c| c.iter().rev().fold(0u32, |a, &x| (a << 8) | u32::from(x)))
            .collect()
    }

    /// `n` random non-zero values in [-4, 4], as bits.
    fn random(self, n: usize) -> Vec<u32> {
        let mut rng = rand::rng();
        (0..n)
            .map(|_| {
                let mag = rng.random_range(0.01f32..4.0);
                let v = if rng.random_bool(0.5) { mag } else { -mag };
                self.bits(v)
            })
            .collect()
    }
}

/// PTX declaring the fused entries and the cluster entries of every type,
/// with their eight parameters.
fn ptx() -> CString {
    let mut t = String::from(".version 8.0\n.target sm_90\n.address_size 64\n");
    let params = " .param .u64 p0,\n .param .u64 p1,\n .param .u64 p2,\n .param .u64 p3,\n \
                  .param .u64 p4,\n .param .u64 p5,\n .param .f32 p6,\n .param .u32 p7\n";
    for ty in Ty::ALL {
        for name in [ty.fused(), ty.cluster()] {
            t.push_str(&format!(
                ".visible .entry {name}(\n{params})\n{{\n ret;\n}}\n"
            ));
        }
    }
    CString::new(t).unwrap()
}

/// The module and the function `name` of it, on the current device.
fn load(name: &str) -> (CUmodule, CUfunction) {
    let c = cuda();
    let image = ptx();
    let cname = CString::new(name).unwrap();
    let (mut m, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid out-parameters; the PTX and the name are NUL-terminated.
    unsafe {
        ck(cuda_sys::call!(c, cuModuleLoadData(&mut m, image.as_ptr().cast())).unwrap());
        ck(cuda_sys::call!(c, cuModuleGetFunction(&mut f, m, cname.as_ptr())).unwrap());
    }
    (m, f)
}

/// One rank's buffers: control block, receive buffer, host-pinned flags,
/// x, residual and weight.
struct Rank {
    ctrl: CUdeviceptr,
    rbuf: CUdeviceptr,
    flags: *mut c_void,
    x: CUdeviceptr,
    res: CUdeviceptr,
    w: CUdeviceptr,
}

impl Rank {
    /// Allocates on the current device: rows of `n` values of `ty` and a
    /// receive buffer of `world` slots of `slot` bytes a lane half.
    fn new(ty: Ty, n: usize, hidden: usize, world: usize, slot: usize) -> Rank {
        let rbytes = abi::LANES * abi::HALVES * world * slot;
        let rbuf = alloc(rbytes);
        let words = rbytes / 4;
        // SAFETY: `rbuf` holds `rbytes` bytes.
        let rc = unsafe { cuda_sys::call!(cuda(), cuMemsetD32_v2(rbuf, abi::SENTINEL, words)) };
        ck(rc.unwrap());
        let mut flags: *mut c_void = std::ptr::null_mut();
        // SAFETY: `flags` is a valid out-parameter.
        ck(unsafe { cuda_sys::call!(cuda(), cuMemAllocHost_v2(&mut flags, 8)) }.unwrap());
        Rank {
            ctrl: alloc(abi::CTRL_BYTES),
            rbuf,
            flags,
            x: alloc(n * ty.size()),
            res: alloc(n * ty.size()),
            w: alloc(hidden * ty.size()),
        }
    }

    /// A fresh control block (no status) of rank `rank` of `peers.len()`,
    /// and the flags cleared.
    fn reset(&self, rank: usize, peers: &[CUdeviceptr], slot: usize) {
        let mut ctrl = abi::Ctrl {
            flags: self.flags as u64,
            timeout_ns: 20_000_000_000,
            rank: rank as u32,
            world: peers.len() as u32,
            slot_bytes: slot as u64,
            ..Default::default()
        };
        ctrl.peer[..peers.len()].copy_from_slice(peers);
        upload(self.ctrl, &[ctrl]);
        // SAFETY: `flags` holds two words and no kernel of this rank runs.
        unsafe { self.flags.cast::<u8>().write_bytes(0, 8) };
    }

    /// The host's status word.
    fn status(&self) -> u32 {
        // SAFETY: `flags` holds the two words.
        unsafe {
            self.flags
                .cast::<u32>()
                .add(abi::FLAG_STATUS)
                .read_volatile()
        }
    }

    fn free(self) {
        for p in [self.ctrl, self.rbuf, self.x, self.res, self.w] {
            free(p);
        }
        // SAFETY: `flags` came from cuMemAllocHost_v2; no kernel uses it now.
        ck(unsafe { cuda_sys::call!(cuda(), cuMemFreeHost(self.flags)) }.unwrap());
    }
}

/// The eight arguments of a fused entry.
struct Args {
    ctrl: u64,
    x: u64,
    res: u64,
    w: u64,
    hidden: u64,
    rows: u64,
    eps: f32,
    lane: u32,
}

impl Args {
    fn of(r: &Rank, hidden: usize, rows: usize) -> Args {
        Args {
            ctrl: r.ctrl,
            x: r.x,
            res: r.res,
            w: r.w,
            hidden: hidden as u64,
            rows: rows as u64,
            eps: EPS,
            lane: abi::LANE_EAGER,
        }
    }

    /// The pointer array the launch calls take (valid while `self` is).
    fn params(&mut self) -> [*mut c_void; 8] {
        [
            (&raw mut self.ctrl).cast(),
            (&raw mut self.x).cast(),
            (&raw mut self.res).cast(),
            (&raw mut self.w).cast(),
            (&raw mut self.hidden).cast(),
            (&raw mut self.rows).cast(),
            (&raw mut self.eps).cast(),
            (&raw mut self.lane).cast(),
        ]
    }
}

/// `cuLaunchKernel` of `f` with `grid` x `block` threads.
fn launch(f: CUfunction, grid: u32, block: u32, s: CUstream, a: &mut Args) -> CUresult {
    let mut p = a.params();
    // SAFETY: `p` points at the eight arguments, which outlive the call;
    // the emulator checks the addresses they name.
    unsafe {
        cuda_sys::call!(
            cuda(),
            cuLaunchKernel(
                f,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                s,
                p.as_mut_ptr(),
                std::ptr::null_mut()
            )
        )
    }
    .unwrap()
}

/// `cuLaunchKernelEx` of `f` with cluster dimensions `cluster`, after an
/// attribute the emulator ignores (a priority).
fn launch_ex(
    f: CUfunction,
    grid: u32,
    block: u32,
    cluster: [u32; 3],
    s: CUstream,
    a: &mut Args,
) -> CUresult {
    let mut attrs = [CUlaunchAttribute::default(); 2];
    attrs[0].id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PRIORITY;
    attrs[0].value.priority = 0;
    attrs[1].id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[1].value.clusterDim.x = cluster[0];
    attrs[1].value.clusterDim.y = cluster[1];
    attrs[1].value.clusterDim.z = cluster[2];
    let config = CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: s,
        attrs: attrs.as_mut_ptr(),
        numAttrs: 2,
    };
    let mut p = a.params();
    // SAFETY: `config` and its attributes, and `p` (pointing at the eight
    // arguments), outlive the call; the emulator checks the addresses.
    unsafe {
        cuda_sys::call!(
            cuda(),
            cuLaunchKernelEx(&config, f, p.as_mut_ptr(), std::ptr::null_mut())
        )
    }
    .unwrap()
}

/// The host reference: `(x, residual)` after the fused call on every
/// rank, from the ranks' inputs `xs`, the residual `res0` and weight `w`.
fn reference(ty: Ty, xs: &[Vec<u32>], res0: &[u32], w: &[u32], hidden: usize) -> [Vec<u32>; 2] {
    let n = res0.len();
    let round = |v: f32| ty.value(ty.bits(v));
    let sum: Vec<f32> = (0..n)
        .map(|i| {
            let s = xs
                .iter()
                .skip(1)
                .fold(ty.value(xs[0][i]), |a, x| a + ty.value(x[i]));
            round(s)
        })
        .collect();
    let w: Vec<f32> = w.iter().map(|&b| ty.value(b)).collect();
    let mut res: Vec<f32> = res0.iter().map(|&b| ty.value(b)).collect();
    let mut out = vec![0f32; n];
    for row in 0..n / hidden {
        let at = row * hidden..(row + 1) * hidden;
        nabi::row(
            &sum[at.clone()],
            &mut res[at.clone()],
            &w,
            EPS,
            ty.size(),
            round,
            &mut out[at],
        );
    }
    [
        out.iter().map(|&v| ty.bits(v)).collect(),
        res.iter().map(|&v| ty.bits(v)).collect(),
    ]
}

/// Asserts `got` equals `want` bit for bit, naming the first difference.
#[track_caller]
fn same_bits(got: &[u32], want: &[u32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: element {i} of {} is {:#x}, want {:#x}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

#[test]
fn the_devices_report_cluster_launch() {
    let c = cuda();
    for dev in 0..2 {
        let mut v = -1;
        // SAFETY: `v` is a valid out-parameter.
        ck(unsafe {
            cuda_sys::call!(
                c,
                cuDeviceGetAttribute(
                    &mut v,
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH,
                    dev
                )
            )
        }
        .unwrap());
        assert_eq!(v, 1, "device {dev}");
    }
}

/// How a call of the row is launched, on every rank.
#[derive(Debug, Clone, Copy)]
enum How {
    /// The fused entry, `cuLaunchKernel`, a block of `threads(hidden)`.
    Fused,
    /// The cluster entry, `cuLaunchKernelEx` with a cluster of `c`.
    Cluster(u32),
    /// The cluster entry, `cuLaunchKernel` (a cluster of one).
    ClusterPlain,
}

#[test]
fn a_cluster_launch_computes_the_fused_entry_bit_for_bit() {
    const WORLD: usize = 2;
    // (hidden, rows): one chunk a thread and a cluster's rows; rows of
    // 16 KiB spread over 512 threads.
    let shapes = [(40usize, 3usize), (1024, 8), (8192, 4)];
    for ty in Ty::ALL {
        for &(hidden, rows) in &shapes {
            let n = hidden * rows;
            let slot = (n * ty.size()).next_multiple_of(abi::UNIT_BYTES);
            let xs: Vec<Vec<u32>> = (0..WORLD).map(|_| ty.random(n)).collect();
            let res0s: Vec<Vec<u32>> = (0..WORLD).map(|_| ty.random(n)).collect();
            let w = ty.random(hidden);
            let threads = nabi::threads(hidden, ty.size());
            let rbufs: Vec<Mutex<u64>> = (0..WORLD).map(|_| Mutex::new(0)).collect();
            let met = Barrier::new(WORLD);
            ranks(WORLD, |r| {
                let (m, fused) = load(ty.fused());
                let (m2, cluster) = load(ty.cluster());
                let rank = Rank::new(ty, n, hidden, WORLD, slot);
                *rbufs[r].lock().unwrap() = rank.rbuf;
                met.wait();
                let peers: Vec<u64> = rbufs.iter().map(|b| *b.lock().unwrap()).collect();
                rank.reset(r, &peers, slot);
                upload(rank.w, &ty.bytes(&w));
                let s = stream();
                let want = reference(ty, &xs, &res0s[r], &w, hidden);
                let grid = rows.min(32) as u32;
                let hows = [
                    How::Fused,
                    How::Cluster(1),
                    How::Cluster(2),
                    How::Cluster(4),
                    How::Cluster(8),
                    How::ClusterPlain,
                ];
                let mut first: Option<[Vec<u32>; 2]> = None;
                for how in hows {
                    let what = format!("{ty:?} {rows} x {hidden}, rank {r}, {how:?}");
                    upload(rank.x, &ty.bytes(&xs[r]));
                    upload(rank.res, &ty.bytes(&res0s[r]));
                    let mut a = Args::of(&rank, hidden, rows);
                    let rc = match how {
                        How::Fused => launch(fused, grid, threads, s, &mut a),
                        How::ClusterPlain => launch(cluster, grid, threads, s, &mut a),
                        How::Cluster(c) => {
                            // The row's threads spread over the cluster's
                            // blocks; a grid of whole clusters.
                            let block = (threads / c).next_multiple_of(nabi::WARP);
                            let grid = grid.next_multiple_of(c);
                            launch_ex(cluster, grid, block, [c, 1, 1], s, &mut a)
                        }
                    };
                    assert_eq!(rc, CUresult::CUDA_SUCCESS, "{what}");
                    sync(s);
                    assert_eq!(rank.status(), 0, "{what}: a status was recorded");
                    let got = [
                        ty.unbytes(&download::<u8>(rank.x, n * ty.size())),
                        ty.unbytes(&download::<u8>(rank.res, n * ty.size())),
                    ];
                    same_bits(
                        &got[0],
                        &want[0],
                        &format!("{what}: x against the reference"),
                    );
                    same_bits(
                        &got[1],
                        &want[1],
                        &format!("{what}: residual against the reference"),
                    );
                    match &first {
                        None => first = Some(got),
                        Some(f) => {
                            same_bits(
                                &got[0],
                                &f[0],
                                &format!("{what}: x against the fused entry"),
                            );
                            same_bits(
                                &got[1],
                                &f[1],
                                &format!("{what}: residual against the fused entry"),
                            );
                        }
                    }
                    // Both ranks' calls are done before the inputs change.
                    met.wait();
                }
                destroy_stream(s);
                met.wait();
                rank.free();
                // SAFETY: the modules are this thread's; no launch of them runs.
                unsafe {
                    ck(cuda_sys::call!(cuda(), cuModuleUnload(m)).unwrap());
                    ck(cuda_sys::call!(cuda(), cuModuleUnload(m2)).unwrap());
                }
            });
        }
    }
}

#[test]
fn a_launch_that_breaks_the_cluster_contract_records_the_bad_launch_status() {
    let ty = Ty::Bf16;
    let (hidden, rows) = (1024usize, 8usize);
    let n = hidden * rows;
    let slot = n * ty.size();
    set_device(0);
    let (m, f) = load(ty.cluster());
    let rank = Rank::new(ty, n, hidden, 2, slot);
    upload(rank.w, &ty.bytes(&ty.random(hidden)));
    let s = stream();
    let x0 = ty.random(n);
    let res0 = ty.random(n);
    // (grid, block, cluster; None: cuLaunchKernel).
    let bad: [(u32, u32, Option<[u32; 3]>); 9] = [
        (6, 64, Some([4, 1, 1])),  // the grid is not whole clusters
        (8, 32, Some([9, 1, 1])),  // more than 8 blocks a cluster
        (8, 32, Some([0, 1, 1])),  // no blocks a cluster
        (8, 64, Some([2, 2, 1])),  // a cluster not (c, 1, 1)
        (8, 64, Some([2, 1, 2])),  // as above
        (4, 256, Some([4, 1, 1])), // 1024 threads a cluster
        (4, 48, Some([2, 1, 1])),  // a block of part of a warp
        (8, 1024, None),           // 1024 threads, a cluster of one
        (8, 100, None),            // a block of part of a warp
    ];
    for (grid, block, cluster) in bad {
        let what = format!("grid {grid}, block {block}, cluster {cluster:?}");
        // Rank 0 of 2, its own buffer standing for the peer's: a refused
        // launch reaches neither.
        rank.reset(0, &[rank.rbuf, rank.rbuf], slot);
        upload(rank.x, &ty.bytes(&x0));
        upload(rank.res, &ty.bytes(&res0));
        let mut a = Args::of(&rank, hidden, rows);
        let rc = match cluster {
            Some(c) => launch_ex(f, grid, block, c, s, &mut a),
            None => launch(f, grid, block, s, &mut a),
        };
        assert_eq!(rc, CUresult::CUDA_SUCCESS, "{what}: the launch itself");
        sync(s);
        assert_eq!(rank.status(), BAD_LAUNCH, "{what}: the host's status");
        let ctrl = download::<abi::Ctrl>(rank.ctrl, 1)[0];
        assert_eq!(ctrl.failed, BAD_LAUNCH, "{what}: the control block's");
        assert_eq!(
            ctrl.lane[0],
            abi::Lane::default(),
            "{what}: the lane was claimed"
        );
        let x = ty.unbytes(&download::<u8>(rank.x, n * ty.size()));
        let res = ty.unbytes(&download::<u8>(rank.res, n * ty.size()));
        same_bits(&x, &x0, &format!("{what}: x written"));
        same_bits(&res, &res0, &format!("{what}: residual written"));
    }
    destroy_stream(s);
    rank.free();
    // SAFETY: the module is this thread's; no launch of it runs.
    ck(unsafe { cuda_sys::call!(cuda(), cuModuleUnload(m)) }.unwrap());
}
