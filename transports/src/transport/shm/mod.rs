//! shm: engines in different processes of one host. The initiator's registered memory is a
//! sealed memfd; the grant owner maps it once (`/proc/PID/fd/N`, the pid taken from the
//! socket's peer credentials, never from the wire) and does the one memcpy itself, under the
//! grant's fence, exactly as the tcp server lands socket bytes and as loopback copies. So
//! grants, revocation and late-write refusal mean the same on every transport, and a payload
//! costs one copy instead of tcp's two plus the wakeups. The protocol is one small request and
//! one small reply per slice on a Unix socket in the abstract namespace (nothing to clean up
//! on the filesystem). Requests may be pipelined: a batch's slices (`Link::start_batch`) leave
//! in one write and the owner answers every request it already holds in one write, in order,
//! so a batch costs one round trip (measured on the pipeline's thinker -> talker hop, five
//! slices of 956 KiB: the engine transfer p50 0.56-0.60 ms against 0.85-0.88 ms one round trip
//! per slice; `OMNIRIG_SHM_BATCH=off` restores that).
//!
//! Request (96 bytes, little-endian): magic "OMSH", version, kind (1 share, 2 write, 3 read),
//! request id, share id, share offset, grant (buffer, epoch, token), grant offset, length,
//! and for a share the initiator's fd number and the file size. Reply (16 bytes): request id,
//! status (0, or an [`ErrorKind`] code), detail length, then the detail.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::net::UnixStream;
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use crate::batch::Liveness;
use crate::error::{Error, ErrorKind, Result};
use crate::grant::GrantRef;
use crate::segment::{Endpoint, SegmentDescriptor};
use crate::transport::spare_core::spare_core;
use crate::transport::tcp::frame::{decode_error_body, error_body};
use crate::transport::{
    Admission, BoxFuture, Counted, Link, LinkInfo, MemoryProvider, OpKind, SliceOp, Slicing,
    Transport, TransportKind, TransportSetup,
};
use memfd::PeerMemory;

pub(crate) mod memfd;
use memfd::shared_file;

const MAGIC: &[u8; 4] = b"OMSH";
const VERSION: u8 = 1;
const REQUEST_LEN: usize = 96;
const REPLY_LEN: usize = 16;
/// Longest error detail a reply carries.
const MAX_DETAIL: usize = 4096;
/// Peer regions one connection keeps mapped; the oldest is unmapped past this.
const MAX_SHARES: usize = 256;
/// Largest region a peer may announce (a sanity bound, far above any pool).
const MAX_SHARE_LEN: u64 = 1 << 40;
/// How an owner says it holds no mapping of the initiator's region (any more).
const UNMAPPED: &str = "shm region not mapped:";

/// Longest an initiator polls through the owner's copy of one slice before it parks.
const MAX_COPY_SPIN: Duration = Duration::from_millis(2);

/// How the shm transport slices and how long it polls for replies.
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// Bytes per slice: one request, one memcpy by the owner.
    pub slice_size: u64,
    /// Connections per peer (slices in flight per transfer).
    pub streams: usize,
    /// Busy-poll window for replies and idle connections, as the tcp transport's.
    pub busy_poll: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self {
            slice_size: 4 << 20,
            streams: 2,
            busy_poll: Duration::from_micros(50),
        }
    }
}

/// Where an engine's shm endpoint is: an abstract socket name, and the host it lives on (boot
/// id and pid namespace: `/proc/PID/fd` only means the same thing inside both).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmEndpoint {
    pub socket: String,
    pub host: String,
}

/// Limits on an endpoint read from the network.
const MAX_SOCKET_NAME: usize = 100;
const MAX_HOST: usize = 160;

impl ShmEndpoint {
    pub fn validate(&self) -> Result<()> {
        if self.socket.is_empty()
            || self.socket.len() > MAX_SOCKET_NAME
            || self.host.len() > MAX_HOST
            || !self.socket.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!(
                    "shm endpoint must name a socket of 1..={MAX_SOCKET_NAME} printable bytes and a host of at most {MAX_HOST}"
                ),
            ));
        }
        Ok(())
    }
}

/// This host's identity for [`ShmEndpoint::host`].
pub fn host_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let pidns = std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!("{}/{pidns}", boot.trim())
}

fn abstract_addr(name: &str) -> io::Result<std::os::unix::net::SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
}

// ---------------------------------------------------------------- wire

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Share = 1,
    Write = 2,
    Read = 3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Request {
    kind: Kind,
    req_id: u64,
    share_id: u64,
    share_offset: u64,
    grant: GrantRef,
    grant_offset: u64,
    len: u64,
    /// Share: the initiator's descriptor number for the region's memfd.
    fd: i32,
}

