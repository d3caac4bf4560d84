//! The TCP transport's decoders: the 64-byte frame header (first 64 bytes of the input), then
//! the error body, a grant and a segment descriptor decoded from the rest. A panic, or a
//! decoded value that breaks its own invariants, is a crash AFL saves.

use omnirig_transports::segment::SegmentDescriptor;
use omnirig_transports::transport::tcp::frame::{HEADER_LEN, Header, decode_error_body};
use omnirig_transports::{ErrorKind, Grant};

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let rest = match data.split_first_chunk::<HEADER_LEN>() {
            Some((head, rest)) => {
                for max in [64 << 20, u64::MAX] {
                    match Header::decode(head, max) {
                        Ok(h) => {
                            assert_eq!(&h.encode(), head, "a decoded header re-encodes");
                            assert!(h.len <= max);
                        }
                        Err(e) => assert_eq!(e.kind(), ErrorKind::Malformed),
                    }
                }
                rest
            }
            None => data,
        };
        let _ = decode_error_body(rest);
        if let Ok(g) = Grant::from_bytes(rest) {
            g.validate().expect("a decoded grant is valid");
            assert_eq!(Grant::from_bytes(&g.to_bytes()).expect("re-decodes"), g);
        }
        if let Ok(d) = SegmentDescriptor::from_bytes(rest) {
            d.validate().expect("a decoded descriptor is valid");
            assert_eq!(
                SegmentDescriptor::from_bytes(&d.to_bytes()).expect("re-decodes"),
                d
            );
        }
    });
}
