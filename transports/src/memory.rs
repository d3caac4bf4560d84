//! Registered memory: the one place that touches raw bytes.
//!
//! A region is host memory, or GPU memory (cargo feature `cuda`): a device region's address is
//! never dereferenced on the host; every access goes through its [`DeviceMemory`] (device
//! copies), and the transports that need host bytes stage through pinned memory
//! ([`crate::staging`]).
//!
//! A [`Region`] is a page-aligned span of host memory the engine owns (allocated here) or
//! adopts (the caller's, under the rules on [`Region::adopt`]). Peers write into it like a NIC
//! writes into DMA memory, so the engine never hands out Rust references into a region that
//! outlive one copy or one system call; everything goes through the bounds-checked methods
//! below. Whether a peer may touch a range at all is decided elsewhere (grants); this module
//! only guarantees that every access stays inside live memory.
//!
//! Soundness, once for the whole module:
//! - `ptr..ptr+len` is valid for reads and writes for the region's whole life: allocated by us
//!   with `alloc_zeroed` and freed only in `Drop`, or adopted under a contract that keeps it valid
//!   until the release callback runs (also only in `Drop`). Everything that accesses a region
//!   holds an `Arc<Region>`, so the memory outlives every access.
//! - Every access is bounds-checked with overflow-checked arithmetic before the pointer is formed.
//! - Bytes have no invalid values, so racing accesses (a local read while a misbehaving peer
//!   writes the same range) can give unspecified bytes but never an invalid value; grants
//!   exclude such races in correct use, exactly as with RDMA hardware.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::transport::MemoryProvider;

/// The page size regions are aligned to.
pub const PAGE_SIZE: usize = 4096;
/// Regions at least this large are aligned to it and backed by huge pages where possible.
pub const HUGE_PAGE_SIZE: usize = 2 << 20;

enum Owner {
    /// Allocated here with this layout.
    Engine(Layout),
    /// Mapped here (large regions): the whole mapping, which starts at or before `ptr`.
    Mapped { base: *mut u8, len: usize },
    /// Adopted from the caller; the callback returns it.
    Caller(Option<Box<dyn FnOnce() + Send + Sync>>),
    /// Made by a transport's [`crate::transport::MemoryProvider`] (shm: a sealed memfd
    /// mapping); dropping the backing releases the memory.
    Backed(Box<dyn Any + Send + Sync>),
}

/// Copies for memory the host cannot dereference (GPU memory), implemented by the device's
/// driver layer (`transport::cuda`). A device region holds one and routes every access to it.
pub trait DeviceMemory: Send + Sync + 'static {
    /// The device, for logs and errors: `cuda:0 (NVIDIA H200)`.
    fn describe(&self) -> String;

    /// Copies `src` to the device address `dst`.
    ///
    /// # Safety
    /// `dst..dst+src.len()` is live memory of this device.
    unsafe fn copy_in(&self, dst: usize, src: &[u8]) -> Result<()>;

    /// Copies from the device address `src` into `dst`.
    ///
    /// # Safety
    /// `src..src+dst.len()` is live memory of this device.
    unsafe fn copy_out(&self, src: usize, dst: &mut [u8]) -> Result<()>;

    /// Copies `len` bytes between two addresses of the unified address space, at least one of
    /// them this device's (device to device, device to host, host to device).
    ///
    /// # Safety
    /// Both ranges are live memory (host or device) for the duration of the call, and do not
    /// overlap.
    unsafe fn copy_raw(&self, dst: usize, src: usize, len: usize) -> Result<()>;

    /// The pinned host buffers transports stage this device's memory through: `outbound` for
    /// bytes leaving device memory (sends), else for bytes landing in it. Two pools, so a
    /// receiver never waits for a buffer a sender holds while that sender waits for the
    /// receiver to read (engines of one process share a device's pools).
    fn staging(&self, outbound: bool) -> &Arc<crate::staging::StagingPool>;

    /// Whether this device can export its memory as dma-bufs an RDMA device registers
    /// (GPUDirect RDMA); `Err` says why it could not be asked. Default: it cannot.
    fn dmabuf_supported(&self) -> Result<bool> {
        Ok(false)
    }

    /// Exports a dma-buf that covers `addr..addr+len` (memory of one allocation of this
    /// device): the fd, and where `addr` sits in it. Default: refused.
    fn export_dmabuf(&self, addr: usize, len: usize) -> Result<(std::os::fd::OwnedFd, u64)> {
        let _ = (addr, len);
        Err(Error::new(
            ErrorKind::Resource,
            format!("{} cannot export its memory as a dma-buf", self.describe()),
        ))
    }
}

