//! The sim transport on its own fabric, under a paused clock: bytes arrive bit-exact, virtual
//! time follows the model (serialisation at the bottleneck plus latency), transfers sharing a
//! NIC queue behind each other, unreachable nodes are named, and bad fabrics are refused
//! naming the field. (The engine and fault suites also run every case on `sim`.)

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use omnirig_transports::transport::sim::{Fabric, FabricSpec, LinkSpec, NicSpec, NodeSpec};
use omnirig_transports::{
    Access, Engine, EngineConfig, ErrorKind, InProcessStore, Request, SimConfig, TransportKind,
};

const MIB: u64 = 1 << 20;

async fn assert_idle(e: &Engine) {
    let u = idle(e).await;
    assert_eq!(
        (u.grants, u.granted_bytes, u.batches, u.tasks, u.leases),
        (0, 0, 0, 0, 0),
        "{u:?}"
    );
}

fn node(name: &str, nic_gbps: f64) -> NodeSpec {
    NodeSpec {
        name: name.into(),
        nics: vec![NicSpec {
            name: "nic0".into(),
            gbps: nic_gbps,
            latency_us: 1.0,
        }],
        local: omnirig_transports::transport::sim::PathModel {
            gbps: 800.0,
            latency_us: 0.0,
        },
    }
}

/// Tokio's timers fire on whole milliseconds: one tokio ms is one modelled us here.
const SCALE: u64 = 1000;

/// Three nodes: a and b linked to c at 8 Gb/s (1 byte/ns) with 10 us of latency; NICs fast.
fn fabric() -> Arc<Fabric> {
    let link = |a: &str, b: &str| LinkSpec {
        between: [a.into(), b.into()],
        gbps: 8.0,
        latency_us: 10.0,
    };
    Fabric::with_time_scale(
        FabricSpec {
            nodes: vec![node("a", 800.0), node("b", 800.0), node("c", 16.0)],
            links: vec![link("a", "c"), link("b", "c")],
            switch: None,
            placement: Default::default(),
            ..FabricSpec::default()
        },
        SCALE,
    )
    .unwrap()
}

async fn engine(f: &Arc<Fabric>, store: &Arc<InProcessStore>, place: &str) -> Engine {
    Engine::new(
        EngineConfig::for_kind(unique(place), TransportKind::Sim)
            .with(SimConfig::on(f, place, place))
            .store(store.clone()),
    )
    .await
    .unwrap()
}

/// One write of `len` bytes from `src` to `dst`; returns the modelled ns it took.
async fn write(f: &Fabric, src: &Engine, dst: &Engine, len: u64, seed: u64) -> u64 {
    let data = pattern(seed, len as usize);
    let s = src.allocate(len).unwrap();
    s.write(0, &data).unwrap();
    let d = dst.allocate(len).unwrap();
    let g = dst.grant(&d, 0, len, Access::Write).unwrap();
    let t = f.now_ns();
    src.transfer(vec![Request::write(&s, 0, &g, 0, len)], None)
        .await
        .unwrap();
    let took = f.now_ns() - t;
    dst.revoke(&g);
    let mut got = vec![0u8; len as usize];
    d.read(0, &mut got).unwrap();
    assert!(got == data, "bytes differ");
    took
}

