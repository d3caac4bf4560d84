//! What crosses process boundaries for rdma: a queue pair's endpoint (exchanged at connection
//! setup) and a grant's remote key (attached to a grant by the issuing side). Fixed little-endian
//! layouts with a magic and a version, validated in full before anything uses them.
//!
//! These compile without the `rdma` feature: peers without verbs still validate and report them.

use crate::error::{Error, ErrorKind, Result};
use crate::grant::GrantRef;

const ENDPOINT_MAGIC: [u8; 4] = *b"ORQP";
const KEY_MAGIC: [u8; 4] = *b"ORRK";
const VERSION: u8 = 1;
/// Device names are short (mlx5_0, rxe0, ...); the kernel allows 64 bytes.
pub const MAX_DEVICE_NAME: usize = 64;

/// Whether `mtu` is a path MTU verbs knows (256..4096, powers of two).
pub fn mtu_bytes_valid(mtu: u32) -> bool {
    matches!(mtu, 256 | 512 | 1024 | 2048 | 4096)
}

fn malformed(what: &str, detail: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Malformed, format!("rdma {what}: {detail}"))
}

/// A reliable-connected queue pair as its peer needs to know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The device the queue pair lives on (for logs and errors; routing uses the GID).
    pub device: String,
    pub port: u8,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    pub gid: [u8; 16],
    pub gid_index: u8,
    /// Active path MTU in bytes.
    pub mtu: u32,
}

impl Endpoint {
    pub fn validate(&self) -> Result<()> {
        let what = "endpoint";
        if self.device.is_empty()
            || self.device.len() > MAX_DEVICE_NAME
            || !self.device.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(malformed(
                what,
                format!(
                    "device name {:?} is not 1..=64 printable ASCII bytes",
                    self.device
                ),
            ));
        }
        if self.port == 0 {
            return Err(malformed(what, "port 0 (ports count from 1)"));
        }
        if self.qpn == 0 || self.qpn > 0x00ff_ffff {
            return Err(malformed(
                what,
                format!("queue pair number {} not in 1..2^24", self.qpn),
            ));
        }
        if self.psn > 0x00ff_ffff {
            return Err(malformed(
                what,
                format!("PSN {} wider than 24 bits", self.psn),
            ));
        }
        if !mtu_bytes_valid(self.mtu) {
            return Err(malformed(
                what,
                format!("MTU {} is not one of 256, 512, 1024, 2048, 4096", self.mtu),
            ));
        }
        if self.gid == [0; 16] {
            return Err(malformed(what, "GID is all zero"));
        }
        Ok(())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(40 + self.device.len());
        b.extend_from_slice(&ENDPOINT_MAGIC);
        b.push(VERSION);
        b.push(self.port);
        b.push(self.gid_index);
        b.push(self.device.len() as u8);
        b.extend_from_slice(&self.qpn.to_le_bytes());
        b.extend_from_slice(&self.psn.to_le_bytes());
        b.extend_from_slice(&self.mtu.to_le_bytes());
        b.extend_from_slice(&self.gid);
        b.extend_from_slice(self.device.as_bytes());
        b
    }

    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let what = "endpoint";
        const FIXED: usize = 4 + 4 + 12 + 16;
        if b.len() < FIXED {
            return Err(malformed(
                what,
                format!("{} bytes, at least {FIXED} needed", b.len()),
            ));
        }
        if b[..4] != ENDPOINT_MAGIC {
            return Err(malformed(what, "bad magic"));
        }
        if b[4] != VERSION {
            return Err(malformed(
                what,
                format!("version {} (this build reads {VERSION})", b[4]),
            ));
        }
        let name_len = b[7] as usize;
        if b.len() != FIXED + name_len {
            return Err(malformed(
                what,
                format!("{} bytes, the header says {}", b.len(), FIXED + name_len),
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let device = std::str::from_utf8(&b[FIXED..])
            .map_err(|_| malformed(what, "device name is not UTF-8"))?
            .to_owned();
        let e = Endpoint {
            device,
            port: b[5],
            gid_index: b[6],
            qpn: u32_at(8),
            psn: u32_at(12),
            mtu: u32_at(16),
            gid: b[20..36].try_into().expect("16 bytes"),
        };
        e.validate()?;
        Ok(e)
    }
}

/// A 32-bit mix of a grant's wire reference (splitmix64's finaliser over its fields): every
/// field changes every bit with probability about one half.
fn seal(g: &GrantRef) -> u32 {
    let mut x = g.token ^ g.epoch.rotate_left(32) ^ (u64::from(g.buffer) << 17);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    (x ^ (x >> 32)) as u32
}

/// How the issuing side fenced a grant's range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceKind {
    /// A type 2 memory window bound over the range (invalidated on revoke).
    Window = 1,
    /// A memory region registered over exactly the range (deregistered on revoke).
    Region = 2,
    /// A memory region over a host bounce buffer standing for GPU memory the target cannot
    /// register (no GPUDirect RDMA): filled from the GPU when a read grant is issued; after a
    /// write the initiator asks the target to copy what landed to the GPU (deregistered and
    /// freed on revoke).
    Staged = 3,
}

