//! The emulator's control API, resolved from the same library the CUDA and
//! NCCL layers open.
//!
//! Invariants: [`EmuControl::install`] runs before anything opens the CUDA or
//! NCCL library: it points `METRALE_CUDA_LIBRARY` and `METRALE_NCCL_LIBRARY`
//! at the emulator, then opens that same path with libloading. Opening a path
//! that is already loaded returns the same library, so the control functions
//! act on the state the stack uses. The library stays loaded for the life of
//! the process.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Environment variable naming the emulator library explicitly.
pub const EMU_LIBRARY_ENV: &str = "METRALE_EMU_LIBRARY";

/// Fault kinds of `metrale_emu_inject`. `nth` counts from the injection:
/// the rank's operations (collectives and send/recv, on any of its
/// communicators), or for `Stalls` its enqueue calls on blocking ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The rank's `nth` operation never completes (until abort).
    Hang = 1,
    /// An asynchronous error after the `nth` operation.
    AsyncError = 2,
    /// The rank's next init fails.
    InitFails = 3,
    /// The rank's next init never joins.
    NeverJoins = 4,
    /// The rank dies at its `nth` operation.
    Dies = 5,
    /// The `nth` enqueue call on a blocking communicator, counted from the
    /// injection, stays inside NCCL until the communicator is aborted.
    Stalls = 6,
}

type InjectFn = unsafe extern "C" fn(i32, i32, u64) -> i32;
type ResetFn = unsafe extern "C" fn();
type CallsFn = unsafe extern "C" fn() -> u64;

/// The emulator's control functions.
#[derive(Debug)]
pub struct EmuControl {
    path: PathBuf,
    inject: InjectFn,
    reset: ResetFn,
    calls: CallsFn,
    ipc_open: CallsFn,
    ipc_violations: CallsFn,
    _lib: libloading::Library,
}

static CONTROL: OnceLock<Result<EmuControl, String>> = OnceLock::new();

/// Where the emulator library is: `METRALE_EMU_LIBRARY`, else
/// `libgpu_emu.so` beside the running executable or in its parent directory.
pub fn find_library() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(EMU_LIBRARY_ENV) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let mut tried = Vec::new();
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        for sub in [Path::new(""), Path::new("deps")] {
            let p = d.join(sub).join("libgpu_emu.so");
            if p.is_file() {
                return Ok(p);
            }
            tried.push(p.display().to_string());
        }
        dir = d.parent();
    }
    Err(format!(
        "the emulator library libgpu_emu.so was not found (tried {}); build it with `cargo build -p gpu-emu` or set {EMU_LIBRARY_ENV}",
        tried.join(", ")
    ))
}

impl EmuControl {
    /// Selects the emulator for this process (before any library is opened)
    /// and returns its control functions; later calls return the same.
    pub fn install() -> Result<&'static EmuControl, String> {
        CONTROL
            .get_or_init(|| {
                let path = find_library()?;
                let p = path.to_string_lossy().into_owned();
                for var in [
                    cuda_sys::LIBRARY_ENV,
                    "METRALE_NCCL_LIBRARY",
                    EMU_LIBRARY_ENV,
                ] {
                    if std::env::var(var).ok().as_deref() != Some(p.as_str()) {
                        // SAFETY: this runs once, at start-up of the test or
                        // the binary, before the suite starts threads that
                        // read the environment (the libraries are opened later,
                        // by the first CUDA or NCCL call).
                        unsafe { std::env::set_var(var, &p) };
                    }
                }
                Self::open(&path)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    fn open(path: &Path) -> Result<EmuControl, String> {
        // SAFETY: the library is the project's emulator, whose initialisers
        // only set up process-local state.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("opening {}: {e}", path.display()))?;
        // SAFETY: the emulator exports these symbols with these C signatures
        // (docs/architecture.md, "Emulator control"); the function pointers
        // stay valid because the library is kept in the returned value and
        // that value lives in a static.
        let (inject, reset, calls, ipc_open, ipc_violations) = unsafe {
            let inject: InjectFn = *lib
                .get::<InjectFn>(b"metrale_emu_inject\0")
                .map_err(|e| format!("metrale_emu_inject: {e}"))?;
            let reset: ResetFn = *lib
                .get::<ResetFn>(b"metrale_emu_reset\0")
                .map_err(|e| format!("metrale_emu_reset: {e}"))?;
            let calls: CallsFn = *lib
                .get::<CallsFn>(b"metrale_emu_nccl_calls\0")
                .map_err(|e| format!("metrale_emu_nccl_calls: {e}"))?;
            let ipc_open: CallsFn = *lib
                .get::<CallsFn>(b"metrale_emu_ipc_open_mappings\0")
                .map_err(|e| format!("metrale_emu_ipc_open_mappings: {e}"))?;
            let ipc_violations: CallsFn = *lib
                .get::<CallsFn>(b"metrale_emu_ipc_violations\0")
                .map_err(|e| format!("metrale_emu_ipc_violations: {e}"))?;
            (inject, reset, calls, ipc_open, ipc_violations)
        };
        Ok(EmuControl {
            path: path.to_path_buf(),
            inject,
            reset,
            calls,
            ipc_open,
            ipc_violations,
            _lib: lib,
        })
    }

    /// The library's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Injects `fault` for `rank` at its `nth` operation from now (1-based;
    /// see [`Fault`]).
    pub fn inject(&self, rank: usize, fault: Fault, nth: u64) -> anyhow::Result<()> {
        // SAFETY: the function takes plain integers and touches no caller memory.
        let rc = unsafe { (self.inject)(rank as i32, fault as i32, nth) };
        anyhow::ensure!(
            rc == 0,
            "metrale_emu_inject({rank}, {fault:?}, {nth}) = {rc}"
        );
        Ok(())
    }

    /// Clears every injected fault.
    pub fn reset(&self) {
        // SAFETY: the function takes no arguments.
        unsafe { (self.reset)() }
    }

    /// NCCL API calls made so far in the process.
    pub fn nccl_calls(&self) -> u64 {
        // SAFETY: the function takes no arguments.
        unsafe { (self.calls)() }
    }

    /// CUDA IPC mappings of other processes' memory open now, in the whole
    /// process.
    pub fn ipc_open_mappings(&self) -> u64 {
        // SAFETY: the function takes no arguments.
        unsafe { (self.ipc_open)() }
    }

    /// Frees of this process's device memory that another process still
    /// had open through CUDA IPC, since the process started (the driver
    /// calls them undefined).
    pub fn ipc_violations(&self) -> u64 {
        // SAFETY: the function takes no arguments.
        unsafe { (self.ipc_violations)() }
    }
}
