//! GPUDirect RDMA registration: how the rdma transport registers GPU memory with the HCA.
//!
//! Where the GPU exports device memory as a dma-buf (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`)
//! and an RDMA device is open, a device buffer's granted range is exported
//! (`cuMemGetHandleForAddressRange`, a dma-buf fd) and registered with the HCA
//! (`ibv_reg_dmabuf_mr`, cargo features `cuda` + `rdma`): the NIC then reads and writes GPU
//! memory directly. Anywhere else the engine stages through pinned host memory, and says so
//! once per engine ([`Notice`]), naming why. [`decide`] is the one place that choice is made,
//! so it is tested without hardware; `omnirig evidence` reports the path that ran
//! ([`RegistrationPath::name`]).

use std::sync::atomic::{AtomicBool, Ordering};

/// How GPU memory reaches an RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistrationPath {
    /// dma-buf export of device memory, registered with the HCA (GPUDirect RDMA).
    Dmabuf,
    /// Through pinned host memory, for the reason given.
    Staged(String),
}

impl RegistrationPath {
    /// The path's name in reports and evidence: `gpudirect-dmabuf` or `staged`.
    pub fn name(&self) -> &'static str {
        match self {
            RegistrationPath::Dmabuf => "gpudirect-dmabuf",
            RegistrationPath::Staged(_) => "staged",
        }
    }
}

/// What this machine offers, as probed by the cuda and rdma layers.
#[derive(Debug, Clone)]
pub struct Capabilities {
    /// Whether this build has the rdma transport (`--features rdma`).
    pub rdma_built: bool,
    /// The RDMA device the engine opened, if any.
    pub rdma_device: Option<String>,
    /// The GPU's answer to "can you export dma-bufs", or why it could not be asked.
    pub gpu_dmabuf: Result<bool, String>,
}

/// Chooses the path for an engine's GPU buffers.
pub fn decide(c: &Capabilities) -> RegistrationPath {
    if !c.rdma_built {
        return RegistrationPath::Staged("this build has no rdma transport".into());
    }
    let Some(dev) = &c.rdma_device else {
        return RegistrationPath::Staged("no RDMA device on this machine".into());
    };
    match &c.gpu_dmabuf {
        Ok(true) => RegistrationPath::Dmabuf,
        Ok(false) => RegistrationPath::Staged(format!(
            "the GPU cannot export dma-bufs (driver or kernel too old), so {dev} cannot register its memory"
        )),
        Err(why) => RegistrationPath::Staged(format!("no usable GPU: {why}")),
    }
}

/// Says "staging" once per engine, not once per buffer.
#[derive(Debug, Default)]
pub struct Notice(AtomicBool);

impl Notice {
    /// Logs the path the first time it is staged; returns whether this call logged.
    pub fn staged_once(&self, engine: &str, path: &RegistrationPath) -> bool {
        let RegistrationPath::Staged(why) = path else {
            return false;
        };
        if self.0.swap(true, Ordering::AcqRel) {
            return false;
        }
        // "rdma:" in the message: the hil agent relays the lines that carry it (evidence)
        tracing::warn!(
            engine,
            path = path.name(),
            why = %why,
            "rdma: GPUDirect RDMA unavailable: GPU memory is staged through pinned host memory"
        );
        true
    }
}

#[cfg(feature = "cuda")]
pub(crate) use probe::export_around;
#[cfg(feature = "cuda")]
pub use probe::{dmabuf_supported, export_dmabuf};

#[cfg(feature = "cuda")]
mod probe {
    use std::os::fd::{FromRawFd, OwnedFd};

    use cudarc::driver::sys;

    use super::super::driver::Gpu;
    use crate::error::{Error, ErrorKind, Result};
    use crate::memory::DeviceMemory as _;
    use crate::memory::{PAGE_SIZE, Region};

