//! Test data and host references: random non-zero values generated from a
//! seed shared by all ranks (so each rank can compute every rank's input),
//! references computed on the host with NCCL's rounding, and element-wise
//! checks that report the first mismatch.
//!
//! Invariants: generated values are never zero and never the poison
//! pattern; bf16 sums are rounded after every addition, in rank order
//! (exactly what NCCL does for 2 ranks), except the one-shot path's
//! reference ([`one_shot_reference`]: f32 in rank order, rounded once); a
//! check looks at every element.

use half::bf16;
use metrale_comm::kernels::{OneShotElement, OneShotSum};
use nccl_safe::Element;

/// The byte every output buffer is filled with before a run (all-ones:
/// NaN for bf16 and f32).
pub const POISON_BYTE: u8 = 0xFF;

/// A cheap deterministic generator (splitmix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `rank`'s data of one test, from a shared `seed`.
    pub fn new(seed: u64, rank: usize, salt: u64) -> Rng {
        Rng(seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt.rotate_left(17))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// An element type the suite checks.
pub trait SuiteElem: Element + std::fmt::Debug {
    /// A random non-zero value in ±[1/4, 8).
    fn random(rng: &mut Rng) -> Self;
    /// `a + b` rounded as NCCL rounds it for this type.
    fn add(a: Self, b: Self) -> Self;
    /// The value as f64.
    fn to_f64(self) -> f64;
    /// The bit pattern.
    fn bits(self) -> u64;
    /// One unit in the last place at magnitude `x`.
    fn ulp(x: f64) -> f64;
    /// The one-shot all-reduce's result, for the types it serves (bf16,
    /// f16, f32).
    fn one_shot_sum(_inputs: &[Vec<Self>]) -> Option<Vec<Self>> {
        None
    }
}

fn random_f32(rng: &mut Rng) -> f32 {
    let r = rng.next_u64();
    let mag = 0.25 + (r >> 40) as f32 / (1u64 << 24) as f32 * 7.75;
    if r & 1 == 0 { mag } else { -mag }
}

impl SuiteElem for bf16 {
    fn random(rng: &mut Rng) -> Self {
        bf16::from_f32(random_f32(rng))
    }
    fn add(a: Self, b: Self) -> Self {
        bf16::from_f32(a.to_f32() + b.to_f32())
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
    fn ulp(x: f64) -> f64 {
        x.abs().max(1e-3) * 2f64.powi(-7)
    }
    fn one_shot_sum(inputs: &[Vec<Self>]) -> Option<Vec<Self>> {
        Some(one_shot_reference(inputs.len(), |k| inputs[k].clone()))
    }
}

impl SuiteElem for half::f16 {
    fn random(rng: &mut Rng) -> Self {
        half::f16::from_f32(random_f32(rng))
    }
    fn add(a: Self, b: Self) -> Self {
        half::f16::from_f32(a.to_f32() + b.to_f32())
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
    fn ulp(x: f64) -> f64 {
        x.abs().max(1e-3) * 2f64.powi(-10)
    }
    fn one_shot_sum(inputs: &[Vec<Self>]) -> Option<Vec<Self>> {
        Some(one_shot_reference(inputs.len(), |k| inputs[k].clone()))
    }
}

impl SuiteElem for f32 {
    fn random(rng: &mut Rng) -> Self {
        random_f32(rng)
    }
    fn add(a: Self, b: Self) -> Self {
        a + b
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
    fn ulp(x: f64) -> f64 {
        x.abs().max(1e-3) * 2f64.powi(-23)
    }
    fn one_shot_sum(inputs: &[Vec<Self>]) -> Option<Vec<Self>> {
        Some(one_shot_reference(inputs.len(), |k| inputs[k].clone()))
    }
}

/// `n` random values of `rank` for the test `salt`.
pub fn random_vec<T: SuiteElem>(seed: u64, rank: usize, salt: u64, n: usize) -> Vec<T> {
    let mut rng = Rng::new(seed, rank, salt);
    (0..n).map(|_| T::random(&mut rng)).collect()
}

/// `n` random non-zero integers in ±[1, 8] of `rank` for the test `salt`.
/// They and their sums over up to 32 ranks are exactly representable in
/// bf16 (and f16, f32), so a reduction gives the same bits in any order.
pub fn small_ints(seed: u64, rank: usize, salt: u64, n: usize) -> Vec<i32> {
    let mut rng = Rng::new(seed, rank, salt);
    (0..n)
        .map(|_| {
            let r = rng.next_u64();
            let mag = 1 + (r >> 33) as i32 % 8;
            if r & 1 == 0 { mag } else { -mag }
        })
        .collect()
}

/// The bf16 values of small integers (exact for magnitudes up to 256).
pub fn ints_to_bf16(v: &[i32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x as f32)).collect()
}

/// The element-wise sum of `inputs`, added in rank order with rounding
/// after every addition.
pub fn sum_in_rank_order<T: SuiteElem>(inputs: &[Vec<T>]) -> Vec<T> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        for (a, b) in acc.iter_mut().zip(x) {
            *a = T::add(*a, *b);
        }
    }
    acc
}

/// The host reference of a sum all-reduce of `inputs` (rank order) on `b`
/// in ordinary device memory: the one-shot path's arithmetic where `b`
/// takes that path for this size, else NCCL's ([`sum_in_rank_order`]).
pub fn all_reduce_reference<T: SuiteElem>(
    b: &metrale_comm::NcclBackend,
    inputs: &[Vec<T>],
) -> Vec<T> {
    let bytes = inputs.first().map_or(0, |v| v.len() * T::DATA_TYPE.size());
    reference_on(b.all_reduce_path_of(T::DATA_TYPE, bytes), inputs)
}

/// The same for an all-reduce captured into a CUDA graph (whose path the
/// tuned table may choose apart from the eager one's).
pub fn captured_all_reduce_reference<T: SuiteElem>(
    b: &metrale_comm::NcclBackend,
    inputs: &[Vec<T>],
) -> Vec<T> {
    let bytes = inputs.first().map_or(0, |v| v.len() * T::DATA_TYPE.size());
    reference_on(b.all_reduce_path_captured(T::DATA_TYPE, bytes), inputs)
}

/// The host reference of a sum all-reduce of `inputs` on `path`.
fn reference_on<T: SuiteElem>(path: metrale_comm::AllReducePath, inputs: &[Vec<T>]) -> Vec<T> {
    if path == metrale_comm::AllReducePath::OneShot
        && let Some(sum) = T::one_shot_sum(inputs)
    {
        return sum;
    }
    sum_in_rank_order(inputs)
}

/// The one-shot all-reduce's result for `world` ranks whose inputs
/// `input(rank)` gives (`metrale_comm::kernels::one_shot_sum`'s arithmetic:
/// the f32 sum in rank order rounded once to the type, a (+0.0, -0.0) pair
/// of bf16 or f16 at an even index read as (+0.0, +0.0), an f32 -0.0 read
/// as +0.0, a NaN sum the GPU's canonical NaN), one rank's input in memory
/// at a time ([`OneShotSum`]).
pub fn one_shot_reference<T: OneShotElement>(
    world: usize,
    input: impl Fn(usize) -> Vec<T>,
) -> Vec<T> {
    let mut sum = OneShotSum::new();
    for k in 0..world {
        sum.add(&input(k))
            .expect("every rank's input has the same length");
    }
    sum.finish()
}

/// Checks every element of `got` against `want`: bit-exact when `exact`,
/// else within `world` ulps of the reference's magnitude (NCCL may add in
/// another order than rank order for more than 2 ranks on GPUs).
pub fn check<T: SuiteElem>(
    what: &str,
    got: &[T],
    want: &[T],
    exact: bool,
    world: usize,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        got.len() == want.len(),
        "{what}: {} elements, expected {}",
        got.len(),
        want.len()
    );
    let mut bad = 0usize;
    let mut first = None;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if exact {
            g.bits() == w.bits()
        } else {
            let tol = T::ulp(w.to_f64()) * (world as f64 + 1.0) * 8.0;
            (g.to_f64() - w.to_f64()).abs() <= tol
        };
        if !ok {
            bad += 1;
            if first.is_none() {
                first = Some((i, *g, *w));
            }
        }
    }
    if let Some((i, g, w)) = first {
        anyhow::bail!(
            "{what}: {bad} of {} elements wrong; first at {i}: got {g:?}, expected {w:?}",
            got.len()
        );
    }
    Ok(())
}

