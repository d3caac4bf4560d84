//! The pipeline on the `sim` transport (issue 16): the fault matrix (every hop x every
//! transport fault kind) on a simulated fabric, run twice; each cell must end as the real
//! transports' matrix says (`faults.rs`), and the two runs' event traces must be identical,
//! byte for byte, and so must their reports. A failing cell prints its seed and the first line where the traces part.

use omnirig_fixtures::{PayloadKind, RequestSpec};
use omnirig_harness::faults::{AnyFault, FaultSpec};
use omnirig_harness::scenario::{RequestEntry, Scenario};
use omnirig_harness::sim;
use omnirig_transports::{FaultKind, FaultPoint, TransportKind};
use rstest::rstest;

fn small(seed: u64) -> RequestSpec {
    let yaml = format!(
        "{{ seed: {seed}, text_tokens: 16, images: [{{ width: 64, height: 64 }}], \
         audios: [{{ seconds: 1.0 }}], output_text_tokens: 8, output_audio_seconds: 0.5 }}"
    );
    serde_saphyr::from_str(&yaml).unwrap()
}

/// As the real matrix: image_audio (all four hops) faulty, two healthy requests beside it.
fn scenario(faults: Vec<FaultSpec>) -> Scenario {
    let mut s = Scenario::golden("image_audio", TransportKind::Sim);
    s.name = "sim-faults".into();
    s.concurrency = 3;
    s.hop_timeout_s = 1.0;
    s.request_timeout_s = 5.0;
    for seed in [101, 102] {
        s.requests.push(RequestEntry {
            case: None,
            name: Some(format!("healthy{seed}")),
            request: Some(small(seed)),
            repeat: 1,
            vary_seed: false,
        });
    }
    s.faults = faults;
    // Some jitter, so the seed matters.
    s.fabric = Some(omnirig_transports::FabricSpec {
        jitter_us: 3.0,
        ..Default::default()
    });
    s
}

fn expected(kind: FaultKind) -> Option<&'static str> {
    match kind {
        FaultKind::FailSubmit | FaultKind::FailSlice => Some("io"),
        FaultKind::Stall | FaultKind::LateWrite => Some("timed_out"),
        FaultKind::Delay { .. } => None,
        FaultKind::DropConnection => Some("peer_disconnected"),
        FaultKind::Corrupt | FaultKind::DuplicateCompletion | FaultKind::EarlyCompletion => {
            Some("corrupt")
        }
    }
}

#[rstest]
fn fault_matrix_on_sim_is_deterministic(
    #[values(
        PayloadKind::EncoderEmbeddings,
        PayloadKind::KvCache,
        PayloadKind::ThinkerToTalker,
        PayloadKind::TalkerToCode2wav
    )]
    hop: PayloadKind,
    #[values(
        FaultKind::FailSubmit,
        FaultKind::FailSlice,
        FaultKind::Stall,
        FaultKind::Delay { ms: 50 },
        FaultKind::DropConnection,
        FaultKind::Corrupt,
        FaultKind::DuplicateCompletion,
        FaultKind::EarlyCompletion,
        FaultKind::LateWrite
    )]
    kind: FaultKind,
) {
    let seed = 16;
    let s = scenario(vec![FaultSpec {
        hop: hop.as_str().into(),
        request: 0,
        tensor: None,
        at: FaultPoint::AfterBytes(4096),
        kind: AnyFault::Transport(kind),
        times: 1,
    }]);
    let a = sim::run(&s, Some(seed)).unwrap();
    let b = sim::run(&s, Some(seed)).unwrap();
    if let Some((i, x, y)) = sim::first_difference(&a.trace, &b.trace) {
        panic!(
            "seed {seed}, {kind:?} at {hop}: traces differ at line {i}:\n  {x}\n  {y}\n\
             replay: omnirig run --transport sim --seed {seed}"
        );
    }
    assert_eq!(a.digest, b.digest);
    // The report too, byte for byte: its times are modelled, its names and epochs seeded.
    assert!(
        serde_json::to_string(&a.report).unwrap() == serde_json::to_string(&b.report).unwrap(),
        "seed {seed}, {kind:?} at {hop}: the reports differ"
    );
    let r = &a.report;
    assert!(r.summary.pools_clean, "seed {seed}: pools not back to zero");
    let f = r.faults.as_ref().unwrap();
    assert_eq!(f.fired.len(), 1, "seed {seed}: the fault did not strike");
    assert!(
        f.late.iter().all(|l| l.refused),
        "seed {seed}: a late write landed"
    );
    let q = &r.requests[0];
    match expected(kind) {
        None => assert!(q.ok, "seed {seed}: {:?}", q.error),
        Some(want) => {
            assert!(!q.ok, "seed {seed}: {kind:?} at {hop} went through");
            let fl = q.failure.as_ref().unwrap();
            assert_eq!(fl.kind, want, "seed {seed}: {:?}", q.error);
            assert_eq!(fl.hop.as_deref(), Some(hop.as_str()));
            // Detected at the deadline or sooner, in modelled time.
            assert!(q.e2e_ms <= 1000.0 + 50.0, "detected after {} ms", q.e2e_ms);
        }
    }
    for q in r.requests.iter().filter(|q| q.label.starts_with("healthy")) {
        assert!(q.ok, "seed {seed}: {} failed: {:?}", q.id, q.error);
        assert!(q.hops.iter().all(|h| h.verified));
    }
}

/// A healthy run's modelled time follows the fabric: a slower fabric takes longer, the
/// bytes arrive exact either way, and a different seed (jitter) changes the trace.
#[test]
fn the_model_shapes_the_run_and_the_seed_shapes_the_trace() {
    let mut s = scenario(vec![]);
    let fast = sim::run(&s, Some(1)).unwrap();
    assert!(fast.report.passed(), "{}", fast.report.summary_text());
    let other = sim::run(&s, Some(2)).unwrap();
    assert_ne!(fast.digest, other.digest, "jitter is seeded");
    let f = s.fabric.as_mut().unwrap();
    for n in &mut f.nodes {
        n.nics[0].gbps = 1.0;
    }
    f.switch.as_mut().unwrap().gbps = 1.0;
    let slow = sim::run(&s, Some(1)).unwrap();
    assert!(slow.report.passed(), "{}", slow.report.summary_text());
    assert!(
        slow.virtual_s > 5.0 * fast.virtual_s,
        "1 Gb/s: {} s, 100 Gb/s: {} s",
        slow.virtual_s,
        fast.virtual_s
    );
    assert!(fast.trace.iter().any(|l| l.contains("msg kv_cache>")));
}

