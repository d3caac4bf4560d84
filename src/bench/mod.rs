//! Benchmark suites and what they share: sizes, latency statistics, the JSON result shape
//! (`rows` with `omnirig`, `baseline`, `ratio`), and the printed table.

pub mod cpus;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod hop;
pub mod peer;
#[cfg(feature = "rdma")]
pub mod perftest;
pub mod pipeline;
#[cfg(feature = "rdma")]
pub mod remote;
pub mod transfer;

use std::time::Duration;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

/// Parses "4K,64K,1M,16M" (binary multiples; a bare number is bytes).
/// One latency the Python baseline reported (`lat_us[]`): a number of microseconds in
/// 0..=1 h, or an error saying what came instead (it crosses a process boundary; a negative
/// or huge value used to panic in the Duration conversion, a non-number became 0).
pub fn baseline_latency(x: &serde_json::Value) -> anyhow::Result<std::time::Duration> {
    let us = x
        .as_f64()
        .filter(|us| us.is_finite() && (0.0..=3.6e9).contains(us))
        .with_context(|| format!("the baseline reported latency {x} us (expected 0..=3.6e9)"))?;
    Ok(std::time::Duration::from_secs_f64(us / 1e6))
}

pub fn parse_sizes(s: &str) -> anyhow::Result<Vec<u64>> {
    s.split(',')
        .map(|part| {
            let part = part.trim();
            let (num, mult) = match part.char_indices().last() {
                Some((i, 'K' | 'k')) => (&part[..i], 1u64 << 10),
                Some((i, 'M' | 'm')) => (&part[..i], 1 << 20),
                Some((i, 'G' | 'g')) => (&part[..i], 1 << 30),
                _ => (part, 1),
            };
            let n: u64 = num
                .parse()
                .with_context(|| format!("size {part:?}: expected e.g. 4K, 1M, 4096"))?;
            let v = n
                .checked_mul(mult)
                .with_context(|| format!("size {part:?} overflows"))?;
            if v == 0 {
                bail!("size {part:?} is zero");
            }
            Ok(v)
        })
        .collect()
}

pub fn human_size(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{}G", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}M", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}K", n >> 10),
        n => format!("{n}"),
    }
}

/// The median of `v` (the mean of the middle two for an even count; 0 when empty).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Latency samples of one measured series.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    pub bytes_per_op: u64,
    pub lat: Vec<Duration>,
}

impl Samples {
    pub fn new(bytes_per_op: u64) -> Self {
        Self {
            bytes_per_op,
            lat: Vec::new(),
        }
    }

    pub fn push(&mut self, d: Duration) {
        self.lat.push(d);
    }

    fn sorted_us(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self.lat.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v
    }

    /// Nearest-rank percentile, in microseconds.
    pub fn percentile_us(&self, p: f64) -> f64 {
        let v = self.sorted_us();
        if v.is_empty() {
            return f64::NAN;
        }
        let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
        v[rank.min(v.len()) - 1]
    }

    /// Bytes moved over time spent moving them (one operation in flight).
    pub fn gbps(&self) -> f64 {
        let total: f64 = self.lat.iter().map(|d| d.as_secs_f64()).sum();
        (self.bytes_per_op as f64 * self.lat.len() as f64) / total / 1e9
    }

    pub fn measured(&self) -> Measured {
        Measured {
            gbps: self.gbps(),
            p50_us: self.percentile_us(50.0),
            p99_us: self.percentile_us(99.0),
            samples_us: None,
        }
    }

