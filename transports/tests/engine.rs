//! Engine behaviour, every case written once and run over each transport it applies to.

mod common;

use std::time::{Duration, Instant};

use common::*;
use omnirig_transports::{
    Access, Engine, EngineConfig, ErrorKind, InProcessStore, Request, TaskState, TransportKind,
    TransportPolicy,
};
use rstest::rstest;

const T: Option<Duration> = Some(Duration::from_secs(60));

async fn assert_idle(e: &Engine) {
    let u = idle(e).await;
    assert_eq!(
        (u.grants, u.granted_bytes, u.batches, u.tasks, u.leases),
        (0, 0, 0, 0, 0),
        "{u:?}"
    );
}

#[rstest]
#[case::one_byte(1)]
#[case::page(4096)]
#[case::mib_plus_3((1 << 20) + 3)]
#[case::mib_64(64 << 20)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_are_bit_exact(
    #[values("loopback", "tcp", "shm", "rdma", "sim")] transport: &'static str,
    #[case] size: usize,
) {
    if common::unavailable(transport) {
        return;
    }
    let e = engines(transport, 2).await;
    let (a, b) = (&e[0], &e[1]);
    let data = pattern(size as u64, size);
    let pad = 8192;
    let src = a.allocate((size + pad) as u64).unwrap();
    src.write(5, &data).unwrap();
    let dst = b.allocate((size + pad) as u64).unwrap();
    dst.write(0, &vec![CANARY; size + pad]).unwrap();

    // Write: a pushes into b's granted range.
    let g = b.grant(&dst, 4096, size as u64, Access::Write).unwrap();
    a.transfer(vec![Request::write(&src, 5, &g, 0, size as u64)], T)
        .await
        .unwrap();
    assert!(b.revoke(&g));
    let mut got = vec![0u8; size + pad];
    dst.read(0, &mut got).unwrap();
    assert!(got[4096..4096 + size] == data[..], "written bytes differ");
    assert!(
        got[..4096]
            .iter()
            .chain(&got[4096 + size..])
            .all(|&x| x == CANARY),
        "bytes outside the grant changed"
    );

    // Read: a pulls the same range back from b into another offset.
    let g = b.grant(&dst, 4096, size as u64, Access::Read).unwrap();
    let back = a.allocate((size + pad) as u64).unwrap();
    a.transfer(vec![Request::read(&back, 3, &g, 0, size as u64)], T)
        .await
        .unwrap();
    b.revoke(&g);
    let mut round = vec![0u8; size];
    back.read(3, &mut round).unwrap();
    assert!(round == data, "read bytes differ");

    assert_idle(a).await;
    assert_idle(b).await;
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_batches_between_several_engines(
    #[values("loopback", "tcp", "shm", "rdma", "sim")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    const N: usize = 4;
    const TASKS: usize = 4;
    let e = engines(transport, N).await;
    let size = |i: usize, j: usize, t: usize| (300 << 10) + 7 * (i * 100 + j * 10 + t);
    // Each engine j owns one destination buffer with a slot per (sender, task).
    let slot = 400 << 10;
    let dsts: Vec<_> = e
        .iter()
        .map(|x| x.allocate((N * TASKS * slot) as u64).unwrap())
        .collect();
    let mut jobs = Vec::new();
    for (i, a) in e.iter().enumerate() {
        for (j, b) in e.iter().enumerate() {
            if i == j {
                continue;
            }
            let mut reqs = Vec::new();
            let mut grants = Vec::new();
            for t in 0..TASKS {
                let n = size(i, j, t);
                let src = a.allocate(n as u64).unwrap();
                src.write(0, &pattern((i * 1000 + j * 10 + t) as u64, n))
                    .unwrap();
                let g = b
                    .grant(
                        &dsts[j],
                        ((i * TASKS + t) * slot) as u64,
                        n as u64,
                        Access::Write,
                    )
                    .unwrap();
                reqs.push(Request::write(&src, 0, &g, 0, n as u64));
                grants.push(g);
            }
            jobs.push(async move {
                let batch = a.submit(reqs, T).await.unwrap();
                batch.wait_all().await.unwrap();
                assert!(batch.statuses().iter().all(|s| *s == TaskState::Completed));
                for g in &grants {
                    assert!(b.revoke(g));
                }
            });
        }
    }
    futures_util::future::join_all(jobs).await;
    for (j, dst) in dsts.iter().enumerate() {
        for i in (0..N).filter(|&i| i != j) {
            for t in 0..TASKS {
                let n = size(i, j, t);
                let mut got = vec![0u8; n];
                dst.read(((i * TASKS + t) * slot) as u64, &mut got).unwrap();
                assert!(
                    got == pattern((i * 1000 + j * 10 + t) as u64, n),
                    "{i}->{j} task {t} differs"
                );
            }
        }
    }
    for x in &e {
        assert_idle(x).await;
    }
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_outside_a_grant_are_refused_and_touch_nothing(
    #[values("loopback", "tcp", "shm", "rdma", "sim")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    let e = engines(transport, 2).await;
    let (a, b) = (&e[0], &e[1]);
    let src = a.allocate(1 << 16).unwrap();
    src.write(0, &pattern(1, 1 << 16)).unwrap();
    let dst = b.allocate(1 << 16).unwrap();
    dst.write(0, &vec![CANARY; 1 << 16]).unwrap();
    let g = b.grant(&dst, 4096, 4096, Access::Write).unwrap();

    // Caught before submit: the request names its batch and task.
    let err = a
        .submit(
            vec![
                Request::write(&src, 0, &g, 0, 16),
                Request::write(&src, 0, &g, 4000, 200),
            ],
            T,
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfGrant);
    assert_eq!(err.task(), Some(1));
    assert_eq!(err.grant().map(|g| g.epoch), Some(g.epoch));

    // A sender that lies about the grant's size gets past its own checks; the receiver refuses.
    let mut forged = g.clone();
    forged.len = 1 << 16;
    let err = a
        .transfer(vec![Request::write(&src, 0, &forged, 0, 8192)], T)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfGrant, "{err}");
    assert_eq!((err.task(), err.peer()), (Some(0), Some(b.name())));
    // A forged token and a write to a read-only grant are refused the same way.
    let mut forged = g.clone();
    forged.token ^= 1;
    let err = a
        .transfer(vec![Request::write(&src, 0, &forged, 0, 16)], T)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BadToken, "{err}");
    let ro = b.grant(&dst, 0, 4096, Access::Read).unwrap();
    let mut forged = ro.clone();
    forged.access = Access::Write;
    let err = a
        .transfer(vec![Request::write(&src, 0, &forged, 0, 16)], T)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::AccessDenied, "{err}");
    b.revoke(&ro);
    b.revoke(&g);

    let mut got = vec![0u8; 1 << 16];
    dst.read(0, &mut got).unwrap();
    assert!(
        got.iter().all(|&x| x == CANARY),
        "a refused write touched the destination"
    );
    assert_idle(a).await;
    assert_idle(b).await;
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_grant_refuses_writes_and_the_canary_survives(
    #[values("loopback", "tcp", "shm", "rdma", "sim")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    let e = engines(transport, 2).await;
    let (a, b) = (&e[0], &e[1]);
    let src = a.allocate(1 << 20).unwrap();
    src.write(0, &pattern(2, 1 << 20)).unwrap();
    let dst = b.allocate(1 << 20).unwrap();
    dst.write(0, &vec![CANARY; 1 << 20]).unwrap();
    let g = b.grant(&dst, 0, 1 << 20, Access::Write).unwrap();
    assert!(b.revoke(&g));
    assert!(
        !b.revoke(&g),
        "revoking twice reports the grant was not live"
    );
    let err = a
        .transfer(vec![Request::write(&src, 0, &g, 0, 1 << 20)], T)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::GrantRevoked, "{err}");
    assert_eq!(err.grant().map(|x| x.epoch), Some(g.epoch));
    let mut got = vec![0u8; 1 << 20];
    dst.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == CANARY));
    assert_idle(a).await;
    assert_idle(b).await;
}

