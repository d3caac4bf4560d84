//! The engine: registered buffers, grants, peers and batches, tied together.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::batch::{Batch, BatchShared, Liveness, TaskState, slices};
use crate::error::{Error, ErrorKind, Result};
use crate::grant::{
    Access, Admitted, Grant, GrantKey, GrantRef, GrantSpec, GrantTable, MAX_KEY_BYTES,
};
use crate::idmap::IdMap;
use crate::memory::Region;
use crate::metadata::{InProcessStore, MetadataStore};
use crate::segment::{BufferDescriptor, Endpoint, MemoryKind, SegmentDescriptor, validate_name};
use crate::transport::tcp;
use crate::transport::{
    Admission, BoxFuture, Link, LinkInfo, MemoryProvider, OpKind, SliceOp, Started, Transport,
    TransportKind, TransportSetup, default_setup,
};

/// Which transports an engine may select for its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportPolicy {
    /// The first of the engine's transports (in [`TransportKind::ALL`] order: same process,
    /// same host, anywhere) that reaches the peer.
    #[default]
    Auto,
    /// Only this kind of transport.
    Only(TransportKind),
}

/// Wraps every transport the engine builds (fault injection, tracing, ...). A decorator sees
/// the data path only (`reaches`, `connect` and the links); the engine calls a transport's
/// hooks, endpoint and memory provider on the transport itself.
pub type TransportDecorator = Arc<dyn Fn(Arc<dyn Transport>) -> Arc<dyn Transport> + Send + Sync>;

/// How to build an engine.
#[derive(Clone)]
pub struct EngineConfig {
    /// The segment name peers use to find this engine.
    pub name: String,
    /// The transports to start, each with its own config (see [`crate::transport::default_setup`]);
    /// at most one per kind.
    pub transports: Vec<Arc<dyn TransportSetup>>,
    pub policy: TransportPolicy,
    /// Lock every buffer's pages in RAM (mlock), best effort: [`Usage::locked_bytes`] says
    /// how much was locked.
    pub lock_memory: bool,
    /// Where to publish and look up descriptors; `None` uses the process-wide in-process store.
    pub store: Option<Arc<dyn MetadataStore>>,
    pub decorator: Option<TransportDecorator>,
}

impl std::fmt::Debug for EngineConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineConfig")
            .field("name", &self.name)
            .field(
                "transports",
                &self.transports.iter().map(|t| t.kind()).collect::<Vec<_>>(),
            )
            .field("policy", &self.policy)
            .field("lock_memory", &self.lock_memory)
            .finish_non_exhaustive()
    }
}

impl EngineConfig {
    /// Defaults: loopback for engines of this process, tcp (on an ephemeral port of
    /// 127.0.0.1) for the rest, the process-wide metadata store.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            transports: vec![
                default_setup(TransportKind::Loopback),
                default_setup(TransportKind::Tcp),
            ],
            policy: TransportPolicy::Auto,
            lock_memory: false,
            store: None,
            decorator: None,
        }
    }

    /// The engine for one transport kind, with that kind's default config: the one place
    /// callers build "an engine over X". Peers are reached only over `kind`. Kinds that cross
    /// processes also run tcp, which serves the descriptor handshake
    /// ([`Engine::connect_addr`]); loopback runs alone.
    pub fn for_kind(name: impl Into<String>, kind: TransportKind) -> Self {
        let mut c = Self::new(name).policy(TransportPolicy::Only(kind));
        c.transports.clear();
        c = c.with_setup(default_setup(kind));
        if kind.crosses_processes() && kind != TransportKind::Tcp {
            c = c.with_setup(default_setup(TransportKind::Tcp));
        }
        c
    }

    /// Adds a transport, or replaces the config of one of the same kind.
    pub fn with(self, setup: impl TransportSetup) -> Self {
        self.with_setup(Arc::new(setup))
    }

    /// As [`with`](Self::with), for a shared setup.
    pub fn with_setup(mut self, setup: Arc<dyn TransportSetup>) -> Self {
        let kind = setup.kind();
        match self.transports.iter_mut().find(|t| t.kind() == kind) {
            Some(t) => *t = setup,
            None => self.transports.push(setup),
        }
        self
    }

    /// Drops the transport of `kind`, if configured.
    pub fn without(mut self, kind: TransportKind) -> Self {
        self.transports.retain(|t| t.kind() != kind);
        self
    }

    pub fn store(mut self, store: Arc<dyn MetadataStore>) -> Self {
        self.store = Some(store);
        self
    }

    pub fn policy(mut self, policy: TransportPolicy) -> Self {
        self.policy = policy;
        self
    }

    pub fn decorator(mut self, d: TransportDecorator) -> Self {
        self.decorator = Some(d);
        self
    }

    pub fn lock_memory(mut self, lock: bool) -> Self {
        self.lock_memory = lock;
        self
    }
}

/// What an engine holds right now; every field returns to its baseline after a request ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Usage {
    pub buffers: usize,
    pub registered_bytes: u64,
    /// Grants handed to peers and still live.
    pub grants: usize,
    pub granted_bytes: u64,
    /// Local leases (the owner's access or a transfer's own source/destination range).
    pub leases: usize,
    pub batches: usize,
    pub tasks: usize,
    /// Open transport connections, both directions.
    pub connections: usize,
    /// Registered bytes locked in RAM (see [`EngineConfig::lock_memory`]).
    pub locked_bytes: u64,
}

struct BufferEntry {
    region: Arc<Region>,
    /// Transfers using this buffer as their local side.
    inflight: AtomicUsize,
}

/// The part of an engine its transports' servers need: memory and grants.
pub(crate) struct EngineCore {
    pub name: String,
    pub instance: u64,
    pub live: Arc<Liveness>,
    buffers: RwLock<IdMap<u32, Arc<BufferEntry>>>,
    grants: Mutex<GrantTable>,
    closed: AtomicBool,
    /// What the transports publish, once they started.
    endpoints: Mutex<Vec<Endpoint>>,
    /// The transports themselves (undecorated), for hooks; set once they started.
    transports: OnceLock<Vec<Arc<dyn Transport>>>,
    /// The one transport-provided allocator, if any.
    provider: OnceLock<Arc<dyn MemoryProvider>>,
    lock_memory: bool,
    next_buffer: AtomicU32,
}

