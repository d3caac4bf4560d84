//! Hardware-in-the-loop mode (`cargo test --features hil`).
//!
//! `golden_cases_on_the_cluster` runs the case list `cargo test loopback` runs
//! ([`omnirig_fixtures::golden_cases`], the one definition both read) with the stages placed
//! on the nodes of the cluster file `OMNIRIG_CLUSTER` names, plus the default scenario
//! (repeats, prefix hits, concurrency). Without `OMNIRIG_CLUSTER` it prints SKIPPED and what
//! to set; with `OMNIRIG_HIL_REQUIRED=1` (CI lanes that have a cluster) that is a failure.
//! The hops run over rdma between the nodes (each stage on its node's `rdma` device, port and
//! GID index) when every node has an `rdma` section, else over tcp; `OMNIRIG_HIL_TRANSPORT`
//! overrides. `faults_on_the_cluster` runs the fault cases that apply to real links on the same
//! cluster: a stage process killed mid-run on its node, and a hop deadline too short for the
//! link; each run ends, fails exactly what it should with an error naming it, and leaves every
//! pool clean.
//!
//! `a_node_that_dies_mid_run_fails_its_requests_naming_it` needs no cluster: it starts two
//! agents on 127.0.0.1, each in its own process group (a "node"), and kills one mid-run.
#![cfg(feature = "hil")]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use omnirig_harness::{Report, Runner, Scenario};
use omnirig_hil::{Cluster, ClusterLauncher, start_agents};
use omnirig_transports::TransportKind;

const EXE: &str = env!("CARGO_BIN_EXE_omnirig");

fn assert_clean_pass(r: &Report, what: &str) {
    for q in &r.requests {
        assert!(q.ok, "{what} {}: {:?}", q.id, q.error);
        for h in &q.hops {
            assert!(h.verified, "{what} {} {}: not verified", q.id, h.hop);
            assert_eq!(
                h.moved_bytes + h.reused_bytes,
                h.bytes,
                "{what} {} {}",
                q.id,
                h.hop
            );
        }
    }
    assert!(r.summary.pools_clean, "{what}: {}", r.summary_text());
    assert!(r.passed(), "{what}: {}", r.summary_text());
    assert_eq!(r.mode, "cluster");
}

/// The cluster `OMNIRIG_CLUSTER` names and the hops' transport, or None (after saying
/// SKIPPED, or failing under `OMNIRIG_HIL_REQUIRED=1`) without one.
fn cluster_under_test(test: &str) -> Option<(Cluster, TransportKind)> {
    let Some(path) = std::env::var_os("OMNIRIG_CLUSTER") else {
        let msg = format!(
            "SKIPPED {test}: set OMNIRIG_CLUSTER=path/to/cluster.yaml (see \
             hil/cluster.example.yaml and the README's HIL section) to run it on a cluster's \
             nodes; nothing was run, nothing passed"
        );
        if std::env::var("OMNIRIG_HIL_REQUIRED").as_deref() == Ok("1") {
            panic!("OMNIRIG_HIL_REQUIRED=1: {msg}");
        }
        // Straight to stderr, past the test harness's capture: a skip must be seen.
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "{msg}");
        return None;
    };
    let cluster = Cluster::from_path(&PathBuf::from(path)).unwrap();
    let transport = match std::env::var("OMNIRIG_HIL_TRANSPORT") {
        Ok(t) => t.parse().expect("OMNIRIG_HIL_TRANSPORT names a transport"),
        Err(_) if cluster.nodes.iter().all(|n| n.rdma.is_some()) => TransportKind::Rdma,
        Err(_) => TransportKind::Tcp,
    };
    println!(
        "{test}: cluster {} ({} nodes), hops over {transport}",
        cluster.name,
        cluster.nodes.len()
    );
    Some((cluster, transport))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_cases_on_the_cluster() {
    let Some((cluster, transport)) = cluster_under_test("golden_cases_on_the_cluster") else {
        return;
    };
    let _agents = start_agents(&cluster, EXE, Duration::from_secs(60))
        .await
        .unwrap();
    let launcher = Arc::new(ClusterLauncher::new(cluster.clone()).unwrap());
    let cases = omnirig_fixtures::golden_cases();
    assert!(!cases.is_empty());
    for case in &cases {
        let r = Runner::new(Scenario::golden(&case.name, transport))
            .cluster(launcher.clone())
            .run()
            .await
            .unwrap();
        assert_clean_pass(&r, &case.name);
        for (hop, t) in &r.transports {
            assert_eq!(t, transport.as_str(), "{}: hop {hop}", case.name);
        }
        println!(
            "{} on cluster {}: ok, {}",
            case.name,
            cluster.name,
            r.summary_text().lines().next().unwrap_or("")
        );
    }
    let r = Runner::new(Scenario::default_scenario().with_transport(transport))
        .cluster(launcher)
        .run()
        .await
        .unwrap();
    assert_clean_pass(&r, "default scenario");
}

