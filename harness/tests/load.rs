//! Load: the shipped 1,000-request scenarios, through all five stages at once.
//! `cargo test --release -p omnirig-harness --test load` (about 35 s on 2 cores; skipped in
//! debug builds, where it would take many minutes).

use omnirig_harness::{Runner, Scenario};

fn scenario(file: &str) -> Scenario {
    Scenario::from_path(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("scenarios")
            .join(file),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    debug_assertions,
    ignore = "a release-build test: cargo test --release -p omnirig-harness --test load"
)]
async fn load_a_thousand_concurrent_small_requests_all_ok_nothing_leaked() {
    let s = scenario("load.yaml");
    assert_eq!(s.concurrency, 1000);
    let r = Runner::new(s).run().await.unwrap();
    assert_eq!(
        (r.summary.requests, r.summary.ok),
        (1000, 1000),
        "{:?}",
        r.requests.iter().find(|q| !q.ok)
    );
    assert!(r.summary.pools_clean, "{:?}", r.stages);
    assert!(
        r.requests
            .iter()
            .all(|q| q.hops.len() == 4 && q.hops.iter().all(|h| h.verified))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    debug_assertions,
    ignore = "a release-build test: cargo test --release -p omnirig-harness --test load"
)]
async fn load_with_five_percent_faults_fails_exactly_those() {
    let s = scenario("load-faults.yaml");
    let must_fail = s.compile_faults(&s.expand().unwrap()).unwrap().must_fail();
    assert_eq!(must_fail.len(), 50);
    let r = Runner::new(s).run().await.unwrap();
    let failed: Vec<String> = r
        .requests
        .iter()
        .filter(|q| !q.ok)
        .map(|q| q.id.clone())
        .collect();
    assert_eq!(failed, must_fail);
    assert!(
        r.requests
            .iter()
            .filter(|q| q.ok)
            .all(|q| q.hops.iter().all(|h| h.verified))
    );
    assert!(r.faults.as_ref().unwrap().late.iter().all(|l| l.refused));
    assert!(r.summary.pools_clean, "{:?}", r.stages);
}
