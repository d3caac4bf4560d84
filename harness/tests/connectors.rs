//! The stage connector against a hand-driven peer on each side: the talker
//! stage between a scripted decode (upstream) and a scripted code2wav (downstream).

use std::sync::Arc;
use std::time::{Duration, Instant};

use omnirig_fixtures::{
    Digest128, Packet, PayloadKind, RequestPlan, Stage, TensorEntry, TensorGenerator, golden_case,
};
use omnirig_harness::control::{Link, Msg, NamedGrant};
use omnirig_harness::stage::HopEnd;
use omnirig_harness::{Scenario, StageWorker};
use omnirig_test_support::slices::on_slices;
use omnirig_transports::{
    Access, Engine, EngineConfig, InProcessStore, Request, TransportDecorator, TransportKind,
};

const T: Duration = Duration::from_secs(20);
const DELAY: Duration = Duration::from_millis(150);

/// Delays every slice: a packet published before its tensors landed would be caught.
fn slow() -> TransportDecorator {
    on_slices(|link, op| {
        Box::pin(async move {
            tokio::time::sleep(DELAY).await;
            link.execute(op).await
        })
    })
}

struct Rig {
    worker: Arc<StageWorker>,
    up: Engine,
    up_link: Link,
    down: Engine,
    down_link: Link,
    plan: RequestPlan,
    spec: omnirig_fixtures::RequestSpec,
}

async fn rig(slow_out: bool) -> Rig {
    let store = InProcessStore::new();
    let cfg = |name: &str| {
        EngineConfig::for_kind(format!("{name}-{slow_out}"), TransportKind::Loopback)
            .store(store.clone())
    };
    let mut out_cfg = cfg("talker-out");
    if slow_out {
        out_cfg = out_cfg.decorator(slow());
    }
    let (up_link, talker_in) = Link::pair("thinker_to_talker");
    let (talker_out, down_link) = Link::pair("talker_to_code2wav");
    let scenario = Scenario::golden("image_audio", TransportKind::Loopback);
    let req = scenario.expand().unwrap().remove(0);
    let sizes = scenario.pool_sizes(&[&req.plan]);
    let worker = StageWorker::new(
        scenario.stage_config(Stage::Talker, sizes),
        Some(HopEnd {
            engine: Arc::new(Engine::new(cfg("talker-in")).await.unwrap()),
            link: talker_in,
        }),
        Some(HopEnd {
            engine: Arc::new(Engine::new(out_cfg).await.unwrap()),
            link: talker_out,
        }),
    )
    .unwrap();
    Rig {
        worker: Arc::new(worker),
        up: Engine::new(cfg("decode-out")).await.unwrap(),
        up_link,
        down: Engine::new(cfg("code2wav-in")).await.unwrap(),
        down_link,
        plan: (*req.plan).clone(),
        spec: golden_case("image_audio").unwrap().request,
    }
}

