//! Modules and kernels: `cuModuleLoadData` parses the `.entry` names of
//! PTX text, and `cuLaunchKernel` and `cuLaunchKernelEx` run the project's
//! kernels that the emulator knows as host code on the stream
//! (`bf16_add_inplace` in `bf16_add`; `bf16_one_shot_all_reduce`,
//! `f16_one_shot_all_reduce` and `f32_one_shot_all_reduce` in `one_shot`;
//! the fused `*_one_shot_add_rms_norm` and `*_one_shot_add_rms_norm_cluster`
//! in `fused`; `*_add_rms_norm` in `norm`). Of `cuLaunchKernelEx`'s
//! attributes only the cluster dimensions are read; the emulator runs a
//! launch as one block whatever its dimensions, and only the cluster
//! entries check them (their launch contract).
//!
//! Invariants:
//! - A function handle exists only for an entry that is in its module's PTX
//!   and has a host implementation.
//! - Every range a kernel touches is checked at launch and again when it
//!   runs, atomically with the run (`memory::access`): a range not
//!   allocated then is the device's sticky `CUDA_ERROR_ILLEGAL_ADDRESS`,
//!   never a read of freed memory. A device with a sticky error refuses
//!   launches and drops queued kernels.

use std::ffi::{CStr, c_char, c_uint, c_void};
use std::sync::Arc;

use cuda_sys::{
    CUfunction, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchConfig, CUmodule, CUresult,
    CUstream,
};

use super::{bf16_add, fused, norm, one_shot};
use crate::cuda::driver::{self, check_init, code};
use crate::cuda::stream;
use crate::{Table, guard, id_to_ptr, ptr_to_id, put};

/// The kernels with a host implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// `bf16_add_inplace(bf16* dst, const bf16* src, u64 n)`.
    Bf16AddInplace,
    /// `{bf16,f16,f32}_one_shot_all_reduce(OsCtrl* ctrl, T* data, u64 n,
    /// u32 lane)`, run by `one_shot`.
    OneShotAllReduce(one_shot::Elem),
    /// `{bf16,f16,f32}_add_rms_norm(T* x, T* residual, const T* weight,
    /// u64 hidden, u64 rows, f32 eps)`, run by `norm`.
    AddRmsNorm(one_shot::Elem),
    /// `{bf16,f16,f32}_one_shot_add_rms_norm(OsCtrl* ctrl, T* x, T*
    /// residual, const T* weight, u64 hidden, u64 rows, f32 eps, u32
    /// lane)`, run by `fused`.
    FusedOneShot(one_shot::Elem),
    /// `{bf16,f16,f32}_one_shot_add_rms_norm_cluster`, the parameters and
    /// arithmetic of `FusedOneShot`, run by `fused` after the check of its
    /// cluster launch contract (`fused::cluster_ok`).
    FusedOneShotCluster(one_shot::Elem),
}

impl Kernel {
    fn by_name(name: &str) -> Option<Self> {
        match name {
            metrale_kernel_abi::add::NAME => Some(Kernel::Bf16AddInplace),
            _ => one_shot::Elem::by_name(name)
                .map(Kernel::OneShotAllReduce)
                .or_else(|| norm::by_name(name).map(Kernel::AddRmsNorm))
                .or_else(|| norm::fused_by_name(name).map(Kernel::FusedOneShot))
                .or_else(|| norm::fused_cluster_by_name(name).map(Kernel::FusedOneShotCluster)),
        }
    }
}

struct Module {
    entries: Vec<String>,
}

static MODULES: Table<Module> = Table::new();
static FUNCTIONS: Table<Kernel> = Table::new();

/// The names of the `.entry` directives of PTX text.
fn entries(ptx: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = ptx;
    while let Some(i) = rest.find(".entry") {
        rest = &rest[i + ".entry".len()..];
        let name: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '$' | '.'))
            .collect();
        if !name.is_empty() {
            out.push(name);
        }
    }
    out
}

/// `cuModuleLoadData`: NUL-terminated PTX text.
///
/// # Safety
/// `image` is null or a NUL-terminated string; `module` is null or valid for
/// a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            driver::current_device().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
            if module.is_null() || image.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: `image` is a NUL-terminated string (this function's contract).
            let text = unsafe { CStr::from_ptr(image.cast::<c_char>()) }
                .to_str()
                .map_err(|_| CUresult::CUDA_ERROR_INVALID_IMAGE)?;
            if !text.contains(".version") && !text.contains(".entry") {
                return Err(CUresult::CUDA_ERROR_INVALID_IMAGE);
            }
            let id = MODULES.insert(Arc::new(Module {
                entries: entries(text),
            }));
            // SAFETY: `module` is non-null and valid (this function's contract).
            unsafe { put(module, id_to_ptr(id)) };
            Ok(())
        })())
    })
}