/// The deadline passes while a slice is held up; the batch ends TimedOut, the receiver's
/// grant expires with it, and when the held slice finally arrives it is fenced off.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_times_out_frees_everything_and_fences_the_late_write(
    #[values("loopback", "tcp", "shm", "rdma", "sim")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    let (a, b, gate) = gated_pair(transport, 0).await;
    let a_base = a.usage();
    let src = a.allocate(256 << 10).unwrap();
    src.write(0, &pattern(3, 256 << 10)).unwrap();
    let dst = b.allocate(256 << 10).unwrap();
    dst.write(0, &vec![CANARY; 256 << 10]).unwrap();
    let ttl = Duration::from_millis(300);
    let g = b.grant_for(&dst, 0, 256 << 10, Access::Write, ttl).unwrap();

    let started = Instant::now();
    let batch = a
        .submit(vec![Request::write(&src, 0, &g, 0, 256 << 10)], Some(ttl))
        .await
        .unwrap();
    gate.wait_parked(1).await;
    let err = batch.wait_all().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TimedOut);
    assert_eq!((err.batch(), err.task()), (Some(batch.id()), Some(0)));
    assert!(started.elapsed() >= ttl);
    assert_eq!(batch.status(0), Some(TaskState::TimedOut));
    batch.free();

    // The grant expired with the deadline: nothing of b's pool is held any more.
    let u = b.usage();
    assert_eq!((u.grants, u.granted_bytes), (0, 0), "{u:?}");
    assert_idle(&a).await;

    // Now the held slice arrives: refused, and not one byte lands.
    gate.open();
    let late = gate.wait_ran(1).await;
    assert_eq!(
        late[0].as_ref().unwrap_err().kind(),
        ErrorKind::GrantRevoked
    );
    let mut got = vec![0u8; 256 << 10];
    dst.read(0, &mut got).unwrap();
    assert!(
        got.iter().all(|&x| x == CANARY),
        "a late write reached revoked memory"
    );
    let u = idle(&a).await;
    assert_eq!(
        (u.buffers, u.registered_bytes),
        (a_base.buffers + 1, 256 << 10)
    );
    assert_idle(&b).await;
}