/// The grant table, locked; when the lock is released, the transports hear of every peer
/// grant revoked meanwhile (whatever the path: revoke, expiry, shutdown).
struct Grants<'a> {
    table: Option<std::sync::MutexGuard<'a, GrantTable>>,
    core: &'a EngineCore,
}

impl std::ops::Deref for Grants<'_> {
    type Target = GrantTable;
    fn deref(&self) -> &GrantTable {
        self.table.as_ref().expect("held until drop")
    }
}

impl std::ops::DerefMut for Grants<'_> {
    fn deref_mut(&mut self) -> &mut GrantTable {
        self.table.as_mut().expect("held until drop")
    }
}

impl Drop for Grants<'_> {
    fn drop(&mut self) {
        let Some(mut table) = self.table.take() else {
            return;
        };
        let revoked = table.take_revoked();
        drop(table);
        for g in &revoked {
            for t in self.core.hooks() {
                t.on_revoke(g);
            }
        }
    }
}

impl EngineCore {
    fn grants(&self) -> Grants<'_> {
        Grants {
            table: Some(self.grants.lock().unwrap_or_else(|p| p.into_inner())),
            core: self,
        }
    }

    fn hooks(&self) -> &[Arc<dyn Transport>] {
        self.transports.get().map_or(&[], |v| v.as_slice())
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn buffer(&self, id: u32) -> Option<Arc<BufferEntry>> {
        self.buffers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }

    /// Checks a peer's access under a grant; the caller pins the returned entry around each
    /// copy or system call.
    pub fn admit(
        &self,
        access: Access,
        wire: GrantRef,
        offset: u64,
        len: u64,
    ) -> Result<(Arc<Region>, Admitted)> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::PeerDisconnected,
                format!("engine {} is shut down", self.name),
            ));
        }
        let admitted = self.grants().admit(access, wire, offset, len)?;
        // A buffer with live grants cannot be unregistered, so it is here.
        let region = self
            .buffer(wire.buffer)
            .ok_or_else(|| Error::new(ErrorKind::UnknownBuffer, format!("buffer {}", wire.buffer)))?
            .region
            .clone();
        Ok((region, admitted))
    }

    pub fn descriptor(&self) -> SegmentDescriptor {
        let mut buffers: Vec<BufferDescriptor> = self
            .buffers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(&id, b)| BufferDescriptor {
                id,
                len: b.region.len() as u64,
                kind: MemoryKind::Host,
            })
            .collect();
        buffers.sort_by_key(|b| b.id);
        SegmentDescriptor::new(
            self.name.clone(),
            self.instance,
            buffers,
            self.endpoints
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }

    /// Takes a lease on a local range for the span of one access or one transfer; returns its
    /// epoch, which the caller's guard revokes.
    fn lease(
        &self,
        buffer: u32,
        buffer_len: u64,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<u64> {
        self.grants().issue_lease(
            &self.name,
            GrantSpec {
                buffer,
                buffer_len,
                offset,
                len,
                access,
                expires: None,
                // Leases are never presented by peers (admit refuses them), so no token.
                token: 0,
                lease: true,
            },
        )
    }
}

struct Lease<'a> {
    core: &'a EngineCore,
    epoch: u64,
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.core.grants().revoke(self.epoch);
    }
}

/// A lease owned by a running transfer.
struct OwnedLease {
    core: Arc<EngineCore>,
    epoch: u64,
}

impl Drop for OwnedLease {
    fn drop(&mut self) {
        self.core.grants().revoke(self.epoch);
    }
}

thread_local! {
    /// A seeded sequence replacing the OS RNG on this thread (see [`seed_thread_randomness`]).
    static SEEDED: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// Makes the grant tokens and instance ids of engines used on this thread a sequence drawn
/// from `seed` (`None`: the OS RNG again). For simulated runs only: their engines all live
/// on one thread and a run must repeat exactly, message sizes included. Never in a real run:
/// unguessable tokens are what keeps a peer from forging grants.
pub fn seed_thread_randomness(seed: Option<u64>) {
    SEEDED.with(|c| c.set(seed));
}

fn random_u64() -> u64 {
    if let Some(x) = SEEDED.with(|c| {
        c.get().map(|s| {
            let s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            c.set(Some(s));
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        })
    }) {
        return x;
    }
    // The OS RNG; if it fails, the process cannot make grants safe, so say so loudly.
    getrandom::u64().expect("the operating system's random number generator failed")
}

/// A registered buffer, for the owning engine's local use.
#[derive(Clone)]
pub struct Buffer {
    id: u32,
    region: Arc<Region>,
    core: Weak<EngineCore>,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("id", &self.id)
            .field("len", &self.region.len())
            .finish()
    }
}

impl Buffer {
    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn len(&self) -> u64 {
        self.region.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }

    /// The memory, for transports that register it with a device.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Runs `f` under a lease of the range: refused if a live grant could let a peer touch it
    /// meanwhile (any grant for `Access::Write`, a write grant for `Access::Read`).
    fn leased<R>(
        &self,
        offset: u64,
        len: u64,
        access: Access,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        self.region.check(offset, len)?;
        match self.core.upgrade() {
            Some(core) => {
                let epoch = core.lease(self.id, self.len(), offset, len, access)?;
                let _lease = Lease { core: &core, epoch };
                f()
            }
            // The engine is gone, and with it every grant.
            None => f(),
        }
    }

