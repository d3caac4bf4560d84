//! `omnirig report RESULTS.json... --out DIR`: plots (PNG and SVG) from benchmark results
//! (`bench transfer|hop|pipeline --json`) and run reports (`run --report DIR` -> report.json).
//!
//! - `bandwidth.{png,svg}`: GB/s against payload size, log-log, one line per transport and
//!   suite, the baselines (memcpy, raw socket, ib_write_bw, pickle, pickle5-oob) dashed.
//! - `latency-cdf-<hop>.{png,svg}`: hop round-trip CDF per case, omnirig against the baselines
//!   (`bench hop`); `run-cdf.{png,svg}`: per-hop transfer and handoff CDFs of a run.
//! - `pipeline-latency.{png,svg}`, `pipeline-throughput.{png,svg}`: end-to-end p50/p99 and
//!   requests/s against concurrency (`bench pipeline`).
//! - `run-timeline.{png,svg}`: per-request stage timeline of a run (report.json).
//!
//! Text is drawn with an embedded DejaVu Sans (fonts/, Bitstream Vera licence), so no system
//! font library is needed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use omnirig_harness::Report;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::bench::Results;

const FONT: &[u8] = include_bytes!("fonts/DejaVuSans.ttf");
const W: u32 = 1200;
const H: u32 = 750;

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for style in [FontStyle::Normal, FontStyle::Bold] {
            // The embedded font is valid; a failure here is a build bug.
            let _ = plotters::style::register_font("sans-serif", style, FONT);
        }
    });
}

/// Draws `$body` (with the drawing area bound to `$a`) to `name.png` and `name.svg`.
macro_rules! both {
    ($out:expr, $name:expr, |$a:ident| $body:expr) => {{
        let name: String = $name.to_string();
        let png = $out.join(format!("{name}.png"));
        let svg = $out.join(format!("{name}.svg"));
        // Drawn under temporary names (the extension picks the format), renamed when whole.
        let png_tmp = $out.join(format!(".{name}.tmp-{}.png", std::process::id()));
        let svg_tmp = $out.join(format!(".{name}.tmp-{}.svg", std::process::id()));
        {
            let root = BitMapBackend::new(&png_tmp, (W, H)).into_drawing_area();
            root.fill(&WHITE).map_err(err)?;
            {
                let $a = &root;
                $body?;
            }
            root.present().map_err(err)?;
        }
        {
            let root = SVGBackend::new(&svg_tmp, (W, H)).into_drawing_area();
            root.fill(&WHITE).map_err(err)?;
            {
                let $a = &root;
                $body?;
            }
            root.present().map_err(err)?;
        }
        for (tmp, path) in [(&png_tmp, &png), (&svg_tmp, &svg)] {
            std::fs::rename(tmp, path).with_context(|| format!("writing {}", path.display()))?;
        }
        vec![png, svg]
    }};
}

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

/// Renders every plot the inputs allow into `out`; returns the files written.
pub fn render(inputs: &[PathBuf], out: &Path) -> anyhow::Result<Vec<PathBuf>> {
    register_font();
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut bench = Vec::new();
    let mut runs = Vec::new();
    for p in inputs {
        match load(p)? {
            Input::Bench(r) => bench.push(r),
            Input::Run(r) => runs.push(*r),
        }
    }
    let mut written = Vec::new();
    let bw = bandwidth_series(&bench, false);
    if !bw.is_empty() {
        let t = "Effective bandwidth vs payload size (log-log): engine vs physical baselines";
        written.extend(both!(out, "bandwidth", |a| bandwidth_chart(a, t, &bw)));
    }
    let bw = bandwidth_series(&bench, true);
    if !bw.is_empty() {
        let t = "Hop bandwidth vs payload size (log-log): tensor-native vs pickle over ZMQ";
        written.extend(both!(out, "bandwidth-hops", |a| bandwidth_chart(a, t, &bw)));
    }
    for (hop, series) in hop_cdfs(&bench) {
        let title = format!("Hop round-trip latency CDF: {hop} (tcp, two processes)");
        written.extend(both!(out, format!("latency-cdf-{hop}"), |a| cdf_chart(
            a,
            &title,
            "round trip (us, log)",
            &series
        )));
    }
    let pipes: Vec<&Results> = bench.iter().filter(|r| r.suite == "pipeline").collect();
    if !pipes.is_empty() {
        written.extend(both!(out, "pipeline-latency", |a| pipeline_latency(
            a, &pipes
        )));
        written.extend(both!(out, "pipeline-throughput", |a| pipeline_throughput(
            a, &pipes
        )));
    }
    for (i, r) in runs.iter().enumerate() {
        let sfx = if runs.len() > 1 {
            format!("-{i}")
        } else {
            String::new()
        };
        written.extend(run_plots(r, out, &sfx)?);
    }
    Ok(written)
}

