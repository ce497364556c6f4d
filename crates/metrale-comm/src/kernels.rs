//! The project's GPU kernels, as committed PTX, and their launch contracts.
//!
//! The PTX is built from `kernels/*.cu` by `cargo xtask ptx` (nvcc
//! `--ptx -arch=compute_80`) and loaded at run time with `cuModuleLoadData`,
//! so the driver JIT-compiles it for whatever GPU it finds.
//!
//! Requirements, decided by the PTX's `.target` and `.version` lines:
//! - GPU: compute capability 8.0 or newer (A100, A10, L4, L40, H100, H200,
//!   B200, ...): sm_80 is the first architecture with native bf16.
//! - Driver: PTX ISA 7.0, which CUDA 11.0 introduced, so driver r450
//!   (450.36.06 on Linux) or newer. nvcc 13.0 writes ISA 9.0 (driver r580);
//!   `cargo xtask ptx` relabels it 7.0 and has `ptxas` confirm that every
//!   instruction exists in ISA 7.0 for sm_80.
//! - [`ONE_SHOT_SM90_PTX`] only (the fused entries over thread block
//!   clusters): compute capability 9.0 and PTX ISA 7.8 (driver r520); it is
//!   loaded only where `nccl_safe::supports_cluster_launch` says yes.
//!
//! The kernels' ABI (control block, statuses, constants, launch contracts)
//! is defined once, in the `metrale-kernel-abi` crate ([`abi`]), which
//! generates the `kernels/abi.h` the `.cu` files include; both PTX modules
//! carry that ABI's hash ([`check_ptx_abi`]).
//!
//! Invariants: [`BF16_ADD_PTX`] defines the entry [`BF16_ADD_NAME`] with the
//! parameters `(bf16* dst, const bf16* src, u64 n)`, and accepts at most
//! [`BF16_ADD_BLOCK`] threads per block; [`launch_config`] never exceeds
//! that, and never returns an empty grid. [`ONE_SHOT_PTX`] defines one
//! entry per type [`one_shot_name`] names (bf16, f16, f32), each with
//! `(OsCtrl* ctrl, T* data, u64 n, u32 lane)`, at most [`ONE_SHOT_BLOCK`]
//! threads per block; [`one_shot_launch_config`] never returns more than
//! [`ONE_SHOT_MAX_GRID`] blocks, nor an empty grid, and 32 to
//! [`ONE_SHOT_BLOCK`] threads a block; [`one_shot_sum`] is their
//! arithmetic on the host.

pub use metrale_kernel_abi as abi;
/// What a one-shot kernel recorded: the status a `FailureKind::OneShot`
/// carries.
pub use metrale_kernel_abi::one_shot::Status as OneShotStatus;

/// PTX of `bf16_add_inplace`, `dst[i] = bf16(float(dst[i]) + float(src[i]))`
/// rounded to nearest even: the arithmetic NCCL uses for a two-rank bf16
/// sum.
///
/// Parameters, in order: `dst` (device address of `n` bf16 values, read and
/// written), `src` (device address of `n` bf16 values, read; equal to `dst`
/// or not overlapping it), `n` (`u64` element count, may be 0). When both
/// addresses are 16-byte aligned it moves 8 values per load; otherwise one.
pub const BF16_ADD_PTX: &str = include_str!("../kernels/bf16_add.ptx");

/// The entry point's name in [`BF16_ADD_PTX`] (`extern "C"`, unmangled).
pub const BF16_ADD_NAME: &str = abi::add::NAME;

/// Threads per block for `bf16_add_inplace`; also the most it accepts
/// (`__launch_bounds__`).
pub const BF16_ADD_BLOCK: u32 = abi::add::BLOCK;

/// The largest grid [`launch_config`] returns: 8 blocks for each of the 132
/// SMs of an H100/H200, enough to keep any current GPU's memory busy; the
/// kernel's loops are grid-stride, so a smaller grid still covers every
/// element.
pub const BF16_ADD_MAX_GRID: u32 = 132 * 8;