impl Request {
    fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[8..16].copy_from_slice(&self.req_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.share_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.share_offset.to_le_bytes());
        b[32..36].copy_from_slice(&self.grant.buffer.to_le_bytes());
        b[40..48].copy_from_slice(&self.grant.epoch.to_le_bytes());
        b[48..56].copy_from_slice(&self.grant.token.to_le_bytes());
        b[56..64].copy_from_slice(&self.grant_offset.to_le_bytes());
        b[64..72].copy_from_slice(&self.len.to_le_bytes());
        b[72..76].copy_from_slice(&self.fd.to_le_bytes());
        b
    }

    /// Validates magic, version, kind, reserved bytes and ranges before anything is used.
    fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self> {
        let bad = |why: String| Error::new(ErrorKind::Malformed, format!("shm request: {why}"));
        if &b[0..4] != MAGIC {
            return Err(bad("bad magic".into()));
        }
        if b[4] != VERSION {
            return Err(bad(format!(
                "version {} (this engine speaks {VERSION})",
                b[4]
            )));
        }
        let kind = match b[5] {
            1 => Kind::Share,
            2 => Kind::Write,
            3 => Kind::Read,
            k => return Err(bad(format!("unknown kind {k}"))),
        };
        if b[6..8]
            .iter()
            .chain(&b[36..40])
            .chain(&b[76..])
            .any(|&x| x != 0)
        {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let r = Request {
            kind,
            req_id: u64_at(8),
            share_id: u64_at(16),
            share_offset: u64_at(24),
            grant: GrantRef {
                buffer: u32::from_le_bytes(b[32..36].try_into().expect("4 bytes")),
                epoch: u64_at(40),
                token: u64_at(48),
            },
            grant_offset: u64_at(56),
            len: u64_at(64),
            fd: i32::from_le_bytes(b[72..76].try_into().expect("4 bytes")),
        };
        match kind {
            Kind::Share if r.fd < 0 || r.len == 0 || r.len > MAX_SHARE_LEN => Err(bad(format!(
                "share of fd {} with {} bytes (1..={MAX_SHARE_LEN})",
                r.fd, r.len
            ))),
            Kind::Write | Kind::Read if r.len == 0 => Err(bad("zero-length slice".into())),
            Kind::Write | Kind::Read if r.share_offset.checked_add(r.len).is_none() => {
                Err(bad("share range overflows".into()))
            }
            _ => Ok(r),
        }
    }
}

fn reply_bytes(req_id: u64, outcome: &Result<()>) -> Vec<u8> {
    let (status, detail) = match outcome {
        Ok(()) => (0u16, Vec::new()),
        Err(e) => (e.kind() as u16, error_body(e)),
    };
    let mut b = Vec::with_capacity(REPLY_LEN + detail.len());
    b.extend_from_slice(&req_id.to_le_bytes());
    b.extend_from_slice(&status.to_le_bytes());
    b.extend_from_slice(&[0, 0]);
    b.extend_from_slice(&(detail.len() as u32).to_le_bytes());
    b.extend_from_slice(&detail);
    b
}

// ---------------------------------------------------------------- socket helpers

async fn write_all(s: &UnixStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        s.writable().await?;
        match s.try_write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One non-blocking `recv` straight on the socket, bypassing tokio's cached readiness, so a
/// busy-poll sees bytes the reactor has not reported yet.
fn recv_now(s: &UnixStream, buf: &mut [u8]) -> io::Result<usize> {
    use std::io::Read;
    (&*socket2::SockRef::from(s)).read(buf)
}

/// Reads exactly `buf.len()` bytes, busy-polling for up to `spin` first (holding the thread
/// when `hold`, else yielding to the runtime between polls), then parking on the reactor.
async fn read_exact(s: &UnixStream, buf: &mut [u8], spin: Duration, hold: bool) -> io::Result<()> {
    let len = buf.len();
    read_at_least(s, buf, len, spin, hold).await.map(|_| ())
}

/// Reads at least `min` bytes into `buf` (more if they are already there, up to its length),
/// polling as [`read_exact`] does; returns how many it read.
async fn read_at_least(
    s: &UnixStream,
    buf: &mut [u8],
    min: usize,
    spin: Duration,
    hold: bool,
) -> io::Result<usize> {
    let mut got = 0;
    let until = std::time::Instant::now() + spin;
    while got < min {
        match recv_now(s, &mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                got += n;
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        // With every core taken, the spin would hold one the peer or other work needs.
        if std::time::Instant::now() < until && spare_core() {
            if hold {
                std::thread::yield_now();
            } else {
                tokio::task::yield_now().await;
            }
            continue;
        }
        s.readable().await?;
        // try_io clears tokio's readiness on WouldBlock, so the next await really parks.
        match s.try_io(tokio::io::Interest::READABLE, || {
            recv_now(s, &mut buf[got..])
        }) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

// ---------------------------------------------------------------- server

/// The owner's side: accepts initiators on this host and serves their slices.
pub(crate) struct ShmServer {
    pub endpoint: ShmEndpoint,
    task: tokio::task::JoinHandle<()>,
    /// Ends every connection's task when the server goes (the engine shut down).
    stop: tokio_util::sync::CancellationToken,
}

impl Drop for ShmServer {
    fn drop(&mut self) {
        self.stop.cancel();
        self.task.abort();
    }
}

impl ShmServer {
    pub async fn bind(core: Admission, cfg: ShmConfig) -> Result<Self> {
        let socket = format!("omnirig-shm-{:016x}", core.instance);
        let listener = abstract_addr(&socket)
            .and_then(|a| std::os::unix::net::UnixListener::bind_addr(&a))
            .and_then(|l| {
                l.set_nonblocking(true)?;
                tokio::net::UnixListener::from_std(l)
            })
            .map_err(|e| Error::io(e, "binding the shm endpoint"))?;
        let endpoint = ShmEndpoint {
            socket,
            host: host_identity(),
        };
        let live = core.live().clone();
        let stop = tokio_util::sync::CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                if !core.is_open() {
                    return;
                }
                let core = core.clone();
                // The initiator's pid from the kernel, never from the wire.
                let pid = match stream.peer_cred().map(|c| c.pid()) {
                    Ok(Some(pid)) => pid,
                    _ => {
                        warn!(engine = %core.engine(), "shm peer without credentials refused");
                        continue;
                    }
                };
                let counted = Counted::new(&live);
                let cfg = cfg.clone();
                let stopped = stopped.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = serve(core, stream, pid, cfg) => {}
                        _ = stopped.cancelled() => {}
                    }
                    drop(counted);
                });
            }
        });
        Ok(Self {
            endpoint,
            task,
            stop,
        })
    }
}

