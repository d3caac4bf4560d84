//! The five-stage pipeline end to end, in one process. Test names carry the
//! transport, so `cargo test loopback` runs the loopback cases.

use omnirig_fixtures::{PayloadKind, golden_cases};
use omnirig_harness::{Report, Runner, Scenario};
use rstest::rstest;

fn assert_clean_pass(r: &Report) {
    for q in &r.requests {
        assert!(q.ok, "{}: {:?}", q.id, q.error);
        for h in &q.hops {
            assert!(h.verified, "{} {}: not verified", q.id, h.hop);
            assert_eq!(
                h.moved_bytes + h.reused_bytes,
                h.bytes,
                "{} {}",
                q.id,
                h.hop
            );
        }
    }
    assert!(r.summary.pools_clean, "{}", r.summary_text());
    assert!(r.passed(), "{}", r.summary_text());
    assert_phases_and_offsets(r);
}

/// Each handoff's phases are consecutive and add up to it; the reply wait holds the engine
/// transfer; each stage's receive, compute and send follow each other on its timeline.
fn assert_phases_and_offsets(r: &Report) {
    const EPS: f64 = 1e-6;
    for q in &r.requests {
        for h in &q.hops {
            let p = &h.phases_ms;
            assert!(
                (p.total() - h.handoff_ms).abs() < EPS,
                "{} {}: phases {p:?} add up to {} ms, handoff {} ms",
                q.id,
                h.hop,
                p.total(),
                h.handoff_ms
            );
            assert!(
                p.transfer + EPS >= h.transfer_ms,
                "{} {}: reply wait {} ms shorter than its engine transfer {} ms",
                q.id,
                h.hop,
                p.transfer,
                h.transfer_ms
            );
        }
        for s in q.stages.iter().filter(|s| s.participated) {
            let compute = s.compute_start_ms.expect("a stage that ran computed");
            if let Some(rec) = &s.received {
                let at = rec.start_ms.expect("a received hop has its offer's offset");
                assert!(
                    at + rec.handoff_ms <= compute + EPS,
                    "{} {}: {s:?}",
                    q.id,
                    s.stage
                );
            }
            if let Some(sent) = &s.sent {
                let at = sent
                    .transfer_start_ms
                    .expect("a sent hop has its transfer's offset");
                assert!(
                    compute + s.compute_ms <= at + EPS,
                    "{} {}: {s:?}",
                    q.id,
                    s.stage
                );
                assert!(
                    at + sent.transfer_ms <= s.total_ms + EPS,
                    "{} {}: {s:?}",
                    q.id,
                    s.stage
                );
            }
        }
    }
}

#[rstest]
#[case::text_short("text_short")]
#[case::image_audio("image_audio")]
#[case::long_audio("long_audio")]
#[case::video_large_kv("video_large_kv")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_case_five_stages(#[case] case: &str, #[values("loopback", "tcp")] transport: &str) {
    let r = Runner::new(Scenario::golden(case, transport.parse().unwrap()))
        .run()
        .await
        .unwrap();
    assert_clean_pass(&r);
    let q = &r.requests[0];
    let plan = Scenario::golden(case, transport.parse().unwrap())
        .expand()
        .unwrap()
        .remove(0)
        .plan;
    assert_eq!(q.hops.len(), plan.hops.len());
    // Fresh pools: decode's blocks are one run, so KV is one request per layer and K/V.
    let kv = q.hops.iter().find(|h| h.hop == "kv_cache").unwrap();
    assert_eq!(kv.requests, 2 * 48);
    assert_eq!(r.transports["kv_cache"], transport);
}

