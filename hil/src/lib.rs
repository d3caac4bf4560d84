//! Hardware in the loop: the same pipeline cases with stages placed on a cluster's nodes.
//!
//! - [`cluster`]: the cluster file (nodes, how to reach them, RDMA device / port / GID index,
//!   GPU, netdev, stages per node, the metadata store), parsed strictly.
//! - [`agent`]: the node agent (`omnirig agent`) and its coordinator side: the coordinator
//!   connects to each node's agent, proves it holds the cluster's secret, and has the agent
//!   start `omnirig stage` processes; the agent relays their exit.
//! - [`launcher`]: places a scenario's five stages on nodes through their agents, for
//!   [`omnirig_harness::process::Remote`].

pub mod agent;
pub mod cluster;
pub mod evidence;
pub mod launcher;

pub use cluster::{Cluster, MetadataConfig, Node, Reach};
pub use launcher::{ClusterLauncher, StartedAgents, start_agents};

/// The crate's one error type.
#[derive(Debug, thiserror::Error)]
pub enum HilError {
    /// The cluster file is missing, malformed or inconsistent; names the file and field.
    #[error("cluster file {file}: {reason}")]
    Cluster { file: String, reason: String },
    /// An agent refused, misbehaved, or could not be reached; names the node.
    #[error("agent of node {node} ({addr}): {reason}")]
    Agent {
        node: String,
        addr: String,
        reason: String,
    },
    /// The agent's own side: a bad request from a coordinator, a process that would not start.
    #[error("agent: {0}")]
    Serve(String),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = HilError> = std::result::Result<T, E>;
