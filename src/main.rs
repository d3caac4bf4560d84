//! The `omnirig` command line.

mod bench;
mod cli;
mod report;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "omnirig",
    version,
    about = "Test and simulation rig for the disaggregated Qwen3-Omni data plane"
)]
struct Cli {
    /// More log output (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Benchmarks: transfer (engine vs physical baseline), hop and pipeline (tensor-native vs
    /// the current pickle-over-ZMQ path).
    #[command(subcommand)]
    Bench(cli::bench::BenchCmd),
    /// Describe and export golden Qwen3-Omni fixtures.
    #[command(subcommand)]
    Fixtures(cli::fixtures::FixturesCmd),
    /// Run the five-stage pipeline on a scenario and write a report.
    Run(cli::run::RunArgs),
    /// Seeded search on the simulated fabric: random fault schedules and arrival patterns,
    /// the invariants checked after each run; prints any failing seed.
    Explore(cli::explore::ExploreArgs),
    /// Predicted per-hop and end-to-end latency and throughput for a fabric, per concurrency
    /// (the simulated fabric's scale model), optionally against measured runs.
    Simulate(cli::simulate::SimulateArgs),
    /// Plots (PNG and SVG) from benchmark results and run reports; markdown tables of the results.
    Report(cli::report::ReportArgs),
    /// A metadata store for clusters, speaking Mooncake's HTTP metadata protocol
    /// (GET / PUT / DELETE on /metadata?key=).
    MetadataServer(cli::metadata::MetadataServerArgs),
    /// The node agent of the hardware-in-the-loop mode: starts stage processes for the
    /// coordinator (`omnirig run --cluster`, `cargo test --features hil`).
    #[cfg(feature = "hil")]
    Agent(cli::agent::AgentArgs),
    /// Evidence for a cluster: host facts per node, per-hop measurements per path, and why
    /// any path could not run (evidence.json, evidence.md, the run's report page).
    #[cfg(feature = "hil")]
    Evidence(cli::evidence::EvidenceArgs),
    /// One stage as its own process (started by `run --processes`).
    #[command(hide = true)]
    Stage(cli::stage::StageArgs),
}

fn init_logging(verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    match cli.cmd {
        Cmd::Bench(cmd) => cli::bench::run(cmd),
        Cmd::Fixtures(cmd) => cli::fixtures::run(cmd),
        Cmd::Run(args) => cli::run::run(args),
        Cmd::Explore(args) => cli::explore::run(args),
        Cmd::Simulate(args) => cli::simulate::run(args),
        Cmd::Report(args) => cli::report::run(args),
        Cmd::Stage(args) => cli::stage::run(args),
        Cmd::MetadataServer(args) => cli::metadata::run(args),
        #[cfg(feature = "hil")]
        Cmd::Agent(args) => cli::agent::run(args),
        #[cfg(feature = "hil")]
        Cmd::Evidence(args) => cli::evidence::run(args),
    }
}
