//! `omnirig bench transfer`: write and read latency and bandwidth per size, against the
//! physical baseline measured in the same run (memcpy for loopback, a plain TCP socket
//! between two processes for tcp).

use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use omnirig_transports::memory::Region;
use omnirig_transports::{
    Access, Buffer, Engine, EngineConfig, Grant, InProcessStore, Request, TcpConfig, TransportKind,
};

use super::peer::{PeerMode, PeerProcess, RAW_HEADER, read_exact_polled, write_all_polled};
#[cfg(feature = "rdma")]
use super::perftest;
use super::{Results, Row, Samples, human_size, iterations};

#[derive(Debug, Clone)]
pub struct Options {
    pub transport: TransportKind,
    pub sizes: Vec<u64>,
    /// Bytes to move per size and op (bounds iterations for large sizes).
    pub budget: u64,
    pub min_iters: usize,
    pub max_iters: usize,
    pub tcp: TcpConfig,
    /// rdma: seconds per `ib_write_bw` point of the perftest baseline (read only by builds
    /// with the rdma feature).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub perftest_seconds: u64,
    /// rdma: engine runs, each between two perftest runs (perftest runs rounds + 1 times).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub rounds: usize,
    /// rdma: the engines' completion spin, if not the default.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub completion_spin: Option<std::time::Duration>,
    /// rdma: the engines' work requests in flight per queue pair, if not the default.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub max_outstanding: Option<u32>,
    pub runtime: Runtime,
    /// Pause before each timed transfer (and each raw round trip), so a peer that parks
    /// between requests, as a pipeline stage does, is measured cold. Zero: back to back.
    pub gap: Gap,
    /// tcp: requests per timed transfer, at consecutive offsets (1: one request).
    pub batch: usize,
    /// rdma: the far node's `omnirig bench peer --mode rdma-engine` (None: both engines here).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub peer: Option<std::net::SocketAddr>,
    /// rdma: how long to wait for that peer to come up.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub peer_wait: Duration,
    /// rdma: the device and GID index the engines (and perftest) use; unset, the engine's
    /// defaults (the first device, the first RoCEv2 IPv4 GID).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub rdma: RdmaDevice,
}

/// `--rdma-device` / `--rdma-gid-index`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RdmaDevice {
    /// rdma: the device to use (`ibv_devices`; default: the first).
    #[arg(long = "rdma-device")]
    pub device: Option<String>,
    /// rdma: the GID index to send from (`show_gids`; default: the first RoCEv2 IPv4 GID).
    #[arg(long = "rdma-gid-index")]
    pub gid_index: Option<u32>,
}

/// The tokio runtime the benchmark's engine runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Runtime {
    /// Multi-threaded, the suite in a spawned task: what `omnirig run` runs.
    Multi,
    /// One thread.
    Current,
}

const OP_TIMEOUT: Option<Duration> = Some(Duration::from_secs(120));

fn progress(msg: &str) {
    eprintln!("[bench transfer] {msg}");
}

pub fn run(o: &Options) -> anyhow::Result<Results> {
    let max = *o.sizes.iter().max().context("no sizes")?;
    let rt = match o.runtime {
        Runtime::Current => tokio::runtime::Builder::new_current_thread(),
        Runtime::Multi => tokio::runtime::Builder::new_multi_thread(),
    }
    .enable_all()
    .build()?;
    progress(&format!("runtime: {:?}", o.runtime));
    // Each transport has its own physical baseline, so its own suite.
    let rows = match o.transport {
        TransportKind::Loopback => rt.block_on(in_process(o, max, TransportKind::Loopback))?,
        // two engines of this process on one RDMA device (soft-RoCE: ci/softroce.sh); perftest's
        // ib_write_bw / ib_write_lat on the same device, run here before and after, are the
        // physical baseline where they are installed
        TransportKind::Rdma => {
            let o = o.clone();
            // on a worker thread, as the product's tasks run (block_on's thread is not one)
            rt.block_on(async move { tokio::spawn(async move { rdma(&o, max).await }).await })??
        }
        TransportKind::Tcp => rt.block_on(tcp(o, max))?,
        TransportKind::Shm => rt.block_on(shm(o, max))?,
        // GPU buffers (docs/gpu.md): the cuda transport and staging against CUDA copies.
        #[cfg(feature = "cuda")]
        TransportKind::Cuda => super::gpu::run(o, max)?,
        #[cfg(not(feature = "cuda"))]
        TransportKind::Cuda => {
            bail!("this build has no cuda transport (build with `--features cuda`)")
        }
        TransportKind::Sim => anyhow::bail!(
            "bench transfer measures real transports; the sim transport's times are the model's \
             (omnirig simulate)"
        ),
    };
    Ok(Results {
        suite: "transfer".into(),
        transport: o.transport.to_string(),
        rows,
        machine: Some(super::Machine::this()),
    })
}