/// PTX of the one-shot all-reduce over peer memory, one entry per type
/// ([`BF16_ONE_SHOT_NAME`], [`F16_ONE_SHOT_NAME`], [`F32_ONE_SHOT_NAME`]:
/// one protocol, layout and bounds, in `kernels/one_shot.cu` and
/// `nccl_backend/one_shot.rs`). Their result is [`one_shot_sum`].
///
/// Parameters of every entry, in order: `ctrl` (device address of the
/// rank's 136-byte control block), `data` (device address of `n` values of
/// the entry's type, reduced in place), `n` (`u64`, `1..=slot_bytes /
/// size`), `lane` (`u32`: 0 eager, 1 captured into a graph). A control
/// block's slot is at most [`ONE_SHOT_MAX_SLOT_BYTES`].
pub const ONE_SHOT_PTX: &str = include_str!("../kernels/one_shot.ptx");

/// PTX of the fused one-shot entries built for compute capability 9.0 and
/// newer (`one_shot.cu` with `OS_CLUSTER`, `compute_90`, ISA 7.8, so driver
/// r520 or newer): `{bf16,f16,f32}_one_shot_add_rms_norm_cluster`
/// ([`crate::norm::fused_cluster_name`]), the fused entries of
/// [`ONE_SHOT_PTX`] with a row spread over a thread block cluster. Loaded
/// only on such devices.
pub const ONE_SHOT_SM90_PTX: &str = include_str!("../kernels/one_shot_sm90.ptx");

/// The bf16 entry point's name in [`ONE_SHOT_PTX`].
pub const BF16_ONE_SHOT_NAME: &str = abi::one_shot::ENTRIES[0].0;

/// The f16 entry point's name in [`ONE_SHOT_PTX`].
pub const F16_ONE_SHOT_NAME: &str = abi::one_shot::ENTRIES[1].0;

/// The f32 entry point's name in [`ONE_SHOT_PTX`].
pub const F32_ONE_SHOT_NAME: &str = abi::one_shot::ENTRIES[2].0;

/// The entry points of [`ONE_SHOT_PTX`], by the type each all-reduces.
pub const ONE_SHOT_ENTRIES: [(nccl_safe::DataType, &str); 3] = [
    (nccl_safe::DataType::Bfloat16, BF16_ONE_SHOT_NAME),
    (nccl_safe::DataType::Float16, F16_ONE_SHOT_NAME),
    (nccl_safe::DataType::Float32, F32_ONE_SHOT_NAME),
];

/// The entry point in [`ONE_SHOT_PTX`] that all-reduces `dtype`, `None`
/// for a type the one-shot path does not serve (it takes NCCL's).
pub fn one_shot_name(dtype: nccl_safe::DataType) -> Option<&'static str> {
    ONE_SHOT_ENTRIES
        .iter()
        .find(|(t, _)| *t == dtype)
        .map(|(_, name)| *name)
}

/// Threads per block for the one-shot kernels, also their most.
pub const ONE_SHOT_BLOCK: u32 = abi::one_shot::BLOCK;

/// The most blocks a one-shot launch uses: a call spins while it waits for
/// its peers, so it must never fill the GPU (two lanes' calls, NCCL's
/// kernels and the engine's must fit beside it); 32 blocks of 512 threads
/// are 8 of an H200's 132 SMs' worth of threads.
pub const ONE_SHOT_MAX_GRID: u32 = 32;

/// The largest slot a one-shot control block may name (`OS_MAX_SLOT`): the
/// kernels' offsets in a receive buffer are 32-bit, and refuse a launch on
/// a larger one with the bad-launch status.
pub const ONE_SHOT_MAX_SLOT_BYTES: usize = abi::one_shot::MAX_SLOT_BYTES;

/// The word every 32-bit word of a one-shot receive buffer holds outside a
/// call (the bf16 or f16 pair (+0.0, -0.0), the f32 -0.0): "not arrived".
pub const ONE_SHOT_SENTINEL: u32 = abi::one_shot::SENTINEL;

