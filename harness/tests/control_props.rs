//! Control-channel frame bodies fed hostile input (issue 5, "Decoders under attack"):
//! arbitrary bytes, and the encodings of every `Msg` variant with bytes flipped, inserted,
//! removed and cut off. `Msg::decode` either refuses with a `HarnessError::Control`, or returns
//! a message that validates and re-encodes to a body that decodes to the same encoding. Never
//! a panic, and never memory out of proportion to the input: a thread-local counting allocator
//! measures the peak of each decode.
//!
//! What bounds memory: the body is capped at `MAX_FRAME` (16 MiB) before decoding; rmp checks
//! every claimed string / byte-string length against the bytes left in the slice; a derived
//! `Vec` preallocates at most `min(claimed, 1 MiB / size_of::<T>())` (serde's
//! `size_hint::cautious`) and then grows only per element actually decoded. The `MAX_ITEMS` /
//! `MAX_ID` limits are checked after decoding (`Msg::validate`), so within the frame cap a
//! decode may hold a few tens of bytes per input byte (a 1-byte empty string becomes a
//! 24-byte `String`): bounded by the input, never by a claim.

use std::sync::LazyLock;
use std::time::{Duration, Instant};

use omnirig_fixtures::RequestSpec;
use omnirig_fixtures::shapes::{AudioSpec, ImageSpec, VideoSpec};
use omnirig_harness::HarnessError;
use omnirig_harness::control::{MAX_ITEMS, Msg, NamedDigest, NamedGrant};
use omnirig_harness::ec::EcSlot;
use omnirig_harness::kv::{KvGrant, KvReservation};
use omnirig_harness::stage::{EngineUsage, PoolUsage, Received, Sent};
use omnirig_harness::{StageOutcome, StageUsage};
use omnirig_test_support::alloc::{Counting, peak_of};
use omnirig_transports::{Access, Grant};
use proptest::prelude::*;

// ---- a per-thread peak-allocation meter (omnirig-test-support) ----

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn the_allocation_meter_is_installed() {
    omnirig_test_support::alloc::assert_installed();
}

/// The allowance per decode: proportional to the input (see the module comment), plus serde's
/// 1 MiB preallocation cap for one list whose claimed length is not (yet) contradicted.
fn allowance(input_len: usize) -> usize {
    128 * input_len + (1 << 20) + (64 << 10)
}

// ---- every variant ----

fn grant(segment: &str, len: u64) -> Grant {
    Grant {
        segment: segment.into(),
        buffer: 3,
        offset: 4096,
        len,
        epoch: 7,
        token: 0x5eed_f00d_dead_beef,
        access: Access::Write,
        keys: Vec::new(),
    }
}

/// Which variant, by a match with no wildcard: adding a `Msg` variant breaks this test's
/// build until it gets a sample below.
fn variant(m: &Msg) -> usize {
    match m {
        Msg::Offer { .. } => 0,
        Msg::EcReserve { .. } => 1,
        Msg::KvReserve { .. } => 2,
        Msg::StageReserve { .. } => 3,
        Msg::Refuse { .. } => 4,
        Msg::Finish { .. } => 5,
        Msg::Packet { .. } => 6,
        Msg::Error { .. } => 7,
        Msg::Hello { .. } => 8,
        Msg::Setup { .. } => 9,
        Msg::Peer { .. } => 10,
        Msg::Ready { .. } => 11,
        Msg::Run { .. } => 12,
        Msg::StageDone { .. } => 13,
        Msg::Shutdown => 14,
        Msg::Bye { .. } => 15,
    }
}
const VARIANTS: usize = 16;

