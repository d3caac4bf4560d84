//! The pipeline runner: builds the five stages (in this process, or as OS
//! processes over TCP), runs a scenario's requests with its concurrency and
//! arrival pattern, and gathers the [`Report`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
// tokio's clock: the wall clock, or virtual time when a sim run pauses it.
use tokio::time::Instant;

use omnirig_fixtures::{PayloadKind, RequestPlan, RequestSpec, Stage};
use omnirig_transports::{
    Engine, EngineConfig, Fabric, FaultInjector, InProcessStore, MetadataStore, SimConfig,
    TransportDecorator, TransportKind,
};

use crate::control::Link;
use crate::error::{HarnessError, Result};
use crate::host::{Cpu, StageCpu};
use crate::report::{Failure, FaultReport, HopResult, REPORT_VERSION, Report, RequestResult, gbps};
use crate::scenario::{PlannedRequest, Scenario};
use crate::stage::{HopEnd, StageOutcome, StageUsage, StageWorker, inbound_kind, outbound_kind};

/// Runs a scenario.
#[derive(Clone)]
pub struct Runner {
    scenario: Scenario,
    /// Stages as OS processes, started by this launcher; the report's mode names it.
    launcher: Option<(Arc<dyn crate::process::StageLauncher>, &'static str)>,
    progress: bool,
    decorators: Decorators,
    store: Option<Arc<dyn MetadataStore>>,
    /// The fabric sim hops run on (default: the scenario's, else the built-in one).
    fabric: Option<Arc<Fabric>>,
    /// Where finished requests are counted as the run goes (see [`Runner::count_finished`]).
    finished: Option<Arc<AtomicUsize>>,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("scenario", &self.scenario.name)
            .field("mode", &self.launcher.as_ref().map(|l| l.1))
            .finish_non_exhaustive()
    }
}

/// Transport decorators for the producer (sending) engine of a hop, by payload kind.
pub type Decorators = BTreeMap<&'static str, TransportDecorator>;

/// A way to run one request on all five stages.
pub(crate) enum Stages {
    Local(Arc<Vec<StageWorker>>),
    Remote(Arc<crate::process::Remote>),
}

impl Stages {
    async fn process(&self, id: &str, spec: &RequestSpec) -> Vec<StageOutcome> {
        match self {
            Stages::Local(w) => {
                futures_util::future::join_all(w.iter().map(|w| w.process(id, spec))).await
            }
            Stages::Remote(r) => r.process(id, spec).await,
        }
    }

    /// Why no new request may start, if a stage is gone.
    fn halted(&self) -> Option<String> {
        match self {
            Stages::Local(_) => None,
            Stages::Remote(r) => r.halted(),
        }
    }

    async fn drain(&self) -> Vec<StageUsage> {
        match self {
            Stages::Local(w) => futures_util::future::join_all(w.iter().map(|w| w.drain())).await,
            Stages::Remote(r) => r.shutdown().await,
        }
    }
}

static RUNS: AtomicUsize = AtomicUsize::new(0);

/// Builds the five stages in this process: one engine per hop end, engines
/// finding each other through a store of this run's own.
/// `decorators` wrap the transports of each hop's producer engine (fault injection).
pub async fn local_stages(
    scenario: &Scenario,
    plans: &[&RequestPlan],
    decorators: &Decorators,
    store: Option<Arc<dyn MetadataStore>>,
) -> Result<Vec<StageWorker>> {
    local_stages_on(scenario, plans, decorators, store, None).await
}

/// Where `stage` sits on `fabric`: its placement, else the fabric's first node.
fn place(fabric: &Fabric, stage: Stage) -> String {
    fabric
        .spec()
        .placement
        .get(stage.as_str())
        .cloned()
        .unwrap_or_else(|| fabric.spec().nodes[0].name.clone())
}

