//! The run report, written as `report.json`.
//!
//! Field names are stable; later tools (plots, fault reports) read them.
//!
//! - `report_version` (1), `scenario`, `mode` (`in_process` | `processes` | `cluster`),
//!   `transports` (payload kind -> transport), `concurrency`, `wall_s`.
//! - `summary`: `requests`, `ok`, `failed`, `pools_clean` (every stage's pools,
//!   KV blocks, encoder-cache entries and engine grants/batches/tasks/leases
//!   back to zero after the run), `e2e_p50_ms`, `e2e_p99_ms`, `e2e_mean_ms`,
//!   `throughput_rps` (requests / wall time), `moved_bytes`, `reused_bytes`.
//! - `hops[]`: per payload kind: `hop`, `transport`, `requests`, `moved_bytes`,
//!   `reused_bytes`, `transfer_ms_p50`, `transfer_ms_p99`, `gbps` (moved bytes /
//!   summed transfer time, 1 GB/s = 1e9 B/s), `handoff_ms_p50`, `handoff_ms_p99`,
//!   `phases_ms_p50`, `phases_ms_p99` (each an object keyed `reserve`, `transfer`, `fence`,
//!   `verify`, `ack`: the per-phase percentile, see [`HandoffPhases`]), `overhead_ms_p50` and
//!   `overhead_share_p50` (per handoff that moved bytes: handoff minus engine transfer minus
//!   verify, p50 in ms and p50 as a share of that handoff's transfer).
//! - `requests[]`: `id`, `label`, `ok`, `error` (the first failing stage's
//!   error in pipeline order, naming hop, request, tensor and cause), `errors`
//!   (every failing stage's error, `stage: error`), `e2e_ms`,
//!   `hops[]` (`hop`, `bytes` planned, `moved_bytes`, `reused_bytes`,
//!   `tensors` verified, `requests` engine requests, `transfer_ms`, `gbps`,
//!   `handoff_ms`, `phases_ms`, `verified`), `stages[]` (each stage's [`StageOutcome`], with
//!   start offsets: `compute_start_ms`, `received.start_ms`, `sent.transfer_start_ms`).
//! - `stages[]`: each stage's [`StageUsage`] after the run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use omnirig_transports::{ErrorKind, FaultInjector};

use crate::error::{Cause, FailureKind, HarnessError, Result};
use crate::faults::{CompiledFaults, FaultTarget, fault_tag};
use crate::stage::{HandoffPhases, StageOutcome, StageUsage};

pub const REPORT_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub report_version: u32,
    pub scenario: String,
    pub mode: String,
    pub transports: BTreeMap<String, String>,
    pub concurrency: usize,
    pub wall_s: f64,
    pub summary: Summary,
    pub hops: Vec<HopSummary>,
    pub requests: Vec<RequestResult>,
    pub stages: Vec<StageUsage>,
    /// Present when the scenario injected faults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub faults: Option<FaultReport>,
}

/// A request's first error, classified for reports and assertions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub hop: Option<String>,
    pub tensor: Option<String>,
    /// The engine peer the failing transfer talked to, when the engine named one; otherwise
    /// the hop's producing stage.
    pub peer: Option<String>,
    /// `timed_out`, `peer_disconnected`, `unreachable`, `io`, `corrupt` (bytes or digest
    /// differ from what the producer made), `grant_refused` (revoked, unknown or out of
    /// bounds), `pool_exhausted`, `bad_sidecar`, `refused` (the consumer refused),
    /// `metadata`, or `other`.
    pub kind: FailureKind,
}

impl Failure {
    /// An error that carried no classification (a stage that did not report one).
    pub fn unclassified() -> Failure {
        Failure {
            hop: None,
            tensor: None,
            peer: None,
            kind: FailureKind::Other,
        }
    }

    /// Classifies an error from what it carries: the kind and peer its cause kept (the
    /// engine's error kind, or the check that failed), and the hop and tensor it names.
    /// Never from its wording.
    pub fn of(error: &HarnessError) -> Failure {
        let (hop, tensor) = match error {
            HarnessError::Handoff(h) => (Some(h.hop.clone()), h.tensor.clone()),
            _ => (None, None),
        };
        let peer = error.failure_peer().or_else(|| {
            hop.as_deref()
                .and_then(|h| omnirig_fixtures::PayloadKind::parse(h, "hop").ok())
                .map(|k| k.source().as_str().to_string())
        });
        Failure {
            hop,
            tensor,
            peer,
            kind: error.failure_kind(),
        }
    }
}

