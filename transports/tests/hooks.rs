//! The transport seam's hooks, seen through a recording transport that wraps the real ones:
//! they fire in a buffer's order (register, grant, revoke, unregister) on every path that
//! ends a grant (revoke, expiry, shutdown), and a refusal surfaces as a clear error with
//! nothing left registered or granted.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{pattern, unique};
use omnirig_transports::grant::GrantRef;
use omnirig_transports::memory::Region;
use omnirig_transports::transport::BoxFuture;
use omnirig_transports::{
    Access, Admission, Endpoint, Engine, EngineConfig, ErrorKind, Grant, InProcessStore, Link,
    MemoryProvider, Request, Result, SegmentDescriptor, Transport, TransportKind, TransportSetup,
    default_setup,
};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Register(TransportKind, u32),
    Unregister(TransportKind, u32),
    Grant(TransportKind, u64),
    Revoke(TransportKind, u64),
    Shutdown(TransportKind),
}

type Log = Arc<Mutex<Vec<Event>>>;

/// What the recorder refuses.
#[derive(Debug, Clone, Copy, Default)]
struct Refuse {
    register: bool,
    grant: bool,
    /// Attach a key longer than a grant may carry.
    oversized_key: bool,
}

/// A setup that starts the real transport of its kind and records every hook on it.
struct Recording {
    inner: Arc<dyn TransportSetup>,
    log: Log,
    refuse: Refuse,
}

impl TransportSetup for Recording {
    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn start(&self, engine: Admission) -> BoxFuture<'static, Result<Arc<dyn Transport>>> {
        let started = self.inner.start(engine);
        let (log, refuse) = (self.log.clone(), self.refuse);
        Box::pin(async move {
            Ok(Arc::new(Recorder {
                inner: started.await?,
                log,
                refuse,
            }) as Arc<dyn Transport>)
        })
    }
}

struct Recorder {
    inner: Arc<dyn Transport>,
    log: Log,
    refuse: Refuse,
}

impl Recorder {
    fn push(&self, e: Event) {
        self.log.lock().unwrap().push(e);
    }
}

impl Transport for Recorder {
    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }
    fn reaches(&self, peer: &SegmentDescriptor) -> bool {
        self.inner.reaches(peer)
    }
    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>> {
        self.inner.connect(peer)
    }
    fn endpoint(&self) -> Option<Endpoint> {
        self.inner.endpoint()
    }
    fn memory(&self) -> Option<Arc<dyn MemoryProvider>> {
        self.inner.memory()
    }
    fn describe(&self, addr: SocketAddr) -> Option<BoxFuture<'static, Result<SegmentDescriptor>>> {
        self.inner.describe(addr)
    }
    fn on_register(&self, buffer: u32, region: &Arc<Region>) -> Result<()> {
        if self.refuse.register {
            return Err(omnirig_transports::Error::new(
                ErrorKind::Resource,
                "no memory region left on the device",
            ));
        }
        self.inner.on_register(buffer, region)?;
        self.push(Event::Register(self.kind(), buffer));
        Ok(())
    }
    fn on_unregister(&self, buffer: u32, region: &Arc<Region>) {
        self.inner.on_unregister(buffer, region);
        self.push(Event::Unregister(self.kind(), buffer));
    }
    fn on_grant(&self, grant: &Grant, region: &Arc<Region>) -> Result<Option<Vec<u8>>> {
        if self.refuse.grant {
            return Err(omnirig_transports::Error::new(
                ErrorKind::Resource,
                "no memory window left",
            ));
        }
        self.inner.on_grant(grant, region)?;
        self.push(Event::Grant(self.kind(), grant.epoch));
        if self.refuse.oversized_key {
            return Ok(Some(vec![0; omnirig_transports::grant::MAX_KEY_BYTES + 1]));
        }
        // A key the initiator can read back: this grant's epoch, as an rkey would be.
        Ok(Some(grant.epoch.to_le_bytes().to_vec()))
    }
    fn on_revoke(&self, grant: &GrantRef) {
        self.inner.on_revoke(grant);
        self.push(Event::Revoke(self.kind(), grant.epoch));
    }
    fn shutdown(&self) {
        self.inner.shutdown();
        self.push(Event::Shutdown(self.kind()));
    }
}

