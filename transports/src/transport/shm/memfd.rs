//! Shareable memory for the shm transport: buffers as sealed memfds (the provider every
//! engine running shm allocates with), and a peer's memfd mapped here for the owner's copy.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, ErrorKind, Result};
use crate::memory::{PAGE_SIZE, Region};
use crate::transport::MemoryProvider;

/// Seals every shareable region carries: its size can never change, so a peer that maps it
/// can never fault on a page that went away (SIGBUS).
const SHARE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

fn os_err(what: &str) -> Error {
    Error::new(
        ErrorKind::Resource,
        format!("{what}: {}", std::io::Error::last_os_error()),
    )
}

/// A shared mapping of a sealed memfd: the backing of a shareable [`Region`]. Dropping it
/// unmaps the memory, then closes the file.
pub(crate) struct SharedFile {
    base: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
    /// Process-unique: names the region to an owner that mapped it.
    id: u64,
}

// SAFETY: the mapping is only unmapped in Drop; the struct itself never dereferences it
// (the Region that owns it does, bounds-checked).
unsafe impl Send for SharedFile {}
// SAFETY: as for Send.
unsafe impl Sync for SharedFile {}

impl Drop for SharedFile {
    fn drop(&mut self) {
        // SAFETY: the exact mapping made in `allocate_shared`, unmapped once, here; the memfd
        // closes after (the field drops next).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// The shm transport's [`MemoryProvider`]: every buffer of an engine running shm is a sealed
/// memfd, so an owner on this host can map it.
#[derive(Debug, Default)]
pub(crate) struct MemfdProvider;

impl MemoryProvider for MemfdProvider {
    fn allocate(&self, len: usize) -> Result<Region> {
        allocate_shared(len)
    }
}

/// Allocates `len` zeroed bytes another process on this host can map: a sealed memfd,
/// mapped shared and populated up front (so no first-touch page faults land in transfers).
pub(crate) fn allocate_shared(len: usize) -> Result<Region> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    if len == 0 {
        return Err(Error::new(
            ErrorKind::InvalidLength,
            "cannot register 0 bytes",
        ));
    }
    let size = len
        .checked_next_multiple_of(PAGE_SIZE)
        .ok_or_else(|| Error::new(ErrorKind::InvalidLength, format!("{len} bytes overflows")))?;
    // Populated up front: a size beyond what the machine has would grow RSS until killed.
    crate::memory::check_available(size)?;
    // SAFETY: the name is a NUL-terminated literal; memfd_create creates a new file.
    let raw = unsafe {
        libc::memfd_create(
            c"omnirig-region".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if raw < 0 {
        return Err(os_err("memfd_create"));
    }
    // SAFETY: `raw` is a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: plain system calls on our own descriptor.
    unsafe {
        if libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) != 0 {
            return Err(os_err(&format!("sizing a {len}-byte memfd")));
        }
        if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SHARE_SEALS) != 0 {
            return Err(os_err("sealing the memfd"));
        }
    }
    // SAFETY: a new shared mapping of our own file, at an address of the kernel's choosing.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            fd.as_raw_fd(),
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(os_err(&format!("mapping a {len}-byte memfd")));
    }
    let base = NonNull::new(base.cast::<u8>()).expect("mmap never returns null on success");
    let file = SharedFile {
        base,
        len: size,
        fd,
        id: NEXT.fetch_add(1, Ordering::Relaxed),
    };
    // SAFETY: `base` is a fresh page-aligned mapping of `size >= len` bytes that lives exactly
    // as long as `file`, which the region owns and drops once.
    unsafe { Region::from_backing(base, len, file) }
}

/// For a shareable region: its process-unique id, its memfd, and the file's size.
pub(crate) fn shared_file(region: &Region) -> Option<(u64, BorrowedFd<'_>, usize)> {
    region
        .backing::<SharedFile>()
        .map(|f| (f.id, f.fd.as_fd(), f.len))
}

