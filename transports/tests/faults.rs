//! The fault decorator on a real engine pair, every kind over every transport: what the
//! sender sees, what lands at the receiver (canaries), and that nothing leaks.

mod common;

use std::time::{Duration, Instant};

use common::*;
use omnirig_transports::{
    Access, Engine, ErrorKind, FaultInjector, FaultKind, FaultPoint, FaultRule, InProcessStore,
    Request, TaskState,
};
use rstest::rstest;

const MIB: u64 = 1 << 20;
const LEN: u64 = 4 * MIB;
/// Mid-way through the second 1 MiB slice.
const AT: u64 = MIB + MIB / 2;
const TAG: u64 = 42;

struct Run {
    a: Engine,
    b: Engine,
    faults: std::sync::Arc<FaultInjector>,
    data: Vec<u8>,
    dst: omnirig_transports::Buffer,
}

async fn setup(transport: &'static str, kind: FaultKind, at: FaultPoint) -> Run {
    let store = InProcessStore::new();
    let faults = FaultInjector::new(vec![FaultRule::new(Some(TAG), at, kind)]);
    let a = Engine::new(config(&unique("a"), transport, &store).decorator(faults.decorator()))
        .await
        .unwrap();
    let b = Engine::new(config(&unique("b"), transport, &store))
        .await
        .unwrap();
    let dst = b.allocate(LEN).unwrap();
    dst.write(0, &vec![CANARY; LEN as usize]).unwrap();
    Run {
        a,
        b,
        faults,
        data: pattern(11, LEN as usize),
        dst,
    }
}

impl Run {
    /// One tagged write of the whole pattern with a deadline; returns the task's end state.
    async fn write(
        &self,
        timeout: Duration,
        ttl: Option<Duration>,
    ) -> (TaskState, omnirig_transports::Grant) {
        let src = self.a.allocate(LEN).unwrap();
        src.write(0, &self.data).unwrap();
        let g = match ttl {
            Some(ttl) => self
                .b
                .grant_for(&self.dst, 0, LEN, Access::Write, ttl)
                .unwrap(),
            None => self.b.grant(&self.dst, 0, LEN, Access::Write).unwrap(),
        };
        let batch = self
            .a
            .submit(
                vec![Request::write(&src, 0, &g, 0, LEN).tagged(TAG)],
                Some(timeout),
            )
            .await
            .unwrap();
        let state = batch.wait().await.remove(0);
        (state, g)
    }

    fn landed(&self) -> Vec<u8> {
        let mut got = vec![0u8; LEN as usize];
        self.dst.read(0, &mut got).unwrap();
        got
    }

    async fn assert_clean(&self) {
        for e in [&self.a, &self.b] {
            let u = idle(e).await;
            assert_eq!(
                (u.grants, u.granted_bytes, u.batches, u.tasks, u.leases),
                (0, 0, 0, 0, 0),
                "{u:?}"
            );
        }
    }
}

