//! Stages as OS processes, as a real deployment runs them.
//!
//! The orchestrator (`omnirig run --processes`) listens on 127.0.0.1, starts
//! `omnirig stage --stage S --orchestrator ADDR` five times, and each stage
//! says Hello with its control listener and engines' TCP addresses. The
//! orchestrator sends each stage the scenario and its downstream peer; the
//! stage connects its outbound control link and its engine (peer-to-peer
//! handshake) to that peer, then reports Ready. Requests are `Run` messages;
//! each stage answers `StageDone`. `Shutdown` makes a stage drain and answer
//! `Bye` with its usage, then exit. Every link is framed msgpack over TCP.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use omnirig_fixtures::{ModelCard, PayloadKind, RequestPlan, RequestSpec, Stage, plan_request};
use omnirig_model_stubs::Stub;
use omnirig_transports::{Engine, EngineConfig, InProcessStore, TransportKind};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};

use crate::control::{Link, Msg};
use crate::error::{HarnessError, Result};
use crate::scenario::{Scenario, StageMemory};
use crate::stage::{HopEnd, StageOutcome, StageUsage, StageWorker, inbound_kind, outbound_kind};

/// How long setup steps (process start, handshakes) may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);
/// A stage process waits this long for its next instruction.
const IDLE_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

fn setup(msg: impl std::fmt::Display) -> HarnessError {
    HarnessError::Setup(msg.to_string())
}

/// The environment variable that hands a stage process its run's secret.
pub const RUN_SECRET_ENV: &str = "OMNIRIG_RUN_SECRET";
/// What a connection sends first, before anything it says is decoded: this magic and the
/// run's secret (32 hex digits). Fixed length, so nothing sized by the peer is read before
/// it proved it is a stage of this run.
const PREFACE_MAGIC: &[u8; 8] = b"OMNIRIG1";
const PREFACE_LEN: usize = 8 + 32;
/// How long an accepted connection has to send its preface.
const PREFACE_TIMEOUT: Duration = Duration::from_secs(5);

/// A fresh secret for one run: 128 bits from the kernel, as hex.
fn new_secret() -> Result<String> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| setup(format!("reading /dev/urandom for the run secret: {e}")))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn preface(secret: &str) -> Vec<u8> {
    let mut p = PREFACE_MAGIC.to_vec();
    p.extend_from_slice(secret.as_bytes());
    p
}

/// Connects to `addr` and proves this process is a stage of the run holding `secret`.
async fn connect_with_secret(addr: SocketAddr, secret: &str) -> Result<TcpStream> {
    use tokio::io::AsyncWriteExt;
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(&preface(secret)).await?;
    Ok(s)
}

/// Reads an accepted connection's preface; the stream if it carries `secret`.
async fn check_preface(mut s: TcpStream, secret: &str) -> Option<TcpStream> {
    use tokio::io::AsyncReadExt;
    let mut got = [0u8; PREFACE_LEN];
    match tokio::time::timeout(PREFACE_TIMEOUT, s.read_exact(&mut got)).await {
        Ok(Ok(_)) if got[..] == preface(secret)[..] => Some(s),
        _ => None,
    }
}

/// Accepts connections on `listener` until one proves it belongs to the run (by `deadline`).
/// Connections that stay silent, send garbage or the wrong secret are dropped without
/// holding up the others: each gets its own task and [`PREFACE_TIMEOUT`].
struct Gate {
    verified: tokio::sync::mpsc::Receiver<TcpStream>,
    task: tokio::task::JoinHandle<()>,
}

impl Gate {
    fn new(listener: TcpListener, secret: String) -> Gate {
        let (tx, verified) = tokio::sync::mpsc::channel(16);
        let task = tokio::spawn(async move {
            while let Ok((s, peer)) = listener.accept().await {
                let (tx, secret) = (tx.clone(), secret.clone());
                tokio::spawn(async move {
                    match check_preface(s, &secret).await {
                        Some(s) => {
                            let _ = tx.send(s).await;
                        }
                        None => {
                            tracing::warn!(%peer, "control connection without the run's secret dropped")
                        }
                    }
                });
            }
        });
        Gate { verified, task }
    }

