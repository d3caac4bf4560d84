//! `omnirig simulate --fabric F --scenario S --concurrency 1,4,16,64`: the scale model. Runs
//! the scenario on the simulated fabric at each concurrency and reports the predicted per-hop
//! and end-to-end latency (p50/p99), the throughput, and the fabric queues that were busiest
//! (the one that binds first). With `--measured REPORT.json ...` (reports of real runs of
//! the same scenario, e.g. `omnirig run --processes --transport tcp --report DIR`), it sets
//! the predictions against them: a table and a predicted-vs-measured plot.

use std::path::{Path, PathBuf};

use crate::bench::median;
use anyhow::Context;
use omnirig_harness::sim;
use omnirig_harness::{Report, Scenario};
use serde::Serialize;

#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// The fabric (YAML): nodes, NICs, links, placement (docs/sim.md).
    #[arg(long)]
    fabric: Option<PathBuf>,
    /// The scenario (default: the embedded default scenario).
    #[arg(long)]
    scenario: Option<PathBuf>,
    /// Concurrencies to predict, comma separated.
    #[arg(long, default_value = "1,4,16,64")]
    concurrency: String,
    /// Runs of each request list: the scenario's requests repeated until there are at least
    /// this many per concurrency level times the concurrency (percentiles need samples).
    #[arg(long, default_value_t = 4)]
    rounds: u32,
    /// Seed of the fabric's jitter.
    #[arg(long)]
    seed: Option<u64>,
    /// Reports of measured runs (report.json, or gzipped) to validate against, matched by
    /// concurrency.
    #[arg(long, num_args = 1..)]
    measured: Vec<PathBuf>,
    /// Write predictions (and the comparison) here: simulate.json, simulate.md, plots.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also write the scenario as simulated at each concurrency (`scenario-cN.yaml`), so
    /// measured runs can run exactly the same requests.
    #[arg(long)]
    scenarios_out: Option<PathBuf>,
    /// Measure this machine's CPU costs (generate, digest, tcp copy, control round trip, a
    /// write's own cost in a batch, the stubs' whole-tensor check, a packet's decode, a
    /// parked process's wake) and print them as a fabric's `cpu:` section, every node of
    /// `--fabric` (or of the default fabric) on one host with this machine's cores; with
    /// `--out`, also write `cpu.yaml` and `cpu-calibration.json` there. Simulates nothing.
    #[arg(long)]
    calibrate_cpu: bool,
    /// `--calibrate-cpu`: MiB each throughput is measured over.
    #[arg(long, default_value_t = 64)]
    calibrate_mib: u64,
}

fn calibrate(args: &SimulateArgs) -> anyhow::Result<()> {
    let fabric = match &args.fabric {
        Some(f) => sim::fabric_file_from_path(f)?.0,
        None => omnirig_transports::FabricSpec::default(),
    };
    let nodes: Vec<&str> = fabric.nodes.iter().map(|n| n.name.as_str()).collect();
    let (wake, after, writes) = measure_engine_writes()
        .context("measuring a parked process's wake-up and a write's cost")?;
    let c = omnirig_harness::host::calibrate(args.calibrate_mib << 20, 2000)
        .context("calibrating the host model")?
        .with_wake(wake)
        .with_wake_after(after)
        .with_writes(writes)
        .with_engine_copy(measure_engine_copy().context("measuring the engine's bulk copy")?)
        .with_checks(
            omnirig_harness::host::measure_checks(CHECK_REPEATS, WAKE_GAP)
                .context("timing the stubs' whole-tensor check")?,
        )
        .with_packets(
            omnirig_harness::host::measure_packets(PACKET_REPEATS, WAKE_GAP)
                .context("timing a packet's decode")?,
        );
    let yaml = c.cpu_yaml(&nodes);
    print!("{yaml}");
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        std::fs::write(dir.join("cpu.yaml"), &yaml)?;
        std::fs::write(
            dir.join("cpu-calibration.json"),
            serde_json::to_string_pretty(&c)?,
        )?;
        println!("written: {}", dir.display());
    }
    Ok(())
}

