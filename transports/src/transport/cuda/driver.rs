//! The thin layer over the CUDA driver API (through `cudarc`, libcuda loaded at run time): the
//! one place this crate calls CUDA. Everything above it works with [`Gpu`], regions and errors.
//!
//! - The driver library is looked up before anything else ([`driver`]): on a machine without
//!   one every entry point returns a `Resource` error saying so (cudarc itself would panic).
//! - Each device is opened once per process ([`Gpu::open`]) on its primary context, which is
//!   made current on the calling thread before every call (cheap; threads come and go).
//! - Copies run on a pool of non-blocking streams; a copy is enqueued, an event is recorded
//!   after it and the caller waits on that event alone. Nothing here synchronizes the device or
//!   the context.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use crate::error::{Error, ErrorKind, Result};
use crate::memory::{DeviceMemory, PAGE_SIZE, Region};
use crate::staging::StagingPool;

/// Pinned buffers per device staging pool (one pool per direction), and their size: 16 x 1 MiB
/// holds every tcp slice (512 KiB by default) of several transfers in flight.
pub const STAGING_SLOTS: usize = 16;
pub const STAGING_SLOT_SIZE: usize = 1 << 20;

fn cuda_err(what: &str, e: cu::DriverError) -> Error {
    let name = e
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    Error::new(ErrorKind::Resource, format!("CUDA: {what}: {name}"))
}

/// Loads libcuda and initializes the driver, once per process. The error says what is missing.
pub fn driver() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only tries to dlopen the driver library by its usual names; nothing from it
        // is called here.
        if !unsafe { sys::is_culib_present() } {
            return Err("the CUDA driver library (libcuda.so.1) cannot be loaded: no NVIDIA driver on this machine".into());
        }
        cu::init().map_err(|e| cuda_err("cuInit", e).detail().to_string())
    })
    .clone()
    .map_err(|why| Error::new(ErrorKind::Resource, why))
}

/// How many CUDA devices this machine has (an error without a driver).
pub fn device_count() -> Result<u32> {
    driver()?;
    let n = cu::device::get_count().map_err(|e| cuda_err("cuDeviceGetCount", e))?;
    Ok(n.max(0) as u32)
}

/// A stream and the event recorded after each copy on it.
struct Lane {
    stream: sys::CUstream,
    event: sys::CUevent,
}

// SAFETY: CUDA streams and events are handles usable from any thread once their context is
// current there (every use binds the context first).
unsafe impl Send for Lane {}

/// One CUDA device of this process, on its primary context.
pub struct Gpu {
    ordinal: u32,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    name: String,
    uuid: [u8; 16],
    lanes: Mutex<Vec<Lane>>,
    staging: [OnceLock<Arc<StagingPool>>; 2],
}

// SAFETY: the context handle is process-wide (primary context, retained for the process's
// life); the lane pool is behind a mutex.
unsafe impl Send for Gpu {}
// SAFETY: as for Send.
unsafe impl Sync for Gpu {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Gpu {
    /// Device `ordinal`, opened once per process (later calls return the same one).
    pub fn open(ordinal: u32) -> Result<Arc<Gpu>> {
        static OPEN: OnceLock<Mutex<HashMap<u32, Arc<Gpu>>>> = OnceLock::new();
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::new(
                ErrorKind::Resource,
                format!("CUDA device {ordinal} does not exist (this machine has {count})"),
            ));
        }
        let mut open = OPEN
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(g) = open.get(&ordinal) {
            return Ok(g.clone());
        }
        let device = cu::device::get(ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
        // SAFETY: `device` came from cuDeviceGet. The primary context stays retained for the
        // process's life (this Gpu is never dropped: it lives in OPEN).
        let ctx = unsafe { cu::primary_ctx::retain(device) }
            .map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
        let name = cu::device::get_name(device).unwrap_or_else(|_| "unknown GPU".into());
        let uuid = cu::device::get_uuid(device)
            .map(|u| u.bytes.map(|b| b as u8))
            .unwrap_or([0; 16]);
        let gpu = Arc::new(Gpu {
            ordinal,
            device,
            ctx,
            name,
            uuid,
            lanes: Mutex::new(Vec::new()),
            staging: [OnceLock::new(), OnceLock::new()],
        });
        open.insert(ordinal, gpu.clone());
        Ok(gpu)
    }

