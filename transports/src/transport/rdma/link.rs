//! The rdma transport: per-peer RC queue pairs set up over a small TCP control connection,
//! grants resolved to (address, rkey) keys, one-sided WRITE / READ slices.
//!
//! Shaped for the transport seam's hooks: [`RdmaNode::on_register`] / [`on_unregister`],
//! [`RdmaNode::grant_key`] (the grant-issue hook: the key bytes a grant carries) and
//! [`RdmaNode::on_revoke`] (returns once the device refuses the grant's rkey). The key travels
//! with the grant ([`SliceOp::key`]), so a slice starts without asking the target anything; the
//! control connection sets up queue pairs and, only after the device refused an access, asks the
//! target's admission why (revoked, expired, unknown). Peers' control addresses come from their
//! descriptors' rdma endpoint (or [`RdmaTransport::add_peer`] in tools and tests).
//!
//! [`on_unregister`]: RdmaNode::on_unregister

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};
use crate::grant::{Access, Grant, GrantRef};
use crate::memory::Region;
use crate::segment::Endpoint as SegmentEndpoint;
use crate::segment::SegmentDescriptor;
use crate::transport::{
    Admission, BoxFuture, Counted, Link, LinkInfo, OpKind, SliceOp, Slicing, Started, Transport,
    TransportKind,
};

pub use super::RdmaConfig;

use super::fence::FencedGrant;
use super::keys::{Endpoint, FenceKind, GrantKey};
use super::verbs::{Device, MemoryRegistration, QueuePair, RemoteAccess, RemoteOp, Run, flushed};
use crate::transport::cuda::gpudirect::{Capabilities, Notice, RegistrationPath, decide};

/// Checks a grant access on the target: the engine's admission (grant table, token, expiry,
/// access kind); returns the buffer's region and the grant. With the seam's `Admission`:
/// `admission.admit(access, wire, 0, 1).map(|(r, a)| (r, a.entry.grant.clone()))`.
pub type Admit = Arc<dyn Fn(Access, GrantRef) -> Result<(Arc<Region>, Grant)> + Send + Sync>;

/// One engine's use of one RDMA device: local registrations, and the fences of grants it issued.
pub struct RdmaNode {
    device: Arc<Device>,
    cfg: RdmaConfig,
    gid_index: u32,
    /// Registrations of local regions, by start address.
    local: Mutex<HashMap<usize, Arc<MemoryRegistration>>>,
    /// Fenced grants by epoch, with the wire reference they were issued for.
    granted: Mutex<HashMap<u64, (GrantRef, FencedGrant)>>,
    /// The engine this node serves (for its log lines); set when the transport starts.
    engine: std::sync::OnceLock<String>,
    /// How this engine's GPU memory reaches the device: decided at its first GPU region, and
    /// turned to staging for good if the device refuses a dma-buf registration.
    gpu_path: Mutex<Option<RegistrationPath>>,
    /// Says "staged, because ..." once per engine.
    notice: Notice,
    /// Whether the first GPUDirect registration was logged.
    gpudirect_said: AtomicBool,
}

impl std::fmt::Debug for RdmaNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaNode")
            .field("device", &self.device.name())
            .field("port", &self.cfg.port)
            .field("gid_index", &self.gid_index)
            .finish()
    }
}

impl RdmaNode {
    /// Opens the device and checks the port is active and has a usable GID.
    pub fn open(cfg: RdmaConfig) -> Result<Arc<Self>> {
        let device = Device::open(cfg.device.as_deref())?;
        let port = device.port(cfg.port)?;
        if !port.active {
            return Err(Error::new(
                ErrorKind::Unreachable,
                format!(
                    "rdma device {} port {}: port is {}, not active",
                    device.name(),
                    cfg.port,
                    port.state
                ),
            ));
        }
        let gid_index = match cfg.gid_index {
            Some(i) => {
                device.gid(cfg.port, i)?;
                i
            }
            None => device.default_gid_index(cfg.port)?,
        };
        Ok(Arc::new(Self {
            device,
            cfg,
            gid_index,
            local: Mutex::new(HashMap::new()),
            granted: Mutex::new(HashMap::new()),
            engine: std::sync::OnceLock::new(),
            gpu_path: Mutex::new(None),
            notice: Notice::default(),
            gpudirect_said: AtomicBool::new(false),
        }))
    }

    fn engine_name(&self) -> &str {
        self.engine.get().map(String::as_str).unwrap_or("rdma")
    }

    /// How GPU memory of `region`'s device reaches this RDMA device: GPUDirect RDMA where the
    /// GPU exports dma-bufs, else staged through pinned host memory (said once, with why).
    /// Probed at the first GPU region and kept.
    pub fn gpu_path(&self, region: &Region) -> RegistrationPath {
        let mut p = self.gpu_path.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(path) = &*p {
            return path.clone();
        }
        let gpu_dmabuf = match region.device() {
            Some(dev) => dev
                .dmabuf_supported()
                .map_err(|e| format!("{}: {}", dev.describe(), e.detail())),
            None => Err("the region is host memory".into()),
        };
        let path = decide(&Capabilities {
            rdma_built: true,
            rdma_device: Some(self.device.name().to_string()),
            gpu_dmabuf,
        });
        self.notice.staged_once(self.engine_name(), &path);
        *p = Some(path.clone());
        path
    }

    /// The device refused a dma-buf registration: this engine stages GPU memory from now on.
    fn fall_back(&self, why: &Error) -> RegistrationPath {
        let path = RegistrationPath::Staged(format!(
            "{} refused to register GPU memory: {}",
            self.device.name(),
            why.detail()
        ));
        *self.gpu_path.lock().unwrap_or_else(|p| p.into_inner()) = Some(path.clone());
        self.notice.staged_once(self.engine_name(), &path);
        path
    }

    /// Whether `region` is GPU memory this engine stages (no registration of its own).
    fn stages(&self, region: &Region) -> bool {
        region.is_device() && matches!(self.gpu_path(region), RegistrationPath::Staged(_))
    }

