//! The suite's processes mode on the CPU emulator, inside `cargo test`: the
//! orchestrator (`comm-suite run --emulator --modes processes`) launches
//! the comm-suite binary once per rank with torchrun's variables, so the
//! ranks are separate processes whose communicators meet over the
//! emulator's loopback transport, and whose one-shot all-reduce maps the
//! peers' buffers with CUDA IPC between processes. Every scenario that
//! runs at two ranks does so here but the two that only repeat others'
//! paths for tens of seconds; a few run again with three, and the
//! one-shot path's streams, stuck-rank and split scenarios with eight; and
//! the killed-rank scenario (`rel_sigkill_rank`: a rank SIGKILLed
//! mid-collective, the survivor must error within its timeout) 20 times;
//! and the multi-host scenarios in the nodes modes (two emulated hosts,
//! started with torchrun's and with srun's variables) at 2 x 2 and 2 x 4
//! ranks.
//! `emulator.rs` runs every scenario in threads mode, unchanged.
//!
//! Invariant: every run is bounded: the orchestrator kills a scenario's
//! ranks at its deadline, and this test kills the orchestrator at
//! [`LIMIT`].

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The scenarios run with two rank processes: all but
/// `backend_blocking_enqueue` (the sweep and every operation again, on a
/// blocking communicator, which the default enqueue mode already is) and
/// `rel_reconnect_cycles_gpu` (20 one-second timeouts, the reconnect path
/// that `rel_reconnect_cycles` takes too).
const TWO_RANKS: &[&str] = &[
    "safe_collectives",
    "safe_init_timeout",
    "safe_resource_cycles",
    "safe_bad_arguments_abort",
    "backend_all_reduce_sweep",
    "backend_every_operation",
    "backend_barrier_waits",
    "backend_graph_replay",
    "backend_bad_inputs",
    "backend_local",
    "backend_fixed_unique_id",
    "backend_engine_flow",
    "api_all_reduce_dtypes",
    "api_all_to_all",
    "api_split_concurrent",
    "api_thread_groups",
    "oneshot_sizes",
    "oneshot_streams",
    "oneshot_stuck_rank",
    "oneshot_concurrent_graphs",
    "oneshot_split",
    "oneshot_ipc_one_device",
    "rel_skipped_collective",
    "rel_injected_hang",
    "rel_blocking_stall",
    "rel_blocking_connect_stall",
    "rel_async_error_poisons",
    "rel_reconnect_cycles",
    "rel_init_without_a_rank",
    "rel_idle_command_wait",
    "rel_sigkill_rank",
    "int_fast_path_streams",
    "int_mismatch_reported",
    "int_shutdown_after_failure",
    "int_reconnect_aborts_waiters",
    "int_shutdown_idle_worker",
    "two_worlds_concurrent",
    "two_worlds_free_deadlock",
    "fuzz_schedules",
    "tune_choice",
];

/// The scenarios run again with three rank processes (a mesh where every
/// rank both connects and accepts).
const THREE_RANKS: &[&str] = &[
    "safe_collectives",
    "backend_every_operation",
    "api_all_to_all",
    "api_split_concurrent",
    "oneshot_sizes",
    "oneshot_split",
    "tune_choice",
];

/// The one-shot scenarios run again with eight rank processes (the most
/// the kernel serves; every rank maps seven peers' buffers; sub-groups of
/// eight, four and two).
const EIGHT_RANKS: &[&str] = &["oneshot_streams", "oneshot_stuck_rank", "oneshot_split"];

/// Repetitions of `rel_sigkill_rank`.
const SIGKILL_REPEAT: usize = 20;

/// The longest one orchestrator run may take.
const LIMIT: Duration = Duration::from_secs(900);

/// The scenarios of ranks on two emulated hosts (the nodes modes, with
/// torchrun's and srun's multi-node variables), at 2 x 2 and 2 x 4 ranks.
const NODES: &[&str] = &["nodes_split_one_shot"];

/// Runs `comm-suite run --emulator --modes processes` over `scenarios` on
/// `gpus` emulated GPUs; returns its stdout, failing with both outputs
/// when it fails.
fn orchestrate(gpus: usize, scenarios: &[&str]) -> String {
    orchestrate_in("processes", gpus, scenarios)
}

/// [`orchestrate`] in `modes`.
fn orchestrate_in(modes: &str, gpus: usize, scenarios: &[&str]) -> String {
    orchestrate_with(modes, gpus, scenarios, SIGKILL_REPEAT)
}