/// The shipped RFC fabric and scenario load, and a request on them arrives bit-exact with
/// its latency in the modelled range: the hop's bytes over 400 Gb/s, plus the modelled
/// compute.
#[test]
fn the_rfc_fabric_runs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let fabric = sim::fabric_from_path(&root.join("fabrics/rfc-ndr400.yaml")).unwrap();
    let mut s = Scenario::from_path(&root.join("scenarios/rfc.yaml")).unwrap();
    s.requests.truncate(1);
    s.fabric = Some(fabric);
    let run = sim::run(&s, None).unwrap();
    assert!(run.report.passed(), "{}", run.report.summary_text());
    // talker and code2wav share a node: their hop never touches a NIC.
    assert!(
        run.trace
            .iter()
            .any(|l| l.contains("talker_to_code2wav> speech.local")),
        "no local hop in the trace"
    );
    let bad = sim::fabric_from_path(&root.join("scenarios/rfc.yaml")).unwrap_err();
    assert!(bad.to_string().contains("rfc.yaml"), "{bad}");
}

/// The host model's `cpu:` section parses from a fabric file, and bad values are refused
/// naming the field.
#[test]
fn the_cpu_section_parses_and_bad_values_name_their_field() {
    let fabric = "nodes:\n  - { name: a, nics: [{ name: lo, gbps: 20 }] }\n  - { name: b, nics: [{ name: lo, gbps: 20 }] }\nswitch: { gbps: 20 }\n";
    let good = format!(
        "{fabric}cpu:\n  generate_ns_per_byte: 1.5\n  digest_ns_per_byte: 0.1\n  copy_ns_per_byte: 0.3\n  message_us: 10\n  hosts: [{{ name: box, cores: 2, nodes: [a, b] }}]\n"
    );
    let (spec, cpu) = sim::fabric_file_from_str(&good, "good.yaml").unwrap();
    assert_eq!(spec.nodes.len(), 2);
    let cpu = cpu.expect("a cpu section");
    assert_eq!(cpu.generate_ns_per_byte, 1.5);
    assert_eq!(cpu.hosts[0].cores, 2);
    // Without the section: no host model (the old behaviour).
    assert!(sim::fabric_file_from_str(fabric, "f").unwrap().1.is_none());
    for (section, field) in [
        ("cpu: { digest_ns_per_byte: -1 }", "cpu.digest_ns_per_byte"),
        (
            "cpu: { generate_ns_per_byte: .nan }",
            "cpu.generate_ns_per_byte",
        ),
        ("cpu: { message_us: 1e9 }", "cpu.message_us"),
        ("cpu: { wake_us: -3 }", "cpu.wake_us"),
        ("cpu: { park_us: .inf }", "cpu.park_us"),
        ("cpu: { cores: 100000 }", "cpu.cores"),
        (
            "cpu: { hosts: [{ name: box, cores: 0, nodes: [a] }] }",
            "cpu.hosts[0].cores",
        ),
        (
            "cpu: { hosts: [{ name: box, cores: 1, nodes: [zz] }] }",
            "cpu.hosts[0].nodes",
        ),
        (
            "cpu: { hosts: [{ name: x, cores: 1, nodes: [a] }, { name: y, cores: 1, nodes: [a] }] }",
            "cpu.hosts[1].nodes",
        ),
        ("cpu: { copy_gbps: 3 }", "copy_gbps"),
        ("bogus: 1", "bogus"),
    ] {
        let e = sim::fabric_file_from_str(&format!("{fabric}{section}\n"), "bad.yaml")
            .expect_err(section)
            .to_string();
        assert!(e.contains(field), "{section}: {e}");
        assert!(e.contains("bad.yaml"), "{e}");
    }
}

/// A runtime on tokio's paused clock: virtual time, as the sim runner's.
fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

/// Processor sharing: two equal jobs on a one-core host each take twice as long in virtual
/// time as one alone; on two cores they do not slow each other.
#[test]
fn two_jobs_on_one_core_take_twice_as_long() {
    use omnirig_harness::host::Host;
    use std::time::Duration;
    let rt = paused_runtime();
    rt.block_on(async {
        let work = Duration::from_millis(10);
        let one = Host::new("one", 1);
        let t0 = tokio::time::Instant::now();
        one.run(work).await;
        let alone = t0.elapsed();
        assert_eq!(alone, work);
        // `work` on the one-core host after `delay`: when it ended, from `t0`.
        let job = |t0: tokio::time::Instant, delay: Duration| {
            let one = &one;
            async move {
                tokio::time::sleep(delay).await;
                one.run(work).await;
                t0.elapsed()
            }
        };
        let t0 = tokio::time::Instant::now();
        let (a, b) = tokio::join!(job(t0, Duration::ZERO), job(t0, Duration::ZERO));
        assert_eq!((a, b), (2 * work, 2 * work));
        // A job arriving halfway: the first runs alone for 5 ms, then both share the core.
        let t0 = tokio::time::Instant::now();
        let (a, b) = tokio::join!(job(t0, Duration::ZERO), job(t0, work / 2));
        assert_eq!(
            (a, b),
            (Duration::from_millis(15), Duration::from_millis(20))
        );
        let two = Host::new("two", 2);
        let t0 = tokio::time::Instant::now();
        tokio::join!(two.run(work), two.run(work));
        assert_eq!(t0.elapsed(), work);
    });
}

