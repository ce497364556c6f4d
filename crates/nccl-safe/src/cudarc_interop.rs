//! Views of [cudarc](https://docs.rs/cudarc)'s device slices and streams
//! (feature `cudarc`), for engines that hold their tensors in cudarc, as
//! candle and mistral.rs do.
//!
//! cudarc orders its own work with events recorded when the guard it hands
//! out is dropped; so a view comes with that guard ([`Guarded`]), and the
//! work must be enqueued on the same stream before the guard drops: pass
//! [`stream_ref`] of that stream to a stream-taking operation
//! (`all_reduce_async`, `send_to`, `recv_from`).
//!
//! Invariants: cudarc's contexts are the devices' primary contexts, as this
//! crate's [`Context`](crate::Context) is, so a cudarc slice is device
//! memory of the same context; a view never outlives the slice it borrows.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};

use crate::memory::Element;
use crate::view::{DeviceView, DeviceViewMut, StreamRef};

/// A view and the cudarc guard that records the stream's work on drop.
pub struct Guarded<'a, V> {
    /// The view, to pass to one operation on the guard's stream.
    pub view: V,
    /// Dropped after the operation is enqueued (cudarc's event record).
    pub guard: SyncOnDrop<'a>,
}

/// Borrows a cudarc stream.
pub fn stream_ref(stream: &CudaStream) -> StreamRef<'_> {
    // SAFETY: cudarc keeps the stream live while the borrow lasts; its
    // CUstream is the same driver handle type under another binding.
    unsafe { StreamRef::from_raw(stream.cu_stream() as cuda_sys::CUstream) }
}

/// A read-only view of `slice` for work on `stream`.
pub fn view<'a, T: Element + DeviceRepr>(
    slice: &'a CudaSlice<T>,
    stream: &'a CudaStream,
) -> Guarded<'a, DeviceView<'a>> {
    let len = slice.len();
    let (ptr, guard) = slice.device_ptr(stream);
    Guarded {
        // SAFETY: cudarc's slice is `len` elements of `T` in device memory
        // of the device's primary context, borrowed for `'a`; the guard
        // orders cudarc's later work after what is enqueued on `stream`.
        view: unsafe { DeviceView::from_raw_typed::<T>(ptr, len) },
        guard,
    }
}

/// A mutable view of `slice` for work on `stream`.
pub fn view_mut<'a, T: Element + DeviceRepr>(
    slice: &'a mut CudaSlice<T>,
    stream: &'a CudaStream,
) -> Guarded<'a, DeviceViewMut<'a>> {
    let len = slice.len();
    let (ptr, guard) = slice.device_ptr_mut(stream);
    Guarded {
        // SAFETY: as in `view`, with the slice borrowed exclusively.
        view: unsafe { DeviceViewMut::from_raw_typed::<T>(ptr, len) },
        guard,
    }
}