    /// Copies `data` into the buffer at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return self.region.check(offset, 0).map(|_| ());
        }
        self.leased(offset, data.len() as u64, Access::Write, || {
            self.region.write(offset, data)
        })
    }

    /// Copies from the buffer at `offset` into `out`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return self.region.check(offset, 0).map(|_| ());
        }
        self.leased(offset, out.len() as u64, Access::Read, || {
            self.region.read(offset, out)
        })
    }

    /// Fills `offset..offset+len` in place (generators write straight into registered memory).
    /// GPU memory is filled in host memory first and copied to the device once (the host
    /// cannot address it; a real stage's outputs would be made there by its kernels).
    pub fn fill<R>(&self, offset: u64, len: u64, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        self.leased(offset, len.max(1), Access::Write, || {
            if self.region.is_device() {
                let mut host = host_copy_buffer(len)?;
                let r = f(&mut host);
                self.region.write(offset, &host)?;
                return Ok(r);
            }
            self.region.with_mut_slice(offset, len, f)
        })
    }

    /// Looks at `offset..offset+len` in place (digests without a copy). GPU memory is copied
    /// back to the host once and looked at there.
    pub fn view<R>(&self, offset: u64, len: u64, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.leased(offset, len.max(1), Access::Read, || {
            if self.region.is_device() {
                let mut host = host_copy_buffer(len)?;
                self.region.read(offset, &mut host)?;
                return Ok(f(&host));
            }
            self.region.with_slice(offset, len, f)
        })
    }
}

/// A host buffer of `len` bytes for one copy of GPU memory, refused (not aborted) when the
/// host cannot spare it.
fn host_copy_buffer(len: u64) -> Result<Vec<u8>> {
    let n = usize::try_from(len).map_err(|_| {
        Error::new(
            ErrorKind::Resource,
            format!("{len} bytes do not fit in host memory"),
        )
    })?;
    crate::memory::check_available(n)?;
    Ok(vec![0u8; n])
}

/// One transfer request: local range <-> a peer's granted range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub kind: OpKind,
    /// Local buffer id.
    pub local: u32,
    pub local_offset: u64,
    pub grant: Grant,
    /// Offset relative to the start of the grant.
    pub grant_offset: u64,
    pub len: u64,
    /// Opaque to the engine; carried to every slice so a decorator (fault injection,
    /// accounting) can tell which caller-level item a slice belongs to. 0 when unused.
    pub tag: u64,
}

impl Request {
    /// Sets the request's tag.
    pub fn tagged(mut self, tag: u64) -> Self {
        self.tag = tag;
        self
    }

    /// The slice of this request at `offset..offset+len` (relative to the request);
    /// `alone`: the only slice its task drives ([`SliceOp::alone`]).
    fn slice(
        &self,
        local: &Arc<Region>,
        key: &Option<Arc<[u8]>>,
        offset: u64,
        len: u64,
        alone: bool,
    ) -> SliceOp {
        SliceOp {
            alone,
            key: key.clone(),
            kind: self.kind,
            local: local.clone(),
            local_offset: self.local_offset + offset,
            grant: self.grant.wire(),
            grant_offset: self.grant_offset + offset,
            len,
            tag: self.tag,
            request_offset: offset,
            request_len: self.len,
        }
    }

    /// Writes `len` bytes from `local` at `local_offset` into the grant at `grant_offset`.
    pub fn write(
        local: &Buffer,
        local_offset: u64,
        grant: &Grant,
        grant_offset: u64,
        len: u64,
    ) -> Self {
        Self::new(OpKind::Write, local, local_offset, grant, grant_offset, len)
    }

    /// Reads `len` bytes of the grant at `grant_offset` into `local` at `local_offset`.
    pub fn read(
        local: &Buffer,
        local_offset: u64,
        grant: &Grant,
        grant_offset: u64,
        len: u64,
    ) -> Self {
        Self::new(OpKind::Read, local, local_offset, grant, grant_offset, len)
    }

    fn new(
        kind: OpKind,
        local: &Buffer,
        local_offset: u64,
        grant: &Grant,
        grant_offset: u64,
        len: u64,
    ) -> Self {
        Self {
            kind,
            local: local.id,
            local_offset,
            grant: grant.clone(),
            grant_offset,
            len,
            tag: 0,
        }
    }
}

struct Peer {
    link: Arc<dyn Link>,
    info: LinkInfo,
}

struct EngineInner {
    core: Arc<EngineCore>,
    /// Decorated (as the config asks), in order of preference: the data path.
    transports: Vec<Arc<dyn Transport>>,
    policy: TransportPolicy,
    store: Arc<dyn MetadataStore>,
    peers: tokio::sync::Mutex<HashMap<String, Arc<Peer>>>,
    /// Descriptors learned by handshake, for peers not in the store.
    known: Mutex<HashMap<String, SegmentDescriptor>>,
    next_batch: AtomicU64,
    shutdown: CancellationToken,
}

/// A transfer engine. Dropping it shuts it down: every grant is revoked (so nothing lands
/// afterwards), its listener and connections close, and its own batches end.
pub struct Engine {
    inner: Arc<EngineInner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("name", &self.inner.core.name)
            .finish()
    }
}