    /// Registers GPU memory through a dma-buf, or says why not and turns to staging.
    fn register_gpu(
        &self,
        region: &Arc<Region>,
        offset: u64,
        len: u64,
        access: RemoteAccess,
    ) -> Result<Option<MemoryRegistration>> {
        if self.stages(region) {
            return Ok(None);
        }
        match self.device.register(region, offset, len, access) {
            Ok(r) => {
                if !self.gpudirect_said.swap(true, Ordering::AcqRel) {
                    tracing::info!(
                        engine = self.engine_name(),
                        device = self.device.name(),
                        gpu = region.device().map(|d| d.describe()).unwrap_or_default(),
                        path = RegistrationPath::Dmabuf.name(),
                        "rdma: GPUDirect RDMA: GPU memory is registered with the device as a dma-buf"
                    );
                }
                Ok(Some(r))
            }
            // the export or the registration refused (a bad range is the caller's error)
            Err(e) if e.kind() != ErrorKind::Resource => Err(e),
            Err(e) => {
                self.fall_back(&e);
                Ok(None)
            }
        }
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    pub fn gid_index(&self) -> u32 {
        self.gid_index
    }

    /// The register hook: registers a buffer's region for local use (the source of writes,
    /// the landing of reads).
    pub fn on_register(&self, _buffer: u32, region: &Arc<Region>) -> Result<()> {
        if self.stages(region) {
            return Ok(());
        }
        match self.local_registration(region) {
            // refused: GPU memory stages from now on (said once), the buffer still registers
            Err(_) if self.stages(region) => Ok(()),
            r => r.map(|_| ()),
        }
    }

    /// The unregister hook: drops the region's local registration (in-flight slices hold
    /// their own reference until their work requests completed).
    pub fn on_unregister(&self, _buffer: u32, region: &Arc<Region>) {
        self.lock_local().remove(&region.addr());
    }

    /// The grant-issue hook: the key bytes the grant carries to initiators (sealed with the
    /// grant's reference: [`GrantKey::sealed`]).
    pub fn on_grant(&self, grant: &Grant, region: &Arc<Region>) -> Result<Option<Vec<u8>>> {
        Ok(Some(
            self.grant_key(grant, region)?
                .sealed(&grant.wire())
                .to_bytes(),
        ))
    }

    fn lock_local(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Arc<MemoryRegistration>>> {
        self.local.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_granted(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (GrantRef, FencedGrant)>> {
        self.granted.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The registration covering `region` (the register hook made it; regions used without
    /// it, as in tools and tests that drive a link directly, are registered on first use).
    pub fn local_registration(&self, region: &Arc<Region>) -> Result<Arc<MemoryRegistration>> {
        if let Some(r) = self.lock_local().get(&region.addr())
            && r.is_over(region)
        {
            return Ok(r.clone());
        }
        let whole = (0, region.len() as u64, RemoteAccess::ReadWrite);
        let r = if region.is_device() {
            Arc::new(
                self.register_gpu(region, whole.0, whole.1, whole.2)?
                    .ok_or_else(|| self.staged_error(region, "register it for local use"))?,
            )
        } else {
            Arc::new(self.device.register(region, whole.0, whole.1, whole.2)?)
        };
        self.lock_local().insert(region.addr(), r.clone());
        Ok(r)
    }

    /// Why GPU memory that this engine stages cannot be `what` directly.
    fn staged_error(&self, region: &Region, what: &str) -> Error {
        let why = match self.gpu_path(region) {
            RegistrationPath::Staged(why) => why,
            RegistrationPath::Dmabuf => "GPUDirect RDMA refused".into(),
        };
        Error::new(
            ErrorKind::Resource,
            format!(
                "rdma: cannot {what}: {} bytes of GPU memory ({}) without GPUDirect RDMA ({why})",
                region.len(),
                region.device().map(|d| d.describe()).unwrap_or_default()
            ),
        )
    }

    /// The key for `grant` over `region`: a memory region registered over exactly the granted
    /// range (memory windows on rxe do not bound the range: see the rdma tests). Idempotent per
    /// grant epoch.
    pub fn grant_key(&self, grant: &Grant, region: &Arc<Region>) -> Result<GrantKey> {
        if let Some((wire, f)) = self.lock_granted().get(&grant.epoch)
            && *wire == grant.wire()
        {
            return Ok(f.key());
        }
        let access = match grant.access {
            Access::Write => RemoteAccess::Write,
            Access::Read => RemoteAccess::Read,
        };
        let fenced = if region.is_device() {
            // Without GPUDirect the key names a host bounce buffer instead; the initiator asks
            // for each write to be copied to the GPU (`sync_grant`).
            match self.register_gpu(region, grant.offset, grant.len, access)? {
                Some(r) => FencedGrant::registered(r, grant.len),
                None => FencedGrant::bounce(&self.device, region, grant.offset, grant.len, access)?,
            }
        } else {
            FencedGrant::register(&self.device, region, grant.offset, grant.len, access)?
        };
        let key = fenced.key();
        self.lock_granted()
            .insert(grant.epoch, (grant.wire(), fenced));
        Ok(key)
    }

    /// Copies `part..part+len` of a staged grant (GPU memory behind a bounce buffer) from the
    /// bounce buffer to the GPU, after a peer's write landed there. Runs under the grants'
    /// lock, so a revoke waits for it, and a grant revoked before it gets no byte.
    pub fn sync_grant(&self, grant: &GrantRef, part: u64, len: u64) -> Result<()> {
        let g = self.lock_granted();
        match g.get(&grant.epoch) {
            Some((wire, f)) if wire == grant => f.sync(part, len),
            _ => Err(Error::new(
                ErrorKind::GrantRevoked,
                format!(
                    "rdma: grant epoch {} of buffer {} was revoked before its staged bytes \
                     reached GPU memory",
                    grant.epoch, grant.buffer
                ),
            )),
        }
    }

    /// The revoke hook: once this returns, the grant's rkey is refused by the device.
    pub fn on_revoke(&self, grant: &GrantRef) {
        if let Err(e) = self.revoke_grant(grant) {
            tracing::error!(
                epoch = grant.epoch,
                "rdma: closing a revoked grant's fence: {e}"
            );
        }
    }

    /// Closes a grant's fence: once this returns, its rkey is refused by the device.
    pub fn revoke_grant(&self, grant: &GrantRef) -> Result<()> {
        let taken = {
            let mut g = self.lock_granted();
            match g.get(&grant.epoch) {
                Some((wire, _)) if wire == grant => g.remove(&grant.epoch),
                _ => None,
            }
        };
        match taken {
            Some((_, f)) => f
                .revoke(Instant::now() + Duration::from_secs(10))
                .map(|_| ()),
            None => Ok(()),
        }
    }

    /// Local regions registered with the device (for leak checks: the unregister hook drops
    /// them).
    pub fn local_registrations(&self) -> usize {
        self.lock_local().len()
    }

    /// Grants with a live fence on the device (for leak checks).
    pub fn fenced_grants(&self) -> usize {
        self.lock_granted().len()
    }

    fn new_queue_pair(&self) -> Result<Arc<QueuePair>> {
        QueuePair::create_with_spin(
            &self.device,
            self.cfg.port,
            self.cfg.max_outstanding,
            self.cfg.completion_spin,
        )
    }

    /// Device, port, GID index and the GID itself: what the engine logs for each peer (the
    /// evidence that a transfer ran over this device, not over TCP).
    fn describe(&self) -> String {
        let gid = self
            .device
            .gid(self.cfg.port, self.gid_index)
            .map(|g| fmt_gid(&g).to_string())
            .unwrap_or_else(|e| format!("unreadable ({e})"));
        format!(
            "{} port {} gid[{}] {gid}",
            self.device.name(),
            self.cfg.port,
            self.gid_index
        )
    }
}

// ---------------------------------------------------------------------------------------------
// control connection: [kind u8][len u32 le][payload], replies [status u8][len u32 le][payload]
// ---------------------------------------------------------------------------------------------

const REQ_CONNECT: u8 = 1;
const REQ_RESOLVE: u8 = 2;
/// After a write into a staged grant: copy what landed in the bounce buffer to the GPU.
const REQ_SYNC: u8 = 3;
const MAX_FRAME: usize = 4096;

fn write_frame(s: &mut TcpStream, tag: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(5 + payload.len());
    b.push(tag);
    b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    b.extend_from_slice(payload);
    s.write_all(&b)
}

fn read_frame(s: &mut TcpStream) -> Result<(u8, Vec<u8>)> {
    let mut h = [0u8; 5];
    s.read_exact(&mut h)
        .map_err(|e| io_err("read a control frame", e))?;
    let len = u32::from_le_bytes(h[1..5].try_into().expect("4 bytes")) as usize;
    if len > MAX_FRAME {
        return Err(Error::new(
            ErrorKind::Malformed,
            format!("rdma control frame of {len} bytes, limit {MAX_FRAME}"),
        ));
    }
    let mut p = vec![0u8; len];
    s.read_exact(&mut p)
        .map_err(|e| io_err("read a control frame", e))?;
    Ok((h[0], p))
}

fn io_err(what: &str, e: std::io::Error) -> Error {
    let kind = match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => ErrorKind::PeerDisconnected,
        std::io::ErrorKind::ConnectionRefused => ErrorKind::Unreachable,
        _ => ErrorKind::Io,
    };
    Error::new(kind, format!("rdma control: {what}: {e}"))
}

fn error_payload(e: &Error) -> Vec<u8> {
    let mut b = e.kind().code().to_le_bytes().to_vec();
    let d = e.detail().as_bytes();
    b.extend_from_slice(&d[..d.len().min(1024)]);
    b
}

fn decode_error(p: &[u8]) -> Error {
    if p.len() < 2 {
        return Error::new(ErrorKind::Malformed, "rdma control: short error reply");
    }
    let code = u16::from_le_bytes([p[0], p[1]]);
    let detail = String::from_utf8_lossy(&p[2..]).into_owned();
    match ErrorKind::from_code(code) {
        Some(k) => Error::new(k, detail),
        None => Error::new(
            ErrorKind::Malformed,
            format!("rdma control: unknown error code {code}: {detail}"),
        ),
    }
}

fn encode_resolve(access: Access, g: &GrantRef) -> Vec<u8> {
    let mut b = Vec::with_capacity(21);
    b.push(match access {
        Access::Write => 1,
        Access::Read => 2,
    });
    b.extend_from_slice(&g.buffer.to_le_bytes());
    b.extend_from_slice(&g.epoch.to_le_bytes());
    b.extend_from_slice(&g.token.to_le_bytes());
    b
}

/// `[part u64][len u64]` then the write grant's resolve payload.
fn encode_sync(part: u64, len: u64, g: &GrantRef) -> Vec<u8> {
    let mut b = Vec::with_capacity(37);
    b.extend_from_slice(&part.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b.extend_from_slice(&encode_resolve(Access::Write, g));
    b
}

fn decode_sync(p: &[u8]) -> Result<(u64, u64, GrantRef)> {
    if p.len() != 37 {
        return Err(Error::new(
            ErrorKind::Malformed,
            format!("rdma sync request of {} bytes, expected 37", p.len()),
        ));
    }
    let u64_at = |i: usize| u64::from_le_bytes(p[i..i + 8].try_into().expect("8 bytes"));
    match decode_resolve(&p[16..])? {
        (Access::Write, g) => Ok((u64_at(0), u64_at(8), g)),
        (Access::Read, _) => Err(Error::new(
            ErrorKind::Malformed,
            "rdma sync request for a read grant",
        )),
    }
}

fn decode_resolve(p: &[u8]) -> Result<(Access, GrantRef)> {
    if p.len() != 21 {
        return Err(Error::new(
            ErrorKind::Malformed,
            format!("rdma key request of {} bytes, expected 21", p.len()),
        ));
    }
    let access = match p[0] {
        1 => Access::Write,
        2 => Access::Read,
        a => {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!("rdma key request: unknown access {a}"),
            ));
        }
    };
    Ok((
        access,
        GrantRef {
            buffer: u32::from_le_bytes(p[1..5].try_into().expect("4")),
            epoch: u64::from_le_bytes(p[5..13].try_into().expect("8")),
            token: u64::from_le_bytes(p[13..21].try_into().expect("8")),
        },
    ))
}

/// The target side: accepts control connections, sets up one queue pair per connection, and
/// resolves admitted grants to keys.
pub struct RdmaServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// Queue pairs of live control connections (for fault injection: [`fail_queue_pairs`]).
    ///
    /// [`fail_queue_pairs`]: RdmaServer::fail_queue_pairs
    accepted: Arc<Mutex<Vec<std::sync::Weak<QueuePair>>>>,
    /// Open control connections by id, to close them at shutdown.
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
    accept: Option<std::thread::JoinHandle<()>>,
}

/// Bytes of the secret a queue pair setup must present when the server has one.
pub const SECRET_LEN: usize = 16;

impl RdmaServer {
    /// A server that sets up queue pairs for anyone who reaches it (tools and tests).
    pub fn start(node: Arc<RdmaNode>, admit: Admit) -> Result<Self> {
        Self::start_with_secret(node, admit, None)
    }

    /// A server that sets up queue pairs only for peers presenting `secret` (the engine's:
    /// published in its descriptor's rdma endpoint, so only peers that learned the descriptor
    /// can reach its memory).
    pub fn start_with_secret(
        node: Arc<RdmaNode>,
        admit: Admit,
        secret: Option<[u8; SECRET_LEN]>,
    ) -> Result<Self> {
        let listener = TcpListener::bind(node.cfg.listen)
            .map_err(|e| io_err(&format!("listen on {}", node.cfg.listen), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| io_err("local address", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let accepted: Arc<Mutex<Vec<std::sync::Weak<QueuePair>>>> = Arc::default();
        let accepted2 = accepted.clone();
        let conns: Arc<Mutex<HashMap<u64, TcpStream>>> = Arc::default();
        let conns2 = conns.clone();
        let accept = std::thread::Builder::new()
            .name("rdma-control".into())
            .spawn(move || {
                for (id, conn) in listener.incoming().enumerate() {
                    if stop2.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let id = id as u64;
                    if let Ok(c) = conn.try_clone() {
                        conns2
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(id, c);
                    }
                    let (node, admit) = (node.clone(), admit.clone());
                    let (accepted, conns) = (accepted2.clone(), conns2.clone());
                    let _ = std::thread::Builder::new()
                        .name("rdma-peer".into())
                        .spawn(move || {
                            serve(conn, node, admit, accepted, secret);
                            conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                        });
                }
            })
            .map_err(|e| io_err("spawn the control thread", e))?;
        Ok(Self {
            addr,
            stop,
            accepted,
            conns,
            accept: Some(accept),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Moves every queue pair peers connected to ERROR, as if this node died: peers' requests
    /// get no answer until they give up (fault injection).
    pub fn fail_queue_pairs(&self) {
        let mut a = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        a.retain(|w| w.strong_count() > 0);
        for qp in a.iter().filter_map(|w| w.upgrade()) {
            let _ = qp.set_error();
        }
    }
}

impl RdmaServer {
    /// Stops accepting and closes every control connection: their queue pairs go to ERROR and
    /// are destroyed, so no peer reaches this node's memory any more (the seam's shutdown hook).
    pub fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.accept.take() {
            // wake the accept loop
            let _ = TcpStream::connect(self.addr);
            let _ = t.join();
        }
        for (_, c) in self.conns.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        self.fail_queue_pairs();
    }
}

impl Drop for RdmaServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One peer's control connection. Its queue pairs live as long as the connection; when it
/// closes they are moved to ERROR (nothing more lands) and destroyed.
fn serve(
    mut s: TcpStream,
    node: Arc<RdmaNode>,
    admit: Admit,
    accepted: Arc<Mutex<Vec<std::sync::Weak<QueuePair>>>>,
    secret: Option<[u8; SECRET_LEN]>,
) {
    let _ = s.set_nodelay(true);
    let mut qps: Vec<Arc<QueuePair>> = Vec::new();
    // a connection that has not presented the secret may ask nothing else either
    let mut admitted = secret.is_none();
    while let Ok((kind, p)) = read_frame(&mut s) {
        let reply = match kind {
            REQ_CONNECT => (|| {
                if p.len() < SECRET_LEN {
                    return Err(Error::new(
                        ErrorKind::Malformed,
                        format!("rdma control: a {}-byte queue pair request", p.len()),
                    ));
                }
                let (presented, endpoint) = p.split_at(SECRET_LEN);
                if let Some(want) = &secret {
                    // compared in full whatever differs first
                    let diff = want
                        .iter()
                        .zip(presented)
                        .fold(0u8, |d, (a, b)| d | (a ^ b));
                    if diff != 0 {
                        return Err(Error::new(
                            ErrorKind::AccessDenied,
                            "rdma control: queue pair setup without this engine's secret \
                             (it is in the engine's descriptor)",
                        ));
                    }
                }
                let remote = Endpoint::from_bytes(endpoint)?;
                let qp = node.new_queue_pair()?;
                let local = qp.endpoint(node.gid_index)?;
                qp.connect(&remote, node.gid_index)?;
                tracing::info!(
                    transport = "rdma",
                    device = node.device.name(),
                    port = node.cfg.port,
                    gid_index = node.gid_index,
                    peer_device = %remote.device,
                    peer_qpn = remote.qpn,
                    "rdma: accepted a queue pair from a peer"
                );
                accepted
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(Arc::downgrade(&qp));
                qps.push(qp);
                admitted = true;
                Ok(local.to_bytes())
            })(),
            REQ_RESOLVE => (|| {
                if !admitted {
                    return Err(Error::new(
                        ErrorKind::AccessDenied,
                        "rdma control: a grant question before queue pair setup",
                    ));
                }
                let (access, wire) = decode_resolve(&p)?;
                let (region, grant) = admit(access, wire)?;
                Ok(node.grant_key(&grant, &region)?.to_bytes())
            })(),
            REQ_SYNC => (|| {
                if !admitted {
                    return Err(Error::new(
                        ErrorKind::AccessDenied,
                        "rdma control: a sync before queue pair setup",
                    ));
                }
                let (part, len, grant) = decode_sync(&p)?;
                // the engine's admission first: expired, unknown, wrong token
                admit(Access::Write, grant)?;
                node.sync_grant(&grant, part, len).map(|_| Vec::new())
            })(),
            k => Err(Error::new(
                ErrorKind::Malformed,
                format!("rdma control: unknown request kind {k}"),
            )),
        };
        let sent = match reply {
            Ok(b) => write_frame(&mut s, 0, &b),
            Err(e) => write_frame(&mut s, 1, &error_payload(&e)),
        };
        if sent.is_err() {
            break;
        }
    }
    for qp in qps {
        let _ = qp.set_error();
    }
}

/// The rdma endpoint a descriptor publishes: `ip:port#` and the secret in 32 hex digits.
fn parse_endpoint(e: &str) -> Option<(SocketAddr, [u8; SECRET_LEN])> {
    let (addr, hex) = e.split_once('#')?;
    if hex.len() != 2 * SECRET_LEN || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut secret = [0u8; SECRET_LEN];
    for (i, b) in secret.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some((addr.parse().ok()?, secret))
}

fn rng_err(e: getrandom::Error) -> Error {
    Error::new(
        ErrorKind::Resource,
        format!("rdma: the OS random number generator failed: {e}"),
    )
}

/// Starts the engine's rdma transport: opens the device (blocking verbs calls, off the
/// runtime) and the control server, whose key requests go through the engine's admission.
pub(super) fn start(
    cfg: RdmaConfig,
    engine: Admission,
) -> BoxFuture<'static, Result<Arc<dyn Transport>>> {
    Box::pin(async move {
        let node = tokio::task::spawn_blocking(move || RdmaNode::open(cfg))
            .await
            .map_err(|e| Error::new(ErrorKind::Io, format!("rdma open task: {e}")))??;
        let adm = engine.clone();
        let admit: Admit = Arc::new(move |access, wire| {
            let (region, a) = adm.admit(access, wire, 0, 1)?;
            Ok((region, a.entry.grant.clone()))
        });
        let mut secret = [0u8; SECRET_LEN];
        secret[..8].copy_from_slice(&getrandom::u64().map_err(rng_err)?.to_le_bytes());
        secret[8..].copy_from_slice(&getrandom::u64().map_err(rng_err)?.to_le_bytes());
        let server = RdmaServer::start_with_secret(node.clone(), admit, Some(secret))?;
        tracing::info!(
            transport = "rdma",
            engine = engine.engine(),
            device = node.device.name(),
            port = node.cfg.port,
            gid_index = node.gid_index,
            control = %server.addr(),
            "rdma: engine serves its memory through this device"
        );
        let _ = node.engine.set(engine.engine().to_string());
        let mut t = RdmaTransport::new(node);
        t.addr = Some(server.addr());
        t.secret = Some(secret);
        t.server = Mutex::new(Some(server));
        t.admission = Some(engine);
        Ok(Arc::new(t) as Arc<dyn Transport>)
    })
}

/// The engine's rdma transport: the initiator side (links to peers) and, when started through
/// the engine, the target side (the control server, grant keys, fences).
pub struct RdmaTransport {
    node: Arc<RdmaNode>,
    /// Peers' control addresses added by hand (tests, tools), besides descriptors' endpoints.
    peers: Mutex<HashMap<String, SocketAddr>>,
    addr: Option<SocketAddr>,
    /// What peers must present to set up queue pairs here (published with `addr`).
    secret: Option<[u8; SECRET_LEN]>,
    server: Mutex<Option<RdmaServer>>,
    admission: Option<Admission>,
}

impl RdmaTransport {
    pub fn new(node: Arc<RdmaNode>) -> Self {
        Self {
            node,
            peers: Mutex::new(HashMap::new()),
            addr: None,
            secret: None,
            server: Mutex::new(None),
            admission: None,
        }
    }

    pub fn node(&self) -> &Arc<RdmaNode> {
        &self.node
    }

    pub fn add_peer(&self, segment: impl Into<String>, control: SocketAddr) {
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(segment.into(), control);
    }

    /// The peer's control address and the secret its queue pair setup asks for: from its
    /// descriptor's rdma endpoint (`ip:port#hex`), else from [`RdmaTransport::add_peer`].
    fn peer_addr(&self, peer: &SegmentDescriptor) -> Option<(SocketAddr, [u8; SECRET_LEN])> {
        if let Some(e) = peer
            .endpoint(TransportKind::Rdma)
            .and_then(|b| std::str::from_utf8(b).ok())
        {
            return parse_endpoint(e);
        }
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&peer.name)
            .map(|a| (*a, [0; SECRET_LEN]))
    }
}

impl Transport for RdmaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn reaches(&self, peer: &SegmentDescriptor) -> bool {
        self.peer_addr(peer).is_some()
    }

    fn endpoint(&self) -> Option<SegmentEndpoint> {
        let secret: String = self
            .secret
            .unwrap_or_default()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        self.addr
            .map(|a| SegmentEndpoint::new(TransportKind::Rdma, format!("{a}#{secret}")))
    }

    fn on_register(&self, buffer: u32, region: &Arc<Region>) -> Result<()> {
        self.node.on_register(buffer, region)
    }

    fn on_unregister(&self, buffer: u32, region: &Arc<Region>) {
        self.node.on_unregister(buffer, region)
    }

    fn on_grant(&self, grant: &Grant, region: &Arc<Region>) -> Result<Option<Vec<u8>>> {
        self.node.on_grant(grant, region)
    }

    fn on_revoke(&self, grant: &GrantRef) {
        self.node.on_revoke(grant)
    }

    fn shutdown(&self) {
        if let Some(mut s) = self.server.lock().unwrap_or_else(|p| p.into_inner()).take() {
            s.shutdown();
        }
    }

    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>> {
        let node = self.node.clone();
        let found = self.peer_addr(&peer);
        let mut counted = self.admission.as_ref().map(|a| a.connection());
        let queue_pairs = self.node.cfg.queue_pairs_per_peer;
        let max_runs = self.node.cfg.runs_per_queue_pair.max(1);
        Box::pin(async move {
            let (addr, secret) = found.ok_or_else(|| {
                Error::new(
                    ErrorKind::NoTransport,
                    "peer has no (valid) rdma endpoint: expected ip:port#32 hex digits",
                )
                .with_peer(&peer.name)
            })?;
            let lanes: Vec<Arc<Shared>> = (0..queue_pairs.max(1))
                .map(|i| {
                    Arc::new(Shared {
                        node: node.clone(),
                        peer: peer.name.clone(),
                        addr,
                        secret,
                        conn: Mutex::new(None),
                        runs: Arc::new(tokio::sync::Semaphore::new(max_runs)),
                        max_runs,
                        // the first lane counts the link in the engine's open connections
                        _counted: if i == 0 { counted.take() } else { None },
                    })
                })
                .collect();
            let link = lanes[0].clone();
            // connect every lane now: an unreachable peer fails here, and a peer that goes
            // away later is seen as gone on every lane (its control connections close)
            let l = lanes.clone();
            tokio::task::spawn_blocking(move || {
                l.iter().try_for_each(|l| l.connection().map(|_| ()))
            })
            .await
            .map_err(|e| Error::new(ErrorKind::Io, format!("rdma connect task: {e}")))?
            .map_err(|e| e.with_peer(&peer.name))?;
            link.announce();
            Ok(Arc::new(RdmaLink {
                lanes,
                next: AtomicUsize::new(0),
            }) as Arc<dyn Link>)
        })
    }
}

struct Conn {
    control: Mutex<TcpStream>,
    qp: Arc<QueuePair>,
    remote: Endpoint,
}

impl Conn {
    /// Whether the peer closed the control connection: its engine (or its rdma transport) is
    /// gone and nothing in flight will ever complete. Checked without blocking; `false` while a
    /// key request holds the connection.
    fn peer_gone(&self) -> bool {
        let Ok(s) = self.control.try_lock() else {
            return false;
        };
        if s.set_nonblocking(true).is_err() {
            return false;
        }
        let mut b = [0u8; 1];
        let r = s.peek(&mut b);
        let _ = s.set_nonblocking(false);
        match r {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        }
    }
}

/// A link to one peer: one or more lanes, each a queue pair (with its own control connection)
/// with up to `runs_per_queue_pair` slices under way on it, their work requests posted back to
/// back. Slices of concurrent tasks spread over the lanes.
struct RdmaLink {
    lanes: Vec<Arc<Shared>>,
    next: AtomicUsize,
}

impl RdmaLink {
    /// An idle lane if there is one, else one with room for another run, else the next in
    /// turn (its queue is async).
    fn lane(&self) -> Arc<Shared> {
        let n = self.lanes.len();
        if n == 1 {
            return self.lanes[0].clone();
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let turn = || (0..n).map(|i| &self.lanes[(start + i) % n]);
        turn()
            .find(|l| l.idle())
            .or_else(|| turn().find(|l| l.runs.available_permits() > 0))
            .unwrap_or(&self.lanes[start % n])
            .clone()
    }
}

struct Shared {
    node: Arc<RdmaNode>,
    peer: String,
    addr: SocketAddr,
    /// Presented at queue pair setup (zeros where the peer asks none).
    secret: [u8; SECRET_LEN],
    conn: Mutex<Option<Arc<Conn>>>,
    /// Runs under way on the queue pair, at most `max_runs` (further slices queue here).
    runs: Arc<tokio::sync::Semaphore>,
    max_runs: usize,
    /// Counts the link in the engine's open connections while it exists (leak checks; first
    /// lane only).
    _counted: Option<Counted>,
}

impl Shared {
    /// No run under way on this lane's queue pair.
    fn idle(&self) -> bool {
        self.runs.available_permits() >= self.max_runs
    }

    /// The live connection, (re)established when there is none or its queue pair broke.
    fn connection(&self) -> Result<Arc<Conn>> {
        let mut slot = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = slot.as_ref()
            && !c.qp.is_error()
        {
            return Ok(c.clone());
        }
        // a broken queue pair is torn down (closing the control connection tells the peer to
        // drop its end) and a new one set up
        *slot = None;
        let c = Arc::new(self.dial()?);
        *slot = Some(c.clone());
        Ok(c)
    }

    fn dial(&self) -> Result<Conn> {
        let mut s = TcpStream::connect_timeout(&self.addr, Duration::from_secs(5))
            .map_err(|e| io_err(&format!("connect to {}", self.addr), e))?;
        let _ = s.set_nodelay(true);
        let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
        let qp = self.node.new_queue_pair()?;
        let local = qp.endpoint(self.node.gid_index)?;
        let mut req = self.secret.to_vec();
        req.extend_from_slice(&local.to_bytes());
        write_frame(&mut s, REQ_CONNECT, &req).map_err(|e| io_err("send the endpoint", e))?;
        let remote = match read_frame(&mut s)? {
            (0, p) => Endpoint::from_bytes(&p)?,
            (_, p) => return Err(decode_error(&p)),
        };
        qp.connect(&remote, self.node.gid_index)?;
        tracing::debug!(peer = %self.peer, qpn = qp.qpn(), peer_qpn = remote.qpn, "rdma: queue pair connected");
        Ok(Conn {
            control: Mutex::new(s),
            qp,
            remote,
        })
    }

    /// Logs which device, port and GID this link selected for its peer (the evidence the RFC
    /// asks for).
    fn announce(&self) {
        let Some(c) = self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            return;
        };
        let local_gid = self
            .node
            .device
            .gid(self.node.cfg.port, self.node.gid_index)
            .unwrap_or([0; 16]);
        tracing::info!(
            transport = "rdma",
            peer = %self.peer,
            device = self.node.device.name(),
            port = self.node.cfg.port,
            gid_index = self.node.gid_index,
            gid = %fmt_gid(&local_gid),
            peer_device = %c.remote.device,
            peer_gid = %fmt_gid(&c.remote.gid),
            mtu = c.remote.mtu,
            "rdma: selected device, port and GID for peer"
        );
    }

    /// The key the grant carries for rdma (the target's `on_grant` hook attached it), decoded
    /// and validated.
    fn op_key(op: &SliceOp) -> Result<GrantKey> {
        match &op.key {
            Some(b) => GrantKey::from_bytes(b).map(|k| k.unsealed(&op.grant)),
            None => Err(Error::new(
                ErrorKind::NoTransport,
                format!(
                    "rdma: grant epoch {} of buffer {} carries no rdma key (its engine has no \
                     rdma transport, or issued the grant before starting one)",
                    op.grant.epoch, op.grant.buffer
                ),
            )),
        }
    }

    /// Asks the peer's admission about a grant (only after the device refused an access: the
    /// key itself travels with the grant).
    fn request_key(&self, conn: &Conn, access: Access, grant: GrantRef) -> Result<GrantKey> {
        let reply = {
            let mut s = conn.control.lock().unwrap_or_else(|p| p.into_inner());
            write_frame(&mut s, REQ_RESOLVE, &encode_resolve(access, &grant))
                .map_err(|e| io_err("ask for a grant's key", e))?;
            read_frame(&mut s)?
        };
        match reply {
            (0, p) => GrantKey::from_bytes(&p),
            (_, p) => Err(decode_error(&p)),
        }
    }

    /// The device refuses a stale key and an out-of-range access alike
    /// (IBV_WC_REM_ACCESS_ERR); the peer's admission tells them apart. A grant it no longer
    /// admits (revoked, expired, unknown) becomes that error, with the verbs status kept in the
    /// detail; otherwise the refusal stays `AccessDenied`.
    fn explain(&self, conn: &Conn, op: &SliceOp, e: Error) -> Error {
        if e.kind() != ErrorKind::AccessDenied {
            return e;
        }
        match self.request_key(conn, op.kind.access(), op.grant) {
            Err(why)
                if matches!(
                    why.kind(),
                    ErrorKind::GrantRevoked | ErrorKind::UnknownGrant | ErrorKind::BadToken
                ) =>
            {
                Error::new(
                    why.kind(),
                    format!(
                        "{}; the device refused the access: {}",
                        why.detail(),
                        e.detail()
                    ),
                )
            }
            _ => e,
        }
    }

    /// The work requests for `op` on `qp`, `key` naming the grant.
    fn remote_ops(
        &self,
        op: &SliceOp,
        key: &GrantKey,
        local: &Arc<MemoryRegistration>,
    ) -> Result<Vec<RemoteOp>> {
        self.ops_at(op, key, local, op.local_offset, 0, op.len)
    }

    /// The work requests for `len` bytes of `op` from `part` on (its grant offset + `part`),
    /// to or from `local` at `local_offset`.
    fn ops_at(
        &self,
        op: &SliceOp,
        key: &GrantKey,
        local: &Arc<MemoryRegistration>,
        local_offset: u64,
        part: u64,
        len: u64,
    ) -> Result<Vec<RemoteOp>> {
        let grant_offset = op.grant_offset + part;
        key.remote_addr(grant_offset, len)?;
        let wr = self.node.cfg.work_request_size.max(1) as u64;
        Ok((0..len.div_ceil(wr))
            .map(|i| {
                let off = i * wr;
                RemoteOp {
                    write: op.kind == OpKind::Write,
                    local: local.clone(),
                    local_offset: local_offset + off,
                    len: wr.min(len - off) as u32,
                    remote_addr: key.addr + grant_offset + off,
                    rkey: key.rkey,
                }
            })
            .collect())
    }

    /// Runs `len` bytes of `op` from `part` on, to or from a registered staging buffer
    /// (blocking): connects as needed, runs once more on a fresh queue pair if another run's
    /// failure flushed it, and explains a refusal as [`finish_off_thread`] does.
    #[allow(clippy::too_many_arguments)]
    fn run_part(
        &self,
        op: &SliceOp,
        local: &Arc<MemoryRegistration>,
        local_offset: u64,
        part: u64,
        len: u64,
        cancel: &AtomicBool,
    ) -> Result<()> {
        let key = Self::op_key(op)?;
        let mut again = true;
        loop {
            let conn = self.connection()?;
            let ops = self.ops_at(op, &key, local, local_offset, part, len)?;
            let run = conn
                .qp
                .start(ops, Instant::now() + self.node.cfg.slice_deadline)?;
            match self.finish(run, &conn, cancel) {
                Err(e) if flushed(&e) && again && !cancel.load(Ordering::Acquire) => again = false,
                Err(e) => return Err(self.explain(&conn, op, e)),
                Ok(()) if key.fence == FenceKind::Staged && op.kind == OpKind::Write => {
                    return self.sync(&conn, op, part, len);
                }
                Ok(()) => return Ok(()),
            }
        }
    }

    /// Asks the target to copy `len` bytes written from `part` of a staged grant to its GPU.
    fn sync(&self, conn: &Conn, op: &SliceOp, part: u64, len: u64) -> Result<()> {
        let reply = {
            let mut s = conn.control.lock().unwrap_or_else(|p| p.into_inner());
            write_frame(
                &mut s,
                REQ_SYNC,
                &encode_sync(op.grant_offset + part, len, &op.grant),
            )
            .map_err(|e| io_err("ask for a staged write's copy to GPU memory", e))?;
            read_frame(&mut s)?
        };
        match reply {
            (0, _) => Ok(()),
            (_, p) => Err(decode_error(&p)),
        }
    }

    /// Whether `op` goes through [`run_staged`]: its local memory is GPU memory this engine
    /// stages, or its grant is staged on the target (each write is followed by a sync).
    fn needs_staging(&self, op: &SliceOp) -> bool {
        self.node.stages(&op.local) || Self::op_key(op).is_ok_and(|k| k.fence == FenceKind::Staged)
    }

    /// Everything needed is at hand (connected, key known, memory registered): start the run
    /// without blocking I/O. `None` when something must be fetched first.
    fn start_ready(&self, op: &SliceOp) -> Option<Result<(Run, Arc<Conn>)>> {
        let conn = self
            .conn
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .filter(|c| !c.qp.is_error())?;
        let local = self
            .node
            .lock_local()
            .get(&op.local.addr())
            .filter(|r| r.is_over(&op.local))
            .cloned()?;
        Some(
            Self::op_key(op)
                .and_then(|key| self.remote_ops(op, &key, &local))
                .and_then(|ops| {
                    conn.qp
                        .start(ops, Instant::now() + self.node.cfg.slice_deadline)
                })
                .map(|run| (run, conn)),
        )
    }

    /// Connects and registers as needed (blocking), then starts the run.
    fn start(&self, op: &SliceOp) -> Result<(Run, Arc<Conn>)> {
        let key = Self::op_key(op)?;
        let conn = self.connection()?;
        let local = self.node.local_registration(&op.local)?;
        let ops = self.remote_ops(op, &key, &local)?;
        let run = conn
            .qp
            .start(ops, Instant::now() + self.node.cfg.slice_deadline)?;
        Ok((run, conn))
    }

    /// Pumps `run` to its end on this (blocking) thread, watching the control connection: a
    /// peer that closed it is gone, so the run is stopped (ERROR, drained) and fails with
    /// `PeerDisconnected` at once instead of waiting out its deadline.
    fn finish(&self, mut run: Run, conn: &Conn, cancel: &AtomicBool) -> Result<()> {
        let stop = AtomicBool::new(false);
        let mut gone = false;
        loop {
            if gone || cancel.load(Ordering::Acquire) {
                stop.store(true, Ordering::Release);
            }
            match run.pump(Instant::now() + Duration::from_millis(50), Some(&stop)) {
                Ok(true) => return Ok(()),
                Ok(false) => gone = gone || conn.peer_gone(),
                Err(e) if gone => return Err(peer_went_away(&e)),
                Err(e) => return Err(e),
            }
        }
    }

    /// A failed slice names its peer.
    fn failed(&self, e: Error, _op: &SliceOp) -> Error {
        e.with_peer(&self.peer)
    }
}

/// Slices at most this long, alone on their queue pair, first spin on the caller's thread for
/// [`INLINE_WAIT`] (the engine's submitting thread through [`Link::start_inline`], or the
/// runtime thread in `execute`) before their completion wait moves to a blocking thread: a
/// thread hand-off costs more than a small write's whole round trip.
const INLINE_MAX: u64 = 64 << 10;
/// `execute` (slices of batches, several may be on their way) spins only for slices this small.
const SPIN_IN_EXECUTE_MAX: u64 = 4 << 10;
/// How long the caller's thread waits for such a slice: the completion wait's own short spin
/// (`completion_spin`), then parked on the completion channel for the rest. Under soft-RoCE a
/// 64 KiB write takes a few hundred microseconds, and handing its wait to another thread (and
/// waking the caller back) costs more than waiting here; spinning all along would take the CPU
/// the emulated device runs on.
const INLINE_WAIT: Duration = Duration::from_millis(1);

fn fmt_gid(g: &[u8; 16]) -> std::net::Ipv6Addr {
    std::net::Ipv6Addr::from(*g)
}

/// Where a slice continues off the runtime thread.
enum Next {
    /// Connect / register as needed, then run.
    Start,
    /// As `Start`, for a slice a flush already stopped once (it is not run a third time).
    Again,
    /// The inline spin did not see the end: keep pumping.
    Resume(Run, Arc<Conn>),
    /// The device refused the access: ask the peer why.
    Explain(Error, Arc<Conn>),
}

/// Pumps a run just started for `wait` on the caller's thread (posting what fits at once):
/// `Err` holds the slice's outcome when it ended, `Ok` where it continues off the runtime
/// thread.
fn spin(
    this: &Shared,
    op: &SliceOp,
    started: Result<(Run, Arc<Conn>)>,
    wait: Duration,
) -> std::result::Result<Next, Result<()>> {
    let (mut run, conn) = started.map_err(|e| Err(this.failed(e, op)))?;
    match run.pump(Instant::now() + wait, None) {
        Ok(true) => Err(Ok(())),
        Ok(false) => Ok(Next::Resume(run, conn)),
        Err(e) if e.kind() == ErrorKind::AccessDenied => Ok(Next::Explain(e, conn)),
        // another run's failure on the queue pair flushed this one: again, on a fresh one
        Err(e) if flushed(&e) => Ok(Next::Start),
        Err(e) => Err(Err(this.failed(e, op))),
    }
}

/// Finishes a slice on a blocking thread (connecting, registering, waiting on the completion
/// channel as needed), holding its lane's run permit until then. Dropping the future cancels
/// the run (ERROR, drained). A run flushed by another run's failure on its queue pair runs once
/// more, on a fresh queue pair.
fn finish_off_thread(
    this: Arc<Shared>,
    permit: tokio::sync::OwnedSemaphorePermit,
    next: Next,
    op: SliceOp,
) -> BoxFuture<'static, Result<()>> {
    Box::pin(async move {
        // a run already posted is waited for as a task: no thread per slice
        let (next, retried) = match next {
            Next::Resume(run, conn) if wait_as_task() => match finish_async(run, conn).await {
                Ok(r) => return r.map_err(|e| this.failed(e, &op)),
                Err(next) => {
                    let retried = matches!(next, Next::Start);
                    (next, retried)
                }
            },
            Next::Again => (Next::Start, true),
            next => (next, false),
        };
        let cancel = Arc::new(AtomicBool::new(false));
        let guard = CancelOnDrop(cancel.clone());
        let shared = this.clone();
        let op2 = op.clone();
        let c = cancel.clone();
        let r = tokio::task::spawn_blocking(move || {
            let _run_permit = permit;
            let mut next = next;
            let mut again = !retried;
            loop {
                let (run, conn) = match next {
                    Next::Resume(run, conn) => (run, conn),
                    Next::Start | Next::Again => shared.start(&op2)?,
                    Next::Explain(e, conn) => return Err(shared.explain(&conn, &op2, e)),
                };
                match shared.finish(run, &conn, &c) {
                    Err(e) if flushed(&e) && again && !c.load(Ordering::Acquire) => {
                        again = false;
                        next = Next::Start;
                    }
                    r => return r.map_err(|e| shared.explain(&conn, &op2, e)),
                }
            }
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Io, format!("rdma slice task: {e}")))?;
        drop(guard);
        r.map_err(|e| this.failed(e, &op))
    })
}

/// A slice whose local memory is GPU memory this engine stages (no GPUDirect RDMA): one staging
/// buffer at a time from the GPU's pinned pool, copied from the GPU before a write and to it
/// after a read, registered with the device for that one run. The buffer goes back (after its
/// registration is dropped) on every path, a dropped future included. A write into a grant
/// the target stages is followed by a sync (the target copies it to its GPU), either way.
async fn run_staged(
    this: Arc<Shared>,
    permit: tokio::sync::OwnedSemaphorePermit,
    op: SliceOp,
) -> Result<()> {
    let _run_permit = permit;
    let dev = match op.local.device() {
        Some(dev) if this.node.stages(&op.local) => dev.clone(),
        // local memory the device registers; only the target stages (the run, then a sync)
        _ => {
            let cancel = Arc::new(AtomicBool::new(false));
            let guard = CancelOnDrop(cancel.clone());
            let (shared, op2) = (this.clone(), op.clone());
            let r = tokio::task::spawn_blocking(move || {
                let local = shared.node.local_registration(&op2.local)?;
                shared.run_part(&op2, &local, op2.local_offset, 0, op2.len, &cancel)
            })
            .await
            .map_err(|e| Error::new(ErrorKind::Io, format!("rdma staged slice task: {e}")))?;
            drop(guard);
            return r.map_err(|e| this.failed(e, &op));
        }
    };
    let write = op.kind == OpKind::Write;
    let pool = dev.staging(write).clone();
    let mut part = 0u64;
    while part < op.len {
        let n = (op.len - part).min(pool.slot_size() as u64);
        let staged = pool.acquire().await?;
        if write {
            op.local
                .copy_to(op.local_offset + part, staged.region(), 0, n)?;
        }
        let cancel = Arc::new(AtomicBool::new(false));
        let guard = CancelOnDrop(cancel.clone());
        let (shared, op2) = (this.clone(), op.clone());
        let reg = tokio::task::spawn_blocking(move || {
            let reg = Arc::new(shared.node.device.register_staged(staged, n)?);
            shared.run_part(&op2, &reg, 0, part, n, &cancel)?;
            Ok::<_, Error>(reg)
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Io, format!("rdma staged slice task: {e}")))?
        .map_err(|e| this.failed(e, &op))?;
        drop(guard);
        if !write {
            let landed = reg.staged().expect("a staging registration");
            landed.copy_to(0, &op.local, op.local_offset + part, n)?;
        }
        part += n;
    }
    Ok(())
}

/// Pumps a posted run to its end as a task, waiting on the completion channel through the
/// runtime's reactor ([`Run::wait_async`]), and watching the control connection as
/// [`Shared::finish`] does. `Err` where it continues on a blocking thread: no reactor
/// (`Resume`), flushed by another run's failure (`Start`, once more on a fresh queue pair), or
/// failed (`Explain`: asking the peer why may block). Dropping the future drops the run, which
/// moves the queue pair to ERROR and drains the run's requests (flushes come back at once).
async fn finish_async(mut run: Run, conn: Arc<Conn>) -> std::result::Result<Result<()>, Next> {
    let stop = AtomicBool::new(false);
    let mut gone = false;
    let mut check = Instant::now() + PEER_CHECK;
    loop {
        if gone {
            stop.store(true, Ordering::Release);
        }
        match run.pump(Instant::now(), Some(&stop)) {
            Ok(true) => return Ok(Ok(())),
            Ok(false) => {}
            Err(e) if gone => return Ok(Err(peer_went_away(&e))),
            Err(e) if flushed(&e) => return Err(Next::Start),
            Err(e) => return Err(Next::Explain(e, conn)),
        }
        let now = Instant::now();
        if now >= check {
            gone = conn.peer_gone();
            check = now + PEER_CHECK;
        }
        match run.wait_async(check).await {
            Ok(true) => {}
            Ok(false) => return Err(Next::Resume(run, conn)),
            Err(e) => return Ok(Err(e)),
        }
    }
}

/// Whether posted runs wait as tasks ([`finish_async`]); `OMNIRIG_RDMA_WAIT=thread` makes them
/// wait on a blocking thread each, as before, to measure one against the other in one run.
fn wait_as_task() -> bool {
    static AS_TASK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AS_TASK.get_or_init(|| std::env::var("OMNIRIG_RDMA_WAIT").as_deref() != Ok("thread"))
}

/// Whether a batch's single-slice requests go out as one run ([`Link::start_batch`]);
/// `OMNIRIG_RDMA_BATCH=off` makes each slice its own run, as before, to measure the two in one
/// run.
fn batch_as_one_run() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("OMNIRIG_RDMA_BATCH").as_deref() != Ok("off"))
}

/// A batch's slices as one [`Run`] on one queue pair ([`Link::start_batch`]): their work
/// requests go out as chains (one doorbell per chain) and one waiter reaps for all. Each op's
/// future drives the run while it is the one polling (whichever comes first; another takes
/// over if it goes away), the others sleep until it ended; then each reads its own fate from
/// where the run stopped (a queue pair completes in order).
struct Group {
    lane: Arc<Shared>,
    conn: Arc<Conn>,
    ops: Vec<SliceOp>,
    /// Op `k`'s work requests are the run's `bounds[k]..bounds[k + 1]`.
    bounds: Vec<usize>,
    state: Mutex<GroupState>,
    /// Set while one of the ops' futures drives the run.
    driving: AtomicBool,
    ended: tokio::sync::Notify,
}

enum GroupState {
    /// The run, and its place among the lane's runs (given back when the run ends).
    Running {
        run: Run,
        _permit: tokio::sync::OwnedSemaphorePermit,
    },
    Ended(GroupEnd),
}

#[derive(Clone)]
struct GroupEnd {
    /// Work requests that completed successfully (the first `completed`).
    completed: usize,
    /// The work request whose completion failed first.
    failed_op: Option<usize>,
    error: Option<Error>,
}

/// What an op of a group does once the group ended.
enum Fate {
    Done,
    Failed(Error),
    /// Its work request failed: ask the peer why (it may block).
    Explain(Error),
    /// It never ran, or was flushed by a failure before it: once more, on its own.
    Again,
}

impl Group {
    /// Starts `ops` as one run on `lane` when everything is at hand (connected, keys valid,
    /// memory registered): `None` otherwise, and the ops go through `execute` one by one.
    fn start(
        lane: &Arc<Shared>,
        permit: tokio::sync::OwnedSemaphorePermit,
        ops: &[SliceOp],
    ) -> Option<Arc<Group>> {
        let conn = lane
            .conn
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .filter(|c| !c.qp.is_error())?;
        let mut all = Vec::new();
        let mut bounds = Vec::with_capacity(ops.len() + 1);
        bounds.push(0);
        let mut local: Option<Arc<MemoryRegistration>> = None;
        for op in ops {
            if !local
                .as_ref()
                .is_some_and(|r| r.region().is_some_and(|m| Arc::ptr_eq(m, &op.local)))
            {
                local = Some(
                    lane.node
                        .lock_local()
                        .get(&op.local.addr())
                        .filter(|r| r.region().is_some_and(|m| Arc::ptr_eq(m, &op.local)))
                        .cloned()?,
                );
            }
            // a bad key or range is reported by the op's own `execute`
            let key = Shared::op_key(op).ok()?;
            all.extend(lane.remote_ops(op, &key, local.as_ref()?).ok()?);
            bounds.push(all.len());
        }
        let mut run = conn
            .qp
            .start(all, Instant::now() + lane.node.cfg.slice_deadline)
            .ok()?;
        // posted right here, back to back with the rest of the batch
        let state = match run.pump(Instant::now(), None) {
            Ok(false) => GroupState::Running {
                run,
                _permit: permit,
            },
            r => GroupState::Ended(GroupEnd::of(&run, r)),
        };
        Some(Arc::new(Group {
            lane: lane.clone(),
            conn,
            ops: ops.to_vec(),
            bounds,
            state: Mutex::new(state),
            driving: AtomicBool::new(false),
            ended: tokio::sync::Notify::new(),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn end(&self) -> Option<GroupEnd> {
        match &*self.lock() {
            GroupState::Ended(e) => Some(e.clone()),
            GroupState::Running { .. } => None,
        }
    }

    /// Ends the group with `error` unless it ended: the run is dropped, which moves the queue
    /// pair to ERROR and drains its requests before this returns.
    fn stop(&self, error: Error) {
        let taken = {
            let mut st = self.lock();
            let GroupState::Running { run, .. } = &*st else {
                return;
            };
            // what completed stays done; the rest runs again on its own or fails with `error`
            let ended = GroupState::Ended(GroupEnd {
                completed: run.completed(),
                failed_op: None,
                error: Some(error),
            });
            std::mem::replace(&mut *st, ended)
        };
        drop(taken);
        self.ended.notify_waiters();
    }

    /// Pumps the run until it ended, sleeping as a task between pumps and watching the
    /// control connection as [`finish_async`] does.
    async fn drive(&self) {
        let stop = AtomicBool::new(false);
        let mut gone = false;
        let mut check = Instant::now() + PEER_CHECK;
        loop {
            let waiter = {
                let mut st = self.lock();
                let GroupState::Running { run, .. } = &mut *st else {
                    return;
                };
                if gone {
                    stop.store(true, Ordering::Release);
                }
                match run.pump(Instant::now(), Some(&stop)) {
                    Ok(false) => {}
                    r => {
                        let mut end = GroupEnd::of(run, r);
                        if gone {
                            end.error = end.error.map(|e| peer_went_away(&e));
                        }
                        *st = GroupState::Ended(end);
                        drop(st);
                        self.ended.notify_waiters();
                        return;
                    }
                }
                let now = Instant::now();
                if now >= check {
                    gone = self.conn.peer_gone();
                    check = now + PEER_CHECK;
                }
                run.waiter(check)
            };
            match waiter.wait().await {
                Ok(true) => {}
                Ok(false) => self.stop(Error::new(
                    ErrorKind::Io,
                    "rdma: the runtime waiting for a batch's completions ended",
                )),
                Err(e) => self.stop(e),
            }
        }
    }

    /// Op `k`'s fate once the group ended with `end`.
    fn fate(&self, k: usize, end: &GroupEnd) -> Fate {
        let (first, last) = (self.bounds[k], self.bounds[k + 1]);
        if last <= end.completed {
            return Fate::Done;
        }
        let Some(e) = &end.error else {
            // ended without error: every request completed
            return Fate::Done;
        };
        if flushed(e) {
            return Fate::Again;
        }
        match end.failed_op {
            Some(w) if (first..last).contains(&w) => Fate::Explain(e.clone()),
            Some(w) if w < first => Fate::Again,
            // stopped because an op went away (its batch was canceled): run on their own
            None if e.kind() == ErrorKind::Canceled => Fate::Again,
            _ => Fate::Failed(e.clone()),
        }
    }
}

impl GroupEnd {
    fn of(run: &Run, r: Result<bool>) -> Self {
        GroupEnd {
            completed: run.completed(),
            failed_op: run.failed_op(),
            error: r.err(),
        }
    }
}

/// Op `k` of a group: drives the group's run or waits for it, then ends as its fate says.
/// Dropped before the group ended, it stops the group (the others then run on their own).
async fn group_op(g: Arc<Group>, k: usize) -> Result<()> {
    struct StopOnDrop(Option<Arc<Group>>);
    impl Drop for StopOnDrop {
        fn drop(&mut self) {
            if let Some(g) = self.0.take() {
                g.stop(Error::new(
                    ErrorKind::Canceled,
                    "rdma: the batch's run was stopped",
                ));
            }
        }
    }
    /// Clears the driver's flag and wakes the others, one of which takes over.
    struct Driving<'a>(&'a Group);
    impl Drop for Driving<'_> {
        fn drop(&mut self) {
            self.0.driving.store(false, Ordering::Release);
            self.0.ended.notify_waiters();
        }
    }
    let mut armed = StopOnDrop(Some(g.clone()));
    let end = loop {
        if let Some(end) = g.end() {
            break end;
        }
        if !g.driving.swap(true, Ordering::AcqRel) {
            let _driving = Driving(&g);
            g.drive().await;
            continue;
        }
        let woken = g.ended.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        if g.end().is_some() || !g.driving.load(Ordering::Acquire) {
            continue;
        }
        woken.await;
    };
    armed.0 = None;
    let op = g.ops[k].clone();
    let lane = g.lane.clone();
    let next = match g.fate(k, &end) {
        Fate::Done => return Ok(()),
        Fate::Failed(e) => return Err(lane.failed(e, &op)),
        Fate::Explain(e) => Next::Explain(e, g.conn.clone()),
        Fate::Again => Next::Again,
    };
    drop(g);
    let permit = lane
        .runs
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| Error::new(ErrorKind::Canceled, "rdma link closed"))?;
    finish_off_thread(lane, permit, next, op).await
}

/// How often a run in flight checks whether its peer closed the control connection.
const PEER_CHECK: Duration = Duration::from_millis(50);

fn peer_went_away(e: &Error) -> Error {
    Error::new(
        ErrorKind::PeerDisconnected,
        format!(
            "rdma: the peer closed its control connection (its engine went away); \
             the requests in flight were stopped and drained ({})",
            e.detail()
        ),
    )
}

/// Sets the flag when dropped: the engine dropping a slice's future cancels its verbs run.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

impl Link for RdmaLink {
    fn info(&self) -> LinkInfo {
        let first = &self.lanes[0];
        let remote = first
            .conn
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|c| format!("{} qpn {}", c.remote.device, c.remote.qpn))
            .unwrap_or_else(|| "not connected".into());
        LinkInfo {
            transport: TransportKind::Rdma,
            device: format!("{} -> {} ({remote})", first.node.describe(), first.addr),
        }
    }

    fn slicing(&self) -> Slicing {
        Slicing {
            slice_size: self.lanes[0].node.cfg.slice_size,
            in_flight: self.lanes.len().max(2),
        }
    }

    fn execute(&self, op: SliceOp) -> BoxFuture<'static, Result<()>> {
        let this = self.lane();
        Box::pin(async move {
            // at most max_runs runs at a time on a lane's queue pair; waiting here is async
            let permit = this
                .runs
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| Error::new(ErrorKind::Canceled, "rdma link closed"))?;
            if this.needs_staging(&op) {
                return run_staged(this, permit, op).await;
            }
            // posted right here, so a batch's slices go out back to back; alone on the queue
            // pair, a latency-sized slice also spins for its completion here
            let alone = this.runs.available_permits() + 1 >= this.max_runs;
            let wait = match alone && op.len <= SPIN_IN_EXECUTE_MAX {
                true => INLINE_WAIT,
                false => Duration::ZERO,
            };
            let next = match this.start_ready(&op) {
                Some(started) => match spin(&this, &op, started, wait) {
                    Ok(next) => next,
                    Err(done) => return done,
                },
                None => Next::Start,
            };
            finish_off_thread(this, permit, next, op).await
        })
    }