/// Pause before each cold write: long enough that both processes park (the busy-poll is
/// 50 us) and sink as deep as they do between a pipeline's requests; shorter pauses here
/// measured smaller wakes (1 ms: about 40%).
const WAKE_GAP: std::time::Duration = std::time::Duration::from_millis(10);
const WAKE_REPEATS: usize = 3;
/// Writes in the batch a write's own cost is read from (`write_us`): enough that the batch
/// is mostly per-write work, few enough to stay well under a KV handoff's 96.
const WRITE_BATCH: usize = 32;
/// Checks of each tensor, back to back and after a pause, for the check's cost (about 3 s).
const CHECK_REPEATS: usize = 7;
/// Decodes of each packet, back to back and after a pause (about 2 s).
const PACKET_REPEATS: usize = 15;
/// The pauses of the wake by time parked (`wake_after`): a stage's engine thread waiting
/// for an acknowledgement parks for a fraction of a millisecond, a stage idle between
/// requests for tens to hundreds; the wake grows with the pause (docs/sim.md).
const WAKE_AFTER_GAPS: [std::time::Duration; 3] = [
    std::time::Duration::from_millis(1),
    WAKE_GAP,
    std::time::Duration::from_millis(100),
];

/// An engine's 4 KiB write to a peer process (`bench transfer`'s tcp suite, on the
/// multi-thread runtime `omnirig run` uses), back to back, after each pause of
/// [`WAKE_AFTER_GAPS`], and as a batch of [`WRITE_BATCH`] back to back, [`WAKE_REPEATS`]
/// times, in turn; the medians of the p50s. Returns the sample after [`WAKE_GAP`]
/// (`wake_us`), one per pause (`wake_after`) and the batch against one write (`write_us`).
fn measure_engine_writes() -> anyhow::Result<(
    omnirig_harness::host::WakeSample,
    Vec<omnirig_harness::host::WakeSample>,
    omnirig_harness::host::BatchSample,
)> {
    let p50 = |gap: std::time::Duration, batch: usize| -> anyhow::Result<f64> {
        // 200 writes; 30 after the 100 ms pause (3 s a run)
        let iters = if gap >= std::time::Duration::from_millis(100) {
            30
        } else {
            200
        };
        Ok(engine_write(4096, batch, iters, gap)?.omnirig.p50_us)
    };
    let mut hot = Vec::new();
    let mut batched = Vec::new();
    let mut cold_batched = Vec::new();
    let mut cold = vec![Vec::new(); WAKE_AFTER_GAPS.len()];
    for _ in 0..WAKE_REPEATS {
        hot.push(p50(std::time::Duration::ZERO, 1)?);
        batched.push(p50(std::time::Duration::ZERO, WRITE_BATCH)?);
        cold_batched.push(p50(WAKE_GAP, WRITE_BATCH)?);
        for (c, gap) in cold.iter_mut().zip(WAKE_AFTER_GAPS) {
            c.push(p50(gap, 1)?);
        }
    }
    let hot_us = median(&mut hot);
    let after: Vec<_> = cold
        .iter_mut()
        .zip(WAKE_AFTER_GAPS)
        .map(|(c, gap)| omnirig_harness::host::WakeSample {
            hot_us,
            cold_us: median(c),
            gap_us: gap.as_micros() as u64,
            repeats: WAKE_REPEATS,
        })
        .collect();
    let at_gap = after
        .iter()
        .find(|w| w.gap_us == WAKE_GAP.as_micros() as u64)
        .cloned()
        .context("WAKE_AFTER_GAPS holds WAKE_GAP")?;
    let writes = omnirig_harness::host::BatchSample {
        size: 4096,
        batch: WRITE_BATCH,
        single_us: hot_us,
        batch_us: median(&mut batched),
        cold_single_us: Some(at_gap.cold_us),
        cold_batch_us: Some(median(&mut cold_batched)),
        cold_gap_us: WAKE_GAP.as_micros() as u64,
        repeats: WAKE_REPEATS,
    };
    Ok((at_gap, after, writes))
}