/// The most requests `--batch` puts in one transfer.
pub const MAX_BATCH: usize = 1024;

/// Times `iters` transfers of the requests `reqs` together (after a short warm-up).
async fn time_engine(
    engine: &Engine,
    reqs: Vec<Request>,
    iters: usize,
    gap: Gap,
) -> anyhow::Result<Samples> {
    Ok(time_engine_cpu(engine, reqs, iters, gap, || None).await?.0)
}

/// As [`time_engine`], also reading `cpu` (CPU time so far, ns) around the timed transfers,
/// not the warm-up (whose first transfer faults the landing pages in): the CPU time they
/// took and the wall time they took it in, pauses included, where `cpu` reads.
async fn time_engine_cpu(
    engine: &Engine,
    reqs: Vec<Request>,
    iters: usize,
    gap: Gap,
    cpu: impl Fn() -> Option<u64>,
) -> anyhow::Result<(Samples, Option<(u64, Duration)>)> {
    let mut s = Samples::new(reqs.iter().map(|r| r.len).sum());
    for _ in 0..iters.min(3) {
        engine.transfer(reqs.clone(), OP_TIMEOUT).await?;
    }
    let (before, t0) = (cpu(), Instant::now());
    for _ in 0..iters {
        pause(gap);
        let t = Instant::now();
        engine.transfer(reqs.clone(), OP_TIMEOUT).await?;
        s.push(t.elapsed());
    }
    let spent = t0.elapsed();
    let used = before.zip(cpu()).map(|(b, a)| (a.saturating_sub(b), spent));
    Ok((s, used))
}

/// The pause before each timed transfer (`--gap-us`, `--gap-busy`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Gap {
    /// Zero: back to back.
    pub len: Duration,
    /// Spent spinning on the timing thread instead of asleep: the peer parks, this side
    /// does not, as in a stage that computes its outputs right up to sending them.
    pub busy: bool,
}

impl Gap {
    /// A pause asleep.
    pub fn asleep(len: Duration) -> Self {
        Self { len, busy: false }
    }
}

/// The pause: a thread sleep (tokio's timer rounds to whole milliseconds), or a spin on
/// this thread where `busy`.
fn pause(gap: Gap) {
    if gap.len.is_zero() {
        return;
    }
    if gap.busy {
        let t = Instant::now();
        while t.elapsed() < gap.len {
            std::hint::spin_loop();
        }
    } else {
        std::thread::sleep(gap.len);
    }
}

/// Two engines of this process over `kind` (loopback, or rdma through one device).
async fn in_process(o: &Options, max: u64, kind: TransportKind) -> anyhow::Result<Vec<Row>> {
    let store = InProcessStore::new();
    let cfg = |n: &str| {
        let c = EngineConfig::for_kind(n, kind).store(store.clone());
        #[cfg(feature = "rdma")]
        if kind == TransportKind::Rdma {
            return c.with(rdma_config(o));
        }
        c
    };
    let a = Arc::new(Engine::new(cfg("bench-a")).await?);
    let b = Engine::new(cfg("bench-b")).await?;
    let src = a.allocate(max)?;
    src.fill(0, max, |x| x.fill(0x5a))?;
    let dst = b.allocate(max)?;
    let wg = b.grant(&dst, 0, max, Access::Write)?;
    let rsrc = b.allocate(max)?;
    rsrc.fill(0, max, |x| x.fill(0x5a))?;
    let rg = b.grant(&rsrc, 0, max, Access::Read)?;
    let landing = a.allocate(max)?;
    let rows = rows_against_memcpy(kind, o, max, &a, (&src, &wg), (&landing, &rg)).await?;
    check_landed(&b, &dst, &wg, 0x5a, max)?;
    Ok(rows)
}

/// Sizes below this are set against `ib_write_lat` (latency), the others against
/// `ib_write_bw` (bandwidth).
#[cfg(feature = "rdma")]
const LATENCY_BELOW: u64 = 4096;

