//! A per-thread peak-allocation meter. A test binary installs it with
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: omnirig_test_support::alloc::Counting = omnirig_test_support::alloc::Counting;
//! ```
//!
//! and measures with [`peak_of`]. Counting is per thread, so tests running in parallel do not
//! see each other's allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The system allocator, counting this thread's live bytes and their peak.
pub struct Counting;

// Signed: a thread that frees memory another thread allocated goes below zero, and the peak
// must still rise with what this thread allocates next (unsigned, it wrapped and the peak
// never moved, so every measured peak read 0).
thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn grew(n: usize) {
    // `try_with`: allocations during thread teardown find the counters gone; skip them.
    let _ = LIVE.try_with(|l| {
        let v = l.get().saturating_add_unsigned(n);
        l.set(v);
        let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
    });
}

fn shrank(n: usize) {
    let _ = LIVE.try_with(|l| l.set(l.get().saturating_sub_unsigned(n)));
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// allocator contract holds exactly as it does for `System`; the counters are thread-local
// cells that never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc`'s contract (non-zero size), forwarded as is.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller passes a block this allocator (that is, `System`) returned for
        // `l`, forwarded as is.
        unsafe { System.dealloc(p, l) };
        shrank(l.size());
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: the caller passes a block `System` returned for `l` and a valid new size.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            // Count the moment both blocks may be live.
            grew(new);
            shrank(l.size());
        }
        q
    }
}

/// `f`'s result and the most bytes it held allocated at once (this thread only). Needs
/// [`Counting`] installed as the global allocator; without it the peak reads 0.
pub fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let out = f();
    let peak = PEAK.with(Cell::get).saturating_sub(start);
    (out, usize::try_from(peak).unwrap_or(0))
}

/// Panics unless [`Counting`] is this binary's global allocator: without it every peak reads
/// 0 and a bounded-memory test could never fail. Each test file using [`peak_of`] calls it.
pub fn assert_installed() {
    let (v, peak) = peak_of(|| std::hint::black_box(vec![1u8; 1 << 20]));
    drop(v);
    assert!(
        peak >= 1 << 20,
        "the allocation meter saw {peak} bytes of a 1 MiB allocation: install \
         omnirig_test_support::alloc::Counting as the #[global_allocator]"
    );
}