/// A span of registered memory: host memory, or GPU memory behind a [`DeviceMemory`].
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    owner: Owner,
    locked: bool,
    /// Who allocated it, if a transport's provider did: copies of it are made the same way.
    provider: Option<Arc<dyn MemoryProvider>>,
    /// Set for GPU memory: `ptr` is a device address, never dereferenced here.
    device: Option<Arc<dyn DeviceMemory>>,
}

// SAFETY: a Region is a pointer to memory that stays valid for its whole life (see the module
// docs); all access goes through bounds-checked copies of plain bytes, so sharing or sending it
// between threads cannot produce an invalid value or a use after free.
unsafe impl Send for Region {}
// SAFETY: as for Send.
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("len", &self.len)
            .field("adopted", &matches!(self.owner, Owner::Caller(_)))
            .field("locked", &self.locked)
            .field("device", &self.device.as_ref().map(|d| d.describe()))
            .finish()
    }
}

/// Bytes the kernel says can be allocated without swapping (`MemAvailable` in
/// /proc/meminfo); `None` where that is not known.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses a registration larger than the memory this machine has available now: the
/// harness touches every page it registers and shared regions are populated up front, so
/// a size taken from input (a benchmark's `--sizes`, a scenario's token counts) would
/// otherwise grow the process until the kernel kills it. Memory providers of transports
/// call it too.
pub fn check_available(len: usize) -> Result<()> {
    match mem_available() {
        Some(avail) if len as u64 > avail => Err(Error::new(
            ErrorKind::Resource,
            format!(
                "registering {len} bytes ({:.1} GiB): only {avail} bytes ({:.1} GiB) are available (MemAvailable)",
                len as f64 / (1u64 << 30) as f64,
                avail as f64 / (1u64 << 30) as f64
            ),
        )),
        _ => Ok(()),
    }
}