/// rdma: the engine's rows between perftest runs on the same device (where perftest is
/// installed): `rounds` engine runs interleaved with `rounds + 1` perftest runs, so drift in
/// the VM hits both alike. Each row is the median engine run, set against the median
/// perftest figure (and, for the record, the best one).
async fn rdma(o: &Options, max: u64) -> anyhow::Result<Vec<Row>> {
    #[cfg(feature = "rdma")]
    {
        if let Some(addr) = o.peer {
            return rdma_two_nodes(o, max, addr).await;
        }
        let (lat, bw): (Vec<u64>, Vec<u64>) = o.sizes.iter().partition(|&&s| s < LATENCY_BELOW);
        match perftest::device(&rdma_config(o)) {
            Err(why) => {
                progress(&format!("no perftest baseline: {why}"));
                in_process(o, max, TransportKind::Rdma).await
            }
            Ok(dev) => {
                let rounds = o.rounds.max(1);
                let mut figures = Vec::new();
                let mut runs = Vec::new();
                for i in 0..=rounds {
                    progress(&format!(
                        "perftest ({} of {}): ib_write_bw, ib_write_lat",
                        i + 1,
                        rounds + 1
                    ));
                    figures.push(perftest::measure(
                        &dev,
                        &mut perftest::Server::Local,
                        &bw,
                        &lat,
                        o.perftest_seconds,
                    )?);
                    if i < rounds {
                        progress(&format!("engine ({} of {rounds})", i + 1));
                        runs.push(in_process(o, max, TransportKind::Rdma).await?);
                    }
                }
                let mut rows = median_rows(runs)?;
                against_perftest(
                    &mut rows,
                    &perftest::Figures::median(&figures),
                    &perftest::Figures::best_of(&figures),
                );
                Ok(rows)
            }
        }
    }
    #[cfg(not(feature = "rdma"))]
    {
        // the engine refuses: this build has no rdma transport (it says how to get one)
        in_process(o, max, TransportKind::Rdma).await
    }
}

/// The engines' rdma config: the defaults, with the bench's overrides.
#[cfg(feature = "rdma")]
fn rdma_config(o: &Options) -> omnirig_transports::RdmaConfig {
    let d = omnirig_transports::RdmaConfig::default();
    omnirig_transports::RdmaConfig {
        completion_spin: o.completion_spin.unwrap_or(d.completion_spin),
        max_outstanding: o.max_outstanding.unwrap_or(d.max_outstanding),
        device: o.rdma.device.clone().or(d.device),
        gid_index: o.rdma.gid_index.or(d.gid_index),
        ..d
    }
}

/// rdma across two nodes: this node's engine writes into and reads from the buffers of the
/// engine of `omnirig bench peer --mode rdma-engine` at `addr`, and perftest's client here
/// runs against servers that peer starts, so both cross the same link. Rounds interleave as
/// in one node; at the end the peer confirms every byte of its write buffer arrived.
#[cfg(feature = "rdma")]
async fn rdma_two_nodes(
    o: &Options,
    max: u64,
    addr: std::net::SocketAddr,
) -> anyhow::Result<Vec<Row>> {
    use super::perftest::Server;
    use super::remote::{PeerControl, WRITTEN, engine_config};

    progress(&format!("connecting to the bench peer at {addr}"));
    let mut peer = PeerControl::connect(addr, o.peer_wait)?;
    let (wg, rg) = peer.hello.grants()?;
    if wg.len < max || rg.len < max {
        bail!(
            "the bench peer grants {} bytes; --sizes up to {max} need `--max-size {max}` (or \
             more) on the peer",
            wg.len.min(rg.len)
        );
    }
    let name = format!("bench-{}", std::process::id());
    let a = Arc::new(Engine::new(engine_config(name, peer.local_ip()?, rdma_config(o))).await?);
    let info = a.connect_addr(peer.hello.addr).await?;
    progress(&format!(
        "engine peer at {} over {} ({})",
        peer.hello.addr, info.transport, info.device
    ));
    let src = a.allocate(max)?;
    src.fill(0, max, |x| x.fill(WRITTEN))?;
    let landing = a.allocate(max)?;
    let (lat, bw): (Vec<u64>, Vec<u64>) = o.sizes.iter().partition(|&&s| s < LATENCY_BELOW);
    let dev = perftest::device(&rdma_config(o));
    if let Err(why) = &dev {
        progress(&format!("no perftest baseline: {why}"));
    }
    let rounds = if dev.is_ok() { o.rounds.max(1) } else { 1 };
    let (mut figures, mut runs) = (Vec::new(), Vec::new());
    for i in 0..=rounds {
        if let Ok(dev) = &dev {
            progress(&format!(
                "perftest across the link ({} of {}): ib_write_bw, ib_write_lat",
                i + 1,
                rounds + 1
            ));
            let mut server = Server::Remote(&mut peer);
            figures.push(perftest::measure(
                dev,
                &mut server,
                &bw,
                &lat,
                o.perftest_seconds,
            )?);
        }
        if i < rounds {
            progress(&format!("engine ({} of {rounds})", i + 1));
            let rows = rows_against_memcpy(
                TransportKind::Rdma,
                o,
                max,
                &a,
                (&src, &wg),
                (&landing, &rg),
            )
            .await?;
            runs.push(rows);
        }
    }
    check_peer_pattern(&landing, o, TransportKind::Rdma)?;
    let differing = peer.check_written(max, WRITTEN)?;
    if differing != 0 {
        bail!("{differing} of the peer's {max} written bytes are not what this node wrote");
    }
    peer.bye();
    let mut rows = median_rows(runs)?;
    if !figures.is_empty() {
        against_perftest(
            &mut rows,
            &perftest::Figures::median(&figures),
            &perftest::Figures::best_of(&figures),
        );
    }
    Ok(rows)
}

