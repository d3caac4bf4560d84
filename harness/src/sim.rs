//! Simulated runs: the whole five-stage pipeline in this process, every hop over the `sim`
//! transport on the scenario's fabric, on a current-thread tokio runtime whose clock is
//! paused. Time jumps to the next event whenever every task waits, so a run costs only its
//! CPU work (generating, copying and digesting the real bytes), and it is a function of
//! (scenario, seed): the same inputs give the same event trace, byte for byte.
//!
//! Tokio's timers fire on whole milliseconds, far coarser than a NIC. So the run's tokio
//! clock runs [`TIME_SCALE`] times slower than the model: one tokio millisecond is one
//! modelled microsecond. The scenario's durations (timeouts, compute, arrival gaps, delay
//! faults) are scaled up by the same factor on the way in, and the report's times scaled
//! back on the way out; everything a person reads is in modelled time.

use std::sync::Arc;

use omnirig_transports::transport::sim::QueueUse;
use omnirig_transports::{Fabric, FabricSpec, FaultKind, TransportKind};

use crate::error::{HarnessError, Result};
use crate::faults::AnyFault;
use crate::host::CpuSpec;
use crate::report::Report;
use crate::runner::Runner;
use crate::scenario::Scenario;

/// Tokio nanoseconds per modelled nanosecond in a simulated run.
pub const TIME_SCALE: u64 = 1000;

/// One simulated run.
#[derive(Debug, Clone)]
pub struct SimRun {
    /// In modelled time.
    pub report: Report,
    /// Every fabric event (slices, control messages), then every request's end and every
    /// fault, one per line, in a canonical order.
    pub trace: Vec<String>,
    /// FNV-1a of the trace, hex: two runs agree iff their traces do.
    pub digest: String,
    /// Modelled seconds the run took, and the real seconds it took to compute.
    pub virtual_s: f64,
    pub real_s: f64,
    /// How much each fabric queue carried and how long it was busy.
    pub queues: Vec<QueueUse>,
}

impl SimRun {
    /// Queue utilisation over the run (busy time / modelled run time), busiest first.
    pub fn utilisation(&self) -> Vec<(String, f64)> {
        let total = (self.virtual_s * 1e9).max(1.0);
        let mut u: Vec<_> = self
            .queues
            .iter()
            .map(|q| (q.queue.clone(), q.busy_ns as f64 / total))
            .collect();
        u.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        u
    }
}

/// The scenario as a simulated run sees it: every hop on `sim`, `seed` (when given) in the
/// fabric, the random faults and the arrivals.
pub fn seeded(scenario: &Scenario, seed: Option<u64>) -> Scenario {
    let mut s = scenario.clone().with_transport(TransportKind::Sim);
    let mut fabric = s.fabric.clone().unwrap_or_default();
    if let Some(seed) = seed {
        fabric.seed = seed;
        s.arrival.seed = seed;
        if let Some(rf) = &mut s.random_faults {
            rf.seed = seed;
        }
    }
    s.fabric = Some(fabric);
    s
}

/// Scales every duration the pipeline hands to tokio by `k` (see the module docs).
fn scale_in(s: &Scenario, k: u64) -> Scenario {
    let mut s = s.clone();
    let kf = k as f64;
    s.hop_timeout_s *= kf;
    s.request_timeout_s *= kf;
    for c in [
        &mut s.compute.encoder,
        &mut s.compute.thinker_prefill,
        &mut s.compute.thinker_decode,
        &mut s.compute.talker,
        &mut s.compute.code2wav,
    ] {
        c.per_token_us = c.per_token_us.saturating_mul(k);
        c.per_item_us = c.per_item_us.saturating_mul(k);
    }
    s.arrival.interval_ms *= kf;
    s.arrival.rate_per_s /= kf;
    let delay = |f: &mut FaultKind| {
        if let FaultKind::Delay { ms } = f {
            *ms = ms.saturating_mul(k);
        }
    };
    for f in &mut s.faults {
        if let AnyFault::Transport(kind) = &mut f.kind {
            delay(kind);
        }
    }
    if let Some(rf) = &mut s.random_faults {
        rf.kinds.iter_mut().for_each(delay);
    }
    s
}

/// Scales a report's times back to modelled ones: every number under a key ending in `_ms`
/// or `_s` is divided by `k`, rates (`gbps`, `_rps`) multiplied; then the summary is redone.
fn scale_out(r: &Report, k: u64) -> Result<Report> {
    fn walk(v: &mut serde_json::Value, k: f64, mode: i8) {
        use serde_json::Value;
        match v {
            Value::Object(m) => {
                for (key, v) in m.iter_mut() {
                    let m = if key.ends_with("_ms") || key.ends_with("_s") {
                        -1
                    } else if key == "gbps" || key.ends_with("_rps") {
                        1
                    } else {
                        mode
                    };
                    walk(v, k, m);
                }
            }
            Value::Array(a) => a.iter_mut().for_each(|v| walk(v, k, mode)),
            Value::Number(n) if mode != 0 => {
                let x = n.as_f64().unwrap_or(0.0);
                let y = if mode < 0 { x / k } else { x * k };
                if let Some(n) = serde_json::Number::from_f64(y) {
                    *v = Value::Number(n);
                }
            }
            _ => {}
        }
    }
    let mut v = serde_json::to_value(r).map_err(|e| HarnessError::Setup(e.to_string()))?;
    walk(&mut v, k as f64, 0);
    let mut out: Report =
        serde_json::from_value(v).map_err(|e| HarnessError::Setup(e.to_string()))?;
    out.summarise();
    Ok(out)
}

