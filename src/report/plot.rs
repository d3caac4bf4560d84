//! Figures as small multiples: a header strip (title, subtitle naming transports and machine,
//! one shared legend laid out to fit) over a grid of panels, each with its own axes in human
//! units. One colour per method everywhere ([`Method`]), one line style per transport
//! ([`Wire`]). Every figure is drawn twice from the same code: a PNG, and an SVG whose header
//! and panels are nested `<svg class="legend|panel">` elements (the page inlines it and its
//! checks find the panels by class).

use std::path::Path;

use anyhow::Context;
use omnirig_harness::Report;
use plotters::coord::Shift;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

const FONT: &[u8] = include_bytes!("fonts/DejaVuSans.ttf");
/// Figure width in pixels (panels share it evenly).
pub const W: u32 = 1200;
const PANEL_H: u32 = 300;
const TITLE_PX: u32 = 24;
const SUB_PX: u32 = 16;
const LEGEND_PX: u32 = 15;
const LEGEND_ROW: u32 = 26;
const SWATCH: i32 = 40;

pub(crate) fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for style in [FontStyle::Normal, FontStyle::Bold] {
            // The embedded font is valid; a failure here is a build bug.
            let _ = plotters::style::register_font("sans-serif", style, FONT);
        }
    });
}

fn err<E: std::error::Error + Send + Sync + 'static>(e: E) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}

/// Who moved the bytes: the colour of a line in every figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Method {
    Omnirig,
    Pickle,
    Pickle5Oob,
    PickleShm,
    /// The physical floor: a plain socket, memcpy, ib_write_bw.
    Floor,
    Other,
}

impl Method {
    pub fn of_baseline(name: &str) -> Self {
        match name {
            "pickle" => Method::Pickle,
            "pickle5-oob" => Method::Pickle5Oob,
            "pickle-shm" => Method::PickleShm,
            n if n == "memcpy" || n.starts_with("raw") || n.starts_with("ib_") => Method::Floor,
            _ => Method::Other,
        }
    }

    pub fn color(self) -> RGBColor {
        match self {
            Method::Omnirig => RGBColor(31, 119, 180),
            Method::Pickle => RGBColor(214, 39, 40),
            Method::Pickle5Oob => RGBColor(255, 127, 14),
            Method::PickleShm => RGBColor(148, 103, 189),
            Method::Floor => RGBColor(90, 90, 90),
            Method::Other => RGBColor(23, 190, 207),
        }
    }

    fn legend(self) -> &'static str {
        match self {
            Method::Omnirig => "omnirig",
            Method::Pickle => "pickle over ZMQ",
            Method::Pickle5Oob => "pickle5 out-of-band over ZMQ",
            Method::PickleShm => "pickle, tensors via shared memory",
            Method::Floor => "floor (plain socket / memcpy / ib_write_bw)",
            Method::Other => "other baseline",
        }
    }
}

/// What carried the bytes: the line style in every figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Wire {
    Tcp,
    Shm,
    Loopback,
    Rdma,
    /// In-memory copies (the memcpy floor).
    Memory,
}

impl Wire {
    pub fn parse(s: &str) -> Self {
        match s {
            "shm" => Wire::Shm,
            "loopback" => Wire::Loopback,
            "rdma" => Wire::Rdma,
            "memcpy" | "memory" => Wire::Memory,
            _ => Wire::Tcp,
        }
    }

    /// The wire a baseline ran over: pickle and pickle5-oob over ZMQ's tcp, pickle-shm's
    /// tensors through shared memory, memcpy in memory, the socket floors over tcp.
    pub fn of_baseline(name: &str) -> Self {
        match name {
            "pickle-shm" => Wire::Shm,
            "memcpy" => Wire::Memory,
            n if n.starts_with("ib_") => Wire::Rdma,
            _ => Wire::Tcp,
        }
    }

    /// Dash and gap in pixels; None draws a solid line.
    fn dash(self) -> Option<(u32, u32)> {
        match self {
            Wire::Tcp | Wire::Memory => None,
            Wire::Shm => Some((14, 7)),
            Wire::Loopback => Some((3, 5)),
            Wire::Rdma => Some((24, 5)),
        }
    }

