//! The `omnirig` command line.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "omnirig", version, about = "Test and simulation rig for the disaggregated Qwen3-Omni data plane")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Describe and export golden Qwen3-Omni fixtures.
    #[command(subcommand)]
    Fixtures(cli::fixtures::FixturesCmd),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Fixtures(cmd) => cli::fixtures::run(cmd),
    }
}
