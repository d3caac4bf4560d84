//! perftest's `ib_write_bw` / `ib_write_lat` on the device the rdma engines use, in this run:
//! the physical baseline of `bench transfer --transport rdma`. The server runs on this host
//! (both ends on one device, e.g. in the soft-RoCE VM of `ci/softroce.sh`), or on the far node
//! of a two-node run, started there by `omnirig bench peer --mode rdma-engine` on request
//! ([`Server::Remote`]), so the baseline crosses the same link as the engine.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use omnirig_transports::RdmaConfig;
use omnirig_transports::transport::rdma::link::RdmaNode;
use serde::{Deserialize, Serialize};

use super::remote::PeerControl;

/// Device and GID index the engines' default rdma config selects (perftest must use the
/// same ones).
pub struct Device {
    name: String,
    gid_index: u32,
}

/// What perftest measured: `ib_write_bw`'s average MiB/s per size, `ib_write_lat`'s
/// t_typical (half a ping-pong round trip) in microseconds per size.
#[derive(Debug, Default, Clone)]
pub struct Figures {
    pub bw_mib_s: Vec<(u64, f64)>,
    pub lat_half_rtt_us: Vec<(u64, f64)>,
}

impl Figures {
    /// Per size, `pick` over the runs' figures (runs that lack a size are left out).
    fn combine(runs: &[Figures], pick: impl Fn(&mut Vec<f64>) -> f64) -> Figures {
        let per = |get: fn(&Figures) -> &Vec<(u64, f64)>| -> Vec<(u64, f64)> {
            let Some(first) = runs.first() else {
                return Vec::new();
            };
            get(first)
                .iter()
                .map(|&(size, _)| {
                    let mut v: Vec<f64> = runs
                        .iter()
                        .filter_map(|f| get(f).iter().find(|(s, _)| *s == size))
                        .map(|x| x.1)
                        .collect();
                    (size, pick(&mut v))
                })
                .collect()
        };
        Figures {
            bw_mib_s: per(|f| &f.bw_mib_s),
            lat_half_rtt_us: per(|f| &f.lat_half_rtt_us),
        }
    }

    /// The median figure per size over the runs (of an even count, the mean of the
    /// middle two): perftest's own run-to-run spread under TCG is 2x, so one engine run
    /// against the best of several perftest runs reads low by chance alone.
    pub fn median(runs: &[Figures]) -> Figures {
        Self::combine(runs, |v| crate::bench::median(v))
    }

    /// The best figure per size over the runs: the most bandwidth, the least latency.
    pub fn best_of(runs: &[Figures]) -> Figures {
        let mut f = Self::combine(runs, |v| v.iter().copied().fold(f64::MIN, f64::max));
        f.lat_half_rtt_us =
            Self::combine(runs, |v| v.iter().copied().fold(f64::MAX, f64::min)).lat_half_rtt_us;
        f
    }

    pub fn bw(&self, size: u64) -> Option<f64> {
        self.bw_mib_s.iter().find(|(s, _)| *s == size).map(|x| x.1)
    }

    pub fn lat(&self, size: u64) -> Option<f64> {
        self.lat_half_rtt_us
            .iter()
            .find(|(s, _)| *s == size)
            .map(|x| x.1)
    }
}

/// Why perftest cannot run here (binaries or device missing), or the device to run it on: the
/// one the engines' `cfg` selects.
pub fn device(cfg: &RdmaConfig) -> Result<Device, String> {
    for tool in ["ib_write_bw", "ib_write_lat"] {
        let found = Command::new(tool)
            .arg("--help")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Err(format!(
                "{tool} not found (install perftest; ci/rdma-bench.sh runs this in the \
                 soft-RoCE VM)"
            ));
        }
    }
    let node = RdmaNode::open(cfg.clone()).map_err(|e| e.to_string())?;
    Ok(Device {
        name: node.device().name().to_string(),
        gid_index: node.gid_index(),
    })
}

/// Which perftest tool a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tool {
    IbWriteBw,
    IbWriteLat,
}