/// Peer regions mapped for one connection, oldest first out.
#[derive(Default)]
struct Shares {
    maps: HashMap<u64, Arc<PeerMemory>>,
    order: VecDeque<u64>,
}

/// Requests an owner takes from its socket at once: a batch's requests arrive together and are
/// answered together (one reply write, one wake-up for the initiator).
const MAX_PIPELINED: usize = 64;

async fn serve(core: Admission, stream: UnixStream, pid: i32, cfg: ShmConfig) {
    let mut shares = Shares::default();
    let name = core.engine().to_owned();
    let mut buf = vec![0u8; REQUEST_LEN * MAX_PIPELINED];
    let mut have = 0;
    let mut replies = Vec::new();
    loop {
        if have < REQUEST_LEN {
            match read_at_least(
                &stream,
                &mut buf[have..],
                REQUEST_LEN - have,
                cfg.busy_poll,
                false,
            )
            .await
            {
                Ok(n) => have += n,
                Err(e) => {
                    debug!(engine = %name, pid, error = %e, "shm connection closed");
                    return;
                }
            }
        }
        // Every whole request already here, in order; then whatever arrived meanwhile.
        let mut at = 0;
        while have - at >= REQUEST_LEN {
            let b: &[u8; REQUEST_LEN] = buf[at..at + REQUEST_LEN].try_into().expect("one request");
            at += REQUEST_LEN;
            let req = match Request::decode(b) {
                Ok(r) => r,
                Err(e) => {
                    warn!(engine = %name, pid, error = %e, "refusing shm connection: malformed request");
                    replies.extend_from_slice(&reply_bytes(0, &Err(e)));
                    let _ = write_all(&stream, &replies).await;
                    return;
                }
            };
            // Admission holds the engine weakly: a shut-down engine refuses with PeerDisconnected.
            let outcome = handle(&core, &mut shares, pid, &req);
            replies.extend_from_slice(&reply_bytes(req.req_id, &outcome));
            if have - at < REQUEST_LEN {
                buf.copy_within(at..have, 0);
                have -= at;
                at = 0;
                match recv_now(&stream, &mut buf[have..]) {
                    Ok(n) => have += n, // 0 (closed): answered below, then the read sees it
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => return,
                }
            }
        }
        buf.copy_within(at..have, 0);
        have -= at;
        if write_all(&stream, &replies).await.is_err() {
            return;
        }
        replies.clear();
    }
}

fn handle(core: &Admission, shares: &mut Shares, pid: i32, req: &Request) -> Result<()> {
    match req.kind {
        Kind::Share => {
            let len = usize::try_from(req.len)
                .map_err(|_| Error::new(ErrorKind::InvalidLength, "share too large"))?;
            let path = std::path::PathBuf::from(format!("/proc/{pid}/fd/{}", req.fd));
            let mem = Arc::new(PeerMemory::map(&path, len)?);
            if shares.maps.insert(req.share_id, mem).is_none() {
                shares.order.push_back(req.share_id);
            }
            while shares.order.len() > MAX_SHARES {
                if let Some(old) = shares.order.pop_front() {
                    shares.maps.remove(&old);
                }
            }
            Ok(())
        }
        Kind::Write | Kind::Read => {
            // Never shared, or unmapped to make room: the initiator shares it again.
            let mem = shares.maps.get(&req.share_id).ok_or_else(|| {
                Error::new(
                    ErrorKind::UnknownBuffer,
                    format!("{UNMAPPED} {} on this connection", req.share_id),
                )
            })?;
            let op = if req.kind == Kind::Write {
                OpKind::Write
            } else {
                OpKind::Read
            };
            let (region, admitted) =
                core.admit(op.access(), req.grant, req.grant_offset, req.len)?;
            // The fence: the copy runs under a pin, so a revoke waits for it, and once the
            // grant is revoked no copy starts.
            let _pin = admitted.entry.pin()?;
            match op {
                OpKind::Write => {
                    mem.copy_into(req.share_offset, &region, admitted.buffer_offset, req.len)
                }
                OpKind::Read => {
                    mem.copy_from(req.share_offset, &region, admitted.buffer_offset, req.len)
                }
            }
        }
    }
}

// ---------------------------------------------------------------- client

impl TransportSetup for ShmConfig {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    /// Binds the engine's shm endpoint; the engine's buffers become sealed memfds.
    fn start(&self, engine: Admission) -> BoxFuture<'static, Result<Arc<dyn Transport>>> {
        let cfg = self.clone();
        Box::pin(async move {
            let live = engine.live().clone();
            let server = ShmServer::bind(engine, cfg.clone()).await?;
            Ok(Arc::new(ShmTransport {
                host: server.endpoint.host.clone(),
                endpoint: server.endpoint.clone(),
                server: Mutex::new(Some(server)),
                cfg,
                live,
            }) as Arc<dyn Transport>)
        })
    }
}

impl ShmEndpoint {
    fn to_endpoint(&self) -> Endpoint {
        Endpoint::new(
            TransportKind::Shm,
            rmp_serde::to_vec(self).expect("an shm endpoint always encodes"),
        )
    }