impl Engine {
    /// Builds the engine: starts its transports (binding their endpoints), and publishes its
    /// descriptor.
    pub async fn new(cfg: EngineConfig) -> Result<Engine> {
        validate_name(&cfg.name)?;
        let mut setups = cfg.transports.clone();
        if setups.is_empty() {
            return Err(Error::new(
                ErrorKind::Resource,
                format!("engine {} has no transport configured", cfg.name),
            ));
        }
        // In order of preference: same process, same host, anywhere.
        setups.sort_by_key(|t| t.kind().preference());
        if let Some(w) = setups.windows(2).find(|w| w[0].kind() == w[1].kind()) {
            return Err(Error::new(
                ErrorKind::Resource,
                format!("engine {} configures {} twice", cfg.name, w[0].kind()),
            ));
        }
        let live = Arc::new(Liveness::default());
        let core = Arc::new(EngineCore {
            name: cfg.name.clone(),
            instance: random_u64(),
            live: live.clone(),
            buffers: RwLock::default(),
            grants: Mutex::default(),
            closed: AtomicBool::new(false),
            endpoints: Mutex::default(),
            transports: OnceLock::new(),
            provider: OnceLock::new(),
            lock_memory: cfg.lock_memory,
            next_buffer: AtomicU32::new(1),
        });
        let admission = Admission::new(&core);
        let mut started: Vec<Arc<dyn Transport>> = Vec::with_capacity(setups.len());
        let mut endpoints = Vec::new();
        let mut provider: Option<(TransportKind, Arc<dyn MemoryProvider>)> = None;
        for setup in &setups {
            let step = async {
                let t = setup.start(admission.clone()).await?;
                if let Some(p) = t.memory() {
                    if let Some((other, _)) = &provider {
                        t.shutdown();
                        return Err(Error::new(
                            ErrorKind::Resource,
                            format!(
                                "transports {other} and {} both want to allocate the engine's memory",
                                t.kind()
                            ),
                        ));
                    }
                    provider = Some((t.kind(), p));
                }
                Ok(t)
            };
            match step.await {
                Ok(t) => {
                    endpoints.extend(t.endpoint());
                    started.push(t);
                }
                Err(e) => {
                    for t in &started {
                        t.shutdown();
                    }
                    return Err(e);
                }
            }
        }
        *core.endpoints.lock().unwrap_or_else(|p| p.into_inner()) = endpoints;
        if let Some((_, p)) = provider {
            let _ = core.provider.set(p);
        }
        let _ = core.transports.set(started.clone());
        let transports = started
            .into_iter()
            .map(|t| match &cfg.decorator {
                Some(d) => d(t),
                None => t,
            })
            .collect();
        let store = cfg
            .store
            .clone()
            .unwrap_or_else(|| InProcessStore::global() as Arc<dyn MetadataStore>);
        let engine = Engine {
            inner: Arc::new(EngineInner {
                core,
                transports,
                policy: cfg.policy,
                store,
                peers: Default::default(),
                known: Default::default(),
                next_batch: AtomicU64::new(1),
                shutdown: CancellationToken::new(),
            }),
        };
        // On failure, dropping `engine` shuts the transports down again.
        engine.inner.store.publish(engine.descriptor()).await?;
        info!(
            engine = %cfg.name,
            transports = ?setups.iter().map(|t| t.kind()).collect::<Vec<_>>(),
            endpoints = ?engine.descriptor().endpoints.iter().map(|e| e.kind).collect::<Vec<_>>(),
            "engine started"
        );
        Ok(engine)
    }

    pub fn name(&self) -> &str {
        &self.inner.core.name
    }

    /// The descriptor peers see (also served on the TCP endpoint).
    pub fn descriptor(&self) -> SegmentDescriptor {
        self.inner.core.descriptor()
    }

