//! Everything the engine decodes from the network, fed arbitrary bytes: never a panic, never
//! an unbounded allocation (inputs are capped before decoding), always a clear refusal or a
//! value that re-encodes to the same bytes.

use omnirig_transports::segment::{
    BufferDescriptor, DESCRIPTOR_VERSION, Endpoint, MAX_ENDPOINT_ADDRESS, MemoryKind,
    SegmentDescriptor,
};
use omnirig_transports::transport::tcp::frame::{HEADER_LEN, Header, decode_error_body};
use omnirig_transports::{Access, ErrorKind, Grant, GrantKey, TransportKind};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    #[test]
    fn frame_headers_decode_canonically_or_are_refused(bytes in prop::array::uniform32(any::<u8>()), tail in prop::array::uniform32(any::<u8>()), max in 1u64..(1 << 30)) {
        let mut b = [0u8; HEADER_LEN];
        b[..32].copy_from_slice(&bytes);
        b[32..].copy_from_slice(&tail);
        match Header::decode(&b, max) {
            Ok(h) => {
                prop_assert_eq!(h.encode(), b);
                prop_assert!(h.len <= max);
            }
            Err(e) => prop_assert_eq!(e.kind(), ErrorKind::Malformed),
        }
    }

    #[test]
    fn near_valid_headers_are_refused_or_canonical(kind in 0u8..12, len in any::<u64>(), body in any::<u32>(), flip in 0usize..HEADER_LEN, bit in 0u8..8) {
        // Start from a valid-looking header so the decoder's later checks get exercised too.
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(b"ORIG");
        b[4] = 1;
        b[5] = kind;
        b[20..24].copy_from_slice(&body.to_le_bytes());
        b[48..56].copy_from_slice(&len.to_le_bytes());
        b[flip] ^= 1 << bit;
        match Header::decode(&b, 64 << 20) {
            Ok(h) => prop_assert_eq!(h.encode(), b),
            Err(e) => prop_assert_eq!(e.kind(), ErrorKind::Malformed),
        }
    }

    #[test]
    fn error_bodies_never_panic(body in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_error_body(&body);
    }

    #[test]
    fn grants_from_the_wire_are_valid_or_refused(bytes in prop::collection::vec(any::<u8>(), 0..1024)) {
        if let Ok(g) = Grant::from_bytes(&bytes) {
            prop_assert!(g.validate().is_ok());
        }
    }

    /// Well-formed descriptors with endpoints of every kind, one byte flipped: decoded to a
    /// valid descriptor that re-encodes to the same bytes, or refused as malformed.
    #[test]
    fn near_valid_descriptors_are_refused_or_canonical(
        kinds in prop::collection::vec(0usize..3, 0..4),
        addr_len in 1usize..64,
        buffers in prop::collection::vec((any::<u32>(), 1u64..u64::MAX), 0..4),
        flip in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let mut endpoints: Vec<Endpoint> = Vec::new();
        for k in kinds {
            let kind = TransportKind::ALL[k];
            if endpoints.iter().all(|e| e.kind != kind) {
                endpoints.push(Endpoint::new(kind, vec![b'a'; addr_len]));
            }
        }
        let d = SegmentDescriptor::new(
            "peer-0",
            7,
            buffers
                .into_iter()
                .map(|(id, len)| BufferDescriptor { id, len, kind: MemoryKind::Host })
                .collect(),
            endpoints,
        );
        let mut b = d.to_bytes();
        prop_assert_eq!(SegmentDescriptor::from_bytes(&b).unwrap(), d);
        let i = flip.index(b.len());
        b[i] ^= 1 << bit;
        match SegmentDescriptor::from_bytes(&b) {
            Ok(got) => {
                prop_assert!(got.validate().is_ok());
                prop_assert_eq!(got.version, DESCRIPTOR_VERSION);
                prop_assert!(got.endpoints.iter().all(|e| !e.address.is_empty() && e.address.len() <= MAX_ENDPOINT_ADDRESS));
            }
            Err(e) => prop_assert_eq!(e.kind(), ErrorKind::Malformed),
        }
    }

    /// Grants with transport keys, one byte flipped: valid or refused, never a panic.
    #[test]
    fn near_valid_keyed_grants_are_valid_or_refused(
        key_len in 1usize..=64,
        flip in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let g = Grant {
            segment: "owner".into(),
            buffer: 1,
            offset: 0,
            len: 4096,
            epoch: 3,
            token: 99,
            access: Access::Write,
            keys: vec![GrantKey { kind: TransportKind::Shm, bytes: vec![1; key_len] }],
        };
        let mut b = g.to_bytes();
        prop_assert_eq!(Grant::from_bytes(&b).unwrap(), g);
        let i = flip.index(b.len());
        b[i] ^= 1 << bit;
        if let Ok(got) = Grant::from_bytes(&b) {
            prop_assert!(got.validate().is_ok());
        }
    }

    #[test]
    fn descriptors_from_the_wire_are_valid_or_refused(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        if let Ok(d) = SegmentDescriptor::from_bytes(&bytes) {
            prop_assert!(d.validate().is_ok());
        }
    }
}

/// A msgpack array header that claims four billion buffers must not make the decoder reserve
/// memory for them.
#[test]
fn a_huge_claimed_length_does_not_allocate() {
    // fixarray(5) [version, name, instance, array32(0xffffffff) buffers, ...]
    let mut b = vec![
        0x95,
        DESCRIPTOR_VERSION as u8,
        0xa1,
        b'x',
        0x01,
        0xdd,
        0xff,
        0xff,
        0xff,
        0xff,
    ];
    b.extend_from_slice(&[0x93, 0x01, 0x01, 0xa4]);
    let e = SegmentDescriptor::from_bytes(&b).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Malformed);
}
