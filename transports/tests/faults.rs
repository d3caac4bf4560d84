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
