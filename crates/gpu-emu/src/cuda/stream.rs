//! Streams: in-order queues of work, each drained by its own worker
//! thread; the legacy stream of each device; the device-wide waits
//! (`cuCtxSynchronize`, and the implicit one of a free).
//!
//! Work is enqueued as a [`Launcher`], a re-runnable closure that makes one
//! execution ([`Work`]) when the work is launched: at the API call, or at each
//! graph launch when it was captured (`graph`). Events are markers in the
//! queue (`event`).
//!
//! Invariants:
//! - `completed <= enqueued`; a stream is idle when they are equal.
//! - A capturing stream records launchers and runs nothing.
//! - The NULL / legacy / per-thread handles are one legacy stream per device,
//!   and every submission to it is waited for before the call returns.
//! - A destroyed stream drains its queue, then its worker exits; until then
//!   it stays in the list of running streams, so a device-wide wait
//!   ([`quiesce`], `cuCtxSynchronize`) still waits for it.
//! - Synchronise and query calls report the device's sticky error once the
//!   work they wait for has run (or at once, for queries).
//!
//! Lock order: the legacy streams' table, then [`RUNNING`] (a legacy
//! stream is spawned, and listed as running, under the table's lock). A
//! stream's state and the stream table are leaves: nothing else is locked
//! while one is held, and work runs with no lock held, so work may
//! enqueue, wait or take any other lock.

use std::collections::VecDeque;
use std::ffi::c_uint;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cuda_sys::{CUresult, CUstream};
use parking_lot::{Condvar, Mutex};

use super::driver::{self, check_init, code, current_device};
use crate::{Table, guard, id_to_ptr, ptr_to_id, put};

/// One execution of enqueued work.
pub(crate) type Work = Box<dyn FnOnce() + Send>;
/// Makes one execution of some work; called at launch.
pub(crate) type Launcher = Arc<dyn Fn() -> Work + Send + Sync>;

/// The longest a host wait sleeps between checks.
pub(super) const TICK: Duration = Duration::from_millis(20);

struct StreamState {
    queue: VecDeque<Work>,
    enqueued: u64,
    completed: u64,
    capture: Option<Vec<Launcher>>,
    /// The id of the capture in progress (a new one per capture).
    capture_id: u64,
    closing: bool,
}

/// An emulated stream.
pub(crate) struct Stream {
    device: i32,
    st: Mutex<StreamState>,
    cv: Condvar,
}

impl Stream {
    /// The stream's device.
    pub(crate) fn device(&self) -> i32 {
        self.device
    }

    fn spawn(device: i32) -> Result<Arc<Stream>, CUresult> {
        let s = Arc::new(Stream {
            device,
            st: Mutex::new(StreamState {
                queue: VecDeque::new(),
                enqueued: 0,
                completed: 0,
                capture: None,
                capture_id: 0,
                closing: false,
            }),
            cv: Condvar::new(),
        });
        let w = s.clone();
        RUNNING.lock().push(s.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("emu-stream-d{device}"))
            .spawn(move || {
                w.worker();
                RUNNING.lock().retain(|r| !Arc::ptr_eq(r, &w));
            });
        if spawned.is_err() {
            RUNNING.lock().retain(|r| !Arc::ptr_eq(r, &s));
            return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
        Ok(s)
    }

    fn worker(&self) {
        loop {
            let work = {
                let mut st = self.st.lock();
                loop {
                    if let Some(w) = st.queue.pop_front() {
                        break w;
                    }
                    if st.closing {
                        return;
                    }
                    self.cv.wait(&mut st);
                }
            };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).is_err() {
                tracing::error!("emulated stream work panicked");
            }
            let mut st = self.st.lock();
            st.completed += 1;
            self.cv.notify_all();
        }
    }

    fn push(&self, w: Work) {
        let mut st = self.st.lock();
        st.queue.push_back(w);
        st.enqueued += 1;
        self.cv.notify_all();
    }

    /// Whether the stream is capturing.
    pub(crate) fn capturing(&self) -> bool {
        self.st.lock().capture.is_some()
    }

    /// The id of the capture in progress, `None` when not capturing.
    pub(super) fn capture_id(&self) -> Option<u64> {
        let st = self.st.lock();
        st.capture.is_some().then_some(st.capture_id)
    }

