//! `omnirig evidence --cluster FILE --out DIR`: what a reviewer needs to believe a cluster
//! run: each node's host facts (kernel, `ibv_devinfo -v`, RDMA link rates and drivers,
//! `nvidia-smi topo -m`), the pipeline measured per hop over each path this build can run,
//! and for each path it cannot, why. Writes `evidence.json`, `evidence.md`, and the run's
//! report page (report.json, index.html, summary.md, plots) through the report writer.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use std::collections::BTreeMap;
use std::net::IpAddr;

use anyhow::Context;
use omnirig_fixtures::{PayloadKind, Stage};
use omnirig_harness::process::StageLauncher;
use omnirig_harness::{Report, Runner, Scenario, StageMemory};
use omnirig_hil::agent;
use omnirig_hil::evidence::{
    HostFacts, PerfRow, PerfTool, PerftestRequest, Probe, netdev_addresses, parse_perftest,
};
use omnirig_hil::{Cluster, ClusterLauncher};
use omnirig_transports::TransportKind;
use serde::Serialize;

#[derive(clap::Args, Debug)]
pub struct EvidenceArgs {
    /// The cluster file.
    #[arg(long)]
    cluster: PathBuf,
    /// Output directory (created).
    #[arg(long)]
    out: PathBuf,
    /// Scenario to measure (default: the embedded default scenario).
    #[arg(long)]
    scenario: Option<PathBuf>,
}

#[derive(Serialize)]
struct NodeEvidence {
    node: String,
    host: String,
    rdma: Option<String>,
    gpu: Option<u32>,
    netdev: Option<String>,
    stages: Vec<String>,
    facts: Option<HostFacts>,
    #[serde(skip_serializing_if = "Option::is_none")]
    facts_error: Option<String>,
}

#[derive(Serialize)]
struct PathEvidence {
    /// What the path is, so paths cannot be confused.
    label: String,
    transport: String,
    ran: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    why_not: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    passed: Option<bool>,
    /// What a reader should know about how this path ran here.
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
    /// Its run's report page, relative to the evidence directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    report: Option<String>,
    hops: Vec<omnirig_harness::HopSummary>,
    /// The rdma transport's own log lines from the run (device, port, GID it selected), per
    /// node.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    engine_log: Vec<NodeLog>,
    /// For the GPU path: how each hop's GPU memory met the NIC.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    gpu_hops: Vec<GpuHop>,
}

/// How one hop's GPU memory reached the NIC, from what its two engines logged.
#[derive(Serialize, Debug, Clone, PartialEq)]
struct GpuHop {
    hop: String,
    /// [`GPU_DIRECT`], [`GPU_STAGED`] or [`GPU_NOT_RUN`]: distinct words, so a staged hop can
    /// never read as GPUDirect.
    path: &'static str,
    /// Which engine said what (the staging reason, or why nothing is known).
    detail: String,
}

const GPU_DIRECT: &str =
    "GPUDirect RDMA (the NIC reads and writes GPU memory, registered as a dma-buf)";
const GPU_STAGED: &str = "STAGED through pinned host memory (not GPUDirect)";
const GPU_NOT_RUN: &str = "not run";

#[derive(Serialize, Clone)]
struct NodeLog {
    node: String,
    lines: Vec<String>,
}

/// A perftest baseline between two nodes: each size's rows, from the client's output (the
/// server's is kept beside it).
#[derive(Serialize)]
struct BaselineEvidence {
    label: String,
    tool: String,
    /// `server -> client`.
    pair: String,
    ran: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    why_not: Option<String>,
    rows: Vec<PerfRow>,
    /// Every invocation: its command line and output, or why it failed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    runs: Vec<Probe>,
}

#[derive(Serialize)]
struct Evidence {
    evidence_version: u32,
    cluster: String,
    scenario: String,
    nodes: Vec<NodeEvidence>,
    paths: Vec<PathEvidence>,
    baselines: Vec<BaselineEvidence>,
    /// The plots, relative to the evidence directory.
    plots: Vec<String>,
}

const PATH_TCP: &str = "TCP between nodes (cluster addresses)";
const PATH_NETDEV: &str = "TCP over the IPoIB / RoCE netdev";
const PATH_RDMA: &str = "RDMA from pinned host memory";
const PATH_GPU: &str = "GPU memory over RDMA (per hop: GPUDirect RDMA or staged)";

/// Stage processes on their nodes, as the cluster file places them, but their engines and
/// control listeners on other addresses of those nodes (the netdev's).
struct BoundElsewhere {
    inner: Arc<ClusterLauncher>,
    bind: BTreeMap<&'static str, IpAddr>,
}

impl StageLauncher for BoundElsewhere {
    fn orchestrator_listen(&self) -> std::net::SocketAddr {
        self.inner.orchestrator_listen()
    }

    fn bind_host(&self, stage: Stage) -> IpAddr {
        self.bind
            .get(stage.as_str())
            .copied()
            .unwrap_or_else(|| self.inner.bind_host(stage))
    }

    fn node(&self, stage: Stage) -> Option<String> {
        self.inner.node(stage)
    }

    fn metadata(&self) -> Option<String> {
        self.inner.metadata()
    }

    fn rdma(&self, stage: Stage) -> Option<omnirig_harness::process::StageRdma> {
        self.inner.rdma(stage)
    }

    fn launch<'a>(
        &'a self,
        stage: Stage,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = omnirig_harness::Result<Box<dyn omnirig_harness::process::StageChild>>,
                > + Send
                + 'a,
        >,
    > {
        self.inner.launch(stage, args, env)
    }
}

