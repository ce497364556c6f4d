//! `cargo xtask bindgen [--check]`: regenerates the committed FFI bindings of
//! `crates/cuda-sys` and `crates/nccl-sys` from pinned headers.
//!
//! Headers come from PyPI wheels (`nvidia-cuda-runtime` for `cuda.h`,
//! `nvidia-nccl-cu13` for `nccl.h`), downloaded with pip into
//! `target/xtask-cache/`. libclang comes from Debian's `libclang-dev`.
//! The output is a pure function of the pinned headers and this file, so two
//! runs give identical bytes, and `--check` compares instead of writing.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::workspace_root;

/// The CUDA 13.0 headers: the test machines' driver is CUDA 13.0
/// (docs/gpu-test.md), so the versioned symbols `cuda.h` maps to must exist
/// there.
const CUDA_WHEEL: &str = "nvidia-cuda-runtime==13.0.96";
/// NCCL 2.28.3, the test machines' NCCL (docs/gpu-test.md).
const NCCL_WHEEL: &str = "nvidia-nccl-cu13==2.28.3";

/// Driver API functions the stack uses. `cuda.h` maps most of these to a
/// versioned symbol (`cuMemAlloc` to `cuMemAlloc_v2`); bindgen sees the macro
/// expansion, so the list names what the header declares.
const CUDA_FUNCTIONS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDeviceGetPCIBusId",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxGetDevice",
    "cuCtxSynchronize",
    "cuCtxEnablePeerAccess",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamQuery",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuStreamIsCapturing",
    "cuStreamGetCaptureInfo_v3",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphDestroy",
    "cuGraphExecDestroy",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventRecordWithFlags",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventElapsedTime_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocHost_v2",
    "cuMemFreeHost",
    "cuMemGetInfo_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyDtoD_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8_v2",
    "cuMemsetD8Async",
    "cuMemsetD32_v2",
    "cuMemsetD32Async",
    "cuPointerGetAttribute",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuModuleGetFunction",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
];

/// Types wanted beyond those the functions pull in.
const CUDA_TYPES: &[&str] = &[
    "CUdevice_attribute_enum",
    "CUpointer_attribute_enum",
    "CUstreamCaptureStatus_enum",
    "CUstreamCaptureMode_enum",
    "CUstream_flags_enum",
    "CUevent_flags_enum",
    "CUevent_wait_flags_enum",
    "CUevent_record_flags_enum",
    "CUmemorytype_enum",
    "CUlaunchConfig",
    "CUlaunchAttribute",
    "CUlaunchAttributeID_enum",
    "CUlaunchAttributeValue",
];

/// Runs the subcommand.
pub fn run(args: &[String]) -> Result<i32> {
    let check = crate::check_flag(args, "cargo xtask bindgen [--check]")?;
    let root = workspace_root();
    let headers = fetch_headers(&root)?;
    let outputs = [
        ("crates/cuda-sys/src/bindings.rs", generate_cuda(&headers)?),
        ("crates/nccl-sys/src/bindings.rs", generate_nccl(&headers)?),
    ];
    let mut stale = Vec::new();
    for (rel, text) in &outputs {
        if crate::update_generated("bindgen", &root, rel, text, check)? && check {
            stale.push(*rel);
        }
    }
    if !stale.is_empty() {
        eprintln!(
            "xtask bindgen --check: committed bindings differ from the headers: {}; \
             run `cargo xtask bindgen`",
            stale.join(", ")
        );
        return Ok(1);
    }
    Ok(0)
}

/// Where the unpacked headers live.
struct Headers {
    cuda_include: PathBuf,
    nccl_include: PathBuf,
    /// Stand-ins for the CUDA runtime headers `nccl.h` includes: NCCL's API
    /// needs only `cudaStream_t` from them, which nccl-sys maps to cuda-sys.
    stub_include: PathBuf,
}

