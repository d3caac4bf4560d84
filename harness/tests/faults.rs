//! `cargo test faults`: the fault matrix. Every hop x every transport fault kind, each in a
//! run with two healthy requests beside the faulty one. For every cell: the faulty request
//! fails with the right kind of error naming its hop (or, for a delay, just completes); the
//! stage behind the fault never started on it; bytes the fault held back are refused when
//! they finally arrive; every pool and engine is back to zero; the failure was detected within
//! the hop deadline plus a small bound; the other requests arrive bit-exact.

use std::time::Duration;

use omnirig_fixtures::PayloadKind;
use omnirig_fixtures::RequestSpec;
use omnirig_harness::faults::{
    AnyFault, FaultSpec, FaultyStore, RandomFaults, StoreFault, failing_kinds,
};
use omnirig_harness::scenario::{RequestEntry, Scenario};
use omnirig_harness::{Report, Runner};
use omnirig_transports::{FaultKind, FaultPoint, TransportKind};
use rstest::rstest;

const HOP_TIMEOUT_S: f64 = 1.0;
/// Detection bound beyond the hop deadline: the consumer's own wait, scheduling, cleanup.
const SLACK_MS: f64 = 2500.0;

fn small(seed: u64) -> RequestSpec {
    let yaml = format!(
        "{{ seed: {seed}, text_tokens: 16, images: [{{ width: 64, height: 64 }}], \
         audios: [{{ seconds: 1.0 }}], output_text_tokens: 8, output_audio_seconds: 0.5 }}"
    );
    serde_saphyr::from_str(&yaml).unwrap()
}

/// The faulty request (image_audio: it crosses all four hops) and two healthy ones with
/// content of their own, so no cache is shared with the faulty one.
fn scenario(transport: &str, faults: Vec<FaultSpec>) -> Scenario {
    let mut s = Scenario::golden("image_audio", transport.parse().unwrap());
    s.name = "faults".into();
    s.concurrency = 3;
    s.hop_timeout_s = HOP_TIMEOUT_S;
    s.request_timeout_s = 5.0;
    for seed in [101, 102] {
        s.requests.push(RequestEntry {
            case: None,
            name: Some(format!("healthy{seed}")),
            request: Some(small(seed)),
            repeat: 1,
            vary_seed: false,
        });
    }
    s.faults = faults;
    s
}

/// What the fault must do to the request: fail with this kind, or (a delay) nothing.
fn expected(kind: FaultKind) -> Option<&'static str> {
    match kind {
        FaultKind::FailSubmit | FaultKind::FailSlice => Some("io"),
        FaultKind::Stall | FaultKind::LateWrite => Some("timed_out"),
        FaultKind::Delay { .. } => None,
        FaultKind::DropConnection => Some("peer_disconnected"),
        FaultKind::Corrupt | FaultKind::DuplicateCompletion | FaultKind::EarlyCompletion => {
            Some("corrupt")
        }
    }
}

async fn run(s: Scenario) -> Report {
    let r = Runner::new(s).run().await.unwrap();
    assert!(
        r.summary.pools_clean,
        "pools or engines not back to zero: {:?}",
        r.stages
    );
    r
}

