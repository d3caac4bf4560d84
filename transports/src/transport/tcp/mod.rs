//! TCP: engines in other processes or on other hosts, over tokio.
//!
//! Payload bytes go straight between sockets and registered memory: the sender writes from
//! its region (header and payload in one vectored write when they fit), the receiver reads
//! the fixed header and then the payload directly into the granted range. The receiver holds
//! the grant's fence for one non-blocking `read` at a time, so a revoke waits microseconds,
//! never for the network, and bytes that arrive after it are read into a scratch buffer and
//! dropped. Each link keeps a small pool of connections; slices of one request travel on
//! several of them at once.

pub mod frame;

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, warn};

use crate::batch::Liveness;
use crate::error::{Error, ErrorKind, Result};
use crate::grant::{GrantEntry, GrantRef};
use crate::memory::Region;
use crate::segment::Endpoint;
use crate::segment::SegmentDescriptor;
use crate::transport::spare_core::spare_core;
use crate::transport::{
    Admission, BoxFuture, Counted, Link, LinkInfo, OpKind, SliceOp, Slicing, Transport,
    TransportKind, TransportSetup,
};
use frame::{FrameKind, HEADER_LEN, Header};

/// TCP tuning.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Where to listen for peers; `None`: no listener (this engine only connects out).
    pub listen: Option<SocketAddr>,
    /// Largest slice one frame carries.
    pub slice_size: u64,
    /// Connections per peer, which is also slices in flight per task.
    pub streams: usize,
    /// Largest payload this engine accepts in one frame (must be >= peers' slice size).
    pub max_payload: u64,
    pub connect_timeout: Duration,
    /// How long a reader busy-polls its socket before parking (0 disables): trades CPU on
    /// idle connections for round-trip latency.
    pub busy_poll: Duration,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            slice_size: 512 << 10,
            streams: 4,
            max_payload: 64 << 20,
            connect_timeout: Duration::from_secs(5),
            busy_poll: Duration::from_micros(50),
        }
    }
}

/// Largest error or hello body we accept (descriptors are larger and only clients read them).
const MAX_SMALL_BODY: u32 = 64 << 10;
/// Largest descriptor reply a client reads.
const MAX_DESCRIPTOR_BODY: u32 = frame::MAX_BODY;

struct Conn {
    stream: TcpStream,
    _counted: Counted,
}

// ---------- socket helpers that work on `&TcpStream` ----------

/// One non-blocking `recv` straight on the socket, bypassing tokio's cached readiness (so a
/// busy-poll sees data the reactor has not reported yet).
fn recv_now(stream: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    use std::io::Read;
    let sock = socket2::SockRef::from(stream);
    (&*sock).read(buf)
}

/// How a read busy-polls before it parks on the reactor.
#[derive(Clone, Copy)]
enum Spin {
    /// Keep the thread for up to this long: for bytes that are on their way (a payload
    /// being received, the reply to what this task just sent). Fastest, but it holds every
    /// other task of the runtime meanwhile.
    Thread(Duration),
    /// Poll for up to this long, yielding to the runtime between attempts: for a
    /// connection idling until its next frame, so an idle connection never holds the
    /// runtime's other tasks (other connections, the caller's control messages).
    Task(Duration),
}

/// Runs `attempt` (one non-blocking read) until it does not report WouldBlock: first by
/// busy-polling (see [`Spin`]), the way RDMA engines poll completion queues (waking a
/// parked thread costs far more than a short spin, above all on virtual CPUs), while a core
/// is spare ([`spare_core`]), then by parking on the reactor.
async fn read_ready<T>(
    stream: &TcpStream,
    spin: Spin,
    mut attempt: impl FnMut() -> io::Result<T>,
) -> io::Result<T> {
    let (window, cooperative) = match spin {
        Spin::Thread(d) => (d, false),
        Spin::Task(d) => (d, true),
    };
    if !window.is_zero() && spare_core() {
        let until = std::time::Instant::now() + window;
        loop {
            match attempt() {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return r,
            }
            // With every core taken, the spin would hold one the peer or other work needs.
            if std::time::Instant::now() >= until || !spare_core() {
                break;
            }
            if cooperative {
                tokio::task::yield_now().await;
            } else {
                std::thread::yield_now();
            }
        }
    }
    loop {
        stream.readable().await?;
        // try_io clears tokio's readiness on WouldBlock, so the next await really parks.
        match stream.try_io(tokio::io::Interest::READABLE, &mut attempt) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            r => return r,
        }
    }
}

