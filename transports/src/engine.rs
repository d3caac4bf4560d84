//! The engine: registered buffers, grants, peers and batches, tied together.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::batch::{Batch, BatchShared, Liveness, TaskState, slices};
use crate::error::{Error, ErrorKind, Result};
use crate::grant::{Access, Admitted, Grant, GrantRef, GrantSpec, GrantTable};
use crate::memory::Region;
use crate::metadata::{InProcessStore, MetadataStore};
use crate::segment::{BufferDescriptor, MemoryKind, SegmentDescriptor, validate_name};
use crate::transport::loopback::{self, LoopbackTransport};
use crate::transport::shm::{ShmConfig, ShmEndpoint, ShmServer, ShmTransport};
use crate::transport::tcp::{self, TcpConfig, TcpServer, TcpTransport};
use crate::transport::{Link, LinkInfo, OpKind, SliceOp, Transport};

/// Which transports an engine may select for its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportPolicy {
    /// Loopback for engines in this process, tcp for the rest.
    #[default]
    Auto,
    /// Only the named transport ("loopback" or "tcp", or a custom transport's name).
    Only(&'static str),
}

/// Wraps every transport the engine builds (fault injection, tracing, ...).
pub type TransportDecorator = Arc<dyn Fn(Arc<dyn Transport>) -> Arc<dyn Transport> + Send + Sync>;

/// How to build an engine.
#[derive(Clone)]
pub struct EngineConfig {
    /// The segment name peers use to find this engine.
    pub name: String,
    /// Where to listen for TCP peers; `None` disables the TCP server (loopback only).
    pub tcp_listen: Option<SocketAddr>,
    pub tcp: TcpConfig,
    /// Slice size for loopback copies: between slices the copy yields, so deadlines and
    /// cancels stay prompt.
    pub loopback_slice: u64,
    pub policy: TransportPolicy,
    /// Lock registered pages in RAM (best effort).
    pub lock_memory: bool,
    /// Where to publish and look up descriptors; `None` uses the process-wide in-process store.
    pub store: Option<Arc<dyn MetadataStore>>,
    pub decorator: Option<TransportDecorator>,
    /// Enables the shm transport: buffers are allocated shareable (sealed memfds), an shm
    /// endpoint serves peers of this host, and peers of this host that have one are reached
    /// through it (before tcp). `None`: off.
    pub shm: Option<ShmConfig>,
}

