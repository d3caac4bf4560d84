//! The cuda transport's data path: one request and one reply per slice on a Unix socket (in the
//! abstract namespace), and one device copy done by the grant owner under the grant's fence.
//!
//! Request (128 bytes, little-endian): magic "OMCU", version, kind (2 write, 3 read), two
//! reserved zero bytes, request id, grant (buffer, 4 reserved zero bytes, epoch, token), grant
//! offset, length, the initiator's offset, its CUDA IPC handle (64 bytes). A handle of all
//! zeros means "same process": the offset is then the initiator's address, accepted only from
//! a connection whose peer credentials carry this process's pid. Reply (16 bytes): request id,
//! status (0, or an [`ErrorKind`] code), detail length, 4 reserved bytes, then the detail.
//!
//! The owner maps each initiator allocation once per connection (at most [`MAX_MAPPINGS`],
//! the oldest closed past that) and closes every mapping when the connection closes.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::driver::{Gpu, IpcMapping, ipc_handle};
use super::{CudaConfig, CudaEndpoint, CudaMemory};
use crate::error::{Error, ErrorKind, Result};
use crate::grant::GrantRef;
use crate::memory::{DeviceMemory, Region};
use crate::segment::{Endpoint, SegmentDescriptor};
use crate::transport::{
    Admission, BoxFuture, Link, LinkInfo, MemoryProvider, OpKind, SliceOp, Slicing, Transport,
    TransportKind,
};

const MAGIC: &[u8; 4] = b"OMCU";
const VERSION: u8 = 1;
pub const REQUEST_LEN: usize = 128;
const REPLY_LEN: usize = 16;
const MAX_DETAIL: usize = 4096;
/// Initiator allocations one connection keeps mapped.
pub const MAX_MAPPINGS: usize = 256;
/// How long the initiator polls for a reply before it blocks: thread wakeups cost tens of
/// microseconds, a device copy of a slice about as much. (The owner's poll for a
/// connection's next request is [`CudaConfig::server_spin`].)
const REPLY_SPIN: Duration = Duration::from_micros(500);

/// `read_exact`, polling without blocking for up to `spin` first, then blocking (with the
/// socket's read timeout) for the rest.
fn read_exact_polled(s: &mut UnixStream, buf: &mut [u8], spin: Duration) -> io::Result<()> {
    let mut got = 0;
    if !spin.is_zero() {
        s.set_nonblocking(true)?;
        let start = Instant::now();
        while got < buf.len() && start.elapsed() < spin {
            match s.read(&mut buf[got..]) {
                Ok(0) => {
                    s.set_nonblocking(false)?;
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    s.set_nonblocking(false)?;
                    return Err(e);
                }
            }
        }
        s.set_nonblocking(false)?;
    }
    s.read_exact(&mut buf[got..])
}

/// This process, for endpoints: a random id (pids repeat across namespaces and restarts).
fn process_id() -> u64 {
    static ID: OnceLock<u64> = OnceLock::new();
    *ID.get_or_init(|| {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).expect("the OS random source");
        u64::from_le_bytes(b)
    })
}

// ---------------------------------------------------------------- wire

/// One slice, as the initiator asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub kind: OpKind,
    pub req_id: u64,
    pub grant: GrantRef,
    pub grant_offset: u64,
    pub len: u64,
    /// Offset in the initiator's allocation (or its address, with a zero handle).
    pub peer_offset: u64,
    pub handle: [u8; 64],
}

impl Request {
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(MAGIC);
        b[4] = VERSION;
        b[5] = match self.kind {
            OpKind::Write => 2,
            OpKind::Read => 3,
        };
        b[8..16].copy_from_slice(&self.req_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.grant.buffer.to_le_bytes());
        b[24..32].copy_from_slice(&self.grant.epoch.to_le_bytes());
        b[32..40].copy_from_slice(&self.grant.token.to_le_bytes());
        b[40..48].copy_from_slice(&self.grant_offset.to_le_bytes());
        b[48..56].copy_from_slice(&self.len.to_le_bytes());
        b[56..64].copy_from_slice(&self.peer_offset.to_le_bytes());
        b[64..128].copy_from_slice(&self.handle);
        b
    }

    /// Validates magic, version, kind, reserved bytes and length before anything is used.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let bad = |what: String| Error::new(ErrorKind::Malformed, format!("cuda request: {what}"));
        if b.len() != REQUEST_LEN {
            return Err(bad(format!("{} bytes, want {REQUEST_LEN}", b.len())));
        }
        if &b[0..4] != MAGIC {
            return Err(bad("bad magic".into()));
        }
        if b[4] != VERSION {
            return Err(bad(format!(
                "version {} (this build speaks {VERSION})",
                b[4]
            )));
        }
        let kind = match b[5] {
            2 => OpKind::Write,
            3 => OpKind::Read,
            k => return Err(bad(format!("unknown kind {k}"))),
        };
        if b[6..8] != [0, 0] || b[20..24] != [0; 4] {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let len = u64_at(48);
        if len == 0 {
            return Err(bad("zero length".into()));
        }
        Ok(Self {
            kind,
            req_id: u64_at(8),
            grant: GrantRef {
                buffer: u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")),
                epoch: u64_at(24),
                token: u64_at(32),
            },
            grant_offset: u64_at(40),
            len,
            peer_offset: u64_at(56),
            handle: b[64..128].try_into().expect("64 bytes"),
        })
    }

    fn in_process(&self) -> bool {
        self.handle == [0; 64]
    }
}

