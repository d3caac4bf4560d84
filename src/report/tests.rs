//! The report page: structure checked here on every `cargo test`; rendered in headless
//! Chromium when it is installed (`.ci/run` installs Debian's package and sets
//! `OMNIRIG_REQUIRE_CHROMIUM=1`, so a missing browser fails CI instead of skipping).
//! `OMNIRIG_REPORT_PAGES=a/index.html:b/index.html` adds pages written from real runs to both
//! checks.

use super::*;
use crate::bench::{Baseline, Samples};
use omnirig_harness::{HopResult, HopSummary, RequestResult, StageOutcome};
use std::io::Write;
use std::time::Duration;

fn samples(us: &[u64], bytes: u64) -> Samples {
    let mut s = Samples::new(bytes);
    for &u in us {
        s.push(Duration::from_micros(u));
    }
    s
}

fn write_json(dir: &Path, name: &str, r: &Results) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_string(r).unwrap()).unwrap();
    p
}

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("omnirig-report-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A hop run like `bench hop` writes: per case, omnirig against three baselines with every
/// sample kept and the plain-socket floor.
fn hop_run(hop: &str, transport: &str, cases: usize) -> Results {
    let mut r = Results {
        suite: "hop".into(),
        transport: transport.into(),
        rows: vec![],
        machine: Some(crate::bench::Machine {
            host: "ci-host".into(),
            cpus: 2,
            cpu_model: "Test CPU <&>".into(),
            kernel: "6.1".into(),
        }),
    };
    for c in 0..cases {
        let size = 3000u64 << (2 * c);
        let base_us = 40 + 30 * c as u64;
        let ours: Vec<u64> = (0..50).map(|i| base_us + i % 7).collect();
        let ours = samples(&ours, size);
        for (k, name) in ["pickle", "pickle5-oob", "pickle-shm"].iter().enumerate() {
            let b: Vec<u64> = (0..50).map(|i| base_us * (3 + k as u64) + i % 11).collect();
            let b = samples(&b, size);
            let mut row = Row::new(&format!("hop-{transport}"), size, &ours, name, &b);
            row.case = Some(format!("case_{c}"));
            row.hop = Some(hop.into());
            row.attach_samples(&ours, &b);
            row.floor = Some(Baseline {
                name: "raw-polled".into(),
                gbps: 1.0,
                p50_us: base_us as f64 * 0.6,
                p99_us: None,
                samples_us: None,
            });
            r.rows.push(row);
        }
    }
    r
}

fn transfer_run(transport: &str, floor: &str) -> Results {
    let mut r = Results {
        suite: "transfer".into(),
        transport: transport.into(),
        rows: vec![],
        machine: None,
    };
    for op in ["write", "read"] {
        for (i, size) in [4096u64, 1 << 20, 64 << 20].into_iter().enumerate() {
            let ours = samples(&[10 + i as u64 * 100, 20, 30], size);
            let base = samples(&[15, 25 + i as u64 * 200, 35], size);
            r.rows.push(Row::new(op, size, &ours, floor, &base));
        }
    }
    r
}

fn pipeline_run() -> Results {
    let mut r = Results {
        suite: "pipeline".into(),
        transport: "tcp".into(),
        rows: vec![],
        machine: None,
    };
    for c in [1usize, 4, 16] {
        let mut row = Row::new(
            "request",
            1 << 20,
            &samples(&[1000 * c as u64, 2000], 1 << 20),
            "pickle",
            &samples(&[5000 * c as u64, 9000], 1 << 20),
        );
        row.concurrency = Some(c);
        row.throughput_rps = Some((100.0 / c as f64, 20.0 / c as f64));
        r.rows.push(row);
    }
    r
}

fn run_report(dir: &Path) -> PathBuf {
    let stage = |name: &str, total: f64| StageOutcome {
        stage: name.into(),
        participated: true,
        compute_ms: 1.0,
        total_ms: total,
        ..Default::default()
    };
    let mut report = Report {
        report_version: 1,
        scenario: "t<&>".into(),
        mode: "in_process".into(),
        transports: [("kv_cache".to_string(), "shm".to_string())].into(),
        concurrency: 1,
        wall_s: 1.0,
        summary: Default::default(),
        hops: vec![],
        requests: (0..3)
            .map(|i| RequestResult {
                id: format!("00{i}-x"),
                label: "x".into(),
                ok: i != 2,
                error: (i == 2).then(|| "kv_cache: timed out <after 5 s> & gave up".into()),
                e2e_ms: 9.0 + i as f64,
                hops: vec![HopResult {
                    hop: "kv_cache".into(),
                    transfer_ms: 2.0 + i as f64,
                    handoff_ms: 3.0 + i as f64,
                    ..Default::default()
                }],
                stages: vec![stage("thinker_prefill", 4.0), stage("thinker_decode", 8.0)],
                ..Default::default()
            })
            .collect(),
        stages: vec![],
        faults: None,
    };
    report.summarise();
    assert!(matches!(report.hops.as_slice(), [HopSummary { transport, .. }] if transport == "shm"));
    report.write(dir).unwrap()
}

/// Every input kind at once, and the hop with many cases over two transports (the figure
/// that used to draw 32 curves in one panel).
fn every_input(dir: &Path) -> Vec<PathBuf> {
    vec![
        write_json(dir, "transfer-tcp.json", &transfer_run("tcp", "raw-polled")),
        write_json(dir, "transfer-shm.json", &transfer_run("shm", "memcpy")),
        write_json(dir, "hop-tt-tcp.json", &hop_run("thinker-talker", "tcp", 8)),
        write_json(dir, "hop-tt-shm.json", &hop_run("thinker-talker", "shm", 8)),
        write_json(dir, "hop-kv-tcp.json", &hop_run("kv", "tcp", 2)),
        write_json(dir, "pipeline.json", &pipeline_run()),
        run_report(dir),
    ]
}

// ---------------------------------------------------------------- structure

/// Tags balance, text has no stray `<`, every `&` starts an entity. Returns the open tags
/// seen, in order.
fn well_formed(html: &str) -> Result<Vec<String>, String> {
    let mut stack: Vec<String> = Vec::new();
    let mut seen = Vec::new();
    let b = html.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'<' => {
                let end = html[i..]
                    .find('>')
                    .map(|e| i + e)
                    .ok_or(format!("unclosed tag at byte {i}"))?;
                let tag = &html[i + 1..end];
                if tag.starts_with('!') {
                    // <!DOCTYPE html>
                } else if let Some(name) = tag.strip_prefix('/') {
                    let open = stack.pop().ok_or(format!("</{name}> closes nothing"))?;
                    if open != name.trim() {
                        return Err(format!("</{name}> closes <{open}> at byte {i}"));
                    }
                } else {
                    let name: String = tag
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                        .collect();
                    if name.is_empty() {
                        return Err(format!("stray '<' at byte {i}: {}", &html[i..end]));
                    }
                    if tag.matches('"').count() % 2 == 1 {
                        return Err(format!("unbalanced quotes in <{tag}>"));
                    }
                    seen.push(name.clone());
                    if !tag.ends_with('/') {
                        stack.push(name);
                    }
                }
                i = end + 1;
            }
            b'&' => {
                let rest = &html[i + 1..];
                let n = rest
                    .find(';')
                    .filter(|&n| {
                        n > 0
                            && n < 8
                            && rest[..n]
                                .chars()
                                .all(|c| c.is_ascii_alphanumeric() || c == '#')
                    })
                    .ok_or(format!("bare '&' at byte {i}"))?;
                i += n + 2;
            }
            _ => i += 1,
        }
    }
    if let Some(open) = stack.pop() {
        return Err(format!("<{open}> never closed"));
    }
    Ok(seen)
}

