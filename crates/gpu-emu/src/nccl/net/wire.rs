//! The wire format of the cross-process transport: length-prefixed frames
//! over TCP on loopback, read and written with short timeouts so that every
//! wait can be given up.
//!
//! Every connection starts with the 8-byte [`PREAMBLE`], then frames:
//! `len: u32 LE` (the bytes after it), `tag: u8`, body. Integers are little
//! endian. Bodies by tag:
//! - 1 `Register`: id `[u8; 128]`, nranks `u32`, rank `u32`, endpoint;
//! - 2 `Table`: count `u32`, then that many endpoints (rank order);
//! - 3 `Refused`: code `i32`, text (the rest, UTF-8);
//! - 4 `Hello`: key `u128`, to `u32`, from `u32` (slots, see `routes`);
//! - 5 `HelloOk`: empty;
//! - 10 `Coll`: seq `u64`, kind `u8`, dt `u8`, op `u8`, count `u64`,
//!   root `u32`, total `u64`;
//! - 11 `P2p`: seq `u64` (the send's number among the sender's sends to
//!   this rank, from 1), dt `u8`, count `u64`, total `u64`;
//! - 12 `Chunk`: payload bytes;
//! - 13 `Split`: seq `u64`, color `i32`, key `i32`;
//! - 14 `Bye`: empty.
//!
//! An endpoint is nonce `u64`, pid `u32`, port `u16`, device `i32`, slot
//! `u32`. A `Coll` or `P2p` header is followed by `Chunk` frames carrying
//! exactly `total` bytes of payload, written back to back under the link's
//! write lock.
//!
//! Invariants: no frame is longer than [`MAX_FRAME`] (a chunk carries at
//! most [`CHUNK`] bytes), so a reader never allocates more than that for
//! one frame whatever a peer sends; a read or write blocks at most one
//! [`IO_TICK`] between checks of its `stop` condition, and reports `stop`
//! as an error of kind `Interrupted`.

use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;

use super::Endpoint;

/// The first bytes of every connection.
pub(crate) const PREAMBLE: [u8; 8] = *b"MEMUNET1";
/// The most payload one `Chunk` frame carries.
pub(crate) const CHUNK: usize = 1 << 20;
/// The longest frame accepted (a chunk and its tag, or a table of 4096
/// ranks).
pub(crate) const MAX_FRAME: usize = CHUNK + 64;
/// The longest a read or write blocks before it checks its stop condition.
pub(crate) const IO_TICK: std::time::Duration = std::time::Duration::from_millis(20);
/// The most ranks a cross-process communicator may have.
pub(crate) const MAX_RANKS: usize = 4096;

const ENDPOINT_LEN: usize = 8 + 4 + 2 + 4 + 4;

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Frame {
    Register {
        id: [u8; 128],
        nranks: u32,
        rank: u32,
        ep: Endpoint,
    },
    Table(Vec<Endpoint>),
    Refused {
        code: i32,
        msg: String,
    },
    Hello {
        key: u128,
        to: u32,
        from: u32,
    },
    HelloOk,
    Coll {
        seq: u64,
        kind: u8,
        dt: u8,
        op: u8,
        count: u64,
        root: u32,
        total: u64,
    },
    P2p {
        seq: u64,
        dt: u8,
        count: u64,
        total: u64,
    },
    Chunk(Vec<u8>),
    Split {
        seq: u64,
        color: i32,
        key: i32,
    },
    Bye,
}

fn put_ep(b: &mut Vec<u8>, e: &Endpoint) {
    b.extend_from_slice(&e.nonce.to_le_bytes());
    b.extend_from_slice(&e.pid.to_le_bytes());
    b.extend_from_slice(&e.port.to_le_bytes());
    b.extend_from_slice(&e.device.to_le_bytes());
    b.extend_from_slice(&e.slot.to_le_bytes());
}