fn assert_healthy_ones_exact(r: &Report) {
    for q in r.requests.iter().filter(|q| q.label.starts_with("healthy")) {
        assert!(
            q.ok,
            "{} failed beside the faulty request: {:?}",
            q.id, q.error
        );
        assert!(
            q.hops.iter().all(|h| h.verified),
            "{}: a hop was not verified",
            q.id
        );
    }
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

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_matrix(
    #[values("loopback", "tcp", "shm")] transport: &str,
    #[values(
        PayloadKind::EncoderEmbeddings,
        PayloadKind::KvCache,
        PayloadKind::ThinkerToTalker,
        PayloadKind::TalkerToCode2wav
    )]
    hop: PayloadKind,
    #[values(
        FaultKind::FailSubmit,
        FaultKind::FailSlice,
        FaultKind::Stall,
        FaultKind::Delay { ms: 50 },
        FaultKind::DropConnection,
        FaultKind::Corrupt,
        FaultKind::DuplicateCompletion,
        FaultKind::EarlyCompletion,
        FaultKind::LateWrite
    )]
    kind: FaultKind,
) {
    let fault = FaultSpec {
        hop: hop.as_str().into(),
        request: 0,
        tensor: None,
        at: FaultPoint::AfterBytes(4096),
        kind: AnyFault::Transport(kind),
        times: 1,
    };
    let r = run(scenario(transport, vec![fault])).await;
    let faults = r.faults.as_ref().unwrap();
    assert_eq!(
        faults.fired.len(),
        1,
        "the fault did not strike: {faults:?}"
    );
    let q = &r.requests[0];
    match expected(kind) {
        None => {
            assert!(q.ok, "{kind:?} at {hop}: {:?}", q.error);
            assert!(q.hops.iter().all(|h| h.verified));
        }
        Some(want) => {
            assert!(!q.ok, "{kind:?} at {hop}: the request went through");
            let f = q.failure.as_ref().unwrap();
            assert_eq!(f.kind, want, "{kind:?} at {hop}: {:?}", q.error);
            assert_eq!(f.hop.as_deref(), Some(hop.as_str()), "{:?}", q.error);
            assert!(
                f.tensor.is_some(),
                "the error names no tensor: {:?}",
                q.error
            );
            // The stage behind the fault never passed its fence for this request, nor did any
            // stage after it.
            let behind = hop.target().as_str();
            let from = q.stages.iter().position(|s| s.stage == behind).unwrap();
            for s in &q.stages[from..] {
                assert!(s.received.is_none(), "{} started on partial data", s.stage);
                assert_eq!(
                    s.compute_ms, 0.0,
                    "{} computed on a failed request",
                    s.stage
                );
            }
            assert!(
                q.e2e_ms <= HOP_TIMEOUT_S * 1000.0 + SLACK_MS,
                "detected after {} ms",
                q.e2e_ms
            );
        }
    }
    assert_late_bytes_refused(&r);
    assert_healthy_ones_exact(&r);
}

/// A fault aimed at another tensor of another hop's request leaves this one alone, and a
/// scripted plan runs the same way twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_strike_the_same_bytes_every_run() {
    let fault = FaultSpec {
        hop: "kv_cache".into(),
        request: 0,
        tensor: Some("kv.layer.7.v".into()),
        at: FaultPoint::AfterBytes(100_000),
        kind: AnyFault::Transport(FaultKind::Corrupt),
        times: 1,
    };
    // One request at a time: with three in flight, which one's blocks are freed before
    // another allocates decides how decode's block ids split into runs, hence where byte
    // 100000 of the first run falls (timing, not the plan).
    let one_at_a_time = |f: FaultSpec| Scenario {
        concurrency: 1,
        ..scenario("loopback", vec![f])
    };
    let a = run(one_at_a_time(fault.clone())).await;
    let b = run(one_at_a_time(fault)).await;
    let fa = &a.faults.as_ref().unwrap().fired;
    assert_eq!(fa, &b.faults.as_ref().unwrap().fired);
    assert_eq!(fa[0].tensor, "kv.layer.7.v");
    let f = a.requests[0].failure.as_ref().unwrap();
    assert_eq!(
        (f.kind.as_str(), f.tensor.as_deref()),
        ("corrupt", Some("kv.layer.7.v"))
    );
}