static SAMPLES: LazyLock<Vec<Msg>> = LazyLock::new(|| {
    let r = || "golden-image_audio".to_string();
    vec![
        Msg::Offer { request: r() },
        Msg::EcReserve {
            request: r(),
            slots: vec![
                EcSlot {
                    mm_hash: "0123456789abcdef".into(),
                    tensor: "embed.vision".into(),
                    grant: Some(grant("prefill-ec", 1 << 20)),
                },
                EcSlot {
                    mm_hash: "fedcba9876543210".into(),
                    tensor: "embed.audio".into(),
                    grant: None,
                },
            ],
        },
        Msg::KvReserve {
            request: r(),
            reservation: KvReservation {
                first_block: 2,
                dst_blocks: vec![9, 10, 11, 40],
                grants: vec![
                    KvGrant {
                        layer: 0,
                        v: false,
                        start: 0,
                        len: 3,
                        grant: grant("decode-kv", 3 << 16),
                    },
                    KvGrant {
                        layer: 47,
                        v: true,
                        start: 3,
                        len: 1,
                        grant: grant("decode-kv", 1 << 16),
                    },
                ],
            },
        },
        Msg::StageReserve {
            request: r(),
            grants: vec![NamedGrant {
                tensor: "codes.audio".into(),
                grant: grant("code2wav", 6400),
            }],
        },
        Msg::Refuse {
            request: r(),
            cause: "no room in pool kv (need 4 blocks)".into(),
            kind: Default::default(),
        },
        Msg::Finish {
            request: r(),
            digests: vec![NamedDigest {
                tensor: "embed.vision".into(),
                digest: "00112233445566778899aabbccddeeff".into(),
            }],
            writing_us: 4_250,
        },
        Msg::Packet {
            request: r(),
            packet: vec![0x89, 0xae, b'p', b'a', b'c', b'k', 0, 1, 0xff],
            writing_us: 17,
            inline: vec![7; 96],
        },
        Msg::Error {
            request: r(),
            failed: vec!["kv.layer0.k".into(), "kv.layer0.v".into()],
            cause: "peer closed".into(),
            kind: Default::default(),
            peer: None,
        },
        Msg::Hello {
            stage: "talker".into(),
            control: "127.0.0.1:40001".into(),
            engine_in: Some("127.0.0.1:40002".into()),
            engine_out: None,
        },
        Msg::Setup {
            scenario_yaml: "requests:\n  - case: text_short\n".into(),
            downstream_control: Some("127.0.0.1:40003".into()),
            downstream_engine: None,
        },
        Msg::Peer {
            stage: "thinker_decode".into(),
        },
        Msg::Ready {
            stage: "code2wav".into(),
        },
        Msg::Run {
            request: r(),
            spec: RequestSpec {
                seed: 42,
                text_tokens: 32,
                images: vec![ImageSpec {
                    width: 448,
                    height: 448,
                }],
                audios: vec![AudioSpec { seconds: 2.5 }],
                videos: vec![VideoSpec {
                    frames: 8,
                    width: 224,
                    height: 224,
                }],
                output_text_tokens: 16,
                output_audio_seconds: 1.0,
                salt: 7,
            },
        },
        Msg::StageDone {
            request: r(),
            outcome: StageOutcome {
                stage: "talker".into(),
                participated: true,
                error: Some("late".into()),
                failure: Some(omnirig_harness::report::Failure {
                    hop: Some("thinker_to_talker".into()),
                    tensor: Some("embed.tts_eos".into()),
                    peer: Some("talker".into()),
                    kind: omnirig_harness::error::FailureKind::TimedOut,
                }),
                received: Some(Received {
                    hop: "thinker_to_talker".into(),
                    tensors: 5,
                    landed_bytes: 1 << 20,
                    reused_bytes: 0,
                    handoff_ms: 1.5,
                    verify_ms: 0.25,
                    start_ms: Some(0.5),
                    phases_ms: omnirig_harness::stage::HandoffPhases {
                        reserve: 0.125,
                        transfer: 0.75,
                        fence: 0.0625,
                        verify: 0.25,
                        ack: 0.3125,
                    },
                }),
                sent: Some(Sent {
                    hop: "talker_to_code2wav".into(),
                    tensors: 1,
                    requests: 1,
                    bytes: 6400,
                    transfer_ms: 0.125,
                    transfer_start_ms: Some(4.5),
                    stage_ms: 0.0625,
                }),
                compute_ms: 3.0,
                compute_start_ms: Some(1.5),
                total_ms: 4.75,
            },
        },
        Msg::Shutdown,
        Msg::Bye {
            usage: StageUsage {
                stage: "encoder".into(),
                pools: vec![PoolUsage {
                    name: "ec".into(),
                    bytes: 0,
                    ranges: 0,
                }],
                kv_blocks_in_use: 0,
                ec_entries_in_use: 1,
                engines: vec![EngineUsage {
                    name: "encoder-out".into(),
                    grants: 0,
                    batches: 0,
                    tasks: 2,
                    leases: 0,
                }],
                open_mailboxes: 0,
                exited: None,
                unanswered: false,
            },
        },
    ]
});

