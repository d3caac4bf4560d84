//! Segment descriptors: what a peer needs to know to reach an engine.

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::transport::TransportKind;

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

/// How to reach an engine over one transport: the transport's kind and its address, encoded
/// and validated by that transport alone (tcp: a socket address; shm: a socket name and host).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub kind: TransportKind,
    #[serde(with = "serde_bytes")]
    pub address: Vec<u8>,
}

impl Endpoint {
    pub fn new(kind: TransportKind, address: impl Into<Vec<u8>>) -> Self {
        Self {
            kind,
            address: address.into(),
        }
    }
}

/// An engine's named set of registered buffers and the endpoints that reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SegmentDescriptor {
    /// The encoding's version ([`DESCRIPTOR_VERSION`]); decoding refuses any other.
    pub version: u16,
    /// The segment (engine) name, unique within a metadata store.
    pub name: String,
    /// Random per engine start: tells a restarted engine from the old one, and tells the
    /// loopback transport whether the engine lives in this process.
    pub instance: u64,
    pub buffers: Vec<BufferDescriptor>,
    /// One per transport the engine serves peers on, at most one per kind.
    pub endpoints: Vec<Endpoint>,
}

/// The descriptor encoding this build speaks.
pub const DESCRIPTOR_VERSION: u16 = 2;
/// Limits on descriptors read from the network.
pub const MAX_SEGMENT_NAME: usize = 255;
pub const MAX_BUFFERS: usize = 1 << 16;
pub const MAX_ENDPOINTS: usize = 16;
pub const MAX_ENDPOINT_ADDRESS: usize = 1024;
/// Longest transport name accepted in an endpoint (a longer one is malformed, not unknown).
const MAX_KIND_NAME: usize = 32;
pub const MAX_ENCODED_DESCRIPTOR: usize = 4 << 20;

/// The descriptor as it crosses the wire: endpoint kinds as names, so a peer's transport this
/// build lacks (a feature it was built without) is skipped, not a reason to refuse the peer.
#[derive(Deserialize)]
struct Wire {
    version: u16,
    name: String,
    instance: u64,
    buffers: Vec<BufferDescriptor>,
    endpoints: Vec<WireEndpoint>,
}

#[derive(Deserialize)]
struct WireEndpoint {
    kind: String,
    #[serde(with = "serde_bytes")]
    address: Vec<u8>,
}

/// Reads only the version (the first field) of an encoding it cannot otherwise decode, so a
/// peer of another version is told so rather than "malformed".
struct VersionProbe(u16);

impl<'de> Deserialize<'de> for VersionProbe {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = VersionProbe;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a descriptor starting with its version")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<VersionProbe, A::Error> {
                let v: u16 = seq
                    .next_element()?
                    .ok_or_else(|| serde::de::Error::custom("empty descriptor"))?;
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(VersionProbe(v))
            }
        }
        d.deserialize_seq(V)
    }
}

impl SegmentDescriptor {
    /// A descriptor of this build's version.
    pub fn new(
        name: impl Into<String>,
        instance: u64,
        buffers: Vec<BufferDescriptor>,
        endpoints: Vec<Endpoint>,
    ) -> Self {
        Self {
            version: DESCRIPTOR_VERSION,
            name: name.into(),
            instance,
            buffers,
            endpoints,
        }
    }

    /// The address published for `kind`, if any.
    pub fn endpoint(&self, kind: TransportKind) -> Option<&[u8]> {
        self.endpoints
            .iter()
            .find(|e| e.kind == kind)
            .map(|e| e.address.as_slice())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        rmp_serde::to_vec(self).expect("a descriptor always encodes")
    }

