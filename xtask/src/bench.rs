//! `cargo xtask bench`: the GPU benchmarks as a markdown table.

/// Runs the subcommand.
pub fn run(_args: &[String]) -> anyhow::Result<i32> {
    anyhow::bail!("not yet implemented")
}