/// Another process's shareable region, mapped here (the shm transport's server side). Only
/// the bounds-checked copies below touch it, through raw pointers: the other process may
/// write its bytes at any time, so no Rust reference into it is ever formed.
pub struct PeerMemory {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: a pointer to a mapping that stays valid until Drop; all access is bounds-checked
// raw copies of plain bytes.
unsafe impl Send for PeerMemory {}
// SAFETY: as for Send.
unsafe impl Sync for PeerMemory {}

impl std::fmt::Debug for PeerMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerMemory")
            .field("len", &self.len)
            .finish()
    }
}

impl PeerMemory {
    /// Maps `len` bytes of the file at `path` (a peer's memfd, `/proc/PID/fd/N`). Refused
    /// unless the file is sealed against shrinking and at least `len` bytes long, so no page
    /// of the mapping can vanish while it is mapped.
    pub fn map(path: &std::path::Path, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::new(ErrorKind::InvalidLength, "empty peer region"));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| {
                Error::new(
                    ErrorKind::Unreachable,
                    format!("opening peer memory {}: {e}", path.display()),
                )
            })?;
        let fd = file.as_raw_fd();
        // SAFETY: F_GET_SEALS reads flags of an open descriptor.
        let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!(
                    "peer memory {} is not sealed against shrinking",
                    path.display()
                ),
            ));
        }
        let meta = file
            .metadata()
            .map_err(|e| Error::new(ErrorKind::Resource, format!("stat peer memory: {e}")))?;
        let size = meta.len();
        if size < len as u64 {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!("peer memory is {size} bytes, {len} announced"),
            ));
        }
        // Every page of a peer's region exists (its owner populated the memfd when it made
        // it): mapping them all now takes the page-table work out of the copies, where it
        // cost a fault per 64 KiB (Thinker -> Talker's 956 KiB over shm: engine transfer
        // 0.65 -> 0.46 ms). A file with holes is mapped lazily: populating it would allocate
        // memory here that the peer never did.
        let allocated = std::os::unix::fs::MetadataExt::blocks(&meta).saturating_mul(512);
        let populate = if allocated >= len as u64 {
            libc::MAP_POPULATE
        } else {
            0
        };
        // SAFETY: a new shared mapping of `len` bytes of a file at least that long, sealed so
        // it stays that long; the descriptor may close afterwards (the mapping keeps the file).
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | populate,
                fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(os_err("mapping peer memory"));
        }
        Ok(Self {
            base: NonNull::new(base.cast()).expect("mmap never returns null on success"),
            len,
        })
    }

    fn check(&self, offset: u64, len: u64) -> Result<usize> {
        let end = offset.checked_add(len);
        match end {
            Some(end) if end <= self.len as u64 => Ok(offset as usize),
            _ => Err(Error::new(
                ErrorKind::OutOfBuffer,
                format!(
                    "peer range {offset}+{len} outside its {}-byte region",
                    self.len
                ),
            )),
        }
    }

    /// Copies `len` bytes from this peer memory at `offset` into `dst` at `dst_off`.
    pub fn copy_into(&self, offset: u64, dst: &Region, dst_off: u64, len: u64) -> Result<()> {
        let s = self.check(offset, len)?;
        let d = dst.range_ptr(dst_off, len)?;
        // SAFETY: both ranges were bounds-checked against live mappings; they are different
        // mappings, and a peer's racing writes can only make the copied bytes unspecified.
        unsafe { std::ptr::copy_nonoverlapping(self.base.as_ptr().add(s), d, len as usize) };
        Ok(())
    }

    /// Copies `len` bytes of `src` at `src_off` into this peer memory at `offset`.
    pub fn copy_from(&self, offset: u64, src: &Region, src_off: u64, len: u64) -> Result<()> {
        let d = self.check(offset, len)?;
        let s = src.range_ptr(src_off, len)?;
        // SAFETY: as in `copy_into`, the other way round.
        unsafe { std::ptr::copy_nonoverlapping(s, self.base.as_ptr().add(d), len as usize) };
        Ok(())
    }
}

impl Drop for PeerMemory {
    fn drop(&mut self) {
        // SAFETY: the exact mapping made in `map`, unmapped once, here.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}
