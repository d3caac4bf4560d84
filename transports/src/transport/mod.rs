//! Transports: how bytes move between an engine's registered memory and a peer's.
//!
//! A [`TransportSetup`] (a transport's config) starts a [`Transport`] for one engine; the
//! transport decides whether it can reach a peer and connects; the resulting [`Link`] executes
//! slices: one-sided writes into, or reads from, a peer's granted memory. The engine tells the
//! transport about memory and grants through hooks (register, grant, revoke, unregister), and
//! its server side admits peers through an [`Admission`]. That shape fits every data path we
//! have or plan: memcpy (loopback), a socket (tcp), one copy by the owner (shm), RDMA
//! WRITE/READ with per-grant keys and polled completions (rdma), and device copies (cuda). A
//! decorator can wrap any transport's data path (fault injection does). `docs/engine.md`
//! walks through adding a transport.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Weak};

use crate::batch::Liveness;
use crate::engine::EngineCore;
use crate::error::{Error, ErrorKind, Result};
use crate::grant::{Access, Admitted, Grant, GrantRef};
use crate::memory::Region;
use crate::segment::{Endpoint, SegmentDescriptor};
pub use kind::TransportKind;

pub mod cuda;
pub mod fault;
pub mod kind;
pub mod loopback;
pub mod rdma;
pub mod shm;
pub mod sim;
mod spare_core;
pub mod tcp;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Counts one open connection in the engine's usage while it exists (leak checks); from
/// [`Admission::connection`].
pub struct Counted(Arc<Liveness>);

impl Counted {
    pub(crate) fn new(live: &Arc<Liveness>) -> Self {
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
    /// The key the granting engine's transport of this link's kind attached to the grant
    /// ([`Transport::on_grant`]; an RDMA rkey and address), if it attached one.
    pub key: Option<Arc<[u8]>>,
    /// Offset relative to the grant's start.
    pub grant_offset: u64,
    pub len: u64,
    /// The request's tag (see [`crate::Request::tag`]).
    pub tag: u64,
    /// Where this slice starts within its request, and the request's whole length.
    pub request_offset: u64,
    pub request_len: u64,
    /// Whether this is the only slice its task drives. Only then may a link hold the thread
    /// while it waits for the reply (tcp, shm): where one task drives several slices (a
    /// batch's requests in `Engine::transfer`, a request's slices), holding the thread
    /// keeps the others from even being sent, and a batch of small writes goes out one
    /// round trip at a time.
    pub alone: bool,
}

/// What a link is, for logs and reports: "this ran over tcp to 10.0.0.2:4000".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    pub transport: TransportKind,
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

/// A way to reach peers: one transport, started for one engine.
///
/// # Writing a transport
///
/// A new transport lives in its own folder under `transport/`, adds a variant to
/// [`TransportKind`] and one line to [`default_setup`]. It provides two things:
///
/// 1. A setup (its config type) implementing [`TransportSetup`]: `kind()` and `start(engine)`.
///    `start` binds whatever serves this engine's memory to peers (a listener, a device
///    context) and keeps the [`Admission`] it is given: the server side calls
///    [`Admission::admit`] before it touches a byte of local memory for a peer, and holds the
///    returned [`crate::grant::FencePin`] (from `admitted.entry.pin()`) for exactly one bounded
///    copy or non-blocking system call, so revocation can fence it.
/// 2. The started transport, implementing this trait. Required: [`kind`](Self::kind),
///    [`reaches`](Self::reaches) (from the peer's [`Endpoint`] of this kind) and
///    [`connect`](Self::connect) (a [`Link`] that executes slices). Optional, all defaulted:
///    - [`endpoint`](Self::endpoint): the address bytes peers need, published in this engine's
///      [`SegmentDescriptor`]; the transport alone encodes and validates them.
///    - [`memory`](Self::memory): a [`MemoryProvider`] when buffers must be allocated in a
///      special way (shm: sealed memfds). At most one transport per engine provides one.
///    - Hooks, called by the engine in this order over a buffer's life, on the transport
///      itself (never through a decorator):
///      [`on_register`](Self::on_register) (may refuse: the registration fails with that
///      error and nothing stays registered), [`on_grant`](Self::on_grant) (may attach opaque
///      key bytes that travel inside the [`Grant`] to the initiator, e.g. an RDMA rkey; may
///      refuse), [`on_revoke`](Self::on_revoke) (must return only once the transport can no
///      longer let that grant be used), [`on_unregister`](Self::on_unregister).
///    - [`describe`](Self::describe): learn a peer's descriptor from an address without a
///      metadata store (tcp does).
///    - [`shutdown`](Self::shutdown): stop serving (close listeners and connections); called
///      once when the engine shuts down, after every grant was revoked.
///
/// Hooks run on the engine's calling thread, outside its locks; they must not call back into
/// the engine. Grants revoked by expiry, by [`crate::Engine::revoke`] and at shutdown all go
/// through [`on_revoke`](Self::on_revoke).
pub trait Transport: Send + Sync + 'static {
    fn kind(&self) -> TransportKind;