/// Runs `scenario` simulated (see [`seeded`] for what `seed` sets), on a fresh current-thread
/// runtime with a paused clock.
pub fn run(scenario: &Scenario, seed: Option<u64>) -> Result<SimRun> {
    let s = seeded(scenario, seed);
    let spec: FabricSpec = s.fabric.clone().unwrap_or_default();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .map_err(|e| HarnessError::Setup(format!("sim runtime: {e}")))?;
    let fabric = Fabric::with_time_scale(spec, TIME_SCALE)
        .map_err(|e| HarnessError::Setup(format!("fabric: {e}")))?;
    let runner = Runner::new(scale_in(&s, TIME_SCALE)).fabric(fabric.clone());
    let t0 = std::time::Instant::now();
    // Grant tokens and engine ids from the seed: their sizes on the wire are charged.
    omnirig_transports::engine::seed_thread_randomness(Some(
        s.fabric.as_ref().map_or(0, |f| f.seed),
    ));
    let raw = rt.block_on(runner.run());
    omnirig_transports::engine::seed_thread_randomness(None);
    let raw = raw?;
    let real_s = t0.elapsed().as_secs_f64();
    drop(rt);
    let report = scale_out(&raw, TIME_SCALE)?;
    Ok(finish(report, &fabric, real_s))
}

fn finish(report: Report, fabric: &Arc<Fabric>, real_s: f64) -> SimRun {
    let mut trace = fabric.trace();
    // How each request ended, in modelled ns: part of the trace, so a changed outcome or
    // latency changes the digest.
    for q in &report.requests {
        let how = match &q.failure {
            None if q.ok => "ok".to_string(),
            None => "failed unclassified".to_string(),
            Some(f) => format!(
                "failed {} hop={} tensor={}",
                f.kind,
                f.hop.as_deref().unwrap_or("-"),
                f.tensor.as_deref().unwrap_or("-"),
            ),
        };
        trace.push(format!(
            "end request {} {how} e2e_ns={}",
            q.id,
            (q.e2e_ms * 1e6).round() as u64
        ));
    }
    if let Some(f) = &report.faults {
        for x in &f.fired {
            trace.push(format!(
                "end fault {} {} {} {} at_byte={}",
                x.hop, x.request, x.tensor, x.kind, x.at_byte
            ));
        }
        for l in &f.late {
            trace.push(format!(
                "end late {} {} {} refused={}",
                l.hop, l.request, l.tensor, l.refused
            ));
        }
    }
    trace.push(format!(
        "end pools_clean={} ok={} failed={}",
        report.summary.pools_clean, report.summary.ok, report.summary.failed
    ));
    let digest = format!("{:016x}", fnv(&trace));
    SimRun {
        virtual_s: report.wall_s,
        report,
        trace,
        digest,
        real_s,
        queues: fabric.usage(),
    }
}

fn fnv(lines: &[String]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for l in lines {
        for b in l.bytes().chain([b'\n']) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The first line where two traces differ, for a failing determinism check.
pub fn first_difference(a: &[String], b: &[String]) -> Option<(usize, String, String)> {
    let n = a.len().max(b.len());
    (0..n).find_map(|i| {
        let (x, y) = (a.get(i), b.get(i));
        (x != y).then(|| {
            (
                i,
                x.cloned().unwrap_or_else(|| "<end>".into()),
                y.cloned().unwrap_or_else(|| "<end>".into()),
            )
        })
    })
}

/// Reads a fabric file (YAML, the same shape as a scenario's `fabric:` section), validated.
/// Its `cpu:` section, if any, is left out: see [`fabric_file_from_path`].
pub fn fabric_from_path(path: &std::path::Path) -> Result<FabricSpec> {
    Ok(fabric_file_from_path(path)?.0)
}

/// Reads a fabric file: the fabric, and its `cpu:` section (the host model; in a scenario
/// it sits beside `fabric:`), both validated.
pub fn fabric_file_from_path(path: &std::path::Path) -> Result<(FabricSpec, Option<CpuSpec>)> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| HarnessError::Scenario {
        source_name: name.clone(),
        reason: e.to_string(),
    })?;
    fabric_file_from_str(&text, &name)
}

/// As [`fabric_file_from_path`], from the file's text; `name` names it in errors.
pub fn fabric_file_from_str(text: &str, name: &str) -> Result<(FabricSpec, Option<CpuSpec>)> {
    let bad = |reason: String| HarnessError::Scenario {
        source_name: name.to_string(),
        reason,
    };
    // `cpu` is the harness's section, beside the engine's fabric fields; anything neither
    // knows is refused.
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct FabricFile {
        #[serde(flatten)]
        fabric: FabricSpec,
        #[serde(default)]
        cpu: Option<CpuSpec>,
    }
    let f: FabricFile = serde_saphyr::from_str(text).map_err(|e| bad(e.to_string()))?;
    let (spec, cpu) = (f.fabric, f.cpu);
    spec.validate().map_err(|e| bad(e.detail().to_string()))?;
    for stage in spec.placement.keys() {
        omnirig_fixtures::Stage::parse(stage, "placement").map_err(|e| bad(e.to_string()))?;
    }
    let cpu = match cpu {
        Some(c) => {
            let nodes: Vec<&str> = spec.nodes.iter().map(|n| n.name.as_str()).collect();
            c.validate(&nodes).map_err(bad)?;
            Some(c)
        }
        None => None,
    };
    Ok((spec, cpu))
}