/// A 64-bit FNV-1a hash of the bit patterns (to compare results across
/// ranks through the store).
pub fn hash<T: SuiteElem>(v: &[T]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in v {
        h ^= x.bits();
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Human-readable size.
pub fn size_name(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_values_are_non_zero_and_differ_by_rank() {
        let a: Vec<bf16> = random_vec(7, 0, 1, 1000);
        let b: Vec<bf16> = random_vec(7, 1, 1, 1000);
        assert!(a.iter().all(|x| x.to_f32() != 0.0 && x.is_finite()));
        assert_ne!(a, b);
    }

    #[test]
    fn small_ints_are_exact_in_bf16() {
        let v = small_ints(3, 1, 2, 10_000);
        assert!(v.iter().all(|&x| x != 0 && x.abs() <= 8));
        assert!(v.contains(&8) && v.contains(&-1));
        // Every sum of 32 of them lies in [-256, 256], all exact in bf16.
        let sums: Vec<i32> = (-256..=256).collect();
        for (b, x) in ints_to_bf16(&sums).iter().zip(&sums) {
            assert_eq!(b.to_f32(), *x as f32);
        }
    }

    #[test]
    fn one_shot_reference_matches_the_library() {
        let mut inputs: Vec<Vec<bf16>> = (0..5).map(|k| random_vec(3, k, 9, 257)).collect();
        for v in &mut inputs {
            v[4] = bf16::from_bits(0);
            v[5] = bf16::from_bits(0x8000);
            v[9] = bf16::from_bits(0x8000);
        }
        let lib = metrale_comm::kernels::one_shot_sum(&inputs).unwrap();
        let ours = one_shot_reference(5, |k| inputs[k].clone());
        assert_eq!(
            lib.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            ours.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let mut inputs: Vec<Vec<half::f16>> = (0..3).map(|k| random_vec(4, k, 9, 33)).collect();
        inputs[1][2] = half::f16::from_bits(0);
        inputs[1][3] = half::f16::from_bits(0x8000);
        inputs[2][7] = half::f16::from_bits(0x8000);
        let lib = metrale_comm::kernels::one_shot_sum(&inputs).unwrap();
        let ours = one_shot_reference(3, |k| inputs[k].clone());
        assert_eq!(
            lib.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            ours.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let mut inputs: Vec<Vec<f32>> = (0..7).map(|k| random_vec(5, k, 9, 33)).collect();
        inputs[0][0] = -0.0;
        inputs[1][0] = -0.0;
        let lib = metrale_comm::kernels::one_shot_sum(&inputs).unwrap();
        let ours = one_shot_reference(7, |k| inputs[k].clone());
        assert_eq!(
            lib.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            ours.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn bf16_sum_rounds_after_each_add() {
        let a = vec![bf16::from_f32(1.0)];
        let b = vec![bf16::from_f32(1.0 / 256.0)];
        let s = sum_in_rank_order(&[a.clone(), b.clone()]);
        assert_eq!(s[0], bf16::from_f32(1.0 + 1.0 / 256.0));
        assert!(check("x", &s, &a, true, 2).is_ok());
        assert!(check("x", &[bf16::from_bits(0xFFFF)], &a, true, 2).is_err());
        assert!(check("x", &[f32::NAN], &[1.0f32], false, 4).is_err());
    }
}
