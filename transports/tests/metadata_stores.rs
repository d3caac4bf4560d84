//! The cluster metadata stores against real servers, started and stopped by each test: the
//! HTTP store against `omnirig`'s own server (Mooncake's protocol), the etcd store against a
//! real `etcd` binary (skipped with a printed reason when none is installed, unless
//! `OMNIRIG_ETCD_REQUIRED=1`, which CI sets).

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use omnirig_transports::metadata::etcd::EtcdStore;
use omnirig_transports::metadata::http::{HttpStore, KEY_PREFIX, MetadataServer};
use omnirig_transports::{
    Access, Engine, EngineConfig, ErrorKind, MetadataStore, Request, SegmentDescriptor,
    TransportKind, TransportPolicy,
};
use rstest::rstest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const T: Option<Duration> = Some(Duration::from_secs(30));

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A real etcd, on private ports and a private data dir, killed on drop.
struct Etcd {
    child: Child,
    url: String,
    _dir: tempdir::Dir,
}

mod tempdir {
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new(tag: &str) -> Self {
            let p = std::env::temp_dir().join(format!(
                "omnirig-{tag}-{}-{}",
                std::process::id(),
                super::unique("d")
            ));
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Etcd {
    /// None (with a printed SKIPPED line) when no etcd binary is installed.
    async fn start() -> Option<Self> {
        let bin = std::env::var("OMNIRIG_ETCD").unwrap_or_else(|_| "etcd".into());
        if Command::new(&bin).arg("--version").output().is_err() {
            if std::env::var("OMNIRIG_ETCD_REQUIRED").as_deref() == Ok("1") {
                panic!("OMNIRIG_ETCD_REQUIRED=1 but no etcd binary ({bin}) can run");
            }
            // Straight to stderr, past the test harness's capture: a skip must be seen.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED (etcd store cases): no etcd binary ({bin}); install Debian's etcd-server or set OMNIRIG_ETCD"
            );
            return None;
        }
        let dir = tempdir::Dir::new("etcd");
        let (client, peer) = (free_port(), free_port());
        let url = format!("http://127.0.0.1:{client}");
        let child = Command::new(&bin)
            .arg("--data-dir")
            .arg(&dir.0)
            .args(["--name", "omnirig-test"])
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .arg("--listen-peer-urls")
            .arg(format!("http://127.0.0.1:{peer}"))
            .arg("--initial-advertise-peer-urls")
            .arg(format!("http://127.0.0.1:{peer}"))
            .arg("--initial-cluster")
            .arg(format!("omnirig-test=http://127.0.0.1:{peer}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd starts");
        let etcd = Etcd {
            child,
            url,
            _dir: dir,
        };
        // Ready when a read through the gateway answers.
        let store = EtcdStore::new(&etcd.url, None).unwrap();
        let t = Instant::now();
        while store.lookup("ready-probe").await.is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "etcd did not come up"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Some(etcd)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A store of the named kind with its server; the server guard keeps it running.
enum Server {
    Http(MetadataServer),
    Etcd(Etcd),
}

async fn store(kind: &str) -> Option<(Arc<dyn MetadataStore>, Server)> {
    match kind {
        "http" => {
            let s = MetadataServer::bind("127.0.0.1:0".parse().unwrap())
                .await
                .unwrap();
            let url = format!("http://{}/metadata", s.local_addr());
            Some((HttpStore::new(&url).unwrap(), Server::Http(s)))
        }
        "etcd" => {
            let e = Etcd::start().await?;
            let st = EtcdStore::new(&e.url, Some(Duration::from_secs(5))).unwrap();
            Some((st, Server::Etcd(e)))
        }
        _ => unreachable!(),
    }
}

fn desc(name: &str, instance: u64) -> SegmentDescriptor {
    SegmentDescriptor::new(name, instance, vec![], vec![])
}

/// The store contract the in-process store keeps, on a real server.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_lookup_remove_and_refuse_duplicates(#[values("http", "etcd")] kind: &str) {
    let Some((s, _server)) = store(kind).await else {
        return;
    };
    let name = unique("seg");
    assert!(s.lookup(&name).await.unwrap().is_none());
    s.publish(desc(&name, 1)).await.unwrap();
    s.publish(desc(&name, 1)).await.unwrap(); // the same engine republishing
    let err = s.publish(desc(&name, 2)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::DuplicateName, "{err}");
    assert!(err.to_string().contains(&name), "{err}");
    assert_eq!(s.lookup(&name).await.unwrap().unwrap(), desc(&name, 1));
    s.remove(&name, 2).await.unwrap(); // not the owner: no effect
    assert!(s.lookup(&name).await.unwrap().is_some());
    s.remove(&name, 1).await.unwrap();
    assert!(s.lookup(&name).await.unwrap().is_none());
    s.remove(&name, 1).await.unwrap(); // removing what is gone is fine
    // After removal the name is free for a new instance.
    s.publish(desc(&name, 2)).await.unwrap();
    assert_eq!(s.lookup(&name).await.unwrap().unwrap().instance, 2);
}

/// A store nobody serves fails every call with a metadata error naming where it looked,
/// promptly; an engine using it fails to reach a peer with that error, naming the peer.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_is_down_fails_cleanly(#[values("http", "etcd")] kind: &str) {
    let url = format!("http://127.0.0.1:{}", free_port());
    let s: Arc<dyn MetadataStore> = match kind {
        "http" => HttpStore::new(&url).unwrap(),
        _ => EtcdStore::new(&url, Some(Duration::from_secs(5))).unwrap(),
    };
    let t = Instant::now();
    for err in [
        s.lookup("x").await.unwrap_err(),
        s.publish(desc("x", 1)).await.unwrap_err(),
        s.remove("x", 1).await.unwrap_err(),
    ] {
        assert_eq!(err.kind(), ErrorKind::Metadata, "{err}");
        assert!(err.to_string().contains(&url[7..]), "{err}");
    }
    assert!(t.elapsed() < Duration::from_secs(10));
    // An engine publishes on start: a down store fails the start, saying so.
    let err = Engine::new(EngineConfig::new(unique("e")).store(s.clone()))
        .await
        .expect_err("an engine cannot publish to a store that is down");
    assert_eq!(err.kind(), ErrorKind::Metadata, "{err}");
}

/// Engines find each other through the store and move real bytes; a departed engine's entry
/// goes when it shuts down; a stale entry (a peer that died without removing it) is never
/// written through: connecting fails naming the peer, and a grant of the old instance is
/// refused by a restarted engine under the same name.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_entries_are_never_written_through(#[values("http", "etcd")] kind: &str) {
    let Some((s, _server)) = store(kind).await else {
        return;
    };
    let tcp = |name: &str| {
        EngineConfig::for_kind(name, TransportKind::Tcp)
            .store(s.clone())
            .policy(TransportPolicy::Only(TransportKind::Tcp))
    };
    let b_name = unique("b");
    let a = Engine::new(tcp(&unique("a"))).await.unwrap();
    let b = Engine::new(tcp(&b_name)).await.unwrap();
    let len: usize = 256 << 10;
    let dst = b.allocate(len as _).unwrap();
    let g = b.grant(&dst, 0, len as _, Access::Write).unwrap();
    let src = a.allocate(len as _).unwrap();
    src.write(0, &pattern(3, len)).unwrap();
    a.transfer(vec![Request::write(&src, 0, &g, 0, len as u64)], T)
        .await
        .unwrap();
    b.revoke(&g);
    let mut got = vec![0u8; len];
    dst.read(0, &mut got).unwrap();
    assert!(
        got == pattern(3, len),
        "bytes differ after a write found through {kind}"
    );

    // Shutdown removes b's entry (in the background for a remote store).
    let old = b.descriptor();
    drop(dst);
    b.shutdown();
    let t = Instant::now();
    while s.lookup(&b_name).await.unwrap().is_some() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "entry outlived shutdown"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A crash leaves the entry behind: put it back as a dead engine would have left it.
    s.publish(old.clone()).await.unwrap();
    let a2 = Engine::new(tcp(&unique("a2"))).await.unwrap();
    let src2 = a2.allocate(len as _).unwrap();
    let err = a2
        .transfer(vec![Request::write(&src2, 0, &g, 0, len as u64)], T)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unreachable, "{err}");
    assert_eq!(err.peer(), Some(b_name.as_str()), "{err}");

