//! Element types and device buffers.
//!
//! Invariants:
//! - [`Element`] is implemented only for types whose size and layout match
//!   their [`DataType`], so a `DeviceBuffer<T>` of `len` elements is exactly
//!   `len * DataType::size()` bytes.
//! - A [`DeviceBuffer`] owns its `cuMemAlloc` allocation and frees it once, on
//!   drop; an empty buffer allocates nothing and has address 0.
//! - Host copies check lengths before calling the driver, and a copy to the
//!   device has landed when it returns (a copy from pageable memory may
//!   otherwise still be in flight, and work on non-blocking streams does not
//!   wait for it).

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use cuda_sys::CUdeviceptr;
use nccl_sys::ncclDataType_t;

use crate::driver::Context;
use crate::error::{Error, Result};
use crate::stream::Stream;

/// How long a copy to the device may take to land.
pub const COPY_DEADLINE: Duration = Duration::from_secs(60);

/// NCCL's element types that this crate supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataType {
    /// `i8`.
    Int8,
    /// `u8`.
    Uint8,
    /// `i32`.
    Int32,
    /// `u32`.
    Uint32,
    /// `i64`.
    Int64,
    /// `u64`.
    Uint64,
    /// IEEE half precision (`half::f16`).
    Float16,
    /// `f32`.
    Float32,
    /// `f64`.
    Float64,
    /// bfloat16 (`half::bf16`).
    Bfloat16,
    /// 8-bit float, 4 exponent and 3 mantissa bits (`ncclFloat8e4m3`,
    /// NCCL 2.24+); moved by gathers, broadcasts and send/recv, reduced
    /// only on GPUs of compute capability 9.0 or newer.
    Float8E4M3,
    /// 8-bit float, 5 exponent and 2 mantissa bits (`ncclFloat8e5m2`,
    /// NCCL 2.24+).
    Float8E5M2,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 | DataType::Float8E4M3 | DataType::Float8E5M2 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    /// A short name: `"i8"`, `"u8"`, `"i32"`, `"u32"`, `"i64"`, `"u64"`,
    /// `"f16"`, `"f32"`, `"f64"`, `"bf16"`, `"f8e4m3"`, `"f8e5m2"`.
    pub fn name(self) -> &'static str {
        match self {
            DataType::Int8 => "i8",
            DataType::Uint8 => "u8",
            DataType::Int32 => "i32",
            DataType::Uint32 => "u32",
            DataType::Int64 => "i64",
            DataType::Uint64 => "u64",
            DataType::Float16 => "f16",
            DataType::Float32 => "f32",
            DataType::Float64 => "f64",
            DataType::Bfloat16 => "bf16",
            DataType::Float8E4M3 => "f8e4m3",
            DataType::Float8E5M2 => "f8e5m2",
        }
    }

    /// NCCL's code for the type.
    pub fn to_raw(self) -> ncclDataType_t {
        match self {
            DataType::Int8 => ncclDataType_t::ncclInt8,
            DataType::Uint8 => ncclDataType_t::ncclUint8,
            DataType::Int32 => ncclDataType_t::ncclInt32,
            DataType::Uint32 => ncclDataType_t::ncclUint32,
            DataType::Int64 => ncclDataType_t::ncclInt64,
            DataType::Uint64 => ncclDataType_t::ncclUint64,
            DataType::Float16 => ncclDataType_t::ncclFloat16,
            DataType::Float32 => ncclDataType_t::ncclFloat32,
            DataType::Float64 => ncclDataType_t::ncclFloat64,
            DataType::Bfloat16 => ncclDataType_t::ncclBfloat16,
            DataType::Float8E4M3 => ncclDataType_t::ncclFloat8e4m3,
            DataType::Float8E5M2 => ncclDataType_t::ncclFloat8e5m2,
        }
    }

    /// Every supported type.
    pub const ALL: [DataType; 12] = [
        DataType::Int8,
        DataType::Uint8,
        DataType::Int32,
        DataType::Uint32,
        DataType::Int64,
        DataType::Uint64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Bfloat16,
        DataType::Float8E4M3,
        DataType::Float8E5M2,
    ];

    /// True for the types NCCL reduces on every supported GPU (integers,
    /// f16, bf16, f32, f64); fp8 reductions need compute capability 9.0.
    pub fn is_reducible_everywhere(self) -> bool {
        !matches!(self, DataType::Float8E4M3 | DataType::Float8E5M2)
    }
}

