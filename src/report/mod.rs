//! `omnirig report RESULTS.json... --out DIR` and `omnirig run --report DIR`: one writer for
//! both. It writes `DIR/index.html` (one self-contained page: per suite and hop the verdict
//! lines, the tables against each baseline with the plain-socket or memcpy floor, and the
//! figures inline as SVG), `DIR/summary.md` (the same tables and verdicts, for pasting into an
//! issue) and every figure as `NAME.png` and `NAME.svg`. Every file is written to a temporary
//! name and renamed into place.
//!
//! Figures (small multiples, see [`plot`]):
//! - `bandwidth`: transfer suite, GB/s against payload size, one panel per transport and op,
//!   the floor (memcpy, raw socket, ib_write_bw) in grey.
//! - `latency-cdf-<hop>`: hop round-trip CDFs, one panel per case and transport, omnirig and
//!   pickle, pickle5-oob, pickle-shm measured interleaved in that run, the plain-socket floor's
//!   p50 as a vertical line; `bandwidth-<hop>`: GB/s per case size, one panel per transport.
//! - `pipeline`: end-to-end p50, p99 and throughput against concurrency (`bench pipeline`).
//! - `run-cdf`: a run's per-hop transfer and handoff CDFs; `run-timeline`: per request and
//!   stage, receive / compute / send.
//!
//! Text is drawn with an embedded DejaVu Sans (fonts/, Bitstream Vera licence), so no system
//! font library is needed.

pub mod html;
pub mod plot;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use omnirig_harness::Report;

use crate::bench::{Results, Row};
use html::{Block, FigureRef, Page, Section, Table};
use plot::{Axis, Body, Figure, Line, Method, Panel, Unit, Wire, human_bytes, human_time};

#[allow(unused_imports)]
pub use plot::stage_spans;

/// One input file.
pub enum Input {
    Bench(Results),
    Run(Box<Report>),
}

/// Inputs larger than this are refused (results and reports are a few MiB at most).
pub const MAX_INPUT_BYTES: u64 = 256 << 20;

pub fn load(path: &Path) -> anyhow::Result<Input> {
    use std::io::Read;
    // Only regular files, and only so much of them: /dev/zero or a FIFO would be read forever.
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if !meta.is_file() {
        anyhow::bail!("{}: not a regular file", path.display());
    }
    if meta.len() > MAX_INPUT_BYTES {
        anyhow::bail!(
            "{}: {} bytes, more than the {MAX_INPUT_BYTES} an input may have",
            path.display(),
            meta.len()
        );
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_INPUT_BYTES + 1).read_to_string(&mut text))
        .with_context(|| format!("reading {}", path.display()))?;
    if text.len() as u64 > MAX_INPUT_BYTES {
        anyhow::bail!(
            "{}: grew past {MAX_INPUT_BYTES} bytes while read",
            path.display()
        );
    }
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    if v.get("report_version").is_some() {
        Ok(Input::Run(Box::new(
            serde_json::from_value(v)
                .with_context(|| format!("{}: not a run report", path.display()))?,
        )))
    } else {
        Ok(Input::Bench(serde_json::from_value(v).with_context(
            || format!("{}: not a benchmark result", path.display()),
        )?))
    }
}

/// The benchmark results among `inputs` as markdown tables, one per file, in the order given;
/// run reports are skipped (their plots say more). Errors if there is no benchmark result.
pub fn markdown(inputs: &[PathBuf]) -> anyhow::Result<String> {
    let mut out = String::new();
    for p in inputs {
        if let Input::Bench(r) = load(p)? {
            if !out.is_empty() {
                out.push('\n');
            }
            out += &format!(
                "<!-- written by `omnirig report --markdown` from {} -->\n",
                p.display()
            );
            out += &r.markdown();
        }
    }
    if out.is_empty() {
        anyhow::bail!("no benchmark results among the inputs (run reports have no table)");
    }
    Ok(out)
}

