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
    probe_within(name, program, args, PROBE_TIMEOUT).await
}

async fn probe_within(name: &str, program: &str, args: &[&str], limit: Duration) -> Probe {
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
    match tokio::time::timeout(limit, child.wait_with_output()).await {
        Err(_) => p.why_not = Some(format!("no result within {limit:?}")),
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
            .unwrap_or_else(|| software_driver(d));
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

/// A software RDMA device (rdma_rxe, siw) has no PCI device behind it: name its module and
/// the netdev it runs on (its `parent`) instead.
fn software_driver(dev: &std::path::Path) -> String {
    let parent = std::fs::read_to_string(dev.join("parent"))
        .map(|s| s.trim().chars().take(64).collect::<String>())
        .ok();
    let module = ["rdma_rxe", "siw"]
        .into_iter()
        .find(|m| std::path::Path::new("/sys/module").join(m).exists());
    match (module, parent) {
        (Some(m), Some(p)) => format!("{m} (software, on netdev {p})"),
        (Some(m), None) => format!("{m} (software)"),
        (None, Some(p)) => format!("? (no PCI device; on netdev {p})"),
        (None, None) => "?".into(),
    }
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
        probe("addresses", "ip", &["-o", "addr", "show"]).await,
        probe("gpu_topology", "nvidia-smi", &["topo", "-m"]).await,
    ];
    HostFacts { hostname, probes }
}

/// How long one side of a perftest baseline may run (the server waits for its client).
pub const PERFTEST_TIMEOUT: Duration = Duration::from_secs(120);

/// The perftest tools an agent runs for the baselines.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum PerfTool {
    IbWriteBw,
    IbWriteLat,
}

impl PerfTool {
    pub fn program(self) -> &'static str {
        match self {
            PerfTool::IbWriteBw => "ib_write_bw",
            PerfTool::IbWriteLat => "ib_write_lat",
        }
    }
}

/// One side of a perftest run between two nodes. The agent builds the command line from
/// these fields, each checked first: it runs nothing a coordinator spells out.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PerftestRequest {
    pub tool: PerfTool,
    /// The verbs device (`-d`).
    pub device: String,
    /// Its port (`-i`, 1-based).
    pub port: u8,
    /// GID index (`-x`); None: perftest's choice.
    pub gid_index: Option<u8>,
    /// Message size in bytes (`-s`).
    pub size: u64,
    /// Iterations (`-n`).
    pub iterations: u32,
    /// perftest's TCP port for its handshake (`-p`).
    pub tcp_port: u16,
    /// None: the server side; Some: the client, connecting to the server there.
    pub server: Option<std::net::IpAddr>,
}

/// Largest perftest message a baseline asks for.
const MAX_PERF_SIZE: u64 = 64 << 20;

impl PerftestRequest {
    /// The command's arguments, or why the request is refused.
    pub fn args(&self) -> Result<Vec<String>, String> {
        let d = &self.device;
        if d.is_empty()
            || d.len() > 64
            || !d
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(format!("device {d:?}: 1..=64 of [A-Za-z0-9-_.]"));
        }
        if self.port == 0 {
            return Err("port 0: ports are 1-based".into());
        }
        if !(1..=MAX_PERF_SIZE).contains(&self.size) {
            return Err(format!("size {}: 1..={MAX_PERF_SIZE}", self.size));
        }
        if !(1..=1_000_000).contains(&self.iterations) {
            return Err(format!("iterations {}: 1..=1000000", self.iterations));
        }
        if self.tcp_port < 1024 {
            return Err(format!("tcp_port {}: 1024 or above", self.tcp_port));
        }
        // -F: no CPU frequency check (it fails in VMs and on governed CPUs).
        let mut a: Vec<String> = vec![
            "-d".into(),
            d.clone(),
            "-i".into(),
            self.port.to_string(),
            "-F".into(),
            "-s".into(),
            self.size.to_string(),
            "-n".into(),
            self.iterations.to_string(),
            "-p".into(),
            self.tcp_port.to_string(),
        ];
        if let Some(g) = self.gid_index {
            a.extend(["-x".into(), g.to_string()]);
        }
        if let Some(server) = self.server {
            a.push(server.to_string());
        }
        Ok(a)
    }
}

/// Runs one side of a perftest baseline on this node.
pub async fn perftest(req: &PerftestRequest) -> Probe {
    let program = req.tool.program();
    let name = format!(
        "{program} {} {}",
        if req.server.is_some() {
            "client"
        } else {
            "server"
        },
        req.size
    );
    match req.args() {
        Ok(args) => {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            probe_within(&name, program, &args, PERFTEST_TIMEOUT).await
        }
        Err(why) => Probe {
            name,
            command: program.into(),
            ran: false,
            output: None,
            why_not: Some(format!("refused: {why}")),
        },
    }
}