/// What the scenario's faults did: where they were aimed, where they struck, and how every
/// byte they held back (late writes, data behind early completions) ended when released
/// after the run. Every `late[].refused` must be true: the grant was revoked by then.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultReport {
    pub targets: Vec<FaultTarget>,
    pub fired: Vec<FiredFault>,
    pub late: Vec<LateBytes>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FiredFault {
    pub hop: String,
    pub request: String,
    pub tensor: String,
    pub kind: String,
    /// Byte of the engine request (tensor, or KV run) where it struck.
    pub at_byte: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LateBytes {
    pub hop: String,
    pub request: String,
    pub tensor: String,
    /// Refused by the receiver (grant revoked or gone): nothing landed.
    pub refused: bool,
    pub outcome: String,
}

impl FaultReport {
    pub(crate) async fn collect(
        faults: &CompiledFaults,
        injectors: &[(&'static str, Arc<FaultInjector>)],
    ) -> Self {
        let by_tag: BTreeMap<u64, &FaultTarget> = faults
            .targets
            .iter()
            .map(|t| (fault_tag(&t.request, &t.tensor), t))
            .collect();
        let name = |tag: u64| {
            by_tag
                .get(&tag)
                .map(|t| (t.request.clone(), t.tensor.clone()))
                .unwrap_or_else(|| (format!("tag {tag:#x}"), String::new()))
        };
        let mut out = FaultReport {
            targets: faults.targets.clone(),
            ..Default::default()
        };
        for (hop, inj) in injectors {
            for f in inj.fired() {
                let (request, tensor) = name(f.tag);
                out.fired.push(FiredFault {
                    hop: hop.to_string(),
                    request,
                    tensor,
                    kind: f.kind.name().into(),
                    at_byte: f.at_byte,
                });
            }
            for (tag, r) in inj.release_held().await {
                let (request, tensor) = name(tag);
                let refused = r.as_ref().is_err_and(|e| {
                    matches!(
                        e.kind(),
                        ErrorKind::GrantRevoked
                            | ErrorKind::UnknownGrant
                            | ErrorKind::PeerDisconnected
                    )
                });
                let outcome = match r {
                    Ok(()) => "landed".to_string(),
                    Err(e) => e.to_string(),
                };
                out.late.push(LateBytes {
                    hop: hop.to_string(),
                    request,
                    tensor,
                    refused,
                    outcome,
                });
            }
        }
        out
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub requests: usize,
    pub ok: usize,
    pub failed: usize,
    pub pools_clean: bool,
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    pub e2e_mean_ms: f64,
    pub throughput_rps: f64,
    pub moved_bytes: u64,
    pub reused_bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HopSummary {
    pub hop: String,
    pub transport: String,
    pub requests: usize,
    pub moved_bytes: u64,
    pub reused_bytes: u64,
    pub transfer_ms_p50: f64,
    pub transfer_ms_p99: f64,
    pub gbps: f64,
    pub handoff_ms_p50: f64,
    pub handoff_ms_p99: f64,
    /// Each phase's own percentile (so the p99s need not add up to `handoff_ms_p99`).
    #[serde(default)]
    pub phases_ms_p50: HandoffPhases,
    #[serde(default)]
    pub phases_ms_p99: HandoffPhases,
    /// Per handoff that moved bytes: what was neither its engine transfer nor its
    /// verification (`handoff_ms - transfer_ms - phases_ms.verify`), p50 over handoffs, and
    /// the p50 of that as a share of the same handoff's transfer (issue 14's figure: taken per
    /// handoff, not as a ratio of p50s of different handoffs).
    #[serde(default)]
    pub overhead_ms_p50: f64,
    #[serde(default)]
    pub overhead_share_p50: f64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestResult {
    pub id: String,
    pub label: String,
    pub ok: bool,
    pub error: Option<String>,
    /// `error`, classified: which hop and tensor, and what kind of failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Failure>,
    /// Every failing stage's error, `stage: error`, pipeline order (consequences included).
    pub errors: Vec<String>,
    pub e2e_ms: f64,
    pub hops: Vec<HopResult>,
    pub stages: Vec<StageOutcome>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HopResult {
    pub hop: String,
    pub bytes: u64,
    pub moved_bytes: u64,
    pub reused_bytes: u64,
    pub tensors: usize,
    pub requests: usize,
    pub transfer_ms: f64,
    pub gbps: f64,
    pub handoff_ms: f64,
    /// `handoff_ms` split into phases, as the consumer saw them.
    #[serde(default)]
    pub phases_ms: HandoffPhases,
    /// The consumer verified every tensor of the hop (digest, bytes where cheap).
    pub verified: bool,
}

/// Nearest-rank percentile of `v` (sorted here); 0 for none.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

pub(crate) fn gbps(bytes: u64, ms: f64) -> f64 {
    if ms > 0.0 {
        bytes as f64 / (ms * 1e6)
    } else {
        0.0
    }
}

impl Report {
    /// Every request finished and every pool is back to zero.
    pub fn passed(&self) -> bool {
        self.summary.failed == 0 && self.summary.pools_clean
    }

    /// Fills `summary` and `hops` from `requests` and `stages`.
    pub fn summarise(&mut self) {
        let e2e: Vec<f64> = self.requests.iter().map(|r| r.e2e_ms).collect();
        let ok = self.requests.iter().filter(|r| r.ok).count();
        // transfer ms, handoff ms, moved, reused, count, phases, (overhead ms, share)
        type Acc = (
            Vec<f64>,
            Vec<f64>,
            u64,
            u64,
            usize,
            Vec<HandoffPhases>,
            (Vec<f64>, Vec<f64>),
        );
        let mut hops: BTreeMap<String, Acc> = BTreeMap::new();
        for r in &self.requests {
            for h in &r.hops {
                let e = hops.entry(h.hop.clone()).or_default();
                e.0.push(h.transfer_ms);
                e.1.push(h.handoff_ms);
                e.2 += h.moved_bytes;
                e.3 += h.reused_bytes;
                e.4 += 1;
                e.5.push(h.phases_ms);
                if h.moved_bytes > 0 && h.transfer_ms > 0.0 {
                    let over = h.handoff_ms - h.transfer_ms - h.phases_ms.verify;
                    e.6.0.push(over);
                    e.6.1.push(over / h.transfer_ms);
                }
            }
        }
        // Pipeline order, not alphabetical.
        let order = omnirig_fixtures::PayloadKind::ALL.map(|k| k.as_str());
        self.hops = order
            .iter()
            .filter_map(|k| hops.get(*k).map(|v| (k, v)))
            .map(|(k, (t, h, moved, reused, n, ph, over))| HopSummary {
                hop: k.to_string(),
                transport: self.transports.get(*k).cloned().unwrap_or_default(),
                requests: *n,
                moved_bytes: *moved,
                reused_bytes: *reused,
                transfer_ms_p50: percentile(t, 50.0),
                transfer_ms_p99: percentile(t, 99.0),
                gbps: gbps(*moved, t.iter().sum()),
                handoff_ms_p50: percentile(h, 50.0),
                handoff_ms_p99: percentile(h, 99.0),
                phases_ms_p50: HandoffPhases::percentile(ph, 50.0),
                phases_ms_p99: HandoffPhases::percentile(ph, 99.0),
                overhead_ms_p50: percentile(&over.0, 50.0),
                overhead_share_p50: percentile(&over.1, 50.0),
            })
            .collect();
        self.summary = Summary {
            requests: self.requests.len(),
            ok,
            failed: self.requests.len() - ok,
            pools_clean: self.stages.iter().all(StageUsage::is_clean),
            e2e_p50_ms: percentile(&e2e, 50.0),
            e2e_p99_ms: percentile(&e2e, 99.0),
            e2e_mean_ms: if e2e.is_empty() {
                0.0
            } else {
                e2e.iter().sum::<f64>() / e2e.len() as f64
            },
            throughput_rps: if self.wall_s > 0.0 {
                self.requests.len() as f64 / self.wall_s
            } else {
                0.0
            },
            moved_bytes: self.hops.iter().map(|h| h.moved_bytes).sum(),
            reused_bytes: self.hops.iter().map(|h| h.reused_bytes).sum(),
        };
    }

    /// Writes `dir/report.json` (creating `dir`); returns its path.
    /// Writes `dir/report.json` atomically: a temporary file next to it, synced, then renamed
    /// over it, so a full disk or a crash never leaves a truncated report. Errors name the path.
    pub fn write(&self, dir: &Path) -> Result<PathBuf> {
        let path = dir.join("report.json");
        let json = serde_json::to_string_pretty(self).map_err(std::io::Error::other)? + "\n";
        write_atomic(&path, json.as_bytes())?;
        Ok(path)
    }

    /// A short human summary.
    pub fn summary_text(&self) -> String {
        use std::fmt::Write;
        let s = &self.summary;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "scenario {} ({}, concurrency {}): {}/{} requests ok, pools {}",
            self.scenario,
            self.mode,
            self.concurrency,
            s.ok,
            s.requests,
            if s.pools_clean { "clean" } else { "NOT clean" }
        );
        let _ = writeln!(
            out,
            "end-to-end: p50 {:.1} ms, p99 {:.1} ms, {:.2} req/s over {:.2} s",
            s.e2e_p50_ms, s.e2e_p99_ms, s.throughput_rps, self.wall_s
        );
        for h in &self.hops {
            let _ = writeln!(
                out,
                "  {:<19} {:<8} {:>3} req  {:>10.1} MiB moved  {:>8.1} MiB reused  {:>6.2} GB/s  transfer p50 {:.2} ms",
                h.hop,
                h.transport,
                h.requests,
                h.moved_bytes as f64 / (1 << 20) as f64,
                h.reused_bytes as f64 / (1 << 20) as f64,
                h.gbps,
                h.transfer_ms_p50
            );
            let p = &h.phases_ms_p50;
            let _ = writeln!(
                out,
                "  {:<19} handoff p50 {:.2} ms: reserve {:.2}, reply wait {:.2} (engine transfer {:.2}), fence {:.2}, verify {:.2}, ack {:.2}",
                "",
                h.handoff_ms_p50,
                p.reserve,
                p.transfer,
                h.transfer_ms_p50,
                p.fence,
                p.verify,
                p.ack
            );
            if h.overhead_ms_p50 != 0.0 || h.overhead_share_p50 != 0.0 {
                let _ = writeln!(
                    out,
                    "  {:<19} neither transfer nor verify, per handoff: p50 {:.3} ms, {:.0}% of its transfer",
                    "",
                    h.overhead_ms_p50,
                    100.0 * h.overhead_share_p50
                );
            }
        }
        for r in self.requests.iter().filter(|r| !r.ok) {
            let _ = writeln!(
                out,
                "FAILED {}: {}",
                r.id,
                r.error.as_deref().unwrap_or("?")
            );
        }
        for st in &self.stages {
            if let Some(how) = &st.exited {
                let _ = writeln!(out, "stage {} exited before the end ({how})", st.stage);
            } else if st.unanswered {
                let _ = writeln!(out, "stage {} did not report its usage", st.stage);
            } else if !st.is_clean() {
                let _ = writeln!(out, "LEAK in {}: {:?}", st.stage, st);
            }
        }
        out
    }
}

/// Writes `path` through a temporary file in the same directory (synced, then renamed), so
/// readers see the old file or the whole new one. Errors name the path.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let named = |e: std::io::Error, what: &str, p: &Path| {
        std::io::Error::new(e.kind(), format!("{what} {}: {e}", p.display()))
    };
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(d) = dir {
        std::fs::create_dir_all(d).map_err(|e| named(e, "creating", d))?;
    }
    let name = path.file_name().map_or_else(
        || std::ffi::OsString::from("file"),
        std::ffi::OsStr::to_os_string,
    );
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(&name);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let result = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(|e| named(e, "creating", &tmp))?;
        f.write_all(bytes).map_err(|e| named(e, "writing", &tmp))?;
        f.sync_all().map_err(|e| named(e, "syncing", &tmp))?;
        std::fs::rename(&tmp, path).map_err(|e| named(e, "renaming over", path))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    /// The overhead is taken per handoff: each of three handoffs spends 5% of its own transfer
    /// outside transfer and verify, while the hop's p50s of handoff, transfer and verify would
    /// make it (5.2 - 1 - 0) / 1 = 420%; a handoff that moved nothing (a cache hit) does not
    /// count.
    #[test]
    fn overhead_is_per_handoff_not_a_ratio_of_p50s() {
        let hop = |handoff: f64, transfer: f64, verify: f64, moved: u64| HopResult {
            hop: "encoder_embeddings".into(),
            moved_bytes: moved,
            transfer_ms: transfer,
            handoff_ms: handoff,
            phases_ms: HandoffPhases {
                verify,
                ..Default::default()
            },
            ..Default::default()
        };
        let req = |h: HopResult| RequestResult {
            ok: true,
            hops: vec![h],
            ..Default::default()
        };
        let mut r = Report {
            report_version: 1,
            scenario: "t".into(),
            mode: "in_process".into(),
            transports: BTreeMap::new(),
            concurrency: 1,
            wall_s: 1.0,
            summary: Summary::default(),
            hops: Vec::new(),
            requests: vec![
                req(hop(10.5, 10.0, 0.0, 1)), // 0.5 ms, 5%
                req(hop(5.2, 4.0, 1.0, 1)),   // 0.2 ms, 5%
                req(hop(2.05, 1.0, 1.0, 1)),  // 0.05 ms, 5%
                req(hop(50.0, 0.0, 0.0, 0)),  // moved nothing
            ],
            stages: Vec::new(),
            faults: None,
        };
        r.summarise();
        let h = &r.hops[0];
        assert!((h.overhead_share_p50 - 0.05).abs() < 1e-9, "{h:?}");
        assert!((h.overhead_ms_p50 - 0.2).abs() < 1e-9, "{h:?}");
        assert!(
            r.summary_text()
                .contains("p50 0.200 ms, 5% of its transfer"),
            "{}",
            r.summary_text()
        );
    }
}