    /// Whether this transport can reach the peer at all (same process, has an endpoint, ...).
    fn reaches(&self, peer: &SegmentDescriptor) -> bool;

    /// Connects; the link is reused for every transfer to this peer.
    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>>;

    /// What peers need to reach this engine over this transport, if it serves peers.
    fn endpoint(&self) -> Option<Endpoint> {
        None
    }

    /// How this engine's buffers must be allocated, if this transport needs a say.
    fn memory(&self) -> Option<Arc<dyn MemoryProvider>> {
        None
    }

    /// A buffer was registered (allocated or adopted). An error refuses the registration:
    /// the engine undoes it (calling [`on_unregister`](Self::on_unregister) on the transports
    /// that accepted) and returns the error to the caller.
    fn on_register(&self, _buffer: u32, _region: &Arc<Region>) -> Result<()> {
        Ok(())
    }

    /// A buffer was unregistered (or the engine shut down): release what `on_register` made.
    /// No grant on it is live any more.
    fn on_unregister(&self, _buffer: u32, _region: &Arc<Region>) {}

    /// A grant is being issued on `region`. `Ok(Some(bytes))` attaches a key the initiator's
    /// transport of the same kind reads with [`Grant::key`] (at most
    /// [`crate::grant::MAX_KEY_BYTES`]); an error refuses the grant (it is revoked, with
    /// [`on_revoke`](Self::on_revoke) on the transports that already accepted).
    fn on_grant(&self, _grant: &Grant, _region: &Arc<Region>) -> Result<Option<Vec<u8>>> {
        Ok(None)
    }

    /// A grant was revoked (explicitly, by expiry, or at shutdown). Blocking: returns only
    /// once this transport can no longer let the grant be used (RDMA: its memory window or
    /// key is invalidated). Called after the engine's own fence, so no engine-side access
    /// under the grant is running. Must not wait on the async runtime. Also called for a
    /// grant another transport refused in [`on_grant`](Self::on_grant), which this one may
    /// never have seen: ignore epochs you hold nothing for.
    fn on_revoke(&self, _grant: &GrantRef) {}

    /// Asks the engine at `addr` for its descriptor, if this transport can (tcp can).
    fn describe(&self, _addr: SocketAddr) -> Option<BoxFuture<'static, Result<SegmentDescriptor>>> {
        None
    }

    /// Stops serving peers: listeners and connections close. Called once, at engine shutdown.
    fn shutdown(&self) {}
}

/// How a transport is configured and started for an engine (its config type implements it).
pub trait TransportSetup: Send + Sync + 'static {
    fn kind(&self) -> TransportKind;

    /// Starts the transport for the engine `engine` admits for: binds its server side, if any.
    fn start(&self, engine: Admission) -> BoxFuture<'static, Result<Arc<dyn Transport>>>;
}

/// The registration line per transport kind: its default setup.
pub fn default_setup(kind: TransportKind) -> Arc<dyn TransportSetup> {
    match kind {
        TransportKind::Loopback => Arc::new(loopback::LoopbackConfig::default()),
        TransportKind::Tcp => Arc::new(tcp::TcpConfig::default()),
        TransportKind::Shm => Arc::new(shm::ShmConfig::default()),
        TransportKind::Rdma => Arc::new(rdma::RdmaConfig::default()),
        TransportKind::Cuda => Arc::new(cuda::CudaConfig::default()),
        TransportKind::Sim => Arc::new(sim::SimConfig::default()),
    }
}

