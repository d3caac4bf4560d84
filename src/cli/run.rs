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
    /// `--transport sim`: the seed of the fabric's jitter, the random faults and the arrivals;
    /// the same seed replays the run exactly (see docs/sim.md).
    #[arg(long)]
    seed: Option<u64>,
    /// `--transport sim`: the fabric (YAML), overriding the scenario's `fabric:` section.
    #[arg(long)]
    fabric: Option<PathBuf>,
    /// `--transport sim`: write the run's event trace here, one event per line.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// The nice value (0-19) of the threads that generate and check the stages' tensors,
    /// so a woken transfer gets a core before them; 0: they run on the runtime's own threads,
    /// at the data plane's priority. `--processes` and `--cluster` pass it to every stage.
    #[arg(long, default_value_t = omnirig_harness::cpu::DEFAULT_NICE,
          value_parser = clap::value_parser!(i32).range(0..=i64::from(omnirig_harness::cpu::MAX_NICE)))]
    check_nice: i32,
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
    let sim = scenario.transport == omnirig_transports::TransportKind::Sim
        && omnirig_fixtures::PayloadKind::ALL
            .iter()
            .all(|&k| scenario.transport_for(k) == omnirig_transports::TransportKind::Sim);
    if !sim && (args.seed.is_some() || args.fabric.is_some() || args.trace.is_some()) {
        anyhow::bail!("--seed, --fabric and --trace need every hop on sim (--transport sim)");
    }
    if sim {
        if args.processes {
            anyhow::bail!("--transport sim runs in one process; drop --processes");
        }
        if let Some(f) = &args.fabric {
            let (fabric, cpu) = omnirig_harness::sim::fabric_file_from_path(f)?;
            scenario.fabric = Some(fabric);
            if cpu.is_some() {
                scenario.cpu = cpu;
            }
        }
        return run_sim(&scenario, &args);
    }
    omnirig_harness::cpu::set_nice(args.check_nice)?;
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

/// A simulated run: the report in modelled time, how fast it ran, its trace's digest.
fn run_sim(scenario: &Scenario, args: &RunArgs) -> anyhow::Result<()> {
    let run = omnirig_harness::sim::run(scenario, args.seed)?;
    let report = &run.report;
    print!("{}", report.summary_text());
    println!(
        "sim: {:.3} s modelled in {:.3} s real ({:.1}x real time), seed {}, trace {} ({} events)",
        run.virtual_s,
        run.real_s,
        run.virtual_s / run.real_s.max(1e-9),
        scenario_seed(scenario, args.seed),
        run.digest,
        run.trace.len()
    );
    for (q, u) in run.utilisation().iter().take(4) {
        println!("sim: {q} busy {:.1}%", u * 100.0);
    }
    if let Some(path) = &args.trace {
        let mut text = run.trace.join("\n");
        text.push('\n');
        std::fs::write(path, text).with_context(|| format!("--trace {}", path.display()))?;
        println!("trace: {}", path.display());
    }
    if let Some(dir) = &args.report {
        let path = report.write(dir)?;
        println!("report: {}", path.display());
        let files = crate::report::write_run_site(report, dir)
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

fn scenario_seed(s: &Scenario, seed: Option<u64>) -> u64 {
    seed.unwrap_or_else(|| s.fabric.as_ref().map_or(0, |f| f.seed))
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
