//! `omnirig bench hop`: one pipeline hop with its real payloads, tensor-native (omnirig) against
//! the current path (pickle over ZMQ, `ci/baseline/pickle_hop.py`), same sizes, same run.
//!
//! The omnirig side is the pipeline itself: `omnirig run --processes` (five stage processes,
//! the harness connectors' protocol machines driven by `StageWorker`, with credits and inline
//! packets as `omnirig run` has them) on the scenario's requests that carry the hop, one at a
//! time, zero compute, stages fed pre-generated payloads (scenario `pregenerate`: outputs and
//! input digests made before the run; every arriving byte is still digested and checked).
//! A handoff's time is the consumer's `handoff_ms` from the run's report: from the producer's
//! offer (its outputs ready) to the ack, through grant, write, packet, fence and verification.
//! The baseline is timed from `pickle.dumps` to its ack at the sender; `handoff_ms` ends when
//! the consumer sends its ack, so it leaves out the ack's flight back (a bias in omnirig's
//! favour of about one control-message latency). The other hops run too, but one
//! request at a time nothing overlaps the hop measured. The KV prefix cache is off, so a KV
//! hop moves its whole cache every time; stage-packet hops carry outputs that differ per
//! request (`distinct_outputs`). The encoder cache serves every repeat of an image or audio,
//! so the EC hop is measured by `bench pipeline` and run reports, not here.
//!
//! Each round runs every case `per` times on both sides (omnirig after `warm` warm-up
//! requests); the first Python round checks its bytes against the fixtures' digests.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use omnirig_fixtures::{Digest128, PayloadKind, RequestSpec, TensorSpec, generate_tensor};
use omnirig_harness::scenario::{RequestEntry, StageCompute};
use omnirig_harness::{Runner, Scenario};
use omnirig_transports::{Buffer, Engine, EngineConfig, TcpConfig, TransportKind};

use super::{Results, Row, Samples, human_size, iterations};

fn progress(msg: &str) {
    eprintln!("[bench hop] {msg}");
}

/// Parses a hop name as the CLI spells it.
pub fn parse_hop(s: &str) -> anyhow::Result<PayloadKind> {
    Ok(match s {
        "ec" | "encoder_embeddings" => PayloadKind::EncoderEmbeddings,
        "kv" | "kv_cache" => PayloadKind::KvCache,
        "thinker-talker" | "thinker_to_talker" => PayloadKind::ThinkerToTalker,
        "talker-code2wav" | "talker_to_code2wav" => PayloadKind::TalkerToCode2wav,
        other => bail!("unknown hop {other:?}: ec, kv, thinker-talker, talker-code2wav"),
    })
}

pub fn hop_label(k: PayloadKind) -> &'static str {
    match k {
        PayloadKind::EncoderEmbeddings => "ec",
        PayloadKind::KvCache => "kv",
        PayloadKind::ThinkerToTalker => "thinker-talker",
        PayloadKind::TalkerToCode2wav => "talker-code2wav",
    }
}

// ---------------------------------------------------------------- payloads

/// One hop of one request: its tensors (fixture bytes, at `offset` in the producer's source
/// buffer) and their digests.
#[derive(Debug, Clone)]
pub struct HopPayload {
    pub case: String,
    pub tensors: Vec<(TensorSpec, u64, Digest128)>,
    pub total: u64,
}

/// The distinct requests (by label) of a scenario that carry `kind`, planned.
pub fn scenario_cases(
    scenario: &Scenario,
    kind: PayloadKind,
) -> anyhow::Result<Vec<(String, RequestSpec, Vec<TensorSpec>)>> {
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for r in scenario.expand()? {
        if seen.contains(&r.label) {
            continue;
        }
        seen.push(r.label.clone());
        if let Some(h) = r.plan.hop(kind) {
            out.push((r.label.clone(), r.spec.clone(), h.tensors.clone()));
        }
    }
    Ok(out)
}