/// The fault cases that apply to real links, on the cluster: a stage process SIGKILLed on
/// its node mid-run (its queue pairs and sockets die with it), and a hop deadline far below
/// what the link can do. Scripted in-process faults (bad sidecars, forged grants) are the
/// fault matrix's (`cargo test faults`), run on every transport there; they test the
/// connectors, not the link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_on_the_cluster() {
    let Some((cluster, transport)) = cluster_under_test("faults_on_the_cluster") else {
        return;
    };
    let _agents = start_agents(&cluster, EXE, Duration::from_secs(60))
        .await
        .unwrap();
    let launcher = Arc::new(ClusterLauncher::new(cluster.clone()).unwrap());
    let talker_node = cluster
        .node_of(omnirig_fixtures::Stage::Talker)
        .name
        .clone();

    // The talker's process dies on its node while requests are in flight: they arrive every
    // 250 ms for 20 s whatever the hardware, and the kill comes 8 s in.
    let mut s = Scenario::from_yaml(
        "name: killed-on-node\nconcurrency: 2\narrival: {pattern: interval, interval_ms: 250}\n\
         hop_timeout_s: 20\nrequest_timeout_s: 60\nrequests:\n  - case: text_short\n    repeat: 80\n",
        "killed-on-node",
    )
    .unwrap()
    .with_transport(transport);
    s.kill_stage = Some(omnirig_harness::scenario::KillStage {
        stage: "talker".into(),
        after_ms: 8000,
    });
    let t = std::time::Instant::now();
    let r = Runner::new(s)
        .cluster(launcher.clone())
        .run()
        .await
        .unwrap();
    println!(
        "killed talker: {} in {:?}",
        r.summary_text().lines().next().unwrap_or(""),
        t.elapsed()
    );
    assert_eq!(r.requests.len(), 80);
    assert!(
        r.summary.failed > 0,
        "nothing failed although the talker was killed"
    );
    for q in r.requests.iter().filter(|q| !q.ok) {
        let e = q.error.as_deref().unwrap_or_default();
        assert!(
            [
                "closed",
                "disconnected",
                "process",
                "gone",
                "timed out",
                "talker"
            ]
            .iter()
            .any(|w| e.contains(w)),
            "{}: {e}",
            q.id
        );
    }
    for q in r.requests.iter().filter(|q| q.ok) {
        assert!(
            q.hops.iter().all(|h| h.verified),
            "{}: passed unverified",
            q.id
        );
    }
    for st in &r.stages {
        if st.stage == "talker" {
            let how = st.exited.as_deref().unwrap_or_default();
            assert!(
                how.contains(&talker_node),
                "talker's end names its node: {st:?}"
            );
        } else {
            assert!(st.is_clean(), "{} leaked: {st:?}", st.stage);
        }
    }

    // A hop deadline no link meets: requests fail as timed out (or pass, bit-exact), the run
    // ends promptly, and nothing is left registered or granted.
    let mut s = Scenario::golden("image_audio", transport);
    s.concurrency = 2;
    s.requests[0].repeat = 6;
    s.hop_timeout_s = 1e-4;
    let t = std::time::Instant::now();
    let r = Runner::new(s).cluster(launcher).run().await.unwrap();
    println!(
        "tiny hop deadline: {} in {:?}",
        r.summary_text().lines().next().unwrap_or(""),
        t.elapsed()
    );
    assert!(
        t.elapsed() < Duration::from_secs(120),
        "took {:?}",
        t.elapsed()
    );
    assert!(r.summary.failed > 0, "a 0.1 ms hop deadline failed nothing");
    for q in &r.requests {
        if q.ok {
            assert!(q.hops.iter().all(|h| h.verified), "{}", q.id);
        } else {
            // Classified, and a timeout: the engine's or the control channel's deadline
            // (timed_out), or a grant the consumer gave up at the hop's deadline: a credit
            // that expired before the producer wrote, or one revoked while its write was
            // running (grant_refused, naming the expiry or the revoke): the fence refuses the
            // late write.
            let f = q
                .failure
                .as_ref()
                .unwrap_or_else(|| panic!("{}: unclassified {:?}", q.id, q.error));
            let e = q.error.as_deref().unwrap_or_default();
            assert!(
                f.kind.as_str() == "timed_out"
                    || e.contains("within")
                    || (f.kind.as_str() == "grant_refused"
                        && (e.contains("expired") || e.contains("revoked"))),
                "{}: {} {e}",
                q.id,
                f.kind.as_str()
            );
        }
    }
    assert!(r.summary.pools_clean, "{}", r.summary_text());
}