/// Row by row, the median of several runs of the same suite: by p50 for latency sizes, by
/// bandwidth for the others (the whole row of that run, so its figures stay consistent).
#[cfg(feature = "rdma")]
fn median_rows(runs: Vec<Vec<Row>>) -> anyhow::Result<Vec<Row>> {
    let n = runs.first().map_or(0, Vec::len);
    if runs.iter().any(|r| r.len() != n) {
        bail!("the engine's runs returned different rows");
    }
    Ok((0..n)
        .map(|j| {
            let mut col: Vec<&Row> = runs.iter().map(|r| &r[j]).collect();
            if col[0].size < LATENCY_BELOW {
                col.sort_by(|a, b| b.omnirig.p50_us.total_cmp(&a.omnirig.p50_us));
            } else {
                col.sort_by(|a, b| a.omnirig.gbps.total_cmp(&b.omnirig.gbps));
            }
            col[col.len() / 2].clone()
        })
        .collect())
}

/// Write rows get perftest as their baseline: `ib_write_bw`'s MiB/s for bandwidth sizes (ratio
/// of GB/s), `ib_write_lat`'s full round trip (twice its t_typical, which is half a ping-pong)
/// for latency sizes (ratio of p50s, baseline over ours, so higher is better in both).
/// `median` is the baseline; `best` rides along in `Row::best`.
#[cfg(feature = "rdma")]
fn against_perftest(rows: &mut [Row], median: &perftest::Figures, best: &perftest::Figures) {
    use super::Baseline;
    // (baseline, ratio) of row `r` against figures `f`
    let against = |r: &Row, f: &perftest::Figures| -> Option<(Baseline, f64)> {
        if let Some(mib) = f.bw(r.size) {
            let gbps = mib * 1048576.0 / 1e9;
            let b = Baseline {
                name: "ib_write_bw".into(),
                gbps,
                p50_us: r.size as f64 / (gbps * 1e3),
                p99_us: None,
                samples_us: None,
            };
            Some((b, r.omnirig.gbps / gbps))
        } else if let Some(half) = f.lat(r.size)
            && r.op == "write"
        {
            let rtt = 2.0 * half;
            let b = Baseline {
                name: "ib_write_lat".into(),
                gbps: r.size as f64 / (rtt * 1e3),
                p50_us: rtt,
                p99_us: None,
                samples_us: None,
            };
            Some((b, rtt / r.omnirig.p50_us))
        } else {
            None
        }
    };
    for r in rows.iter_mut().filter(|r| r.op.starts_with("write")) {
        if let Some((b, ratio)) = against(r, median) {
            r.baseline = b;
            r.ratio = ratio;
            r.best = against(r, best);
        }
    }
}

/// The peer process fills its read buffer with (i * 7 + 3); the last read must have brought
/// that, so the benchmark moved real bytes.
fn check_peer_pattern(
    landing: &Buffer,
    o: &Options,
    transport: TransportKind,
) -> anyhow::Result<()> {
    let last = *o.sizes.last().expect("sizes");
    let ok = landing.view(0, last, |b| {
        b.iter().enumerate().all(|(i, &x)| x == (i * 7 + 3) as u8)
    })?;
    if !ok {
        bail!("bytes read over {transport} differ from the peer's buffer");
    }
    Ok(())
}

