//! Registered pools carved into disjoint ranges.
//!
//! The engine refuses overlapping write grants, so every stage reserves each
//! destination from its pool's [`RangeAllocator`] first. The allocator is
//! plain state (no I/O); [`Pool`] adds the registered buffer and waiting.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use omnirig_fixtures::POISON_BYTE;
use omnirig_transports::{Buffer, Engine};
use tokio::sync::Notify;

use crate::error::{HarnessError, Result};

/// Ranges are aligned so tensors start on cache lines and pages.
pub const RANGE_ALIGN: u64 = 4096;

/// `n` rounded up to [`RANGE_ALIGN`] (saturating: a size that large is refused when registered).
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(RANGE_ALIGN).max(1).saturating_mul(RANGE_ALIGN)
}

/// First-fit allocator of disjoint ranges in `0..capacity`.
#[derive(Debug, Clone)]
pub struct RangeAllocator {
    capacity: u64,
    /// Free ranges by start, never adjacent (coalesced on free).
    free: BTreeMap<u64, u64>,
    used: u64,
    live: usize,
}

impl RangeAllocator {
    pub fn new(capacity: u64) -> Self {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Self {
            capacity,
            free,
            used: 0,
            live: 0,
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Reserves `len` bytes (rounded up to [`RANGE_ALIGN`]); returns (offset, reserved len).
    pub fn alloc(&mut self, len: u64) -> Option<(u64, u64)> {
        let len = align_up(len);
        let (&start, &flen) = self.free.iter().find(|&(_, &l)| l >= len)?;
        self.free.remove(&start);
        if flen > len {
            self.free.insert(start + len, flen - len);
        }
        self.used += len;
        self.live += 1;
        Some((start, len))
    }

    /// Returns a range from [`alloc`](Self::alloc).
    pub fn free(&mut self, start: u64, len: u64) {
        debug_assert!(start + len <= self.capacity);
        self.used -= len;
        self.live -= 1;
        let (mut start, mut len) = (start, len);
        if let Some((&ps, &pl)) = self.free.range(..start).next_back()
            && ps + pl == start
        {
            self.free.remove(&ps);
            start = ps;
            len += pl;
        }
        if let Some(&nl) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += nl;
        }
        self.free.insert(start, len);
    }

    /// Bytes reserved now.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Ranges reserved now.
    pub fn live(&self) -> usize {
        self.live
    }
}

/// Overwrites `offset..offset+len` of `buffer` with [`POISON_BYTE`], so whatever a
/// transfer does not write there cannot pass as expected bytes (stale bytes of an earlier
/// request included). For ranges of at most a few hundred KiB, or where the range's owner
/// cannot be held (see [`poison_held`]).
pub fn poison(buffer: &Buffer, offset: u64, len: u64) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    crate::cpu::cpu_for(len, || fill_poison(buffer, &[(offset, len)]))?;
    Ok(())
}

fn fill_poison(
    buffer: &Buffer,
    ranges: &[(u64, u64)],
) -> std::result::Result<(), omnirig_transports::Error> {
    ranges
        .iter()
        .filter(|r| r.1 > 0)
        .try_for_each(|&(offset, len)| buffer.fill(offset, len, |m| m.fill(POISON_BYTE)))
}

/// [`poison`] for every `(offset, len)` range of a reservation, `held` being what keeps
/// the ranges reserved (handed back when it drops). A large total runs on the stages' CPU
/// pool ([`crate::cpu`]), once for all ranges, while this task waits: the async worker goes on running the
/// process's other tasks. Blocking the worker in place instead (`block_in_place`) left a
/// control message another stage's task was woken for waiting behind a KV reservation's
/// memset: 4-5 ms of the EC handoff in one process. `held` travels with the memset and comes
/// back with it, so a caller that gives up waiting (its future dropped) cannot hand the
/// ranges back while poison is still being written into them.
pub async fn poison_held<H: Send + 'static>(
    buffer: &Buffer,
    ranges: Vec<(u64, u64)>,
    held: H,
) -> Result<H> {
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    if total <= crate::cpu::IN_PLACE_BYTES || !crate::cpu::multi_thread() {
        fill_poison(buffer, &ranges)?;
        return Ok(held);
    }
    let b = buffer.clone();
    let (held, r) = crate::cpu::spawn("poison", move || {
        let r = fill_poison(&b, &ranges);
        (held, r)
    })
    .await?;
    r?;
    Ok(held)
}

/// A registered buffer of one engine with an allocator over it.
#[derive(Debug)]
pub struct Pool {
    pub name: String,
    pub buffer: Buffer,
    alloc: Mutex<RangeAllocator>,
    freed: Notify,
    /// Whether [`reserve`](Self::reserve) poisons each range before handing it out.
    poisoned: bool,
}

impl Pool {
    /// A pool whose ranges come back as they were left (benchmarks).
    pub fn new(engine: &Engine, name: impl Into<String>, capacity: u64) -> Result<Arc<Pool>> {
        Self::build(engine, name.into(), capacity, false)
    }

    /// A pool that [`poison`]s every range before handing it out: what the pipeline's
    /// stages use, so a request never sees bytes an earlier one left behind.
    pub fn new_poisoned(
        engine: &Engine,
        name: impl Into<String>,
        capacity: u64,
    ) -> Result<Arc<Pool>> {
        Self::build(engine, name.into(), capacity, true)
    }