/// `cuModuleUnload`.
#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: CUmodule) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code(check_init().and_then(|_| {
            MODULES
                .remove(ptr_to_id(module))
                .map(|_| ())
                .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
        }))
    })
}

/// `cuModuleGetFunction`: `CUDA_ERROR_NOT_FOUND` for a name not in the
/// module, or one the emulator cannot run.
///
/// # Safety
/// `name` is null or NUL-terminated; `func` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    func: *mut CUfunction,
    module: CUmodule,
    name: *const c_char,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            check_init()?;
            let m = MODULES
                .get(ptr_to_id(module))
                .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
            if func.is_null() || name.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: `name` is NUL-terminated (this function's contract).
            let name = unsafe { CStr::from_ptr(name) }
                .to_str()
                .map_err(|_| CUresult::CUDA_ERROR_NOT_FOUND)?;
            if !m.entries.iter().any(|e| e == name) {
                return Err(CUresult::CUDA_ERROR_NOT_FOUND);
            }
            let k = Kernel::by_name(name).ok_or(CUresult::CUDA_ERROR_NOT_FOUND)?;
            let id = FUNCTIONS.insert(Arc::new(k));
            // SAFETY: `func` is non-null and valid (this function's contract).
            unsafe { put(func, id_to_ptr(id)) };
            Ok(())
        })())
    })
}

/// `cuLaunchKernel`: runs the kernel's host implementation on the stream;
/// grid and block dimensions are checked to be non-zero and otherwise
/// ignored, except by the cluster entries, which check their launch
/// contract (a launch here has cluster dimensions `(1, 1, 1)`).
///
/// # Safety
/// `params` is null or an array of pointers to the kernel's arguments.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    _shared: c_uint,
    s: CUstream,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        let dims = Dims {
            grid: [gx, gy, gz],
            block: [bx, by, bz],
            cluster: [1, 1, 1],
        };
        // SAFETY: `params` is as `launch` requires (this function's contract).
        code(unsafe { launch(f, dims, s, params) })
    })
}

/// `cuLaunchKernelEx`: `cuLaunchKernel` with its grid, block, shared
/// memory and stream read from `config`, and its attributes:
/// `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION` sets the cluster dimensions
/// (the last one wins; `(1, 1, 1)` without one), which the cluster entries
/// check against their launch contract; any other attribute is ignored
/// (programmatic stream serialization among them: every launch of a
/// stream runs after the work before it, which a programmatic launch's
/// kernel, waiting for that work, also sees on a GPU).
///
/// # Safety
/// `config` is null or points to a launch configuration whose `attrs` is
/// null or holds `numAttrs` attributes; `params` is null or an array of
/// pointers to the kernel's arguments.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    guard(CUresult::CUDA_ERROR_UNKNOWN, || {
        code((|| {
            if config.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: `config` is non-null and valid (this function's contract).
            let c = unsafe { &*config };
            if c.numAttrs > 0 && c.attrs.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            let mut cluster = [1, 1, 1];
            for i in 0..c.numAttrs as usize {
                // SAFETY: `attrs` holds `numAttrs` attributes (this
                // function's contract); the fields are read through raw
                // pointers, as a caller may leave the rest (`pad`, other
                // members of the value) unwritten.
                let a: *const CUlaunchAttribute = unsafe { c.attrs.add(i) };
                // SAFETY: as above; an id is any u32.
                let id = unsafe { std::ptr::addr_of!((*a).id).read_unaligned() };
                if id == CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION {
                    // SAFETY: as above; the id says the value holds the
                    // cluster dimensions, three u32.
                    let d = unsafe { std::ptr::addr_of!((*a).value.clusterDim).read_unaligned() };
                    cluster = [d.x, d.y, d.z];
                }
            }
            let dims = Dims {
                grid: [c.gridDimX, c.gridDimY, c.gridDimZ],
                block: [c.blockDimX, c.blockDimY, c.blockDimZ],
                cluster,
            };
            // SAFETY: `params` is as `launch` requires (this function's contract).
            unsafe { launch(f, dims, c.hStream, params) }
        })())
    })
}

/// A launch's dimensions: grid and block, and cluster (`(1, 1, 1)` for
/// `cuLaunchKernel`).
#[derive(Clone, Copy)]
struct Dims {
    grid: [u32; 3],
    block: [u32; 3],
    cluster: [u32; 3],
}

