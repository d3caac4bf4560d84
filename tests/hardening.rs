//! Issue 10 at the command line: input that passes a casual look must get a clear error
//! naming what was wrong (never a panic, an abort or a hang), and reports are either written
//! whole or refused up front.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("omnirig-hard-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn omnirig(args: &[&str], files: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_omnirig"))
        .args(args)
        .args(files)
        .env("RUST_BACKTRACE", "0")
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

/// Exit status 1 (an error, not a panic's 101 or an abort's signal) and every needle said.
fn refused(o: &Output, needles: &[&str]) {
    let t = text(o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(!t.contains("panicked"), "{t}");
    for n in needles {
        assert!(t.contains(n), "missing {n:?} in: {t}");
    }
}

#[test]
fn out_of_range_scenario_values_are_refused_naming_field_and_file() {
    let d = dir("ranges");
    for (i, (yaml, field)) in [
        ("hop_timeout_s: 1e300", "hop_timeout_s"),
        ("request_timeout_s: 1e19", "request_timeout_s"),
        ("concurrency: 18446744073709551615", "concurrency"),
        (
            "arrival: { pattern: interval, interval_ms: 1e19 }",
            "arrival.interval_ms",
        ),
        (
            "arrival: { pattern: poisson, rate_per_s: 1e-300 }",
            "arrival.rate_per_s",
        ),
        (
            "faults: [{ hop: kv_cache, request: 0, kind: explode }]",
            "valid kinds: fail_submit",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let f = d.join(format!("s{i}.yaml"));
        std::fs::write(&f, format!("{yaml}\nrequests: [{{ case: text_short }}]\n")).unwrap();
        let o = omnirig(&["run", "-q"], &[&f]);
        refused(&o, &[field, &f.display().to_string()]);
    }
    // The same through a command-line override: the error still names the file.
    let f = d.join("ok.yaml");
    std::fs::write(&f, "requests: [{ case: text_short }]\n").unwrap();
    let o = omnirig(
        &["run", "-q", "--concurrency", "18446744073709551615"],
        &[&f],
    );
    refused(&o, &["concurrency", &f.display().to_string()]);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_card_with_four_billion_layers_is_refused() {
    let d = dir("card");
    let card = d.join("card.yaml");
    let yaml = include_str!("../fixtures/cards/qwen3-omni-30b-a3b.yaml")
        .replace("num_layers: 48", "num_layers: 4294967295");
    std::fs::write(&card, yaml).unwrap();
    let o = omnirig(
        &["fixtures", "describe", "--case", "text_short", "--card"],
        &[&card],
    );
    refused(&o, &["thinker.num_layers", "4294967295"]);
    let _ = std::fs::remove_dir_all(&d);
}

/// `--report` at a file: refused before the run (the scenario would take 30 s), naming it.
#[test]
fn an_unusable_report_path_fails_before_the_run() {
    let d = dir("report-path");
    let f = d.join("slow.yaml");
    std::fs::write(
        &f,
        "compute: { thinker_decode: { per_item_us: 30000000 } }\nrequests: [{ case: text_short }]\n",
    )
    .unwrap();
    let file = d.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let t = Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_omnirig"))
        .args(["run", "-q", "--report"])
        .arg(&file)
        .arg(&f)
        .output()
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    refused(&o, &[&file.display().to_string(), "not a directory"]);
    let _ = std::fs::remove_dir_all(&d);
}

/// A plot that cannot be written fails the command; report.json is still whole.
#[test]
fn a_failed_plot_fails_the_run() {
    let d = dir("plot");
    // A directory where the page must go: the page cannot be renamed into place.
    std::fs::create_dir_all(d.join("index.html").join("x")).unwrap();
    let f = d.join("s.yaml");
    std::fs::write(&f, "requests: [{ case: text_short }]\n").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_omnirig"))
        .args(["run", "-q", "--report"])
        .arg(&d)
        .arg(&f)
        .output()
        .unwrap();
    refused(&o, &["index.html"]);
    let r: omnirig_harness::Report =
        serde_json::from_slice(&std::fs::read(d.join("report.json")).unwrap()).unwrap();
    assert_eq!(r.requests.len(), 1);
    let leftovers: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let _ = std::fs::remove_dir_all(&d);
}

/// The pids of `parent`'s child processes.
fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{parent}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let p = t.path().join("children");
        if let Ok(s) = std::fs::read_to_string(p) {
            out.extend(s.split_whitespace().filter_map(|x| x.parse::<u32>().ok()));
        }
    }
    out
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// Issue 10: a stage process that stops (SIGSTOP) used to keep the run alive for 24 hours.
/// Now it is seen stopped and killed, the run ends promptly naming the stage, and no new
/// request starts once it is lost. (A stage hung while running is bounded by the per-request
/// deadline: request timeout + 8 hop timeouts + compute + 5 s.)
#[test]
fn a_stopped_stage_process_ends_the_run_in_bounded_time() {
    let d = dir("sigstop");
    let f = d.join("s.yaml");
    // 40 requests of ~0.2 s each at concurrency 2: the run would last ~4 s; decode is
    // stopped early on. Deadline per request: 2 + 8 x 0.5 + 0.2 + 5 s = 11.2 s.
    std::fs::write(
        &f,
        "concurrency: 2\nhop_timeout_s: 0.5\nrequest_timeout_s: 2\n\
         compute: { talker: { per_item_us: 200000 } }\n\
         requests: [{ case: text_short, repeat: 40 }]\n",
    )
    .unwrap();
    let t = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_omnirig"))
        .args(["run", "--processes", "--quiet"])
        .arg(&f)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Find the decode stage once it runs, let it work a little, then stop it.
    let decode = loop {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no decode stage process"
        );
        if let Some(p) = children_of(child.id())
            .into_iter()
            .find(|&p| cmdline(p).contains("--stage thinker_decode"))
        {
            break p;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::thread::sleep(Duration::from_millis(1500));
    let stopped = Command::new("kill")
        .args(["-STOP", &decode.to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let stopped_at = Instant::now();
    let out = child.wait_with_output().unwrap();
    let took = stopped_at.elapsed();
    // Whatever happened, never leave a stopped process behind.
    let _ = Command::new("kill")
        .args(["-KILL", &decode.to_string()])
        .status();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    // Seen stopped within a second (the watchdog) and killed: its peers' waits end at once.
    assert!(
        took < Duration::from_secs(15),
        "ended {took:?} after the stop: {t}"
    );
    assert!(t.contains("thinker_decode"), "{t}");
    assert!(t.contains("stopped (SIGSTOP)"), "{t}");
    assert!(
        t.contains("not started: stage thinker_decode is gone"),
        "{t}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Issue 10: sizes from input are checked against the memory this machine has, with a
/// clear error, before anything is registered (shm used to populate a 1000 GiB memfd until
/// the kernel killed the process).
#[test]
fn sizes_beyond_the_machine_are_refused_up_front() {
    let t = Instant::now();
    let o = omnirig(
        &[
            "bench",
            "transfer",
            "--transport",
            "shm",
            "--sizes",
            "1000G",
        ],
        &[],
    );
    refused(&o, &["1000.0 GiB", "MemAvailable"]);
    let d = dir("huge-tokens");
    let f = d.join("huge.yaml");
    std::fs::write(
        &f,
        "transport: shm\nrequests: [{ name: huge, request: { seed: 1, text_tokens: 100000000, \
         output_text_tokens: 8, output_audio_seconds: 1.0 } }]\n",
    )
    .unwrap();
    for args in [&["run", "-q"][..], &["run", "-q", "--processes"][..]] {
        let o = omnirig(args, &[&f]);
        refused(&o, &["MemAvailable", &f.display().to_string()]);
    }
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    let _ = std::fs::remove_dir_all(&d);
}

/// `bench transfer --batch`: out of range, or on a transport it does not apply to, is refused
/// naming the flag, before any peer starts.
#[test]
fn a_bad_batch_is_refused_naming_it() {
    let bench = |extra: &[&str]| {
        let mut args = vec!["bench", "transfer", "--sizes", "4K"];
        args.extend_from_slice(extra);
        omnirig(&args, &[])
    };
    refused(&bench(&["--batch", "0"]), &["--batch 0", "1..=1024"]);
    refused(&bench(&["--batch", "1025"]), &["--batch 1025", "1..=1024"]);
    refused(
        &bench(&["--batch", "4", "--transport", "shm"]),
        &["--batch is for --transport tcp"],
    );
}

/// A stage process needs the run's secret from its orchestrator; without it, it says so.
#[test]
fn a_stage_without_the_run_secret_refuses_to_start() {
    let o = Command::new(env!("CARGO_BIN_EXE_omnirig"))
        .args([
            "stage",
            "--stage",
            "talker",
            "--orchestrator",
            "127.0.0.1:9",
        ])
        .env_remove("OMNIRIG_RUN_SECRET")
        .output()
        .unwrap();
    refused(&o, &["OMNIRIG_RUN_SECRET"]);
}

/// Export generates each tensor whole: a card that makes one larger than the machine has is
/// refused with the tensor named, not left to the OOM killer.
#[test]
fn an_export_larger_than_the_machine_is_refused() {
    let d = dir("export");
    let card = d.join("card.yaml");
    let yaml = include_str!("../fixtures/cards/qwen3-omni-30b-a3b.yaml")
        .replace("num_kv_heads: 4", "num_kv_heads: 65536")
        .replace("num_attention_heads: 32", "num_attention_heads: 65536")
        .replace("head_dim: 128", "head_dim: 65536");
    std::fs::write(&card, yaml).unwrap();
    let o = omnirig(
        &["fixtures", "export", "--case", "text_short", "--out"],
        &[&d.join("out"), Path::new("--card"), &card],
    );
    refused(&o, &["kv.layer.", "MemAvailable"]);
    let _ = std::fs::remove_dir_all(&d);
}