    fn legend(self) -> &'static str {
        match self {
            Wire::Tcp => "over tcp",
            Wire::Shm => "over shm (same host)",
            Wire::Loopback => "loopback (one process)",
            Wire::Rdma => "over rdma",
            Wire::Memory => "in memory",
        }
    }
}

/// Human units for tick labels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Unit {
    Micros,
    Bytes,
    GBps,
    Fraction,
    Count,
    Rps,
}

/// Three significant digits, trailing zeros dropped.
fn sig(x: f64) -> String {
    let s = match x.abs() {
        a if a >= 100.0 => format!("{x:.0}"),
        a if a >= 10.0 => format!("{x:.1}"),
        a if a >= 1.0 => format!("{x:.2}"),
        _ => format!("{x:.3}"),
    };
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// A duration given in microseconds, as us, ms or s.
pub fn human_time(us: f64) -> String {
    match us {
        u if u >= 1e6 => format!("{} s", sig(u / 1e6)),
        u if u >= 1e3 => format!("{} ms", sig(u / 1e3)),
        u => format!("{} us", sig(u)),
    }
}

/// A byte count in binary units (KiB, MiB, GiB).
pub fn human_bytes(b: f64) -> String {
    const K: f64 = 1024.0;
    match b {
        b if b >= K * K * K => format!("{} GiB", sig(b / (K * K * K))),
        b if b >= K * K => format!("{} MiB", sig(b / (K * K))),
        b if b >= K => format!("{} KiB", sig(b / K)),
        b => format!("{} B", sig(b)),
    }
}

impl Unit {
    fn tick(self, v: f64) -> String {
        match self {
            Unit::Micros => human_time(v),
            Unit::Bytes => human_bytes(v),
            Unit::GBps | Unit::Rps => sig(v),
            Unit::Fraction => format!("{v:.1}"),
            Unit::Count => format!("{v:.0}"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Axis {
    pub desc: String,
    pub unit: Unit,
    pub log: bool,
}

impl Axis {
    pub fn new(desc: &str, unit: Unit, log: bool) -> Self {
        Axis {
            desc: desc.into(),
            unit,
            log,
        }
    }
}

/// One drawn line.
#[derive(Debug, Clone)]
pub struct Line {
    pub method: Method,
    pub wire: Wire,
    pub pts: Vec<(f64, f64)>,
}

/// One panel of a figure. The x axis is always logarithmic (sizes, latencies, concurrency).
#[derive(Debug, Clone)]
pub struct Panel {
    pub title: String,
    pub x: Axis,
    pub y: Axis,
    pub lines: Vec<Line>,
    /// Vertical markers (x, method), e.g. the floor's p50 on a CDF.
    pub marks: Vec<(f64, Method)>,
    /// Dots on each point (few points per line).
    pub dots: bool,
}

impl Panel {
    pub fn new(title: String, x: Axis, y: Axis) -> Self {
        Panel {
            title,
            x,
            y,
            lines: vec![],
            marks: vec![],
            dots: false,
        }
    }

    /// Whether any line has a point the axes can show (x > 0 on the log x axis, y > 0 too
    /// on a log y axis).
    pub fn has_data(&self) -> bool {
        self.lines.iter().any(|l| {
            l.pts
                .iter()
                .any(|p| p.0 > 0.0 && p.1.is_finite() && (!self.y.log || p.1 > 0.0))
        })
    }
}

/// The empirical CDF of `samples` as a step line: (value, fraction of samples <= value),
/// rising from 0 at the smallest sample; above 400 samples every k-th sample is kept, the
/// largest always.
pub fn cdf(samples: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = samples
        .iter()
        .copied()
        .filter(|x| x.is_finite() && *x > 0.0)
        .collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let step = n.div_ceil(400).max(1);
    let mut keep: Vec<usize> = (0..n).step_by(step).collect();
    if n > 0 && keep.last() != Some(&(n - 1)) {
        keep.push(n - 1);
    }
    let mut out = Vec::with_capacity(2 * keep.len());
    let mut below = 0.0;
    for i in keep {
        let frac = (i + 1) as f64 / n as f64;
        out.push((v[i], below));
        out.push((v[i], frac));
        below = frac;
    }
    out
}

/// A legend entry: a coloured solid line (a method), a grey styled line (a transport) or a
/// filled block (a timeline phase).
#[derive(Debug, Clone, PartialEq)]
pub struct Key {
    pub label: String,
    pub color: RGBColor,
    pub dash: Option<(u32, u32)>,
    pub block: bool,
}

pub enum Body {
    Panels { cols: usize, panels: Vec<Panel> },
    Timeline(Box<Report>),
}

pub struct Figure {
    /// File stem (`latency-cdf-kv` -> `latency-cdf-kv.png` / `.svg`).
    pub name: String,
    pub title: String,
    pub subtitle: String,
    pub body: Body,
    /// Extra legend entries before the derived ones.
    pub keys: Vec<Key>,
}

const TIMELINE_ROW: u32 = 16;
/// Requests drawn on a timeline at most (the rest are counted in the subtitle).
pub const TIMELINE_MAX_REQUESTS: usize = 40;

impl Figure {
    /// The legend: the given keys, then every method drawn, then every transport drawn.
    pub fn legend(&self) -> Vec<Key> {
        let mut keys = self.keys.clone();
        if let Body::Panels { panels, .. } = &self.body {
            let mut methods: Vec<Method> = panels
                .iter()
                .flat_map(|p| {
                    p.lines
                        .iter()
                        .map(|l| l.method)
                        .chain(p.marks.iter().map(|m| m.1))
                })
                .collect();
            methods.sort();
            methods.dedup();
            let mut wires: Vec<Wire> = panels
                .iter()
                .flat_map(|p| p.lines.iter().map(|l| l.wire))
                // The memcpy floor's wire goes without saying (its method key names it).
                .filter(|w| *w != Wire::Memory)
                .collect();
            wires.sort();
            wires.dedup();
            let marks = panels.iter().any(|p| !p.marks.is_empty());
            for m in methods {
                let label = if m == Method::Floor && marks {
                    "floor: plain socket p50 (vertical line)".to_string()
                } else {
                    m.legend().to_string()
                };
                keys.push(Key {
                    label,
                    color: m.color(),
                    dash: None,
                    block: false,
                });
            }
            if wires.len() > 1 || wires.iter().any(|w| w.dash().is_some()) {
                for w in wires {
                    keys.push(Key {
                        label: w.legend().into(),
                        color: RGBColor(40, 40, 40),
                        dash: w.dash(),
                        block: false,
                    });
                }
            }
        }
        keys
    }

    /// Legend entries placed in rows that fit the width: (row, x, key).
    fn legend_layout(&self) -> Vec<(u32, i32, Key)> {
        let font = ("sans-serif", LEGEND_PX).into_font();
        let mut out = Vec::new();
        let (mut row, mut x) = (0u32, 10i32);
        for k in self.legend() {
            let tw = font.box_size(&k.label).map(|b| b.0 as i32).unwrap_or(200);
            // Slack as in `fit`: the viewer's sans-serif may be wider.
            let w = SWATCH + 8 + tw * 11 / 10 + 24;
            if x > 10 && x + w > W as i32 - 10 {
                row += 1;
                x = 10;
            }
            out.push((row, x, k));
            x += w;
        }
        out
    }

    fn header_h(&self) -> u32 {
        let rows = self
            .legend_layout()
            .last()
            .map_or(0, |(r, _, _)| r + 1)
            .max(1);
        14 + TITLE_PX + 8 + SUB_PX + 14 + rows * LEGEND_ROW + 6
    }

    fn grid(&self) -> (u32, u32, u32) {
        match &self.body {
            Body::Panels { cols, panels } => {
                let cols = (*cols).clamp(1, panels.len().max(1)) as u32;
                let rows = (panels.len() as u32).div_ceil(cols).max(1);
                (cols, rows, PANEL_H)
            }
            Body::Timeline(r) => {
                let n = r.requests.len().min(TIMELINE_MAX_REQUESTS) as u32;
                (1, 1, (n * 5 * TIMELINE_ROW + 110).max(PANEL_H))
            }
        }
    }

    /// Width and height in pixels.
    pub fn size(&self) -> (u32, u32) {
        let (cols, rows, ph) = self.grid();
        ((W / cols) * cols, self.header_h() + rows * ph)
    }

    fn draw_header<DB: DrawingBackend>(&self, a: &DrawingArea<DB, Shift>) -> anyhow::Result<()>
    where
        DB::ErrorType: 'static,
    {
        a.fill(&WHITE).map_err(err)?;
        let max = W as i32 - 20;
        // Regular weight: the embedded font has no bold face, so a bold title would be
        // measured narrower than a browser draws it.
        let title = ("sans-serif", fit(&self.title, TITLE_PX, max)).into_font();
        a.draw(&Text::new(self.title.clone(), (10, 12), title))
            .map_err(err)?;
        let sub = ("sans-serif", fit(&self.subtitle, SUB_PX, max)).into_font();
        a.draw(&Text::new(
            self.subtitle.clone(),
            (10, 14 + TITLE_PX as i32 + 8),
            sub.color(&RGBColor(70, 70, 70)),
        ))
        .map_err(err)?;
        let y0 = (14 + TITLE_PX + 8 + SUB_PX + 14) as i32;
        for (row, x, k) in self.legend_layout() {
            let y = y0 + (row * LEGEND_ROW) as i32 + LEGEND_ROW as i32 / 2;
            swatch(a, &k, x, y)?;
            a.draw(&Text::new(
                k.label.clone(),
                (x + SWATCH + 8, y),
                TextStyle::from(("sans-serif", LEGEND_PX).into_font())
                    .pos(Pos::new(HPos::Left, VPos::Center)),
            ))
            .map_err(err)?;
        }
        Ok(())
    }

    fn draw_cell<DB: DrawingBackend>(
        &self,
        i: usize,
        a: &DrawingArea<DB, Shift>,
    ) -> anyhow::Result<()>
    where
        DB::ErrorType: 'static,
    {
        a.fill(&WHITE).map_err(err)?;
        match &self.body {
            Body::Panels { panels, .. } => draw_panel(a, &panels[i]),
            Body::Timeline(r) => timeline(a, r),
        }
    }

    fn cells(&self) -> usize {
        match &self.body {
            Body::Panels { panels, .. } => panels.len(),
            Body::Timeline(_) => 1,
        }
    }

    /// Writes `dir/name.png` (through a temporary file renamed into place).
    pub fn write_png(&self, dir: &Path) -> anyhow::Result<std::path::PathBuf> {
        register_font();
        let path = dir.join(format!("{}.png", self.name));
        let tmp = dir.join(format!(".{}.{}.tmp.png", self.name, std::process::id()));
        let drawn = (|| -> anyhow::Result<()> {
            let (w, h) = self.size();
            let (cols, _, ph) = self.grid();
            let root = BitMapBackend::new(&tmp, (w, h)).into_drawing_area();
            root.fill(&WHITE).map_err(err)?;
            let hh = self.header_h();
            self.draw_header(&root.clone().shrink((0, 0), (w, hh)))?;
            let pw = w / cols;
            for i in 0..self.cells() {
                let (c, r) = (i as u32 % cols, i as u32 / cols);
                let cell = root
                    .clone()
                    .shrink(((c * pw) as i32, (hh + r * ph) as i32), (pw, ph));
                self.draw_cell(i, &cell)?;
            }
            root.present().map_err(err)?;
            Ok(())
        })();
        if let Err(e) = drawn {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.context(format!("drawing {}", path.display())));
        }
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
        Ok(path)
    }

    /// The figure as one SVG document: the header and each panel nested inside.
    pub fn svg(&self) -> anyhow::Result<String> {
        register_font();
        let (w, h) = self.size();
        let (cols, _, ph) = self.grid();
        let mut out = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"figure\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" role=\"img\" aria-label=\"{}\">\n<rect width=\"{w}\" height=\"{h}\" fill=\"#FFFFFF\"/>\n",
            crate::report::html::esc(&self.title)
        );
        let hh = self.header_h();
        piece(&mut out, "legend", (0, 0), (w, hh), |a| self.draw_header(a))?;
        let pw = w / cols;
        for i in 0..self.cells() {
            let (c, r) = (i as u32 % cols, i as u32 / cols);
            piece(&mut out, "panel", (c * pw, hh + r * ph), (pw, ph), |a| {
                self.draw_cell(i, a)
            })?;
        }
        out.push_str("</svg>\n");
        Ok(out)
    }
}

/// Draws one part of a figure into its own SVG and nests it at (x, y) with a class.
fn piece(
    out: &mut String,
    class: &str,
    (x, y): (u32, u32),
    size: (u32, u32),
    f: impl FnOnce(&DrawingArea<SVGBackend<'_>, Shift>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut s = String::new();
    {
        let root = SVGBackend::with_string(&mut s, size).into_drawing_area();
        f(&root)?;
        root.present().map_err(err)?;
    }
    let s = s.replacen(
        "<svg ",
        &format!("<svg class=\"{class}\" x=\"{x}\" y=\"{y}\" "),
        1,
    );
    out.push_str(&s);
    Ok(())
}

/// The largest font size up to `px` at which `text` fits in `max` pixels.
fn fit(text: &str, px: u32, max: i32) -> u32 {
    let mut px = px;
    while px > 9 {
        let w = ("sans-serif", px)
            .into_font()
            .box_size(text)
            .map(|b| b.0 as i32)
            .unwrap_or(0);
        // Slack for a viewer whose sans-serif is wider than the embedded DejaVu Sans.
        if w <= max * 9 / 10 {
            break;
        }
        px -= 1;
    }
    px
}

fn swatch<DB: DrawingBackend>(
    a: &DrawingArea<DB, Shift>,
    k: &Key,
    x: i32,
    y: i32,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    if k.block {
        a.draw(&Rectangle::new(
            [(x + 4, y - 7), (x + SWATCH - 4, y + 7)],
            k.color.filled(),
        ))
        .map_err(err)?;
        return Ok(());
    }
    let style = k.color.stroke_width(3);
    let segs: Vec<(i32, i32)> = match k.dash {
        None => vec![(0, SWATCH)],
        Some((d, g)) => {
            let (d, g) = (d as i32, g as i32);
            (0..)
                .map(|i| (i * (d + g), (i * (d + g) + d).min(SWATCH)))
                .take_while(|s| s.0 < SWATCH)
                .collect()
        }
    };
    for (s, e) in segs {
        a.draw(&PathElement::new(vec![(x + s, y), (x + e, y)], style))
            .map_err(err)?;
    }
    Ok(())
}

fn bounds(v: impl Iterator<Item = f64>, log: bool) -> Option<(f64, f64)> {
    let (lo, hi) = v
        .filter(|x| x.is_finite() && (!log || *x > 0.0))
        .fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    (lo <= hi).then_some((lo, hi))
}

fn padded(lo: f64, hi: f64, log: bool) -> (f64, f64) {
    if log {
        // A decade at least, so a single point still gets ticks either side.
        let (lo, hi) = (lo / 1.25, hi * 1.25);
        if hi / lo < 10.0 {
            let mid = (lo * hi).sqrt();
            (mid / 10f64.sqrt(), mid * 10f64.sqrt())
        } else {
            (lo, hi)
        }
    } else {
        (lo.min(0.0), if hi > 0.0 { hi * 1.1 } else { 1.0 })
    }
}

fn draw_panel<DB: DrawingBackend>(a: &DrawingArea<DB, Shift>, p: &Panel) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let xs = p
        .lines
        .iter()
        .flat_map(|l| l.pts.iter().map(|q| q.0))
        .chain(p.marks.iter().map(|m| m.0));
    let Some((x0, x1)) = bounds(xs, true) else {
        anyhow::bail!("panel {:?} has nothing to draw", p.title);
    };
    let (x0, x1) = padded(x0, x1, true);
    let ys = p.lines.iter().flat_map(|l| l.pts.iter().map(|q| q.1));
    let (y0, y1) = if p.y.unit == Unit::Fraction {
        (0.0, 1.02)
    } else {
        let (lo, hi) = bounds(ys, p.y.log).unwrap_or((0.1, 1.0));
        padded(lo, hi, p.y.log)
    };
    let title = (
        "sans-serif",
        fit(&p.title, 15, a.dim_in_pixel().0 as i32 - 16),
    )
        .into_font();
    let mut b = ChartBuilder::on(a);
    b.caption(&p.title, title)
        .margin(8)
        .margin_right(22)
        .x_label_area_size(46)
        .y_label_area_size(70);
    let log_axis = |lo: f64, hi: f64, unit: Unit| {
        let (bold, light) = match unit {
            // Sizes and concurrency are powers of two: label those.
            Unit::Bytes | Unit::Count => {
                let all = pow2_points(lo, hi, 1);
                let step = all.len().div_ceil(8).max(1) as u32;
                (pow2_points(lo, hi, step), all)
            }
            _ => (log_ticks(lo, hi), log_minor(lo, hi)),
        };
        (lo..hi)
            .log_scale()
            .with_key_points(bold)
            .with_light_points(light)
    };
    let (xu, yu) = (p.x.unit, p.y.unit);
    if p.y.log {
        let c = b
            .build_cartesian_2d(log_axis(x0, x1, xu), log_axis(y0, y1, yu))
            .map_err(err)?;
        panel_body(c, p, (y0, y1))
    } else {
        let c = b
            .build_cartesian_2d(log_axis(x0, x1, xu), y0..y1)
            .map_err(err)?;
        panel_body(c, p, (y0, y1))
    }
}

/// Labelled ticks on a log axis: 1-2-5 per decade, thinned to 1-3 or 1 when the range spans
/// many decades, so a panel carries 3 to 8 labels.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut best = Vec::new();
    for mults in [&[1.0, 2.0, 5.0][..], &[1.0, 3.0], &[1.0]] {
        let ticks = decade_points(lo, hi, mults);
        if ticks.len() <= 8 {
            return ticks;
        }
        best = ticks;
    }
    let step = best.len().div_ceil(8);
    best.into_iter().step_by(step).collect()
}

/// Powers of two in [lo, hi], every `step`-th.
fn pow2_points(lo: f64, hi: f64, step: u32) -> Vec<f64> {
    let (a, b) = (lo.log2().ceil() as i32, hi.log2().floor() as i32);
    (a..=b)
        .step_by(step.max(1) as usize)
        .map(|k| 2f64.powi(k))
        .collect()
}

/// Grid lines at every 1..9 of each decade.
fn log_minor(lo: f64, hi: f64) -> Vec<f64> {
    decade_points(lo, hi, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
}

fn decade_points(lo: f64, hi: f64, mults: &[f64]) -> Vec<f64> {
    let mut out = Vec::new();
    let mut d = 10f64.powf(lo.log10().floor());
    while d <= hi {
        for m in mults {
            let v = d * m;
            if v >= lo && v <= hi {
                out.push(v);
            }
        }
        d *= 10.0;
    }
    out
}

fn panel_body<DB: DrawingBackend, X, Y>(
    mut chart: ChartContext<'_, DB, Cartesian2d<X, Y>>,
    p: &Panel,
    (y0, y1): (f64, f64),
) -> anyhow::Result<()>
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
    DB::ErrorType: 'static,
{
    let (xu, yu) = (p.x.unit, p.y.unit);
    chart
        .configure_mesh()
        .x_desc(p.x.desc.as_str())
        .y_desc(p.y.desc.as_str())
        .y_labels(6)
        .x_label_formatter(&|v| xu.tick(*v))
        .y_label_formatter(&|v| yu.tick(*v))
        .label_style(("sans-serif", 12))
        .axis_desc_style(("sans-serif", 13))
        .light_line_style(RGBColor(235, 235, 235))
        .bold_line_style(RGBColor(215, 215, 215))
        .draw()
        .map_err(err)?;
    for &(x, m) in &p.marks {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(x, y0), (x, y1)],
                m.color().stroke_width(2),
            )))
            .map_err(err)?;
    }
    for l in &p.lines {
        let pts: Vec<(f64, f64)> = l
            .pts
            .iter()
            .copied()
            .filter(|q| q.0 > 0.0 && q.1.is_finite() && (!p.y.log || q.1 > 0.0))
            .collect();
        let style = l.method.color().stroke_width(3);
        match l.wire.dash() {
            None => chart.draw_series(LineSeries::new(pts.clone(), style)),
            Some((d, g)) => chart.draw_series(DashedLineSeries::new(pts.clone(), d, g, style)),
        }
        .map_err(err)?;
        if p.dots || pts.len() == 1 {
            let c = l.method.color();
            chart
                .draw_series(pts.into_iter().map(|q| Circle::new(q, 4, c.filled())))
                .map_err(err)?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- timeline

/// (stage, `[start, end]` ms of each phase of [`PHASES`]: receive, compute, send).
pub type StageSpan = (String, [(f64, f64); 3]);

/// Per request, per stage: where each phase lay, relative to the request's start (stages
/// start a request together): receive (offer -> inputs verified), compute, and send (the
/// outbound engine transfer). Outcomes carry start offsets; a report written before they
/// did has none, and its spans are laid back from each stage's end (`total_ms`) instead.
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
                    let laid_back = (s.total_ms - recv - s.compute_ms - send).max(0.0);
                    let compute_at = s.compute_start_ms.unwrap_or(laid_back + recv);
                    let recv_at = s
                        .received
                        .as_ref()
                        .and_then(|x| x.start_ms)
                        .unwrap_or(compute_at - recv);
                    let send_at = s
                        .sent
                        .as_ref()
                        .and_then(|x| x.transfer_start_ms)
                        .unwrap_or(compute_at + s.compute_ms);
                    (
                        s.stage.clone(),
                        [
                            (recv_at, recv_at + recv),
                            (compute_at, compute_at + s.compute_ms),
                            (send_at, send_at + send),
                        ],
                    )
                })
                .collect();
            (q.id.clone(), spans)
        })
        .collect()
}

