//! `omnirig bench transfer --transport cuda` (cargo feature `cuda`, a machine with a GPU):
//! the cuda transport and GPU staging against CUDA copies measured in the same run,
//! interleaved round by round so drift hits both sides alike.
//!
//! | op            | omnirig                                            | baseline                     |
//! |---------------|----------------------------------------------------|------------------------------|
//! | write/read d2d| cuda transport, device buffer -> device grant      | cuMemcpy device -> device    |
//! | write d2h     | cuda transport, device buffer -> pinned host grant | pinned cuMemcpy device->host |
//! | write h2d     | cuda transport, pinned buffer -> device grant      | pinned cuMemcpy host->device |
//! | staged write/read | tcp over device memory on both sides (GPU -> pinned -> tcp -> pinned -> GPU) | tcp over host memory, same engines' config |
//!
//! With two GPUs the d2d rows put the destination on GPU 1 (a peer copy, against a plain
//! device-to-device copy between the two); with one, both sides are on GPU 0.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use omnirig_transports::transport::cuda::driver::{Gpu, device_count};
use omnirig_transports::{
    Access, Buffer, CudaConfig, CudaMemory, Engine, EngineConfig, InProcessStore, Request,
    TransportKind,
};

use super::transfer::Options;
use super::{Row, Samples, human_size, iterations};

const OP_TIMEOUT: Option<Duration> = Some(Duration::from_secs(120));

fn progress(msg: &str) {
    eprintln!("[bench transfer cuda] {msg}");
}

/// One measured pair per round: `base` then `ours`, after three warm-up rounds.
async fn interleaved<B, O, F>(
    iters: usize,
    size: u64,
    mut base: B,
    mut ours: O,
) -> anyhow::Result<(Samples, Samples)>
where
    B: FnMut() -> anyhow::Result<()>,
    O: FnMut() -> F,
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    let (mut b, mut o) = (Samples::new(size), Samples::new(size));
    for i in 0..iters + 3 {
        let t = Instant::now();
        base()?;
        let tb = t.elapsed();
        let t = Instant::now();
        ours().await?;
        let to = t.elapsed();
        if i >= 3 {
            b.push(tb);
            o.push(to);
        }
    }
    Ok((b, o))
}

/// One measured pair per round of two engine transfers, `base` then `ours`, after two warm-up
/// rounds.
async fn interleaved_transfers(
    iters: usize,
    size: u64,
    base: (&Engine, &Request),
    ours: (&Engine, &Request),
) -> anyhow::Result<(Samples, Samples)> {
    let (mut b, mut o) = (Samples::new(size), Samples::new(size));
    for i in 0..iters + 2 {
        let t = Instant::now();
        base.0.transfer(vec![base.1.clone()], OP_TIMEOUT).await?;
        let tb = t.elapsed();
        let t = Instant::now();
        ours.0.transfer(vec![ours.1.clone()], OP_TIMEOUT).await?;
        let to = t.elapsed();
        if i >= 2 {
            b.push(tb);
            o.push(to);
        }
    }
    Ok((b, o))
}

fn gpu_engine_config(
    name: &str,
    kind: TransportKind,
    device: u32,
    store: &std::sync::Arc<InProcessStore>,
    memory: CudaMemory,
) -> EngineConfig {
    EngineConfig::for_kind(name, kind)
        .store(store.clone())
        .with(CudaConfig {
            device,
            memory,
            slice_size: env_or("OMNIRIG_CUDA_SLICE_SIZE", CudaConfig::default().slice_size),
            streams: env_or("OMNIRIG_CUDA_STREAMS", CudaConfig::default().streams as u64) as usize,
            server_spin: std::time::Duration::from_micros(env_or(
                "OMNIRIG_CUDA_SERVER_SPIN_US",
                CudaConfig::default().server_spin.as_micros() as u64,
            )),
            ..CudaConfig::default()
        })
        .policy(omnirig_transports::TransportPolicy::Only(kind))
}

/// A cuda transport setting for the benchmark from the environment (bytes or a count), else
/// the transport's default: slice size and streams trade per-slice overhead against overlap.
fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| super::parse_sizes(&v).ok())
        .and_then(|v| v.first().copied())
        .unwrap_or(default)
}

/// Checks the destination holds `byte` over `len`, reading it back once.
fn check(buf: &Buffer, len: u64, byte: u8, what: &str) -> anyhow::Result<()> {
    let mut out = vec![0u8; len as usize];
    buf.read(0, &mut out)?;
    if !out.iter().all(|&b| b == byte) {
        bail!("{what}: destination bytes differ from the source after the benchmark");
    }
    Ok(())
}