fn attr_values<'a>(html: &'a str, attr: &str) -> Vec<&'a str> {
    let key = format!(" {attr}=\"");
    html.match_indices(&key)
        .map(|(i, _)| {
            let v = &html[i + key.len()..];
            &v[..v.find('"').unwrap_or(0)]
        })
        .collect()
}

/// The colours only data draws with: method lines and timeline phases.
fn data_colours() -> Vec<String> {
    use plot::Method as M;
    let hex = |c: plotters::style::RGBColor| format!("\"#{:02X}{:02X}{:02X}\"", c.0, c.1, c.2);
    [
        M::Omnirig,
        M::Pickle,
        M::Pickle5Oob,
        M::PickleShm,
        M::Floor,
        M::Other,
    ]
    .iter()
    .map(|m| hex(m.color()))
    .chain(plot::PHASES.iter().map(|p| hex(p.1)))
    .collect()
}

/// Per figure id: its panels' texts, each panel checked for drawn data. Errors name the
/// figure and the panel.
fn check_structure(index: &Path) -> Result<BTreeMap<String, Vec<String>>, String> {
    let dir = index.parent().unwrap();
    let html = std::fs::read_to_string(index).map_err(|e| e.to_string())?;
    let tags = well_formed(&html)?;
    for forbidden in ["script", "img", "link", "iframe", "object"] {
        if tags.iter().any(|t| t == forbidden) {
            return Err(format!("the page has a <{forbidden}>: it must stand alone"));
        }
    }
    for v in attr_values(&html, "href")
        .into_iter()
        .chain(attr_values(&html, "src"))
    {
        if let Some(id) = v.strip_prefix('#') {
            if !html.contains(&format!("id=\"{id}\"")) {
                return Err(format!("link to missing #{id}"));
            }
        } else if v.contains("://") || v.starts_with("//") {
            return Err(format!("the page reaches out to {v}"));
        } else if !dir.join(v).is_file() {
            return Err(format!(
                "the page names {v}, which is not in {}",
                dir.display()
            ));
        }
    }
    let colours = data_colours();
    let mut figures = BTreeMap::new();
    for fig in html.split("<figure id=\"").skip(1) {
        let id = fig[..fig.find('"').unwrap()].to_string();
        let body = &fig[..fig.find("</figure>").ok_or("unclosed figure")?];
        if !body.contains("<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"figure\"") {
            return Err(format!("{id}: no inline svg"));
        }
        if body.matches("<svg class=\"legend\"").count() != 1 {
            return Err(format!("{id}: not exactly one legend"));
        }
        let mut panels = Vec::new();
        for p in body.split("<svg class=\"panel\"").skip(1) {
            let p = &p[..p.find("</svg>").ok_or("unclosed panel")?];
            let title = p
                .split("<text")
                .nth(1)
                .and_then(|t| t.split('>').nth(1))
                .and_then(|t| t.split('<').next())
                .unwrap_or("")
                .trim()
                .to_string();
            let data = p
                .split('<')
                .filter(|e| {
                    ["polyline", "circle", "rect"]
                        .iter()
                        .any(|t| e.starts_with(t))
                })
                .any(|e| colours.iter().any(|c| e.contains(c.as_str())));
            if !data {
                return Err(format!("{id}: panel {title:?} draws no data"));
            }
            panels.push(title);
        }
        if panels.is_empty() {
            return Err(format!("{id}: no panels"));
        }
        for ext in ["png", "svg"] {
            let f = dir.join(format!("{}.{ext}", id.trim_start_matches("fig-")));
            let len = std::fs::metadata(&f).map(|m| m.len()).unwrap_or(0);
            if len < 1000 {
                return Err(format!("{} missing or empty", f.display()));
            }
        }
        figures.insert(id, panels);
    }
    if figures.is_empty() {
        return Err("no figures".into());
    }
    Ok(figures)
}

