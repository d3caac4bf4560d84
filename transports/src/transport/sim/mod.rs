//! Sim: engines of one process on a modelled fabric ([`fabric`]). Bytes are really copied
//! (the same grant checks and fenced memcpy as loopback), but only once the model says they
//! have crossed: each slice reserves its route's queues, sleeps until it lands on tokio's
//! clock, then copies. Under a paused clock (a current-thread runtime started paused) that
//! sleep is virtual, so a run is a function of its inputs and its fabric's seed: see
//! `docs/sim.md`.
//!
//! Why tokio's paused clock and not turmoil or madsim: the pipeline is already tokio code
//! (engine, connectors, control links) and only needs virtual time and a deterministic
//! scheduler, which a current-thread runtime with a paused clock gives without touching it.
//! turmoil simulates hosts and a socket network (we model RDMA-style one-sided writes into
//! granted memory, not sockets), and madsim replaces tokio at build time with its own crate
//! (`--cfg madsim`), which would fork every build of the workspace.

pub mod fabric;

use std::sync::{Arc, Mutex};

pub use fabric::{Fabric, FabricSpec, LinkSpec, NicSpec, NodeSpec, PathModel, Place, QueueUse};

use crate::error::{Error, ErrorKind, Result};
use crate::segment::SegmentDescriptor;
use crate::transport::{
    Admission, BoxFuture, Link, LinkInfo, SliceOp, Slicing, Transport, TransportKind,
    TransportSetup,
};
use fabric::{Route, lock};

/// Sim's config: the fabric and where on it this engine sits.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub fabric: Arc<Fabric>,
    /// `node` or `node/nic`; `None`: the fabric's first node and NIC.
    pub place: Option<String>,
    /// Who this engine belongs to, for the trace (a stage's name); default: the node.
    pub owner: Option<String>,
}

impl Default for SimConfig {
    /// The process-wide one-node fabric.
    fn default() -> Self {
        Self {
            fabric: Fabric::process_default(),
            place: None,
            owner: None,
        }
    }
}

impl SimConfig {
    /// An engine at `place` (`node` or `node/nic`) of `fabric`, named `owner` in the trace.
    pub fn on(fabric: &Arc<Fabric>, place: &str, owner: &str) -> Self {
        Self {
            fabric: fabric.clone(),
            place: Some(place.into()),
            owner: Some(owner.into()),
        }
    }
}

impl TransportSetup for SimConfig {
    fn kind(&self) -> TransportKind {
        TransportKind::Sim
    }

    fn start(&self, engine: Admission) -> BoxFuture<'static, Result<Arc<dyn Transport>>> {
        let fabric = self.fabric.clone();
        let place = match &self.place {
            Some(p) => fabric.resolve(p),
            None => Ok(Place { node: 0, nic: 0 }),
        };
        let owner = self.owner.clone();
        Box::pin(async move {
            let place = place?;
            let owner: Arc<str> = owner
                .unwrap_or_else(|| fabric.node_name(place).to_string())
                .into();
            lock(&fabric.engines).insert(engine.instance(), (engine.clone(), place));
            Ok(Arc::new(SimTransport {
                fabric,
                place,
                owner,
                instance: engine.instance(),
            }) as Arc<dyn Transport>)
        })
    }
}

/// One engine on a fabric.
#[derive(Debug)]
pub struct SimTransport {
    fabric: Arc<Fabric>,
    place: Place,
    owner: Arc<str>,
    instance: u64,
}

impl Drop for SimTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Transport for SimTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Sim
    }

    fn reaches(&self, peer: &SegmentDescriptor) -> bool {
        lock(&self.fabric.engines)
            .get(&peer.instance)
            .is_some_and(|(a, p)| a.is_open() && self.fabric.route(self.place, *p).is_ok())
    }

    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>> {
        let found = lock(&self.fabric.engines).get(&peer.instance).cloned();
        let (fabric, from, owner) = (self.fabric.clone(), self.place, self.owner.clone());
        Box::pin(async move {
            let (engine, to) = found.filter(|(a, _)| a.is_open()).ok_or_else(|| {
                Error::new(ErrorKind::Unreachable, "engine is not on this fabric")
                    .with_peer(&peer.name)
            })?;
            let route = fabric
                .route(from, to)
                .map_err(|e| e.with_peer(&peer.name))?;
            let back = fabric
                .route(to, from)
                .map_err(|e| e.with_peer(&peer.name))?;
            Ok(Arc::new(SimLink {
                fabric,
                peer: engine,
                name: peer.name,
                route,
                back,
                owner,
            }) as Arc<dyn Link>)
        })
    }

    fn shutdown(&self) {
        lock(&self.fabric.engines).remove(&self.instance);
    }
}

