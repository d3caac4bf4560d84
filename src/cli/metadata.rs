//! `omnirig metadata-server`: a metadata store for clusters, speaking Mooncake's HTTP metadata
//! protocol (so Mooncake engines and omnirig engines can share it).

use std::net::SocketAddr;

use omnirig_transports::metadata::http::MetadataServer;

#[derive(clap::Args, Debug)]
pub struct MetadataServerArgs {
    /// Address to listen on (Mooncake's default port is 8080).
    #[arg(long, default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
}

/// Serves until the process is ended (SIGINT / SIGTERM; the store lives in memory only).
pub fn run(args: MetadataServerArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let server = MetadataServer::bind(args.listen).await?;
        println!(
            "metadata server on http://{}/metadata (GET / PUT / DELETE ?key=)",
            server.local_addr()
        );
        std::future::pending::<()>().await;
        drop(server);
        anyhow::Ok(())
    })
}