/// An engine running loopback and tcp, each wrapped in a recorder; `refuse_tcp` is what tcp's
/// recorder refuses.
async fn recorded(store: &Arc<InProcessStore>, refuse_tcp: Refuse) -> (Engine, Log) {
    let log = Log::default();
    let cfg = EngineConfig::new(unique("rec"))
        .store(store.clone())
        .with(Recording {
            inner: default_setup(TransportKind::Loopback),
            log: log.clone(),
            refuse: Refuse::default(),
        })
        .with(Recording {
            inner: default_setup(TransportKind::Tcp),
            log: log.clone(),
            refuse: refuse_tcp,
        });
    (Engine::new(cfg).await.unwrap(), log)
}

fn take(log: &Log) -> Vec<Event> {
    std::mem::take(&mut *log.lock().unwrap())
}

const T: Option<Duration> = Some(Duration::from_secs(30));
use TransportKind::{Loopback as Lo, Tcp};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_fire_in_a_buffers_order_and_keys_travel_in_the_grant() {
    let store = InProcessStore::new();
    let (owner, log) = recorded(&store, Refuse::default()).await;
    // The initiator's link sees the key of its own kind in every slice.
    let seen: Arc<Mutex<Vec<Option<Vec<u8>>>>> = Arc::default();
    let seen_by_link = seen.clone();
    let peer = Engine::new(
        EngineConfig::for_kind(unique("peer"), Lo)
            .store(store.clone())
            .decorator(omnirig_test_support::slices::on_slices(move |link, op| {
                seen_by_link
                    .lock()
                    .unwrap()
                    .push(op.key.as_deref().map(<[u8]>::to_vec));
                link.execute(op)
            })),
    )
    .await
    .unwrap();
    let dst = owner.allocate(8192).unwrap();
    let id = dst.id();
    assert_eq!(
        take(&log),
        [Event::Register(Lo, id), Event::Register(Tcp, id)]
    );

    let g = owner.grant(&dst, 0, 8192, Access::Write).unwrap();
    assert_eq!(
        take(&log),
        [Event::Grant(Lo, g.epoch), Event::Grant(Tcp, g.epoch)]
    );
    // Each transport's key rides in the grant, across the wire encoding too.
    let g = Grant::from_bytes(&g.to_bytes()).unwrap();
    assert_eq!(g.key(Lo), Some(&g.epoch.to_le_bytes()[..]));
    assert_eq!(g.key(Tcp), Some(&g.epoch.to_le_bytes()[..]));

    // The grant works as before (the data path is the real loopback).
    let src = peer.allocate(8192).unwrap();
    src.write(0, &pattern(3, 8192)).unwrap();
    peer.transfer(vec![Request::write(&src, 0, &g, 0, 8192)], T)
        .await
        .unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [Some(g.epoch.to_le_bytes().to_vec())],
        "one slice, carrying the loopback key"
    );
    assert!(owner.revoke(&g));
    assert_eq!(
        take(&log),
        [Event::Revoke(Lo, g.epoch), Event::Revoke(Tcp, g.epoch)]
    );
    // Revoking twice tells nobody twice.
    assert!(!owner.revoke(&g));
    assert!(take(&log).is_empty());
    let mut got = vec![0u8; 8192];
    dst.read(0, &mut got).unwrap();
    assert!(got == pattern(3, 8192));
    // Local reads and writes take leases, which transports never hear of.
    assert!(take(&log).is_empty());

    owner.unregister(&dst).unwrap();
    assert_eq!(
        take(&log),
        [Event::Unregister(Lo, id), Event::Unregister(Tcp, id)]
    );
}

