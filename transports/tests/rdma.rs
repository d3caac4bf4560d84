//! The rdma verbs layer and the grant fence against a real RDMA device.
//!
//! Needs a device (an HCA, or soft-RoCE): `ci/softroce.sh run -- cargo test -p
//! omnirig-transports --features rdma --test rdma` runs these in a VM with rxe0. Where there is
//! no device each test says it was skipped and how to run it; with OMNIRIG_RDMA_REQUIRED=1 (the
//! soft-RoCE lane sets it) a missing device fails instead.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use omnirig_transports::ErrorKind;
use omnirig_transports::memory::Region;
use omnirig_transports::transport::rdma::fence::FencedGrant;
use omnirig_transports::transport::rdma::keys::{Endpoint, FenceKind, GrantKey};
use omnirig_transports::transport::rdma::verbs::{
    self, Device, MemoryRegistration, QueuePair, RemoteAccess, RemoteOp,
};

fn device(test: &str) -> Option<Arc<Device>> {
    let name = std::env::var("OMNIRIG_RDMA_DEVICE").ok();
    match Device::open(name.as_deref()) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("OMNIRIG_RDMA_REQUIRED").as_deref() == Ok("1") => {
            panic!("{test}: OMNIRIG_RDMA_REQUIRED=1 but {e}")
        }
        Err(e) => {
            skipped(&format!("{test}: {e}. {}", verbs::HOW_TO_RUN));
            None
        }
    }
}

/// Says a test was skipped where the person running cargo test sees it: straight to stderr,
/// past libtest's capture of passing tests' output.
fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {why}");
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// Two RC queue pairs on one device connected to each other, their endpoints sent through the
/// wire encoding as peers would.
fn pair(dev: &Arc<Device>) -> (Arc<QueuePair>, Arc<QueuePair>) {
    let gid = dev.default_gid_index(1).unwrap();
    let a = QueuePair::create(dev, 1, 16).unwrap();
    let b = QueuePair::create(dev, 1, 16).unwrap();
    let ea = Endpoint::from_bytes(&a.endpoint(gid).unwrap().to_bytes()).unwrap();
    let eb = Endpoint::from_bytes(&b.endpoint(gid).unwrap().to_bytes()).unwrap();
    a.connect(&eb, gid).unwrap();
    b.connect(&ea, gid).unwrap();
    (a, b)
}

fn region(len: usize, fill: impl Fn(usize) -> u8) -> Arc<Region> {
    let r = Region::allocate(len, false).unwrap();
    let bytes: Vec<u8> = (0..len).map(fill).collect();
    r.write(0, &bytes).unwrap();
    Arc::new(r)
}

fn contents(r: &Region) -> Vec<u8> {
    let mut v = vec![0u8; r.len()];
    r.read(0, &mut v).unwrap();
    v
}

fn pattern(seed: u64) -> impl Fn(usize) -> u8 {
    move |i| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed).to_le_bytes()[3]
}

/// `len` bytes from `local` into the peer at `key`+`offset` in `slice`-byte work requests.
fn ops(
    write: bool,
    local: &Arc<MemoryRegistration>,
    key: &GrantKey,
    offset: u64,
    len: u64,
    slice: u64,
) -> Vec<RemoteOp> {
    (0..len.div_ceil(slice))
        .map(|i| {
            let off = i * slice;
            let n = slice.min(len - off);
            RemoteOp {
                write,
                local: local.clone(),
                local_offset: off,
                len: n as u32,
                remote_addr: key.addr + offset + off,
                rkey: key.rkey,
            }
        })
        .collect()
}

/// A zeroed `len`-byte target with a read-write grant over all of it, and a `len`-byte
/// source filled with `pattern(seed)`, registered for the device to read.
fn granted_pair(
    dev: &Arc<Device>,
    len: usize,
    seed: u64,
) -> (
    Arc<Region>,
    FencedGrant,
    Arc<Region>,
    Arc<MemoryRegistration>,
) {
    let target = region(len, |_| 0);
    let grant =
        FencedGrant::register(dev, &target, 0, len as u64, RemoteAccess::ReadWrite).unwrap();
    let src = region(len, pattern(seed));
    let src_mr = Arc::new(
        dev.register(&src, 0, len as u64, RemoteAccess::Read)
            .unwrap(),
    );
    (target, grant, src, src_mr)
}

fn median_us(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e6
}

#[test]
fn device_and_port_are_described() {
    let Some(dev) = device("device_and_port_are_described") else {
        return;
    };
    let port = dev.port(1).unwrap();
    assert!(port.active, "{port:?}");
    let gi = dev.default_gid_index(1).unwrap();
    let gid = dev.gid(1, gi).unwrap();
    assert_ne!(gid, [0; 16]);
    println!(
        "RESULT device {} port 1: {} mtu {} ethernet {} gid[{gi}] {:02x?} max_mw {}",
        dev.name(),
        port.state,
        port.mtu,
        port.ethernet,
        gid,
        dev.max_memory_windows()
    );
    // a port that does not exist is refused naming device, port and step
    let e = dev.port(9).unwrap_err();
    assert!(
        e.detail()
            .contains(&format!("rdma device {} port 9: query port", dev.name())),
        "{e}"
    );
    let e = Device::open(Some("no-such-device")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unreachable);
    assert!(e.detail().contains("no-such-device"), "{e}");
}

#[test]
fn write_and_read_between_two_queue_pairs_are_bit_exact() {
    let Some(dev) = device("write_and_read_between_two_queue_pairs_are_bit_exact") else {
        return;
    };
    let (a, b) = pair(&dev);
    const LEN: usize = 1 << 20;
    // target: a 1 MiB + 2 pages buffer, granted [4096, 4096 + 1 MiB) as a registration
    let target = region(LEN + 8192, |_| 0xAA);
    let grant =
        FencedGrant::register(&dev, &target, 4096, LEN as u64, RemoteAccess::ReadWrite).unwrap();
    let key = GrantKey::from_bytes(&grant.key().to_bytes()).unwrap();
    assert_eq!(key.fence, FenceKind::Region);

    let src = region(LEN, pattern(1));
    let src_mr = Arc::new(
        dev.register(&src, 0, LEN as u64, RemoteAccess::Read)
            .unwrap(),
    );
    let t0 = Instant::now();
    // 64 KiB slices, more slices than the queue pair lets out at once (16)
    a.run(&ops(true, &src_mr, &key, 0, LEN as u64, 65536), deadline())
        .unwrap();
    let wt = t0.elapsed();
    let got = contents(&target);
    assert_eq!(
        &got[4096..4096 + LEN],
        &contents(&src)[..],
        "written bytes differ"
    );
    assert!(
        got[..4096]
            .iter()
            .chain(&got[4096 + LEN..])
            .all(|&x| x == 0xAA)
    );

    let back = region(LEN, |_| 0);
    let back_mr = Arc::new(
        dev.register(&back, 0, LEN as u64, RemoteAccess::Write)
            .unwrap(),
    );
    let t0 = Instant::now();
    a.run(
        &ops(false, &back_mr, &key, 0, LEN as u64, 65536),
        deadline(),
    )
    .unwrap();
    let rt = t0.elapsed();
    assert_eq!(contents(&back), contents(&src), "read bytes differ");
    println!(
        "RESULT 1 MiB in 64 KiB slices, 16 outstanding: WRITE {:.1} ms ({:.0} MB/s), READ {:.1} ms ({:.0} MB/s)",
        wt.as_secs_f64() * 1e3,
        LEN as f64 / wt.as_secs_f64() / 1e6,
        rt.as_secs_f64() * 1e3,
        LEN as f64 / rt.as_secs_f64() / 1e6
    );
    grant.revoke(deadline()).unwrap();
    drop(b);
}

