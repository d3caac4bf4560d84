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

use omnirig_fixtures::{PayloadKind, RequestPlan, RequestSpec, Stage};
use omnirig_transports::{Engine, EngineConfig, InProcessStore, TransportKind};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};

use crate::control::{Link, Msg};
use crate::error::{HarnessError, Result};
use crate::scenario::Scenario;
use crate::stage::{HopEnd, StageOutcome, StageUsage, StageWorker, inbound_kind, outbound_kind};

/// How long setup steps (process start, handshakes) may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);
/// A stage process waits this long for its next instruction.
const IDLE_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

fn setup(msg: impl std::fmt::Display) -> HarnessError {
    HarnessError::Setup(msg.to_string())
}

/// A stage's link, inbound and outbound engine addresses, control address.
type Hello = (Link, Option<String>, Option<String>, String);

/// The orchestrator's handle on five stage processes.
pub struct Remote {
    links: Vec<(Stage, Link)>,
    children: Arc<tokio::sync::Mutex<Vec<Child>>>,
    timeout: Duration,
}

impl Remote {
    /// Starts the five stage processes of `exe` and wires them up.
    pub async fn spawn(exe: &Path, scenario: &Scenario) -> Result<Remote> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let mut children = Vec::new();
        for stage in Stage::ALL {
            // A stage without that hop still takes the flag; its engine is never built.
            let hop_transport = |k: Option<PayloadKind>| {
                k.map_or(TransportKind::Tcp, |k| {
                    process_transport(scenario.transport_for(k))
                })
                .as_str()
            };
            let child = Command::new(exe)
                .arg("stage")
                .arg("--stage")
                .arg(stage.as_str())
                .arg("--orchestrator")
                .arg(addr.to_string())
                .arg("--in-transport")
                .arg(hop_transport(inbound_kind(stage)))
                .arg("--out-transport")
                .arg(hop_transport(outbound_kind(stage)))
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| setup(format!("starting {} {stage}: {e}", exe.display())))?;
            children.push(child);
        }
        let mut hellos: BTreeMap<&'static str, Hello> = BTreeMap::new();
        while hellos.len() < Stage::ALL.len() {
            let (stream, _) = tokio::time::timeout(SETUP_TIMEOUT, listener.accept())
                .await
                .map_err(|_| setup("stage processes did not all connect within 60 s"))??;
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
            match link.recv("", SETUP_TIMEOUT).await? {
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
                let _ = children.lock().await[i].start_kill();
            });
        }
        Ok(Remote {
            links,
            children,
            // Each stage bounds its own waits by the hop timeout and always answers; this
            // only catches a stage process that hangs (one that dies closes its link at once).
            timeout: IDLE_TIMEOUT,
        })
    }

    /// Runs one request on all five stages.
    pub async fn process(&self, id: &str, spec: &RequestSpec) -> Vec<StageOutcome> {
        for (_, l) in &self.links {
            let _ = l.send(Msg::Run {
                request: id.into(),
                spec: spec.clone(),
            });
        }
        let all = self.links.iter().map(|(stage, l)| async move {
            let r = l.recv(id, self.timeout).await;
            l.forget(id);
            match r {
                Ok(Msg::StageDone { outcome, .. }) => outcome,
                Ok(other) => StageOutcome {
                    stage: stage.as_str().into(),
                    participated: true,
                    error: Some(format!(
                        "{stage}: expected stage_done, got {}",
                        other.name()
                    )),
                    ..Default::default()
                },
                Err(e) => StageOutcome {
                    stage: stage.as_str().into(),
                    participated: true,
                    error: Some(format!("{stage} process: {e}")),
                    failure: Some(crate::report::Failure::of(&e)),
                    ..Default::default()
                },
            }
        });
        futures_util::future::join_all(all).await
    }

    /// Drains and stops every stage process; returns their usage.
    pub async fn shutdown(&self) -> Vec<StageUsage> {
        let mut out = Vec::new();
        for (stage, l) in &self.links {
            let _ = l.send(Msg::Shutdown);
            match l.recv("", SETUP_TIMEOUT).await {
                Ok(Msg::Bye { usage }) => {
                    out.push(usage);
                    // Tells the stage its Bye arrived: it may exit now.
                    let _ = l.send(Msg::Shutdown);
                }
                _ => out.push(StageUsage {
                    stage: stage.as_str().into(),
                    // Unknown usage counts as a leak.
                    open_mailboxes: usize::MAX,
                    ..Default::default()
                }),
            }
        }
        let mut children = self.children.lock().await;
        for c in children.iter_mut() {
            if tokio::time::timeout(Duration::from_secs(10), c.wait())
                .await
                .is_err()
            {
                let _ = c.start_kill();
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
/// `out_transport` are its inbound and outbound hops' transports (kinds that cross processes).
pub async fn run_stage_process(
    stage: Stage,
    orchestrator: SocketAddr,
    in_transport: TransportKind,
    out_transport: TransportKind,
) -> Result<()> {
    for t in [in_transport, out_transport] {
        if !t.crosses_processes() {
            return Err(setup(format!(
                "transport {t} cannot cross processes (use one of {})",
                TransportKind::process_names()
            )));
        }
    }
    let store = InProcessStore::new();
    let engine = |side: &str, transport: TransportKind| {
        EngineConfig::for_kind(format!("p{}-{stage}-{side}", std::process::id()), transport)
            .store(store.clone())
    };
    let engine_in = match inbound_kind(stage) {
        Some(_) => Some(Arc::new(Engine::new(engine("in", in_transport)).await?)),
        None => None,
    };
    let engine_out = match outbound_kind(stage) {
        Some(_) => Some(Arc::new(Engine::new(engine("out", out_transport)).await?)),
        None => None,
    };
    let control = TcpListener::bind("127.0.0.1:0").await?;
    let orch = Link::tcp("orchestrator", TcpStream::connect(orchestrator).await?);
    orch.send(Msg::Hello {
        stage: stage.as_str().into(),
        control: control.local_addr()?.to_string(),
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
    let plans: Vec<&RequestPlan> = requests.iter().map(|r| &r.plan).collect();
    let sizes = scenario.pool_sizes(&plans);

    let parse = |s: &Option<String>, what: &str| -> Result<SocketAddr> {
        s.as_deref()
            .ok_or_else(|| setup(format!("{stage}: no downstream {what}")))?
            .parse()
            .map_err(|e| setup(format!("{stage}: downstream {what}: {e}")))
    };
    let outbound = match &engine_out {
        Some(e) => {
            let stream = TcpStream::connect(parse(&down_control, "control address")?).await?;
            let link = Link::tcp(&format!("{stage}->downstream"), stream);
            link.send(Msg::Peer {
                stage: stage.as_str().into(),
            })?;
            e.connect_addr(parse(&down_engine, "engine address")?)
                .await?;
            Some(HopEnd {
                engine: e.clone(),
                link,
            })
        }
        None => None,
    };
    let inbound = match &engine_in {
        Some(e) => {
            let (stream, _) = tokio::time::timeout(SETUP_TIMEOUT, control.accept())
                .await
                .map_err(|_| setup(format!("{stage}: upstream stage did not connect")))??;
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
    let worker = Arc::new(StageWorker::new(
        scenario.stage_config(stage, sizes),
        inbound,
        outbound,
    )?);
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
                return Ok(());
            }
            other => return Err(setup(format!("unexpected {}", other.name()))),
        }
    }
}
