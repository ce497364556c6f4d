//! The scenario registry.
//!
//! Invariant: names are unique; every scenario's `emu_worlds` lie within
//! its `min_ranks..=max_ranks`.

pub mod backend;
pub mod reliability;
pub mod safe;

use crate::{Needs, Scenario};

const fn s(
    name: &'static str,
    about: &'static str,
    min_ranks: usize,
    max_ranks: Option<usize>,
    emu_worlds: &'static [usize],
    needs: Needs,
    body: fn(&crate::RankCtx) -> anyhow::Result<()>,
) -> Scenario {
    Scenario {
        name,
        about,
        min_ranks,
        max_ranks,
        emu_worlds,
        needs,
        body,
    }
}

/// Every scenario, in run order.
pub fn all() -> Vec<Scenario> {
    use Needs::*;
    vec![
        s(
            "safe_collectives",
            "every nccl-safe collective, bf16 and f32, 1 element to 64 MiB",
            2,
            None,
            &[2, 3],
            Nothing,
            safe::collectives,
        ),
        s(
            "safe_init_timeout",
            "non-blocking init with a rank that never joins times out",
            2,
            Some(2),
            &[2],
            Nothing,
            safe::init_timeout,
        ),
        s(
            "safe_resource_cycles",
            "1000 stream/event/buffer cycles leave device memory flat",
            1,
            Some(1),
            &[1],
            Nothing,
            safe::resource_cycles,
        ),
        s(
            "safe_bad_arguments_abort",
            "typed argument errors, abort releases a blocked rank, Aborted after",
            2,
            None,
            &[2],
            Nothing,
            safe::bad_arguments_and_abort,
        ),
        s(
            "backend_all_reduce_sweep",
            "all_reduce at 20+ sizes, fast path always/never, sync/async",
            2,
            None,
            &[2],
            Nothing,
            backend::all_reduce_sweep,
        ),
        s(
            "backend_every_operation",
            "all_gather, reduce_scatter, broadcast, send/recv, registration, add kernel",
            2,
            None,
            &[2, 3],
            Nothing,
            backend::every_operation,
        ),
        s(
            "backend_barrier_waits",
            "a barrier waits for a rank that sleeps 2 s",
            2,
            None,
            &[2],
            Nothing,
            backend::barrier_waits,
        ),
        s(
            "backend_graph_replay",
            "a captured all_reduce_async replays 100 times",
            2,
            None,
            &[2],
            Nothing,
            backend::graph_replay,
        ),
        s(
            "backend_bad_inputs",
            "15+ bad inputs with typed errors, then a correct all_reduce",
            2,
            None,
            &[2],
            Nothing,
            backend::bad_inputs,
        ),
        s(
            "backend_local",
            "LocalBackend on one rank",
            1,
            Some(1),
            &[1],
            Nothing,
            backend::local_backend,
        ),
        s(
            "backend_fixed_unique_id",
            "a backend from an engine-distributed unique id; reconnect refused with its cause",
            2,
            None,
            &[2],
            Nothing,
            backend::fixed_unique_id,
        ),
        s(
            "backend_engine_flow",
            "commands by broadcast/recv_command_u32, all_reduce, barrier, shutdown",
            2,
            None,
            &[2],
            Nothing,
            backend::engine_flow,
        ),
        s(
            "rel_skipped_collective",
            "a skipped collective times out with op and seq, dump and analysis",
            2,
            Some(2),
            &[2],
            Nothing,
            reliability::skipped_collective,
        ),
        s(
            "rel_injected_hang",
            "an injected hang is caught by the deadline",
            2,
            Some(2),
            &[2],
            EmulatorFaults,
            reliability::injected_hang,
        ),
        s(
            "rel_async_error_poisons",
            "an async error poisons; 1000 refusals, fast, no NCCL call",
            2,
            Some(2),
            &[2],
            Nothing,
            reliability::async_error_poisons,
        ),
        s(
            "rel_reconnect_cycles",
            "20 failure/poison/reconnect cycles, memory and fds flat",
            2,
            Some(2),
            &[2],
            EmulatorFaults,
            reliability::reconnect_cycles,
        ),
        s(
            "rel_reconnect_cycles_gpu",
            "20 skipped-collective timeouts, reconnect on both ranks, memory and fds flat",
            2,
            Some(2),
            &[2],
            Nothing,
            reliability::reconnect_cycles_gpu,
        ),
        s(
            "rel_init_without_a_rank",
            "NcclBackend::new fails by the init deadline when a rank never joins",
            2,
            None,
            &[2, 3],
            Nothing,
            reliability::init_without_a_rank,
        ),
        s(
            "rel_idle_command_wait",
            "recv_command_u32 returns on shutdown and on poison",
            2,
            Some(2),
            &[2],
            Nothing,
            reliability::idle_command_wait,
        ),
        s(
            "rel_sigkill_rank",
            "SIGKILL of a rank mid-collective: the survivor errors in time",
            2,
            Some(2),
            &[],
            Processes,
            reliability::sigkill_rank,
        ),
    ]
}