    async fn next(&mut self, deadline: tokio::time::Instant, what: &str) -> Result<TcpStream> {
        match tokio::time::timeout_at(deadline, self.verified.recv()).await {
            Ok(Some(s)) => Ok(s),
            _ => Err(setup(format!(
                "{what} did not connect with the run's secret in time"
            ))),
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A stage's link, inbound and outbound engine addresses, control address.
type Hello = (Link, Option<String>, Option<String>, String);

/// Starts stage processes: on this host ([`LocalLauncher`]) or through node agents
/// (`omnirig-hil`'s cluster launcher).
pub trait StageLauncher: Send + Sync {
    /// Where the orchestrator listens for its stages (they dial back to it).
    fn orchestrator_listen(&self) -> SocketAddr;
    /// The address `stage` binds its control listener and engines to.
    fn bind_host(&self, stage: Stage) -> std::net::IpAddr;
    /// The node `stage` runs on, named in errors (None on this host).
    fn node(&self, stage: Stage) -> Option<String>;
    /// The metadata store stage engines publish to and find each other through
    /// ([`omnirig_transports::metadata::open_store`]'s spec); None: peer-to-peer.
    fn metadata(&self) -> Option<String> {
        None
    }
    /// The RDMA device `stage`'s engines use (a cluster node's `rdma` section); None: the
    /// rdma transport's defaults (the first device, the first RoCEv2 IPv4 GID).
    fn rdma(&self, _stage: Stage) -> Option<StageRdma> {
        None
    }
    /// Starts `omnirig stage ARGS` for `stage` with `env` added to its environment.
    fn launch<'a>(
        &'a self,
        stage: Stage,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> BoxFuture<'a, Result<Box<dyn StageChild>>>;
}

/// The RDMA device, port and GID index a stage's rdma engines use (`omnirig stage
/// --rdma-device D --rdma-port P --rdma-gid-index G`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageRdma {
    pub device: String,
    /// 1-based.
    pub port: u8,
    /// None: the first RoCEv2 IPv4 GID (the first GID on InfiniBand).
    pub gid_index: Option<u32>,
}

/// The devices a stage process uses: its node's RDMA device (None: the transport's defaults)
/// and where its tensors live.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StageDevices {
    pub rdma: Option<StageRdma>,
    pub memory: StageMemory,
}

type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// A started stage process, wherever it runs.
pub trait StageChild: Send {
    /// Its process id on this host, if it runs here (the stopped-process watchdog reads
    /// /proc).
    fn local_pid(&self) -> Option<u32>;
    /// How it ended, if it has.
    fn try_wait(&mut self) -> Option<String>;
    /// Starts killing it (SIGKILL).
    fn start_kill(&mut self);
    /// Waits for it to end; how it ended.
    fn wait(&mut self) -> BoxFuture<'_, String>;
}

/// Stage processes of `exe` on this host, on 127.0.0.1.
pub struct LocalLauncher {
    pub exe: std::path::PathBuf,
}

impl StageLauncher for LocalLauncher {
    fn orchestrator_listen(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 0))
    }

    fn bind_host(&self, _: Stage) -> std::net::IpAddr {
        std::net::Ipv4Addr::LOCALHOST.into()
    }

    fn node(&self, _: Stage) -> Option<String> {
        None
    }

    fn launch<'a>(
        &'a self,
        stage: Stage,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> BoxFuture<'a, Result<Box<dyn StageChild>>> {
        Box::pin(async move {
            let child = Command::new(&self.exe)
                .args(&args)
                .envs(env)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| setup(format!("starting {} {stage}: {e}", self.exe.display())))?;
            Ok(Box::new(child) as Box<dyn StageChild>)
        })
    }
}

