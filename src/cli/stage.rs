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
    /// The RDMA device its rdma engines use (a cluster node's `rdma.device`); default: the
    /// first device.
    #[arg(long)]
    rdma_device: Option<String>,
    /// The port on `--rdma-device` (1-based).
    #[arg(long, default_value_t = 1, requires = "rdma_device",
          value_parser = clap::value_parser!(u8).range(1..))]
    rdma_port: u8,
    /// The GID index to send from; default: the first RoCEv2 IPv4 GID.
    #[arg(long, requires = "rdma_device")]
    rdma_gid_index: Option<u32>,
    /// Where its tensors live: host, or gpu (device memory; a build with `--features cuda`).
    #[arg(long, default_value = "host")]
    memory: omnirig_harness::StageMemory,
    /// The nice value (0-19) of the threads that generate and check its tensors (see
    /// `omnirig run --check-nice`).
    #[arg(long, default_value_t = omnirig_harness::cpu::DEFAULT_NICE,
          value_parser = clap::value_parser!(i32).range(0..=i64::from(omnirig_harness::cpu::MAX_NICE)))]
    check_nice: i32,
}

pub fn run(args: StageArgs) -> anyhow::Result<()> {
    let stage = Stage::parse(&args.stage, "--stage")?;
    omnirig_harness::cpu::set_nice(args.check_nice)?;
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
        omnirig_harness::process::StageDevices {
            rdma: args
                .rdma_device
                .map(|device| omnirig_harness::process::StageRdma {
                    device,
                    port: args.rdma_port,
                    gid_index: args.rdma_gid_index,
                }),
            memory: args.memory,
        },
    ))?;
    Ok(())
}