    fn build(engine: &Engine, name: String, capacity: u64, poisoned: bool) -> Result<Arc<Pool>> {
        let capacity = align_up(capacity);
        Ok(Arc::new(Pool {
            name,
            buffer: engine.allocate(capacity)?,
            alloc: Mutex::new(RangeAllocator::new(capacity)),
            freed: Notify::new(),
            poisoned,
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RangeAllocator> {
        self.alloc.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves `len` bytes, waiting up to `timeout` for space freed by other requests.
    pub async fn reserve(self: &Arc<Self>, len: u64, timeout: Duration) -> Result<Lease> {
        if align_up(len) > self.lock().capacity() {
            return Err(HarnessError::Pool {
                pool: self.name.clone(),
                reason: format!(
                    "{len} bytes can never fit in {} bytes",
                    self.lock().capacity()
                ),
            });
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let got = self.lock().alloc(len);
            if let Some((offset, len)) = got {
                let lease = Lease {
                    pool: self.clone(),
                    offset,
                    len,
                };
                if self.poisoned {
                    // Nobody holds a grant on a free range, so the owner's write goes through.
                    return poison_held(&self.buffer, vec![(offset, len)], lease).await;
                }
                return Ok(lease);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(HarnessError::Pool {
                    pool: self.name.clone(),
                    reason: format!("no room for {len} bytes within {timeout:?}"),
                });
            }
        }
    }

    /// (bytes, ranges) reserved now.
    /// Bytes the pool can ever hold.
    pub fn capacity(&self) -> u64 {
        self.lock().capacity()
    }

    pub fn usage(&self) -> (u64, usize) {
        let a = self.lock();
        (a.used(), a.live())
    }
}

/// A reserved range; returned to its pool on drop, so every error path releases it.
#[derive(Debug)]
pub struct Lease {
    pub pool: Arc<Pool>,
    pub offset: u64,
    /// Reserved length (aligned).
    pub len: u64,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pool.lock().free(self.offset, self.len);
        self.pool.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_disjoint_and_coalesce_back() {
        let mut a = RangeAllocator::new(10 * RANGE_ALIGN);
        let x = a.alloc(1).unwrap();
        let y = a.alloc(RANGE_ALIGN + 1).unwrap();
        let z = a.alloc(3 * RANGE_ALIGN).unwrap();
        assert_eq!((x, y, z), ((0, 4096), (4096, 8192), (12288, 12288)));
        assert!(a.alloc(5 * RANGE_ALIGN).is_none());
        a.free(y.0, y.1);
        assert_eq!(a.alloc(2 * RANGE_ALIGN).unwrap().0, 4096);
        a.free(4096, 8192);
        a.free(x.0, x.1);
        a.free(z.0, z.1);
        assert_eq!((a.used(), a.live()), (0, 0));
        assert_eq!(a.alloc(10 * RANGE_ALIGN).unwrap(), (0, 10 * RANGE_ALIGN));
    }

    async fn loopback_engine(name: &str) -> Engine {
        use omnirig_transports::{EngineConfig, TransportKind};
        Engine::new(EngineConfig::for_kind(name, TransportKind::Loopback))
            .await
            .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reservation_comes_back_poisoned_over_what_the_last_one_wrote() {
        let engine = loopback_engine("pool-test-reuse").await;
        let pool = Pool::new_poisoned(&engine, "t", 4 << 20).unwrap();
        let lease = pool.reserve(4 << 20, Duration::from_secs(5)).await.unwrap();
        pool.buffer.fill(0, 4 << 20, |m| m.fill(0x5a)).unwrap();
        drop(lease);
        let lease = pool.reserve(4 << 20, Duration::from_secs(5)).await.unwrap();
        let all = pool
            .buffer
            .view(0, 4 << 20, |b| b.iter().all(|&x| x == POISON_BYTE))
            .unwrap();
        assert!(all, "a reused range still holds the last request's bytes");
        drop(lease);
        assert_eq!(pool.usage(), (0, 0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reservation_dropped_while_poisoning_is_handed_back_only_once_the_memset_ends() {
        let engine = loopback_engine("pool-test-dropped").await;
        let pool = Pool::new_poisoned(&engine, "t", 16 << 20).unwrap();
        for round in 0..8 {
            // Gives up at once: mostly while the 16 MiB memset runs on the blocking pool.
            let r = tokio::time::timeout(
                Duration::from_micros(1),
                pool.reserve(16 << 20, Duration::from_secs(5)),
            )
            .await;
            drop(r);
            // The next owner gets the range only once that memset is over: no poison lands
            // on what it writes.
            let lease = pool
                .reserve(16 << 20, Duration::from_secs(10))
                .await
                .unwrap();
            pool.buffer.fill(0, 16 << 20, |m| m.fill(0x5a)).unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
            let kept = pool
                .buffer
                .view(0, 16 << 20, |b| b.iter().all(|&x| x == 0x5a))
                .unwrap();
            assert!(
                kept,
                "round {round}: a dropped reservation's poison landed on the next owner's bytes"
            );
            drop(lease);
            assert_eq!(pool.usage(), (0, 0));
        }
    }
}
