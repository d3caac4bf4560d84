//! A thin safe layer over libibverbs, through `sideway` (which loads libibverbs.so.1 at run time,
//! so a binary built with the `rdma` feature starts on machines without it).
//!
//! `sideway` owns the objects' lifetimes (device, protection domain, memory regions, completion
//! queue and channel, queue pairs, their state changes). What it does not wrap (memory windows,
//! posting bind / invalidate / one-sided work requests through one path, arming and reading the
//! completion channel) is called through its sys crate, `rdma-mummy-sys`, in [`raw`]: the only
//! unsafe code of the rdma transport.
//!
//! Every refusal is an [`Error`] naming the device, the port and the step that failed.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel};
use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair as _, QueuePairAttribute, QueuePairState, QueuePairType,
};

use crate::error::{Error, ErrorKind, Result};
use crate::idmap::IdMap;
use crate::memory::Region;
use crate::staging::Staged;

use super::keys::{Endpoint, mtu_bytes_valid};

/// How to run the rdma tests and tools where this machine has no RDMA device.
pub const HOW_TO_RUN: &str = "ci/softroce.sh runs them in a QEMU VM with soft-RoCE (rdma_rxe), e.g. \
     `cargo test -p omnirig-transports --features rdma --test rdma --no-run` then \
     `ci/softroce.sh run -- cargo test -p omnirig-transports --features rdma --test rdma`";

/// Names of the RDMA devices present. Distinguishes "libibverbs missing" from "no device".
pub fn device_names() -> Result<Vec<String>> {
    let list = DeviceList::new().map_err(|e| {
        let errno = match &e.0 {
            GetDeviceListErrorKind::Ibverbs(io) => io.raw_os_error(),
            #[allow(unreachable_patterns)]
            _ => None,
        };
        if errno == Some(libc::EOPNOTSUPP) {
            Error::new(
                ErrorKind::Unreachable,
                "rdma: libibverbs.so.1 not found (install libibverbs1 and ibverbs-providers)",
            )
        } else {
            Error::new(
                ErrorKind::Unreachable,
                format!(
                    "rdma: no RDMA device: ibv_get_device_list failed: {}",
                    chain(&e)
                ),
            )
        }
    })?;
    Ok(list.iter().map(|d| d.name()).collect())
}

/// An opened device with its protection domain. Everything this layer creates lives in this PD.
pub struct Device {
    name: String,
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
    max_qp_rd_atom: u8,
    max_mw: i32,
    max_qp_wr: u32,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("name", &self.name).finish()
    }
}

/// What the engine needs to know about a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    pub port: u8,
    pub active: bool,
    pub state: String,
    /// Active path MTU in bytes.
    pub mtu: u32,
    pub ethernet: bool,
    pub gid_table_len: u32,
}

impl Device {
    /// Opens the device called `name`, or the first device when `name` is `None`.
    pub fn open(name: Option<&str>) -> Result<Arc<Self>> {
        let names = device_names()?;
        if names.is_empty() {
            return Err(Error::new(
                ErrorKind::Unreachable,
                "rdma: no RDMA device (libibverbs found no HCA and no rxe/siw link)",
            ));
        }
        let list = DeviceList::new()
            .map_err(|e| Error::new(ErrorKind::Unreachable, format!("rdma: {}", chain(&e))))?;
        let dev = match name {
            Some(n) => list.iter().find(|d| d.name() == n).ok_or_else(|| {
                Error::new(
                    ErrorKind::Unreachable,
                    format!(
                        "rdma: no device named {n:?} (present: {})",
                        names.join(", ")
                    ),
                )
            })?,
            None => list.get(0).expect("the list is not empty"),
        };
        let dev_name = dev.name();
        let step = |s: &str, e: &dyn std::error::Error| {
            Error::new(
                ErrorKind::Resource,
                format!("rdma device {dev_name}: {s}: {}", chain(e)),
            )
        };
        let ctx = dev.open().map_err(|e| step("open", &e))?;
        let attr = ctx.query_device().map_err(|e| step("query device", &e))?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| step("allocate protection domain", &e))?;
        Ok(Arc::new(Self {
            name: dev_name.clone(),
            max_qp_rd_atom: attr.max_qp_rd_atom().clamp(1, 16) as u8,
            max_mw: attr.max_mw(),
            max_qp_wr: attr.max_qp_wr().max(1) as u32,
            ctx,
            pd,
        }))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many memory windows the device allows (0: it has none).
    pub fn max_memory_windows(&self) -> i32 {
        self.max_mw
    }

    fn err(&self, port: Option<u8>, step: &str, e: impl std::fmt::Display) -> Error {
        let at = match port {
            Some(p) => format!("rdma device {} port {p}", self.name),
            None => format!("rdma device {}", self.name),
        };
        Error::new(ErrorKind::Resource, format!("{at}: {step}: {e}"))
    }

    pub fn port(&self, port: u8) -> Result<PortInfo> {
        let a = self
            .ctx
            .query_port(port)
            .map_err(|e| self.err(Some(port), "query port", chain(&e)))?;
        Ok(PortInfo {
            port,
            active: a.port_state() == PortState::Active,
            state: format!("{:?}", a.port_state()),
            mtu: mtu_to_bytes(a.active_mtu()),
            ethernet: a.link_layer() == LinkLayer::Ethernet,
            gid_table_len: a.gid_tbl_len().max(0) as u32,
        })
    }

    pub fn gid(&self, port: u8, index: u32) -> Result<[u8; 16]> {
        let g = self
            .ctx
            .query_gid(port, index)
            .map_err(|e| self.err(Some(port), &format!("query GID {index}"), chain(&e)))?;
        Ok(g.raw)
    }

    /// The first RoCEv2 GID holding an IPv4 address (::ffff:a.b.c.d): what RoCE peers on an
    /// IPv4 network route with. On InfiniBand (no RoCE), the first non-zero GID.
    pub fn default_gid_index(&self, port: u8) -> Result<u32> {
        let info = self.port(port)?;
        for i in 0..info.gid_table_len {
            let Ok(g) = self.gid(port, i) else { continue };
            if g == [0; 16] {
                continue;
            }
            if !info.ethernet {
                return Ok(i);
            }
            let v4 = g[..10] == [0; 10] && g[10] == 0xff && g[11] == 0xff;
            // sysfs GID type 1 is RoCE v2
            let v2 = self
                .ctx
                .query_gid_type(port, i)
                .map(|t| t == 1)
                .unwrap_or(false);
            if v4 && v2 {
                return Ok(i);
            }
        }
        Err(self.err(
            Some(port),
            "choose a GID",
            "no RoCEv2 IPv4 GID (is an IPv4 address set on the port's netdev?)",
        ))
    }

