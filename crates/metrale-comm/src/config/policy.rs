//! The all-reduce path policies (the 2-rank fast path's and the one-shot
//! path's: never, always, a byte range, or `Auto`, tuned at set-up) and the
//! byte counts their settings are written in.
//!
//! Invariants: a range policy is refused unless some payload can take it
//! (`MIN <= MAX`, room for one bf16 element, and for the fast path `MIN`
//! at most [`super::MAX_FAST_PATH_MIN_BYTES`]); `Auto` answers no size by
//! itself (`takes`, `takes_fast_path`): the backend's tuned table does.

use super::MAX_FAST_PATH_MIN_BYTES;
use crate::error::CommError;

/// When the 2-rank all-reduce uses grouped send/recv plus the add kernel
/// instead of NCCL's all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FastPathPolicy {
    /// NCCL's all-reduce always.
    Never,
    /// The fast path at every size.
    Always,
    /// The fast path for payloads in `min_bytes..=max_bytes`.
    Range {
        /// Smallest payload taking the fast path.
        min_bytes: usize,
        /// Largest payload taking the fast path.
        max_bytes: usize,
    },
    /// Where the tuner measured it faster than NCCL's all-reduce on this
    /// machine, at set-up (up to [`AUTO_FAST_PATH_MAX_BYTES`];
    /// `NcclBackend::path_table` shows the ranges; docs/operations.md,
    /// "How the all-reduce path is chosen"). With tuning off, never.
    Auto,
}

/// The largest payload the tuner considers for the fast path (and the
/// most scratch it allocates for it): twice the top of the window where it
/// was measured ahead on 2 GPUs over NVLink (2-4 MiB, decision 0004); above
/// it NCCL's all-reduce runs near bus bandwidth and the add kernel's extra
/// pass over memory only loses.
pub const AUTO_FAST_PATH_MAX_BYTES: usize = 8 << 20;
/// The largest payload the tuner considers for the one-shot path (its
/// largest slot: one launch per call).
pub const AUTO_ONE_SHOT_MAX_BYTES: usize = 1 << 20;

impl FastPathPolicy {
    /// The default: [`FastPathPolicy::Auto`], tuned on the machine.
    pub const DEFAULT: FastPathPolicy = FastPathPolicy::Auto;

    /// Whether a payload of `bytes` takes the fast path by this policy
    /// alone: `false` for [`FastPathPolicy::Auto`], whose choice is the
    /// backend's tuned table.
    pub fn takes_fast_path(self, bytes: usize) -> bool {
        match self {
            FastPathPolicy::Never | FastPathPolicy::Auto => false,
            FastPathPolicy::Always => true,
            FastPathPolicy::Range {
                min_bytes,
                max_bytes,
            } => (min_bytes..=max_bytes).contains(&bytes),
        }
    }

    /// The largest payload this policy sends down the fast path (`None`
    /// for [`FastPathPolicy::Never`]). The backend sizes its scratch buffer
    /// from it.
    pub fn max_fast_bytes(self) -> Option<usize> {
        match self {
            FastPathPolicy::Never => None,
            FastPathPolicy::Always => Some(usize::MAX),
            FastPathPolicy::Range { max_bytes, .. } => Some(max_bytes),
            FastPathPolicy::Auto => Some(AUTO_FAST_PATH_MAX_BYTES),
        }
    }

    /// Parses `never`, `always`, `auto` (the default: tuned) or `MIN-MAX`
    /// in bytes (suffixes `K`, `M`, `G` for KiB, MiB, GiB).
    pub fn parse(s: &str) -> Result<Self, CommError> {
        let s = s.trim();
        match s.to_ascii_lowercase().as_str() {
            "never" | "off" | "0" => return Ok(FastPathPolicy::Never),
            "always" => return Ok(FastPathPolicy::Always),
            "auto" | "default" => return Ok(FastPathPolicy::Auto),
            _ => {}
        }
        let (lo, hi) = s.split_once('-').ok_or_else(|| {
            CommError::Config(format!(
                "fast path policy `{s}`: expected never, always, auto or MIN-MAX"
            ))
        })?;
        let (min_bytes, max_bytes) = (parse_bytes(lo)?, parse_bytes(hi)?);
        let p = FastPathPolicy::Range {
            min_bytes,
            max_bytes,
        };
        p.validate()
            .map_err(|why| CommError::Config(format!("fast path policy `{s}`: {why}")))?;
        Ok(p)
    }

    /// Checks that a range can be meant: `MIN <= MAX`, room for at least
    /// one bf16 element, and `MIN` at most [`MAX_FAST_PATH_MIN_BYTES`].
    pub(super) fn validate(self) -> Result<(), String> {
        let FastPathPolicy::Range {
            min_bytes,
            max_bytes,
        } = self
        else {
            return Ok(());
        };
        if min_bytes > max_bytes {
            return Err("MIN > MAX".into());
        }
        if max_bytes < 2 {
            return Err(
                "MAX is below one bf16 element (2 bytes): no payload takes it; \
                        use `never` to turn the fast path off"
                    .into(),
            );
        }
        if min_bytes > MAX_FAST_PATH_MIN_BYTES {
            return Err(format!(
                "MIN exceeds {} MiB, where NCCL's all-reduce always wins; \
                 use `never` to turn the fast path off",
                MAX_FAST_PATH_MIN_BYTES >> 20
            ));
        }
        Ok(())
    }
}

