//! The node agent's protocol end to end on 127.0.0.1: only a coordinator with the secret is
//! served, only `stage` processes start, exits and kills are relayed, and a lost agent is
//! reported naming its node.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use omnirig_harness::process::StageChild;
use omnirig_hil::agent::{Agent, AgentChild};

const SECRET: &str = "a-secret-of-enough-length";

/// A stand-in for `omnirig`: a script that exits with the code in its environment or sleeps.
fn fake_omnirig() -> PathBuf {
    let p = std::env::temp_dir().join(format!("omnirig-fake-{}.sh", std::process::id()));
    std::fs::write(
        &p,
        "#!/bin/sh\n[ \"$1\" = stage ] || exit 3\n[ -n \"$OMNIRIG_RUN_SECRET\" ] || exit 4\n[ \"$2\" = sleep ] && exec sleep 30\n[ \"$2\" = log ] && printf '\\033[2mINFO\\033[0m rdma: selected device rxe0\\nnot an rdma line\\n' >&2\nexit 0\n",
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

async fn agent() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let a = Arc::new(Agent::new(fake_omnirig(), SECRET.into()).unwrap());
    tokio::spawn(a.serve(listener));
    addr
}

fn env() -> Vec<(String, String)> {
    vec![("OMNIRIG_RUN_SECRET".into(), "x".repeat(32))]
}

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_stage_processes_and_relays_their_exit() {
    let addr = agent().await;
    let mut c = AgentChild::start("node-a", addr, SECRET, args(&["stage", "x"]), env())
        .await
        .unwrap();
    assert!(c.remote_pid() > 0);
    let st = tokio::time::timeout(Duration::from_secs(10), c.wait())
        .await
        .unwrap();
    assert_eq!(st, "exit status: 0");
    assert_eq!(c.try_wait().as_deref(), Some("exit status: 0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_is_relayed() {
    let addr = agent().await;
    let mut c = AgentChild::start("node-a", addr, SECRET, args(&["stage", "sleep"]), env())
        .await
        .unwrap();
    assert!(c.try_wait().is_none());
    let t = Instant::now();
    c.start_kill();
    let st = tokio::time::timeout(Duration::from_secs(10), c.wait())
        .await
        .unwrap();
    assert!(st.contains("SIGKILL") || st.contains("signal: 9"), "{st}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_wrong_secret_other_programs_and_foreign_environment() {
    let addr = agent().await;
    let wrong = AgentChild::start(
        "node-a",
        addr,
        "not-the-secret-at-all",
        args(&["stage"]),
        env(),
    )
    .await
    .err()
    .expect("a wrong secret is refused");
    let s = wrong.to_string();
    assert!(s.contains("node-a") && s.contains("wrong secret"), "{s}");
    let other = AgentChild::start("node-a", addr, SECRET, args(&["sh", "-c", "id"]), env())
        .await
        .err()
        .expect("only stage processes start");
    assert!(
        other.to_string().contains("only `omnirig stage`"),
        "{other}"
    );
    let mut bad_env = env();
    bad_env.push(("LD_PRELOAD".into(), "/tmp/x.so".into()));
    let e = AgentChild::start("node-a", addr, SECRET, args(&["stage"]), bad_env)
        .await
        .err()
        .expect("foreign variables are refused");
    assert!(e.to_string().contains("LD_PRELOAD"), "{e}");
    // Nobody listening: the error names the node and says what to run there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let e = AgentChild::start("node-z", closed, SECRET, args(&["stage"]), env())
        .await
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("node-z") && e.to_string().contains("omnirig agent"),
        "{e}"
    );
}

/// An agent whose connection drops while its stage runs (the node died): the coordinator's
/// handle ends, naming the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_agent_is_reported_naming_its_node() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 8 + 1 + 128];
        s.read_exact(&mut buf).await.unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await.unwrap();
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut body).await.unwrap();
        let reply = br#"{"started":{"pid":42}}"#;
        s.write_all(&(reply.len() as u32).to_be_bytes())
            .await
            .unwrap();
        s.write_all(reply).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        // The node dies: the connection drops without an exit report.
    });
    let mut c = AgentChild::start("node-b", addr, SECRET, args(&["stage"]), env())
        .await
        .unwrap();
    assert_eq!(c.remote_pid(), 42);
    let st = tokio::time::timeout(Duration::from_secs(10), c.wait())
        .await
        .unwrap();
    assert!(st.contains("lost node node-b"), "{st}");
}

/// The agent relays a stage's stderr and keeps its rdma lines, colour codes stripped, until
/// a coordinator clears them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeps_the_rdma_lines_its_stages_log() {
    let addr = agent().await;
    let mut c = AgentChild::start("node-a", addr, SECRET, args(&["stage", "log"]), env())
        .await
        .unwrap();
    let st = tokio::time::timeout(Duration::from_secs(10), c.wait())
        .await
        .unwrap();
    assert_eq!(st, "exit status: 0");
    // The relay task may trail the exit by a moment.
    let mut lines = vec![];
    for _ in 0..50 {
        lines = omnirig_hil::agent::engine_log("node-a", addr, SECRET, false)
            .await
            .unwrap();
        if !lines.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(lines, vec!["INFO rdma: selected device rxe0".to_string()]);
    let again = omnirig_hil::agent::engine_log("node-a", addr, SECRET, true)
        .await
        .unwrap();
    assert_eq!(again, lines);
    let cleared = omnirig_hil::agent::engine_log("node-a", addr, SECRET, false)
        .await
        .unwrap();
    assert!(cleared.is_empty(), "{cleared:?}");
    // A wrong secret gets nothing.
    assert!(
        omnirig_hil::agent::engine_log("node-a", addr, "not-the-secret-at-all", false)
            .await
            .is_err()
    );
}

/// A perftest request the agent will not run: refused with the field named, nothing started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_perftest_requests_with_bad_fields() {
    use omnirig_hil::evidence::{PerfTool, PerftestRequest};
    let addr = agent().await;
    let req = PerftestRequest {
        tool: PerfTool::IbWriteBw,
        device: "rxe0 -x 1; reboot".into(),
        port: 1,
        gid_index: None,
        size: 4096,
        iterations: 10,
        tcp_port: 18_900,
        server: None,
    };
    let p = omnirig_hil::agent::perftest("node-a", addr, SECRET, req)
        .await
        .unwrap();
    assert!(!p.ran, "{p:?}");
    let why = p.why_not.unwrap_or_default();
    assert!(why.contains("refused") && why.contains("device"), "{why}");
}