/// Many requests, a seeded random 10% of them faulty: exactly those fail, the rest are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_at_random_fail_exactly_their_requests() {
    let mut s = scenario("loopback", vec![]);
    s.requests = (0..40)
        .map(|i| RequestEntry {
            case: None,
            name: Some(format!("r{i}")),
            request: Some(small(1000 + i)),
            repeat: 1,
            vary_seed: false,
        })
        .collect();
    s.concurrency = 8;
    s.random_faults = Some(RandomFaults {
        fraction: 0.1,
        seed: 5,
        kinds: failing_kinds(),
    });
    let planned = s.compile_faults(&s.expand().unwrap()).unwrap().must_fail();
    let r = run(s).await;
    let failed: Vec<String> = r
        .requests
        .iter()
        .filter(|q| !q.ok)
        .map(|q| q.id.clone())
        .collect();
    let f = r.faults.as_ref().unwrap();
    assert_eq!(
        failed, planned,
        "targets {:?}\nfired {:?}",
        f.targets, f.fired
    );
    assert!(
        r.requests
            .iter()
            .filter(|q| q.ok)
            .all(|q| q.hops.iter().all(|h| h.verified))
    );
    assert_late_bytes_refused(&r);
    let _ = Duration::ZERO;
}

/// Faults outside the transport: sidecars, grants and pools in the connectors.
#[rstest]
#[case::t2t_truncated("thinker_to_talker", "truncated_sidecar", "bad_sidecar")]
#[case::t2t_unknown_version("thinker_to_talker", "unknown_version_sidecar", "bad_sidecar")]
#[case::t2t_inconsistent("thinker_to_talker", "inconsistent_sidecar", "bad_sidecar")]
#[case::t2c_truncated("talker_to_code2wav", "truncated_sidecar", "bad_sidecar")]
#[case::t2c_unknown_version("talker_to_code2wav", "unknown_version_sidecar", "bad_sidecar")]
#[case::t2c_inconsistent("talker_to_code2wav", "inconsistent_sidecar", "bad_sidecar")]
#[case::t2t_grant_oob("thinker_to_talker", "grant_out_of_bounds", "grant_refused")]
#[case::t2c_grant_revoked("talker_to_code2wav", "grant_revoked", "grant_refused")]
#[case::kv_grant_oob("kv_cache", "grant_out_of_bounds", "grant_refused")]
#[case::kv_grant_revoked("kv_cache", "grant_revoked", "grant_refused")]
#[case::t2t_pool("thinker_to_talker", "pool_exhausted", "pool_exhausted")]
#[case::kv_pool("kv_cache", "pool_exhausted", "pool_exhausted")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_in_connectors(
    #[values("loopback", "tcp", "shm")] transport: &str,
    #[case] hop: &str,
    #[case] kind: &str,
    #[case] want: &str,
) {
    let yaml = format!("hop: {hop}\nrequest: 0\nkind: {kind}\n");
    let fault: FaultSpec = serde_saphyr::from_str(&yaml).unwrap();
    let r = run(scenario(transport, vec![fault])).await;
    let q = &r.requests[0];
    assert!(!q.ok, "{kind} at {hop}: the request went through");
    let f = q.failure.as_ref().unwrap();
    assert_eq!(f.kind, want, "{kind} at {hop}: {:?}", q.error);
    assert_eq!(f.hop.as_deref(), Some(hop), "{:?}", q.error);
    let behind = PayloadKind::parse(hop, "hop").unwrap().target().as_str();
    let from = q.stages.iter().position(|s| s.stage == behind).unwrap();
    for s in &q.stages[from..] {
        assert!(s.received.is_none(), "{} started on partial data", s.stage);
    }
    assert!(
        q.e2e_ms <= HOP_TIMEOUT_S * 1000.0 + SLACK_MS,
        "detected after {} ms",
        q.e2e_ms
    );
    assert_healthy_ones_exact(&r);
}