    /// Registers `len` bytes of `region` from `offset` for remote `access` (plus local write,
    /// which READ needs to land data, and window binding).
    pub fn register(
        &self,
        region: &Arc<Region>,
        offset: u64,
        len: u64,
        access: RemoteAccess,
    ) -> Result<MemoryRegistration> {
        let (off, n) = region.check(offset, len)?;
        if n == 0 {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                "rdma: cannot register an empty range",
            ));
        }
        let mut flags = AccessFlags::LocalWrite | AccessFlags::MemoryWindowBind;
        flags |= access.flags();
        if region.is_device() {
            return self.register_dmabuf(region, offset, len, flags);
        }
        // SAFETY: region.check proved off..off+n lies inside the region, and the registration
        // holds an Arc of the region, so the memory outlives the MR (deregistered on drop).
        let mr = unsafe { self.pd.reg_mr(region.addr() + off, n, flags) }
            .map_err(|e| self.err(None, &format!("register {n} bytes"), chain(&e)))?;
        Ok(MemoryRegistration {
            mr,
            memory: Kept::Region(region.clone()),
            offset,
            len,
        })
    }

    /// GPUDirect RDMA: registers `offset..offset+len` of GPU memory through a dma-buf its
    /// device exports, so the HCA reads and writes the GPU's memory itself. Peers name device
    /// addresses (the MR's iova is the range's device address), exactly as they name host
    /// addresses of host memory. A refusal names the step: the export (the GPU or its driver
    /// cannot) or `ibv_reg_dmabuf_mr` (the HCA, its driver, the kernel or rdma-core cannot;
    /// rdma-core before 34 has no such call and answers EOPNOTSUPP).
    fn register_dmabuf(
        &self,
        region: &Arc<Region>,
        offset: u64,
        len: u64,
        flags: AccessFlags,
    ) -> Result<MemoryRegistration> {
        let (off, n) = region.check(offset, len)?;
        let (fd, at) = region.export_dmabuf(offset, len).map_err(|e| {
            self.err(
                None,
                &format!("export {n} bytes of GPU memory as a dma-buf"),
                e.detail(),
            )
        })?;
        let iova = (region.addr() + off) as u64;
        // SAFETY: fd is a live dma-buf of the GPU pages around off..off+n, and at..at+n is the
        // range inside it (export_dmabuf). The kernel takes its own reference to the dma-buf
        // for the MR, so closing fd after this call is fine, and the registration holds an Arc
        // of the region, so the device allocation outlives the MR (deregistered on drop).
        let mr =
            unsafe { self.pd.reg_dmabuf_mr(at, n, iova, fd.as_raw_fd(), flags) }.map_err(|e| {
                self.err(
                    None,
                    &format!("ibv_reg_dmabuf_mr of {n} bytes of GPU memory"),
                    chain(&e),
                )
            })?;
        Ok(MemoryRegistration {
            mr,
            memory: Kept::Region(region.clone()),
            offset,
            len,
        })
    }

    /// Registers a lent staging buffer's first `len` bytes for local use (the source of a
    /// staged write, the landing of a staged read). The registration owns the buffer: it goes
    /// back to its pool only after the MR is deregistered.
    pub fn register_staged(&self, staged: Staged, len: u64) -> Result<MemoryRegistration> {
        let (_, n) = staged.region().check(0, len)?;
        if n == 0 || staged.region().is_device() {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                "rdma: a staging buffer is non-empty host memory",
            ));
        }
        let flags = AccessFlags::LocalWrite;
        // SAFETY: 0..n lies inside the buffer (checked), host memory that stays allocated while
        // the registration holds the `Staged` guard (dropped after the MR: field order).
        let mr = unsafe { self.pd.reg_mr(staged.region().addr(), n, flags) }.map_err(|e| {
            self.err(
                None,
                &format!("register a {n} byte staging buffer"),
                chain(&e),
            )
        })?;
        Ok(MemoryRegistration {
            mr,
            memory: Kept::Staged(staged),
            offset: 0,
            len,
        })
    }

    /// Allocates a type 2 memory window (bound later, per grant, through a queue pair).
    pub fn alloc_window(self: &Arc<Self>) -> Result<MemoryWindow> {
        raw::alloc_mw(&self.pd)
            .map(|mw| MemoryWindow {
                mw,
                _device: self.clone(),
            })
            .map_err(|e| self.err(None, "allocate a type 2 memory window", e))
    }
}

/// What a peer may do with registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteAccess {
    Write,
    Read,
    ReadWrite,
}

impl RemoteAccess {
    fn flags(self) -> AccessFlags {
        match self {
            RemoteAccess::Write => AccessFlags::RemoteWrite,
            RemoteAccess::Read => AccessFlags::RemoteRead,
            RemoteAccess::ReadWrite => AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
        }
    }
}

fn mtu_to_bytes(m: Mtu) -> u32 {
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

fn mtu_from_bytes(b: u32) -> Mtu {
    match b {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// A memory region over part of an engine [`Region`] or over a staging buffer; holds the
/// memory alive (declared after `mr`, so it is released after the MR is deregistered).
pub struct MemoryRegistration {
    mr: Arc<MemoryRegion>,
    memory: Kept,
    offset: u64,
    len: u64,
}

/// The memory a registration keeps alive.
enum Kept {
    Region(Arc<Region>),
    Staged(Staged),
}

impl std::fmt::Debug for MemoryRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegistration")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl MemoryRegistration {
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    /// The address a peer names to reach the registration's first byte.
    pub fn addr(&self) -> u64 {
        self.mr.get_ptr() as u64
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The region's offset of the registration's first byte.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// The engine region registered (`None` for a staging buffer).
    pub fn region(&self) -> Option<&Arc<Region>> {
        match &self.memory {
            Kept::Region(r) => Some(r),
            Kept::Staged(_) => None,
        }
    }
    /// Checks `local_offset..+len` (from the registration's first byte) lies inside the
    /// memory it keeps.
    fn check(&self, local_offset: u64, len: u64) -> Result<()> {
        let at = self
            .offset
            .checked_add(local_offset)
            .ok_or_else(|| Error::new(ErrorKind::OutOfBuffer, "rdma: local offset overflows"))?;
        match &self.memory {
            Kept::Region(r) => r.check(at, len).map(|_| ()),
            Kept::Staged(s) => s.region().check(at, len).map(|_| ()),
        }
    }
    /// Whether this registers (part of) `region` itself.
    pub fn is_over(&self, region: &Arc<Region>) -> bool {
        self.region().is_some_and(|r| Arc::ptr_eq(r, region))
    }
    /// The staging buffer registered, if this is one.
    pub fn staged(&self) -> Option<&Region> {
        match &self.memory {
            Kept::Region(_) => None,
            Kept::Staged(s) => Some(s.region()),
        }
    }
}

/// A type 2 memory window: an rkey over a sub-range of a registration, bound and invalidated
/// through one queue pair (and only usable by that queue pair's peer).
pub struct MemoryWindow {
    mw: raw::Mw,
    _device: Arc<Device>,
}

impl MemoryWindow {
    pub fn rkey(&self) -> u32 {
        self.mw.rkey()
    }
}

/// One completed work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
}

impl Completion {
    pub fn ok(&self) -> bool {
        self.status == 0
    }
    pub fn status_name(&self) -> &'static str {
        status_name(self.status)
    }
}

/// The verbs name of a work completion status.
pub fn status_name(status: u32) -> &'static str {
    const NAMES: [&str; 24] = [
        "IBV_WC_SUCCESS",
        "IBV_WC_LOC_LEN_ERR",
        "IBV_WC_LOC_QP_OP_ERR",
        "IBV_WC_LOC_EEC_OP_ERR",
        "IBV_WC_LOC_PROT_ERR",
        "IBV_WC_WR_FLUSH_ERR",
        "IBV_WC_MW_BIND_ERR",
        "IBV_WC_BAD_RESP_ERR",
        "IBV_WC_LOC_ACCESS_ERR",
        "IBV_WC_REM_INV_REQ_ERR",
        "IBV_WC_REM_ACCESS_ERR",
        "IBV_WC_REM_OP_ERR",
        "IBV_WC_RETRY_EXC_ERR",
        "IBV_WC_RNR_RETRY_EXC_ERR",
        "IBV_WC_LOC_RDD_VIOL_ERR",
        "IBV_WC_REM_INV_RD_REQ_ERR",
        "IBV_WC_REM_ABORT_ERR",
        "IBV_WC_INV_EECN_ERR",
        "IBV_WC_INV_EEC_STATE_ERR",
        "IBV_WC_FATAL_ERR",
        "IBV_WC_RESP_TIMEOUT_ERR",
        "IBV_WC_GENERAL_ERR",
        "IBV_WC_TM_ERR",
        "IBV_WC_TM_RNDV_INCOMPLETE",
    ];
    NAMES
        .get(status as usize)
        .copied()
        .unwrap_or("IBV_WC_(unknown)")
}

/// The status codes the fence and failure handling look for.
pub mod wc {
    pub const SUCCESS: u32 = 0;
    pub const WR_FLUSH_ERR: u32 = 5;
    pub const MW_BIND_ERR: u32 = 6;
    pub const REM_ACCESS_ERR: u32 = 10;
    pub const RETRY_EXC_ERR: u32 = 12;
}

/// The engine's error for a failed work completion: the verbs status is always in the detail.
pub fn completion_error(c: &Completion, what: &str) -> Error {
    let kind = match c.status {
        wc::REM_ACCESS_ERR => ErrorKind::AccessDenied,
        wc::RETRY_EXC_ERR | 13 | 20 => ErrorKind::PeerDisconnected,
        wc::WR_FLUSH_ERR => ErrorKind::Canceled,
        _ => ErrorKind::Io,
    };
    Error::new(
        kind,
        format!(
            "rdma: {what} failed with {} (status {}, vendor error {:#x})",
            c.status_name(),
            c.status,
            c.vendor_err
        ),
    )
}

/// A completion queue with its completion channel: polled in a short spin, then parked on the
/// channel's file descriptor so an idle waiter burns no CPU.
pub struct CompletionQueue {
    /// The channel's fd registered with the tokio reactor of the first async waiter (declared
    /// first: dropped, and so deregistered, while the channel is still open).
    reactor: Mutex<Option<Arc<AsyncFd<ChannelFd>>>>,
    cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    device: Arc<Device>,
    /// Events read from the channel and not yet acknowledged (a CQ with unacknowledged events
    /// cannot be destroyed); acknowledged in batches and on drop.
    unacked: AtomicU32,
    /// How long `wait` spins before it parks.
    spin: Duration,
    lock: Mutex<()>,
}