    /// The GPU of this machine with this UUID, if there is one.
    pub fn by_uuid(uuid: &[u8]) -> Result<Option<Arc<Gpu>>> {
        for i in 0..device_count()? {
            let g = Gpu::open(i)?;
            if g.uuid[..] == *uuid {
                return Ok(Some(g));
            }
        }
        Ok(None)
    }

    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The device's name as the driver reports it (`NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's UUID: tells engines of two processes whether they share a GPU.
    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// Makes this device's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: the primary context is retained for the process's life.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| cuda_err("cuCtxSetCurrent", e))
    }

    /// A device attribute's value.
    pub(crate) fn attribute(&self, a: sys::CUdevice_attribute) -> Result<i32> {
        // SAFETY: `device` came from cuDeviceGet.
        unsafe { cu::device::get_attribute(self.device, a) }
            .map_err(|e| cuda_err("cuDeviceGetAttribute", e))
    }

    /// Whether this device can address `other`'s memory directly (peer access).
    pub fn can_access_peer(&self, other: &Gpu) -> Result<bool> {
        if other.ordinal == self.ordinal {
            return Ok(true);
        }
        let mut yes = 0;
        // SAFETY: both handles came from cuDeviceGet; the out pointer is a live local.
        unsafe { sys::cuDeviceCanAccessPeer(&mut yes, self.device, other.device) }
            .result()
            .map_err(|e| cuda_err("cuDeviceCanAccessPeer", e))?;
        Ok(yes != 0)
    }

    /// Lets this device's context address `other`'s memory (peer copies). Idempotent.
    pub fn enable_peer(&self, other: &Gpu) -> Result<()> {
        if other.ordinal == self.ordinal {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: other's primary context is retained for the process's life.
        match unsafe { sys::cuCtxEnablePeerAccess(other.ctx, 0) }.result() {
            Ok(())
            | Err(cu::DriverError(sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)) => Ok(()),
            Err(e) => Err(cuda_err("cuCtxEnablePeerAccess", e)),
        }
    }

    fn lane(&self) -> Result<Lane> {
        if let Some(l) = self.lanes.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(l);
        }
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| cuda_err("cuStreamCreate", e))?;
        let event = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| cuda_err("cuEventCreate", e))?;
        Ok(Lane { stream, event })
    }

    /// Copies `len` bytes between two addresses of the unified address space on one of this
    /// device's streams and waits for exactly that copy (its event).
    ///
    /// # Safety
    /// Both ranges are live host or device memory for the duration of the call and do not
    /// overlap.
    pub(crate) unsafe fn copy(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        let lane = self.lane()?;
        // SAFETY: the caller guarantees both ranges; the stream and event belong to this
        // context, which is current. The event is recorded after the copy and waited on
        // before we return, so the memory is not used past the call.
        let done = unsafe {
            sys::cuMemcpyAsync(dst, src, len, lane.stream)
                .result()
                .map_err(|e| cuda_err("cuMemcpyAsync", e))
                .and_then(|()| {
                    cu::event::record(lane.event, lane.stream)
                        .map_err(|e| cuda_err("cuEventRecord", e))
                })
                .and_then(|()| {
                    cu::event::synchronize(lane.event)
                        .map_err(|e| cuda_err("cuEventSynchronize", e))
                })
        };
        match done {
            Ok(()) => {
                self.lanes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(lane);
                Ok(())
            }
            Err(e) => {
                // A lane that failed is not reused.
                // SAFETY: our own handles, destroyed once.
                unsafe {
                    let _ = cu::event::destroy(lane.event);
                    let _ = cu::stream::destroy(lane.stream);
                }
                Err(e)
            }
        }
    }

    /// `len` zeroed bytes of device memory, page-aligned, as a region whose accesses go
    /// through this device.
    pub fn allocate(self: &Arc<Self>, len: usize) -> Result<Region> {
        let size = rounded(len)?;
        self.bind()?;
        let (free, _) = cu::mem_get_info().map_err(|e| cuda_err("cuMemGetInfo", e))?;
        if size > free {
            return Err(Error::new(
                ErrorKind::Resource,
                format!(
                    "allocating {len} bytes on {}: only {free} bytes of device memory are free",
                    self.describe()
                ),
            ));
        }
        // Over-allocate one page so the region can start on a page boundary whatever the
        // allocator returns.
        // SAFETY: plain allocation in the current context.
        let base = unsafe { cu::malloc_sync(size + PAGE_SIZE) }
            .map_err(|e| cuda_err(&format!("cuMemAlloc of {len} bytes"), e))?;
        let alloc = DeviceAlloc {
            gpu: self.clone(),
            base,
        };
        let addr = (base as usize).next_multiple_of(PAGE_SIZE);
        // SAFETY: addr..addr+size lies inside the allocation just made, in this context.
        unsafe { cu::memset_d8_sync(addr as u64, 0, size) }
            .map_err(|e| cuda_err("cuMemsetD8", e))?;
        let device: Arc<dyn DeviceMemory> = self.clone();
        // SAFETY: addr..addr+len is device memory of this GPU that `alloc` frees only when it
        // drops, which the region does after its last use.
        unsafe { Region::from_device(addr, len, device, alloc) }
    }

    /// `len` zeroed bytes of pinned (page-locked, device-mapped) host memory: a host region the
    /// GPU copies to and from at full speed.
    pub fn allocate_pinned(&self, len: usize) -> Result<Region> {
        let size = rounded(len)?;
        crate::memory::check_available(size)?;
        self.bind()?;
        // SAFETY: plain allocation in the current context; PORTABLE makes it pinned for every
        // context of the process.
        let ptr = unsafe { cu::malloc_host(size, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| cuda_err(&format!("cuMemHostAlloc of {len} bytes"), e))?;
        let host = PinnedAlloc { ptr };
        let ptr = std::ptr::NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::new(ErrorKind::Resource, "cuMemHostAlloc returned null"))?;
        // SAFETY: the allocation is `size` bytes, ours alone; zeroing it is writing plain bytes.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, size) };
        // SAFETY: ptr..ptr+size is host memory freed only when `host` drops (by the region,
        // after its last use); cuMemHostAlloc returns page-aligned memory (checked there).
        unsafe { Region::from_backing(ptr, len, host) }
    }

    /// This device's staging pool (pinned buffers) for one direction, made on first use.
    pub fn staging_pool(&self, outbound: bool) -> &Arc<StagingPool> {
        self.staging[outbound as usize].get_or_init(|| {
            let ordinal = self.ordinal;
            let dir = if outbound { "outbound" } else { "inbound" };
            StagingPool::new(
                format!("cuda:{ordinal} {dir} staging"),
                STAGING_SLOTS,
                STAGING_SLOT_SIZE,
                Box::new(move |n| Gpu::open(ordinal)?.allocate_pinned(n)),
            )
            .expect("constant, non-zero pool shape")
        })
    }
}

