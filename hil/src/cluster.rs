//! The cluster file: which nodes, how to reach them, their RDMA devices, which stages each
//! runs, and the metadata store. YAML, parsed strictly (unknown fields refused), checked
//! as a whole (every stage placed exactly once, names unique) before anything starts.
//! A documented example is `hil/cluster.example.yaml`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::Path;

use omnirig_fixtures::Stage;
use serde::Deserialize;

use crate::{HilError, Result};

/// The environment variable the agents' shared secret is read from when the file names none.
pub const SECRET_ENV: &str = "OMNIRIG_AGENT_SECRET";
/// The agents' default port.
pub const DEFAULT_AGENT_PORT: u16 = 7070;
/// Shortest secret accepted (characters).
pub const MIN_SECRET: usize = 16;
/// Longest secret accepted (it travels in a fixed-size preface).
pub const MAX_SECRET: usize = 128;
/// Largest cluster file read.
const MAX_FILE: u64 = 1 << 20;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// A name for reports.
    pub name: String,
    /// The agents' shared secret, inline (prefer `secret_env`: files get copied around).
    #[serde(default)]
    pub secret: Option<String>,
    /// The environment variable holding the secret (default `OMNIRIG_AGENT_SECRET`).
    #[serde(default)]
    pub secret_env: Option<String>,
    /// The address the coordinator listens on for its stages (reachable from every node).
    pub coordinator: Coordinator,
    /// Where engines publish segment descriptors.
    #[serde(default)]
    pub metadata: MetadataConfig,
    /// For `reach: ssh` nodes: an ssh_config file the coordinator's `ssh` reads instead of the
    /// user's (`ssh -F FILE`): ports, identities, jump hosts, known-hosts policy.
    #[serde(default)]
    pub ssh_config: Option<String>,
    pub nodes: Vec<Node>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Coordinator {
    /// An address of the coordinator's host that every node can reach.
    pub address: IpAddr,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "snake_case", tag = "kind")]
pub enum MetadataConfig {
    /// Peer-to-peer: each engine asks its peer for its descriptor (no store).
    #[default]
    P2p,
    /// A store speaking Mooncake's HTTP metadata protocol (`omnirig metadata-server` or
    /// Mooncake's `mooncake_http_metadata_server`).
    Http { url: String },
    /// An etcd v3 cluster (client URL); entries live under a lease of `ttl_s` seconds.
    Etcd {
        url: String,
        #[serde(default = "default_ttl")]
        ttl_s: u64,
    },
}

impl MetadataConfig {
    /// The store spec stage processes take (`--metadata`); None for peer-to-peer.
    pub fn spec(&self) -> Option<String> {
        match self {
            MetadataConfig::P2p => None,
            MetadataConfig::Http { url } => Some(url.clone()),
            MetadataConfig::Etcd { url, ttl_s } => Some(format!(
                "etcd://{}?ttl_s={ttl_s}",
                url.trim_start_matches("http://").trim_end_matches('/')
            )),
        }
    }
}

fn default_ttl() -> u64 {
    10
}

/// How the coordinator gets the node's agent running.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Reach {
    /// Someone started `omnirig agent` on the node already.
    #[default]
    Manual,
    /// `ssh HOST omnirig agent ...` (key-based, non-interactive).
    Ssh,
    /// `srun -w HOST omnirig agent ...` (inside a Slurm allocation).
    Srun,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Node {
    /// Unique; named in every error about the node.
    pub name: String,
    /// The node's address on the cluster network (its agent, stages and TCP engines listen
    /// there).
    pub host: IpAddr,
    #[serde(default)]
    pub reach: Reach,
    /// For `reach: ssh`: the ssh destination, when not `host` (e.g. `user@login-name`).
    #[serde(default)]
    pub ssh: Option<String>,
    /// The agent's port.
    #[serde(default = "default_agent_port")]
    pub agent_port: u16,
    /// The omnirig binary on the node (default: the coordinator's own path, as on a shared
    /// file system).
    #[serde(default)]
    pub omnirig: Option<String>,
    /// The RDMA device the node's engines use, when it has one.
    #[serde(default)]
    pub rdma: Option<Rdma>,
    /// A GPU index, for GPUDirect paths and the topology in the evidence.
    #[serde(default)]
    pub gpu: Option<u32>,
    /// The IPoIB or RoCE network interface (TCP over it is measured apart from plain TCP).
    #[serde(default)]
    pub netdev: Option<String>,
    /// The stages this node runs (encoder, thinker_prefill, thinker_decode, talker,
    /// code2wav).
    pub stages: Vec<String>,
}

