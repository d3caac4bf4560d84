//! `omnirig bench pipeline --concurrency 1,4,16,64`: end-to-end five-stage request latency
//! (p50/p99) and throughput against concurrency, tensor-native against the current path.
//!
//! Both sides move the scenario's requests (cycled) through the five stages:
//!
//! - omnirig: the real pipeline runner, `omnirig run --processes` (five stage processes, the
//!   harness connectors' protocol machines driven by `StageWorker`, credits and inline packets
//!   as `omnirig run` has them), with zero compute and stages fed pre-generated payloads
//!   (scenario `pregenerate`: each stage makes its outputs and its inputs' digests before the
//!   run; every arriving byte is still digested and checked). The KV prefix cache is off, so
//!   every request moves its whole KV cache as the baseline does; the encoder cache still
//!   serves a repeated image or audio (the row's `omnirig moved` says how much moved). The
//!   first `concurrency` requests of each level warm up and are left out of the figures.
//! - current path: `ci/baseline/pickle_hop.py` runs the stages as five Python processes chained
//!   by ZMQ PUSH/PULL on tcp://127.0.0.1 (the driver is the encoder); each stage unpickles its
//!   inbound hop and pickles and sends its outbound hop; the last answers the driver.
//!
//! Stage compute is zero on both sides: this measures the data plane. Payloads are generated
//! once before timing on both sides.

use std::time::Duration;

use anyhow::{Context, bail};
use omnirig_fixtures::{PayloadKind, RequestSpec, TensorSpec};
use omnirig_harness::scenario::{RequestEntry, StageCompute};
use omnirig_harness::{Runner, Scenario};
use omnirig_transports::{Engine, EngineConfig, TransportKind};

use super::hop::{Python, Scratch, hop_label, stage_payloads};
use super::{Results, Row, Samples, human_size_approx};

fn progress(msg: &str) {
    eprintln!("[bench pipeline] {msg}");
}

#[derive(Debug, Clone)]
pub struct Options {
    pub scenario: Scenario,
    pub concurrency: Vec<usize>,
    /// Timed requests per level: at least this many, and at least 2 x concurrency.
    pub requests: usize,
    pub inline_below: u64,
    pub modes: Vec<String>,
    pub python: std::path::PathBuf,
    pub script: std::path::PathBuf,
    /// omnirig's transport between the stage processes (one that crosses processes).
    pub transport: TransportKind,
    /// The omnirig binary the stage processes run (`omnirig stage ...`).
    pub exe: std::path::PathBuf,
}

/// The scenario's requests, in order: (label, spec, per hop in pipeline order: tensors).
type Case = (String, RequestSpec, Vec<Option<Vec<TensorSpec>>>);
/// One hop of one request: (label, spec, tensors).
type HopCase = (String, RequestSpec, Vec<TensorSpec>);

fn cases(s: &Scenario) -> anyhow::Result<Vec<Case>> {
    let mut out = Vec::new();
    for r in s.expand()? {
        let hops = PayloadKind::ALL
            .iter()
            .map(|k| r.plan.hop(*k).map(|h| h.tensors.clone()))
            .collect();
        out.push((r.label.clone(), r.spec.clone(), hops));
    }
    Ok(out)
}

pub fn run(o: &Options) -> anyhow::Result<Results> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let rows = rt.block_on(suite(o))?;
    Ok(Results {
        suite: "pipeline".into(),
        transport: o.transport.to_string(),
        rows,
        machine: Some(super::Machine::this()),
    })
}

async fn suite(o: &Options) -> anyhow::Result<Vec<Row>> {
    let cases = cases(&o.scenario)?;
    if cases.is_empty() {
        bail!("scenario {} has no requests", o.scenario.name);
    }
    let scratch = Scratch::new("bench-pipeline")?;
    progress(&format!(
        "writing the baseline's payloads of {} request(s) for 4 hops",
        cases.len()
    ));
    let mut hop_files: Vec<Vec<Option<std::path::PathBuf>>> = vec![vec![None; 4]; cases.len()];
    let engine = Engine::new(EngineConfig::for_kind(
        "pipe-payloads",
        TransportKind::Loopback,
    ))
    .await?;
    for (hi, kind) in PayloadKind::ALL.into_iter().enumerate() {
        let with: Vec<(usize, HopCase)> = cases
            .iter()
            .enumerate()
            .filter_map(|(ci, c)| {
                c.2[hi]
                    .clone()
                    .map(|t| (ci, (format!("{ci}-{}", c.0), c.1.clone(), t)))
            })
            .collect();
        let specs: Vec<_> = with.iter().map(|x| x.1.clone()).collect();
        let (_src, _ps, manifest) = stage_payloads(&engine, kind, &specs, Some(&scratch.0))?;
        for ((ci, _), m) in with.iter().zip(manifest) {
            let path = scratch.0.join(format!("{}-{ci}.json", hop_label(kind)));
            std::fs::write(&path, serde_json::json!({ "cases": [m] }).to_string())?;
            hop_files[*ci][hi] = Some(path);
        }
    }
    drop(engine);
    let manifest = scratch.0.join("pipeline.json");
    let m: Vec<_> = hop_files
        .iter()
        .map(|h| serde_json::json!({ "hops": h }))
        .collect();
    std::fs::write(&manifest, serde_json::json!({ "pipeline": m }).to_string())?;
    let mut py = Python::spawn(&o.python, &o.script, None)?;
    py.call(serde_json::json!({"cmd": "pipeline_start", "manifest": manifest, "hops": 4}))?;

    let mut rows = Vec::new();
    for &c in &o.concurrency {
        let n = o.requests.max(2 * c);
        let seq: Vec<usize> = (0..n).map(|i| i % cases.len()).collect();
        let warm: Vec<usize> = (0..c.min(n)).map(|i| i % cases.len()).collect();
        progress(&format!(
            "concurrency {c}: {n} requests (after {} warm-up), omnirig run --processes then {}",
            warm.len(),
            o.modes.join(", ")
        ));
        let ours = run_pipeline(o, &cases, &warm, &seq, c).await?;
        let bytes_per_op = ours.baseline_bytes;
        progress(&format!(
            "omnirig: {} moved per request of {} ({} reused from the encoder cache)",
            human_size_approx(ours.moved_bytes),
            human_size_approx(ours.baseline_bytes),
            human_size_approx(ours.baseline_bytes.saturating_sub(ours.moved_bytes)),
        ));
        let mut lat = ours.samples;
        lat.bytes_per_op = bytes_per_op;
        for mode in &o.modes {
            let all: Vec<usize> = warm.iter().chain(&seq).copied().collect();
            let v = py.call(serde_json::json!({
                "cmd": "pipeline", "cases": all, "concurrency": c, "mode": mode,
                "warmup": warm.len(),
            }))?;
            let mut base = Samples::new(bytes_per_op);
            for x in v["lat_us"].as_array().context("lat_us")? {
                base.push(super::baseline_latency(x)?);
            }
            let wall = v["wall_s"].as_f64().unwrap_or(f64::NAN);
            let mut row = Row::new("request", bytes_per_op, &lat, mode, &base);
            row.concurrency = Some(c);
            row.case = Some(o.scenario.name.clone());
            row.throughput_rps = Some((ours.rps, base.lat.len() as f64 / wall));
            rows.push(row);
        }
    }
    drop(py);
    Ok(rows)
}