/// The receiving engine goes away between two slices of one transfer.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_dropping_mid_transfer_fails_the_task_promptly_and_leaks_nothing(
    #[values("loopback", "tcp", "shm", "rdma", "sim")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    let (a, b, gate) = gated_pair(transport, 1).await;
    let src = a.allocate(4 << 20).unwrap();
    let dst = b.allocate(4 << 20).unwrap();
    let g = b.grant(&dst, 0, 4 << 20, Access::Write).unwrap();
    let batch = a
        .submit(vec![Request::write(&src, 0, &g, 0, 4 << 20)], T)
        .await
        .unwrap();
    gate.wait_parked(1).await;
    assert_eq!(
        batch.bytes_done(0),
        1 << 20,
        "the first slice landed before the drop"
    );
    drop(b);
    let dropped = Instant::now();
    gate.open();
    let err = batch.wait_all().await.unwrap_err();
    assert!(
        dropped.elapsed() < Duration::from_secs(5),
        "took {:?}",
        dropped.elapsed()
    );
    assert_eq!(err.kind(), ErrorKind::PeerDisconnected, "{err}");
    assert_eq!(err.task(), Some(0));
    drop(batch);
    let u = idle(&a).await;
    assert_eq!(
        (u.batches, u.tasks, u.leases, u.connections),
        (0, 0, 0, 0),
        "{u:?}"
    );
    // With the buffer no longer in use, it unregisters.
    a.unregister(&src).unwrap();
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_buffers_refuse_to_unregister(
    #[values("loopback", "tcp", "shm", "rdma", "sim")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    let e = engines(transport, 2).await;
    let (a, b) = (&e[0], &e[1]);
    let dst = b.allocate(8192).unwrap();
    let g = b.grant(&dst, 0, 4096, Access::Write).unwrap();
    assert_eq!(
        b.unregister(&dst).unwrap_err().kind(),
        ErrorKind::BufferBusy
    );
    // The owner cannot read or write a range a peer may be writing.
    assert_eq!(
        dst.write(100, &[1]).unwrap_err().kind(),
        ErrorKind::GrantOverlap
    );
    dst.write(4096, &[1]).unwrap();
    b.revoke(&g);
    b.unregister(&dst).unwrap();
    assert_eq!(
        b.unregister(&dst).unwrap_err().kind(),
        ErrorKind::UnknownBuffer
    );
    assert_eq!(
        b.grant(&dst, 0, 1, Access::Write).unwrap_err().kind(),
        ErrorKind::UnknownBuffer
    );
    let _ = a;
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_errors_that_name_them(
    #[values("loopback", "tcp", "shm", "rdma", "sim")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    let e = engines(transport, 2).await;
    let (a, b) = (&e[0], &e[1]);
    let src = a.allocate(4096).unwrap();
    let dst = b.allocate(4096).unwrap();
    let g = b.grant(&dst, 0, 4096, Access::Write).unwrap();
    let kind_and_task = |r: omnirig_transports::Result<_>| {
        let e = r.unwrap_err();
        (e.kind(), e.task())
    };
    let ok = Request::write(&src, 0, &g, 0, 1);
    let zero = Request::write(&src, 0, &g, 0, 0);
    assert_eq!(
        kind_and_task(a.submit(vec![ok.clone(), zero], T).await),
        (ErrorKind::InvalidLength, Some(1))
    );
    let overflow = Request {
        grant_offset: u64::MAX,
        ..ok.clone()
    };
    assert_eq!(
        kind_and_task(a.submit(vec![overflow], T).await),
        (ErrorKind::OutOfGrant, Some(0))
    );
    let outside_local = Request {
        local_offset: 4095,
        len: 2,
        ..ok.clone()
    };
    assert_eq!(
        kind_and_task(a.submit(vec![outside_local], T).await),
        (ErrorKind::OutOfBuffer, Some(0))
    );
    let unknown_local = Request {
        local: 999,
        ..ok.clone()
    };
    assert_eq!(
        kind_and_task(a.submit(vec![unknown_local], T).await),
        (ErrorKind::UnknownBuffer, Some(0))
    );
    let wrong_way = Request::read(&src, 0, &g, 0, 1);
    assert_eq!(
        kind_and_task(a.submit(vec![wrong_way], T).await),
        (ErrorKind::AccessDenied, Some(0))
    );
    let mut nowhere = g.clone();
    nowhere.segment = "nobody-published-this".into();
    let err = a
        .transfer(vec![Request::write(&src, 0, &nowhere, 0, 1)], T)
        .await
        .unwrap_err();
    assert_eq!(
        (err.kind(), err.peer()),
        (ErrorKind::UnknownSegment, Some("nobody-published-this"))
    );
    b.revoke(&g);
    assert_idle(a).await;
    assert_idle(b).await;
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freeing_a_running_batch_cancels_and_releases(
    #[values("loopback", "tcp", "shm", "rdma", "sim")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    let (a, b, gate) = gated_pair(transport, 0).await;
    let src = a.allocate(4096).unwrap();
    let dst = b.allocate(4096).unwrap();
    let g = b.grant(&dst, 0, 4096, Access::Write).unwrap();
    let batch = a
        .submit(vec![Request::write(&src, 0, &g, 0, 4096)], None)
        .await
        .unwrap();
    gate.wait_parked(1).await;
    assert_eq!(batch.status(0), Some(TaskState::Pending));
    batch.cancel();
    assert_eq!(batch.wait().await, vec![TaskState::Canceled]);
    drop(batch);
    assert_idle(&a).await;
    // A canceled transfer's source is released: the buffer can go.
    a.unregister(&src).unwrap();
    b.revoke(&g);
    gate.open();
    assert_eq!(
        gate.wait_ran(1).await[0].as_ref().unwrap_err().kind(),
        ErrorKind::GrantRevoked
    );
}

/// Moves a few writes and returns the receiver's name; the callers check the log.
async fn three_writes(transport: &'static str) -> String {
    let e = engines(transport, 2).await;
    let (a, b) = (&e[0], &e[1]);
    let src = a.allocate(4096).unwrap();
    let dst = b.allocate(4096).unwrap();
    for _ in 0..3 {
        let g = b.grant(&dst, 0, 4096, Access::Write).unwrap();
        a.transfer(vec![Request::write(&src, 0, &g, 0, 4096)], T)
            .await
            .unwrap();
        b.revoke(&g);
    }
    b.name().to_owned()
}

fn one_selection_line(lines: &[&str], transport: &str, peer: &str) -> Result<(), String> {
    let expected = format!("transport=\"{transport}\"");
    let selected: Vec<_> = lines
        .iter()
        .filter(|l| l.contains("selected transport") && l.contains(peer))
        .collect();
    match selected.as_slice() {
        [line] if line.contains(&expected) => Ok(()),
        other => Err(format!(
            "expected one 'selected transport' line for {peer} with {expected}, got {other:?}"
        )),
    }
}

// tracing-test's capture does not compose with rstest's expansion, so one line per transport.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[tracing_test::traced_test]
async fn the_selected_transport_is_logged_once_per_peer_loopback() {
    let peer = three_writes("loopback").await;
    logs_assert(|lines: &[&str]| one_selection_line(lines, "loopback", &peer));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[tracing_test::traced_test]
async fn the_selected_transport_is_logged_once_per_peer_tcp() {
    let peer = three_writes("tcp").await;
    logs_assert(|lines: &[&str]| one_selection_line(lines, "tcp", &peer));
}

/// Peer-to-peer: no shared store, the sender asks the receiver itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_find_each_other_by_handshake_without_a_store() {
    let a = Engine::new(
        EngineConfig::new(unique("a"))
            .store(InProcessStore::new())
            .policy(TransportPolicy::Only(TransportKind::Tcp)),
    )
    .await
    .unwrap();
    let b = Engine::new(EngineConfig::new(unique("b")).store(InProcessStore::new()))
        .await
        .unwrap();
    let dst = b.allocate(1 << 20).unwrap();
    let g = b.grant(&dst, 0, 1 << 20, Access::Write).unwrap();
    let src = a.allocate(1 << 20).unwrap();
    src.write(0, &pattern(9, 1 << 20)).unwrap();
    // Unknown to a's store until the handshake.
    let err = a
        .transfer(vec![Request::write(&src, 0, &g, 0, 1 << 20)], T)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::UnknownSegment);
    let info = a.connect_addr(b.tcp_addr().unwrap()).await.unwrap();
    assert_eq!(info.transport, TransportKind::Tcp);
    a.transfer(vec![Request::write(&src, 0, &g, 0, 1 << 20)], T)
        .await
        .unwrap();
    b.revoke(&g);
    let mut got = vec![0u8; 1 << 20];
    dst.read(0, &mut got).unwrap();
    assert!(got == pattern(9, 1 << 20));
    // An address with nobody listening: a clear error, not a hang.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let err = a.connect_addr(closed).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unreachable, "{err}");
}

/// shm owners keep a bounded number of initiator regions mapped per connection (256); a
/// region unmapped to make room is shared again on its next use, and every byte still lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_shares_again_what_the_owner_unmapped() {
    let e = engines("shm", 2).await;
    let (a, b) = (&e[0], &e[1]);
    let dst = b.allocate(4096).unwrap();
    let srcs: Vec<_> = (0..300).map(|_| a.allocate(4096).unwrap()).collect();
    for round in 0..2u64 {
        for (i, src) in srcs.iter().enumerate() {
            let want = pattern(round * 1000 + i as u64, 4096);
            src.write(0, &want).unwrap();
            let g = b.grant(&dst, 0, 4096, Access::Write).unwrap();
            a.transfer(vec![Request::write(src, 0, &g, 0, 4096)], T)
                .await
                .unwrap_or_else(|err| panic!("round {round}, region {i}: {err}"));
            b.revoke(&g);
            let mut got = vec![0u8; 4096];
            dst.read(0, &mut got).unwrap();
            assert!(got == want, "round {round}, region {i}: bytes differ");
        }
    }
    assert_idle(a).await;
    assert_idle(b).await;
}