    // A restarted engine under the same name cannot take the name over a live-looking entry
    // (two engines must not share one), until the stale one is removed by its instance.
    let err = Engine::new(tcp(&b_name)).await.err().unwrap();
    assert_eq!(err.kind(), ErrorKind::DuplicateName, "{err}");
    s.remove(&b_name, old.instance).await.unwrap();
    let b2 = Engine::new(tcp(&b_name)).await.unwrap();
    assert_ne!(b2.descriptor().instance, old.instance);
    let _dst2 = b2.allocate(len as _).unwrap();
    // The old grant names the old instance's epoch and token: the new engine refuses it.
    let err = a2
        .transfer(vec![Request::write(&src2, 0, &g, 0, len as u64)], T)
        .await
        .unwrap_err();
    assert!(
        matches!(err.kind(), ErrorKind::UnknownGrant | ErrorKind::BadToken),
        "{err}"
    );
    assert_eq!(err.peer(), Some(b_name.as_str()), "{err}");
}

/// etcd: an engine that dies without removing its entry loses it when its lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_entries_of_a_dead_publisher_expire_with_its_lease() {
    let Some(etcd) = Etcd::start().await else {
        return;
    };
    let name = unique("leased");
    let dying = EtcdStore::new(&etcd.url, Some(Duration::from_secs(2))).unwrap();
    dying.publish(desc(&name, 7)).await.unwrap();
    let observer = EtcdStore::new(&etcd.url, None).unwrap();
    // Kept alive past its TTL while the publisher lives...
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(observer.lookup(&name).await.unwrap().is_some());
    // ...gone within a TTL or so after it stops renewing (no remove call).
    drop(dying);
    let t = Instant::now();
    while observer.lookup(&name).await.unwrap().is_some() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "lease did not expire"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    observer.publish(desc(&name, 8)).await.unwrap();
}