/// Generates every case's tensors into one registered source buffer (8-byte aligned
/// offsets) and returns the payloads; also writes `dir/<case>.bin` + a manifest entry for the
/// Python baseline when `dir` is given.
pub fn stage_payloads(
    engine: &Engine,
    kind: PayloadKind,
    cases: &[(String, RequestSpec, Vec<TensorSpec>)],
    dir: Option<&Path>,
) -> anyhow::Result<(Buffer, Vec<HopPayload>, Vec<serde_json::Value>)> {
    let total: u64 = cases
        .iter()
        .flat_map(|c| c.2.iter())
        .map(|t| t.byte_length.next_multiple_of(64))
        .sum();
    let src = engine.allocate(total.max(4096))?;
    let mut off = 0;
    let mut payloads = Vec::new();
    let mut manifest = Vec::new();
    for (case, spec, tensors) in cases {
        let mut p = HopPayload {
            case: case.clone(),
            tensors: Vec::new(),
            total: 0,
        };
        let mut blob = Vec::new();
        let mut entries = Vec::new();
        for t in tensors {
            let bytes = generate_tensor(spec.seed, t);
            let d = Digest128::of_bytes(&bytes);
            src.write(off, &bytes)?;
            if dir.is_some() {
                entries.push(serde_json::json!({
                    "name": t.name, "dtype": t.dtype.as_str(), "shape": t.shape,
                    "offset": blob.len(), "len": t.byte_length, "digest": d.to_hex(),
                }));
                blob.extend_from_slice(&bytes);
            }
            p.tensors.push((t.clone(), off, d));
            p.total += t.byte_length;
            off += t.byte_length.next_multiple_of(64);
        }
        if let Some(dir) = dir {
            let path = dir.join(format!("{}-{case}.bin", hop_label(kind)));
            std::fs::write(&path, &blob).with_context(|| format!("writing {}", path.display()))?;
            manifest.push(serde_json::json!({
                "name": case, "payload": path, "tensors": entries,
            }));
        }
        payloads.push(p);
    }
    Ok((src, payloads, manifest))
}

/// The hop and pipeline suites run omnirig between processes: a kind that crosses them.
pub fn process_transport(kind: TransportKind) -> anyhow::Result<TransportKind> {
    if !kind.crosses_processes() {
        bail!(
            "transport {kind} cannot cross processes (use one of {})",
            TransportKind::process_names()
        );
    }
    Ok(kind)
}

// ---------------------------------------------------------------- the Python baseline

/// The current path: `ci/baseline/pickle_hop.py` driving its own receiver process.
pub struct Python {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Python {
    /// `receiver_cpu`: the CPU its receiver process pins itself to (the driver, the sending
    /// side, inherits this process's placement).
    pub fn spawn(
        python: &Path,
        script: &Path,
        receiver_cpu: Option<usize>,
    ) -> anyhow::Result<Self> {
        let mut cmd = Command::new(python);
        match receiver_cpu {
            Some(c) => cmd.env(super::cpus::BASELINE_RECEIVER_CPU, c.to_string()),
            None => cmd.env_remove(super::cpus::BASELINE_RECEIVER_CPU),
        };
        let mut child = cmd
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} {} (install the baseline with ci/baseline/setup.sh)",
                    python.display(),
                    script.display()
                )
            })?;
        Ok(Self {
            stdin: child.stdin.take().context("python stdin")?,
            stdout: BufReader::new(child.stdout.take().context("python stdout")?),
            child,
        })
    }

    pub fn call(&mut self, cmd: serde_json::Value) -> anyhow::Result<serde_json::Value> {
        writeln!(self.stdin, "{cmd}")?;
        self.stdin.flush()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        if line.is_empty() {
            bail!("the Python baseline exited (see its error above)");
        }
        let v: serde_json::Value = serde_json::from_str(&line)?;
        if v["ok"] != true {
            bail!("Python baseline: {}", v["error"]);
        }
        Ok(v)
    }

    /// `iters` timed round trips (after `warmup`) of case `case` in `mode`.
    pub fn hop(
        &mut self,
        case: usize,
        mode: &str,
        iters: usize,
        warmup: usize,
        bytes: u64,
    ) -> anyhow::Result<(Samples, bool)> {
        let v = self.call(serde_json::json!({
            "cmd": "hop", "case": case, "mode": mode, "iters": iters, "warmup": warmup,
        }))?;
        let mut s = Samples::new(bytes);
        for x in v["lat_us"].as_array().context("lat_us")? {
            s.push(super::baseline_latency(x)?);
        }
        Ok((s, v["verified"] == true))
    }
}