/// When an all-reduce takes the one-shot path over peer memory (every rank
/// pushes its input into every peer's buffer and sums all of them itself;
/// `nccl_backend/one_shot.rs`): bf16, f16 and f32 (the range is in bytes,
/// the same for every type), 2 to 8 ranks of one node, and only once peer
/// access was proven at construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OneShotPolicy {
    /// Never: no peer buffers are set up.
    Never,
    /// At every size (in chunks of the slot size above it).
    Always,
    /// For payloads in `min_bytes..=max_bytes`.
    Range {
        /// Smallest payload taking the one-shot path.
        min_bytes: usize,
        /// Largest payload taking the one-shot path.
        max_bytes: usize,
    },
    /// Where the tuner measured it faster than NCCL's all-reduce on this
    /// machine, eagerly and in graphs apart, at set-up (up to
    /// [`AUTO_ONE_SHOT_MAX_BYTES`]; `NcclBackend::path_table` shows the
    /// ranges). With tuning off, never.
    Auto,
}

impl OneShotPolicy {
    /// The default: [`OneShotPolicy::Auto`], tuned on the machine.
    pub const DEFAULT: OneShotPolicy = OneShotPolicy::Auto;

    /// Whether a payload of `bytes` takes the one-shot path by this policy
    /// alone: `false` for [`OneShotPolicy::Auto`], whose choice is the
    /// backend's tuned table.
    pub fn takes(self, bytes: usize) -> bool {
        match self {
            OneShotPolicy::Never | OneShotPolicy::Auto => false,
            OneShotPolicy::Always => true,
            OneShotPolicy::Range {
                min_bytes,
                max_bytes,
            } => (min_bytes..=max_bytes).contains(&bytes),
        }
    }

    /// The largest payload this policy sends down the one-shot path
    /// (`None` for [`OneShotPolicy::Never`]); the backend sizes its peer
    /// buffers from it.
    pub fn max_bytes(self) -> Option<usize> {
        match self {
            OneShotPolicy::Never => None,
            OneShotPolicy::Always => Some(usize::MAX),
            OneShotPolicy::Range { max_bytes, .. } => Some(max_bytes),
            OneShotPolicy::Auto => Some(AUTO_ONE_SHOT_MAX_BYTES),
        }
    }

    /// Parses `never`, `always`, `auto` (the default: tuned) or `MIN-MAX`
    /// in bytes (suffixes `K`, `M`, `G`), as `METRALE_COMM_ONE_SHOT` takes
    /// them.
    pub fn parse(s: &str) -> Result<Self, CommError> {
        let s = s.trim();
        match s.to_ascii_lowercase().as_str() {
            "never" | "off" | "0" => return Ok(OneShotPolicy::Never),
            "always" => return Ok(OneShotPolicy::Always),
            "auto" | "default" => return Ok(OneShotPolicy::Auto),
            _ => {}
        }
        let (lo, hi) = s.split_once('-').ok_or_else(|| {
            CommError::Config(format!(
                "one-shot policy `{s}`: expected never, always, auto or MIN-MAX"
            ))
        })?;
        let p = OneShotPolicy::Range {
            min_bytes: parse_bytes(lo)?,
            max_bytes: parse_bytes(hi)?,
        };
        p.validate()
            .map_err(|why| CommError::Config(format!("one-shot policy `{s}`: {why}")))?;
        Ok(p)
    }

    /// Checks that a range can be meant: `MIN <= MAX` and room for one bf16
    /// element.
    pub(super) fn validate(self) -> Result<(), String> {
        match self {
            OneShotPolicy::Range {
                min_bytes,
                max_bytes,
            } if min_bytes > max_bytes => Err("MIN > MAX".into()),
            OneShotPolicy::Range { max_bytes, .. } if max_bytes < 2 => Err(
                "MAX is below one bf16 element (2 bytes): use `never` to turn the \
                 one-shot path off"
                    .into(),
            ),
            _ => Ok(()),
        }
    }
}

/// Parses a byte count with an optional `K`, `M` or `G` suffix (powers of
/// 1024).
pub fn parse_bytes(s: &str) -> Result<usize, CommError> {
    let s = s.trim();
    let (digits, shift) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    let n: usize = digits
        .trim()
        .parse()
        .map_err(|_| CommError::Config(format!("`{s}` is not a byte count")))?;
    n.checked_shl(shift)
        .filter(|v| v >> shift == n)
        .ok_or_else(|| CommError::Config(format!("`{s}` is too large")))
}