/// The plots of one run: per-hop CDFs and the request timeline.
pub fn run_plots(r: &Report, out: &Path, sfx: &str) -> anyhow::Result<Vec<PathBuf>> {
    register_font();
    std::fs::create_dir_all(out)?;
    let mut written = Vec::new();
    let mut series = Vec::new();
    for (i, h) in r.hops.iter().enumerate() {
        let mut t: Vec<f64> = Vec::new();
        let mut hd: Vec<f64> = Vec::new();
        for q in &r.requests {
            for x in q.hops.iter().filter(|x| x.hop == h.hop) {
                t.push(x.transfer_ms * 1e3);
                hd.push(x.handoff_ms * 1e3);
            }
        }
        let c = color(i);
        series.push(Series::new(format!("{} transfer", h.hop), t, c, 0));
        series.push(Series::new(format!("{} handoff", h.hop), hd, c, 1));
    }
    if series.iter().any(|s| !s.y.is_empty()) {
        let title = format!(
            "Run {} ({}, concurrency {}): per-hop latency CDF",
            r.scenario, r.mode, r.concurrency
        );
        written.extend(both!(out, format!("run-cdf{sfx}"), |a| cdf_chart(
            a,
            &title,
            "latency (us, log)",
            &series
        )));
    }
    if !r.requests.is_empty() {
        written.extend(both!(out, format!("run-timeline{sfx}"), |a| timeline(a, r)));
    }
    Ok(written)
}

const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// A line: (x, y) points (or raw values for a CDF), a colour, dashed or not.
struct Series {
    name: String,
    x: Vec<f64>,
    y: Vec<f64>,
    color: RGBColor,
    /// 0 solid, 1 dashed, 2 dotted.
    dash: u8,
}

impl Series {
    fn new(name: String, y: Vec<f64>, color: RGBColor, dash: u8) -> Self {
        Self {
            name,
            x: vec![],
            y,
            color,
            dash,
        }
    }
}

/// Values an axis spans at most: plotters walks an axis decade by decade, so an empty
/// range (no plottable value: `f64::MAX..f64::MIN`) or one reaching infinity never ends.
const AXIS_MIN: f64 = 1e-12;
const AXIS_MAX: f64 = 1e15;

/// The range of the positive finite values of `v`, clamped to [`AXIS_MIN`]..[`AXIS_MAX`];
/// `(1, 10)` when there is none.
fn bounds(v: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = v
        .filter(|x| x.is_finite() && *x > 0.0)
        .map(|x| x.clamp(AXIS_MIN, AXIS_MAX))
        .fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    if lo > hi { (1.0, 10.0) } else { (lo, hi) }
}

/// Draws one line, dashed as a run of short segments.
fn draw_line<DB: DrawingBackend, X, Y>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<X, Y>>,
    s: &Series,
    pts: Vec<(f64, f64)>,
) -> anyhow::Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
    DB::ErrorType: 'static,
{
    // Points far outside the axis would overflow the pixel arithmetic: keep them at its edge.
    let pts: Vec<(f64, f64)> = pts
        .into_iter()
        .filter(|(x, y)| !x.is_nan() && !y.is_nan())
        .map(|(x, y)| (x.clamp(-AXIS_MAX, AXIS_MAX), y.clamp(-AXIS_MAX, AXIS_MAX)))
        .collect();
    let style = s.color.stroke_width(3);
    let c = s.color;
    match s.dash {
        0 => chart.draw_series(LineSeries::new(pts.clone(), style))?,
        1 => chart.draw_series(DashedLineSeries::new(pts.clone(), 12, 6, style))?,
        _ => chart.draw_series(DashedLineSeries::new(pts.clone(), 3, 5, style))?,
    };
    if pts.len() <= 40 {
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled())))?;
    }
    Ok(())
}

