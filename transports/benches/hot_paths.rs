//! Microbenchmarks of the engine's per-slice hot paths: the grant check a receiver runs before
//! every byte lands, the fence pin around each copy, slicing, and frame headers.
//! Run: `cargo bench -p omnirig-transports`.

use divan::{Bencher, black_box};
use omnirig_transports::batch::slices;
use omnirig_transports::grant::{Access, GrantSpec, GrantTable};
use omnirig_transports::transport::tcp::frame::{FrameKind, Header};

fn main() {
    divan::main();
}

/// A table with `live` grants, as a busy receiver has.
fn table(live: u64) -> (GrantTable, Vec<omnirig_transports::Grant>) {
    let mut t = GrantTable::default();
    let grants = (0..live)
        .map(|i| {
            let spec = GrantSpec {
                buffer: 1,
                buffer_len: 1 << 40,
                offset: i << 20,
                len: 1 << 20,
                access: Access::Write,
                expires: None,
                token: i ^ 0x5eed,
                lease: false,
            };
            t.issue("bench", spec).unwrap()
        })
        .collect();
    (t, grants)
}

#[divan::bench(args = [1, 64, 4096])]
fn grant_admit(b: Bencher, live: u64) {
    let (mut t, grants) = table(live);
    let g = grants[grants.len() / 2].wire();
    b.bench_local(|| black_box(t.admit(Access::Write, black_box(g), 4096, 65536)).is_ok());
}

#[divan::bench]
fn grant_pin_unpin(b: Bencher) {
    let (mut t, grants) = table(1);
    let adm = t.admit(Access::Write, grants[0].wire(), 0, 4096).unwrap();
    b.bench_local(|| drop(black_box(adm.entry.pin().unwrap())));
}

#[divan::bench(args = [64, 4096])]
fn grant_issue_and_revoke(b: Bencher, live: u64) {
    let (mut t, _) = table(live);
    b.bench_local(|| {
        let spec = GrantSpec {
            buffer: 2,
            buffer_len: 1 << 30,
            offset: 0,
            len: 4096,
            access: Access::Write,
            expires: None,
            token: 7,
            lease: true,
        };
        let g = t.issue("bench", spec).unwrap();
        t.revoke(g.epoch)
    });
}

#[divan::bench(args = [1 << 20, 256 << 20])]
fn slicing_512k(len: u64) -> u64 {
    slices(black_box(len), 512 << 10).map(|(_, l)| l).sum()
}

#[divan::bench]
fn frame_header_encode_decode() -> bool {
    let h = Header {
        buffer: 3,
        epoch: 9,
        token: 0xabcdef,
        offset: 128,
        len: 4096,
        ..Header::new(FrameKind::Write, 77)
    };
    Header::decode(&black_box(h).encode(), 64 << 20).is_ok()
}