/// A path's run, or why it did not run.
type PathRun = Result<Report, String>;

pub fn run(args: EvidenceArgs) -> anyhow::Result<()> {
    let cluster = Cluster::from_path(&args.cluster)?;
    let scenario = match &args.scenario {
        Some(p) => Scenario::from_path(p)?,
        None => Scenario::default_scenario(),
    };
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("--out {}: cannot create it", args.out.display()))?;
    let exe = std::env::current_exe().context("locating the omnirig binary")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let secret = cluster.secret()?;
    let agent_addr = |n: &omnirig_hil::Node| std::net::SocketAddr::new(n.host, n.agent_port);
    let (nodes, runs, logs, gpu_logs, baselines) = rt.block_on(async {
        let _agents =
            omnirig_hil::start_agents(&cluster, &exe.to_string_lossy(), Duration::from_secs(60))
                .await?;
        let mut nodes = Vec::new();
        for n in &cluster.nodes {
            let facts = agent::collect_facts(&n.name, agent_addr(n), &secret).await;
            nodes.push(NodeEvidence {
                node: n.name.clone(),
                host: n.host.to_string(),
                rdma: n.rdma.as_ref().map(|r| match r.gid_index {
                    Some(g) => format!("{} port {} gid {g}", r.device, r.port),
                    None => format!("{} port {} (first RoCEv2 GID)", r.device, r.port),
                }),
                gpu: n.gpu,
                netdev: n.netdev.clone(),
                stages: n.stages.clone(),
                facts_error: facts.as_ref().err().map(|e| e.to_string()),
                facts: facts.ok(),
            });
        }
        let launcher = Arc::new(ClusterLauncher::new(cluster.clone())?);
        let measure_in = |l: Arc<dyn StageLauncher>, t: TransportKind, memory: StageMemory| {
            let mut s = scenario.clone().with_transport(t);
            s.memory = memory;
            async move {
                Runner::new(s)
                    .cluster(l)
                    .run()
                    .await
                    .map_err(|e| format!("the run failed to start: {e}"))
            }
        };
        let measure =
            |l: Arc<dyn StageLauncher>, t: TransportKind| measure_in(l, t, StageMemory::Host);
        let mut runs: Vec<(&str, PathRun)> = Vec::new();
        runs.push((
            PATH_TCP,
            measure(launcher.clone(), TransportKind::Tcp).await,
        ));
        runs.push((
            PATH_NETDEV,
            match netdev_binds(&cluster, &nodes) {
                Ok(bind) => {
                    let l = Arc::new(BoundElsewhere {
                        inner: launcher.clone(),
                        bind,
                    });
                    measure(l, TransportKind::Tcp).await
                }
                Err(why) => Err(why),
            },
        ));
        // The engine log is cleared first, so the lines are this run's.
        for n in &cluster.nodes {
            let _ = agent::engine_log(&n.name, agent_addr(n), &secret, true).await;
        }
        let rdma = match cluster.nodes.iter().find(|n| n.rdma.is_none()) {
            Some(n) => Err(format!(
                "node {} has no rdma section in the cluster file",
                n.name
            )),
            None => measure(launcher.clone(), TransportKind::Rdma).await,
        };
        let mut logs = Vec::new();
        if rdma.is_ok() {
            for n in &cluster.nodes {
                let lines = match agent::engine_log(&n.name, agent_addr(n), &secret, false).await {
                    Ok(l) if l.is_empty() => vec![
                        "(no rdma lines: is the agent an omnirig that relays its stages' logs?)"
                            .into(),
                    ],
                    Ok(l) => l,
                    Err(e) => vec![format!("(no log: {e})")],
                };
                logs.push(NodeLog {
                    node: n.name.clone(),
                    lines,
                });
            }
        }
        runs.push((PATH_RDMA, rdma));
        // GPU-resident stage tensors over rdma: which path each engine took, from its log.
        let mut gpu_logs = Vec::new();
        let gpu = match gpu_why_not(&cluster) {
            Some(why) => Err(why),
            None => {
                for n in &cluster.nodes {
                    let _ = agent::engine_log(&n.name, agent_addr(n), &secret, true).await;
                }
                let r = measure_in(launcher.clone(), TransportKind::Rdma, StageMemory::Gpu).await;
                for n in &cluster.nodes {
                    let lines = agent::engine_log(&n.name, agent_addr(n), &secret, false)
                        .await
                        .unwrap_or_else(|e| vec![format!("(no log: {e})")]);
                    gpu_logs.push(NodeLog {
                        node: n.name.clone(),
                        lines,
                    });
                }
                r
            }
        };
        runs.push((PATH_GPU, gpu));
        let baselines = perftest_baselines(&cluster, &secret).await;
        anyhow::Ok((nodes, runs, logs, gpu_logs, baselines))
    })?;

    let mut paths = Vec::new();
    let mut reports: Vec<(&str, &Report)> = Vec::new();
    for (label, run) in &runs {
        let (transport, dir) = match *label {
            PATH_TCP => ("tcp", "tcp"),
            PATH_NETDEV => ("tcp", "tcp-netdev"),
            PATH_GPU => ("rdma", "rdma-gpu"),
            _ => ("rdma", "rdma"),
        };
        match run {
            Ok(r) => {
                let d = args.out.join(dir);
                std::fs::create_dir_all(&d)?;
                r.write(&d)?;
                crate::report::write_run_site(r, &d)
                    .with_context(|| format!("report page in {}", d.display()))?;
                let mut p = path_of(label, transport, r);
                if *label == PATH_GPU {
                    p.gpu_hops = gpu_hops(&r.hops, &gpu_logs);
                    p.engine_log = gpu_logs.clone();
                }
                p.report = Some(format!("{dir}/index.html"));
                p.note = note_for(label, &cluster, &nodes);
                paths.push(p);
                reports.push((label, r));
            }
            Err(why) => {
                let mut p = not_run(label, transport, why.clone());
                if *label == PATH_GPU {
                    p.gpu_hops = PayloadKind::ALL
                        .iter()
                        .map(|k| GpuHop {
                            hop: k.as_str().into(),
                            path: GPU_NOT_RUN,
                            detail: why.clone(),
                        })
                        .collect();
                }
                paths.push(p);
            }
        }
    }
    if let Some(p) = paths.iter_mut().find(|p| p.label == PATH_RDMA && p.ran) {
        p.engine_log = logs;
    }
    if let Some(p) = paths.iter_mut().find(|p| p.label == PATH_GPU && !p.ran) {
        p.why_not = Some(gpudirect_why_not(&cluster, &nodes, p.why_not.take()));
    }
    let plots = write_plots(&args.out, &reports, &baselines)?;
    let ev = Evidence {
        evidence_version: 2,
        cluster: cluster.name.clone(),
        scenario: scenario.name.clone(),
        nodes,
        paths,
        baselines,
        plots,
    };
    let json = args.out.join("evidence.json");
    std::fs::write(&json, serde_json::to_vec_pretty(&ev)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let md = args.out.join("evidence.md");
    std::fs::write(&md, markdown(&ev)).with_context(|| format!("writing {}", md.display()))?;
    println!("evidence: {} and {}", json.display(), md.display());
    let failed: Vec<&str> = ev
        .paths
        .iter()
        .filter(|p| p.ran && p.passed != Some(true))
        .map(|p| p.label.as_str())
        .collect();
    if runs[0].1.is_err() {
        anyhow::bail!(
            "the TCP run between nodes did not start; see {}",
            md.display()
        );
    }
    if !failed.is_empty() {
        anyhow::bail!(
            "measured runs did not pass: {}; see {}",
            failed.join(", "),
            md.display()
        );
    }
    Ok(())
}