impl StageChild for Child {
    fn local_pid(&self) -> Option<u32> {
        self.id()
    }

    fn try_wait(&mut self) -> Option<String> {
        Child::try_wait(self).ok().flatten().map(|s| s.to_string())
    }

    fn start_kill(&mut self) {
        let _ = Child::start_kill(self);
    }

    fn wait(&mut self) -> BoxFuture<'_, String> {
        Box::pin(async move {
            match Child::wait(self).await {
                Ok(s) => s.to_string(),
                Err(e) => format!("waiting for it failed: {e}"),
            }
        })
    }
}

type Children = Arc<tokio::sync::Mutex<Vec<Box<dyn StageChild>>>>;

/// The orchestrator's handle on five stage processes.
pub struct Remote {
    links: Vec<(Stage, Link)>,
    children: Children,
    /// The node each stage runs on, when not this host.
    nodes: Vec<Option<String>>,
    scenario: Scenario,
    /// Set once a stage process died or stopped answering: no new request starts.
    halted: Arc<std::sync::Mutex<Option<(Stage, String)>>>,
    watchdog: tokio::task::JoinHandle<()>,
}

impl Drop for Remote {
    fn drop(&mut self) {
        self.watchdog.abort();
    }
}

/// Whether process `pid` is stopped (state `T`: SIGSTOP, SIGTSTP), from /proc.
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let (_, rest) = s.rsplit_once(')')?;
            rest.split_whitespace().next().map(|st| st == "T")
        })
        .unwrap_or(false)
}

/// How long a stage process may stay stopped before the run gives up on it.
const STOPPED_FOR: Duration = Duration::from_secs(1);

/// Watches the stage processes: one that stays stopped (SIGSTOP) for [`STOPPED_FOR`] can
/// answer nothing, so it is recorded as lost and killed at once, which closes its sockets and
/// ends every wait on it (its peers', the orchestrator's) now rather than at their deadlines.
/// Hangs of a running process are caught by the per-request deadline instead.
fn watchdog(
    children: Children,
    halted: Arc<std::sync::Mutex<Option<(Stage, String)>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut since: Vec<Option<std::time::Instant>> = vec![None; Stage::ALL.len()];
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut children = children.lock().await;
            for (i, c) in children.iter_mut().enumerate() {
                let stopped = c.local_pid().is_some_and(is_stopped);
                since[i] = if stopped {
                    since[i].or(Some(std::time::Instant::now()))
                } else {
                    None
                };
                if since[i].is_some_and(|t| t.elapsed() >= STOPPED_FOR) {
                    let stage = Stage::ALL[i];
                    let why = format!(
                        "its process was stopped (SIGSTOP) for {STOPPED_FOR:?}; stopped or hung stages are killed"
                    );
                    tracing::warn!(%stage, "stage process stopped: killing it");
                    let mut h = halted.lock().unwrap_or_else(|p| p.into_inner());
                    if h.is_none() {
                        *h = Some((stage, why));
                    }
                    drop(h);
                    c.start_kill();
                    since[i] = None;
                }
            }
        }
    })
}

impl Remote {
    /// Starts the five stage processes of `exe` on this host and wires them up.
    pub async fn spawn(exe: &Path, scenario: &Scenario) -> Result<Remote> {
        Self::spawn_with(
            &LocalLauncher {
                exe: exe.to_path_buf(),
            },
            scenario,
        )
        .await
    }