/// Loads `inputs` and writes the report into `out` (see the module doc); returns the files
/// written, `index.html` first.
pub fn write_site(inputs: &[PathBuf], out: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut sources = Vec::new();
    for p in inputs {
        sources.push((p.display().to_string(), load(p)?));
    }
    write(sources, out, None)
}

/// The report of one run, into its report directory, next to its `report.json`.
/// The run happened on this host, so its page names it (report.json does not record it).
pub fn write_run_site(report: &Report, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    write(
        vec![(
            "report.json".to_string(),
            Input::Run(Box::new(report.clone())),
        )],
        dir,
        Some(crate::bench::Machine::this().label()),
    )
}

fn write(
    sources: Vec<(String, Input)>,
    out: &Path,
    run_host: Option<String>,
) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let (page, figures) = build(&sources, run_host.as_deref())?;
    let mut files = page.write(out)?;
    for f in &figures {
        files.push(f.write_png(out)?);
        let svg = f.svg()?;
        files.push(html::write_atomic(
            &out.join(format!("{}.svg", f.name)),
            svg.as_bytes(),
        )?);
    }
    Ok(files)
}

/// The page and the figures it shows; `run_host` names the machine the run reports ran on,
/// when the caller knows it.
pub fn build(
    sources: &[(String, Input)],
    run_host: Option<&str>,
) -> anyhow::Result<(Page, Vec<Figure>)> {
    let mut page = Page {
        title: "omnirig report".into(),
        ..Default::default()
    };
    let names: Vec<&str> = sources.iter().map(|s| s.0.as_str()).collect();
    page.meta
        .push(format!("Written by omnirig from: {}", names.join(", ")));
    let mut machines: Vec<String> = sources
        .iter()
        .filter_map(|s| match &s.1 {
            Input::Bench(r) => r.machine.as_ref().map(|m| m.label()),
            Input::Run(_) => None,
        })
        .collect();
    machines.sort();
    machines.dedup();
    if !machines.is_empty() {
        page.meta
            .push(format!("Benchmarks measured on: {}", machines.join("; ")));
    }
    if let Some(h) = run_host {
        page.meta.push(format!("Run on: {h}"));
    }
    let mut figures = Vec::new();
    let bench: Vec<(&str, &Results)> = sources
        .iter()
        .filter_map(|(n, i)| match i {
            Input::Bench(r) => Some((n.as_str(), r)),
            Input::Run(_) => None,
        })
        .collect();

    // Transfer suite.
    let mut transfers: Vec<_> = bench
        .iter()
        .filter(|r| r.1.suite == "transfer")
        .copied()
        .collect();
    transfers.sort_by_key(|(name, r)| (Wire::parse(&r.transport), name.to_string()));
    if !transfers.is_empty() {
        let mut sec = section(
            "transfer",
            "Transfer suite: engine against the physical floor",
        );
        for (name, r) in &transfers {
            sec.blocks.push(Block::Heading(format!(
                "omnirig over {} ({name})",
                r.transport
            )));
            sec.blocks
                .push(Block::Verdicts(crate::bench::transfer::verdicts(r)));
            sec.blocks.push(Block::Table(transfer_table(r)));
        }
        add_figure(&mut sec, &mut figures, transfer_figure(&transfers))?;
        page.sections.push(sec);
    }

    // Hop suite, one section per hop.
    let mut hops: BTreeMap<(usize, String), Vec<(&str, Results)>> = BTreeMap::new();
    for (name, r) in bench.iter().filter(|r| r.1.suite == "hop") {
        let mut by_hop: BTreeMap<String, Vec<Row>> = BTreeMap::new();
        for row in &r.rows {
            by_hop
                .entry(row.hop.clone().unwrap_or_else(|| "hop".into()))
                .or_default()
                .push(row.clone());
        }
        for (hop, rows) in by_hop {
            let order = ["ec", "kv", "thinker-talker", "talker-code2wav"]
                .iter()
                .position(|h| *h == hop)
                .unwrap_or(usize::MAX);
            hops.entry((order, hop)).or_default().push((
                name,
                Results {
                    rows,
                    ..(*r).clone()
                },
            ));
        }
    }
    // tcp, then shm, loopback, rdma: the same order in every table and figure.
    for runs in hops.values_mut() {
        runs.sort_by_key(|(name, r)| (Wire::parse(&r.transport), name.to_string()));
    }
    for ((_, hop), runs) in &hops {
        let mut sec = section(
            &format!("hop-{hop}"),
            &format!("{hop} hop: omnirig against the pickle baselines"),
        );
        sec.blocks.push(Block::Para(
            "p50 ratio: the baseline's p50 round trip over omnirig's (above 1: omnirig is \
             faster); rate ratio: the same with mean rates. The floor: the same bytes \
             through a plain TCP socket between the same CPUs, measured in the same run."
                .into(),
        ));
        for (name, r) in runs {
            sec.blocks.push(Block::Heading(format!(
                "omnirig over {} ({name})",
                r.transport
            )));
            sec.blocks
                .push(Block::Verdicts(crate::bench::hop::verdicts(r)));
            sec.blocks.push(Block::Table(hop_table(r)));
        }
        let runs: Vec<&Results> = runs.iter().map(|r| &r.1).collect();
        if let Some(f) = hop_cdf_figure(hop, &runs) {
            add_figure(&mut sec, &mut figures, f)?;
        }
        if let Some(f) = hop_bandwidth_figure(hop, &runs) {
            add_figure(&mut sec, &mut figures, f)?;
        }
        page.sections.push(sec);
    }

    // Pipeline suite.
    let mut pipes: Vec<_> = bench
        .iter()
        .filter(|r| r.1.suite == "pipeline")
        .copied()
        .collect();
    pipes.sort_by_key(|(name, r)| (Wire::parse(&r.transport), name.to_string()));
    if !pipes.is_empty() {
        let mut sec = section("pipeline", "Five-stage pipeline against pickle over ZMQ");
        for (name, r) in &pipes {
            sec.blocks.push(Block::Heading(format!(
                "omnirig over {} ({name})",
                r.transport
            )));
            sec.blocks
                .push(Block::Verdicts(crate::bench::pipeline::verdicts(r)));
            sec.blocks.push(Block::Table(pipeline_table(r)));
        }
        add_figure(&mut sec, &mut figures, pipeline_figure(&pipes))?;
        page.sections.push(sec);
    }

    // Run reports.
    let runs: Vec<(&str, &Report)> = sources
        .iter()
        .filter_map(|(n, i)| match i {
            Input::Run(r) => Some((n.as_str(), &**r)),
            Input::Bench(_) => None,
        })
        .collect();
    for (i, (name, r)) in runs.iter().enumerate() {
        let sfx = if runs.len() > 1 {
            format!("-{i}")
        } else {
            String::new()
        };
        let mut sec = section(
            &format!("run{sfx}"),
            &format!(
                "Run {} ({}, concurrency {}, {name})",
                r.scenario, r.mode, r.concurrency
            ),
        );
        sec.blocks.push(Block::Verdicts(run_verdicts(r)));
        sec.blocks.push(Block::Table(run_hop_table(r)));
        sec.blocks.push(Block::Table(run_phase_table(r)));
        let failed: Vec<_> = r.requests.iter().filter(|q| !q.ok).collect();
        if !failed.is_empty() {
            let mut t = Table::new(&[("request", false), ("error", false)]);
            for q in failed {
                t.push(vec![q.id.clone(), q.error.clone().unwrap_or_default()]);
            }
            sec.blocks.push(Block::Heading("Failed requests".into()));
            sec.blocks.push(Block::Table(t));
        }
        sec.blocks.push(Block::Pre(r.summary_text()));
        if let Some(f) = run_cdf_figure(r, &sfx, run_host) {
            add_figure(&mut sec, &mut figures, f)?;
        }
        if !r.requests.is_empty() {
            add_figure(&mut sec, &mut figures, run_timeline_figure(r, &sfx))?;
        }
        page.sections.push(sec);
    }
    if page.sections.is_empty() {
        anyhow::bail!("nothing to report in the inputs");
    }
    Ok((page, figures))
}

