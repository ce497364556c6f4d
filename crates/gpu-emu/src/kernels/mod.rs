//! The project's kernels, run on the host with the GPU's arithmetic: the
//! driver's module and launch entry points (`module`: `cuModuleLoadData`,
//! `cuModuleGetFunction`, `cuLaunchKernel`, `cuLaunchKernelEx`), which
//! know the kernels by name and are the only way to launch one, and each
//! kernel's host implementation: `bf16_add` (`bf16_add_inplace`),
//! `one_shot` (the one-shot all-reduces of bf16, f16 and f32), `fused`
//! (their fused add + norm variants, the cluster entries included) and
//! `norm` (the residual add + RMSNorm).
//!
//! Invariant: kernels reach memory and streams only through `cuda`
//! (`memory::access`, `stream::Launcher`), which knows nothing of them.

mod bf16_add;
mod fused;
pub(crate) mod module;
mod norm;
mod one_shot;
