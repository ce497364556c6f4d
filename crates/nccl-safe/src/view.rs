//! Borrowed views of memory and streams the caller owns: what the layers
//! above pass instead of raw `u64`s.
//!
//! A [`DeviceView`] / [`DeviceViewMut`] is device memory with its element
//! type and length; a [`StreamRef`] is a borrowed stream, in the manner of
//! std's `BorrowedFd<'a>`. Each has one `unsafe fn from_raw` that states its
//! contract once; views made from this crate's owning types
//! ([`DeviceBuffer::view`], [`Stream::as_ref`]) are safe. Passing a stream
//! where memory belongs, or memory of one element type where another is
//! expected by type, no longer compiles:
//!
//! ```compile_fail
//! # use nccl_safe::{DeviceView, StreamRef};
//! fn send(buf: DeviceView<'_>, stream: StreamRef<'_>) {}
//! fn misuse(buf: DeviceView<'_>, stream: StreamRef<'_>) {
//!     send(stream, buf); // a stream where memory belongs
//! }
//! ```
//!
//! Invariants:
//! - A view's `ptr .. ptr + len * dtype.size()` lies in device memory of
//!   one context for the view's lifetime and until work enqueued on it
//!   completes (the `from_raw` contract, or the owning buffer's).
//! - A view never frees what it views; dropping it does nothing.
//! - `DeviceViewMut` is the only way to write through a view; it is not
//!   `Copy`, so one mutable view is passed to one operation at a time.

use std::fmt;
use std::marker::PhantomData;

use cuda_sys::CUstream;

use crate::memory::{DataType, DeviceBuffer, Element};
use crate::stream::Stream;

/// Device memory an operation reads: an address, a length in elements, and
/// their type.
#[derive(Clone, Copy)]
pub struct DeviceView<'a> {
    ptr: u64,
    len: usize,
    dtype: DataType,
    _borrow: PhantomData<&'a [u8]>,
}

/// Device memory an operation writes (or reads and writes in place).
pub struct DeviceViewMut<'a> {
    ptr: u64,
    len: usize,
    dtype: DataType,
    _borrow: PhantomData<&'a mut [u8]>,
}

macro_rules! view_common {
    ($t:ident) => {
        impl<'a> $t<'a> {
            /// Views `len` elements of `dtype` at the device address `ptr`.
            ///
            /// # Safety
            /// `ptr .. ptr + len * dtype.size()` is device memory of the
            /// context the view is used with, allocated for `'a` and until
            /// every operation enqueued on it through this view completes;
            /// while such an operation runs, nothing else writes that memory
            /// (nor, for a mutable view, reads it).
            pub unsafe fn from_raw(ptr: u64, len: usize, dtype: DataType) -> $t<'a> {
                $t {
                    ptr,
                    len,
                    dtype,
                    _borrow: PhantomData,
                }
            }

            /// Views `len` elements of `T` at `ptr`.
            ///
            /// # Safety
            /// As for `from_raw` with `dtype = T::DATA_TYPE`.
            pub unsafe fn from_raw_typed<T: Element>(ptr: u64, len: usize) -> $t<'a> {
                // SAFETY: the caller's contract is from_raw's.
                unsafe { $t::from_raw(ptr, len, T::DATA_TYPE) }
            }

            /// The device address of the first element.
            pub fn ptr(&self) -> u64 {
                self.ptr
            }

            /// The number of elements.
            pub fn len(&self) -> usize {
                self.len
            }

            /// True for a view of no elements.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            /// The element type.
            pub fn dtype(&self) -> DataType {
                self.dtype
            }

            /// The length in bytes.
            pub fn bytes(&self) -> usize {
                self.len * self.dtype.size()
            }
        }

        impl fmt::Debug for $t<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    f,
                    "{}({:#x}, {} x {})",
                    stringify!($t),
                    self.ptr,
                    self.len,
                    self.dtype
                )
            }
        }
    };
}