/// A write and a read row per size, each against memcpy between two page-aligned buffers,
/// reused as the engine's are (the floor of a one-copy data path).
async fn rows_against_memcpy(
    transport: TransportKind,
    o: &Options,
    max: u64,
    a: &Arc<Engine>,
    (src, wg): (&Buffer, &Grant),
    (landing, rg): (&Buffer, &Grant),
) -> anyhow::Result<Vec<Row>> {
    let msrc = Region::allocate(max as usize, false)?;
    msrc.with_mut_slice(0, max, |b| b.fill(0x5a))?;
    let mdst = Region::allocate(max as usize, false)?;
    let mut rows = Vec::new();
    for &size in &o.sizes {
        let iters = iterations(size, o.budget, o.min_iters, o.max_iters);
        progress(&format!("{transport} {} x {iters}", human_size(size)));
        let write = Request::write(src, 0, wg, 0, size);
        let read = Request::read(landing, 0, rg, 0, size);
        let (base, w, r) = against_memcpy(a, &write, &read, (&msrc, &mdst), iters, o.gap).await?;
        rows.push(Row::new("write", size, &w, "memcpy", &base));
        rows.push(Row::new("read", size, &r, "memcpy", &base));
        if transport == TransportKind::Rdma {
            // What ib_write_bw measures: many writes in flight, not one at a time. A batch of
            // WINDOW requests (how a KV handoff arrives), timed per batch.
            let reqs: Vec<Request> = (0..WINDOW)
                .map(|i| {
                    let off = if size * WINDOW <= max { i * size } else { 0 };
                    Request::write(src, off, wg, off, size)
                })
                .collect();
            let rounds = iters.div_ceil(WINDOW as usize).max(3);
            let mut ws = Samples::new(size * WINDOW);
            for i in 0..rounds + 1 {
                let t = Instant::now();
                a.transfer(reqs.clone(), OP_TIMEOUT).await?;
                if i >= 1 {
                    ws.push(t.elapsed());
                }
            }
            rows.push(Row::new(
                &format!("write-x{WINDOW}"),
                size,
                &ws,
                "memcpy",
                &base,
            ));
            // ib_write_bw never lets its queue drain; a batch at a time does, between batches.
            // `depth` batches kept in flight (each loop starts its next batch as soon as its
            // last one ended) keep the queue pair busy as a stage with several requests in
            // flight does: each loop is a task of its own, as each request is in a stage
            // process (so the runtime's threads share them). Bandwidth is every byte over the
            // wall time; the row's time per batch is that wall time shared out over the
            // batches.
            for depth in DEPTHS {
                let one_loop = || {
                    let (a, reqs) = (a.clone(), reqs.clone());
                    tokio::spawn(async move {
                        for _ in 0..rounds {
                            a.transfer(reqs.clone(), OP_TIMEOUT).await?;
                        }
                        anyhow::Ok(())
                    })
                };
                let t = Instant::now();
                let loops: Vec<_> = (0..depth).map(|_| one_loop()).collect();
                for l in loops {
                    l.await??;
                }
                let batches = depth as u32 * rounds as u32;
                let mut ds = Samples::new(size * WINDOW);
                (0..batches).for_each(|_| ds.push(t.elapsed() / batches));
                rows.push(Row::new(
                    &format!("write-x{WINDOW}-d{depth}"),
                    size,
                    &ds,
                    "memcpy",
                    &base,
                ));
            }
        }
    }
    Ok(rows)
}

/// Requests per batch in rdma's windowed write rows.
const WINDOW: u64 = 16;
/// Batches in flight at once in rdma's pipelined write rows (one task per batch in flight):
/// 2 and 4 keep 32 and 64 writes posted, where ib_write_bw keeps 128.
const DEPTHS: [usize; 2] = [2, 4];

/// Times `write`, `read` and a memcpy of the same size between the two baseline buffers,
/// interleaved one of each per round, so drift (frequency, the other vCPU, cache state) hits
/// the baseline and the engine alike. Returns (memcpy, write, read) samples.
async fn against_memcpy(
    a: &Engine,
    write: &Request,
    read: &Request,
    (msrc, mdst): (&Region, &Region),
    iters: usize,
    gap: Gap,
) -> anyhow::Result<(Samples, Samples, Samples)> {
    let size = write.len;
    let (mut base, mut w, mut r) = (Samples::new(size), Samples::new(size), Samples::new(size));
    for i in 0..iters + 3 {
        pause(gap);
        let t = Instant::now();
        msrc.copy_to(0, mdst, 0, size)?;
        std::hint::black_box(mdst);
        let tb = t.elapsed();
        let t = Instant::now();
        a.transfer(vec![write.clone()], OP_TIMEOUT).await?;
        let tw = t.elapsed();
        let t = Instant::now();
        a.transfer(vec![read.clone()], OP_TIMEOUT).await?;
        let tr = t.elapsed();
        if i >= 3 {
            base.push(tb);
            w.push(tw);
            r.push(tr);
        }
    }
    Ok((base, w, r))
}

/// Proves the benchmark moved real bytes: the destination holds what the source held.
fn check_landed(owner: &Engine, dst: &Buffer, g: &Grant, byte: u8, max: u64) -> anyhow::Result<()> {
    owner.revoke(g);
    let ok = dst.view(0, max, |b| b.iter().all(|&x| x == byte))?;
    if !ok {
        bail!("destination bytes differ from the source after the benchmark");
    }
    Ok(())
}

