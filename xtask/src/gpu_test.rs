//! `cargo xtask gpu-test`: the multi-rank suite on every GPU of a box.

/// Runs the subcommand.
pub fn run(_args: &[String]) -> anyhow::Result<i32> {
    anyhow::bail!("not yet implemented")
}