    fn start_inline(&self, op: &SliceOp) -> Option<Started> {
        if op.len > INLINE_MAX {
            return None;
        }
        let this = self.lane();
        if this.needs_staging(op) {
            return None;
        }
        // only when nothing else is under way on the queue pair: a batch's slices are posted
        // back to back by `execute` instead of each waiting for the one before
        if !this.idle() {
            return None;
        }
        let permit = this.runs.clone().try_acquire_owned().ok()?;
        let started = this.start_ready(op)?;
        Some(match spin(&this, op, started, INLINE_WAIT) {
            Err(done) => Started::Done(done),
            Ok(next) => Started::Pending(finish_off_thread(this, permit, next, op.clone())),
        })
    }

    fn start_batch(&self, ops: &[SliceOp]) -> Option<Vec<BoxFuture<'static, Result<()>>>> {
        if ops.len() < 2 || !batch_as_one_run() {
            return None;
        }
        // the group waits as a task: it needs a runtime with a reactor
        tokio::runtime::Handle::try_current().ok()?;
        let lane = self.lane();
        let permit = lane.runs.clone().try_acquire_owned().ok()?;
        let group = Group::start(&lane, permit, ops)?;
        Some(
            (0..ops.len())
                .map(|k| Box::pin(group_op(group.clone(), k)) as BoxFuture<'static, Result<()>>)
                .collect(),
        )
    }