fn section(id: &str, title: &str) -> Section {
    Section {
        id: id.into(),
        title: title.into(),
        blocks: vec![],
    }
}

fn add_figure(sec: &mut Section, figures: &mut Vec<Figure>, f: Figure) -> anyhow::Result<()> {
    sec.blocks.push(Block::Figure(FigureRef {
        name: f.name.clone(),
        title: f.title.clone(),
        svg: f.svg()?,
    }));
    figures.push(f);
    Ok(())
}

fn machines(runs: &[&Results]) -> String {
    let mut m: Vec<String> = runs
        .iter()
        .filter_map(|r| r.machine.as_ref().map(|m| m.label()))
        .collect();
    m.sort();
    m.dedup();
    if m.is_empty() {
        "machine not recorded".into()
    } else {
        format!("on {}", m.join("; "))
    }
}

fn transports(runs: &[&Results]) -> String {
    let mut t: Vec<&str> = runs.iter().map(|r| r.transport.as_str()).collect();
    t.dedup();
    and_list(&t)
}

/// "a", "a and b", "a, b and c".
fn and_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => one.to_string(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

fn ratio(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2}x")
    } else {
        "-".into()
    }
}

fn time(us: f64) -> String {
    if us.is_finite() {
        human_time(us)
    } else {
        "-".into()
    }
}