    /// Every sample in microseconds, in the order taken (for CDF plots).
    pub fn samples_us(&self) -> Vec<f64> {
        self.lat.iter().map(|d| d.as_secs_f64() * 1e6).collect()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Measured {
    pub gbps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Every latency sample (us), for CDF plots (hop suite).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_us: Option<Vec<f64>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Baseline {
    pub name: String,
    pub gbps: f64,
    pub p50_us: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p99_us: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_us: Option<Vec<f64>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Row {
    pub op: String,
    pub size: u64,
    pub omnirig: Measured,
    pub baseline: Baseline,
    /// omnirig GB/s over baseline GB/s.
    pub ratio: f64,
    /// Hop and pipeline suites: the scenario's request (golden case) the row measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub case: Option<String>,
    /// Hop suite: which hop (ec, kv, thinker-talker, talker-code2wav).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hop: Option<String>,
    /// Pipeline suite: requests in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<usize>,
    /// Pipeline suite: requests per second (omnirig, baseline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throughput_rps: Option<(f64, f64)>,
    /// Hop suite: the same bytes through a plain TCP socket between the same two CPUs, one
    /// way plus a 1-byte ack, measured in the same run: the floor for any tcp handoff.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub floor: Option<Baseline>,
    /// rdma: the best of the perftest runs (`baseline` is their median), and the ratio
    /// against it: noise between perftest runs lowers this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best: Option<(Baseline, f64)>,
    /// tcp writes: CPU time both engines' processes spent per byte they moved over the
    /// timed writes, not their warm-up (the sender's and the receiver's together, busy-polls
    /// included), Linux only. `simulate --calibrate-cpu` records a side's share of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_ns_per_byte: Option<f64>,
    /// tcp writes: that CPU time over the wall time it was spent in (the timed writes,
    /// pauses included): the cores both processes kept busy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_cores: Option<f64>,
}

impl Row {
    pub fn new(op: &str, size: u64, ours: &Samples, base_name: &str, base: &Samples) -> Self {
        let b = base.measured();
        let omnirig = ours.measured();
        Row {
            op: op.into(),
            size,
            ratio: omnirig.gbps / b.gbps,
            omnirig,
            baseline: Baseline {
                name: base_name.into(),
                gbps: b.gbps,
                p50_us: b.p50_us,
                p99_us: Some(b.p99_us),
                samples_us: None,
            },
            case: None,
            hop: None,
            concurrency: None,
            throughput_rps: None,
            floor: None,
            best: None,
            cpu_ns_per_byte: None,
            cpu_cores: None,
        }
    }

    /// Keeps every sample of both sides in the JSON (for CDF plots).
    pub fn attach_samples(&mut self, ours: &Samples, base: &Samples) {
        self.omnirig.samples_us = Some(ours.samples_us());
        self.baseline.samples_us = Some(base.samples_us());
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    pub suite: String,
    pub transport: String,
    pub rows: Vec<Row>,
    /// Where the figures were measured (reports name the machine in titles); absent in
    /// results written before the field existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<Machine>,
}

/// The host a benchmark ran on, as reports name it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Machine {
    pub host: String,
    /// CPUs the host has online.
    pub cpus: usize,
    pub cpu_model: String,
    pub kernel: String,
}

impl Machine {
    /// This host, read from /proc (fields it cannot read stay empty).
    pub fn this() -> Self {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        };
        let cpu_model = read("/proc/cpuinfo")
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default();
        // The host's CPUs, not this process's: a bench pins itself before it reports.
        let online = read("/proc/cpuinfo")
            .lines()
            .filter(|l| l.starts_with("processor"))
            .count();
        Machine {
            host: read("/proc/sys/kernel/hostname"),
            cpus: if online > 0 {
                online
            } else {
                std::thread::available_parallelism().map_or(0, |n| n.get())
            },
            cpu_model,
            kernel: read("/proc/sys/kernel/osrelease"),
        }
    }

    /// "host (2 CPUs, model)" for titles.
    pub fn label(&self) -> String {
        let mut s = if self.host.is_empty() {
            "unnamed host".to_string()
        } else {
            self.host.clone()
        };
        s += &format!(" ({} CPUs", self.cpus);
        if !self.cpu_model.is_empty() {
            s += &format!(", {}", self.cpu_model);
        }
        s + ")"
    }
}

impl Results {
    pub fn table(&self) -> String {
        if self
            .rows
            .iter()
            .any(|r| r.case.is_some() || r.concurrency.is_some())
        {
            return self.case_table();
        }
        let mut s = format!(
            "{:<6} {:>6} {:>10} {:>10} {:>10}   {:<12} {:>10} {:>10} {:>7}\n",
            "op", "size", "GB/s", "p50 us", "p99 us", "baseline", "GB/s", "p50 us", "ratio"
        );
        for r in &self.rows {
            s += &format!(
                "{:<6} {:>6} {:>10.3} {:>10.1} {:>10.1}   {:<12} {:>10.3} {:>10.1} {:>7.3}\n",
                r.op,
                human_size(r.size),
                r.omnirig.gbps,
                r.omnirig.p50_us,
                r.omnirig.p99_us,
                r.baseline.name,
                r.baseline.gbps,
                r.baseline.p50_us,
                r.ratio
            );
        }
        for r in &self.rows {
            if let (Some(per), Some(cores)) = (r.cpu_ns_per_byte, r.cpu_cores) {
                s += &format!(
                    "{} {}: both engines' processes spent {per:.3} ns of CPU a byte, \
                     {cores:.2} cores busy\n",
                    r.op,
                    human_size(r.size),
                );
            }
        }
        s
    }
}

impl Results {
    /// The hop and pipeline suites' table: one line per case (or concurrency) and baseline.
    fn case_table(&self) -> String {
        let mut s = format!(
            "{:<20} {:<16} {:>8} {:>11} {:>11}   {:<12} {:>11} {:>11} {:>8} {:>8}\n",
            "op",
            "case",
            "size",
            "p50 us",
            "p99 us",
            "baseline",
            "p50 us",
            "p99 us",
            "ratio",
            "p50 x"
        );
        for r in &self.rows {
            let case = match (r.concurrency, &r.case) {
                (Some(c), _) => format!("c={c}"),
                (None, Some(c)) => c.clone(),
                _ => String::new(),
            };
            s += &format!(
                "{:<20} {:<16} {:>8} {:>11.1} {:>11.1}   {:<12} {:>11.1} {:>11.1} {:>7.2}x {:>7.2}x\n",
                r.op,
                case,
                human_size_approx(r.size),
                r.omnirig.p50_us,
                r.omnirig.p99_us,
                r.baseline.name,
                r.baseline.p50_us,
                r.baseline.p99_us.unwrap_or(f64::NAN),
                r.ratio,
                r.baseline.p50_us / r.omnirig.p50_us
            );
            if let Some((ours, base)) = r.throughput_rps {
                s.pop();
                s += &format!("   {ours:.1} vs {base:.1} req/s\n");
            }
        }
        s
    }
}

impl Results {
    /// The results as a markdown table (what README-style pages show): written from the JSON
    /// a bench run produced, never typed by hand.
    pub fn markdown(&self) -> String {
        let cases = self
            .rows
            .iter()
            .any(|r| r.case.is_some() || r.concurrency.is_some());
        let mut s = format!(
            "### {} over {}

",
            self.suite, self.transport
        );
        if !cases {
            s += "| op | size | omnirig GB/s | p50 us | p99 us | baseline | baseline GB/s | baseline p50 us | ratio |\n";
            s += "|---|---:|---:|---:|---:|---|---:|---:|---:|\n";
            for r in &self.rows {
                s += &format!(
                    "| {} | {} | {:.3} | {:.1} | {:.1} | {} | {:.3} | {:.1} | {:.2}x |\n",
                    r.op,
                    human_size(r.size),
                    r.omnirig.gbps,
                    r.omnirig.p50_us,
                    r.omnirig.p99_us,
                    r.baseline.name,
                    r.baseline.gbps,
                    r.baseline.p50_us,
                    r.ratio
                );
            }
            return s;
        }
        s += "| op | case | size | omnirig p50 us | p99 us | baseline | baseline p50 us | p99 us | p50 x | req/s (omnirig vs baseline) |\n";
        s += "|---|---|---:|---:|---:|---|---:|---:|---:|---|\n";
        for r in &self.rows {
            let case = match (r.concurrency, &r.case) {
                (Some(c), _) => format!("c={c}"),
                (None, Some(c)) => c.clone(),
                _ => String::new(),
            };
            let rps = r
                .throughput_rps
                .map(|(a, b)| format!("{a:.1} vs {b:.1}"))
                .unwrap_or_default();
            let p99 = r
                .baseline
                .p99_us
                .map(|v| format!("{v:.1}"))
                .unwrap_or_default();
            s += &format!(
                "| {} | {case} | {} | {:.1} | {:.1} | {} | {:.1} | {p99} | {:.2}x | {rps} |\n",
                r.op,
                human_size_approx(r.size),
                r.omnirig.p50_us,
                r.omnirig.p99_us,
                r.baseline.name,
                r.baseline.p50_us,
                r.baseline.p50_us / r.omnirig.p50_us,
            );
        }
        s
    }
}

/// Sizes that are not powers of two, shortened (3.2K, 145.3M).
pub fn human_size_approx(n: u64) -> String {
    let f = n as f64;
    match n {
        n if n >= 1 << 30 => format!("{:.1}G", f / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1}M", f / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1}K", f / 1024.0),
        n => format!("{n}"),
    }
}

/// How many operations to time for a size: enough bytes for a stable rate, enough samples
/// for a p99, bounded so the largest sizes finish.
pub fn iterations(size: u64, budget_bytes: u64, min: usize, max: usize) -> usize {
    ((budget_bytes / size.max(1)) as usize).clamp(min, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 10: a negative or huge latency from the baseline process panicked.
    #[test]
    fn baseline_latencies_are_checked() {
        use serde_json::json;
        assert_eq!(
            baseline_latency(&json!(1500.0)).unwrap(),
            Duration::from_micros(1500)
        );
        for bad in [json!(-1.0), json!(1e300), json!("12"), json!(null)] {
            let e = baseline_latency(&bad).unwrap_err().to_string();
            assert!(e.contains("baseline reported latency"), "{e}");
        }
    }

    #[test]
    fn sizes_parse_with_suffixes_and_refuse_nonsense() {
        assert_eq!(
            parse_sizes("4K,64K,1M,16M,1G,7").unwrap(),
            vec![4096, 65536, 1 << 20, 16 << 20, 1 << 30, 7]
        );
        assert!(parse_sizes("0").is_err());
        assert!(parse_sizes("4X").is_err());
        assert!(parse_sizes("99999999999999999G").is_err());
        assert_eq!(human_size(256 << 20), "256M");
        assert_eq!(human_size(1000), "1000");
    }

    #[test]
    fn markdown_tables_come_from_the_rows() {
        let mut s = Samples::new(1 << 20);
        for us in [100, 200, 300] {
            s.push(Duration::from_micros(us));
        }
        let mut b = Samples::new(1 << 20);
        for us in [150, 250, 350] {
            b.push(Duration::from_micros(us));
        }
        let row = Row::new("write", 1 << 20, &s, "memcpy", &b);
        let t = Results {
            suite: "transfer".into(),
            transport: "shm".into(),
            rows: vec![row.clone()],
            machine: None,
        }
        .markdown();
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "### transfer over shm");
        assert_eq!(lines.len(), 5, "{t}");
        let cells: Vec<&str> = lines[4].split('|').map(str::trim).collect();
        assert_eq!(
            &cells[1..6],
            [
                "write",
                "1M",
                &format!("{:.3}", row.omnirig.gbps)[..],
                "200.0",
                "300.0"
            ]
        );
        assert_eq!(cells[6], "memcpy");
        assert_eq!(cells[9], format!("{:.2}x", row.ratio));
        let mut hop = row;
        hop.case = Some("text_short".into());
        let t = Results {
            suite: "hop".into(),
            transport: "tcp".into(),
            rows: vec![hop],
            machine: None,
        }
        .markdown();
        let last = t.lines().last().unwrap();
        assert!(
            last.starts_with(
                "| write | text_short | 1.0M | 200.0 | 300.0 | memcpy | 250.0 | 350.0 | 1.25x |"
            ),
            "{last}"
        );
    }

    #[test]
    fn percentiles_and_rate() {
        let mut s = Samples::new(1000);
        for us in 1..=100 {
            s.push(Duration::from_micros(us));
        }
        assert_eq!(s.percentile_us(50.0), 50.0);
        assert_eq!(s.percentile_us(99.0), 99.0);
        assert_eq!(s.percentile_us(100.0), 100.0);
        // 100 ops x 1000 B over 5050 us.
        assert!((s.gbps() - 100_000.0 / 5050e-6 / 1e9).abs() < 1e-12);
    }
}