    /// The peer's shm endpoint, decoded and validated, if it publishes one.
    fn of(peer: &SegmentDescriptor) -> Result<Option<ShmEndpoint>> {
        let Some(bytes) = peer.endpoint(TransportKind::Shm) else {
            return Ok(None);
        };
        let e: ShmEndpoint = rmp_serde::from_slice(bytes)
            .map_err(|e| Error::new(ErrorKind::Malformed, format!("shm endpoint: {e}")))?;
        e.validate()?;
        Ok(Some(e))
    }
}

/// Serves this engine's memory to, and reaches, engines of other processes on this host
/// through shared memory.
pub struct ShmTransport {
    cfg: ShmConfig,
    host: String,
    live: Arc<Liveness>,
    endpoint: ShmEndpoint,
    server: Mutex<Option<ShmServer>>,
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn reaches(&self, peer: &SegmentDescriptor) -> bool {
        ShmEndpoint::of(peer).is_ok_and(|e| e.is_some_and(|e| e.host == self.host))
    }

    fn endpoint(&self) -> Option<Endpoint> {
        Some(self.endpoint.to_endpoint())
    }

    fn memory(&self) -> Option<Arc<dyn MemoryProvider>> {
        Some(Arc::new(memfd::MemfdProvider))
    }

    fn shutdown(&self) {
        drop(self.server.lock().unwrap_or_else(|p| p.into_inner()).take());
    }

    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>> {
        let cfg = self.cfg.clone();
        let live = self.live.clone();
        Box::pin(async move {
            let ep = ShmEndpoint::of(&peer)
                .map_err(|e| e.with_peer(&peer.name))?
                .ok_or_else(|| {
                    Error::new(ErrorKind::NoTransport, "peer has no shm endpoint")
                        .with_peer(&peer.name)
                })?;
            let first = dial(&ep.socket, &live)
                .await
                .map_err(|e| e.with_peer(&peer.name))?;
            Ok(Arc::new(ShmLink(Arc::new(LinkShared {
                socket: ep.socket,
                peer: peer.name,
                slots: Semaphore::new(cfg.streams.max(1)),
                idle: Mutex::new(vec![first]),
                next_req: std::sync::atomic::AtomicU64::new(1),
                cfg,
                live,
            }))) as Arc<dyn Link>)
        })
    }
}

struct Conn {
    stream: UnixStream,
    /// Regions this connection already shared with the owner.
    shared: HashSet<u64>,
    _counted: Counted,
}

async fn dial(socket: &str, live: &Arc<Liveness>) -> Result<Conn> {
    let stream = abstract_addr(socket)
        .and_then(|a| std::os::unix::net::UnixStream::connect_addr(&a))
        .and_then(|s| {
            s.set_nonblocking(true)?;
            UnixStream::from_std(s)
        })
        .map_err(|e| Error::new(ErrorKind::Unreachable, format!("shm {socket}: {e}")))?;
    Ok(Conn {
        stream,
        shared: HashSet::new(),
        _counted: Counted::new(live),
    })
}

struct ShmLink(Arc<LinkShared>);

struct LinkShared {
    socket: String,
    peer: String,
    cfg: ShmConfig,
    slots: Semaphore,
    idle: Mutex<Vec<Conn>>,
    next_req: std::sync::atomic::AtomicU64,
    live: Arc<Liveness>,
}

impl LinkShared {
    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn execute(&self, op: SliceOp) -> Result<()> {
        let (share_id, fd, file_len) = share_of(&op)?;
        let _slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| Error::new(ErrorKind::EngineClosed, "link closed"))?;
        let pooled = self.idle().pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => dial(&self.socket, &self.live).await?,
        };
        // Alone on the link and on its task, hold the thread for the reply; else let other
        // slices run.
        let alone = op.alone && self.slots.available_permits() + 1 >= self.cfg.streams.max(1);
        // If this future is dropped mid-request, `conn` drops with it, out of sync or not.
        if !conn.shared.contains(&share_id) {
            let share = self.share_request(share_id, fd, file_len);
            // The fd number stays ours while `op.local` (this region) is alive, which it is.
            round_trip(&conn.stream, &share, self.cfg.busy_poll, alone).await??;
            conn.shared.insert(share_id);
        }
        let req = self.slice_request(&op, share_id);
        let spin = self.copy_spin(op.len);
        let mut reply = round_trip(&conn.stream, &req, spin, alone).await?;
        if matches!(&reply, Err(e) if is_unmapped(e)) {
            // The owner unmapped the region to make room for others: share it again, once.
            let share = self.share_request(share_id, fd, file_len);
            round_trip(&conn.stream, &share, self.cfg.busy_poll, alone).await??;
            let req = Request {
                req_id: self.next_req.fetch_add(1, Ordering::Relaxed),
                ..req
            };
            reply = round_trip(&conn.stream, &req, spin, alone).await?;
        }
        self.idle().push(conn);
        reply
    }
}

/// Most slices one group puts on a connection at once (with their shares, at most
/// [`MAX_PIPELINED`] requests: the owner answers them in one write, and the requests always
/// fit the socket's buffer, so neither side can block the other).
const MAX_GROUP: usize = MAX_PIPELINED / 2;

/// Whether a batch's slices go out as groups ([`Link::start_batch`]); `OMNIRIG_SHM_BATCH=off`
/// makes each slice its own round trip, as before, to measure the two in one run.
fn batch_as_groups() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("OMNIRIG_SHM_BATCH").as_deref() != Ok("off"))
}

