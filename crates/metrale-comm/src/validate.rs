//! Argument checks shared by the backends: they run before anything is
//! submitted, so bad input is a typed error and never poisons a healthy
//! communicator.
//!
//! Invariant: every check names the operation and the argument it refused.

use nccl_safe::{DataType, DeviceView, DeviceViewMut};

use crate::backend::Result;
use crate::error::CommError;

fn invalid(op: &'static str, reason: String) -> CommError {
    CommError::InvalidArgument { op, reason }
}

/// A view's address, length and type, for checks.
#[derive(Clone, Copy)]
pub(crate) struct Span {
    pub ptr: u64,
    pub len: usize,
    pub dtype: DataType,
}

impl Span {
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }
}

impl From<&DeviceView<'_>> for Span {
    fn from(v: &DeviceView<'_>) -> Span {
        Span {
            ptr: v.ptr(),
            len: v.len(),
            dtype: v.dtype(),
        }
    }
}

impl From<&DeviceViewMut<'_>> for Span {
    fn from(v: &DeviceViewMut<'_>) -> Span {
        Span {
            ptr: v.ptr(),
            len: v.len(),
            dtype: v.dtype(),
        }
    }
}

/// Checks a view: non-null when non-empty, aligned to its element, and a
/// size that does not overflow.
pub(crate) fn check_view(op: &'static str, what: &str, s: Span) -> Result<()> {
    if s.len.checked_mul(s.dtype.size()).is_none() {
        return Err(invalid(op, format!("{what}: {} elements overflow", s.len)));
    }
    if s.len > 0 && s.ptr == 0 {
        return Err(invalid(op, format!("{what}: null device address")));
    }
    if !s.ptr.is_multiple_of(s.dtype.size() as u64) {
        return Err(invalid(
            op,
            format!(
                "{what}: address {:#x} is not aligned to its {}-byte {} elements",
                s.ptr,
                s.dtype.size(),
                s.dtype
            ),
        ));
    }
    Ok(())
}

/// Checks a reduction's element type: NCCL reduces it on every GPU the
/// stack supports.
pub(crate) fn check_reducible(op: &'static str, s: Span) -> Result<()> {
    if !s.dtype.is_reducible_everywhere() {
        return Err(invalid(
            op,
            format!(
                "{} cannot be summed portably; gather fp8, reduce in bf16, f16 or f32",
                s.dtype
            ),
        ));
    }
    Ok(())
}

/// Checks that `b` has `a`'s type and `factor` times its length.
pub(crate) fn check_pair(
    op: &'static str,
    (a_name, a): (&str, Span),
    (b_name, b): (&str, Span),
    factor: usize,
) -> Result<()> {
    if a.dtype != b.dtype {
        return Err(invalid(
            op,
            format!("{a_name} holds {} but {b_name} holds {}", a.dtype, b.dtype),
        ));
    }
    let want = a
        .len
        .checked_mul(factor)
        .ok_or_else(|| invalid(op, "length * world_size overflows".into()))?;
    if b.len != want {
        return Err(invalid(
            op,
            format!(
                "{b_name} holds {} elements; it needs {want} ({a_name}'s {} x {factor})",
                b.len, a.len
            ),
        ));
    }
    Ok(())
}

pub(crate) fn check_rank(op: &'static str, what: &str, r: usize, world_size: usize) -> Result<()> {
    if r >= world_size {
        return Err(invalid(
            op,
            format!("{what} {r} is out of range for {world_size} ranks"),
        ));
    }
    Ok(())
}

/// Checks a buffer to register: a valid, non-empty range.
pub(crate) fn check_register(op: &'static str, s: Span) -> Result<()> {
    check_view(op, "buffer", s)?;
    if s.len == 0 {
        return Err(invalid(op, "cannot register an empty buffer".into()));
    }
    Ok(())
}

/// Checks an allocation size.
pub(crate) fn check_alloc(op: &'static str, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Err(invalid(op, "cannot allocate 0 bytes".into()));
    }
    Ok(())
}

/// Checks a command buffer: exactly 4 bytes.
pub(crate) fn check_command(op: &'static str, s: Span) -> Result<()> {
    check_view(op, "command buffer", s)?;
    if s.bytes() != 4 {
        return Err(invalid(
            op,
            format!("a command is one u32: the buffer holds {} bytes", s.bytes()),
        ));
    }
    Ok(())
}

/// Checks all-to-all counts: one per rank, and the sum fits the view.
pub(crate) fn check_counts(
    op: &'static str,
    what: &str,
    counts: &[usize],
    world_size: usize,
    view_len: usize,
) -> Result<()> {
    if counts.len() != world_size {
        return Err(invalid(
            op,
            format!("{what}: {} counts for {world_size} ranks", counts.len()),
        ));
    }
    let total = counts
        .iter()
        .try_fold(0usize, |acc, &c| acc.checked_add(c))
        .ok_or_else(|| invalid(op, format!("{what}: the counts overflow")))?;
    if total > view_len {
        return Err(invalid(
            op,
            format!("{what}: the counts add up to {total} elements; the buffer holds {view_len}"),
        ));
    }
    Ok(())
}
