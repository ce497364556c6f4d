//! Events: markers in a stream's queue, completed (and timed, with the
//! host's clock) when the stream reaches them; `cuStreamWaitEvent` makes a
//! stream wait for one.
//!
//! Invariants: each record is a new generation of the event, and the event
//! is complete once its latest record's marker has run (an event never
//! recorded is complete); a wait is for the generation recorded at the
//! time of the call; a record on a capturing stream is a no-op, and a wait
//! for a pending event from a capturing stream is
//! `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (no cross-stream capture).
//! An event's state is a leaf lock: a query holds it only to read the
//! device's sticky error, and a record or a wait releases it before it
//! enqueues.

use std::ffi::c_uint;
use std::sync::Arc;
use std::time::Instant;

use cuda_sys::{CUevent, CUevent_flags_enum, CUresult, CUstream};
use parking_lot::{Condvar, Mutex};

use super::driver::{self, check_init, code, current_device};
use super::stream::{TICK, resolve, submit};
use crate::{Table, guard, id_to_ptr, ptr_to_id, put};

struct EventState {
    /// Generation of the latest record.
    recorded: u64,
    /// The device of the stream of the latest record.
    device: Option<i32>,
    /// Highest generation whose marker has run.
    done: u64,
    time: Option<Instant>,
}

/// An emulated event.
struct Event {
    timing: bool,
    st: Mutex<EventState>,
    cv: Condvar,
}

impl Event {
    fn complete(&self, generation: u64) {
        let mut st = self.st.lock();
        if generation > st.done {
            st.done = generation;
            st.time = Some(Instant::now());
        }
        self.cv.notify_all();
    }

    fn wait(&self, generation: u64) {
        let mut st = self.st.lock();
        while st.done < generation {
            self.cv.wait_for(&mut st, TICK);
        }
    }
}

static EVENTS: Table<Event> = Table::new();

fn event(h: CUevent) -> Result<Arc<Event>, CUresult> {
    EVENTS
        .get(ptr_to_id(h))
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
}

/// `cuEventCreate`.
///
/// # Safety
/// `ph` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(ph: *mut CUevent, flags: c_uint) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            if ph.is_null() || flags > 7 {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            let timing = flags & CUevent_flags_enum::CU_EVENT_DISABLE_TIMING.0 == 0;
            let id = EVENTS.insert(Arc::new(Event {
                timing,
                st: Mutex::new(EventState {
                    recorded: 0,
                    device: None,
                    done: 0,
                    time: None,
                }),
                cv: Condvar::new(),
            }));
            // SAFETY: `ph` is non-null and valid (this function's contract).
            unsafe { put(ph, id_to_ptr(id)) };
            Ok(())
        })())
    })
}

/// `cuEventDestroy_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(h: CUevent) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code(check_init().and_then(|_| {
            EVENTS
                .remove(ptr_to_id(h))
                .map(|_| ())
                .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
        }))
    })
}

/// `cuEventRecord`: a marker on the stream; a no-op on a capturing stream.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(h: CUevent, s: CUstream) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let ev = event(h)?;
            let t = resolve(s, None)?;
            if t.stream.capturing() {
                return Ok(());
            }
            driver::sticky(t.stream.device())?;
            let generation = {
                let mut st = ev.st.lock();
                st.recorded += 1;
                st.device = Some(t.stream.device());
                st.recorded
            };
            submit(
                &t,
                Arc::new(move || {
                    let ev = ev.clone();
                    Box::new(move || ev.complete(generation))
                }),
            )
        })())
    })
}

/// `cuEventQuery`: the sticky error of the device it was recorded on, if
/// any, else `CUDA_ERROR_NOT_READY` until the stream reaches the latest
/// record; an event never recorded is complete.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(h: CUevent) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let ev = event(h)?;
            let st = ev.st.lock();
            st.device.map_or(Ok(()), driver::sticky)?;
            if st.done >= st.recorded {
                Ok(())
            } else {
                Err(CUresult::CUDA_ERROR_NOT_READY)
            }
        })())
    })
}

/// `cuEventSynchronize`: blocks until the latest record has run, then
/// reports the sticky error of the device it was recorded on, if any.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(h: CUevent) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let ev = event(h)?;
            let (g, device) = {
                let st = ev.st.lock();
                (st.recorded, st.device)
            };
            ev.wait(g);
            device.map_or(Ok(()), driver::sticky)
        })())
    })
}

/// `cuEventElapsedTime_v2`: milliseconds between the two markers' host
/// times.
///
/// # Safety
/// `ms` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: CUevent,
    end: CUevent,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let (a, b) = (event(start)?, event(end)?);
            if ms.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            if !a.timing || !b.timing {
                return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
            }
            let time = |e: &Event| {
                let st = e.st.lock();
                if st.recorded == 0 {
                    Err(CUresult::CUDA_ERROR_INVALID_HANDLE)
                } else if st.done < st.recorded {
                    Err(CUresult::CUDA_ERROR_NOT_READY)
                } else {
                    st.time.ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
                }
            };
            let (ta, tb) = (time(&a)?, time(&b)?);
            let v = if tb >= ta {
                tb.duration_since(ta).as_secs_f64() * 1e3
            } else {
                -(ta.duration_since(tb).as_secs_f64() * 1e3)
            };
            // SAFETY: `ms` is non-null and valid (this function's contract).
            unsafe { put(ms, v as f32) };
            Ok(())
        })())
    })
}

/// `cuStreamWaitEvent`: the stream waits for the event's latest record at
/// the time of the call (none: no wait).
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(s: CUstream, h: CUevent, _flags: c_uint) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let ev = event(h)?;
            let t = resolve(s, None)?;
            driver::sticky(t.stream.device())?;
            let g = {
                let st = ev.st.lock();
                if st.done >= st.recorded {
                    return Ok(());
                }
                st.recorded
            };
            if t.stream.capturing() {
                return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
            submit(
                &t,
                Arc::new(move || {
                    let ev = ev.clone();
                    Box::new(move || ev.wait(g))
                }),
            )
        })())
    })
}