    /// The address of this engine's tcp endpoint, if it runs tcp with a listener.
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        tcp::endpoint_addr(&self.descriptor())
    }

    /// Publishes the current descriptor (buffer list) to the metadata store again.
    pub async fn publish(&self) -> Result<()> {
        self.inner.store.publish(self.descriptor()).await
    }

    /// Registers a region: every transport hears of it first, and any may refuse.
    fn add_buffer(&self, region: Region) -> Result<Buffer> {
        let core = &self.inner.core;
        if core.is_closed() {
            return Err(Error::new(ErrorKind::EngineClosed, "engine is shut down"));
        }
        let id = core.next_buffer.fetch_add(1, Ordering::Relaxed);
        let region = Arc::new(region);
        let hooks = core.hooks();
        for (i, t) in hooks.iter().enumerate() {
            if let Err(e) = t.on_register(id, &region) {
                for done in &hooks[..i] {
                    done.on_unregister(id, &region);
                }
                return Err(Error::new(
                    e.kind(),
                    format!(
                        "the {} transport refused to register {} bytes: {}",
                        t.kind(),
                        region.len(),
                        e.detail()
                    ),
                ));
            }
        }
        core.buffers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                id,
                Arc::new(BufferEntry {
                    region: region.clone(),
                    inflight: AtomicUsize::new(0),
                }),
            );
        debug!(engine = %core.name, buffer = id, bytes = region.len(), locked = region.is_locked(), "registered");
        Ok(Buffer {
            id,
            region,
            core: Arc::downgrade(core),
        })
    }

    /// Allocates and registers `len` zeroed, page-aligned bytes (by the transport that
    /// provides memory, if one does; locked when [`EngineConfig::lock_memory`] is set).
    pub fn allocate(&self, len: u64) -> Result<Buffer> {
        self.allocate_with(len, self.inner.core.lock_memory)
    }

    /// Allocates, registers and locks (mlock, best effort) `len` bytes.
    pub fn allocate_locked(&self, len: u64) -> Result<Buffer> {
        self.allocate_with(len, true)
    }

    fn allocate_with(&self, len: u64, lock: bool) -> Result<Buffer> {
        let len = usize::try_from(len).map_err(|_| {
            Error::new(
                ErrorKind::InvalidLength,
                format!("{len} bytes does not fit in memory"),
            )
        })?;
        let mut region = match self.inner.core.provider.get() {
            Some(p) => p.allocate(len)?.with_provider(p.clone()),
            None => Region::allocate(len, false)?,
        };
        if lock && !region.lock_pages() {
            debug!(engine = %self.name(), bytes = len, "mlock refused; buffer stays unlocked");
        }
        self.add_buffer(region)
    }

    /// Registers a region made elsewhere (GPU memory from `transport::cuda::driver::Gpu`,
    /// pinned host memory), the same way [`Engine::allocate`] registers its own.
    pub fn register(&self, region: Region) -> Result<Buffer> {
        self.add_buffer(region)
    }

    /// Registers caller-owned memory.
    ///
    /// # Safety
    /// As for [`Region::adopt`]: `ptr` is page-aligned and valid for `len` bytes until
    /// `release` runs (when the last handle, grant and transfer using it are gone), and the
    /// caller touches it only through the returned [`Buffer`] until then.
    pub unsafe fn adopt(
        &self,
        ptr: *mut u8,
        len: usize,
        release: impl FnOnce() + Send + Sync + 'static,
    ) -> Result<Buffer> {
        // SAFETY: forwarded contract.
        let region = unsafe { Region::adopt(ptr, len, release) }?;
        self.add_buffer(region)
    }

    /// Unregisters a buffer. Refused with `BufferBusy` while it has live grants, leases or
    /// transfers in flight: the caller revokes or waits, then tries again. The memory itself
    /// is freed when the last [`Buffer`] handle goes.
    pub fn unregister(&self, buffer: &Buffer) -> Result<()> {
        let core = &self.inner.core;
        let grants = core.grants();
        let mut buffers = core.buffers.write().unwrap_or_else(|p| p.into_inner());
        let entry = buffers
            .get(&buffer.id)
            .ok_or_else(|| Error::new(ErrorKind::UnknownBuffer, format!("buffer {}", buffer.id)))?;
        let (held, inflight) = (
            grants.count_on(buffer.id),
            entry.inflight.load(Ordering::Acquire),
        );
        if held > 0 || inflight > 0 {
            return Err(Error::new(
                ErrorKind::BufferBusy,
                format!(
                    "buffer {}: {held} live grants or leases, {inflight} transfers in flight",
                    buffer.id
                ),
            ));
        }
        let entry = buffers.remove(&buffer.id).expect("looked up above");
        drop(buffers);
        drop(grants);
        for t in core.hooks() {
            t.on_unregister(buffer.id, &entry.region);
        }
        Ok(())
    }

    /// Grants `access` to `offset..offset+len` of `buffer`, for a peer to use over any transport.
    pub fn grant(&self, buffer: &Buffer, offset: u64, len: u64, access: Access) -> Result<Grant> {
        self.grant_inner(buffer, offset, len, access, None)
    }

    /// As [`grant`](Self::grant), revoked automatically once `ttl` has passed.
    pub fn grant_for(
        &self,
        buffer: &Buffer,
        offset: u64,
        len: u64,
        access: Access,
        ttl: Duration,
    ) -> Result<Grant> {
        self.grant_inner(
            buffer,
            offset,
            len,
            access,
            Some((Instant::now() + ttl).into_std()),
        )
    }

    fn grant_inner(
        &self,
        buffer: &Buffer,
        offset: u64,
        len: u64,
        access: Access,
        expires: Option<std::time::Instant>,
    ) -> Result<Grant> {
        let core = &self.inner.core;
        if core
            .buffer(buffer.id)
            .is_none_or(|b| !Arc::ptr_eq(&b.region, &buffer.region))
        {
            return Err(Error::new(
                ErrorKind::UnknownBuffer,
                format!("buffer {} is not registered here", buffer.id),
            ));
        }
        let mut g = core.grants().issue(
            &core.name,
            GrantSpec {
                buffer: buffer.id,
                buffer_len: buffer.len(),
                offset,
                len,
                access,
                expires,
                token: random_u64(),
                lease: false,
            },
        )?;
        for t in core.hooks() {
            let key = t.on_grant(&g, &buffer.region).and_then(|key| match key {
                Some(bytes) if bytes.is_empty() || bytes.len() > MAX_KEY_BYTES => Err(Error::new(
                    ErrorKind::Resource,
                    format!("a {}-byte key (1..={MAX_KEY_BYTES})", bytes.len()),
                )),
                k => Ok(k),
            });
            match key {
                Ok(Some(bytes)) => g.keys.push(GrantKey {
                    kind: t.kind(),
                    bytes,
                }),
                Ok(None) => {}
                Err(e) => {
                    // Revoked again: every transport hears of it (those that never saw it
                    // ignore it), so nothing of the refused grant stays usable.
                    core.grants().revoke(g.epoch);
                    return Err(Error::new(
                        e.kind(),
                        format!(
                            "the {} transport refused to grant {offset}+{len} of buffer {}: {}",
                            t.kind(),
                            buffer.id,
                            e.detail()
                        ),
                    )
                    .with_grant(&core.name, g.epoch));
                }
            }
        }
        if let Some(at) = expires {
            self.expire_at(at);
        }
        debug!(engine = %core.name, grant = g.epoch, buffer = g.buffer, offset, len, %access, "granted");
        Ok(g)
    }

    /// Sweeps expired grants at `at`, so transports hear of the expiry when it happens, not
    /// at the next use of the table.
    fn expire_at(&self, at: std::time::Instant) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let core = Arc::downgrade(&self.inner.core);
        rt.spawn(async move {
            tokio::time::sleep_until(at.into()).await;
            if let Some(core) = core.upgrade() {
                core.grants().sweep(std::time::Instant::now());
            }
        });
    }

    /// Revokes a grant. When this returns, no access under it is running and none can start:
    /// a write that arrives later is refused and its bytes never reach memory. Returns
    /// `false` if the grant was not live (already revoked, expired, or not ours).
    pub fn revoke(&self, grant: &Grant) -> bool {
        let core = &self.inner.core;
        if grant.segment != core.name {
            return false;
        }
        // Only the exact grant (token too) can be revoked through this handle.
        let ok = core.grants().revoke_matching(grant.epoch, grant.token);
        if ok {
            debug!(engine = %core.name, grant = grant.epoch, "revoked");
        }
        ok
    }

    /// Current usage, for leak checks.
    pub fn usage(&self) -> Usage {
        let core = &self.inner.core;
        let (grants, granted_bytes, leases) = {
            let mut g = core.grants();
            g.sweep(std::time::Instant::now());
            (g.live(), g.granted_bytes(), g.leases())
        };
        let buffers = core.buffers.read().unwrap_or_else(|p| p.into_inner());
        Usage {
            buffers: buffers.len(),
            registered_bytes: buffers.values().map(|b| b.region.len() as u64).sum(),
            locked_bytes: buffers
                .values()
                .filter(|b| b.region.is_locked())
                .map(|b| b.region.len() as u64)
                .sum(),
            grants,
            granted_bytes,
            leases,
            batches: core.live.batches.load(Ordering::Acquire),
            tasks: core.live.tasks.load(Ordering::Acquire),
            connections: core.live.connections.load(Ordering::Acquire),
        }
    }

    /// Waits until no batch or task of this engine is alive (freed batches release their
    /// tasks asynchronously), then returns the usage. Errors with TimedOut after `timeout`.
    pub async fn wait_idle(&self, timeout: Duration) -> Result<Usage> {
        let live = &self.inner.core.live;
        let deadline = Instant::now() + timeout;
        loop {
            let notified = live.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let u = self.usage();
            if u.batches == 0 && u.tasks == 0 && u.leases == 0 {
                return Ok(u);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(Error::new(
                    ErrorKind::TimedOut,
                    format!("engine {} still busy: {u:?}", self.name()),
                ));
            }
        }
    }

    /// Learns a peer's descriptor by asking it directly at `addr` (no metadata store needed)
    /// and connects to it.
    pub async fn connect_addr(&self, addr: SocketAddr) -> Result<LinkInfo> {
        let ask = self
            .inner
            .core
            .hooks()
            .iter()
            .find_map(|t| t.describe(addr))
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::NoTransport,
                    format!(
                        "no transport of engine {} can ask {addr} for its descriptor (tcp can)",
                        self.name()
                    ),
                )
            })?;
        let desc = ask.await?;
        let name = desc.name.clone();
        self.inner
            .known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.clone(), desc);
        Ok(self.inner.peer(&name).await?.info.clone())
    }

    /// Connects to a peer by segment name (through the metadata store), if not yet connected.
    pub async fn connect(&self, segment: &str) -> Result<LinkInfo> {
        Ok(self.inner.peer(segment).await?.info.clone())
    }

    /// Submits requests as one batch. Every request is validated first (lengths, ranges,
    /// buffers, grant bounds and access); a bad one fails the submit with an error naming its
    /// task, and nothing starts. `timeout` bounds the whole batch: tasks still running then
    /// end TimedOut.
    pub async fn submit(&self, requests: Vec<Request>, timeout: Option<Duration>) -> Result<Batch> {
        let (batch, rest, span) = self.start(requests, timeout)?;
        for (i, p, alive, started) in rest {
            let task = run_task(
                self.inner.clone(),
                batch.shared.clone(),
                (i, p, alive, started),
                true,
                false,
            );
            tokio::spawn(task.instrument(span.clone()));
        }
        Ok(batch)
    }

    /// Validates, creates the batch and runs what can run inline; returns the tasks that still
    /// need a driver.
    fn start(
        &self,
        requests: Vec<Request>,
        timeout: Option<Duration>,
    ) -> Result<(Batch, Vec<Waiting>, tracing::Span)> {
        let inner = &self.inner;
        let core = &inner.core;
        let id = inner.next_batch.fetch_add(1, Ordering::Relaxed);
        if inner.shutdown.is_cancelled() {
            return Err(Error::new(ErrorKind::EngineClosed, "engine is shut down"));
        }
        let mut prepared = Vec::with_capacity(requests.len());
        for (i, r) in requests.into_iter().enumerate() {
            let named = |e: Error| {
                e.with_task(id, i)
                    .with_grant(&r.grant.segment, r.grant.epoch)
                    .with_peer(&r.grant.segment)
            };
            let p = (|| {
                if r.len == 0 {
                    return Err(Error::new(ErrorKind::InvalidLength, "request length is 0"));
                }
                r.grant.validate()?;
                if r.grant.access != r.kind.access() {
                    return Err(Error::new(
                        ErrorKind::AccessDenied,
                        format!("a {} grant does not permit {}", r.grant.access, r.kind),
                    ));
                }
                r.grant.check_range(r.grant_offset, r.len)?;
                let buf = core.buffer(r.local).ok_or_else(|| {
                    Error::new(
                        ErrorKind::UnknownBuffer,
                        format!("local buffer {}", r.local),
                    )
                })?;
                buf.region.check(r.local_offset, r.len)?;
                // The local range is this transfer's own while it runs: the source is only
                // read, the destination only written by the transport.
                let access = match r.kind {
                    OpKind::Write => Access::Read,
                    OpKind::Read => Access::Write,
                };
                let epoch = core.lease(
                    r.local,
                    buf.region.len() as u64,
                    r.local_offset,
                    r.len,
                    access,
                )?;
                let lease = OwnedLease {
                    core: core.clone(),
                    epoch,
                };
                buf.inflight.fetch_add(1, Ordering::AcqRel);
                Ok((buf, lease))
            })()
            .map_err(named)?;
            // moved, not cloned: a request's grant holds a name and keys on the heap
            prepared.push(Prepared {
                req: r,
                buf: p.0,
                _lease: p.1,
            });
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        let shared = BatchShared::new(
            id,
            deadline,
            prepared.iter().map(|p| p.req.len).collect(),
            core.live.clone(),
        );
        let span = info_span!("batch", engine = %core.name, batch = id, tasks = prepared.len());
        let mut rest = Vec::new();
        // A lone request may also start on this thread on a link that waits briefly for its
        // device (rdma); in a batch of several, that would post them one after the other.
        let alone = prepared.len() == 1;
        // A batch of several single-slice requests to one connected peer may start as one
        // (rdma: one run, its work requests posted as chains) instead of one slice each.
        let mut together = match alone {
            true => None,
            false => span.in_scope(|| inner.try_batch(&prepared)),
        }
        .map(|v| v.into_iter());
        for (i, p) in prepared.into_iter().enumerate() {
            core.live.tasks.fetch_add(1, Ordering::AcqRel);
            // The count is given back by this guard however the task ends, even when its
            // driver future is dropped before its first poll (`transfer` ending on an early
            // failure), which used to leave the count up for good.
            let alive = TaskAlive(core.live.clone());
            if let Some(begun) = together.as_mut().and_then(|t| t.next()) {
                rest.push((i, p, alive, Some(begun)));
                continue;
            }
            if let Some(p) = span.in_scope(|| inner.try_inline(&shared, i, p, alive, alone)) {
                rest.push(p);
            }
        }
        Ok((Batch { shared }, rest, span))
    }

    /// Submits and waits: every request Completed, or the first failure naming its task.
    /// The caller's task drives the transfers itself (no spawned tasks, no cross-task
    /// wake-ups); dropping the future cancels them, as dropping a batch does.
    pub async fn transfer(&self, requests: Vec<Request>, timeout: Option<Duration>) -> Result<()> {
        let (batch, mut rest, span) = self.start(requests, timeout)?;
        if rest.len() <= 1 {
            // Nothing to race: drive the one task (if any) to its end, then read the outcome.
            if let Some(w) = rest.pop() {
                run_task(self.inner.clone(), batch.shared.clone(), w, false, false)
                    .instrument(span)
                    .await;
            }
            return batch.outcome().expect("every task has ended");
        }
        // One task drives them all: none of their slices may hold the thread.
        let drivers = futures_util::future::join_all(rest.into_iter().map(|w| {
            run_task(self.inner.clone(), batch.shared.clone(), w, false, true)
                .instrument(span.clone())
        }));
        // Biased: an unbiased select polls its branches in a random order, and which one runs
        // first decides whether more slices start after a failure; a simulated run must
        // repeat exactly (docs/sim.md).
        tokio::select! {
            biased;
            // The first failure ends the wait; dropping `drivers` cancels the rest.
            r = batch.wait_all() => r,
            _ = drivers => batch.wait_all().await,
        }
    }

    /// Shuts the engine down now (also done on drop).
    pub fn shutdown(&self) {
        self.inner.close();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.inner.close();
    }
}