fn p50x(r: &Row) -> f64 {
    r.baseline.p50_us / r.omnirig.p50_us
}

// ---------------------------------------------------------------- tables

fn transfer_table(r: &Results) -> Table {
    let mut t = Table::new(&[
        ("op", false),
        ("size", true),
        ("omnirig GB/s", true),
        ("p50", true),
        ("p99", true),
        ("floor", false),
        ("floor GB/s", true),
        ("floor p50", true),
        ("rate ratio", true),
    ]);
    for x in &r.rows {
        t.push(vec![
            x.op.clone(),
            human_bytes(x.size as f64),
            format!("{:.3}", x.omnirig.gbps),
            time(x.omnirig.p50_us),
            time(x.omnirig.p99_us),
            x.baseline.name.clone(),
            format!("{:.3}", x.baseline.gbps),
            time(x.baseline.p50_us),
            ratio(x.ratio),
        ]);
    }
    t
}

fn hop_table(r: &Results) -> Table {
    let mut t = Table::new(&[
        ("omnirig path", false),
        ("case", false),
        ("size", true),
        ("omnirig p50", true),
        ("p99", true),
        ("baseline", false),
        ("baseline p50", true),
        ("p99", true),
        ("p50 ratio", true),
        ("rate ratio", true),
        ("floor", false),
        ("floor p50", true),
    ]);
    for x in &r.rows {
        t.push(vec![
            x.op.clone(),
            x.case.clone().unwrap_or_default(),
            human_bytes(x.size as f64),
            time(x.omnirig.p50_us),
            time(x.omnirig.p99_us),
            x.baseline.name.clone(),
            time(x.baseline.p50_us),
            time(x.baseline.p99_us.unwrap_or(f64::NAN)),
            ratio(p50x(x)),
            ratio(x.ratio),
            x.floor.as_ref().map(|f| f.name.clone()).unwrap_or_default(),
            x.floor.as_ref().map_or("-".into(), |f| time(f.p50_us)),
        ]);
    }
    t
}

fn pipeline_table(r: &Results) -> Table {
    let mut t = Table::new(&[
        ("concurrency", true),
        ("bytes per request", true),
        ("omnirig p50", true),
        ("p99", true),
        ("baseline", false),
        ("baseline p50", true),
        ("p99", true),
        ("p50 ratio", true),
        ("omnirig req/s", true),
        ("baseline req/s", true),
    ]);
    for x in &r.rows {
        let (to, tb) = x.throughput_rps.unwrap_or((f64::NAN, f64::NAN));
        t.push(vec![
            x.concurrency.map(|c| c.to_string()).unwrap_or_default(),
            human_bytes(x.size as f64),
            time(x.omnirig.p50_us),
            time(x.omnirig.p99_us),
            x.baseline.name.clone(),
            time(x.baseline.p50_us),
            time(x.baseline.p99_us.unwrap_or(f64::NAN)),
            ratio(p50x(x)),
            format!("{to:.1}"),
            format!("{tb:.1}"),
        ]);
    }
    t
}