/// `bench transfer`'s tcp write row for `iters` transfers of `batch` writes of `size` bytes
/// each to a peer process, `gap` before each, on the multi-thread runtime `omnirig run` uses.
fn engine_write(
    size: u64,
    batch: usize,
    iters: usize,
    gap: std::time::Duration,
) -> anyhow::Result<crate::bench::Row> {
    use crate::bench::transfer;
    let o = transfer::Options {
        transport: omnirig_transports::TransportKind::Tcp,
        sizes: vec![size],
        budget: u64::MAX,
        min_iters: iters,
        max_iters: iters,
        tcp: omnirig_transports::TcpConfig::default(),
        perftest_seconds: 0,
        rounds: 1,
        completion_spin: None,
        max_outstanding: None,
        runtime: transfer::Runtime::Multi,
        gap: transfer::Gap::asleep(gap),
        batch,
        peer: None,
        peer_wait: std::time::Duration::ZERO,
        rdma: Default::default(),
    };
    transfer::run(&o)?
        .rows
        .into_iter()
        .find(|r| r.op == "write")
        .context("bench transfer returned no write row")
}

/// The engine's bulk transfer the copy is read from: [`COPY_BATCH`] writes of
/// [`COPY_WRITE_BYTES`] (128 MiB, a KV handoff's order), [`COPY_ITERS`] timed back to back.
const COPY_WRITE_BYTES: u64 = 16 << 20;
const COPY_BATCH: usize = 8;
const COPY_ITERS: usize = 10;

