//! Stream capture and graphs: a capturing stream records the launchers of
//! its work instead of running it; the capture ends as a graph, which is
//! instantiated and launched, each launch a fresh execution of every
//! recorded launcher (a captured collective is a new collective each
//! time).
//!
//! Invariants: a graph and its instances are ids in their tables until
//! destroyed; an instance owns a copy of the graph's launchers, so
//! destroying the graph leaves it usable; a graph launch is one work item
//! on its stream, running the executions in recorded order, in the cost
//! model's graph mode (`cost::in_graph`). The tables'
//! locks are leaves.

use std::sync::Arc;

use cuda_sys::{
    CUgraph, CUgraphExec, CUresult, CUstream, CUstreamCaptureMode, CUstreamCaptureStatus,
};

use super::driver::{self, check_init, code};
use super::stream::{Launcher, Work, is_legacy, push_launched, resolve};
use crate::{Table, cost, guard, id_to_ptr, ptr_to_id, put};

/// A recorded sequence of work.
struct Graph {
    nodes: Vec<Launcher>,
}

static GRAPHS: Table<Graph> = Table::new();
static EXECS: Table<Graph> = Table::new();

/// `cuStreamBeginCapture_v2`: later work on the stream is recorded.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_v2(h: CUstream, mode: CUstreamCaptureMode) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            if mode.0 > 2 {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            if is_legacy(h) {
                return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
            let t = resolve(h, None)?;
            t.stream.begin_capture()
        })())
    })
}

/// `cuStreamEndCapture`: the recorded work as a graph.
///
/// # Safety
/// `ph` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture(h: CUstream, ph: *mut CUgraph) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            if ph.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            if is_legacy(h) {
                return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
            }
            let t = resolve(h, None)?;
            let nodes = t
                .stream
                .end_capture()
                .ok_or(CUresult::CUDA_ERROR_ILLEGAL_STATE)?;
            let id = GRAPHS.insert(Arc::new(Graph { nodes }));
            // SAFETY: `ph` is non-null and valid (this function's contract).
            unsafe { put(ph, id_to_ptr(id)) };
            Ok(())
        })())
    })
}

/// `cuStreamIsCapturing`.
///
/// # Safety
/// `status` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing(
    h: CUstream,
    status: *mut CUstreamCaptureStatus,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let t = resolve(h, None)?;
            let s = if t.stream.capturing() {
                CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
            } else {
                CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
            };
            // SAFETY: `status` is null or valid (this function's contract).
            if unsafe { put(status, s) } {
                Ok(())
            } else {
                Err(CUresult::CUDA_ERROR_INVALID_VALUE)
            }
        })())
    })
}

/// `cuStreamGetCaptureInfo_v3`: whether the stream is capturing and the
/// capture's id (every capture has its own); the graph, dependencies and
/// edges are not emulated (null, and 0 dependencies).
///
/// # Safety
/// Every out-parameter is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v3(
    h: CUstream,
    status: *mut CUstreamCaptureStatus,
    id: *mut u64,
    graph: *mut CUgraph,
    deps: *mut *const cuda_sys::CUgraphNode,
    edges: *mut *const cuda_sys::CUgraphEdgeData,
    n_deps: *mut usize,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            if status.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            let t = resolve(h, None)?;
            let cid = t.stream.capture_id();
            let s = if cid.is_some() {
                CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
            } else {
                CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
            };
            // SAFETY: every pointer is null or valid (this function's
            // contract); `put` writes only through non-null ones.
            unsafe {
                put(status, s);
                if let Some(cid) = cid {
                    put(id, cid);
                }
                put(graph, std::ptr::null_mut());
                put(deps, std::ptr::null());
                put(edges, std::ptr::null());
                put(n_deps, 0);
            }
            Ok(())
        })())
    })
}

/// `cuGraphInstantiateWithFlags`.
///
/// # Safety
/// `ph` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    ph: *mut CUgraphExec,
    graph: CUgraph,
    _flags: u64,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let g = GRAPHS
                .get(ptr_to_id(graph))
                .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
            if ph.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            let id = EXECS.insert(Arc::new(Graph {
                nodes: g.nodes.clone(),
            }));
            // SAFETY: `ph` is non-null and valid (this function's contract).
            unsafe { put(ph, id_to_ptr(id)) };
            Ok(())
        })())
    })
}

/// `cuGraphLaunch`: a fresh execution of the recorded work on `h`, its
/// operations charged their graph-mode costs (`cost`).
#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch(exec: CUgraphExec, h: CUstream) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let g = EXECS
                .get(ptr_to_id(exec))
                .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
            let t = resolve(h, None)?;
            if t.stream.capturing() {
                return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
            driver::sticky(t.stream.device())?;
            let works: Vec<Work> = g.nodes.iter().map(|l| l()).collect();
            push_launched(
                &t,
                Box::new(move || {
                    cost::in_graph(|| {
                        for w in works {
                            w();
                        }
                    })
                }),
            );
            if t.sync {
                t.stream.wait_idle()?;
                driver::sticky(t.stream.device())?;
            }
            Ok(())
        })())
    })
}

/// `cuGraphExecDestroy`.
#[unsafe(no_mangle)]
pub extern "C" fn cuGraphExecDestroy(exec: CUgraphExec) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code(check_init().and_then(|_| {
            EXECS
                .remove(ptr_to_id(exec))
                .map(|_| ())
                .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
        }))
    })
}

/// `cuGraphDestroy`.
#[unsafe(no_mangle)]
pub extern "C" fn cuGraphDestroy(graph: CUgraph) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code(check_init().and_then(|_| {
            GRAPHS
                .remove(ptr_to_id(graph))
                .map(|_| ())
                .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
        }))
    })
}