fn run_verdicts(r: &Report) -> Vec<String> {
    let s = &r.summary;
    vec![format!(
        "{}: {}/{} requests ok (every byte of those verified), pools {}",
        if r.passed() { "PASSED" } else { "FAILED" },
        s.ok,
        s.requests,
        if s.pools_clean {
            "back to zero"
        } else {
            "NOT back to zero"
        },
    )]
}

fn run_hop_table(r: &Report) -> Table {
    let mut t = Table::new(&[
        ("hop", false),
        ("transport", false),
        ("requests", true),
        ("moved", true),
        ("reused", true),
        ("transfer p50", true),
        ("transfer p99", true),
        ("GB/s", true),
        ("handoff p50", true),
        ("handoff p99", true),
    ]);
    for h in &r.hops {
        t.push(vec![
            h.hop.clone(),
            h.transport.clone(),
            h.requests.to_string(),
            human_bytes(h.moved_bytes as f64),
            human_bytes(h.reused_bytes as f64),
            time(h.transfer_ms_p50 * 1e3),
            time(h.transfer_ms_p99 * 1e3),
            format!("{:.3}", h.gbps),
            time(h.handoff_ms_p50 * 1e3),
            time(h.handoff_ms_p99 * 1e3),
        ]);
    }
    t
}

/// Where each hop's handoff time goes (p50 of each phase, as its consumer saw it), beside
/// the engine transfer: what is neither transfer nor verification shows here.
fn run_phase_table(r: &Report) -> Table {
    let mut t = Table::new(&[
        ("hop", false),
        ("handoff p50", true),
        ("reserve + grant", true),
        ("reply wait", true),
        ("of which engine transfer", true),
        ("fence", true),
        ("verify", true),
        ("ack", true),
        ("neither, per handoff p50", true),
        ("share of its transfer", true),
    ]);
    for h in &r.hops {
        let p = &h.phases_ms_p50;
        t.push(vec![
            h.hop.clone(),
            time(h.handoff_ms_p50 * 1e3),
            time(p.reserve * 1e3),
            time(p.transfer * 1e3),
            time(h.transfer_ms_p50 * 1e3),
            time(p.fence * 1e3),
            time(p.verify * 1e3),
            time(p.ack * 1e3),
            time(h.overhead_ms_p50 * 1e3),
            format!("{:.0}%", 100.0 * h.overhead_share_p50),
        ]);
    }
    t
}

// ---------------------------------------------------------------- figures

fn figure(
    name: String,
    title: String,
    subtitle: String,
    cols: usize,
    panels: Vec<Panel>,
) -> Figure {
    Figure {
        name,
        title,
        subtitle,
        body: Body::Panels { cols, panels },
        keys: vec![],
    }
}

fn transfer_figure(runs: &[(&str, &Results)]) -> Figure {
    let mut panels = Vec::new();
    for (_, r) in runs {
        let wire = Wire::parse(&r.transport);
        let mut ops: Vec<&str> = Vec::new();
        for x in &r.rows {
            if !ops.contains(&x.op.as_str()) {
                ops.push(&x.op);
            }
        }
        for op in ops {
            let rows: Vec<&Row> = r.rows.iter().filter(|x| x.op == op).collect();
            let mut p = Panel::new(
                format!("{op} over {}", r.transport),
                Axis::new("payload size", Unit::Bytes, true),
                Axis::new("GB/s (1e9 B/s, log)", Unit::GBps, true),
            );
            p.dots = true;
            p.lines.push(Line {
                method: Method::Omnirig,
                wire,
                pts: rows
                    .iter()
                    .map(|x| (x.size as f64, x.omnirig.gbps))
                    .collect(),
            });
            // One line per method: the tcp floor is the best plain socket per size, whichever
            // variant (polled, blocking) that was.
            let mut methods: Vec<Method> = rows
                .iter()
                .map(|x| Method::of_baseline(&x.baseline.name))
                .collect();
            methods.sort();
            methods.dedup();
            for m in methods {
                let these: Vec<&&Row> = rows
                    .iter()
                    .filter(|x| Method::of_baseline(&x.baseline.name) == m)
                    .collect();
                p.lines.push(Line {
                    method: m,
                    wire: Wire::of_baseline(&these[0].baseline.name),
                    pts: these
                        .iter()
                        .map(|x| (x.size as f64, x.baseline.gbps))
                        .collect(),
                });
            }
            if p.has_data() {
                panels.push(p);
            }
        }
    }
    let rs: Vec<&Results> = runs.iter().map(|r| r.1).collect();
    figure(
        "bandwidth".into(),
        format!(
            "Transfer suite: bandwidth vs payload size, omnirig over {} vs the physical floor",
            transports(&rs)
        ),
        format!("one panel per transport and op; {}", machines(&rs)),
        2,
        panels,
    )
}

