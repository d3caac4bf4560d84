//! Loopback: engines in the same process, one memcpy per slice, the same grant checks as
//! every other transport.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::engine::EngineCore;
use crate::error::{Error, ErrorKind, Result};
use crate::segment::SegmentDescriptor;
use crate::transport::{BoxFuture, Link, LinkInfo, OpKind, SliceOp, Slicing, Transport};

/// Engines alive in this process, by instance id.
fn registry() -> &'static Mutex<HashMap<u64, Weak<EngineCore>>> {
    static REG: OnceLock<Mutex<HashMap<u64, Weak<EngineCore>>>> = OnceLock::new();
    REG.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, HashMap<u64, Weak<EngineCore>>> {
    registry().lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn register(core: &Arc<EngineCore>) {
    lock().insert(core.instance, Arc::downgrade(core));
}

pub(crate) fn unregister(instance: u64) {
    lock().remove(&instance);
}

/// Memcpy between engines of one process.
#[derive(Debug, Clone)]
pub struct LoopbackTransport {
    slice_size: u64,
}

impl LoopbackTransport {
    pub fn new(slice_size: u64) -> Self {
        Self {
            slice_size: slice_size.max(1),
        }
    }
}

impl Transport for LoopbackTransport {
    fn name(&self) -> &'static str {
        "loopback"
    }

    fn reaches(&self, peer: &SegmentDescriptor) -> bool {
        lock()
            .get(&peer.instance)
            .is_some_and(|w| w.strong_count() > 0)
    }

    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>> {
        let found = lock().get(&peer.instance).cloned();
        let slice_size = self.slice_size;
        Box::pin(async move {
            let core = found.filter(|w| w.strong_count() > 0).ok_or_else(|| {
                Error::new(ErrorKind::Unreachable, "engine is not in this process")
                    .with_peer(&peer.name)
            })?;
            Ok(Arc::new(LoopbackLink {
                peer: core,
                name: peer.name,
                slice_size,
            }) as Arc<dyn Link>)
        })
    }
}

struct LoopbackLink {
    peer: Weak<EngineCore>,
    name: String,
    slice_size: u64,
}

impl Link for LoopbackLink {
    fn info(&self) -> LinkInfo {
        LinkInfo {
            transport: "loopback",
            device: "memcpy".into(),
        }
    }

    fn slicing(&self) -> Slicing {
        // One slice at a time: the copy runs on the caller's thread, so more in flight would
        // only interleave, and yielding between slices keeps deadlines and cancels prompt.
        Slicing {
            slice_size: self.slice_size,
            in_flight: 1,
        }
    }

    fn execute(&self, op: SliceOp) -> BoxFuture<'static, Result<()>> {
        let peer = self.peer.clone();
        let name = self.name.clone();
        Box::pin(async move {
            // Between slices of a large copy, let deadlines, cancels and other tasks run.
            tokio::task::yield_now().await;
            copy(&peer, &name, &op)
        })
    }

    fn execute_inline(&self, op: &SliceOp) -> Option<Result<()>> {
        Some(copy(&self.peer, &self.name, op))
    }
}

/// The loopback data path: the peer checks the grant, then one memcpy under its fence.
fn copy(peer: &Weak<EngineCore>, name: &str, op: &SliceOp) -> Result<()> {
    let core = peer.upgrade().ok_or_else(|| {
        Error::new(ErrorKind::PeerDisconnected, "peer engine was dropped").with_peer(name)
    })?;
    let (region, admitted) = core
        .admit(op.kind.access(), op.grant, op.grant_offset, op.len)
        .map_err(|e| e.with_peer(name))?;
    drop(core);
    let _pin = admitted.entry.pin().map_err(|e| e.with_peer(name))?;
    match op.kind {
        OpKind::Write => op
            .local
            .copy_to(op.local_offset, &region, admitted.buffer_offset, op.len),
        OpKind::Read => region.copy_to(admitted.buffer_offset, &op.local, op.local_offset, op.len),
    }
}
