//! Transports: how bytes move between an engine's registered memory and a peer's.
//!
//! One small pair of traits. A [`Transport`] decides whether it can reach a peer and connects;
//! the resulting [`Link`] executes slices: one-sided writes into, or reads from, a peer's
//! granted memory. That shape fits every data path we have or plan: memcpy (loopback), a
//! socket (tcp), RDMA WRITE/READ with remote keys and polled completions (rdma), and device
//! copies (cuda). A decorator can wrap any transport (fault injection does).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::error::Result;
use crate::grant::GrantRef;
use crate::memory::Region;
use crate::segment::SegmentDescriptor;

pub mod fault;
pub mod loopback;
pub mod rdma;
pub mod shm;
pub mod tcp;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Counts one open connection in the engine's liveness while it exists (leak checks).
pub(crate) struct Counted(Arc<crate::batch::Liveness>);

impl Counted {
    pub(crate) fn new(live: &Arc<crate::batch::Liveness>) -> Self {
        live.connections
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Self(live.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.dec(&self.0.connections);
    }
}

/// Direction of a one-sided operation, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum OpKind {
    /// Local memory -> the peer's granted range.
    Write,
    /// The peer's granted range -> local memory.
    Read,
}

impl OpKind {
    /// The grant access this operation needs on the peer.
    pub fn access(self) -> crate::grant::Access {
        match self {
            OpKind::Write => crate::grant::Access::Write,
            OpKind::Read => crate::grant::Access::Read,
        }
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OpKind::Write => "write",
            OpKind::Read => "read",
        })
    }
}

/// One slice of a transfer, ready for a link: every range already checked locally; the peer
/// checks the grant again before it touches its memory.
#[derive(Debug, Clone)]
pub struct SliceOp {
    pub kind: OpKind,
    /// Local registered memory (held, so it outlives the operation even if unregistered).
    pub local: Arc<Region>,
    pub local_offset: u64,
    pub grant: GrantRef,
    /// Offset relative to the grant's start.
    pub grant_offset: u64,
    pub len: u64,
    /// The request's tag (see [`crate::Request::tag`]).
    pub tag: u64,
    /// Where this slice starts within its request, and the request's whole length.
    pub request_offset: u64,
    pub request_len: u64,
}

/// What a link is, for logs and reports: "this ran over tcp to 10.0.0.2:4000".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    pub transport: &'static str,
    pub device: String,
}

/// How the engine should cut requests for a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slicing {
    /// Largest slice handed to [`Link::execute`].
    pub slice_size: u64,
    /// Slices of one task in flight at once.
    pub in_flight: usize,
}

/// A way to reach peers.
pub trait Transport: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    /// Whether this transport can reach the peer at all (same process, has an endpoint, ...).
    fn reaches(&self, peer: &SegmentDescriptor) -> bool;
    /// Connects; the link is reused for every transfer to this peer.
    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>>;
}

/// An established path to one peer.
pub trait Link: Send + Sync + 'static {
    fn info(&self) -> LinkInfo;
    fn slicing(&self) -> Slicing;
    /// Moves one slice. Dropping the future cancels it; the link stays usable.
    fn execute(&self, op: SliceOp) -> BoxFuture<'static, Result<()>>;

    /// Drops every idle connection to the peer (fault injection uses it to model a link that
    /// went down; the next slice reconnects). A no-op where there are no connections.
    fn drop_connections(&self) {}

    /// Moves one slice right now on the caller's thread, if this link is a plain memory
    /// copy. The engine uses it for single-slice tasks to skip scheduling entirely; links
    /// that wait on anything (sockets, completions, decorators) keep the default `None`.
    fn execute_inline(&self, _op: &SliceOp) -> Option<Result<()>> {
        None
    }
}