fn rounded(len: usize) -> Result<usize> {
    if len == 0 {
        return Err(Error::new(
            ErrorKind::InvalidLength,
            "cannot register 0 bytes",
        ));
    }
    len.checked_next_multiple_of(PAGE_SIZE)
        .filter(|s| s.checked_add(PAGE_SIZE).is_some())
        .ok_or_else(|| Error::new(ErrorKind::InvalidLength, format!("{len} bytes overflows")))
}

impl DeviceMemory for Gpu {
    fn describe(&self) -> String {
        format!("cuda:{} ({})", self.ordinal, self.name)
    }

    unsafe fn copy_in(&self, dst: usize, src: &[u8]) -> Result<()> {
        // SAFETY: dst range per the caller; src is a live slice that does not alias device
        // memory.
        unsafe { self.copy(dst as u64, src.as_ptr() as u64, src.len()) }
    }

    unsafe fn copy_out(&self, src: usize, dst: &mut [u8]) -> Result<()> {
        // SAFETY: src range per the caller; dst is a live, exclusive slice.
        unsafe { self.copy(dst.as_mut_ptr() as u64, src as u64, dst.len()) }
    }

    unsafe fn copy_raw(&self, dst: usize, src: usize, len: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.copy(dst as u64, src as u64, len) }
    }

    fn staging(&self, outbound: bool) -> &Arc<StagingPool> {
        self.staging_pool(outbound)
    }

    fn dmabuf_supported(&self) -> Result<bool> {
        super::gpudirect::dmabuf_supported(self)
    }

    fn export_dmabuf(&self, addr: usize, len: usize) -> Result<(std::os::fd::OwnedFd, u64)> {
        super::gpudirect::export_around(self, addr as u64, len)
    }
}