/// Issue 10: a registration larger than the machine's available memory is refused with an
/// error saying so, on every kind of memory (an shm engine's memfds used to be populated
/// page by page until the kernel killed the process).
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_more_than_the_machine_has_is_refused(#[values(false, true)] shm: bool) {
    let mut cfg = EngineConfig::new(unique("big")).store(InProcessStore::new());
    if shm {
        cfg = cfg.with(omnirig_transports::ShmConfig::default());
    }
    let e = Engine::new(cfg).await.unwrap();
    let t = Instant::now();
    let err = e.allocate(1000 << 30).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Resource, "{err}");
    assert!(err.to_string().contains("MemAvailable"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(e.allocate(1 << 20).is_ok());
}

/// `lock_memory` locks every buffer's pages (best effort) and the usage says how many bytes
/// are locked; without it nothing is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_memory_locks_buffers_and_reports_it() {
    let store = InProcessStore::new();
    let plain = Engine::new(config(&unique("plain"), "loopback", &store))
        .await
        .unwrap();
    let _a = plain.allocate(8192).unwrap();
    assert_eq!(plain.usage().locked_bytes, 0);
    let locking = Engine::new(config(&unique("locking"), "loopback", &store).lock_memory(true))
        .await
        .unwrap();
    let b = locking.allocate(8192).unwrap();
    // mlock is allowed up to RLIMIT_MEMLOCK; where even two pages are over it, nothing locks
    // and the usage must say so rather than claim it.
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limit into the struct we pass and nothing else.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } == 0;
    let u = locking.usage();
    if ok && lim.rlim_cur >= 1 << 20 {
        assert_eq!(u.locked_bytes, 8192, "{u:?}");
        assert!(b.region().is_locked());
    } else {
        assert_eq!(
            u.locked_bytes,
            u64::from(b.region().is_locked()) * 8192,
            "{u:?}"
        );
    }
    locking.unregister(&b).unwrap();
    assert_eq!(locking.usage().locked_bytes, 0);
}

