//! The meter counts what this thread allocates, and only when installed.

use omnirig_test_support::alloc::{Counting, assert_installed, peak_of};

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn the_meter_sees_allocations_and_their_release() {
    assert_installed();
    let (_, peak) = peak_of(|| {
        let a = std::hint::black_box(vec![0u8; 4 << 20]);
        drop(a);
        std::hint::black_box(vec![0u8; 1 << 20])
    });
    // Released before the second: the peak is the larger, not the sum.
    assert!((4 << 20..5 << 20).contains(&peak), "{peak}");
}