/// An engine's bulk transfer to a peer process (`bench transfer`'s tcp suite on the
/// multi-thread runtime, as [`measure_engine_writes`]), [`WAKE_REPEATS`] times: the medians
/// of its p50 and of both processes' CPU time per byte.
fn measure_engine_copy() -> anyhow::Result<omnirig_harness::host::EngineCopySample> {
    let mut walls = Vec::new();
    let mut cpus = Vec::new();
    let mut cores = Vec::new();
    for _ in 0..WAKE_REPEATS {
        let w = engine_write(
            COPY_WRITE_BYTES,
            COPY_BATCH,
            COPY_ITERS,
            std::time::Duration::ZERO,
        )?;
        walls.push(w.omnirig.p50_us);
        let no_cpu = || anyhow::anyhow!("no CPU time (it is read from Linux's /proc schedstat)");
        cpus.push(w.cpu_ns_per_byte.ok_or_else(no_cpu)?);
        cores.push(w.cpu_cores.ok_or_else(no_cpu)?);
    }
    Ok(omnirig_harness::host::EngineCopySample {
        size: COPY_WRITE_BYTES,
        batch: COPY_BATCH,
        wall_us: median(&mut walls),
        cpu_ns_per_byte: median(&mut cpus),
        cpu_cores: median(&mut cores),
        repeats: WAKE_REPEATS,
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct HopPrediction {
    pub hop: String,
    pub transfer_ms_p50: f64,
    pub transfer_ms_p99: f64,
    pub handoff_ms_p50: f64,
    pub handoff_ms_p99: f64,
    /// Where the handoff's time goes (reserve, transfer, fence, verify, ack), as a report's.
    pub phases_ms_p50: omnirig_harness::stage::HandoffPhases,
}

#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    pub concurrency: usize,
    pub requests: usize,
    pub ok: usize,
    pub hops: Vec<HopPrediction>,
    pub e2e_ms_p50: f64,
    pub e2e_ms_p99: f64,
    pub throughput_rps: f64,
    /// Each hop's transfers by payload size (not scored).
    pub sizes: Vec<SizeFigure>,
    /// The busiest fabric queues, utilisation in [0, 1].
    pub busiest: Vec<(String, f64)>,
    pub modelled_s: f64,
    pub real_s: f64,
}

/// A measured report's text: plain JSON, or gzipped (the committed ones under docs/results/sim
/// are, to keep the tree small), told apart by gzip's magic bytes rather than the file's name.
fn read_report_text(p: &std::path::Path) -> anyhow::Result<String> {
    use std::io::Read;
    let bytes = std::fs::read(p).with_context(|| p.display().to_string())?;
    if !bytes.starts_with(&[0x1f, 0x8b]) {
        return String::from_utf8(bytes)
            .with_context(|| format!("{}: not UTF-8 text", p.display()));
    }
    // A report is a few hundred KiB; a bound keeps a corrupt or hostile file from filling memory.
    const MAX_REPORT: u64 = 256 << 20;
    let mut text = String::new();
    flate2::read::MultiGzDecoder::new(&bytes[..])
        .take(MAX_REPORT + 1)
        .read_to_string(&mut text)
        .with_context(|| {
            format!(
                "{}: gzip data that does not decompress to text",
                p.display()
            )
        })?;
    anyhow::ensure!(
        text.len() as u64 <= MAX_REPORT,
        "{}: decompresses to more than {} MiB, larger than any report",
        p.display(),
        MAX_REPORT >> 20
    );
    Ok(text)
}

/// One predicted-against-measured figure.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub concurrency: usize,
    /// A hop's `handoff p50`, or `e2e p50`.
    pub what: String,
    pub predicted_ms: f64,
    /// The median over the measured runs at this concurrency.
    pub measured_ms: f64,
    /// The fastest and slowest of those runs, and how many there were.
    pub measured_min_ms: f64,
    pub measured_max_ms: f64,
    pub runs: usize,
    /// (predicted - measured) / measured.
    pub error: f64,
}

/// One hop's transfers of one payload size: the p50s over them alone.
///
/// A hop's p50 is taken over a mix of payload sizes, and where the sizes' times overlap it
/// can sit at a boundary between two of them and jump from run to run; the figures by size
/// show which transfers a miss comes from. Diagnostic: not one of the scored figures.
#[derive(Debug, Clone, Serialize)]
pub struct SizeFigure {
    pub hop: String,
    /// The payload's bytes (a request's whole handoff on this hop).
    pub bytes: u64,
    /// Transfers of this size the figures are over.
    pub transfers: usize,
    pub transfer_ms_p50: f64,
    pub handoff_ms_p50: f64,
}

/// A hop's place in pipeline order, its name and a payload size.
type SizeKey<'a> = (usize, &'a str, u64);
/// Transfer and handoff times (ms) of one `SizeKey`'s transfers.
type SizeTimes = (Vec<f64>, Vec<f64>);

/// Every hop's transfers in `reports`, pooled, by hop (pipeline order) and payload size.
fn by_size(reports: &[&Report]) -> Vec<SizeFigure> {
    use omnirig_harness::report::percentile;
    let mut at: std::collections::BTreeMap<SizeKey, SizeTimes> = Default::default();
    let order = omnirig_fixtures::PayloadKind::ALL.map(|k| k.as_str());
    for r in reports.iter().flat_map(|r| &r.requests) {
        for h in &r.hops {
            let rank = order
                .iter()
                .position(|k| *k == h.hop)
                .unwrap_or(order.len());
            let e = at.entry((rank, h.hop.as_str(), h.bytes)).or_default();
            e.0.push(h.transfer_ms);
            e.1.push(h.handoff_ms);
        }
    }
    at.into_iter()
        .map(|((_, hop, bytes), (t, h))| SizeFigure {
            hop: hop.into(),
            bytes,
            transfers: t.len(),
            transfer_ms_p50: percentile(&t, 50.0),
            handoff_ms_p50: percentile(&h, 50.0),
        })
        .collect()
}