/// The 64-bit words of a one-shot control block ([`abi::one_shot::Ctrl`]).
pub const ONE_SHOT_CTRL_WORDS: usize = abi::one_shot::CTRL_WORDS;

/// The 32-bit words of one rank's one-shot receive buffer: 2 lanes x 2
/// halves x `world` slots of `slot_bytes` (a multiple of 16).
pub fn one_shot_recv_words(world: usize, slot_bytes: usize) -> usize {
    abi::one_shot::recv_bytes(world, slot_bytes) / 4
}

/// The control block of rank `rank` of `peers.len()` (2 to 8), as the host
/// writes it before the first call ([`abi::one_shot::Ctrl`], the layout
/// `one_shot.cu`'s `OsCtrl` is generated from; its two lanes start free at
/// epoch 0): `peers[p]` is
/// rank `p`'s receive buffer as mapped on this rank, `flags` the device
/// address of two host-pinned `u32` words (abort, status), `timeout_ns` how
/// long a thread may spin; no status recorded yet. `None` for a world
/// outside 2 to 8, or a slot that is not a multiple of 16 bytes or is
/// larger than [`ONE_SHOT_MAX_SLOT_BYTES`].
pub fn one_shot_ctrl(
    peers: &[u64],
    flags: u64,
    timeout_ns: u64,
    rank: usize,
    slot_bytes: usize,
) -> Option<[u64; ONE_SHOT_CTRL_WORDS]> {
    abi::one_shot::Ctrl::new(peers, flags, timeout_ns, rank, slot_bytes).map(|c| c.to_words())
}

/// Whether `ptx` was compiled against this build's kernel ABI (the
/// [`abi::PTX_ABI_SYMBOL`] global it carries); `Err` says what it found.
pub fn check_ptx_abi(ptx: &str) -> Result<(), String> {
    let want = abi::abi_hash();
    match abi::ptx_abi(ptx) {
        Some(got) if got == want => Ok(()),
        Some(got) => Err(format!(
            "the PTX was built against kernel ABI {got:#018x}, this build's is {want:#018x}: \
             rebuild it with `cargo xtask ptx`"
        )),
        None => Err(format!(
            "the PTX carries no `{}`: it was built before the kernel ABI was exported, \
             or not from this project's kernels",
            abi::PTX_ABI_SYMBOL
        )),
    }
}

/// Grid and block for a one-shot call of `bytes` (of any type): one thread
/// per 16 bytes; a call of at most [`ONE_SHOT_BLOCK`] threads' worth is one
/// block of that many threads rounded up to a warp (a few tens of
/// nanoseconds faster than 512 on one H200: decision 0010), larger ones
/// [`ONE_SHOT_BLOCK`] threads per block, up to [`ONE_SHOT_MAX_GRID`]
/// blocks.
pub fn one_shot_launch_config(bytes: u64) -> ((u32, u32, u32), (u32, u32, u32)) {
    let units = bytes.div_ceil(16).max(1);
    if units <= u64::from(ONE_SHOT_BLOCK) {
        // At most ONE_SHOT_BLOCK (512), a multiple of 32: within u32.
        let threads = units.next_multiple_of(32) as u32;
        return ((1, 1, 1), (threads, 1, 1));
    }
    let blocks = units
        .div_ceil(u64::from(ONE_SHOT_BLOCK))
        .clamp(1, u64::from(ONE_SHOT_MAX_GRID));
    let blocks = u32::try_from(blocks).unwrap_or(ONE_SHOT_MAX_GRID);
    ((blocks, 1, 1), (ONE_SHOT_BLOCK, 1, 1))
}

/// The NaN the GPU's f32 arithmetic returns (PTX: "canonical NaN").
const CANONICAL_NAN: f32 = f32::from_bits(0x7FFF_FFFF);

