//! Host facts for the evidence report, collected on each node (by its agent): kernel, RDMA
//! devices (`ibv_devinfo -v`), their drivers and link rates, GPU-NIC topology
//! (`nvidia-smi topo -m`). Each probe that cannot run says why instead of vanishing.

use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Most bytes of one probe's output kept (a GID table can be long; not megabytes).
pub const MAX_PROBE_OUTPUT: usize = 256 << 10;
const PROBE_TIMEOUT: Duration = Duration::from_secs(20);

/// One probe: the command and what it printed, or why it could not run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Probe {
    pub name: String,
    pub command: String,
    pub ran: bool,
    /// stdout (bounded), when it ran and succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    /// Why there is no output: absent tool, non-zero exit (with stderr), timeout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why_not: Option<String>,
}

/// A node's facts.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HostFacts {
    pub hostname: String,
    pub probes: Vec<Probe>,
}

async fn probe(name: &str, program: &str, args: &[&str]) -> Probe {
    let command = std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ");
    let mut p = Probe {
        name: name.into(),
        command,
        ran: false,
        output: None,
        why_not: None,
    };
    let child = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            p.why_not = Some(format!("{program} is not installed on this node"));
            return p;
        }
        Err(e) => {
            p.why_not = Some(format!("{program} could not start: {e}"));
            return p;
        }
    };
    match tokio::time::timeout(PROBE_TIMEOUT, child.wait_with_output()).await {
        Err(_) => p.why_not = Some(format!("no result within {PROBE_TIMEOUT:?}")),
        Ok(Err(e)) => p.why_not = Some(e.to_string()),
        Ok(Ok(out)) => {
            p.ran = true;
            let text = |b: &[u8]| {
                let mut s =
                    String::from_utf8_lossy(&b[..b.len().min(MAX_PROBE_OUTPUT)]).into_owned();
                if b.len() > MAX_PROBE_OUTPUT {
                    s.push_str("\n[... cut at 256 KiB]");
                }
                s
            };
            if out.status.success() {
                p.output = Some(text(&out.stdout));
            } else {
                p.why_not = Some(format!(
                    "{} ({})",
                    out.status,
                    text(&out.stderr)
                        .trim()
                        .chars()
                        .take(500)
                        .collect::<String>()
                ));
            }
        }
    }
    p
}

/// Reads small sysfs files the RDMA evidence needs: per device and port, the link rate and
/// state and the kernel driver bound to it.
fn sysfs_rdma() -> Probe {
    let mut p = Probe {
        name: "rdma_sysfs".into(),
        command: "/sys/class/infiniband/*/{ports/*/rate,ports/*/state,device/driver}".into(),
        ran: false,
        output: None,
        why_not: None,
    };
    let Ok(devs) = std::fs::read_dir("/sys/class/infiniband") else {
        p.why_not = Some(
            "no /sys/class/infiniband: no RDMA devices (or the ib_core module) on this node".into(),
        );
        return p;
    };
    let mut out = String::new();
    let mut devs: Vec<_> = devs.flatten().map(|d| d.path()).collect();
    devs.sort();
    for d in devs.iter().take(64) {
        let name = d
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let driver = std::fs::read_link(d.join("device/driver"))
            .ok()
            .and_then(|l| l.file_name().map(|f| f.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "?".into());
        out.push_str(&format!("{name}: driver {driver}\n"));
        if let Ok(ports) = std::fs::read_dir(d.join("ports")) {
            let mut ports: Vec<_> = ports.flatten().map(|p| p.path()).collect();
            ports.sort();
            for port in ports.iter().take(16) {
                let read = |f: &str| {
                    std::fs::read_to_string(port.join(f))
                        .map(|s| s.trim().chars().take(100).collect::<String>())
                        .unwrap_or_else(|_| "?".into())
                };
                out.push_str(&format!(
                    "  port {}: rate {}, state {}, link_layer {}\n",
                    port.file_name().unwrap_or_default().to_string_lossy(),
                    read("rate"),
                    read("state"),
                    read("link_layer")
                ));
            }
        }
    }
    if devs.is_empty() {
        p.why_not = Some("/sys/class/infiniband is empty: no RDMA devices on this node".into());
    } else {
        p.ran = true;
        p.output = Some(out);
    }
    p
}

/// Collects this host's facts.
pub async fn collect() -> HostFacts {
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".into());
    let probes = vec![
        probe("kernel", "uname", &["-srvm"]).await,
        probe("ibv_devinfo", "ibv_devinfo", &["-v"]).await,
        sysfs_rdma(),
        probe("rdma_links", "rdma", &["link", "show"]).await,
        probe("gpu_topology", "nvidia-smi", &["topo", "-m"]).await,
        probe("ib_write_bw", "ib_write_bw", &["--version"]).await,
    ];
    HostFacts { hostname, probes }
}