/// A job on several threads gets a share of the cores per thread while they are contended,
/// and never runs faster than alone.
#[test]
fn a_job_on_more_threads_gets_more_of_a_contended_host() {
    use omnirig_harness::host::Host;
    use std::time::Duration;
    let ms = Duration::from_millis;
    let rt = paused_runtime();
    rt.block_on(async {
        // Alone, or beside one job on two cores: as fast as alone.
        let two = Host::new("two", 2);
        let t0 = tokio::time::Instant::now();
        two.run_on(ms(10), 4).await;
        assert_eq!(t0.elapsed(), ms(10));
        // One core: 3 threads against 1, so 3/4 and 1/4 of it; the first is done at 8 ms
        // (6 of work), the other has done 2 of its 10 by then and runs alone after.
        let one = Host::new("one", 1);
        let timed = |work: Duration, threads: u32| {
            let one = &one;
            async move {
                let t0 = tokio::time::Instant::now();
                one.run_on(work, threads).await;
                t0.elapsed()
            }
        };
        let (a, b) = tokio::join!(timed(ms(6), 3), timed(ms(10), 1));
        assert_eq!((a, b), (ms(8), ms(16)));
        // Two cores, a job on 2 threads and two on 1: 4 threads, so half a core each. The
        // first gets a whole core (as fast as alone) and is done at 10 ms; the others have
        // done 5 by then and take a core each.
        let timed2 = |threads: u32| {
            let two = &two;
            async move {
                let t0 = tokio::time::Instant::now();
                two.run_on(ms(10), threads).await;
                t0.elapsed()
            }
        };
        let (a, b, c) = tokio::join!(timed2(2), timed2(1), timed2(1));
        assert_eq!((a, b, c), (ms(10), ms(15), ms(15)));
        // The same three all on one thread: two thirds of a core each, all done at 15 ms.
        let (a, b, c) = tokio::join!(timed2(1), timed2(1), timed2(1));
        assert_eq!((a, b, c), (ms(15), ms(15), ms(15)));
    });
}

/// The stages' checks run below the data plane: on one core, a transfer's copy beside a check
/// gets the core by Linux's weights (1024 at nice 0 against 110 at nice 10), where at one
/// priority the two share it evenly. Work is conserved either way.
#[test]
fn a_check_yields_the_core_to_the_data_plane() {
    use omnirig_harness::host::{Host, Priority};
    use std::time::Duration;
    let ms = Duration::from_millis;
    let rt = paused_runtime();
    rt.block_on(async {
        // 1024 ms of work each (tokio's timers tick by the millisecond).
        async fn timed(host: &Host, p: Priority) -> Duration {
            let t0 = tokio::time::Instant::now();
            host.run_as(Duration::from_millis(1024), 1, p).await;
            t0.elapsed()
        }
        let niced = Host::with_check_nice("one", 1, 10);
        let (copy, check) = tokio::join!(
            timed(&niced, Priority::DataPlane),
            timed(&niced, Priority::Checks)
        );
        // The copy at 1024/1134 of the core; the check has done 110 ms by then.
        assert_eq!((copy, check), (ms(1134), ms(2048)));
        // Two checks beside each other weigh the same: an even share.
        let (a, b) = tokio::join!(
            timed(&niced, Priority::Checks),
            timed(&niced, Priority::Checks)
        );
        assert_eq!((a, b), (ms(2048), ms(2048)));
        // Nice 0: the checks at the data plane's priority, as before they had a pool.
        let even = Host::with_check_nice("one", 1, 0);
        let (copy, check) = tokio::join!(
            timed(&even, Priority::DataPlane),
            timed(&even, Priority::Checks)
        );
        assert_eq!((copy, check), (ms(2048), ms(2048)));
        // With a core each, the priority changes nothing.
        let two = Host::with_check_nice("two", 2, 19);
        let (copy, check) = tokio::join!(
            timed(&two, Priority::DataPlane),
            timed(&two, Priority::Checks)
        );
        assert_eq!((copy, check), (ms(1024), ms(1024)));
    });
}

/// A stage process's checks run on its pool of as many threads as its host has cores: on
/// one core, two of its checks take turns (the first done at 10 ms, not 20), where with the
/// checks at the data plane's priority (no pool) each has a thread and they share the core.
#[test]
fn a_process_checks_on_a_pool_of_its_hosts_cores() {
    use omnirig_harness::host::{Cpu, CpuSpec, HostSpec, StageCpu};
    use std::sync::Arc;
    use std::time::Duration;
    let ms = Duration::from_millis;
    let rt = paused_runtime();
    rt.block_on(async {
        let stage = |check_nice: i32| {
            let spec = CpuSpec {
                kv_check_ns_per_byte: Some(1.0),
                check_nice,
                hosts: vec![HostSpec {
                    name: "one".into(),
                    cores: 1,
                    nodes: vec!["a".into()],
                }],
                ..CpuSpec::default()
            };
            let cpu = Arc::new(Cpu::new(spec, &["a"], 1).unwrap());
            let host = cpu.host("a").unwrap();
            StageCpu {
                pool: cpu.check_pool(&host),
                cpu,
                host,
                peer: None,
                process: "a".into(),
                peer_process: None,
            }
        };
        // 10 ms of KV check each (10^7 bytes at 1 ns).
        async fn timed(s: &StageCpu) -> Duration {
            let t0 = tokio::time::Instant::now();
            s.verify_kv(10_000_000, false).await;
            t0.elapsed()
        }
        let pooled = stage(10);
        assert_eq!(
            tokio::join!(timed(&pooled), timed(&pooled)),
            (ms(10), ms(20))
        );
        let unpooled = stage(0);
        assert!(unpooled.pool.is_none());
        assert_eq!(
            tokio::join!(timed(&unpooled), timed(&unpooled)),
            (ms(20), ms(20))
        );
    });
}