impl Tool {
    pub fn name(self) -> &'static str {
        match self {
            Tool::IbWriteBw => "ib_write_bw",
            Tool::IbWriteLat => "ib_write_lat",
        }
    }

    /// The column of the result line that holds the figure (`BW average[MB/sec]`,
    /// `t_typical[usec]`).
    fn column(self) -> usize {
        match self {
            Tool::IbWriteBw => 3,
            Tool::IbWriteLat => 4,
        }
    }
}

/// One perftest run's parameters, which server and client must share: both sides build their
/// arguments from it (a remote peer receives it, checks it and starts its server).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerRequest {
    pub tool: Tool,
    /// Message size in bytes, 1 ..= 1 GiB.
    pub size: u64,
    /// `ib_write_bw`: seconds to run (`-D`), 1 ..= 60.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<u64>,
    /// `ib_write_lat`: iterations (`-n`), 1 ..= 1,000,000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iters: Option<u64>,
}

impl ServerRequest {
    /// The tool's arguments besides device, GID and port; refuses what is out of bounds.
    pub fn args(&self) -> anyhow::Result<Vec<String>> {
        if !(1..=1 << 30).contains(&self.size) {
            bail!("perftest size {} is not in 1..=1073741824", self.size);
        }
        let mut a = vec!["-s".to_string(), self.size.to_string()];
        match (self.tool, self.seconds, self.iters) {
            (Tool::IbWriteBw, Some(s), None) if (1..=60).contains(&s) => {
                a.extend(["-D".into(), s.to_string()])
            }
            (Tool::IbWriteLat, None, Some(n)) if (1..=1_000_000).contains(&n) => {
                a.extend(["-n".into(), n.to_string()])
            }
            (t, s, n) => bail!(
                "{}: seconds {s:?} / iterations {n:?} not allowed (ib_write_bw takes seconds \
                 1..=60, ib_write_lat iterations 1..=1000000)",
                t.name()
            ),
        }
        Ok(a)
    }
}

/// Where a run's perftest server runs.
pub enum Server<'a> {
    /// On this host, on the same device as the client.
    Local,
    /// On the far node, started by its bench peer.
    Remote(&'a mut PeerControl),
}

/// `ib_write_bw` for each of `bw_sizes` (`seconds` each) and `ib_write_lat` for each of
/// `lat_sizes`, client on `dev`, server as `server` says, one after the other.
pub fn measure(
    dev: &Device,
    server: &mut Server,
    bw_sizes: &[u64],
    lat_sizes: &[u64],
    seconds: u64,
) -> anyhow::Result<Figures> {
    let mut f = Figures::default();
    for &size in bw_sizes {
        let req = ServerRequest {
            tool: Tool::IbWriteBw,
            size,
            seconds: Some(seconds.clamp(1, 60)),
            iters: None,
        };
        f.bw_mib_s.push((size, figure(dev, server, &req)?));
    }
    for &size in lat_sizes {
        let req = ServerRequest {
            tool: Tool::IbWriteLat,
            size,
            seconds: None,
            iters: Some(2000),
        };
        f.lat_half_rtt_us.push((size, figure(dev, server, &req)?));
    }
    Ok(f)
}