/// The omnirig rows of a hop run that carry samples (not the in-process loopback rows).
fn main_rows(r: &Results) -> impl Iterator<Item = &Row> {
    r.rows
        .iter()
        .filter(|x| x.op.starts_with("hop-") && !x.op.starts_with("hop-loopback"))
}

fn cases(runs: &[&Results]) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = Vec::new();
    for r in runs {
        for x in &r.rows {
            let c = x.case.clone().unwrap_or_default();
            if !out.iter().any(|o| o.0 == c) {
                out.push((c, x.size));
            }
        }
    }
    out
}

fn hop_cdf_figure(hop: &str, runs: &[&Results]) -> Option<Figure> {
    let mut panels = Vec::new();
    for (case, size) in cases(runs) {
        for r in runs {
            let rows: Vec<&Row> = main_rows(r)
                .filter(|x| x.case.as_deref().unwrap_or_default() == case)
                .collect();
            let Some(first) = rows.first() else { continue };
            let mut p = Panel::new(
                format!(
                    "{case} ({}), omnirig over {}",
                    human_bytes(size as f64),
                    r.transport
                ),
                Axis::new("round trip (log)", Unit::Micros, true),
                Axis::new("fraction of round trips", Unit::Fraction, false),
            );
            if let Some(s) = &first.omnirig.samples_us {
                p.lines.push(Line {
                    method: Method::Omnirig,
                    wire: Wire::parse(&r.transport),
                    pts: plot::cdf(s),
                });
            }
            for x in &rows {
                if let Some(s) = &x.baseline.samples_us {
                    p.lines.push(Line {
                        method: Method::of_baseline(&x.baseline.name),
                        wire: Wire::of_baseline(&x.baseline.name),
                        pts: plot::cdf(s),
                    });
                }
            }
            if let Some(f) = &first.floor {
                p.marks.push((f.p50_us, Method::Floor));
            }
            if p.has_data() {
                panels.push(p);
            }
        }
    }
    if panels.is_empty() {
        return None;
    }
    let n = runs.len().clamp(2, 3);
    Some(figure(
        format!("latency-cdf-{hop}"),
        format!(
            "{hop} hop: round-trip latency CDF per case, omnirig over {} vs pickle baselines (two processes)",
            transports(runs)
        ),
        format!(
            "one panel per case and transport; each panel's lines measured interleaved in one run; {}",
            machines(runs)
        ),
        n,
        panels,
    ))
}