/// The rows on a multi-threaded runtime: the one `omnirig run` and the stages use, so
/// the benchmark measures the slice path the product runs.
pub fn run(o: &Options, max: u64) -> anyhow::Result<Vec<Row>> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(rows(o, max))
}

pub async fn rows(o: &Options, max: u64) -> anyhow::Result<Vec<Row>> {
    let gpus = device_count().context("bench transfer --transport cuda needs a GPU")?;
    if gpus == 0 {
        bail!("bench transfer --transport cuda: the driver reports no CUDA device");
    }
    let g0 = Gpu::open(0)?;
    let peer = if gpus >= 2 { 1 } else { 0 };
    let g1 = Gpu::open(peer)?;
    if peer != 0 {
        g0.enable_peer(&g1)?;
        g1.enable_peer(&g0)?;
    }
    progress(&format!(
        "cuda slices {} x {} in flight, owner polls {} us",
        human_size(env_or(
            "OMNIRIG_CUDA_SLICE_SIZE",
            CudaConfig::default().slice_size
        )),
        env_or("OMNIRIG_CUDA_STREAMS", CudaConfig::default().streams as u64),
        env_or(
            "OMNIRIG_CUDA_SERVER_SPIN_US",
            CudaConfig::default().server_spin.as_micros() as u64
        )
    ));
    progress(&format!(
        "{} -> {} ({})",
        g0.name(),
        if peer == 0 { "the same GPU" } else { "GPU 1" },
        if peer == 0 {
            "one GPU: d2d rows are copies within it"
        } else {
            "peer copies"
        }
    ));
    let store = InProcessStore::new();
    let a = Engine::new(gpu_engine_config(
        "bench-cuda-a",
        TransportKind::Cuda,
        0,
        &store,
        CudaMemory::Device,
    ))
    .await?;
    let b = Engine::new(gpu_engine_config(
        "bench-cuda-b",
        TransportKind::Cuda,
        peer,
        &store,
        CudaMemory::Device,
    ))
    .await?;

    // Engine buffers: device on both sides, pinned ones registered next to them.
    let dsrc = a.allocate(max)?;
    dsrc.write(0, &vec![0x5a; max as usize])?;
    let ddst = b.allocate(max)?;
    let psrc = a.register(g0.allocate_pinned(max as usize)?)?;
    psrc.write(0, &vec![0x3c; max as usize])?;
    let pdst = b.register(g1.allocate_pinned(max as usize)?)?;
    let dback = a.allocate(max)?;
    // Baseline buffers, outside any engine.
    let bd0 = g0.allocate(max as usize)?;
    let bd1 = g1.allocate(max as usize)?;
    let bp = g0.allocate_pinned(max as usize)?;

    let mut rows = Vec::new();
    for &size in &o.sizes {
        let iters = iterations(size, o.budget, o.min_iters, o.max_iters);
        progress(&format!("{} x {iters}", human_size(size)));
        let d2d = if peer == 0 {
            "cuMemcpy D2D"
        } else {
            "cuMemcpy D2D peer"
        };

        let wg = b.grant(&ddst, 0, size, Access::Write)?;
        let req = Request::write(&dsrc, 0, &wg, 0, size);
        let (base, w) = interleaved(
            iters,
            size,
            || Ok(bd0.copy_to(0, &bd1, 0, size)?),
            || async {
                a.transfer(vec![req.clone()], OP_TIMEOUT).await?;
                Ok(())
            },
        )
        .await?;
        rows.push(Row::new("write d2d", size, &w, d2d, &base));
        b.revoke(&wg);

        let rg = b.grant(&ddst, 0, size, Access::Read)?;
        let req = Request::read(&dback, 0, &rg, 0, size);
        let (base, r) = interleaved(
            iters,
            size,
            || Ok(bd1.copy_to(0, &bd0, 0, size)?),
            || async {
                a.transfer(vec![req.clone()], OP_TIMEOUT).await?;
                Ok(())
            },
        )
        .await?;
        rows.push(Row::new("read d2d", size, &r, d2d, &base));
        b.revoke(&rg);

        let wg = b.grant(&pdst, 0, size, Access::Write)?;
        let req = Request::write(&dsrc, 0, &wg, 0, size);
        let (base, w) = interleaved(
            iters,
            size,
            || Ok(bd0.copy_to(0, &bp, 0, size)?),
            || async {
                a.transfer(vec![req.clone()], OP_TIMEOUT).await?;
                Ok(())
            },
        )
        .await?;
        rows.push(Row::new(
            "write d2h",
            size,
            &w,
            "pinned cuMemcpy D2H",
            &base,
        ));
        b.revoke(&wg);

        let wg = b.grant(&ddst, 0, size, Access::Write)?;
        let req = Request::write(&psrc, 0, &wg, 0, size);
        let (base, w) = interleaved(
            iters,
            size,
            || Ok(bp.copy_to(0, &bd0, 0, size)?),
            || async {
                a.transfer(vec![req.clone()], OP_TIMEOUT).await?;
                Ok(())
            },
        )
        .await?;
        rows.push(Row::new(
            "write h2d",
            size,
            &w,
            "pinned cuMemcpy H2D",
            &base,
        ));
        b.revoke(&wg);
    }
    check(&ddst, max, 0x3c, "write h2d")?;
    check(&pdst, max, 0x5a, "write d2h")?;
    check(&dback, max, 0x5a, "read d2d")?;
    drop((bd0, bd1, bp));

    rows.extend(staged_tcp(o, max).await?);
    Ok(rows)
}

