//! The store's wire format: length-prefixed binary frames.
//!
//! A frame is a 10-byte header — the magic `MRDV`, the version byte, the
//! kind byte, the payload length as a big-endian `u32` — and the payload.
//! A payload is never longer than [`MAX_FRAME`]; a reader refuses a longer
//! length before allocating. Parsing never panics: every field is read
//! through bounds-checked helpers that return [`WireError`].

use std::io::{Read, Write};

/// The first four bytes of every frame.
pub(crate) const MAGIC: [u8; 4] = *b"MRDV";
/// The protocol version this build speaks.
pub(crate) const VERSION: u8 = 1;
/// The largest payload accepted.
pub(crate) const MAX_FRAME: usize = 1 << 20;
/// The largest key accepted, in bytes.
pub(crate) const MAX_KEY: usize = 4096;
const HEADER: usize = 10;

/// Frame kinds. Requests are below 0x80, responses at or above.
pub(crate) mod kind {
    /// Client hello: payload = the token (possibly empty).
    pub const HELLO: u8 = 1;
    /// Set: key, then the value (the rest).
    pub const SET: u8 = 2;
    /// Get: key, then the wait in milliseconds (`u64`).
    pub const GET: u8 = 3;
    /// Add: key, then the delta (`i64`).
    pub const ADD: u8 = 4;
    /// Success; the payload depends on the request.
    pub const OK: u8 = 0x80;
    /// A get's wait ended without the key.
    pub const TIMEOUT: u8 = 0x81;
    /// An error; payload = UTF-8 message. The server closes after it.
    pub const ERROR: u8 = 0x82;
    /// The hello's token was refused. The server closes after it.
    pub const UNAUTHORIZED: u8 = 0x83;
    /// The server is shutting down.
    pub const CLOSED: u8 = 0x84;
}

/// Why a frame could not be read or parsed.
#[derive(Debug)]
pub(crate) enum WireError {
    /// The transport failed (including timeouts and end of stream).
    Io(std::io::Error),
    /// The bytes are not a valid frame or payload.
    Malformed(String),
}

impl From<std::io::Error> for WireError {
    fn from(err: std::io::Error) -> Self {
        WireError::Io(err)
    }
}

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Frame {
    pub kind: u8,
    pub payload: Vec<u8>,
}

/// Writes one frame (header and payload in one write).
pub(crate) fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    if payload.len() > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("frame of {} bytes exceeds {MAX_FRAME}", payload.len()),
        ));
    }
    let mut buf = Vec::with_capacity(HEADER + payload.len());
    buf.extend_from_slice(&MAGIC);
    buf.push(VERSION);
    buf.push(kind);
    // The length fits: it is at most MAX_FRAME.
    buf.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

/// Reads one frame's header; separate from the payload so that the caller
/// can use a different timeout for the first byte (idle) and the rest.
pub(crate) fn read_header(r: &mut impl Read) -> Result<(u8, usize), WireError> {
    let mut header = [0u8; HEADER];
    r.read_exact(&mut header)?;
    if header[..4] != MAGIC {
        return Err(WireError::Malformed("bad magic".to_owned()));
    }
    if header[4] != VERSION {
        return Err(WireError::Malformed(format!(
            "unsupported protocol version {} (this build speaks {VERSION})",
            header[4]
        )));
    }
    let len = u32::from_be_bytes([header[6], header[7], header[8], header[9]]) as usize;
    if len > MAX_FRAME {
        return Err(WireError::Malformed(format!(
            "frame of {len} bytes exceeds {MAX_FRAME}"
        )));
    }
    Ok((header[5], len))
}

/// Reads a payload of `len` bytes (already checked against `MAX_FRAME`).
pub(crate) fn read_payload(r: &mut impl Read, len: usize) -> Result<Vec<u8>, WireError> {
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok(payload)
}

/// Reads a whole frame with the reader's current timeout.
pub(crate) fn read_frame(r: &mut impl Read) -> Result<Frame, WireError> {
    let (kind, len) = read_header(r)?;
    let payload = read_payload(r, len)?;
    Ok(Frame { kind, payload })
}

/// Encodes a key: `u16` big-endian length, then the UTF-8 bytes.
pub(crate) fn put_key(buf: &mut Vec<u8>, key: &str) -> std::io::Result<()> {
    if key.len() > MAX_KEY {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("key of {} bytes exceeds {MAX_KEY}", key.len()),
        ));
    }
    // The length fits: it is at most MAX_KEY.
    buf.extend_from_slice(&(key.len() as u16).to_be_bytes());
    buf.extend_from_slice(key.as_bytes());
    Ok(())
}

/// Splits a payload into its key and the rest.
pub(crate) fn take_key(payload: &[u8]) -> Result<(String, &[u8]), WireError> {
    let Some((len, rest)) = payload.split_first_chunk::<2>() else {
        return Err(WireError::Malformed("truncated key length".to_owned()));
    };
    let len = u16::from_be_bytes(*len) as usize;
    if len > MAX_KEY || len > rest.len() {
        return Err(WireError::Malformed("bad key length".to_owned()));
    }
    let (key, rest) = rest.split_at(len);
    let key = std::str::from_utf8(key)
        .map_err(|_| WireError::Malformed("key is not UTF-8".to_owned()))?;
    Ok((key.to_owned(), rest))
}

/// Reads an 8-byte big-endian integer that must be the whole of `rest`.
pub(crate) fn take_u64(rest: &[u8]) -> Result<u64, WireError> {
    let bytes: [u8; 8] = rest
        .try_into()
        .map_err(|_| WireError::Malformed("expected an 8-byte integer".to_owned()))?;
    Ok(u64::from_be_bytes(bytes))
}