/// Under the Auto policy the most local transport that reaches a peer wins: shm before tcp
/// for an engine of this host (loopback, were it running, before both).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_prefers_shm_to_tcp_on_one_host() {
    use omnirig_transports::{ShmConfig, TransportKind};
    let store = InProcessStore::new();
    let cfg = |n: &str| {
        EngineConfig::new(unique(n))
            .store(store.clone())
            .without(TransportKind::Loopback)
            .with(ShmConfig::default())
    };
    let a = Engine::new(cfg("auto-a")).await.unwrap();
    let b = Engine::new(cfg("auto-b")).await.unwrap();
    assert_eq!(
        a.connect(b.name()).await.unwrap().transport,
        TransportKind::Shm
    );
    let c = Engine::new(EngineConfig::new(unique("auto-c")).store(store.clone()))
        .await
        .unwrap();
    assert_eq!(
        c.connect(a.name()).await.unwrap().transport,
        TransportKind::Tcp,
        "c runs no shm: tcp is what reaches a"
    );
    assert_eq!(
        c.connect(b.name()).await.unwrap().transport,
        TransportKind::Tcp
    );
    let d = Engine::new(EngineConfig::new(unique("auto-d")).store(store.clone()))
        .await
        .unwrap();
    assert_eq!(
        c.connect(d.name()).await.unwrap().transport,
        TransportKind::Loopback
    );
}