/// Where each stage's engines bind for the netdev path: the first IPv4 address of its node's
/// netdev (from the node's `ip -o addr show`), or why the path cannot run.
fn netdev_binds(
    cluster: &Cluster,
    nodes: &[NodeEvidence],
) -> Result<BTreeMap<&'static str, IpAddr>, String> {
    let mut bind = BTreeMap::new();
    for stage in Stage::ALL {
        let n = cluster.node_of(stage);
        let Some(dev) = &n.netdev else {
            return Err(format!(
                "node {} names no netdev in the cluster file",
                n.name
            ));
        };
        let ev = nodes.iter().find(|e| e.node == n.name);
        let listing = ev
            .and_then(|e| e.facts.as_ref())
            .and_then(|f| f.probes.iter().find(|p| p.name == "addresses"))
            .and_then(|p| p.output.as_deref());
        let Some(listing) = listing else {
            return Err(format!(
                "node {}: its addresses are unknown (`ip -o addr show` did not run there)",
                n.name
            ));
        };
        let Some(addr) = netdev_addresses(listing, dev).into_iter().next() else {
            return Err(format!("node {}: netdev {dev} has no IPv4 address", n.name));
        };
        bind.insert(stage.as_str(), addr);
    }
    Ok(bind)
}

fn note_for(label: &str, cluster: &Cluster, nodes: &[NodeEvidence]) -> Option<String> {
    match label {
        PATH_NETDEV => {
            let same = netdev_binds(cluster, nodes)
                .map(|b| {
                    Stage::ALL
                        .iter()
                        .all(|s| b.get(s.as_str()) == Some(&cluster.node_of(*s).host))
                })
                .unwrap_or(false);
            same.then(|| {
                "every node's netdev carries its cluster address here, so this is the same \
                 interface as the TCP path, measured again"
                    .into()
            })
        }
        PATH_RDMA => {
            let soft = cluster
                .nodes
                .iter()
                .filter_map(|n| n.rdma.as_ref())
                .any(|r| r.device.starts_with("rxe"));
            let base = "the engine registers each grant's host memory as a memory region \
                        (pinned by the kernel); one-sided RDMA WRITE/READ between the nodes";
            Some(if soft {
                format!(
                    "{base}; soft-RoCE (rdma_rxe): the NIC is the kernel, so this measures \
                     the software stack, not an HCA"
                )
            } else {
                base.into()
            })
        }
        _ => None,
    }
}

/// Why GPU memory over rdma cannot be measured on this cluster with this build (`None`: run
/// it, and let each engine say which path it took).
fn gpu_why_not(cluster: &Cluster) -> Option<String> {
    if !cfg!(feature = "cuda") {
        return Some(
            "this build has no GPU memory: build with --features cuda (GPUDirect RDMA also \
             needs it)"
                .into(),
        );
    }
    let no_gpu: Vec<&str> = cluster
        .nodes
        .iter()
        .filter(|n| n.gpu.is_none())
        .map(|n| n.name.as_str())
        .collect();
    if !no_gpu.is_empty() {
        return Some(format!(
            "node {} names no gpu in the cluster file",
            no_gpu.join(", ")
        ));
    }
    cluster
        .nodes
        .iter()
        .find(|n| n.rdma.is_none())
        .map(|n| format!("node {} has no rdma section in the cluster file", n.name))
}