/// One WRITE of `len` bytes at `offset` into the grant through a fresh pair; the grant is
/// made by `fence` on the target side (b) after `before` ran.
fn canary(
    dev: &Arc<Device>,
    use_window: bool,
    offset: i64,
    len: u64,
    revoke_first: bool,
) -> (omnirig_transports::Result<()>, Vec<u8>) {
    const GRANT_OFF: u64 = 4196; // not page aligned: the fence must hold mid-page
    const GRANT_LEN: u64 = 8000;
    let (a, b) = pair(dev);
    let target = region(32768, |_| 0xAA);
    let whole = Arc::new(
        dev.register(&target, 0, 32768, RemoteAccess::Write)
            .unwrap(),
    );
    let grant = if use_window {
        FencedGrant::bind_window(
            &b,
            dev.alloc_window().unwrap(),
            &whole,
            GRANT_OFF,
            GRANT_LEN,
            RemoteAccess::Write,
            deadline(),
        )
        .unwrap()
    } else {
        FencedGrant::register(dev, &target, GRANT_OFF, GRANT_LEN, RemoteAccess::Write).unwrap()
    };
    // the whole-buffer registration exists in both cases; its rkey is never handed out. The
    // window case needs it to bind; the region case keeps it to show a second MR over the same
    // pages does not widen what the grant's rkey reaches.
    let key = grant.key();
    let src = region(len as usize, |_| 0x55);
    let src_mr = Arc::new(dev.register(&src, 0, len, RemoteAccess::Read).unwrap());
    if revoke_first {
        // a first, in-range write succeeds, then revoke, then the write under test
        let ok_src = region(16, |_| 0x11);
        let ok_mr = Arc::new(dev.register(&ok_src, 0, 16, RemoteAccess::Read).unwrap());
        a.run(&ops(true, &ok_mr, &key, 0, 16, 16), deadline())
            .unwrap();
        grant.revoke(deadline()).unwrap();
    }
    // bypass GrantKey::remote_addr's own check: this is what a misbehaving peer would post
    let op = RemoteOp {
        write: true,
        local: src_mr.clone(),
        local_offset: 0,
        len: len as u32,
        remote_addr: key.addr.wrapping_add_signed(offset),
        rkey: key.rkey,
    };
    let r = a.run(&[op], deadline());
    let bytes = contents(&target);
    drop(whole);
    (r, bytes)
}

/// Runs the canaries on one fence; returns, per canary, whether the device refused it and how
/// many bytes outside the grant (or after revoke) changed. Only in-range success is asserted
/// here; the callers assert what each fence must hold.
fn canaries(dev: &Arc<Device>, use_window: bool) -> Vec<(&'static str, Option<String>, usize)> {
    let fence = if use_window { "window" } else { "region" };
    let outside = |b: &[u8]| {
        b[..4196]
            .iter()
            .chain(&b[12196..])
            .filter(|&&x| x != 0xAA)
            .count()
    };
    // in range: lands, and nothing around it moves
    let (r, b) = canary(dev, use_window, 0, 8000, false);
    r.unwrap_or_else(|e| panic!("{fence}: in-range write failed: {e}"));
    assert!(
        b[4196..12196].iter().all(|&x| x == 0x55),
        "{fence}: in-range write missing"
    );
    assert_eq!(
        outside(&b),
        0,
        "{fence}: an in-range write changed bytes outside the grant"
    );
    let mut out = Vec::new();
    let (r, b) = canary(dev, use_window, 0, 8001, false);
    out.push((
        "write 1 byte past the grant",
        r.err().map(|e| e.to_string()),
        outside(&b),
    ));
    let (r, b) = canary(dev, use_window, -1, 16, false);
    out.push((
        "write starting 1 byte before the grant",
        r.err().map(|e| e.to_string()),
        outside(&b),
    ));
    let (r, b) = canary(dev, use_window, 0, 16, true);
    assert!(
        b[4196..4212].iter().all(|&x| x == 0x11),
        "{fence}: the pre-revoke write is lost"
    );
    let changed = b
        .iter()
        .enumerate()
        .filter(|&(i, &x)| {
            x != if (4196..4212).contains(&i) {
                0x11
            } else {
                0xAA
            }
        })
        .count();
    out.push((
        "write after revoke",
        r.err().map(|e| e.to_string()),
        changed,
    ));
    for (what, refused, changed) in &out {
        match refused {
            Some(e) => {
                println!("RESULT canary {fence}: {what}: refused, {changed} bytes changed: {e}")
            }
            None => println!("RESULT canary {fence}: {what}: NOT refused, {changed} bytes changed"),
        }
    }
    out
}

#[test]
fn canaries_a_write_past_the_grant_and_a_write_after_revoke_are_refused() {
    let Some(dev) = device("canaries_a_write_past_the_grant_and_a_write_after_revoke_are_refused")
    else {
        return;
    };
    // the fence the transport uses: a memory region per grant
    for (what, refused, changed) in canaries(&dev, false) {
        let e =
            refused.unwrap_or_else(|| panic!("region fence: {what}: the device let it through"));
        assert!(
            e.contains("IBV_WC_REM_ACCESS_ERR"),
            "region fence: {what}: {e}"
        );
        assert!(
            e.contains("access not permitted"),
            "region fence: {what}: kind: {e}"
        );
        assert_eq!(
            changed, 0,
            "region fence: {what}: refused, yet bytes changed"
        );
    }
}

/// Memory windows are measured, not relied on: record what this device enforces.
#[test]
fn canaries_on_memory_windows_are_recorded() {
    let Some(dev) = device("canaries_on_memory_windows_are_recorded") else {
        return;
    };
    if let Err(e) = dev.alloc_window() {
        println!(
            "RESULT memory windows: not supported on {}: {e}",
            dev.name()
        );
        return;
    }
    let out = canaries(&dev, true);
    // whatever the range check does, a revoked (invalidated) window must be dead
    let (what, refused, changed) = &out[2];
    assert!(
        refused.is_some(),
        "window: {what}: the device let it through"
    );
    assert_eq!(*changed, 0, "window: {what}");
}