impl Drop for Python {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{{\"cmd\": \"quit\"}}");
        let _ = self.stdin.flush();
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the baseline script is: next to the repository's `ci/`, found from the current
/// directory or the binary's location.
pub fn default_script() -> PathBuf {
    let rel = Path::new("ci/baseline/pickle_hop.py");
    if rel.exists() {
        return rel.to_path_buf();
    }
    let exe = std::env::current_exe().unwrap_or_default();
    for dir in exe.ancestors() {
        if dir.join(rel).exists() {
            return dir.join(rel);
        }
    }
    rel.to_path_buf()
}

/// A scratch directory for the baseline's payload files, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(what: &str) -> anyhow::Result<Self> {
        let d = std::env::temp_dir().join(format!("omnirig-{what}-{}", std::process::id()));
        std::fs::create_dir_all(&d)?;
        Ok(Self(d))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------- the suite

#[derive(Debug, Clone)]
pub struct Options {
    pub hop: PayloadKind,
    pub scenario: Scenario,
    pub budget: u64,
    pub min_iters: usize,
    pub max_iters: usize,
    /// Interleaved rounds: every round times omnirig, pickle, pickle5-oob and pickle-shm in turn.
    pub rounds: usize,
    pub inline_below: u64,
    /// Also time the pipeline in one process over loopback.
    pub loopback: bool,
    pub python: PathBuf,
    pub script: PathBuf,
    /// The plain-socket floor's TCP settings.
    pub tcp: TcpConfig,
    /// Sender side and receiver side CPUs of the baseline and the floor; None: unpinned.
    /// omnirig's five stage processes are not pinned (two CPUs cannot hold them).
    pub cpus: Option<super::cpus::CpuPair>,
    /// omnirig's transport between the stage processes (one that crosses processes).
    pub transport: TransportKind,
    /// The omnirig binary the stage processes run.
    pub exe: PathBuf,
}

pub fn run(o: &Options) -> anyhow::Result<Results> {
    match o.cpus {
        Some(c) => progress(&format!(
            "baseline sender on CPU {}, receiver on CPU {}; omnirig's stage processes unpinned",
            c.sender, c.receiver
        )),
        None => progress("processes unpinned (--cpus none, or only one CPU)"),
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let rows = rt.block_on(suite(o))?;
    Ok(Results {
        suite: "hop".into(),
        transport: o.transport.to_string(),
        rows,
        machine: Some(super::Machine::this()),
    })
}

/// Runs every case `warm + per` times, one request at a time, through the pipeline runner
/// over `transport` (in stage processes unless loopback) and returns each case's handoff
/// times of hop `kind` (warm-ups left out).
async fn omnirig_round(
    o: &Options,
    cases: &[(String, RequestSpec, Vec<TensorSpec>)],
    transport: TransportKind,
    warm: usize,
    per: usize,
) -> anyhow::Result<Vec<Vec<Duration>>> {
    let kind = o.hop;
    let mut s = o.scenario.clone().with_transport(transport);
    s.name = format!("bench-hop-{}", hop_label(kind));
    s.concurrency = 1;
    s.arrival = Default::default();
    s.compute = StageCompute::default();
    s.inline_below = o.inline_below;
    s.prefix_cache = false;
    s.distinct_outputs = true;
    s.pregenerate = true;
    s.faults = Vec::new();
    s.random_faults = None;
    s.kill_stage = None;
    s.requests = cases
        .iter()
        .map(|(label, spec, _)| RequestEntry {
            case: None,
            name: Some(label.clone()),
            request: Some(spec.clone()),
            repeat: u32::try_from(warm + per).unwrap_or(u32::MAX),
            vary_seed: false,
        })
        .collect();
    let mut runner = Runner::new(s).progress(false);
    if transport.crosses_processes() {
        runner = runner.processes(o.exe.clone());
    }
    let report = runner.run().await?;
    let mut requests = report.requests.clone();
    requests.sort_by(|a, b| a.id.cmp(&b.id));
    if let Some(q) = requests.iter().find(|q| !q.ok) {
        bail!(
            "omnirig request {} failed: {}",
            q.id,
            q.error.as_deref().unwrap_or("?")
        );
    }
    let mut out = vec![Vec::new(); cases.len()];
    for (ci, chunk) in requests.chunks(warm + per).enumerate().take(cases.len()) {
        for q in &chunk[warm..] {
            let h = q
                .hops
                .iter()
                .find(|h| h.hop == kind.as_str())
                .with_context(|| format!("request {} has no {} hop", q.id, kind.as_str()))?;
            if h.moved_bytes != h.bytes || !h.verified {
                bail!(
                    "request {}: {} moved {} of {} bytes (verified: {})",
                    q.id,
                    kind.as_str(),
                    h.moved_bytes,
                    h.bytes,
                    h.verified
                );
            }
            out[ci].push(Duration::from_secs_f64(h.handoff_ms / 1e3));
        }
    }
    Ok(out)
}

async fn suite(o: &Options) -> anyhow::Result<Vec<Row>> {
    let kind = o.hop;
    if kind == PayloadKind::EncoderEmbeddings {
        bail!(
            "ec: the encoder cache serves every repeat of an image or audio, so one hop cannot be \
             timed alone over and over; bench pipeline and run reports measure it"
        );
    }
    let cases = scenario_cases(&o.scenario, kind)?;
    if cases.is_empty() {
        bail!(
            "no request of scenario {} carries the {} hop",
            o.scenario.name,
            kind.as_str()
        );
    }
    let scratch = Scratch::new("bench-hop")?;
    progress(&format!(
        "writing the baseline's {} payloads of {} case(s)",
        kind.as_str(),
        cases.len()
    ));
    let engine = Engine::new(EngineConfig::for_kind(
        "hop-payloads",
        TransportKind::Loopback,
    ))
    .await?;
    let (_src, payloads, manifest) = stage_payloads(&engine, kind, &cases, Some(&scratch.0))?;
    drop(engine);
    let max = payloads.iter().map(|p| p.total).max().unwrap_or(0);
    let manifest_path = scratch.0.join("manifest.json");
    std::fs::write(
        &manifest_path,
        serde_json::json!({ "cases": manifest }).to_string(),
    )?;
    progress("starting the Python baseline");
    let mut py = Python::spawn(&o.python, &o.script, o.cpus.map(|c| c.receiver))?;
    // The floor: the same bytes through a plain socket between the same CPUs.
    let raw_peer = super::peer::PeerProcess::spawn_on(
        super::peer::PeerMode::Raw,
        max,
        &o.tcp,
        o.cpus.map(|c| c.receiver),
    )?;
    let mut raw = std::net::TcpStream::connect(raw_peer.hello.addr)?;
    raw.set_nodelay(true)?;
    raw.set_nonblocking(true)?;
    let mut raw_buf = vec![0x5au8; max as usize];
    let loaded = py.call(serde_json::json!({"cmd": "load", "manifest": manifest_path}))?;
    if loaded["xxhash"] != true {
        progress("WARNING: the Python side has no xxhash; its digest check is skipped");
    }

    // Every case gets the iterations its size allows within the budget; rounds interleave.
    let iters = payloads
        .iter()
        .map(|p| iterations(p.total, o.budget, o.min_iters, o.max_iters))
        .min()
        .unwrap_or(1);
    let rounds = o.rounds.clamp(1, iters);
    let per = iters.div_ceil(rounds);
    let warm = 3.min(per).max(1);
    let n = payloads.len();
    let mut ours: Vec<Samples> = payloads.iter().map(|p| Samples::new(p.total)).collect();
    let mut lbs: Vec<Samples> = payloads.iter().map(|p| Samples::new(p.total)).collect();
    let mut base: Vec<[Samples; 3]> = payloads
        .iter()
        .map(|p| {
            [
                Samples::new(p.total),
                Samples::new(p.total),
                Samples::new(p.total),
            ]
        })
        .collect();
    let mut verified = true;
    const MODES: [&str; 3] = ["pickle", "pickle5-oob", "pickle-shm"];
    for r in 0..rounds {
        progress(&format!(
            "round {}/{rounds}: {n} case(s) x {per} on each side",
            r + 1
        ));
        for (ci, p) in payloads.iter().enumerate() {
            for (mi, mode) in MODES.iter().enumerate() {
                let w = if r == 0 { warm } else { 1 };
                let (s, v) = py.hop(ci, mode, per, w, p.total)?;
                base[ci][mi].lat.extend(s.lat);
                verified &= v;
            }
        }
        for (ci, lat) in omnirig_round(o, &cases, o.transport, warm, per)
            .await?
            .into_iter()
            .enumerate()
        {
            ours[ci].lat.extend(lat);
        }
        if o.loopback {
            for (ci, lat) in omnirig_round(o, &cases, TransportKind::Loopback, warm, per)
                .await?
                .into_iter()
                .enumerate()
            {
                lbs[ci].lat.extend(lat);
            }
        }
    }
    if !verified {
        progress("WARNING: the Python side did not verify digests");
    }
    let mut rows = Vec::new();
    for (ci, p) in payloads.iter().enumerate() {
        let (floor_name, floor) = super::transfer::best_raw(
            &mut raw,
            b'W',
            &mut raw_buf[..p.total as usize],
            per * rounds,
            o.tcp.busy_poll,
            super::transfer::Gap::default(),
        )?;
        let floor = {
            let m = floor.measured();
            super::Baseline {
                name: floor_name.into(),
                gbps: m.gbps,
                p50_us: m.p50_us,
                p99_us: Some(m.p99_us),
                samples_us: None,
            }
        };
        let inline = p.total <= o.inline_below;
        let op = if inline {
            format!("hop-{}-inline", o.transport)
        } else {
            format!("hop-{}", o.transport)
        };
        for (name, b) in MODES.iter().zip(&base[ci]) {
            let mut row = Row::new(&op, p.total, &ours[ci], name, b);
            row.case = Some(p.case.clone());
            row.hop = Some(hop_label(kind).into());
            row.attach_samples(&ours[ci], b);
            row.floor = Some(floor.clone());
            rows.push(row);
        }
        if o.loopback {
            let lop = if inline {
                "hop-loopback-inline"
            } else {
                "hop-loopback"
            };
            for (name, b) in MODES.iter().zip(&base[ci]) {
                let mut row = Row::new(lop, p.total, &lbs[ci], name, b);
                row.case = Some(p.case.clone());
                row.hop = Some(hop_label(kind).into());
                rows.push(row);
            }
        }
    }
    drop(py);
    drop(raw_peer);
    Ok(rows)
}

/// The targets for this hop, checked against this run's ratios (printed, never asserted).
pub fn verdicts(r: &Results) -> Vec<String> {
    let mut out = Vec::new();
    let tcp = |base: &'static str| {
        r.rows.iter().filter(move |x| {
            x.op.starts_with("hop-") && !x.op.starts_with("hop-loopback") && x.baseline.name == base
        })
    };
    let hop = r
        .rows
        .first()
        .and_then(|x| x.hop.clone())
        .unwrap_or_default();
    let targets: &[(&str, f64)] = match hop.as_str() {
        "thinker-talker" => &[("pickle", 5.0)],
        "talker-code2wav" => &[("pickle", 3.0)],
        "kv" => &[("pickle", 3.0), ("pickle5-oob", 1.0)],
        _ => &[],
    };
    // Judged on the p50 round trip (the typical handoff; a shared VM's stalls land in the
    // mean and p99, which are printed too).
    let p50x = |x: &Row| x.baseline.p50_us / x.omnirig.p50_us;
    for &(base, need) in targets {
        if let Some(min) = tcp(base).min_by(|a, b| p50x(a).total_cmp(&p50x(b))) {
            out.push(format!(
                "{hop} >= {need}x {base} (p50 round trip incl. every control message, omnirig over {}, two processes): {} (lowest {:.2}x: {} {}, {:.1} us vs {:.1} us; mean-rate ratio {:.2}x)",
                r.transport,
                if p50x(min) >= need { "met" } else { "MISSED" },
                p50x(min),
                min.case.as_deref().unwrap_or("?"),
                super::human_size_approx(min.size),
                min.omnirig.p50_us,
                min.baseline.p50_us,
                min.ratio,
            ));
            for x in tcp(base) {
                let mut line = format!(
                    "  {} {}: {:.2}x p50 ({:.1} us vs {:.1} us)",
                    x.case.as_deref().unwrap_or("?"),
                    super::human_size_approx(x.size),
                    p50x(x),
                    x.omnirig.p50_us,
                    x.baseline.p50_us
                );
                if let Some(f) = &x.floor {
                    // What the target leaves, against what a plain socket needs for the bytes.
                    let budget = x.baseline.p50_us / need;
                    line += &format!(
                        "; {need}x needs <= {budget:.1} us, a plain socket alone takes {:.1} us ({}){}",
                        f.p50_us,
                        f.name,
                        if f.p50_us > budget {
                            ": below the tcp floor on this machine"
                        } else {
                            ""
                        }
                    );
                }
                out.push(line);
            }
        }
    }
    // Context, no target: the same-host pickle wire (what omnirig's shm is up against).
    if let Some(min) = tcp("pickle-shm").min_by(|a, b| p50x(a).total_cmp(&p50x(b))) {
        out.push(format!(
            "{hop} vs pickle-shm (the same-host pickle wire; no target): lowest {:.2}x p50 ({} {}, {:.1} us vs {:.1} us)",
            p50x(min),
            min.case.as_deref().unwrap_or("?"),
            super::human_size_approx(min.size),
            min.omnirig.p50_us,
            min.baseline.p50_us
        ));
    }
    if targets.is_empty() {
        for base in ["pickle", "pickle5-oob"] {
            if let Some(min) = tcp(base).min_by(|a, b| a.ratio.total_cmp(&b.ratio)) {
                out.push(format!(
                    "{hop} vs {base} (no target): lowest {:.2}x ({} {})",
                    min.ratio,
                    min.case.as_deref().unwrap_or("?"),
                    human_size(min.size)
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_names_parse_both_spellings() {
        for k in PayloadKind::ALL {
            assert_eq!(parse_hop(hop_label(k)).unwrap(), k);
            assert_eq!(parse_hop(k.as_str()).unwrap(), k);
        }
        assert!(parse_hop("x").is_err());
    }

    #[test]
    fn every_hop_of_the_default_scenario_has_cases() {
        let s = Scenario::default_scenario();
        for k in PayloadKind::ALL {
            let c = scenario_cases(&s, k).unwrap();
            assert!(!c.is_empty(), "{k:?}");
            // Distinct labels: the repeated image_audio request is measured once.
            let mut labels: Vec<_> = c.iter().map(|x| x.0.clone()).collect();
            labels.dedup();
            assert_eq!(labels.len(), c.len());
        }
    }
}