impl Region {
    /// Allocates `len` zeroed bytes, page-aligned. With `lock`, the pages are also locked in
    /// RAM (mlock) where the process is allowed to; failure to lock is not an error, since
    /// pinning is an optimisation here, and [`Region::is_locked`] says whether it happened.
    pub fn allocate(len: usize, lock: bool) -> Result<Self> {
        if len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                "cannot register 0 bytes",
            ));
        }
        let size = len.checked_next_multiple_of(PAGE_SIZE).ok_or_else(|| {
            Error::new(ErrorKind::InvalidLength, format!("{len} bytes overflows"))
        })?;
        check_available(size)?;
        let mut region = if size >= HUGE_PAGE_SIZE {
            Self::map_huge(len, size)?
        } else {
            let layout = Layout::from_size_align(size, PAGE_SIZE)
                .map_err(|e| Error::new(ErrorKind::InvalidLength, format!("{len} bytes: {e}")))?;
            // SAFETY: layout has non-zero size.
            let ptr = unsafe { alloc_zeroed(layout) };
            let ptr = NonNull::new(ptr).ok_or_else(|| {
                Error::new(
                    ErrorKind::Resource,
                    format!("allocating {len} bytes failed"),
                )
            })?;
            Self {
                ptr,
                len,
                owner: Owner::Engine(layout),
                locked: false,
                provider: None,
                device: None,
            }
        };
        if lock {
            region.locked = region.mlock();
        }
        Ok(region)
    }

    /// Large regions come straight from mmap, aligned to 2 MiB and advised to use transparent
    /// huge pages: fewer TLB misses for the copy paths and fewer translation entries for a
    /// NIC later. The pages are zero-filled by the kernel on first touch.
    fn map_huge(len: usize, size: usize) -> Result<Self> {
        let map_len = size.checked_add(HUGE_PAGE_SIZE).ok_or_else(|| {
            Error::new(ErrorKind::InvalidLength, format!("{len} bytes overflows"))
        })?;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches
        // no existing memory.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::new(
                ErrorKind::Resource,
                format!(
                    "mapping {len} bytes failed: {}",
                    std::io::Error::last_os_error()
                ),
            ));
        }
        let base = base.cast::<u8>();
        let skew = (HUGE_PAGE_SIZE - base as usize % HUGE_PAGE_SIZE) % HUGE_PAGE_SIZE;
        // SAFETY: skew < HUGE_PAGE_SIZE, and skew + size <= map_len, so the aligned start and
        // the advised range lie inside the mapping. madvise only changes paging policy.
        let ptr = unsafe {
            let ptr = base.add(skew);
            libc::madvise(ptr.cast(), size, libc::MADV_HUGEPAGE);
            ptr
        };
        Ok(Self {
            ptr: NonNull::new(ptr).expect("mmap never returns null on success"),
            len,
            owner: Owner::Mapped { base, len: map_len },
            locked: false,
            provider: None,
            device: None,
        })
    }

    /// Adopts caller-owned memory.
    ///
    /// # Safety
    /// - `ptr` must be page-aligned (checked) and valid for reads and writes of `len` bytes
    ///   until `release` is called; the engine calls it exactly once, when the last user of the
    ///   region (the buffer handle, a grant, an in-flight transfer) is gone, which may be after
    ///   the buffer was unregistered.
    /// - Until then the caller must not free or reuse the memory, and must access it only
    ///   through the engine (its buffer handle), never through its own references.
    pub unsafe fn adopt(
        ptr: *mut u8,
        len: usize,
        release: impl FnOnce() + Send + Sync + 'static,
    ) -> Result<Self> {
        if len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                "cannot register 0 bytes",
            ));
        }
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| Error::new(ErrorKind::InvalidLength, "null pointer"))?;
        if !(ptr.as_ptr() as usize).is_multiple_of(PAGE_SIZE) {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                format!("{:p} is not {PAGE_SIZE}-byte aligned", ptr.as_ptr()),
            ));
        }
        if (ptr.as_ptr() as usize).checked_add(len).is_none() {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                "address range overflows",
            ));
        }
        Ok(Self {
            ptr,
            len,
            owner: Owner::Caller(Some(Box::new(release))),
            locked: false,
            provider: None,
            device: None,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// The start address, for transports that register the region with a device (RDMA, CUDA).
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Checks `offset..offset+len` lies inside the region.
    pub fn check(&self, offset: u64, len: u64) -> Result<(usize, usize)> {
        let end = offset.checked_add(len);
        match end {
            Some(end) if end <= self.len as u64 => Ok((offset as usize, len as usize)),
            _ => Err(Error::new(
                ErrorKind::OutOfBuffer,
                format!(
                    "offset {offset} + len {len} exceeds buffer length {}",
                    self.len
                ),
            )),
        }
    }

    /// Copies `src` into the region at `offset`.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<()> {
        let (off, len) = self.check(offset, src.len() as u64)?;
        if let Some(dev) = &self.device {
            // SAFETY: off+len is inside this device region (checked).
            return unsafe { dev.copy_in(self.addr() + off, src) };
        }
        // SAFETY: off+len is inside the region (checked), src is a separate live slice.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), len) };
        Ok(())
    }

    /// Copies from the region at `offset` into `dst`.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let (off, len) = self.check(offset, dst.len() as u64)?;
        if let Some(dev) = &self.device {
            // SAFETY: off+len is inside this device region (checked).
            return unsafe { dev.copy_out(self.addr() + off, dst) };
        }
        // SAFETY: off+len is inside the region (checked), dst is a separate live slice.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), len) };
        Ok(())
    }

    /// Copies `len` bytes from `self` at `src_off` to `dst` at `dst_off` (a local memcpy, or a
    /// device copy when either side is GPU memory; the loopback transport's data path).
    /// Overlap within one region is allowed.
    pub fn copy_to(&self, src_off: u64, dst: &Region, dst_off: u64, len: u64) -> Result<()> {
        let (s, n) = self.check(src_off, len)?;
        let (d, _) = dst.check(dst_off, len)?;
        if let Some(dev) = self.device.as_ref().or(dst.device.as_ref()) {
            if n == 0 {
                return Ok(());
            }
            let same = std::ptr::eq(self, dst);
            if same && s.abs_diff(d) < n {
                // Device copies do not allow overlap: go through the host once.
                let mut tmp = vec![0u8; n];
                self.read(src_off, &mut tmp)?;
                return dst.write(dst_off, &tmp);
            }
            // SAFETY: both ranges are inside live regions (checked), host or device memory of
            // the unified address space, and they do not overlap (different regions, or
            // disjoint ranges of one).
            return unsafe { dev.copy_raw(dst.addr() + d, self.addr() + s, n) };
        }
        // SAFETY: both ranges are inside their regions (checked); `copy` tolerates overlap,
        // which can only happen when both are the same region.
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(s), dst.ptr.as_ptr().add(d), n) };
        Ok(())
    }

    /// The device behind a GPU region; `None` for host memory.
    pub fn device(&self) -> Option<&Arc<dyn DeviceMemory>> {
        self.device.as_ref()
    }

    /// Whether this is GPU memory (not addressable by the host).
    pub fn is_device(&self) -> bool {
        self.device.is_some()
    }

    fn host_only(&self) -> Result<()> {
        match &self.device {
            None => Ok(()),
            Some(d) => Err(Error::new(
                ErrorKind::Resource,
                format!(
                    "a {} byte region in GPU memory ({}) cannot be touched by the host: stage it through pinned memory",
                    self.len,
                    d.describe()
                ),
            )),
        }
    }

    /// Lends `offset..offset+len` as a slice for the span of `f`: one system call that sends
    /// from registered memory. `f` must not keep the slice. Host memory only.
    pub fn with_slice<R>(&self, offset: u64, len: u64, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.host_only()?;
        let (off, len) = self.check(offset, len)?;
        // SAFETY: inside the region (checked); the borrow ends with `f`.
        let s = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) };
        Ok(f(s))
    }

    /// Lends `offset..offset+len` mutably for the span of `f`: one system call that receives
    /// straight into registered memory. `f` must not keep the slice. Host memory only.
    pub fn with_mut_slice<R>(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R> {
        self.host_only()?;
        let (off, len) = self.check(offset, len)?;
        // SAFETY: inside the region (checked); the borrow ends with `f`. Grants keep other
        // writers off this range in correct use (see module docs for the racy case).
        let s = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) };
        Ok(f(s))
    }

    /// Wraps memory a transport's provider made (see [`crate::transport::MemoryProvider`]).
    ///
    /// # Safety
    /// `ptr` must be page-aligned and valid for reads and writes of `len` bytes for as long as
    /// `backing` lives; the region drops `backing` exactly once, after its last use, and
    /// nothing else may access the memory except through this region (or, for memory shared
    /// with peers, under grants).
    pub unsafe fn from_backing(
        ptr: NonNull<u8>,
        len: usize,
        backing: impl Any + Send + Sync,
    ) -> Result<Self> {
        if len == 0 || !(ptr.as_ptr() as usize).is_multiple_of(PAGE_SIZE) {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                format!(
                    "backed region at {:p} of {len} bytes must be non-empty and page-aligned",
                    ptr.as_ptr()
                ),
            ));
        }
        Ok(Self {
            ptr,
            len,
            owner: Owner::Backed(Box::new(backing)),
            locked: false,
            provider: None,
            device: None,
        })
    }

    /// Wraps GPU memory a device layer allocated: `addr` is a device address, accessed only
    /// through `device`.
    ///
    /// # Safety
    /// `addr..addr+len` must be memory of `device` that stays allocated for as long as
    /// `backing` lives (the region drops `backing` exactly once, after its last use), accessed
    /// by nothing else except through this region (or, for memory shared with peers, under
    /// grants).
    pub unsafe fn from_device(
        addr: usize,
        len: usize,
        device: Arc<dyn DeviceMemory>,
        backing: impl Any + Send + Sync,
    ) -> Result<Self> {
        let ptr = NonNull::new(addr as *mut u8)
            .ok_or_else(|| Error::new(ErrorKind::InvalidLength, "null device address"))?;
        // SAFETY: forwarded contract; the pointer is never dereferenced on the host because
        // `device` is set below before anyone can use the region.
        let mut region = unsafe { Self::from_backing(ptr, len, backing) }?;
        region.device = Some(device);
        Ok(region)
    }

    /// The backing a provider gave [`Region::from_backing`], if it is a `T`.
    pub fn backing<T: Any>(&self) -> Option<&T> {
        match &self.owner {
            Owner::Backed(b) => b.downcast_ref(),
            _ => None,
        }
    }

    /// Remembers the provider that made this region (the engine does, when it allocates).
    pub(crate) fn with_provider(mut self, p: Arc<dyn MemoryProvider>) -> Self {
        self.provider = Some(p);
        self
    }

    /// `len` zeroed bytes made the same way as this region (by its provider, or plain).
    pub fn allocate_like(&self, len: usize) -> Result<Region> {
        match &self.provider {
            Some(p) => Ok(p.allocate(len)?.with_provider(p.clone())),
            None => Region::allocate(len, false),
        }
    }

    /// Locks the pages in RAM (mlock), best effort; returns whether they are locked. GPU
    /// memory is never paged out: nothing to lock.
    pub fn lock_pages(&mut self) -> bool {
        if self.device.is_some() {
            return false;
        }
        if !self.locked {
            self.locked = self.mlock();
        }
        self.locked
    }

    /// The address of `offset..offset+len`, bounds-checked, for transports that copy with
    /// raw pointers (another process's mapping, a device). Valid while the region lives.
    pub fn range_ptr(&self, offset: u64, len: u64) -> Result<*mut u8> {
        self.host_only()?;
        let (off, _) = self.check(offset, len)?;
        // SAFETY: off <= len of the allocation (checked), so the result stays in bounds (or one
        // past its end for an empty range at the end).
        Ok(unsafe { self.ptr.as_ptr().add(off) })
    }

    /// The address of `offset..offset+len`, bounds-checked, as a number: host or device memory
    /// (device copies take either). Valid while the region lives.
    pub fn range_addr(&self, offset: u64, len: u64) -> Result<u64> {
        let (off, _) = self.check(offset, len)?;
        Ok((self.addr() + off) as u64)
    }

    /// Exports `offset..offset+len` of GPU memory as a dma-buf for an RDMA device
    /// (`ibv_reg_dmabuf_mr`): the fd and where the range's first byte sits in it. The device
    /// decides how much it exports around the range (whole pages, or its whole allocation);
    /// the caller registers exactly the range, so the HCA's bounds stay the grant's.
    pub fn export_dmabuf(&self, offset: u64, len: u64) -> Result<(std::os::fd::OwnedFd, u64)> {
        let Some(dev) = &self.device else {
            return Err(Error::new(
                ErrorKind::Resource,
                "only GPU memory is exported as a dma-buf (host memory registers directly)",
            ));
        };
        let (off, n) = self.check(offset, len)?;
        if n == 0 {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                "cannot export an empty range as a dma-buf",
            ));
        }
        dev.export_dmabuf(self.addr() + off, n)
    }

    fn mlock(&self) -> bool {
        // SAFETY: mlock only changes residency of pages we own; it never dereferences them.
        unsafe { libc::mlock(self.ptr.as_ptr().cast(), self.len) == 0 }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.locked {
            // SAFETY: undoes our own mlock on memory that is still ours.
            unsafe { libc::munlock(self.ptr.as_ptr().cast(), self.len) };
        }
        match &mut self.owner {
            // SAFETY: allocated in `allocate` with exactly this layout, freed once, here.
            Owner::Engine(layout) => unsafe { dealloc(self.ptr.as_ptr(), *layout) },
            // SAFETY: the exact mapping made in `map_huge`, unmapped once, here.
            Owner::Mapped { base, len } => unsafe {
                libc::munmap(base.cast(), *len);
            },
            // The backing releases its memory when the field drops, right after this.
            Owner::Backed(_) => {}
            Owner::Caller(release) => {
                if let Some(release) = release.take() {
                    release();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn allocation_is_page_aligned_zeroed_and_bounds_checked() {
        let r = Region::allocate(10_000, false).unwrap();
        assert_eq!(r.addr() % PAGE_SIZE, 0);
        let mut out = vec![1u8; 10_000];
        r.read(0, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 0));
        r.write(9_998, &[7, 8]).unwrap();
        assert_eq!(
            r.write(9_999, &[7, 8]).unwrap_err().kind(),
            ErrorKind::OutOfBuffer
        );
        assert_eq!(
            r.check(u64::MAX, 2).unwrap_err().kind(),
            ErrorKind::OutOfBuffer
        );
        assert_eq!(
            Region::allocate(0, false).unwrap_err().kind(),
            ErrorKind::InvalidLength
        );
    }

    #[test]
    fn large_regions_are_huge_page_aligned_and_zeroed() {
        let r = Region::allocate(HUGE_PAGE_SIZE * 2 + 5, false).unwrap();
        assert_eq!(r.addr() % HUGE_PAGE_SIZE, 0);
        let mut tail = vec![1u8; 4096];
        r.read((HUGE_PAGE_SIZE * 2 + 5 - 4096) as u64, &mut tail)
            .unwrap();
        assert!(tail.iter().all(|&b| b == 0));
        r.write((HUGE_PAGE_SIZE * 2 + 4) as u64, &[9]).unwrap();
        assert_eq!(
            r.write((HUGE_PAGE_SIZE * 2 + 5) as u64, &[9])
                .unwrap_err()
                .kind(),
            ErrorKind::OutOfBuffer
        );
    }

    #[test]
    fn copy_between_regions_is_exact() {
        let a = Region::allocate(4096, false).unwrap();
        let b = Region::allocate(4096, true).unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 31) as u8).collect();
        a.write(0, &data).unwrap();
        a.copy_to(100, &b, 200, 1000).unwrap();
        let mut out = vec![0u8; 1000];
        b.read(200, &mut out).unwrap();
        assert_eq!(out, data[100..1100]);
        assert_eq!(
            a.copy_to(4000, &b, 0, 200).unwrap_err().kind(),
            ErrorKind::OutOfBuffer
        );
    }

    #[test]
    fn adopted_memory_is_released_once_when_the_region_drops() {
        let layout = Layout::from_size_align(8192, PAGE_SIZE).unwrap();
        // SAFETY: test allocation with a non-zero layout.
        let ptr = unsafe { alloc_zeroed(layout) };
        let released = Arc::new(AtomicBool::new(false));
        let flag = released.clone();
        let addr = ptr as usize;
        // SAFETY: ptr is valid for 8192 bytes until the release callback frees it.
        let r = unsafe {
            Region::adopt(ptr, 8192, move || {
                flag.store(true, Ordering::SeqCst);
                // SAFETY: allocated above with this layout; released exactly once.
                dealloc(addr as *mut u8, layout);
            })
        }
        .unwrap();
        r.write(8191, &[9]).unwrap();
        assert!(!released.load(Ordering::SeqCst));
        drop(r);
        assert!(released.load(Ordering::SeqCst));
        // SAFETY: misaligned pointer is refused before it is ever used.
        let e = unsafe { Region::adopt(std::ptr::dangling_mut::<u8>(), 1, || {}) }.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidLength);
    }

    /// A device that records the ranges it is asked to export (its memory is host memory, so
    /// the test runs anywhere; nothing here dereferences it as device memory).
    struct Exporter {
        asked: std::sync::Mutex<Vec<(usize, usize)>>,
        pool: Arc<crate::staging::StagingPool>,
    }

    impl DeviceMemory for Exporter {
        fn describe(&self) -> String {
            "test:0".into()
        }
        unsafe fn copy_in(&self, _dst: usize, _src: &[u8]) -> Result<()> {
            Err(Error::new(ErrorKind::Resource, "not used"))
        }
        unsafe fn copy_out(&self, _src: usize, _dst: &mut [u8]) -> Result<()> {
            Err(Error::new(ErrorKind::Resource, "not used"))
        }
        unsafe fn copy_raw(&self, _dst: usize, _src: usize, _len: usize) -> Result<()> {
            Err(Error::new(ErrorKind::Resource, "not used"))
        }
        fn staging(&self, _outbound: bool) -> &Arc<crate::staging::StagingPool> {
            &self.pool
        }
        fn export_dmabuf(&self, addr: usize, len: usize) -> Result<(std::os::fd::OwnedFd, u64)> {
            self.asked.lock().unwrap().push((addr, len));
            let f = std::fs::File::open("/dev/null")
                .map_err(|e| Error::new(ErrorKind::Io, e.to_string()))?;
            // like the CUDA device: the pages around the range
            Ok((f.into(), (addr % PAGE_SIZE) as u64))
        }
    }

    #[test]
    fn a_dmabuf_export_asks_the_device_for_the_range_and_says_where_it_starts() {
        let dev = Arc::new(Exporter {
            asked: Default::default(),
            pool: crate::staging::StagingPool::new(
                "t",
                1,
                4096,
                Box::new(|n| Region::allocate(n, false)),
            )
            .unwrap(),
        });
        let host = Region::allocate(5 * PAGE_SIZE, false).unwrap();
        let base = host.addr();
        let d: Arc<dyn DeviceMemory> = dev.clone();
        // SAFETY: `host` backs the region and lives as long as it; the test device never
        // dereferences the address.
        let r = unsafe { Region::from_device(base, 3 * PAGE_SIZE + 10, d, host) }.unwrap();
        let (_, at) = r
            .export_dmabuf(PAGE_SIZE as u64 + 100, 2 * PAGE_SIZE as u64 - 200)
            .unwrap();
        assert_eq!(at, 100);
        let (_, at) = r.export_dmabuf(0, 3 * PAGE_SIZE as u64 + 10).unwrap();
        assert_eq!(at, 0);
        assert_eq!(
            *dev.asked.lock().unwrap(),
            vec![
                (base + PAGE_SIZE + 100, 2 * PAGE_SIZE - 200),
                (base, 3 * PAGE_SIZE + 10)
            ],
            "the device is asked for exactly the range"
        );
        for (off, len, kind) in [
            (0, 3 * PAGE_SIZE as u64 + 11, ErrorKind::OutOfBuffer),
            (u64::MAX, 2, ErrorKind::OutOfBuffer),
            (5, 0, ErrorKind::InvalidLength),
        ] {
            assert_eq!(r.export_dmabuf(off, len).unwrap_err().kind(), kind);
        }
        let e = Region::allocate(4096, false)
            .unwrap()
            .export_dmabuf(0, 4096)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Resource);
        assert!(e.detail().contains("only GPU memory"), "{e}");
        assert_eq!(
            dev.asked.lock().unwrap().len(),
            2,
            "refusals export nothing"
        );
    }
}
