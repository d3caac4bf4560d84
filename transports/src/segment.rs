//! Segment descriptors: what a peer needs to know to reach an engine.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};

/// Where a buffer's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemoryKind {
    Host,
}

/// One registered buffer, as peers see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDescriptor {
    pub id: u32,
    pub len: u64,
    pub kind: MemoryKind,
}

/// An engine's named set of registered buffers and the endpoints that reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDescriptor {
    /// The segment (engine) name, unique within a metadata store.
    pub name: String,
    /// Random per engine start: tells a restarted engine from the old one, and tells the
    /// loopback transport whether the engine lives in this process.
    pub instance: u64,
    /// The TCP data and control endpoint, if the engine listens.
    pub tcp: Option<SocketAddr>,
    pub buffers: Vec<BufferDescriptor>,
    /// The shared-memory endpoint for engines on the same host, if enabled.
    #[serde(default)]
    pub shm: Option<crate::transport::shm::ShmEndpoint>,
}

/// Limits on descriptors read from the network.
pub const MAX_SEGMENT_NAME: usize = 255;
pub const MAX_BUFFERS: usize = 1 << 16;
pub const MAX_ENCODED_DESCRIPTOR: usize = 4 << 20;

impl SegmentDescriptor {
    pub fn to_bytes(&self) -> Vec<u8> {
        rmp_serde::to_vec(self).expect("a descriptor always encodes")
    }

    /// Decodes and validates a descriptor from the network.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() > MAX_ENCODED_DESCRIPTOR {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!(
                    "descriptor is {} bytes, limit {MAX_ENCODED_DESCRIPTOR}",
                    bytes.len()
                ),
            ));
        }
        let d: SegmentDescriptor = rmp_serde::from_slice(bytes)
            .map_err(|e| Error::new(ErrorKind::Malformed, format!("segment descriptor: {e}")))?;
        d.validate()?;
        Ok(d)
    }

    pub fn validate(&self) -> Result<()> {
        validate_name(&self.name)?;
        if self.buffers.len() > MAX_BUFFERS {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!(
                    "descriptor lists {} buffers, limit {MAX_BUFFERS}",
                    self.buffers.len()
                ),
            ));
        }
        if let Some(e) = &self.shm {
            e.validate()?;
        }
        if let Some(b) = self.buffers.iter().find(|b| b.len == 0) {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!("buffer {} has length 0", b.id),
            ));
        }
        Ok(())
    }
}

/// Segment names: 1..=255 bytes of printable ASCII without spaces, so logs and keys stay sane.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_SEGMENT_NAME
        && name.bytes().all(|b| b.is_ascii_graphic());
    if ok {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::Malformed,
            format!("segment name {name:?} must be 1..={MAX_SEGMENT_NAME} printable ASCII bytes"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_round_trips_and_refuses_garbage() {
        let d = SegmentDescriptor {
            name: "decode-0".into(),
            instance: 7,
            tcp: Some("127.0.0.1:4000".parse().unwrap()),
            buffers: vec![BufferDescriptor {
                id: 1,
                len: 4096,
                kind: MemoryKind::Host,
            }],
            shm: None,
        };
        assert_eq!(SegmentDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);
        assert_eq!(
            SegmentDescriptor::from_bytes(b"\x93\x01")
                .unwrap_err()
                .kind(),
            ErrorKind::Malformed
        );
        let bad = SegmentDescriptor {
            name: "has space".into(),
            ..d.clone()
        };
        assert_eq!(
            SegmentDescriptor::from_bytes(&bad.to_bytes())
                .unwrap_err()
                .kind(),
            ErrorKind::Malformed
        );
        let empty = SegmentDescriptor {
            buffers: vec![BufferDescriptor {
                id: 1,
                len: 0,
                kind: MemoryKind::Host,
            }],
            ..d
        };
        assert_eq!(
            SegmentDescriptor::from_bytes(&empty.to_bytes())
                .unwrap_err()
                .kind(),
            ErrorKind::Malformed
        );
    }
}