/// An element type the one-shot kernels reduce: bf16, f16 and f32 (the
/// trait is sealed).
pub trait OneShotElement: nccl_safe::Element + sealed::Sealed {
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;
    /// `x` rounded to the type, to nearest even.
    fn from_f32(x: f32) -> Self;
    /// The value's bits, in the low bits of a `u32`.
    fn to_bits32(self) -> u32;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
    impl Sealed for f32 {}
}

macro_rules! half_element {
    ($($t:ty),*) => {$(
        impl OneShotElement for $t {
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            fn from_f32(x: f32) -> Self {
                <$t>::from_f32(x)
            }
            fn to_bits32(self) -> u32 {
                u32::from(self.to_bits())
            }
        }
    )*};
}

half_element!(half::bf16, half::f16);

impl OneShotElement for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_bits32(self) -> u32 {
        self.to_bits()
    }
}

/// The one-shot all-reduce's result for `inputs` (rank order), as the
/// kernels compute it on every rank: per element, the f32 sum
/// `((v0 + v1) + v2) + ...` rounded once to the type (nearest even; f32
/// needs no rounding), where every 32-bit word of an input whose bits are
/// [`ONE_SHOT_SENTINEL`] counts as 0: that word is the kernels' "not
/// arrived" mark. For bf16 and f16 that word is a pair of elements `(2j,
/// 2j + 1)` (indices from the start of the call, or of its chunk; chunks
/// start at even indices) holding `(+0.0, -0.0)`, which counts as `(+0.0,
/// +0.0)`; for f32 it is -0.0, which counts as +0.0. A NaN sum is the
/// GPU's canonical NaN (f32 bits `0x7FFF_FFFF`, bf16 and f16 `0x7FFF`),
/// whatever the inputs' NaNs were. Inputs of unequal length are an error.
///
/// ```
/// use metrale_comm::kernels::one_shot_sum;
/// let s = one_shot_sum(&[vec![f32::INFINITY, 1.5], vec![f32::NEG_INFINITY, 2.0]]).unwrap();
/// assert_eq!((s[0].to_bits(), s[1]), (0x7FFF_FFFF, 3.5));
/// ```
pub fn one_shot_sum<T: OneShotElement>(inputs: &[Vec<T>]) -> Result<Vec<T>, String> {
    let mut sum = OneShotSum::new();
    for v in inputs {
        sum.add(v)?;
    }
    Ok(sum.finish())
}

/// [`one_shot_sum`] one rank's input at a time, in rank order, for inputs
/// too large to hold all at once: the same arithmetic, in f32 until
/// [`OneShotSum::finish`] rounds.
#[derive(Debug, Clone, Default)]
pub struct OneShotSum<T> {
    acc: Vec<f32>,
    ranks: usize,
    _type: std::marker::PhantomData<T>,
}

impl<T: OneShotElement> OneShotSum<T> {
    /// No rank added yet.
    pub fn new() -> Self {
        OneShotSum {
            acc: Vec::new(),
            ranks: 0,
            _type: std::marker::PhantomData,
        }
    }

    /// Adds the next rank's input; one of another length than the first's
    /// is an error.
    pub fn add(&mut self, input: &[T]) -> Result<(), String> {
        if self.ranks > 0 && input.len() != self.acc.len() {
            return Err("inputs of unequal length".into());
        }
        if self.ranks == 0 {
            // -0.0 is the identity of f32 addition (+0.0 is not: +0.0 +
            // -0.0 is +0.0), so the first rank's values land unchanged.
            self.acc = vec![-0.0; input.len()];
        }
        // Every 32-bit word holding the sentinel counts as +0.0 (a tail
        // element of a 16-bit type pairs with +0.0, as the kernels pad).
        let per_word = 4 / T::DATA_TYPE.size();
        for (word, acc) in input.chunks(per_word).zip(self.acc.chunks_mut(per_word)) {
            // One f32, or a 16-bit pair with the even element low.
            let bits = word[0].to_bits32() | word.get(1).map_or(0, |x| x.to_bits32() << 16);
            let arrived = bits != ONE_SHOT_SENTINEL;
            for (a, x) in acc.iter_mut().zip(word) {
                *a += if arrived { x.to_f32() } else { 0.0 };
            }
        }
        self.ranks += 1;
        Ok(())
    }

