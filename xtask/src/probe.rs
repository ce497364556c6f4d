//! `cargo xtask probe`: what the driver, the GPUs and NCCL are.
//!
//! Prints the driver's path and version, each GPU (name, memory, compute
//! capability, SMs), peer access between each pair, and NCCL's version and
//! path. Uses only cuda-sys and nccl-sys, through their `call!` macros, so it
//! works where the higher layers do not build or run, and against the CPU
//! emulator (`METRALE_CUDA_LIBRARY=.../libgpu_emu.so
//! METRALE_NCCL_LIBRARY=.../libgpu_emu.so cargo xtask probe`).
//!
//! Invariants: exit status 0 only when the driver, at least one GPU and a
//! supported NCCL were all found; every failure is one line on stderr,
//! starting `probe: `, that names what was missing and where it was looked
//! for. Nothing here panics on a missing library or symbol.

use std::ffi::CStr;
use std::io::{self, Write};
use std::os::raw::{c_char, c_int};

use cuda_sys::{CUdevice, CUdevice_attribute, CUresult, Cuda, LoadError};
use nccl_sys::Nccl;

/// The oldest compute capability the project's kernels run on (bf16 needs
/// sm_80).
const MIN_CC: (c_int, c_int) = (8, 0);

/// Runs the subcommand.
pub fn run(args: &[String]) -> anyhow::Result<i32> {
    if !args.is_empty() {
        anyhow::bail!("usage: cargo xtask probe");
    }
    let stdout = io::stdout();
    let stderr = io::stderr();
    Ok(probe(
        cuda_sys::cuda(),
        nccl_sys::nccl,
        &mut stdout.lock(),
        &mut stderr.lock(),
    )?)
}

/// Probes `cuda` and, when it has GPUs or not, `nccl`; writes the report to
/// `out` and each failure as one line to `err`; returns the exit status.
fn probe<'a>(
    cuda: Result<&Cuda, LoadError>,
    nccl: impl FnOnce() -> Result<&'a Nccl, LoadError>,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> io::Result<i32> {
    let cuda = match cuda {
        Ok(cuda) => cuda,
        Err(e) => {
            writeln!(err, "probe: {e}")?;
            return Ok(1);
        }
    };
    let mut status = 0;
    match gpus(cuda, out) {
        Ok(0) => {
            writeln!(
                err,
                "probe: the CUDA driver at {} reports no GPU",
                cuda.path()
            )?;
            status = 1;
        }
        Ok(_) => {}
        Err(e) => {
            writeln!(err, "probe: {e}")?;
            return Ok(1);
        }
    }
    match nccl() {
        Ok(nccl) => writeln!(
            out,
            "NCCL: {} ({})",
            nccl_sys::version_string(nccl.version()),
            nccl.path()
        )?,
        Err(e) => {
            writeln!(err, "probe: {e}")?;
            status = 1;
        }
    }
    Ok(status)
}