    /// Starts recording launchers under a new capture id;
    /// `CUDA_ERROR_ILLEGAL_STATE` when the stream is capturing already.
    pub(super) fn begin_capture(&self) -> Result<(), CUresult> {
        /// Capture ids, one per capture in the process (from 1).
        static CAPTURE_IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let mut st = self.st.lock();
        if st.capture.is_some() {
            return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
        }
        st.capture = Some(Vec::new());
        st.capture_id = CAPTURE_IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Ends a capture: the launchers recorded, `None` when not capturing.
    pub(super) fn end_capture(&self) -> Option<Vec<Launcher>> {
        self.st.lock().capture.take()
    }

    fn idle(&self) -> bool {
        let st = self.st.lock();
        st.completed == st.enqueued
    }

    /// Waits until the work enqueued so far has run.
    pub(crate) fn wait_idle(&self) -> Result<(), CUresult> {
        let mut st = self.st.lock();
        if st.capture.is_some() {
            return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let target = st.enqueued;
        while st.completed < target {
            self.cv.wait_for(&mut st, TICK);
        }
        Ok(())
    }

    /// The number of work items enqueued so far.
    fn enqueued(&self) -> u64 {
        self.st.lock().enqueued
    }

    /// Waits until `target` work items have run (capture or not).
    fn wait_for_count(&self, target: u64) {
        let mut st = self.st.lock();
        while st.completed < target {
            self.cv.wait_for(&mut st, TICK);
        }
    }

    fn close(&self) {
        let mut st = self.st.lock();
        st.closing = true;
        self.cv.notify_all();
    }
}

static STREAMS: Table<Stream> = Table::new();

/// Every stream whose worker runs: created ones (destroyed ones too, until
/// they drain) and the legacy ones.
static RUNNING: Mutex<Vec<Arc<Stream>>> = Mutex::new(Vec::new());

/// `device`'s running streams with the work enqueued on each so far.
fn snapshot(device: i32) -> Vec<(Arc<Stream>, u64)> {
    let streams: Vec<Arc<Stream>> = RUNNING
        .lock()
        .iter()
        .filter(|s| s.device == device)
        .cloned()
        .collect();
    streams
        .into_iter()
        .map(|s| {
            let n = s.enqueued();
            (s, n)
        })
        .collect()
}

/// Waits until the work queued on `device` before the call (every stream of
/// the device, legacy and destroyed ones included) has run, as the driver's
/// implicit synchronisation in `cuMemFree` does. Work enqueued meanwhile is
/// not waited for; work captured into a graph is not queued. No deadline:
/// under work that never ends this never returns, as on a GPU.
pub(crate) fn quiesce(device: i32) {
    for (s, n) in snapshot(device) {
        s.wait_for_count(n);
    }
}

fn legacy(device: i32) -> Result<Arc<Stream>, CUresult> {
    static L: OnceLock<Mutex<Vec<Option<Arc<Stream>>>>> = OnceLock::new();
    let l = L.get_or_init(|| Mutex::new(vec![None; 64]));
    let mut g = l.lock();
    let slot = g
        .get_mut(device as usize)
        .ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
    if let Some(s) = slot {
        return Ok(s.clone());
    }
    let s = Stream::spawn(device)?;
    *slot = Some(s.clone());
    Ok(s)
}

/// Where work goes: a stream, and whether the call waits for it.
pub(crate) struct Target {
    /// The stream.
    pub(crate) stream: Arc<Stream>,
    /// The legacy stream: the call waits for its work.
    pub(crate) sync: bool,
}

/// Whether `h` is the NULL, legacy or per-thread handle.
pub(super) fn is_legacy(h: CUstream) -> bool {
    matches!(ptr_to_id(h), 0..=2)
}

/// Resolves a stream handle; the legacy handles use `device`, else the
/// current context's device.
pub(crate) fn resolve(h: CUstream, device: Option<i32>) -> Result<Target, CUresult> {
    if is_legacy(h) {
        let d = device
            .or_else(current_device)
            .ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
        return Ok(Target {
            stream: legacy(d)?,
            sync: true,
        });
    }
    let s = STREAMS
        .get(ptr_to_id(h))
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
    Ok(Target {
        stream: s,
        sync: false,
    })
}

/// Launches `l` on `t` (or records it when capturing); waits for legacy work
/// (and then reports the device's sticky error, if that work set one).
pub(crate) fn submit(t: &Target, l: Launcher) -> Result<(), CUresult> {
    if enqueue(t, l) && t.sync {
        t.stream.wait_idle()?;
        driver::sticky(t.stream.device)?;
    }
    Ok(())
}

/// Launches `l` on `t` (or records it when capturing) without waiting;
/// says whether it was launched.
pub(crate) fn enqueue(t: &Target, l: Launcher) -> bool {
    {
        let mut st = t.stream.st.lock();
        if let Some(cap) = st.capture.as_mut() {
            cap.push(l);
            return false;
        }
    }
    t.stream.push(l());
    true
}

/// Pushes work that was launched earlier (its launcher already ran) onto
/// `t`'s queue without waiting, even for the legacy stream: the caller is a
/// background thread and the host call that launched it has returned.
pub(crate) fn push_launched(t: &Target, w: Work) {
    t.stream.push(w);
}

/// Waits for every stream of `device` (destroyed ones still draining
/// included) but capturing ones.
pub(crate) fn sync_device(device: i32) -> Result<(), CUresult> {
    legacy(device)?;
    for (s, n) in snapshot(device) {
        if !s.capturing() {
            s.wait_for_count(n);
        }
    }
    Ok(())
}

/// `cuStreamCreate`: a stream of the current device with its own worker.
///
/// # Safety
/// `ph` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(ph: *mut CUstream, flags: c_uint) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let d = current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            if ph.is_null() || flags > 1 {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            let id = STREAMS.insert(Stream::spawn(d)?);
            // SAFETY: `ph` is non-null and valid (this function's contract).
            unsafe { put(ph, id_to_ptr(id)) };
            Ok(())
        })())
    })
}

/// `cuStreamDestroy_v2`: pending work still runs, then the worker exits.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(h: CUstream) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            if is_legacy(h) {
                return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
            }
            let s = STREAMS
                .remove(ptr_to_id(h))
                .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
            s.close();
            Ok(())
        })())
    })
}

/// `cuStreamQuery`: the device's sticky error if it has one, else
/// `CUDA_ERROR_NOT_READY` while work is pending.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamQuery(h: CUstream) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let t = resolve(h, None)?;
            if t.stream.capturing() {
                return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
            driver::sticky(t.stream.device)?;
            if t.stream.idle() {
                Ok(())
            } else {
                Err(CUresult::CUDA_ERROR_NOT_READY)
            }
        })())
    })
}

/// `cuStreamSynchronize`: blocks until the stream's work has run, then
/// reports the device's sticky error, if any.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(h: CUstream) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let t = resolve(h, None)?;
            t.stream.wait_idle()?;
            driver::sticky(t.stream.device)
        })())
    })
}

/// `cuCtxSynchronize`: waits for every stream of the current device, then
/// reports the context's sticky error, if any.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let d = current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            sync_device(d)?;
            driver::sticky(d)
        })())
    })
}
