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
    /// The rank's `nth` one-shot kernel, counted from the injection,
    /// writes a wrong first word of its result.
    Corrupts = 7,
}

/// Environment variable with the emulator's costs, read by each process
/// on first use (for ranks in processes); [`costs_env`] builds its value.
pub const COSTS_ENV: &str = "METRALE_EMU_COSTS";

/// The operations the emulator can be told the cost of
/// (`metrale_emu_set_cost`'s `op`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostOp {
    /// `ncclAllReduce`.
    AllReduce = 1,
    /// A one-shot all-reduce kernel, of any element type (the rank is its
    /// control block's).
    OneShot = 2,
    /// `ncclSend` (the fast path's grouped send/recv: charged once per
    /// send, by the bytes sent).
    Send = 3,
}

impl CostOp {
    fn name(self) -> &'static str {
        match self {
            CostOp::AllReduce => "allreduce",
            CostOp::OneShot => "oneshot",
            CostOp::Send => "send",
        }
    }
}

/// Which launches a cost applies to (`metrale_emu_set_cost`'s `mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostMode {
    /// Every launch.
    Any = 0,
    /// Eager launches only.
    Eager = 1,
    /// Graph replays only (work run by `cuGraphLaunch`).
    Graph = 2,
}

impl CostMode {
    fn name(self) -> &'static str {
        match self {
            CostMode::Any => "*",
            CostMode::Eager => "eager",
            CostMode::Graph => "graph",
        }
    }
}

/// One cost entry: `op` of `bytes` run by `rank` (`None`: every rank) in
/// `mode` takes `base_ns + ns_per_kib * bytes / 1024` ns of emulated time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cost {
    /// A communicator rank, or `None` for every rank.
    pub rank: Option<usize>,
    /// The operation.
    pub op: CostOp,
    /// The launches it applies to.
    pub mode: CostMode,
    /// Nanoseconds of every launch.
    pub base_ns: u64,
    /// Nanoseconds per KiB of the operation's bytes.
    pub ns_per_kib: u64,
}

/// The value of [`COSTS_ENV`] that sets `costs` in a process, in order (a
/// later entry for the same rank, op and mode replaces the earlier).
pub fn costs_env(costs: &[Cost]) -> String {
    costs
        .iter()
        .map(|c| {
            let rank = c.rank.map_or_else(|| "*".to_string(), |r| r.to_string());
            format!(
                "{rank}:{}:{}={}+{}",
                c.op.name(),
                c.mode.name(),
                c.base_ns,
                c.ns_per_kib
            )
        })
        .collect::<Vec<_>>()
        .join(";")
}

type InjectFn = unsafe extern "C" fn(i32, i32, u64) -> i32;
type ResetFn = unsafe extern "C" fn();
type CallsFn = unsafe extern "C" fn() -> u64;
type SetCostFn = unsafe extern "C" fn(i32, i32, i32, u64, u64) -> i32;

/// The emulator's control functions.
#[derive(Debug)]
pub struct EmuControl {
    path: PathBuf,
    inject: InjectFn,
    reset: ResetFn,
    calls: CallsFn,
    ipc_open: CallsFn,
    ipc_violations: CallsFn,
    set_cost: SetCostFn,
    clear_costs: ResetFn,
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
        let (inject, reset, calls, ipc_open, ipc_violations, set_cost, clear_costs) = unsafe {
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
            let set_cost: SetCostFn = *lib
                .get::<SetCostFn>(b"metrale_emu_set_cost\0")
                .map_err(|e| format!("metrale_emu_set_cost: {e}"))?;
            let clear_costs: ResetFn = *lib
                .get::<ResetFn>(b"metrale_emu_clear_costs\0")
                .map_err(|e| format!("metrale_emu_clear_costs: {e}"))?;
            (
                inject,
                reset,
                calls,
                ipc_open,
                ipc_violations,
                set_cost,
                clear_costs,
            )
        };
        Ok(EmuControl {
            path: path.to_path_buf(),
            inject,
            reset,
            calls,
            ipc_open,
            ipc_violations,
            set_cost,
            clear_costs,
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

    /// Sets how long `op` takes in emulated time for `rank` (`None`: every
    /// rank) in `mode`: `base_ns + ns_per_kib * bytes / 1024` ns. While a
    /// cost is set, events are timed on the streams' virtual clocks
    /// (`crates/gpu-emu/src/cost.rs`). Acts on this process's ranks.
    pub fn set_cost(
        &self,
        rank: Option<usize>,
        op: CostOp,
        mode: CostMode,
        base_ns: u64,
        ns_per_kib: u64,
    ) -> anyhow::Result<()> {
        let r = match rank {
            None => -1,
            Some(r) => i32::try_from(r).map_err(|_| anyhow::anyhow!("rank {r} out of range"))?,
        };
        // SAFETY: the function takes plain integers and touches no caller memory.
        let rc = unsafe { (self.set_cost)(r, op as i32, mode as i32, base_ns, ns_per_kib) };
        anyhow::ensure!(
            rc == 0,
            "metrale_emu_set_cost({r}, {op:?}, {mode:?}, {base_ns}, {ns_per_kib}) = {rc}"
        );
        Ok(())
    }

    /// Sets every cost of `costs`, in order.
    pub fn set_costs(&self, costs: &[Cost]) -> anyhow::Result<()> {
        for c in costs {
            self.set_cost(c.rank, c.op, c.mode, c.base_ns, c.ns_per_kib)?;
        }
        Ok(())
    }

    /// Clears every cost: events are timed with host clocks again.
    pub fn clear_costs(&self) {
        // SAFETY: the function takes no arguments.
        unsafe { (self.clear_costs)() }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_env_names_every_field() {
        let costs = [
            Cost {
                rank: None,
                op: CostOp::AllReduce,
                mode: CostMode::Any,
                base_ns: 1000,
                ns_per_kib: 20,
            },
            Cost {
                rank: Some(3),
                op: CostOp::OneShot,
                mode: CostMode::Graph,
                base_ns: 5,
                ns_per_kib: 0,
            },
            Cost {
                rank: Some(0),
                op: CostOp::Send,
                mode: CostMode::Eager,
                base_ns: 7,
                ns_per_kib: 1,
            },
        ];
        assert_eq!(
            costs_env(&costs),
            "*:allreduce:*=1000+20;3:oneshot:graph=5+0;0:send:eager=7+1"
        );
        assert_eq!(costs_env(&[]), "");
    }
}
