//! Element types and reductions, computed on bytes.
//!
//! Invariants: reductions run in rank order; 16-bit floats are computed in
//! `f32` and rounded after each step, as NCCL's kernels do; averages follow
//! NCCL (floats pre-multiplied by `1/n`, integers divided after the sum).

use half::{bf16, f16};
use nccl_sys::{ncclDataType_t, ncclRedOp_t, ncclResult_t};

use super::R;
use super::errors::fail;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dt {
    I8,
    U8,
    I32,
    U32,
    I64,
    U64,
    F16,
    F32,
    F64,
    Bf16,
}

impl Dt {
    pub(super) fn from_nccl(d: ncclDataType_t) -> R<Dt> {
        Ok(match d.0 {
            0 => Dt::I8,
            1 => Dt::U8,
            2 => Dt::I32,
            3 => Dt::U32,
            4 => Dt::I64,
            5 => Dt::U64,
            6 => Dt::F16,
            7 => Dt::F32,
            8 => Dt::F64,
            9 => Dt::Bf16,
            10 | 11 => {
                return fail(
                    ncclResult_t::ncclInvalidArgument,
                    "fp8 data types are not supported by the emulator",
                );
            }
            other => {
                return fail(
                    ncclResult_t::ncclInvalidArgument,
                    format!("invalid data type {other}"),
                );
            }
        })
    }

    /// Its `ncclDataType_t` value.
    pub(super) fn code(self) -> u8 {
        match self {
            Dt::I8 => 0,
            Dt::U8 => 1,
            Dt::I32 => 2,
            Dt::U32 => 3,
            Dt::I64 => 4,
            Dt::U64 => 5,
            Dt::F16 => 6,
            Dt::F32 => 7,
            Dt::F64 => 8,
            Dt::Bf16 => 9,
        }
    }

    pub(super) fn size(self) -> usize {
        match self {
            Dt::I8 | Dt::U8 => 1,
            Dt::F16 | Dt::Bf16 => 2,
            Dt::I32 | Dt::U32 | Dt::F32 => 4,
            Dt::I64 | Dt::U64 | Dt::F64 => 8,
        }
    }

    pub(super) fn is_float(self) -> bool {
        matches!(self, Dt::F16 | Dt::F32 | Dt::F64 | Dt::Bf16)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
}

impl Op {
    pub(super) fn from_nccl(o: ncclRedOp_t) -> R<Op> {
        Ok(match o.0 {
            0 => Op::Sum,
            1 => Op::Prod,
            2 => Op::Max,
            3 => Op::Min,
            4 => Op::Avg,
            other => {
                return fail(
                    ncclResult_t::ncclInvalidArgument,
                    format!("invalid reduction operation {other}"),
                );
            }
        })
    }

    /// Its `ncclRedOp_t` value.
    pub(super) fn code(self) -> u8 {
        match self {
            Op::Sum => 0,
            Op::Prod => 1,
            Op::Max => 2,
            Op::Min => 3,
            Op::Avg => 4,
        }
    }
}

/// An element type stored as native-endian bytes.
pub(super) trait El: Copy {
    fn ld(b: &[u8]) -> Self;
    fn st(self, b: &mut [u8]);
}

macro_rules! el_num {
    ($($t:ty),*) => {$(
        impl El for $t {
            fn ld(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                <$t>::from_ne_bytes(a)
            }
            fn st(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_ne_bytes());
            }
        }
    )*};
}
el_num!(i8, u8, i32, u32, i64, u64, f32, f64);

macro_rules! el_half {
    ($($t:ty),*) => {$(
        impl El for $t {
            fn ld(b: &[u8]) -> Self {
                <$t>::from_bits(u16::ld(b))
            }
            fn st(self, b: &mut [u8]) {
                self.to_bits().st(b)
            }
        }
    )*};
}
impl El for u16 {
    fn ld(b: &[u8]) -> Self {
        u16::from_ne_bytes([b[0], b[1]])
    }
    fn st(self, b: &mut [u8]) {
        b.copy_from_slice(&self.to_ne_bytes());
    }
}
el_half!(f16, bf16);

pub(super) fn map2<T: El>(acc: &mut [u8], x: &[u8], f: impl Fn(T, T) -> T) {
    let n = std::mem::size_of::<T>();
    for (a, b) in acc.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
        f(T::ld(a), T::ld(b)).st(a);
    }
}

pub(super) fn map1<T: El>(acc: &mut [u8], f: impl Fn(T) -> T) {
    let n = std::mem::size_of::<T>();
    for a in acc.chunks_exact_mut(n) {
        f(T::ld(a)).st(a);
    }
}

