//! The pipeline on the `sim` transport (issue 16): the fault matrix (every hop x every
//! transport fault kind) on a simulated fabric, run twice; each cell must end as the real
//! transports' matrix says (`faults.rs`), and the two runs' event traces must be identical,
//! byte for byte, and so must their reports. A failing cell prints its seed and the first line where the traces part.

use omnirig_fixtures::{PayloadKind, RequestSpec};
use omnirig_harness::faults::{AnyFault, FaultSpec};
use omnirig_harness::scenario::{RequestEntry, Scenario};
use omnirig_harness::sim;
use omnirig_transports::{FaultKind, FaultPoint, TransportKind};
use rstest::rstest;

fn small(seed: u64) -> RequestSpec {
    let yaml = format!(
        "{{ seed: {seed}, text_tokens: 16, images: [{{ width: 64, height: 64 }}], \
         audios: [{{ seconds: 1.0 }}], output_text_tokens: 8, output_audio_seconds: 0.5 }}"
    );
    serde_saphyr::from_str(&yaml).unwrap()
}

/// As the real matrix: image_audio (all four hops) faulty, two healthy requests beside it.
fn scenario(faults: Vec<FaultSpec>) -> Scenario {
    let mut s = Scenario::golden("image_audio", TransportKind::Sim);
    s.name = "sim-faults".into();
    s.concurrency = 3;
    s.hop_timeout_s = 1.0;
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
    // Some jitter, so the seed matters.
    s.fabric = Some(omnirig_transports::FabricSpec {
        jitter_us: 3.0,
        ..Default::default()
    });
    s
}

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

#[rstest]
fn fault_matrix_on_sim_is_deterministic(
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
    let seed = 16;
    let s = scenario(vec![FaultSpec {
        hop: hop.as_str().into(),
        request: 0,
        tensor: None,
        at: FaultPoint::AfterBytes(4096),
        kind: AnyFault::Transport(kind),
        times: 1,
    }]);
    let a = sim::run(&s, Some(seed)).unwrap();
    let b = sim::run(&s, Some(seed)).unwrap();
    if let Some((i, x, y)) = sim::first_difference(&a.trace, &b.trace) {
        panic!(
            "seed {seed}, {kind:?} at {hop}: traces differ at line {i}:\n  {x}\n  {y}\n\
             replay: omnirig run --transport sim --seed {seed}"
        );
    }
    assert_eq!(a.digest, b.digest);
    // The report too, byte for byte: its times are modelled, its names and epochs seeded.
    assert!(
        serde_json::to_string(&a.report).unwrap() == serde_json::to_string(&b.report).unwrap(),
        "seed {seed}, {kind:?} at {hop}: the reports differ"
    );
    let r = &a.report;
    assert!(r.summary.pools_clean, "seed {seed}: pools not back to zero");
    let f = r.faults.as_ref().unwrap();
    assert_eq!(f.fired.len(), 1, "seed {seed}: the fault did not strike");
    assert!(
        f.late.iter().all(|l| l.refused),
        "seed {seed}: a late write landed"
    );
    let q = &r.requests[0];
    match expected(kind) {
        None => assert!(q.ok, "seed {seed}: {:?}", q.error),
        Some(want) => {
            assert!(!q.ok, "seed {seed}: {kind:?} at {hop} went through");
            let fl = q.failure.as_ref().unwrap();
            assert_eq!(fl.kind, want, "seed {seed}: {:?}", q.error);
            assert_eq!(fl.hop.as_deref(), Some(hop.as_str()));
            // Detected at the deadline or sooner, in modelled time.
            assert!(q.e2e_ms <= 1000.0 + 50.0, "detected after {} ms", q.e2e_ms);
        }
    }
    for q in r.requests.iter().filter(|q| q.label.starts_with("healthy")) {
        assert!(q.ok, "seed {seed}: {} failed: {:?}", q.id, q.error);
        assert!(q.hops.iter().all(|h| h.verified));
    }
}

/// A healthy run's modelled time follows the fabric: a slower fabric takes longer, the
/// bytes arrive exact either way, and a different seed (jitter) changes the trace.
#[test]
fn the_model_shapes_the_run_and_the_seed_shapes_the_trace() {
    let mut s = scenario(vec![]);
    let fast = sim::run(&s, Some(1)).unwrap();
    assert!(fast.report.passed(), "{}", fast.report.summary_text());
    let other = sim::run(&s, Some(2)).unwrap();
    assert_ne!(fast.digest, other.digest, "jitter is seeded");
    let f = s.fabric.as_mut().unwrap();
    for n in &mut f.nodes {
        n.nics[0].gbps = 1.0;
    }
    f.switch.as_mut().unwrap().gbps = 1.0;
    let slow = sim::run(&s, Some(1)).unwrap();
    assert!(slow.report.passed(), "{}", slow.report.summary_text());
    assert!(
        slow.virtual_s > 5.0 * fast.virtual_s,
        "1 Gb/s: {} s, 100 Gb/s: {} s",
        slow.virtual_s,
        fast.virtual_s
    );
    assert!(fast.trace.iter().any(|l| l.contains("msg kv_cache>")));
}

/// The shipped RFC fabric and scenario load, and a request on them arrives bit-exact with
/// its latency in the modelled range: the hop's bytes over 400 Gb/s, plus the modelled
/// compute.
#[test]
fn the_rfc_fabric_runs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let fabric = sim::fabric_from_path(&root.join("fabrics/rfc-ndr400.yaml")).unwrap();
    let mut s = Scenario::from_path(&root.join("scenarios/rfc.yaml")).unwrap();
    s.requests.truncate(1);
    s.fabric = Some(fabric);
    let run = sim::run(&s, None).unwrap();
    assert!(run.report.passed(), "{}", run.report.summary_text());
    // talker and code2wav share a node: their hop never touches a NIC.
    assert!(
        run.trace
            .iter()
            .any(|l| l.contains("talker_to_code2wav> speech.local")),
        "no local hop in the trace"
    );
    let bad = sim::fabric_from_path(&root.join("scenarios/rfc.yaml")).unwrap_err();
    assert!(bad.to_string().contains("rfc.yaml"), "{bad}");
}
