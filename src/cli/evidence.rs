//! `omnirig evidence --cluster FILE --out DIR`: what a reviewer needs to believe a cluster
//! run: each node's host facts (kernel, `ibv_devinfo -v`, RDMA link rates and drivers,
//! `nvidia-smi topo -m`), the pipeline measured per hop over each path this build can run,
//! and for each path it cannot, why. Writes `evidence.json`, `evidence.md`, and the run's
//! report page (report.json, index.html, summary.md, plots) through the report writer.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use omnirig_harness::{Report, Runner, Scenario};
use omnirig_hil::evidence::HostFacts;
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
    hops: Vec<omnirig_harness::HopSummary>,
}

#[derive(Serialize)]
struct Evidence {
    evidence_version: u32,
    cluster: String,
    scenario: String,
    nodes: Vec<NodeEvidence>,
    paths: Vec<PathEvidence>,
    baselines: Vec<PathEvidence>,
}

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
    let (nodes, tcp_report) = rt.block_on(async {
        let _agents =
            omnirig_hil::start_agents(&cluster, &exe.to_string_lossy(), Duration::from_secs(60))
                .await?;
        let mut nodes = Vec::new();
        for n in &cluster.nodes {
            let addr = std::net::SocketAddr::new(n.host, n.agent_port);
            let facts = omnirig_hil::agent::collect_facts(&n.name, addr, &secret).await;
            nodes.push(NodeEvidence {
                node: n.name.clone(),
                host: n.host.to_string(),
                rdma: n
                    .rdma
                    .as_ref()
                    .map(|r| format!("{} port {} gid {}", r.device, r.port, r.gid_index)),
                gpu: n.gpu,
                netdev: n.netdev.clone(),
                stages: n.stages.clone(),
                facts_error: facts.as_ref().err().map(|e| e.to_string()),
                facts: facts.ok(),
            });
        }
        let launcher = Arc::new(ClusterLauncher::new(cluster.clone())?);
        let report = Runner::new(scenario.clone().with_transport(TransportKind::Tcp))
            .cluster(launcher)
            .run()
            .await;
        anyhow::Ok((nodes, report))
    })?;
    let tcp_dir = args.out.join("tcp");
    let mut paths = Vec::new();
    match &tcp_report {
        Ok(r) => {
            std::fs::create_dir_all(&tcp_dir)?;
            r.write(&tcp_dir)?;
            crate::report::write_run_site(r, &tcp_dir)
                .with_context(|| format!("report page in {}", tcp_dir.display()))?;
            paths.push(path_of("TCP between nodes (cluster addresses)", "tcp", r));
        }
        Err(e) => paths.push(not_run(
            "TCP between nodes (cluster addresses)",
            "tcp",
            format!("the run failed to start: {e}"),
        )),
    }
    let netdevs = cluster.nodes.iter().filter(|n| n.netdev.is_some()).count();
    paths.push(not_run(
        "TCP over the IPoIB / RoCE netdev",
        "tcp",
        if netdevs == 0 {
            "no node names a netdev in the cluster file".into()
        } else {
            "not measured yet: placing engines on the netdev's address is not built (issue 13)"
                .into()
        },
    ));
    paths.push(not_run(
        "RDMA from pinned host memory",
        "rdma",
        "this build has no rdma transport (feature rdma; issue 12 brings it to main)".into(),
    ));
    paths.push(not_run(
        "GPUDirect RDMA",
        "rdma+cuda",
        "needs the rdma and cuda transports, neither in this build".into(),
    ));
    let baselines = vec![
        not_run(
            "ib_write_bw on the same node pair",
            "verbs",
            "perftest baselines between nodes are not built yet (issue 13)".into(),
        ),
        not_run(
            "ib_write_lat on the same node pair",
            "verbs",
            "perftest baselines between nodes are not built yet (issue 13)".into(),
        ),
    ];
    let ev = Evidence {
        evidence_version: 1,
        cluster: cluster.name.clone(),
        scenario: scenario.name.clone(),
        nodes,
        paths,
        baselines,
    };
    let json = args.out.join("evidence.json");
    std::fs::write(&json, serde_json::to_vec_pretty(&ev)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let md = args.out.join("evidence.md");
    std::fs::write(&md, markdown(&ev)).with_context(|| format!("writing {}", md.display()))?;
    println!("evidence: {} and {}", json.display(), md.display());
    if tcp_report.is_ok() {
        println!("tcp run page: {}", tcp_dir.join("index.html").display());
    }
    let passed = tcp_report.as_ref().is_ok_and(Report::passed);
    if !passed {
        anyhow::bail!("the measured run did not pass; see {}", md.display());
    }
    Ok(())
}

fn path_of(label: &str, transport: &str, r: &Report) -> PathEvidence {
    PathEvidence {
        label: label.into(),
        transport: transport.into(),
        ran: true,
        why_not: None,
        passed: Some(r.passed()),
        hops: r.hops.clone(),
    }
}

fn not_run(label: &str, transport: &str, why: String) -> PathEvidence {
    PathEvidence {
        label: label.into(),
        transport: transport.into(),
        ran: false,
        why_not: Some(why),
        passed: None,
        hops: vec![],
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
                .filter(|l| !l.starts_with(' '))
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
    let _ = writeln!(
        s,
        "\n### Paths (per hop: transfer p50 / p99, effective bandwidth)\n"
    );
    for p in ev.paths.iter().chain(&ev.baselines) {
        if !p.ran {
            let _ = writeln!(
                s,
                "- **{}** (`{}`): not run: {}",
                p.label,
                p.transport,
                p.why_not.as_deref().unwrap_or("?")
            );
            continue;
        }
        let verdict = if p.passed == Some(true) {
            "passed, bit-exact"
        } else {
            "FAILED"
        };
        let _ = writeln!(s, "- **{}** (`{}`): {verdict}\n", p.label, p.transport);
        let _ = writeln!(
            s,
            "  | hop | transport | requests | moved MiB | p50 ms | p99 ms | GB/s |"
        );
        let _ = writeln!(s, "  |---|---|---|---|---|---|---|");
        for h in &p.hops {
            let _ = writeln!(
                s,
                "  | {} | {} | {} | {:.1} | {:.2} | {:.2} | {:.2} |",
                h.hop,
                h.transport,
                h.requests,
                h.moved_bytes as f64 / (1 << 20) as f64,
                h.transfer_ms_p50,
                h.transfer_ms_p99,
                h.gbps
            );
        }
        let _ = writeln!(s);
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
        "\nFull probe output (ibv_devinfo -v, GID tables, topology): `evidence.json`."
    );
    s
}