/// The wake model: traffic reaching a process that saw none for `park_us` waits `wake_us`
/// (latency, no core busy); traffic within `park_us` of the last does not.
#[test]
fn a_parked_process_wakes_late_and_a_hot_one_at_once() {
    use omnirig_harness::host::{Cpu, CpuSpec};
    use std::time::Duration;
    let rt = paused_runtime();
    rt.block_on(async {
        let spec = CpuSpec {
            wake_us: 100.0,
            park_us: 50.0,
            ..CpuSpec::default()
        };
        // The sim runner's scale: a tokio millisecond is a modelled microsecond (tokio's
        // timer counts whole milliseconds).
        let cpu = Cpu::new(spec, &["a"], 1000).unwrap();
        let us = Duration::from_millis;
        let timed = |p: &'static str| {
            let cpu = &cpu;
            async move {
                let t0 = tokio::time::Instant::now();
                cpu.wake(p).await;
                t0.elapsed()
            }
        };
        // Never seen: parked.
        assert_eq!(timed("a/control").await, us(100));
        // At once, and 40 us later: hot.
        assert_eq!(timed("a/control").await, us(0));
        tokio::time::sleep(us(40)).await;
        assert_eq!(timed("a/control").await, us(0));
        // Another thread of the process parks on its own.
        assert_eq!(timed("a/engine").await, us(100));
        // 60 us after its last traffic: parked again.
        tokio::time::sleep(us(60)).await;
        assert_eq!(timed("a/control").await, us(100));
        // Sending is traffic too.
        tokio::time::sleep(us(60)).await;
        cpu.touch("a/control");
        assert_eq!(timed("a/control").await, us(0));
        // No core was busy: the wake is latency, not work.
        assert_eq!(cpu.busy_s()[0].1, 0.0);
    });
    // Without wake_us nothing waits.
    let free = Cpu::new(CpuSpec::default(), &["a"], 1000).unwrap();
    rt.block_on(async {
        let t0 = tokio::time::Instant::now();
        free.wake("a/control").await;
        assert_eq!(t0.elapsed(), Duration::ZERO);
    });
}

/// In a simulated run a small hop pays two wakes when both stage processes were parked:
/// the owner's for the write, the producer's for its acknowledgement.
#[test]
fn a_small_hop_between_parked_stages_pays_two_wakes() {
    let (s, cpu) = image_audio_on_localhost();
    let hop = |wake_us: f64| {
        let r = passing_run(
            &s,
            omnirig_harness::host::CpuSpec {
                wake_us,
                ..cpu.clone()
            },
        );
        r.hops
            .iter()
            .find(|h| h.hop == "talker_to_code2wav")
            .unwrap()
            .transfer_ms_p50
    };
    let (none, woken) = (hop(0.0), hop(500.0));
    let added = woken - none;
    assert!(
        (0.95..=1.05).contains(&added),
        "talker -> code2wav transfer {none} ms without wakes, {woken} ms with 0.5 ms wakes"
    );
}

/// The golden image_audio case on the committed tcp-localhost fabric, and its `cpu:` section.
fn image_audio_on_localhost() -> (Scenario, omnirig_harness::host::CpuSpec) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let (fabric, cpu) =
        sim::fabric_file_from_path(&root.join("fabrics/tcp-localhost.yaml")).unwrap();
    let mut s = Scenario::golden("image_audio", TransportKind::Sim);
    s.fabric = Some(fabric);
    (s, cpu.expect("tcp-localhost.yaml has a cpu section"))
}

/// A simulated run of `s` under the host model `cpu` (seed 5), which must pass.
fn passing_run(
    s: &Scenario,
    cpu: omnirig_harness::host::CpuSpec,
) -> omnirig_harness::report::Report {
    let mut s = s.clone();
    s.cpu = Some(cpu);
    let r = sim::run(&s, Some(5)).unwrap();
    assert!(r.report.passed(), "{}", r.report.summary_text());
    r.report
}

/// The committed tcp-localhost fabric with `line` added to its `cpu:` section is refused,
/// the error naming `named`.
fn refused_on_localhost(line: &str, named: &str) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("fabrics/tcp-localhost.yaml")).unwrap();
    let bad = text.replace("  wake_us:", &format!("{line}\n  wake_us:"));
    let e = sim::fabric_file_from_str(&bad, "bad")
        .unwrap_err()
        .to_string();
    assert!(e.contains(named), "{e}");
}

/// The KV hop's verification is charged at `kv_check_ns_per_byte` where the host model has
/// one (the check as the decode stage runs it, in its pool), and as generate + 2 x digest
/// where it has not; a bad value is refused by name.
#[test]
fn the_kv_check_is_charged_at_its_own_rate_where_measured() {
    let (s, cpu) = image_audio_on_localhost();
    let bulk = cpu.generate_ns_per_byte + 2.0 * cpu.digest_ns_per_byte;
    let verify = |kv_check: Option<f64>| {
        let r = passing_run(
            &s,
            omnirig_harness::host::CpuSpec {
                kv_check_ns_per_byte: kv_check,
                ..cpu.clone()
            },
        );
        let kv = r.hops.iter().find(|h| h.hop == "kv_cache").unwrap();
        kv.phases_ms_p50.verify
    };
    let (unset, same, triple) = (verify(None), verify(Some(bulk)), verify(Some(3.0 * bulk)));
    assert!(
        (same / unset - 1.0).abs() < 0.02,
        "{unset} ms unset, {same} ms at the bulk rate"
    );
    assert!(
        (triple / unset - 3.0).abs() < 0.15,
        "{unset} ms at the bulk rate, {triple} ms at three times it"
    );
    refused_on_localhost("  kv_check_ns_per_byte: -1", "cpu.kv_check_ns_per_byte: -1");
}

