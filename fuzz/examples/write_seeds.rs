//! Writes the seed corpora under `fuzz/seeds/<target>/`: a few small valid encodings per
//! target. Run from `fuzz/`: `cargo run --example write_seeds` (plain cargo, no AFL needed).
//! The files are committed; rerun only when an encoding changes.

use std::fs;
use std::path::Path;

use omnirig_fixtures::{ModelCard, ShapeOptions, TransferKey, expected_packet, golden_case};
use omnirig_harness::control::{Msg, NamedDigest, NamedGrant};
use omnirig_harness::ec::EcSlot;
use omnirig_harness::kv::{KvGrant, KvReservation};
use omnirig_transports::segment::{BufferDescriptor, Endpoint, MemoryKind, SegmentDescriptor};
use omnirig_transports::TransportKind;
use omnirig_transports::transport::tcp::frame::{FrameKind, Header, error_body};
use omnirig_transports::{Access, Error, ErrorKind, Grant};

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("seeds")
        .join(target);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join(name), bytes).unwrap();
}

fn grant() -> Grant {
    Grant {
        segment: "decode-kv".into(),
        buffer: 3,
        offset: 4096,
        len: 65536,
        epoch: 7,
        token: 0x5eed_f00d_dead_beef,
        access: Access::Write,
        keys: Vec::new(),
    }
}

fn main() {
    // frame: a 64-byte header, then a body for the other decoders.
    let mut h = Header::new(FrameKind::Write, 42);
    h.buffer = 3;
    h.epoch = 7;
    h.token = 0x5eed_f00d_dead_beef;
    h.offset = 4096;
    h.len = 65536;
    let grant_bytes = grant().to_bytes();
    write(
        "frame",
        "write_grant",
        &[&h.encode()[..], &grant_bytes].concat(),
    );
    let mut h = Header::new(FrameKind::Error, 43);
    let body = error_body(&Error::new(
        ErrorKind::GrantRevoked,
        "grant decode-kv#7 revoked",
    ));
    h.body_len = body.len() as u32;
    write("frame", "error_body", &[&h.encode()[..], &body].concat());
    let d = SegmentDescriptor::new(
        "prefill-ec",
        0x1234_5678,
        vec![
            BufferDescriptor {
                id: 1,
                len: 1 << 20,
                kind: MemoryKind::Host,
            },
            BufferDescriptor {
                id: 2,
                len: 4096,
                kind: MemoryKind::Host,
            },
        ],
        vec![Endpoint::new(TransportKind::Tcp, "127.0.0.1:40002")],
    );
    let body = d.to_bytes();
    let mut h = Header::new(FrameKind::DescribeReply, 44);
    h.body_len = body.len() as u32;
    write(
        "frame",
        "describe_reply",
        &[&h.encode()[..], &body].concat(),
    );

    // packet: every hop of the smallest golden case, msgpack; two as JSON.
    let card = ModelCard::qwen3_omni();
    let case = golden_case("text_short").unwrap();
    let plan = case.plan(&card, &ShapeOptions::default()).unwrap();
    for (i, hop) in plan.hops.iter().enumerate() {
        let mut p = expected_packet(&case.request_id(), plan.seed, hop);
        if let Some(e) = p.entries.get_mut(0) {
            e.transfer_key = Some(TransferKey::Text("seg0/buf3@4096".into()));
        }
        if let Some(e) = p.entries.get_mut(1) {
            e.transfer_key = Some(TransferKey::Opaque(vec![0, 1, 2, 0xff]));
        }
        let mp = p.to_msgpack().unwrap();
        if mp.len() <= 4096 {
            write("packet", &format!("{}.msgpack", hop.payload_kind), &mp);
        }
        let js = p.to_json_pretty().unwrap();
        if i < 2 && js.len() <= 4096 {
            write(
                "packet",
                &format!("{}.json", hop.payload_kind),
                js.as_bytes(),
            );
        }
    }

    // control: one message of several shapes.
    let r = || "golden-text_short".to_string();
    let msgs = [
        Msg::Offer { request: r() },
        Msg::EcReserve {
            request: r(),
            slots: vec![EcSlot {
                mm_hash: "0123456789abcdef".into(),
                tensor: "embed.vision".into(),
                grant: Some(grant()),
            }],
        },
        Msg::KvReserve {
            request: r(),
            reservation: KvReservation {
                first_block: 2,
                dst_blocks: vec![9, 10, 11],
                grants: vec![KvGrant {
                    layer: 0,
                    v: true,
                    start: 0,
                    len: 3,
                    grant: grant(),
                }],
            },
        },
        Msg::StageReserve {
            request: r(),
            grants: vec![NamedGrant {
                tensor: "codes.audio".into(),
                grant: grant(),
            }],
        },
        Msg::Finish {
            request: r(),
            digests: vec![NamedDigest {
                tensor: "embed.vision".into(),
                digest: "00112233445566778899aabbccddeeff".into(),
            }],
            writing_us: 4_250,
        },
        Msg::Error {
            request: r(),
            failed: vec!["kv.layer0.k".into()],
            cause: "peer closed".into(),
        },
        Msg::Hello {
            stage: "talker".into(),
            control: "127.0.0.1:40001".into(),
            engine_in: Some("127.0.0.1:40002".into()),
            engine_out: None,
        },
        Msg::Run {
            request: r(),
            spec: case.request.clone(),
        },
        Msg::StageDone {
            request: r(),
            outcome: Default::default(),
        },
        Msg::Shutdown,
        Msg::Bye {
            usage: Default::default(),
        },
    ];
    for m in &msgs {
        write("control", m.name(), &m.encode().unwrap());
    }
}