fn hop_bandwidth_figure(hop: &str, runs: &[&Results]) -> Option<Figure> {
    let mut panels = Vec::new();
    for r in runs {
        let mut p = Panel::new(
            format!("{hop} hop, omnirig over {}", r.transport),
            Axis::new("payload size per handoff", Unit::Bytes, true),
            Axis::new("GB/s (1e9 B/s, log)", Unit::GBps, true),
        );
        p.dots = true;
        let pts = |f: &dyn Fn(&Row) -> Option<f64>, rows: &mut dyn Iterator<Item = &Row>| {
            let mut v: Vec<(f64, f64)> = Vec::new();
            for x in rows {
                if let Some(y) = f(x)
                    && !v.iter().any(|q| q.0 == x.size as f64)
                {
                    v.push((x.size as f64, y));
                }
            }
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            v
        };
        let ours = pts(&|x| Some(x.omnirig.gbps), &mut main_rows(r));
        p.lines.push(Line {
            method: Method::Omnirig,
            wire: Wire::parse(&r.transport),
            pts: ours,
        });
        let lb = pts(
            &|x| Some(x.omnirig.gbps),
            &mut r.rows.iter().filter(|x| x.op.starts_with("hop-loopback")),
        );
        if !lb.is_empty() {
            p.lines.push(Line {
                method: Method::Omnirig,
                wire: Wire::Loopback,
                pts: lb,
            });
        }
        let mut bases: Vec<&str> = r.rows.iter().map(|x| x.baseline.name.as_str()).collect();
        bases.sort();
        bases.dedup();
        for b in bases {
            let v = pts(
                &|x| Some(x.baseline.gbps),
                &mut main_rows(r).filter(|x| x.baseline.name == b),
            );
            p.lines.push(Line {
                method: Method::of_baseline(b),
                wire: Wire::of_baseline(b),
                pts: v,
            });
        }
        let floor = pts(&|x| x.floor.as_ref().map(|f| f.gbps), &mut main_rows(r));
        if !floor.is_empty() {
            p.lines.push(Line {
                method: Method::Floor,
                wire: Wire::Tcp,
                pts: floor,
            });
        }
        if p.has_data() {
            panels.push(p);
        }
    }
    if panels.is_empty() {
        return None;
    }
    Some(figure(
        format!("bandwidth-{hop}"),
        format!(
            "{hop} hop: effective bandwidth per case size, omnirig over {} vs pickle baselines",
            transports(runs)
        ),
        format!(
            "one panel per transport, one point per case (bytes / mean round trip); {}",
            machines(runs)
        ),
        2,
        panels,
    ))
}

fn pipeline_figure(runs: &[(&str, &Results)]) -> Figure {
    let rs: Vec<&Results> = runs.iter().map(|r| r.1).collect();
    let mut lat50 = Panel::new(
        "p50 end-to-end latency".into(),
        Axis::new("requests in flight", Unit::Count, true),
        Axis::new("p50 latency (log)", Unit::Micros, true),
    );
    let mut lat99 = Panel::new(
        "p99 end-to-end latency".into(),
        Axis::new("requests in flight", Unit::Count, true),
        Axis::new("p99 latency (log)", Unit::Micros, true),
    );
    let mut rps = Panel::new(
        "throughput".into(),
        Axis::new("requests in flight", Unit::Count, true),
        Axis::new("requests / s", Unit::Rps, false),
    );
    for p in [&mut lat50, &mut lat99, &mut rps] {
        p.dots = true;
    }
    // omnirig per run; each baseline once (every run measures the same current path; the
    // first run's figures are drawn).
    let mut seen: Vec<String> = Vec::new();
    for r in &rs {
        let rows: Vec<&Row> = r.rows.iter().filter(|x| x.concurrency.is_some()).collect();
        let c = |x: &Row| x.concurrency.unwrap_or(1) as f64;
        let wire = Wire::parse(&r.transport);
        let mut ours: Vec<&Row> = Vec::new();
        for x in &rows {
            if !ours.iter().any(|o| o.concurrency == x.concurrency) {
                ours.push(x);
            }
        }
        let line = |m, w, f: &dyn Fn(&Row) -> f64, rows: &[&Row]| Line {
            method: m,
            wire: w,
            pts: rows.iter().map(|x| (c(x), f(x))).collect(),
        };
        lat50
            .lines
            .push(line(Method::Omnirig, wire, &|x| x.omnirig.p50_us, &ours));
        lat99
            .lines
            .push(line(Method::Omnirig, wire, &|x| x.omnirig.p99_us, &ours));
        rps.lines.push(line(
            Method::Omnirig,
            wire,
            &|x| x.throughput_rps.map_or(f64::NAN, |t| t.0),
            &ours,
        ));
        let mut bases: Vec<&str> = rows.iter().map(|x| x.baseline.name.as_str()).collect();
        bases.sort();
        bases.dedup();
        for b in bases {
            if seen.iter().any(|s| s == b) {
                continue;
            }
            seen.push(b.to_string());
            let brows: Vec<&Row> = rows
                .iter()
                .filter(|x| x.baseline.name == b)
                .copied()
                .collect();
            let (m, w) = (Method::of_baseline(b), Wire::of_baseline(b));
            lat50.lines.push(line(m, w, &|x| x.baseline.p50_us, &brows));
            lat99.lines.push(line(
                m,
                w,
                &|x| x.baseline.p99_us.unwrap_or(f64::NAN),
                &brows,
            ));
            rps.lines.push(line(
                m,
                w,
                &|x| x.throughput_rps.map_or(f64::NAN, |t| t.1),
                &brows,
            ));
        }
    }
    let panels = [lat50, lat99, rps]
        .into_iter()
        .filter(Panel::has_data)
        .collect();
    figure(
        "pipeline".into(),
        format!(
            "Five-stage pipeline vs concurrency: omnirig over {} vs pickle over ZMQ",
            transports(&rs)
        ),
        format!("stages as processes on one host; {}", machines(&rs)),
        2,
        panels,
    )
}

