//! `omnirig bench pipeline --concurrency 1,4,16,64`: end-to-end five-stage request latency
//! (p50/p99) and throughput against concurrency, tensor-native against the current path.
//!
//! Both sides move the same bytes per request and hop (the scenario's requests, cycled):
//!
//! - omnirig: every hop is the `bench hop` protocol (offer, reservation + grants, one engine
//!   batch, packet v1 / FINISH, ack; inline below the threshold) between two processes over
//!   tcp: the sending stage ends live in the driver, each receiving stage (prefill, decode,
//!   talker, code2wav) in its own process with its own engine and pool. A request runs its
//!   hops in pipeline order; `concurrency` requests are in flight (closed loop).
//! - current path: `ci/baseline/pickle_hop.py` runs the stages as five Python processes chained
//!   by ZMQ PUSH/PULL on tcp://127.0.0.1 (the driver is the encoder); each stage unpickles its
//!   inbound hop and pickles and sends its outbound hop; the last answers the driver.
//!
//! Stage compute is zero on both sides: this measures the data plane. Payloads are generated
//! once per case before timing on both sides; the first handoff of every case and hop checks
//! its bytes against the fixtures' digests (both sides).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use omnirig_fixtures::{PayloadKind, RequestSpec, TensorSpec};
use omnirig_harness::Scenario;
use omnirig_transports::{Engine, TcpConfig, TransportKind};

use super::hop::{
    ConsumerProcess, HopPayload, Producer, Python, Scratch, connect_producer, engine_config,
    hop_label, stage_payloads,
};
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
    pub tcp: TcpConfig,
    /// Registered receive pool per stage (reservations wait for room: backpressure).
    pub pool_bytes: u64,
    /// omnirig's transport between the stage processes (one that crosses processes).
    pub transport: TransportKind,
    /// Stage hops: grant each handoff's destination ahead.
    pub credits: bool,
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

struct Side {
    producers: Vec<Producer>,
    /// [case][hop]
    payloads: Vec<Vec<Option<HopPayload>>>,
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
        "generating the payloads of {} request(s) for 4 hops",
        cases.len()
    ));
    // Per hop: one producer engine and source buffer holding every case's tensors.
    let mut producers = Vec::new();
    let mut payloads: Vec<Vec<Option<HopPayload>>> = vec![vec![None; 4]; cases.len()];
    let mut hop_files: Vec<Vec<Option<std::path::PathBuf>>> = vec![vec![None; 4]; cases.len()];
    let mut consumers = Vec::new();
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
        let engine = Arc::new(
            Engine::new(engine_config(
                &format!("pipe-{}", hop_label(kind)),
                o.transport,
                &o.tcp,
            ))
            .await?,
        );
        let (src, ps, manifest) = stage_payloads(&engine, kind, &specs, Some(&scratch.0))?;
        let max = ps.iter().map(|p| p.total).max().unwrap_or(0);
        for ((ci, _), (p, m)) in with.iter().zip(ps.into_iter().zip(manifest)) {
            let path = scratch.0.join(format!("{}-{ci}.json", hop_label(kind)));
            std::fs::write(&path, serde_json::json!({ "cases": [m] }).to_string())?;
            hop_files[*ci][hi] = Some(path);
            payloads[*ci][hi] = Some(p);
        }
        let peer = ConsumerProcess::spawn(
            o.pool_bytes.max(2 * max + (1 << 20)),
            &o.tcp,
            None,
            o.transport,
        )?;
        producers
            .push(connect_producer(&peer.hello, engine, src, o.inline_below, o.credits).await?);
        consumers.push(peer);
    }
    let side = Arc::new(Side {
        producers,
        payloads,
    });
    let manifest = scratch.0.join("pipeline.json");
    let m: Vec<_> = hop_files
        .iter()
        .map(|h| serde_json::json!({ "hops": h }))
        .collect();
    std::fs::write(&manifest, serde_json::json!({ "pipeline": m }).to_string())?;
    let mut py = Python::spawn(&o.python, &o.script, None)?;
    py.call(serde_json::json!({"cmd": "pipeline_start", "manifest": manifest, "hops": 4}))?;

    let mean_bytes = cases
        .iter()
        .map(|c| {
            c.2.iter()
                .flatten()
                .flat_map(|t| t.iter())
                .map(|t| t.byte_length)
                .sum::<u64>()
        })
        .sum::<u64>()
        / cases.len() as u64;
    let mut rows = Vec::new();
    for (li, &c) in o.concurrency.iter().enumerate() {
        let n = o.requests.max(2 * c);
        let seq: Vec<usize> = (0..n).map(|i| i % cases.len()).collect();
        let warm: Vec<usize> = (0..c.min(n)).map(|i| i % cases.len()).collect();
        progress(&format!(
            "concurrency {c}: {n} requests (after {} warm-up), omnirig then {}",
            warm.len(),
            o.modes.join(", ")
        ));
        closed_loop(&side, &warm, c, &format!("w{li}")).await?;
        let (mut ours, ours_wall) = closed_loop(&side, &seq, c, &format!("c{li}")).await?;
        ours.bytes_per_op = mean_bytes;
        for mode in &o.modes {
            let all: Vec<usize> = warm.iter().chain(&seq).copied().collect();
            let v = py.call(serde_json::json!({
                "cmd": "pipeline", "cases": all, "concurrency": c, "mode": mode,
                "warmup": warm.len(),
            }))?;
            let mut base = Samples::new(mean_bytes);
            for x in v["lat_us"].as_array().context("lat_us")? {
                base.push(super::baseline_latency(x)?);
            }
            let wall = v["wall_s"].as_f64().unwrap_or(f64::NAN);
            let mut row = Row::new("request", mean_bytes, &ours, mode, &base);
            row.concurrency = Some(c);
            row.case = Some(o.scenario.name.clone());
            row.throughput_rps = Some((n as f64 / ours_wall, base.lat.len() as f64 / wall));
            rows.push(row);
        }
    }
    for p in &side.producers {
        let _ = p.link.send(omnirig_harness::control::Msg::Shutdown);
    }
    drop(py);
    drop(consumers);
    Ok(rows)
}

/// Runs `seq` (case indices) with `c` requests in flight; returns the end-to-end latencies and
/// the wall time from the first start to the last end.
async fn closed_loop(
    side: &Arc<Side>,
    seq: &[usize],
    c: usize,
    tag: &str,
) -> anyhow::Result<(Samples, f64)> {
    let sem = Arc::new(tokio::sync::Semaphore::new(c.max(1)));
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for (i, &case) in seq.iter().enumerate() {
        let permit = sem.clone().acquire_owned().await?;
        let side = side.clone();
        let rid = format!("{tag}-{i}");
        handles.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = request(&side, case, &rid).await;
            drop(permit);
            r.map(|()| t.elapsed())
        }));
    }
    let mut s = Samples::new(0);
    for h in handles {
        s.push(h.await??);
    }
    Ok((s, t0.elapsed().as_secs_f64()))
}

/// One request through the four hops, in pipeline order.
async fn request(side: &Side, case: usize, rid: &str) -> anyhow::Result<()> {
    for (hi, p) in side.payloads[case].iter().enumerate() {
        let Some(p) = p else { continue };
        let prod = &side.producers[hi];
        prod.announce(rid, p)?;
        prod.send(rid, p)
            .await
            .with_context(|| format!("request {rid} hop {}", hop_label(p.kind)))?;
        prod.retire(rid)?;
    }
    Ok(())
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