/// Anything read from a store is decoded with bounds and checked against the name it is
/// filed under: garbage, a descriptor of another name, or Mooncake's own JSON is refused
/// with an error naming the key.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_entries_are_refused_naming_the_key(#[values("http", "etcd")] kind: &str) {
    let Some((s, server)) = store(kind).await else {
        return;
    };
    let name = unique("bad");
    let key = format!("{KEY_PREFIX}{name}");
    let other = desc("someone-else", 1).to_bytes();
    for bad in [
        b"{\"name\":\"mooncake json\"}".to_vec(),
        vec![0xff; 64],
        other,
    ] {
        match &server {
            Server::Http(srv) => {
                let h = HttpStore::new(&format!("http://{}", srv.local_addr())).unwrap();
                h.put(&key, &bad).await.unwrap();
            }
            Server::Etcd(e) => raw_etcd_put(&e.url, &key, &bad).await,
        }
        let err = s.lookup(&name).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Malformed, "{err}");
        assert!(err.to_string().contains(&key), "{err}");
    }
}

async fn raw_etcd_put(url: &str, key: &str, value: &[u8]) {
    // Through the store's own client path would hide a bug in it; this writes the JSON by hand.
    let body = format!(
        "{{\"key\":\"{}\",\"value\":\"{}\"}}",
        b64(key.as_bytes()),
        b64(value)
    );
    let (status, reply) = raw(
        url[7..].parse().unwrap(),
        &format!(
            "POST /v3/kv/put HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
    .await;
    assert_eq!(status, 200, "{reply}");
}

fn b64(d: &[u8]) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut o = String::new();
    for c in d.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = u32::from_be_bytes([0, b[0], b[1], b[2]]);
        for i in 0..4 {
            o.push(if i <= c.len() {
                A[(n >> (18 - 6 * i) & 63) as usize] as char
            } else {
                '='
            });
        }
    }
    o
}

/// One raw HTTP exchange: the status and the whole reply as text.
async fn raw(addr: SocketAddr, req: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    let mut reply = Vec::new();
    s.read_to_end(&mut reply).await.unwrap();
    let text = String::from_utf8_lossy(&reply).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// `omnirig metadata-server` speaks Mooncake's protocol exactly: 404 for a missing key, the
/// raw body back, DELETE idempotent, and it refuses malformed requests with 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_speaks_mooncakes_protocol() {
    let srv = MetadataServer::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let a = srv.local_addr();
    let get = "GET /metadata?key=mooncake%2Fram%2Fnode1 HTTP/1.1\r\nHost: x\r\n\r\n";
    let (st, _) = raw(a, get).await;
    assert_eq!(st, 404);
    let value = "{\"segment\":\"raw bytes\"}\u{1}";
    let put = format!(
        "PUT /metadata?key=mooncake%2Fram%2Fnode1 HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{value}",
        value.len()
    );
    assert_eq!(raw(a, &put).await.0, 200);
    let (st, reply) = raw(a, get).await;
    assert_eq!(st, 200);
    assert!(reply.ends_with(&format!("\r\n\r\n{value}")), "{reply:?}");
    assert_eq!(srv.len(), 1);
    let del = "DELETE /metadata?key=mooncake%2Fram%2Fnode1 HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_eq!(raw(a, del).await.0, 200);
    assert_eq!(raw(a, del).await.0, 200);
    assert_eq!(raw(a, get).await.0, 404);
    assert!(srv.is_empty());
    for bad in [
        "GET /metadata HTTP/1.1\r\n\r\n".to_owned(),
        "GET /metadata?key= HTTP/1.1\r\n\r\n".to_owned(),
        "PUT /metadata?key=k HTTP/1.1\r\nContent-Length: 999999999999\r\n\r\n".to_owned(),
        "PUT /metadata?key=k HTTP/1.1\r\nContent-Length: nope\r\n\r\n".to_owned(),
        format!("GET /metadata?key={} HTTP/1.1\r\n\r\n", "k".repeat(2000)),
    ] {
        assert_eq!(raw(a, &bad).await.0, 400, "{bad:.80}");
    }
    assert_eq!(raw(a, "POST /metadata?key=k HTTP/1.1\r\n\r\n").await.0, 405);
    assert_eq!(raw(a, "GET /other?key=k HTTP/1.1\r\n\r\n").await.0, 404);
    srv.stop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(tokio::net::TcpStream::connect(a).await.is_err());
}