const STAGES: [&str; 5] = [
    "encoder",
    "thinker_prefill",
    "thinker_decode",
    "talker",
    "code2wav",
];

/// The timeline's phases and their colours (not method colours: these are parts of a stage).
pub const PHASES: [(&str, RGBColor); 3] = [
    ("receive (offer -> verified)", RGBColor(23, 190, 207)),
    ("compute", RGBColor(44, 160, 44)),
    ("send (engine transfer)", RGBColor(188, 189, 34)),
];

fn timeline<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, r: &Report) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let mut spans = stage_spans(r);
    spans.truncate(TIMELINE_MAX_REQUESTS);
    let rows = spans.len() * STAGES.len();
    let xmax = r
        .requests
        .iter()
        .take(TIMELINE_MAX_REQUESTS)
        .map(|q| q.e2e_ms)
        .fold(1e-3f64, f64::max);
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        .margin_right(30)
        .x_label_area_size(46)
        .y_label_area_size(250)
        .build_cartesian_2d(0.0..xmax * 1.05, (0..rows as i32).into_segmented())
        .map_err(err)?;
    let labels: Vec<String> = spans
        .iter()
        .flat_map(|(id, _)| STAGES.iter().map(move |s| format!("{id} {s}")))
        .collect();
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc("time since the request started")
        .x_label_formatter(&|v| human_time(v * 1e3))
        .y_labels(rows)
        .y_label_formatter(&|y| match y {
            SegmentValue::CenterOf(i) => rows
                .checked_sub(*i as usize + 1)
                .and_then(|k| labels.get(k))
                .cloned()
                .unwrap_or_default(),
            _ => String::new(),
        })
        .label_style(("sans-serif", 11))
        .axis_desc_style(("sans-serif", 13))
        .draw()
        .map_err(err)?;
    for (pi, (_, c)) in PHASES.iter().enumerate() {
        let mut rects = Vec::new();
        for (ri, (_, sp)) in spans.iter().enumerate() {
            for (stage, phases) in sp {
                let si = STAGES.iter().position(|s| s == stage).unwrap_or(0);
                let row = (rows - 1 - (ri * STAGES.len() + si)) as i32;
                let (a, b) = phases[pi];
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
        chart.draw_series(rects).map_err(err)?;
    }
    // Each request's end-to-end mark.
    for (ri, q) in r.requests.iter().take(TIMELINE_MAX_REQUESTS).enumerate() {
        let top = (rows - ri * STAGES.len()) as i32;
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![
                    (q.e2e_ms, SegmentValue::Exact(top)),
                    (q.e2e_ms, SegmentValue::Exact(top - STAGES.len() as i32)),
                ],
                BLACK.stroke_width(2),
            )))
            .map_err(err)?;
    }
    Ok(())
}