/// Legend entries from pixel (x0, y0) of `area`, one per line.
fn legend_entries<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    series: &[Series],
    x0: i32,
    y0: i32,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let mut y = y0;
    for s in series {
        let style = s.color.stroke_width(3);
        let segs: Vec<(i32, i32)> = match s.dash {
            0 => vec![(0, 34)],
            1 => vec![(0, 12), (18, 30)],
            _ => vec![(0, 3), (8, 11), (16, 19), (24, 27), (32, 35)],
        };
        for (a, b) in segs {
            area.draw(&PathElement::new(vec![(x0 + a, y), (x0 + b, y)], style))?;
        }
        area.draw(&Text::new(
            s.name.clone(),
            (x0 + 44, y - 8),
            ("sans-serif", 15),
        ))?;
        y += 24;
    }
    Ok(())
}

/// The legend, drawn beside the plot (never over the data).
fn side_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    series: &[Series],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    legend_entries(area, series, 6, 90)
}

/// A boxed legend at pixel (x, y) of `area`.
fn legend_box<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    series: &[Series],
    x: i32,
    y: i32,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let h = 24 * series.len() as i32 + 12;
    area.draw(&Rectangle::new(
        [(x, y), (x + 300, y + h)],
        WHITE.mix(0.9).filled(),
    ))?;
    area.draw(&Rectangle::new([(x, y), (x + 300, y + h)], BLACK))?;
    legend_entries(area, series, x + 10, y + 18)
}

fn err<E: std::error::Error + Send + Sync + 'static>(e: E) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}

// ---------------------------------------------------------------- bandwidth

/// Lines of the bandwidth charts: `hops` false -> the transfer suite (omnirig per transport
/// and op; memcpy, raw socket, ib_write_bw dashed), true -> the hop suites (omnirig per hop
/// solid, pickle dashed, pickle5-oob dotted, one colour per hop).
fn bandwidth_series(results: &[Results], hops: bool) -> Vec<Series> {
    // (group, dash, name) -> points
    let mut lines: BTreeMap<(String, u8, String), Vec<(f64, f64)>> = BTreeMap::new();
    for r in results
        .iter()
        .filter(|r| (r.suite == "hop") == hops && r.suite != "pipeline")
    {
        for row in &r.rows {
            let (group, ours) = match &row.hop {
                // One line per hop and transport: inline rows are that transport's small sizes.
                Some(h) => {
                    let t = row
                        .op
                        .trim_start_matches("hop-")
                        .trim_end_matches("-inline");
                    (h.clone(), format!("omnirig {h} ({t})"))
                }
                None => (
                    format!("{} {}", r.transport, row.op),
                    format!("omnirig {} {}", r.transport, row.op),
                ),
            };
            lines
                .entry((group.clone(), 0, ours))
                .or_default()
                .push((row.size as f64, row.omnirig.gbps));
            let n = row.baseline.name.as_str();
            let (bgroup, dash, name) = match &row.hop {
                Some(h) => (
                    h.clone(),
                    if n.contains('5') { 2 } else { 1 },
                    format!("{n} ({h})"),
                ),
                None if n.starts_with("raw") => ("~raw".into(), 1, "raw socket (tcp)".into()),
                None => (format!("~{n}"), 1, n.to_string()),
            };
            lines
                .entry((bgroup, dash, name))
                .or_default()
                .push((row.size as f64, row.baseline.gbps));
        }
    }
    let mut groups: Vec<String> = lines.keys().map(|k| k.0.clone()).collect();
    groups.dedup();
    lines
        .into_iter()
        .map(|((group, dash, name), mut pts)| {
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            pts.dedup_by(|a, b| a.0 == b.0);
            let gi = groups.iter().position(|g| *g == group).unwrap_or(0);
            // Same hue per hop; shm (ours, and the pickle-shm wire) a darker shade, so the
            // same-host lines read apart from the tcp ones.
            let c = color(gi);
            let c = if name.ends_with("(shm)") || name.starts_with("pickle-shm") {
                RGBColor(c.0 / 2, c.1 / 2, c.2 / 2)
            } else {
                c
            };
            Series {
                name,
                x: pts.iter().map(|p| p.0).collect(),
                y: pts.iter().map(|p| p.1).collect(),
                color: c,
                dash,
            }
        })
        .collect()
}

/// Byte counts on log axes, SI (10 kB, 1 MB).
fn si_bytes(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{} GB", x / 1e9),
        x if x >= 1e6 => format!("{} MB", x / 1e6),
        x if x >= 1e3 => format!("{} kB", x / 1e3),
        x => format!("{x} B"),
    }
}