impl std::fmt::Display for DataType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A host type that NCCL can move and reduce as [`Element::DATA_TYPE`].
///
/// # Safety
/// The type's size is `DATA_TYPE.size()`, it has no padding, and every bit
/// pattern NCCL or a kernel may write is a valid value of it.
pub unsafe trait Element: Copy + Send + Sync + Default + 'static {
    /// The matching NCCL type.
    const DATA_TYPE: DataType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        // SAFETY: a plain number of exactly `DataType::$d.size()` bytes, no
        // padding, every bit pattern valid.
        unsafe impl Element for $t {
            const DATA_TYPE: DataType = DataType::$d;
        }
    )*};
}

element! {
    i8 => Int8,
    u8 => Uint8,
    i32 => Int32,
    u32 => Uint32,
    i64 => Int64,
    u64 => Uint64,
    half::f16 => Float16,
    f32 => Float32,
    f64 => Float64,
    half::bf16 => Bfloat16,
}

/// Device memory holding `len` values of `T`, allocated with `cuMemAlloc`.
///
/// Host copies are synchronous with respect to the host but do not wait for
/// work queued on non-blocking streams: synchronize those streams first.
#[derive(Debug)]
pub struct DeviceBuffer<T: Element> {
    ptr: CUdeviceptr,
    len: usize,
    ctx: Arc<Context>,
    _t: PhantomData<T>,
}

// SAFETY: the buffer is a device address owned by this value; the driver lets
// any thread use it, and `T` is Send.
unsafe impl<T: Element> Send for DeviceBuffer<T> {}
// SAFETY: shared references only read the device memory (copies to the
// host); writes need `&mut`.
unsafe impl<T: Element> Sync for DeviceBuffer<T> {}

impl<T: Element> DeviceBuffer<T> {
    /// Allocates `len` uninitialised elements (nothing for `len == 0`).
    pub fn alloc(ctx: &Arc<Context>, len: usize) -> Result<Self> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            Error::invalid("DeviceBuffer::alloc", format!("{len} elements overflow"))
        })?;
        let mut ptr: CUdeviceptr = 0;
        if bytes > 0 {
            ctx.make_current()?;
            // SAFETY: writes one device address through a valid pointer; the
            // context is current.
            unsafe { cu!(cuMemAlloc_v2(&mut ptr, bytes)) }?;
        }
        Ok(DeviceBuffer {
            ptr,
            len,
            ctx: Arc::clone(ctx),
            _t: PhantomData,
        })
    }

    /// Allocates a buffer holding a copy of `data`.
    pub fn from_host(ctx: &Arc<Context>, data: &[T]) -> Result<Self> {
        let mut buf = Self::alloc(ctx, data.len())?;
        buf.copy_from_host(data)?;
        Ok(buf)
    }

    /// Waits, at most [`COPY_DEADLINE`], until copies from the host have
    /// landed: `cuMemcpyHtoD` from pageable memory may return while its DMA
    /// is still queued on the legacy stream.
    fn landed(&self) -> Result<()> {
        // SAFETY: the null handle is the legacy default stream of this
        // buffer's context, which lives as long as the context.
        let legacy = unsafe { Stream::borrowed(&self.ctx, std::ptr::null_mut()) };
        legacy.wait_until_idle(COPY_DEADLINE)
    }

    /// Copies `data` into the buffer; `data.len()` must equal `self.len()`.
    pub fn copy_from_host(&mut self, data: &[T]) -> Result<()> {
        self.write_prefix("DeviceBuffer::copy_from_host", data, data.len() == self.len)
    }

    /// Copies `data` into the first `data.len()` elements of the buffer;
    /// the rest is left as it is. `data.len()` must not exceed `self.len()`.
    pub fn copy_prefix_from_host(&mut self, data: &[T]) -> Result<()> {
        self.write_prefix(
            "DeviceBuffer::copy_prefix_from_host",
            data,
            data.len() <= self.len,
        )
    }

    /// The host-to-device copy behind both: refuses unless `fits`, then
    /// copies `data` to the start of the buffer and waits until it landed.
    fn write_prefix(&mut self, call: &'static str, data: &[T], fits: bool) -> Result<()> {
        if !fits || data.len() > self.len {
            return Err(Error::invalid(
                call,
                format!(
                    "host slice has {} elements, buffer has {}",
                    data.len(),
                    self.len
                ),
            ));
        }
        if data.is_empty() {
            return Ok(());
        }
        self.ctx.make_current()?;
        let (dst, src, bytes) = (self.ptr, data.as_ptr().cast(), size_of_val(data));
        // SAFETY: `src` is `bytes` readable host bytes and `dst` is this
        // buffer's allocation of at least `bytes` bytes (checked above); the
        // context is current.
        unsafe { cu!(cuMemcpyHtoD_v2(dst, src, bytes)) }?;
        self.landed()
    }

    /// Copies the buffer into `out`; `out.len()` must equal `self.len()`.
    pub fn copy_to_host(&self, out: &mut [T]) -> Result<()> {
        if out.len() != self.len {
            return Err(Error::invalid(
                "DeviceBuffer::copy_to_host",
                format!(
                    "host slice has {} elements, buffer has {}",
                    out.len(),
                    self.len
                ),
            ));
        }
        if self.len == 0 {
            return Ok(());
        }
        self.ctx.make_current()?;
        let (dst, src, bytes) = (out.as_mut_ptr().cast(), self.ptr, self.bytes());
        // SAFETY: `dst` is `bytes` writable host bytes of `T`, valid for any
        // bit pattern (Element's contract); `src` is this buffer's allocation.
        unsafe { cu!(cuMemcpyDtoH_v2(dst, src, bytes)) }
    }

    /// Copies the buffer into a new vector.
    pub fn to_host_vec(&self) -> Result<Vec<T>> {
        let mut v = vec![T::default(); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// Sets every byte of the buffer to `byte` (synchronous `cuMemsetD8`).
    pub fn fill_bytes(&mut self, byte: u8) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        self.ctx.make_current()?;
        let (dst, n) = (self.ptr, self.bytes());
        // SAFETY: `dst` is this buffer's allocation of `n` bytes; the context
        // is current.
        unsafe { cu!(cuMemsetD8_v2(dst, byte, n)) }
    }

    /// The device address (0 when empty).
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The context the memory belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl<T: Element> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        let free = || -> Result<()> {
            self.ctx.make_current()?;
            // SAFETY: this value owns the allocation and frees it once, here.
            unsafe { cu!(cuMemFree_v2(self.ptr)) }
        };
        if let Err(e) = free() {
            tracing::error!(bytes = self.bytes(), error = %e, "freeing device memory failed");
        }
    }
}