    /// Decodes and validates a descriptor from the network: size, version, then every field's
    /// bounds, before anything is used. Endpoints of transports this build does not know are
    /// dropped (each transport validates its own address when it reads it).
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
        let malformed = |e: rmp_serde::decode::Error| {
            Error::new(ErrorKind::Malformed, format!("segment descriptor: {e}"))
        };
        let w: Wire = match rmp_serde::from_slice(bytes) {
            Ok(w) => w,
            Err(e) => {
                return Err(match rmp_serde::from_slice::<VersionProbe>(bytes) {
                    Ok(VersionProbe(v)) if v != DESCRIPTOR_VERSION => version_error(v),
                    _ => malformed(e),
                });
            }
        };
        if w.version != DESCRIPTOR_VERSION {
            return Err(version_error(w.version));
        }
        if w.endpoints.len() > MAX_ENDPOINTS {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!(
                    "descriptor lists {} endpoints, limit {MAX_ENDPOINTS}",
                    w.endpoints.len()
                ),
            ));
        }
        let mut endpoints = Vec::with_capacity(w.endpoints.len());
        for e in w.endpoints {
            if e.kind.is_empty()
                || e.kind.len() > MAX_KIND_NAME
                || !e.kind.bytes().all(|b| b.is_ascii_graphic())
            {
                return Err(Error::new(
                    ErrorKind::Malformed,
                    format!("endpoint kind {:?} is not a transport name", e.kind),
                ));
            }
            if let Ok(kind) = e.kind.parse::<TransportKind>() {
                endpoints.push(Endpoint {
                    kind,
                    address: e.address,
                });
            }
        }
        let d = SegmentDescriptor {
            version: w.version,
            name: w.name,
            instance: w.instance,
            buffers: w.buffers,
            endpoints,
        };
        d.validate()?;
        Ok(d)
    }

    pub fn validate(&self) -> Result<()> {
        if self.version != DESCRIPTOR_VERSION {
            return Err(version_error(self.version));
        }
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
        if self.endpoints.len() > MAX_ENDPOINTS {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!(
                    "descriptor lists {} endpoints, limit {MAX_ENDPOINTS}",
                    self.endpoints.len()
                ),
            ));
        }
        for (i, e) in self.endpoints.iter().enumerate() {
            if e.address.is_empty() || e.address.len() > MAX_ENDPOINT_ADDRESS {
                return Err(Error::new(
                    ErrorKind::Malformed,
                    format!(
                        "{} endpoint address is {} bytes (1..={MAX_ENDPOINT_ADDRESS})",
                        e.kind,
                        e.address.len()
                    ),
                ));
            }
            if self.endpoints[..i].iter().any(|o| o.kind == e.kind) {
                return Err(Error::new(
                    ErrorKind::Malformed,
                    format!("descriptor lists two {} endpoints", e.kind),
                ));
            }
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

fn version_error(v: u16) -> Error {
    Error::new(
        ErrorKind::Malformed,
        format!("segment descriptor version {v} (this engine speaks {DESCRIPTOR_VERSION})"),
    )
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
        let d = SegmentDescriptor::new(
            "decode-0",
            7,
            vec![BufferDescriptor {
                id: 1,
                len: 4096,
                kind: MemoryKind::Host,
            }],
            vec![Endpoint::new(TransportKind::Tcp, "127.0.0.1:4000")],
        );
        assert_eq!(SegmentDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);
        assert_eq!(d.endpoint(TransportKind::Tcp), Some(&b"127.0.0.1:4000"[..]));
        assert_eq!(d.endpoint(TransportKind::Shm), None);
        let refused = |d: &SegmentDescriptor| {
            let e = SegmentDescriptor::from_bytes(&d.to_bytes()).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Malformed, "{e}");
            e.to_string()
        };
        assert_eq!(
            SegmentDescriptor::from_bytes(b"\x93\x01")
                .unwrap_err()
                .kind(),
            ErrorKind::Malformed
        );
        refused(&SegmentDescriptor {
            name: "has space".into(),
            ..d.clone()
        });
        refused(&SegmentDescriptor {
            buffers: vec![BufferDescriptor {
                id: 1,
                len: 0,
                kind: MemoryKind::Host,
            }],
            ..d.clone()
        });
        let e = refused(&SegmentDescriptor {
            version: 9,
            ..d.clone()
        });
        assert!(e.contains("version 9"), "{e}");
        let e = refused(&SegmentDescriptor {
            endpoints: vec![d.endpoints[0].clone(), d.endpoints[0].clone()],
            ..d.clone()
        });
        assert!(e.contains("two tcp endpoints"), "{e}");
        refused(&SegmentDescriptor {
            endpoints: vec![Endpoint::new(
                TransportKind::Tcp,
                vec![1u8; MAX_ENDPOINT_ADDRESS + 1],
            )],
            ..d.clone()
        });
        refused(&SegmentDescriptor {
            endpoints: vec![Endpoint::new(TransportKind::Tcp, Vec::new())],
            ..d.clone()
        });
    }

    /// A peer built with a transport this build lacks: that endpoint is skipped, the rest kept.
    #[test]
    fn unknown_endpoint_kinds_are_skipped_and_bad_names_refused() {
        #[derive(Serialize)]
        struct Raw<'a> {
            version: u16,
            name: &'a str,
            instance: u64,
            buffers: Vec<BufferDescriptor>,
            endpoints: Vec<(&'a str, serde_bytes::ByteBuf)>,
        }
        let raw = |kinds: &[&'static str]| {
            rmp_serde::to_vec(&Raw {
                version: DESCRIPTOR_VERSION,
                name: "p",
                instance: 1,
                buffers: vec![],
                endpoints: kinds
                    .iter()
                    .map(|k| (*k, serde_bytes::ByteBuf::from(b"x".to_vec())))
                    .collect(),
            })
            .unwrap()
        };
        let d = SegmentDescriptor::from_bytes(&raw(&["warp-drive", "tcp"])).unwrap();
        assert_eq!(d.endpoints, vec![Endpoint::new(TransportKind::Tcp, "x")]);
        let e = SegmentDescriptor::from_bytes(&raw(&["has space"])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Malformed);
        let many = vec!["tcp"; MAX_ENDPOINTS + 1];
        assert!(SegmentDescriptor::from_bytes(&raw(&many)).is_err());
    }
}
