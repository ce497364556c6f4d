//! The NCCL unique id: the 128 bytes every rank of a communicator shares.
//!
//! Invariant: an id is exactly 128 bytes; hex and byte forms round-trip.

use nccl_sys::ncclUniqueId;

use crate::error::{Error, Result, nccl_check};

use super::*;

/// An NCCL unique id: the 128 bytes every rank of a communicator shares.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId([u8; 128]);

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId({}…)", &self.to_hex()[..16])
    }
}

impl UniqueId {
    /// A fresh id from `ncclGetUniqueId`.
    pub fn new() -> Result<UniqueId> {
        let mut raw = ncclUniqueId::default();
        // SAFETY: writes one ncclUniqueId through a valid pointer.
        let rc = unsafe { nccl_raw!(ncclGetUniqueId(&mut raw)) };
        nccl_check(rc, "ncclGetUniqueId", std::ptr::null_mut())?;
        Ok(UniqueId(raw.internal.map(|c| c as u8)))
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.0
    }

    /// An id from exactly 128 bytes.
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        let bytes: [u8; 128] = b.try_into().map_err(|_| {
            Error::invalid(
                "UniqueId::from_bytes",
                format!("expected 128 bytes, got {}", b.len()),
            )
        })?;
        Ok(UniqueId(bytes))
    }

    /// The id as 256 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        use fmt::Write;
        let mut s = String::with_capacity(256);
        for b in self.0 {
            let _ = write!(s, "{b:02x}");
        }
        s
    }

    /// An id from 256 hex digits (either case).
    pub fn from_hex(s: &str) -> Result<UniqueId> {
        let s = s.trim();
        if s.len() != 256 || !s.is_ascii() {
            return Err(Error::invalid(
                "UniqueId::from_hex",
                format!(
                    "expected 256 hex digits, got {} characters",
                    s.chars().count()
                ),
            ));
        }
        let mut out = [0u8; 128];
        for (i, byte) in out.iter_mut().enumerate() {
            let pair = &s[2 * i..2 * i + 2];
            *byte = u8::from_str_radix(pair, 16).map_err(|_| {
                Error::invalid(
                    "UniqueId::from_hex",
                    format!("`{pair}` at offset {} is not hex", 2 * i),
                )
            })?;
        }
        Ok(UniqueId(out))
    }

    /// The id in NCCL's layout.
    pub fn raw(&self) -> ncclUniqueId {
        ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}
