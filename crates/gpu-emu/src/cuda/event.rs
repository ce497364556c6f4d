//! Events: markers in a stream's queue, completed (and timed, with the
//! host's clock) when the stream reaches them; `cuStreamWaitEvent` makes a
//! stream wait for one. While the cost model is active (`cost`) a marker
//! also stamps the event with its stream's virtual clock, a wait moves the
//! waiting stream's clock up to the event's stamp (a marker is enqueued
//! for it even when the event is complete), and the elapsed time of two
//! events stamped under one model is the difference of their stamps.
//!
//! Invariants: each record is a new generation of the event, and the event
//! is complete once its latest record's marker has run (an event never
//! recorded is complete); a wait is for the generation recorded at the
//! time of the call. On a capturing stream an external record or wait
//! (`CU_EVENT_RECORD_EXTERNAL`, `CU_EVENT_WAIT_EXTERNAL`) is a node that
//! takes its generation at each launch of the graph, as if enqueued then;
//! any other record there is a no-op, and any other wait for a pending
//! event `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (no cross-stream
//! capture).
//! An event's state is a leaf lock: a query holds it only to read the
//! device's sticky error, and a record or a wait releases it before it
//! enqueues.

use std::ffi::c_uint;
use std::sync::Arc;
use std::time::Instant;

use cuda_sys::{CUevent, CUevent_flags_enum, CUresult, CUstream};
use parking_lot::{Condvar, Mutex};

use super::driver::{self, check_init, code, current_device};
use super::stream::{Launcher, TICK, resolve, submit};
use crate::{Table, cost, guard, id_to_ptr, ptr_to_id, put};

struct EventState {
    /// Generation of the latest record.
    recorded: u64,
    /// The device of the stream of the latest record.
    device: Option<i32>,
    /// Highest generation whose marker has run.
    done: u64,
    time: Option<Instant>,
    /// The virtual clock at the latest completed record, taken while the
    /// cost model was active.
    stamp: Option<cost::Stamp>,
}

/// An emulated event.
struct Event {
    timing: bool,
    st: Mutex<EventState>,
    cv: Condvar,
}

impl Event {
    fn complete(&self, generation: u64, stamp: Option<cost::Stamp>) {
        let mut st = self.st.lock();
        if generation > st.done {
            st.done = generation;
            st.time = Some(Instant::now());
            st.stamp = stamp;
        }
        self.cv.notify_all();
    }

    fn stamp(&self) -> Option<cost::Stamp> {
        self.st.lock().stamp
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
                    stamp: None,
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

/// `CU_EVENT_RECORD_EXTERNAL` / `CU_EVENT_WAIT_EXTERNAL`.
const EXTERNAL: c_uint = 1;

/// A record of `ev` as one execution: the generation is taken when the
/// launcher runs (the call, or each launch of a graph that captured it),
/// the event completes when the stream reaches it.
fn record_launcher(ev: Arc<Event>, device: i32) -> Launcher {
    Arc::new(move || {
        let generation = {
            let mut st = ev.st.lock();
            st.recorded += 1;
            st.device = Some(device);
            st.recorded
        };
        let ev = ev.clone();
        Box::new(move || ev.complete(generation, cost::stamp()))
    })
}

/// `cuEventRecord` and `cuEventRecordWithFlags`: a marker on the stream.
/// On a capturing stream an external record (`CU_EVENT_RECORD_EXTERNAL`)
/// is captured as a node that records the event at each launch of the
/// graph; any other record there is a no-op (cross-stream capture is not
/// emulated).
fn record(h: CUevent, s: CUstream, flags: c_uint) -> Result<(), CUresult> {
    check_init()?;
    if flags & !EXTERNAL != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let ev = event(h)?;
    let t = resolve(s, None)?;
    let capturing = t.stream.capturing();
    if capturing && flags & EXTERNAL == 0 {
        return Ok(());
    }
    if !capturing {
        driver::sticky(t.stream.device())?;
    }
    submit(&t, record_launcher(ev, t.stream.device()))
}

/// `cuEventRecord`: a marker on the stream; a no-op on a capturing stream.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(h: CUevent, s: CUstream) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || code(record(h, s, 0)))
}

/// `cuEventRecordWithFlags`: as `cuEventRecord`; with
/// `CU_EVENT_RECORD_EXTERNAL` on a capturing stream, a record node that
/// records the event at each launch of the graph.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecordWithFlags(h: CUevent, s: CUstream, flags: c_uint) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || code(record(h, s, flags)))
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

/// `cuEventElapsedTime_v2`: milliseconds between the two markers: the
/// difference of their virtual stamps when both carry stamps taken under
/// one cost model (no clear between them), else of their host times.
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
            if let Some(v) = cost::elapsed_ms(a.stamp(), b.stamp()) {
                // SAFETY: `ms` is non-null and valid (this function's contract).
                unsafe { put(ms, v) };
                return Ok(());
            }
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
/// the time of the call (none: no wait). On a capturing stream a wait with
/// `CU_EVENT_WAIT_EXTERNAL` is captured as a node that, at each launch of
/// the graph, waits for the event's latest record as of that launch (the
/// way NCCL orders captured work after earlier launches); any other wait
/// there on an event not yet complete is
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (cross-stream capture is not
/// emulated). While the cost model is active, the wait (even for a
/// complete event) moves the stream's virtual clock up to the event's
/// stamp when it runs.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(s: CUstream, h: CUevent, flags: c_uint) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            if flags & !EXTERNAL != 0 {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            let ev = event(h)?;
            let t = resolve(s, None)?;
            if t.stream.capturing() && flags & EXTERNAL != 0 {
                return submit(
                    &t,
                    Arc::new(move || {
                        let g = {
                            let st = ev.st.lock();
                            (st.done < st.recorded).then_some(st.recorded)
                        };
                        let ev = ev.clone();
                        Box::new(move || {
                            if let Some(g) = g {
                                ev.wait(g);
                            }
                            cost::merge(ev.stamp());
                        })
                    }),
                );
            }
            driver::sticky(t.stream.device())?;
            let (g, pending) = {
                let st = ev.st.lock();
                (st.recorded, st.done < st.recorded)
            };
            let capturing = t.stream.capturing();
            if !pending && (capturing || g == 0 || !cost::active()) {
                return Ok(());
            }
            if capturing {
                return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
            submit(
                &t,
                Arc::new(move || {
                    let ev = ev.clone();
                    Box::new(move || {
                        ev.wait(g);
                        cost::merge(ev.stamp());
                    })
                }),
            )
        })())
    })
}