fn fetch_headers(root: &Path) -> Result<Headers> {
    let cache = root.join("target/xtask-cache/headers");
    let cuda_include = cache.join("nvidia/cu13/include");
    let nccl_include = cache.join("nvidia/nccl/include");
    for (wheel, marker, platform) in [
        (
            CUDA_WHEEL,
            cuda_include.join("cuda.h"),
            "manylinux2014_x86_64",
        ),
        (
            NCCL_WHEEL,
            nccl_include.join("nccl.h"),
            "manylinux_2_18_x86_64",
        ),
    ] {
        if marker.exists() {
            continue;
        }
        println!(
            "xtask bindgen: downloading {wheel} from PyPI into {}",
            cache.display()
        );
        std::fs::create_dir_all(&cache)?;
        let status = Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
            ])
            .args(["--python-version", "3.12", "--platform", platform, "-d"])
            .arg(&cache)
            .arg(wheel)
            .status()
            .context("running `python3 -m pip download` (is pip installed?)")?;
        if !status.success() {
            bail!("pip could not download {wheel}");
        }
        let name = wheel.split("==").next().unwrap_or(wheel).replace('-', "_");
        let whl = std::fs::read_dir(&cache)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&name) && n.ends_with(".whl"))
            })
            .with_context(|| format!("no wheel for {wheel} in {}", cache.display()))?;
        println!("xtask bindgen: unpacking the headers of {}", whl.display());
        let status = Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&whl)
            .arg(&cache)
            .status()
            .context("running `python3 -m zipfile`")?;
        if !status.success() || !marker.exists() {
            bail!("{} did not contain {}", whl.display(), marker.display());
        }
    }
    let stub_include = cache.join("stub-include");
    std::fs::create_dir_all(&stub_include)?;
    std::fs::write(
        stub_include.join("cuda_runtime.h"),
        "#pragma once\n#include <stddef.h>\n#define CUDART_VERSION 13000\n\
         typedef struct CUstream_st* cudaStream_t;\n",
    )?;
    for empty in ["cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h"] {
        std::fs::write(stub_include.join(empty), "#pragma once\n")?;
    }
    Ok(Headers {
        cuda_include,
        nccl_include,
        stub_include,
    })
}

fn base_builder() -> bindgen::Builder {
    bindgen::Builder::default()
        .default_enum_style(bindgen::EnumVariation::NewType {
            is_bitfield: false,
            is_global: false,
        })
        .derive_default(true)
        .derive_debug(true)
        .derive_eq(true)
        .generate_comments(false)
        .layout_tests(true)
        .dynamic_link_require_all(false)
        .formatter(bindgen::Formatter::Rustfmt)
}

fn generate_cuda(headers: &Headers) -> Result<String> {
    let mut b = base_builder()
        .header(headers.cuda_include.join("cuda.h").display().to_string())
        .clang_arg(format!("-I{}", headers.cuda_include.display()))
        .dynamic_library_name("CudaLib")
        .raw_line(
            "// Generated by `cargo xtask bindgen` from cuda.h (nvidia-cuda-runtime 13.0.96).",
        )
        .raw_line("// Do not edit: regenerate instead.");
    for f in CUDA_FUNCTIONS {
        b = b.allowlist_function(format!("^{f}$"));
    }
    for t in CUDA_TYPES {
        b = b.allowlist_type(format!("^{t}$"));
    }
    b = b.allowlist_var("^CU_.*").allowlist_var("^CUDA_VERSION$");
    let out = b.generate().context("bindgen failed on cuda.h")?;
    let text = out.to_string();
    for f in CUDA_FUNCTIONS {
        if !text.contains(&format!("pub {f}:")) {
            bail!("cuda.h declares no `{f}`: fix CUDA_FUNCTIONS in xtask");
        }
    }
    Ok(text)
}

fn generate_nccl(headers: &Headers) -> Result<String> {
    let b = base_builder()
        .header(headers.nccl_include.join("nccl.h").display().to_string())
        .clang_arg(format!("-I{}", headers.stub_include.display()))
        .clang_arg(format!("-I{}", headers.nccl_include.display()))
        .dynamic_library_name("NcclLib")
        .allowlist_function("^nccl.*")
        .blocklist_function("^ncclResetDebugInit$")
        .allowlist_type("^nccl.*")
        .allowlist_var("^NCCL_.*")
        .blocklist_type("^cudaStream_t$")
        .blocklist_type("^CUstream_st$")
        .raw_line("// Generated by `cargo xtask bindgen` from nccl.h (nvidia-nccl-cu13 2.28.3).")
        .raw_line("// Do not edit: regenerate instead.")
        .raw_line("use cuda_sys::cudaStream_t;");
    let out = b.generate().context("bindgen failed on nccl.h")?;
    Ok(out.to_string())
}