/// A whole inbound tensor's check is charged at `check_ns_per_byte` where measured (the
/// stubs' check, byte compare included, for tensors up to 4 MiB), plus `check_us` per tensor
/// checked; unset, as 2 x (generate + digest). Bad values are refused by name.
#[test]
fn a_whole_tensor_check_is_charged_at_its_measured_cost() {
    let (s, cpu) = image_audio_on_localhost();
    let bulk = 2.0 * (cpu.generate_ns_per_byte + cpu.digest_ns_per_byte);
    // talker -> code2wav: one tensor of 6400 B; thinker -> talker: five, 0.98 MB in all
    let verify = |check: Option<f64>, check_us: f64| {
        let r = passing_run(
            &s,
            omnirig_harness::host::CpuSpec {
                check_ns_per_byte: check,
                check_us,
                ..cpu.clone()
            },
        );
        let v = |hop: &str| {
            let h = r.hops.iter().find(|h| h.hop == hop).unwrap();
            (h.phases_ms_p50.verify, h.moved_bytes)
        };
        (v("thinker_to_talker"), v("talker_to_code2wav"))
    };
    let ((unset, t2t_bytes), _) = verify(None, 0.0);
    let ((same, _), _) = verify(Some(bulk), 0.0);
    let ((triple, _), _) = verify(Some(3.0 * bulk), 0.0);
    assert!(
        (same / unset - 1.0).abs() < 0.02,
        "{unset} ms unset, {same} ms at the bulk rate"
    );
    assert!(
        (triple / unset - 3.0).abs() < 0.15,
        "{unset} ms at the bulk rate, {triple} ms at three times it"
    );
    // the fixed cost: 1 ms per tensor, five tensors checked one after another on one hop,
    // one on the other
    let ((t2t, _), (t2c, _)) = verify(Some(bulk), 1000.0);
    let ((_, _), (t2c_free, _)) = verify(Some(bulk), 0.0);
    assert!(
        (t2t - same - 5.0).abs() < 0.05,
        "{same} ms, {t2t} ms with 1 ms a tensor ({t2t_bytes} B)"
    );
    assert!(
        (t2c - t2c_free - 1.0).abs() < 0.02,
        "{t2c_free} ms, {t2c} ms with 1 ms a tensor"
    );
    refused_on_localhost("  check_ns_per_byte: 0", "cpu.check_ns_per_byte: 0");
    refused_on_localhost("  check_us: -3", "cpu.check_us: -3");
}

/// Each hop's (write requests, transfer ms) in the first request of a passing run of `s`
/// under `cpu`.
fn writes_and_transfer_ms(
    s: &Scenario,
    cpu: omnirig_harness::host::CpuSpec,
) -> std::collections::BTreeMap<String, (usize, f64)> {
    passing_run(s, cpu).requests[0]
        .hops
        .iter()
        .map(|h| (h.hop.clone(), (h.requests, h.transfer_ms)))
        .collect()
}

/// A transfer of many writes pays each write's own cost on top of its bytes (`write_us`), in
/// the job that copies them: the KV hop's 96 writes, thinker -> talker's five, and nothing
/// for talker -> code2wav's one.
#[test]
fn a_transfer_pays_for_each_write_beyond_its_first() {
    let (s, cpu) = image_audio_on_localhost();
    let run = |write_us: f64| {
        let cpu = omnirig_harness::host::CpuSpec {
            write_us,
            ..cpu.clone()
        };
        writes_and_transfer_ms(&s, cpu)
    };
    let (free, paid) = (run(0.0), run(1000.0));
    let writes = |hop: &str| free[hop].0;
    assert_eq!(
        (
            writes("kv_cache"),
            writes("thinker_to_talker"),
            writes("talker_to_code2wav")
        ),
        (96, 5, 1)
    );
    for (hop, (n, ms)) in &free {
        let extra = paid[hop].1 - ms;
        let want = (*n as f64 - 1.0) * 1.0;
        assert!(
            (extra - want).abs() <= 0.02 * want.max(1.0),
            "{hop}: {n} writes, {ms} ms without the per-write cost, {} ms with 1 ms a write",
            paid[hop].1
        );
    }
    refused_on_localhost("  write_us: -1", "cpu.write_us: -1");
    refused_on_localhost("  transfer_threads: 0", "cpu.transfer_threads: 0");
    refused_on_localhost("  transfer_threads: 65", "cpu.transfer_threads: 65");
    refused_on_localhost("  check_nice: 20", "cpu.check_nice: 20");
    refused_on_localhost("  check_nice: -1", "cpu.check_nice: -1");
}

/// A transfer to an owner parked for `cold_after_us` or more (here: one that saw no traffic
/// yet), while a core of its host is idle, pays `cold_write_us` for each write beyond its
/// first, as latency; an owner parked for less, or on a host whose cores are all busy, pays
/// nothing more.
#[test]
fn a_transfer_to_a_long_parked_owner_pays_for_each_write_beyond_its_first() {
    let (s, cpu) = image_audio_on_localhost();
    let run = |cold_write_us: f64| {
        let cpu = omnirig_harness::host::CpuSpec {
            cold_write_us,
            ..cpu.clone()
        };
        writes_and_transfer_ms(&s, cpu)
    };
    let (hot, cold) = (run(0.0), run(1000.0));
    assert_eq!(hot["kv_cache"].0, 96);
    for (hop, (n, ms)) in &hot {
        let extra = cold[hop].1 - ms;
        let want = (*n as f64 - 1.0) * 1.0;
        assert!(
            (extra - want).abs() <= 0.02 * want.max(1.0),
            "{hop}: {n} writes, {ms} ms hot, {} ms after the owner parked",
            cold[hop].1
        );
    }
    let spec = omnirig_harness::host::CpuSpec {
        cold_write_us: 50.0,
        ..Default::default()
    };
    assert_eq!(spec.cold_writes_us(None, 5), 200.0);
    assert_eq!(spec.cold_writes_us(Some(2000.0), 5), 200.0);
    assert_eq!(spec.cold_writes_us(Some(1999.0), 5), 0.0);
    assert_eq!(spec.cold_writes_us(Some(1e6), 1), 0.0);
    // Only where a core of the owner's host is idle: its CPUs halt only then.
    let rt = paused_runtime();
    rt.block_on(async {
        let host = omnirig_harness::host::Host::new("two", 2);
        assert!(host.has_idle_core());
        let busy = host.run_on(std::time::Duration::from_millis(10), 2);
        tokio::pin!(busy);
        tokio::select! {
            _ = &mut busy => panic!("10 ms of work done at once"),
            _ = tokio::time::sleep(std::time::Duration::from_millis(1)) => {}
        }
        assert!(!host.has_idle_core(), "two threads on two cores");
        busy.await;
        assert!(host.has_idle_core());
    });
    refused_on_localhost("  cold_write_us: -1", "cpu.cold_write_us: -1");
    refused_on_localhost("  cold_after_us: 2e9", "cpu.cold_after_us: 2000000000");
}

