//! `cargo test faults`, the seed half (issue 10): identical requests in one run, a fault on
//! some of them, and every fault that fires must be caught, at any hop, tensor and point a
//! seed draws. Its own test binary, so its load never slows the timing-bound cells of the
//! main matrix (`faults.rs`; test binaries run one after another).

use omnirig_harness::faults::{AnyFault, FaultSpec};
use omnirig_harness::scenario::{RequestEntry, Scenario};
use omnirig_harness::{Report, Runner};
use omnirig_transports::{FaultKind, FaultPoint, TransportKind};
use rstest::rstest;

const HOP_TIMEOUT_S: f64 = 1.0;

async fn run(s: Scenario) -> Report {
    let r = Runner::new(s).run().await.unwrap();
    assert!(
        r.summary.pools_clean,
        "pools or engines not back to zero: {:?}",
        r.stages
    );
    r
}

fn assert_late_bytes_refused(r: &Report) {
    for l in &r.faults.as_ref().expect("fault report").late {
        assert!(
            l.refused,
            "held bytes for {} {} landed late: {}",
            l.request, l.tensor, l.outcome
        );
    }
}

/// Issue 10's example: ten identical `text_short` requests at concurrency 10, an early
/// completion on the Thinker -> Talker hop of one of them. The slot it lands in may have
/// held an earlier identical request's bytes; the run must still catch the missing bytes.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_completion_among_identical_requests_is_caught(
    #[values(TransportKind::Loopback, TransportKind::Tcp, TransportKind::Shm)]
    transport: TransportKind,
    #[values(5, 9)] victim: usize,
    #[values(FaultPoint::AfterBytes(4096), FaultPoint::AtCompletion)] at: FaultPoint,
) {
    let mut s = Scenario::golden("text_short", transport);
    s.concurrency = 10;
    s.requests[0].repeat = 10;
    // No fault here waits on a deadline, so a roomy one: under a loaded CI machine a tight
    // deadline fails requests before the fault's hop, and the fault never fires.
    s.hop_timeout_s = 10.0;
    s.faults = vec![FaultSpec {
        hop: "thinker_to_talker".into(),
        request: victim,
        tensor: None,
        at,
        kind: AnyFault::Transport(FaultKind::EarlyCompletion),
        times: 1,
    }];
    let r = run(s).await;
    assert_eq!(
        r.faults.as_ref().unwrap().fired.len(),
        1,
        "{:?}",
        r.requests.iter().map(|q| &q.error).collect::<Vec<_>>()
    );
    for (i, q) in r.requests.iter().enumerate() {
        if i == victim {
            assert!(!q.ok, "{}: the early completion went unnoticed", q.id);
            assert_eq!(q.failure.as_ref().unwrap().kind, "corrupt", "{:?}", q.error);
        } else {
            assert!(q.ok, "{}: {:?}", q.id, q.error);
        }
    }
}

/// Seeds per fault kind in [`faults_caught_over_seeds`].
const SEEDS: u64 = 100;

/// splitmix64, so each seed draws its own hop, tensor and point.
fn draw(seed: u64, i: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i.wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The fault of `seed`: a hop, a tensor and a point drawn from the seed.
fn seeded_fault(plan: &omnirig_fixtures::RequestPlan, seed: u64, kind: FaultKind) -> FaultSpec {
    let hop = &plan.hops[(draw(seed, 0) % plan.hops.len() as u64) as usize];
    let t = &hop.tensors[(draw(seed, 1) % hop.tensors.len() as u64) as usize];
    // KV tensors move as runs of blocks; a point inside the first block always strikes.
    let len = hop.kv.as_ref().map_or(t.byte_length, |kv| kv.k_block_bytes);
    let at = match draw(seed, 2) % 3 {
        0 => FaultPoint::BeforeSubmit,
        1 => FaultPoint::AfterBytes(draw(seed, 3) % len.max(1)),
        _ => FaultPoint::AtCompletion,
    };
    FaultSpec {
        hop: hop.payload_kind.as_str().into(),
        request: (2 * seed) as usize,
        tensor: Some(t.name.clone()),
        at,
        kind: AnyFault::Transport(kind),
        times: 1,
    }
}

/// Detection over seeds (issue 10): for every fault kind that can cut or corrupt data,
/// [`SEEDS`] seeds, each striking its own request of a run of identical requests at
/// concurrency 10, at a hop, tensor and point drawn from the seed; every other request is
/// healthy. Identical outputs are kept (`distinct_outputs: false`), so only the poisoning of
/// reused memory stands between a cut transfer and stale bytes of an earlier twin that
/// would match. A fault that fires and is not caught fails the test; so does a healthy
/// request that does not arrive bit-exact.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_caught_over_seeds(
    #[values(
        FaultKind::FailSubmit,
        FaultKind::FailSlice,
        FaultKind::Stall,
        FaultKind::DropConnection,
        FaultKind::Corrupt,
        FaultKind::DuplicateCompletion,
        FaultKind::EarlyCompletion,
        FaultKind::LateWrite
    )]
    kind: FaultKind,
) {
    let mut s = Scenario::golden("text_short", TransportKind::Loopback);
    s.name = "seeds".into();
    s.requests[0] = RequestEntry {
        case: None,
        name: Some("twin".into()),
        // Text only: twins share no encoder-cache entry, whose fill a healthy twin would
        // wait on behind a stalled one (the main matrix covers the encoder hop).
        request: Some(
            serde_saphyr::from_str(
                "{ seed: 7, text_tokens: 40, output_text_tokens: 8, output_audio_seconds: 0.5 }",
            )
            .unwrap(),
        ),
        repeat: (2 * SEEDS) as u32,
        vary_seed: false,
    };
    s.concurrency = 10;
    s.distinct_outputs = false;
    s.hop_timeout_s = HOP_TIMEOUT_S;
    s.request_timeout_s = 5.0;
    let planned = s.expand().unwrap();
    s.faults = (0..SEEDS)
        .map(|seed| seeded_fault(&planned[0].plan, seed, kind))
        .collect();
    let r = run(s).await;
    let f = r.faults.as_ref().unwrap();
    let fired: std::collections::HashSet<&str> =
        f.fired.iter().map(|x| x.request.as_str()).collect();
    for q in &r.requests {
        if fired.contains(q.id.as_str()) {
            assert!(!q.ok, "{kind:?}: fired on {} and went unnoticed", q.id);
        } else {
            assert!(q.ok, "{}: {:?}", q.id, q.error);
            assert!(q.hops.iter().all(|h| h.verified), "{}", q.id);
        }
    }
    // A seed whose point lies past what moves does not strike; nearly all must.
    assert!(
        fired.len() as u64 >= SEEDS * 9 / 10,
        "{kind:?}: only {} of {SEEDS} faults fired",
        fired.len()
    );
    assert_late_bytes_refused(&r);
}
