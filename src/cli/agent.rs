//! `omnirig agent`: the node agent of the hardware-in-the-loop mode. It starts
//! `omnirig stage` processes for a coordinator that proves it holds the cluster's secret,
//! and relays their exit.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use omnirig_hil::Cluster;
use omnirig_hil::agent::Agent;
use omnirig_hil::cluster::SECRET_ENV;

#[derive(clap::Args, Debug)]
pub struct AgentArgs {
    /// Address to listen on (default with --cluster/--node: the node's host and agent_port).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// The cluster file (for this node's address and the secret).
    #[arg(long, requires = "node")]
    cluster: Option<PathBuf>,
    /// This node's name in the cluster file.
    #[arg(long, requires = "cluster")]
    node: Option<String>,
    /// Read the secret from the first line of stdin (how ssh / srun hand it over); otherwise
    /// the cluster file's secret, or OMNIRIG_AGENT_SECRET.
    #[arg(long)]
    secret_stdin: bool,
}

pub fn run(args: AgentArgs) -> anyhow::Result<()> {
    let cluster = args
        .cluster
        .as_deref()
        .map(Cluster::from_path)
        .transpose()?;
    let listen = match (&args.listen, &cluster, &args.node) {
        (Some(l), _, _) => *l,
        (None, Some(c), Some(n)) => {
            let node = c
                .node(n)
                .with_context(|| format!("--node {n}: not a node of cluster {}", c.name))?;
            SocketAddr::new(node.host, node.agent_port)
        }
        _ => anyhow::bail!("give --listen ADDR, or --cluster FILE with --node NAME"),
    };
    let secret = if args.secret_stdin {
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .context("reading the secret from stdin")?;
        line.trim_end_matches(['\r', '\n']).to_owned()
    } else if let Some(c) = &cluster {
        c.secret()?
    } else {
        std::env::var(SECRET_ENV).with_context(|| {
            format!("no secret: set {SECRET_ENV}, or use --cluster or --secret-stdin")
        })?
    };
    let exe = std::env::current_exe().context("locating the omnirig binary")?;
    let agent = Arc::new(Agent::new(exe, secret)?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("agent: binding {listen}"))?;
        println!("omnirig agent listening on {}", listener.local_addr()?);
        agent.serve(listener).await?;
        anyhow::Ok(())
    })
}