/// Allocates an engine's buffers when a transport needs them made a particular way.
pub trait MemoryProvider: Send + Sync + 'static {
    /// `len` (> 0) zeroed, page-aligned bytes.
    fn allocate(&self, len: usize) -> Result<Region>;
}

/// A transport's server-side handle on its engine: admits peers' accesses under grants.
/// Holds the engine weakly: a transport's tasks never keep an engine alive, and every call
/// after the engine is gone fails with `PeerDisconnected` naming it.
#[derive(Clone)]
pub struct Admission {
    core: Weak<EngineCore>,
    name: Arc<str>,
    instance: u64,
    live: Arc<Liveness>,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("engine", &self.name)
            .finish_non_exhaustive()
    }
}

impl Admission {
    pub(crate) fn new(core: &Arc<EngineCore>) -> Self {
        Self {
            core: Arc::downgrade(core),
            name: core.name.as_str().into(),
            instance: core.instance,
            live: core.live.clone(),
        }
    }

    pub(crate) fn core(&self) -> Result<Arc<EngineCore>> {
        self.core.upgrade().ok_or_else(|| {
            Error::new(
                ErrorKind::PeerDisconnected,
                format!("engine {} is shut down", self.name),
            )
        })
    }

    /// The engine's segment name.
    pub fn engine(&self) -> &str {
        &self.name
    }

    /// The engine's instance (random per start; see [`SegmentDescriptor::instance`]).
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// Whether the engine still serves (not dropped, not shut down).
    pub fn is_open(&self) -> bool {
        self.core().is_ok_and(|c| !c.is_closed())
    }

    /// Checks a peer's `access` to `offset..offset+len` of the grant `wire` names (relative to
    /// the grant). On success: the buffer's memory and where in it the range starts. Pin the
    /// grant (`admitted.entry.pin()`) around each copy or system call that touches it.
    pub fn admit(
        &self,
        access: Access,
        wire: GrantRef,
        offset: u64,
        len: u64,
    ) -> Result<(Arc<Region>, Admitted)> {
        self.core()?.admit(access, wire, offset, len)
    }

    /// The engine's descriptor as peers see it now.
    pub fn descriptor(&self) -> Result<SegmentDescriptor> {
        Ok(self.core()?.descriptor())
    }

    /// Counts one open connection in the engine's usage while the guard lives (leak checks).
    pub fn connection(&self) -> Counted {
        Counted::new(&self.live)
    }

    pub(crate) fn live(&self) -> &Arc<Liveness> {
        &self.live
    }
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

    /// Starts one slice on the caller's thread and waits for it a short, bounded while (a
    /// device whose completions come back within microseconds: rdma). The engine uses it for
    /// the one slice of a one-request batch on a connected peer, skipping its task machinery
    /// when the slice ends within the wait. `None`: not possible right now, use `execute`.
    fn start_inline(&self, _op: &SliceOp) -> Option<Started> {
        None
    }

    /// Starts the slices of a batch's single-slice requests together (`ops`, one per request)
    /// where the link can hand them to its device as one (rdma: one run, its work requests
    /// posted as chains, one doorbell each) instead of one `execute` each. Returns one future
    /// per op, each ending as that op's `execute` would (dropping one before it ended stops
    /// the whole group; the others then run again on their own). `None`: not possible now
    /// (not connected, no room), use `execute`.
    fn start_batch(&self, _ops: &[SliceOp]) -> Option<Vec<BoxFuture<'static, Result<()>>>> {
        None
    }
}

/// A slice [`Link::start_inline`] started.
pub enum Started {
    /// It ended on the caller's thread.
    Done(Result<()>),
    /// It is under way; this future finishes it (dropping it cancels the slice, as dropping
    /// `execute`'s does).
    Pending(BoxFuture<'static, Result<()>>),
}