impl Frame {
    /// The frame's bytes, length prefix included.
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; 4];
        match self {
            Frame::Register {
                id,
                nranks,
                rank,
                ep,
            } => {
                b.push(1);
                b.extend_from_slice(id);
                b.extend_from_slice(&nranks.to_le_bytes());
                b.extend_from_slice(&rank.to_le_bytes());
                put_ep(&mut b, ep);
            }
            Frame::Table(eps) => {
                b.push(2);
                b.extend_from_slice(&(eps.len() as u32).to_le_bytes());
                for e in eps {
                    put_ep(&mut b, e);
                }
            }
            Frame::Refused { code, msg } => {
                b.push(3);
                b.extend_from_slice(&code.to_le_bytes());
                let text = msg.as_bytes();
                b.extend_from_slice(&text[..text.len().min(4096)]);
            }
            Frame::Hello { key, to, from } => {
                b.push(4);
                b.extend_from_slice(&key.to_le_bytes());
                b.extend_from_slice(&to.to_le_bytes());
                b.extend_from_slice(&from.to_le_bytes());
            }
            Frame::HelloOk => b.push(5),
            Frame::Coll {
                seq,
                kind,
                dt,
                op,
                count,
                root,
                total,
            } => {
                b.push(10);
                b.extend_from_slice(&seq.to_le_bytes());
                b.extend_from_slice(&[*kind, *dt, *op]);
                b.extend_from_slice(&count.to_le_bytes());
                b.extend_from_slice(&root.to_le_bytes());
                b.extend_from_slice(&total.to_le_bytes());
            }
            Frame::P2p {
                seq,
                dt,
                count,
                total,
            } => {
                b.push(11);
                b.extend_from_slice(&seq.to_le_bytes());
                b.push(*dt);
                b.extend_from_slice(&count.to_le_bytes());
                b.extend_from_slice(&total.to_le_bytes());
            }
            Frame::Chunk(data) => {
                b.push(12);
                b.extend_from_slice(data);
            }
            Frame::Split { seq, color, key } => {
                b.push(13);
                b.extend_from_slice(&seq.to_le_bytes());
                b.extend_from_slice(&color.to_le_bytes());
                b.extend_from_slice(&key.to_le_bytes());
            }
            Frame::Bye => b.push(14),
        }
        let len = (b.len() - 4) as u32;
        b[..4].copy_from_slice(&len.to_le_bytes());
        b
    }

    /// Decodes a frame body (tag first); `None` when it is malformed.
    pub(super) fn decode(body: &[u8]) -> Option<Frame> {
        let (&tag, rest) = body.split_first()?;
        let mut c = Cursor(rest);
        let f = match tag {
            1 => {
                let id: [u8; 128] = c.take(128)?.try_into().ok()?;
                Frame::Register {
                    id,
                    nranks: c.u32()?,
                    rank: c.u32()?,
                    ep: c.ep()?,
                }
            }
            2 => {
                let n = c.u32()? as usize;
                if n > MAX_RANKS {
                    return None;
                }
                Frame::Table((0..n).map(|_| c.ep()).collect::<Option<_>>()?)
            }
            3 => {
                let code = c.i32()?;
                let msg = String::from_utf8_lossy(c.rest()).into_owned();
                return Some(Frame::Refused { code, msg });
            }
            4 => Frame::Hello {
                key: u128::from_le_bytes(c.take(16)?.try_into().ok()?),
                to: c.u32()?,
                from: c.u32()?,
            },
            5 => Frame::HelloOk,
            10 => Frame::Coll {
                seq: c.u64()?,
                kind: c.u8()?,
                dt: c.u8()?,
                op: c.u8()?,
                count: c.u64()?,
                root: c.u32()?,
                total: c.u64()?,
            },
            11 => Frame::P2p {
                seq: c.u64()?,
                dt: c.u8()?,
                count: c.u64()?,
                total: c.u64()?,
            },
            12 => return Some(Frame::Chunk(c.rest().to_vec())),
            13 => Frame::Split {
                seq: c.u64()?,
                color: c.i32()?,
                key: c.i32()?,
            },
            14 => Frame::Bye,
            _ => return None,
        };
        c.0.is_empty().then_some(f)
    }
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }

    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn i32(&mut self) -> Option<i32> {
        Some(i32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn ep(&mut self) -> Option<Endpoint> {
        let raw = self.take(ENDPOINT_LEN)?;
        let mut c = Cursor(raw);
        Some(Endpoint {
            nonce: c.u64()?,
            pid: c.u32()?,
            port: c.u16()?,
            device: c.i32()?,
            slot: c.u32()?,
        })
    }
}

fn interrupted() -> io::Error {
    io::Error::new(ErrorKind::Interrupted, "given up (aborted or closing)")
}

fn timed_out(e: &io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Sets the short timeouts every read and write of `s` relies on.
pub(crate) fn prepare(s: &TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(IO_TICK))?;
    s.set_write_timeout(Some(IO_TICK))
}

/// Writes all of `buf`, checking `stop` whenever the socket stays full for
/// [`IO_TICK`].
pub(crate) fn write_all(
    mut s: &TcpStream,
    mut buf: &[u8],
    stop: &dyn Fn() -> bool,
) -> io::Result<()> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if timed_out(&e) || e.kind() == ErrorKind::Interrupted => {
                if stop() {
                    return Err(interrupted());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes one frame.
pub(crate) fn write_frame(s: &TcpStream, f: &Frame, stop: &dyn Fn() -> bool) -> io::Result<()> {
    write_all(s, &f.encode(), stop)
}

/// Writes `data` as `Chunk` frames (nothing when it is empty).
pub(crate) fn write_chunks(s: &TcpStream, data: &[u8], stop: &dyn Fn() -> bool) -> io::Result<()> {
    for part in data.chunks(CHUNK) {
        let mut head = [0u8; 5];
        head[..4].copy_from_slice(&(part.len() as u32 + 1).to_le_bytes());
        head[4] = 12;
        write_all(s, &head, stop)?;
        write_all(s, part, stop)?;
    }
    Ok(())
}

/// Fills `buf`; `Ok(false)` when the peer closed before its first byte.
fn read_full(mut s: &TcpStream, buf: &mut [u8], stop: &dyn Fn() -> bool) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if timed_out(&e) || e.kind() == ErrorKind::Interrupted => {
                if stop() {
                    return Err(interrupted());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Reads one frame; `Ok(None)` when the peer closed the connection between
/// frames.
pub(crate) fn read_frame(s: &TcpStream, stop: &dyn Fn() -> bool) -> io::Result<Option<Frame>> {
    let mut len = [0u8; 4];
    if !read_full(s, &mut len, stop)? {
        return Ok(None);
    }
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(io::Error::new(
            ErrorKind::InvalidData,
            format!("frame of {len} bytes"),
        ));
    }
    let mut body = vec![0u8; len];
    if !read_full(s, &mut body, stop)? {
        return Err(ErrorKind::UnexpectedEof.into());
    }
    Frame::decode(&body)
        .map(Some)
        .ok_or_else(|| io::Error::new(ErrorKind::InvalidData, "malformed frame"))
}

/// Writes the preamble.
pub(crate) fn write_preamble(s: &TcpStream, stop: &dyn Fn() -> bool) -> io::Result<()> {
    write_all(s, &PREAMBLE, stop)
}

/// Reads and checks the preamble.
pub(crate) fn read_preamble(s: &TcpStream, stop: &dyn Fn() -> bool) -> io::Result<()> {
    let mut p = [0u8; 8];
    if !read_full(s, &mut p, stop)? || p != PREAMBLE {
        return Err(io::Error::new(
            ErrorKind::InvalidData,
            "not a gpu-emu connection",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let ep = Endpoint {
            nonce: 7,
            pid: 42,
            port: 5000,
            device: -1,
            slot: 3,
        };
        let frames = [
            Frame::Register {
                id: [9; 128],
                nranks: 4,
                rank: 2,
                ep,
            },
            Frame::Table(vec![ep, ep]),
            Frame::Refused {
                code: 4,
                msg: "nope".into(),
            },
            Frame::Hello {
                key: u128::MAX - 5,
                to: 1,
                from: 0,
            },
            Frame::HelloOk,
            Frame::Coll {
                seq: 9,
                kind: 1,
                dt: 9,
                op: 0,
                count: 1 << 40,
                root: 2,
                total: 77,
            },
            Frame::P2p {
                seq: 4,
                dt: 7,
                count: 3,
                total: 12,
            },
            Frame::Chunk(vec![1, 2, 3]),
            Frame::Split {
                seq: 1,
                color: -1,
                key: 5,
            },
            Frame::Bye,
        ];
        for f in frames {
            let b = f.encode();
            let len = u32::from_le_bytes(b[..4].try_into().unwrap()) as usize;
            assert_eq!(len, b.len() - 4);
            assert_eq!(Frame::decode(&b[4..]), Some(f));
        }
        assert_eq!(Frame::decode(&[99]), None);
        assert_eq!(Frame::decode(&[5, 0]), None, "trailing bytes");
        assert_eq!(Frame::decode(&[4, 1, 2]), None, "short body");
    }
}