/// A grant that expires is revoked at its expiry, and the transports hear of it then, not at
/// the table's next use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_reaches_the_transports_by_itself() {
    let store = InProcessStore::new();
    let (owner, log) = recorded(&store, Refuse::default()).await;
    let buf = owner.allocate(4096).unwrap();
    let g = owner
        .grant_for(&buf, 0, 4096, Access::Read, Duration::from_millis(20))
        .unwrap();
    take(&log);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let seen = log.lock().unwrap().clone();
        if seen.len() == 2 {
            assert_eq!(
                seen,
                [Event::Revoke(Lo, g.epoch), Event::Revoke(Tcp, g.epoch)]
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no revoke after expiry: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(owner.usage().grants, 0);
}

/// Shutdown: every live grant revoked, every buffer unregistered, then each transport stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_revokes_unregisters_then_stops_each_transport() {
    let store = InProcessStore::new();
    let (owner, log) = recorded(&store, Refuse::default()).await;
    let buf = owner.allocate(4096).unwrap();
    let g = owner.grant(&buf, 0, 4096, Access::Write).unwrap();
    take(&log);
    drop(owner);
    let id = buf.id();
    assert_eq!(
        take(&log),
        [
            Event::Revoke(Lo, g.epoch),
            Event::Revoke(Tcp, g.epoch),
            Event::Unregister(Lo, id),
            Event::Shutdown(Lo),
            Event::Unregister(Tcp, id),
            Event::Shutdown(Tcp),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_registration_is_a_clear_error_and_leaves_nothing() {
    let store = InProcessStore::new();
    let (owner, log) = recorded(
        &store,
        Refuse {
            register: true,
            ..Refuse::default()
        },
    )
    .await;
    let e = owner.allocate(4096).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Resource);
    let msg = e.to_string();
    assert!(
        msg.contains("tcp transport refused to register 4096 bytes"),
        "{msg}"
    );
    assert!(msg.contains("no memory region left"), "{msg}");
    // Loopback had accepted: it is told to undo, and the engine holds nothing.
    let events = take(&log);
    assert!(
        matches!(events.as_slice(), [Event::Register(Lo, a), Event::Unregister(Lo, b)] if a == b),
        "{events:?}"
    );
    let u = owner.usage();
    assert_eq!((u.buffers, u.registered_bytes), (0, 0), "{u:?}");
    assert_eq!(owner.descriptor().buffers, vec![]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_grant_is_a_clear_error_and_leaves_nothing() {
    for refuse in [
        Refuse {
            grant: true,
            ..Refuse::default()
        },
        Refuse {
            oversized_key: true,
            ..Refuse::default()
        },
    ] {
        let store = InProcessStore::new();
        let (owner, log) = recorded(&store, refuse).await;
        let buf = owner.allocate(4096).unwrap();
        take(&log);
        let e = owner.grant(&buf, 0, 4096, Access::Write).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Resource, "{refuse:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("tcp transport refused to grant 0+4096 of buffer"),
            "{msg}"
        );
        // Every transport hears the refused grant revoked, so none keeps a key alive.
        let events = take(&log);
        let epoch = match events.first() {
            Some(Event::Grant(Lo, e)) => *e,
            other => panic!("{other:?} in {events:?}"),
        };
        assert!(events.contains(&Event::Revoke(Lo, epoch)), "{events:?}");
        assert!(events.contains(&Event::Revoke(Tcp, epoch)), "{events:?}");
        let u = owner.usage();
        assert_eq!((u.grants, u.granted_bytes), (0, 0), "{u:?}");
        // The range is free again: a grant of the same range now only fails the same way,
        // never as an overlap, and the buffer unregisters.
        let again = owner.grant(&buf, 0, 4096, Access::Write).unwrap_err();
        assert_ne!(again.kind(), ErrorKind::GrantOverlap);
        owner.unregister(&buf).unwrap();
    }
}

/// Two transports that each want to allocate the engine's memory: refused at start, by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_memory_provider_per_engine() {
    struct Wants(Arc<dyn TransportSetup>);
    struct WantsT(Arc<dyn Transport>);
    struct Plain;
    impl MemoryProvider for Plain {
        fn allocate(&self, len: usize) -> Result<Region> {
            Region::allocate(len, false)
        }
    }
    impl TransportSetup for Wants {
        fn kind(&self) -> TransportKind {
            self.0.kind()
        }
        fn start(&self, engine: Admission) -> BoxFuture<'static, Result<Arc<dyn Transport>>> {
            let s = self.0.start(engine);
            Box::pin(async move { Ok(Arc::new(WantsT(s.await?)) as Arc<dyn Transport>) })
        }
    }
    impl Transport for WantsT {
        fn kind(&self) -> TransportKind {
            self.0.kind()
        }
        fn reaches(&self, peer: &SegmentDescriptor) -> bool {
            self.0.reaches(peer)
        }
        fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>> {
            self.0.connect(peer)
        }
        fn memory(&self) -> Option<Arc<dyn MemoryProvider>> {
            Some(Arc::new(Plain))
        }
    }
    let cfg = EngineConfig::new(unique("two-providers"))
        .store(InProcessStore::new())
        .with(Wants(default_setup(Lo)))
        .with(Wants(default_setup(Tcp)));
    let e = Engine::new(cfg).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Resource);
    assert!(
        e.to_string()
            .contains("transports loopback and tcp both want to allocate"),
        "{e}"
    );
}
