//! Everything the engine decodes from the network, fed arbitrary bytes: never a panic, never
//! an unbounded allocation (inputs are capped before decoding), always a clear refusal or a
//! value that re-encodes to the same bytes.

use omnirig_transports::segment::SegmentDescriptor;
use omnirig_transports::transport::tcp::frame::{HEADER_LEN, Header, decode_error_body};
use omnirig_transports::{ErrorKind, Grant};
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
    // fixarray(4) [name, instance, tcp, array32(0xffffffff)]
    let mut b = vec![0x94, 0xa1, b'x', 0x01, 0xc0, 0xdd, 0xff, 0xff, 0xff, 0xff];
    b.extend_from_slice(&[0x93, 0x01, 0x01, 0xa4]);
    let e = SegmentDescriptor::from_bytes(&b).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Malformed);
}