/// The GPU path's reason for not running, with what the nodes' facts add.
fn gpudirect_why_not(cluster: &Cluster, nodes: &[NodeEvidence], why: Option<String>) -> String {
    let mut why = vec![why.unwrap_or_else(|| "?".into())];
    let no_smi: Vec<&str> = nodes
        .iter()
        .filter(|n| {
            n.facts.as_ref().is_some_and(|f| {
                f.probes
                    .iter()
                    .any(|p| p.name == "gpu_topology" && p.output.is_none())
            })
        })
        .map(|n| n.node.as_str())
        .collect();
    if !no_smi.is_empty() {
        why.push(format!(
            "nvidia-smi gave no GPU topology on {}",
            no_smi.join(", ")
        ));
    }
    if cluster
        .nodes
        .iter()
        .filter_map(|n| n.rdma.as_ref())
        .any(|r| r.device.starts_with("rxe"))
    {
        why.push(
            "soft-RoCE (rxe) copies through the CPU and cannot DMA to or from GPU memory".into(),
        );
    }
    why.join("; ")
}

/// What one engine said about its GPU memory: GPUDirect, or staged and why.
#[derive(Debug, Clone, PartialEq)]
enum EngineGpuPath {
    Direct,
    Staged(String),
}

/// The GPU path line an engine named `...-{stage}-{side}` logged, if any (the last one: an
/// engine that turned to staging after a refused registration logs that after).
fn engine_gpu_path(logs: &[NodeLog], stage: Stage, side: &str) -> Option<(String, EngineGpuPath)> {
    let suffix = format!("-{stage}-{side}");
    let mut found = None;
    for l in logs {
        for line in &l.lines {
            let staged = line.contains("rdma: GPUDirect RDMA unavailable");
            let direct = line.contains("rdma: GPUDirect RDMA: GPU memory is registered");
            if !(staged || direct) {
                continue;
            }
            let Some(engine) = field(line, "engine") else {
                continue;
            };
            if !engine.ends_with(&suffix) {
                continue;
            }
            let path = if staged {
                let why = line
                    .split_once(" why=")
                    .map(|(_, w)| w.trim().to_owned())
                    .unwrap_or_else(|| "no reason logged".into());
                EngineGpuPath::Staged(why)
            } else {
                EngineGpuPath::Direct
            };
            found = Some((l.node.clone(), path));
        }
    }
    found
}

/// A `name=value` field of a tracing line (the value quoted or bare).
fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let at = line.find(&format!(" {name}="))? + name.len() + 2;
    let rest = &line[at..];
    match rest.strip_prefix('"') {
        Some(q) => q.split('"').next(),
        None => rest.split_whitespace().next(),
    }
}

/// Each measured hop's GPU path: GPUDirect only when both ends' engines registered their GPU
/// memory with the NIC; staged when either staged (naming it and why); not run when neither
/// end said anything (the log is missing, or the hop moved no GPU memory over rdma).
fn gpu_hops(hops: &[omnirig_harness::HopSummary], logs: &[NodeLog]) -> Vec<GpuHop> {
    hops.iter()
        .map(|h| {
            let Ok(kind) = PayloadKind::parse(&h.hop, "hop") else {
                return GpuHop {
                    hop: h.hop.clone(),
                    path: GPU_NOT_RUN,
                    detail: "not a hop of the pipeline".into(),
                };
            };
            let ends = [
                (
                    kind.source(),
                    "out",
                    engine_gpu_path(logs, kind.source(), "out"),
                ),
                (
                    kind.target(),
                    "in",
                    engine_gpu_path(logs, kind.target(), "in"),
                ),
            ];
            let mut staged = Vec::new();
            let mut direct = Vec::new();
            let mut silent = Vec::new();
            for (stage, side, said) in ends {
                match said {
                    Some((node, EngineGpuPath::Staged(why))) => {
                        staged.push(format!("{stage} ({side}, on {node}) staged: {why}"))
                    }
                    Some((node, EngineGpuPath::Direct)) => {
                        direct.push(format!("{stage} ({side}, on {node})"))
                    }
                    None => silent.push(format!("{stage} ({side})")),
                }
            }
            let (path, detail) = if !staged.is_empty() {
                (GPU_STAGED, staged.join("; "))
            } else if silent.is_empty() {
                (
                    GPU_DIRECT,
                    format!("dma-buf registered by {}", direct.join(" and ")),
                )
            } else {
                (
                    GPU_NOT_RUN,
                    format!(
                        "no GPU path line from {} (is the agent an omnirig that relays its \
                         stages' rdma lines?)",
                        silent.join(" and ")
                    ),
                )
            };
            GpuHop {
                hop: h.hop.clone(),
                path,
                detail,
            }
        })
        .collect()
}

/// Message sizes of the ib_write_bw baseline and of the ib_write_lat one.
const BW_SIZES: [u64; 4] = [4 << 10, 64 << 10, 1 << 20, 4 << 20];
const LAT_SIZES: [u64; 3] = [8, 4 << 10, 64 << 10];
const PERF_PORT: u16 = 18_900;