struct Prepared {
    req: Request,
    buf: Arc<BufferEntry>,
    _lease: OwnedLease,
}

impl Drop for Prepared {
    fn drop(&mut self) {
        self.buf.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A task that still needs a driver: its index, its hold on the local buffer, and, where the
/// link already started its one slice ([`Link::start_inline`]), the future that finishes it.
type Waiting = (
    usize,
    Prepared,
    TaskAlive,
    Option<BoxFuture<'static, Result<()>>>,
);

/// Decrements the engine's task count when a task's driver ends, however it ends.
struct TaskAlive(Arc<Liveness>);

impl Drop for TaskAlive {
    fn drop(&mut self) {
        self.0.dec(&self.0.tasks);
    }
}

/// Drives one task to its terminal state. `cancelable`: whether someone else can cancel the
/// batch while this runs (a submitted batch can; `transfer()`'s single task is canceled by
/// dropping its future instead, so it skips registering for that). `shared`: whether the
/// task driving this one drives others too (`transfer()`'s batch of several).
async fn run_task(
    inner: Arc<EngineInner>,
    batch: Arc<BatchShared>,
    (i, p, alive, begun): Waiting,
    cancelable: bool,
    shared: bool,
) {
    let r = &p.req;
    if !batch.lock().start(i) {
        // a slice already under way stops (and its device is done with the memory) before
        // the buffer's hold goes
        drop(begun);
        return;
    }
    let span = transfer_span(i, r);
    let started = Instant::now();
    let moved = async {
        let peer = inner.peer(&r.grant.segment).await?;
        tracing::Span::current()
            .record("transport", peer.info.transport.as_str())
            .record("device", peer.info.device.as_str());
        let s = peer.link.slicing();
        // The key for this link's kind, shared by every slice of the task.
        let key: Option<Arc<[u8]>> = r.grant.key(peer.info.transport).map(Arc::from);
        if let Some(begun) = begun {
            begun.await?;
            batch.progress(i, r.len);
            return Ok(());
        }
        if r.len <= s.slice_size {
            // One slice: no stream machinery on the latency path.
            peer.link
                .execute(r.slice(&p.buf.region, &key, 0, r.len, !shared))
                .await?;
            batch.progress(i, r.len);
            return Ok(());
        }
        let mut pending = futures_util::stream::iter(slices(r.len, s.slice_size))
            .map(|(off, len)| {
                // Polled together on this task: none may hold the thread.
                let fut = peer
                    .link
                    .execute(r.slice(&p.buf.region, &key, off, len, false));
                async move { fut.await.map(|()| len) }
            })
            .buffer_unordered(s.in_flight.max(1));
        while let Some(done) = pending.next().await {
            batch.progress(i, done?);
        }
        Ok::<_, Error>(())
    }
    .instrument(span.clone());
    let timed = async {
        match batch.deadline {
            Some(d) => tokio::time::timeout_at(d, moved).await.ok(),
            None => Some(moved.await),
        }
    };
    let outcome = tokio::select! {
        biased;
        _ = batch.cancel.cancelled(), if cancelable => TaskState::Canceled,
        _ = inner.shutdown.cancelled() => TaskState::Failed(Error::new(ErrorKind::EngineClosed, "engine shut down")),
        r = timed => match r {
            Some(Ok(())) => TaskState::Completed,
            Some(Err(e)) => {
                if matches!(e.kind(), ErrorKind::PeerDisconnected | ErrorKind::Unreachable) {
                    inner.forget_peer(&p.req.grant.segment).await;
                }
                TaskState::Failed(e)
            }
            None => TaskState::TimedOut,
        },
    };
    conclude(&batch, i, p, alive, &span, started, outcome);
}

fn transfer_span(i: usize, r: &Request) -> tracing::Span {
    info_span!(
        "transfer",
        task = i,
        op = %r.kind,
        peer = %r.grant.segment,
        bytes = r.len,
        transport = tracing::field::Empty,
        device = tracing::field::Empty,
        latency_us = tracing::field::Empty,
    )
}

/// Names the failure, records the latency, releases the task's hold, then reports: in this
/// order, so that whoever sees the terminal state finds the buffer free and the engine idle.
fn conclude(
    batch: &BatchShared,
    i: usize,
    p: Prepared,
    alive: TaskAlive,
    span: &tracing::Span,
    started: Instant,
    outcome: TaskState,
) {
    let r = &p.req;
    let outcome = match outcome {
        TaskState::Failed(e) => TaskState::Failed(
            e.with_peer(&r.grant.segment)
                .with_task(batch.id, i)
                .with_grant(&r.grant.segment, r.grant.epoch),
        ),
        o => o,
    };
    span.record("latency_us", started.elapsed().as_micros() as u64);
    span.in_scope(|| debug!(outcome = ?outcome, "transfer ended"));
    drop(p);
    drop(alive);
    batch.finish(i, outcome);
}

impl EngineInner {
    /// Runs a single-slice task on the submitting thread when its peer is already connected
    /// over a link that copies memory (loopback): no task, no timer, no wake-up. Gives the
    /// task back when it has to go through the scheduler.
    fn try_inline(
        &self,
        batch: &BatchShared,
        i: usize,
        p: Prepared,
        alive: TaskAlive,
        alone: bool,
    ) -> Option<Waiting> {
        let peer = match self.peers.try_lock() {
            Ok(peers) => peers.get(&p.req.grant.segment).cloned(),
            Err(_) => None,
        };
        let Some(peer) = peer else {
            return Some((i, p, alive, None));
        };
        let r = &p.req;
        if r.len > peer.link.slicing().slice_size {
            return Some((i, p, alive, None));
        }
        let key = r.grant.key(peer.info.transport).map(Arc::from);
        let op = r.slice(&p.buf.region, &key, 0, r.len, alone);
        let span = transfer_span(i, r);
        span.record("transport", peer.info.transport.as_str())
            .record("device", peer.info.device.as_str());
        let started = Instant::now();
        let ran = span.in_scope(|| match peer.link.execute_inline(&op) {
            Some(r) => Some(Started::Done(r)),
            None if alone => peer.link.start_inline(&op),
            None => None,
        });
        let outcome = match ran {
            None => return Some((i, p, alive, None)),
            // under way: a driver finishes it, under the batch's deadline and cancel
            Some(Started::Pending(f)) => return Some((i, p, alive, Some(f))),
            Some(Started::Done(Ok(()))) => TaskState::Completed,
            Some(Started::Done(Err(e))) => TaskState::Failed(e),
        };
        batch.lock().start(i);
        conclude(batch, i, p, alive, &span, started, outcome);
        None
    }

    /// Starts a batch's requests together through [`Link::start_batch`] when they all go to
    /// one connected peer in one slice each: one future per request, in order. `None`: they
    /// run one by one.
    fn try_batch(&self, prepared: &[Prepared]) -> Option<Vec<BoxFuture<'static, Result<()>>>> {
        let segment = &prepared.first()?.req.grant.segment;
        if prepared.iter().any(|p| &p.req.grant.segment != segment) {
            return None;
        }
        let peer = self.peers.try_lock().ok()?.get(segment).cloned()?;
        let slice_size = peer.link.slicing().slice_size;
        if prepared.iter().any(|p| p.req.len > slice_size) {
            return None;
        }
        let ops: Vec<SliceOp> = prepared
            .iter()
            .map(|p| {
                let key = p.req.grant.key(peer.info.transport).map(Arc::from);
                p.req.slice(&p.buf.region, &key, 0, p.req.len, false)
            })
            .collect();
        let futures = peer.link.start_batch(&ops)?;
        (futures.len() == ops.len()).then_some(futures)
    }

    /// The peer's link, connecting (and logging the selection) the first time.
    async fn peer(&self, segment: &str) -> Result<Arc<Peer>> {
        if self.shutdown.is_cancelled() {
            return Err(Error::new(ErrorKind::EngineClosed, "engine is shut down"));
        }
        if let Ok(peers) = self.peers.try_lock()
            && let Some(p) = peers.get(segment)
        {
            return Ok(p.clone());
        }
        let mut peers = self.peers.lock().await;
        if let Some(p) = peers.get(segment) {
            return Ok(p.clone());
        }
        let known = self
            .known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(segment)
            .cloned();
        let desc = match known {
            Some(d) => d,
            None => self
                .store
                .lookup(segment)
                .await
                .map_err(|e| e.with_peer(segment))?
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::UnknownSegment,
                        format!("segment {segment:?} is not published"),
                    )
                    .with_peer(segment)
                })?,
        };
        let mut last = Error::new(
            ErrorKind::NoTransport,
            format!("no transport allowed by {:?} reaches it", self.policy),
        )
        .with_peer(segment);
        for t in &self.transports {
            let allowed = match self.policy {
                TransportPolicy::Auto => true,
                TransportPolicy::Only(kind) => t.kind() == kind,
            };
            if !allowed || !t.reaches(&desc) {
                continue;
            }
            match t.connect(desc.clone()).await {
                Ok(link) => {
                    let info = link.info();
                    info!(
                        engine = %self.core.name,
                        peer = %segment,
                        transport = info.transport.as_str(),
                        device = %info.device,
                        "selected transport"
                    );
                    let p = Arc::new(Peer { link, info });
                    peers.insert(segment.to_owned(), p.clone());
                    return Ok(p);
                }
                Err(e) => {
                    warn!(engine = %self.core.name, peer = %segment, transport = t.kind().as_str(), error = %e, "connect failed");
                    last = e.with_peer(segment);
                }
            }
        }
        Err(last)
    }

    async fn forget_peer(&self, segment: &str) {
        self.peers.lock().await.remove(segment);
        self.known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(segment);
    }

    fn close(&self) {
        let core = &self.core;
        if core.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.shutdown.cancel();
        // Every grant revoked (transports hear of each), then every buffer unregistered from
        // the transports, then they stop serving.
        core.grants().revoke_all();
        let buffers: Vec<(u32, Arc<Region>)> = core
            .buffers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(&id, b)| (id, b.region.clone()))
            .collect();
        for t in core.hooks() {
            for (id, region) in &buffers {
                t.on_unregister(*id, region);
            }
            t.shutdown();
        }
        if let Ok(mut peers) = self.peers.try_lock() {
            peers.clear();
        }
        // The in-process store removes at once; a remote store finishes in the background.
        use futures_util::FutureExt;
        if self
            .store
            .remove(&core.name, core.instance)
            .now_or_never()
            .is_none()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let store = self.store.clone();
            let (name, instance) = (core.name.clone(), core.instance);
            rt.spawn(async move {
                let _ = store.remove(&name, instance).await;
            });
        }
        info!(engine = %core.name, "engine shut down");
    }
}