view_common!(DeviceView);
view_common!(DeviceViewMut);

impl<'a> DeviceViewMut<'a> {
    /// A shorter-lived mutable view of the same memory, so that one view can
    /// be passed to several operations in turn.
    pub fn reborrow(&mut self) -> DeviceViewMut<'_> {
        DeviceViewMut {
            ptr: self.ptr,
            len: self.len,
            dtype: self.dtype,
            _borrow: PhantomData,
        }
    }

    /// A read-only view of the same memory.
    pub fn as_view(&self) -> DeviceView<'_> {
        DeviceView {
            ptr: self.ptr,
            len: self.len,
            dtype: self.dtype,
            _borrow: PhantomData,
        }
    }
}

impl<'a> From<DeviceViewMut<'a>> for DeviceView<'a> {
    fn from(v: DeviceViewMut<'a>) -> DeviceView<'a> {
        DeviceView {
            ptr: v.ptr,
            len: v.len,
            dtype: v.dtype,
            _borrow: PhantomData,
        }
    }
}

impl<T: Element> DeviceBuffer<T> {
    /// A read-only view of the whole buffer.
    pub fn view(&self) -> DeviceView<'_> {
        DeviceView {
            ptr: self.device_ptr(),
            len: self.len(),
            dtype: T::DATA_TYPE,
            _borrow: PhantomData,
        }
    }

    /// A mutable view of the whole buffer.
    pub fn view_mut(&mut self) -> DeviceViewMut<'_> {
        DeviceViewMut {
            ptr: self.device_ptr(),
            len: self.len(),
            dtype: T::DATA_TYPE,
            _borrow: PhantomData,
        }
    }
}

/// A borrowed CUDA stream: live for `'a`, owned by someone else. Two
/// borrows are equal when they name the same stream.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamRef<'a> {
    raw: CUstream,
    _borrow: PhantomData<&'a Stream>,
}

// SAFETY: a stream handle may be used from any thread; the borrow only
// carries the handle.
unsafe impl Send for StreamRef<'_> {}
// SAFETY: as above; the driver serialises calls on one stream.
unsafe impl Sync for StreamRef<'_> {}

impl<'a> StreamRef<'a> {
    /// Borrows the raw stream `raw`.
    ///
    /// # Safety
    /// `raw` is a live stream of the context it is used with (not the NULL
    /// or legacy stream), and stays live for `'a` and until every operation
    /// enqueued on it through this borrow completes.
    pub unsafe fn from_raw(raw: CUstream) -> StreamRef<'a> {
        StreamRef {
            raw,
            _borrow: PhantomData,
        }
    }

    /// The raw handle.
    pub fn as_raw(&self) -> CUstream {
        self.raw
    }
}

impl fmt::Debug for StreamRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StreamRef({:p})", self.raw)
    }
}

impl Stream {
    /// Borrows this stream.
    pub fn as_ref(&self) -> StreamRef<'_> {
        StreamRef {
            raw: self.raw(),
            _borrow: PhantomData,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_carry_length_type_and_bytes() {
        // SAFETY: the views are only inspected, never used with a context.
        let (v, mut m) = unsafe {
            (
                DeviceView::from_raw_typed::<half::bf16>(0x1000, 6),
                DeviceViewMut::from_raw(0x2000, 3, DataType::Float32),
            )
        };
        assert_eq!(
            (v.ptr(), v.len(), v.dtype(), v.bytes()),
            (0x1000, 6, DataType::Bfloat16, 12)
        );
        let r = m.reborrow();
        assert_eq!((r.ptr(), r.bytes()), (0x2000, 12));
        let ro: DeviceView<'_> = m.into();
        assert_eq!(ro.dtype(), DataType::Float32);
        assert_eq!(format!("{v:?}"), "DeviceView(0x1000, 6 x bf16)");
        // SAFETY: an empty view of nothing.
        assert!(unsafe { DeviceView::from_raw(0, 0, DataType::Uint8) }.is_empty());
    }
}