fn run_cdf_figure(r: &Report, sfx: &str, host: Option<&str>) -> Option<Figure> {
    let mut panels = Vec::new();
    for h in &r.hops {
        let mut t: Vec<f64> = Vec::new();
        let mut hd: Vec<f64> = Vec::new();
        for q in &r.requests {
            for x in q.hops.iter().filter(|x| x.hop == h.hop) {
                t.push(x.transfer_ms * 1e3);
                hd.push(x.handoff_ms * 1e3);
            }
        }
        for (what, v) in [("engine transfer", t), ("handoff (offer to verified)", hd)] {
            let mut p = Panel::new(
                format!("{} over {}: {what}", h.hop, h.transport),
                Axis::new("latency (log)", Unit::Micros, true),
                Axis::new("fraction of requests", Unit::Fraction, false),
            );
            p.lines.push(Line {
                method: Method::Omnirig,
                wire: Wire::parse(&h.transport),
                pts: plot::cdf(&v),
            });
            if p.has_data() {
                panels.push(p);
            }
        }
    }
    if panels.is_empty() {
        return None;
    }
    Some(figure(
        format!("run-cdf{sfx}"),
        format!(
            "Run {}: per-hop latency CDF, omnirig over {} ({}, concurrency {})",
            r.scenario,
            run_transports(r),
            r.mode,
            r.concurrency
        ),
        format!(
            "one panel per hop and measure; {} requests, {} ok; {}",
            r.summary.requests,
            r.summary.ok,
            host.map_or("machine not recorded".into(), |h| format!("on {h}"))
        ),
        2,
        panels,
    ))
}

/// The transports a run's hops used, tcp first.
fn run_transports(r: &Report) -> String {
    let mut ts: Vec<&str> = r.transports.values().map(String::as_str).collect();
    ts.sort_by_key(|t| (Wire::parse(t), t.to_string()));
    ts.dedup();
    if ts.is_empty() {
        "no transport".into()
    } else {
        and_list(&ts)
    }
}

fn run_timeline_figure(r: &Report, sfx: &str) -> Figure {
    let n = r.requests.len();
    let shown = n.min(plot::TIMELINE_MAX_REQUESTS);
    Figure {
        name: format!("run-timeline{sfx}"),
        title: format!(
            "Run {}: per-request stage timeline, omnirig over {} ({}, concurrency {})",
            r.scenario,
            run_transports(r),
            r.mode,
            r.concurrency
        ),
        subtitle: if shown < n {
            format!("the first {shown} of {n} requests")
        } else {
            format!("{n} requests; each stage's busy span laid back from its end")
        },
        body: Body::Timeline(Box::new(r.clone())),
        keys: plot::timeline_keys(),
    }
}

#[cfg(test)]
mod tests;