fn bandwidth_chart<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    series: &[Series],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let (area, legend) = area.split_horizontally(W - 330);
    side_legend(&legend, series)?;
    let area = &area;
    let (x0, x1) = bounds(series.iter().flat_map(|s| s.x.iter().copied()));
    let (y0, y1) = bounds(series.iter().flat_map(|s| s.y.iter().copied()));
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 24))
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(80)
        .build_cartesian_2d(
            (x0 / 1.5..x1 * 1.5).log_scale(),
            (y0 / 2.0..y1 * 2.0).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("payload size (bytes)")
        .y_desc("GB/s (1e9 B/s)")
        .x_label_formatter(&|x| si_bytes(*x))
        .y_label_formatter(&|y| format!("{y:.3}"))
        .label_style(("sans-serif", 18))
        .axis_desc_style(("sans-serif", 22))
        .draw()
        .map_err(err)?;
    for s in series {
        let pts = s.x.iter().copied().zip(s.y.iter().copied()).collect();
        draw_line(&mut chart, s, pts)?;
    }
    Ok(())
}

// ---------------------------------------------------------------- CDFs

fn hop_cdfs(results: &[Results]) -> BTreeMap<String, Vec<Series>> {
    let mut out: BTreeMap<String, Vec<Series>> = BTreeMap::new();
    for r in results.iter().filter(|r| r.suite == "hop") {
        let mut cases: Vec<String> = Vec::new();
        for row in &r.rows {
            let (Some(hop), Some(case)) = (&row.hop, &row.case) else {
                continue;
            };
            if !cases.contains(case) {
                cases.push(case.clone());
            }
            let c = color(cases.iter().position(|x| x == case).unwrap_or(0));
            let v = out.entry(hop.clone()).or_default();
            let ours = format!("omnirig {} {case}", row.op);
            if let Some(s) = &row.omnirig.samples_us
                && !v.iter().any(|x| x.name == ours)
            {
                v.push(Series::new(ours, s.clone(), c, 0));
            }
            if let Some(s) = &row.baseline.samples_us {
                let name = format!("{} {case}", row.baseline.name);
                // pickle dashed; pickle5-oob dashed in a lighter shade of the case colour.
                let shade = if row.baseline.name.contains('5') {
                    RGBColor(c.0 / 2 + 100, c.1 / 2 + 100, c.2 / 2 + 100)
                } else {
                    c
                };
                v.push(Series::new(
                    name,
                    s.clone(),
                    shade,
                    if row.baseline.name.contains('5') {
                        2
                    } else {
                        1
                    },
                ));
            }
        }
    }
    out
}

fn cdf_chart<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    xdesc: &str,
    series: &[Series],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let (x0, x1) = bounds(series.iter().flat_map(|s| s.y.iter().copied()));
    if x0 > x1 {
        return Ok(());
    }
    let (area, legend) = area.split_horizontally(W - 300);
    side_legend(&legend, series)?;
    let area = &area;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 28))
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(70)
        .build_cartesian_2d((x0 / 1.3..x1 * 1.3).log_scale(), 0.0..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(xdesc)
        .y_desc("fraction of samples <= x")
        .x_label_formatter(&|x| {
            if *x >= 100.0 {
                format!("{x:.0}")
            } else {
                format!("{x:.1}")
            }
        })
        .label_style(("sans-serif", 18))
        .axis_desc_style(("sans-serif", 22))
        .draw()
        .map_err(err)?;
    for s in series.iter().filter(|s| !s.y.is_empty()) {
        let mut v: Vec<f64> = s.y.iter().copied().filter(|x| *x > 0.0).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len() as f64;
        let pts: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, (i + 1) as f64 / n))
            .collect();
        // Thin the line for plotting; keep the tail.
        let step = (pts.len() / 400).max(1);
        let mut thin: Vec<(f64, f64)> = pts.iter().step_by(step).copied().collect();
        if let Some(last) = pts.last() {
            thin.push(*last);
        }
        draw_line(&mut chart, s, thin)?;
    }
    Ok(())
}

// ---------------------------------------------------------------- pipeline

/// Per side (omnirig, then each baseline): (concurrency, p50 ms, p99 ms, requests/s) points.
type PipePoints = Vec<(String, Vec<(f64, f64, f64, f64)>)>;

