//! Places a scenario's stages on a cluster's nodes and starts them through the nodes' agents.

use std::net::{IpAddr, SocketAddr};

use omnirig_fixtures::Stage;
use omnirig_harness::process::{StageChild, StageLauncher};

use crate::agent::AgentChild;
use crate::cluster::Cluster;

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
            let node = self.cluster.node_of(stage);
            let addr = SocketAddr::new(node.host, node.agent_port);
            let child = AgentChild::start(&node.name, addr, &self.secret, args, env)
                .await
                .map_err(|e| omnirig_harness::HarnessError::Setup(format!("{stage}: {e}")))?;
            Ok(Box::new(child) as Box<dyn StageChild>)
        })
    }
}