fn hops_of(r: &Report) -> Vec<HopPrediction> {
    r.hops
        .iter()
        .map(|h| HopPrediction {
            hop: h.hop.clone(),
            transfer_ms_p50: h.transfer_ms_p50,
            transfer_ms_p99: h.transfer_ms_p99,
            handoff_ms_p50: h.handoff_ms_p50,
            handoff_ms_p99: h.handoff_ms_p99,
            phases_ms_p50: h.phases_ms_p50,
        })
        .collect()
}

/// The scenario at concurrency `c`, with enough requests for percentiles.
fn at_concurrency(base: &Scenario, c: usize, rounds: u32) -> Scenario {
    let mut s = base.clone();
    s.concurrency = c;
    let per_round: u32 = s.requests.iter().map(|r| r.repeat).sum();
    let want = (c as u32).saturating_mul(rounds).max(per_round);
    let times = want.div_ceil(per_round.max(1));
    for r in &mut s.requests {
        r.repeat = r.repeat.saturating_mul(times);
    }
    s
}

pub fn predict(
    base: &Scenario,
    c: usize,
    rounds: u32,
    seed: Option<u64>,
) -> anyhow::Result<Prediction> {
    let s = at_concurrency(base, c, rounds);
    let run = sim::run(&s, seed).with_context(|| format!("simulating concurrency {c}"))?;
    let r = &run.report;
    Ok(Prediction {
        concurrency: c,
        requests: r.summary.requests,
        ok: r.summary.ok,
        hops: hops_of(r),
        sizes: by_size(&[r]),
        e2e_ms_p50: r.summary.e2e_p50_ms,
        e2e_ms_p99: r.summary.e2e_p99_ms,
        throughput_rps: r.summary.throughput_rps,
        busiest: run.utilisation().into_iter().take(3).collect(),
        modelled_s: run.virtual_s,
        real_s: run.real_s,
    })
}

/// The prediction against every measured run of its concurrency (`ms`: at least one):
/// each figure against the runs' median.
fn compare(p: &Prediction, ms: &[&Report]) -> Vec<Comparison> {
    let mut out = Vec::new();
    let mut push = |what: String, predicted_ms: f64, measured: &mut Vec<f64>| {
        measured.retain(|&x| x > 0.0);
        if measured.is_empty() {
            return;
        }
        let measured_ms = median(measured);
        out.push(Comparison {
            concurrency: p.concurrency,
            what,
            predicted_ms,
            measured_ms,
            measured_min_ms: measured[0],
            measured_max_ms: measured[measured.len() - 1],
            runs: measured.len(),
            error: (predicted_ms - measured_ms) / measured_ms,
        });
    };
    for h in &p.hops {
        let hops: Vec<_> = ms
            .iter()
            .filter_map(|m| m.hops.iter().find(|x| x.hop == h.hop))
            .collect();
        push(
            format!("{} transfer p50", h.hop),
            h.transfer_ms_p50,
            &mut hops.iter().map(|x| x.transfer_ms_p50).collect(),
        );
        push(
            format!("{} handoff p50", h.hop),
            h.handoff_ms_p50,
            &mut hops.iter().map(|x| x.handoff_ms_p50).collect(),
        );
    }
    push(
        "e2e p50".into(),
        p.e2e_ms_p50,
        &mut ms.iter().map(|m| m.summary.e2e_p50_ms).collect(),
    );
    out
}