async fn read_exact(stream: &TcpStream, buf: &mut [u8], spin: Spin) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match read_ready(stream, spin, || recv_now(stream, &mut buf[got..])).await? {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    Ok(())
}

async fn write_all(stream: &TcpStream, parts: &[&[u8]]) -> io::Result<()> {
    // Frames have at most a header and a body: two slices, no allocation per write.
    debug_assert!(parts.len() <= 2);
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut sent = 0;
    while sent < total {
        stream.writable().await?;
        let mut skip = sent;
        let mut slices = [IoSlice::new(&[]), IoSlice::new(&[])];
        let mut n = 0;
        for p in parts.iter().take(2) {
            if skip >= p.len() {
                skip -= p.len();
            } else {
                slices[n] = IoSlice::new(&p[skip..]);
                skip = 0;
                n += 1;
            }
        }
        match stream.try_write_vectored(&slices[..n]) {
            Ok(k) => sent += k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Why a transfer between a socket and memory stopped.
enum Stop {
    Io(io::Error),
    /// The grant was revoked; `remaining` payload bytes are still on the wire.
    Revoked(Error, u64),
}

/// Sends `head` then `len` bytes of `region` at `offset`. GPU memory is staged through the
/// device's pinned pool ([`crate::staging`]), one slot at a time, each copy under the fence.
async fn send_from(
    stream: &TcpStream,
    head: &[u8],
    region: &Region,
    offset: u64,
    len: u64,
    fence: Option<&Arc<GrantEntry>>,
) -> std::result::Result<(), Stop> {
    let Some(dev) = region.device() else {
        return send_host(stream, head, region, offset, len, fence).await;
    };
    let pool = dev.staging(true).clone();
    let stage_err = |e: Error| Stop::Io(io::Error::other(e.to_string()));
    let (mut head, mut done) = (head, 0u64);
    while done < len || !head.is_empty() {
        let n = (len - done).min(pool.slot_size() as u64);
        let staged = pool.acquire().await.map_err(stage_err)?;
        {
            let _pin = match fence {
                Some(f) => Some(f.pin().map_err(|e| Stop::Revoked(e, len - done))?),
                None => None,
            };
            region
                .copy_to(offset + done, staged.region(), 0, n)
                .map_err(stage_err)?;
        }
        send_host(stream, head, staged.region(), 0, n, None).await?;
        head = &[];
        done += n;
    }
    Ok(())
}

/// Sends `head` then `len` bytes of host `region` at `offset`, in as few system calls as
/// possible. With a fence, each system call runs under a pin of that grant.
async fn send_host(
    stream: &TcpStream,
    head: &[u8],
    region: &Region,
    offset: u64,
    len: u64,
    fence: Option<&Arc<GrantEntry>>,
) -> std::result::Result<(), Stop> {
    let mut head_sent = 0usize;
    let mut sent = 0u64;
    while head_sent < head.len() || sent < len {
        stream.writable().await.map_err(Stop::Io)?;
        let _pin = match fence {
            Some(f) => Some(f.pin().map_err(|e| Stop::Revoked(e, len - sent))?),
            None => None,
        };
        let r = region
            .with_slice(offset + sent, len - sent, |data| {
                if head_sent < head.len() {
                    stream
                        .try_write_vectored(&[IoSlice::new(&head[head_sent..]), IoSlice::new(data)])
                } else {
                    stream.try_write(data)
                }
            })
            .map_err(|e| Stop::Io(io::Error::other(e.to_string())))?;
        match r {
            Ok(mut n) => {
                let h = n.min(head.len() - head_sent);
                head_sent += h;
                n -= h;
                sent += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(Stop::Io(e)),
        }
    }
    Ok(())
}

/// Payloads up to this size are busy-polled holding the thread, like reply headers; larger
/// ones poll yielding to the runtime, so the other slices of a transfer (other connections,
/// same thread) keep moving meanwhile.
const SPIN_PAYLOAD_MAX: u64 = 64 << 10;

/// Receives `len` bytes into `region` at `offset`. GPU memory is staged: each slot's worth
/// lands in a pinned buffer, then is copied to the device under the fence, so once the grant
/// is revoked no further byte reaches the device.
async fn recv_into(
    stream: &TcpStream,
    region: &Region,
    offset: u64,
    len: u64,
    fence: Option<&Arc<GrantEntry>>,
    spin: Duration,
) -> std::result::Result<(), Stop> {
    let Some(dev) = region.device() else {
        return recv_host(stream, region, offset, len, fence, spin).await;
    };
    let pool = dev.staging(false).clone();
    let stage_err = |e: Error| Stop::Io(io::Error::other(e.to_string()));
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(pool.slot_size() as u64);
        let staged = pool.acquire().await.map_err(stage_err)?;
        recv_host(stream, staged.region(), 0, n, None, spin).await?;
        let _pin = match fence {
            Some(f) => Some(f.pin().map_err(|e| Stop::Revoked(e, len - done - n))?),
            None => None,
        };
        staged
            .region()
            .copy_to(0, region, offset + done, n)
            .map_err(stage_err)?;
        done += n;
    }
    Ok(())
}

/// Receives `len` bytes straight into host `region` at `offset`. With a fence, each `read`
/// runs under a pin of that grant; once it is revoked, no further byte lands.
async fn recv_host(
    stream: &TcpStream,
    region: &Region,
    offset: u64,
    len: u64,
    fence: Option<&Arc<GrantEntry>>,
    spin: Duration,
) -> std::result::Result<(), Stop> {
    let spin = if len <= SPIN_PAYLOAD_MAX {
        Spin::Thread(spin)
    } else {
        Spin::Task(spin)
    };
    let mut got = 0u64;
    while got < len {
        let attempt = || -> io::Result<std::result::Result<usize, Error>> {
            let _pin = match fence {
                Some(f) => match f.pin() {
                    Ok(p) => Some(p),
                    Err(e) => return Ok(Err(e)),
                },
                None => None,
            };
            region
                .with_mut_slice(offset + got, len - got, |dst| recv_now(stream, dst))
                .map_err(|e| io::Error::other(e.to_string()))?
                .map(Ok)
        };
        match read_ready(stream, spin, attempt).await.map_err(Stop::Io)? {
            Ok(0) => return Err(Stop::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n as u64,
            Err(revoked) => return Err(Stop::Revoked(revoked, len - got)),
        }
    }
    Ok(())
}

/// Reads and drops `len` payload bytes (refused or fenced writes) with bounded memory.
async fn discard(stream: &TcpStream, mut len: u64) -> io::Result<()> {
    let mut scratch = vec![0u8; 64 << 10];
    while len > 0 {
        let n = len.min(scratch.len() as u64) as usize;
        read_exact(stream, &mut scratch[..n], Spin::Thread(Duration::ZERO)).await?;
        len -= n as u64;
    }
    Ok(())
}

async fn read_header(stream: &TcpStream, max_payload: u64, spin: Spin) -> Result<Header> {
    let mut hb = [0u8; HEADER_LEN];
    read_exact(stream, &mut hb, spin)
        .await
        .map_err(|e| Error::io(e, "reading frame header"))?;
    Header::decode(&hb, max_payload)
}

async fn read_body(stream: &TcpStream, h: &Header, limit: u32) -> Result<Vec<u8>> {
    if h.body_len > limit {
        return Err(Error::new(
            ErrorKind::Malformed,
            format!("{:?} body of {} bytes exceeds {limit}", h.kind, h.body_len),
        ));
    }
    let mut body = vec![0u8; h.body_len as usize];
    read_exact(stream, &mut body, Spin::Thread(Duration::ZERO))
        .await
        .map_err(|e| Error::io(e, "reading frame body"))?;
    Ok(body)
}

async fn send_error(stream: &TcpStream, req_id: u64, err: &Error) -> io::Result<()> {
    let body = frame::error_body(err);
    let h = Header {
        body_len: body.len() as u32,
        ..Header::new(FrameKind::Error, req_id)
    };
    write_all(stream, &[&h.encode(), &body]).await
}

// ---------- server: serves this engine's memory to peers ----------

/// Accepts connections and serves grant-checked writes, reads and descriptors. Dropping it
/// closes the listener and every connection.
pub(crate) struct TcpServer {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        // Aborting the accept loop drops its JoinSet, which aborts every connection task.
        self.task.abort();
    }
}

impl TcpServer {
    pub async fn bind(addr: SocketAddr, core: Admission, cfg: TcpConfig) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io(e, &format!("binding {addr}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io(e, "local_addr"))?;
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((stream, from)) => {
                            let _ = stream.set_nodelay(true);
                            let conn = Conn { stream, _counted: core.connection() };
                            conns.spawn(serve(core.clone(), conn, from, cfg.clone()));
                        }
                        Err(e) => warn!(engine = %core.engine(), error = %e, "accept failed"),
                    },
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(Self { addr, task })
    }
}

async fn serve(core: Admission, conn: Conn, from: SocketAddr, cfg: TcpConfig) {
    let stream = &conn.stream;
    let mut peer = from.to_string();
    loop {
        let h = match read_header(stream, cfg.max_payload, Spin::Task(cfg.busy_poll)).await {
            Ok(h) => h,
            Err(e) if e.kind() == ErrorKind::Malformed => {
                warn!(engine = %core.engine(), peer = %peer, error = %e, "refusing connection: malformed frame");
                let _ = send_error(stream, 0, &e).await;
                return;
            }
            Err(e) => {
                debug!(engine = %core.engine(), peer = %peer, error = %e, "connection closed");
                return;
            }
        };
        let result = match h.kind {
            FrameKind::Hello => match read_body(stream, &h, 255).await {
                Ok(body) => match std::str::from_utf8(&body)
                    .map_err(|e| e.to_string())
                    .and_then(|s| {
                        crate::segment::validate_name(s)
                            .map(|_| s.to_owned())
                            .map_err(|e| e.to_string())
                    }) {
                    Ok(name) => {
                        debug!(engine = %core.engine(), peer = %name, addr = %from, "peer connected");
                        peer = name;
                        Ok(())
                    }
                    Err(e) => Err(Error::new(ErrorKind::Malformed, format!("hello: {e}"))),
                },
                Err(e) => Err(e),
            },
            FrameKind::Describe => {
                let body = match core.descriptor() {
                    Ok(d) => d.to_bytes(),
                    Err(_) => return,
                };
                let r = Header {
                    body_len: body.len() as u32,
                    ..Header::new(FrameKind::DescribeReply, h.req_id)
                };
                write_all(stream, &[&r.encode(), &body])
                    .await
                    .map_err(|e| Error::io(e, "describe reply"))
            }
            FrameKind::Write => serve_write(&core, stream, &h, cfg.busy_poll).await,
            FrameKind::Read => serve_read(&core, stream, &h).await,
            other => Err(Error::new(
                ErrorKind::Malformed,
                format!("a client must not send {other:?}"),
            )),
        };
        if let Err(e) = result {
            if e.kind() == ErrorKind::Malformed {
                warn!(engine = %core.engine(), peer = %peer, error = %e, "refusing connection: malformed frame");
                let _ = send_error(stream, h.req_id, &e).await;
            } else {
                debug!(engine = %core.engine(), peer = %peer, error = %e, "connection closed");
            }
            return;
        }
    }
}

fn wire(h: &Header) -> GrantRef {
    GrantRef {
        buffer: h.buffer,
        epoch: h.epoch,
        token: h.token,
    }
}

/// One write: check the grant, then payload straight into memory, then the ack. A refused
/// write's payload is drained so the connection stays usable for the peer's next slice.
/// Returns Err only when the connection must close.
async fn serve_write(
    core: &Admission,
    stream: &TcpStream,
    h: &Header,
    spin: Duration,
) -> Result<()> {
    let refused = match core.admit(OpKind::Write.access(), wire(h), h.offset, h.len) {
        Ok((region, adm)) => {
            match recv_into(
                stream,
                &region,
                adm.buffer_offset,
                h.len,
                Some(&adm.entry),
                spin,
            )
            .await
            {
                Ok(()) => {
                    let ack = Header::new(FrameKind::WriteAck, h.req_id).encode();
                    return write_all(stream, &[&ack])
                        .await
                        .map_err(|e| Error::io(e, "write ack"));
                }
                Err(Stop::Io(e)) => return Err(Error::io(e, "receiving payload")),
                Err(Stop::Revoked(e, remaining)) => {
                    discard(stream, remaining)
                        .await
                        .map_err(|e| Error::io(e, "draining fenced payload"))?;
                    e
                }
            }
        }
        Err(e) => {
            discard(stream, h.len)
                .await
                .map_err(|e| Error::io(e, "draining refused payload"))?;
            e
        }
    };
    debug!(engine = %core.engine(), error = %refused, "write refused");
    send_error(stream, h.req_id, &refused)
        .await
        .map_err(|e| Error::io(e, "error reply"))
}

async fn serve_read(core: &Admission, stream: &TcpStream, h: &Header) -> Result<()> {
    let (region, adm) = match core.admit(OpKind::Read.access(), wire(h), h.offset, h.len) {
        Ok(x) => x,
        Err(e) => {
            debug!(engine = %core.engine(), error = %e, "read refused");
            return send_error(stream, h.req_id, &e)
                .await
                .map_err(|e| Error::io(e, "error reply"));
        }
    };
    let head = Header {
        len: h.len,
        ..Header::new(FrameKind::ReadData, h.req_id)
    }
    .encode();
    match send_from(
        stream,
        &head,
        &region,
        adm.buffer_offset,
        h.len,
        Some(&adm.entry),
    )
    .await
    {
        Ok(()) => Ok(()),
        Err(Stop::Io(e)) => Err(Error::io(e, "sending read data")),
        // The header promised `len` bytes; closing is the only honest way to stop now.
        Err(Stop::Revoked(e, _)) => Err(e),
    }
}

// ---------- client: reaches peers' memory ----------

/// Reads a tcp endpoint's address from a descriptor (a socket address, as text).
pub fn endpoint_addr(peer: &SegmentDescriptor) -> Option<SocketAddr> {
    std::str::from_utf8(peer.endpoint(TransportKind::Tcp)?)
        .ok()?
        .parse()
        .ok()
}

impl TransportSetup for TcpConfig {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    /// Binds the listener (if `listen` is set).
    fn start(&self, engine: Admission) -> BoxFuture<'static, Result<Arc<dyn Transport>>> {
        let cfg = self.clone();
        Box::pin(async move {
            if cfg.max_payload < cfg.slice_size {
                return Err(Error::new(
                    ErrorKind::Resource,
                    format!(
                        "tcp max_payload {} < slice_size {}",
                        cfg.max_payload, cfg.slice_size
                    ),
                ));
            }
            let server = match cfg.listen {
                Some(addr) => Some(TcpServer::bind(addr, engine.clone(), cfg.clone()).await?),
                None => None,
            };
            Ok(Arc::new(TcpTransport {
                addr: server.as_ref().map(|s| s.addr),
                server: Mutex::new(server),
                local_name: engine.engine().to_owned(),
                live: engine.live().clone(),
                cfg,
            }) as Arc<dyn Transport>)
        })
    }
}

/// Serves this engine's memory to tcp peers (if it listens) and connects to peers that
/// publish a tcp endpoint.
pub struct TcpTransport {
    cfg: TcpConfig,
    local_name: String,
    live: Arc<Liveness>,
    addr: Option<SocketAddr>,
    server: Mutex<Option<TcpServer>>,
}

async fn dial(
    addr: SocketAddr,
    local_name: &str,
    cfg: &TcpConfig,
    live: &Arc<Liveness>,
) -> Result<Conn> {
    let stream = tokio::time::timeout(cfg.connect_timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::Unreachable,
                format!("connecting to {addr} timed out"),
            )
        })?
        .map_err(|e| {
            let e = Error::io(e, &format!("connecting to {addr}"));
            if e.kind() == ErrorKind::Io {
                Error::new(ErrorKind::Unreachable, e.detail())
            } else {
                e
            }
        })?;
    let _ = stream.set_nodelay(true);
    let body = local_name.as_bytes();
    let h = Header {
        body_len: body.len() as u32,
        ..Header::new(FrameKind::Hello, 0)
    };
    write_all(&stream, &[&h.encode(), body])
        .await
        .map_err(|e| Error::io(e, "hello"))?;
    Ok(Conn {
        stream,
        _counted: Counted::new(live),
    })
}