/// The node pairs that exchange a hop (upstream, downstream), each once.
fn hop_pairs(cluster: &Cluster) -> Vec<(&omnirig_hil::Node, &omnirig_hil::Node)> {
    let mut pairs: Vec<(&omnirig_hil::Node, &omnirig_hil::Node)> = Vec::new();
    for w in Stage::ALL.windows(2) {
        let (a, b) = (cluster.node_of(w[0]), cluster.node_of(w[1]));
        if a.name != b.name
            && !pairs.iter().any(|(x, y)| {
                (x.name == a.name && y.name == b.name) || (x.name == b.name && y.name == a.name)
            })
        {
            pairs.push((a, b));
        }
    }
    pairs
}

/// ib_write_bw and ib_write_lat between each pair of nodes that exchange a hop, in this run:
/// the server side through one node's agent, the client through the other's.
async fn perftest_baselines(cluster: &Cluster, secret: &str) -> Vec<BaselineEvidence> {
    let mut out = Vec::new();
    let pairs = hop_pairs(cluster);
    let mut port = PERF_PORT;
    for tool in [PerfTool::IbWriteBw, PerfTool::IbWriteLat] {
        let label = format!("{} on the same node pair", tool.program());
        if pairs.is_empty() {
            out.push(not_baseline(
                &label,
                tool,
                "-",
                "every stage runs on one node: no pair",
            ));
            continue;
        }
        for (server, client) in &pairs {
            let pair = format!("{} -> {}", server.name, client.name);
            let (Some(rs), Some(rc)) = (&server.rdma, &client.rdma) else {
                out.push(not_baseline(
                    &label,
                    tool,
                    &pair,
                    "a node of the pair has no rdma section in the cluster file",
                ));
                continue;
            };
            let sizes: &[u64] = match tool {
                PerfTool::IbWriteBw => &BW_SIZES,
                PerfTool::IbWriteLat => &LAT_SIZES,
            };
            let mut b = BaselineEvidence {
                label: label.clone(),
                tool: tool.program().into(),
                pair: pair.clone(),
                ran: false,
                why_not: None,
                rows: vec![],
                runs: vec![],
            };
            for &size in sizes {
                // Enough bytes to be a measurement, few enough for a soft-RoCE VM.
                let iterations = match tool {
                    PerfTool::IbWriteBw => ((32u64 << 20) / size).clamp(16, 2000) as u32,
                    PerfTool::IbWriteLat => 500,
                };
                port += 1;
                let req = |r: &omnirig_hil::cluster::Rdma, peer: Option<IpAddr>| PerftestRequest {
                    tool,
                    device: r.device.clone(),
                    port: r.port,
                    gid_index: r.gid_index,
                    size,
                    iterations,
                    tcp_port: port,
                    server: peer,
                };
                let (srv, cli) = perftest_pair(
                    server,
                    req(rs, None),
                    client,
                    req(rc, Some(server.host)),
                    secret,
                )
                .await;
                let rows = cli
                    .output
                    .as_deref()
                    .map(|o| parse_perftest(tool, o))
                    .unwrap_or_default();
                if rows.is_empty() && b.why_not.is_none() {
                    b.why_not = Some(format!(
                        "{} bytes: {}",
                        size,
                        cli.why_not
                            .clone()
                            .or(srv.why_not.clone())
                            .unwrap_or_else(|| "no result rows in its output".into())
                    ));
                }
                b.rows.extend(rows);
                b.runs.extend([srv, cli]);
            }
            b.ran = !b.rows.is_empty();
            out.push(b);
        }
    }
    out
}

fn not_baseline(label: &str, tool: PerfTool, pair: &str, why: &str) -> BaselineEvidence {
    BaselineEvidence {
        label: label.into(),
        tool: tool.program().into(),
        pair: pair.into(),
        ran: false,
        why_not: Some(why.into()),
        rows: vec![],
        runs: vec![],
    }
}

/// Starts the server side, then the client until it connects (the server needs a moment to
/// listen; a client that cannot connect fails at once and is retried).
async fn perftest_pair(
    server: &omnirig_hil::Node,
    sreq: PerftestRequest,
    client: &omnirig_hil::Node,
    creq: PerftestRequest,
    secret: &str,
) -> (Probe, Probe) {
    let program = sreq.tool.program();
    let failed = |name: &str, e: String| Probe {
        name: name.into(),
        command: program.into(),
        ran: false,
        output: None,
        why_not: Some(e),
    };
    let saddr = std::net::SocketAddr::new(server.host, server.agent_port);
    let caddr = std::net::SocketAddr::new(client.host, client.agent_port);
    let (sname, secret_s) = (server.name.clone(), secret.to_owned());
    let srv = tokio::spawn(async move { agent::perftest(&sname, saddr, &secret_s, sreq).await });
    let mut cli = failed("client", "not started".into());
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        cli = match agent::perftest(&client.name, caddr, secret, creq.clone()).await {
            Ok(p) => p,
            Err(e) => failed("client", e.to_string()),
        };
        let refused = cli.why_not.as_deref().is_some_and(|w| {
            w.contains("Couldn't connect") || w.contains("Unable to") || w.contains("refused")
        });
        if !refused || srv.is_finished() {
            break;
        }
    }
    let srv = match tokio::time::timeout(Duration::from_secs(30), srv).await {
        Ok(Ok(Ok(p))) => p,
        Ok(Ok(Err(e))) => failed("server", e.to_string()),
        Ok(Err(e)) => failed("server", e.to_string()),
        Err(_) => failed("server", "still running 30 s after its client ended".into()),
    };
    (srv, cli)
}