#[test]
fn fence_costs_window_bind_invalidate_vs_region_register_deregister() {
    let Some(dev) = device("fence_costs_window_bind_invalidate_vs_region_register_deregister")
    else {
        return;
    };
    const N: usize = 21;
    for len in [64u64 << 10, 1 << 20, 16 << 20] {
        let target = region(len as usize, |_| 0);
        let mut reg = Vec::new();
        let mut dereg = Vec::new();
        for _ in 0..N {
            let t = Instant::now();
            let g = FencedGrant::register(&dev, &target, 0, len, RemoteAccess::Write).unwrap();
            reg.push(t.elapsed());
            let t = Instant::now();
            g.revoke(deadline()).unwrap();
            dereg.push(t.elapsed());
        }
        println!(
            "RESULT fence region {} KiB: register {:.1} us, deregister {:.1} us (median of {N})",
            len >> 10,
            median_us(reg),
            median_us(dereg)
        );
        let Ok(mut mw) = dev.alloc_window() else {
            println!("RESULT fence window: memory windows not supported");
            continue;
        };
        let (_a, b) = pair(&dev);
        let whole = Arc::new(dev.register(&target, 0, len, RemoteAccess::Write).unwrap());
        let mut bind = Vec::new();
        let mut inv = Vec::new();
        for _ in 0..N {
            let t = Instant::now();
            let g =
                FencedGrant::bind_window(&b, mw, &whole, 0, len, RemoteAccess::Write, deadline())
                    .unwrap();
            bind.push(t.elapsed());
            let t = Instant::now();
            mw = g.revoke(deadline()).unwrap().expect("a window comes back");
            inv.push(t.elapsed());
        }
        println!(
            "RESULT fence window {} KiB: bind {:.1} us, invalidate {:.1} us (median of {N})",
            len >> 10,
            median_us(bind),
            median_us(inv)
        );
    }
}