/// What a group waits for, in request order.
enum Awaited {
    Share(u64),
    Slice(usize),
}

impl LinkShared {
    /// Moves a batch's slices on one connection in one round trip: the requests (and the
    /// shares they need) leave in one write, the owner copies them in order and answers them
    /// together. One outcome per op, as each op's own [`LinkShared::execute`] would end.
    async fn execute_group(&self, ops: &[SliceOp]) -> Vec<Result<()>> {
        let n = ops.len();
        let mut outcomes: Vec<Option<Result<()>>> = vec![None; n];
        let fail_rest = |outcomes: &mut Vec<Option<Result<()>>>, e: &Error| {
            outcomes
                .iter_mut()
                .filter(|o| o.is_none())
                .for_each(|o| *o = Some(Err(e.clone())));
        };
        let slot = match self.slots.acquire().await {
            Ok(s) => s,
            Err(_) => {
                fail_rest(
                    &mut outcomes,
                    &Error::new(ErrorKind::EngineClosed, "link closed"),
                );
                return outcomes.into_iter().flatten().collect();
            }
        };
        let pooled = self.idle().pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => match dial(&self.socket, &self.live).await {
                Ok(c) => c,
                Err(e) => {
                    fail_rest(&mut outcomes, &e);
                    return outcomes.into_iter().flatten().collect();
                }
            },
        };
        let alone = self.slots.available_permits() + 1 >= self.cfg.streams.max(1);
        let mut wire = Vec::with_capacity(2 * n * REQUEST_LEN);
        let mut awaited = Vec::with_capacity(2 * n);
        let mut shares = vec![0u64; n];
        let mut sharing = HashSet::new();
        for (k, op) in ops.iter().enumerate() {
            let (share_id, fd, file_len) = match share_of(op) {
                Ok(f) => f,
                Err(e) => {
                    outcomes[k] = Some(Err(e));
                    continue;
                }
            };
            shares[k] = share_id;
            if !conn.shared.contains(&share_id) && sharing.insert(share_id) {
                // The fd number stays ours while `op.local` (this region) is alive, which
                // it is until the group ends.
                let share = self.share_request(share_id, fd, file_len);
                wire.extend_from_slice(&share.encode());
                awaited.push((share.req_id, Awaited::Share(share_id)));
            }
            let req = self.slice_request(op, share_id);
            wire.extend_from_slice(&req.encode());
            awaited.push((req.req_id, Awaited::Slice(k)));
        }
        let spin = self.copy_spin(ops.iter().map(|o| o.len).sum());
        // If this future is dropped mid-group, `conn` drops with it, out of sync or not.
        if let Err(e) = write_all(&conn.stream, &wire).await {
            fail_rest(&mut outcomes, &Error::io(e, "sending shm requests"));
            return outcomes.into_iter().flatten().collect();
        }
        let mut again = Vec::new();
        for (id, what) in awaited {
            let reply = match read_reply(&conn.stream, id, spin, alone).await {
                Ok(r) => r,
                Err(e) => {
                    // The connection is done (it drops here); whatever was not answered
                    // fails with why.
                    fail_rest(&mut outcomes, &e);
                    return outcomes.into_iter().flatten().collect();
                }
            };
            match what {
                Awaited::Share(id) => {
                    if reply.is_ok() {
                        conn.shared.insert(id);
                    }
                }
                // Not mapped (a refused share, or unmapped to make room): that slice runs
                // again on its own, which shares once more and says why if it cannot.
                Awaited::Slice(k) => match reply {
                    Err(e) if is_unmapped(&e) => again.push(k),
                    r => outcomes[k] = Some(r),
                },
            }
        }
        for &k in &again {
            conn.shared.remove(&shares[k]);
        }
        self.idle().push(conn);
        drop(slot);
        for k in again {
            outcomes[k] = Some(self.execute(ops[k].clone()).await);
        }
        outcomes
            .into_iter()
            .map(|o| o.expect("every slice answered"))
            .collect()
    }
}

impl LinkShared {
    /// A share request for the region, with a fresh request id.
    fn share_request(&self, share_id: u64, fd: i32, file_len: usize) -> Request {
        Request {
            req_id: self.next_req.fetch_add(1, Ordering::Relaxed),
            ..share_request(share_id, fd, file_len)
        }
    }

    /// The request moving `op` from region `share_id`, with a fresh request id.
    fn slice_request(&self, op: &SliceOp, share_id: u64) -> Request {
        Request {
            kind: if op.kind == OpKind::Write {
                Kind::Write
            } else {
                Kind::Read
            },
            req_id: self.next_req.fetch_add(1, Ordering::Relaxed),
            share_id,
            share_offset: op.local_offset,
            grant: op.grant,
            grant_offset: op.grant_offset,
            len: op.len,
            fd: 0,
        }
    }

    /// How long to poll for a reply the owner sends once it has copied `bytes`: through the
    /// copy too (at a conservative 4 GB/s), or a parked initiator pays a wake-up each time.
    fn copy_spin(&self, bytes: u64) -> Duration {
        self.cfg.busy_poll + Duration::from_nanos(bytes / 4).min(MAX_COPY_SPIN)
    }
}

/// `op`'s local region as the owner maps it: share id, this process's fd number, file size.
fn share_of(op: &SliceOp) -> Result<(u64, i32, usize)> {
    shared_file(&op.local)
        .map(|(i, f, l)| (i, f.as_raw_fd(), l))
        .ok_or_else(|| {
            Error::new(
                ErrorKind::NoTransport,
                "local buffer is not shareable (an engine with shm enabled allocates shareable buffers)",
            )
        })
}

