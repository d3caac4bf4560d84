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
    let secret_stdin = args.secret_stdin;
    let r = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("agent: binding {listen}"))?;
        println!("omnirig agent listening on {}", listener.local_addr()?);
        tokio::select! {
            r = agent.serve(listener) => r?,
            () = launcher_gone(secret_stdin) => eprintln!(
                "omnirig agent on {listen}: stdin closed (the ssh or srun that started it \
                 ended); stopping its stages and exiting"
            ),
        }
        anyhow::Ok(())
    });
    // Dropping the runtime drops the tasks holding stage processes, which kills them
    // (kill_on_drop): an agent never leaves stages behind on its node.
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    r
}

/// Resolves when stdin reaches end of file, for an agent started with `--secret-stdin`: its
/// launcher (ssh, srun) holds the other end, and when the coordinator ends it the agent must not
/// linger on the node holding its port. Never resolves otherwise (a hand-started agent runs
/// until killed).
async fn launcher_gone(secret_stdin: bool) {
    if !secret_stdin {
        return std::future::pending().await;
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    // A plain thread: a blocking read of stdin cannot be cancelled, and the runtime's
    // shutdown must not wait for it.
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        let _ = tx.send(());
    });
    let _ = rx.await;
}