/// Copies `bytes` from device address `src` to `dst` on `stream`
/// (`cuMemcpyDtoDAsync`), ordered with the stream's other work.
///
/// # Safety
/// `src` and `dst` are device memory of `ctx`, each valid for `bytes` until
/// the copy completes, not overlapping; `stream` is a live stream of `ctx`.
pub unsafe fn copy_device_async(
    ctx: &Context,
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: cuda_sys::CUstream,
) -> Result<()> {
    ctx.make_current()?;
    // SAFETY: this function's contract.
    unsafe { cu!(cuMemcpyDtoDAsync_v2(dst, src, bytes, stream)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check<T: Element>() {
        assert_eq!(
            std::mem::size_of::<T>(),
            T::DATA_TYPE.size(),
            "{}",
            T::DATA_TYPE
        );
    }

    #[test]
    fn element_sizes_match_data_types() {
        check::<i8>();
        check::<u8>();
        check::<i32>();
        check::<u32>();
        check::<i64>();
        check::<u64>();
        check::<half::f16>();
        check::<f32>();
        check::<f64>();
        check::<half::bf16>();
    }

    #[test]
    fn data_types_map_to_nccl_codes_and_names() {
        let expected = [
            (DataType::Int8, 0, 1, "i8"),
            (DataType::Uint8, 1, 1, "u8"),
            (DataType::Int32, 2, 4, "i32"),
            (DataType::Uint32, 3, 4, "u32"),
            (DataType::Int64, 4, 8, "i64"),
            (DataType::Uint64, 5, 8, "u64"),
            (DataType::Float16, 6, 2, "f16"),
            (DataType::Float32, 7, 4, "f32"),
            (DataType::Float64, 8, 8, "f64"),
            (DataType::Bfloat16, 9, 2, "bf16"),
            (DataType::Float8E4M3, 10, 1, "f8e4m3"),
            (DataType::Float8E5M2, 11, 1, "f8e5m2"),
        ];
        assert_eq!(expected.len(), DataType::ALL.len());
        for ((d, raw, size, name), all) in expected.into_iter().zip(DataType::ALL) {
            assert_eq!(d, all);
            assert_eq!(d.to_raw().0, raw);
            assert_eq!(d.size(), size);
            assert_eq!(d.name(), name);
            assert_eq!(d.to_string(), name);
        }
    }
}