#[test]
fn every_golden_case_is_covered() {
    let names: Vec<_> = golden_cases().into_iter().map(|c| c.name).collect();
    assert_eq!(
        names,
        ["text_short", "image_audio", "long_audio", "video_large_kv"]
    );
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeat_dedupes_ec_and_moves_only_kv_tail(#[values("loopback", "tcp")] transport: &str) {
    let yaml = format!(
        "transport: {transport}\nconcurrency: 1\nrequests:\n  - case: image_audio\n    repeat: 2\n"
    );
    let r = Runner::new(Scenario::from_yaml(&yaml, "t").unwrap())
        .run()
        .await
        .unwrap();
    assert_clean_pass(&r);
    let hop = |i: usize, k: PayloadKind| {
        r.requests[i]
            .hops
            .iter()
            .find(|h| h.hop == k.as_str())
            .unwrap()
            .clone()
    };
    let (ec0, ec1) = (
        hop(0, PayloadKind::EncoderEmbeddings),
        hop(1, PayloadKind::EncoderEmbeddings),
    );
    assert_eq!(
        (ec0.reused_bytes, ec1.moved_bytes),
        (0, 0),
        "second request moves no embeddings"
    );
    assert_eq!(ec1.reused_bytes, ec0.bytes);
    assert_eq!(
        (ec0.tensors, ec1.tensors),
        (2, 2),
        "cached embeddings are verified too"
    );
    let (kv0, kv1) = (hop(0, PayloadKind::KvCache), hop(1, PayloadKind::KvCache));
    assert_eq!(kv0.reused_bytes, 0);
    assert!(kv1.reused_bytes > 0 && kv1.moved_bytes < kv0.moved_bytes);
    // Every full block hits; only the last (partial) block moves: 48 layers x K, V x 16 tokens x 4 heads x 128 x bf16.
    assert_eq!(kv1.moved_bytes, 48 * 2 * 16 * 4 * 128 * 2);
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_mixed_requests_loopback_with_kv_over_tcp() {
    let yaml = r#"
name: mixed
concurrency: 4
arrival: { pattern: poisson, rate_per_s: 200, seed: 7 }
transport: loopback
hops: { kv_cache: tcp }
compute: { thinker_decode: { per_token_us: 50 }, encoder: { per_item_us: 500 } }
requests:
  - case: text_short
    repeat: 3
  - case: image_audio
    repeat: 3
  - case: long_audio
  - name: two_images
    request: { seed: 11, text_tokens: 40, images: [{ width: 320, height: 320 }, { width: 64, height: 96 }], output_text_tokens: 8 }
"#;
    let r = Runner::new(Scenario::from_yaml(yaml, "t").unwrap())
        .run()
        .await
        .unwrap();
    assert_clean_pass(&r);
    assert_eq!(r.summary.requests, 8);
    // No audio out: no talker hops for two_images.
    assert_eq!(r.requests[7].hops.len(), 2);
    assert!(r.summary.e2e_p99_ms >= r.summary.e2e_p50_ms);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_handoff_names_hop_and_releases_pools_loopback() {
    // Prefill takes 300 ms; decode gives up waiting for its KV offer after 100 ms.
    let yaml = r#"
transport: loopback
request_timeout_s: 0.1
compute: { thinker_prefill: { per_item_us: 300000 } }
requests: [{ case: text_short }]
"#;
    let r = Runner::new(Scenario::from_yaml(yaml, "t").unwrap())
        .run()
        .await
        .unwrap();
    let q = &r.requests[0];
    assert!(!q.ok);
    let err = q.error.as_deref().unwrap();
    assert!(err.contains("kv_cache") && err.contains(&q.id), "{err}");
    assert!(!r.passed());
    assert!(r.summary.pools_clean, "{}", r.summary_text());
}

/// The README's first command: the embedded default scenario, in one process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_scenario_runs_clean_loopback() {
    let r = Runner::new(Scenario::default_scenario())
        .run()
        .await
        .unwrap();
    assert_clean_pass(&r);
    assert_eq!((r.summary.requests, r.mode.as_str()), (5, "in_process"));
    assert!(r.summary.reused_bytes > 0, "the repeat reuses EC and KV");
    let text = r.summary_text();
    assert!(text.contains("5/5 requests ok, pools clean"), "{text}");
}

/// Stages fed pre-generated payloads (what benchmarks run) move and verify the same bytes:
/// the default scenario (with a repeat whose outputs differ downstream of the caches) passes
/// clean, every hop verified, pools back to zero.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pregenerated_payloads_arrive_bit_exact(#[values("loopback", "tcp")] transport: &str) {
    let mut s = Scenario::default_scenario().with_transport(transport.parse().unwrap());
    s.pregenerate = true;
    let r = Runner::new(s).run().await.unwrap();
    assert_clean_pass(&r);
    assert_eq!(r.summary.requests, 5);
}

/// Packets up to 64 KiB travel inline with their sidecar (Talker -> Code2Wav's codes), the
/// rest through the engine; every byte still lands and verifies.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_packets_inline_arrive_bit_exact(#[values("loopback", "tcp")] transport: &str) {
    let mut s = Scenario::golden("image_audio", transport.parse().unwrap());
    s.inline_below = 64 << 10;
    let r = Runner::new(s).run().await.unwrap();
    assert_clean_pass(&r);
    let q = &r.requests[0];
    let hop = |k: PayloadKind| q.hops.iter().find(|h| h.hop == k.as_str()).unwrap();
    let codes = hop(PayloadKind::TalkerToCode2wav);
    assert!(codes.bytes <= 64 << 10, "{} bytes", codes.bytes);
    assert_eq!(codes.requests, 0, "inline: no engine request");
    assert_eq!(codes.moved_bytes, codes.bytes);
    let t2t = hop(PayloadKind::ThinkerToTalker);
    assert!(t2t.bytes > 64 << 10 && t2t.requests > 0, "{t2t:?}");
}

/// Credits are granted while upstream computes: a consumer's reservation may wait on
/// upstream (here the second request's encoder-cache entry, which the first is receiving)
/// for longer than a hop timeout, as its wait for the offer may; the hop timeout still
/// bounds each handoff from its offer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credits_wait_out_upstream_compute_longer_than_a_hop_timeout_loopback() {
    let yaml = r#"
transport: loopback
concurrency: 2
hop_timeout_s: 0.3
request_timeout_s: 20
compute: { encoder: { per_item_us: 400000 } }
requests: [{ case: image_audio, repeat: 2 }]
"#;
    let r = Runner::new(Scenario::from_yaml(yaml, "t").unwrap())
        .run()
        .await
        .unwrap();
    assert_clean_pass(&r);
    // The second request's prefill took the first one's embeddings from its cache.
    let ec = |i: usize| {
        r.requests[i]
            .hops
            .iter()
            .find(|h| h.hop == PayloadKind::EncoderEmbeddings.as_str())
            .unwrap()
            .clone()
    };
    assert_eq!(ec(0).reused_bytes + ec(1).reused_bytes, ec(0).bytes);
}