/// Bandwidth against size (each path's hops, ib_write_bw's line) and the transfer-latency
/// CDF per path and hop, each a PNG and an SVG.
fn write_plots(
    out: &std::path::Path,
    reports: &[(&str, &Report)],
    baselines: &[BaselineEvidence],
) -> anyhow::Result<Vec<String>> {
    use crate::report::plot::{Axis, Body, Figure, Line, Method, Panel, Unit, Wire, cdf};
    let mut files = Vec::new();
    let bw_line: Vec<(f64, f64)> = baselines
        .iter()
        .filter(|b| b.tool == "ib_write_bw")
        .flat_map(|b| &b.rows)
        .filter_map(|r| Some((r.bytes as f64, r.bw_average_mbps? / 1e3)))
        .collect();
    let mut panels = Vec::new();
    for (label, r) in reports {
        let mut pts: Vec<(f64, f64)> = r
            .hops
            .iter()
            .filter(|h| h.requests > 0 && h.moved_bytes > 0)
            .map(|h| (h.moved_bytes as f64 / h.requests as f64, h.gbps))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let wire = Wire::parse(r.hops.first().map_or("tcp", |h| h.transport.as_str()));
        let mut p = Panel::new(
            label.to_string(),
            Axis::new("bytes per request on the hop", Unit::Bytes, true),
            Axis::new("GB/s", Unit::GBps, true),
        );
        p.dots = true;
        p.lines.push(Line {
            method: Method::Omnirig,
            wire,
            pts,
        });
        if !bw_line.is_empty() {
            p.lines.push(Line {
                method: Method::Floor,
                wire: Wire::Rdma,
                pts: bw_line.clone(),
            });
        }
        if p.has_data() {
            panels.push(p);
        }
    }
    let mut figures = Vec::new();
    if !panels.is_empty() {
        figures.push(Figure {
            name: "evidence-bandwidth".into(),
            title: "Effective bandwidth per hop against bytes per request".into(),
            subtitle: if bw_line.is_empty() {
                "one point per hop (its moved bytes over its transfer time); no ib_write_bw baseline ran".into()
            } else {
                "one point per hop (its moved bytes over its transfer time); grey: ib_write_bw on the same node pair".into()
            },
            body: Body::Panels { cols: panels.len().min(3), panels },
            keys: vec![],
        });
    }
    let mut panels = Vec::new();
    for (label, r) in reports {
        let mut hops: Vec<&str> = r.hops.iter().map(|h| h.hop.as_str()).collect();
        hops.dedup();
        for hop in hops {
            let samples: Vec<f64> = r
                .requests
                .iter()
                .flat_map(|q| q.hops.iter().filter(|h| h.hop == hop && h.moved_bytes > 0))
                .map(|h| h.transfer_ms * 1e3)
                .collect();
            let transport = r.transports.get(hop).map_or("tcp", String::as_str);
            let mut p = Panel::new(
                format!("{hop}: {label}"),
                Axis::new("transfer time", Unit::Micros, true),
                Axis::new("fraction of requests", Unit::Fraction, false),
            );
            p.lines.push(Line {
                method: Method::Omnirig,
                wire: Wire::parse(transport),
                pts: cdf(&samples),
            });
            if p.has_data() {
                panels.push(p);
            }
        }
    }
    if !panels.is_empty() {
        figures.push(Figure {
            name: "evidence-latency-cdf".into(),
            title: "Transfer time per request, per path and hop (CDF)".into(),
            subtitle: "the engine's transfer of each request's bytes on the hop".into(),
            body: Body::Panels { cols: 4, panels },
            keys: vec![],
        });
    }
    for f in figures {
        let png = f.write_png(out)?;
        let svg = out.join(format!("{}.svg", f.name));
        std::fs::write(&svg, f.svg()?).with_context(|| format!("writing {}", svg.display()))?;
        for p in [png, svg] {
            files.push(
                p.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            );
        }
    }
    Ok(files)
}

fn path_of(label: &str, transport: &str, r: &Report) -> PathEvidence {
    PathEvidence {
        label: label.into(),
        transport: transport.into(),
        ran: true,
        why_not: None,
        passed: Some(r.passed()),
        note: None,
        report: None,
        hops: r.hops.clone(),
        engine_log: vec![],
        gpu_hops: vec![],
    }
}

fn not_run(label: &str, transport: &str, why: String) -> PathEvidence {
    PathEvidence {
        label: label.into(),
        transport: transport.into(),
        ran: false,
        why_not: Some(why),
        passed: None,
        note: None,
        report: None,
        hops: vec![],
        engine_log: vec![],
        gpu_hops: vec![],
    }
}

/// The GPU path of each hop, under the GPU memory path.
fn gpu_hop_table(s: &mut String, hops: &[GpuHop]) {
    use std::fmt::Write;
    if hops.is_empty() {
        return;
    }
    let _ = writeln!(s, "\n  | hop | GPU path | detail |");
    let _ = writeln!(s, "  |---|---|---|");
    for h in hops {
        let _ = writeln!(
            s,
            "  | {} | {} | {} |",
            h.hop,
            h.path,
            h.detail.replace('|', "/")
        );
    }
}