/// The metadata store fails after the engines started, or sends producers to an endpoint
/// where nobody listens: every request fails with that cause, nothing hangs or leaks.
#[rstest]
#[case::unavailable("loopback", StoreFault::Unavailable, "metadata")]
#[case::unreachable("tcp", StoreFault::Misdirect, "unreachable")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_in_the_metadata_store(
    #[case] transport: &str,
    #[case] mode: StoreFault,
    #[case] want: &str,
) {
    let store = FaultyStore::new(mode);
    let r = Runner::new(scenario(transport, vec![]))
        .metadata(store)
        .run()
        .await
        .unwrap();
    assert!(r.summary.pools_clean, "{:?}", r.stages);
    for q in &r.requests {
        assert!(!q.ok);
        assert_eq!(q.failure.as_ref().unwrap().kind, want, "{:?}", q.error);
    }
}

/// Issue 10: a hop deadline of 0.1 ms fails requests (or not: loopback is quick), and
/// whatever happens, freeing a batch releases everything: no engine task is left behind (it
/// used to leave the tasks of transfers that ended on an early failure counted for good, and
/// the run then waited 10 s for them).
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_hop_deadline_leaves_nothing_behind(
    #[values(TransportKind::Loopback, TransportKind::Tcp)] transport: TransportKind,
) {
    for _ in 0..3 {
        let mut s = Scenario::golden("text_short", transport);
        s.concurrency = 4;
        s.requests[0].repeat = 8;
        s.hop_timeout_s = 1e-4;
        let t = std::time::Instant::now();
        let r = run(s).await;
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        for q in r.requests.iter().filter(|q| !q.ok) {
            assert!(q.failure.is_some(), "{}: {:?}", q.id, q.error);
        }
    }
}

/// Issue 10: a modelled compute far beyond the request timeout used to keep the run alive
/// after every downstream stage had given up. Nobody would wait for it: it fails at once,
/// naming the stage, and the stages after it are told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compute_past_the_request_timeout_fails_at_once() {
    let mut s = Scenario::golden("text_short", TransportKind::Loopback);
    s.request_timeout_s = 2.0;
    s.compute.thinker_prefill.per_item_us = 1_000_000_000_000;
    let t = std::time::Instant::now();
    let r = run(s).await;
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    let q = &r.requests[0];
    let e = q.error.as_deref().unwrap();
    assert!(
        e.contains("thinker_prefill") && e.contains("modelled compute"),
        "{e}"
    );
    assert_eq!(q.failure.as_ref().unwrap().kind, "timed_out", "{e}");
}

/// Pre-generated payloads (benchmarks) are checked as strictly as generated ones: a byte
/// corrupted in flight on any hop fails the request as `corrupt`, naming hop and tensor,
/// while the healthy requests beside it arrive bit-exact.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pregenerated_payloads_still_catch_corruption_loopback(
    #[values(
        PayloadKind::EncoderEmbeddings,
        PayloadKind::KvCache,
        PayloadKind::ThinkerToTalker,
        PayloadKind::TalkerToCode2wav
    )]
    hop: PayloadKind,
) {
    let fault = FaultSpec {
        hop: hop.as_str().into(),
        request: 0,
        tensor: None,
        at: FaultPoint::AfterBytes(4096),
        kind: AnyFault::Transport(FaultKind::Corrupt),
        times: 1,
    };
    let mut s = scenario("loopback", vec![fault]);
    s.pregenerate = true;
    let r = run(s).await;
    let q = &r.requests[0];
    assert!(!q.ok, "corruption at {hop} went through");
    let f = q.failure.as_ref().unwrap();
    assert_eq!(f.kind, "corrupt", "{hop}: {:?}", q.error);
    assert_eq!(f.hop.as_deref(), Some(hop.as_str()), "{:?}", q.error);
    assert!(f.tensor.is_some(), "names no tensor: {:?}", q.error);
    for q in &r.requests[1..] {
        assert!(q.ok, "{}: {:?}", q.id, q.error);
        assert!(q.hops.iter().all(|h| h.verified), "{}", q.id);
    }
    assert!(r.summary.pools_clean, "{}", r.summary_text());
}