/// A "node": an agent in its own process group, so killing the group kills the agent and
/// every stage it started, as a node's power loss would.
struct Node {
    child: Child,
}

impl Node {
    fn start(port: u16, secret: &str) -> Node {
        use std::os::unix::process::CommandExt;
        let child = Command::new(EXE)
            .args(["agent", "--listen", &format!("127.0.0.1:{port}")])
            .env("OMNIRIG_AGENT_SECRET", secret)
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        Node { child }
    }

    fn kill(&mut self) {
        let st = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .status()
            .unwrap();
        assert!(st.success());
        let _ = self.child.wait();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_dies_mid_run_fails_its_requests_naming_it() {
    let secret = "node-death-test-secret";
    let (pa, pb) = (free_port(), free_port());
    let yaml = format!(
        "name: two-local\nsecret: {secret}\ncoordinator: {{address: 127.0.0.1}}\nnodes:\n  \
         - {{name: node-a, host: 127.0.0.1, agent_port: {pa}, stages: [encoder, thinker_prefill, thinker_decode]}}\n  \
         - {{name: node-b, host: 127.0.0.1, agent_port: {pb}, stages: [talker, code2wav]}}\n"
    );
    let cluster = Cluster::from_yaml(&yaml, "test cluster").unwrap();
    let _a = Node::start(pa, secret);
    let mut b = Node::start(pb, secret);
    start_agents(&cluster, EXE, Duration::from_secs(30))
        .await
        .unwrap();
    // Enough requests that node-b dies with some in flight.
    let scenario = Scenario::from_yaml(
        "name: node-death\ntransport: tcp\nconcurrency: 2\nrequests:\n  - case: image_audio\n    repeat: 400\n",
        "node-death",
    )
    .unwrap();
    let finished = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let runner = Runner::new(scenario)
        .cluster(Arc::new(ClusterLauncher::new(cluster).unwrap()))
        .count_finished(finished.clone());
    let run = tokio::spawn(async move { runner.run().await });
    // Node b dies once requests flow through it (set up, two finished), not after a guessed
    // delay: a slow machine still sets up when a fixed sleep has run out.
    let t = std::time::Instant::now();
    while finished.load(std::sync::atomic::Ordering::Relaxed) < 2 {
        assert!(
            t.elapsed() < Duration::from_secs(120) && !run.is_finished(),
            "no request finished before the kill"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    b.kill();
    let r = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the run ends after a node died")
        .unwrap()
        .expect("the run reports after a node died");
    assert!(!r.passed(), "{}", r.summary_text());
    let failed: Vec<_> = r.requests.iter().filter(|q| !q.ok).collect();
    assert!(!failed.is_empty(), "{}", r.summary_text());
    assert!(
        failed
            .iter()
            .any(|q| q.error.as_deref().is_some_and(|e| e.contains("node-b"))),
        "no failure names node-b: {:?}",
        failed.iter().map(|q| &q.error).collect::<Vec<_>>()
    );
    // Node b's stages report how they ended, naming the node.
    for st in r
        .stages
        .iter()
        .filter(|s| s.stage == "talker" || s.stage == "code2wav")
    {
        assert!(
            st.exited.as_deref().is_some_and(|e| e.contains("node-b")),
            "{st:?}"
        );
    }
    println!("{}", r.summary_text());
}

/// `omnirig evidence` on two local agents: every node's facts (or why each probe could not
/// run), the TCP path measured per hop and passed, and every path it cannot run says why.
#[test]
fn evidence_collects_facts_measures_tcp_and_says_why_for_the_rest() {
    let secret = "evidence-test-secret-01";
    let (pa, pb) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("omnirig-evidence-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cluster = dir.join("cluster.yaml");
    std::fs::write(
        &cluster,
        format!(
            "name: ev-local\nsecret: {secret}\ncoordinator: {{address: 127.0.0.1}}\nnodes:\n  \
             - {{name: node-a, host: 127.0.0.1, agent_port: {pa}, stages: [encoder, thinker_prefill, thinker_decode]}}\n  \
             - {{name: node-b, host: 127.0.0.1, agent_port: {pb}, netdev: lo, stages: [talker, code2wav]}}\n"
        ),
    )
    .unwrap();
    let scenario = dir.join("scenario.yaml");
    std::fs::write(&scenario, "name: ev\nrequests:\n  - case: text_short\n").unwrap();
    let (_a, _b) = (Node::start(pa, secret), Node::start(pb, secret));
    let out = dir.join("out");
    let st = Command::new(EXE)
        .args(["evidence", "--cluster"])
        .arg(&cluster)
        .arg("--out")
        .arg(&out)
        .arg("--scenario")
        .arg(&scenario)
        .status()
        .unwrap();
    assert!(st.success());
    let ev: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("evidence.json")).unwrap()).unwrap();
    let nodes = ev["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2);
    for n in nodes {
        let probes = n["facts"]["probes"]
            .as_array()
            .expect("facts from the agent");
        assert!(!probes.is_empty());
        for p in probes {
            // Each probe has output, or says why not.
            assert!(p["output"].is_string() || p["why_not"].is_string(), "{p}");
        }
        let kernel = probes.iter().find(|p| p["name"] == "kernel").unwrap();
        assert!(
            kernel["output"].as_str().unwrap().starts_with("Linux"),
            "{kernel}"
        );
    }
    let paths = ev["paths"].as_array().unwrap();
    let tcp = &paths[0];
    assert_eq!(
        (tcp["ran"].as_bool(), tcp["passed"].as_bool()),
        (Some(true), Some(true))
    );
    // text_short has no encoder hop: the other three, each measured over tcp.
    let hops = tcp["hops"].as_array().unwrap();
    assert_eq!(hops.len(), 3, "{tcp}");
    for h in hops {
        assert_eq!(h["transport"], "tcp", "{h}");
        assert!(
            h["requests"].as_u64() > Some(0) && h["transfer_ms_p50"].as_f64() > Some(0.0),
            "{h}"
        );
    }
    for p in paths
        .iter()
        .skip(1)
        .chain(ev["baselines"].as_array().unwrap())
    {
        assert_eq!(p["ran"], false, "{p}");
        assert!(p["why_not"].as_str().is_some_and(|w| !w.is_empty()), "{p}");
    }
    // Each path that could not run names its reason: node-a has no netdev, no node rdma.
    let why = |label: &str| {
        paths
            .iter()
            .chain(ev["baselines"].as_array().unwrap())
            .find(|p| p["label"].as_str().is_some_and(|l| l.starts_with(label)))
            .and_then(|p| p["why_not"].as_str())
            .unwrap_or_else(|| panic!("no why_not for {label}"))
            .to_owned()
    };
    assert!(why("TCP over").contains("node-a names no netdev"));
    assert!(why("RDMA from").contains("no rdma section"));
    assert!(why("GPU memory over RDMA").contains("cuda"));
    // ... and each hop's GPU path says it did not run, with the same reason
    let gpu = paths
        .iter()
        .find(|p| {
            p["label"]
                .as_str()
                .is_some_and(|l| l.starts_with("GPU memory over RDMA"))
        })
        .unwrap();
    let gpu_hops = gpu["gpu_hops"].as_array().expect("gpu_hops");
    assert_eq!(gpu_hops.len(), 4, "{gpu}");
    for h in gpu_hops {
        assert_eq!(h["path"], "not run", "{h}");
        assert!(
            h["detail"].as_str().is_some_and(|d| d.contains("cuda")),
            "{h}"
        );
    }
    assert!(why("ib_write_bw").contains("no rdma section"));
    // The tcp run's plots: bandwidth per hop against size, the latency CDF per hop.
    for f in [
        "evidence-bandwidth.png",
        "evidence-bandwidth.svg",
        "evidence-latency-cdf.png",
        "evidence-latency-cdf.svg",
    ] {
        assert!(
            ev["plots"].as_array().unwrap().iter().any(|p| p == f),
            "{f}"
        );
        assert!(out.join(f).metadata().unwrap().len() > 1000, "{f}");
    }
    let md = std::fs::read_to_string(out.join("evidence.md")).unwrap();
    assert!(
        md.contains("| node-a | 127.0.0.1 |") && md.contains("passed, bit-exact"),
        "{md}"
    );
    assert!(out.join("tcp/report.json").is_file() && out.join("tcp/index.html").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A private sshd on 127.0.0.1 (its own host key, one authorized client key, an ssh_config
/// for the coordinator), stopped when dropped: the `reach: ssh` path run for real.
struct Sshd {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl Sshd {
    /// None (after saying SKIPPED, or failing under `OMNIRIG_SSH_REQUIRED=1`) where there is
    /// no sshd binary.
    fn start(test: &str) -> Option<Sshd> {
        let sshd = ["/usr/sbin/sshd", "/usr/bin/sshd"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists());
        let Some(sshd) = sshd else {
            let msg = format!(
                "SKIPPED {test}: no sshd (Debian: apt-get install openssh-server); nothing passed"
            );
            assert!(
                std::env::var("OMNIRIG_SSH_REQUIRED").as_deref() != Ok("1"),
                "OMNIRIG_SSH_REQUIRED=1: {msg}"
            );
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "{msg}");
            return None;
        };
        let dir = std::env::temp_dir().join(format!("omnirig-sshd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for key in ["host_key", "client_key"] {
            let st = Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                .arg(dir.join(key))
                .status()
                .unwrap();
            assert!(st.success(), "ssh-keygen {key}");
        }
        std::fs::copy(dir.join("client_key.pub"), dir.join("authorized_keys")).unwrap();
        // sshd refuses to start without its privilege separation directory.
        let _ = std::fs::create_dir_all("/run/sshd");
        let port = free_port();
        let d = dir.display();
        std::fs::write(
            dir.join("sshd_config"),
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\n\
                 AuthorizedKeysFile {d}/authorized_keys\nPidFile {d}/sshd.pid\nStrictModes no\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n\
                 PermitRootLogin prohibit-password\n"
            ),
        )
        .unwrap();
        let user = String::from_utf8(Command::new("id").arg("-un").output().unwrap().stdout)
            .unwrap()
            .trim()
            .to_owned();
        std::fs::write(
            dir.join("ssh_config"),
            format!(
                "Host omnirig-ssh-*\n  HostName 127.0.0.1\n  Port {port}\n  User {user}\n  \
                 IdentityFile {d}/client_key\n  IdentitiesOnly yes\n  \
                 StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
            ),
        )
        .unwrap();
        let child = Command::new(sshd)
            .args(["-D", "-e", "-f"])
            .arg(dir.join("sshd_config"))
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let t = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(t.elapsed() < Duration::from_secs(20), "sshd never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(Sshd { child, dir, port })
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `reach: ssh` for real: the coordinator starts both nodes' agents through `ssh` (a private
/// sshd on 127.0.0.1, the cluster's `ssh_config`), hands each its secret down stdin, runs a
/// golden case through them bit-exact with clean pools, and when the coordinator lets go of
/// its ssh sessions the agents exit with them (their ports close): nothing is left on a node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_started_over_ssh_run_the_cases_and_end_with_their_session() {
    let Some(sshd) =
        Sshd::start("agents_started_over_ssh_run_the_cases_and_end_with_their_session")
    else {
        return;
    };
    let (pa, pb) = (free_port(), free_port());
    let yaml = format!(
        "name: two-over-ssh\nsecret: ssh-started-agents-secret\n\
         coordinator: {{address: 127.0.0.1}}\nssh_config: {}/ssh_config\nnodes:\n  \
         - {{name: node-a, host: 127.0.0.1, reach: ssh, ssh: omnirig-ssh-a, agent_port: {pa}, stages: [encoder, thinker_prefill, thinker_decode]}}\n  \
         - {{name: node-b, host: 127.0.0.1, reach: ssh, ssh: omnirig-ssh-b, agent_port: {pb}, stages: [talker, code2wav]}}\n",
        sshd.dir.display()
    );
    let cluster = Cluster::from_yaml(&yaml, "ssh test cluster").unwrap();
    agents_run_the_cases_and_end_with_their_launcher(
        &cluster,
        2,
        &format!("ssh, sshd on port {}", sshd.port),
    )
    .await;
}

/// Starts `cluster`'s agents (`started` of them through ssh or srun), runs a golden case
/// through them bit-exact with clean pools, lets go of the launchers, and checks every
/// started agent's port closes: the agents ended with their sessions.
async fn agents_run_the_cases_and_end_with_their_launcher(
    cluster: &Cluster,
    started: usize,
    how: &str,
) {
    let agents = start_agents(cluster, EXE, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("agents started by {how}: {e}"));
    assert_eq!(agents.len(), started, "agents started by {how}");
    let launcher = Arc::new(ClusterLauncher::new(cluster.clone()).unwrap());
    let r = Runner::new(Scenario::golden("image_audio", TransportKind::Tcp))
        .cluster(launcher)
        .run()
        .await
        .unwrap();
    assert_clean_pass(&r, &format!("over agents started by {how}"));
    drop(agents);
    for node in cluster
        .nodes
        .iter()
        .filter(|n| n.reach != omnirig_hil::Reach::Manual)
    {
        let t = std::time::Instant::now();
        while std::net::TcpStream::connect((node.host, node.agent_port)).is_ok() {
            assert!(
                t.elapsed() < Duration::from_secs(15),
                "{}'s agent outlived the {how} session that started it",
                node.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `reach: srun` for real, where a Slurm controller answers (`ci/slurm-local.sh` starts a
/// one-node one on this machine; `OMNIRIG_SLURM_REQUIRED=1` makes its absence a failure):
/// node-a is the Slurm node and its agent starts through `srun -w`, node-b's by hand; a golden
/// case runs through both bit-exact, and node-a's agent ends with its srun.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_started_by_srun_runs_the_cases_and_ends_with_its_step() {
    let test = "an_agent_started_by_srun_runs_the_cases_and_ends_with_its_step";
    let slurm_node = Command::new("sinfo")
        .args(["-h", "-o", "%n"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(|l| l.trim().to_owned()))
        .filter(|n| !n.is_empty());
    let Some(slurm_node) = slurm_node else {
        let msg = format!(
            "SKIPPED {test}: no Slurm controller answers `sinfo` (ci/slurm-local.sh starts a \
             one-node Slurm here); nothing passed"
        );
        assert!(
            std::env::var("OMNIRIG_SLURM_REQUIRED").as_deref() != Ok("1"),
            "OMNIRIG_SLURM_REQUIRED=1: {msg}"
        );
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "{msg}");
        return;
    };
    let secret = "srun-started-agent-secret";
    let (pa, pb) = (free_port(), free_port());
    let yaml = format!(
        "name: srun-and-manual\nsecret: {secret}\ncoordinator: {{address: 127.0.0.1}}\nnodes:\n  \
         - {{name: {slurm_node}, host: 127.0.0.1, reach: srun, agent_port: {pa}, stages: [encoder, thinker_prefill, thinker_decode]}}\n  \
         - {{name: node-b, host: 127.0.0.1, agent_port: {pb}, stages: [talker, code2wav]}}\n"
    );
    let cluster = Cluster::from_yaml(&yaml, "srun test cluster").unwrap();
    let _b = Node::start(pb, secret);
    agents_run_the_cases_and_end_with_their_launcher(&cluster, 1, "srun").await;
}
