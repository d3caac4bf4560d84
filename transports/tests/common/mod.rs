//! Shared test rig: engine pairs over a chosen transport, data patterns, and a gate decorator
//! that parks slices until the test releases them (faults are scripts, not sleeps).

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use omnirig_transports::{
    Engine, EngineConfig, InProcessStore, Link, LinkInfo, LoopbackConfig, Result,
    SegmentDescriptor, ShmConfig, SliceOp, Slicing, TcpConfig, Transport, TransportKind, Usage,
    transport::BoxFuture,
};
use tokio::sync::{Notify, watch};

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

/// Scripted gate: the first `free` slices pass; later ones park until `open()`.
pub struct Gate {
    free: usize,
    seen: AtomicUsize,
    parked: AtomicUsize,
    parked_changed: Notify,
    open: watch::Sender<bool>,
    late: std::sync::Mutex<Vec<Result<()>>>,
    late_changed: Notify,
}

impl Gate {
    pub fn new(free: usize) -> Arc<Self> {
        Arc::new(Self {
            free,
            seen: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
            parked_changed: Notify::new(),
            open: watch::channel(false).0,
            late: Default::default(),
            late_changed: Notify::new(),
        })
    }

    pub fn open(&self) {
        self.open.send_replace(true);
    }

    /// Waits until `n` slices are parked at the gate.
    pub async fn wait_parked(&self, n: usize) {
        loop {
            let notified = self.parked_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.parked.load(Ordering::Acquire) >= n {
                return;
            }
            notified.await;
        }
    }

    /// Waits until `n` parked slices have run, and returns their outcomes.
    pub async fn wait_ran(&self, n: usize) -> Vec<Result<()>> {
        loop {
            let notified = self.late_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let late = self.late.lock().unwrap();
                if late.len() >= n {
                    return late.clone();
                }
            }
            notified.await;
        }
    }

    /// A decorator for [`EngineConfig::decorator`].
    pub fn decorator(self: &Arc<Self>) -> omnirig_transports::TransportDecorator {
        let gate = self.clone();
        Arc::new(move |inner: Arc<dyn Transport>| {
            Arc::new(Gated {
                inner,
                gate: gate.clone(),
            }) as Arc<dyn Transport>
        })
    }
}

struct Gated {
    inner: Arc<dyn Transport>,
    gate: Arc<Gate>,
}

impl Transport for Gated {
    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }
    fn reaches(&self, peer: &SegmentDescriptor) -> bool {
        self.inner.reaches(peer)
    }
    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>> {
        let inner = self.inner.connect(peer);
        let gate = self.gate.clone();
        Box::pin(async move {
            Ok(Arc::new(GatedLink {
                inner: inner.await?,
                gate,
            }) as Arc<dyn Link>)
        })
    }
}

struct GatedLink {
    inner: Arc<dyn Link>,
    gate: Arc<Gate>,
}

impl Link for GatedLink {
    fn info(&self) -> LinkInfo {
        self.inner.info()
    }
    fn slicing(&self) -> Slicing {
        // One slice at a time, so "the first N pass" is well defined.
        Slicing {
            in_flight: 1,
            ..self.inner.slicing()
        }
    }
    fn execute(&self, op: SliceOp) -> BoxFuture<'static, Result<()>> {
        let gate = self.gate.clone();
        let inner = self.inner.clone();
        if gate.seen.fetch_add(1, Ordering::AcqRel) < gate.free {
            return inner.execute(op);
        }
        // A parked slice runs in its own task, so it goes on once the gate opens even if its
        // batch gave up on it (like a work request already posted to a NIC): exactly the late
        // write a revoked grant must stop. Its outcome is recorded for the test.
        let mut rx = gate.open.subscribe();
        gate.parked.fetch_add(1, Ordering::AcqRel);
        gate.parked_changed.notify_waiters();
        let task = tokio::spawn(async move {
            let _ = rx.wait_for(|open| *open).await;
            let r = inner.execute(op).await;
            gate.late.lock().unwrap().push(r.clone());
            gate.late_changed.notify_waiters();
            r
        });
        Box::pin(async move { task.await.expect("gated slice panicked") })
    }
}