/// One perftest figure; a run that reports none (under TCG on a loaded host,
/// `ib_write_bw -D` now and then counts 0 iterations, sometimes several times in a row) is
/// repeated, at most four times.
fn figure(dev: &Device, server: &mut Server, req: &ServerRequest) -> anyhow::Result<f64> {
    let mut last = None;
    for _ in 0..5 {
        match run(dev, server, req).and_then(|line| column(&line, req)) {
            Ok(v) => return Ok(v),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("five tries"))
}

/// The tool's figure in its result line, which must be for the request's size.
fn column(line: &str, req: &ServerRequest) -> anyhow::Result<f64> {
    let (tool, index) = (req.tool.name(), req.tool.column());
    let cols: Vec<&str> = line.split_whitespace().collect();
    if cols.first().and_then(|c| c.parse::<u64>().ok()) != Some(req.size) {
        bail!("{tool}: result line {line:?} is not for {} bytes", req.size);
    }
    cols.get(index)
        .and_then(|c| c.parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v > 0.0)
        .with_context(|| format!("{tool}: no figure in column {index} of {line:?}"))
}

/// `req`'s tool on `dev` (device, GID index, perftest's own handshake on `port`).
fn command(dev: &Device, req: &ServerRequest, port: u16) -> anyhow::Result<Command> {
    let mut c = Command::new(req.tool.name());
    c.args(["-d", &dev.name, "-x", &dev.gid_index.to_string(), "-F"])
        .args(["-p", &port.to_string()])
        .args(req.args()?);
    Ok(c)
}

/// Starts `req`'s server on the device `cfg` selects, on a free port (a remote peer's side);
/// returns it and the port.
pub fn start_server(req: &ServerRequest, cfg: &RdmaConfig) -> anyhow::Result<(Child, u16)> {
    // what arrived is checked before anything is looked up or started
    req.args()?;
    let dev = device(cfg).map_err(anyhow::Error::msg)?;
    let port = TcpListener::bind("0.0.0.0:0")?.local_addr()?.port();
    let child = command(&dev, req, port)?
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("start {} server", req.tool.name()))?;
    Ok((child, port))
}

/// Runs `req`'s server (here in the background, or on the far node) and its client against
/// it (perftest's own handshake over TCP; the data moves over the device), and returns the
/// client's result line (the one under `#bytes`).
fn run(dev: &Device, server: &mut Server, req: &ServerRequest) -> anyhow::Result<String> {
    let tool = req.tool.name();
    let (mut local, host, port) = match server {
        Server::Local => {
            let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let child = command(dev, req, port)?
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .with_context(|| format!("start {tool} server"))?;
            (Some(child), "127.0.0.1".to_string(), port)
        }
        Server::Remote(peer) => {
            let port = peer.start_perftest(req)?;
            (None, peer.peer_ip()?.to_string(), port)
        }
    };
    let mut last = String::new();
    let mut line = None;
    // the server needs a moment to listen; the client says so when it came too early
    for _ in 0..60 {
        std::thread::sleep(Duration::from_millis(300));
        let out = command(dev, req, port)?
            .arg(&host)
            .output()
            .with_context(|| format!("run {tool} client"))?;
        last = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if out.status.success() {
            line = last
                .lines()
                .skip_while(|l| !l.trim_start().starts_with("#bytes"))
                .nth(1)
                .map(|l| l.trim().to_string());
            break;
        }
        if !last.contains("Couldn't connect") {
            break;
        }
    }
    if let Some(server) = local.as_mut() {
        if line.is_none() {
            let _ = server.kill();
        }
        let _ = server.wait();
    }
    line.with_context(|| format!("{tool} {:?} failed: {last}", req.args()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer builds the server's arguments from the request alone, and refuses bounds a
    /// benchmark never asks for.
    #[test]
    fn server_requests_become_bounded_arguments() {
        let bw = ServerRequest {
            tool: Tool::IbWriteBw,
            size: 65536,
            seconds: Some(2),
            iters: None,
        };
        assert_eq!(bw.args().unwrap(), ["-s", "65536", "-D", "2"]);
        let lat = ServerRequest {
            tool: Tool::IbWriteLat,
            size: 8,
            seconds: None,
            iters: Some(2000),
        };
        assert_eq!(lat.args().unwrap(), ["-s", "8", "-n", "2000"]);
        let e = ServerRequest {
            size: 0,
            ..lat.clone()
        }
        .args()
        .unwrap_err();
        assert!(e.to_string().contains("size 0"), "{e}");
        let e = ServerRequest {
            seconds: Some(3600),
            ..bw.clone()
        }
        .args()
        .unwrap_err();
        assert!(e.to_string().contains("ib_write_bw"), "{e}");
        let e = ServerRequest {
            seconds: Some(2),
            ..lat
        }
        .args()
        .unwrap_err();
        assert!(e.to_string().contains("ib_write_lat"), "{e}");
        // the result line's figure is the tool's column, for the request's size only
        assert_eq!(column(" 65536 1000 210.5 200.25 3.2", &bw).unwrap(), 200.25);
        assert!(column(" 8 1000 210.5 200.25 3.2", &bw).is_err());
    }
}