#[test]
fn a_deadline_moves_the_queue_pair_to_error_and_drains_it() {
    let Some(dev) = device("a_deadline_moves_the_queue_pair_to_error_and_drains_it") else {
        return;
    };
    let (a, b) = pair(&dev);
    let (_target, grant, _src, src_mr) = granted_pair(&dev, 1 << 20, 2);
    // the peer's queue pair dies silently: no acknowledgement ever comes back
    b.set_error().unwrap();
    let t = Instant::now();
    let e = a
        .run(
            &ops(true, &src_mr, &grant.key(), 0, 1 << 20, 65536),
            Instant::now() + Duration::from_millis(100),
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert!(
        a.is_error(),
        "the queue pair must be in ERROR after a timeout"
    );
    println!(
        "RESULT timeout: {e} (returned after {:.0} ms, drained)",
        t.elapsed().as_secs_f64() * 1e3
    );
    // nothing is in flight any more and nothing new runs on it
    let e = a
        .run(&ops(true, &src_mr, &grant.key(), 0, 16, 16), deadline())
        .unwrap_err();
    assert!(
        e.detail().contains("IBV_WC_WR_FLUSH_ERR") || e.detail().contains("post"),
        "{e}"
    );
}

/// A dead peer ends the request with the verbs status (retry exceeded) or, at the latest, at the
/// deadline; it never hangs and never touches the target. (On rxe 6.1 loopback, with the peer's
/// queue pair in ERROR or destroyed and ibv_query_qp confirming timeout 14 / retry 7 / RNR
/// retry 7, no retry-exceeded completion came within 20 s: the deadline ends it.)
#[test]
fn a_dead_peer_fails_by_retry_exceeded_or_the_deadline() {
    let Some(dev) = device("a_dead_peer_fails_by_retry_exceeded_or_the_deadline") else {
        return;
    };
    let (a, b) = pair(&dev);
    let (target, grant, _src, src_mr) = granted_pair(&dev, 4096, 3);
    // ~67 ms per try, 7 retries: what connect set, as the device reports it
    assert_eq!(a.retry_attributes().unwrap(), (14, 7, 7));
    b.set_error().unwrap();
    let t = Instant::now();
    let e = a
        .run(
            &ops(true, &src_mr, &grant.key(), 0, 4096, 4096),
            Instant::now() + Duration::from_secs(3),
        )
        .unwrap_err();
    match e.kind() {
        ErrorKind::PeerDisconnected => assert!(e.detail().contains("IBV_WC_RETRY_EXC_ERR"), "{e}"),
        ErrorKind::TimedOut => {}
        k => panic!("unexpected {k:?}: {e}"),
    }
    assert!(a.is_error());
    assert!(
        target
            .with_slice(0, 4096, |s| s.iter().all(|&x| x == 0))
            .unwrap()
    );
    println!(
        "RESULT dead peer: {e} after {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
}

// ---------------------------------------------------------------------------------------------
// The transport: a target node with its control server and grant table, an initiator link.
// ---------------------------------------------------------------------------------------------

mod transport {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use omnirig_transports::grant::{Access, Grant, GrantSpec, GrantTable};
    use omnirig_transports::memory::Region;
    use omnirig_transports::segment::SegmentDescriptor;
    use omnirig_transports::transport::rdma::link::{
        Admit, RdmaConfig, RdmaNode, RdmaServer, RdmaTransport,
    };
    use omnirig_transports::transport::{Link, OpKind, SliceOp, Transport, TransportKind};
    use omnirig_transports::{Error, ErrorKind};
    use tracing_test::traced_test;

    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use omnirig_transports::memory::DeviceMemory;
    use omnirig_transports::staging::StagingPool;
    use omnirig_transports::transport::cuda::gpudirect::RegistrationPath;

    use super::{FenceKind, contents, device, pattern, region};

    struct Target {
        node: Arc<RdmaNode>,
        table: Arc<Mutex<GrantTable>>,
        regions: Arc<HashMap<u32, Arc<Region>>>,
        server: RdmaServer,
    }

    fn target(regions: HashMap<u32, Arc<Region>>) -> Target {
        let node = RdmaNode::open(RdmaConfig::default()).unwrap();
        let table = Arc::new(Mutex::new(GrantTable::default()));
        let (t, r) = (table.clone(), Arc::new(regions));
        let r2 = r.clone();
        // what the engine's admission handle does: the grant table's check, then the buffer
        let admit: Admit = Arc::new(move |access, wire| {
            let a = t.lock().unwrap().admit(access, wire, 0, 1)?;
            let region = r
                .get(&wire.buffer)
                .cloned()
                .ok_or_else(|| Error::new(ErrorKind::UnknownBuffer, "no such buffer"))?;
            Ok((region, a.entry.grant.clone()))
        });
        let server = RdmaServer::start(node.clone(), admit).unwrap();
        Target {
            node,
            table,
            regions: r2,
            server,
        }
    }

    impl Target {
        fn grant(&self, buffer: u32, len_of: u64, offset: u64, len: u64, access: Access) -> Grant {
            self.grant_fenced(buffer, len_of, offset, len, access, FenceKind::Region)
        }

        fn grant_fenced(
            &self,
            buffer: u32,
            len_of: u64,
            offset: u64,
            len: u64,
            access: Access,
            fence: FenceKind,
        ) -> Grant {
            let g = self
                .table
                .lock()
                .unwrap()
                .issue(
                    "target",
                    GrantSpec {
                        buffer,
                        buffer_len: len_of,
                        offset,
                        len,
                        access,
                        expires: None,
                        token: 0x5eed_0000 + offset,
                        lease: false,
                    },
                )
                .unwrap();
            // what the engine's grant hook does: the key is made when the grant is issued and
            // travels inside it
            let mut g = g;
            let bytes = self
                .node
                .on_grant(&g, &self.regions[&buffer])
                .unwrap()
                .unwrap();
            let key =
                omnirig_transports::transport::rdma::keys::GrantKey::from_bytes(&bytes).unwrap();
            assert_eq!((key.len, key.fence), (len, fence));
            g.keys.push(omnirig_transports::grant::GrantKey {
                kind: TransportKind::Rdma,
                bytes,
            });
            g
        }

        fn revoke(&self, g: &Grant) {
            assert!(self.table.lock().unwrap().revoke(g.epoch));
            self.node.revoke_grant(&g.wire()).unwrap();
        }
    }

    fn descriptor() -> SegmentDescriptor {
        SegmentDescriptor::new("target", 1, vec![], vec![])
    }

    /// `len` bytes of `local` from 0 into / out of the grant, cut as the link asks.
    async fn transfer(
        link: &Arc<dyn Link>,
        kind: OpKind,
        local: &Arc<Region>,
        g: &Grant,
        len: u64,
    ) -> omnirig_transports::Result<()> {
        let slice = link.slicing().slice_size;
        let mut off = 0;
        while off < len {
            let n = slice.min(len - off);
            link.execute(SliceOp {
                kind,
                local: local.clone(),
                local_offset: off,
                grant: g.wire(),
                key: g.key(TransportKind::Rdma).map(Arc::from),
                grant_offset: off,
                len: n,
                tag: 7,
                request_offset: off,
                request_len: len,
                alone: true,
            })
            .await?;
            off += n;
        }
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[traced_test]
    async fn push_pull_revoke_and_reconnect_through_the_link() {
        if device("push_pull_revoke_and_reconnect_through_the_link").is_none() {
            return;
        }
        const BUF: u64 = 12 << 20;
        const LEN: u64 = (9 << 20) + 123; // more than two slices, odd tail
        const OFF: u64 = 4096 + 7;
        let dst = region(BUF as usize, |_| 0);
        let t = target(HashMap::from([(1, dst.clone())]));
        let init = RdmaNode::open(RdmaConfig::default()).unwrap();
        let transport = RdmaTransport::new(init.clone());
        assert!(!transport.reaches(&descriptor()));
        transport.add_peer("target", t.server.addr());
        assert!(transport.reaches(&descriptor()));
        let link = transport.connect(descriptor()).await.unwrap();
        assert_eq!(
            link.info().transport,
            omnirig_transports::TransportKind::Rdma
        );
        assert!(
            link.info().device.contains("rxe0") || std::env::var("OMNIRIG_RDMA_DEVICE").is_ok()
        );
        assert!(logs_contain("rdma: selected device, port and GID for peer"));
        assert!(logs_contain("gid_index="));

        // push: one-sided WRITE into the write grant, bit-exact, nothing around it moves
        let src = region(LEN as usize, pattern(9));
        let wg = t.grant(1, BUF, OFF, LEN, Access::Write);
        let t0 = std::time::Instant::now();
        transfer(&link, OpKind::Write, &src, &wg, LEN)
            .await
            .unwrap();
        let push = t0.elapsed();
        let got = contents(&dst);
        assert_eq!(
            &got[OFF as usize..(OFF + LEN) as usize],
            &contents(&src)[..]
        );
        assert!(got[..OFF as usize].iter().all(|&x| x == 0));
        assert!(got[(OFF + LEN) as usize..].iter().all(|&x| x == 0));
        assert_eq!(t.node.fenced_grants(), 1);

        // revoke, then the initiator (still holding the key) writes again: the device refuses,
        // and the target's admission says why
        t.revoke(&wg);
        assert_eq!(t.node.fenced_grants(), 0);
        let other = region(64, |_| 0xEE);
        let e = transfer(&link, OpKind::Write, &other, &wg, 64)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::GrantRevoked, "{e}");
        assert!(e.detail().contains("IBV_WC_REM_ACCESS_ERR"), "{e}");
        assert_eq!(e.peer(), Some("target"));
        assert_eq!(
            contents(&dst),
            got,
            "a write after revoke changed the target"
        );
        println!("RESULT transport: write after revoke: {e}");

        // pull: a read grant over the same range; the broken queue pair is re-established
        let rg = t.grant(1, BUF, OFF, LEN, Access::Read);
        let back = region(LEN as usize, |_| 0);
        let t0 = std::time::Instant::now();
        transfer(&link, OpKind::Read, &back, &rg, LEN)
            .await
            .unwrap();
        let pull = t0.elapsed();
        assert_eq!(contents(&back), contents(&src));

        // a write under a read grant: the key itself only allows READ on the device
        let e = transfer(&link, OpKind::Write, &other, &rg, 64)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AccessDenied, "{e}");
        assert_eq!(contents(&dst), got);

        // a fresh link reads with the revoked grant's key: the device refuses it, and the
        // target's admission names why
        t.revoke(&rg);
        let fresh = transport.connect(descriptor()).await.unwrap();
        let e = transfer(&fresh, OpKind::Read, &back, &rg, 64)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::GrantRevoked, "{e}");
        assert!(e.detail().contains("IBV_WC_REM_ACCESS_ERR"), "{e}");

        // a grant that carries no rdma key is refused before anything is posted
        let mut keyless = t.grant(1, BUF, OFF, 64, Access::Write);
        keyless.keys.clear();
        let e = transfer(&fresh, OpKind::Write, &other, &keyless, 64)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoTransport, "{e}");
        assert!(e.detail().contains("carries no rdma key"), "{e}");
        assert_eq!(contents(&dst), got);
        t.revoke(&keyless);
        assert_eq!(t.node.fenced_grants(), 0);
        // the unregister hook drops the local registrations the slices made
        let before = init.local_registrations();
        assert!(before >= 3, "{before} local registrations");
        for r in [&src, &back, &other] {
            transport.on_unregister(0, r);
        }
        assert_eq!(init.local_registrations(), before - 3);
        println!(
            "RESULT transport: push {:.1} MiB in {:.0} ms ({:.0} MB/s), pull in {:.0} ms ({:.0} MB/s)",
            LEN as f64 / 1048576.0,
            push.as_secs_f64() * 1e3,
            LEN as f64 / push.as_secs_f64() / 1e6,
            pull.as_secs_f64() * 1e3,
            LEN as f64 / pull.as_secs_f64() / 1e6
        );
    }

    fn descriptor_named(name: &str) -> SegmentDescriptor {
        SegmentDescriptor::new(name, 1, vec![], vec![])
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_peer_does_not_starve_a_healthy_one_and_its_link_recovers() {
        if device("a_dead_peer_does_not_starve_a_healthy_one_and_its_link_recovers").is_none() {
            return;
        }
        const MB: u64 = 1 << 20;
        let dead_buf = region(MB as usize, |_| 0);
        let ok_buf = region(4 * MB as usize, |_| 0);
        let t_dead = target(HashMap::from([(1, dead_buf.clone())]));
        let t_ok = target(HashMap::from([(1, ok_buf.clone())]));
        let transport = RdmaTransport::new(RdmaNode::open(RdmaConfig::default()).unwrap());
        transport.add_peer("dead", t_dead.server.addr());
        transport.add_peer("ok", t_ok.server.addr());
        let link_dead = transport.connect(descriptor_named("dead")).await.unwrap();
        let link_ok = transport.connect(descriptor_named("ok")).await.unwrap();
        let gd = t_dead.grant(1, MB, 0, MB, Access::Write);
        let go = t_ok.grant(1, 4 * MB, 0, 4 * MB, Access::Write);
        let src = region(4 * MB as usize, pattern(5));
        // both links connected and holding their keys: what follows is the data path only
        transfer(&link_dead, OpKind::Write, &src, &gd, 4096)
            .await
            .unwrap();
        transfer(&link_ok, OpKind::Write, &src, &go, 4096)
            .await
            .unwrap();

        t_dead.server.fail_queue_pairs(); // the dead peer answers nothing from now on
        let (l, s, g) = (link_dead.clone(), src.clone(), gd.clone());
        let stuck = tokio::spawn(async move {
            tokio::time::timeout(
                std::time::Duration::from_secs(2),
                transfer(&l, OpKind::Write, &s, &g, MB),
            )
            .await
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        // meanwhile the healthy peer's transfer runs to the end
        transfer(&link_ok, OpKind::Write, &src, &go, 4 * MB)
            .await
            .unwrap();
        assert_eq!(contents(&ok_buf), contents(&src));
        let healthy_done_while_stuck = !stuck.is_finished();
        match stuck.await.unwrap() {
            Err(_elapsed) => {}
            Ok(Err(e)) => assert_eq!(e.kind(), ErrorKind::PeerDisconnected, "{e}"),
            Ok(Ok(())) => panic!("a write to a dead peer succeeded"),
        }
        // the canceled transfer was drained: nothing past the warm-up landed
        let d = contents(&dead_buf);
        assert!(
            d[4096..].iter().all(|&x| x == 0),
            "a canceled write landed later"
        );
        println!(
            "RESULT dead peer: healthy 4 MiB finished while the dead transfer was pending: {healthy_done_while_stuck}"
        );
        // the broken queue pair is replaced on next use (the control connection still works)
        transfer(&link_dead, OpKind::Write, &src, &gd, MB)
            .await
            .unwrap();
        assert_eq!(&contents(&dead_buf)[..], &contents(&src)[..MB as usize]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shut_down_target_refuses_new_links_and_fails_its_queue_pairs() {
        if device("a_shut_down_target_refuses_new_links_and_fails_its_queue_pairs").is_none() {
            return;
        }
        let buf = region(1 << 20, |_| 0);
        let mut t = target(HashMap::from([(1, buf.clone())]));
        let transport = RdmaTransport::new(RdmaNode::open(RdmaConfig::default()).unwrap());
        transport.add_peer("target", t.server.addr());
        let link = transport.connect(descriptor()).await.unwrap();
        let g = t.grant(1, 1 << 20, 0, 1 << 20, Access::Write);
        let src = region(1 << 20, pattern(6));
        transfer(&link, OpKind::Write, &src, &g, 4096)
            .await
            .unwrap();
        t.server.shutdown();
        let e = match transport.connect(descriptor()).await {
            Ok(_) => panic!("connected to a shut-down target"),
            Err(e) => e,
        };
        assert_eq!(e.kind(), ErrorKind::Unreachable, "{e}");
        // the old link's requests get no answer now: the closed control connection says the
        // peer is gone, so they fail at once (not at the deadline) and nothing lands
        let t0 = std::time::Instant::now();
        let e = transfer(&link, OpKind::Write, &src, &g, 1 << 20)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PeerDisconnected, "{e}");
        println!(
            "RESULT shut-down peer: {e} after {:.0} ms",
            t0.elapsed().as_secs_f64() * 1e3
        );
        assert!(contents(&buf)[4096..].iter().all(|&x| x == 0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_peer_fails_at_connect_naming_it() {
        if device("an_unreachable_peer_fails_at_connect_naming_it").is_none() {
            return;
        }
        let init = RdmaNode::open(RdmaConfig::default()).unwrap();
        let transport = RdmaTransport::new(init);
        // a port nobody listens on
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        transport.add_peer("target", addr);
        let e = match transport.connect(descriptor()).await {
            Ok(_) => panic!("connected to nobody"),
            Err(e) => e,
        };
        assert_eq!(e.kind(), ErrorKind::Unreachable, "{e}");
        assert_eq!(e.peer(), Some("target"));
    }

    // -----------------------------------------------------------------------------------------
    // GPU memory on the rdma transport. A `FakeGpu` is a DeviceMemory made of host memory (so
    // this runs in the soft-RoCE VM, which has no GPU): the engine treats it exactly as GPU
    // memory (never registers or dereferences it directly), so the staged path and the
    // GPUDirect decision are what runs. Its "dma-buf" is a memfd, which no RDMA device accepts:
    // the registration is refused, as on a cluster whose HCA, kernel or rdma-core lacks it.
    // -----------------------------------------------------------------------------------------

    struct FakeGpu {
        staging: [Arc<StagingPool>; 2],
        dmabuf: bool,
        exports: AtomicUsize,
    }

    impl FakeGpu {
        fn new(dmabuf: bool) -> Arc<Self> {
            let pool = |dir: &str| {
                StagingPool::new(
                    format!("fake {dir}"),
                    4,
                    1 << 20,
                    Box::new(|n| Region::allocate(n, false)),
                )
                .unwrap()
            };
            Arc::new(Self {
                staging: [pool("inbound"), pool("outbound")],
                dmabuf,
                exports: AtomicUsize::new(0),
            })
        }

        fn region(self: &Arc<Self>, len: usize, fill: impl Fn(usize) -> u8) -> Arc<Region> {
            let host = Region::allocate(len, false).unwrap();
            let addr = host.addr();
            let dev: Arc<dyn DeviceMemory> = self.clone();
            // SAFETY: `host` backs the region for its whole life; every access goes through
            // the copies below, which treat the address as the host memory it is.
            let r = unsafe { Region::from_device(addr, len, dev, host) }.unwrap();
            let bytes: Vec<u8> = (0..len).map(fill).collect();
            r.write(0, &bytes).unwrap();
            Arc::new(r)
        }
    }

    impl DeviceMemory for FakeGpu {
        fn describe(&self) -> String {
            "fake-gpu:0 (host memory)".into()
        }
        unsafe fn copy_in(&self, dst: usize, src: &[u8]) -> omnirig_transports::Result<()> {
            // SAFETY: the caller's contract: dst..dst+len is live memory of this "device".
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
            Ok(())
        }
        unsafe fn copy_out(&self, src: usize, dst: &mut [u8]) -> omnirig_transports::Result<()> {
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
            Ok(())
        }
        unsafe fn copy_raw(
            &self,
            dst: usize,
            src: usize,
            len: usize,
        ) -> omnirig_transports::Result<()> {
            // SAFETY: as above; the ranges do not overlap (the caller's contract).
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
            Ok(())
        }
        fn staging(&self, outbound: bool) -> &Arc<StagingPool> {
            &self.staging[outbound as usize]
        }
        fn dmabuf_supported(&self) -> omnirig_transports::Result<bool> {
            Ok(self.dmabuf)
        }
        fn export_dmabuf(
            &self,
            _addr: usize,
            len: usize,
        ) -> omnirig_transports::Result<(OwnedFd, u64)> {
            self.exports.fetch_add(1, Ordering::SeqCst);
            // SAFETY: plain syscall with a valid C string; the fd is ours.
            let fd = unsafe { libc::memfd_create(c"not-a-dmabuf".as_ptr(), 0) };
            assert!(fd >= 0);
            // SAFETY: just opened, owned here.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: fd is a live memfd.
            let sized = unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) };
            assert_eq!(sized, 0);
            Ok((fd, 0))
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[traced_test]
    async fn gpu_memory_without_gpudirect_is_staged_bit_exact_and_said_once() {
        if device("gpu_memory_without_gpudirect_is_staged_bit_exact_and_said_once").is_none() {
            return;
        }
        const BUF: u64 = 6 << 20;
        const LEN: u64 = (3 << 20) + 77; // several staging buffers, odd tail
        const OFF: u64 = 4096 + 5;
        let dst = region(BUF as usize, |_| 0);
        let gpu = FakeGpu::new(true);
        let theirs = gpu.region(1 << 20, |_| 0);
        let t = target(HashMap::from([(1, dst.clone()), (2, theirs.clone())]));
        let init = RdmaNode::open(RdmaConfig::default()).unwrap();
        let transport = RdmaTransport::new(init.clone());
        transport.add_peer("target", t.server.addr());
        let link = transport.connect(descriptor()).await.unwrap();

        // the GPU says it exports dma-bufs: GPUDirect is tried once, the device refuses the
        // registration, and the engine stages from then on (registering the buffer still works)
        let src = gpu.region(LEN as usize, pattern(5));
        transport.on_register(1, &src).unwrap();
        assert_eq!(gpu.exports.load(Ordering::SeqCst), 1);
        let why = match init.gpu_path(&src) {
            RegistrationPath::Staged(why) => why,
            p => panic!("{p:?}"),
        };
        assert!(why.contains("refused to register GPU memory"), "{why}");
        assert!(why.contains("ibv_reg_dmabuf_mr"), "{why}");
        assert_eq!(
            init.local_registrations(),
            0,
            "GPU memory registered directly"
        );

        // push from GPU memory, through the outbound staging buffers, bit-exact
        let wg = t.grant(1, BUF, OFF, LEN, Access::Write);
        transfer(&link, OpKind::Write, &src, &wg, LEN)
            .await
            .unwrap();
        let got = contents(&dst);
        assert_eq!(
            &got[OFF as usize..(OFF + LEN) as usize],
            &contents(&src)[..]
        );
        assert!(got[..OFF as usize].iter().all(|&x| x == 0));
        assert!(got[(OFF + LEN) as usize..].iter().all(|&x| x == 0));
        let out = gpu.staging(true);
        assert!(out.allocated() >= 1, "the write was not staged");
        assert_eq!(out.outstanding(), 0, "staging buffers leaked");

        // a revoked grant is refused on the staged path too, and names why
        t.revoke(&wg);
        let e = transfer(&link, OpKind::Write, &src, &wg, 64)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::GrantRevoked, "{e}");
        assert_eq!(out.outstanding(), 0);
        assert_eq!(
            contents(&dst),
            got,
            "a write after revoke changed the target"
        );

        // pull into GPU memory, through the inbound staging buffers
        let back = gpu.region(LEN as usize, |_| 0);
        transport.on_register(2, &back).unwrap();
        let rg = t.grant(1, BUF, OFF, LEN, Access::Read);
        transfer(&link, OpKind::Read, &back, &rg, LEN)
            .await
            .unwrap();
        assert_eq!(contents(&back), contents(&src));
        assert!(
            gpu.staging(false).allocated() >= 1,
            "the read was not staged"
        );
        assert_eq!(gpu.staging(false).outstanding(), 0);
        assert_eq!(
            gpu.exports.load(Ordering::SeqCst),
            1,
            "probed more than once"
        );
        assert_eq!(init.local_registrations(), 0);

        // a GPU that cannot export: staged from the start, without trying
        let plain = FakeGpu::new(false);
        let t2 = RdmaNode::open(RdmaConfig::default()).unwrap();
        let r = plain.region(4096, |_| 1);
        match t2.gpu_path(&r) {
            RegistrationPath::Staged(why) => {
                assert!(why.contains("cannot export dma-bufs"), "{why}")
            }
            p => panic!("{p:?}"),
        }
        assert_eq!(plain.exports.load(Ordering::SeqCst), 0);

        // the target side: GPU memory that engine stages is granted through a host bounce
        // buffer (the key says so); a write reaches the GPU when the target serves the sync that
        // follows it, a read grant is filled from the GPU when issued
        t.revoke(&rg);
        const TLEN: u64 = (1 << 20) - 8192 + 5; // several work requests, odd tail
        const TOFF: u64 = 4096 + 3;
        let (a, b) = (TOFF as usize, (TOFF + TLEN) as usize);
        let hsrc = region(TLEN as usize, pattern(11));
        let tg = t.grant_fenced(2, 1 << 20, TOFF, TLEN, Access::Write, FenceKind::Staged);
        transfer(&link, OpKind::Write, &hsrc, &tg, TLEN)
            .await
            .unwrap();
        let on_gpu = contents(&theirs);
        assert_eq!(&on_gpu[a..b], &contents(&hsrc)[..]);
        assert!(on_gpu[..a].iter().all(|&x| x == 0) && on_gpu[b..].iter().all(|&x| x == 0));
        t.revoke(&tg);
        let e = transfer(&link, OpKind::Write, &region(64, |_| 0xEE), &tg, 64)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::GrantRevoked, "{e}");
        assert_eq!(
            contents(&theirs),
            on_gpu,
            "a write after revoke reached the GPU"
        );
        // staged GPU memory read into staged GPU memory: both sides stage
        let rg2 = t.grant_fenced(2, 1 << 20, TOFF, TLEN, Access::Read, FenceKind::Staged);
        let gback = gpu.region(TLEN as usize, |_| 0);
        transfer(&link, OpKind::Read, &gback, &rg2, TLEN)
            .await
            .unwrap();
        assert_eq!(contents(&gback), contents(&hsrc));
        assert_eq!(gpu.staging(false).outstanding(), 0);
        t.revoke(&rg2);
        assert_eq!(t.node.fenced_grants(), 0);
        assert_eq!(
            init.local_registrations(),
            2,
            "the two host sources, never GPU memory"
        );

        // said once per engine (the initiator, the second node, the target), never per buffer
        logs_assert(|lines: &[&str]| {
            let n = lines
                .iter()
                .filter(|l| l.contains("rdma: GPUDirect RDMA unavailable"))
                .count();
            match n {
                3 => Ok(()),
                n => Err(format!("{n} staging notices")),
            }
        });
    }
}

/// `ops` for the `part`th MiB of both sides.
fn mib_part(local: &Arc<MemoryRegistration>, key: &GrantKey, part: u64) -> Vec<RemoteOp> {
    let mut v = ops(true, local, key, part << 20, 1 << 20, 65536);
    for op in &mut v {
        op.local_offset += part << 20;
    }
    v
}

/// Several runs under way on one queue pair at once (how a batch's slices go out back to
/// back): their work requests share the send queue and every completion reaches its own run,
/// whichever thread polled it.
#[test]
fn several_runs_share_a_queue_pair_bit_exact() {
    let Some(dev) = device("several_runs_share_a_queue_pair_bit_exact") else {
        return;
    };
    let (a, _b) = pair(&dev);
    let (target, grant, src, src_mr) = granted_pair(&dev, 4 << 20, 7);
    // 4 runs of 16 requests each, all started before any is pumped: 64 requests for the queue
    // pair's 16 send queue entries
    let mut runs: Vec<_> = (0..4)
        .map(|i| {
            a.start(mib_part(&src_mr, &grant.key(), i), deadline())
                .unwrap()
        })
        .collect();
    std::thread::scope(|s| {
        for run in runs.iter_mut() {
            s.spawn(move || while !run.pump(deadline(), None).unwrap() {});
        }
    });
    assert!(!a.is_error());
    assert!(contents(&target) == contents(&src), "bytes differ");
    // one completion per chain of 16 freed every entry before it
    assert_eq!(a.in_flight(), 0, "send queue entries left in use");
}

/// A chain the provider takes only in part (it refuses request #8 of 16: two scatter entries
/// where the queue pair allows one). Only a chain's last request is signaled, so the last one
/// taken would never say it finished: the run must still fail at once naming the refusal,
/// leave no send queue entry in use (its drain heard of every request it posted), and nothing
/// from the refused request on reaches the target.
#[test]
fn a_chain_taken_in_part_fails_drains_and_frees_its_entries() {
    let Some(dev) = device("a_chain_taken_in_part_fails_drains_and_frees_its_entries") else {
        return;
    };
    let (a, _b) = pair(&dev);
    let (target, grant, _src, src_mr) = granted_pair(&dev, 1 << 20, 9);
    a.refuse_in_chains_at(Some(8));
    let e = a
        .run(
            &ops(true, &src_mr, &grant.key(), 0, 1 << 20, 65536),
            deadline(),
        )
        .expect_err("a chain refused at #8 must fail");
    assert_eq!(e.kind(), ErrorKind::Resource, "{e}");
    assert!(e.detail().contains("refused at #8"), "{e}");
    assert!(a.is_error());
    assert_eq!(a.in_flight(), 0, "send queue entries left in use: {e}");
    let t = contents(&target);
    assert!(
        t[8 * 65536..].iter().all(|&x| x == 0),
        "bytes from the refused request on were written"
    );
    println!("RESULT chain taken in part: {e}");
}

/// A run refused by the device (a write past its grant) moves the shared queue pair to ERROR:
/// it fails with the verbs status, a run beside it either completed or failed as flushed (so
/// the link may run it again on a fresh queue pair), and nothing past the grant was written.
#[test]
fn a_failed_run_flushes_the_runs_beside_it_and_names_its_status() {
    let Some(dev) = device("a_failed_run_flushes_the_runs_beside_it_and_names_its_status") else {
        return;
    };
    let (a, _b) = pair(&dev);
    let target = region(4 << 20, |_| 0);
    // the grant covers the first 3 MiB; the last MiB is the canary
    let grant = FencedGrant::register(&dev, &target, 0, 3 << 20, RemoteAccess::ReadWrite).unwrap();
    let src = region(4 << 20, pattern(8));
    let src_mr = Arc::new(dev.register(&src, 0, 4 << 20, RemoteAccess::Read).unwrap());
    let mut good = a
        .start(mib_part(&src_mr, &grant.key(), 0), deadline())
        .unwrap();
    let mut bad = a
        .start(mib_part(&src_mr, &grant.key(), 3), deadline())
        .unwrap();
    let (g, b) = std::thread::scope(|s| {
        let g = s.spawn(|| {
            loop {
                match good.pump(deadline(), None) {
                    Ok(true) => return Ok(()),
                    Ok(false) => {}
                    Err(e) => return Err(e),
                }
            }
        });
        let b = s.spawn(|| {
            loop {
                match bad.pump(deadline(), None) {
                    Ok(true) => return Ok(()),
                    Ok(false) => {}
                    Err(e) => return Err(e),
                }
            }
        });
        (g.join().unwrap(), b.join().unwrap())
    });
    let e = b.expect_err("a write past the grant must fail");
    assert_eq!(e.kind(), ErrorKind::AccessDenied, "{e}");
    assert!(e.detail().contains("IBV_WC_REM_ACCESS_ERR"), "{e}");
    assert!(!verbs::flushed(&e), "{e}");
    let t = contents(&target);
    assert!(
        t[3 << 20..].iter().all(|&x| x == 0),
        "the canary MiB was written"
    );
    match &g {
        Ok(()) => assert!(t[..1 << 20] == contents(&src)[..1 << 20], "bytes differ"),
        Err(e) => assert!(verbs::flushed(e), "{e}"),
    }
    assert_eq!(a.in_flight(), 0, "send queue entries left in use");
    println!("RESULT shared queue pair: refused run {e}; the run beside it: {g:?}");
}

/// What a dropped slice future does (the link sets the flag): ERROR, drained, `Canceled`.
#[test]
fn a_canceled_run_moves_the_queue_pair_to_error_and_drains_it() {
    let Some(dev) = device("a_canceled_run_moves_the_queue_pair_to_error_and_drains_it") else {
        return;
    };
    let (a, b) = pair(&dev);
    let (target, grant, _src, src_mr) = granted_pair(&dev, 1 << 20, 4);
    b.set_error().unwrap(); // nothing will complete
    let cancel = std::sync::atomic::AtomicBool::new(true);
    let e = a
        .run_cancellable(
            &ops(true, &src_mr, &grant.key(), 0, 1 << 20, 65536),
            deadline(),
            Some(&cancel),
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Canceled, "{e}");
    assert!(a.is_error());
    assert!(
        target
            .with_slice(0, 1 << 20, |s| s.iter().all(|&x| x == 0))
            .unwrap()
    );
}

/// Two RoCE nodes (two VMs): node 0 serves a write grant and a read grant, node 1 pushes and
/// pulls through the rdma link, then writes again after node 0 revoked: refused, bytes kept.
/// `ci/softroce.sh run --vms 2 -- target/debug/deps/rdma-* --exact two_nodes_push_pull_and_revoke`.
#[test]
fn two_nodes_push_pull_and_revoke() {
    use omnirig_transports::grant::{Access, Grant, GrantSpec, GrantTable};
    use omnirig_transports::segment::SegmentDescriptor;
    use omnirig_transports::transport::rdma::link::{
        Admit, RdmaConfig, RdmaNode, RdmaServer, RdmaTransport,
    };
    use omnirig_transports::transport::{OpKind, SliceOp, Transport, TransportKind};

    let Some(nodes) = common::TwoNodes::from_env(
        "two_nodes_push_pull_and_revoke",
        "ci/softroce.sh run --vms 2 -- <rdma test binary> --exact two_nodes_push_pull_and_revoke",
    ) else {
        return;
    };
    let Some(_) = device("two_nodes_push_pull_and_revoke") else {
        return;
    };
    let (node, ip, peer) = (&nodes.node, &nodes.ip, &nodes.peer_ip);
    let (put, wait) = (|n: &str, b: &[u8]| nodes.put(n, b), |n: &str| nodes.wait(n));
    const LEN: u64 = 4 << 20;
    if node == "0" {
        let buf = region((2 * LEN) as usize, |_| 0);
        // the second half holds what node 1 will pull
        buf.write(LEN, &(0..LEN as usize).map(pattern(77)).collect::<Vec<_>>())
            .unwrap();
        let table = Arc::new(std::sync::Mutex::new(GrantTable::default()));
        let (t, r) = (table.clone(), buf.clone());
        let admit: Admit = Arc::new(move |access, wire| {
            let a = t.lock().unwrap().admit(access, wire, 0, 1)?;
            Ok((r.clone(), a.entry.grant.clone()))
        });
        let rn = RdmaNode::open(RdmaConfig {
            listen: format!("{ip}:18500").parse().unwrap(),
            ..RdmaConfig::default()
        })
        .unwrap();
        let server = RdmaServer::start(rn.clone(), admit).unwrap();
        let issue = |offset, access| {
            table
                .lock()
                .unwrap()
                .issue(
                    "node0",
                    GrantSpec {
                        buffer: 1,
                        buffer_len: 2 * LEN,
                        offset,
                        len: LEN,
                        access,
                        expires: None,
                        token: 99 + offset,
                        lease: false,
                    },
                )
                .unwrap()
        };
        // the grant hook attaches each grant's key; it travels inside the grant
        let keyed = |mut g: Grant| {
            let bytes = rn.on_grant(&g, &buf).unwrap().unwrap();
            g.keys.push(omnirig_transports::grant::GrantKey {
                kind: TransportKind::Rdma,
                bytes,
            });
            g
        };
        let (wg, rg) = (
            keyed(issue(0, Access::Write)),
            keyed(issue(LEN, Access::Read)),
        );
        put(
            "grants",
            format!(
                "{}\n{}",
                common::hex(&wg.to_bytes()),
                common::hex(&rg.to_bytes())
            )
            .as_bytes(),
        );
        wait("pushed");
        let got = contents(&buf);
        let want: Vec<u8> = (0..LEN as usize).map(pattern(11)).collect();
        assert_eq!(
            &got[..LEN as usize],
            &want[..],
            "node 0: pushed bytes differ"
        );
        assert!(table.lock().unwrap().revoke(wg.epoch));
        rn.revoke_grant(&wg.wire()).unwrap();
        put("revoked", b"");
        let verdict = wait("after-revoke");
        assert_eq!(
            contents(&buf),
            got,
            "node 0: a write after revoke changed bytes"
        );
        println!(
            "RESULT two nodes: node 0 saw the push bit-exact; after revoke: {}",
            String::from_utf8_lossy(&verdict)
        );
        drop(server);
    } else {
        let raw = wait("grants");
        let text = String::from_utf8(raw).unwrap();
        let mut lines = text.lines();
        let wg = Grant::from_bytes(&common::unhex(lines.next().unwrap())).unwrap();
        let rg = Grant::from_bytes(&common::unhex(lines.next().unwrap())).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let rn = RdmaNode::open(RdmaConfig::default()).unwrap();
        let tr = RdmaTransport::new(rn);
        tr.add_peer("node0", format!("{peer}:18500").parse().unwrap());
        let desc = SegmentDescriptor::new("node0", 1, vec![], vec![]);
        let link = rt.block_on(tr.connect(desc)).unwrap();
        let src = region(LEN as usize, pattern(11));
        let back = region(LEN as usize, |_| 0);
        let go = |kind, local: &Arc<Region>, g: &Grant, len: u64| {
            let slice = link.slicing().slice_size;
            let mut off = 0;
            while off < len {
                let n = slice.min(len - off);
                rt.block_on(link.execute(SliceOp {
                    kind,
                    local: local.clone(),
                    local_offset: off,
                    grant: g.wire(),
                    key: g.key(TransportKind::Rdma).map(Arc::from),
                    grant_offset: off,
                    len: n,
                    tag: 1,
                    request_offset: off,
                    request_len: len,
                    alone: true,
                }))?;
                off += n;
            }
            Ok::<_, omnirig_transports::Error>(())
        };
        let t = Instant::now();
        go(OpKind::Write, &src, &wg, LEN).unwrap();
        let push = t.elapsed();
        let t = Instant::now();
        go(OpKind::Read, &back, &rg, LEN).unwrap();
        let pull = t.elapsed();
        assert_eq!(
            contents(&back),
            (0..LEN as usize).map(pattern(77)).collect::<Vec<_>>(),
            "node 1: pulled bytes differ"
        );
        put("pushed", b"");
        wait("revoked");
        let e = go(OpKind::Write, &back, &wg, 4096).unwrap_err();
        put("after-revoke", e.to_string().as_bytes());
        assert_eq!(e.kind(), ErrorKind::GrantRevoked, "{e}");
        assert!(e.detail().contains("IBV_WC_REM_ACCESS_ERR"), "{e}");
        println!(
            "RESULT two nodes: push 4 MiB {:.0} ms ({:.1} MB/s), pull {:.0} ms ({:.1} MB/s), write after revoke: {e}",
            push.as_secs_f64() * 1e3,
            LEN as f64 / push.as_secs_f64() / 1e6,
            pull.as_secs_f64() * 1e3,
            LEN as f64 / pull.as_secs_f64() / 1e6
        );
    }
}