/// [`orchestrate_in`] with `repeat` repetitions of the orchestrated
/// scenarios.
fn orchestrate_with(modes: &str, gpus: usize, scenarios: &[&str], repeat: usize) -> String {
    let lib = comm_suite::emu::find_library().expect("the emulator library");
    let mut child = Command::new(env!("CARGO_BIN_EXE_comm-suite"))
        .args(["run", "--emulator", "--modes", modes])
        .args(["--gpus", &gpus.to_string()])
        .args(["--scenarios", &scenarios.join(",")])
        .args(["--repeat", &repeat.to_string()])
        .args(["--timeout", "120"])
        .env(comm_suite::emu::EMU_LIBRARY_ENV, &lib)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning the orchestrator");
    let out = child.stdout.take().expect("stdout");
    let err = child.stderr.take().expect("stderr");
    let out_t = std::thread::spawn(move || read_all(out));
    let err_t = std::thread::spawn(move || read_all(err));
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    match status {
        Some(st) if st.success() => stdout,
        other => {
            let lines: Vec<&str> = stderr.lines().collect();
            let tail = lines[lines.len().saturating_sub(200)..].join("\n");
            let how = match other {
                Some(st) => format!("failed ({st})"),
                None => format!("did not finish within {LIMIT:?}"),
            };
            panic!("the orchestrator {how}:\n{stdout}\n--- its stderr, last lines ---\n{tail}")
        }
    }
}

fn read_all(mut r: impl Read) -> String {
    let mut s = String::new();
    let _ = r.read_to_string(&mut s);
    s
}

/// Writes `text` to stderr directly (the test harness captures only the
/// print macros), so the tables show in `cargo test` output.
fn show(text: &str) {
    let _ = std::io::Write::write_all(&mut std::io::stderr(), text.as_bytes());
}

#[test]
fn processes_mode_on_the_emulator() {
    let t = Instant::now();
    let two = orchestrate(2, TWO_RANKS);
    let took_two = t.elapsed();
    assert!(
        two.contains("rel_sigkill_rank") && two.contains("comm-suite: 0 failure(s)"),
        "{two}"
    );
    let t = Instant::now();
    let three = orchestrate(3, THREE_RANKS);
    let took_three = t.elapsed();
    assert!(three.contains("comm-suite: 0 failure(s)"), "{three}");
    let t = Instant::now();
    let eight = orchestrate(8, EIGHT_RANKS);
    let took_eight = t.elapsed();
    assert!(eight.contains("comm-suite: 0 failure(s)"), "{eight}");
    let t = Instant::now();
    let mut nodes = String::new();
    for gpus in [4, 8] {
        let out = orchestrate_in("nodes,nodes-srun", gpus, NODES);
        assert!(out.contains("comm-suite: 0 failure(s)"), "{out}");
        for sc in NODES {
            assert!(
                out.lines()
                    .any(|l| l.starts_with(sc) && l.matches("PASS").count() == 2),
                "{sc} did not pass in both nodes modes at {gpus} ranks:\n{out}"
            );
        }
        nodes.push_str(&out);
    }
    let took_nodes = t.elapsed();
    show(&format!(
        "\n{two}\n(two ranks, rel_sigkill_rank x{SIGKILL_REPEAT}: {:.0}s)\n\n{three}\n(three ranks: {:.0}s)\n\n{eight}\n(eight ranks: {:.0}s)\n\n{nodes}\n(two hosts of 2 and of 4 ranks: {:.0}s)\n",
        took_two.as_secs_f64(),
        took_three.as_secs_f64(),
        took_eight.as_secs_f64(),
        took_nodes.as_secs_f64()
    ));
}

/// `rel_dead_peer` once per case (NCCL's path, the one-shot path and the
/// tuned defaults, SIGSTOP and SIGKILL, of rank 0 and of the last rank) and
/// its healthy counterpart `int_shutdown_healthy` at 2 and 4 rank
/// processes; the stress run (20 each) is in docs/operations.md.
#[test]
fn dead_peer_on_the_emulator() {
    for gpus in [2, 4] {
        let t = Instant::now();
        let out = orchestrate_with(
            "processes",
            gpus,
            &["rel_dead_peer", "int_shutdown_healthy"],
            1,
        );
        assert!(
            out.contains("rel_dead_peer")
                && out.contains("int_shutdown_healthy")
                && out.contains("comm-suite: 0 failure(s)"),
            "{out}"
        );
        show(&format!(
            "\n{out}\n(rel_dead_peer and int_shutdown_healthy at {gpus} ranks: {:.0}s)\n",
            t.elapsed().as_secs_f64()
        ));
    }
}
