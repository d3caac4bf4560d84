//! The five-stage pipeline with GPU-resident stage tensors (`memory: gpu`, `--features cuda`):
//! every pool, the KV cache and the encoder cache are device memory of GPU 0; fixtures are
//! generated on the host and copied in once, landed tensors are copied back once and checked
//! bit-exact against the producer's digests. tcp hops stage through pinned buffers, cuda hops
//! are device-to-device copies by the grant owner, loopback hops are device copies.
//!
//! Without a GPU the run cases print SKIPPED and return (not a pass);
//! `OMNIRIG_CUDA_REQUIRED=1` makes that a failure. Run them with `--test-threads=1` (the
//! staging-pool checks are per process).
#![cfg(feature = "cuda")]

use std::io::Write as _;

use omnirig_fixtures::PayloadKind;
use omnirig_harness::faults::{AnyFault, FaultSpec};
use omnirig_harness::{Report, Runner, Scenario, StageMemory};
use omnirig_transports::transport::cuda::driver::{Gpu, device_count};
use omnirig_transports::{FaultKind, FaultPoint};
use rstest::rstest;

/// Why there is no GPU to run on, or `None` when there is one.
fn no_gpu() -> Option<String> {
    let why = match device_count() {
        Ok(n) if n > 0 => return None,
        Ok(_) => "the driver reports no CUDA device".to_string(),
        Err(e) => e.to_string(),
    };
    assert!(
        std::env::var("OMNIRIG_CUDA_REQUIRED").as_deref() != Ok("1"),
        "OMNIRIG_CUDA_REQUIRED=1 but {why}"
    );
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED a GPU case: {why}. Run the test binary on a machine with a GPU (docs/gpu.md)"
    );
    Some(why)
}

/// image_audio twice (the repeat reuses encoder-cache and KV prefix blocks held in GPU
/// memory) and a text request, every hop over `transport`, tensors in GPU memory.
fn gpu_scenario(transport: &str) -> Scenario {
    let yaml = format!(
        r#"
name: gpu-{transport}
concurrency: 2
transport: {transport}
memory: gpu
requests:
  - case: image_audio
    repeat: 2
  - case: text_short
"#
    );
    Scenario::from_yaml(&yaml, "gpu test").unwrap()
}

fn assert_staging_returned() {
    let gpu = Gpu::open(0).unwrap();
    for outbound in [true, false] {
        let pool = gpu.staging_pool(outbound);
        assert_eq!(
            pool.outstanding(),
            0,
            "staging buffers not returned: {pool:?}"
        );
    }
}

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
}

#[rstest]
#[case::loopback("loopback")]
#[case::tcp_staged("tcp")]
#[case::cuda("cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_stages_with_gpu_resident_tensors_arrive_bit_exact(#[case] transport: &str) {
    if no_gpu().is_some() {
        return;
    }
    let r = Runner::new(gpu_scenario(transport)).run().await.unwrap();
    assert_clean_pass(&r);
    assert_eq!(r.summary.requests, 3);
    assert!(r.summary.moved_bytes > 0, "{}", r.summary_text());
    assert!(
        r.summary.reused_bytes > 0,
        "the repeat reuses EC and KV held on the GPU"
    );
    if transport == "tcp" {
        // Only staging makes pinned buffers: tcp really moved device memory.
        let gpu = Gpu::open(0).unwrap();
        assert!(gpu.staging_pool(true).allocated() > 0);
        assert!(gpu.staging_pool(false).allocated() > 0);
    }
    assert_staging_returned();
}

/// A byte flipped on the way (the copy is GPU memory too) is caught by the check after the
/// one copy back: that request fails as corrupt naming the tensor, the others are exact.
#[rstest]
#[case::tcp_staged("tcp")]
#[case::cuda("cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corrupted_gpu_tensor_fails_its_request_and_only_it(#[case] transport: &str) {
    if no_gpu().is_some() {
        return;
    }
    let mut s = gpu_scenario(transport);
    s.hop_timeout_s = 5.0;
    s.faults = vec![FaultSpec {
        hop: PayloadKind::KvCache.as_str().into(),
        request: 0,
        tensor: Some("kv.layer.7.v".into()),
        at: FaultPoint::AfterBytes(100_000),
        kind: AnyFault::Transport(FaultKind::Corrupt),
        times: 1,
    }];
    let r = Runner::new(s).run().await.unwrap();
    let f = r.requests[0].failure.as_ref().expect("request 0 fails");
    assert_eq!(
        (f.kind.as_str(), f.tensor.as_deref()),
        ("corrupt", Some("kv.layer.7.v")),
        "{}",
        r.summary_text()
    );
    for q in &r.requests[1..] {
        assert!(q.ok, "{}: {:?}", q.id, q.error);
    }
    assert!(r.summary.pools_clean, "{}", r.summary_text());
    assert_staging_returned();
}

/// Without a GPU, `memory: gpu` is refused up front with the reason (never a panic, never a
/// silent fall back to host memory). This case runs where the others skip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_without_a_gpu_is_refused_naming_why() {
    let Some(why) = (match device_count() {
        Ok(n) if n > 0 => None,
        Ok(_) => Some("no CUDA device".to_string()),
        Err(e) => Some(e.to_string()),
    }) else {
        let _ = writeln!(std::io::stderr(), "SKIPPED: this machine has a GPU");
        return;
    };
    let err = Runner::new(gpu_scenario("tcp"))
        .run()
        .await
        .expect_err("no GPU: the engines cannot allocate GPU memory");
    let msg = err.to_string();
    assert!(
        msg.contains("CUDA") || msg.contains("cuda"),
        "{msg} (device check said: {why})"
    );
}

#[test]
fn memory_parses_from_scenarios_and_flags() {
    assert_eq!(gpu_scenario("tcp").memory, StageMemory::Gpu);
    let host = Scenario::from_yaml("requests: [{ case: text_short }]", "t").unwrap();
    assert_eq!(host.memory, StageMemory::Host);
    assert_eq!("gpu".parse::<StageMemory>(), Ok(StageMemory::Gpu));
    let e = "vram".parse::<StageMemory>().unwrap_err();
    assert!(e.contains("vram") && e.contains("host, gpu"), "{e}");
    let e = Scenario::from_yaml("memory: vram\nrequests: [{ case: text_short }]", "t").unwrap_err();
    assert!(e.to_string().contains("memory"), "{e}");
}