    /// Whether `gpu` can export its memory as dma-bufs.
    pub fn dmabuf_supported(gpu: &Gpu) -> Result<bool> {
        gpu.bind()?;
        let v = gpu.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)?;
        Ok(v != 0)
    }

    /// Exports `offset..offset+len` of a device region (page-aligned, as the driver requires)
    /// as a dma-buf fd an RDMA device can register.
    pub fn export_dmabuf(gpu: &Gpu, region: &Region, offset: u64, len: u64) -> Result<OwnedFd> {
        if !region.is_device() {
            return Err(Error::new(
                ErrorKind::Resource,
                "only GPU memory is exported as a dma-buf (host memory registers directly)",
            ));
        }
        let addr = region.range_addr(offset, len)?;
        if !addr.is_multiple_of(PAGE_SIZE as u64) || !len.is_multiple_of(PAGE_SIZE as u64) {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                format!(
                    "a dma-buf range must be {PAGE_SIZE}-byte aligned: offset {offset}, len {len}"
                ),
            ));
        }
        export_range(gpu, addr, len as usize)
    }

    /// A dma-buf covering `addr..addr+len` of `gpu`'s memory, and where `addr` sits in it: the
    /// whole pages around the range, or, where the driver refuses that (on the H200 with
    /// driver 580 a page-aligned range not at its allocation's start was refused), the whole
    /// allocation the range lies in (`cuMemGetAddressRange`, page-rounded, as UCX exports).
    pub(crate) fn export_around(gpu: &Gpu, addr: u64, len: usize) -> Result<(OwnedFd, u64)> {
        let page = PAGE_SIZE as u64;
        let end = addr
            .checked_add(len as u64)
            .filter(|_| len > 0)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidLength,
                    format!("a dma-buf of {len} bytes at {addr:#x}"),
                )
            })?;
        let start = addr - addr % page;
        let first = match export_range(gpu, start, (end.next_multiple_of(page) - start) as usize) {
            Ok(fd) => return Ok((fd, addr - start)),
            Err(e) => e,
        };
        gpu.bind()?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: out pointers are live locals; the driver looks the address up.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }
            .result()
            .map_err(|e| {
                Error::new(
                    ErrorKind::Resource,
                    format!("{}; cuMemGetAddressRange({addr:#x}): {e:?}", first.detail()),
                )
            })?;
        if end > base + size as u64 {
            return Err(Error::new(
                ErrorKind::OutOfBuffer,
                format!("{addr:#x} + {len} runs past its allocation {base:#x} + {size}"),
            ));
        }
        let whole = base - base % page;
        let whole_end = (base + size as u64).next_multiple_of(page);
        export_range(gpu, whole, (whole_end - whole) as usize)
            .map(|fd| (fd, addr - whole))
            .map_err(|e| {
                Error::new(
                    e.kind(),
                    format!(
                        "{}; then the whole allocation: {}",
                        first.detail(),
                        e.detail()
                    ),
                )
            })
    }

    /// Exports `addr..addr+len` of `gpu`'s memory (page-aligned; the driver refuses a range
    /// outside one of its allocations) as a dma-buf fd.
    pub(crate) fn export_range(gpu: &Gpu, addr: u64, len: usize) -> Result<OwnedFd> {
        if !addr.is_multiple_of(PAGE_SIZE as u64) || !len.is_multiple_of(PAGE_SIZE) || len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                format!("a dma-buf range must be whole {PAGE_SIZE}-byte pages: {addr:#x} + {len}"),
            ));
        }
        gpu.bind()?;
        let mut fd: i32 = -1;
        // SAFETY: the out pointer is a live local the driver writes an fd number into; the
        // driver itself checks that addr..addr+len is device memory it allocated.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut i32).cast(),
                addr,
                len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
        .result()
        .map_err(|e| {
            Error::new(
                ErrorKind::Resource,
                format!(
                    "{}: cuMemGetHandleForAddressRange (dma-buf export of {len} bytes): {e:?}",
                    gpu.describe()
                ),
            )
        })?;
        if fd < 0 {
            return Err(Error::new(
                ErrorKind::Resource,
                "CUDA returned no dma-buf fd",
            ));
        }
        // SAFETY: the driver just opened this fd for us; we own it from here.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_is_gpudirect_only_with_rdma_a_device_and_dmabuf_export() {
        let full = Capabilities {
            rdma_built: true,
            rdma_device: Some("mlx5_0".into()),
            gpu_dmabuf: Ok(true),
        };
        assert_eq!(decide(&full), RegistrationPath::Dmabuf);
        assert_eq!(decide(&full).name(), "gpudirect-dmabuf");
        let cases = [
            (
                Capabilities {
                    rdma_built: false,
                    ..full.clone()
                },
                "no rdma transport",
            ),
            (
                Capabilities {
                    rdma_device: None,
                    ..full.clone()
                },
                "no RDMA device",
            ),
            (
                Capabilities {
                    gpu_dmabuf: Ok(false),
                    ..full.clone()
                },
                "cannot export dma-bufs",
            ),
            (
                Capabilities {
                    gpu_dmabuf: Err("libcuda.so.1 cannot be loaded".into()),
                    ..full.clone()
                },
                "libcuda",
            ),
        ];
        for (c, why) in cases {
            match decide(&c) {
                RegistrationPath::Staged(w) => assert!(w.contains(why), "{w}"),
                p => panic!("{c:?} chose {p:?}"),
            }
        }
    }

    #[test]
    fn staging_is_announced_once_per_engine() {
        let n = Notice::default();
        let staged = RegistrationPath::Staged("no RDMA device".into());
        assert!(!n.staged_once("e", &RegistrationPath::Dmabuf));
        assert!(n.staged_once("e", &staged));
        assert!(!n.staged_once("e", &staged));
        assert!(Notice::default().staged_once("other", &staged));
    }
}
