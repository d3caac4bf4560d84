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

/// One side of two soft-RoCE VMs (`ci/softroce.sh run --vms 2`): which node this is, both
/// nodes' addresses, and the run folder they share, through which each writes small files
/// (atomically: written aside, then renamed) that the other waits for.
pub struct TwoNodes {
    /// "0" or "1".
    pub node: String,
    /// This node's address on the link between the VMs.
    pub ip: String,
    /// The other node's address.
    pub peer_ip: String,
    run: std::path::PathBuf,
}

impl TwoNodes {
    /// This VM's side, or None, after saying on stderr that `test` was SKIPPED and how to run
    /// it, outside two VMs (a skip, not a failure: the one-VM lane runs the same binaries).
    pub fn from_env(test: &str, how: &str) -> Option<TwoNodes> {
        use std::io::Write;
        let var = |k: &str| std::env::var(k).ok();
        let why = match (var("SOFTROCE_NODE"), var("SOFTROCE_RUN")) {
            (Some(node), Some(run)) if var("SOFTROCE_NODES").as_deref() == Some("2") => {
                return Some(TwoNodes {
                    node,
                    ip: var("SOFTROCE_IP").expect("SOFTROCE_IP unset in a two-VM run"),
                    peer_ip: var("SOFTROCE_PEER_IP")
                        .expect("SOFTROCE_PEER_IP unset in a two-VM run"),
                    run: run.into(),
                });
            }
            (Some(_), Some(_)) => "one VM (pass --vms 2)".to_string(),
            _ => format!("needs two RoCE nodes; run it with `{how}`"),
        };
        let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
        None
    }

    /// Publishes `bytes` as `name` for the other node.
    pub fn put(&self, name: &str, bytes: &[u8]) {
        let tmp = self.run.join(format!("{name}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, bytes).unwrap();
        std::fs::rename(tmp, self.run.join(name)).unwrap();
    }

    /// Waits (up to three minutes: the other VM boots and builds its side under TCG) for the
    /// other node to publish `name`, and returns its bytes.
    pub fn wait(&self, name: &str) -> Vec<u8> {
        let p = self.run.join(name);
        let t = std::time::Instant::now();
        while !p.exists() {
            assert!(
                t.elapsed() < Duration::from_secs(180),
                "the other node never wrote {name}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        std::fs::read(&p).unwrap()
    }
}

/// Lower-case hex, for passing grants between nodes as text lines.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The inverse of [`hex`].
pub fn unhex(l: &str) -> Vec<u8> {
    (0..l.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&l[i..i + 2], 16).unwrap())
        .collect()
}