struct SimLink {
    fabric: Arc<Fabric>,
    peer: Admission,
    name: String,
    /// Writes go this way; reads come back the other.
    route: Route,
    back: Route,
    owner: Arc<str>,
}

impl Link for SimLink {
    fn info(&self) -> LinkInfo {
        LinkInfo {
            transport: TransportKind::Sim,
            device: format!("sim {}", self.route.label),
        }
    }

    fn slicing(&self) -> Slicing {
        let s = self.fabric.spec();
        Slicing {
            slice_size: s.slice_bytes,
            in_flight: s.in_flight,
        }
    }

    fn execute(&self, op: SliceOp) -> BoxFuture<'static, Result<()>> {
        let fabric = self.fabric.clone();
        // The bytes cross one way; the other way carries the answer that completes a write
        // (the RDMA ACK, the tcp owner's reply) or the request that starts a read. Either
        // way a slice costs a round trip's latency, as on the wire.
        let write = matches!(op.kind, crate::transport::OpKind::Write);
        let (route, answer_ns) = if write {
            (self.route.clone(), self.back.latency_ns())
        } else {
            (self.back.clone(), self.route.latency_ns())
        };
        let (peer, name, owner) = (self.peer.clone(), self.name.clone(), self.owner.clone());
        Box::pin(async move {
            let now = fabric.now_ns();
            let leaves = if write { now } else { now + answer_ns };
            let lands = fabric.reserve(&route, op.len, leaves);
            let what = format!(
                "{owner} {} {} tag={:016x} at={} len={}",
                op.kind, route.label, op.tag, op.request_offset, op.len
            );
            fabric.event(now, format!("slice {what} lands={lands}"));
            // Dropped here (a deadline, a cancel): the bytes were on the wire but never land.
            tokio::time::sleep_until(fabric.instant(lands)).await;
            let r = super::loopback::copy(&peer, &name, &op);
            let outcome = match &r {
                Ok(()) => "ok".to_string(),
                Err(e) => format!("refused {:?}", e.kind()),
            };
            fabric.event(fabric.now_ns(), format!("landed {what} {outcome}"));
            if write && r.is_ok() {
                // Landed; the initiator learns it when the acknowledgement is back.
                tokio::time::sleep_until(fabric.instant(lands + answer_ns)).await;
            }
            r
        })
    }
}

/// A one-way message channel across the fabric (the pipeline's control messages): each
/// message reserves the route like a slice and is delivered, in order, when it lands.
#[derive(Debug, Clone)]
pub struct Channel {
    fabric: Arc<Fabric>,
    route: Route,
    name: Arc<str>,
    /// Last delivery time: messages of one channel never overtake each other (jitter would).
    last: Arc<Mutex<u64>>,
}

impl Channel {
    /// From `from` to `to` (`node` or `node/nic`), named `name` in the trace.
    pub fn new(fabric: &Arc<Fabric>, from: &str, to: &str, name: &str) -> Result<Channel> {
        let route = fabric.route(fabric.resolve(from)?, fabric.resolve(to)?)?;
        Ok(Channel {
            fabric: fabric.clone(),
            route,
            name: name.into(),
            last: Arc::default(),
        })
    }

    /// A message of `bytes` leaves now, described as `what` in the trace: the instant it is
    /// delivered.
    pub fn send(&self, bytes: u64, what: &str) -> tokio::time::Instant {
        let now = self.fabric.now_ns();
        let lands = self.fabric.reserve(&self.route, bytes, now);
        let mut last = lock(&self.last);
        let at = lands.max(*last);
        *last = at;
        drop(last);
        self.fabric.event(
            now,
            format!(
                "msg {} {} {what} bytes={bytes} lands={at}",
                self.name, self.route.label
            ),
        );
        self.fabric.instant(at)
    }
}