/// The owner's answer when it holds no mapping of the region (never shared, or unmapped to
/// make room): the initiator shares it again.
fn is_unmapped(e: &Error) -> bool {
    e.kind() == ErrorKind::UnknownBuffer && e.detail().contains(UNMAPPED)
}

/// The request announcing a region: its memfd's number in this process and its size.
fn share_request(share_id: u64, fd: i32, file_len: usize) -> Request {
    Request {
        kind: Kind::Share,
        req_id: 0,
        share_id,
        share_offset: 0,
        grant: GrantRef {
            buffer: 0,
            epoch: 0,
            token: 0,
        },
        grant_offset: 0,
        len: file_len as u64,
        fd,
    }
}

/// Sends one request and reads its reply. `Ok(Err(e))` is the owner's clean refusal (the
/// connection stays usable); `Err(e)` means the connection is done.
async fn round_trip(
    s: &UnixStream,
    req: &Request,
    spin: Duration,
    hold: bool,
) -> Result<Result<()>> {
    write_all(s, &req.encode())
        .await
        .map_err(|e| Error::io(e, "sending shm request"))?;
    read_reply(s, req.req_id, spin, hold).await
}

/// Reads the reply to request `req_id` (replies come in request order), as [`round_trip`].
async fn read_reply(s: &UnixStream, req_id: u64, spin: Duration, hold: bool) -> Result<Result<()>> {
    let mut r = [0u8; REPLY_LEN];
    read_exact(s, &mut r, spin, hold)
        .await
        .map_err(|e| Error::io(e, "reading shm reply"))?;
    let id = u64::from_le_bytes(r[0..8].try_into().expect("8 bytes"));
    let status = u16::from_le_bytes(r[8..10].try_into().expect("2 bytes"));
    let detail_len = u32::from_le_bytes(r[12..16].try_into().expect("4 bytes")) as usize;
    if detail_len > MAX_DETAIL + 2 {
        return Err(Error::new(
            ErrorKind::Malformed,
            format!("shm reply detail of {detail_len} bytes"),
        ));
    }
    let mut detail = vec![0u8; detail_len];
    read_exact(s, &mut detail, Duration::ZERO, hold)
        .await
        .map_err(|e| Error::io(e, "reading shm reply"))?;
    if id != req_id && id != 0 {
        return Err(Error::new(
            ErrorKind::Malformed,
            format!("shm reply for request {id} while waiting for {req_id}"),
        ));
    }
    if status == 0 {
        Ok(Ok(()))
    } else if id == 0 {
        // The owner refused the connection itself.
        Err(decode_error_body(&detail))
    } else {
        Ok(Err(decode_error_body(&detail)))
    }
}

impl Link for ShmLink {
    fn info(&self) -> LinkInfo {
        LinkInfo {
            transport: TransportKind::Shm,
            device: format!("memfd@{}", self.0.socket),
        }
    }

    fn slicing(&self) -> Slicing {
        Slicing {
            slice_size: self.0.cfg.slice_size,
            in_flight: self.0.cfg.streams.max(1),
        }
    }

