//! `omnirig fixtures ...`: owned by the fixtures work (issue 3).

#[derive(clap::Subcommand, Debug)]
pub enum FixturesCmd {}

pub fn run(cmd: FixturesCmd) -> anyhow::Result<()> {
    match cmd {}
}
