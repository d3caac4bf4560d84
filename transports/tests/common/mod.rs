//! Shared test rig: engine pairs over a chosen transport, data patterns, and (from
//! omnirig-test-support) the gate decorator that parks slices until the test releases them.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub use omnirig_test_support::slices::Gate;
use omnirig_transports::{
    CudaConfig, Engine, EngineConfig, InProcessStore, LoopbackConfig, RdmaConfig, ShmConfig,
    TcpConfig, TransportKind, Usage,
};

/// Whether `transport` cannot run here (rdma built without its feature, or no RDMA device):
/// says so on stderr, past libtest's capture, with how to run it. OMNIRIG_RDMA_REQUIRED=1 (the
/// soft-RoCE lane) makes it a failure instead.
pub fn unavailable(transport: &str) -> bool {
    use std::io::Write;
    if transport != "rdma" {
        return false;
    }
    #[cfg(feature = "rdma")]
    let why = match omnirig_transports::transport::rdma::verbs::device_names() {
        Ok(names) if !names.is_empty() => return false,
        Ok(_) => "no RDMA device".to_string(),
        Err(e) => e.to_string(),
    };
    #[cfg(not(feature = "rdma"))]
    let why = "built without the rdma feature".to_string();
    assert!(
        std::env::var("OMNIRIG_RDMA_REQUIRED").as_deref() != Ok("1"),
        "OMNIRIG_RDMA_REQUIRED=1 but {why}"
    );
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED an rdma case: {why}. Build with --features rdma and run the test binary with \
         ci/softroce.sh run -- ... (a QEMU VM with soft-RoCE)"
    );
    true
}

/// A unique engine name per test, so tests sharing a process never collide.
pub fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Small slices so that multi-slice behaviour shows at test sizes. `transport` is a kind's
/// name (tests name their cases by it).
pub fn config(name: &str, transport: &str, store: &Arc<InProcessStore>) -> EngineConfig {
    let kind: TransportKind = transport.parse().unwrap();
    let mut c = EngineConfig::for_kind(name, kind).store(store.clone());
    // Override only what this engine runs, so each engine stays exactly what for_kind builds.
    for t in c.transports.clone() {
        c = match t.kind() {
            TransportKind::Loopback => c.with(LoopbackConfig {
                slice_size: 1 << 20,
            }),
            TransportKind::Tcp => c.with(TcpConfig {
                slice_size: 1 << 20,
                streams: 2,
                ..TcpConfig::default()
            }),
            TransportKind::Shm => c.with(ShmConfig {
                slice_size: 1 << 20,
                streams: 2,
                ..ShmConfig::default()
            }),
            TransportKind::Rdma => c.with(RdmaConfig {
                slice_size: 1 << 20,
                ..RdmaConfig::default()
            }),
            TransportKind::Cuda => c.with(CudaConfig {
                slice_size: 1 << 20,
                ..CudaConfig::default()
            }),
            // The process-wide one-node fabric; its slices are 1 MiB already.
            TransportKind::Sim => c,
        };
    }
    c
}

pub async fn engines(transport: &'static str, n: usize) -> Vec<Engine> {
    let store = InProcessStore::new();
    let mut out = Vec::new();
    for i in 0..n {
        out.push(
            Engine::new(config(&unique(&format!("e{i}")), transport, &store))
                .await
                .unwrap(),
        );
    }
    out
}

/// Engines `a` (sender, its slices pass through a gate letting `free` through) and `b`.
pub async fn gated_pair(transport: &'static str, free: usize) -> (Engine, Engine, Arc<Gate>) {
    let store = InProcessStore::new();
    let gate = Gate::new(free);
    let a = Engine::new(config(&unique("a"), transport, &store).decorator(gate.decorator()))
        .await
        .unwrap();
    let b = Engine::new(config(&unique("b"), transport, &store))
        .await
        .unwrap();
    (a, b, gate)
}

/// Deterministic bytes that differ for every (seed, position).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while out.len() < len {
        // splitmix64
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

pub const CANARY: u8 = 0xA5;

/// Waits until the engine holds nothing transient and returns its usage.
pub async fn idle(e: &Engine) -> Usage {
    e.wait_idle(Duration::from_secs(10)).await.unwrap()
}