    fn drop_connections(&self) {
        for lane in &self.lanes {
            if let Some(c) = lane.conn.lock().unwrap_or_else(|p| p.into_inner()).take() {
                let _ = c.qp.set_error();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_requests_round_trip_and_refuse_bad_input() {
        let g = GrantRef {
            buffer: 3,
            epoch: 9,
            token: 0xfeed,
        };
        let b = encode_resolve(Access::Read, &g);
        assert_eq!(decode_resolve(&b).unwrap(), (Access::Read, g));
        let e = decode_resolve(&b[..20]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Malformed);
        assert!(e.detail().contains("expected 21"), "{e}");
        let mut bad = b.clone();
        bad[0] = 7;
        assert!(
            decode_resolve(&bad)
                .unwrap_err()
                .detail()
                .contains("unknown access 7")
        );
    }

    #[test]
    fn endpoints_carry_address_and_secret_and_bad_ones_are_refused() {
        let (a, s) = parse_endpoint("10.0.0.1:4791#000102030405060708090a0b0c0d0eff").unwrap();
        assert_eq!(a, "10.0.0.1:4791".parse::<SocketAddr>().unwrap());
        assert_eq!(s[15], 0xff);
        assert_eq!(s[1], 1);
        for bad in [
            "10.0.0.1:4791",
            "10.0.0.1:4791#00",
            "10.0.0.1:4791#000102030405060708090a0b0c0d0eZZ",
            "nohost#000102030405060708090a0b0c0d0eff",
        ] {
            assert!(parse_endpoint(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn error_replies_keep_their_kind_and_refuse_unknown_codes() {
        let e = Error::new(ErrorKind::GrantRevoked, "grant epoch 4 was revoked");
        let back = decode_error(&error_payload(&e));
        assert_eq!(back.kind(), ErrorKind::GrantRevoked);
        assert_eq!(back.detail(), "grant epoch 4 was revoked");
        assert_eq!(
            decode_error(&[0xff, 0xff, b'x']).kind(),
            ErrorKind::Malformed
        );
        assert_eq!(decode_error(&[1]).kind(), ErrorKind::Malformed);
    }
}