/// Prints the driver and its GPUs; returns the number of GPUs.
fn gpus(cuda: &Cuda, out: &mut dyn Write) -> Result<usize, String> {
    let io = |e: io::Error| e.to_string();
    writeln!(out, "CUDA driver: {}", cuda.path()).map_err(io)?;
    // SAFETY: cuInit takes a flags word and no pointers.
    let rc = unsafe { cuda_sys::call!(cuda, cuInit(0)) };
    check(cuda, rc, "cuInit")?;
    let mut version: c_int = 0;
    // SAFETY: the pointer is to a live c_int the driver writes once.
    let rc = unsafe { cuda_sys::call!(cuda, cuDriverGetVersion(&mut version)) };
    check(cuda, rc, "cuDriverGetVersion")?;
    writeln!(
        out,
        "driver version: CUDA {}.{} ({version})",
        version / 1000,
        version % 1000 / 10
    )
    .map_err(io)?;
    let mut count: c_int = 0;
    // SAFETY: the pointer is to a live c_int the driver writes once.
    let rc = unsafe { cuda_sys::call!(cuda, cuDeviceGetCount(&mut count)) };
    check(cuda, rc, "cuDeviceGetCount")?;
    writeln!(out, "GPUs: {count}").map_err(io)?;
    let mut devices: Vec<CUdevice> = Vec::new();
    for ordinal in 0..count {
        let mut dev: CUdevice = 0;
        // SAFETY: the pointer is to a live CUdevice the driver writes once.
        let rc = unsafe { cuda_sys::call!(cuda, cuDeviceGet(&mut dev, ordinal)) };
        check(cuda, rc, "cuDeviceGet")?;
        devices.push(dev);
        let mut name = [0 as c_char; 256];
        // SAFETY: the buffer is live and its length is passed; the driver
        // writes a NUL-terminated name of at most that many bytes.
        let rc = unsafe {
            cuda_sys::call!(
                cuda,
                cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev)
            )
        };
        check(cuda, rc, "cuDeviceGetName")?;
        // The last byte stays NUL, whatever the driver wrote.
        name[name.len() - 1] = 0;
        // SAFETY: `name` is NUL-terminated (its last byte is NUL) and lives
        // for the borrow.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy();
        let mut bytes: usize = 0;
        // SAFETY: the pointer is to a live usize the driver writes once.
        let rc = unsafe { cuda_sys::call!(cuda, cuDeviceTotalMem_v2(&mut bytes, dev)) };
        check(cuda, rc, "cuDeviceTotalMem")?;
        let major = attribute(
            cuda,
            dev,
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        )?;
        let minor = attribute(
            cuda,
            dev,
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        )?;
        let sms = attribute(
            cuda,
            dev,
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        let note = if (major, minor) < MIN_CC {
            "  (below sm_80: the bf16 add kernel cannot run here)"
        } else {
            ""
        };
        writeln!(
            out,
            "  GPU {ordinal}: {name}, {}, compute capability {major}.{minor}, {sms} SMs{note}",
            gib(bytes as u64)
        )
        .map_err(io)?;
    }
    if devices.len() > 1 {
        writeln!(out, "peer access (row can access column):").map_err(io)?;
        let mut header = String::from("      ");
        for j in 0..devices.len() {
            header.push_str(&format!("{j:>4}"));
        }
        writeln!(out, "{header}").map_err(io)?;
        for (i, &a) in devices.iter().enumerate() {
            let mut row = format!("  {i:>4}");
            for (j, &b) in devices.iter().enumerate() {
                if i == j {
                    row.push_str("   -");
                    continue;
                }
                let mut can: c_int = 0;
                // SAFETY: the pointer is to a live c_int the driver writes
                // once; both devices came from cuDeviceGet.
                let rc = unsafe { cuda_sys::call!(cuda, cuDeviceCanAccessPeer(&mut can, a, b)) };
                check(cuda, rc, "cuDeviceCanAccessPeer")?;
                row.push_str(if can != 0 { "   Y" } else { "   N" });
            }
            writeln!(out, "{row}").map_err(io)?;
        }
    }
    Ok(devices.len())
}

/// One integer attribute of `dev`.
fn attribute(cuda: &Cuda, dev: CUdevice, attr: CUdevice_attribute) -> Result<c_int, String> {
    let mut value: c_int = 0;
    // SAFETY: the pointer is to a live c_int the driver writes once; `dev`
    // came from cuDeviceGet.
    let rc = unsafe { cuda_sys::call!(cuda, cuDeviceGetAttribute(&mut value, attr, dev)) };
    check(cuda, rc, "cuDeviceGetAttribute")?;
    Ok(value)
}

/// Turns a driver call's outcome into a one-line message on failure.
fn check(cuda: &Cuda, rc: Result<CUresult, LoadError>, what: &str) -> Result<(), String> {
    let rc = rc.map_err(|e| e.to_string())?;
    if rc == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: the pointer is to a live pointer the driver sets to a static
    // string, or leaves alone.
    let named = unsafe { cuda_sys::call!(cuda, cuGetErrorName(rc, &mut name)) };
    let name = match named {
        Ok(r) if r == CUresult::CUDA_SUCCESS && !name.is_null() => {
            // SAFETY: the driver returned a static NUL-terminated string.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        }
        _ => "unknown error".to_owned(),
    };
    Err(format!(
        "{what} failed with {name} ({}) in the CUDA driver at {}",
        rc.0,
        cuda.path()
    ))
}

/// `bytes` in GiB, one decimal.
fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_driver_is_one_line_naming_where_it_looked() {
        // SAFETY: the path does not exist, so nothing is loaded.
        let cuda = unsafe { Cuda::open("/nonexistent/libcuda.so.1") };
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut nccl_asked = false;
        let status = probe(
            cuda.as_ref().map_err(Clone::clone),
            || {
                nccl_asked = true;
                Err(LoadError::open_failed("NCCL", "x", "y".into()))
            },
            &mut out,
            &mut err,
        )
        .unwrap();
        assert_eq!(status, 1);
        assert!(out.is_empty());
        assert!(!nccl_asked);
        let err = String::from_utf8(err).unwrap();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with(
                "probe: CUDA driver library not found: tried /nonexistent/libcuda.so.1: "
            ),
            "{err}"
        );
    }

    #[test]
    fn memory_is_shown_in_gib() {
        assert_eq!(gib(0), "0.0 GiB");
        assert_eq!(gib(80 << 30), "80.0 GiB");
        assert_eq!(gib(150_754_820_096), "140.4 GiB");
    }
}