impl CompletionQueue {
    /// A CQ of `depth` entries whose waiters spin for `spin` before parking on the channel.
    pub fn new(device: &Arc<Device>, depth: u32, spin: Duration) -> Result<Arc<Self>> {
        let channel = device
            .ctx
            .create_comp_channel()
            .map_err(|e| device.err(None, "create completion channel", chain(&e)))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| device.err(None, "make the completion channel non-blocking", e))?;
        let mut b = device.ctx.create_cq_builder();
        b.setup_cqe(depth.max(1)).setup_comp_channel(&channel, 0);
        let cq = b
            .build()
            .map_err(|e| device.err(None, &format!("create a {depth}-entry CQ"), chain(&e)))?;
        Ok(Arc::new(Self {
            reactor: Mutex::new(None),
            cq,
            channel,
            device: device.clone(),
            unacked: AtomicU32::new(0),
            spin,
            lock: Mutex::new(()),
        }))
    }

    /// Appends every completion ready now to `out`; returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>) -> usize {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let before = out.len();
        while raw::poll_cq(&self.cq, out) > 0 {}
        out.len() - before
    }

    /// Polls until at least one completion arrives or `deadline` passes: a short spin, then
    /// arm the channel and sleep on its fd. Returns how many completions were appended.
    pub fn wait(&self, out: &mut Vec<Completion>, deadline: Instant) -> Result<usize> {
        let spin_until = Instant::now() + self.spin;
        loop {
            let n = self.poll(out);
            if n > 0 {
                return Ok(n);
            }
            if Instant::now() >= spin_until {
                break;
            }
            std::hint::spin_loop();
        }
        loop {
            // Arm, then poll once more: a completion that landed between the last poll and the
            // arming raises no event.
            raw::req_notify_cq(&self.cq)
                .map_err(|e| self.device.err(None, "arm the completion channel", e))?;
            let n = self.poll(out);
            if n > 0 {
                return Ok(n);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(0);
            }
            let left = (deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32;
            let mut pfd = libc::pollfd {
                fd: self.channel.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: pfd is one valid pollfd on the stack for the duration of the call.
            let r = unsafe { libc::poll(&mut pfd, 1, left) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(self.device.err(None, "wait on the completion channel", e));
                }
            }
            if r > 0 && raw::get_cq_event(&self.channel) {
                self.note_event();
            }
        }
    }

    /// Counts one event read from the channel; acknowledges them 64 at a time.
    fn note_event(&self) {
        let n = self.unacked.fetch_add(1, Ordering::AcqRel) + 1;
        if n >= 64 {
            self.unacked.fetch_sub(n, Ordering::AcqRel);
            raw::ack_cq_events(&self.cq, n);
        }
    }

    /// Reads every event waiting on the (non-blocking) channel.
    fn take_events(&self) {
        while raw::get_cq_event(&self.channel) {
            self.note_event();
        }
    }

    /// The channel's fd in the current tokio runtime's reactor, registered on first use;
    /// `None` outside a runtime or where the runtime has no I/O driver (callers then wait on a
    /// blocking thread instead).
    fn reactor(&self) -> Option<Arc<AsyncFd<ChannelFd>>> {
        let mut g = self.reactor.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = g.as_ref() {
            return Some(a.clone());
        }
        tokio::runtime::Handle::try_current().ok()?;
        let fd = ChannelFd(self.channel.clone());
        // tokio panics (rather than failing) in a runtime built without I/O
        let a = std::panic::catch_unwind(|| raw::register_channel(fd))
            .ok()?
            .ok()?;
        let a = Arc::new(a);
        *g = Some(a.clone());
        Some(a)
    }
}

/// A completion channel's fd as the tokio reactor sees it; holding the channel keeps the fd
/// open as long as the registration lives.
struct ChannelFd(Arc<CompletionChannel>);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        let n = self.unacked.swap(0, Ordering::AcqRel);
        if n > 0 {
            raw::ack_cq_events(&self.cq, n);
        }
    }
}

/// How long a completion wait spins before it parks on the completion channel.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// One one-sided operation for [`QueuePair::run`].
#[derive(Debug, Clone)]
pub struct RemoteOp {
    pub write: bool,
    pub local: Arc<MemoryRegistration>,
    /// Offset within `local`.
    pub local_offset: u64,
    pub len: u32,
    pub remote_addr: u64,
    pub rkey: u32,
}

/// A reliable-connected queue pair with its own completion queue.
///
/// Several [`Run`]s may be under way on one queue pair at once (their work requests interleave
/// on the send queue, at most `max_outstanding` posted in all). Each run owns a [`Slot`]: the
/// upper 32 bits of a work request id name the slot, the lower its operation. One waiter at a
/// time polls the completion queue (a short spin, then parked on the channel) and routes what
/// it reaped to the slots, waking only their owners; the others sleep on their own slot. On
/// leaving, the poller wakes one of them to take its place.
pub struct QueuePair {
    qp: Mutex<BasicQueuePair>,
    cq: Arc<CompletionQueue>,
    device: Arc<Device>,
    port: u8,
    psn: u32,
    /// Work requests posted and not yet completed never exceed this.
    max_outstanding: u32,
    /// Send queue entries in use: posted, completion not yet reaped.
    posted: AtomicU32,
    /// The ids of the work requests on the send queue, in the order they were posted (pushed
    /// under the `qp` lock). Only the last of a chain is signaled; a send queue completes in
    /// order, so a completion frees its own entry and every one before it.
    on_queue: Mutex<std::collections::VecDeque<u64>>,
    /// A test's hook: the request at this index of the next chains is refused by the provider
    /// ([`refuse_in_chains_at`](Self::refuse_in_chains_at)).
    refuse_at: std::sync::atomic::AtomicUsize,
    next_slot: AtomicU32,
    slots: Mutex<IdMap<u32, Arc<Slot>>>,
    /// Held by the one waiter polling the completion queue.
    poller: Mutex<()>,
}

/// Completions routed to one run (or one bind / invalidate) and not yet taken by it, and how
/// its owner sleeps until there are some.
#[derive(Default)]
struct Slot {
    inbox: Mutex<Inbox>,
    ready: Condvar,
    /// Wakes an owner waiting as a task ([`QueuePair::wait_async`]); a notification sent while
    /// it is not waiting is kept for its next wait.
    notify: tokio::sync::Notify,
    /// What its owner sleeps for: [`NOT_WAITING`], [`FOR_COMPLETIONS`] or [`FOR_ENTRIES`].
    waiting: AtomicU8,
}

#[derive(Default)]
struct Inbox {
    done: Vec<Completion>,
    /// Set by whoever wakes the owner for something other than completions (free send queue
    /// entries, or the poller's place being free), so a wake-up that comes between the owner's
    /// check and its sleep is not lost.
    kick: bool,
}

const NOT_WAITING: u8 = 0;
/// The owner has requests posted and waits for their completions.
const FOR_COMPLETIONS: u8 = 1;
/// The owner has nothing posted and waits for a free send queue entry.
const FOR_ENTRIES: u8 = 2;

impl Slot {
    fn inbox(&self) -> std::sync::MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take(&self, out: &mut Vec<Completion>) {
        let mut inbox = self.inbox();
        if out.is_empty() {
            // hand over the inbox's allocation instead of copying into a second one
            std::mem::swap(out, &mut inbox.done);
        } else {
            out.append(&mut inbox.done);
        }
    }

    fn is_empty(&self) -> bool {
        self.inbox().done.is_empty()
    }

    fn kick(&self) {
        self.inbox().kick = true;
        self.ready.notify_one();
        self.notify.notify_one();
    }
}

/// The slot a work request id names, and the operation's index within it.
fn split_wr_id(wr_id: u64) -> (u32, u32) {
    ((wr_id >> 32) as u32, wr_id as u32 & !MARKER)
}

/// Set in a work request id's operation index: a signaled copy of that operation posted after
/// its queue pair went to ERROR, so its completion (flushed) says the device is done with
/// every request before it ([`QueuePair::post_chain`]). Its own id, so it frees its own send
/// queue entry.
const MARKER: u32 = 1 << 31;

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("device", &self.device.name)
            .field("port", &self.port)
            .field("qpn", &self.qpn())
            .finish()
    }
}

impl QueuePair {
    /// Creates an RC queue pair on `port` in RESET, with at most `max_outstanding` send work
    /// requests in flight.
    pub fn create(device: &Arc<Device>, port: u8, max_outstanding: u32) -> Result<Arc<Self>> {
        Self::create_with_spin(device, port, max_outstanding, DEFAULT_SPIN)
    }