/// A device allocation, freed when the region that owns it drops.
pub(crate) struct DeviceAlloc {
    gpu: Arc<Gpu>,
    pub(crate) base: sys::CUdeviceptr,
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: our allocation, freed once, after the region's last use.
            let _ = unsafe { cu::free_sync(self.base) };
        }
    }
}

/// A pinned host allocation, freed when the region that owns it drops.
struct PinnedAlloc {
    ptr: *mut c_void,
}

// SAFETY: a plain host allocation; the region that owns it governs access.
unsafe impl Send for PinnedAlloc {}
// SAFETY: as for Send.
unsafe impl Sync for PinnedAlloc {}

impl Drop for PinnedAlloc {
    fn drop(&mut self) {
        // SAFETY: returned by cuMemHostAlloc, freed once.
        let _ = unsafe { cu::free_host(self.ptr) };
    }
}

/// A CUDA IPC handle for the device allocation behind `region` and where the region starts in
/// it: what another process needs to map the memory.
pub fn ipc_handle(region: &Region) -> Result<([u8; 64], u64)> {
    let alloc = region.backing::<DeviceAlloc>().ok_or_else(|| {
        Error::new(
            ErrorKind::Resource,
            "only GPU memory allocated by omnirig can be shared over CUDA IPC",
        )
    })?;
    alloc.gpu.bind()?;
    let mut h = MaybeUninit::<sys::CUipcMemHandle>::uninit();
    // SAFETY: base is a live allocation of this context; the out pointer is a live local.
    unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), alloc.base) }
        .result()
        .map_err(|e| cuda_err("cuIpcGetMemHandle", e))?;
    // SAFETY: initialized by the successful call above.
    let h = unsafe { h.assume_init() };
    Ok((
        h.reserved.map(|b| b as u8),
        region.addr() as u64 - alloc.base,
    ))
}

/// Another process's device allocation mapped into this one (CUDA IPC). Closed on drop.
pub struct IpcMapping {
    gpu: Arc<Gpu>,
    base: sys::CUdeviceptr,
    size: u64,
}

// SAFETY: a device address and the retained context it lives in.
unsafe impl Send for IpcMapping {}
// SAFETY: as for Send.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Maps the allocation `handle` names into this process on `gpu`.
    pub fn open(gpu: &Arc<Gpu>, handle: &[u8; 64]) -> Result<Self> {
        gpu.bind()?;
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as _),
        };
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: the handle is plain bytes the driver validates; the out pointer is a live
        // local. Lazy peer access lets a handle from another GPU of this host map too.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| cuda_err("cuIpcOpenMemHandle", e))?;
        let mut mapping = Self {
            gpu: gpu.clone(),
            base,
            size: 0,
        };
        // The size comes from the driver, never from the wire: it bounds every access.
        let (mut start, mut size) = (0, 0usize);
        // SAFETY: base is the live mapping just made; out pointers are live locals.
        unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base) }
            .result()
            .map_err(|e| cuda_err("cuMemGetAddressRange", e))?;
        mapping.size = (start + size as u64).saturating_sub(base);
        Ok(mapping)
    }

    /// Bytes mapped from the base.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The mapping's base address in this process.
    pub fn base(&self) -> u64 {
        self.base
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: our own mapping, closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        }
    }
}