fn encode_reply(req_id: u64, result: &Result<()>) -> Vec<u8> {
    let (status, detail) = match result {
        Ok(()) => (0u16, String::new()),
        Err(e) => (e.kind().code(), e.detail().to_string()),
    };
    let mut detail = detail.into_bytes();
    detail.truncate(MAX_DETAIL);
    let mut b = Vec::with_capacity(REPLY_LEN + detail.len());
    b.extend_from_slice(&req_id.to_le_bytes());
    b.extend_from_slice(&status.to_le_bytes());
    b.extend_from_slice(&(detail.len() as u16).to_le_bytes());
    b.extend_from_slice(&[0; 4]);
    b.extend_from_slice(&detail);
    b
}

/// Reads one reply for `req_id`: the status as a result, the detail as its message.
fn read_reply(s: &mut UnixStream, req_id: u64) -> Result<Result<()>> {
    let mut h = [0u8; REPLY_LEN];
    read_exact_polled(s, &mut h, REPLY_SPIN).map_err(|e| io_err(e, "reading a reply"))?;
    let id = u64::from_le_bytes(h[0..8].try_into().expect("8 bytes"));
    let status = u16::from_le_bytes([h[8], h[9]]);
    let n = u16::from_le_bytes([h[10], h[11]]) as usize;
    if id != req_id || n > MAX_DETAIL || (status == 0 && n != 0) {
        return Err(Error::new(
            ErrorKind::Malformed,
            format!("cuda reply for request {id} (want {req_id}) with a {n} byte detail"),
        ));
    }
    let mut detail = vec![0u8; n];
    s.read_exact(&mut detail)
        .map_err(|e| io_err(e, "reading a reply"))?;
    if status == 0 {
        return Ok(Ok(()));
    }
    let kind = ErrorKind::from_code(status).ok_or_else(|| {
        Error::new(
            ErrorKind::Malformed,
            format!("cuda reply with unknown status {status}"),
        )
    })?;
    Ok(Err(Error::new(
        kind,
        String::from_utf8_lossy(&detail).into_owned(),
    )))
}

fn io_err(e: io::Error, what: &str) -> Error {
    let kind = match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ErrorKind::TimedOut,
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe => ErrorKind::PeerDisconnected,
        _ => ErrorKind::Io,
    };
    Error::new(kind, format!("cuda transport: {what}: {e}"))
}

/// The pid of the process at the other end of a Unix socket, from the kernel (SO_PEERCRED).
fn peer_pid(s: &UnixStream) -> Option<i32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a getsockopt into a live, correctly sized local on a socket we own.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some(cred.pid)
}

fn abstract_addr(name: &str) -> io::Result<std::os::unix::net::SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
}

// ---------------------------------------------------------------- server (grant owner)

struct Server {
    socket: String,
    closed: Arc<AtomicBool>,
    conns: Conns,
}

/// The connections being served (a clone of each, so shutdown can end them), by number.
type Conns = Arc<Mutex<HashMap<u64, UnixStream>>>;

