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
    if let Some(t) = args.transport {
        scenario = scenario.with_transport(t);
    }
    if let Some(c) = args.concurrency {
        scenario.concurrency = c;
    }
    scenario.validate("command line")?;
    let mut runner = Runner::new(scenario).progress(!args.quiet);
    if args.processes {
        runner = runner.processes(std::env::current_exe().context("locating the omnirig binary")?);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(runner.run())?;
    print!("{}", report.summary_text());
    if let Some(dir) = &args.report {
        let path = report.write(dir)?;
        println!("report: {}", path.display());
        // The run's page, summary and plots next to it (a failed plot never fails the run).
        match crate::report::write_run_site(&report, dir) {
            Ok(files) => println!(
                "page: {} ({} files)",
                dir.join("index.html").display(),
                files.len()
            ),
            Err(e) => eprintln!("report page: {e:#}"),
        }
    }
    if !report.passed() {
        std::process::exit(1);
    }
    Ok(())
}