/// The packet connector's consumer pays for decoding the packet when it fences the grants
/// (`packet_us`, and `packet_entry_us` per entry), in the verify phase of thinker -> talker
/// (five entries) and talker -> code2wav (one), not on the other connectors' hops.
#[test]
fn a_packet_handoff_pays_for_its_decode() {
    let (s, cpu) = image_audio_on_localhost();
    let run = |packet_us: f64, packet_entry_us: f64| {
        let r = passing_run(
            &s,
            omnirig_harness::host::CpuSpec {
                packet_us,
                packet_entry_us,
                ..cpu.clone()
            },
        );
        r.requests[0]
            .hops
            .iter()
            .map(|h| (h.hop.clone(), (h.tensors, h.phases_ms.verify)))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let (free, per_packet, per_entry) = (run(0.0, 0.0), run(1000.0, 0.0), run(0.0, 1000.0));
    let entries = |hop: &str| free[hop].0;
    assert_eq!(
        (entries("thinker_to_talker"), entries("talker_to_code2wav")),
        (5, 1)
    );
    for (hop, (n, ms)) in &free {
        let (packet, entry) = match hop.as_str() {
            "thinker_to_talker" | "talker_to_code2wav" => (1.0, *n as f64),
            _ => (0.0, 0.0),
        };
        for (paid, want) in [(&per_packet, packet), (&per_entry, entry)] {
            let extra = paid[hop].1 - ms;
            assert!(
                (extra - want).abs() <= 0.02,
                "{hop}: {n} entries, verify {ms} ms free, {} ms paid, want {want} ms more",
                paid[hop].1
            );
        }
    }
    refused_on_localhost("  packet_us: -1", "cpu.packet_us: -1");
    refused_on_localhost("  packet_entry_us: .nan", "cpu.packet_entry_us: NaN");
}

/// Every hop but KV, in order.
const NOT_KV: [&str; 3] = [
    "encoder_embeddings",
    "talker_to_code2wav",
    "thinker_to_talker",
];

/// The hops that calibration samples named `case/hop[/tensor]` cover, in order, each once.
fn hops_named<'a>(names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let hops: std::collections::BTreeSet<&str> =
        names.map(|n| n.split('/').nth(1).unwrap()).collect();
    hops.into_iter().collect()
}

/// The packet calibration decodes every golden case's packet for each hop but KV.
#[test]
fn the_packet_calibration_decodes_every_hop_but_kv() {
    let samples =
        omnirig_harness::host::measure_packets(1, std::time::Duration::from_micros(100)).unwrap();
    assert_eq!(
        hops_named(samples.iter().map(|p| p.packet.as_str())),
        NOT_KV
    );
    assert!(
        samples
            .iter()
            .all(|p| p.entries >= 1 && p.bytes > 0 && p.hot_us > 0.0 && p.cold_us > 0.0),
        "{samples:?}"
    );
}

/// The check's calibration times the stubs' real check on every golden case's byte-compared
/// inputs (the bytes the upstream stub produces, so each check passes), none of KV.
#[test]
fn the_check_calibration_times_every_byte_compared_input() {
    let samples =
        omnirig_harness::host::measure_checks(1, std::time::Duration::from_micros(100)).unwrap();
    assert_eq!(
        hops_named(samples.iter().map(|c| c.tensor.as_str())),
        NOT_KV
    );
    for c in &samples {
        assert!(
            c.bytes > 0 && c.bytes <= omnirig_model_stubs::BYTE_COMPARE_MAX,
            "{c:?}"
        );
        assert!(
            c.hot_us > 0.0 && c.cold_us > 0.0 && c.gap_us == 100,
            "{c:?}"
        );
    }
    assert!(
        samples
            .iter()
            .any(|c| c.tensor == "text_short/talker_to_code2wav/codes.audio")
    );
}

