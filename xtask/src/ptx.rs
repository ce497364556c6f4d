//! `cargo xtask ptx`: compiles the CUDA kernels to committed PTX.

/// Runs the subcommand.
pub fn run(_args: &[String]) -> anyhow::Result<i32> {
    anyhow::bail!("not yet implemented")
}