    /// [`create`](Self::create), with completion waits that spin for `spin` before parking.
    pub fn create_with_spin(
        device: &Arc<Device>,
        port: u8,
        max_outstanding: u32,
        spin: Duration,
    ) -> Result<Arc<Self>> {
        let max_outstanding = max_outstanding.clamp(1, device.max_qp_wr);
        let cq = CompletionQueue::new(device, max_outstanding * 2, spin)?;
        let mut b = device.pd.create_qp_builder();
        b.setup_qp_type(QueuePairType::ReliableConnection)
            .setup_max_send_wr(max_outstanding)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_cq(cq.cq.clone())
            .setup_recv_cq(cq.cq.clone());
        let qp = b
            .build()
            .map_err(|e| device.err(Some(port), "create RC queue pair", chain(&e)))?;
        let mut psn = [0u8; 4];
        getrandom::fill(&mut psn).map_err(|e| device.err(Some(port), "draw a PSN", e))?;
        Ok(Arc::new(Self {
            qp: Mutex::new(qp),
            cq,
            device: device.clone(),
            port,
            psn: u32::from_le_bytes(psn) & 0x00ff_ffff,
            max_outstanding,
            posted: AtomicU32::new(0),
            on_queue: Mutex::new(std::collections::VecDeque::with_capacity(
                max_outstanding as usize,
            )),
            refuse_at: std::sync::atomic::AtomicUsize::new(usize::MAX),
            next_slot: AtomicU32::new(1),
            slots: Mutex::new(IdMap::default()),
            poller: Mutex::new(()),
        }))
    }

    /// Send queue entries in use: requests posted whose completion (their own, or a later
    /// one's) was not reaped yet. Zero once every run on the queue pair finished.
    pub fn in_flight(&self) -> u32 {
        self.posted.load(Ordering::Acquire)
    }

    /// For tests: from now on the provider refuses the request at `index` of every chain
    /// posted here (`None`: none), so a chain is taken only in part, as a real refusal would.
    #[doc(hidden)]
    pub fn refuse_in_chains_at(&self, index: Option<usize>) {
        self.refuse_at
            .store(index.unwrap_or(usize::MAX), Ordering::Relaxed);
    }

    pub fn qpn(&self) -> u32 {
        self.qp
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .qp_number()
    }

    pub fn state(&self) -> QueuePairState {
        self.qp.lock().unwrap_or_else(|p| p.into_inner()).state()
    }

    /// The (local ACK timeout exponent, retry count, RNR retry count) the device holds for
    /// this queue pair, as `ibv_query_qp` reports them.
    pub fn retry_attributes(&self) -> Result<(u8, u8, u8)> {
        use sideway::ibverbs::queue_pair::QueuePairAttributeMask as M;
        let qp = self.qp.lock().unwrap_or_else(|p| p.into_inner());
        let (a, _) = qp
            .query(M::Timeout | M::RetryCount | M::ResponderNotReadyRetryCount)
            .map_err(|e| {
                self.device
                    .err(Some(self.port), "query queue pair", chain(&e))
            })?;
        Ok((a.timeout(), a.retry_cnt(), a.rnr_retry()))
    }

    /// Whether the queue pair is in ERROR (after a failure or a timeout): reconnect to use the
    /// peer again.
    pub fn is_error(&self) -> bool {
        self.state() == QueuePairState::Error
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    pub fn port(&self) -> u8 {
        self.port
    }

    pub fn max_outstanding(&self) -> u32 {
        self.max_outstanding
    }

    /// What the peer needs to connect to this queue pair.
    pub fn endpoint(&self, gid_index: u32) -> Result<Endpoint> {
        let info = self.device.port(self.port)?;
        if !info.active {
            return Err(self.device.err(
                Some(self.port),
                "check port state",
                format!("port is {}, not active", info.state),
            ));
        }
        Ok(Endpoint {
            device: self.device.name.clone(),
            port: self.port,
            qpn: self.qpn(),
            psn: self.psn,
            gid: self.device.gid(self.port, gid_index)?,
            gid_index: gid_index as u8,
            mtu: info.mtu,
        })
    }

    /// RESET -> INIT -> RTR -> RTS towards `remote`, sending from local GID `gid_index`. The
    /// path MTU is the smaller of both ends'.
    pub fn connect(&self, remote: &Endpoint, gid_index: u32) -> Result<()> {
        remote.validate()?;
        let local = self.endpoint(gid_index)?;
        let mtu = local.mtu.min(remote.mtu);
        debug_assert!(mtu_bytes_valid(mtu));
        let mut qp = self.qp.lock().unwrap_or_else(|p| p.into_inner());
        let step = |s: &str, e: &dyn std::error::Error| {
            self.device.err(
                Some(self.port),
                &format!(
                    "queue pair {} {s} (peer {} qpn {} gid index {})",
                    local.qpn, remote.device, remote.qpn, remote.gid_index
                ),
                chain(e),
            )
        };
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(self.port)
            .setup_access_flags(
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            );
        qp.modify(&a).map_err(|e| step("RESET->INIT", &e))?;

        let mut av = AddressHandleAttribute::new();
        av.setup_port(self.port)
            .setup_grh(&Gid { raw: remote.gid }, 0, gid_index as u8, 64, 0);
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu_from_bytes(mtu))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(self.device.max_qp_rd_atom)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&av);
        qp.modify(&a).map_err(|e| step("INIT->RTR", &e))?;

