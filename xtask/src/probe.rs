//! `cargo xtask probe`: what the driver, the GPUs and NCCL are.

/// Runs the subcommand.
pub fn run(_args: &[String]) -> anyhow::Result<i32> {
    anyhow::bail!("not yet implemented")
}