fn table(preds: &[Prediction]) -> String {
    let mut t = String::from(
        "| concurrency | hop | transfer p50 ms | transfer p99 ms | handoff p50 ms | handoff p99 ms |\n\
         |---|---|---|---|---|---|\n",
    );
    for p in preds {
        for h in &p.hops {
            t += &format!(
                "| {} | {} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
                p.concurrency,
                h.hop,
                h.transfer_ms_p50,
                h.transfer_ms_p99,
                h.handoff_ms_p50,
                h.handoff_ms_p99
            );
        }
    }
    t += "\n| concurrency | requests ok | e2e p50 ms | e2e p99 ms | throughput req/s | busiest queue (utilisation) |\n\
          |---|---|---|---|---|---|\n";
    for p in preds {
        t += &format!(
            "| {} | {}/{} | {:.3} | {:.3} | {:.1} | {} |\n",
            p.concurrency,
            p.ok,
            p.requests,
            p.e2e_ms_p50,
            p.e2e_ms_p99,
            p.throughput_rps,
            p.busiest
                .iter()
                .map(|(q, u)| format!("{q} {:.0}%", u * 100.0))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    t
}

/// Each hop's transfers by payload size, predicted against the measured runs' pooled (not
/// scored): where a miss of a hop's p50 comes from.
fn size_table(preds: &[Prediction], measured: &[Report]) -> String {
    let mut t = String::from(
        "By payload size (not scored: a hop's p50 mixes sizes; these show which size a miss comes from):\n\n\
         | concurrency | hop | payload | transfers (predicted / measured) | transfer p50 ms predicted | measured | error | handoff p50 ms predicted | measured | error |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut rows = 0;
    for p in preds {
        let ms: Vec<&Report> = measured
            .iter()
            .filter(|m| m.concurrency == p.concurrency)
            .collect();
        if ms.is_empty() {
            continue;
        }
        let m = by_size(&ms);
        for s in &p.sizes {
            let Some(x) = m.iter().find(|x| x.hop == s.hop && x.bytes == s.bytes) else {
                continue;
            };
            let err = |p: f64, m: f64| {
                if m > 0.0 {
                    format!("{:+.1}%", (p - m) / m * 100.0)
                } else {
                    "-".into()
                }
            };
            t += &format!(
                "| {} | {} | {} | {} / {} | {:.3} | {:.3} | {} | {:.3} | {:.3} | {} |\n",
                p.concurrency,
                s.hop,
                crate::bench::human_size_approx(s.bytes),
                s.transfers,
                x.transfers,
                s.transfer_ms_p50,
                x.transfer_ms_p50,
                err(s.transfer_ms_p50, x.transfer_ms_p50),
                s.handoff_ms_p50,
                x.handoff_ms_p50,
                err(s.handoff_ms_p50, x.handoff_ms_p50),
            );
            rows += 1;
        }
    }
    if rows == 0 { String::new() } else { t }
}

fn comparison_table(cmp: &[Comparison]) -> String {
    let mut t = String::from(
        "| concurrency | figure | predicted ms | measured ms (median) | measured min-max ms | runs | error | within 20% |\n|---|---|---|---|---|---|---|---|\n",
    );
    for c in cmp {
        t += &format!(
            "| {} | {} | {:.3} | {:.3} | {:.3}-{:.3} | {} | {:+.1}% | {} |\n",
            c.concurrency,
            c.what,
            c.predicted_ms,
            c.measured_ms,
            c.measured_min_ms,
            c.measured_max_ms,
            c.runs,
            c.error * 100.0,
            if c.error.abs() <= 0.2 { "yes" } else { "no" }
        );
    }
    t
}

/// Predicted against measured, log-log, with the y = x line and the 20% band.
fn plot(cmp: &[Comparison], path: &Path) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let lo = cmp
        .iter()
        .flat_map(|c| [c.predicted_ms, c.measured_ms])
        .fold(f64::INFINITY, f64::min)
        .max(1e-4)
        / 2.0;
    let hi = cmp
        .iter()
        .flat_map(|c| [c.predicted_ms, c.measured_ms])
        .fold(0.0, f64::max)
        * 2.0;
    crate::report::plot::register_font();
    let root = SVGBackend::new(path, (720, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "simulate: predicted vs measured p50 (ms)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((lo..hi).log_scale(), (lo..hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("measured p50, ms")
        .y_desc("predicted p50, ms")
        .draw()?;
    for (k, style) in [
        (1.0, BLACK),
        (1.2, RGBColor(150, 150, 150)),
        (0.8, RGBColor(150, 150, 150)),
    ] {
        chart.draw_series(LineSeries::new(
            [(lo, lo * k), (hi, hi * k)],
            style.stroke_width(1),
        ))?;
    }
    chart.draw_series(cmp.iter().map(|c| {
        let color = if c.what.starts_with("e2e") {
            RED
        } else if c.what.ends_with("transfer p50") {
            GREEN
        } else {
            BLUE
        };
        Circle::new((c.measured_ms, c.predicted_ms), 4, color.filled())
    }))?;
    root.present()?;
    Ok(())
}

/// The scale model's answer as two plots: each hop's handoff p50 and the end-to-end p50
/// against concurrency (log-log), and the busiest fabric queue's utilisation against
/// concurrency (where the links saturate).
fn plot_levels(preds: &[Prediction], latency: &Path, utilisation: &Path) -> anyhow::Result<()> {
    use plotters::prelude::*;
    if preds.is_empty() {
        return Ok(());
    }
    crate::report::plot::register_font();
    let cmin = preds.iter().map(|p| p.concurrency).min().unwrap_or(1) as f64;
    let cmax = preds.iter().map(|p| p.concurrency).max().unwrap_or(1) as f64;
    let (x0, x1) = (cmin / 1.5, cmax * 1.5);
    let mut names: Vec<&str> = Vec::new();
    for p in preds {
        for h in &p.hops {
            if !names.contains(&h.hop.as_str()) {
                names.push(&h.hop);
            }
        }
    }
    let mut series: Vec<(String, Vec<(f64, f64)>)> = names
        .iter()
        .map(|&n| {
            let pts = preds
                .iter()
                .filter_map(|p| {
                    let h = p.hops.iter().find(|h| h.hop == n)?;
                    Some((p.concurrency as f64, h.handoff_ms_p50))
                })
                .collect();
            (format!("{n} handoff p50"), pts)
        })
        .collect();
    series.push((
        "end to end p50".into(),
        preds
            .iter()
            .map(|p| (p.concurrency as f64, p.e2e_ms_p50))
            .collect(),
    ));
    let ys = series.iter().flat_map(|(_, v)| v.iter().map(|&(_, y)| y));
    let lo = ys
        .clone()
        .filter(|&y| y > 0.0)
        .fold(f64::INFINITY, f64::min)
        .min(1.0)
        / 2.0;
    // Headroom above the end-to-end line for the legend.
    let hi = ys.fold(0.0, f64::max).max(lo * 4.0) * 40.0;
    let root = SVGBackend::new(latency, (760, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("simulate: latency against concurrency", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x0..x1).log_scale(), (lo..hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("requests in flight")
        .y_desc("p50, ms")
        .draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = if name.starts_with("end to end") {
            BLACK.to_rgba()
        } else {
            Palette99::pick(i).to_rgba()
        };
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;

    let root = SVGBackend::new(utilisation, (760, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let busiest: Vec<(f64, f64, &str)> = preds
        .iter()
        .filter_map(|p| {
            let (q, u) = p.busiest.first()?;
            Some((p.concurrency as f64, u * 100.0, q.as_str()))
        })
        .collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "simulate: busiest fabric queue against concurrency",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        // Room on the right for the last level's label.
        .build_cartesian_2d((x0..x1 * 2.0).log_scale(), 0.0..100.0)?;
    chart
        .configure_mesh()
        .x_desc("requests in flight")
        .y_desc("utilisation, %")
        .draw()?;
    chart.draw_series(LineSeries::new(
        busiest.iter().map(|&(c, u, _)| (c, u)),
        RED.stroke_width(2),
    ))?;
    for &(c, u, q) in &busiest {
        chart.draw_series([Circle::new((c, u), 4, RED.filled())])?;
        chart.draw_series([Text::new(
            format!("{q} {u:.0}%"),
            (c, u + 3.0),
            ("sans-serif", 12),
        )])?;
    }
    root.present()?;
    Ok(())
}

pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    if args.calibrate_cpu {
        return calibrate(&args);
    }
    let mut scenario = match &args.scenario {
        Some(p) => Scenario::from_path(p)?,
        None => Scenario::default_scenario(),
    };
    if let Some(f) = &args.fabric {
        let (fabric, cpu) = sim::fabric_file_from_path(f)?;
        scenario.fabric = Some(fabric);
        if cpu.is_some() {
            scenario.cpu = cpu;
        }
    }
    let levels: Vec<usize> = args
        .concurrency
        .split(',')
        .map(|x| {
            x.trim()
                .parse::<usize>()
                .ok()
                .filter(|&c| (1..=omnirig_harness::scenario::MAX_CONCURRENCY).contains(&c))
                .with_context(|| format!("--concurrency: {x:?} is not a concurrency"))
        })
        .collect::<anyhow::Result<_>>()?;
    let measured: Vec<Report> = args
        .measured
        .iter()
        .map(|p| -> anyhow::Result<Report> {
            let text = read_report_text(p)?;
            serde_json::from_str(&text).with_context(|| format!("{}: not a report", p.display()))
        })
        .collect::<anyhow::Result<_>>()?;
    if let Some(dir) = &args.scenarios_out {
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        for &c in &levels {
            let s = at_concurrency(&scenario, c, args.rounds);
            let path = dir.join(format!("scenario-c{c}.yaml"));
            // JSON is YAML: the scenario loader reads it back as written.
            std::fs::write(&path, serde_json::to_string_pretty(&s)?)
                .with_context(|| path.display().to_string())?;
        }
    }
    let mut preds = Vec::new();
    for &c in &levels {
        let p = predict(&scenario, c, args.rounds, args.seed)?;
        eprintln!(
            "[simulate] concurrency {c}: {} requests, {:.3} s modelled in {:.2} s",
            p.requests, p.modelled_s, p.real_s
        );
        preds.push(p);
    }
    let mut md = table(&preds);
    let mut cmp = Vec::new();
    for p in &preds {
        let ms: Vec<&Report> = measured
            .iter()
            .filter(|m| m.concurrency == p.concurrency)
            .collect();
        if !ms.is_empty() {
            cmp.extend(compare(p, &ms));
        }
    }
    if !cmp.is_empty() {
        let sizes = size_table(&preds, &measured);
        if !sizes.is_empty() {
            md += "\n";
            md += &sizes;
        }
        md += "\n";
        md += &comparison_table(&cmp);
        md += &format!(
            "\n{} of {} figures within 20% of the measured median.\n",
            cmp.iter().filter(|c| c.error.abs() <= 0.2).count(),
            cmp.len()
        );
    }
    print!("{md}");
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        #[derive(Serialize)]
        struct Out<'a> {
            scenario: &'a str,
            fabric: &'a Option<omnirig_transports::FabricSpec>,
            cpu: &'a Option<omnirig_harness::host::CpuSpec>,
            predictions: &'a [Prediction],
            comparison: &'a [Comparison],
        }
        let json = serde_json::to_string_pretty(&Out {
            scenario: &scenario.name,
            fabric: &scenario.fabric,
            cpu: &scenario.cpu,
            predictions: &preds,
            comparison: &cmp,
        })?;
        std::fs::write(dir.join("simulate.json"), json)?;
        std::fs::write(dir.join("simulate.md"), &md)?;
        plot_levels(
            &preds,
            &dir.join("latency_vs_concurrency.svg"),
            &dir.join("utilisation_vs_concurrency.svg"),
        )?;
        if !cmp.is_empty() {
            plot(&cmp, &dir.join("predicted_vs_measured.svg"))?;
        }
        println!("written: {}", dir.display());
    }
    Ok(())
}