/// The better (higher rate) of a blocking and a busy-polled plain socket: the physical
/// baseline for tcp is the best a plain socket does on this machine, not a handicapped one.
pub fn best_raw(
    s: &mut TcpStream,
    op: u8,
    buf: &mut [u8],
    iters: usize,
    spin: Duration,
    gap: Gap,
) -> anyhow::Result<(&'static str, Samples)> {
    let blocking = time_raw(s, op, buf, iters, Duration::ZERO, gap)?;
    if spin.is_zero() {
        return Ok(("raw-blocking", blocking));
    }
    let polled = time_raw(s, op, buf, iters, spin, gap)?;
    Ok(if polled.gbps() > blocking.gbps() {
        ("raw-polled", polled)
    } else {
        ("raw-blocking", blocking)
    })
}

/// Raw-socket round trips with reused buffers.
fn time_raw(
    s: &mut TcpStream,
    op: u8,
    buf: &mut [u8],
    iters: usize,
    spin: Duration,
    gap: Gap,
) -> anyhow::Result<Samples> {
    let size = buf.len();
    let mut h = [0u8; RAW_HEADER];
    h[0] = if spin.is_zero() {
        op.to_ascii_lowercase()
    } else {
        op
    };
    h[1..].copy_from_slice(&(size as u64).to_le_bytes());
    let mut ack = [0u8; 1];
    let mut samples = Samples::new(size as u64);
    for i in 0..iters + 3 {
        pause(gap);
        let t = Instant::now();
        if op == b'W' {
            // Header and payload in one call where it fits, as the engine does.
            if size <= 64 << 10 {
                let mut one = Vec::with_capacity(RAW_HEADER + size);
                one.extend_from_slice(&h);
                one.extend_from_slice(buf);
                write_all_polled(s, &one)?;
            } else {
                write_all_polled(s, &h)?;
                write_all_polled(s, buf)?;
            }
            read_exact_polled(s, &mut ack, spin)?;
        } else {
            write_all_polled(s, &h)?;
            read_exact_polled(s, buf, spin)?;
        }
        if i >= 3 {
            samples.push(t.elapsed());
        }
    }
    Ok(samples)
}

async fn tcp(o: &Options, max: u64) -> anyhow::Result<Vec<Row>> {
    progress("starting peer processes (engine and raw socket)");
    let batch = o.batch.max(1) as u64;
    // a batch's requests land side by side, each at its own offset
    let room = max
        .checked_mul(batch)
        .context("--batch times the largest size overflows 64 bits")?;
    let engine_peer = PeerProcess::spawn(PeerMode::Engine, room, &o.tcp)?;
    let raw_peer = PeerProcess::spawn(PeerMode::Raw, max, &o.tcp)?;
    let a = Engine::new(
        EngineConfig::for_kind(format!("bench-{}", std::process::id()), TransportKind::Tcp)
            .store(InProcessStore::new())
            .with(o.tcp.clone()),
    )
    .await?;
    let info = a.connect_addr(engine_peer.hello.addr).await?;
    progress(&format!(
        "engine peer over {} ({})",
        info.transport, info.device
    ));
    let (wg, rg) = engine_peer.hello.grants()?;
    let src = a.allocate(room)?;
    src.fill(0, room, |x| x.fill(0x5a))?;
    let landing = a.allocate(room)?;
    let mut raw = TcpStream::connect(raw_peer.hello.addr)?;
    raw.set_nodelay(true)?;
    raw.set_nonblocking(true)?;
    let mut raw_buf = vec![0x5au8; max as usize];
    let mut rows = Vec::new();
    for &size in &o.sizes {
        let iters = iterations(size, o.budget, o.min_iters, o.max_iters);
        progress(&format!("tcp {} x {iters}", human_size(size)));
        let (name, bw) = best_raw(
            &mut raw,
            b'W',
            &mut raw_buf[..size as usize],
            iters,
            o.tcp.busy_poll,
            o.gap,
        )?;
        let offsets = || (0..batch).map(|i| i * size);
        let writes = offsets()
            .map(|o| Request::write(&src, o, &wg, o, size))
            .collect();
        let cpu = || {
            use omnirig_harness::host::process_cpu_ns;
            Some(process_cpu_ns(std::process::id())? + process_cpu_ns(engine_peer.pid())?)
        };
        let (w, used) = time_engine_cpu(&a, writes, iters, o.gap, cpu).await?;
        let mut row = Row::new("write", size, &w, name, &bw);
        if let Some((ns, spent)) = used {
            row.cpu_ns_per_byte = Some(ns as f64 / (iters as u64 * batch * size) as f64);
            row.cpu_cores = Some(ns as f64 / spent.as_nanos().max(1) as f64);
        }
        rows.push(row);
        let (name, br) = best_raw(
            &mut raw,
            b'R',
            &mut raw_buf[..size as usize],
            iters,
            o.tcp.busy_poll,
            o.gap,
        )?;
        let reads = offsets()
            .map(|o| Request::read(&landing, o, &rg, o, size))
            .collect();
        let r = time_engine(&a, reads, iters, o.gap).await?;
        rows.push(Row::new("read", size, &r, name, &br));
    }
    check_peer_pattern(&landing, o, TransportKind::Tcp)?;
    Ok(rows)
}