fn markdown(ev: &Evidence) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "## omnirig evidence: cluster `{}`, scenario `{}`\n",
        ev.cluster, ev.scenario
    );
    let _ = writeln!(
        s,
        "| node | host | kernel | RDMA (cluster file) | RDMA devices seen | stages |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for n in &ev.nodes {
        let probe = |name: &str| {
            n.facts
                .as_ref()
                .and_then(|f| f.probes.iter().find(|p| p.name == name))
        };
        let kernel = probe("kernel")
            .and_then(|p| p.output.as_deref())
            .map(|o| o.trim().to_owned())
            .unwrap_or_else(|| "?".into());
        let rdma_seen = match probe("rdma_sysfs") {
            Some(p) if p.ran => p
                .output
                .as_deref()
                .unwrap_or("")
                .lines()
                .map(str::trim)
                .collect::<Vec<_>>()
                .join("; "),
            Some(p) => format!("none ({})", p.why_not.as_deref().unwrap_or("?")),
            None => format!("? ({})", n.facts_error.as_deref().unwrap_or("no facts")),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} |",
            n.node,
            n.host,
            kernel,
            n.rdma.as_deref().unwrap_or("none"),
            rdma_seen,
            n.stages.join(", ")
        );
    }
    let hca: Vec<String> = ev
        .nodes
        .iter()
        .filter_map(|n| {
            let out = n
                .facts
                .as_ref()?
                .probes
                .iter()
                .find(|p| p.name == "ibv_devinfo")?
                .output
                .as_deref()?;
            let pick = |key: &str| {
                out.lines()
                    .find(|l| l.trim_start().starts_with(key))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_owned())
                    .unwrap_or_else(|| "?".into())
            };
            Some(format!(
                "- {}: `{}` fw {}, {} / {}, port {} ({}), active MTU {}, link layer {}, {} GIDs listed",
                n.node,
                pick("hca_id"),
                pick("fw_ver"),
                pick("transport"),
                pick("vendor_part_id"),
                pick("state"),
                pick("active_speed"),
                pick("active_mtu"),
                pick("link_layer"),
                out.lines().filter(|l| l.contains("GID[")).count()
            ))
        })
        .collect();
    if !hca.is_empty() {
        let _ = writeln!(s, "\n### HCAs (`ibv_devinfo -v`)\n\n{}", hca.join("\n"));
    }
    let _ = writeln!(
        s,
        "\n### Paths (per hop: bytes per request, transfer p50 / p99, effective bandwidth)\n"
    );
    for p in &ev.paths {
        if !p.ran {
            let _ = writeln!(
                s,
                "- **{}** (`{}`): not run: {}",
                p.label,
                p.transport,
                p.why_not.as_deref().unwrap_or("?")
            );
            gpu_hop_table(&mut s, &p.gpu_hops);
            continue;
        }
        let verdict = if p.passed == Some(true) {
            "passed, bit-exact"
        } else {
            "FAILED"
        };
        let _ = writeln!(s, "- **{}** (`{}`): {verdict}", p.label, p.transport);
        if let Some(n) = &p.note {
            let _ = writeln!(s, "  ({n})");
        }
        let _ = writeln!(
            s,
            "\n  | hop | transport | requests | KiB / request | p50 ms | p99 ms | GB/s |"
        );
        let _ = writeln!(s, "  |---|---|---|---|---|---|---|");
        for h in &p.hops {
            let _ = writeln!(
                s,
                "  | {} | {} | {} | {:.1} | {:.2} | {:.2} | {:.3} |",
                h.hop,
                h.transport,
                h.requests,
                h.moved_bytes as f64 / h.requests.max(1) as f64 / 1024.0,
                h.transfer_ms_p50,
                h.transfer_ms_p99,
                h.gbps
            );
        }
        gpu_hop_table(&mut s, &p.gpu_hops);
        for l in &p.engine_log {
            let _ = writeln!(
                s,
                "\n  engine log on {} ({} rdma lines; one of each kind):\n",
                l.node,
                l.lines.len()
            );
            let mut shown = 0;
            for kind in [
                "engine serves its memory",
                "selected device, port and GID",
                "accepted a queue pair",
                "GPUDirect RDMA",
            ] {
                if let Some(line) = l.lines.iter().find(|x| x.contains(kind)) {
                    let _ = writeln!(s, "      {}", line.trim());
                    shown += 1;
                }
            }
            if shown == 0 {
                for line in l.lines.iter().take(3) {
                    let _ = writeln!(s, "      {}", line.trim());
                }
            }
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(s, "\n### Baselines (perftest, same node pair, same run)\n");
    for b in &ev.baselines {
        if !b.ran {
            let _ = writeln!(
                s,
                "- **{}** ({}): not run: {}",
                b.label,
                b.pair,
                b.why_not.as_deref().unwrap_or("?")
            );
            continue;
        }
        let _ = writeln!(s, "- **{}** ({}):\n", b.label, b.pair);
        if b.tool == "ib_write_bw" {
            let _ = writeln!(s, "  | bytes | iterations | average MB/s |");
            let _ = writeln!(s, "  |---|---|---|");
            for r in &b.rows {
                let _ = writeln!(
                    s,
                    "  | {} | {} | {:.2} |",
                    r.bytes,
                    r.iterations,
                    r.bw_average_mbps.unwrap_or(0.0)
                );
            }
        } else {
            let _ = writeln!(s, "  | bytes | iterations | typical us | p99 us |");
            let _ = writeln!(s, "  |---|---|---|---|");
            for r in &b.rows {
                let _ = writeln!(
                    s,
                    "  | {} | {} | {:.2} | {:.2} |",
                    r.bytes,
                    r.iterations,
                    r.lat_typical_us.unwrap_or(0.0),
                    r.lat_p99_us.unwrap_or(0.0)
                );
            }
        }
        if let Some(w) = &b.why_not {
            let _ = writeln!(s, "\n  (some sizes did not run: {w})");
        }
        let _ = writeln!(s);
    }
    if !ev.plots.is_empty() {
        let _ = writeln!(s, "\nPlots: {}", ev.plots.join(", "));
    }
    let _ = writeln!(s, "\n### Host probes that could not run\n");
    for n in &ev.nodes {
        if let Some(e) = &n.facts_error {
            let _ = writeln!(s, "- {}: no facts: {e}", n.node);
        }
        for p in n
            .facts
            .iter()
            .flat_map(|f| &f.probes)
            .filter(|p| p.why_not.is_some())
        {
            let _ = writeln!(
                s,
                "- {}: `{}`: {}",
                n.node,
                p.command,
                p.why_not.as_deref().unwrap_or("")
            );
        }
    }
    let _ = writeln!(
        s,
        "\nFull probe output (ibv_devinfo -v, GID tables, topology, perftest output): `evidence.json`."
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hop(name: &str) -> omnirig_harness::HopSummary {
        omnirig_harness::HopSummary {
            hop: name.into(),
            transport: "rdma".into(),
            requests: 2,
            ..Default::default()
        }
    }

    /// Lines as the agent relays them from the stage processes (tracing's format, ANSI off).
    fn log(node: &str, lines: &[&str]) -> NodeLog {
        NodeLog {
            node: node.into(),
            lines: lines.iter().map(|l| l.to_string()).collect(),
        }
    }

    const DIRECT: &str = "2026-12-01T10:00:00Z  INFO omnirig_transports::transport::rdma::link: \
        rdma: GPUDirect RDMA: GPU memory is registered with the device as a dma-buf \
        engine=\"runX-{stage}-{side}\" device=\"mlx5_0\" gpu=\"cuda:0 (NVIDIA H200)\" \
        path=\"gpudirect-dmabuf\"";
    const STAGED: &str = "2026-12-01T10:00:00Z  WARN omnirig_transports::transport::cuda::gpudirect: \
        rdma: GPUDirect RDMA unavailable: GPU memory is staged through pinned host memory \
        engine=\"runX-{stage}-{side}\" path=\"staged\" why=mlx5_0 refused to register GPU \
        memory: ibv_reg_dmabuf_mr: Operation not supported (os error 95)";

    fn line(t: &str, stage: &str, side: &str) -> String {
        t.replace("{stage}", stage).replace("{side}", side)
    }

    #[test]
    fn each_hop_reports_the_gpu_path_its_two_engines_took() {
        let a = [
            line(DIRECT, "encoder", "out"),
            line(DIRECT, "thinker_prefill", "in"),
            line(DIRECT, "thinker_prefill", "out"),
            "rdma: engine serves its memory through this device engine=\"runX-talker-in\"".into(),
        ];
        let b = [
            line(STAGED, "thinker_decode", "in"),
            line(DIRECT, "thinker_decode", "out"),
            line(DIRECT, "talker", "in"),
        ];
        let logs = [
            log("node-a", &a.iter().map(String::as_str).collect::<Vec<_>>()),
            log("node-b", &b.iter().map(String::as_str).collect::<Vec<_>>()),
        ];
        let got = gpu_hops(
            &[
                hop("encoder_embeddings"),
                hop("kv_cache"),
                hop("thinker_to_talker"),
                hop("talker_to_code2wav"),
            ],
            &logs,
        );
        let paths: Vec<(&str, &str)> = got.iter().map(|h| (h.hop.as_str(), h.path)).collect();
        assert_eq!(
            paths,
            [
                ("encoder_embeddings", GPU_DIRECT),
                ("kv_cache", GPU_STAGED),
                ("thinker_to_talker", GPU_DIRECT),
                ("talker_to_code2wav", GPU_NOT_RUN),
            ]
        );
        assert!(
            got[0].detail.contains("encoder (out, on node-a)"),
            "{}",
            got[0].detail
        );
        assert!(
            got[1]
                .detail
                .contains("thinker_decode (in, on node-b) staged")
                && got[1].detail.contains("Operation not supported"),
            "{}",
            got[1].detail
        );
        assert!(
            got[3].detail.contains("talker (out)") && got[3].detail.contains("code2wav (in)"),
            "{}",
            got[3].detail
        );
        // the labels cannot be mistaken for one another
        assert!(!GPU_STAGED.contains("GPUDirect RDMA (") && !GPU_NOT_RUN.contains("GPUDirect"));
        // an engine that turned to staging after a refused registration: its last line wins
        let later = [
            line(DIRECT, "encoder", "out"),
            line(STAGED, "encoder", "out"),
        ];
        let logs = [log(
            "n",
            &later.iter().map(String::as_str).collect::<Vec<_>>(),
        )];
        assert_eq!(
            engine_gpu_path(&logs, Stage::Encoder, "out")
                .map(|(_, p)| matches!(p, EngineGpuPath::Staged(_))),
            Some(true)
        );
        assert_eq!(engine_gpu_path(&logs, Stage::Encoder, "in"), None);
    }

    #[test]
    fn the_markdown_lists_each_hops_gpu_path() {
        let mut s = String::new();
        gpu_hop_table(
            &mut s,
            &[GpuHop {
                hop: "kv_cache".into(),
                path: GPU_STAGED,
                detail: "a | b".into(),
            }],
        );
        assert!(
            s.contains("| kv_cache | STAGED through pinned host memory (not GPUDirect) | a / b |"),
            "{s}"
        );
        let mut empty = String::new();
        gpu_hop_table(&mut empty, &[]);
        assert!(empty.is_empty());
    }
}
