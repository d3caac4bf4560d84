//! `omnirig explore --seeds N`: a seeded search on the simulated fabric. Each seed draws a run
//! (requests, concurrency, arrival pattern, jitter, random transport faults and scripted
//! harness faults), runs it on `sim`, checks the invariants, and runs it again to check it
//! replays exactly. A failing seed is printed with the command that replays it.

use std::path::PathBuf;

use omnirig_harness::faults::{AnyFault, FaultSpec, HarnessFault, RandomFaults};
use omnirig_harness::scenario::{Arrival, RequestEntry, Scenario};
use omnirig_harness::sim::{self, SimRun};
use omnirig_transports::{FabricSpec, FaultKind, FaultPoint, TransportKind};

#[derive(clap::Args, Debug)]
pub struct ExploreArgs {
    /// How many seeds to try.
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// The first seed (seeds run `start`, `start + 1`, ...).
    #[arg(long, default_value_t = 1)]
    start: u64,
    /// The fabric (YAML); default: one node per stage behind a 100 Gb/s switch.
    #[arg(long)]
    fabric: Option<PathBuf>,
    /// Skip the second run of each seed (the replay check).
    #[arg(long)]
    no_replay: bool,
    /// Print the drawn scenario of each seed (JSON) before running it.
    #[arg(long)]
    show: bool,
    /// Start no new seed after this many minutes (run "for a while": a large --seeds and a
    /// time budget).
    #[arg(long)]
    minutes: Option<f64>,
}