fn default_agent_port() -> u16 {
    DEFAULT_AGENT_PORT
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Rdma {
    /// The verbs device (`ibv_devices`), e.g. `mlx5_0` or `rxe0`.
    pub device: String,
    /// The port on it (1-based).
    #[serde(default = "default_port")]
    pub port: u8,
    /// The GID table index (`show_gids`; RoCE v2 usually 1 or 3). Absent: the first RoCEv2
    /// IPv4 GID (the first GID on InfiniBand), which the engine logs when it opens the device.
    #[serde(default)]
    pub gid_index: Option<u8>,
}

fn default_port() -> u8 {
    1
}

impl Cluster {
    pub fn from_path(path: &Path) -> Result<Cluster> {
        let file = path.display().to_string();
        let err = |reason: String| HilError::Cluster {
            file: file.clone(),
            reason,
        };
        let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
        if !meta.is_file() || meta.len() > MAX_FILE {
            return Err(err(format!(
                "not a regular file of at most {MAX_FILE} bytes"
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        Cluster::from_yaml(&text, &file)
    }

    /// Parses and checks a cluster file; `file` names it in errors.
    pub fn from_yaml(yaml: &str, file: &str) -> Result<Cluster> {
        let c: Cluster = serde_saphyr::from_str(yaml).map_err(|e| HilError::Cluster {
            file: file.into(),
            reason: e.to_string(),
        })?;
        c.validate(file)?;
        Ok(c)
    }

    fn validate(&self, file: &str) -> Result<()> {
        let bad = |field: String, why: String| {
            Err(HilError::Cluster {
                file: file.into(),
                reason: format!("{field}: {why}"),
            })
        };
        if self.name.trim().is_empty() {
            return bad("name".into(), "empty".into());
        }
        if self.nodes.is_empty() {
            return bad("nodes".into(), "no nodes".into());
        }
        if let Some(s) = &self.secret
            && !(MIN_SECRET..=MAX_SECRET).contains(&s.len())
        {
            return bad(
                "secret".into(),
                format!("{} characters; {MIN_SECRET}..={MAX_SECRET} needed", s.len()),
            );
        }
        match &self.metadata {
            MetadataConfig::P2p => {}
            MetadataConfig::Http { url } | MetadataConfig::Etcd { url, .. } => {
                if let Err(e) = omnirig_transports::metadata::http::HttpUrl::parse(url) {
                    return bad("metadata.url".into(), e.detail().into());
                }
            }
        }
        if let MetadataConfig::Etcd { ttl_s, .. } = self.metadata
            && !(2..=3600).contains(&ttl_s)
        {
            return bad("metadata.ttl_s".into(), format!("{ttl_s}; 2..=3600 s"));
        }
        let mut names = BTreeSet::new();
        let mut placed: Vec<(Stage, String)> = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let at = |f: &str| format!("nodes[{i}] ({}).{f}", n.name);
            if n.name.is_empty()
                || n.name.len() > 64
                || !n
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            {
                return bad(
                    format!("nodes[{i}].name"),
                    format!("{:?}: 1..=64 of [A-Za-z0-9-_.]", n.name),
                );
            }
            if !names.insert(n.name.clone()) {
                return bad(at("name"), "another node has this name".into());
            }
            if n.agent_port == 0 {
                return bad(at("agent_port"), "0 is not a port".into());
            }
            if let Some(r) = &n.rdma {
                if r.device.is_empty() || r.device.len() > 64 {
                    return bad(at("rdma.device"), "empty or too long".into());
                }
                if r.port == 0 {
                    return bad(at("rdma.port"), "ports are 1-based".into());
                }
            }
            if n.reach != Reach::Ssh && n.ssh.is_some() {
                return bad(at("ssh"), "given but reach is not ssh".into());
            }
            for s in &n.stages {
                let st = Stage::parse(s, &at("stages")).map_err(|e| HilError::Cluster {
                    file: file.into(),
                    reason: e.to_string(),
                })?;
                if let Some((_, other)) = placed.iter().find(|(p, _)| *p == st) {
                    return bad(
                        at("stages"),
                        format!("{s} is already placed on node {other}"),
                    );
                }
                placed.push((st, n.name.clone()));
            }
        }
        for st in Stage::ALL {
            if !placed.iter().any(|(p, _)| *p == st) {
                return bad("nodes[*].stages".into(), format!("no node runs {st}"));
            }
        }
        Ok(())
    }

    /// The node that runs `stage` (every stage has one once the file parsed).
    pub fn node_of(&self, stage: Stage) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.stages.iter().any(|s| s == stage.as_str()))
            .expect("a parsed cluster places every stage")
    }

    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The agents' secret: inline, or from the environment variable the file (or the
    /// default) names.
    pub fn secret(&self) -> Result<String> {
        if let Some(s) = &self.secret {
            return Ok(s.clone());
        }
        let var = self.secret_env.as_deref().unwrap_or(SECRET_ENV);
        let s = std::env::var(var).map_err(|_| HilError::Cluster {
            file: self.name.clone(),
            reason: format!("no `secret` in the file and {var} is not set"),
        })?;
        check_secret(&s, var)?;
        Ok(s)
    }
}

/// A secret's length bounds, named by where it came from.
pub fn check_secret(s: &str, from: &str) -> Result<()> {
    if !(MIN_SECRET..=MAX_SECRET).contains(&s.len()) || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(HilError::Serve(format!(
            "the secret from {from} must be {MIN_SECRET}..={MAX_SECRET} printable ASCII characters"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../cluster.example.yaml");

    #[test]
    fn the_documented_example_parses() {
        let c = Cluster::from_yaml(EXAMPLE, "cluster.example.yaml").unwrap();
        assert_eq!(c.nodes.len(), 2);
        assert_eq!(c.node_of(Stage::Talker).name, "node-b");
        let r = c.nodes[0].rdma.as_ref().unwrap();
        assert_eq!(
            (r.device.as_str(), r.port, r.gid_index),
            ("mlx5_0", 1, Some(3))
        );
        assert!(matches!(c.metadata, MetadataConfig::Etcd { ttl_s: 10, .. }));
    }

    fn err(yaml: &str) -> String {
        Cluster::from_yaml(yaml, "test.yaml")
            .unwrap_err()
            .to_string()
    }

    const BASE: &str = "name: t\nsecret: 0123456789abcdef\ncoordinator: {address: 127.0.0.1}\n";

    #[test]
    fn bad_files_are_refused_naming_file_and_field() {
        let one = |extra: &str, stages: &str| {
            format!(
                "{BASE}nodes:\n  - name: a\n    host: 127.0.0.1\n    stages: [{stages}]\n{extra}"
            )
        };
        let all = "encoder, thinker_prefill, thinker_decode, talker, code2wav";
        assert!(Cluster::from_yaml(&one("", all), "ok.yaml").is_ok());
        for (yaml, want) in [
            (one("    colour: red\n", all), "colour"),
            (one("", "encoder, talker"), "no node runs thinker_prefill"),
            (
                one("", &format!("{all}, talker")),
                "talker is already placed",
            ),
            (one("", &format!("{all}, vocoder")), "vocoder"),
            (
                one("    rdma: {device: mlx5_0, port: 0}\n", all),
                "rdma.port",
            ),
            (
                one("    rdma: {device: mlx5_0, gid_index: 300}\n", all),
                "gid_index",
            ),
            (
                one("    ssh: me@x\n", all),
                "ssh: given but reach is not ssh",
            ),
            (one("    reach: telnet\n", all), "telnet"),
            (
                one("", all).replace(
                    "nodes:\n",
                    "metadata: {kind: http, url: 'ftp://x'}\nnodes:\n",
                ),
                "metadata.url",
            ),
            (format!("{BASE}nodes: []\n"), "no nodes"),
            (
                one("", all).replace("host: 127.0.0.1", "host: not-an-ip"),
                "host",
            ),
            (
                one("", all).replace("secret: 0123456789abcdef", "secret: short"),
                "secret: 5 characters",
            ),
        ] {
            let e = err(&yaml);
            assert!(
                e.contains("test.yaml") && e.contains(want),
                "{want:?} not in {e}"
            );
        }
    }
}