/// The engine logs, once per peer, the transport it selected and, for rdma, the device, port,
/// GID index and GID (the evidence a report needs that bytes moved over RDMA on that device).
#[cfg(feature = "rdma")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[tracing_test::traced_test]
async fn rdma_the_engine_logs_device_port_and_gid_per_peer() {
    if common::unavailable("rdma") {
        return;
    }
    let e = engines("rdma", 2).await;
    let (a, b) = (&e[0], &e[1]);
    let info = a.connect(b.name()).await.unwrap();
    assert_eq!(info.transport, TransportKind::Rdma);
    let dev = omnirig_transports::transport::rdma::verbs::Device::open(None).unwrap();
    let index = dev.default_gid_index(1).unwrap();
    let gid = std::net::Ipv6Addr::from(dev.gid(1, index).unwrap()).to_string();
    let want = [
        "selected transport".to_string(),
        format!("peer={}", b.name()),
        "transport=\"rdma\"".to_string(),
        format!("{} port 1 gid[{index}] {gid}", dev.name()),
    ];
    logs_assert(|lines: &[&str]| {
        match lines
            .iter()
            .find(|l| want.iter().all(|w| l.contains(w.as_str())))
        {
            Some(_) => Ok(()),
            None => Err(format!("no log line has all of {want:?}")),
        }
    });
    // once per peer: a second connect reuses the link and logs nothing new
    a.connect(b.name()).await.unwrap();
    logs_assert(|lines: &[&str]| {
        let n = lines
            .iter()
            .filter(|l| l.contains("selected transport") && l.contains(b.name()))
            .count();
        (n == 1).then_some(()).ok_or(format!("{n} selection lines"))
    });
}

/// A batch of single-slice writes to a connected peer goes out as one (rdma: one run, its
/// work requests chained; shm: groups of requests, one round trip each, 40 slices making two
/// groups): bit-exact. With one grant revoked in the middle, that task alone fails
/// GrantRevoked naming it, the others complete (rdma: the ones after it, flushed when the
/// queue pair went to ERROR, run again on their own), and the revoked range is untouched. A
/// batch canceled while it runs ends with nothing held. Reads batch the same way.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_runs_as_one_and_a_failure_names_its_task(
    #[values("shm", "rdma")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    let n: usize = if transport == "shm" { 40 } else { 16 };
    const SLOT: usize = 64 << 10;
    let e = engines(transport, 2).await;
    let (a, b) = (&e[0], &e[1]);
    a.connect(b.name()).await.unwrap();
    let src = a.allocate((n * SLOT) as u64).unwrap();
    let dst = b.allocate((n * SLOT) as u64).unwrap();
    dst.write(0, &vec![CANARY; n * SLOT]).unwrap();
    let grants: Vec<_> = (0..n)
        .map(|i| {
            b.grant(&dst, (i * SLOT) as u64, SLOT as u64, Access::Write)
                .unwrap()
        })
        .collect();
    let writes = |len: usize| -> Vec<Request> {
        (0..n)
            .map(|i| Request::write(&src, (i * SLOT) as u64, &grants[i], 0, len as u64))
            .collect()
    };
    let first = pattern(21, n * SLOT);
    src.write(0, &first).unwrap();
    a.transfer(writes(SLOT), T).await.unwrap();
    let mut got = vec![0u8; n * SLOT];
    // the region itself: the buffer's own read refuses a range under a live write grant
    dst.region().read(0, &mut got).unwrap();
    assert!(got == first, "a batched write differs");

    // one revoked grant in the middle of the batch
    const BAD: usize = 5;
    assert!(b.revoke(&grants[BAD]));
    let second = pattern(22, n * SLOT);
    src.write(0, &second).unwrap();
    let batch = a.submit(writes(SLOT), T).await.unwrap();
    let states = batch.wait().await;
    for (i, s) in states.iter().enumerate() {
        match (i, s) {
            (BAD, TaskState::Failed(err)) => {
                assert_eq!(err.kind(), ErrorKind::GrantRevoked, "{err}");
                assert_eq!(err.task(), Some(BAD));
                assert_eq!(err.grant().map(|g| g.epoch), Some(grants[BAD].epoch));
            }
            (BAD, s) => panic!("task {BAD} on a revoked grant ended {s:?}"),
            (_, s) => assert_eq!(*s, TaskState::Completed, "task {i}"),
        }
    }
    drop(batch);
    dst.region().read(0, &mut got).unwrap();
    for i in 0..n {
        let (have, want) = (
            &got[i * SLOT..(i + 1) * SLOT],
            &second[i * SLOT..(i + 1) * SLOT],
        );
        if i == BAD {
            assert!(
                have == &first[i * SLOT..(i + 1) * SLOT],
                "the revoked range changed"
            );
        } else {
            assert!(have == want, "slot {i} differs");
        }
    }

    // canceled while it runs (16 x 64 KiB take milliseconds on soft-RoCE): whatever ended, ended
    // cleanly, and nothing is held
    let live: Vec<Request> = writes(SLOT)
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i != BAD)
        .map(|(_, r)| r)
        .collect();
    let batch = a.submit(live, T).await.unwrap();
    batch.cancel();
    for s in batch.wait().await {
        assert!(
            matches!(s, TaskState::Completed | TaskState::Canceled),
            "{s:?}"
        );
    }
    drop(batch);
    assert_idle(a).await;

    // reads, batched the same way, bit-exact
    for (i, g) in grants.iter().enumerate() {
        if i != BAD {
            assert!(b.revoke(g));
        }
    }
    let back = a.allocate((n * SLOT) as u64).unwrap();
    let reads: Vec<_> = (0..n)
        .map(|i| {
            b.grant(&dst, (i * SLOT) as u64, SLOT as u64, Access::Read)
                .unwrap()
        })
        .collect();
    let reqs: Vec<_> = (0..n)
        .map(|i| Request::read(&back, (i * SLOT) as u64, &reads[i], 0, SLOT as u64))
        .collect();
    a.transfer(reqs, T).await.unwrap();
    let mut again = vec![0u8; n * SLOT];
    back.read(0, &mut again).unwrap();
    dst.region().read(0, &mut got).unwrap();
    assert!(again == got, "a batched read differs");
    for g in &reads {
        assert!(b.revoke(g));
    }
    assert_idle(a).await;
    assert_idle(b).await;
}

