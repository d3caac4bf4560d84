//! `omnirig run [SCENARIO] [--report DIR]`: the five-stage pipeline.

use std::path::PathBuf;

use anyhow::Context;
use omnirig_harness::{Runner, Scenario};

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Scenario YAML (default: the embedded default scenario).
    scenario: Option<PathBuf>,
    /// Write `report.json`, its page (`index.html`, `summary.md`) and its plots into this directory.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Run each stage as its own OS process on this host: hops the scenario puts on loopback
    /// go over tcp on 127.0.0.1 instead; tcp and shm hops keep their transport.
    #[arg(long)]
    processes: bool,
    /// Run the stages on a cluster's nodes through their agents (hardware-in-the-loop mode);
    /// ssh / srun nodes get their agents started, manual ones must have them running.
    #[cfg(feature = "hil")]
    #[arg(long, conflicts_with = "processes")]
    cluster: Option<PathBuf>,
    /// Use this transport for every hop, overriding the scenario.
    #[arg(long, value_enum)]
    transport: Option<omnirig_transports::TransportKind>,
    /// Requests in flight at most, overriding the scenario.
    #[arg(long)]
    concurrency: Option<usize>,
    /// No per-request progress lines on stderr.
    #[arg(long, short)]
    quiet: bool,
}

/// Exit status 1 when any request failed, any byte differed, or a pool leaked.
pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let mut scenario = match &args.scenario {
        Some(p) => Scenario::from_path(p)?,
        None => Scenario::default_scenario(),
    };
    let source = match &args.scenario {
        Some(p) => p.display().to_string(),
        None => "the default scenario".into(),
    };
    if let Some(t) = args.transport {
        scenario = scenario.with_transport(t);
    }
    if let Some(c) = args.concurrency {
        scenario.concurrency = c;
    }
    if args.transport.is_some() || args.concurrency.is_some() {
        scenario.validate(&format!("{source} with the command line's overrides"))?;
    }
    {
        let requests = scenario.expand()?;
        let plans: Vec<_> = requests.iter().map(|r| &*r.plan).collect();
        scenario.check_memory(&plans, &source)?;
    }
    // Before the run, not after it: a report that cannot be written fails now.
    if let Some(dir) = &args.report {
        check_report_dir(dir)?;
    }
    let mut runner = Runner::new(scenario).progress(!args.quiet);
    if args.processes {
        runner = runner.processes(std::env::current_exe().context("locating the omnirig binary")?);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    #[cfg(feature = "hil")]
    let _agents = match &args.cluster {
        Some(path) => {
            let cluster = omnirig_hil::Cluster::from_path(path)?;
            let exe = std::env::current_exe().context("locating the omnirig binary")?;
            let agents = rt.block_on(omnirig_hil::start_agents(
                &cluster,
                &exe.to_string_lossy(),
                std::time::Duration::from_secs(60),
            ))?;
            runner = runner.cluster(std::sync::Arc::new(omnirig_hil::ClusterLauncher::new(
                cluster,
            )?));
            Some(agents)
        }
        None => None,
    };
    let report = rt.block_on(runner.run())?;
    print!("{}", report.summary_text());
    if let Some(dir) = &args.report {
        let path = report.write(dir)?;
        println!("report: {}", path.display());
        // The run's page, summary and plots next to it; one that cannot be written fails
        // the command (the run's verdict is printed above either way).
        let files = crate::report::write_run_site(&report, dir)
            .with_context(|| format!("report page in {}", dir.display()))?;
        println!(
            "page: {} ({} files)",
            dir.join("index.html").display(),
            files.len()
        );
    }
    if !report.passed() {
        std::process::exit(1);
    }
    Ok(())
}

/// `--report DIR` must be a directory this process can create files in (created if missing).
fn check_report_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    if dir.exists() && !dir.is_dir() {
        anyhow::bail!("--report {}: exists and is not a directory", dir.display());
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("--report {}: cannot create the directory", dir.display()))?;
    let probe = dir.join(format!(".omnirig-probe-{}", std::process::id()));
    std::fs::File::create(&probe)
        .with_context(|| format!("--report {}: cannot write into it", dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}