        let mut a = QueuePairAttribute::new();
        // timeout 14: 4.096 us * 2^14 = 67 ms per try; 7 retries: a dead peer fails in ~0.5 s.
        a.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(self.device.max_qp_rd_atom);
        qp.modify(&a).map_err(|e| step("RTR->RTS", &e))?;
        Ok(())
    }

    /// Moves the queue pair to ERROR: outstanding work requests complete as flushed, and the
    /// device will neither read nor write any memory through it again.
    pub fn set_error(&self) -> Result<()> {
        let mut qp = self.qp.lock().unwrap_or_else(|p| p.into_inner());
        self.set_error_locked(&mut qp)
    }

    fn set_error_locked(&self, qp: &mut BasicQueuePair) -> Result<()> {
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Error);
        qp.modify(&a).map_err(|e| {
            self.device.err(
                Some(self.port),
                &format!("queue pair {} ->ERROR", qp.qp_number()),
                chain(&e),
            )
        })
    }

    fn post(&self, wr: raw::SendWr) -> Result<()> {
        let qp = self.qp.lock().unwrap_or_else(|p| p.into_inner());
        // queued before the post: on rxe the request may complete (and be routed) before
        // ibv_post_send returns
        self.queued().push_back(wr.wr_id());
        raw::post_send(&qp, wr).map_err(|e| {
            // the last one queued: no one else posts while the queue pair is locked
            self.queued().pop_back();
            self.device.err(
                Some(self.port),
                &format!("post {} on queue pair {}", wr.what(), qp.qp_number()),
                e,
            )
        })
    }

    fn queued(&self) -> std::sync::MutexGuard<'_, std::collections::VecDeque<u64>> {
        self.on_queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes one send queue entry, if one is free.
    fn reserve(&self) -> bool {
        self.posted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_outstanding).then_some(n + 1)
            })
            .is_ok()
    }

    /// Takes up to `want` free send queue entries; returns how many it took.
    fn reserve_up_to(&self, want: u32) -> u32 {
        let mut took = 0;
        let _ = self
            .posted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                took = want.min(self.max_outstanding.saturating_sub(n));
                (took > 0).then_some(n + took)
            });
        took
    }

    /// Posts a chain of requests on entries taken with [`reserve_up_to`](Self::reserve_up_to)
    /// (one doorbell); gives back the entries of those the device did not take. Returns how
    /// many it took, and the refusal if it did not take them all.
    fn post_chain(&self, wrs: &[raw::RdmaWr]) -> (usize, Result<()>) {
        let mut qp = self.qp.lock().unwrap_or_else(|p| p.into_inner());
        // under the queue pair's lock, so this order is the send queue's; queued before the
        // post, as in `post`
        let n = wrs.len().min(raw::CHAIN);
        self.queued().extend(wrs[..n].iter().map(|w| w.wr_id));
        let refuse_at = self.refuse_at.load(Ordering::Relaxed);
        let (taken, r) = raw::post_rdma_chain(&qp, &wrs[..n], refuse_at);
        let mut unused = wrs.len() - taken;
        if taken < n {
            // the ones the device did not take are the last queued, and no completion names
            // them
            let mut q = self.queued();
            let keep = q.len() - (n - taken);
            q.truncate(keep);
        }
        if taken > 0 && taken < n && !signal_all() {
            // The last request taken is not signaled: if it succeeds, nothing would ever say
            // so, and a drain could not tell when the device is done with its memory. So,
            // with the queue pair in ERROR (the run fails anyway), the same request goes once
            // more, signaled, on one of the entries given back: it is flushed, never executed,
            // and its completion comes after every request before it.
            let last = raw::RdmaWr {
                wr_id: wrs[taken - 1].wr_id | MARKER as u64,
                ..wrs[taken - 1]
            };
            let marked = self.set_error_locked(&mut qp).is_ok() && {
                self.queued().push_back(last.wr_id);
                let (m, _) = raw::post_rdma_chain(&qp, &[last], usize::MAX);
                if m == 0 {
                    self.queued().pop_back();
                }
                m == 1
            };
            if marked {
                unused -= 1;
            } else {
                tracing::error!(
                    "rdma: queue pair {}: a chain was refused at #{taken} and no marker could \
                     follow it; its drain waits for its bound",
                    qp.qp_number()
                );
            }
        }
        if unused > 0 {
            self.posted.fetch_sub(unused as u32, Ordering::AcqRel);
        }
        let r = r.map_err(|e| {
            self.device.err(
                Some(self.port),
                &format!(
                    "post {} chained work requests (refused at #{taken}) on queue pair {}",
                    wrs.len(),
                    qp.qp_number()
                ),
                e,
            )
        });
        (taken, r)
    }

    /// Posts `wr` on an entry taken with [`reserve`](Self::reserve); gives the entry back if
    /// the device refused the request.
    fn post_reserved(&self, wr: raw::SendWr) -> Result<()> {
        self.post(wr).inspect_err(|_| {
            self.posted.fetch_sub(1, Ordering::AcqRel);
        })
    }

    fn open_slot(&self) -> (u32, Arc<Slot>) {
        let slot = Arc::new(Slot::default());
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let id = loop {
            let id = self.next_slot.fetch_add(1, Ordering::Relaxed);
            if id != 0 && !slots.contains_key(&id) {
                break id;
            }
        };
        slots.insert(id, slot.clone());
        (id, slot)
    }

    fn close_slot(&self, id: u32) {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
    }

    /// Waits until completions were routed to `slot`, `until` passed, or (`want` is
    /// [`FOR_ENTRIES`]) send queue entries were freed: polls the completion queue itself when
    /// no one else does, else sleeps until the poller hands it something or its place (at most
    /// 1 ms at a time).
    fn wait_progress(&self, slot: &Slot, until: Instant, want: u8) -> Result<()> {
        // announced before trying the poller's place: a poller leaving now sees it
        if self.announce(slot, want) {
            return Ok(());
        }
        let poller = match self.poller.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        if let Some(g) = poller {
            slot.waiting.store(NOT_WAITING, Ordering::Release);
            let mut got = Vec::new();
            let r = if slot.is_empty() {
                self.cq.wait(&mut got, until)
            } else {
                Ok(self.cq.poll(&mut got))
            };
            self.route(&got);
            drop(g);
            // someone else polls while this one deals with what it got
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(next) = slots
                .values()
                .find(|s| s.waiting.load(Ordering::Acquire) != NOT_WAITING)
            {
                next.kick();
            }
            return r.map(|_| ());
        }
        let mut inbox = slot.inbox();
        if inbox.done.is_empty() && !inbox.kick {
            let left = until
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(1));
            inbox = slot
                .ready
                .wait_timeout(inbox, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        inbox.kick = false;
        drop(inbox);
        slot.waiting.store(NOT_WAITING, Ordering::Release);
        Ok(())
    }

    /// Says what `slot`'s owner is about to sleep for. `true`: it need not sleep, because it
    /// waits for send queue entries and some are free already: `route` frees entries before
    /// it looks for owners waiting for them, so one that freed them just before this
    /// announcement did not kick this owner (before this check such an owner slept until its
    /// next peer check, 50 ms, a whole batch's time at 64 KiB).
    fn announce(&self, slot: &Slot, want: u8) -> bool {
        slot.waiting.store(want, Ordering::SeqCst);
        if want == FOR_ENTRIES && self.posted.load(Ordering::SeqCst) < self.max_outstanding {
            slot.waiting.store(NOT_WAITING, Ordering::Release);
            return true;
        }
        false
    }

    /// [`wait_progress`](Self::wait_progress) for a task, with no thread of its own: arms the
    /// completion channel, reaps and routes what is there, then waits (as a task) until
    /// something is routed to `slot`, the channel's fd is readable (then reaps again on the
    /// next call), or `until`. Any number of tasks wait at once; whichever wakes first reaps
    /// for all. `Ok(false)`: no tokio reactor to wait on (wait on a blocking thread instead).
    async fn wait_async(&self, slot: &Slot, until: Instant, want: u8) -> Result<bool> {
        let Some(fd) = self.cq.reactor() else {
            return Ok(false);
        };
        // enabled before reaping: a completion routed from here on is not missed
        let notified = slot.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.announce(slot, want) {
            return Ok(true);
        }
        // armed before polling: a completion after the poll raises an event on the fd
        raw::req_notify_cq(&self.cq.cq)
            .map_err(|e| self.device.err(None, "arm the completion channel", e))?;
        let mut got = Vec::new();
        self.cq.poll(&mut got);
        self.route(&got);
        if !got.is_empty() || !slot.is_empty() {
            slot.waiting.store(NOT_WAITING, Ordering::Release);
            return Ok(true);
        }
        let r = tokio::time::timeout_at(until.into(), async {
            tokio::select! {
                _ = &mut notified => Ok(()),
                g = fd.readable() => g.map(|mut g| {
                    self.cq.take_events();
                    // the next call arms and polls again before waiting: nothing is lost
                    g.clear_ready();
                }),
            }
        })
        .await;
        slot.waiting.store(NOT_WAITING, Ordering::Release);
        match r {
            Ok(Err(_)) => Ok(false), // the reactor went away (its runtime ended)
            _ => Ok(true),
        }
    }

    /// Hands reaped completions to the slots their ids name, waking their owners, and frees
    /// their send queue entries, waking owners waiting for one. Only a chain's last request is
    /// signaled (a failed or flushed one completes whether signaled or not), and a send queue
    /// completes in order: a completion frees its entry and every entry posted before it.
    fn route(&self, got: &[Completion]) {
        if got.is_empty() {
            return;
        }
        let mut freed = 0u32;
        {
            let mut q = self.queued();
            for c in got {
                if let Some(at) = q.iter().position(|&id| id == c.wr_id) {
                    q.drain(..=at);
                    freed += at as u32 + 1;
                }
            }
        }
        // SeqCst, then the waiters' flags (SeqCst): pairs with `announce`'s store, then load
        let _ = self
            .posted
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some(n.saturating_sub(freed))
            });
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let mut woken: Vec<u32> = Vec::new();
        for c in got {
            let id = split_wr_id(c.wr_id).0;
            if let Some(s) = slots.get(&id) {
                s.inbox().done.push(*c);
                if !woken.contains(&id) {
                    woken.push(id);
                }
            }
        }
        // only owners asleep on their slot need waking (a notify is a syscall)
        for id in &woken {
            let s = &slots[id];
            if s.waiting.load(Ordering::Acquire) != NOT_WAITING {
                s.ready.notify_one();
            }
            // no syscall: wakes a task waiting on it, else is kept for its next wait
            s.notify.notify_one();
        }
        for s in slots.values() {
            if s.waiting.load(Ordering::SeqCst) == FOR_ENTRIES {
                s.kick();
            }
        }
    }

    /// Runs `ops` with at most `max_outstanding` in flight and waits for all of them. On the
    /// first failed completion, or when `deadline` passes, the queue pair is moved to ERROR
    /// and drained (every posted request completed) before this returns: the device touches
    /// none of `ops`' memory after that. The queue pair is then unusable (reconnect).
    pub fn run(self: &Arc<Self>, ops: &[RemoteOp], deadline: Instant) -> Result<()> {
        self.run_cancellable(ops, deadline, None)
    }

    /// [`run`](Self::run), also stopped (ERROR, drained, `Canceled`) once `cancel` is set;
    /// checked at least every 20 ms.
    pub fn run_cancellable(
        self: &Arc<Self>,
        ops: &[RemoteOp],
        deadline: Instant,
        cancel: Option<&AtomicBool>,
    ) -> Result<()> {
        self.start(ops.to_vec(), deadline)?
            .pump(deadline, cancel)
            .map(|_| ())
    }

    /// Checks `ops` and returns a [`Run`] that posts and reaps them as it is pumped. Several
    /// runs may be under way on one queue pair; they share its send queue.
    pub fn start(self: &Arc<Self>, ops: Vec<RemoteOp>, deadline: Instant) -> Result<Run> {
        for op in &ops {
            op.local.check(op.local_offset, op.len as u64)?;
            if op.local_offset + op.len as u64 > op.local.len {
                return Err(Error::new(
                    ErrorKind::OutOfBuffer,
                    format!(
                        "rdma: local offset {} + len {} exceeds the registration's {} bytes",
                        op.local_offset, op.len, op.local.len
                    ),
                ));
            }
        }
        if ops.len() > MARKER as usize {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                format!("rdma: {} work requests in one run", ops.len()),
            ));
        }
        let (id, slot) = self.open_slot();
        Ok(Run {
            qp: self.clone(),
            id,
            slot,
            ops,
            next: 0,
            reaped: 0,
            outstanding: 0,
            failure: None,
            deadline,
            // filled by swapping with the slot's inbox (no allocation of its own)
            done: Vec::new(),
            finished: false,
            completed: 0,
            failed_op: None,
        })
    }

    /// Moves to ERROR (when anything is outstanding) and waits until the completion of
    /// `slot`'s operation `next - 1` (flushed or not) came back: its operations complete in
    /// order, so from `reaped` (the first not yet heard of) up to it, every one is then done.
    /// Other runs on the queue pair are flushed too.
    fn drain(&self, slot: &Slot, mut reaped: u32, next: u32) -> Result<()> {
        if reaped >= next {
            return Ok(());
        }
        self.set_error()?;
        let mut done = Vec::new();
        // Flushes are generated by the device at once; bound the wait anyway.
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            done.clear();
            slot.take(&mut done);
            for c in &done {
                reaped = reaped.max(split_wr_id(c.wr_id).1.saturating_add(1));
            }
            let outstanding = next.saturating_sub(reaped);
            if outstanding == 0 {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(self.device.err(
                    Some(self.port),
                    "drain after ERROR",
                    format!("{outstanding} work requests never completed"),
                ));
            }
            self.wait_progress(slot, until, FOR_COMPLETIONS)?;
        }
    }

    /// Posts one request (built for the slot's work request id) and waits for its completion
    /// (bind / invalidate, used at grant and revoke time).
    fn post_and_wait<'a>(
        &self,
        wr: impl FnOnce(u64) -> raw::SendWr<'a>,
        what: &str,
        deadline: Instant,
    ) -> Result<()> {
        let (id, slot) = self.open_slot();
        let r = self.post_and_wait_in(&slot, wr((id as u64) << 32), what, deadline);
        self.close_slot(id);
        r
    }

    fn post_and_wait_in(
        &self,
        slot: &Slot,
        wr: raw::SendWr,
        what: &str,
        deadline: Instant,
    ) -> Result<()> {
        let timed_out = |why: &str| {
            Error::new(
                ErrorKind::TimedOut,
                format!("rdma: {what} {why} by the deadline"),
            )
        };
        while !self.reserve() {
            if Instant::now() >= deadline {
                return Err(timed_out("found no free send queue entry"));
            }
            self.wait_progress(slot, deadline, FOR_ENTRIES)?;
        }
        self.post_reserved(wr)?;
        let mut done = Vec::new();
        loop {
            slot.take(&mut done);
            if !done.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                self.drain(slot, 0, 1)?;
                return Err(timed_out("did not complete"));
            }
            self.wait_progress(slot, deadline, FOR_COMPLETIONS)?;
        }
        match done.iter().find(|c| !c.ok()) {
            Some(c) => Err(completion_error(c, what)),
            None => Ok(()),
        }
    }

    /// Binds `mw` to `len` bytes of `mr` from `offset` (relative to the registration) with
    /// remote `access`; returns the window's new rkey. Only this queue pair's peer can use it.
    pub fn bind_window(
        &self,
        mw: &mut MemoryWindow,
        mr: &MemoryRegistration,
        offset: u64,
        len: u64,
        access: RemoteAccess,
        deadline: Instant,
    ) -> Result<u32> {
        if offset.checked_add(len).is_none_or(|e| e > mr.len) || len == 0 {
            return Err(Error::new(
                ErrorKind::OutOfBuffer,
                format!(
                    "rdma: window {offset}+{len} outside the {}-byte registration",
                    mr.len
                ),
            ));
        }
        let rkey = raw::next_rkey(mw.rkey());
        let wr = |wr_id| raw::SendWr::Bind {
            wr_id,
            mw: &mw.mw,
            rkey,
            mr: &mr.mr,
            addr: mr.addr() + offset,
            len,
            access: access.flags().bits() as u32,
        };
        self.post_and_wait(wr, "bind memory window", deadline)?;
        mw.mw.set_rkey(rkey);
        Ok(rkey)
    }

    /// Invalidates `rkey` (a window bound through this queue pair). Once this returns, no
    /// access with that rkey can succeed.
    pub fn invalidate(&self, rkey: u32, deadline: Instant) -> Result<()> {
        let wr = |wr_id| raw::SendWr::LocalInv { wr_id, rkey };
        self.post_and_wait(wr, "local invalidate", deadline)
    }
}