/// The launch of `f` on stream `s`, shared by both launch calls.
///
/// # Safety
/// `params` is null or an array of pointers to the kernel's arguments.
unsafe fn launch(
    f: CUfunction,
    dims: Dims,
    s: CUstream,
    params: *mut *mut c_void,
) -> Result<(), CUresult> {
    check_init()?;
    let k = FUNCTIONS
        .get(ptr_to_id(f))
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
    if dims.grid.contains(&0) || dims.block.contains(&0) || params.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let target = stream::resolve(s, None)?;
    let dev = target.stream.device();
    driver::sticky(dev)?;
    match *k {
        Kernel::Bf16AddInplace => {
            // SAFETY: `params` holds pointers to the three arguments
            // (this function's contract).
            let (dst, src, n) = unsafe {
                let p0 = *params.add(0);
                let p1 = *params.add(1);
                let p2 = *params.add(2);
                if p0.is_null() || p1.is_null() || p2.is_null() {
                    return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
                }
                (
                    p0.cast::<u64>().read_unaligned(),
                    p1.cast::<u64>().read_unaligned(),
                    p2.cast::<u64>().read_unaligned(),
                )
            };
            let l = bf16_add::launcher((dst, src, n), dev)?;
            stream::submit(&target, l)
        }
        Kernel::OneShotAllReduce(elem) => {
            // SAFETY: `params` holds pointers to the four arguments
            // (this function's contract).
            let (ctrl, data, n, lane) = unsafe {
                let p: [*mut c_void; 4] = std::array::from_fn(|i| *params.add(i));
                if p.iter().any(|a| a.is_null()) {
                    return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
                }
                (
                    p[0].cast::<u64>().read_unaligned(),
                    p[1].cast::<u64>().read_unaligned(),
                    p[2].cast::<u64>().read_unaligned(),
                    p[3].cast::<u32>().read_unaligned(),
                )
            };
            let l = one_shot::launcher(elem, (ctrl, data, n, lane), dev)?;
            stream::submit(&target, l)
        }
        Kernel::AddRmsNorm(elem) => {
            // SAFETY: `params` holds pointers to the six arguments
            // (this function's contract).
            let a = unsafe { norm_args(params, 0)? };
            stream::submit(&target, norm::launcher(elem, a, dev)?)
        }
        Kernel::FusedOneShot(elem) | Kernel::FusedOneShotCluster(elem) => {
            // SAFETY: `params` holds pointers to the eight
            // arguments (this function's contract).
            let (ctrl, a, lane) = unsafe {
                let p: [*mut c_void; 8] = std::array::from_fn(|i| *params.add(i));
                if p.iter().any(|a| a.is_null()) {
                    return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
                }
                (
                    p[0].cast::<u64>().read_unaligned(),
                    norm_args(params, 1)?,
                    p[7].cast::<u32>().read_unaligned(),
                )
            };
            let launch_ok = match *k {
                Kernel::FusedOneShotCluster(_) => {
                    fused::cluster_ok(dims.grid[0], dims.block[0], dims.cluster)
                }
                _ => true,
            };
            let l = fused::launcher(elem, ctrl, a, lane, launch_ok, dev)?;
            stream::submit(&target, l)
        }
    }
}

/// The add + norm's six arguments `(x, residual, weight, hidden, rows,
/// eps)`, from `params[at..at + 6]`.
///
/// # Safety
/// `params` holds pointers to those arguments there.
unsafe fn norm_args(params: *mut *mut c_void, at: usize) -> Result<norm::Args, CUresult> {
    // SAFETY: this function's contract.
    let p: [*mut c_void; 6] = std::array::from_fn(|i| unsafe { *params.add(at + i) });
    if p.iter().any(|a| a.is_null()) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let as_usize = |v: u64| usize::try_from(v).map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE);
    // SAFETY: each pointer points to its argument's type (the contract).
    unsafe {
        Ok(norm::Args {
            x: p[0].cast::<u64>().read_unaligned(),
            res: p[1].cast::<u64>().read_unaligned(),
            w: p[2].cast::<u64>().read_unaligned(),
            hidden: as_usize(p[3].cast::<u64>().read_unaligned())?,
            rows: as_usize(p[4].cast::<u64>().read_unaligned())?,
            eps: p[5].cast::<f32>().read_unaligned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_entries() {
        let ptx = ".version 8.0\n.target sm_90\n.visible .entry bf16_add_inplace(\n .param .u64 a\n)\n{}\n.entry other_kernel (\n)";
        assert_eq!(entries(ptx), vec!["bf16_add_inplace", "other_kernel"]);
    }
}
