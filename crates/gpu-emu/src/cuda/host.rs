//! The emulated host a process runs on: `NCCL_HOSTID` when set (the
//! variable NCCL itself reads to tell hosts apart), else one host for every
//! process of the machine. CUDA IPC works only between processes of one
//! host, as on real machines (`ipc`); NCCL's transport connects any.
//!
//! Invariant: a process's host never changes (read once).

use std::sync::OnceLock;

/// The variable naming the emulated host.
pub(crate) const HOST_ENV: &str = "NCCL_HOSTID";

/// This process's emulated host, as a 64-bit hash of its name.
pub(crate) fn id() -> u64 {
    static ID: OnceLock<u64> = OnceLock::new();
    *ID.get_or_init(|| {
        let name = std::env::var(HOST_ENV)
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| "the machine".to_string());
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    })
}