/// Plays thinker_decode: writes the thinker->talker tensors (one byte of
/// `corrupt` flipped after digesting), then publishes the packet.
async fn play_decode(r: &Rig, rid: &str, corrupt: Option<&str>) {
    let hop = r.plan.hop(PayloadKind::ThinkerToTalker).unwrap();
    r.up_link
        .send(Msg::Offer {
            request: rid.into(),
        })
        .unwrap();
    let Msg::StageReserve { grants, .. } = r.up_link.recv(rid, T).await.unwrap() else {
        panic!("expected a reservation")
    };
    let src = r.up.allocate(hop.total_bytes()).unwrap();
    let (mut off, mut reqs, mut entries) = (0, vec![], vec![]);
    for t in &hop.tensors {
        let mut bytes = TensorGenerator::new(r.plan.seed, t).generate();
        entries.push(TensorEntry::for_bytes(
            &t.name,
            t.dtype,
            t.shape.clone(),
            &bytes,
        ));
        if corrupt == Some(t.name.as_str()) {
            bytes[7] ^= 0x40;
        }
        src.write(off, &bytes).unwrap();
        let g = &grants.iter().find(|g| g.tensor == t.name).unwrap().grant;
        reqs.push(Request::write(&src, off, g, 0, t.byte_length));
        off += t.byte_length;
    }
    r.up.transfer(reqs, Some(T)).await.unwrap();
    let packet = Packet::new(rid, PayloadKind::ThinkerToTalker, 0, true, entries)
        .to_msgpack()
        .unwrap();
    r.up_link
        .send(Msg::Packet {
            request: rid.into(),
            packet,
            writing_us: 0,
            inline: vec![],
        })
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stage_packet_published_only_after_tensors_landed_loopback() {
    let r = rig(true).await;
    let rid = "req-1";
    let (w, spec) = (r.worker.clone(), r.spec.clone());
    let task = tokio::spawn(async move { w.process("req-1", &spec).await });
    play_decode(&r, rid, None).await;
    // Plays code2wav: on the talker's offer, reserve and grant, then wait for the sidecar.
    assert!(matches!(
        r.down_link.recv(rid, T).await.unwrap(),
        Msg::Offer { .. }
    ));
    let codes = &r.plan.hop(PayloadKind::TalkerToCode2wav).unwrap().tensors[0];
    let dst = r.down.allocate(codes.byte_length).unwrap();
    let g = r
        .down
        .grant(&dst, 0, codes.byte_length, Access::Write)
        .unwrap();
    r.down_link
        .send(Msg::StageReserve {
            request: rid.into(),
            grants: vec![NamedGrant {
                tensor: codes.name.clone(),
                grant: g.clone(),
            }],
        })
        .unwrap();
    let t0 = Instant::now();
    let Msg::Packet { packet, .. } = r.down_link.recv(rid, T).await.unwrap() else {
        panic!("expected the packet")
    };
    // Revoke at once: had the packet gone out before the (slow) write finished,
    // the fence would keep those bytes out and the digest below would differ.
    assert!(r.down.revoke(&g));
    assert!(t0.elapsed() >= DELAY);
    let p = Packet::from_msgpack(&packet).unwrap();
    let mut got = vec![0u8; codes.byte_length as usize];
    dst.read(0, &mut got).unwrap();
    let e = p.entry("codes.audio").unwrap();
    assert_eq!(Digest128::of_bytes(&got), e.digest);
    assert_eq!(
        e.digest,
        Digest128::of_bytes(&TensorGenerator::new(r.plan.seed, codes).generate())
    );
    let outcome = task.await.unwrap();
    assert!(outcome.error.is_none(), "{:?}", outcome.error);
    assert_eq!(outcome.received.as_ref().unwrap().tensors, 5);
    let u = r.worker.drain().await;
    assert!(u.is_clean(), "{u:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_tensor_fails_naming_hop_and_tensor_and_releases_loopback() {
    let r = rig(false).await;
    let rid = "req-2";
    let (w, spec) = (r.worker.clone(), r.spec.clone());
    let task = tokio::spawn(async move { w.process("req-2", &spec).await });
    play_decode(&r, rid, Some("embed.tts_eos")).await;
    let outcome = task.await.unwrap();
    let err = outcome.error.unwrap();
    assert!(
        err.contains("thinker_to_talker") && err.contains("embed.tts_eos") && err.contains(rid),
        "{err}"
    );
    // The talker never started: downstream, waiting for its offer, is told why.
    match r.down_link.recv(rid, T).await.unwrap() {
        Msg::Error { cause, .. } => assert!(cause.contains("embed.tts_eos"), "{cause}"),
        other => panic!("expected ERROR, got {other:?}"),
    }
    let u = r.worker.drain().await;
    assert!(u.is_clean(), "{u:?}");
}

/// Fails every slice of one layer's V tensor, as a broken link would.
fn fail_v() -> TransportDecorator {
    on_slices(|link, op| {
        // Prefill's KV layout is [layer][K, V][3 blocks of 16 KiB]: fail layer 0's V.
        let half = op.local_offset / (3 * 16 * 4 * 128 * 2);
        if half == 1 {
            return Box::pin(async {
                Err(omnirig_transports::Error::new(
                    omnirig_transports::ErrorKind::Io,
                    "injected link failure",
                ))
            });
        }
        link.execute(op)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_error_names_the_failed_blocks_and_releases_loopback() {
    // text_short: 48 tokens = 3 blocks, so prefill's KV cache holds 3 blocks per tensor.
    let s = Scenario::golden("text_short", TransportKind::Loopback);
    let r = omnirig_harness::Runner::new(s)
        .decorate(PayloadKind::KvCache, fail_v())
        .run()
        .await
        .unwrap();
    let q = &r.requests[0];
    let err = q.error.as_deref().unwrap();
    assert!(
        err.contains("kv_cache")
            && err.contains("kv.layer.0.v blocks 0..3")
            && err.contains("injected"),
        "{err}"
    );
    // Nothing downstream ran; every pool is back to zero.
    assert!(r.summary.pools_clean, "{}", r.summary_text());
    assert_eq!(r.summary.failed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_timeout_fails_the_transfer_and_names_it_loopback() {
    // Each KV slice takes 150 ms; the hop allows 100 ms from offer to FINISH.
    let s =
        Scenario::from_yaml("hop_timeout_s: 0.1\nrequests: [{ case: text_short }]", "t").unwrap();
    let r = omnirig_harness::Runner::new(s)
        .decorate(PayloadKind::KvCache, slow())
        .run()
        .await
        .unwrap();
    let q = &r.requests[0];
    let err = q.error.as_deref().unwrap();
    assert!(
        err.contains("kv_cache") && err.contains("timed out"),
        "{err}"
    );
    assert!(
        q.errors.iter().any(|e| e.starts_with("thinker_decode:")),
        "{:?}",
        q.errors
    );
    assert!(r.summary.pools_clean, "{}", r.summary_text());
}