/// `acc = acc (op) x`, element-wise.
pub(super) fn combine(dt: Dt, op: Op, acc: &mut [u8], x: &[u8]) {
    macro_rules! int {
        ($t:ty) => {
            match op {
                Op::Sum | Op::Avg => map2::<$t>(acc, x, |a, b| a.wrapping_add(b)),
                Op::Prod => map2::<$t>(acc, x, |a, b| a.wrapping_mul(b)),
                Op::Max => map2::<$t>(acc, x, |a, b| a.max(b)),
                Op::Min => map2::<$t>(acc, x, |a, b| a.min(b)),
            }
        };
    }
    macro_rules! flt {
        ($t:ty) => {
            match op {
                Op::Sum | Op::Avg => map2::<$t>(acc, x, |a, b| a + b),
                Op::Prod => map2::<$t>(acc, x, |a, b| a * b),
                Op::Max => map2::<$t>(acc, x, |a, b| a.max(b)),
                Op::Min => map2::<$t>(acc, x, |a, b| a.min(b)),
            }
        };
    }
    macro_rules! half {
        ($t:ty) => {
            match op {
                Op::Sum | Op::Avg => {
                    map2::<$t>(acc, x, |a, b| <$t>::from_f32(a.to_f32() + b.to_f32()))
                }
                Op::Prod => map2::<$t>(acc, x, |a, b| <$t>::from_f32(a.to_f32() * b.to_f32())),
                Op::Max => map2::<$t>(acc, x, |a, b| <$t>::from_f32(a.to_f32().max(b.to_f32()))),
                Op::Min => map2::<$t>(acc, x, |a, b| <$t>::from_f32(a.to_f32().min(b.to_f32()))),
            }
        };
    }
    match dt {
        Dt::I8 => int!(i8),
        Dt::U8 => int!(u8),
        Dt::I32 => int!(i32),
        Dt::U32 => int!(u32),
        Dt::I64 => int!(i64),
        Dt::U64 => int!(u64),
        Dt::F32 => flt!(f32),
        Dt::F64 => flt!(f64),
        Dt::F16 => half!(f16),
        Dt::Bf16 => half!(bf16),
    }
}

/// NCCL's average of floats: each input is multiplied by `1/n` (in its own
/// type) before the sum.
pub(super) fn premul(dt: Dt, x: &mut [u8], n: usize) {
    match dt {
        Dt::F32 => {
            let s = 1.0f32 / n as f32;
            map1::<f32>(x, |a| a * s)
        }
        Dt::F64 => {
            let s = 1.0f64 / n as f64;
            map1::<f64>(x, |a| a * s)
        }
        Dt::F16 => {
            let s = f16::from_f32(1.0 / n as f32).to_f32();
            map1::<f16>(x, |a| f16::from_f32(a.to_f32() * s))
        }
        Dt::Bf16 => {
            let s = bf16::from_f32(1.0 / n as f32).to_f32();
            map1::<bf16>(x, |a| bf16::from_f32(a.to_f32() * s))
        }
        _ => {}
    }
}

/// NCCL's average of integers: the sum divided by `n`.
pub(super) fn postdiv(dt: Dt, x: &mut [u8], n: usize) {
    let n = n as i128;
    macro_rules! div {
        ($t:ty) => {
            map1::<$t>(x, |a| (a as i128 / n) as $t)
        };
    }
    match dt {
        Dt::I8 => div!(i8),
        Dt::U8 => div!(u8),
        Dt::I32 => div!(i32),
        Dt::U32 => div!(u32),
        Dt::I64 => div!(i64),
        Dt::U64 => div!(u64),
        _ => {}
    }
}

/// Reduces `inputs` in rank order.
pub(super) fn reduce(dt: Dt, op: Op, inputs: &[Vec<u8>]) -> Vec<u8> {
    let n = inputs.len();
    let avg_f = op == Op::Avg && dt.is_float();
    let mut acc = inputs[0].clone();
    if avg_f {
        premul(dt, &mut acc, n);
    }
    for x in &inputs[1..] {
        if avg_f {
            let mut y = x.clone();
            premul(dt, &mut y, n);
            combine(dt, Op::Sum, &mut acc, &y);
        } else {
            combine(dt, op, &mut acc, x);
        }
    }
    if op == Op::Avg && !dt.is_float() {
        postdiv(dt, &mut acc, n);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: El>(v: &[T]) -> Vec<u8> {
        let n = std::mem::size_of::<T>();
        let mut out = vec![0u8; std::mem::size_of_val(v)];
        for (x, b) in v.iter().zip(out.chunks_exact_mut(n)) {
            x.st(b);
        }
        out
    }

    #[test]
    fn bf16_sum_rounds_after_each_add() {
        let a = [bf16::from_f32(1.0), bf16::from_f32(3.5)];
        let b = [bf16::from_bits(0x3b80), bf16::from_f32(-0.125)];
        let c = [bf16::from_bits(0x3b80), bf16::from_f32(7.0)];
        let got = reduce(Dt::Bf16, Op::Sum, &[bytes(&a), bytes(&b), bytes(&c)]);
        for i in 0..2 {
            let ab = bf16::from_f32(a[i].to_f32() + b[i].to_f32());
            let want = bf16::from_f32(ab.to_f32() + c[i].to_f32());
            assert_eq!(bf16::ld(&got[2 * i..2 * i + 2]).to_bits(), want.to_bits());
        }
    }

    #[test]
    fn integer_ops() {
        let a = bytes(&[5i32, -7, 100]);
        let b = bytes(&[3i32, 2, -50]);
        let check = |op, want: [i32; 3]| {
            let got = reduce(Dt::I32, op, &[a.clone(), b.clone()]);
            for (i, w) in want.iter().enumerate() {
                assert_eq!(i32::ld(&got[4 * i..4 * i + 4]), *w, "{op:?}");
            }
        };
        check(Op::Sum, [8, -5, 50]);
        check(Op::Prod, [15, -14, -5000]);
        check(Op::Max, [5, 2, 100]);
        check(Op::Min, [3, -7, -50]);
        check(Op::Avg, [4, -2, 25]);
    }
}