/// The timeline's legend entries.
pub fn timeline_keys() -> Vec<Key> {
    let mut keys: Vec<Key> = PHASES
        .iter()
        .map(|(l, c)| Key {
            label: (*l).into(),
            color: *c,
            dash: None,
            block: true,
        })
        .collect();
    keys.push(Key {
        label: "request end to end".into(),
        color: BLACK,
        dash: None,
        block: false,
    });
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_read_as_people_write_them() {
        assert_eq!(human_time(12.345), "12.3 us");
        assert_eq!(human_time(1500.0), "1.5 ms");
        assert_eq!(human_time(2.5e6), "2.5 s");
        assert_eq!(human_bytes(4096.0), "4 KiB");
        assert_eq!(human_bytes(1.5 * 1024.0 * 1024.0), "1.5 MiB");
        assert_eq!(human_bytes(100.0), "100 B");
    }

    #[test]
    fn log_axes_get_a_few_round_ticks() {
        assert_eq!(log_ticks(30.0, 900.0), vec![50.0, 100.0, 200.0, 500.0]);
        let wide = log_ticks(1.0, 1e9);
        assert!(wide.len() <= 8 && wide.len() >= 3, "{wide:?}");
        assert!(log_minor(1.0, 100.0).len() == 19);
        assert_eq!(pow2_points(3.0, 40.0, 1), vec![4.0, 8.0, 16.0, 32.0]);
        assert_eq!(pow2_points(1000.0, 1e9, 4).len(), 5);
    }

    #[test]
    fn a_cdf_ends_at_one_and_keeps_the_tail() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        let c = cdf(&v);
        assert!(c.len() <= 804, "{}", c.len());
        assert_eq!(c[0], (1.0, 0.0));
        assert_eq!(*c.last().unwrap(), (1000.0, 1.0));
        assert!(c.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
        // Steps: up at each sample, flat between.
        assert_eq!(
            cdf(&[3.0, 1.0]),
            vec![(1.0, 0.0), (1.0, 0.5), (3.0, 0.5), (3.0, 1.0)]
        );
        assert!(cdf(&[0.0, f64::NAN]).is_empty());
    }

    #[test]
    fn every_method_has_its_own_colour_and_baselines_map_to_them() {
        let all = [
            Method::Omnirig,
            Method::Pickle,
            Method::Pickle5Oob,
            Method::PickleShm,
            Method::Floor,
            Method::Other,
        ];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a.color(), b.color(), "{a:?} and {b:?}");
            }
        }
        assert_eq!(Method::of_baseline("pickle5-oob"), Method::Pickle5Oob);
        assert_eq!(Method::of_baseline("raw-polled"), Method::Floor);
        assert_eq!(Method::of_baseline("memcpy"), Method::Floor);
        assert_eq!(Wire::of_baseline("pickle-shm"), Wire::Shm);
        assert_ne!(Wire::Tcp.dash(), Wire::Shm.dash());
    }
}