/// Asks the engine at `addr` for its descriptor (the peer-to-peer handshake).
async fn describe(
    addr: SocketAddr,
    local_name: &str,
    cfg: &TcpConfig,
    live: &Arc<Liveness>,
) -> Result<SegmentDescriptor> {
    let conn = dial(addr, local_name, cfg, live).await?;
    let s = &conn.stream;
    write_all(s, &[&Header::new(FrameKind::Describe, 1).encode()])
        .await
        .map_err(|e| Error::io(e, "describe"))?;
    let h = read_header(s, 0, Spin::Thread(Duration::ZERO)).await?;
    match h.kind {
        FrameKind::DescribeReply => {
            let body = read_body(s, &h, MAX_DESCRIPTOR_BODY).await?;
            SegmentDescriptor::from_bytes(&body)
        }
        FrameKind::Error => Err(frame::decode_error_body(
            &read_body(s, &h, MAX_SMALL_BODY).await?,
        )),
        k => Err(Error::new(
            ErrorKind::Malformed,
            format!("expected DescribeReply, got {k:?}"),
        )),
    }
    .map_err(|e| e.with_peer(addr.to_string()))
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn reaches(&self, peer: &SegmentDescriptor) -> bool {
        endpoint_addr(peer).is_some()
    }

    fn endpoint(&self) -> Option<Endpoint> {
        self.addr
            .map(|a| Endpoint::new(TransportKind::Tcp, a.to_string()))
    }

    fn describe(&self, addr: SocketAddr) -> Option<BoxFuture<'static, Result<SegmentDescriptor>>> {
        let (name, cfg, live) = (self.local_name.clone(), self.cfg.clone(), self.live.clone());
        Some(Box::pin(
            async move { describe(addr, &name, &cfg, &live).await },
        ))
    }

    fn shutdown(&self) {
        drop(self.server.lock().unwrap_or_else(|p| p.into_inner()).take());
    }

    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>> {
        let cfg = self.cfg.clone();
        let local_name = self.local_name.clone();
        let live = self.live.clone();
        Box::pin(async move {
            let addr = endpoint_addr(&peer).ok_or_else(|| {
                Error::new(ErrorKind::NoTransport, "peer has no tcp endpoint").with_peer(&peer.name)
            })?;
            // Connect once now, so an unreachable peer fails here and the log line names a
            // real local address.
            let first = dial(addr, &local_name, &cfg, &live)
                .await
                .map_err(|e| e.with_peer(&peer.name))?;
            let local = first
                .stream
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_default();
            Ok(Arc::new(TcpLink(Arc::new(LinkShared {
                addr,
                device: format!("{local}->{addr}"),
                peer: peer.name,
                local_name,
                slots: Semaphore::new(cfg.streams.max(1)),
                idle: Mutex::new(vec![first]),
                next_req: AtomicU64::new(1),
                cfg,
                live,
            }))) as Arc<dyn Link>)
        })
    }
}

