//! The TCP wire format: a fixed 64-byte header, an optional small body, then payload bytes.
//!
//! Fixed-size headers carry everything a write or read needs, so the receiver reads one
//! header and then the payload straight into registered memory. All integers little-endian.
//!
//! ```text
//!  0 magic   b"ORIG"        4 version u8 (1)   5 kind u8   6 flags u16 (0)
//!  8 req_id  u64           16 buffer u32      20 body_len u32
//! 24 epoch   u64           32 token u64       40 offset u64 (within the grant)
//! 48 len     u64 (payload bytes that follow, or bytes requested by a read)
//! 56 reserved u64 (0)
//! ```
//!
//! [`Header::decode`] validates everything before any memory is touched or allocated.

use crate::error::{Error, ErrorKind, Result};

pub const HEADER_LEN: usize = 64;
pub const MAGIC: [u8; 4] = *b"ORIG";
pub const VERSION: u8 = 1;
/// Largest body (descriptors, error messages).
pub const MAX_BODY: u32 = 4 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Client -> server, first frame: body = the client's segment name.
    Hello = 1,
    /// Ask for the server's segment descriptor.
    Describe = 2,
    /// body = msgpack segment descriptor.
    DescribeReply = 3,
    /// Write `len` payload bytes under a grant.
    Write = 4,
    /// The write landed.
    WriteAck = 5,
    /// Read `len` bytes under a grant.
    Read = 6,
    /// `len` payload bytes follow.
    ReadData = 7,
    /// body = u16 error code + UTF-8 detail.
    Error = 8,
}