    /// The sums, rounded once to the type. The GPU's f32 add returns its
    /// canonical NaN, whatever the operands' payloads (a call has at least
    /// two ranks: one add), so a NaN sum is that NaN.
    pub fn finish(self) -> Vec<T> {
        self.acc
            .into_iter()
            .map(|a| T::from_f32(if a.is_nan() { CANONICAL_NAN } else { a }))
            .collect()
    }
}

/// Launches the bf16 add kernel ([`BF16_ADD_NAME`]): `dst[i] += src[i]`
/// for `i < n`, on [`launch_config`]'s grid.
///
/// # Safety
/// `kernel` takes `(bf16* dst, const bf16* src, u64 n)`; `dst` and `src` are
/// device memory of `ctx` valid for `n` elements; `stream` is a live stream of
/// `ctx`.
pub unsafe fn launch_add(
    ctx: &nccl_safe::Context,
    kernel: cuda_sys::CUfunction,
    dst: u64,
    src: u64,
    n: u64,
    stream: cuda_sys::CUstream,
) -> nccl_safe::Result<()> {
    let (grid, block) = launch_config(n);
    let (mut dst, mut src, mut n) = (dst, src, n);
    let mut params = [
        (&mut dst as *mut u64).cast::<std::ffi::c_void>(),
        (&mut src as *mut u64).cast::<std::ffi::c_void>(),
        (&mut n as *mut u64).cast::<std::ffi::c_void>(),
    ];
    // SAFETY: the parameters match the kernel's signature and live through
    // the call, which copies them; the rest is this function's contract.
    unsafe { nccl_safe::launch_raw(ctx, kernel, grid, block, 0, stream, &mut params) }
}

/// Launches a one-shot kernel (`kernel`, the entry [`one_shot_name`] names
/// for `dtype` in [`ONE_SHOT_PTX`]) on `n` values of `dtype` at `data`, on
/// lane `lane`, on [`one_shot_launch_config`]'s grid.
///
/// # Safety
/// `kernel` is the entry for `dtype`; `data` is device memory of the
/// kernel's context valid for `n` values of `dtype` until the work
/// completes, `ctrl` a control block written as
/// [`one_shot_ctrl`] lays it out, whose receive buffers stay allocated and
/// mapped until the work completes, `stream` a live stream of that
/// context.
pub unsafe fn launch_one_shot(
    kernel: &nccl_safe::Function,
    ctrl: u64,
    data: u64,
    (n, dtype): (usize, nccl_safe::DataType),
    lane: u32,
    stream: cuda_sys::CUstream,
) -> nccl_safe::Result<()> {
    let (grid, block) = one_shot_launch_config((n * dtype.size()) as u64);
    let (mut ctrl, mut data, mut n, mut lane) = (ctrl, data, n as u64, lane);
    let mut params = [
        (&mut ctrl as *mut u64).cast::<std::ffi::c_void>(),
        (&mut data as *mut u64).cast::<std::ffi::c_void>(),
        (&mut n as *mut u64).cast::<std::ffi::c_void>(),
        (&mut lane as *mut u32).cast::<std::ffi::c_void>(),
    ];
    // SAFETY: the parameters match the kernel's signature and live through
    // the call, which copies them; the rest is this function's contract.
    unsafe { kernel.launch(grid, block, 0, stream, &mut params) }
}

/// bf16 values per vectorised (16-byte) load.
const VALUES_PER_LOAD: u64 = abi::add::PER_LOAD as u64;

