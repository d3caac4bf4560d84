//! Loopback: engines in the same process, one memcpy per slice, the same grant checks as
//! every other transport.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, ErrorKind, Result};
use crate::segment::SegmentDescriptor;
use crate::transport::{
    Admission, BoxFuture, Link, LinkInfo, OpKind, SliceOp, Slicing, Transport, TransportKind,
    TransportSetup,
};

/// Engines running loopback in this process, by instance id.
fn registry() -> &'static Mutex<HashMap<u64, Admission>> {
    static REG: OnceLock<Mutex<HashMap<u64, Admission>>> = OnceLock::new();
    REG.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, HashMap<u64, Admission>> {
    registry().lock().unwrap_or_else(|p| p.into_inner())
}

/// Loopback's config.
#[derive(Debug, Clone)]
pub struct LoopbackConfig {
    /// Slice size for copies: between slices the copy yields, so deadlines and cancels stay
    /// prompt.
    pub slice_size: u64,
}

impl Default for LoopbackConfig {
    fn default() -> Self {
        Self {
            slice_size: 256 << 20,
        }
    }
}

impl TransportSetup for LoopbackConfig {
    fn kind(&self) -> TransportKind {
        TransportKind::Loopback
    }

    /// Makes the engine reachable by the other engines of this process.
    fn start(&self, engine: Admission) -> BoxFuture<'static, Result<Arc<dyn Transport>>> {
        let t = LoopbackTransport {
            slice_size: self.slice_size.max(1),
            instance: engine.instance(),
        };
        lock().insert(engine.instance(), engine);
        Box::pin(async move { Ok(Arc::new(t) as Arc<dyn Transport>) })
    }
}

/// Memcpy between engines of one process.
#[derive(Debug)]
pub struct LoopbackTransport {
    slice_size: u64,
    /// This engine, in the registry until shutdown.
    instance: u64,
}

impl Drop for LoopbackTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Transport for LoopbackTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Loopback
    }

    fn reaches(&self, peer: &SegmentDescriptor) -> bool {
        lock().get(&peer.instance).is_some_and(Admission::is_open)
    }

    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>> {
        let found = lock().get(&peer.instance).cloned();
        let slice_size = self.slice_size;
        Box::pin(async move {
            let engine = found.filter(Admission::is_open).ok_or_else(|| {
                Error::new(ErrorKind::Unreachable, "engine is not in this process")
                    .with_peer(&peer.name)
            })?;
            Ok(Arc::new(LoopbackLink {
                peer: engine,
                name: peer.name,
                slice_size,
            }) as Arc<dyn Link>)
        })
    }

    fn shutdown(&self) {
        lock().remove(&self.instance);
    }
}

struct LoopbackLink {
    peer: Admission,
    name: String,
    slice_size: u64,
}

impl Link for LoopbackLink {
    fn info(&self) -> LinkInfo {
        LinkInfo {
            transport: TransportKind::Loopback,
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

/// The loopback data path (sim's too, once its model lets the bytes land): the peer checks the grant, then one memcpy under its fence.
pub(crate) fn copy(peer: &Admission, name: &str, op: &SliceOp) -> Result<()> {
    let (region, admitted) = peer
        .admit(op.kind.access(), op.grant, op.grant_offset, op.len)
        .map_err(|e| e.with_peer(name))?;
    let _pin = admitted.entry.pin().map_err(|e| e.with_peer(name))?;
    match op.kind {
        OpKind::Write => op
            .local
            .copy_to(op.local_offset, &region, admitted.buffer_offset, op.len),
        OpKind::Read => region.copy_to(admitted.buffer_offset, &op.local, op.local_offset, op.len),
    }
}