/// The engine's transfers across two RoCE nodes (two VMs joined by a virtual link): node 0
/// grants a write range and a read range of its buffer; node 1 learns node 0's descriptor over
/// tcp, connects over rdma, writes requests of several sizes (one byte, a page, a slice plus
/// three, several slices) and reads one back, bit-exact; after node 0 revokes, a write fails
/// GrantRevoked and changes nothing. `ci/softroce.sh run --vms 2 -- cargo test ... --test engine
/// -- --exact two_nodes_engine_transfers_over_rdma`.
#[cfg(feature = "rdma")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_engine_transfers_over_rdma() {
    use omnirig_transports::{Grant, RdmaConfig, TcpConfig};
    let Some(nodes) = TwoNodes::from_env(
        "two_nodes_engine_transfers_over_rdma",
        "ci/softroce.sh run --vms 2 -- cargo test --features rdma --test engine -- --exact \
         two_nodes_engine_transfers_over_rdma",
    ) else {
        return;
    };
    if common::unavailable("rdma") {
        return;
    }
    let (node, ip, peer) = (&nodes.node, &nodes.ip, &nodes.peer_ip);
    let (put, wait) = (|n: &str, b: &[u8]| nodes.put(n, b), |n: &str| nodes.wait(n));
    const LEN: u64 = 6 << 20;
    // (local offset, grant offset, len): one byte, a page, a slice plus three, several slices
    const PIECES: [(u64, u64, u64); 4] = [
        (0, 1, 1),
        (4096, 4096, 4096),
        (8192, 3 << 20, (1 << 20) + 3),
        (16384, 8192, 3 << 20),
    ];
    let config = |name: &str, tcp: Option<std::net::SocketAddr>| {
        config(name, "rdma", &InProcessStore::new())
            .with(TcpConfig {
                listen: tcp,
                ..TcpConfig::default()
            })
            .with(RdmaConfig {
                slice_size: 1 << 20,
                listen: format!("{ip}:0").parse().unwrap(),
                ..RdmaConfig::default()
            })
    };
    if node == "0" {
        let e = Engine::new(config(
            "node0",
            Some(format!("{ip}:18600").parse().unwrap()),
        ))
        .await
        .unwrap();
        let buf = e.allocate(2 * LEN).unwrap();
        buf.write(0, &vec![0xA5; LEN as usize]).unwrap();
        buf.write(LEN, &pattern(77, LEN as usize)).unwrap();
        let wg = e.grant(&buf, 0, LEN, Access::Write).unwrap();
        let rg = e.grant(&buf, LEN, LEN, Access::Read).unwrap();
        put(
            "engine-grants",
            format!("{}\n{}", hex(&wg.to_bytes()), hex(&rg.to_bytes())).as_bytes(),
        );
        wait("engine-pushed");
        let src = pattern(11, LEN as usize);
        let mut want = vec![0xA5; LEN as usize];
        for (lo, go, n) in PIECES {
            want[go as usize..(go + n) as usize]
                .copy_from_slice(&src[lo as usize..(lo + n) as usize]);
        }
        // the buffer is readable here once the grant that lends it out is revoked
        assert!(e.revoke(&wg));
        let mut got = vec![0u8; LEN as usize];
        buf.read(0, &mut got).unwrap();
        assert!(got == want, "node 1's writes did not land bit-exact");
        put("engine-revoked", b"");
        wait("engine-done");
        buf.read(0, &mut got).unwrap();
        assert!(got == want, "a write after revoke changed node 0's memory");
        e.revoke(&rg);
        assert_idle(&e).await;
        println!("RESULT two nodes: node 0 saw every write land and none after revoke");
    } else {
        let e = Engine::new(config("node1", None)).await.unwrap();
        let raw = String::from_utf8(wait("engine-grants")).unwrap();
        let mut lines = raw.lines();
        let wg = Grant::from_bytes(&unhex(lines.next().unwrap())).unwrap();
        let rg = Grant::from_bytes(&unhex(lines.next().unwrap())).unwrap();
        let info = e
            .connect_addr(format!("{peer}:18600").parse().unwrap())
            .await
            .unwrap();
        assert_eq!(info.transport, TransportKind::Rdma, "{info:?}");
        let src = e.allocate(LEN).unwrap();
        src.write(0, &pattern(11, LEN as usize)).unwrap();
        let t0 = Instant::now();
        e.transfer(
            PIECES
                .iter()
                .map(|&(lo, go, n)| Request::write(&src, lo, &wg, go, n))
                .collect(),
            T,
        )
        .await
        .unwrap();
        let push = t0.elapsed();
        let back = e.allocate(LEN).unwrap();
        let t0 = Instant::now();
        e.transfer(vec![Request::read(&back, 0, &rg, 0, LEN)], T)
            .await
            .unwrap();
        let pull = t0.elapsed();
        let mut got = vec![0u8; LEN as usize];
        back.read(0, &mut got).unwrap();
        assert!(
            got == pattern(77, LEN as usize),
            "the read was not bit-exact"
        );
        put("engine-pushed", b"");
        wait("engine-revoked");
        let err = e
            .transfer(vec![Request::write(&src, 0, &wg, 0, 4096)], T)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::GrantRevoked, "{err}");
        assert_eq!(err.peer(), Some("node0"));
        put("engine-done", b"");
        assert_idle(&e).await;
        println!(
            "RESULT two nodes over {}: writes {:.1} MiB in {:.0} ms, read {:.0} MiB in {:.0} ms; \
             write after revoke: {err}",
            info.device,
            PIECES.iter().map(|p| p.2).sum::<u64>() as f64 / 1048576.0,
            push.as_secs_f64() * 1e3,
            LEN as f64 / 1048576.0,
            pull.as_secs_f64() * 1e3
        );
    }
}

