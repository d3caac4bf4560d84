//! `omnirig bench ...`

use std::path::PathBuf;

use anyhow::Context;
use omnirig_transports::{TcpConfig, TransportKind};

use crate::bench::{self, hop, parse_sizes, peer, pipeline, transfer};

#[derive(clap::Subcommand, Debug)]
pub enum BenchCmd {
    /// Write/read latency and bandwidth per size against the physical baseline
    /// (memcpy for loopback, a plain TCP socket between two processes for tcp).
    Transfer(TransferArgs),
    /// One hop's real payloads (a scenario's requests): omnirig tensor-native, every control
    /// message included, against the current path (pickle / pickle protocol 5 out-of-band over
    /// ZMQ, ci/baseline/pickle_hop.py), between two processes on 127.0.0.1.
    Hop(HopArgs),
    /// End-to-end five-stage request latency (p50/p99) and throughput against concurrency:
    /// tensor-native hops against the current path (five Python processes, pickle over ZMQ).
    Pipeline(PipelineArgs),
    /// The far side of a benchmark: started by `bench transfer` itself for tcp and shm; for
    /// rdma across two nodes, run it on the far node (`--mode rdma-engine --listen ADDR`).
    Peer(PeerArgs),
}

/// What the hop and pipeline suites share.
#[derive(clap::Args, Debug)]
pub struct CommonArgs {
    /// Scenario YAML whose requests give the payloads (default: the embedded default scenario).
    #[arg(long)]
    pub scenario: Option<PathBuf>,
    /// Python interpreter with numpy + pyzmq + xxhash (ci/baseline/setup.sh prints one).
    #[arg(long, env = "OMNIRIG_BASELINE_PYTHON", default_value = "python3")]
    pub python: PathBuf,
    /// The baseline program (default: ci/baseline/pickle_hop.py of this checkout).
    #[arg(long)]
    pub script: Option<PathBuf>,
    /// Payloads of at most this many bytes travel inline (sidecar + bytes in one frame on the
    /// busy-polled inline channel, omnirig_harness::inline: one round trip instead of the
    /// reservation / grant / write / packet ones); 0 turns it off.
    #[arg(long, default_value = "256K")]
    pub inline_below: String,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// omnirig's transport between the processes: tcp, or shm (same host: sealed memfds, one
    /// copy by the grant owner).
    #[arg(long, value_enum, default_value_t = TransportKind::Tcp)]
    pub transport: TransportKind,
    /// Stage hops: ask for each handoff's destination with an offer instead of having the
    /// consumer grant it ahead (credits: granted when the request is announced and again
    /// with each ack, so a handoff is write -> packet -> ack).
    #[arg(long)]
    pub no_credits: bool,
}

#[derive(clap::Args, Debug)]
pub struct HopArgs {
    /// ec, kv, thinker-talker, talker-code2wav.
    #[arg(long)]
    hop: String,
    #[command(flatten)]
    common: CommonArgs,
    /// Bytes to move per case and side (bounds iterations for large payloads).
    #[arg(long, default_value = "2G")]
    budget: String,
    #[arg(long, default_value_t = 5)]
    min_iters: usize,
    #[arg(long, default_value_t = 400)]
    max_iters: usize,
    /// Interleaved rounds (omnirig, pickle, pickle5-oob in turn in each).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Also time the same protocol in one process over loopback.
    #[arg(long)]
    loopback: bool,
    /// TCP slice size (bytes per frame). With one CPU per side, fewer and larger slices
    /// win; with cores to spare, more streams do.
    #[arg(long, default_value = "512K")]
    slice_size: String,
    /// TCP connections per peer (slices in flight per transfer).
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// CPUs for the sender side and the receiver side, for omnirig and the baseline alike:
    /// auto (the first two this process may use), none (the scheduler decides), or A,B.
    #[arg(long, default_value = "auto")]
    cpus: String,
}

#[derive(clap::Args, Debug)]
pub struct PipelineArgs {
    /// Requests in flight, comma separated.
    #[arg(long, default_value = "1,4,16,64")]
    concurrency: String,
    #[command(flatten)]
    common: CommonArgs,
    /// Timed requests per concurrency level (at least 2 x concurrency).
    #[arg(long, default_value_t = 24)]
    requests: usize,
    /// Baseline modes: pickle, pickle5-oob (comma separated).
    #[arg(long, default_value = "pickle,pickle5-oob")]
    modes: String,
}