/// One result row of perftest's output.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct PerfRow {
    pub bytes: u64,
    pub iterations: u64,
    /// ib_write_bw: average bandwidth, MB/s (10^6 bytes per second).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bw_average_mbps: Option<f64>,
    /// ib_write_lat: typical (median) latency, microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lat_typical_us: Option<f64>,
    /// ib_write_lat: 99th percentile, microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lat_p99_us: Option<f64>,
}

/// The result rows of an ib_write_bw or ib_write_lat client's output: the numeric lines
/// after the `#bytes` header (bw: bytes, iterations, peak, average MB/s, rate; lat: bytes,
/// iterations, min, max, typical, average, stdev, 99%, 99.9% in us).
pub fn parse_perftest(tool: PerfTool, output: &str) -> Vec<PerfRow> {
    let mut rows = Vec::new();
    let mut in_table = false;
    for line in output.lines() {
        let t = line.trim();
        if t.starts_with("#bytes") {
            in_table = true;
            continue;
        }
        if !in_table {
            continue;
        }
        let f: Vec<f64> = t
            .split_whitespace()
            .map_while(|x| x.parse::<f64>().ok())
            .collect();
        let row = match (tool, f.as_slice()) {
            (PerfTool::IbWriteBw, [b, n, _peak, avg, ..]) => PerfRow {
                bytes: *b as u64,
                iterations: *n as u64,
                bw_average_mbps: Some(*avg),
                lat_typical_us: None,
                lat_p99_us: None,
            },
            (PerfTool::IbWriteLat, [b, n, _min, _max, typical, _avg, _sd, p99, ..]) => PerfRow {
                bytes: *b as u64,
                iterations: *n as u64,
                bw_average_mbps: None,
                lat_typical_us: Some(*typical),
                lat_p99_us: Some(*p99),
            },
            _ => {
                if t.starts_with('-') || t.is_empty() {
                    continue;
                }
                in_table = false;
                continue;
            }
        };
        rows.push(row);
    }
    rows
}

/// The IPv4 addresses `ip -o addr show` lists for `netdev`.
pub fn netdev_addresses(ip_o_addr: &str, netdev: &str) -> Vec<std::net::IpAddr> {
    ip_o_addr
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f.as_slice() {
                [_, dev, "inet", cidr, ..] if *dev == netdev => {
                    cidr.split('/').next()?.parse().ok()
                }
                _ => None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perftest_rows_are_read_from_both_tools() {
        let bw = "---\n #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n 65536      200              35.10              34.87  \t\t   0.000558\n---------\n";
        let r = parse_perftest(PerfTool::IbWriteBw, bw);
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].bytes, r[0].iterations), (65536, 200));
        assert_eq!(r[0].bw_average_mbps, Some(34.87));
        let lat = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n 8       500          41.20          980.11       60.05                65.31        20.10   150.77                  900.00 \n---\n";
        let r = parse_perftest(PerfTool::IbWriteLat, lat);
        assert_eq!(r.len(), 1);
        assert_eq!(
            (r[0].lat_typical_us, r[0].lat_p99_us),
            (Some(60.05), Some(150.77))
        );
        assert!(
            parse_perftest(PerfTool::IbWriteBw, "Couldn't connect to 10.0.0.1:18900").is_empty()
        );
    }

    #[test]
    fn perftest_requests_are_checked_before_anything_runs() {
        let ok = PerftestRequest {
            tool: PerfTool::IbWriteBw,
            device: "rxe0".into(),
            port: 1,
            gid_index: Some(1),
            size: 4096,
            iterations: 100,
            tcp_port: 18900,
            server: Some("10.0.0.2".parse().unwrap()),
        };
        assert_eq!(
            ok.args().unwrap().join(" "),
            "-d rxe0 -i 1 -F -s 4096 -n 100 -p 18900 -x 1 10.0.0.2"
        );
        for (bad, want) in [
            (
                PerftestRequest {
                    device: "rxe0; rm -rf /".into(),
                    ..ok.clone()
                },
                "device",
            ),
            (
                PerftestRequest {
                    port: 0,
                    ..ok.clone()
                },
                "port",
            ),
            (
                PerftestRequest {
                    size: 0,
                    ..ok.clone()
                },
                "size",
            ),
            (
                PerftestRequest {
                    size: 1 << 40,
                    ..ok.clone()
                },
                "size",
            ),
            (
                PerftestRequest {
                    iterations: 0,
                    ..ok.clone()
                },
                "iterations",
            ),
            (
                PerftestRequest {
                    tcp_port: 22,
                    ..ok.clone()
                },
                "tcp_port",
            ),
        ] {
            let e = bad.args().unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    #[test]
    fn netdev_addresses_come_from_ip_o_addr() {
        let out = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n2: eth0    inet 10.77.0.1/24 scope global eth0\\ x\n2: eth0    inet6 fe80::1/64 scope link\n";
        assert_eq!(
            netdev_addresses(out, "eth0"),
            vec!["10.77.0.1".parse::<std::net::IpAddr>().unwrap()]
        );
        assert!(netdev_addresses(out, "ib0").is_empty());
    }
}
