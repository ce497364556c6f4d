//! Rank processes for the tests that need several: a test binary runs
//! itself as the other processes (its `child` test, which does nothing
//! unless [`ROLE`] says what to do; the unique id and the data seed travel
//! in the environment, [`ID`] and [`SEED`]).
//!
//! Invariant: every wait for a child has a deadline, and a child is killed
//! when a test gives up on it.

use std::ffi::c_char;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nccl_sys::ncclUniqueId;

/// What a child process does: `role:rank:n`.
pub const ROLE: &str = "GPU_EMU_PROC_ROLE";
/// The unique id, in hex.
pub const ID: &str = "GPU_EMU_PROC_ID";
/// The data seed.
pub const SEED: &str = "GPU_EMU_PROC_SEED";

/// `bytes` as hex, two digits each.
pub fn hex(bytes: &[c_char]) -> String {
    bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect()
}

/// Fills `out` from [`hex`]'s text.
pub fn unhex(s: &str, out: &mut [c_char]) {
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex") as _;
    }
}

pub fn id_hex(id: &ncclUniqueId) -> String {
    hex(&id.internal)
}

pub fn id_unhex(s: &str) -> ncclUniqueId {
    let mut id = ncclUniqueId::default();
    unhex(s, &mut id.internal);
    id
}

/// Runs this binary's `child` test as `role` for rank `rank` of `n`.
pub fn spawn(role: &str, rank: usize, n: usize, id: &ncclUniqueId, seed: u64) -> Child {
    spawn_with(role, rank, n, id, seed, &[])
}

/// [`spawn`] with extra environment variables.
pub fn spawn_with(
    role: &str,
    rank: usize,
    n: usize,
    id: &ncclUniqueId,
    seed: u64,
    env: &[(&str, &str)],
) -> Child {
    Command::new(std::env::current_exe().expect("current exe"))
        .envs(env.iter().copied())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env(ROLE, format!("{role}:{rank}:{n}"))
        .env(ID, id_hex(id))
        .env(SEED, seed.to_string())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawning a rank process")
}

/// Waits for `c` to exit successfully within `limit` (killing it if not).
pub fn wait_ok(c: &mut Child, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = c.try_wait().expect("try_wait") {
            assert!(st.success(), "a rank process failed: {st}");
            return;
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            let _ = c.wait();
            panic!("a rank process did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// This process's role when it runs as a child: (role, rank, n, id,
/// seed); `None` in the test binary's own run.
pub fn child_role() -> Option<(String, usize, usize, ncclUniqueId, u64)> {
    let spec = std::env::var(ROLE).ok()?;
    let mut it = spec.split(':');
    let role = it.next().unwrap_or_default().to_string();
    let mut num = || {
        it.next()
            .and_then(|v| v.parse::<usize>().ok())
            .expect("role spec")
    };
    let (rank, n) = (num(), num());
    let id = id_unhex(&std::env::var(ID).expect("id"));
    let seed: u64 = std::env::var(SEED).expect("seed").parse().expect("seed");
    Some((role, rank, n, id, seed))
}