/// splitmix64 over (seed, i): every draw of a seed its own number.
fn draw(seed: u64, i: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i.wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn pick<T: Copy>(seed: u64, i: u64, from: &[T]) -> T {
    from[(draw(seed, i) % from.len() as u64) as usize]
}

/// The run of `seed`.
pub fn scenario_of(seed: u64, fabric: &FabricSpec) -> Scenario {
    let mut s = Scenario::golden("text_short", TransportKind::Sim);
    s.name = format!("explore-{seed}");
    let n = 2 + draw(seed, 1) % 9;
    s.requests = (0..n)
        .map(|i| {
            let d = draw(seed, 100 + i);
            let images = if d.is_multiple_of(3) {
                serde_json::json!([{ "width": 64, "height": 64 }])
            } else {
                serde_json::json!([])
            };
            let audios = if d.is_multiple_of(5) {
                serde_json::json!([{ "seconds": 1.0 }])
            } else {
                serde_json::json!([])
            };
            let spec = serde_json::json!({
                // A few share a seed: twins, so caches and reused slots come into play.
                "seed": d % 4,
                "text_tokens": 8 + (d >> 8) % 120,
                "images": images,
                "audios": audios,
                "output_text_tokens": 1 + (d >> 16) % 16,
                "output_audio_seconds": 0.25 * (1 + (d >> 24) % 4) as f64,
            });
            RequestEntry {
                case: None,
                name: Some(format!("r{i}")),
                request: Some(serde_json::from_value(spec).expect("a valid request")),
                repeat: 1,
                vary_seed: false,
            }
        })
        .collect();
    s.concurrency = pick(seed, 2, &[1, 2, 4, 8, 16]);
    s.arrival = match draw(seed, 3) % 3 {
        0 => Arrival::default(),
        1 => Arrival {
            pattern: "interval".into(),
            interval_ms: (draw(seed, 4) % 2000) as f64 / 100.0,
            ..Arrival::default()
        },
        _ => Arrival {
            pattern: "poisson".into(),
            rate_per_s: 50.0 + (draw(seed, 4) % 5000) as f64,
            seed,
            ..Arrival::default()
        },
    };
    s.hop_timeout_s = pick(seed, 5, &[0.05, 0.2, 1.0]);
    s.request_timeout_s = 10.0;
    s.distinct_outputs = !draw(seed, 6).is_multiple_of(4);
    s.prefix_cache = !draw(seed, 7).is_multiple_of(3);
    let fraction = pick(seed, 8, &[0.0, 0.1, 0.3, 0.6]);
    if fraction > 0.0 {
        s.random_faults = Some(RandomFaults {
            fraction,
            seed,
            kinds: FaultKind::ALL.to_vec(),
        });
    }
    // Now and then a scripted harness fault on top (sidecar, grant and pool faults).
    if draw(seed, 9).is_multiple_of(4) {
        let kind = pick(seed, 10, &HarnessFault::ALL);
        let hop = match kind {
            HarnessFault::TruncatedSidecar
            | HarnessFault::UnknownVersionSidecar
            | HarnessFault::InconsistentSidecar => {
                pick(seed, 11, &["thinker_to_talker", "talker_to_code2wav"])
            }
            _ => pick(
                seed,
                11,
                &["kv_cache", "thinker_to_talker", "talker_to_code2wav"],
            ),
        };
        s.faults.push(FaultSpec {
            hop: hop.into(),
            request: (draw(seed, 12) % n) as usize,
            tensor: None,
            at: FaultPoint::BeforeSubmit,
            kind: AnyFault::Harness(kind),
            times: 1,
        });
    }
    let mut f = fabric.clone();
    f.jitter_us = pick(seed, 13, &[0.0, 1.0, 5.0, 50.0]);
    f.seed = seed;
    f.in_flight = pick(seed, 14, &[1, 2, 4, 8]);
    s.fabric = Some(f);
    s
}

/// The invariants of one run; the first one broken, if any.
pub fn check(s: &Scenario, run: &SimRun) -> Result<(), String> {
    let r = &run.report;
    let planned = s.expand().map_err(|e| e.to_string())?.len();
    if r.requests.len() != planned {
        return Err(format!("{} of {planned} requests ended", r.requests.len()));
    }
    for q in &r.requests {
        if q.ok {
            if q.error.is_some() || !q.hops.iter().all(|h| h.verified) {
                return Err(format!("{} ok without every hop verified", q.id));
            }
        } else {
            let Some(f) = &q.failure else {
                return Err(format!("{} failed with no failure: {:?}", q.id, q.error));
            };
            if f.kind.as_str() == "other" {
                return Err(format!(
                    "{} failed unnamed (kind other): {:?}",
                    q.id, q.error
                ));
            }
        }
    }
    if !r.summary.pools_clean {
        return Err(format!("pools or engines not back to zero: {:?}", r.stages));
    }
    if let Some(f) = &r.faults {
        if let Some(l) = f.late.iter().find(|l| !l.refused) {
            return Err(format!(
                "late bytes of {} {} landed: {}",
                l.request, l.tensor, l.outcome
            ));
        }
        // A request that met no fault must arrive exact, unless it shares a multimodal item
        // with one that did: its encoder output is one cache entry (EC dedupe by mm_hash),
        // and the twin waits on the faulty request's fill of it, so it may time out too.
        let planned = s.expand().map_err(|e| e.to_string())?;
        // Every multimodal item of a request, as (seed, kind, shape): one cache entry each.
        let items = |id: &str| -> std::collections::BTreeSet<String> {
            planned
                .iter()
                .find(|p| p.id == id)
                .map(|p| {
                    let sp = &p.spec;
                    let one = |kind: &str, v: serde_json::Result<String>| {
                        format!("{} {kind} {}", sp.seed, v.unwrap_or_default())
                    };
                    sp.images
                        .iter()
                        .map(|x| one("image", serde_json::to_string(x)))
                        .chain(
                            sp.audios
                                .iter()
                                .map(|x| one("audio", serde_json::to_string(x))),
                        )
                        .chain(
                            sp.videos
                                .iter()
                                .map(|x| one("video", serde_json::to_string(x))),
                        )
                        .collect()
                })
                .unwrap_or_default()
        };
        let struck = |id: &str| {
            f.fired.iter().any(|x| x.request == id) || f.targets.iter().any(|t| t.request == id)
        };
        for q in &r.requests {
            if struck(&q.id) || q.ok {
                continue;
            }
            let mine = items(&q.id);
            let twin = r
                .requests
                .iter()
                .any(|o| struck(&o.id) && !items(&o.id).is_disjoint(&mine));
            let timed_out = q
                .failure
                .as_ref()
                .is_some_and(|f| f.kind.as_str() == "timed_out");
            if !(twin && timed_out) {
                return Err(format!(
                    "{} failed without a fault of its own: {:?}",
                    q.id, q.error
                ));
            }
        }
        // A fault that fired and must fail its request did.
        for x in &f.fired {
            if x.kind == "delay" {
                continue;
            }
            if let Some(q) = r.requests.iter().find(|q| q.id == x.request)
                && q.ok
            {
                return Err(format!(
                    "{} fired on {} {} and went unnoticed",
                    x.kind, x.request, x.tensor
                ));
            }
        }
    } else if let Some(q) = r.requests.iter().find(|q| !q.ok) {
        return Err(format!(
            "{} failed in a run without faults: {:?}",
            q.id, q.error
        ));
    }
    Ok(())
}

pub fn run(args: ExploreArgs) -> anyhow::Result<()> {
    let fabric = match &args.fabric {
        Some(p) => sim::fabric_from_path(p)?,
        None => FabricSpec::default(),
    };
    let t0 = std::time::Instant::now();
    let (mut failed, mut requests, mut fired, mut modelled) = (Vec::new(), 0, 0, 0.0);
    let mut tried = 0;
    for seed in args.start..args.start.saturating_add(args.seeds) {
        if args
            .minutes
            .is_some_and(|m| t0.elapsed().as_secs_f64() > m * 60.0)
        {
            break;
        }
        tried += 1;
        let s = scenario_of(seed, &fabric);
        if args.show {
            println!("--- seed {seed}\n{}", serde_json::to_string(&s)?);
        }
        let verdict = match sim::run(&s, None) {
            Err(e) => Err(format!("the run failed to start: {e}")),
            Ok(a) => {
                let mut v = check(&s, &a);
                if v.is_ok() && !args.no_replay {
                    match sim::run(&s, None) {
                        Ok(b) if b.digest != a.digest => {
                            let (i, x, y) =
                                sim::first_difference(&a.trace, &b.trace).unwrap_or_default();
                            v = Err(format!(
                                "the replay differs at trace line {i}:\n    {x}\n    {y}"
                            ));
                        }
                        Ok(_) => {}
                        Err(e) => v = Err(format!("the replay failed to start: {e}")),
                    }
                }
                requests += a.report.requests.len();
                fired += a.report.faults.as_ref().map_or(0, |f| f.fired.len());
                modelled += a.virtual_s;
                println!(
                    "seed {seed}: {} requests ({} ok), {} faults fired, {:.1} ms modelled, trace {}{}",
                    a.report.requests.len(),
                    a.report.summary.ok,
                    a.report.faults.as_ref().map_or(0, |f| f.fired.len()),
                    a.virtual_s * 1e3,
                    a.digest,
                    if v.is_ok() { "" } else { "  FAILED" }
                );
                v
            }
        };
        if let Err(why) = verdict {
            println!(
                "seed {seed} FAILED: {why}\n  replay: omnirig explore --start {seed} --seeds 1{}",
                args.fabric
                    .as_ref()
                    .map(|p| format!(" --fabric {}", p.display()))
                    .unwrap_or_default()
            );
            failed.push(seed);
        }
    }
    println!(
        "explored {tried} seeds: {requests} requests, {fired} faults fired, {:.2} s modelled in {:.1} s; {} failing{}",
        modelled,
        t0.elapsed().as_secs_f64(),
        failed.len(),
        if failed.is_empty() {
            String::new()
        } else {
            format!(
                ": {}",
                failed
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        }
    );
    if !failed.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}
