//! Argument checks shared by the backends: one function per operation of
//! [`crate::CommBackend`] (`all_reduce`, `all_gather`, ...), which both
//! `NcclBackend` and `LocalBackend` call before anything is submitted, so
//! bad input is a typed error, the same one from either backend, and never
//! poisons a healthy communicator. The argument checks they are built of
//! (`check_*`) come after them.
//!
//! Invariant: every check names the operation and the argument it refused;
//! a check reads its arguments and the world's shape ([`Ranks`]), nothing
//! else, so it cannot touch a communicator.

use nccl_safe::{DataType, DeviceView, DeviceViewMut};

use crate::backend::{AddKernel, Result};
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

    /// The span in consecutive pieces of at most `max` elements (at least
    /// one each), in order; none for an empty span.
    pub fn chunks(self, max: usize) -> impl Iterator<Item = Span> {
        let max = max.max(1);
        let size = self.dtype.size() as u64;
        (0..self.len).step_by(max).map(move |off| Span {
            ptr: self.ptr + off as u64 * size,
            len: max.min(self.len - off),
            dtype: self.dtype,
        })
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

/// This rank and the size of its world, for the checks that name ranks.
#[derive(Clone, Copy)]
pub(crate) struct Ranks {
    pub rank: usize,
    pub size: usize,
}

/// `all_reduce` and `all_reduce_async`: a valid view of a reducible type.
pub(crate) fn all_reduce(op: &'static str, buf: Span) -> Result<()> {
    check_view(op, "buffer", buf)?;
    check_reducible(op, buf)
}

/// `all_gather`: valid views of one type, the receive buffer `world` times
/// the send buffer.
pub(crate) fn all_gather(op: &'static str, send: Span, recv: Span, world: usize) -> Result<()> {
    check_send_recv(op, send, recv, world)
}

/// `reduce_scatter`: valid views of one reducible type, the send buffer
/// `world` times the receive buffer.
pub(crate) fn reduce_scatter(op: &'static str, send: Span, recv: Span, world: usize) -> Result<()> {
    check_view(op, "send buffer", send)?;
    check_view(op, "receive buffer", recv)?;
    check_reducible(op, send)?;
    check_pair(
        op,
        ("the receive buffer", recv),
        ("the send buffer", send),
        world,
    )
}

/// `broadcast`: a valid view and a root in the world.
pub(crate) fn broadcast(op: &'static str, buf: Span, root: usize, world: usize) -> Result<()> {
    check_view(op, "buffer", buf)?;
    check_rank(op, "root", root, world)
}

/// `recv_command_u32`: one u32, from a root that is another rank.
pub(crate) fn command(op: &'static str, buf: Span, root: usize, ranks: Ranks) -> Result<()> {
    check_command(op, buf)?;
    check_rank(op, "root", root, ranks.size)?;
    if root == ranks.rank {
        return Err(invalid(
            op,
            format!("rank {root} is the root: only other ranks receive commands"),
        ));
    }
    Ok(())
}

/// `send_to` and `recv_from` (`verb`: "send to", "receive from"): a valid
/// view and a peer that is another rank of the world.
pub(crate) fn point_to_point(
    op: &'static str,
    buf: Span,
    peer: usize,
    ranks: Ranks,
    verb: &str,
) -> Result<()> {
    check_view(op, "buffer", buf)?;
    check_rank(op, "peer", peer, ranks.size)?;
    if peer == ranks.rank {
        return Err(invalid(op, format!("rank {peer} cannot {verb} itself")));
    }
    Ok(())
}

/// `all_to_all`: valid views of one type and length, in `world` equal
/// blocks.
pub(crate) fn all_to_all(op: &'static str, send: Span, recv: Span, world: usize) -> Result<()> {
    check_send_recv(op, send, recv, 1)?;
    if !send.len.is_multiple_of(world) {
        return Err(invalid(
            op,
            format!(
                "{} elements do not split into {world} equal blocks",
                send.len
            ),
        ));
    }
    Ok(())
}

/// `all_to_all_v`: valid views of one type, one count per rank that fits
/// each view, and as much sent to this rank as received from it.
pub(crate) fn all_to_all_v(
    op: &'static str,
    (send, send_counts): (Span, &[usize]),
    (recv, recv_counts): (Span, &[usize]),
    ranks: Ranks,
) -> Result<()> {
    check_view(op, "send buffer", send)?;
    check_view(op, "receive buffer", recv)?;
    if send.dtype != recv.dtype {
        return Err(invalid(
            op,
            format!(
                "the send buffer holds {} but the receive buffer holds {}",
                send.dtype, recv.dtype
            ),
        ));
    }
    check_counts(op, "send_counts", send_counts, ranks.size, send.len)?;
    check_counts(op, "recv_counts", recv_counts, ranks.size, recv.len)?;
    let me = ranks.rank;
    if send_counts[me] != recv_counts[me] {
        return Err(invalid(
            op,
            format!(
                "this rank sends itself {} elements but receives {}",
                send_counts[me], recv_counts[me]
            ),
        ));
    }
    Ok(())
}

/// `set_add_kernel`: a kernel handle that is not null.
pub(crate) fn add_kernel(op: &'static str, kernel: &AddKernel) -> Result<()> {
    if kernel.raw().is_null() {
        return Err(invalid(op, "null CUfunction".into()));
    }
    Ok(())
}

/// `all_reduce_add_rms_norm`: `x` and `residual` valid views of one type
/// the kernels take (bf16, f16, f32) and one length, a whole number of
/// rows of `hidden` = `weight`'s length (1 to the kernels' limit), `weight`
/// of the same type, and a finite, positive `eps`. Returns the launch's
/// arguments.
pub(crate) fn add_rms_norm(
    op: &'static str,
    x: Span,
    residual: Span,
    weight: Span,
    eps: f32,
) -> Result<crate::norm::NormArgs> {
    check_view(op, "x", x)?;
    check_view(op, "residual", residual)?;
    check_view(op, "weight", weight)?;
    if crate::norm::add_rms_norm_name(x.dtype).is_none() {
        return Err(invalid(
            op,
            format!("x holds {}; the norm takes bf16, f16 or f32", x.dtype),
        ));
    }
    check_pair(op, ("x", x), ("residual", residual), 1)?;
    if weight.dtype != x.dtype {
        return Err(invalid(
            op,
            format!("x holds {} but weight holds {}", x.dtype, weight.dtype),
        ));
    }
    let hidden = weight.len;
    if hidden == 0 || hidden > crate::norm::MAX_HIDDEN {
        return Err(invalid(
            op,
            format!(
                "weight holds {hidden} values: hidden must be 1 to {}",
                crate::norm::MAX_HIDDEN
            ),
        ));
    }
    if !x.len.is_multiple_of(hidden) {
        return Err(invalid(
            op,
            format!(
                "x holds {} values, not a whole number of rows of hidden = {hidden} (weight's length)",
                x.len
            ),
        ));
    }
    if !eps.is_finite() || eps <= 0.0 {
        return Err(invalid(op, format!("eps {eps} is not finite and positive")));
    }
    let (lo, hi) = (x.ptr, x.ptr + x.bytes() as u64);
    for (name, other) in [("residual", residual), ("weight", weight)] {
        let (a, b) = (other.ptr, other.ptr + other.bytes() as u64);
        if x.len > 0 && other.len > 0 && a < hi && lo < b {
            return Err(invalid(op, format!("{name} overlaps x")));
        }
    }
    Ok(crate::norm::NormArgs {
        x: x.ptr,
        residual: residual.ptr,
        weight: weight.ptr,
        hidden,
        rows: x.len / hidden,
        eps,
        dtype: x.dtype,
    })
}

/// `split`: a color and a key that NCCL's `int`s hold.
pub(crate) fn split(
    op: &'static str,
    color: Option<u32>,
    key: usize,
) -> Result<(Option<i32>, i32)> {
    let color = color
        .map(|c| i32::try_from(c).map_err(|_| invalid(op, format!("color {c} exceeds i32::MAX"))))
        .transpose()?;
    let key = i32::try_from(key).map_err(|_| invalid(op, format!("key {key} exceeds i32::MAX")))?;
    Ok((color, key))
}

/// Checks a send and a receive view: both valid, of one type, the receive
/// buffer `factor` times the send buffer.
fn check_send_recv(op: &'static str, send: Span, recv: Span, factor: usize) -> Result<()> {
    check_view(op, "send buffer", send)?;
    check_view(op, "receive buffer", recv)?;
    check_pair(
        op,
        ("the send buffer", send),
        ("the receive buffer", recv),
        factor,
    )
}

/// Checks a view: non-null when non-empty, aligned to its element, and a
/// size that does not overflow.
fn check_view(op: &'static str, what: &str, s: Span) -> Result<()> {
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
fn check_reducible(op: &'static str, s: Span) -> Result<()> {
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
fn check_pair(
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

fn check_rank(op: &'static str, what: &str, r: usize, world_size: usize) -> Result<()> {
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
fn check_command(op: &'static str, s: Span) -> Result<()> {
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
fn check_counts(
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

#[cfg(test)]
mod tests {
    use super::*;

    const R: Ranks = Ranks { rank: 1, size: 4 };

    fn span(ptr: u64, len: usize, dtype: DataType) -> Span {
        Span { ptr, len, dtype }
    }

    fn refused(r: Result<()>) -> String {
        match r {
            Err(CommError::InvalidArgument { reason, .. }) => reason,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn chunks_cover_the_span_in_order() {
        let s = span(0x1000, 10, DataType::Float32);
        let got: Vec<(u64, usize)> = s.chunks(4).map(|c| (c.ptr, c.len)).collect();
        assert_eq!(got, [(0x1000, 4), (0x1010, 4), (0x1020, 2)]);
        assert_eq!(s.chunks(10).count(), 1);
        assert_eq!(s.chunks(0).count(), 10);
        assert_eq!(span(0x1000, 0, DataType::Float32).chunks(4).count(), 0);
    }

    #[test]
    fn add_rms_norm_refuses_each_bad_input() {
        const OP: &str = "all_reduce_add_rms_norm";
        let at = |ptr, len| span(ptr, len, DataType::Bfloat16);
        let (x, r, w) = (at(0x1000, 64), at(0x2000, 64), at(0x3000, 16));
        let a = add_rms_norm(OP, x, r, w, 1e-5).expect("valid");
        assert_eq!((a.hidden, a.rows), (16, 4));
        let bad = |x, r, w, eps| match add_rms_norm(OP, x, r, w, eps) {
            Err(CommError::InvalidArgument { reason, .. }) => reason,
            other => panic!("accepted: {other:?}"),
        };
        assert!(bad(x, at(0x2000, 32), w, 1e-5).contains("needs 64"));
        assert!(bad(x, r, at(0x3000, 5), 1e-5).contains("whole number of rows"));
        assert!(bad(x, r, at(0x3000, 0), 1e-5).contains("hidden must be 1"));
        assert!(
            bad(
                at(0x100000, 65_537),
                at(0x200000, 65_537),
                at(0x300000, 65_537),
                1e-5
            )
            .contains("hidden must be 1")
        );
        for eps in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert!(bad(x, r, w, eps).contains("eps"));
        }
        assert!(bad(x, r, span(0x3000, 16, DataType::Float16), 1e-5).contains("weight holds"));
        assert!(bad(x, span(0x2000, 64, DataType::Float32), w, 1e-5).contains("holds"));
        assert!(bad(at(0x1001, 64), r, w, 1e-5).contains("aligned"));
        assert!(bad(span(0x1000, 64, DataType::Uint32), r, w, 1e-5).contains("bf16, f16 or f32"));
        assert!(bad(x, at(0x1010, 64), w, 1e-5).contains("overlaps"));
        assert!(add_rms_norm(OP, at(0x1000, 0), at(0x2000, 0), w, 1e-5).is_ok());
    }

    #[test]
    fn each_operation_refuses_what_it_must() {
        let bf = |len| span(0x1000, len, DataType::Bfloat16);
        assert!(all_reduce("all_reduce", bf(8)).is_ok());
        assert!(
            refused(all_reduce(
                "all_reduce",
                span(0x1001, 8, DataType::Bfloat16)
            ))
            .contains("aligned")
        );
        assert!(refused(all_reduce("all_reduce", span(0, 8, DataType::Float32))).contains("null"));
        assert!(all_gather("all_gather", bf(2), bf(8), 4).is_ok());
        assert!(refused(all_gather("all_gather", bf(2), bf(6), 4)).contains("needs 8"));
        assert!(reduce_scatter("reduce_scatter", bf(8), bf(2), 4).is_ok());
        assert!(refused(reduce_scatter("reduce_scatter", bf(8), bf(3), 4)).contains("needs"));
        assert!(refused(broadcast("broadcast", bf(1), 4, 4)).contains("root 4"));
        let word = span(0x1000, 1, DataType::Uint32);
        assert!(command("recv_command_u32", word, 0, R).is_ok());
        assert!(refused(command("recv_command_u32", word, 1, R)).contains("is the root"));
        assert!(refused(command("recv_command_u32", bf(1), 0, R)).contains("one u32"));
        assert!(point_to_point("send_to", bf(1), 0, R, "send to").is_ok());
        assert!(refused(point_to_point("send_to", bf(1), 1, R, "send to")).contains("itself"));
        assert!(refused(all_to_all("all_to_all", bf(6), bf(6), 4)).contains("equal blocks"));
        assert!(
            all_to_all_v(
                "all_to_all_v",
                (bf(4), &[1, 1, 1, 1]),
                (bf(4), &[1, 1, 1, 1]),
                R
            )
            .is_ok()
        );
        assert!(
            refused(all_to_all_v(
                "all_to_all_v",
                (bf(4), &[1, 2, 1, 0]),
                (bf(4), &[1, 1, 1, 1]),
                R
            ))
            .contains("sends itself 2")
        );
        assert!(
            refused(all_to_all_v(
                "all_to_all_v",
                (bf(4), &[1, 1, 1]),
                (bf(4), &[1, 1, 1, 1]),
                R
            ))
            .contains("3 counts for 4 ranks")
        );
        assert!(split("split", Some(u32::MAX), 0).is_err());
        assert!(split("split", None, usize::MAX).is_err());
        assert_eq!(split("split", Some(3), 5).ok(), Some((Some(3), 5)));
    }
}