    /// Starts the five stage processes through `launcher` and wires them up.
    pub async fn spawn_with(launcher: &dyn StageLauncher, scenario: &Scenario) -> Result<Remote> {
        let listener = TcpListener::bind(launcher.orchestrator_listen()).await?;
        let addr = listener.local_addr()?;
        let secret = new_secret()?;
        let mut gate = Gate::new(listener, secret.clone());
        let mut children = Vec::new();
        let nodes: Vec<Option<String>> = Stage::ALL.iter().map(|&s| launcher.node(s)).collect();
        for stage in Stage::ALL {
            // A stage without that hop still takes the flag; its engine is never built.
            let hop_transport = |k: Option<PayloadKind>| {
                k.map_or(TransportKind::Tcp, |k| {
                    process_transport(scenario.transport_for(k))
                })
                .as_str()
                .to_owned()
            };
            let args = vec![
                "stage".into(),
                "--stage".into(),
                stage.as_str().into(),
                "--orchestrator".into(),
                addr.to_string(),
                "--in-transport".into(),
                hop_transport(inbound_kind(stage)),
                "--out-transport".into(),
                hop_transport(outbound_kind(stage)),
                "--bind".into(),
                launcher.bind_host(stage).to_string(),
                "--memory".into(),
                scenario.memory.as_str().into(),
                "--check-nice".into(),
                crate::cpu::nice().to_string(),
            ];
            let mut args = args;
            if let Some(spec) = launcher.metadata() {
                args.extend(["--metadata".into(), spec]);
            }
            if let Some(r) = launcher.rdma(stage) {
                args.extend([
                    "--rdma-device".into(),
                    r.device,
                    "--rdma-port".into(),
                    r.port.to_string(),
                ]);
                if let Some(g) = r.gid_index {
                    args.extend(["--rdma-gid-index".into(), g.to_string()]);
                }
            }
            let env = vec![(RUN_SECRET_ENV.to_owned(), secret.clone())];
            children.push(launcher.launch(stage, args, env).await?);
        }
        let mut hellos: BTreeMap<&'static str, Hello> = BTreeMap::new();
        let deadline = tokio::time::Instant::now() + SETUP_TIMEOUT;
        while hellos.len() < Stage::ALL.len() {
            let stream = gate
                .next(deadline, "not every stage process (within 60 s)")
                .await?;
            let link = Link::tcp("orchestrator", stream);
            match link.recv("", SETUP_TIMEOUT).await? {
                Msg::Hello {
                    stage,
                    control,
                    engine_in,
                    engine_out,
                } => {
                    let st = Stage::parse(&stage, "hello.stage")?;
                    hellos.insert(st.as_str(), (link, engine_in, engine_out, control));
                }
                other => return Err(setup(format!("expected hello, got {}", other.name()))),
            }
        }
        let json = serde_json::to_string(scenario).map_err(setup)?;
        let mut links = Vec::new();
        for stage in Stage::ALL {
            let down = outbound_kind(stage).map(|k| &hellos[k.target().as_str()]);
            let link = hellos[stage.as_str()].0.clone();
            link.send(Msg::Setup {
                scenario_yaml: json.clone(),
                downstream_control: down.map(|d| d.3.clone()),
                downstream_engine: down.and_then(|d| d.1.clone()),
            })?;
            links.push((stage, link));
        }
        for (stage, link) in &links {
            // A stage (or its node) lost during setup ends the run before any request: the
            // error names the stage and node, not only the closed link.
            let at = |e: HarnessError| {
                let i = Stage::ALL.iter().position(|s| s == stage).expect("a stage");
                let node = nodes[i].as_ref().map(|n| format!(" on node {n}"));
                setup(format!("{stage}{}: {e}", node.unwrap_or_default()))
            };
            match link.recv("", SETUP_TIMEOUT).await.map_err(at)? {
                Msg::Ready { .. } => {}
                other => {
                    return Err(setup(format!(
                        "{stage}: expected ready, got {}",
                        other.name()
                    )));
                }
            }
        }
        let children = Arc::new(tokio::sync::Mutex::new(children));
        if let Some(k) = &scenario.kill_stage {
            // Chaos: SIGKILL one stage mid-run. The timer is the fault, not a synchronisation.
            let st = Stage::parse(&k.stage, "kill_stage.stage")?;
            let i = Stage::ALL
                .iter()
                .position(|s| *s == st)
                .expect("every stage is spawned");
            let (children, after) = (children.clone(), Duration::from_millis(k.after_ms));
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                tracing::warn!(stage = %st, "kill_stage: sending SIGKILL");
                // tokio's start_kill is SIGKILL on Unix.
                children.lock().await[i].start_kill();
            });
        }
        let halted = Arc::new(std::sync::Mutex::new(None));
        let watchdog = watchdog(children.clone(), halted.clone());
        Ok(Remote {
            links,
            children,
            nodes,
            scenario: scenario.clone(),
            watchdog,
            halted,
        })
    }

    /// Why no new request may start (a stage process died or stopped answering), if so.
    pub fn halted(&self) -> Option<String> {
        self.halted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|(stage, why)| format!("stage {}{} is gone ({why})", stage, self.on_node(*stage)))
    }

    /// " on node N" when `stage` runs on a cluster node.
    fn on_node(&self, stage: Stage) -> String {
        let i = Stage::ALL
            .iter()
            .position(|s| *s == stage)
            .expect("a stage");
        self.nodes[i]
            .as_ref()
            .map(|n| format!(" on node {n}"))
            .unwrap_or_default()
    }

    fn halt(&self, stage: Stage, why: String) {
        let mut h = self.halted.lock().unwrap_or_else(|p| p.into_inner());
        if h.is_none() {
            tracing::warn!(%stage, %why, "stage process lost: no new requests start");
            *h = Some((stage, why));
        }
    }

    /// How long every stage together may take for `spec`: each stage bounds its own waits
    /// (an offer within the request timeout, each handoff step within the hop timeout) and
    /// always answers, so a stage silent past this is stopped or hung.
    pub fn request_deadline(&self, spec: &RequestSpec) -> Duration {
        let s = &self.scenario;
        let compute = plan_request(&ModelCard::qwen3_omni(), spec, &s.shape_options())
            .map(|plan| {
                Stage::ALL
                    .iter()
                    .map(|&st| Stub::new(st, s.compute.of(st)).compute_time(&plan))
                    .fold(Duration::ZERO, Duration::saturating_add)
            })
            .unwrap_or_default();
        Duration::from_secs_f64(s.request_timeout_s)
            .saturating_add(s.hop_timeout().saturating_mul(8))
            .saturating_add(compute)
            .saturating_add(Duration::from_secs(5))
    }

    /// Runs one request on all five stages.
    pub async fn process(&self, id: &str, spec: &RequestSpec) -> Vec<StageOutcome> {
        for (_, l) in &self.links {
            let _ = l.send(Msg::Run {
                request: id.into(),
                spec: spec.clone(),
            });
        }
        let deadline = self.request_deadline(spec);
        let all = self.links.iter().map(|(stage, l)| async move {
            let r = l.recv(id, deadline).await;
            l.forget(id);
            let failed = |e: String| StageOutcome {
                stage: stage.as_str().into(),
                participated: true,
                error: Some(e),
                ..Default::default()
            };
            match r {
                Ok(Msg::StageDone { outcome, .. }) => outcome,
                Ok(other) => failed(format!(
                    "{stage}: expected stage_done, got {}",
                    other.name()
                )),
                Err(e) => {
                    // Closed: the process died. Silent past the deadline: stopped or hung.
                    let silent = matches!(&e, HarnessError::ControlTimeout { .. });
                    let why = if silent {
                        format!(
                            "did not answer request {id} within {:.1} s (request timeout + 8 hop timeouts + compute + 5 s); stopped or hung",
                            deadline.as_secs_f64()
                        )
                    } else {
                        e.to_string()
                    };
                    self.halt(*stage, why.clone());
                    let err = HarnessError::Deadline {
                        stage: format!("{stage} process{}", self.on_node(*stage)),
                        request: id.into(),
                        reason: why,
                    };
                    // A silent stage timed out; a closed one keeps its own kind.
                    let failure = crate::report::Failure::of(if silent { &err } else { &e });
                    StageOutcome {
                        failure: Some(failure),
                        ..failed(err.to_string())
                    }
                }
            }
        });
        futures_util::future::join_all(all).await
    }

    /// Drains and stops every stage process; returns their usage.
    pub async fn shutdown(&self) -> Vec<StageUsage> {
        self.watchdog.abort();
        // A stage that stopped answering is killed first: its peers' waits on it end at once
        // (its sockets close) instead of running out their timeouts, and so does ours.
        let lost = self
            .halted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some((stage, _)) = &lost {
            let i = Stage::ALL.iter().position(|s| s == stage).expect("a stage");
            let mut children = self.children.lock().await;
            if children[i].try_wait().is_none() {
                children[i].start_kill();
                let _ = tokio::time::timeout(Duration::from_secs(5), children[i].wait()).await;
            }
        }
        let mut out = Vec::new();
        for (i, (stage, l)) in self.links.iter().enumerate() {
            let _ = l.send(Msg::Shutdown);
            match l.recv("", SETUP_TIMEOUT).await {
                Ok(Msg::Bye { usage }) => {
                    out.push(usage);
                    // Tells the stage its Bye arrived: it may exit now.
                    let _ = l.send(Msg::Shutdown);
                }
                _ => {
                    // No usage: a process that exited took its memory with it; one still
                    // running that does not answer counts as not clean.
                    let status = self.children.lock().await[i].try_wait();
                    let why = lost
                        .as_ref()
                        .filter(|(s, _)| s == stage)
                        .map(|(_, why)| format!("; killed after it was lost: {why}"))
                        .unwrap_or_default();
                    out.push(StageUsage {
                        stage: stage.as_str().into(),
                        unanswered: status.is_none(),
                        exited: status.map(|s| format!("{s}{}{why}", self.on_node(*stage))),
                        ..Default::default()
                    });
                }
            }
        }
        let mut children = self.children.lock().await;
        for c in children.iter_mut() {
            if tokio::time::timeout(Duration::from_secs(10), c.wait())
                .await
                .is_err()
            {
                c.start_kill();
            }
        }
        out
    }
}

