//! The grant fence with no CPU on the target side: the device itself must refuse a peer that
//! writes outside its grant, or writes after revoke. Two ways, both measured in the rdma tests:
//!
//! - a type 2 memory window bound over exactly the granted range, through the queue pair of the
//!   peer it is for, invalidated (LOCAL_INV) on revoke;
//! - a memory region registered over exactly the granted range, deregistered on revoke.
//!
//! Either way the grant's [`GrantKey`] names the range and the rkey; once [`FencedGrant::revoke`]
//! returns, that rkey is dead on the device.

use std::sync::Arc;
use std::time::Instant;

use crate::error::{Error, ErrorKind, Result};
use crate::memory::Region;

use super::keys::{FenceKind, GrantKey};
use super::verbs::{Device, MemoryRegistration, MemoryWindow, QueuePair, RemoteAccess};

enum Held {
    Window {
        window: MemoryWindow,
        qp: Arc<QueuePair>,
    },
    Region {
        _registration: MemoryRegistration,
    },
}

/// A granted range fenced on the device; revoke it (or drop it) to close it.
pub struct FencedGrant {
    key: GrantKey,
    held: Option<Held>,
    /// For GPU memory without GPUDirect: the host bounce buffer the key names, and the GPU
    /// range (region, offset) it stands for.
    bounce: Option<(Arc<Region>, Arc<Region>, u64)>,
}

impl std::fmt::Debug for FencedGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FencedGrant")
            .field("key", &self.key)
            .finish()
    }
}

impl FencedGrant {
    /// Binds `window` over `len` bytes of `registration` from `offset`, through `qp` (the
    /// queue pair connected to the grantee: a type 2 window works for that peer only).
    pub fn bind_window(
        qp: &Arc<QueuePair>,
        mut window: MemoryWindow,
        registration: &MemoryRegistration,
        offset: u64,
        len: u64,
        access: RemoteAccess,
        deadline: Instant,
    ) -> Result<Self> {
        let rkey = qp.bind_window(&mut window, registration, offset, len, access, deadline)?;
        Ok(Self {
            key: GrantKey {
                fence: FenceKind::Window,
                addr: registration.addr() + offset,
                len,
                rkey,
            },
            held: Some(Held::Window {
                window,
                qp: qp.clone(),
            }),
            bounce: None,
        })
    }

    /// Registers exactly `offset..offset+len` of `region` as its own memory region.
    pub fn register(
        device: &Device,
        region: &Arc<Region>,
        offset: u64,
        len: u64,
        access: RemoteAccess,
    ) -> Result<Self> {
        let registration = device.register(region, offset, len, access)?;
        Ok(Self::registered(registration, len))
    }

    /// Fences with a registration made over exactly the granted range (GPU memory: through
    /// a dma-buf).
    pub fn registered(registration: MemoryRegistration, len: u64) -> Self {
        Self {
            key: GrantKey {
                fence: FenceKind::Region,
                addr: registration.addr(),
                len,
                rkey: registration.rkey(),
            },
            held: Some(Held::Region {
                _registration: registration,
            }),
            bounce: None,
        }
    }

    /// Fences `offset..offset+len` of GPU memory the device cannot register (no GPUDirect
    /// RDMA) through a host bounce buffer of `len` bytes registered in its place: filled from
    /// the GPU now for a read grant (the owner grants a read of what it already wrote), copied
    /// to the GPU by [`FencedGrant::sync`] after writes.
    pub fn bounce(
        device: &Device,
        gpu: &Arc<Region>,
        offset: u64,
        len: u64,
        access: RemoteAccess,
    ) -> Result<Self> {
        gpu.check(offset, len)?;
        let n = usize::try_from(len)
            .map_err(|_| Error::new(ErrorKind::Resource, format!("a {len} byte bounce buffer")))?;
        crate::memory::check_available(n)?;
        let bounce = Arc::new(Region::allocate(n, false)?);
        if access != RemoteAccess::Write {
            gpu.copy_to(offset, &bounce, 0, len)?;
        }
        let mut f = Self::register(device, &bounce, 0, len, access)?;
        f.key.fence = FenceKind::Staged;
        f.bounce = Some((bounce, gpu.clone(), offset));
        Ok(f)
    }

    /// Copies `part..part+len` of the grant from the bounce buffer to the GPU (after a peer's
    /// write landed there). The caller holds the grant live (not revoked) meanwhile.
    pub fn sync(&self, part: u64, len: u64) -> Result<()> {
        let Some((bounce, gpu, offset)) = &self.bounce else {
            return Err(Error::new(
                ErrorKind::Malformed,
                "rdma: a sync for a grant that is not staged",
            ));
        };
        bounce.check(part, len)?;
        bounce.copy_to(part, gpu, offset + part, len)
    }

    pub fn key(&self) -> GrantKey {
        self.key
    }

    /// Closes the fence; returns once the device refuses the grant's rkey. A window comes back
    /// for reuse (its next binding gets a different rkey).
    pub fn revoke(mut self, deadline: Instant) -> Result<Option<MemoryWindow>> {
        match self.held.take() {
            Some(Held::Window { window, qp }) => {
                qp.invalidate(self.key.rkey, deadline)?;
                Ok(Some(window))
            }
            // deregistration (ibv_dereg_mr) happens as the registration drops
            Some(Held::Region { .. }) | None => Ok(None),
        }
    }
}

impl Drop for FencedGrant {
    fn drop(&mut self) {
        if let Some(Held::Window { qp, .. }) = &self.held {
            // Not revoked explicitly: invalidate before the window is deallocated (deallocating
            // also kills the rkey, but say so if the queue pair refuses).
            let deadline = Instant::now() + std::time::Duration::from_secs(5);
            if let Err(e) = qp.invalidate(self.key.rkey, deadline) {
                tracing::debug!("rdma: invalidating a dropped grant's window: {e}");
            }
        }
    }
}