/// shm: an engine in another process of this host. Its physical floor is one memcpy between
/// page-aligned buffers (the shm data path is exactly one copy), timed interleaved with it.
async fn shm(o: &Options, max: u64) -> anyhow::Result<Vec<Row>> {
    progress("starting the engine peer process (shm)");
    let peer = PeerProcess::spawn(PeerMode::ShmEngine, max, &o.tcp)?;
    let a = Arc::new(
        Engine::new(
            EngineConfig::for_kind(format!("bench-{}", std::process::id()), TransportKind::Shm)
                .store(InProcessStore::new())
                .with(o.tcp.clone()),
        )
        .await?,
    );
    let info = a.connect_addr(peer.hello.addr).await?;
    progress(&format!(
        "engine peer over {} ({})",
        info.transport, info.device
    ));
    let (wg, rg) = peer.hello.grants()?;
    let src = a.allocate(max)?;
    src.fill(0, max, |x| x.fill(0x5a))?;
    let landing = a.allocate(max)?;
    let rows =
        rows_against_memcpy(TransportKind::Shm, o, max, &a, (&src, &wg), (&landing, &rg)).await?;
    check_peer_pattern(&landing, o, TransportKind::Shm)?;
    Ok(rows)
}

/// The targets, checked against this run's ratios (printed, never asserted).
pub fn verdicts(r: &Results) -> Vec<String> {
    let mut out = Vec::new();
    let big: Vec<&Row> = r.rows.iter().filter(|x| x.size >= 1 << 20).collect();
    let kind = r.transport.parse::<TransportKind>().ok();
    if kind == Some(TransportKind::Rdma) {
        return rdma_verdicts(r);
    }
    if kind == Some(TransportKind::Cuda) {
        #[cfg(feature = "cuda")]
        out.extend(super::gpu::verdicts(&r.rows));
        return out;
    }
    if kind == Some(TransportKind::Shm) {
        // No issue sets a figure for shm; say where it stands against its floor.
        if let Some(min) = big.iter().min_by(|a, b| a.ratio.total_cmp(&b.ratio)) {
            out.push(format!(
                "shm vs memcpy at >= 1 MiB (no target): lowest {:.3}x ({} {})",
                min.ratio,
                min.op,
                human_size(min.size)
            ));
        }
        return out;
    }
    if let Some(min) = big.iter().min_by(|a, b| a.ratio.total_cmp(&b.ratio)) {
        let (base, need) = if kind == Some(TransportKind::Tcp) {
            ("raw socket", 0.9)
        } else {
            ("memcpy", 0.9)
        };
        out.push(format!(
            "{} >= {need}x {base} at >= 1 MiB: {} (lowest {:.3}x: {} {})",
            r.transport,
            if min.ratio >= need { "met" } else { "MISSED" },
            min.ratio,
            min.op,
            human_size(min.size)
        ));
    }
    if kind == Some(TransportKind::Tcp)
        && let Some(w4k) = r.rows.iter().find(|x| x.op == "write" && x.size == 4096)
    {
        let lat = w4k.omnirig.p50_us / w4k.baseline.p50_us;
        out.push(format!(
            "tcp 4 KiB write round trip <= 1.3x raw socket: {} ({:.1} us vs {:.1} us p50 = {lat:.3}x)",
            if lat <= 1.3 { "met" } else { "MISSED" },
            w4k.omnirig.p50_us,
            w4k.baseline.p50_us
        ));
    }
    out
}

/// "; <what>" for a row's ratio against the best perftest run, if it has one.
fn against_best(row: &Row, what: impl Fn(&super::Baseline, f64) -> String) -> String {
    row.best
        .as_ref()
        .map_or(String::new(), |(b, x)| format!("; {}", what(b, *x)))
}