impl std::fmt::Debug for EngineConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineConfig")
            .field("name", &self.name)
            .field("tcp_listen", &self.tcp_listen)
            .field("tcp", &self.tcp)
            .field("loopback_slice", &self.loopback_slice)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl EngineConfig {
    /// Defaults: TCP on an ephemeral port of 127.0.0.1, loopback for local peers, the
    /// process-wide metadata store.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            tcp_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            tcp: TcpConfig::default(),
            loopback_slice: 256 << 20,
            policy: TransportPolicy::Auto,
            lock_memory: false,
            store: None,
            decorator: None,
            shm: None,
        }
    }

    /// Turns the shm transport on (see [`EngineConfig::shm`]).
    pub fn shm_config(mut self, shm: ShmConfig) -> Self {
        self.shm = Some(shm);
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

    pub fn tcp_listen(mut self, addr: Option<SocketAddr>) -> Self {
        self.tcp_listen = addr;
        self
    }

    pub fn tcp_config(mut self, tcp: TcpConfig) -> Self {
        self.tcp = tcp;
        self
    }

    pub fn decorator(mut self, d: TransportDecorator) -> Self {
        self.decorator = Some(d);
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
    /// Open TCP connections, both directions.
    pub connections: usize,
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
    buffers: RwLock<HashMap<u32, Arc<BufferEntry>>>,
    grants: Mutex<GrantTable>,
    closed: AtomicBool,
    tcp_addr: Mutex<Option<SocketAddr>>,
    shm: Mutex<Option<ShmEndpoint>>,
    /// Allocate shareable (memfd) regions: the shm transport is on.
    shareable: bool,
    next_buffer: AtomicU32,
}

impl EngineCore {
    fn grants(&self) -> std::sync::MutexGuard<'_, GrantTable> {
        self.grants.lock().unwrap_or_else(|p| p.into_inner())
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
        SegmentDescriptor {
            name: self.name.clone(),
            instance: self.instance,
            tcp: *self.tcp_addr.lock().unwrap_or_else(|p| p.into_inner()),
            buffers,
            shm: self.shm.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
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
        let g = self.grants().issue(
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
        )?;
        Ok(g.epoch)
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

fn random_u64() -> u64 {
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
    pub fn fill<R>(&self, offset: u64, len: u64, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        self.leased(offset, len.max(1), Access::Write, || {
            self.region.with_mut_slice(offset, len, f)
        })
    }

    /// Looks at `offset..offset+len` in place (digests without a copy).
    pub fn view<R>(&self, offset: u64, len: u64, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.leased(offset, len.max(1), Access::Read, || {
            self.region.with_slice(offset, len, f)
        })
    }
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

    /// The slice of this request at `offset..offset+len` (relative to the request).
    fn slice(&self, local: &Arc<Region>, offset: u64, len: u64) -> SliceOp {
        SliceOp {
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
    transports: Vec<Arc<dyn Transport>>,
    policy: TransportPolicy,
    tcp_cfg: TcpConfig,
    store: Arc<dyn MetadataStore>,
    peers: tokio::sync::Mutex<HashMap<String, Arc<Peer>>>,
    /// Descriptors learned by handshake, for peers not in the store.
    known: Mutex<HashMap<String, SegmentDescriptor>>,
    server: Mutex<Option<TcpServer>>,
    shm_server: Mutex<Option<ShmServer>>,
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
    /// Builds the engine: binds its TCP endpoint (if any), makes it reachable by loopback,
    /// and publishes its descriptor.
    pub async fn new(cfg: EngineConfig) -> Result<Engine> {
        validate_name(&cfg.name)?;
        if cfg.tcp.max_payload < cfg.tcp.slice_size {
            return Err(Error::new(
                ErrorKind::Resource,
                format!(
                    "tcp max_payload {} < slice_size {}",
                    cfg.tcp.max_payload, cfg.tcp.slice_size
                ),
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
            tcp_addr: Mutex::new(None),
            shm: Mutex::new(None),
            shareable: cfg.shm.is_some(),
            next_buffer: AtomicU32::new(1),
        });
        let server = match cfg.tcp_listen {
            Some(addr) => {
                let s = TcpServer::bind(addr, core.clone(), cfg.tcp.clone()).await?;
                *core.tcp_addr.lock().unwrap_or_else(|p| p.into_inner()) = Some(s.addr);
                Some(s)
            }
            None => None,
        };
        let shm_server = match &cfg.shm {
            Some(c) => {
                let s = ShmServer::bind(core.clone(), c.clone()).await?;
                *core.shm.lock().unwrap_or_else(|p| p.into_inner()) = Some(s.endpoint.clone());
                Some(s)
            }
            None => None,
        };
        let wrap = |t: Arc<dyn Transport>| match &cfg.decorator {
            Some(d) => d(t),
            None => t,
        };
        // In order of preference: same process, same host, anywhere.
        let mut transports = vec![wrap(Arc::new(LoopbackTransport::new(cfg.loopback_slice)))];
        if let Some(c) = &cfg.shm {
            transports.push(wrap(Arc::new(ShmTransport::new(c.clone(), live.clone()))));
        }
        transports.push(wrap(Arc::new(TcpTransport::new(
            cfg.tcp.clone(),
            cfg.name.clone(),
            live,
        ))));
        let store = cfg
            .store
            .clone()
            .unwrap_or_else(|| InProcessStore::global() as Arc<dyn MetadataStore>);
        store.publish(core.descriptor()).await?;
        loopback::register(&core);
        info!(engine = %cfg.name, tcp = ?core.descriptor().tcp, "engine started");
        Ok(Engine {
            inner: Arc::new(EngineInner {
                core,
                transports,
                policy: cfg.policy,
                tcp_cfg: cfg.tcp,
                store,
                peers: Default::default(),
                known: Default::default(),
                server: Mutex::new(server),
                shm_server: Mutex::new(shm_server),
                next_batch: AtomicU64::new(1),
                shutdown: CancellationToken::new(),
            }),
        })
    }

    pub fn name(&self) -> &str {
        &self.inner.core.name
    }

    /// The descriptor peers see (also served on the TCP endpoint).
    pub fn descriptor(&self) -> SegmentDescriptor {
        self.inner.core.descriptor()
    }

    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.descriptor().tcp
    }

    /// Publishes the current descriptor (buffer list) to the metadata store again.
    pub async fn publish(&self) -> Result<()> {
        self.inner.store.publish(self.descriptor()).await
    }

    fn add_buffer(&self, region: Region) -> Buffer {
        let core = &self.inner.core;
        let id = core.next_buffer.fetch_add(1, Ordering::Relaxed);
        let region = Arc::new(region);
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
        debug!(engine = %core.name, buffer = id, bytes = region.len(), "registered");
        Buffer {
            id,
            region,
            core: Arc::downgrade(core),
        }
    }

    /// Allocates and registers `len` zeroed, page-aligned bytes.
    pub fn allocate(&self, len: u64) -> Result<Buffer> {
        let len = usize::try_from(len).map_err(|_| {
            Error::new(
                ErrorKind::InvalidLength,
                format!("{len} bytes does not fit in memory"),
            )
        })?;
        Ok(self.add_buffer(self.region(len, false)?))
    }

    fn region(&self, len: usize, lock: bool) -> Result<Region> {
        if self.inner.core.shareable {
            Region::allocate_shared(len, lock)
        } else {
            Region::allocate(len, lock)
        }
    }

    /// Allocates, registers and locks (mlock, best effort) `len` bytes.
    pub fn allocate_locked(&self, len: u64) -> Result<Buffer> {
        let len = usize::try_from(len).map_err(|_| {
            Error::new(
                ErrorKind::InvalidLength,
                format!("{len} bytes does not fit in memory"),
            )
        })?;
        Ok(self.add_buffer(self.region(len, true)?))
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
        Ok(self.add_buffer(region))
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
        buffers.remove(&buffer.id);
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
        let g = core.grants().issue(
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
        debug!(engine = %core.name, grant = g.epoch, buffer = g.buffer, offset, len, %access, "granted");
        Ok(g)
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
        let desc = tcp::describe(
            addr,
            self.name(),
            &self.inner.tcp_cfg,
            &self.inner.core.live,
        )
        .await?;
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
        for (i, p, alive) in rest {
            let task = run_task(self.inner.clone(), batch.shared.clone(), i, p, alive, true);
            tokio::spawn(task.instrument(span.clone()));
        }
        Ok(batch)
    }

    /// Validates, creates the batch and runs what can run inline; returns the tasks that still
    /// need a driver.
    #[allow(clippy::type_complexity)]
    fn start(
        &self,
        requests: Vec<Request>,
        timeout: Option<Duration>,
    ) -> Result<(Batch, Vec<(usize, Prepared, TaskAlive)>, tracing::Span)> {
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
                Ok(Prepared {
                    req: r.clone(),
                    buf,
                    _lease: lease,
                })
            })()
            .map_err(named)?;
            prepared.push(p);
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
        for (i, p) in prepared.into_iter().enumerate() {
            core.live.tasks.fetch_add(1, Ordering::AcqRel);
            // The count is given back by this guard however the task ends, even when its
            // driver future is dropped before its first poll (`transfer` ending on an early
            // failure), which used to leave the count up for good.
            let alive = TaskAlive(core.live.clone());
            if let Some(p) = span.in_scope(|| inner.try_inline(&shared, i, p, alive)) {
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
            if let Some((i, p, alive)) = rest.pop() {
                run_task(self.inner.clone(), batch.shared.clone(), i, p, alive, false)
                    .instrument(span)
                    .await;
            }
            return batch.outcome().expect("every task has ended");
        }
        let drivers = futures_util::future::join_all(rest.into_iter().map(|(i, p, alive)| {
            run_task(self.inner.clone(), batch.shared.clone(), i, p, alive, false)
                .instrument(span.clone())
        }));
        tokio::select! {
            _ = drivers => batch.wait_all().await,
            // The first failure ends the wait; dropping `drivers` cancels the rest.
            r = batch.wait_all() => r,
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

/// Decrements the engine's task count when a task's driver ends, however it ends.
struct TaskAlive(Arc<Liveness>);

impl Drop for TaskAlive {
    fn drop(&mut self) {
        self.0.dec(&self.0.tasks);
    }
}

/// Drives one task to its terminal state. `cancelable`: whether someone else can cancel the
/// batch while this runs (a submitted batch can; `transfer()`'s single task is canceled by
/// dropping its future instead, so it skips registering for that).
async fn run_task(
    inner: Arc<EngineInner>,
    batch: Arc<BatchShared>,
    i: usize,
    p: Prepared,
    alive: TaskAlive,
    cancelable: bool,
) {
    let r = &p.req;
    if !batch.lock().start(i) {
        return;
    }
    let span = transfer_span(i, r);
    let started = Instant::now();
    let moved = async {
        let peer = inner.peer(&r.grant.segment).await?;
        tracing::Span::current()
            .record("transport", peer.info.transport)
            .record("device", peer.info.device.as_str());
        let s = peer.link.slicing();
        if r.len <= s.slice_size {
            // One slice: no stream machinery on the latency path.
            peer.link.execute(r.slice(&p.buf.region, 0, r.len)).await?;
            batch.progress(i, r.len);
            return Ok(());
        }
        let mut pending = futures_util::stream::iter(slices(r.len, s.slice_size))
            .map(|(off, len)| {
                let fut = peer.link.execute(r.slice(&p.buf.region, off, len));
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
    ) -> Option<(usize, Prepared, TaskAlive)> {
        let peer = match self.peers.try_lock() {
            Ok(peers) => peers.get(&p.req.grant.segment).cloned(),
            Err(_) => None,
        };
        let Some(peer) = peer else {
            return Some((i, p, alive));
        };
        let r = &p.req;
        if r.len > peer.link.slicing().slice_size {
            return Some((i, p, alive));
        }
        let op = r.slice(&p.buf.region, 0, r.len);
        let span = transfer_span(i, r);
        span.record("transport", peer.info.transport)
            .record("device", peer.info.device.as_str());
        let started = Instant::now();
        let outcome = match span.in_scope(|| peer.link.execute_inline(&op)) {
            None => return Some((i, p, alive)),
            Some(Ok(())) => TaskState::Completed,
            Some(Err(e)) => TaskState::Failed(e),
        };
        batch.lock().start(i);
        conclude(batch, i, p, alive, &span, started, outcome);
        None
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
                TransportPolicy::Only(name) => t.name() == name,
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
                        transport = info.transport,
                        device = %info.device,
                        "selected transport"
                    );
                    let p = Arc::new(Peer { link, info });
                    peers.insert(segment.to_owned(), p.clone());
                    return Ok(p);
                }
                Err(e) => {
                    warn!(engine = %self.core.name, peer = %segment, transport = t.name(), error = %e, "connect failed");
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
        core.grants().revoke_all();
        loopback::unregister(core.instance);
        drop(self.server.lock().unwrap_or_else(|p| p.into_inner()).take());
        drop(
            self.shm_server
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
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