/// What an initiator needs to reach a granted range with one-sided verbs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantKey {
    pub fence: FenceKind,
    /// The address of the grant's first byte, as the target's device knows it.
    pub addr: u64,
    /// The grant's length; the key covers exactly addr..addr+len.
    pub len: u64,
    pub rkey: u32,
}

impl GrantKey {
    pub const ENCODED_LEN: usize = 4 + 1 + 1 + 2 + 8 + 8 + 4;

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::ENCODED_LEN);
        b.extend_from_slice(&KEY_MAGIC);
        b.push(VERSION);
        b.push(self.fence as u8);
        b.extend_from_slice(&[0, 0]);
        b.extend_from_slice(&self.addr.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        b.extend_from_slice(&self.rkey.to_le_bytes());
        b
    }

    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let what = "grant key";
        if b.len() != Self::ENCODED_LEN {
            return Err(malformed(
                what,
                format!("{} bytes, expected {}", b.len(), Self::ENCODED_LEN),
            ));
        }
        if b[..4] != KEY_MAGIC {
            return Err(malformed(what, "bad magic"));
        }
        if b[4] != VERSION {
            return Err(malformed(
                what,
                format!("version {} (this build reads {VERSION})", b[4]),
            ));
        }
        let fence = match b[5] {
            1 => FenceKind::Window,
            2 => FenceKind::Region,
            3 => FenceKind::Staged,
            k => return Err(malformed(what, format!("unknown fence kind {k}"))),
        };
        if b[6] != 0 || b[7] != 0 {
            return Err(malformed(what, "reserved bytes are not zero"));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let key = GrantKey {
            fence,
            addr: u64_at(8),
            len: u64_at(16),
            rkey: u32::from_le_bytes(b[24..28].try_into().expect("4 bytes")),
        };
        if key.len == 0 {
            return Err(malformed(what, "zero length"));
        }
        if key.addr.checked_add(key.len).is_none() {
            return Err(malformed(
                what,
                format!("address {:#x} + length {} overflows", key.addr, key.len),
            ));
        }
        Ok(key)
    }

    /// The key as it travels inside a grant: its rkey sealed with the grant's wire reference
    /// (buffer, epoch, token). The device checks only the rkey, never the token, so the seal
    /// makes the token matter: a slice whose grant reference was altered (a forged token, another
    /// epoch) unseals to a wrong rkey that the device refuses, and the target's admission then
    /// names why. Not secrecy (whoever holds the grant holds both): integrity of the pairing.
    /// Sealing twice with the same reference gives the key back, so [`GrantKey::unsealed`] is
    /// the same operation.
    pub fn sealed(mut self, grant: &GrantRef) -> Self {
        self.rkey ^= seal(grant);
        self
    }

    /// The device's rkey back from a key sealed with `grant` (see [`GrantKey::sealed`]).
    pub fn unsealed(self, grant: &GrantRef) -> Self {
        self.sealed(grant)
    }

    /// The remote address of `len` bytes at `offset` into the grant; refuses ranges outside it
    /// (the target's device refuses them too, with IBV_WC_REM_ACCESS_ERR: this check only
    /// makes the error local, early and named).
    pub fn remote_addr(&self, offset: u64, len: u64) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len && len > 0 => Ok(self.addr + offset),
            _ => Err(Error::new(
                ErrorKind::OutOfGrant,
                format!(
                    "rdma: offset {offset} + len {len} outside the {}-byte grant",
                    self.len
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint() -> Endpoint {
        Endpoint {
            device: "rxe0".into(),
            port: 1,
            qpn: 0x11,
            psn: 0x00ab_cdef,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 1],
            gid_index: 1,
            mtu: 4096,
        }
    }

    #[test]
    fn endpoint_round_trips() {
        let e = endpoint();
        assert_eq!(Endpoint::from_bytes(&e.to_bytes()).unwrap(), e);
    }

    #[test]
    fn endpoint_refuses_bad_input_naming_it() {
        let good = endpoint().to_bytes();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (good[..10].to_vec(), "at least"),
            ([b"XXXX".as_slice(), &good[4..]].concat(), "magic"),
            (
                {
                    let mut b = good.clone();
                    b[4] = 9;
                    b
                },
                "version 9",
            ),
            (
                {
                    let mut b = good.clone();
                    b.push(0);
                    b
                },
                "header says",
            ),
            (
                {
                    let mut b = good.clone();
                    b[5] = 0;
                    b
                },
                "port 0",
            ),
            (
                {
                    let mut b = good.clone();
                    b[11] = 1;
                    b
                },
                "queue pair number",
            ),
            (
                {
                    let mut b = good.clone();
                    b[15] = 1;
                    b
                },
                "PSN",
            ),
            (
                {
                    let mut b = good.clone();
                    b[16..20].copy_from_slice(&1500u32.to_le_bytes());
                    b
                },
                "MTU 1500",
            ),
            (
                {
                    let mut b = good.clone();
                    b[20..36].fill(0);
                    b
                },
                "all zero",
            ),
            (
                {
                    let mut b = good.clone();
                    let n = b.len();
                    b[n - 1] = b' ';
                    b
                },
                "printable",
            ),
        ];
        for (bytes, want) in cases {
            let e = Endpoint::from_bytes(&bytes).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Malformed);
            assert!(
                e.detail().contains(want),
                "{want:?} not in {:?}",
                e.detail()
            );
        }
    }

    #[test]
    fn grant_key_round_trips_and_bounds_ranges() {
        let k = GrantKey {
            fence: FenceKind::Window,
            addr: 0x7f00_0000_1000,
            len: 4096,
            rkey: 0x1234,
        };
        let b = k.to_bytes();
        assert_eq!(b.len(), GrantKey::ENCODED_LEN);
        assert_eq!(GrantKey::from_bytes(&b).unwrap(), k);
        let staged = GrantKey {
            fence: FenceKind::Staged,
            ..k
        };
        assert_eq!(GrantKey::from_bytes(&staged.to_bytes()).unwrap(), staged);
        assert_eq!(k.remote_addr(4000, 96).unwrap(), 0x7f00_0000_1000 + 4000);
        for (off, len) in [(4000, 97), (4096, 1), (0, 0), (u64::MAX, 2)] {
            assert_eq!(
                k.remote_addr(off, len).unwrap_err().kind(),
                ErrorKind::OutOfGrant
            );
        }
    }

    #[test]
    fn a_sealed_key_unseals_only_with_its_grant_reference() {
        let k = GrantKey {
            fence: FenceKind::Region,
            addr: 0x1000,
            len: 4096,
            rkey: 0x0001_2345,
        };
        let g = GrantRef {
            buffer: 3,
            epoch: 77,
            token: 0x0123_4567_89ab_cdef,
        };
        let sealed = k.sealed(&g);
        assert_ne!(sealed.rkey, k.rkey);
        assert_eq!(sealed.unsealed(&g), k);
        for other in [
            GrantRef {
                token: g.token ^ 1,
                ..g
            },
            GrantRef { epoch: 78, ..g },
            GrantRef { buffer: 4, ..g },
        ] {
            assert_ne!(sealed.unsealed(&other).rkey, k.rkey, "{other:?}");
        }
    }

    #[test]
    fn grant_key_refuses_bad_input_naming_it() {
        let good = GrantKey {
            fence: FenceKind::Region,
            addr: 0x1000,
            len: 10,
            rkey: 7,
        }
        .to_bytes();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (good[..27].to_vec(), "expected 28"),
            ([b"ORQP".as_slice(), &good[4..]].concat(), "magic"),
            (
                {
                    let mut b = good.clone();
                    b[4] = 2;
                    b
                },
                "version 2",
            ),
            (
                {
                    let mut b = good.clone();
                    b[5] = 4;
                    b
                },
                "fence kind 4",
            ),
            (
                {
                    let mut b = good.clone();
                    b[6] = 1;
                    b
                },
                "reserved",
            ),
            (
                {
                    let mut b = good.clone();
                    b[16..24].fill(0);
                    b
                },
                "zero length",
            ),
            (
                {
                    let mut b = good.clone();
                    b[8..16].fill(0xff);
                    b
                },
                "overflows",
            ),
        ];
        for (bytes, want) in cases {
            let e = GrantKey::from_bytes(&bytes).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Malformed);
            assert!(
                e.detail().contains(want),
                "{want:?} not in {:?}",
                e.detail()
            );
        }
    }
}