/// rdma against perftest (rows carry it as baseline where perftest ran): one line per write
/// row, each `ratio <op> <size>: <x>x <tool> ...`, the lines ci/rdma-bench.sh collects.
fn rdma_verdicts(r: &Results) -> Vec<String> {
    let mut out = Vec::new();
    for row in r.rows.iter().filter(|x| x.op.starts_with("write")) {
        let size = human_size(row.size);
        match row.baseline.name.as_str() {
            "ib_write_bw" => out.push(format!(
                "ratio {} {size}: {:.3}x ib_write_bw ({:.1} vs {:.1} MiB/s, perftest's median; \
                 target >= 0.9 at >= 64 KiB{}){}",
                row.op,
                row.ratio,
                row.omnirig.gbps * 1e9 / 1048576.0,
                row.baseline.gbps * 1e9 / 1048576.0,
                if row.op == "write" {
                    ", one request at a time: latency bound"
                } else {
                    ""
                },
                against_best(row, |b, x| format!(
                    "{x:.3}x against its best run ({:.1} MiB/s)",
                    b.gbps * 1e9 / 1048576.0
                )),
            )),
            "ib_write_lat" => out.push(format!(
                "ratio {} {size}: {:.3}x ib_write_lat round trip (p50 {:.1} us vs {:.1} us, \
                 perftest's median; target <= 1.3){}",
                row.op,
                1.0 / row.ratio,
                row.omnirig.p50_us,
                row.baseline.p50_us,
                against_best(row, |b, x| format!(
                    "{:.3}x against its best run ({:.1} us)",
                    1.0 / x,
                    b.p50_us
                )),
            )),
            _ => {}
        }
    }
    if out.is_empty() {
        out.push(
            "rdma: no perftest baseline in this run (memcpy is for reference only); the \
             targets (>= 0.9x ib_write_bw at >= 64 KiB, 8-byte write <= 1.3x ib_write_lat) \
             need ib_write_bw / ib_write_lat on the same device: ci/rdma-bench.sh"
                .to_string(),
        );
    }
    out
}

#[cfg(all(test, feature = "rdma"))]
mod tests {
    use super::*;
    use crate::bench::perftest::Figures;

    fn figures(bw: f64, lat: f64) -> Figures {
        Figures {
            bw_mib_s: vec![(65536, bw)],
            lat_half_rtt_us: vec![(8, lat)],
        }
    }

    /// perftest's baseline is its median run (of two, their mean), and the best run rides
    /// along: the most bandwidth and the least latency.
    #[test]
    fn perftest_runs_combine_to_their_median_and_their_best() {
        let runs = [
            figures(100.0, 20.0),
            figures(60.0, 30.0),
            figures(130.0, 25.0),
        ];
        let m = Figures::median(&runs);
        assert_eq!((m.bw(65536), m.lat(8)), (Some(100.0), Some(25.0)));
        let b = Figures::best_of(&runs);
        assert_eq!((b.bw(65536), b.lat(8)), (Some(130.0), Some(20.0)));
        let m = Figures::median(&runs[..2]);
        assert_eq!((m.bw(65536), m.lat(8)), (Some(80.0), Some(25.0)));
        assert_eq!(Figures::median(&[]).bw(65536), None);
    }

    /// Each row is the median engine run's row (by bandwidth; by p50 for latency sizes), and
    /// it is then set against perftest's median with the best run beside it.
    #[test]
    fn rows_are_the_median_run_against_the_median_perftest() {
        let row = |op: &str, size: u64, gbps: f64, p50: f64| {
            let mut r = Row::new(op, size, &Samples::new(size), "memcpy", &Samples::new(size));
            r.omnirig.gbps = gbps;
            r.omnirig.p50_us = p50;
            r
        };
        let runs = vec![
            vec![
                row("write", 8, 0.0, 90.0),
                row("write-x16", 65536, 0.08, 0.0),
            ],
            vec![
                row("write", 8, 0.0, 50.0),
                row("write-x16", 65536, 0.12, 0.0),
            ],
            vec![
                row("write", 8, 0.0, 70.0),
                row("write-x16", 65536, 0.10, 0.0),
            ],
        ];
        let mut rows = median_rows(runs).unwrap();
        assert_eq!(rows[0].omnirig.p50_us, 70.0);
        assert_eq!(rows[1].omnirig.gbps, 0.10);
        let pt = [
            figures(100.0, 20.0),
            figures(60.0, 30.0),
            figures(130.0, 25.0),
        ];
        against_perftest(&mut rows, &Figures::median(&pt), &Figures::best_of(&pt));
        // 8 B: twice the median half round trip (50 us) over 70 us.
        assert_eq!(rows[0].baseline.name, "ib_write_lat");
        assert!((rows[0].ratio - 50.0 / 70.0).abs() < 1e-12);
        let (best, x) = rows[0].best.clone().unwrap();
        assert_eq!(best.p50_us, 40.0);
        assert!((x - 40.0 / 70.0).abs() < 1e-12);
        // 64 KiB: 0.10 GB/s over 100 MiB/s, and over 130 MiB/s against the best.
        let mib = 1048576.0 / 1e9;
        assert!((rows[1].ratio - 0.10 / (100.0 * mib)).abs() < 1e-9);
        assert!((rows[1].best.as_ref().unwrap().1 - 0.10 / (130.0 * mib)).abs() < 1e-9);
        // Runs of different shapes are refused, not mixed.
        assert!(median_rows(vec![vec![row("write", 8, 0.0, 1.0)], vec![]]).is_err());
    }
}