impl CommonArgs {
    pub fn scenario(&self) -> anyhow::Result<omnirig_harness::Scenario> {
        Ok(match &self.scenario {
            Some(p) => omnirig_harness::Scenario::from_path(p)?,
            None => omnirig_harness::Scenario::default_scenario(),
        })
    }

    pub fn script(&self) -> PathBuf {
        self.script.clone().unwrap_or_else(hop::default_script)
    }

    pub fn inline_below(&self) -> anyhow::Result<u64> {
        if self.inline_below.trim() == "0" {
            return Ok(0);
        }
        one_size(&self.inline_below, "inline-below")
    }
}

fn emit(
    results: &bench::Results,
    verdicts: Vec<String>,
    json: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    print!("{}", results.table());
    for v in verdicts {
        println!("{v}");
    }
    if let Some(path) = json {
        write_json(path, results)?;
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct TransferArgs {
    #[arg(long, value_enum, default_value_t = TransportKind::Tcp)]
    transport: TransportKind,
    /// Sizes, comma separated, with K/M/G binary suffixes.
    #[arg(long, default_value = "4K,64K,1M,16M,64M,256M")]
    sizes: String,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Bytes to move per size and op; small sizes are capped by --max-iters.
    #[arg(long, default_value = "2G")]
    budget: String,
    #[arg(long, default_value_t = 5)]
    min_iters: usize,
    #[arg(long, default_value_t = 2000)]
    max_iters: usize,
    /// TCP slice size (bytes per frame).
    #[arg(long, default_value = "512K")]
    slice_size: String,
    /// TCP connections per peer (slices in flight per transfer).
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Microseconds a TCP reader busy-polls before parking; the raw-socket baseline uses the
    /// same value (0 = block at once).
    #[arg(long, default_value_t = 50)]
    busy_poll_us: u64,
    /// rdma: seconds per ib_write_bw point of the perftest baseline (run before and after the
    /// engine where perftest is installed).
    #[arg(long, default_value_t = 2)]
    perftest_seconds: u64,
    /// rdma: engine runs, interleaved with perftest runs (one before each and one after the
    /// last); each row is the median engine run against perftest's median.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// rdma: microseconds a completion wait busy-polls before it parks on the completion
    /// channel (the engine's `RdmaConfig::completion_spin`; default: the engine's).
    #[arg(long)]
    completion_spin_us: Option<u64>,
    /// rdma: work requests in flight per queue pair (the engine's
    /// `RdmaConfig::max_outstanding`; default: the engine's).
    #[arg(long)]
    max_outstanding: Option<u32>,
    /// The tokio runtime the engine runs on: `multi` (multi-threaded, the engine driven from
    /// a spawned task, as in `omnirig run`) or `current` (one thread). Default: multi for
    /// rdma, current for the others.
    #[arg(long, value_enum)]
    runtime: Option<transfer::Runtime>,
    /// Microseconds to pause before each timed transfer and each raw round trip (tcp, shm;
    /// with loopback and rdma, before each round), so a peer that parks between requests, as
    /// a pipeline stage does, is measured cold (what `simulate --calibrate-cpu`'s `wake_us`
    /// models). 0: back to back.
    #[arg(long, default_value_t = 0)]
    gap_us: u64,
    /// Spend each `--gap-us` pause spinning on the timing thread instead of asleep: the peer
    /// parks, this side stays busy, as in a stage that computes its outputs right up to
    /// sending them (docs/benchmarks.md: over tcp here a cold batch then pays about one
    /// wake-up, not one per write).
    #[arg(long, requires = "gap_us")]
    gap_busy: bool,
    /// tcp: requests per timed transfer, each of the size, at consecutive offsets (a batch,
    /// as a stage's KV handoff moves its 96 tensors): the row's time is the whole batch's,
    /// what `simulate --calibrate-cpu` reads a write's own cost from (the raw-socket
    /// column stays one write of the size). 1: one request.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// rdma across two nodes: the far node's `omnirig bench peer --mode rdma-engine --listen
    /// ADDR` (ADDR as this node reaches it). The engine here writes into and reads from that
    /// peer's engine, and perftest runs across the same link (its servers started by the
    /// peer). Without it, both engines share this node's device.
    #[arg(long)]
    peer: Option<std::net::SocketAddr>,
    /// Seconds to wait for `--peer` to come up.
    #[arg(long, default_value_t = 120)]
    peer_wait_s: u64,
    #[command(flatten)]
    rdma: transfer::RdmaDevice,
}

#[derive(clap::Args, Debug)]
pub struct PeerArgs {
    /// engine, shm-engine, raw: the child of a tcp/shm benchmark on this host; rdma-engine:
    /// the far node of `bench transfer --transport rdma --peer ADDR` (needs --listen).
    #[arg(long, value_enum)]
    mode: peer::PeerMode,
    /// Bytes of each granted buffer (K/M/G suffixes).
    #[arg(long)]
    max_size: String,
    #[arg(long, default_value_t = TcpConfig::default().slice_size)]
    slice_size: u64,
    #[arg(long, default_value_t = TcpConfig::default().max_payload)]
    max_payload: u64,
    #[arg(long, default_value_t = 50)]
    busy_poll_us: u64,
    /// Pin the peer to this CPU.
    #[arg(long)]
    cpu: Option<usize>,
    /// rdma-engine: the address to serve the benchmark on (this node's address on the link).
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// rdma-engine: seconds to wait for the benchmark to connect before giving up.
    #[arg(long, default_value_t = 300)]
    wait_s: u64,
    /// rdma-engine: work requests in flight per queue pair (default: the engine's).
    #[arg(long)]
    max_outstanding: Option<u32>,
    #[command(flatten)]
    rdma: transfer::RdmaDevice,
}

/// The pipeline suite's default requests: the interactive golden cases (the 144 MiB and 300 MiB
/// KV cases would hold gigabytes in the baseline's ZMQ queues at concurrency 64; pass
/// `--scenario` to run them).
const PIPELINE_SCENARIO: &str = "name: bench-pipeline
concurrency: 1
transport: tcp
requests:
  - case: text_short
  - case: image_audio
";

fn one_size(s: &str, what: &str) -> anyhow::Result<u64> {
    match parse_sizes(s)
        .with_context(|| format!("--{what}"))?
        .as_slice()
    {
        [v] => Ok(*v),
        _ => anyhow::bail!("--{what} takes one size"),
    }
}

pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Transfer(a) => {
            let slice_size = one_size(&a.slice_size, "slice-size")?;
            let tcp = TcpConfig {
                slice_size,
                streams: a.streams,
                max_payload: slice_size.max(TcpConfig::default().max_payload),
                busy_poll: std::time::Duration::from_micros(a.busy_poll_us),
                ..TcpConfig::default()
            };
            let opts = transfer::Options {
                transport: a.transport,
                sizes: parse_sizes(&a.sizes).context("--sizes")?,
                budget: one_size(&a.budget, "budget")?,
                min_iters: a.min_iters.max(1),
                max_iters: a.max_iters.max(a.min_iters.max(1)),
                tcp,
                perftest_seconds: a.perftest_seconds,
                rounds: a.rounds,
                completion_spin: a.completion_spin_us.map(std::time::Duration::from_micros),
                max_outstanding: a.max_outstanding,
                runtime: a.runtime.unwrap_or(match a.transport {
                    TransportKind::Rdma => transfer::Runtime::Multi,
                    _ => transfer::Runtime::Current,
                }),
                gap: transfer::Gap {
                    len: std::time::Duration::from_micros(a.gap_us),
                    busy: a.gap_busy,
                },
                batch: a.batch,
                peer: a.peer,
                peer_wait: std::time::Duration::from_secs(a.peer_wait_s),
                rdma: a.rdma.clone(),
            };
            if !(1..=transfer::MAX_BATCH).contains(&a.batch) {
                anyhow::bail!("--batch {}: not in 1..={}", a.batch, transfer::MAX_BATCH);
            }
            if a.batch > 1 && a.transport != TransportKind::Tcp {
                anyhow::bail!(
                    "--batch is for --transport tcp (rdma's rows time batches of their own)"
                );
            }
            if a.peer.is_some() && a.transport != TransportKind::Rdma {
                anyhow::bail!(
                    "--peer is for --transport rdma across two nodes (tcp and shm start their \
                     peer on this host)"
                );
            }
            let results = transfer::run(&opts)?;
            print!("{}", results.table());
            for v in transfer::verdicts(&results) {
                println!("{v}");
            }
            if let Some(path) = a.json {
                write_json(&path, &results)?;
            }
            Ok(())
        }
        BenchCmd::Hop(a) => {
            let opts = hop::Options {
                hop: hop::parse_hop(&a.hop)?,
                scenario: a.common.scenario()?,
                budget: one_size(&a.budget, "budget")?,
                min_iters: a.min_iters.max(1),
                max_iters: a.max_iters.max(a.min_iters.max(1)),
                rounds: a.rounds.max(1),
                inline_below: a.common.inline_below()?,
                loopback: a.loopback,
                python: a.common.python.clone(),
                script: a.common.script(),
                tcp: {
                    let slice_size = one_size(&a.slice_size, "slice-size")?;
                    TcpConfig {
                        slice_size,
                        streams: a.streams.max(1),
                        max_payload: slice_size.max(TcpConfig::default().max_payload),
                        ..TcpConfig::default()
                    }
                },
                cpus: bench::cpus::parse(&a.cpus)?,
                transport: hop::process_transport(a.common.transport)?,
                exe: std::env::current_exe().context("locating the omnirig binary")?,
            };
            if a.common.no_credits {
                anyhow::bail!("--no-credits: the pipeline's stages always grant credits ahead");
            }
            let results = hop::run(&opts)?;
            emit(&results, hop::verdicts(&results), a.common.json.as_deref())
        }
        BenchCmd::Pipeline(a) => {
            let concurrency = a
                .concurrency
                .split(',')
                .map(|c| c.trim().parse::<usize>().context("--concurrency"))
                .collect::<anyhow::Result<Vec<_>>>()?;
            if concurrency.contains(&0) {
                anyhow::bail!("--concurrency: 0 requests in flight");
            }
            let opts = pipeline::Options {
                scenario: match &a.common.scenario {
                    Some(_) => a.common.scenario()?,
                    None => omnirig_harness::Scenario::from_yaml(
                        PIPELINE_SCENARIO,
                        "bench pipeline default",
                    )?,
                },
                concurrency,
                requests: a.requests.max(1),
                inline_below: a.common.inline_below()?,
                modes: a.modes.split(',').map(|m| m.trim().to_string()).collect(),
                python: a.common.python.clone(),
                script: a.common.script(),
                transport: hop::process_transport(a.common.transport)?,
                exe: std::env::current_exe().context("locating the omnirig binary")?,
            };
            if a.common.no_credits {
                anyhow::bail!(
                    "--no-credits: the pipeline runner's stages always grant credits ahead"
                );
            }
            let results = pipeline::run(&opts)?;
            emit(
                &results,
                pipeline::verdicts(&results),
                a.common.json.as_deref(),
            )
        }
        BenchCmd::Peer(p) => {
            if let Some(c) = p.cpu {
                bench::cpus::pin(c)?;
            }
            let max_size = one_size(&p.max_size, "max-size")?;
            if p.mode == peer::PeerMode::RdmaEngine {
                let listen = p.listen.context(
                    "--mode rdma-engine needs --listen ADDR (this node's address on the link)",
                )?;
                #[cfg(feature = "rdma")]
                {
                    let d = omnirig_transports::RdmaConfig::default();
                    return bench::remote::serve(
                        listen,
                        max_size,
                        omnirig_transports::RdmaConfig {
                            max_outstanding: p.max_outstanding.unwrap_or(d.max_outstanding),
                            device: p.rdma.device.clone().or(d.device.clone()),
                            gid_index: p.rdma.gid_index.or(d.gid_index),
                            ..d
                        },
                        std::time::Duration::from_secs(p.wait_s),
                    );
                }
                #[cfg(not(feature = "rdma"))]
                anyhow::bail!(
                    "--mode rdma-engine (on {listen}) needs a build with `--features rdma`"
                );
            }
            peer::serve(
                p.mode,
                max_size,
                TcpConfig {
                    slice_size: p.slice_size,
                    max_payload: p.max_payload,
                    ..TcpConfig::default()
                },
            )
        }
    }
}

pub fn write_json(path: &std::path::Path, results: &bench::Results) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(results)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
