//! Streams, events and captured graphs.
//!
//! Invariants:
//! - Every method makes the owning context current before calling the
//!   driver.
//! - An owned [`Stream`], every [`Event`], [`Graph`] and [`GraphExec`] is
//!   destroyed exactly once, on drop; a borrowed stream is never destroyed.
//! - Host waits with a timeout poll (`cuStreamQuery`/`cuEventQuery`) and
//!   return [`Error::Timeout`] at the deadline instead of blocking forever.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_sys::{
    CUevent, CUevent_flags_enum, CUgraph, CUgraphExec, CUresult, CUstream, CUstream_flags_enum,
    CUstreamCaptureMode, CUstreamCaptureStatus,
};

use crate::driver::Context;
use crate::error::{Error, Result, cuda_check};

/// Polls `done` until it reports true or `timeout` passes, sleeping a little
/// longer each round (up to 1 ms).
pub(crate) fn poll_until(
    what: &'static str,
    timeout: Duration,
    mut done: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let start = Instant::now();
    let mut nap = Duration::from_micros(10);
    let mut spins = 0u32;
    loop {
        if done()? {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            return Err(Error::Timeout {
                what,
                after: timeout,
            });
        }
        // Spin for the first ~100 µs: enqueues and small collectives finish
        // in microseconds, and a sleep costs tens of them. Then back off to
        // 1 ms naps.
        if spins < 256 && start.elapsed() < Duration::from_micros(100) {
            spins += 1;
            std::thread::yield_now();
        } else {
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }
}

/// Maps a query result: success is `true`, `CUDA_ERROR_NOT_READY` is `false`.
fn ready(rc: CUresult, call: &'static str) -> Result<bool> {
    if rc == CUresult::CUDA_ERROR_NOT_READY {
        Ok(false)
    } else {
        cuda_check(rc, call).map(|()| true)
    }
}

/// A CUDA stream of one context, owned (destroyed on drop) or borrowed.
#[derive(Debug)]
pub struct Stream {
    raw: CUstream,
    ctx: Arc<Context>,
    owned: bool,
}

// SAFETY: a CUstream is a handle the driver lets any thread use; the driver
// synchronises concurrent use internally.
unsafe impl Send for Stream {}
// SAFETY: as for Send; no method mutates the value.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a non-blocking stream (`CU_STREAM_NON_BLOCKING`) in `ctx`.
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        ctx.make_current()?;
        let mut raw: CUstream = std::ptr::null_mut();
        let flags = CUstream_flags_enum::CU_STREAM_NON_BLOCKING.0;
        // SAFETY: writes one stream handle through a valid pointer; the
        // context is current.
        unsafe { cu!(cuStreamCreate(&mut raw, flags)) }?;
        Ok(Stream {
            raw,
            ctx: Arc::clone(ctx),
            owned: true,
        })
    }

    /// Wraps a stream someone else owns; it is not destroyed on drop.
    ///
    /// # Safety
    /// `raw` is a live stream of `ctx` (or null, the legacy default stream)
    /// that outlives the returned value.
    pub unsafe fn borrowed(ctx: &Arc<Context>, raw: CUstream) -> Stream {
        Stream {
            raw,
            ctx: Arc::clone(ctx),
            owned: false,
        }
    }

    /// The raw handle (still owned by this value when owned).
    pub fn raw(&self) -> CUstream {
        self.raw
    }

    /// The stream's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// True when all work submitted to the stream has completed.
    pub fn query(&self) -> Result<bool> {
        self.ctx.make_current()?;
        // SAFETY: `self.raw` is a live stream of the current context.
        let rc = unsafe { cuda_sys::call!(crate::error::cuda_lib()?, cuStreamQuery(self.raw)) }?;
        ready(rc, "cuStreamQuery")
    }

    /// Blocks until all submitted work completes (no deadline: prefer
    /// [`Stream::wait_until_idle`]).
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.make_current()?;
        // SAFETY: `self.raw` is a live stream of the current context.
        unsafe { cu!(cuStreamSynchronize(self.raw)) }
    }

    /// Waits for all submitted work, polling, up to `timeout`.
    pub fn wait_until_idle(&self, timeout: Duration) -> Result<()> {
        poll_until("stream", timeout, || self.query())
    }

    /// Makes later work on this stream wait for `event`.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.ctx.make_current()?;
        // SAFETY: both handles are live and this stream's context is current.
        unsafe { cu!(cuStreamWaitEvent(self.raw, event.raw, 0)) }
    }

    /// True while the stream is capturing into a graph.
    pub fn is_capturing(&self) -> Result<bool> {
        // SAFETY: the stream is live and of `self.ctx`.
        unsafe { Stream::is_capturing_raw(&self.ctx, self.raw) }
    }

    /// [`Stream::is_capturing`] for a raw stream, without a wrapper (a
    /// submission path asks this of every caller stream).
    ///
    /// # Safety
    /// `raw` is a live stream of `ctx` (or null, the legacy default stream).
    pub unsafe fn is_capturing_raw(ctx: &Context, raw: CUstream) -> Result<bool> {
        ctx.make_current()?;
        let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: writes one status through a valid pointer; the stream is
        // live (this function's contract).
        unsafe { cu!(cuStreamIsCapturing(raw, &mut status)) }?;
        Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// The id of the capture sequence `raw` is part of, `None` when it is
    /// not capturing (`cuStreamGetCaptureInfo_v3`, CUDA 12.3): streams
    /// forked into one capture share its id, and every capture has a new
    /// one.
    ///
    /// # Safety
    /// `raw` is a live stream of `ctx`.
    pub unsafe fn capture_id_raw(ctx: &Context, raw: CUstream) -> Result<Option<u64>> {
        ctx.make_current()?;
        let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: u64 = 0;
        // SAFETY: writes a status and an id through valid pointers and asks
        // for nothing else (null out-parameters are allowed); the stream is
        // live (this function's contract).
        unsafe {
            cu!(cuStreamGetCaptureInfo_v3(
                raw,
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut()
            ))
        }?;
        Ok((status == CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE).then_some(id))
    }

    /// Starts capturing this stream's work into a graph
    /// (`CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`).
    pub fn begin_capture(&self) -> Result<()> {
        self.ctx.make_current()?;
        let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: the stream is live and its context is current.
        unsafe { cu!(cuStreamBeginCapture_v2(self.raw, mode)) }
    }

    /// Ends the capture started by [`Stream::begin_capture`].
    pub fn end_capture(&self) -> Result<Graph> {
        self.ctx.make_current()?;
        let mut raw: CUgraph = std::ptr::null_mut();
        // SAFETY: writes one graph handle through a valid pointer; the stream
        // is live and its context is current.
        unsafe { cu!(cuStreamEndCapture(self.raw, &mut raw)) }?;
        if raw.is_null() {
            return Err(Error::invalid(
                "cuStreamEndCapture",
                "the driver returned no graph",
            ));
        }
        Ok(Graph {
            raw,
            ctx: Arc::clone(&self.ctx),
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let destroy = || -> Result<()> {
            self.ctx.make_current()?;
            // SAFETY: this value owns the stream and destroys it once, here.
            unsafe { cu!(cuStreamDestroy_v2(self.raw)) }
        };
        if let Err(e) = destroy() {
            tracing::error!(error = %e, "destroying a stream failed");
        }
    }
}

/// A captured CUDA graph.
#[derive(Debug)]
pub struct Graph {
    raw: CUgraph,
    ctx: Arc<Context>,
}

// SAFETY: a CUgraph may be used from any thread, one at a time; `Graph` is
// not Sync, so it is.
unsafe impl Send for Graph {}

impl Graph {
    /// The raw handle (still owned by this value).
    pub fn raw(&self) -> CUgraph {
        self.raw
    }

    /// Instantiates the graph for launching.
    pub fn instantiate(&self) -> Result<GraphExec> {
        self.ctx.make_current()?;
        let mut raw: CUgraphExec = std::ptr::null_mut();
        // SAFETY: writes one handle through a valid pointer; the graph is live.
        unsafe { cu!(cuGraphInstantiateWithFlags(&mut raw, self.raw, 0)) }?;
        Ok(GraphExec {
            raw,
            ctx: Arc::clone(&self.ctx),
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let destroy = || -> Result<()> {
            self.ctx.make_current()?;
            // SAFETY: this value owns the graph and destroys it once, here.
            unsafe { cu!(cuGraphDestroy(self.raw)) }
        };
        if let Err(e) = destroy() {
            tracing::error!(error = %e, "destroying a graph failed");
        }
    }
}

/// An instantiated, launchable graph.
#[derive(Debug)]
pub struct GraphExec {
    raw: CUgraphExec,
    ctx: Arc<Context>,
}

// SAFETY: a CUgraphExec may be used from any thread, one at a time;
// `GraphExec` is not Sync, so it is.
unsafe impl Send for GraphExec {}

impl GraphExec {
    /// The raw handle (still owned by this value).
    pub fn raw(&self) -> CUgraphExec {
        self.raw
    }

    /// Launches the graph on `stream`.
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        if stream.ctx.raw() != self.ctx.raw() {
            return Err(Error::invalid(
                "GraphExec::launch",
                "the stream belongs to another context",
            ));
        }
        self.ctx.make_current()?;
        // SAFETY: both handles are live and belong to the current context.
        unsafe { cu!(cuGraphLaunch(self.raw, stream.raw)) }
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        let destroy = || -> Result<()> {
            self.ctx.make_current()?;
            // SAFETY: this value owns the instance and destroys it once, here.
            unsafe { cu!(cuGraphExecDestroy(self.raw)) }
        };
        if let Err(e) = destroy() {
            tracing::error!(error = %e, "destroying a graph instance failed");
        }
    }
}

/// A CUDA event of one context.
#[derive(Debug)]
pub struct Event {
    raw: CUevent,
    ctx: Arc<Context>,
}

// SAFETY: a CUevent is a handle the driver lets any thread use; the driver
// synchronises concurrent use internally.
unsafe impl Send for Event {}
// SAFETY: as for Send; no method mutates the value.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event; `timing = false` adds `CU_EVENT_DISABLE_TIMING`.
    pub fn new(ctx: &Arc<Context>, timing: bool) -> Result<Event> {
        ctx.make_current()?;
        let flags = if timing {
            CUevent_flags_enum::CU_EVENT_DEFAULT.0
        } else {
            CUevent_flags_enum::CU_EVENT_DISABLE_TIMING.0
        };
        let mut raw: CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle through a valid pointer; the
        // context is current.
        unsafe { cu!(cuEventCreate(&mut raw, flags)) }?;
        Ok(Event {
            raw,
            ctx: Arc::clone(ctx),
        })
    }

    /// The raw handle (still owned by this value).
    pub fn raw(&self) -> CUevent {
        self.raw
    }

    /// The event's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Records the event at the current end of `stream`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        if stream.ctx.raw() != self.ctx.raw() {
            return Err(Error::invalid(
                "Event::record",
                "the stream belongs to another context",
            ));
        }
        // SAFETY: `stream` is a live stream of this event's context.
        unsafe { self.record_raw(stream.raw) }
    }

    /// Records the event on a raw stream.
    ///
    /// # Safety
    /// `stream` is a live stream of this event's context (or null).
    pub unsafe fn record_raw(&self, stream: CUstream) -> Result<()> {
        self.ctx.make_current()?;
        // SAFETY: the event is live and `stream` is a live stream of the
        // current context (this function's contract).
        unsafe { cu!(cuEventRecord(self.raw, stream)) }
    }

    /// Makes later work on a raw stream wait for this event.
    ///
    /// # Safety
    /// `stream` is a live stream (or null).
    pub unsafe fn wait_raw(&self, stream: CUstream) -> Result<()> {
        self.ctx.make_current()?;
        // SAFETY: the event is live and `stream` is a live stream (this
        // function's contract).
        unsafe { cu!(cuStreamWaitEvent(stream, self.raw, 0)) }
    }

    /// Records the event on a raw stream as an external event: on a stream
    /// being captured into a graph, an event-record node that records the
    /// event at each launch of the graph, which work outside the graph (or
    /// another graph's [`Event::wait_external_raw`]) can wait for; on a
    /// stream not capturing, a plain record. (`cuEventRecordWithFlags`
    /// with `CU_EVENT_RECORD_EXTERNAL`, CUDA 11.1.)
    ///
    /// # Safety
    /// `stream` is a live stream of this event's context.
    pub unsafe fn record_external_raw(&self, stream: CUstream) -> Result<()> {
        self.ctx.make_current()?;
        let flags = cuda_sys::CUevent_record_flags_enum::CU_EVENT_RECORD_EXTERNAL.0;
        // SAFETY: the event is live and `stream` is a live stream of the
        // current context (this function's contract).
        unsafe { cu!(cuEventRecordWithFlags(self.raw, stream, flags)) }
    }

    /// Makes later work on a raw stream wait for this event as an external
    /// event: on a stream being captured, an event-wait node that, at each
    /// launch of the graph, waits for the event's latest record as of that
    /// launch; on a stream not capturing, a plain wait.
    /// (`cuStreamWaitEvent` with `CU_EVENT_WAIT_EXTERNAL`.)
    ///
    /// # Safety
    /// `stream` is a live stream.
    pub unsafe fn wait_external_raw(&self, stream: CUstream) -> Result<()> {
        self.ctx.make_current()?;
        let flags = cuda_sys::CUevent_wait_flags_enum::CU_EVENT_WAIT_EXTERNAL.0;
        // SAFETY: the event is live and `stream` is a live stream (this
        // function's contract).
        unsafe { cu!(cuStreamWaitEvent(stream, self.raw, flags)) }
    }

    /// True when the work recorded before the event has completed (also
    /// true for a never-recorded event).
    pub fn query(&self) -> Result<bool> {
        self.ctx.make_current()?;
        // SAFETY: the event is live.
        let rc = unsafe { cuda_sys::call!(crate::error::cuda_lib()?, cuEventQuery(self.raw)) }?;
        ready(rc, "cuEventQuery")
    }

    /// Blocks until the event completes (no deadline: prefer
    /// [`Event::wait_with_deadline`]).
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.make_current()?;
        // SAFETY: the event is live.
        unsafe { cu!(cuEventSynchronize(self.raw)) }
    }

    /// Waits for the event, polling, up to `timeout`.
    pub fn wait_with_deadline(&self, timeout: Duration) -> Result<()> {
        poll_until("event", timeout, || self.query())
    }

    /// Milliseconds between `start` and this event (both recorded with
    /// timing enabled and completed).
    pub fn elapsed_ms(&self, start: &Event) -> Result<f32> {
        self.ctx.make_current()?;
        let mut ms = 0f32;
        // SAFETY: writes one float through a valid pointer; both events are live.
        unsafe { cu!(cuEventElapsedTime_v2(&mut ms, start.raw, self.raw)) }?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let destroy = || -> Result<()> {
            self.ctx.make_current()?;
            // SAFETY: this value owns the event and destroys it once, here.
            unsafe { cu!(cuEventDestroy_v2(self.raw)) }
        };
        if let Err(e) = destroy() {
            tracing::error!(error = %e, "destroying an event failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_until_times_out_with_the_requested_duration() {
        let mut calls = 0;
        let err = poll_until("stream", Duration::from_millis(5), || {
            calls += 1;
            Ok(false)
        })
        .unwrap_err();
        assert!(calls > 1, "polled {calls} times");
        match err {
            Error::Timeout { what, after } => {
                assert_eq!(what, "stream");
                assert_eq!(after, Duration::from_millis(5));
            }
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn poll_until_stops_when_done() {
        let mut calls = 0;
        poll_until("event", Duration::from_secs(5), || {
            calls += 1;
            Ok(calls == 3)
        })
        .unwrap();
        assert_eq!(calls, 3);
    }
}