/// One concurrency level on omnirig's side.
struct Level {
    samples: Samples,
    /// Requests per second over the whole run (warm-ups included).
    rps: f64,
    /// Mean bytes a request carries over its hops (what the baseline moves).
    baseline_bytes: u64,
    /// Mean bytes omnirig moved per request (less where the encoder cache served).
    moved_bytes: u64,
}

/// Runs `warm` then `seq` (case indices) through `omnirig run --processes` with `c` requests
/// in flight, zero compute, stages fed pre-generated payloads; returns the timed requests'
/// end-to-end latencies.
async fn run_pipeline(
    o: &Options,
    cases: &[Case],
    warm: &[usize],
    seq: &[usize],
    c: usize,
) -> anyhow::Result<Level> {
    let mut s = o.scenario.clone().with_transport(o.transport);
    s.name = format!("{}-c{c}", o.scenario.name);
    s.concurrency = c;
    s.arrival = Default::default();
    s.compute = StageCompute::default();
    s.inline_below = o.inline_below;
    s.prefix_cache = false;
    s.pregenerate = true;
    s.faults = Vec::new();
    s.random_faults = None;
    s.kill_stage = None;
    s.requests = warm
        .iter()
        .chain(seq)
        .map(|&ci| RequestEntry {
            case: None,
            name: Some(cases[ci].0.clone()),
            request: Some(cases[ci].1.clone()),
            repeat: 1,
            vary_seed: false,
        })
        .collect();
    let report = Runner::new(s)
        .processes(o.exe.clone())
        .progress(false)
        .run()
        .await?;
    let mut requests = report.requests.clone();
    requests.sort_by(|a, b| a.id.cmp(&b.id));
    if let Some(q) = requests.iter().find(|q| !q.ok) {
        bail!(
            "omnirig request {} failed: {}",
            q.id,
            q.error.as_deref().unwrap_or("?")
        );
    }
    let timed = &requests[warm.len()..];
    let mut samples = Samples::new(0);
    for q in timed {
        samples.push(Duration::from_secs_f64(q.e2e_ms / 1e3));
    }
    let per = |f: &dyn Fn(&omnirig_harness::HopResult) -> u64| {
        timed
            .iter()
            .map(|q| q.hops.iter().map(f).sum::<u64>())
            .sum::<u64>()
            / timed.len().max(1) as u64
    };
    Ok(Level {
        samples,
        rps: requests.len() as f64 / report.wall_s,
        baseline_bytes: per(&|h| h.bytes),
        moved_bytes: per(&|h| h.moved_bytes),
    })
}

/// The target (five-stage request >= 3x at concurrency 16), checked against this run.
pub fn verdicts(r: &Results) -> Vec<String> {
    let mut out = Vec::new();
    for row in r.rows.iter().filter(|x| x.baseline.name == "pickle") {
        let c = row.concurrency.unwrap_or(0);
        let p50x = row.baseline.p50_us / row.omnirig.p50_us;
        let (to, tb) = row.throughput_rps.unwrap_or((f64::NAN, f64::NAN));
        let line = format!(
            "c={c}: p50 {:.1} ms vs {:.1} ms ({p50x:.2}x), mean {:.2}x, throughput {to:.1} vs {tb:.1} req/s ({:.2}x), {} per request",
            row.omnirig.p50_us / 1e3,
            row.baseline.p50_us / 1e3,
            row.ratio,
            to / tb,
            human_size_approx(row.size)
        );
        if c == 16 {
            out.push(format!(
                "five-stage request >= 3x pickle at concurrency 16 (p50 latency): {} ({line})",
                if p50x >= 3.0 { "met" } else { "MISSED" }
            ));
        } else {
            out.push(line);
        }
    }
    out
}