/// `simulate --calibrate-cpu`'s section, pasted into a fabric, parses back (and costs
/// something on this machine).
#[test]
fn the_calibration_parses_back_as_a_fabric() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("fabrics/rfc-ndr400.yaml")).unwrap();
    let (spec, _) = sim::fabric_file_from_str(&text, "rfc").unwrap();
    let nodes: Vec<&str> = spec.nodes.iter().map(|n| n.name.as_str()).collect();
    // The wake is measured by the CLI (an engine's write to a peer process): set here.
    let c = omnirig_harness::host::calibrate(4 << 20, 50)
        .unwrap()
        .with_wake(omnirig_harness::host::WakeSample {
            hot_us: 20.0,
            cold_us: 260.0,
            gap_us: 10_000,
            repeats: 3,
        })
        .with_wake_after(
            [
                (100_000, 340.0),
                (1_000, 60.0),
                (10_000, 260.0),
                (30_000, 250.0),
            ]
            .map(|(gap_us, cold_us)| omnirig_harness::host::WakeSample {
                hot_us: 20.0,
                cold_us,
                gap_us,
                repeats: 3,
            })
            .to_vec(),
        );
    let section = c.cpu_yaml(&nodes);
    let (back, cpu) = sim::fabric_file_from_str(&format!("{text}\n{section}"), "calibrated")
        .unwrap_or_else(|e| panic!("{e}\n{section}"));
    assert_eq!(back, spec);
    let cpu = cpu.expect("a cpu section");
    assert!(
        cpu.generate_ns_per_byte > 0.0 && cpu.digest_ns_per_byte > 0.0,
        "{section}"
    );
    assert!(
        cpu.copy_ns_per_byte > 0.0 && cpu.message_us > 0.0,
        "{section}"
    );
    assert_eq!(cpu.hosts[0].nodes.len(), nodes.len());
    // The copy charged is one socket's; the one on the tcp engine's streams and slices is kept.
    let tcp = omnirig_transports::TcpConfig::default();
    assert_eq!(
        (c.copy_streams, c.copy_slice_bytes),
        (tcp.streams, tcp.slice_size),
        "{c:?}"
    );
    assert_eq!(
        format!("{:.4}", cpu.copy_ns_per_byte),
        format!("{:.4}", c.copy_ns_per_byte),
        "{section}"
    );
    assert!(c.copy_streams_ns_per_byte > 0.0, "{c:?}");
    assert!(
        section.contains(&format!("on {} streams of 512 KiB", tcp.streams)),
        "{section}"
    );
    // the decode stage's KV check: over one buffer a record, in the stage's pool the charge
    assert!(
        c.kv_verify_ns_per_byte > 0.0 && c.kv_block_bytes == 16 << 10,
        "{c:?}"
    );
    assert_eq!(
        cpu.kv_check_ns_per_byte.map(|v| format!("{v:.4}")),
        Some(format!("{:.4}", c.kv_verify_pool_ns_per_byte)),
        "{section}"
    );
    assert!(
        section.contains("the KV check (16 KiB blocks)"),
        "{section}"
    );
    // The check's fit: its rate from the large tensors back to back, its fixed cost from the
    // small ones after the pause less their bytes at that rate; only measured ones charge.
    assert_eq!(cpu.check_ns_per_byte, None, "{section}");
    let sample = |bytes: u64, hot_us: f64, cold_us: f64| omnirig_harness::host::CheckSample {
        tensor: format!("t{bytes}"),
        bytes,
        hot_us,
        cold_us,
        gap_us: 10_000,
    };
    assert_eq!(cpu.write_us, 0.0, "{section}");
    // A write's own cost: a batch of 32 in 800 us against 25 us for one: 25 us each beyond
    // the first. After the pause the batch took 2575 us and one write 250: the pause added
    // 1775 us to the batch, 1550 beyond the 225 it added to one write, 50 us for each of the
    // 31 writes beyond the first.
    let checked = c
        .clone()
        .with_writes(omnirig_harness::host::BatchSample {
            size: 4096,
            batch: 32,
            single_us: 25.0,
            batch_us: 800.0,
            cold_single_us: Some(250.0),
            cold_batch_us: Some(2575.0),
            cold_gap_us: 10_000,
            repeats: 3,
        })
        // The engine's bulk copy: both processes spent 0.44 ns of CPU a byte with 1.9 cores
        // busy, so a side copies at 0.22 ns/B on 0.95 threads; a record, not charged.
        .with_engine_copy(omnirig_harness::host::EngineCopySample {
            size: 16 << 20,
            batch: 8,
            wall_us: 30_000.0,
            cpu_ns_per_byte: 0.44,
            cpu_cores: 1.9,
            repeats: 3,
        })
        .with_checks(vec![
            sample(2048, 6.0, 14.0),
            sample(3200, 5.0, 16.4),
            sample(6400, 9.0, 30.8),
            sample(100_000, 300.0, 330.0),
            sample(200_000, 500.0, 520.0),
            sample(400_000, 1400.0, 1500.0),
        ])
        .with_packets(
            [
                (1, 18.0),
                (1, 20.0),
                (1, 22.0),
                (2, 99.0),
                (5, 30.0),
                (5, 34.0),
            ]
            .map(|(entries, cold_us)| omnirig_harness::host::PacketSample {
                packet: format!("p{entries}"),
                entries,
                bytes: 100 * entries,
                hot_us: 2.0,
                cold_us,
                gap_us: 10_000,
            })
            .to_vec(),
        );
    let section = checked.cpu_yaml(&nodes);
    let (_, cpu) = sim::fabric_file_from_str(&format!("{text}\n{section}"), "checked")
        .unwrap_or_else(|e| panic!("{e}\n{section}"));
    let cpu = cpu.unwrap();
    // rates 3.0, 2.5 and 3.5 ns/B: 3.0; beyond their bytes 7.856, 6.8 and 11.6 us: 7.856
    assert_eq!(cpu.check_ns_per_byte, Some(3.0), "{section}");
    assert_eq!(format!("{:.1}", cpu.check_us), "7.9", "{section}");
    assert_eq!(cpu.write_us, 25.0, "{section}");
    assert_eq!(cpu.cold_write_us, 50.0, "{section}");
    assert_eq!(
        (checked.engine_copy_ns_per_byte, checked.engine_copy_threads),
        (0.22, 0.95),
        "{checked:?}"
    );
    assert!(
        section.contains("a side's copy 0.2200 ns/B on 0.95 threads (not charged)"),
        "{section}"
    );
    assert_eq!(
        format!("{:.4}", cpu.copy_ns_per_byte),
        format!("{:.4}", c.copy_ns_per_byte),
        "{section}"
    );
    assert_eq!(cpu.cold_after_us, 2000.0, "{section}");
    // the packets' decode: medians 20 us at one entry and 34 us at five (the two-entry
    // packet is neither), so 3.5 us an entry and 16.5 a packet
    assert_eq!(
        (cpu.packet_us, cpu.packet_entry_us),
        (16.5, 3.5),
        "{section}"
    );
    assert!(
        section.contains("32 writes of 4 KiB in one transfer: 800.0 us, one: 25.0 us"),
        "{section}"
    );
    // Two parked processes per cold round trip: each wake is half the difference.
    assert_eq!(cpu.wake_us, 120.0, "{section}");
    // One point per pause, in order of the pause; the 30 ms point, below the 10 ms one, is
    // raised to it.
    let points: Vec<(f64, f64)> = cpu
        .wake_after
        .iter()
        .map(|p| (p.idle_us, p.wake_us))
        .collect();
    assert_eq!(
        points,
        [
            (1000.0, 20.0),
            (10000.0, 120.0),
            (30000.0, 120.0),
            (100000.0, 160.0)
        ],
        "{section}"
    );
}

