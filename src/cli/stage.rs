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
    /// The inbound hop's transport.
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "shm"])]
    in_transport: String,
    /// The outbound hop's transport.
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "shm"])]
    out_transport: String,
}

fn transport(s: &str) -> &'static str {
    if s == "shm" { "shm" } else { "tcp" }
}

pub fn run(args: StageArgs) -> anyhow::Result<()> {
    let stage = Stage::parse(&args.stage, "--stage")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(omnirig_harness::process::run_stage_process(
        stage,
        args.orchestrator,
        transport(&args.in_transport),
        transport(&args.out_transport),
    ))?;
    Ok(())
}