struct TcpLink(Arc<LinkShared>);

struct LinkShared {
    addr: SocketAddr,
    device: String,
    peer: String,
    local_name: String,
    cfg: TcpConfig,
    /// Bounds connections (and so slices in flight) to this peer.
    slots: Semaphore,
    idle: Mutex<Vec<Conn>>,
    next_req: AtomicU64,
    live: Arc<Liveness>,
}

impl LinkShared {
    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn execute(&self, op: SliceOp) -> Result<()> {
        let _slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| Error::new(ErrorKind::EngineClosed, "link closed"))?;
        let pooled = self.idle().pop();
        let conn = match pooled {
            Some(c) => c,
            None => dial(self.addr, &self.local_name, &self.cfg, &self.live).await?,
        };
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        // If this future is dropped mid-slice, `conn` drops with it: a half-sent frame never
        // goes back into the pool.
        // Alone on the link and on its task, the reply is best awaited holding the thread;
        // with other slices in flight or waiting on this task to be sent ([`SliceOp::alone`]),
        // holding it would keep them from being sent and read meanwhile.
        let alone = op.alone && self.slots.available_permits() + 1 >= self.cfg.streams.max(1);
        match run_slice(&conn, req, &op, &self.cfg, alone).await {
            Ok(reply) => {
                self.idle().push(conn);
                reply
            }
            Err(e) => Err(e),
        }
    }
}