fn extra_pages() -> Vec<PathBuf> {
    std::env::var("OMNIRIG_REPORT_PAGES")
        .map(|v| {
            v.split(':')
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn every_suite_and_a_run_report_make_one_well_formed_page() {
    let dir = scratch("site");
    let inputs = every_input(&dir);
    let out = dir.join("out");
    let files = write_site(&inputs, &out).unwrap();
    assert_eq!(files[0], out.join("index.html"));
    assert_eq!(files[1], out.join("summary.md"));
    let figs = check_structure(&out.join("index.html")).unwrap();
    let names: Vec<&str> = figs.keys().map(|k| k.as_str()).collect();
    assert_eq!(
        names,
        [
            "fig-bandwidth",
            "fig-bandwidth-kv",
            "fig-bandwidth-thinker-talker",
            "fig-latency-cdf-kv",
            "fig-latency-cdf-thinker-talker",
            "fig-pipeline",
            "fig-run-cdf",
            "fig-run-timeline",
        ]
    );
    // Small multiples: one panel per case and transport, never one crowded panel.
    let tt = &figs["fig-latency-cdf-thinker-talker"];
    assert_eq!(tt.len(), 16, "{tt:?}");
    assert!(
        tt.iter()
            .any(|t| t.starts_with("case_7 (") && t.ends_with("omnirig over shm"))
    );
    assert_eq!(figs["fig-bandwidth"].len(), 4);
    assert_eq!(figs["fig-pipeline"].len(), 3);
    assert_eq!(figs["fig-run-cdf"].len(), 2);
    // Titles come from the data: both transports named, the machine named (escaped).
    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert!(
        html.contains(
            "thinker-talker hop: round-trip latency CDF per case, omnirig over tcp and shm"
        )
    );
    assert!(html.contains("ci-host (2 CPUs, Test CPU &lt;&amp;&gt;)"));
    assert!(html.contains("Run t&lt;&amp;&gt;"));
    // A failed request is named, with its error, escaped.
    assert!(
        html.contains("<li class=\"missed\">FAILED: 2/3 requests ok"),
        "{html}"
    );
    assert!(
        html.contains("<td>002-x</td><td>kv_cache: timed out &lt;after 5 s&gt; &amp; gave up</td>")
    );
    assert!(!html.contains("(tcp, two processes)"));
    // One colour per method: every hop figure's legend names each method once.
    let legend = html
        .split("id=\"fig-latency-cdf-thinker-talker\"")
        .nth(1)
        .unwrap()
        .split("<svg class=\"panel\"")
        .next()
        .unwrap();
    for m in [
        "omnirig",
        "pickle over ZMQ",
        "pickle5 out-of-band over ZMQ",
        "pickle, tensors via shared memory",
        "floor: plain socket p50 (vertical line)",
        "over tcp",
        "over shm (same host)",
    ] {
        assert_eq!(legend.matches(&format!(">\n{m}\n<")).count(), 1, "{m}");
    }
    // Verdicts and tables per run; summary.md has the same tables.
    assert!(html.contains("thinker-talker &gt;= 5x pickle"));
    // The run: hops, where each handoff's time goes, failed requests.
    assert!(
        html.contains(">reserve + grant</th>"),
        "no handoff phase table"
    );
    assert_eq!(html.matches("<table>").count(), 2 + 3 + 1 + 3);
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert_eq!(
        md.matches("\n|---").count(),
        html.matches("<table>").count(),
        "{md}"
    );
    let rows_html = html.matches("<tr>").count();
    let rows_md = md.lines().filter(|l| l.starts_with("| ")).count();
    assert_eq!(rows_html, rows_md);
    assert!(md.contains("![thinker-talker hop: round-trip latency CDF"));
    // PNGs are PNGs; nothing temporary is left behind.
    let png = std::fs::read(out.join("latency-cdf-thinker-talker.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    for f in std::fs::read_dir(&out).unwrap() {
        let name = f.unwrap().file_name().to_string_lossy().to_string();
        assert!(!name.starts_with('.'), "left behind: {name}");
    }
    // Run reports alone still make a page; nothing at all is an error.
    let run_only = dir.join("run-only");
    write_run_site(
        &serde_json::from_str(&std::fs::read_to_string(&inputs[6]).unwrap()).unwrap(),
        &run_only,
    )
    .unwrap();
    check_structure(&run_only.join("index.html")).unwrap();
    assert!(write_site(&[], &dir.join("none")).is_err());
    // The markdown tables of `--markdown` are unchanged: one per benchmark file.
    let md = markdown(&inputs).unwrap();
    assert_eq!(md.matches("### ").count(), 6, "{md}");
    assert!(markdown(&inputs[6..]).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_structure_check_catches_what_it_looks_for() {
    assert!(well_formed("<p>a</p>").is_ok());
    assert!(well_formed("<p>a</b>").is_err());
    assert!(well_formed("<p>a < b</p>").is_err());
    assert!(well_formed("<p>a & b</p>").is_err());
    assert!(well_formed("<p>a &amp; b").is_err());
    let dir = scratch("broken");
    let write = |html: &str| {
        std::fs::write(dir.join("index.html"), html).unwrap();
        check_structure(&dir.join("index.html"))
    };
    let fig = |panel: &str| {
        format!(
            "<figure id=\"fig-x\"><svg xmlns=\"http://www.w3.org/2000/svg\" class=\"figure\"><svg class=\"legend\"></svg><svg class=\"panel\">{panel}</svg></svg></figure>"
        )
    };
    let blue = "<polyline stroke=\"#1F77B4\"/>";
    let e = write(&format!("<body>{}</body>", fig("<text>t</text>"))).unwrap_err();
    assert!(e.contains("draws no data"), "{e}");
    let e = write(&format!("<body>{}</body>", fig(blue))).unwrap_err();
    assert!(e.contains("x.png missing"), "{e}");
    let e = write("<body><a href=\"https://example.com/x.png\">x</a></body>").unwrap_err();
    assert!(e.contains("reaches out"), "{e}");
    let e = write("<body><script>1</script></body>").unwrap_err();
    assert!(e.contains("<script>"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pages_from_real_runs_are_well_formed() {
    for p in extra_pages() {
        let figs = check_structure(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let _ = writeln!(
            std::io::stderr(),
            "{}: {} figures, {} panels",
            p.display(),
            figs.len(),
            figs.values().map(Vec::len).sum::<usize>()
        );
    }
}

// ---------------------------------------------------------------- chromium

/// Injected into a copy of the page (the page itself has no script): measures what the
/// browser laid out and writes the findings into the DOM, which `--dump-dom` prints.
const CHECK_JS: &str = r#"
(function () {
  const bad = [];
  let figures = 0, panels = 0, texts = 0, images = 0;
  const DATA = __DATA__;
  for (const img of document.images) {
    images++;
    if (!img.complete || img.naturalWidth === 0) bad.push('image not loaded: ' + img.src);
  }
  const inside = (r, b) => r.left >= b.left - 1 && r.right <= b.right + 1 && r.top >= b.top - 1 && r.bottom <= b.bottom + 1;
  for (const fig of document.querySelectorAll('figure')) {
    figures++;
    const svg = fig.querySelector('svg.figure');
    if (!svg) { bad.push('figure without svg: ' + fig.id); continue; }
    const fb = svg.getBoundingClientRect();
    if (fb.width < 300 || fb.height < 100) bad.push('figure not rendered: ' + fig.id + ' ' + fb.width + 'x' + fb.height);
    // A nested svg's own client rect grows to hold whatever overflows it, so each part's box
    // comes from its attributes, scaled as the figure is.
    const vb = svg.viewBox.baseVal, k = fb.width / vb.width;
    const boxOf = p => {
      const x = +p.getAttribute('x'), y = +p.getAttribute('y');
      const w = +p.getAttribute('width'), h = +p.getAttribute('height');
      return { left: fb.left + x * k, top: fb.top + y * k, right: fb.left + (x + w) * k,
               bottom: fb.top + (y + h) * k, width: w * k, height: h * k };
    };
    const ps = svg.querySelectorAll('svg.panel');
    if (ps.length === 0) bad.push('figure without panels: ' + fig.id);
    for (const p of ps) {
      panels++;
      const pb = boxOf(p);
      if (pb.width < 50 || pb.height < 50) { bad.push('panel not rendered in ' + fig.id); continue; }
      let data = 0;
      for (const e of p.querySelectorAll('polyline, circle, rect')) {
        const c = ((e.getAttribute('stroke') || '') + ' ' + (e.getAttribute('fill') || '')).toUpperCase();
        if (!DATA.some(d => c.includes(d))) continue;
        const b = e.getBoundingClientRect();
        if ((b.width > 0 || b.height > 0) && b.right > pb.left && b.left < pb.right && b.bottom > pb.top && b.top < pb.bottom) data++;
      }
      if (data === 0) bad.push('empty panel in ' + fig.id + ': ' + (p.querySelector('text') || {}).textContent);
    }
    for (const part of svg.querySelectorAll('svg.legend, svg.panel')) {
      const b = boxOf(part);
      const boxes = [];
      for (const t of part.querySelectorAll('text')) {
        texts++;
        const r = t.getBoundingClientRect();
        if (r.width === 0) continue;
        if (!inside(r, b)) bad.push('text overflows its ' + part.getAttribute('class') + ' in ' + fig.id + ': ' + t.textContent.trim());
        boxes.push([r, t.textContent.trim()]);
      }
      if (part.getAttribute('class') === 'legend') {
        for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
          const [a, an] = boxes[i], [c, cn] = boxes[j];
          if (a.left < c.right - 1 && c.left < a.right - 1 && a.top < c.bottom - 1 && c.top < a.bottom - 1)
            bad.push('legend texts overlap in ' + fig.id + ': ' + an + ' / ' + cn);
        }
      }
    }
  }
  const pre = document.createElement('pre');
  pre.id = 'omnirig-check';
  pre.textContent = JSON.stringify({ figures, panels, texts, images, bad });
  document.body.appendChild(pre);
})();
"#;

fn chromium() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("OMNIRIG_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| ["chromium", "chromium-browser"].map(|n| d.join(n)))
        .find(|p| p.is_file())
}

#[derive(Debug, serde::Deserialize)]
struct BrowserCheck {
    figures: usize,
    panels: usize,
    texts: usize,
    bad: Vec<String>,
}

/// Loads a copy of `index` with the check injected into headless Chromium and returns what
/// the check found.
fn render_in_chromium(browser: &Path, index: &Path) -> BrowserCheck {
    let html = std::fs::read_to_string(index).unwrap();
    let colours: Vec<String> = data_colours()
        .iter()
        .map(|c| format!("'{}'", c.trim_matches('"')))
        .collect();
    let js = CHECK_JS.replace("__DATA__", &format!("[{}]", colours.join(",")));
    let checked = index.with_file_name(".chromium-check.html");
    std::fs::write(
        &checked,
        html.replace("</body>", &format!("<script>{js}</script>\n</body>")),
    )
    .unwrap();
    let profile = scratch("chromium-profile");
    let mut child = std::process::Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1280,1000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("--dump-dom")
        .arg(format!(
            "file://{}",
            checked.canonicalize().unwrap().display()
        ))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("starting chromium");
    let mut out = String::new();
    let reader = {
        let mut so = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut so, &mut s).map(|_| s)
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "chromium did not finish rendering {} in 120 s",
                index.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    out += &reader.join().unwrap().unwrap();
    let _ = std::fs::remove_file(&checked);
    let _ = std::fs::remove_dir_all(&profile);
    let start = out.find("<pre id=\"omnirig-check\">").unwrap_or_else(|| {
        panic!(
            "the check did not run; chromium printed:\n{}",
            &out[..out.len().min(2000)]
        )
    });
    let json = &out[start + "<pre id=\"omnirig-check\">".len()..];
    let json = &json[..json.find("</pre>").unwrap()];
    let json = json
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&amp;", "&");
    serde_json::from_str(&json).unwrap()
}

#[test]
fn the_page_renders_in_headless_chromium_with_every_figure_legible() {
    let Some(browser) = chromium() else {
        let msg = "SKIPPED the_page_renders_in_headless_chromium: no chromium on PATH (apt-get install chromium, or set OMNIRIG_CHROMIUM)";
        if std::env::var_os("OMNIRIG_REQUIRE_CHROMIUM").is_some() {
            panic!("{msg}, and OMNIRIG_REQUIRE_CHROMIUM is set");
        }
        // Straight to stderr, past the test harness's capture: a skip must be seen.
        let _ = writeln!(std::io::stderr(), "{msg}");
        return;
    };
    let dir = scratch("chromium");
    let inputs = every_input(&dir);
    let out = dir.join("out");
    write_site(&inputs, &out).unwrap();
    let mut pages = vec![out.join("index.html")];
    pages.extend(extra_pages());
    for page in pages {
        let expect = check_structure(&page).unwrap();
        let c = render_in_chromium(&browser, &page);
        assert!(
            c.bad.is_empty(),
            "{}:\n{}",
            page.display(),
            c.bad.join("\n")
        );
        assert_eq!(c.figures, expect.len(), "{}", page.display());
        assert_eq!(
            c.panels,
            expect.values().map(Vec::len).sum::<usize>(),
            "{}",
            page.display()
        );
        assert!(c.texts > 0);
        let _ = writeln!(
            std::io::stderr(),
            "chromium rendered {}: {} figures, {} panels, {} texts, all laid out inside their panels",
            page.display(),
            c.figures,
            c.panels,
            c.texts
        );
    }
    // The check can fail: a legend entry pushed out of its strip and a panel emptied of data.
    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    let li = html.find("<svg class=\"legend\"").unwrap();
    let ti = li + html[li..].find("<text x=\"").unwrap() + "<text x=\"".len();
    let te = ti + html[ti..].find('"').unwrap();
    let mut broken = format!("{}5000{}", &html[..ti], &html[te..]);
    let pi = broken.rfind("<svg class=\"panel\"").unwrap();
    let pe = pi + broken[pi..].find("</svg>").unwrap();
    let mut panel = broken[pi..pe].to_string();
    for c in data_colours() {
        panel = panel.replace(c.as_str(), "\"#EEEEEE\"");
    }
    broken.replace_range(pi..pe, &panel);
    let bdir = dir.join("broken");
    std::fs::create_dir_all(&bdir).unwrap();
    std::fs::write(bdir.join("index.html"), broken).unwrap();
    let c = render_in_chromium(&browser, &bdir.join("index.html"));
    assert!(
        c.bad
            .iter()
            .any(|b| b.starts_with("text overflows its legend")),
        "{:?}",
        c.bad
    );
    assert!(
        c.bad
            .iter()
            .any(|b| b.starts_with("empty panel in fig-run-timeline")),
        "{:?}",
        c.bad
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 10: `omnirig report` spun forever at 100% CPU on a pipeline result without
/// `throughput_rps` and on extreme values, and read /dev/zero forever. Every input renders
/// (within a bound, checked from another thread) or is refused with its path named.
#[test]
fn odd_inputs_render_or_are_refused_never_spin() {
    let dir = scratch("odd");
    let mut inputs = Vec::new();
    for (i, (lat, rps)) in [
        (1000u64, None),
        (u64::MAX / 2, Some((1e300, f64::MAX))),
        (1, Some((0.0, -1.0))),
    ]
    .into_iter()
    .enumerate()
    {
        let mut pipe = Results {
            suite: "pipeline".into(),
            transport: "tcp".into(),
            rows: vec![],
            machine: None,
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
        inputs.push(write_json(&dir, &format!("p{i}.json"), &pipe));
    }
    let mut report = Report {
        report_version: 1,
        scenario: "t".into(),
        mode: "in_process".into(),
        transports: Default::default(),
        concurrency: 1,
        wall_s: 1.0,
        summary: Default::default(),
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
    let (ins, out) = (inputs.clone(), dir.join("site"));
    std::thread::spawn(move || {
        let _ = tx.send(write_site(&ins, &out).map(|f| f.len()));
    });
    let files = rx
        .recv_timeout(Duration::from_secs(120))
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

/// The timeline places each phase where the outcome says it started; a report written
/// before outcomes carried offsets is laid back from each stage's end.
#[test]
fn timeline_spans_follow_the_outcomes_start_offsets() {
    use omnirig_harness::stage::{Received, Sent};
    let with = StageOutcome {
        stage: "talker".into(),
        participated: true,
        received: Some(Received {
            handoff_ms: 2.0,
            start_ms: Some(10.0),
            ..Default::default()
        }),
        sent: Some(Sent {
            transfer_ms: 1.0,
            transfer_start_ms: Some(20.0),
            ..Default::default()
        }),
        compute_ms: 5.0,
        compute_start_ms: Some(12.5),
        total_ms: 30.0,
        ..Default::default()
    };
    let mut without = with.clone();
    without.compute_start_ms = None;
    without.received.as_mut().unwrap().start_ms = None;
    without.sent.as_mut().unwrap().transfer_start_ms = None;
    let report = Report {
        report_version: 1,
        scenario: "t".into(),
        mode: "in_process".into(),
        transports: Default::default(),
        concurrency: 1,
        wall_s: 1.0,
        summary: Default::default(),
        hops: vec![],
        requests: vec![RequestResult {
            id: "000-x".into(),
            stages: vec![with, without],
            ..Default::default()
        }],
        stages: vec![],
        faults: None,
    };
    let spans = stage_spans(&report);
    let [(_, exact), (_, laid_back)] = spans[0].1.as_slice() else {
        panic!("{spans:?}")
    };
    assert_eq!(exact, &[(10.0, 12.0), (12.5, 17.5), (20.0, 21.0)]);
    // Laid back from the end (30): send 29..30, compute 24..29, receive 22..24.
    assert_eq!(laid_back, &[(22.0, 24.0), (24.0, 29.0), (29.0, 30.0)]);
}