/// Whether a run failed only because its queue pair was moved to ERROR by something else (its
/// first failed completion was a flush: another run's failure, timeout or cancel on the same
/// queue pair). Such a run did not touch memory it should not have; it may run again on a
/// fresh queue pair.
pub fn flushed(e: &Error) -> bool {
    e.kind() == ErrorKind::Canceled && e.detail().contains(status_name(wc::WR_FLUSH_ERR))
}

/// One run of one-sided operations on a queue pair: [`pump`](Run::pump) it until it finishes.
/// It may be pumped on one thread for a while (a short inline spin) and finished on another.
/// Dropped unfinished, it moves the queue pair to ERROR and drains its requests first.
pub struct Run {
    qp: Arc<QueuePair>,
    /// The slot its completions are routed to (upper half of its work request ids).
    id: u32,
    slot: Arc<Slot>,
    ops: Vec<RemoteOp>,
    /// The first operation not yet posted.
    next: usize,
    /// The first operation not yet heard of: a completion names the last of a chain (or one
    /// that failed or was flushed), and every operation before it is done too.
    reaped: usize,
    outstanding: u32,
    failure: Option<Error>,
    deadline: Instant,
    done: Vec<Completion>,
    finished: bool,
    /// Operations completed successfully (in order: the first `completed` of `ops`).
    completed: usize,
    /// The operation whose completion failed first, if one did.
    failed_op: Option<usize>,
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Run")
            .field("ops", &self.ops.len())
            .field("next", &self.next)
            .field("outstanding", &self.outstanding)
            .finish()
    }
}

impl Run {
    /// Waits as a task until this run may make progress (completions routed to it, send
    /// queue entries freed), `until` or its deadline passed; then [`pump`](Self::pump) it
    /// again. `Ok(false)`: no tokio reactor here, pump it on a blocking thread instead.
    pub async fn wait_async(&self, until: Instant) -> Result<bool> {
        self.waiter(until).wait().await
    }

    /// What [`wait_async`](Self::wait_async) waits on, owned: to wait without holding the run
    /// (which others may then take, to stop it).
    pub fn waiter(&self, until: Instant) -> RunWaiter {
        RunWaiter {
            qp: self.qp.clone(),
            slot: self.slot.clone(),
            until: until.min(self.deadline),
            want: if self.outstanding > 0 {
                FOR_COMPLETIONS
            } else {
                FOR_ENTRIES
            },
        }
    }

    /// Operations that completed successfully: the first `completed()` of the run's (a queue
    /// pair completes in order).
    pub fn completed(&self) -> usize {
        self.completed
    }

    /// The operation whose completion failed first (the others after it were flushed).
    pub fn failed_op(&self) -> Option<usize> {
        self.failed_op
    }

    /// Posts what fits and reaps completions until every operation completed (`Ok(true)`),
    /// `until` passed with work left (`Ok(false)`: pump again), or it failed: a failed
    /// completion, the run's deadline, or `cancel` (then the queue pair is in ERROR and
    /// this run's requests are drained before this returns).
    pub fn pump(&mut self, until: Instant, cancel: Option<&AtomicBool>) -> Result<bool> {
        if self.finished {
            return Ok(true);
        }
        let r = self.pump_inner(until, cancel);
        if r.is_err() && self.outstanding > 0 {
            // an error before every posted request came back (a failed wait on the channel):
            // the device must be done with the memory before anyone hears of the failure
            self.outstanding = 0;
            if let Err(e) = self
                .qp
                .drain(&self.slot, self.reaped as u32, self.next as u32)
            {
                tracing::error!("rdma: {e}");
            }
        }
        if !matches!(r, Ok(false)) {
            self.finished = true;
            self.qp.close_slot(self.id);
        }
        r
    }