fn pipeline_points(pipes: &[&Results]) -> PipePoints {
    // omnirig sides first (one per transport), then the baselines (once: every run measures
    // the same current path; the first run's figures are drawn).
    let mut ours: PipePoints = Vec::new();
    let mut bases: PipePoints = Vec::new();
    let side = |sides: &mut PipePoints, name: String| -> usize {
        match sides.iter().position(|s| s.0 == name) {
            Some(i) => i,
            None => {
                sides.push((name, vec![]));
                sides.len() - 1
            }
        }
    };
    for r in pipes {
        for row in &r.rows {
            let Some(c) = row.concurrency else { continue };
            let c = c as f64;
            let (ro, rb) = row.throughput_rps.unwrap_or((f64::NAN, f64::NAN));
            let i = side(&mut ours, format!("omnirig over {}", r.transport));
            if !ours[i].1.iter().any(|p| p.0 == c) {
                ours[i]
                    .1
                    .push((c, row.omnirig.p50_us / 1e3, row.omnirig.p99_us / 1e3, ro));
            }
            let i = side(&mut bases, row.baseline.name.clone());
            if !bases[i].1.iter().any(|p| p.0 == c) {
                bases[i].1.push((
                    c,
                    row.baseline.p50_us / 1e3,
                    row.baseline.p99_us.unwrap_or(f64::NAN) / 1e3,
                    rb,
                ));
            }
        }
    }
    let mut sides = ours;
    sides.extend(bases);
    for s in &mut sides {
        s.1.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    sides
}

fn pipeline_latency<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    pipes: &[&Results],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let sides = pipeline_points(pipes);
    let (x0, x1) = bounds(sides.iter().flat_map(|s| s.1.iter().map(|p| p.0)));
    let (y0, y1) = bounds(
        sides
            .iter()
            .flat_map(|s| s.1.iter().flat_map(|p| [p.1, p.2])),
    );
    let mut chart = ChartBuilder::on(area)
        .caption(
            "Five-stage request latency vs concurrency (processes on 127.0.0.1)",
            ("sans-serif", 28),
        )
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(80)
        .build_cartesian_2d(
            (x0 / 1.3..x1 * 1.3).log_scale(),
            (y0 / 1.5..y1 * 1.5).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("requests in flight (concurrency)")
        .y_desc("end-to-end latency (ms, log)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.1}"))
        .label_style(("sans-serif", 18))
        .axis_desc_style(("sans-serif", 22))
        .draw()
        .map_err(err)?;
    let mut legend = Vec::new();
    for (i, (name, pts)) in sides.iter().enumerate() {
        for (pi, q) in ["p50", "p99"].iter().enumerate() {
            let s = Series {
                name: format!("{name} {q}"),
                x: vec![],
                y: vec![],
                color: color(i),
                dash: if pi == 0 { 0 } else { 1 },
            };
            let xy = pts
                .iter()
                .map(|p| (p.0, if pi == 0 { p.1 } else { p.2 }))
                .collect();
            draw_line(&mut chart, &s, xy)?;
            legend.push(s);
        }
    }
    legend_box(area, &legend, 130, 90)?;
    Ok(())
}

fn pipeline_throughput<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    pipes: &[&Results],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let sides = pipeline_points(pipes);
    let (x0, x1) = bounds(sides.iter().flat_map(|s| s.1.iter().map(|p| p.0)));
    let (_, y1) = bounds(sides.iter().flat_map(|s| s.1.iter().map(|p| p.3)));
    let mut chart = ChartBuilder::on(area)
        .caption(
            "Five-stage throughput vs concurrency (processes on 127.0.0.1)",
            ("sans-serif", 28),
        )
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(80)
        .build_cartesian_2d((x0 / 1.3..x1 * 1.3).log_scale(), 0.0..y1 * 1.5)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("requests in flight (concurrency)")
        .y_desc("requests / s")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .label_style(("sans-serif", 18))
        .axis_desc_style(("sans-serif", 22))
        .draw()
        .map_err(err)?;
    let mut legend = Vec::new();
    for (i, (name, pts)) in sides.iter().enumerate() {
        let s = Series {
            name: if name.starts_with("omnirig") {
                format!("{name} (tensor-native)")
            } else {
                format!("{name} over ZMQ (current path)")
            },
            x: vec![],
            y: vec![],
            color: color(i),
            dash: if name.starts_with("omnirig") { 0 } else { 1 },
        };
        draw_line(&mut chart, &s, pts.iter().map(|p| (p.0, p.3)).collect())?;
        legend.push(s);
    }
    legend_box(area, &legend, 130, 90)?;
    Ok(())
}