/// An engine's rdma control server sets up queue pairs only for peers presenting the secret
/// its descriptor publishes: a peer that merely reaches the address is refused, naming why.
#[cfg(feature = "rdma")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_queue_pair_setup_needs_the_engines_secret() {
    use omnirig_transports::transport::Transport;
    use omnirig_transports::transport::rdma::link::{RdmaNode, RdmaTransport};
    use omnirig_transports::{RdmaConfig, SegmentDescriptor};
    if common::unavailable("rdma") {
        return;
    }
    let e = engines("rdma", 2).await;
    let endpoint = e[1]
        .descriptor()
        .endpoint(TransportKind::Rdma)
        .map(|b| String::from_utf8(b.to_vec()).unwrap())
        .expect("an rdma endpoint in the descriptor");
    let (addr, secret) = endpoint.split_once('#').expect("address#secret");
    assert_eq!(secret.len(), 32, "{endpoint}");
    // the engine's own peers get through
    assert_eq!(
        e[0].connect(e[1].name()).await.unwrap().transport,
        TransportKind::Rdma
    );
    // a stranger that knows only the address does not
    let stranger = RdmaTransport::new(RdmaNode::open(RdmaConfig::default()).unwrap());
    stranger.add_peer("victim", addr.parse().unwrap());
    let err = match stranger
        .connect(SegmentDescriptor::new("victim", 1, vec![], vec![]))
        .await
    {
        Ok(_) => panic!("queue pair set up without the secret"),
        Err(err) => err,
    };
    assert_eq!(err.kind(), ErrorKind::AccessDenied, "{err}");
    assert!(err.detail().contains("secret"), "{err}");
}