    fn pump_inner(&mut self, until: Instant, cancel: Option<&AtomicBool>) -> Result<bool> {
        let qp = self.qp.clone();
        loop {
            // what fits goes out as chains, one doorbell each
            while self.failure.is_none() && self.next < self.ops.len() {
                let want = (self.ops.len() - self.next).min(chain_len()) as u32;
                let k = qp.reserve_up_to(want) as usize;
                if k == 0 {
                    break;
                }
                let mut wrs = [raw::RdmaWr {
                    wr_id: 0,
                    write: false,
                    lkey: 0,
                    addr: 0,
                    len: 0,
                    remote_addr: 0,
                    rkey: 0,
                }; raw::CHAIN];
                for (j, w) in wrs[..k].iter_mut().enumerate() {
                    let i = self.next + j;
                    let op = &self.ops[i];
                    *w = raw::RdmaWr {
                        wr_id: ((self.id as u64) << 32) | i as u64,
                        write: op.write,
                        lkey: op.local.lkey(),
                        addr: op.local.addr() + op.local_offset,
                        len: op.len,
                        remote_addr: op.remote_addr,
                        rkey: op.rkey,
                    };
                }
                let (taken, r) = qp.post_chain(&wrs[..k]);
                self.next += taken;
                self.outstanding += taken as u32;
                if let Err(e) = r {
                    self.failure = Some(e);
                    let _ = qp.set_error();
                    break;
                }
            }
            if self.outstanding == 0 && (self.failure.is_some() || self.next == self.ops.len()) {
                return match self.failure.take() {
                    Some(e) => Err(e),
                    None => Ok(true),
                };
            }
            self.done.clear();
            self.slot.take(&mut self.done);
            if self.done.is_empty() {
                let now = Instant::now();
                let why = if cancel.is_some_and(|c| c.load(Ordering::Acquire)) {
                    Some((ErrorKind::Canceled, "canceled"))
                } else if now >= self.deadline {
                    Some((ErrorKind::TimedOut, "not complete by the deadline"))
                } else {
                    None
                };
                if let Some((kind, what)) = why {
                    // stop the device first, then collect every posted request
                    let e = Error::new(
                        kind,
                        format!(
                            "rdma: {} work requests on {} port {} queue pair {} {what}",
                            self.outstanding,
                            qp.device.name,
                            qp.port,
                            qp.qpn()
                        ),
                    );
                    self.outstanding = 0;
                    qp.drain(&self.slot, self.reaped as u32, self.next as u32)?;
                    return Err(self.failure.take().unwrap_or(e));
                }
                if now >= until {
                    return Ok(false);
                }
                let step = self
                    .deadline
                    .min(until)
                    .min(now + Duration::from_millis(20));
                let want = if self.outstanding > 0 {
                    FOR_COMPLETIONS
                } else {
                    FOR_ENTRIES
                };
                qp.wait_progress(&self.slot, step, want)?;
                continue;
            }
            for i in 0..self.done.len() {
                let c = self.done[i];
                let at = split_wr_id(c.wr_id).1 as usize;
                if at < self.reaped {
                    // heard of already: the marker after a chain taken in part repeats the
                    // index of the last request taken, which may have completed on its own
                    continue;
                }
                // a queue pair completes its requests in order: those before `at` not heard
                // of succeeded silently (unsignaled), so the successes are a prefix
                let newly = at + 1 - self.reaped;
                self.reaped = at + 1;
                self.outstanding = self.outstanding.saturating_sub(newly as u32);
                if self.failure.is_none() {
                    self.completed += if c.ok() { newly } else { newly - 1 };
                }
                if !c.ok() && self.failure.is_none() {
                    self.failed_op = Some(split_wr_id(c.wr_id).1 as usize);
                    let what = self
                        .ops
                        .get(split_wr_id(c.wr_id).1 as usize)
                        .map(|o| {
                            format!(
                                "RDMA {} of {} bytes at {:#x} rkey {:#x}",
                                if o.write { "WRITE" } else { "READ" },
                                o.len,
                                o.remote_addr,
                                o.rkey
                            )
                        })
                        .unwrap_or_else(|| "work request".into());
                    self.failure = Some(completion_error(&c, &what));
                    // ERROR now, so the rest flush instead of running
                    let _ = qp.set_error();
                }
            }
        }
    }
}

/// Work requests per doorbell: [`raw::CHAIN`], or fewer with `OMNIRIG_RDMA_CHAIN=N` (1..=16),
/// to measure chain lengths against each other in one VM.
fn chain_len() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("OMNIRIG_RDMA_CHAIN")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(raw::CHAIN, |n| n.clamp(1, raw::CHAIN))
    })
}

/// `OMNIRIG_RDMA_SIGNAL=all` signals every request of a chain, not only its last: to measure
/// what the completions cost against each other in one VM.
fn signal_all() -> bool {
    static ALL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALL.get_or_init(|| std::env::var("OMNIRIG_RDMA_SIGNAL").is_ok_and(|v| v == "all"))
}

/// A [`Run`]'s wait ([`Run::waiter`]).
pub struct RunWaiter {
    qp: Arc<QueuePair>,
    slot: Arc<Slot>,
    until: Instant,
    want: u8,
}

impl RunWaiter {
    /// As [`Run::wait_async`].
    pub async fn wait(&self) -> Result<bool> {
        self.qp.wait_async(&self.slot, self.until, self.want).await
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if !self.finished {
            if self.outstanding > 0 {
                // the device must not touch these buffers once they may be reused
                let _ = self
                    .qp
                    .drain(&self.slot, self.reaped as u32, self.next as u32);
            }
            self.qp.close_slot(self.id);
        }
    }
}

/// An error and its sources in one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

/// The raw verbs calls sideway does not wrap. All unsafe code of the rdma transport is here.
mod raw {
    use std::ptr::NonNull;
    use std::sync::Arc;