impl FrameKind {
    fn from_u8(v: u8) -> Option<Self> {
        use FrameKind::*;
        [
            Hello,
            Describe,
            DescribeReply,
            Write,
            WriteAck,
            Read,
            ReadData,
            Error,
        ]
        .into_iter()
        .find(|k| *k as u8 == v)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: FrameKind,
    pub req_id: u64,
    pub buffer: u32,
    pub body_len: u32,
    pub epoch: u64,
    pub token: u64,
    pub offset: u64,
    pub len: u64,
}

impl Header {
    pub fn new(kind: FrameKind, req_id: u64) -> Self {
        Self {
            kind,
            req_id,
            buffer: 0,
            body_len: 0,
            epoch: 0,
            token: 0,
            offset: 0,
            len: 0,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[8..16].copy_from_slice(&self.req_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.buffer.to_le_bytes());
        b[20..24].copy_from_slice(&self.body_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.epoch.to_le_bytes());
        b[32..40].copy_from_slice(&self.token.to_le_bytes());
        b[40..48].copy_from_slice(&self.offset.to_le_bytes());
        b[48..56].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and validates a header. `max_payload` bounds `len` for frames that carry or
    /// request payload, so a peer can never make us read or allocate without limit.
    pub fn decode(b: &[u8; HEADER_LEN], max_payload: u64) -> Result<Self> {
        let bad = |what: String| Err(Error::new(ErrorKind::Malformed, what));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if b[0..4] != MAGIC {
            return bad(format!("bad magic {:02x?}", &b[0..4]));
        }
        if b[4] != VERSION {
            return bad(format!("unsupported frame version {}", b[4]));
        }
        let Some(kind) = FrameKind::from_u8(b[5]) else {
            return bad(format!("unknown frame kind {}", b[5]));
        };
        if b[6..8] != [0, 0] || u64_at(56) != 0 {
            return bad("reserved header bytes are not zero".into());
        }
        let h = Header {
            kind,
            req_id: u64_at(8),
            buffer: u32_at(16),
            body_len: u32_at(20),
            epoch: u64_at(24),
            token: u64_at(32),
            offset: u64_at(40),
            len: u64_at(48),
        };
        if h.body_len > MAX_BODY {
            return bad(format!(
                "{kind:?} body of {} bytes exceeds {MAX_BODY}",
                h.body_len
            ));
        }
        match kind {
            FrameKind::Write | FrameKind::Read | FrameKind::ReadData => {
                if h.len == 0 || h.len > max_payload {
                    return bad(format!(
                        "{kind:?} length {} outside 1..={max_payload}",
                        h.len
                    ));
                }
                if h.body_len != 0 {
                    return bad(format!("{kind:?} must not carry a body"));
                }
            }
            FrameKind::Hello | FrameKind::DescribeReply | FrameKind::Error => {
                if h.len != 0 {
                    return bad(format!("{kind:?} must not carry payload"));
                }
                if h.body_len == 0 || (kind == FrameKind::Error && h.body_len < 2) {
                    return bad(format!("{kind:?} needs a body"));
                }
            }
            FrameKind::Describe | FrameKind::WriteAck => {
                if h.len != 0 || h.body_len != 0 {
                    return bad(format!("{kind:?} carries neither body nor payload"));
                }
            }
        }
        Ok(h)
    }
}

/// Encodes an error body: code + detail (truncated to keep frames small).
pub fn error_body(err: &Error) -> Vec<u8> {
    let detail = err.detail().as_bytes();
    let detail = &detail[..detail.len().min(4096)];
    let mut b = Vec::with_capacity(2 + detail.len());
    b.extend_from_slice(&err.kind().code().to_le_bytes());
    b.extend_from_slice(detail);
    b
}

/// Decodes an error body sent by a peer into the same error kind.
pub fn decode_error_body(body: &[u8]) -> Error {
    if body.len() < 2 {
        return Error::new(ErrorKind::Malformed, "error frame without a code");
    }
    let code = u16::from_le_bytes([body[0], body[1]]);
    let detail = String::from_utf8_lossy(&body[2..]);
    match ErrorKind::from_code(code) {
        Some(kind) => Error::new(kind, format!("refused by peer: {detail}")),
        None => Error::new(
            ErrorKind::Malformed,
            format!("unknown error code {code}: {detail}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_header(len: u64) -> Header {
        Header {
            buffer: 3,
            epoch: 9,
            token: 0xabcdef,
            offset: 128,
            len,
            ..Header::new(FrameKind::Write, 77)
        }
    }

    #[test]
    fn header_round_trips() {
        let h = write_header(4096);
        assert_eq!(Header::decode(&h.encode(), 1 << 20).unwrap(), h);
        let e = Header {
            body_len: 5,
            ..Header::new(FrameKind::Error, 1)
        };
        assert_eq!(Header::decode(&e.encode(), 1).unwrap(), e);
    }

    #[test]
    fn header_refusals_name_the_problem() {
        let refuse = |b: [u8; HEADER_LEN], needle: &str| {
            let e = Header::decode(&b, 1 << 20).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Malformed);
            assert!(
                e.detail().contains(needle),
                "{} should mention {needle}",
                e.detail()
            );
        };
        let good = write_header(4096).encode();
        let mut b = good;
        b[0] = b'X';
        refuse(b, "magic");
        let mut b = good;
        b[4] = 2;
        refuse(b, "version");
        let mut b = good;
        b[5] = 99;
        refuse(b, "kind");
        let mut b = good;
        b[60] = 1;
        refuse(b, "reserved");
        refuse(write_header(0).encode(), "length");
        refuse(write_header((1 << 20) + 1).encode(), "length");
        refuse(
            Header {
                body_len: 1,
                ..write_header(1)
            }
            .encode(),
            "body",
        );
        refuse(
            Header {
                body_len: MAX_BODY + 1,
                ..Header::new(FrameKind::Hello, 0)
            }
            .encode(),
            "exceeds",
        );
        refuse(Header::new(FrameKind::Hello, 0).encode(), "needs a body");
        refuse(
            Header {
                len: 5,
                ..Header::new(FrameKind::WriteAck, 0)
            }
            .encode(),
            "neither",
        );
    }

    #[test]
    fn error_bodies_round_trip_their_kind() {
        let e = Error::new(ErrorKind::GrantRevoked, "late");
        let back = decode_error_body(&error_body(&e));
        assert_eq!(back.kind(), ErrorKind::GrantRevoked);
        assert!(back.detail().contains("late"));
        assert_eq!(
            decode_error_body(&[0xff, 0xff]).kind(),
            ErrorKind::Malformed
        );
        assert_eq!(decode_error_body(&[1]).kind(), ErrorKind::Malformed);
    }
}
