//! EC connector state (no I/O): the consumer's encoder cache by mm_hash.
//!
//! Prefill reserves pool space per mm_hash and grants it to the encoder; an
//! mm_hash already cached (or arriving for another request) is not transferred
//! again (embedding sharing). Unused entries stay cached until space is needed.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::pool::RangeAllocator;

/// What [`EncoderCache::acquire`] decided for one mm_hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EcAcquire {
    /// Cached and verified: use it, transfer nothing.
    Hit { offset: u64, len: u64 },
    /// Another request is receiving it now: wait for it, then ask again.
    Pending,
    /// Reserved for this request: grant it, the encoder writes it.
    Reserve { offset: u64, len: u64 },
    /// No room even after evicting unused entries.
    NoRoom,
}

#[derive(Debug, Clone)]
struct Entry {
    offset: u64,
    len: u64,
    refs: u32,
    ready: bool,
}

#[derive(Debug, Clone)]
pub struct EncoderCache {
    alloc: RangeAllocator,
    entries: HashMap<String, Entry>,
    /// Ready entries without users, least recently released first.
    evictable: VecDeque<String>,
}

impl EncoderCache {
    pub fn new(capacity: u64) -> Self {
        Self {
            alloc: RangeAllocator::new(capacity),
            entries: HashMap::new(),
            evictable: VecDeque::new(),
        }
    }

    /// Takes a use of `mm_hash` (`len` bytes of embeddings).
    pub fn acquire(&mut self, mm_hash: &str, len: u64) -> EcAcquire {
        if let Some(e) = self.entries.get_mut(mm_hash) {
            if !e.ready {
                return EcAcquire::Pending;
            }
            if e.refs == 0 {
                self.evictable.retain(|h| h != mm_hash);
            }
            e.refs += 1;
            return EcAcquire::Hit {
                offset: e.offset,
                len: e.len,
            };
        }
        let got = loop {
            if let Some(r) = self.alloc.alloc(len) {
                break Some(r);
            }
            let Some(victim) = self.evictable.pop_front() else {
                break None;
            };
            if let Some(v) = self.entries.remove(&victim) {
                self.alloc.free(v.offset, v.len);
            }
        };
        match got {
            Some((offset, len)) => {
                self.entries.insert(
                    mm_hash.into(),
                    Entry {
                        offset,
                        len,
                        refs: 1,
                        ready: false,
                    },
                );
                EcAcquire::Reserve { offset, len }
            }
            None => EcAcquire::NoRoom,
        }
    }

    /// The reserved entry arrived and was verified.
    pub fn ready(&mut self, mm_hash: &str) {
        if let Some(e) = self.entries.get_mut(mm_hash) {
            e.ready = true;
        }
    }

    /// The reserved entry failed to arrive: forget it and free its space
    /// (waiters see it gone and reserve it themselves).
    pub fn fail(&mut self, mm_hash: &str) {
        if let Some(e) = self.entries.remove(mm_hash) {
            self.alloc.free(e.offset, e.len);
        }
    }

    /// Drops one use; unused ready entries stay cached (evictable).
    pub fn release(&mut self, mm_hash: &str) {
        if let Some(e) = self.entries.get_mut(mm_hash) {
            e.refs = e.refs.saturating_sub(1);
            if e.refs == 0 && e.ready {
                self.evictable.push_back(mm_hash.into());
            }
        }
    }

    /// Forgets every unused entry.
    pub fn clear(&mut self) {
        while let Some(h) = self.evictable.pop_front() {
            if let Some(e) = self.entries.remove(&h) {
                self.alloc.free(e.offset, e.len);
            }
        }
    }

    /// Entries in use by requests now (referenced or being received).
    pub fn in_use(&self) -> usize {
        self.entries
            .values()
            .filter(|e| e.refs > 0 || !e.ready)
            .count()
    }

    /// (bytes, ranges) of the pool held now, cached entries included.
    pub fn held(&self) -> (u64, usize) {
        (self.alloc.used(), self.alloc.live())
    }
}

/// One encoder output the consumer wants: its grant, or none when cached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EcSlot {
    pub mm_hash: String,
    pub tensor: String,
    pub grant: Option<omnirig_transports::Grant>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dedupes_by_mm_hash() {
        let mut c = EncoderCache::new(1 << 20);
        let EcAcquire::Reserve { offset, len } = c.acquire("a", 5000) else {
            panic!()
        };
        assert_eq!((offset, len), (0, 8192));
        // A second request for the same item waits rather than transferring it again.
        assert_eq!(c.acquire("a", 5000), EcAcquire::Pending);
        c.ready("a");
        assert_eq!(
            c.acquire("a", 5000),
            EcAcquire::Hit {
                offset: 0,
                len: 8192
            }
        );
        assert!(matches!(
            c.acquire("b", 10),
            EcAcquire::Reserve { offset: 8192, .. }
        ));
        c.release("a");
        c.release("a");
        c.fail("b");
        assert_eq!(c.in_use(), 0);
        // Still cached after its users are gone: a later request hits.
        assert!(matches!(c.acquire("a", 5000), EcAcquire::Hit { .. }));
        c.release("a");
        c.clear();
        assert_eq!(c.held(), (0, 0));
    }

    #[test]
    fn evicts_unused_entries_for_room() {
        let mut c = EncoderCache::new(3 * 4096);
        for h in ["x", "y", "z"] {
            assert!(matches!(c.acquire(h, 4096), EcAcquire::Reserve { .. }));
            c.ready(h);
        }
        assert_eq!(c.acquire("w", 4096), EcAcquire::NoRoom);
        c.release("y");
        assert!(matches!(c.acquire("w", 4096), EcAcquire::Reserve { .. }));
        assert_eq!(c.acquire("y", 4096), EcAcquire::NoRoom);
    }
}