/// tcp with device memory on both sides (staged through pinned buffers) against tcp with
/// host memory, same config, interleaved: what staging costs on top of the transport.
async fn staged_tcp(o: &Options, max: u64) -> anyhow::Result<Vec<Row>> {
    let store = InProcessStore::new();
    let engine = |n: &str, m: CudaMemory| {
        Engine::new(gpu_engine_config(n, TransportKind::Tcp, 0, &store, m).with(o.tcp.clone()))
    };
    let (ga, gb) = (
        engine("bench-staged-a", CudaMemory::Device).await?,
        engine("bench-staged-b", CudaMemory::Device).await?,
    );
    let (ha, hb) = (
        engine("bench-host-a", CudaMemory::Host).await?,
        engine("bench-host-b", CudaMemory::Host).await?,
    );
    let gsrc = ga.allocate(max)?;
    gsrc.write(0, &vec![0x77; max as usize])?;
    let gdst = gb.allocate(max)?;
    let gback = ga.allocate(max)?;
    let hsrc = ha.allocate(max)?;
    let hdst = hb.allocate(max)?;
    let mut rows = Vec::new();
    for &size in &o.sizes {
        let iters = iterations(size, o.budget, o.min_iters, o.max_iters).min(50);
        progress(&format!("staged tcp {} x {iters}", human_size(size)));
        let gw = gb.grant(&gdst, 0, size, Access::Write)?;
        let hw = hb.grant(&hdst, 0, size, Access::Write)?;
        let (greq, hreq) = (
            Request::write(&gsrc, 0, &gw, 0, size),
            Request::write(&hsrc, 0, &hw, 0, size),
        );
        let (base, ours) = interleaved_transfers(iters, size, (&ha, &hreq), (&ga, &greq)).await?;
        rows.push(Row::new(
            "staged write",
            size,
            &ours,
            "tcp host memory",
            &base,
        ));
        gb.revoke(&gw);
        hb.revoke(&hw);
        let gr = gb.grant(&gdst, 0, size, Access::Read)?;
        let hr = hb.grant(&hdst, 0, size, Access::Read)?;
        let (greq, hreq) = (
            Request::read(&gback, 0, &gr, 0, size),
            Request::read(&hsrc, 0, &hr, 0, size),
        );
        let (base, ours) = interleaved_transfers(iters, size, (&ha, &hreq), (&ga, &greq)).await?;
        rows.push(Row::new(
            "staged read",
            size,
            &ours,
            "tcp host memory",
            &base,
        ));
        gb.revoke(&gr);
        hb.revoke(&hr);
    }
    check(&gdst, max, 0x77, "staged write")?;
    check(&gback, max, 0x77, "staged read")?;
    Ok(rows)
}

/// The verdict lines: each row family against its target at >= 16 MiB.
pub fn verdicts(rows: &[Row]) -> Vec<String> {
    let mut out = Vec::new();
    for op in [
        "write d2d",
        "read d2d",
        "write d2h",
        "write h2d",
        "staged write",
        "staged read",
    ] {
        let big: Vec<&Row> = rows
            .iter()
            .filter(|r| r.op == op && r.size >= 16 << 20)
            .collect();
        if let Some(min) = big.iter().min_by(|a, b| a.ratio.total_cmp(&b.ratio)) {
            out.push(format!(
                "cuda {op} >= 0.9x {} at >= 16 MiB: {} (lowest {:.3}x at {})",
                min.baseline.name,
                if min.ratio >= 0.9 { "met" } else { "MISSED" },
                min.ratio,
                human_size(min.size)
            ));
        }
    }
    out
}
