//! Device memory of a program's buffers: typed device buffers and symmetric
//! allocations, their views for the 0.2 API, and their contents as numbers.
//!
//! Invariants: every view is made from an owning buffer or allocation (no
//! `from_raw` here), so it cannot outlive the memory; the host copies to
//! and from symmetric memory are synchronous and wait until the copy
//! landed; a buffer is filled with its data, or the poison pattern, before
//! any call sees it.

use std::sync::Arc;

use half::{bf16, f16};
use metrale_comm::SymmetricAlloc;
use nccl_safe::{Context, DataType, DeviceBuffer, DeviceView, DeviceViewMut, Stream};

use super::program::{COLLECTIVE_TIMEOUT, Ty};
use super::reference::BufPlan;
use crate::data::POISON_BYTE;

/// Device memory of one buffer.
pub(super) enum Mem {
    Bf16(DeviceBuffer<bf16>),
    F16(DeviceBuffer<f16>),
    F32(DeviceBuffer<f32>),
    U32(DeviceBuffer<u32>),
    /// bf16 in memory from backend `b`'s `symmetric_alloc`.
    Sym {
        b: usize,
        alloc: SymmetricAlloc,
    },
}

impl Mem {
    pub fn view(&self) -> DeviceView<'_> {
        match self {
            Mem::Bf16(d) => d.view(),
            Mem::F16(d) => d.view(),
            Mem::F32(d) => d.view(),
            Mem::U32(d) => d.view(),
            Mem::Sym { alloc, .. } => alloc.view(DataType::Bfloat16),
        }
    }

    pub fn view_mut(&mut self) -> DeviceViewMut<'_> {
        match self {
            Mem::Bf16(d) => d.view_mut(),
            Mem::F16(d) => d.view_mut(),
            Mem::F32(d) => d.view_mut(),
            Mem::U32(d) => d.view_mut(),
            Mem::Sym { alloc, .. } => alloc.view_mut(DataType::Bfloat16),
        }
    }

    /// The elements as numbers (the poison pattern reads as NaN or
    /// `u32::MAX`).
    pub fn read(&self, c: &Arc<Context>) -> anyhow::Result<Vec<f64>> {
        Ok(match self {
            Mem::Bf16(d) => d.to_host_vec()?.iter().map(|x| x.to_f64()).collect(),
            Mem::F16(d) => d.to_host_vec()?.iter().map(|x| x.to_f64()).collect(),
            Mem::F32(d) => d.to_host_vec()?.iter().map(|&x| x as f64).collect(),
            Mem::U32(d) => d.to_host_vec()?.iter().map(|&x| x as f64).collect(),
            Mem::Sym { alloc, .. } => {
                let n = alloc.bytes() / 2;
                let mut host = vec![bf16::ZERO; n];
                let lib = cuda_sys::cuda()?;
                c.make_current()?;
                // SAFETY: the allocation is live device memory of `2n` bytes
                // (borrowed through `alloc`) and `host` has room for `2n`
                // bytes during the synchronous copy.
                let rc = unsafe {
                    cuda_sys::call!(
                        lib,
                        cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), alloc.ptr(), 2 * n)
                    )?
                };
                nccl_safe::cuda_check(rc, "cuMemcpyDtoH_v2")?;
                host.iter().map(|x| x.to_f64()).collect()
            }
        })
    }

    /// Overwrites the buffer with `vals` (a graph's fresh data).
    pub fn refill(&mut self, c: &Arc<Context>, vals: &[i32]) -> anyhow::Result<()> {
        match self {
            Mem::Bf16(d) => {
                d.copy_from_host(&vals.iter().map(|&x| to_bf16(x)).collect::<Vec<_>>())?
            }
            Mem::F16(d) => d.copy_from_host(
                &vals
                    .iter()
                    .map(|&x| f16::from_f32(x as f32))
                    .collect::<Vec<_>>(),
            )?,
            Mem::F32(d) => d.copy_from_host(&vals.iter().map(|&x| x as f32).collect::<Vec<_>>())?,
            Mem::U32(d) => d.copy_from_host(&vals.iter().map(|&x| x as u32).collect::<Vec<_>>())?,
            Mem::Sym { alloc, .. } => write_sym(c, alloc, vals)?,
        }
        Ok(())
    }
}

fn to_bf16(x: i32) -> bf16 {
    bf16::from_f32(x as f32)
}

/// Writes `vals` as bf16 into symmetric memory.
pub(super) fn write_sym(
    c: &Arc<Context>,
    alloc: &mut SymmetricAlloc,
    vals: &[i32],
) -> anyhow::Result<()> {
    let host: Vec<bf16> = vals.iter().map(|&x| to_bf16(x)).collect();
    let bytes = std::mem::size_of_val(host.as_slice());
    anyhow::ensure!(
        bytes <= alloc.bytes(),
        "{bytes} bytes do not fit the {alloc:?}"
    );
    let lib = cuda_sys::cuda()?;
    c.make_current()?;
    // SAFETY: the allocation is live device memory of at least `bytes`
    // bytes (checked; borrowed exclusively through `alloc`) and `host`
    // holds `bytes` bytes during the synchronous copy.
    let rc = unsafe {
        cuda_sys::call!(
            lib,
            cuMemcpyHtoD_v2(alloc.ptr(), host.as_ptr().cast(), bytes)
        )?
    };
    nccl_safe::cuda_check(rc, "cuMemcpyHtoD_v2")?;
    // SAFETY: the null handle is the context's legacy default stream, which
    // lives as long as the context; the wrapper does not destroy it.
    let legacy = unsafe { Stream::borrowed(c, std::ptr::null_mut()) };
    legacy.wait_until_idle(COLLECTIVE_TIMEOUT)?;
    Ok(())
}

/// A device buffer for `bp`: its data, or the poison pattern.
pub(super) fn device(c: &Arc<Context>, bp: &BufPlan) -> anyhow::Result<Mem> {
    fn make<T: nccl_safe::Element>(
        c: &Arc<Context>,
        len: usize,
        init: Option<&Vec<i32>>,
        conv: impl Fn(i32) -> T,
    ) -> anyhow::Result<DeviceBuffer<T>> {
        Ok(match init {
            Some(v) => DeviceBuffer::from_host(c, &v.iter().map(|&x| conv(x)).collect::<Vec<T>>())?,
            None => {
                let mut d = DeviceBuffer::alloc(c, len)?;
                d.fill_bytes(POISON_BYTE)?;
                d
            }
        })
    }
    let init = bp.init.as_ref();
    Ok(match bp.ty {
        Ty::Bf16 => Mem::Bf16(make(c, bp.len, init, to_bf16)?),
        Ty::F16 => Mem::F16(make(c, bp.len, init, |x| f16::from_f32(x as f32))?),
        Ty::F32 => Mem::F32(make(c, bp.len, init, |x| x as f32)?),
        Ty::U32 => Mem::U32(make(c, bp.len, init, |x| x as u32)?),
    })
}

/// A read-only view of `mems[k]` and a writable one of `mems[k + 1]` (a
/// send and a receive buffer).
pub(super) fn pair(mems: &mut [Mem], k: usize) -> (DeviceView<'_>, DeviceViewMut<'_>) {
    let (a, b) = mems[k..].split_at_mut(1);
    (a[0].view(), b[0].view_mut())
}
