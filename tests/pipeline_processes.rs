//! The pipeline from the root package, so a plain `cargo test loopback` at the
//! repository root runs it: every golden case through the five stages in one
//! process over loopback, `omnirig run --processes` (each stage its own OS
//! process, over tcp on 127.0.0.1), and the CLI's failure exit status. The
//! full matrix (every transport, connector cases) is in `harness/tests`.

use std::path::PathBuf;
use std::process::Command;

fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("omnirig-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Every golden case, one after another, in one process over loopback: every
/// hop verified bit-exact, every request finished, every pool back to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_golden_case_in_one_process_loopback() {
    use omnirig_harness::{Runner, Scenario};
    for case in omnirig_fixtures::golden_cases() {
        let r = Runner::new(Scenario::golden(
            &case.name,
            omnirig_transports::TransportKind::Loopback,
        ))
        .run()
        .await
        .unwrap();
        assert!(r.passed(), "{}: {}", case.name, r.summary_text());
        for q in &r.requests {
            assert!(q.ok, "{}: {:?}", q.id, q.error);
            for h in &q.hops {
                assert!(h.verified && h.moved_bytes == h.bytes, "{} {h:?}", q.id);
            }
        }
    }
}

#[test]
fn five_stage_processes_over_tcp_on_loopback_interface() {
    five_stage_processes("tcp", false);
}

/// The same over shared memory: every stage process maps its upstream's sealed memfds.
#[test]
fn five_stage_processes_over_shm() {
    five_stage_processes("shm", false);
}

/// Stage processes fed pre-generated payloads (what `bench hop` and `bench pipeline` run)
/// move and verify the same bytes.
#[test]
fn five_stage_processes_pregenerated_over_shm() {
    five_stage_processes("shm", true);
}

fn five_stage_processes(transport: &str, pregenerate: bool) {
    let dir = out_dir(&format!("processes-{transport}-{pregenerate}"));
    std::fs::create_dir_all(&dir).unwrap();
    let scenario = dir.join("scenario.yaml");
    // Every golden case, plus a repeat for EC dedupe and a KV prefix hit.
    std::fs::write(
        &scenario,
        format!("name: processes\ntransport: {transport}\npregenerate: {pregenerate}\nconcurrency: 2\nrequests:\n  - case: text_short\n  - case: image_audio\n    repeat: 2\n  - case: long_audio\n  - case: video_large_kv\n"),
    )
    .unwrap();
    // Over shm the stages check at the data plane's priority (`--check-nice 0`, the runtime's
    // own threads), elsewhere on the niced pool (the default): both paths move the same bytes.
    let nice = if transport == "shm" && !pregenerate {
        "0"
    } else {
        "10"
    };
    let out = Command::new(env!("CARGO_BIN_EXE_omnirig"))
        .args([
            "run",
            "--processes",
            "--quiet",
            "--check-nice",
            nice,
            "--report",
        ])
        .arg(&dir)
        .arg(&scenario)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["mode"], "processes");
    assert_eq!(report["summary"]["ok"], 5);
    assert!(report["summary"]["reused_bytes"].as_u64().unwrap() > 0);
    assert_eq!(report["summary"]["failed"], 0);
    assert_eq!(report["summary"]["pools_clean"], true);
    for hop in report["hops"].as_array().unwrap() {
        assert_eq!(hop["transport"], transport);
    }
    for r in report["requests"].as_array().unwrap() {
        for h in r["hops"].as_array().unwrap() {
            assert_eq!(h["verified"], true, "{r}");
            let (b, m, u) = (
                h["bytes"].as_u64(),
                h["moved_bytes"].as_u64(),
                h["reused_bytes"].as_u64(),
            );
            assert_eq!(b.unwrap(), m.unwrap() + u.unwrap(), "{r}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_fails_with_a_named_error_loopback() {
    let dir = out_dir("failing");
    std::fs::create_dir_all(&dir).unwrap();
    let scenario = dir.join("scenario.yaml");
    std::fs::write(
        &scenario,
        "request_timeout_s: 0.1\ncompute: { thinker_prefill: { per_item_us: 300000 } }\nrequests: [{ case: text_short }]\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_omnirig"))
        .args(["run", "--quiet"])
        .arg(&scenario)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("FAILED 000-text_short") && stdout.contains("kv_cache"),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stage process SIGKILLed mid-run: the run still ends, promptly, with every request
/// accounted for (ok, or failed naming what broke), the non-zero exit status, and every
/// surviving stage's pools and engines back to zero. Test name says "faults" so that
/// `cargo test faults` runs it with the fault matrix.
#[test]
fn faults_a_killed_stage_process_fails_cleanly() {
    let dir = out_dir("killed");
    std::fs::create_dir_all(&dir).unwrap();
    let scenario = dir.join("scenario.yaml");
    std::fs::write(
        &scenario,
        "name: killed\nconcurrency: 2\nhop_timeout_s: 5\nrequest_timeout_s: 20\n\
         kill_stage: { stage: thinker_decode, after_ms: 300 }\n\
         requests:\n  - case: video_large_kv\n    repeat: 4\n    vary_seed: true\n",
    )
    .unwrap();
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_omnirig"))
        .args(["run", "--processes", "--quiet", "--report"])
        .arg(&dir)
        .arg(&scenario)
        .output()
        .unwrap();
    let took = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(took < std::time::Duration::from_secs(90), "took {took:?}");
    let report: omnirig_harness::Report =
        serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report.requests.len(), 4);
    assert!(
        report.summary.failed > 0,
        "nothing failed although decode was killed"
    );
    for q in report.requests.iter().filter(|q| !q.ok) {
        let e = q.error.as_deref().unwrap();
        // The dead stage's peers see its connections close: the error says which channel or
        // hop, and that the other side went away.
        let named = ["closed", "disconnected", "process", "timed out"]
            .iter()
            .any(|w| e.contains(w));
        assert!(named, "{}: {e}", q.id);
    }
    for s in &report.stages {
        if s.stage != "thinker_decode" {
            assert!(s.is_clean(), "{} leaked: {s:?}", s.stage);
        } else {
            // Issue 10: reported as exited, not as a leak with an underflowed counter.
            let how = s.exited.as_deref().unwrap_or_default();
            assert!(how.contains("signal: 9"), "{s:?}");
            assert_eq!(s.open_mailboxes, 0);
        }
    }
    assert!(report.summary.pools_clean, "{stdout}");
    assert!(
        stdout.contains("stage thinker_decode exited before the end") && !stdout.contains("LEAK"),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