    fn execute(&self, op: SliceOp) -> BoxFuture<'static, Result<()>> {
        let shared = self.0.clone();
        Box::pin(async move {
            shared
                .execute(op)
                .await
                .map_err(|e| e.with_peer(&shared.peer))
        })
    }

    /// A batch's slices in groups of up to [`MAX_GROUP`], each one round trip on one
    /// connection (groups share the link's connections as single slices do). A group goes on
    /// while any of its ops' futures is polled; dropping all of them drops its connection.
    fn start_batch(&self, ops: &[SliceOp]) -> Option<Vec<BoxFuture<'static, Result<()>>>> {
        use futures_util::FutureExt;
        if ops.len() < 2 || !batch_as_groups() {
            return None;
        }
        let mut futures: Vec<BoxFuture<'static, Result<()>>> = Vec::with_capacity(ops.len());
        // One group per round trip rather than the batch spread over the link's connections:
        // measured, two groups of a 5-slice batch in parallel were slower than one.
        for chunk in ops.chunks(MAX_GROUP) {
            let shared = self.0.clone();
            let len = chunk.len();
            let chunk = chunk.to_vec();
            let group = async move { Arc::new(shared.execute_group(&chunk).await) }
                .boxed()
                .shared();
            for k in 0..len {
                let group = group.clone();
                let peer = self.0.peer.clone();
                futures.push(Box::pin(async move {
                    group.await[k].clone().map_err(|e| e.with_peer(&peer))
                }));
            }
        }
        Some(futures)
    }

    fn drop_connections(&self) {
        self.0.idle().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(kind: Kind) -> Request {
        Request {
            kind,
            req_id: 9,
            share_id: 3,
            share_offset: 4096,
            grant: GrantRef {
                buffer: 2,
                epoch: 77,
                token: 0xdead_beef,
            },
            grant_offset: 64,
            len: 1 << 20,
            fd: 5,
        }
    }

    #[test]
    fn requests_round_trip_and_bad_ones_are_refused() {
        for k in [Kind::Share, Kind::Write, Kind::Read] {
            let r = req(k);
            assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        }
        let malformed = |mut b: [u8; REQUEST_LEN], i: usize, v: u8| {
            b[i] = v;
            Request::decode(&b).unwrap_err().kind()
        };
        let good = req(Kind::Write).encode();
        assert_eq!(malformed(good, 0, b'X'), ErrorKind::Malformed); // magic
        assert_eq!(malformed(good, 4, 2), ErrorKind::Malformed); // version
        assert_eq!(malformed(good, 5, 9), ErrorKind::Malformed); // kind
        assert_eq!(malformed(good, 90, 1), ErrorKind::Malformed); // reserved
        let zero = Request {
            len: 0,
            ..req(Kind::Write)
        };
        assert!(Request::decode(&zero.encode()).is_err());
        let wrap = Request {
            share_offset: u64::MAX,
            ..req(Kind::Read)
        };
        assert!(Request::decode(&wrap.encode()).is_err());
        let neg = Request {
            fd: -1,
            ..req(Kind::Share)
        };
        assert!(Request::decode(&neg.encode()).is_err());
        let huge = Request {
            len: MAX_SHARE_LEN + 1,
            ..req(Kind::Share)
        };
        assert!(Request::decode(&huge.encode()).is_err());
    }

    proptest::proptest! {
        /// Any 96 bytes: decoded or refused, never a panic; what decodes re-encodes the same.
        #[test]
        fn arbitrary_requests_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, REQUEST_LEN)) {
            let b: [u8; REQUEST_LEN] = bytes.try_into().unwrap();
            if let Ok(r) = Request::decode(&b) {
                proptest::prop_assert_eq!(Request::decode(&r.encode()).unwrap(), r);
            }
        }

        /// Valid headers with random fields round-trip or are refused for a named reason.
        #[test]
        fn valid_magic_random_fields(kind in 1u8..=3, rest in proptest::collection::vec(proptest::num::u8::ANY, REQUEST_LEN - 8)) {
            let mut b = [0u8; REQUEST_LEN];
            b[0..4].copy_from_slice(MAGIC);
            b[4] = VERSION;
            b[5] = kind;
            b[8..].copy_from_slice(&rest);
            match Request::decode(&b) {
                Ok(r) => proptest::prop_assert_eq!(Request::decode(&r.encode()).unwrap(), r),
                Err(e) => proptest::prop_assert_eq!(e.kind(), ErrorKind::Malformed),
            }
        }
    }

    /// A peer region with holes is mapped lazily: populating it would allocate here what the
    /// peer never did. Its pages come into being only as they are copied.
    #[test]
    fn a_peer_file_with_holes_maps_without_allocating() {
        use crate::memory::Region;
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        use std::os::unix::fs::MetadataExt;
        let len = 64 << 20;
        // SAFETY: plain system calls on a descriptor this test creates and owns.
        let fd = unsafe {
            let raw = libc::memfd_create(
                c"omnirig-sparse".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            );
            assert!(raw >= 0, "memfd_create");
            let fd = OwnedFd::from_raw_fd(raw);
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
            assert_eq!(
                libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK),
                0
            );
            fd
        };
        let path = std::path::PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            fd.as_raw_fd()
        ));
        let blocks = || std::fs::metadata(&path).unwrap().blocks();
        assert_eq!(blocks(), 0, "a fresh memfd has no pages");
        let m = PeerMemory::map(&path, len).unwrap();
        assert_eq!(blocks(), 0, "mapping a file with holes allocated its pages");
        let dst = Region::allocate(4096, false).unwrap();
        m.copy_into(0, &dst, 0, 4096).unwrap();
        assert!(
            blocks() * 512 < len as u64 / 2,
            "only what was copied exists"
        );
    }

    #[test]
    fn peer_memory_refuses_unsealed_and_short_files() {
        use crate::memory::Region;
        use std::os::fd::AsRawFd;
        // A plain file can shrink under a mapping: refused.
        let path = std::env::temp_dir().join(format!("omnirig-shm-test-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let e = PeerMemory::map(&path, 4096).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Malformed, "{e}");
        assert!(e.to_string().contains("not sealed"), "{e}");
        let _ = std::fs::remove_file(&path);
        // A sealed region announced larger than it is: refused.
        let r = memfd::allocate_shared(4096).unwrap();
        let (_, fd, len) = shared_file(&r).unwrap();
        let proc_path = std::path::PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            fd.as_raw_fd()
        ));
        let e = PeerMemory::map(&proc_path, len + 4096).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Malformed, "{e}");
        // The real thing maps, and copies stay inside it.
        r.write(0, b"omnirig").unwrap();
        let m = PeerMemory::map(&proc_path, len).unwrap();
        let dst = Region::allocate(4096, false).unwrap();
        m.copy_into(0, &dst, 0, 7).unwrap();
        let mut got = [0u8; 7];
        dst.read(0, &mut got).unwrap();
        assert_eq!(&got, b"omnirig");
        assert_eq!(
            m.copy_into(len as u64 - 3, &dst, 0, 7).unwrap_err().kind(),
            ErrorKind::OutOfBuffer
        );
        assert_eq!(
            m.copy_from(u64::MAX, &dst, 0, 7).unwrap_err().kind(),
            ErrorKind::OutOfBuffer
        );
    }

    /// A link to a scripted owner on an abstract socket of its own (no engine behind it).
    fn scripted_link(name: &str) -> (std::os::unix::net::UnixListener, Arc<LinkShared>) {
        let socket = format!("omnirig-shm-test-{name}-{}", std::process::id());
        let listener =
            std::os::unix::net::UnixListener::bind_addr(&abstract_addr(&socket).unwrap()).unwrap();
        let link = Arc::new(LinkShared {
            socket,
            peer: "owner".into(),
            cfg: ShmConfig::default(),
            slots: Semaphore::new(2),
            idle: Mutex::new(Vec::new()),
            next_req: std::sync::atomic::AtomicU64::new(1),
            live: Arc::new(Liveness::default()),
        });
        (listener, link)
    }

    fn write_op(local: &Arc<crate::memory::Region>, k: u64) -> SliceOp {
        SliceOp {
            kind: OpKind::Write,
            local: local.clone(),
            local_offset: k * 64,
            grant: GrantRef {
                buffer: 1,
                epoch: 1,
                token: k,
            },
            key: None,
            grant_offset: 0,
            len: 64,
            tag: 0,
            request_offset: 0,
            request_len: 64,
            alone: true,
        }
    }

    fn read_requests(s: &mut std::os::unix::net::UnixStream, n: usize) -> Vec<Request> {
        use std::io::Read;
        (0..n)
            .map(|_| {
                let mut b = [0u8; REQUEST_LEN];
                s.read_exact(&mut b).unwrap();
                Request::decode(&b).unwrap()
            })
            .collect()
    }

    /// A group's requests (its share first) all reach the owner before the owner answers
    /// any: one round trip, not one per slice. A slice the owner says it has not mapped runs
    /// again on its own, sharing its region first, and every op ends with its own outcome.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_group_is_one_round_trip_and_an_unmapped_slice_runs_again_alone() {
        use std::io::Write;
        let (listener, link) = scripted_link("group");
        let local = Arc::new(memfd::allocate_shared(4096).unwrap());
        let ops: Vec<SliceOp> = (0..5).map(|k| write_op(&local, k)).collect();
        let owner = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            // Answers nothing until all six requests are here: a link that waited for a
            // reply between them would time this read out.
            let reqs = read_requests(&mut s, 6);
            let kinds: Vec<Kind> = reqs.iter().map(|r| r.kind).collect();
            assert_eq!(kinds[0], Kind::Share);
            assert!(kinds[1..].iter().all(|&k| k == Kind::Write), "{kinds:?}");
            let mut replies = Vec::new();
            replies.extend(reply_bytes(reqs[0].req_id, &Ok(())));
            for (i, r) in reqs[1..].iter().enumerate() {
                let outcome = match i {
                    2 => Err(Error::new(
                        ErrorKind::UnknownBuffer,
                        format!("{UNMAPPED} 1"),
                    )),
                    3 => Err(Error::new(ErrorKind::GrantRevoked, "grant 3 was revoked")),
                    _ => Ok(()),
                };
                replies.extend(reply_bytes(r.req_id, &outcome));
            }
            s.write_all(&replies).unwrap();
            // Slice 2 again on its own: its share, then the write.
            let again = read_requests(&mut s, 1);
            assert_eq!(again[0].kind, Kind::Share);
            s.write_all(&reply_bytes(again[0].req_id, &Ok(()))).unwrap();
            let again = read_requests(&mut s, 1);
            assert_eq!((again[0].kind, again[0].grant.token), (Kind::Write, 2));
            s.write_all(&reply_bytes(again[0].req_id, &Ok(()))).unwrap();
            reqs[1..].iter().map(|r| r.grant.token).collect::<Vec<_>>()
        });
        let outcomes = link.execute_group(&ops).await;
        let tokens = owner.join().unwrap();
        assert_eq!(tokens, vec![0, 1, 2, 3, 4], "slices in request order");
        let kinds: Vec<Option<ErrorKind>> = outcomes
            .iter()
            .map(|o| o.as_ref().err().map(|e| e.kind()))
            .collect();
        assert_eq!(
            kinds,
            vec![None, None, None, Some(ErrorKind::GrantRevoked), None]
        );
        // Five ops, one future each, whatever the grouping.
        let futures = ShmLink(link).start_batch(
            &(0..70)
                .map(|k| write_op(&local, k % 60))
                .collect::<Vec<_>>(),
        );
        assert_eq!(futures.map(|f| f.len()), Some(70));
    }

    /// An owner that dies mid-group fails every slice it did not answer, with why.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_group_cut_off_fails_what_was_not_answered() {
        use std::io::Write;
        let (listener, link) = scripted_link("cut");
        let local = Arc::new(memfd::allocate_shared(4096).unwrap());
        let ops: Vec<SliceOp> = (0..4).map(|k| write_op(&local, k)).collect();
        let owner = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let reqs = read_requests(&mut s, 5);
            let mut replies = reply_bytes(reqs[0].req_id, &Ok(()));
            replies.extend(reply_bytes(reqs[1].req_id, &Ok(())));
            s.write_all(&replies).unwrap();
            // then the owner goes away
        });
        let outcomes = link.execute_group(&ops).await;
        owner.join().unwrap();
        assert!(outcomes[0].is_ok());
        for o in &outcomes[1..] {
            let e = o.as_ref().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::PeerDisconnected, "{e}");
            assert!(e.to_string().contains("reading shm reply"), "{e}");
        }
    }

    #[test]
    fn endpoints_validate() {
        let ok = ShmEndpoint {
            socket: "omnirig-shm-1".into(),
            host: host_identity(),
        };
        ok.validate().unwrap();
        assert!(!ok.host.is_empty());
        let bad = ShmEndpoint {
            socket: "has space".into(),
            ..ok.clone()
        };
        assert!(bad.validate().is_err());
        let long = ShmEndpoint {
            socket: "x".repeat(MAX_SOCKET_NAME + 1),
            ..ok
        };
        assert!(long.validate().is_err());
    }
}