    use rdma_mummy_sys as sys;
    use sideway::ibverbs::completion::{
        BasicCompletionQueue, CompletionChannel, CompletionQueue as _,
    };
    use sideway::ibverbs::memory_region::MemoryRegion;
    use sideway::ibverbs::protection_domain::ProtectionDomain;
    use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair as _};

    use super::Completion;
    use tokio::io::unix::AsyncFd;

    /// An allocated memory window; deallocated on drop. Holds its PD.
    pub struct Mw {
        mw: NonNull<sys::ibv_mw>,
        _pd: Arc<ProtectionDomain>,
    }

    // SAFETY: an ibv_mw is a handle the verbs library lets any thread use; we only read its
    // rkey field and pass it to verbs calls that serialise on the QP.
    unsafe impl Send for Mw {}
    // SAFETY: as for Send; mutation (set_rkey) takes &mut self.
    unsafe impl Sync for Mw {}

    impl Mw {
        pub fn rkey(&self) -> u32 {
            // SAFETY: mw points to a live ibv_mw (owned by self until drop).
            unsafe { self.mw.as_ref().rkey }
        }
        /// Records the rkey a successful bind installed (the C API writes it back in
        /// ibv_bind_mw; with ibv_post_send the caller does).
        pub fn set_rkey(&mut self, rkey: u32) {
            // SAFETY: as above; &mut self means no other reference reads it meanwhile.
            unsafe { self.mw.as_mut().rkey = rkey }
        }
    }

    impl Drop for Mw {
        fn drop(&mut self) {
            // SAFETY: allocated by ibv_alloc_mw and not freed before; the PD it belongs to is
            // still alive (held in _pd).
            unsafe { sys::ibv_dealloc_mw(self.mw.as_ptr()) };
        }
    }

    pub fn alloc_mw(pd: &Arc<ProtectionDomain>) -> Result<Mw, std::io::Error> {
        // SAFETY: pd() is a live ibv_pd (we hold the Arc); ibv_alloc_mw returns NULL and sets
        // errno when the provider has no windows.
        let mw = unsafe { sys::ibv_alloc_mw(pd.pd().as_ptr(), sys::ibv_mw_type::IBV_MW_TYPE_2) };
        match NonNull::new(mw) {
            Some(mw) => Ok(Mw {
                mw,
                _pd: pd.clone(),
            }),
            None => Err(std::io::Error::last_os_error()),
        }
    }

    /// The rkey for the next bind: same index, the low 8 bits (the key) bumped, so a stale
    /// rkey from an earlier binding never matches again.
    pub fn next_rkey(rkey: u32) -> u32 {
        (rkey & 0xffff_ff00) | ((rkey.wrapping_add(1)) & 0xff)
    }

    #[derive(Clone, Copy)]
    pub enum SendWr<'a> {
        Bind {
            wr_id: u64,
            mw: &'a Mw,
            rkey: u32,
            mr: &'a Arc<MemoryRegion>,
            addr: u64,
            len: u64,
            access: u32,
        },
        LocalInv {
            wr_id: u64,
            rkey: u32,
        },
    }

    impl SendWr<'_> {
        pub fn what(&self) -> &'static str {
            match self {
                SendWr::Bind { .. } => "BIND_MW",
                SendWr::LocalInv { .. } => "LOCAL_INV",
            }
        }

        pub fn wr_id(&self) -> u64 {
            match *self {
                SendWr::Bind { wr_id, .. } | SendWr::LocalInv { wr_id, .. } => wr_id,
            }
        }
    }

    /// Posts one signaled bind / invalidate work request (RDMA WRITE / READ go through
    /// [`post_rdma_chain`]).
    pub fn post_send(qp: &BasicQueuePair, wr: SendWr<'_>) -> Result<(), std::io::Error> {
        // SAFETY: ibv_send_wr is a plain C struct for which all-zero is a valid (empty) value.
        let mut w: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        w.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        match wr {
            SendWr::Bind {
                wr_id,
                mw,
                rkey,
                mr,
                addr,
                len,
                access,
            } => {
                w.wr_id = wr_id;
                w.opcode = sys::ibv_wr_opcode::IBV_WR_BIND_MW;
                w.bind_mw_tso_union.bind_mw = sys::bind_mw_t {
                    mw: mw.mw.as_ptr(),
                    rkey,
                    bind_info: sys::ibv_mw_bind_info {
                        // SAFETY: mr() is the live ibv_mr the Arc keeps registered.
                        mr: unsafe { mr.mr().as_ptr() },
                        addr,
                        length: len,
                        mw_access_flags: access,
                    },
                };
            }
            SendWr::LocalInv { wr_id, rkey } => {
                w.wr_id = wr_id;
                w.opcode = sys::ibv_wr_opcode::IBV_WR_LOCAL_INV;
                w.imm_data_invalidated_rkey_union.invalidated_rkey = rkey;
            }
        }
        let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: qp() is the live ibv_qp of `qp` (borrowed for the call); w lives on
        // this stack frame for the call, and the provider copies the request into its queue
        // before returning. The memory the request names is registered and held by the caller
        // until its completion is reaped (QueuePair::run / post_and_wait).
        let r = unsafe { sys::ibv_post_send(qp.qp().as_ptr(), &mut w, &mut bad) };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::from_raw_os_error(r))
        }
    }

    /// One RDMA WRITE / READ of a chain ([`post_rdma_chain`]).
    #[derive(Clone, Copy, Debug)]
    pub struct RdmaWr {
        pub wr_id: u64,
        pub write: bool,
        pub lkey: u32,
        pub addr: u64,
        pub len: u32,
        pub remote_addr: u64,
        pub rkey: u32,
    }

    /// Work requests [`post_rdma_chain`] posts with one call (one doorbell).
    pub const CHAIN: usize = 16;

    /// Posts up to [`CHAIN`] RDMA work requests as one linked list: one `ibv_post_send`, so one
    /// doorbell (on rxe, one system call) for all of them. Only the last is signaled: a send
    /// queue completes in order, so its completion says the others succeeded too, and a
    /// request that fails (or is flushed) completes whether signaled or not. Returns how many
    /// the provider took (all of them unless it refused one: then the ones before it).
    ///
    /// `refuse_at` (a test's hook, `usize::MAX` for none) gives the request at that index two
    /// scatter entries where the queue pair allows one, so the provider really refuses it.
    pub fn post_rdma_chain(
        qp: &BasicQueuePair,
        wrs: &[RdmaWr],
        refuse_at: usize,
    ) -> (usize, Result<(), std::io::Error>) {
        let n = wrs.len().min(CHAIN);
        if n == 0 {
            return (0, Ok(()));
        }
        let signal_all = super::signal_all();
        // SAFETY: ibv_send_wr and ibv_sge are plain C structs; all-zero is a valid value.
        let mut ws: [sys::ibv_send_wr; CHAIN] = unsafe { std::mem::zeroed() };
        // SAFETY: as above: a plain C struct, all-zero valid.
        let mut sges: [sys::ibv_sge; CHAIN] = unsafe { std::mem::zeroed() };
        for (i, r) in wrs[..n].iter().enumerate() {
            sges[i] = sys::ibv_sge {
                addr: r.addr,
                length: r.len,
                lkey: r.lkey,
            };
            let w = &mut ws[i];
            w.wr_id = r.wr_id;
            if i + 1 == n || signal_all {
                w.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            w.opcode = if r.write {
                sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE
            } else {
                sys::ibv_wr_opcode::IBV_WR_RDMA_READ
            };
            w.num_sge = if i == refuse_at { 2 } else { 1 };
            w.wr.rdma = sys::rdma_t {
                remote_addr: r.remote_addr,
                rkey: r.rkey,
            };
        }
        // the hook's request names its own entry and an empty one (if a provider took it
        // anyway, it would move the same bytes)
        let mut refused = [
            sges[refuse_at.min(CHAIN - 1)],
            sys::ibv_sge {
                addr: 0,
                length: 0,
                lkey: 0,
            },
        ];
        // linked through raw pointers only, after every element was written
        let wp = ws.as_mut_ptr();
        let sp = sges.as_mut_ptr();
        for i in 0..n {
            // SAFETY: i and i + 1 < CHAIN index the two stack arrays, which outlive the call.
            unsafe {
                (*wp.add(i)).sg_list = if i == refuse_at {
                    refused.as_mut_ptr()
                } else {
                    sp.add(i)
                };
                (*wp.add(i)).next = if i + 1 < n {
                    wp.add(i + 1)
                } else {
                    std::ptr::null_mut()
                };
            }
        }
        let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: qp() is the live ibv_qp of `qp` (borrowed for the call); the n linked
        // requests and their scatter entries live on this stack frame for the call, and the
        // provider copies them into its queue before returning. The memory they name is
        // registered and held by the caller until their completions are reaped (Run).
        let r = unsafe { sys::ibv_post_send(qp.qp().as_ptr(), wp, &mut bad) };
        if r == 0 {
            return (n, Ok(()));
        }
        // the provider took the requests before `bad`
        let taken = (0..n)
            // SAFETY: i < n indexes the array; only the address is compared.
            .find(|&i| unsafe { wp.add(i) } == bad)
            .unwrap_or(0);
        (taken, Err(std::io::Error::from_raw_os_error(r)))
    }

    /// Polls up to 16 completions into `out`; returns how many.
    pub fn poll_cq(cq: &BasicCompletionQueue, out: &mut Vec<Completion>) -> usize {
        // SAFETY: ibv_wc is a plain C struct; all-zero is valid and the call overwrites it.
        let mut wcs: [sys::ibv_wc; 16] = unsafe { std::mem::zeroed() };
        // SAFETY: cq() is a live ibv_cq (borrowed); wcs has room for the 16 entries asked for.
        let n = unsafe { sys::ibv_poll_cq(cq.cq().as_ptr(), 16, wcs.as_mut_ptr()) };
        if n <= 0 {
            return 0;
        }
        for wc in &wcs[..n as usize] {
            out.push(Completion {
                wr_id: wc.wr_id,
                status: wc.status,
                opcode: wc.opcode,
                vendor_err: wc.vendor_err,
            });
        }
        n as usize
    }

    pub fn req_notify_cq(cq: &BasicCompletionQueue) -> Result<(), std::io::Error> {
        // SAFETY: cq() is a live ibv_cq with a completion channel.
        let r = unsafe { sys::ibv_req_notify_cq(cq.cq().as_ptr(), 0) };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::from_raw_os_error(r))
        }
    }

    /// Registers a completion channel's fd with the current tokio runtime's reactor, for
    /// reading. Panics where the runtime has no I/O driver.
    pub(super) fn register_channel(
        fd: super::ChannelFd,
    ) -> Result<AsyncFd<super::ChannelFd>, tokio::io::unix::AsyncFdRegisterError<super::ChannelFd>>
    {
        // SAFETY: the fd is the completion channel's, which `fd` holds (an Arc): it stays open
        // and names the same channel until the AsyncFd, which owns `fd`, is dropped.
        unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
    }

    /// Reads one event from the (non-blocking) channel; false when there was none.
    pub fn get_cq_event(ch: &CompletionChannel) -> bool {
        let mut cq: *mut sys::ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: comp_channel() is the live channel (borrowed); the out pointers are locals.
        unsafe { sys::ibv_get_cq_event(ch.comp_channel().as_ptr(), &mut cq, &mut ctx) == 0 }
    }

    pub fn ack_cq_events(cq: &BasicCompletionQueue, n: u32) {
        // SAFETY: cq() is a live ibv_cq; n events were read from its channel and not acked.
        unsafe { sys::ibv_ack_cq_events(cq.cq().as_ptr(), n) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_are_the_verbs_names() {
        assert_eq!(status_name(wc::REM_ACCESS_ERR), "IBV_WC_REM_ACCESS_ERR");
        assert_eq!(status_name(wc::WR_FLUSH_ERR), "IBV_WC_WR_FLUSH_ERR");
        assert_eq!(status_name(wc::RETRY_EXC_ERR), "IBV_WC_RETRY_EXC_ERR");
        assert_eq!(status_name(99), "IBV_WC_(unknown)");
        let e = completion_error(
            &Completion {
                wr_id: 1,
                status: wc::REM_ACCESS_ERR,
                opcode: 0,
                vendor_err: 0,
            },
            "RDMA WRITE",
        );
        assert_eq!(e.kind(), ErrorKind::AccessDenied);
        assert!(
            e.detail().contains("IBV_WC_REM_ACCESS_ERR"),
            "{}",
            e.detail()
        );
    }

    #[test]
    fn next_rkey_keeps_the_index_and_changes_the_key() {
        assert_eq!(raw::next_rkey(0x1234_56ff), 0x1234_5600);
        assert_eq!(raw::next_rkey(0x1234_5601), 0x1234_5602);
    }
}
