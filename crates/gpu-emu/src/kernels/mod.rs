//! The project's kernels, run on the host: the driver's module and launch
//! entry points (`module`), which know the kernels by name, and the host
//! implementation of the one-shot all-reduce (`one_shot`).

pub(crate) mod module;
mod one_shot;