static ENCODED: LazyLock<Vec<Vec<u8>>> =
    LazyLock::new(|| SAMPLES.iter().map(|m| m.encode().unwrap()).collect());

// ---- the property ----

fn decode_checked(bytes: &[u8]) -> Result<(), TestCaseError> {
    let (r, peak) = peak_of(|| Msg::decode(bytes));
    prop_assert!(
        peak <= allowance(bytes.len()),
        "decoding {} bytes peaked at {peak} bytes",
        bytes.len()
    );
    match r {
        Ok(m) => {
            prop_assert!(m.validate().is_ok(), "decoded an invalid message: {m:?}");
            let once = m.encode().map_err(|e| TestCaseError::fail(e.to_string()))?;
            let again = Msg::decode(&once).map_err(|e| TestCaseError::fail(e.to_string()))?;
            // Encodings, not values: f64 fields may decode as NaN.
            prop_assert_eq!(again.encode().unwrap(), once);
        }
        Err(HarnessError::Control { channel, reason }) => {
            prop_assert_eq!(channel, "decode");
            prop_assert!(!reason.is_empty());
        }
        Err(e) => prop_assert!(false, "refused with the wrong error: {e:?}"),
    }
    Ok(())
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip { at: usize, bit: u8 },
    Set { at: usize, byte: u8 },
    Insert { at: usize, byte: u8 },
    Remove { at: usize },
    Truncate { at: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    // Positions are reduced modulo the current length when applied.
    let at = any::<usize>();
    prop_oneof![
        4 => (at, 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        // msgpack markers that matter: 32-bit lengths, wide ints, floats, nil, bool.
        3 => (at, prop_oneof![any::<u8>(), Just(0xdd), Just(0xdf), Just(0xdb), Just(0xc6),
              Just(0xcf), Just(0xd3), Just(0xcb), Just(0xc0), Just(0xc3), Just(0xff)])
            .prop_map(|(at, byte)| Mutation::Set { at, byte }),
        2 => (at, any::<u8>()).prop_map(|(at, byte)| Mutation::Insert { at, byte }),
        2 => at.prop_map(|at| Mutation::Remove { at }),
        1 => at.prop_map(|at| Mutation::Truncate { at }),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let n = bytes.len();
    if n == 0 {
        return;
    }
    match *m {
        Mutation::Flip { at, bit } => bytes[at % n] ^= 1 << bit,
        Mutation::Set { at, byte } => bytes[at % n] = byte,
        Mutation::Insert { at, byte } => bytes.insert(at % (n + 1), byte),
        Mutation::Remove { at } => {
            bytes.remove(at % n);
        }
        Mutation::Truncate { at } => bytes.truncate(at % n),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_are_refused_or_decode_to_a_valid_message(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        decode_checked(&bytes)?;
    }

    /// A variant name followed by arbitrary bytes gets past the enum tag into the fields.
    #[test]
    fn a_known_tag_then_arbitrary_bytes(
        which in any::<prop::sample::Index>(),
        tail in prop::collection::vec(any::<u8>(), 0..128),
    ) {
        let name = format!("{:?}", SAMPLES[which.index(SAMPLES.len())]);
        let name = name.split([' ', '{', '(']).next().unwrap();
        // fixmap(1) { fixstr(name): tail }
        let mut bytes = vec![0x81, 0xa0 | name.len() as u8];
        bytes.extend_from_slice(name.as_bytes());
        bytes.extend_from_slice(&tail);
        decode_checked(&bytes)?;
    }

    #[test]
    fn mutated_messages_of_every_variant_are_refused_or_valid(
        which in any::<prop::sample::Index>(),
        edits in prop::collection::vec(mutation(), 1..6),
    ) {
        let mut bytes = ENCODED[which.index(ENCODED.len())].clone();
        for m in &edits {
            apply(&mut bytes, m);
        }
        decode_checked(&bytes)?;
    }
}

#[test]
fn every_variant_round_trips_unmutated() {
    let mut seen = [false; VARIANTS];
    for (m, b) in SAMPLES.iter().zip(ENCODED.iter()) {
        seen[variant(m)] = true;
        assert_eq!(&Msg::decode(b).unwrap(), m);
    }
    assert!(seen.iter().all(|s| *s), "a variant has no sample: {seen:?}");
}

/// msgpack markers that announce ~4 billion items or bytes where a list, map, string or
/// byte string is expected, with nothing behind them: refused at once, with no allocation in
/// proportion to the claim (at most serde's 1 MiB preallocation cap for a list).
#[test]
fn huge_claimed_lengths_are_refused_without_allocating() {
    const HUGE: [u8; 4] = [0xff, 0xff, 0xff, 0xff];
    let fixstr = |s: &str| [&[0xa0 | s.len() as u8][..], s.as_bytes()].concat();
    // { variant: { request: "r", field: <claim> } }
    let with = |variant: &str, field: &str, claim: &[u8]| {
        let mut v = vec![0x81];
        v.extend(fixstr(variant));
        v.push(0x82);
        v.extend(fixstr("request"));
        v.extend(fixstr("r"));
        v.extend(fixstr(field));
        v.extend_from_slice(claim);
        v
    };
    let array32 = [&[0xdd][..], &HUGE].concat();
    let map32 = [&[0xdf][..], &HUGE].concat();
    let str32 = [&[0xdb][..], &HUGE].concat();
    let bin32 = [&[0xc6][..], &HUGE].concat();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("map32 at the top", map32.clone()),
        ("array32 at the top", array32.clone()),
        ("str32 variant name", [&[0x81][..], &str32].concat()),
        ("EcReserve.slots", with("EcReserve", "slots", &array32)),
        (
            "StageReserve.grants",
            with("StageReserve", "grants", &array32),
        ),
        ("Finish.digests", with("Finish", "digests", &array32)),
        ("Error.failed", with("Error", "failed", &array32)),
        ("Packet.packet array", with("Packet", "packet", &array32)),
        ("Packet.packet bin", with("Packet", "packet", &bin32)),
        ("Refuse.cause", with("Refuse", "cause", &str32)),
        (
            "KvReserve.reservation",
            with("KvReserve", "reservation", &map32),
        ),
        (
            "KvReserve.reservation.dst_blocks",
            with(
                "KvReserve",
                "reservation",
                &[&[0x93, 0x00][..], &array32].concat(),
            ),
        ),
        ("skipped unknown field", with("Offer", "x", &array32)),
    ];
    for (what, bytes) in &cases {
        let t = Instant::now();
        let (r, peak) = peak_of(|| Msg::decode(bytes));
        let e = r.expect_err(what);
        assert!(matches!(e, HarnessError::Control { .. }), "{what}: {e:?}");
        assert!(
            peak <= (1 << 20) + (16 << 10),
            "{what}: {peak} bytes allocated"
        );
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "{what}: {:?}",
            t.elapsed()
        );
    }
}

/// An honest list over `MAX_ITEMS`: `Error.failed` with MAX_ITEMS + 1 empty strings (one byte
/// each on the wire, 24 bytes each decoded) is refused, with memory in proportion to the
/// input.
#[test]
fn a_list_over_max_items_is_refused_with_bounded_memory() {
    let n = MAX_ITEMS + 1;
    let mut bytes = vec![0x81, 0xa5];
    bytes.extend_from_slice(b"Error");
    bytes.extend_from_slice(b"\x83\xa7request\xa1r\xa5cause\xa0\xa6failed\xdd");
    bytes.extend_from_slice(&(n as u32).to_be_bytes());
    bytes.resize(bytes.len() + n, 0xa0);
    let t = Instant::now();
    let (r, peak) = peak_of(|| Msg::decode(&bytes));
    let e = r.unwrap_err().to_string();
    assert!(e.contains("exceeds"), "{e}");
    assert!(
        peak <= allowance(bytes.len()),
        "{peak} bytes for {}",
        bytes.len()
    );
    eprintln!(
        "{n} empty strings in {} bytes: peak {peak} bytes ({:.1}x the input) in {:?}",
        bytes.len(),
        peak as f64 / bytes.len() as f64,
        t.elapsed()
    );
}
