//! `cargo xtask diagnose DIR`: reads flight-recorder dumps of all ranks.

/// Runs the subcommand.
pub fn run(_args: &[String]) -> anyhow::Result<i32> {
    anyhow::bail!("not yet implemented")
}
