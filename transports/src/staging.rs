//! Staging: GPU memory travels over transports that need host bytes (tcp) through a bounded
//! pool of pinned host buffers. A slice is copied device -> pinned buffer (on a CUDA stream,
//! completion awaited on an event), sent, and on the far side received into a pinned buffer
//! and copied -> device under the grant's fence. Several slices are in flight at once (one per
//! connection), so the copies of one slice overlap the network time of the others.
//!
//! The pool is bounded: at most `slots` buffers exist, a slice that finds none free waits for
//! one, and every buffer goes back when its [`Staged`] guard drops, on every path (success,
//! error, a canceled future). [`StagingPool::outstanding`] is zero whenever nothing is staged.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, ErrorKind, Result};
use crate::memory::Region;

/// Makes one pinned host buffer of the given size.
pub type StagingAllocator = Box<dyn Fn(usize) -> Result<Region> + Send + Sync>;

/// A bounded set of equal, reusable (pinned) host buffers.
pub struct StagingPool {
    name: String,
    slot_size: usize,
    slots: usize,
    permits: Arc<Semaphore>,
    free: Mutex<Vec<Region>>,
    allocate: StagingAllocator,
    outstanding: AtomicUsize,
    allocated: AtomicUsize,
}

impl std::fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingPool")
            .field("name", &self.name)
            .field("slot_size", &self.slot_size)
            .field("slots", &self.slots)
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

/// One staging buffer, lent until this guard drops.
pub struct Staged {
    region: Option<Region>,
    pool: Arc<StagingPool>,
    _permit: OwnedSemaphorePermit,
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staged")
            .field("bytes", &self.region().len())
            .finish()
    }
}

impl Staged {
    /// The buffer (host memory, `slot_size` bytes).
    pub fn region(&self) -> &Region {
        self.region.as_ref().expect("present until drop")
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let Some(r) = self.region.take() {
            self.pool
                .free
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(r);
        }
        self.pool.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

impl StagingPool {
    /// A pool of at most `slots` buffers of `slot_size` bytes each, made lazily by `allocate`.
    pub fn new(
        name: impl Into<String>,
        slots: usize,
        slot_size: usize,
        allocate: StagingAllocator,
    ) -> Result<Arc<Self>> {
        if slots == 0 || slot_size == 0 {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                format!("a staging pool needs slots ({slots}) and a slot size ({slot_size}) > 0"),
            ));
        }
        Ok(Arc::new(Self {
            name: name.into(),
            slot_size,
            slots,
            permits: Arc::new(Semaphore::new(slots)),
            free: Mutex::new(Vec::new()),
            allocate,
            outstanding: AtomicUsize::new(0),
            allocated: AtomicUsize::new(0),
        }))
    }

    /// Bytes per buffer: the largest piece staged at once.
    pub fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// The bound on buffers.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Buffers lent right now (0 when nothing is staged: leak checks).
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Acquire)
    }

    /// Buffers made so far (never more than `slots`).
    pub fn allocated(&self) -> usize {
        self.allocated.load(Ordering::Acquire)
    }

    /// Lends a buffer, waiting while all `slots` are lent.
    pub async fn acquire(self: &Arc<Self>) -> Result<Staged> {
        let permit = self.permits.clone().acquire_owned().await.map_err(|_| {
            Error::new(
                ErrorKind::Resource,
                format!("staging pool {} is closed", self.name),
            )
        })?;
        self.lend(permit)
    }

    /// Lends a buffer if one is free now.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Result<Staged>> {
        let permit = self.permits.clone().try_acquire_owned().ok()?;
        Some(self.lend(permit))
    }

    fn lend(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Result<Staged> {
        let reused = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let region = match reused {
            Some(r) => r,
            None => {
                let r = (self.allocate)(self.slot_size).map_err(|e| {
                    Error::new(
                        e.kind(),
                        format!(
                            "staging pool {}: allocating a {} byte buffer: {}",
                            self.name,
                            self.slot_size,
                            e.detail()
                        ),
                    )
                })?;
                self.allocated.fetch_add(1, Ordering::AcqRel);
                r
            }
        };
        self.outstanding.fetch_add(1, Ordering::AcqRel);
        Ok(Staged {
            region: Some(region),
            pool: self.clone(),
            _permit: permit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_pool(slots: usize) -> Arc<StagingPool> {
        StagingPool::new(
            "test",
            slots,
            4096,
            Box::new(|n| Region::allocate(n, false)),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn buffers_are_bounded_reused_and_always_returned() {
        let pool = host_pool(2);
        let a = pool.acquire().await.unwrap();
        let b = pool.acquire().await.unwrap();
        assert_eq!(pool.outstanding(), 2);
        assert!(
            pool.try_acquire().is_none(),
            "a third buffer past the bound"
        );
        let addr = a.region().addr();
        drop(a);
        let c = pool.try_acquire().unwrap().unwrap();
        assert_eq!(c.region().addr(), addr, "the returned buffer is reused");
        // A waiter parked on a full pool is woken by a return, and a canceled waiter takes
        // nothing.
        let waiter = tokio::spawn({
            let pool = pool.clone();
            async move { pool.acquire().await.map(|s| s.region().len()) }
        });
        let canceled = tokio::time::timeout(std::time::Duration::from_millis(10), pool.acquire());
        assert!(canceled.await.is_err());
        drop(b);
        assert_eq!(waiter.await.unwrap().unwrap(), 4096);
        drop(c);
        assert_eq!(pool.outstanding(), 0);
        assert_eq!(pool.allocated(), 2);
    }

    #[test]
    fn a_failing_allocator_returns_its_permit_and_names_the_pool() {
        let pool = StagingPool::new(
            "gpu0",
            1,
            4096,
            Box::new(|_| Err(Error::new(ErrorKind::Resource, "no pinned memory"))),
        )
        .unwrap();
        let e = pool.try_acquire().unwrap().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Resource);
        assert!(e.to_string().contains("gpu0"), "{e}");
        assert_eq!(pool.outstanding(), 0);
        // The permit came back with the error: the next try is not refused for lack of slots.
        assert!(pool.try_acquire().is_some());
        assert_eq!(
            StagingPool::new("x", 0, 1, Box::new(|n| Region::allocate(n, false)))
                .unwrap_err()
                .kind(),
            ErrorKind::InvalidLength
        );
    }
}