/// One read of `len` bytes that `owner` holds, by `reader`; checks the bytes and returns the
/// modelled ns it took.
async fn read(f: &Fabric, reader: &Engine, owner: &Engine, len: u64, seed: u64) -> u64 {
    let data = pattern(seed, len as usize);
    let src = owner.allocate(len).unwrap();
    src.write(0, &data).unwrap();
    let g = owner.grant(&src, 0, len, Access::Read).unwrap();
    let back = reader.allocate(len).unwrap();
    let t = f.now_ns();
    reader
        .transfer(vec![Request::read(&back, 0, &g, 0, len)], None)
        .await
        .unwrap();
    let took = f.now_ns() - t;
    owner.revoke(&g);
    let mut got = vec![0u8; len as usize];
    back.read(0, &mut got).unwrap();
    assert!(got == data, "bytes differ");
    took
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn bytes_are_exact_and_virtual_time_follows_the_model() {
    let f = fabric();
    let store = InProcessStore::new();
    let a = engine(&f, &store, "a").await;
    let c = engine(&f, &store, "c").await;
    // 8 MiB at 1 byte/ns through the 8 Gb/s link (NICs are faster): 8 Mi ns on the wire,
    // the last slice lands 12 us (link + both NICs) after it leaves, and its acknowledgement
    // takes 12 us back.
    let took = write(&f, &a, &c, 8 * MIB, 1).await;
    let expect = 8 * MIB + 12_000 + 12_000; // ns
    // Wake-ups land on the next whole tokio ms: one modelled us at this scale.
    assert!(
        (expect..expect + 1000).contains(&took),
        "virtual time {took} ns, model {expect} ns"
    );
    assert_idle(&a).await;
    assert_idle(&c).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn transfers_sharing_a_nic_queue_behind_each_other() {
    let f = fabric();
    let store = InProcessStore::new();
    let a = engine(&f, &store, "a").await;
    let b = engine(&f, &store, "b").await;
    let c = engine(&f, &store, "c").await;
    let len = 8 * MIB;
    // Alone: the 8 Gb/s link binds. Together: a and b have links of their own, but c's
    // 16 Gb/s NIC now carries both, so each gets half of it.
    let alone = write(&f, &a, &c, len, 2).await;
    let (ta, tb) = tokio::join!(write(&f, &a, &c, len, 3), write(&f, &b, &c, len, 4));
    let both = ta.max(tb);
    assert!(
        both > alone + alone / 2,
        "contention: alone {alone} ns, two at once {both} ns"
    );
    let usage = f.usage();
    let rx = usage.iter().find(|q| q.queue == "c/nic0.rx").unwrap();
    assert_eq!(rx.bytes, 3 * len, "{usage:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn reads_cross_the_route_back() {
    let f = fabric();
    let store = InProcessStore::new();
    let a = engine(&f, &store, "a").await;
    let c = engine(&f, &store, "c").await;
    let len = 3 * MIB + 5;
    read(&f, &a, &c, len, 9).await;
    assert!(f.usage().iter().any(|q| q.queue == "c>a" && q.bytes == len));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_small_write_or_read_costs_a_round_trip_of_latency() {
    let f = fabric();
    let store = InProcessStore::new();
    let a = engine(&f, &store, "a").await;
    let c = engine(&f, &store, "c").await;
    // 8 bytes: 12 us to land (link + both NICs), 12 us for the answer back.
    let took = write(&f, &a, &c, 8, 3).await;
    assert!((24_000..25_100).contains(&took), "write took {took} ns");
    let took = read(&f, &a, &c, 8, 7).await;
    assert!((24_000..25_100).contains(&took), "read took {took} ns");
    assert_idle(&a).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn nodes_without_a_path_are_unreachable_by_name() {
    let f = fabric();
    let store = InProcessStore::new();
    let a = engine(&f, &store, "a").await;
    let b = engine(&f, &store, "b").await;
    let d = b.allocate(4096).unwrap();
    let g = b.grant(&d, 0, 4096, Access::Write).unwrap();
    let s = a.allocate(4096).unwrap();
    let e = a
        .transfer(vec![Request::write(&s, 0, &g, 0, 4096)], None)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoTransport, "{e}");
    assert_eq!(e.peer(), Some(b.name()), "{e}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_deadline_in_virtual_time_stops_a_slow_transfer() {
    let f = fabric();
    let store = InProcessStore::new();
    let a = engine(&f, &store, "a").await;
    let c = engine(&f, &store, "c").await;
    let len = 64 * MIB; // 67 ms of modelled wire time
    let s = a.allocate(len).unwrap();
    let d = c.allocate(len).unwrap();
    let g = c.grant(&d, 0, len, Access::Write).unwrap();
    let t = f.now_ns();
    // 10 modelled ms, in tokio's units.
    let e = a
        .transfer(
            vec![Request::write(&s, 0, &g, 0, len)],
            Some(Duration::from_millis(10) * SCALE as u32),
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert_eq!(f.now_ns() - t, 10_000_000);
    c.revoke(&g);
    assert_idle(&a).await;
}

#[test]
fn bad_fabrics_are_refused_naming_the_field() {
    let ok = FabricSpec::default();
    ok.validate().unwrap();
    let cases: Vec<(FabricSpec, &str)> = vec![
        (
            FabricSpec {
                nodes: vec![],
                ..ok.clone()
            },
            "fabric.nodes",
        ),
        (
            FabricSpec {
                slice_bytes: 0,
                ..ok.clone()
            },
            "fabric.slice_bytes",
        ),
        (
            FabricSpec {
                links: vec![LinkSpec {
                    between: ["encoder".into(), "nowhere".into()],
                    gbps: 1.0,
                    latency_us: 0.0,
                }],
                ..ok.clone()
            },
            "nowhere",
        ),
        (
            FabricSpec {
                nodes: vec![node("x", f64::NAN)],
                placement: Default::default(),
                ..ok.clone()
            },
            "fabric.nodes[0].nics[0].gbps",
        ),
        (
            FabricSpec {
                placement: [("talker".to_string(), "encoder/mlx9".to_string())].into(),
                ..ok.clone()
            },
            "fabric.placement.talker",
        ),
    ];
    for (spec, needle) in cases {
        let e = spec.validate().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Malformed);
        assert!(e.to_string().contains(needle), "{needle}: {e}");
    }
}