/// Ends one served connection when its thread returns, on every path: the peer sees it
/// closed even though the server still held a clone, and the clone is released.
struct Served {
    conns: Conns,
    id: u64,
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(c) = self
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id)
        {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Server {
    fn bind(adm: Admission, gpu: Arc<Gpu>, spin: Duration) -> Result<Self> {
        let socket = format!(
            "omnirig-cuda-{}-{:016x}",
            std::process::id(),
            adm.instance()
        );
        let listener = abstract_addr(&socket)
            .and_then(|a| UnixListener::bind_addr(&a))
            .map_err(|e| io_err(e, &format!("binding {socket}")))?;
        let closed = Arc::new(AtomicBool::new(false));
        let conns: Conns = Arc::default();
        let (c, l) = (closed.clone(), conns.clone());
        std::thread::Builder::new()
            .name("cuda-accept".into())
            .spawn(move || {
                for (id, conn) in (0u64..).zip(listener.incoming()) {
                    if c.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let same_process = peer_pid(&conn) == Some(std::process::id() as i32);
                    let Ok(k) = conn.try_clone() else { continue };
                    l.lock().unwrap_or_else(|p| p.into_inner()).insert(id, k);
                    let served = Served {
                        conns: l.clone(),
                        id,
                    };
                    let (adm, gpu) = (adm.clone(), gpu.clone());
                    let spawned = std::thread::Builder::new()
                        .name("cuda-serve".into())
                        .spawn(move || serve(conn, adm, gpu, same_process, spin, served));
                    if let Err(e) = spawned {
                        warn!(error = %e, "cuda transport: cannot start a connection thread");
                    }
                }
            })
            .map_err(|e| io_err(e, "starting the accept thread"))?;
        Ok(Self {
            socket,
            closed,
            conns,
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Release);
        // Wakes the accept loop so it sees `closed`, then ends every connection.
        if let Ok(a) = abstract_addr(&self.socket) {
            let _ = UnixStream::connect_addr(&a);
        }
        for c in self
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(_, c)| c)
        {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Initiator allocations this connection has mapped, oldest first.
struct Mappings {
    open: HashMap<[u8; 64], (IpcMapping, u64)>,
    order: VecDeque<[u8; 64]>,
}

impl Mappings {
    /// The mapping of `handle`'s allocation and its size, opened on first use.
    fn get(&mut self, gpu: &Arc<Gpu>, handle: &[u8; 64]) -> Result<(u64, u64)> {
        if let Some((m, size)) = self.open.get(handle) {
            return Ok((m.base(), *size));
        }
        if self.order.len() >= MAX_MAPPINGS
            && let Some(old) = self.order.pop_front()
        {
            self.open.remove(&old);
        }
        let m = IpcMapping::open(gpu, handle)?;
        let size = m.size();
        let base = m.base();
        self.open.insert(*handle, (m, size));
        self.order.push_back(*handle);
        Ok((base, size))
    }
}

fn serve(
    mut conn: UnixStream,
    adm: Admission,
    gpu: Arc<Gpu>,
    same_process: bool,
    spin: Duration,
    _served: Served,
) {
    let _counted = adm.connection();
    let mut maps = Mappings {
        open: HashMap::new(),
        order: VecDeque::new(),
    };
    let mut buf = [0u8; REQUEST_LEN];
    loop {
        if read_exact_polled(&mut conn, &mut buf, spin).is_err() {
            return;
        }
        let req = match Request::decode(&buf) {
            Ok(r) => r,
            Err(e) => {
                // The stream can no longer be trusted to be in step: say why, then close.
                let id = u64::from_le_bytes(buf[8..16].try_into().expect("8 bytes"));
                let _ = conn.write_all(&encode_reply(id, &Err(e)));
                return;
            }
        };
        let result = copy_slice(&req, &adm, &gpu, &mut maps, same_process);
        if let Err(e) = &result {
            debug!(engine = %adm.engine(), error = %e, "cuda slice refused");
        }
        if conn.write_all(&encode_reply(req.req_id, &result)).is_err() {
            return;
        }
    }
}

/// Admits one slice under its grant and does the device copy under the grant's fence.
fn copy_slice(
    req: &Request,
    adm: &Admission,
    gpu: &Arc<Gpu>,
    maps: &mut Mappings,
    same_process: bool,
) -> Result<()> {
    let (region, admitted) = adm.admit(req.kind.access(), req.grant, req.grant_offset, req.len)?;
    let peer = if req.in_process() {
        if !same_process {
            return Err(Error::new(
                ErrorKind::Malformed,
                "cuda request with a raw address from another process",
            ));
        }
        req.peer_offset
    } else {
        let (base, size) = maps.get(gpu, &req.handle)?;
        match req.peer_offset.checked_add(req.len) {
            Some(end) if end <= size => base + req.peer_offset,
            _ => {
                return Err(Error::new(
                    ErrorKind::OutOfBuffer,
                    format!(
                        "initiator range {}+{} exceeds its {size} byte allocation",
                        req.peer_offset, req.len
                    ),
                ));
            }
        }
    };
    let local = region.addr() as u64 + admitted.buffer_offset;
    let _pin = admitted.entry.pin()?;
    // SAFETY: `local..local+len` is inside the admitted region (checked by admit), which
    // `region` keeps alive; the peer's range is inside its mapped allocation (checked above),
    // or, for this process, the initiator's own registered region, which its slice holds
    // until our reply. Granted ranges never overlap the initiator's source in correct use.
    unsafe {
        match req.kind {
            OpKind::Write => gpu.copy(local, peer, req.len as usize),
            OpKind::Read => gpu.copy(peer, local, req.len as usize),
        }
    }
}

// ---------------------------------------------------------------- transport

pub(super) fn start(
    cfg: CudaConfig,
    adm: Admission,
) -> BoxFuture<'static, Result<Arc<dyn Transport>>> {
    Box::pin(async move {
        let gpu = Gpu::open(cfg.device)?;
        let server = Server::bind(adm, gpu.clone(), cfg.server_spin)?;
        let endpoint = CudaEndpoint {
            socket: server.socket.clone(),
            host: crate::transport::shm::host_identity(),
            gpu: gpu.uuid().to_vec(),
            process: process_id(),
        };
        debug!(device = %gpu.describe(), socket = %endpoint.socket, "cuda transport started");
        Ok(Arc::new(CudaTransport {
            cfg,
            gpu,
            endpoint,
            server: Mutex::new(Some(server)),
        }) as Arc<dyn Transport>)
    })
}

/// Serves this engine's memory to, and reaches, engines on this host through CUDA copies.
pub struct CudaTransport {
    cfg: CudaConfig,
    gpu: Arc<Gpu>,
    endpoint: CudaEndpoint,
    server: Mutex<Option<Server>>,
}

struct GpuMemory {
    gpu: Arc<Gpu>,
    pinned: bool,
}

impl MemoryProvider for GpuMemory {
    fn allocate(&self, len: usize) -> Result<Region> {
        if self.pinned {
            self.gpu.allocate_pinned(len)
        } else {
            self.gpu.allocate(len)
        }
    }
}

impl Transport for CudaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Cuda
    }

    fn reaches(&self, peer: &SegmentDescriptor) -> bool {
        CudaEndpoint::of(peer).is_ok_and(|e| e.is_some_and(|e| e.host == self.endpoint.host))
    }

    fn endpoint(&self) -> Option<Endpoint> {
        Some(self.endpoint.to_endpoint())
    }

    fn memory(&self) -> Option<Arc<dyn MemoryProvider>> {
        match self.cfg.memory {
            CudaMemory::Host => None,
            CudaMemory::Pinned => Some(Arc::new(GpuMemory {
                gpu: self.gpu.clone(),
                pinned: true,
            })),
            CudaMemory::Device => Some(Arc::new(GpuMemory {
                gpu: self.gpu.clone(),
                pinned: false,
            })),
        }
    }

    fn shutdown(&self) {
        drop(self.server.lock().unwrap_or_else(|p| p.into_inner()).take());
    }

    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>> {
        let cfg = self.cfg.clone();
        let gpu = self.gpu.clone();
        let process = self.endpoint.process;
        Box::pin(async move {
            let ep = CudaEndpoint::of(&peer)
                .map_err(|e| e.with_peer(&peer.name))?
                .ok_or_else(|| {
                    Error::new(ErrorKind::NoTransport, "peer has no cuda endpoint")
                        .with_peer(&peer.name)
                })?;
            let same_gpu = ep.gpu == gpu.uuid();
            let path = if ep.process == process {
                "in-process device copy"
            } else {
                "CUDA IPC"
            };
            // Two GPUs of this host: let each address the other's memory where the hardware
            // allows (NVLink or PCIe peer copies); otherwise the driver copies through host.
            let gpus = if same_gpu {
                "same GPU".to_string()
            } else {
                match Gpu::by_uuid(&ep.gpu)? {
                    Some(other) if gpu.can_access_peer(&other)? => {
                        gpu.enable_peer(&other)?;
                        other.enable_peer(&gpu)?;
                        format!("peer copy to cuda:{}", other.ordinal())
                    }
                    Some(other) => format!("cuda:{} without peer access", other.ordinal()),
                    None => "a GPU this process cannot see".to_string(),
                }
            };
            let device = format!("{} -> {} ({path}, {gpus})", gpu.describe(), ep.socket);
            let link = CudaLink(Arc::new(LinkInner {
                socket: ep.socket.clone(),
                same_process: ep.process == process,
                cfg,
                idle: Mutex::new(Vec::new()),
                next_id: std::sync::atomic::AtomicU64::new(1),
                info: LinkInfo {
                    transport: TransportKind::Cuda,
                    device,
                },
            }));
            // Fail at connect, not on the first slice, when the peer is not there.
            let first = link.0.dial().map_err(|e| e.with_peer(&peer.name))?;
            link.0
                .idle
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(first);
            Ok(Arc::new(link) as Arc<dyn Link>)
        })
    }
}

struct CudaLink(Arc<LinkInner>);

struct LinkInner {
    socket: String,
    same_process: bool,
    cfg: CudaConfig,
    idle: Mutex<Vec<UnixStream>>,
    next_id: std::sync::atomic::AtomicU64,
    info: LinkInfo,
}

impl LinkInner {
    fn dial(&self) -> Result<UnixStream> {
        let s = abstract_addr(&self.socket)
            .and_then(|a| UnixStream::connect_addr(&a))
            .map_err(|e| {
                Error::new(
                    ErrorKind::Unreachable,
                    format!("cuda transport: connecting to {}: {e}", self.socket),
                )
            })?;
        s.set_read_timeout(Some(self.cfg.slice_deadline))
            .map_err(|e| io_err(e, "setting the reply deadline"))?;
        Ok(s)
    }

    /// Runs one slice on the calling (blocking) thread.
    fn run(&self, op: &SliceOp) -> Result<()> {
        let (handle, peer_offset) = if self.same_process {
            ([0u8; 64], op.local.range_addr(op.local_offset, op.len)?)
        } else {
            op.local.check(op.local_offset, op.len)?;
            let (h, start) = ipc_handle(&op.local)?;
            (h, start + op.local_offset)
        };
        let req = Request {
            kind: op.kind,
            req_id: self
                .next_id
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            grant: op.grant,
            grant_offset: op.grant_offset,
            len: op.len,
            peer_offset,
            handle,
        };
        let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut s = match pooled {
            Some(s) => s,
            None => self.dial()?,
        };
        s.write_all(&req.encode())
            .map_err(|e| io_err(e, "sending a request"))?;
        // A connection that failed mid-reply is dropped; one that carried a refusal is fine.
        let result = read_reply(&mut s, req.req_id)?;
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(s);
        result
    }
}

impl Link for CudaLink {
    fn info(&self) -> LinkInfo {
        self.0.info.clone()
    }

    fn slicing(&self) -> Slicing {
        Slicing {
            slice_size: self.0.cfg.slice_size,
            in_flight: self.0.cfg.streams.max(1),
        }
    }

    fn execute(&self, op: SliceOp) -> BoxFuture<'static, Result<()>> {
        // The owner copies out of or into `op.local`; the thread running the slice holds the
        // op (and so the memory) until the reply came back, even if this future is dropped
        // meanwhile.
        let link = self.0.clone();
        // A request's only or last slice: no other slice of its task waits to be started
        // (the engine starts them in order), so it runs on this worker (the runtime moves the
        // worker's other tasks to another thread) and saves the two thread wakeups of a
        // handoff to the blocking pool and back (with the owner's poll, 16 MiB device<->host
        // went from about 0.8x to 0.94-0.96x of cuMemcpy on an H200, docs/gpu.md). Earlier
        // slices keep the pool, so a request's slices still overlap.
        let inline = op.request_offset.saturating_add(op.len) >= op.request_len
            && tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        Box::pin(async move {
            if inline {
                return tokio::task::block_in_place(|| link.run(&op));
            }
            tokio::task::spawn_blocking(move || link.run(&op))
                .await
                .map_err(|e| Error::new(ErrorKind::Io, format!("cuda slice task: {e}")))?
        })
    }

    fn drop_connections(&self) {
        self.0
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Request {
        Request {
            kind: OpKind::Read,
            req_id: 9,
            grant: GrantRef {
                buffer: 3,
                epoch: 4,
                token: 5,
            },
            grant_offset: 6,
            len: 7,
            peer_offset: 8,
            handle: [1; 64],
        }
    }

    #[test]
    fn requests_round_trip_and_every_bad_field_is_refused() {
        let r = sample();
        assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        let mutate = |i: usize, v: u8| {
            let mut b = r.encode();
            b[i] = v;
            Request::decode(&b).unwrap_err().kind()
        };
        assert_eq!(mutate(0, b'X'), ErrorKind::Malformed);
        assert_eq!(mutate(4, 2), ErrorKind::Malformed);
        assert_eq!(mutate(5, 1), ErrorKind::Malformed);
        assert_eq!(mutate(6, 1), ErrorKind::Malformed);
        assert_eq!(mutate(21, 1), ErrorKind::Malformed);
        let zero = Request { len: 0, ..r }.encode();
        assert_eq!(
            Request::decode(&zero).unwrap_err().kind(),
            ErrorKind::Malformed
        );
        assert_eq!(
            Request::decode(&r.encode()[..100]).unwrap_err().kind(),
            ErrorKind::Malformed
        );
    }
}
