//! `omnirig stage` (hidden): one pipeline stage as its own process, started by
//! `omnirig run --processes`.

use std::net::SocketAddr;

use omnirig_fixtures::Stage;
use omnirig_transports::TransportKind;

#[derive(clap::Args, Debug)]
pub struct StageArgs {
    /// encoder, thinker_prefill, thinker_decode, talker or code2wav.
    #[arg(long)]
    stage: String,
    /// The orchestrator's control address.
    #[arg(long)]
    orchestrator: SocketAddr,
    /// The inbound hop's transport (one that crosses processes).
    #[arg(long, value_enum, default_value_t = TransportKind::Tcp)]
    in_transport: TransportKind,
    /// The outbound hop's transport (one that crosses processes).
    #[arg(long, value_enum, default_value_t = TransportKind::Tcp)]
    out_transport: TransportKind,
    /// The address its control listener and engines listen on (a cluster node's address).
    #[arg(long, default_value = "127.0.0.1")]
    bind: std::net::IpAddr,
    /// The metadata store its engines publish to and find peers through (http://host:port or
    /// etcd://host:port[?ttl_s=N]); default: peer-to-peer.
    #[arg(long)]
    metadata: Option<String>,
    /// Where its tensors live: host, or gpu (device memory; a build with `--features cuda`).
    #[arg(long, default_value = "host")]
    memory: omnirig_harness::StageMemory,
}

pub fn run(args: StageArgs) -> anyhow::Result<()> {
    let stage = Stage::parse(&args.stage, "--stage")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // Kinds that cannot cross processes are refused there, by name.
    rt.block_on(omnirig_harness::process::run_stage_process(
        stage,
        args.orchestrator,
        args.in_transport,
        args.out_transport,
        args.bind,
        args.metadata.as_deref(),
        args.memory,
    ))?;
    Ok(())
}