/// As [`local_stages`]; hops over the sim transport run on `fabric` (their engines placed
/// where the fabric puts their stages, their control messages crossing it too).
pub async fn local_stages_on(
    scenario: &Scenario,
    plans: &[&RequestPlan],
    decorators: &Decorators,
    store: Option<Arc<dyn MetadataStore>>,
    fabric: Option<&Arc<Fabric>>,
) -> Result<Vec<StageWorker>> {
    let sizes = scenario.pool_sizes(plans);
    let store = store.unwrap_or_else(|| InProcessStore::new() as Arc<dyn MetadataStore>);
    // A simulated run's engines are alone on their fabric and store, and their names travel
    // in its control messages (whose sizes the model charges): the same name every run.
    let tag = match fabric {
        Some(_) => "sim".to_string(),
        None => format!(
            "r{}x{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        ),
    };
    // The host model, when the scenario has one and this run is simulated.
    let cpu = match (fabric, &scenario.cpu) {
        (Some(f), Some(c)) if !c.is_free() => {
            let nodes: Vec<&str> = f.spec().nodes.iter().map(|n| n.name.as_str()).collect();
            Some(Arc::new(
                Cpu::new(c.clone(), &nodes, f.time_scale())
                    .map_err(|e| HarnessError::Setup(format!("cpu: {e}")))?,
            ))
        }
        _ => None,
    };
    let mut ends: BTreeMap<&str, (HopEnd, HopEnd)> = BTreeMap::new();
    for kind in PayloadKind::ALL {
        let transport = scenario.transport_for(kind);
        let mk = |side: &str| {
            scenario.memory.configure(
                EngineConfig::for_kind(format!("{tag}-{kind}-{side}"), transport)
                    .store(store.clone()),
            )
        };
        let mut tx_cfg = mk("tx");
        let mut rx_cfg = mk("rx");
        let sim = match (transport, fabric) {
            (TransportKind::Sim, Some(f)) => {
                let (src, dst) = (kind.source(), kind.target());
                let (ps, pd) = (place(f, src), place(f, dst));
                tx_cfg = tx_cfg.with(SimConfig::on(f, &ps, src.as_str()));
                rx_cfg = rx_cfg.with(SimConfig::on(f, &pd, dst.as_str()));
                Some((f, ps, pd))
            }
            _ => None,
        };
        if let Some(d) = decorators.get(kind.as_str()) {
            tx_cfg = tx_cfg.decorator(d.clone());
        }
        let tx = Arc::new(Engine::new(tx_cfg).await?);
        let rx = Arc::new(Engine::new(rx_cfg).await?);
        let (a, b) = match sim {
            Some((f, ps, pd)) => {
                let procs = (kind.source().as_str(), kind.target().as_str());
                Link::pair_over_hosts(kind.as_str(), f, &ps, &pd, cpu.as_ref().map(|c| (c, procs)))?
            }
            None => Link::pair(kind.as_str()),
        };
        ends.insert(
            kind.as_str(),
            (
                HopEnd {
                    engine: tx,
                    link: a,
                },
                HopEnd {
                    engine: rx,
                    link: b,
                },
            ),
        );
    }
    let specs = if scenario.pregenerate {
        scenario.distinct_specs()?
    } else {
        Vec::new()
    };
    Stage::ALL
        .into_iter()
        .map(|stage| {
            let inbound = inbound_kind(stage).map(|k| ends[k.as_str()].1.clone());
            let outbound = outbound_kind(stage).map(|k| ends[k.as_str()].0.clone());
            let mut w = StageWorker::new(scenario.stage_config(stage, sizes), inbound, outbound)?;
            if scenario.pregenerate {
                w.pregenerate(&specs)?;
            }
            if let (Some(c), Some(f)) = (&cpu, fabric) {
                let host_of = |s: Stage| c.host(&place(f, s));
                if let Some(host) = host_of(stage) {
                    w.charge_cpu(StageCpu {
                        cpu: c.clone(),
                        pool: c.check_pool(&host),
                        host,
                        peer: outbound_kind(stage).and_then(|k| host_of(k.target())),
                        process: stage.as_str().to_string(),
                        peer_process: outbound_kind(stage).map(|k| k.target().as_str().to_string()),
                    });
                }
            }
            Ok(w)
        })
        .collect()
}

impl Runner {
    pub fn new(scenario: Scenario) -> Self {
        Self {
            scenario,
            launcher: None,
            progress: false,
            decorators: Decorators::new(),
            store: None,
            fabric: None,
            finished: None,
        }
    }

    /// Counts finished requests (passed or failed) into `n` as the run goes: for a caller that
    /// acts on progress, such as a test that kills a node once requests are flowing, instead of
    /// guessing with a sleep.
    pub fn count_finished(mut self, n: Arc<AtomicUsize>) -> Self {
        self.finished = Some(n);
        self
    }

    /// The fabric the scenario's sim hops run on (in-process runs). Its clock starts when
    /// the run does; read its trace and queue usage after the run.
    pub fn fabric(mut self, fabric: Arc<Fabric>) -> Self {
        self.fabric = Some(fabric);
        self
    }

    /// Wraps the transports of `hop`'s sending engine (in-process runs only),
    /// e.g. to inject faults.
    pub fn decorate(mut self, hop: PayloadKind, d: TransportDecorator) -> Self {
        self.decorators.insert(hop.as_str(), d);
        self
    }

    /// The metadata store the stages' engines use (in-process runs; default: a fresh
    /// in-process store), e.g. one that fails on purpose.
    pub fn metadata(mut self, store: Arc<dyn MetadataStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// Runs each stage as its own OS process (`exe stage ...`) over TCP on 127.0.0.1.
    pub fn processes(mut self, exe: PathBuf) -> Self {
        let local = crate::process::LocalLauncher { exe };
        self.launcher = Some((Arc::new(local), "processes"));
        self
    }

    /// Runs each stage as an OS process started by `launcher` (on a cluster's nodes, through
    /// their agents); the report's mode is `cluster`.
    pub fn cluster(mut self, launcher: Arc<dyn crate::process::StageLauncher>) -> Self {
        self.launcher = Some((launcher, "cluster"));
        self
    }

    /// One line per finished request on stderr.
    pub fn progress(mut self, on: bool) -> Self {
        self.progress = on;
        self
    }

    pub fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    pub async fn run(&self) -> Result<Report> {
        let requests = self.scenario.expand()?;
        let plans: Vec<&RequestPlan> = requests.iter().map(|r| &*r.plan).collect();
        let faults = self.scenario.compile_faults(&requests)?;
        self.scenario.check_memory(&plans, &self.scenario.name)?;
        if self.scenario.kill_stage.is_some() && self.launcher.is_none() {
            return Err(HarnessError::Setup(
                "kill_stage needs --processes: it kills a stage's OS process".into(),
            ));
        }
        if !faults.is_empty() && self.launcher.is_some() {
            return Err(HarnessError::Setup(
                "fault plans run in-process only; drop --processes or the scenario's faults".into(),
            ));
        }
        // Fault injectors sit under any caller-supplied decorator of the same hop.
        let mut decorators = self.decorators.clone();
        let mut injectors = Vec::new();
        for (&hop, rules) in &faults.rules {
            let inj = FaultInjector::new(rules.clone());
            let inner = inj.decorator();
            let d: TransportDecorator = match decorators.remove(hop) {
                Some(outer) => Arc::new(move |t| outer(inner(t))),
                None => inner,
            };
            decorators.insert(hop, d);
            injectors.push((hop, inj));
        }
        let uses_sim = PayloadKind::ALL
            .iter()
            .any(|&k| self.scenario.transport_for(k) == TransportKind::Sim);
        let fabric = match (&self.fabric, uses_sim) {
            (Some(f), _) => Some(f.clone()),
            (None, true) => Some(
                Fabric::new(self.scenario.fabric.clone().unwrap_or_default())
                    .map_err(|e| HarnessError::Setup(format!("fabric: {e}")))?,
            ),
            (None, false) => None,
        };
        if let Some(f) = &fabric {
            f.start_clock();
        }
        let (stages, mode) = match &self.launcher {
            None => (
                Stages::Local(Arc::new(
                    local_stages_on(
                        &self.scenario,
                        &plans,
                        &decorators,
                        self.store.clone(),
                        fabric.as_ref(),
                    )
                    .await?,
                )),
                "in_process",
            ),
            Some((launcher, mode)) => (
                Stages::Remote(Arc::new(
                    crate::process::Remote::spawn_with(&**launcher, &self.scenario).await?,
                )),
                *mode,
            ),
        };
        let stages = Arc::new(stages);
        let t0 = Instant::now();
        let results = self.drive(&stages, &requests).await;
        let wall_s = t0.elapsed().as_secs_f64();
        // Bytes the faults held back go now, after every request ended and every grant was
        // revoked: each must be refused.
        let fault_report = if faults.is_empty() {
            None
        } else {
            Some(FaultReport::collect(&faults, &injectors).await)
        };
        let usage = stages.drain().await;
        let mut transports = BTreeMap::new();
        for k in PayloadKind::ALL {
            let t = if self.launcher.is_some() {
                crate::process::process_transport(self.scenario.transport_for(k))
            } else {
                self.scenario.transport_for(k)
            };
            transports.insert(k.as_str().to_string(), t.to_string());
        }
        let mut report = Report {
            report_version: REPORT_VERSION,
            scenario: self.scenario.name.clone(),
            mode: mode.into(),
            transports,
            concurrency: self.scenario.concurrency,
            wall_s,
            summary: Default::default(),
            hops: vec![],
            requests: results,
            stages: usage,
            faults: fault_report,
        };
        report.summarise();
        Ok(report)
    }

    async fn drive(&self, stages: &Arc<Stages>, requests: &[PlannedRequest]) -> Vec<RequestResult> {
        let sem = Arc::new(tokio::sync::Semaphore::new(self.scenario.concurrency));
        let offsets = self.scenario.arrival_offsets(requests.len());
        let start = tokio::time::Instant::now();
        let done = self.finished.clone().unwrap_or_default();
        let total = requests.len();
        let mut handles = Vec::new();
        for (r, off) in requests.iter().zip(offsets) {
            if let Some(off) = off {
                tokio::time::sleep_until(start + off).await;
            }
            let permit = sem.clone().acquire_owned().await.expect("never closed");
            // A stage is gone: the rest fail at once, naming it, instead of one by one.
            if let Some(why) = stages.halted() {
                let outcome = StageOutcome {
                    stage: "orchestrator".into(),
                    participated: true,
                    error: Some(format!("request {} not started: {why}", r.id)),
                    ..Default::default()
                };
                let res = request_result(r, vec![outcome], 0.0);
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                if self.progress {
                    eprintln!("[{n}/{total}] {} NOT STARTED: {why}", res.id);
                }
                handles.push(tokio::spawn(async move { res }));
                continue;
            }
            let (stages, r, done, progress) =
                (stages.clone(), r.clone(), done.clone(), self.progress);
            handles.push(tokio::spawn(async move {
                let t = Instant::now();
                let outcomes = stages.process(&r.id, &r.spec).await;
                let e2e_ms = t.elapsed().as_secs_f64() * 1e3;
                drop(permit);
                let res = request_result(&r, outcomes, e2e_ms);
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                if progress {
                    match &res.error {
                        None => eprintln!("[{n}/{total}] {} ok in {e2e_ms:.1} ms", res.id),
                        Some(e) => eprintln!("[{n}/{total}] {} FAILED: {e}", res.id),
                    }
                }
                res
            }));
        }
        let mut out = Vec::with_capacity(handles.len());
        for h in handles {
            out.push(h.await.unwrap_or_else(|e| RequestResult {
                error: Some(format!("request task panicked: {e}")),
                ..Default::default()
            }));
        }
        out
    }
}

/// Joins the stages' outcomes into one request's result.
pub fn request_result(r: &PlannedRequest, stages: Vec<StageOutcome>, e2e_ms: f64) -> RequestResult {
    let error = stages.iter().find_map(|s| s.error.clone());
    let hops = r
        .plan
        .hops
        .iter()
        .map(|h| {
            let sent = stages
                .iter()
                .find(|s| s.stage == h.source.as_str())
                .and_then(|s| s.sent.clone())
                .unwrap_or_default();
            let rec = stages
                .iter()
                .find(|s| s.stage == h.target.as_str())
                .and_then(|s| s.received.clone());
            HopResult {
                hop: h.payload_kind.as_str().into(),
                bytes: h.total_bytes(),
                moved_bytes: sent.bytes,
                reused_bytes: rec.as_ref().map_or(0, |r| r.reused_bytes),
                tensors: rec.as_ref().map_or(0, |r| r.tensors),
                requests: sent.requests,
                transfer_ms: sent.transfer_ms,
                gbps: gbps(sent.bytes, sent.transfer_ms),
                handoff_ms: rec.as_ref().map_or(0.0, |r| r.handoff_ms),
                phases_ms: rec.as_ref().map_or_else(Default::default, |r| r.phases_ms),
                verified: rec.is_some(),
            }
        })
        .collect();
    let errors = stages
        .iter()
        .filter_map(|s| s.error.as_ref().map(|e| format!("{}: {e}", s.stage)))
        .collect();
    RequestResult {
        id: r.id.clone(),
        label: r.label.clone(),
        ok: error.is_none(),
        // The first failing stage in pipeline order, as that stage classified it.
        failure: stages
            .iter()
            .find(|s| s.error.is_some())
            .map(|s| s.failure.clone().unwrap_or_else(Failure::unclassified)),
        error,
        errors,
        e2e_ms,
        hops,
        stages,
    }
}