/// Faults that fail the task: the error kind, and nothing lands past the fault point.
#[rstest]
#[case::fail_submit(FaultKind::FailSubmit, ErrorKind::Io)]
#[case::fail_slice(FaultKind::FailSlice, ErrorKind::Io)]
#[case::drop_connection(FaultKind::DropConnection, ErrorKind::PeerDisconnected)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_faults_fail_the_task_and_stop_at_the_fault(
    #[values("loopback", "tcp", "rdma", "sim")] transport: &'static str,
    #[case] kind: FaultKind,
    #[case] expected: ErrorKind,
) {
    if common::unavailable(transport) {
        return;
    }
    let r = setup(transport, kind, FaultPoint::AfterBytes(AT)).await;
    let (state, g) = r.write(Duration::from_secs(30), None).await;
    let TaskState::Failed(e) = state else {
        panic!("{kind:?}: expected Failed, got {state:?}")
    };
    assert_eq!(e.kind(), expected, "{e}");
    assert!(e.detail().contains("fault injected"), "{e}");
    assert_eq!(e.task(), Some(0));
    r.b.revoke(&g);
    let got = r.landed();
    // Other slices may run beside the faulty one (tcp has two streams here), so check what
    // must hold: the faulty slice stopped at the fault point.
    assert!(
        got[AT as usize..2 * MIB as usize]
            .iter()
            .all(|&x| x == CANARY),
        "bytes past the fault landed"
    );
    assert_eq!(r.faults.fired().len(), 1);
    r.assert_clean().await;
    // The link still works (a dropped connection is re-established).
    let g = r.b.grant(&r.dst, 0, MIB, Access::Write).unwrap();
    let src = r.a.allocate(MIB).unwrap();
    r.a.transfer(
        vec![Request::write(&src, 0, &g, 0, MIB)],
        Some(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    r.b.revoke(&g);
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_times_out_within_the_deadline(
    #[values("loopback", "tcp", "rdma", "sim")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    let r = setup(transport, FaultKind::Stall, FaultPoint::BeforeSubmit).await;
    let deadline = Duration::from_millis(300);
    let t = Instant::now();
    let (state, g) = r.write(deadline, None).await;
    assert_eq!(state, TaskState::TimedOut);
    let took = t.elapsed();
    assert!(
        took >= deadline && took < deadline + Duration::from_secs(2),
        "took {took:?}"
    );
    r.b.revoke(&g);
    r.assert_clean().await;
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delay_only_slows_the_transfer(
    #[values("loopback", "tcp", "rdma", "sim")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    let r = setup(
        transport,
        FaultKind::Delay { ms: 100 },
        FaultPoint::AfterBytes(AT),
    )
    .await;
    let t = Instant::now();
    let (state, g) = r.write(Duration::from_secs(30), None).await;
    assert_eq!(state, TaskState::Completed);
    assert!(t.elapsed() >= Duration::from_millis(100));
    r.b.revoke(&g);
    assert!(r.landed() == r.data);
    r.assert_clean().await;
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corruption_flips_exactly_one_landed_byte_and_never_the_source(
    #[values("loopback", "tcp", "rdma", "sim")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    let r = setup(transport, FaultKind::Corrupt, FaultPoint::AfterBytes(AT)).await;
    let (state, g) = r.write(Duration::from_secs(30), None).await;
    // The transport cannot know: only a digest at the receiver catches this.
    assert_eq!(state, TaskState::Completed);
    r.b.revoke(&g);
    let got = r.landed();
    let diffs: Vec<usize> = (0..LEN as usize).filter(|&i| got[i] != r.data[i]).collect();
    assert_eq!(diffs, vec![AT as usize]);
    r.assert_clean().await;
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicated_completion_reports_done_with_bytes_missing(
    #[values("loopback", "tcp", "rdma", "sim")] transport: &'static str,
) {
    if common::unavailable(transport) {
        return;
    }
    let r = setup(
        transport,
        FaultKind::DuplicateCompletion,
        FaultPoint::AfterBytes(AT),
    )
    .await;
    let (state, g) = r.write(Duration::from_secs(30), None).await;
    assert_eq!(
        state,
        TaskState::Completed,
        "the engine cannot tell; the receiver's digest must"
    );
    r.b.revoke(&g);
    let got = r.landed();
    assert!(
        got[AT as usize..2 * MIB as usize]
            .iter()
            .all(|&x| x == CANARY)
    );
    assert!(got[..AT as usize] == r.data[..AT as usize]);
    r.assert_clean().await;
}

/// Early completion and late writes: the held bytes arrive after the receiver revoked its
/// grant, and are refused without touching memory.
#[rstest]
#[case::early_completion(FaultKind::EarlyCompletion, TaskState::Completed)]
#[case::late_write(FaultKind::LateWrite, TaskState::TimedOut)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_bytes_that_arrive_after_revoke_never_land(
    #[values("loopback", "tcp", "rdma", "sim")] transport: &'static str,
    #[case] kind: FaultKind,
    #[case] expected: TaskState,
) {
    if common::unavailable(transport) {
        return;
    }
    let r = setup(transport, kind, FaultPoint::AfterBytes(AT)).await;
    let (state, g) = r.write(Duration::from_millis(500), None).await;
    assert_eq!(state, expected);
    assert_eq!(r.faults.held(), 1);
    assert!(r.b.revoke(&g));
    let outcomes = r.faults.release_held().await;
    assert_eq!(outcomes.len(), 1);
    assert_eq!(outcomes[0].0, TAG);
    let e = outcomes[0].1.as_ref().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::GrantRevoked, "{e}");
    let got = r.landed();
    assert!(
        got[AT as usize..2 * MIB as usize]
            .iter()
            .all(|&x| x == CANARY),
        "a late byte landed"
    );
    r.assert_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_for_other_tags_leave_transfers_alone() {
    let r = setup("tcp", FaultKind::FailSubmit, FaultPoint::BeforeSubmit).await;
    let src = r.a.allocate(LEN).unwrap();
    src.write(0, &r.data).unwrap();
    let g = r.b.grant(&r.dst, 0, LEN, Access::Write).unwrap();
    r.a.transfer(
        vec![Request::write(&src, 0, &g, 0, LEN).tagged(TAG + 1)],
        Some(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    r.b.revoke(&g);
    assert!(r.landed() == r.data);
    assert!(r.faults.fired().is_empty());
}

/// The fault cases across two RoCE nodes (two VMs joined by a virtual link): node 0 owns the
/// canary buffer and lends four write grants; node 1 runs the fault decorator over its rdma link
/// to node 0. A failed slice stops at the fault point, a stall times out within its deadline (and
/// nothing past its fault point lands), a
/// late write held past the deadline is refused after revoke (`GrantRevoked`); node 0 checks that
/// nothing landed where it must not. Then node 0's engine shuts down and node 1's next transfer
/// fails promptly (`PeerDisconnected`) naming node 0, with nothing left held on node 1.
/// `ci/softroce.sh run --vms 2 -- <faults test binary> --exact two_nodes_faults_over_rdma`.
#[cfg(feature = "rdma")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_faults_over_rdma() {
    use omnirig_transports::{Grant, RdmaConfig, TcpConfig, TransportKind};
    let Some(nodes) = TwoNodes::from_env(
        "two_nodes_faults_over_rdma",
        "ci/softroce.sh run --vms 2 -- cargo test --features rdma --test faults -- --exact \
         two_nodes_faults_over_rdma",
    ) else {
        return;
    };
    if common::unavailable("rdma") {
        return;
    }
    let (node, ip, peer) = (&nodes.node, &nodes.ip, &nodes.peer_ip);
    let (put, wait) = (|n: &str, b: &[u8]| nodes.put(n, b), |n: &str| nodes.wait(n));
    // one grant per case: fail_slice, stall, late_write, dead peer
    const CASES: u64 = 4;
    let config = |name: &str, tcp: Option<std::net::SocketAddr>| {
        config(name, "rdma", &InProcessStore::new())
            .with(TcpConfig {
                listen: tcp,
                ..TcpConfig::default()
            })
            .with(RdmaConfig {
                slice_size: MIB,
                listen: format!("{ip}:0").parse().unwrap(),
                ..RdmaConfig::default()
            })
    };
    let region = |g: &Grant| g.offset as usize..(g.offset + g.len) as usize;
    if node == "0" {
        let e = Engine::new(config(
            "node0",
            Some(format!("{ip}:18610").parse().unwrap()),
        ))
        .await
        .unwrap();
        let buf = e.allocate(CASES * LEN).unwrap();
        buf.write(0, &vec![CANARY; (CASES * LEN) as usize]).unwrap();
        let grants: Vec<Grant> = (0..CASES)
            .map(|i| e.grant(&buf, i * LEN, LEN, Access::Write).unwrap())
            .collect();
        let lines: Vec<String> = grants.iter().map(|g| hex(&g.to_bytes())).collect();
        put("faults-grants", lines.join("\n").as_bytes());
        wait("faults-held");
        assert!(e.revoke(&grants[2]));
        put("faults-revoked", b"");
        wait("faults-cases-done");
        assert!(e.revoke(&grants[0]) && e.revoke(&grants[1]));
        // the first three cases' ranges (the fourth is still lent out)
        let mut got = vec![0u8; (3 * LEN) as usize];
        buf.read(0, &mut got).unwrap();
        let (fail, stall, late) = (region(&grants[0]), region(&grants[1]), region(&grants[2]));
        let past = |r: &std::ops::Range<usize>| r.start + AT as usize..r.start + 2 * MIB as usize;
        assert!(
            got[past(&fail)].iter().all(|&x| x == CANARY),
            "fail_slice: bytes past the fault landed"
        );
        assert!(
            got[past(&stall)].iter().all(|&x| x == CANARY),
            "stall: bytes past the fault landed"
        );
        assert!(
            got[past(&late)].iter().all(|&x| x == CANARY),
            "late_write: a held byte landed after revoke"
        );
        // the dead-peer case: node 0 goes away with grant 3 still out
        e.shutdown();
        drop(e);
        put("faults-node0-gone", b"");
        wait("faults-node1-done");
        println!("RESULT two nodes, node 0: no byte landed past a fault or after revoke");
    } else {
        let faults = FaultInjector::new(vec![
            FaultRule::new(Some(1), FaultPoint::AfterBytes(AT), FaultKind::FailSlice),
            FaultRule::new(Some(2), FaultPoint::AfterBytes(AT), FaultKind::Stall),
            FaultRule::new(Some(3), FaultPoint::AfterBytes(AT), FaultKind::LateWrite),
        ]);
        let e = Engine::new(config("node1", None).decorator(faults.decorator()))
            .await
            .unwrap();
        let raw = String::from_utf8(wait("faults-grants")).unwrap();
        let grants: Vec<Grant> = raw
            .lines()
            .map(|l| Grant::from_bytes(&unhex(l)).unwrap())
            .collect();
        let info = e
            .connect_addr(format!("{peer}:18610").parse().unwrap())
            .await
            .unwrap();
        assert_eq!(info.transport, TransportKind::Rdma, "{info:?}");
        let src = e.allocate(LEN).unwrap();
        src.write(0, &pattern(11, LEN as usize)).unwrap();
        let write = |tag: u64, timeout: Duration| {
            let req = Request::write(&src, 0, &grants[tag as usize - 1], 0, LEN).tagged(tag);
            let e = &e;
            async move {
                let batch = e.submit(vec![req], Some(timeout)).await.unwrap();
                batch.wait().await.remove(0)
            }
        };
        // fail_slice: the task fails, naming the injected fault
        let state = write(1, Duration::from_secs(30)).await;
        let TaskState::Failed(err) = state else {
            panic!("fail_slice: expected Failed, got {state:?}")
        };
        assert_eq!(err.kind(), ErrorKind::Io, "{err}");
        assert!(err.detail().contains("fault injected"), "{err}");
        // stall: timed out within the deadline
        let t = Instant::now();
        let deadline = Duration::from_millis(300);
        assert_eq!(write(2, deadline).await, TaskState::TimedOut);
        assert!(
            t.elapsed() < deadline + Duration::from_secs(2),
            "{:?}",
            t.elapsed()
        );
        // late_write: the held bytes go out only after node 0 revoked the grant
        assert_eq!(
            write(3, Duration::from_millis(500)).await,
            TaskState::TimedOut
        );
        assert_eq!(faults.held(), 1);
        put("faults-held", b"");
        wait("faults-revoked");
        let outcomes = faults.release_held().await;
        assert_eq!(outcomes.len(), 1);
        let late = outcomes[0].1.as_ref().unwrap_err();
        assert_eq!(late.kind(), ErrorKind::GrantRevoked, "{late}");
        put("faults-cases-done", b"");
        // the dead peer: its engine is gone; the next transfer fails promptly, naming it
        wait("faults-node0-gone");
        let t = Instant::now();
        let dead = e
            .transfer(
                vec![Request::write(&src, 0, &grants[3], 0, MIB).tagged(4)],
                Some(Duration::from_secs(60)),
            )
            .await
            .unwrap_err();
        let took = t.elapsed();
        assert!(
            matches!(
                dead.kind(),
                ErrorKind::PeerDisconnected | ErrorKind::Unreachable
            ),
            "{dead}"
        );
        assert_eq!(dead.peer(), Some("node0"), "{dead}");
        assert!(took < Duration::from_secs(10), "took {took:?}");
        let u = idle(&e).await;
        assert_eq!((u.batches, u.tasks, u.leases), (0, 0, 0), "{u:?}");
        put("faults-node1-done", b"");
        println!(
            "RESULT two nodes, node 1 over {}: fail_slice {err}; late write after revoke \
             {late}; dead peer after {:.0} ms: {dead}",
            info.device,
            took.as_secs_f64() * 1e3
        );
    }
}
