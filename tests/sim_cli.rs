//! Issue 16 at the command line: `run --transport sim` replays a seed exactly, `explore`
//! passes its invariants, `simulate` predicts and compares with a measured report, and bad
//! sim input is refused naming what was wrong.

use std::path::PathBuf;
use std::process::{Command, Output};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("omnirig-sim-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn omnirig(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_omnirig"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .env("RUST_LOG", "error")
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

const SMALL: &str = "name: small\nconcurrency: 2\nrequests:\n  - case: text_short\n    repeat: 3\n    vary_seed: true\n";

#[test]
fn a_seed_replays_exactly_and_bad_input_is_named() {
    let d = dir("replay");
    let scenario = d.join("small.yaml");
    std::fs::write(&scenario, SMALL).unwrap();
    let s = scenario.to_str().unwrap();
    let mut traces = Vec::new();
    for i in 0..2 {
        let trace = d.join(format!("trace{i}.txt"));
        let report = d.join(format!("r{i}"));
        let o = omnirig(&[
            "run",
            s,
            "--transport",
            "sim",
            "--seed",
            "9",
            "--trace",
            trace.to_str().unwrap(),
            "--report",
            report.to_str().unwrap(),
            "-q",
        ]);
        assert!(o.status.success(), "{}", text(&o));
        assert!(text(&o).contains("3/3 requests ok"), "{}", text(&o));
        traces.push((
            std::fs::read(&trace).unwrap(),
            std::fs::read(report.join("report.json")).unwrap(),
        ));
    }
    assert!(traces[0].0 == traces[1].0, "traces differ");
    assert!(traces[0].1 == traces[1].1, "reports differ");
    assert!(!traces[0].0.is_empty());

    // --seed without sim, a broken fabric file, a placement on a node that does not exist.
    let o = omnirig(&["run", s, "--seed", "9"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("--transport sim"), "{}", text(&o));
    let fabric = d.join("fabric.yaml");
    std::fs::write(
        &fabric,
        "nodes: [{ name: a, nics: [{ name: x, gbps: -1 }] }]\n",
    )
    .unwrap();
    let o = omnirig(&[
        "run",
        s,
        "--transport",
        "sim",
        "--fabric",
        fabric.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("fabric.nodes[0].nics[0].gbps"),
        "{}",
        text(&o)
    );
    std::fs::write(
        &fabric,
        "nodes: [{ name: a, nics: [{ name: x, gbps: 10 }] }]\nplacement: { talker: b }\n",
    )
    .unwrap();
    let o = omnirig(&[
        "run",
        s,
        "--transport",
        "sim",
        "--fabric",
        fabric.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("placement.talker"), "{}", text(&o));
}

#[test]
fn explore_passes_a_few_seeds() {
    let o = omnirig(&["explore", "--seeds", "3", "--start", "40"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("explored 3 seeds"), "{}", text(&o));
    assert!(text(&o).contains("0 failing"), "{}", text(&o));
}

#[test]
fn simulate_predicts_and_compares_with_a_measured_run() {
    let d = dir("simulate");
    let scenario = d.join("small.yaml");
    std::fs::write(&scenario, SMALL).unwrap();
    let s = scenario.to_str().unwrap();
    // The "measured" run: the same requests over loopback, for real.
    let scenarios = d.join("scenarios");
    let out = d.join("out");
    let simulate = |more: &[&str]| {
        let mut args = vec![
            "simulate",
            "--scenario",
            s,
            "--concurrency",
            "2",
            "--rounds",
            "1",
        ];
        args.extend_from_slice(more);
        omnirig(&args)
    };
    let o = simulate(&["--scenarios-out", scenarios.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let measured = d.join("measured");
    let o = omnirig(&[
        "run",
        scenarios.join("scenario-c2.yaml").to_str().unwrap(),
        "--transport",
        "loopback",
        "--report",
        measured.to_str().unwrap(),
        "-q",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let compare = |report: &std::path::Path, out: &std::path::Path| {
        simulate(&[
            "--measured",
            report.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
    };
    let o = compare(&measured.join("report.json"), &out);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("| 2 | kv_cache |"), "{t}");
    assert!(t.contains("| 2 | e2e p50 |"), "{t}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("simulate.json")).unwrap()).unwrap();
    assert_eq!(json["predictions"][0]["concurrency"], 2);
    assert_eq!(json["predictions"][0]["ok"], 3);
    assert!(!json["comparison"].as_array().unwrap().is_empty());
    assert!(out.join("predicted_vs_measured.svg").exists());
    // By payload size: every hop's transfers of each size, which add up to the hop's; the
    // measured run ran the same requests, so each size has as many transfers on both sides.
    let sizes = json["predictions"][0]["sizes"].as_array().unwrap();
    let kv: u64 = sizes
        .iter()
        .filter(|s| s["hop"] == "kv_cache")
        .map(|s| s["transfers"].as_u64().unwrap())
        .sum();
    assert_eq!(kv, 3, "{sizes:?}");
    let md = std::fs::read_to_string(out.join("simulate.md")).unwrap();
    let rows: Vec<&str> = md
        .split("By payload size")
        .nth(1)
        .expect("a table by payload size")
        .lines()
        .skip_while(|l| !l.starts_with("|---"))
        .skip(1)
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert_eq!(rows.len(), sizes.len(), "{md}");
    for r in rows {
        let (predicted, measured) = r.split('|').nth(4).unwrap().split_once('/').unwrap();
        assert_eq!(predicted.trim(), measured.trim(), "{r}");
    }
    assert!(
        md.trim_end()
            .ends_with("figures within 20% of the measured median."),
        "{md}"
    );
    // The answer's plots: every hop and end to end against concurrency, and the busiest
    // queue's utilisation.
    let latency = std::fs::read_to_string(out.join("latency_vs_concurrency.svg")).unwrap();
    for label in ["kv_cache handoff p50", "end to end p50"] {
        assert!(
            latency.contains(label),
            "{label} missing from the latency plot"
        );
    }
    let busiest = json["predictions"][0]["busiest"][0][0].as_str().unwrap();
    let utilisation = std::fs::read_to_string(out.join("utilisation_vs_concurrency.svg")).unwrap();
    assert!(
        utilisation.contains(busiest),
        "{busiest} missing from the utilisation plot"
    );
    // The committed reports are gzipped: the same report gzipped scores the same, and a cut
    // one is named, not read as whatever part of it decompressed.
    let gz = d.join("report.json.gz");
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(
        &mut enc,
        &std::fs::read(measured.join("report.json")).unwrap(),
    )
    .unwrap();
    let packed = enc.finish().unwrap();
    std::fs::write(&gz, &packed).unwrap();
    let out_gz = d.join("out-gz");
    let o = compare(&gz, &out_gz);
    assert!(o.status.success(), "{}", text(&o));
    let scored = |dir: &std::path::Path| {
        let md = std::fs::read_to_string(dir.join("simulate.md")).unwrap();
        md.lines()
            .filter(|l| l.contains("% |") || l.contains("within 20%"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert!(!scored(&out).is_empty());
    assert_eq!(scored(&out_gz), scored(&out));
    let cut = d.join("cut.json.gz");
    std::fs::write(&cut, &packed[..packed.len() / 2]).unwrap();
    let o = compare(&cut, &d.join("out-cut"));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("cut.json.gz: gzip data that does not decompress"),
        "{}",
        text(&o)
    );
    let o = omnirig(&["simulate", "--concurrency", "0,4"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("--concurrency: \"0\""), "{}", text(&o));
}

/// `bench transfer` over tcp on the multi-thread runtime, `iters` writes and reads of
/// `size`, with `more` options: its output and its JSON's rows.
fn tcp_bench(d: &std::path::Path, size: &str, iters: &str, more: &[&str]) -> (Output, Rows) {
    let json = d.join(format!("{size}-{}.json", more.join("")));
    let mut args = vec![
        "bench",
        "transfer",
        "--transport",
        "tcp",
        "--runtime",
        "multi",
        "--sizes",
        size,
        "--min-iters",
        iters,
        "--max-iters",
        iters,
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(more);
    let o = omnirig(&args);
    assert!(o.status.success(), "{}", text(&o));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (o, Rows(r))
}

/// A bench's JSON, by row.
struct Rows(serde_json::Value);

impl Rows {
    fn row(&self, op: &str) -> serde_json::Value {
        self.0["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["op"] == op)
            .unwrap_or_else(|| panic!("no {op} row in {}", self.0))
            .clone()
    }
}

/// The host model's copy is read from the engine's own bulk transfer: `bench transfer`'s tcp
/// write row carries the CPU time both engines' processes spent a byte and the cores they
/// kept busy (Linux's schedstat); the read row, which the calibration does not use, none.
#[test]
fn the_tcp_bench_counts_both_engines_cpu_time() {
    if !std::path::Path::new("/proc/self/task").exists() {
        return; // no /proc: the figure is None, as documented
    }
    let d = dir("bench-cpu");
    let (o, r) = tcp_bench(&d, "1M", "5", &["--batch", "4"]);
    let w = r.row("write");
    let per = w["cpu_ns_per_byte"]
        .as_f64()
        .unwrap_or_else(|| panic!("{w}"));
    let cores = w["cpu_cores"].as_f64().unwrap_or_else(|| panic!("{w}"));
    let have = std::thread::available_parallelism().unwrap().get() as f64;
    // bytes copied in and out of two sockets cost something, and no more cores than exist
    assert!(per > 0.0, "{w}");
    assert!(
        cores > 0.0 && cores <= have + 0.5,
        "{cores} cores busy of {have}: {w}"
    );
    assert!(r.row("read").get("cpu_ns_per_byte").is_none(), "{}", r.0);
    assert!(text(&o).contains("ns of CPU a byte"), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&d);
}

/// `--gap-busy` spends the pause spinning on the timing thread, not asleep: the CPU time the
/// bench counts around its writes (pauses included) holds every pause's 2 ms then, and
/// none of it asleep. Without `--gap-us` there is no pause to spend.
#[test]
fn a_busy_gap_is_spent_on_a_core() {
    if !std::path::Path::new("/proc/self/task").exists() {
        return; // no /proc: no CPU figure to read
    }
    const GAP_NS: f64 = 2e6;
    let d = dir("bench-gap-busy");
    let cpu_per_write = |more: &[&str]| {
        let w = tcp_bench(&d, "4K", "10", more).1.row("write");
        w["cpu_ns_per_byte"]
            .as_f64()
            .unwrap_or_else(|| panic!("{w}"))
            * 4096.0
    };
    let busy = cpu_per_write(&["--gap-us", "2000", "--gap-busy"]);
    let asleep = cpu_per_write(&["--gap-us", "2000"]);
    assert!(busy >= 0.9 * GAP_NS, "{busy} ns of CPU a write, busy");
    assert!(asleep < 0.5 * GAP_NS, "{asleep} ns of CPU a write, asleep");
    let o = omnirig(&["bench", "transfer", "--gap-busy"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--gap-us"), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&d);
}