fn addr_of(e: &Engine) -> Option<String> {
    e.tcp_addr().map(|a| a.to_string())
}

/// The transport a hop uses when its stages are processes: loopback cannot cross a process,
/// so it becomes tcp; tcp and shm stay.
pub fn process_transport(scenario_transport: TransportKind) -> TransportKind {
    if scenario_transport.crosses_processes() {
        scenario_transport
    } else {
        TransportKind::Tcp
    }
}

/// The body of `omnirig stage`: one stage as its own process. `in_transport` and
/// `out_transport` are its inbound and outbound hops' transports (kinds that cross processes);
/// `devices` the RDMA device and memory its engines use.
pub async fn run_stage_process(
    stage: Stage,
    orchestrator: SocketAddr,
    in_transport: TransportKind,
    out_transport: TransportKind,
    bind: std::net::IpAddr,
    metadata: Option<&str>,
    devices: StageDevices,
) -> Result<()> {
    let StageDevices { rdma, memory } = devices;
    for t in [in_transport, out_transport] {
        if !t.crosses_processes() {
            return Err(setup(format!(
                "transport {t} cannot cross processes (use one of {})",
                TransportKind::process_names()
            )));
        }
    }
    let secret = std::env::var(RUN_SECRET_ENV).map_err(|_| {
        setup(format!(
            "{RUN_SECRET_ENV} is not set: stage processes are started by `omnirig run --processes`"
        ))
    })?;
    // With a shared store, engines are named by run (the orchestrator's address is unique per
    // run) and stage, so the upstream finds its downstream by name; without, peer-to-peer.
    let shared = match metadata {
        Some(spec) => omnirig_transports::metadata::open_store(spec)?,
        None => None,
    };
    let run_tag: String = orchestrator
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let name = |st: Stage, side: &str| match &shared {
        Some(_) => format!("run{run_tag}-{st}-{side}"),
        None => format!("p{}-{st}-{side}", std::process::id()),
    };
    let store: Arc<dyn omnirig_transports::MetadataStore> = match &shared {
        Some(s) => s.clone(),
        None => InProcessStore::new(),
    };
    let engine = |side: &str, transport: TransportKind| {
        let mut c = memory
            .configure(EngineConfig::for_kind(name(stage, side), transport).store(store.clone()));
        // Peers on other nodes reach the engine on the node's address, not on 127.0.0.1.
        if !bind.is_loopback() {
            c = c.with(omnirig_transports::TcpConfig {
                listen: Some(SocketAddr::new(bind, 0)),
                ..Default::default()
            });
        }
        // The rdma control server (queue pair setup, key lookups) listens there too, and the
        // node's device, port and GID index come from the cluster file.
        if transport == TransportKind::Rdma && (rdma.is_some() || !bind.is_loopback()) {
            let defaults = omnirig_transports::RdmaConfig::default();
            c = c.with(omnirig_transports::RdmaConfig {
                device: rdma.as_ref().map(|r| r.device.clone()),
                port: rdma.as_ref().map_or(defaults.port, |r| r.port),
                gid_index: rdma.as_ref().and_then(|r| r.gid_index),
                listen: SocketAddr::new(bind, 0),
                ..defaults
            });
        }
        c
    };
    let engine_in = match inbound_kind(stage) {
        Some(_) => Some(Arc::new(Engine::new(engine("in", in_transport)).await?)),
        None => None,
    };
    let engine_out = match outbound_kind(stage) {
        Some(_) => Some(Arc::new(Engine::new(engine("out", out_transport)).await?)),
        None => None,
    };
    let control = TcpListener::bind(SocketAddr::new(bind, 0)).await?;
    let control_addr = control.local_addr()?;
    let mut gate = Gate::new(control, secret.clone());
    let orch = Link::tcp(
        "orchestrator",
        connect_with_secret(orchestrator, &secret).await?,
    );
    orch.send(Msg::Hello {
        stage: stage.as_str().into(),
        control: control_addr.to_string(),
        engine_in: engine_in.as_deref().and_then(addr_of),
        engine_out: engine_out.as_deref().and_then(addr_of),
    })?;
    let (json, down_control, down_engine) = match orch.recv("", SETUP_TIMEOUT).await? {
        Msg::Setup {
            scenario_yaml,
            downstream_control,
            downstream_engine,
        } => (scenario_yaml, downstream_control, downstream_engine),
        other => return Err(setup(format!("expected setup, got {}", other.name()))),
    };
    let scenario: Scenario = serde_json::from_str(&json).map_err(setup)?;
    scenario.validate("setup")?;
    let requests = scenario.expand()?;
    let plans: Vec<&RequestPlan> = requests.iter().map(|r| &*r.plan).collect();
    let sizes = scenario.pool_sizes(&plans);

    let parse = |s: &Option<String>, what: &str| -> Result<SocketAddr> {
        s.as_deref()
            .ok_or_else(|| setup(format!("{stage}: no downstream {what}")))?
            .parse()
            .map_err(|e| setup(format!("{stage}: downstream {what}: {e}")))
    };
    let outbound = match &engine_out {
        Some(e) => {
            let stream =
                connect_with_secret(parse(&down_control, "control address")?, &secret).await?;
            let link = Link::tcp(&format!("{stage}->downstream"), stream);
            link.send(Msg::Peer {
                stage: stage.as_str().into(),
            })?;
            match (&shared, outbound_kind(stage)) {
                (Some(_), Some(k)) => {
                    e.connect(&name(k.target(), "in")).await?;
                }
                _ => {
                    e.connect_addr(parse(&down_engine, "engine address")?)
                        .await?;
                }
            }
            Some(HopEnd {
                engine: e.clone(),
                link,
            })
        }
        None => None,
    };
    let inbound = match &engine_in {
        Some(e) => {
            let stream = gate
                .next(
                    tokio::time::Instant::now() + SETUP_TIMEOUT,
                    &format!("{stage}: the upstream stage"),
                )
                .await?;
            let link = Link::tcp(&format!("upstream->{stage}"), stream);
            match link.recv("", SETUP_TIMEOUT).await? {
                Msg::Peer { .. } => link.forget(""),
                other => return Err(setup(format!("expected peer, got {}", other.name()))),
            }
            Some(HopEnd {
                engine: e.clone(),
                link,
            })
        }
        None => None,
    };
    let mut worker = StageWorker::new(scenario.stage_config(stage, sizes), inbound, outbound)?;
    if scenario.pregenerate {
        worker.pregenerate(&scenario.distinct_specs()?)?;
    }
    let worker = Arc::new(worker);
    orch.send(Msg::Ready {
        stage: stage.as_str().into(),
    })?;
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        match orch.recv("", IDLE_TIMEOUT).await? {
            Msg::Run { request, spec } => {
                let (w, o) = (worker.clone(), orch.clone());
                tasks.spawn(async move {
                    let outcome = w.process(&request, &spec).await;
                    let _ = o.send(Msg::StageDone { request, outcome });
                });
            }
            Msg::Shutdown => {
                while tasks.join_next().await.is_some() {}
                let usage = worker.drain().await;
                orch.send(Msg::Bye { usage })?;
                // Wait for the orchestrator's second Shutdown (or hang-up), so the Bye is flushed.
                let _ = orch.recv("", SETUP_TIMEOUT).await;
                // A shared store's entries go before the process does (the engines' own
                // removal on drop runs in the background and would die with the runtime).
                if let Some(store) = &shared {
                    for e in [&engine_in, &engine_out].into_iter().flatten() {
                        let d = e.descriptor();
                        if let Err(err) = store.remove(&d.name, d.instance).await {
                            tracing::warn!(engine = %d.name, error = %err, "removing the metadata entry failed");
                        }
                    }
                }
                return Ok(());
            }
            other => return Err(setup(format!("unexpected {}", other.name()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// Issue 10: a local process that connects first and stays silent used to stall setup
    /// 60 s, and one that sent a huge length prefix aborted the run. Neither holds up a stage
    /// that proves it belongs to the run, and neither gets anything decoded.
    #[tokio::test]
    async fn only_connections_with_the_run_secret_pass_the_gate() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let secret = new_secret().unwrap();
        assert_eq!(secret.len(), 32);
        let mut gate = Gate::new(listener, secret.clone());
        let _silent = TcpStream::connect(addr).await.unwrap();
        let mut huge = TcpStream::connect(addr).await.unwrap();
        huge.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        let mut wrong = TcpStream::connect(addr).await.unwrap();
        wrong.write_all(&preface(&"0".repeat(32))).await.unwrap();
        let t = std::time::Instant::now();
        let good = connect_with_secret(addr, &secret).await.unwrap();
        let got = gate
            .next(tokio::time::Instant::now() + Duration::from_secs(3), "test")
            .await
            .unwrap();
        assert!(t.elapsed() < PREFACE_TIMEOUT, "{:?}", t.elapsed());
        assert_eq!(got.peer_addr().unwrap(), good.local_addr().unwrap());
        // Nothing else gets through.
        let e = gate
            .next(
                tokio::time::Instant::now() + Duration::from_millis(300),
                "nobody",
            )
            .await
            .unwrap_err();
        assert!(e.to_string().contains("nobody did not connect"), "{e}");
    }
}