/// Grid and block dimensions, `((gx, gy, gz), (bx, by, bz))`, for adding `n`
/// values with `bf16_add_inplace`: one thread per 8 values, 256 threads per
/// block, at most [`BF16_ADD_MAX_GRID`] blocks and at least one.
pub(crate) fn launch_config(n: u64) -> ((u32, u32, u32), (u32, u32, u32)) {
    let threads = n.div_ceil(VALUES_PER_LOAD);
    let blocks = threads
        .div_ceil(u64::from(BF16_ADD_BLOCK))
        .clamp(1, u64::from(BF16_ADD_MAX_GRID));
    // The clamp keeps `blocks` within u32.
    let blocks = u32::try_from(blocks).unwrap_or(BF16_ADD_MAX_GRID);
    ((blocks, 1, 1), (BF16_ADD_BLOCK, 1, 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_defines_the_entry_for_sm80_at_isa_7_0() {
        let lines: Vec<&str> = BF16_ADD_PTX.lines().map(str::trim).collect();
        assert!(
            lines.contains(&".version 7.0"),
            "PTX ISA changed: update the driver docs"
        );
        assert!(lines.contains(&".target sm_80"));
        assert!(lines.contains(&".address_size 64"));
        let entry = format!(".visible .entry {BF16_ADD_NAME}(");
        assert!(lines.contains(&entry.as_str()), "no entry {BF16_ADD_NAME}");
        let params = lines
            .iter()
            .filter(|l| l.starts_with(&format!(".param .u64 {BF16_ADD_NAME}_param_")))
            .count();
        assert_eq!(params, 3, "expected (dst, src, n)");
        assert!(lines.contains(&format!(".maxntid {BF16_ADD_BLOCK}, 1, 1").as_str()));
    }

    #[test]
    fn the_committed_header_is_the_abi_crates() {
        assert_eq!(
            include_str!("../kernels/abi.h"),
            abi::cuda_header(),
            "kernels/abi.h is stale: run `cargo xtask ptx`"
        );
    }

    #[test]
    fn the_committed_ptx_was_built_against_this_abi() {
        for (name, ptx) in [
            ("bf16_add", BF16_ADD_PTX),
            ("one_shot", ONE_SHOT_PTX),
            ("add_rms_norm", crate::norm::ADD_RMS_NORM_PTX),
        ] {
            if let Err(e) = check_ptx_abi(ptx) {
                panic!("{name}.ptx: {e}");
            }
        }
        assert!(check_ptx_abi(".version 7.0\n").is_err());
        let other = BF16_ADD_PTX.replace(
            &abi::abi_hash().to_string(),
            &(abi::abi_hash() ^ 1).to_string(),
        );
        assert!(check_ptx_abi(&other).is_err(), "another ABI's PTX");
    }

    #[test]
    fn the_kernel_sources_take_their_abi_from_the_header() {
        for (name, src) in [
            ("bf16_add.cu", include_str!("../kernels/bf16_add.cu")),
            ("one_shot.cu", include_str!("../kernels/one_shot.cu")),
            (
                "add_rms_norm.cu",
                include_str!("../kernels/add_rms_norm.cu"),
            ),
        ] {
            assert!(
                src.contains("#include \"abi.h\""),
                "{name} does not include abi.h"
            );
            assert!(
                src.contains("metrale_kernel_abi = METRALE_KERNEL_ABI;"),
                "{name} does not export the ABI hash"
            );
            for line in src.lines() {
                let l = line.trim_start();
                assert!(
                    !(l.starts_with("#define OS_") || l.starts_with("#define BF16_ADD_")),
                    "{name} defines an ABI constant itself: {line}"
                );
                assert!(
                    !(l.starts_with("struct OsCtrl") || l.starts_with("struct OsLane")),
                    "{name} declares an ABI struct itself: {line}"
                );
            }
        }
    }

    #[test]
    fn ptx_rounds_to_nearest_even() {
        assert!(BF16_ADD_PTX.contains("cvt.rn.bf16x2.f32"));
        assert!(BF16_ADD_PTX.contains("cvt.rn.bf16.f32"));
        assert!(!BF16_ADD_PTX.contains("cvt.rz."));
    }

    #[test]
    fn launch_config_covers_every_element() {
        for n in [
            0u64,
            1,
            7,
            8,
            9,
            2047,
            2048,
            2049,
            1 << 20,
            (1 << 20) + 3,
            u64::from(u32::MAX) * 8 + 5,
            u64::MAX,
        ] {
            let ((gx, gy, gz), (bx, by, bz)) = launch_config(n);
            assert_eq!((gy, gz, by, bz), (1, 1, 1, 1), "n = {n}");
            assert_eq!(bx, BF16_ADD_BLOCK, "n = {n}");
            assert!((1..=BF16_ADD_MAX_GRID).contains(&gx), "n = {n}: grid {gx}");
            let threads = u64::from(gx) * u64::from(bx);
            // Either one thread per 8 values, or the capped grid strides.
            assert!(
                threads * 8 >= n || gx == BF16_ADD_MAX_GRID,
                "n = {n}: grid {gx} leaves elements to no thread"
            );
            // No wholly idle block below the cap.
            if gx > 1 && gx < BF16_ADD_MAX_GRID {
                assert!(
                    (threads - u64::from(bx)) * 8 < n,
                    "n = {n}: grid {gx} too big"
                );
            }
        }
    }

    #[test]
    fn one_shot_ptx_defines_the_entries() {
        use nccl_safe::DataType;
        let lines: Vec<&str> = ONE_SHOT_PTX.lines().map(str::trim).collect();
        assert!(lines.contains(&".version 7.0") && lines.contains(&".target sm_80"));
        for (dtype, name) in ONE_SHOT_ENTRIES {
            assert_eq!(one_shot_name(dtype), Some(name));
            let entry = format!(".visible .entry {name}(");
            assert!(lines.contains(&entry.as_str()), "no entry {name}");
            let param = |ty: &str, i: usize| format!(".param .{ty} {name}_param_{i}");
            for (i, ty) in ["u64", "u64", "u64", "u32"].iter().enumerate() {
                assert!(
                    lines.iter().any(|l| l.starts_with(&param(ty, i))),
                    "{name}: parameter {i} is not .{ty}"
                );
            }
        }
        assert_eq!(one_shot_name(DataType::Float64), None);
        // Three plain entries and three fused ones (crate::norm).
        let bound = format!(".maxntid {ONE_SHOT_BLOCK}, 1, 1");
        assert_eq!(lines.iter().filter(|l| **l == bound).count(), 6);
        // Two blocks an SM: at most 64 registers a thread.
        assert_eq!(lines.iter().filter(|l| **l == ".minnctapersm 2").count(), 6);
        assert!(ONE_SHOT_PTX.contains("cvt.rn.bf16.f32"));
        assert!(ONE_SHOT_PTX.contains("cvt.rn.f16.f32"));
        // Plain peer loads and stores only: no multicast objects, no multimem.
        assert!(!ONE_SHOT_PTX.contains("multimem"));
        assert!(ONE_SHOT_PTX.contains("%globaltimer"));
    }

    #[test]
    fn one_shot_ctrl_refuses_what_the_kernel_refuses() {
        let peers = [0x1000, 0x2000];
        let ctrl = one_shot_ctrl(&peers, 0x3000, 7, 1, 1 << 20).expect("a valid block");
        assert_eq!(&ctrl[..2], &peers);
        assert_eq!(
            (ctrl[8], ctrl[9], ctrl[10], ctrl[11]),
            (0x3000, 7, 1 | 2 << 32, 1 << 20)
        );
        assert!(ctrl[12..].iter().all(|&w| w == 0), "lanes free, no status");
        assert!(one_shot_ctrl(&peers, 0, 0, 0, ONE_SHOT_MAX_SLOT_BYTES).is_some());
        assert!(one_shot_ctrl(&peers, 0, 0, 0, ONE_SHOT_MAX_SLOT_BYTES + 16).is_none());
        assert!(one_shot_ctrl(&peers, 0, 0, 0, (1 << 20) + 8).is_none());
        assert!(one_shot_ctrl(&peers, 0, 0, 2, 1 << 20).is_none());
        assert!(one_shot_ctrl(&peers[..1], 0, 0, 0, 1 << 20).is_none());
        assert!(one_shot_ctrl(&[0; 9], 0, 0, 0, 1 << 20).is_none());
    }

    #[test]
    fn one_shot_launch_config_is_bounded() {
        assert_eq!(one_shot_launch_config(0), ((1, 1, 1), (32, 1, 1)));
        assert_eq!(one_shot_launch_config(1), ((1, 1, 1), (32, 1, 1)));
        assert_eq!(one_shot_launch_config(512), ((1, 1, 1), (32, 1, 1)));
        assert_eq!(one_shot_launch_config(513), ((1, 1, 1), (64, 1, 1)));
        assert_eq!(one_shot_launch_config(8191), ((1, 1, 1), (512, 1, 1)));
        assert_eq!(one_shot_launch_config(8192), ((1, 1, 1), (512, 1, 1)));
        assert_eq!(one_shot_launch_config(8193), ((2, 1, 1), (512, 1, 1)));
        assert_eq!(one_shot_launch_config(u64::MAX), ((32, 1, 1), (512, 1, 1)));
    }

    #[test]
    fn one_shot_sum_adds_in_f32_and_rounds_once() {
        use half::bf16;
        let one = bf16::from_f32(1.0);
        let tiny = bf16::from_f32(1.0 / 512.0);
        // Rounded after every add (NCCL's order) this is 1.0; summed in f32
        // and rounded once it is 1 + 1/256.
        let s = one_shot_sum(&[vec![one], vec![tiny], vec![tiny]]).unwrap();
        assert_eq!(s[0], bf16::from_f32(1.0 + 1.0 / 256.0));
        // (+0, -0) pairs read as (+0, +0); a lone -0.0 elsewhere stays.
        let (pz, nz) = (bf16::from_bits(0), bf16::from_bits(0x8000));
        let s = one_shot_sum(&[vec![pz, nz, nz], vec![pz, nz, nz]]).unwrap();
        assert_eq!(
            s.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            [0, 0, 0x8000]
        );
        assert!(one_shot_sum(&[vec![one], vec![]]).is_err());
    }

    #[test]
    fn one_shot_sum_of_f16_and_f32() {
        use half::f16;
        // f16 rounds once too: 1 + 2^-11 + 2^-11 is 1 + 2^-10 in f32, while
        // rounding after every add keeps 1.0.
        let (one, tiny) = (f16::from_f32(1.0), f16::from_f32(1.0 / 2048.0));
        let s = one_shot_sum(&[vec![one], vec![tiny], vec![tiny]]).unwrap();
        assert_eq!(s[0], f16::from_f32(1.0 + 1.0 / 1024.0));
        let (pz, nz) = (f16::from_bits(0), f16::from_bits(0x8000));
        let s = one_shot_sum(&[vec![pz, nz, nz], vec![pz, nz, nz]]).unwrap();
        assert_eq!(
            s.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            [0, 0, 0x8000]
        );
        // f32 -0.0 is the sentinel word itself: it counts as +0.0.
        let s = one_shot_sum(&[vec![-0.0f32, 1.5], vec![-0.0, 2.25]]).unwrap();
        assert_eq!(s[0].to_bits(), 0);
        assert_eq!(s[1], 3.75);
        let s = one_shot_sum(&[vec![1.0f32, -0.0], vec![1e-8, 0.5]]).unwrap();
        assert_eq!(s, [1.0f32 + 1e-8, 0.5]);
    }

    #[test]
    fn launch_config_examples() {
        assert_eq!(launch_config(0), ((1, 1, 1), (256, 1, 1)));
        assert_eq!(launch_config(2048), ((1, 1, 1), (256, 1, 1)));
        assert_eq!(launch_config(2049), ((2, 1, 1), (256, 1, 1)));
        assert_eq!(launch_config(1 << 30), ((1056, 1, 1), (256, 1, 1)));
    }
}
