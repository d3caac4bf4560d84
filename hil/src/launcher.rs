//! Places a scenario's stages on a cluster's nodes and starts them through the nodes' agents.

use std::net::{IpAddr, SocketAddr};

use omnirig_fixtures::Stage;
use omnirig_harness::process::{StageChild, StageLauncher, StageRdma};

use crate::agent::AgentChild;
use crate::cluster::Cluster;

/// The rdma transport's tracing target (its selection lines are logged there).
const RDMA_LOG_TARGET: &str = "omnirig_transports::transport::rdma";

/// [`StageLauncher`] over a cluster's agents.
pub struct ClusterLauncher {
    cluster: Cluster,
    secret: String,
}

impl ClusterLauncher {
    pub fn new(cluster: Cluster) -> crate::Result<Self> {
        let secret = cluster.secret()?;
        Ok(Self { cluster, secret })
    }

    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }
}

impl StageLauncher for ClusterLauncher {
    fn orchestrator_listen(&self) -> SocketAddr {
        SocketAddr::new(self.cluster.coordinator.address, 0)
    }

    fn bind_host(&self, stage: Stage) -> IpAddr {
        self.cluster.node_of(stage).host
    }

    fn node(&self, stage: Stage) -> Option<String> {
        Some(self.cluster.node_of(stage).name.clone())
    }

    fn metadata(&self) -> Option<String> {
        self.cluster.metadata.spec()
    }

    fn rdma(&self, stage: Stage) -> Option<StageRdma> {
        self.cluster
            .node_of(stage)
            .rdma
            .as_ref()
            .map(|r| StageRdma {
                device: r.device.clone(),
                port: r.port,
                gid_index: r.gid_index.map(u32::from),
            })
    }

    fn launch<'a>(
        &'a self,
        stage: Stage,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = omnirig_harness::Result<Box<dyn StageChild>>>
                + Send
                + 'a,
        >,
    > {
        Box::pin(async move {
            let mut env = env;
            // The rdma transport logs the device, port and GID it selected at info: the
            // agent keeps those lines for the evidence report.
            if !env.iter().any(|(k, _)| k == "RUST_LOG") {
                let base = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
                env.push(("RUST_LOG".into(), format!("{base},{RDMA_LOG_TARGET}=info")));
            }
            let node = self.cluster.node_of(stage);
            let addr = SocketAddr::new(node.host, node.agent_port);
            let child = AgentChild::start(&node.name, addr, &self.secret, args, env)
                .await
                .map_err(|e| omnirig_harness::HarnessError::Setup(format!("{stage}: {e}")))?;
            Ok(Box::new(child) as Box<dyn StageChild>)
        })
    }
}

/// Agents this coordinator started (`reach: ssh` / `srun`); killed when dropped.
pub struct StartedAgents {
    children: Vec<(String, tokio::process::Child)>,
    /// Each agent's stdin, held open for as long as the agents should live: an agent started
    /// with `--secret-stdin` exits when it closes (dropping these ends them all, even where
    /// killing the local ssh would not reach the remote process).
    stdins: Vec<tokio::process::ChildStdin>,
}

impl StartedAgents {
    /// How many agents were started (manual nodes are not).
    pub fn len(&self) -> usize {
        self.children.len()
    }

    pub fn is_empty(&self) -> bool {
        self.children.is_empty()
    }
}

impl Drop for StartedAgents {
    fn drop(&mut self) {
        self.stdins.clear();
        for (_, c) in &mut self.children {
            let _ = c.start_kill();
        }
    }
}

/// The command that starts `node`'s agent from the coordinator: `ssh` or `srun` running
/// `EXE agent --listen HOST:PORT --secret-stdin` (the secret goes down stdin, never into a
/// command line other users can read; the agent exits when that stdin closes, so it ends with
/// the ssh or srun that started it). None for `reach: manual`.
pub fn agent_command(
    cluster: &Cluster,
    node: &crate::Node,
    exe: &str,
) -> Option<tokio::process::Command> {
    let exe = node.omnirig.as_deref().unwrap_or(exe);
    let listen = SocketAddr::new(node.host, node.agent_port).to_string();
    let agent = [exe, "agent", "--listen", &listen, "--secret-stdin"];
    let mut c = match node.reach {
        crate::Reach::Manual => return None,
        crate::Reach::Ssh => {
            let mut c = tokio::process::Command::new("ssh");
            let dest = node.ssh.clone().unwrap_or_else(|| node.host.to_string());
            if let Some(f) = &cluster.ssh_config {
                c.args(["-F", f]);
            }
            c.args(["-o", "BatchMode=yes", "-T", &dest, "--"]);
            c
        }
        crate::Reach::Srun => {
            let mut c = tokio::process::Command::new("srun");
            c.args(["--nodes=1", "--ntasks=1", "--input=0", "-w", &node.name]);
            c
        }
    };
    c.args(agent)
        .stdin(std::process::Stdio::piped())
        .kill_on_drop(true);
    Some(c)
}

/// Starts the agents of every `ssh` / `srun` node and waits (up to `wait`) until every
/// node's agent port accepts connections, manual ones included; errors name the node.
pub async fn start_agents(
    cluster: &Cluster,
    exe: &str,
    wait: std::time::Duration,
) -> crate::Result<StartedAgents> {
    use tokio::io::AsyncWriteExt;
    let secret = cluster.secret()?;
    let mut started = StartedAgents {
        children: vec![],
        stdins: vec![],
    };
    for node in &cluster.nodes {
        let Some(mut cmd) = agent_command(cluster, node, exe) else {
            continue;
        };
        let fail = |reason: String| crate::HilError::Agent {
            node: node.name.clone(),
            addr: SocketAddr::new(node.host, node.agent_port).to_string(),
            reason,
        };
        let mut child = cmd
            .spawn()
            .map_err(|e| fail(format!("starting its agent ({:?}): {e}", node.reach)))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(format!("{secret}\n").as_bytes())
                .await
                .map_err(|e| fail(format!("handing its agent the secret: {e}")))?;
            started.stdins.push(stdin);
        }
        started.children.push((node.name.clone(), child));
    }
    let start = tokio::time::Instant::now();
    for node in &cluster.nodes {
        let addr = SocketAddr::new(node.host, node.agent_port);
        // A manual node's agent should be up already: a short grace, not the start-up wait.
        let wait = match node.reach {
            crate::Reach::Manual => wait.min(std::time::Duration::from_secs(5)),
            _ => wait,
        };
        let deadline = start + wait;
        loop {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                break;
            }
            if let Some((_, c)) = started.children.iter_mut().find(|(n, _)| *n == node.name)
                && let Ok(Some(st)) = c.try_wait()
            {
                return Err(crate::HilError::Agent {
                    node: node.name.clone(),
                    addr: addr.to_string(),
                    reason: format!("its agent exited at start: {st}"),
                });
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(crate::HilError::Agent {
                    node: node.name.clone(),
                    addr: addr.to_string(),
                    reason: format!(
                        "no agent listening after {wait:?} (reach: {:?}; for manual nodes start `omnirig agent` there)",
                        node.reach
                    ),
                });
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    Ok(started)
}
