//! `omnirig stage` (hidden): one pipeline stage as its own process, started by
//! `omnirig run --processes`.

use std::net::SocketAddr;

use omnirig_fixtures::Stage;

#[derive(clap::Args, Debug)]
pub struct StageArgs {
    /// encoder, thinker_prefill, thinker_decode, talker or code2wav.
    #[arg(long)]
    stage: String,
    /// The orchestrator's control address.
    #[arg(long)]
    orchestrator: SocketAddr,
}

pub fn run(args: StageArgs) -> anyhow::Result<()> {
    let stage = Stage::parse(&args.stage, "--stage")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(omnirig_harness::process::run_stage_process(
        stage,
        args.orchestrator,
    ))?;
    Ok(())
}