/// Longest an initiator polls for a write's reply through the owner's landing of it.
const MAX_LANDING_SPIN: Duration = Duration::from_millis(1);

/// Runs one slice on one connection. `Ok(Err(e))` is a clean refusal from the peer (the
/// connection is still in sync and can be reused); `Err(e)` means the connection is done.
async fn run_slice(
    c: &Conn,
    req: u64,
    op: &SliceOp,
    cfg: &TcpConfig,
    alone: bool,
) -> Result<Result<()>> {
    let s = &c.stream;
    let h = Header {
        buffer: op.grant.buffer,
        epoch: op.grant.epoch,
        token: op.grant.token,
        offset: op.grant_offset,
        len: op.len,
        ..Header::new(
            if op.kind == OpKind::Write {
                FrameKind::Write
            } else {
                FrameKind::Read
            },
            req,
        )
    }
    .encode();
    match op.kind {
        OpKind::Write => match send_from(s, &h, &op.local, op.local_offset, op.len, None).await {
            Ok(()) => {}
            Err(Stop::Io(e)) => return Err(Error::io(e, "sending payload")),
            Err(Stop::Revoked(e, _)) => return Err(e),
        },
        OpKind::Read => write_all(s, &[&h])
            .await
            .map_err(|e| Error::io(e, "sending read request"))?,
    }
    // A write's reply comes once the owner has read and landed the payload: poll through
    // that too (at a conservative 1 GB/s, the loopback copy rate measured here), or the
    // initiator parks and pays a wake-up per slice.
    let window = match op.kind {
        OpKind::Write => cfg.busy_poll + Duration::from_nanos(op.len).min(MAX_LANDING_SPIN),
        OpKind::Read => cfg.busy_poll,
    };
    let spin = if alone {
        Spin::Thread(window)
    } else {
        Spin::Task(window)
    };
    let r = read_header(s, cfg.max_payload.max(op.len), spin).await?;
    if r.req_id != req {
        return Err(Error::new(
            ErrorKind::Malformed,
            format!("reply for request {} while waiting for {req}", r.req_id),
        ));
    }
    match (op.kind, r.kind) {
        (OpKind::Write, FrameKind::WriteAck) => Ok(Ok(())),
        (OpKind::Read, FrameKind::ReadData) if r.len == op.len => {
            match recv_into(s, &op.local, op.local_offset, op.len, None, cfg.busy_poll).await {
                Ok(()) => Ok(Ok(())),
                Err(Stop::Io(e)) => Err(Error::io(e, "receiving read data")),
                Err(Stop::Revoked(e, _)) => Err(e),
            }
        }
        (_, FrameKind::Error) => Ok(Err(frame::decode_error_body(
            &read_body(s, &r, MAX_SMALL_BODY).await?,
        ))),
        (k, got) => Err(Error::new(
            ErrorKind::Malformed,
            format!("unexpected {got:?} (len {}) in reply to {k}", r.len),
        )),
    }
}

impl Link for TcpLink {
    fn info(&self) -> LinkInfo {
        LinkInfo {
            transport: TransportKind::Tcp,
            device: self.0.device.clone(),
        }
    }

    fn slicing(&self) -> Slicing {
        Slicing {
            slice_size: self.0.cfg.slice_size,
            in_flight: self.0.cfg.streams.max(1),
        }
    }

    fn drop_connections(&self) {
        self.0.idle().clear();
    }

    fn execute(&self, op: SliceOp) -> BoxFuture<'static, Result<()>> {
        let link = self.0.clone();
        Box::pin(async move { link.execute(op).await.map_err(|e| e.with_peer(&link.peer)) })
    }
}