// ---------------------------------------------------------------- timeline

/// (stage, start ms, receive ms, compute ms, send ms).
pub type StageSpan = (String, f64, f64, f64, f64);

/// Per request, per stage: `[start, end]` relative to the request's start, split into
/// receive (offer -> inputs verified), compute, and send (the outbound engine transfer).
/// Stages start with the request and wait for their inbound offer, so a stage's end is its
/// `total_ms`; its busy span is laid back from there (handoff + compute + transfer).
pub fn stage_spans(r: &Report) -> Vec<(String, Vec<StageSpan>)> {
    r.requests
        .iter()
        .map(|q| {
            let spans = q
                .stages
                .iter()
                .filter(|s| s.participated)
                .map(|s| {
                    let recv = s.received.as_ref().map_or(0.0, |x| x.handoff_ms);
                    let send = s.sent.as_ref().map_or(0.0, |x| x.transfer_ms);
                    let end = s.total_ms;
                    let start = (end - recv - s.compute_ms - send).max(0.0);
                    (s.stage.clone(), start, recv, s.compute_ms, send)
                })
                .collect();
            (q.id.clone(), spans)
        })
        .collect()
}

fn timeline<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, r: &Report) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let spans = stage_spans(r);
    let stages = [
        "encoder",
        "thinker_prefill",
        "thinker_decode",
        "talker",
        "code2wav",
    ];
    let rows = spans.len() * stages.len();
    let xmax = bounds(r.requests.iter().map(|q| q.e2e_ms)).1.max(1.0);
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!(
                "Per-request stage timeline: {} ({}, concurrency {})",
                r.scenario, r.mode, r.concurrency
            ),
            ("sans-serif", 26),
        )
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(260)
        .build_cartesian_2d(0.0..xmax * 1.05, (0..rows as i32).into_segmented())
        .map_err(err)?;
    let labels: Vec<String> = spans
        .iter()
        .flat_map(|(id, _)| stages.iter().map(move |s| format!("{id} {s}")))
        .collect();
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc("ms since the request started (spans laid back from each stage's end)")
        .y_labels(rows)
        .y_label_formatter(&|y| match y {
            SegmentValue::CenterOf(i) => rows
                .checked_sub(*i as usize + 1)
                .and_then(|k| labels.get(k))
                .cloned()
                .unwrap_or_default(),
            _ => String::new(),
        })
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 20))
        .draw()
        .map_err(err)?;
    let phases = [
        ("receive (offer -> verified)", color(0)),
        ("compute", color(2)),
        ("send (engine transfer)", color(3)),
    ];
    for (pi, (name, c)) in phases.iter().enumerate() {
        let mut rects = Vec::new();
        for (ri, (_, sp)) in spans.iter().enumerate() {
            for (stage, start, recv, comp, send) in sp {
                let si = stages.iter().position(|s| s == stage).unwrap_or(0);
                let row = (rows - 1 - (ri * stages.len() + si)) as i32;
                let (a, b) = match pi {
                    0 => (*start, start + recv),
                    1 => (start + recv, start + recv + comp),
                    _ => (start + recv + comp, start + recv + comp + send),
                };
                // Within the axis (extreme values would overflow the pixel arithmetic).
                let edge = |v: f64| {
                    if v.is_nan() {
                        0.0
                    } else {
                        v.clamp(0.0, xmax * 1.05)
                    }
                };
                let (a, b) = (edge(a), edge(b));
                if b > a {
                    rects.push(Rectangle::new(
                        [
                            (a, SegmentValue::Exact(row)),
                            (b, SegmentValue::Exact(row + 1)),
                        ],
                        c.filled(),
                    ));
                }
            }
        }
        let c = *c;
        chart
            .draw_series(rects)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 20, y + 6)], c.filled()));
    }
    // Each request's end-to-end mark.
    for (ri, q) in r.requests.iter().enumerate() {
        let top = (rows - ri * stages.len()) as i32;
        let e2e = if q.e2e_ms.is_nan() {
            0.0
        } else {
            q.e2e_ms.clamp(0.0, xmax * 1.05)
        };
        chart.draw_series(std::iter::once(PathElement::new(
            vec![
                (e2e, SegmentValue::Exact(top)),
                (e2e, SegmentValue::Exact(top - stages.len() as i32)),
            ],
            BLACK.stroke_width(2),
        )))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()
        .map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{Row, Samples};
    use omnirig_harness::{HopResult, RequestResult, StageOutcome, Summary};
    use std::time::Duration;

    fn samples(us: &[u64], bytes: u64) -> Samples {
        let mut s = Samples::new(bytes);
        for &u in us {
            s.push(Duration::from_micros(u));
        }
        s
    }

    fn write(dir: &Path, name: &str, r: &Results) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, serde_json::to_string(r).unwrap()).unwrap();
        p
    }

    #[test]
    fn every_plot_renders_from_every_suite_and_a_run_report() {
        let dir = std::env::temp_dir().join(format!("omnirig-report-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut transfer = Results {
            suite: "transfer".into(),
            transport: "tcp".into(),
            rows: vec![],
        };
        let mut hop = Results {
            suite: "hop".into(),
            transport: "tcp".into(),
            rows: vec![],
        };
        let mut pipe = Results {
            suite: "pipeline".into(),
            transport: "tcp".into(),
            rows: vec![],
        };
        for (i, size) in [4096u64, 1 << 20, 64 << 20].into_iter().enumerate() {
            let ours = samples(&[10 + i as u64 * 100, 20, 30], size);
            let base = samples(&[15, 25 + i as u64 * 200, 35], size);
            transfer
                .rows
                .push(Row::new("write", size, &ours, "raw-polled", &base));
            let mut r = Row::new("hop-tcp", size, &ours, "pickle", &base);
            r.hop = Some("kv".into());
            r.case = Some(format!("case{i}"));
            r.attach_samples(&ours, &base);
            hop.rows.push(r);
        }
        for c in [1usize, 4, 16] {
            let mut r = Row::new(
                "request",
                1 << 20,
                &samples(&[1000 * c as u64, 2000], 1 << 20),
                "pickle",
                &samples(&[5000 * c as u64, 9000], 1 << 20),
            );
            r.concurrency = Some(c);
            r.throughput_rps = Some((100.0 / c as f64, 20.0 / c as f64));
            pipe.rows.push(r);
        }
        let stage = |name: &str, total: f64| StageOutcome {
            stage: name.into(),
            participated: true,
            compute_ms: 1.0,
            total_ms: total,
            ..Default::default()
        };
        let report = Report {
            report_version: 1,
            scenario: "t".into(),
            mode: "in_process".into(),
            transports: Default::default(),
            concurrency: 1,
            wall_s: 1.0,
            summary: Summary::default(),
            hops: vec![],
            requests: vec![RequestResult {
                id: "000-x".into(),
                label: "x".into(),
                ok: true,
                e2e_ms: 9.0,
                hops: vec![HopResult {
                    hop: "kv_cache".into(),
                    transfer_ms: 2.0,
                    handoff_ms: 3.0,
                    ..Default::default()
                }],
                stages: vec![stage("thinker_prefill", 4.0), stage("thinker_decode", 8.0)],
                ..Default::default()
            }],
            stages: vec![],
            faults: None,
        };
        let mut report = report;
        report.summarise();
        let run = dir.join("report.json");
        report.write(&dir).unwrap();
        let inputs = vec![
            write(&dir, "t.json", &transfer),
            write(&dir, "h.json", &hop),
            write(&dir, "p.json", &pipe),
            run,
        ];
        // One markdown table per benchmark file, none for the run report.
        let md = markdown(&inputs).unwrap();
        assert_eq!(md.matches("### ").count(), 3, "{md}");
        assert!(md.contains("### pipeline over tcp"), "{md}");
        assert!(markdown(&inputs[3..]).is_err());
        let out = dir.join("plots");
        let files = render(&inputs, &out).unwrap();
        for name in [
            "bandwidth",
            "bandwidth-hops",
            "latency-cdf-kv",
            "pipeline-latency",
            "pipeline-throughput",
            "run-cdf",
            "run-timeline",
        ] {
            for ext in ["png", "svg"] {
                let f = out.join(format!("{name}.{ext}"));
                assert!(files.contains(&f), "{} not written", f.display());
                assert!(
                    std::fs::metadata(&f).unwrap().len() > 1000,
                    "{} is empty",
                    f.display()
                );
            }
        }
        let png = std::fs::read(out.join("bandwidth.png")).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        let svg = std::fs::read_to_string(out.join("pipeline-latency.svg")).unwrap();
        assert!(svg.contains("Five-stage request latency"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Issue 10: `omnirig report` spun forever at 100% CPU on a pipeline result without
    /// `throughput_rps` and on extreme values, and read /dev/zero forever. Every input renders
    /// (within a bound, checked from another thread) or is refused.
    #[test]
    fn odd_inputs_render_or_are_refused_never_spin() {
        let dir = std::env::temp_dir().join(format!("omnirig-report-odd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut inputs = Vec::new();
        for (i, (lat, rps)) in [
            (1000u64, None),
            (u64::MAX, Some((1e300, f64::MAX))),
            (1, Some((0.0, -1.0))),
        ]
        .into_iter()
        .enumerate()
        {
            let mut pipe = Results {
                suite: "pipeline".into(),
                transport: "tcp".into(),
                rows: vec![],
            };
            let mut r = Row::new(
                "request",
                1 << 20,
                &samples(&[lat, lat], 1 << 20),
                "pickle",
                &samples(&[lat, 1], 1 << 20),
            );
            r.concurrency = Some(1 + i);
            r.throughput_rps = rps;
            pipe.rows.push(r);
            inputs.push(write(&dir, &format!("p{i}.json"), &pipe));
        }
        let mut report = Report {
            report_version: 1,
            scenario: "t".into(),
            mode: "in_process".into(),
            transports: Default::default(),
            concurrency: 1,
            wall_s: 1.0,
            summary: Summary::default(),
            hops: vec![],
            requests: vec![RequestResult {
                id: "000-x".into(),
                e2e_ms: 1e300,
                hops: vec![HopResult {
                    hop: "kv_cache".into(),
                    transfer_ms: f64::MAX,
                    handoff_ms: 0.0,
                    ..Default::default()
                }],
                ..Default::default()
            }],
            stages: vec![],
            faults: None,
        };
        report.summarise();
        report.write(&dir).unwrap();
        inputs.push(dir.join("report.json"));
        let (tx, rx) = std::sync::mpsc::channel();
        let (ins, out) = (inputs.clone(), dir.join("plots"));
        std::thread::spawn(move || {
            let _ = tx.send(render(&ins, &out).map(|f| f.len()));
        });
        let files = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .expect("render did not finish: it spins")
            .unwrap();
        assert!(files > 0);
        // Not regular files, or too large: refused with the path named, nothing read.
        let big = dir.join("big.json");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(MAX_INPUT_BYTES + 1)
            .unwrap();
        for (p, why) in [
            (Path::new("/dev/zero"), "not a regular file"),
            (dir.as_path(), "not a regular file"),
            (big.as_path(), "more than"),
        ] {
            let e = format!("{:#}", load(p).err().expect("refused"));
            assert!(
                e.contains(why) && e.contains(&p.display().to_string()),
                "{e}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn timeline_spans_end_at_each_stage_total() {
        let r: Report = serde_json::from_value(serde_json::json!({
            "report_version": 1, "scenario": "s", "mode": "in_process", "transports": {},
            "concurrency": 1, "wall_s": 1.0, "summary": {
                "requests": 1, "ok": 1, "failed": 0, "pools_clean": true, "e2e_p50_ms": 1.0,
                "e2e_p99_ms": 1.0, "e2e_mean_ms": 1.0, "throughput_rps": 1.0,
                "moved_bytes": 0, "reused_bytes": 0 },
            "hops": [], "stages": [],
            "requests": [{ "id": "r", "label": "r", "ok": true, "error": null, "errors": [],
                "e2e_ms": 10.0, "hops": [], "stages": [
                    { "stage": "talker", "participated": true, "error": null,
                      "received": { "hop": "thinker_to_talker", "tensors": 5, "landed_bytes": 1,
                        "reused_bytes": 0, "handoff_ms": 2.0, "verify_ms": 0.1 },
                      "sent": { "hop": "talker_to_code2wav", "tensors": 1, "requests": 1,
                        "bytes": 1, "transfer_ms": 0.5 },
                      "compute_ms": 1.5, "total_ms": 9.0 } ] }]
        }))
        .unwrap();
        let spans = stage_spans(&r);
        let (stage, start, recv, comp, send) = &spans[0].1[0];
        assert_eq!(stage, "talker");
        assert_eq!((*start, *recv, *comp, *send), (5.0, 2.0, 1.5, 0.5));
    }
}