/// The wake by time parked (`wake_after`): nothing while hot, interpolated in log(idle)
/// between the points (from nothing at `park_us`), the last point's beyond it and for a
/// process never seen; without points, `wake_us` for every wake.
#[test]
fn a_wake_grows_with_the_time_parked() {
    use omnirig_harness::host::{Cpu, CpuSpec, WakePoint};
    use std::time::Duration;
    let spec = CpuSpec {
        wake_us: 999.0,
        park_us: 50.0,
        wake_after: [(1_000.0, 20.0), (10_000.0, 90.0), (100_000.0, 160.0)]
            .map(|(idle_us, wake_us)| WakePoint { idle_us, wake_us })
            .to_vec(),
        ..CpuSpec::default()
    };
    let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert_eq!(spec.wake_for(Some(50.0)), 0.0);
    assert_eq!(spec.wake_for(Some(1_000.0)), 20.0);
    assert_eq!(spec.wake_for(Some(10_000.0)), 90.0);
    // halfway in log between 1 and 10 ms: halfway in wake
    assert!(near(spec.wake_for(Some(10f64.powf(3.5))), 55.0));
    // between park_us and the first point: from nothing
    let f = (100f64.ln() - 50f64.ln()) / (1000f64.ln() - 50f64.ln());
    assert!(near(spec.wake_for(Some(100.0)), 20.0 * f));
    assert_eq!(spec.wake_for(Some(5e6)), 160.0);
    assert_eq!(spec.wake_for(None), 160.0);
    let flat = CpuSpec {
        wake_us: 999.0,
        ..CpuSpec::default()
    };
    assert_eq!(flat.wake_for(Some(100.0)), 999.0);
    assert_eq!(flat.wake_for(Some(20.0)), 0.0);

    // In a run: a process's wake follows how long it was parked.
    let rt = paused_runtime();
    rt.block_on(async {
        // a tokio millisecond is a modelled microsecond
        let cpu = Cpu::new(spec.clone(), &["a"], 1000).unwrap();
        let us = Duration::from_millis;
        let timed = || async {
            let t0 = tokio::time::Instant::now();
            cpu.wake("a/engine").await;
            t0.elapsed()
        };
        assert_eq!(timed().await, us(160), "never seen");
        tokio::time::sleep(us(1_000)).await;
        assert_eq!(timed().await, us(20));
        tokio::time::sleep(us(10_000)).await;
        assert_eq!(timed().await, us(90));
        tokio::time::sleep(us(30)).await;
        assert_eq!(timed().await, us(0), "hot");
    });

    // Bad curves are refused naming the point.
    let bad = |wake_after: Vec<(f64, f64)>| {
        CpuSpec {
            wake_after: wake_after
                .into_iter()
                .map(|(idle_us, wake_us)| WakePoint { idle_us, wake_us })
                .collect(),
            ..CpuSpec::default()
        }
        .validate(&[])
        .unwrap_err()
    };
    let e = bad(vec![(1000.0, 1.0), (900.0, 2.0)]);
    assert!(e.starts_with("cpu.wake_after[1].idle_us: 900"), "{e}");
    let e = bad(vec![(40.0, 1.0)]);
    assert!(e.starts_with("cpu.wake_after[0].idle_us: 40"), "{e}");
    let e = bad(vec![(1000.0, f64::NAN)]);
    assert!(e.starts_with("cpu.wake_after[0].wake_us: NaN"), "{e}");
    let e = bad(vec![(1000.0, 1.0); 17]);
    assert!(e.contains("at most 16"), "{e}");
}

/// With a host model a run's CPU work takes virtual time (so e2e grows), and the run stays
/// a function of (scenario, seed).
#[test]
fn the_host_model_charges_time_and_replays() {
    let mut s = Scenario::golden("image_audio", TransportKind::Sim);
    s.concurrency = 2;
    s.requests[0].repeat = 2;
    let free = sim::run(&s, Some(3)).unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let (fabric, cpu) =
        sim::fabric_file_from_path(&root.join("fabrics/tcp-localhost.yaml")).unwrap();
    assert!(cpu.is_some(), "tcp-localhost.yaml has a cpu section");
    s.fabric = Some(fabric.clone());
    let no_cpu = sim::run(&s, Some(3)).unwrap();
    s.cpu = cpu;
    let a = sim::run(&s, Some(3)).unwrap();
    let b = sim::run(&s, Some(3)).unwrap();
    assert!(a.report.passed(), "{}", a.report.summary_text());
    assert_eq!(
        a.digest,
        b.digest,
        "{:?}",
        sim::first_difference(&a.trace, &b.trace)
    );
    assert_eq!(
        serde_json::to_string(&a.report.requests).unwrap(),
        serde_json::to_string(&b.report.requests).unwrap()
    );
    assert!(
        a.report.summary.e2e_p50_ms > no_cpu.report.summary.e2e_p50_ms * 2.0,
        "cpu {} ms vs none {} ms",
        a.report.summary.e2e_p50_ms,
        no_cpu.report.summary.e2e_p50_ms
    );
    assert!(free.report.passed());
}

/// Every fabric shipped in `harness/fabrics/` parses (with its `cpu:` section, where it has
/// one) and carries a golden request bit-exact in a simulated run.
#[test]
fn every_shipped_fabric_parses_and_carries_a_request() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fabrics");
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let (fabric, cpu) =
            sim::fabric_file_from_path(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut s = Scenario::golden("text_short", TransportKind::Sim);
        s.fabric = Some(fabric);
        s.cpu = cpu;
        let r = sim::run(&s, Some(1)).unwrap();
        assert!(
            r.report.passed(),
            "{}: {}",
            path.display(),
            r.report.summary_text()
        );
        seen.push(path.file_name().unwrap().to_string_lossy().into_owned());
    }
    seen.sort();
    assert!(
        seen.contains(&"softroce-2vm.yaml".to_string()) && seen.len() >= 3,
        "{seen:?}"
    );
}

/// A busy child process's count grows to its work; one that is gone reads None. (A
/// child, not this process: the other tests' threads come and go here.)
#[test]
fn a_process_cpu_time_counts_the_work_its_threads_did() {
    if omnirig_harness::host::process_cpu_ns(std::process::id()).is_none() {
        return; // no schedstat here: nothing to count
    }
    let mut busy = std::process::Command::new("sh")
        .args(["-c", "while :; do :; done"])
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    let mut seen = 0;
    while t.elapsed() < std::time::Duration::from_secs(20) {
        seen = omnirig_harness::host::process_cpu_ns(busy.id()).unwrap_or(0);
        if seen >= 30_000_000 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let wall = t.elapsed();
    busy.kill().unwrap();
    busy.wait().unwrap();
    assert!(
        seen >= 30_000_000,
        "{seen} ns counted in {wall:?} of a busy loop"
    );
    // one thread cannot have run longer than the wall time since it started
    assert!(
        seen as u128 <= wall.as_nanos() + 20_000_000,
        "{seen} ns in {wall:?}"
    );
    assert_eq!(
        omnirig_harness::host::process_cpu_ns(u32::MAX),
        None,
        "no such process"
    );
}
