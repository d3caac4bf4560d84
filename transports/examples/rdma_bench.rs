//! The rdma link alone (no engine) timed on one device: a diagnostic beside the engine's own
//! figures (`omnirig bench transfer --transport rdma`, which `ci/rdma-bench.sh` runs with
//! perftest), to tell what the engine adds from what the link costs.
//!
//!   rdma_bench [SECONDS]      bandwidth per size for SECONDS (default 3), then 8-byte latency
//!
//! Bandwidth: back-to-back slices through `Link::execute` (one-sided WRITE into a write grant),
//! work requests of the size measured, 128 in flight like ib_write_bw's default tx depth.
//! Latency: one 8-byte slice at a time through `Link::execute` (post, completion, wake), and the
//! same through the verbs layer alone; medians. MiB/s (2^20) like perftest's MB/sec.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use omnirig_transports::grant::{Access, GrantSpec, GrantTable};
use omnirig_transports::memory::Region;
use omnirig_transports::segment::SegmentDescriptor;
use omnirig_transports::transport::rdma::link::{
    Admit, RdmaConfig, RdmaNode, RdmaServer, RdmaTransport,
};
use omnirig_transports::transport::rdma::verbs::RemoteOp;
use omnirig_transports::transport::{OpKind, SliceOp, Transport};
use omnirig_transports::{Error, ErrorKind};

fn main() {
    if let Err(e) = bench() {
        eprintln!("rdma_bench: {e}");
        std::process::exit(1);
    }
}

fn bench() -> Result<(), Box<dyn std::error::Error>> {
    let seconds: f64 = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(3.0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    const BUF: usize = 64 << 20;
    let dst = Arc::new(Region::allocate(BUF, false)?);
    let table = Arc::new(Mutex::new(GrantTable::default()));
    let regions = Arc::new(HashMap::from([(1u32, dst.clone())]));
    let (t, r) = (table.clone(), regions.clone());
    let admit: Admit = Arc::new(move |access, wire| {
        let a = t.lock().unwrap().admit(access, wire, 0, 1)?;
        let region = r
            .get(&wire.buffer)
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::UnknownBuffer, "no buffer"))?;
        Ok((region, a.entry.grant.clone()))
    });
    let target = RdmaNode::open(RdmaConfig::default())?;
    let server = RdmaServer::start(target.clone(), admit)?;
    let grant = table.lock().unwrap().issue(
        "target",
        GrantSpec {
            buffer: 1,
            buffer_len: BUF as u64,
            offset: 0,
            len: BUF as u64,
            access: Access::Write,
            expires: None,
            token: 42,
            lease: false,
        },
    )?;
    // the grant hook's key travels with the grant (SliceOp::key)
    let key: Option<Arc<[u8]>> = target.on_grant(&grant, &dst)?.map(Arc::from);
    let desc = SegmentDescriptor::new("target", 1, vec![], vec![]);
    let src = Arc::new(Region::allocate(8 << 20, false)?);
    src.write(
        0,
        &(0..8 << 20)
            .map(|i: usize| (i % 251) as u8)
            .collect::<Vec<_>>(),
    )?;

    // completion waits: spin then park (the default), park at once, busy-poll
    let spins = [
        ("spin 50 us then park", Duration::from_micros(50)),
        ("park at once", Duration::ZERO),
        ("busy-poll", Duration::from_secs(1)),
    ];
    for size in [65536u32, 1 << 20] {
        for (how, spin) in spins {
            let node = RdmaNode::open(RdmaConfig {
                work_request_size: size,
                max_outstanding: 128,
                slice_size: 8 << 20,
                completion_spin: spin,
                ..RdmaConfig::default()
            })?;
            let tr = RdmaTransport::new(node);
            tr.add_peer("target", server.addr());
            let link = rt.block_on(tr.connect(desc.clone()))?;
            let op = |i: u64| SliceOp {
                kind: OpKind::Write,
                local: src.clone(),
                local_offset: 0,
                grant: grant.wire(),
                key: key.clone(),
                grant_offset: (i * (8 << 20)) % BUF as u64,
                len: 8 << 20,
                tag: 1,
                request_offset: 0,
                request_len: 8 << 20,
                alone: true,
            };
            rt.block_on(link.execute(op(0)))?; // warm up: connection, registration
            let cpu0 = cpu_seconds();
            let (mut bytes, mut i, t0) = (0u64, 0u64, Instant::now());
            while t0.elapsed().as_secs_f64() < seconds {
                rt.block_on(link.execute(op(i)))?;
                bytes += 8 << 20;
                i += 1;
            }
            let el = t0.elapsed().as_secs_f64();
            let cpu = cpu_seconds() - cpu0;
            println!(
                "omnirig rdma WRITE {size} B: {:.2} MiB/s ({bytes} bytes in {el:.2} s, {how}; process CPU {:.0}% of one core, rxe kernel work included)",
                bytes as f64 / el / 1048576.0,
                cpu / el * 100.0
            );
        }
    }

    let mut node = None;
    for (how, spin) in spins {
        let n = RdmaNode::open(RdmaConfig {
            completion_spin: spin,
            ..RdmaConfig::default()
        })?;
        let tr = RdmaTransport::new(n.clone());
        tr.add_peer("target", server.addr());
        let link = rt.block_on(tr.connect(desc.clone()))?;
        let op = SliceOp {
            kind: OpKind::Write,
            local: src.clone(),
            local_offset: 0,
            grant: grant.wire(),
            key: key.clone(),
            grant_offset: 0,
            len: 8,
            tag: 1,
            request_offset: 0,
            request_len: 8,
            alone: true,
        };
        rt.block_on(link.execute(op.clone()))?;
        let mut lat = Vec::new();
        for _ in 0..2000 {
            let t = Instant::now();
            rt.block_on(link.execute(op.clone()))?;
            lat.push(t.elapsed());
        }
        println!(
            "omnirig rdma WRITE 8 B via Link::execute ({how}): median {:.2} us, p99 {:.2} us (2000 iterations, completion = acknowledged)",
            pct(&mut lat, 50),
            pct(&mut lat, 99)
        );
        node = Some(n);
    }
    let node = node.expect("one node");

    // the verbs layer alone: one queue pair pair, 8-byte WRITE, spin-then-park completion
    let qp = omnirig_transports::transport::rdma::verbs::QueuePair::create_with_spin(
        node.device(),
        1,
        16,
        Duration::from_secs(1),
    )?;
    let peer =
        omnirig_transports::transport::rdma::verbs::QueuePair::create(target.device(), 1, 16)?;
    let gi = node.gid_index();
    qp.connect(&peer.endpoint(gi)?, gi)?;
    peer.connect(&qp.endpoint(gi)?, gi)?;
    let key = target.grant_key(&grant, &dst)?;
    let mr = node.local_registration(&src)?;
    let ops = [RemoteOp {
        write: true,
        local: mr.clone(),
        local_offset: 0,
        len: 8,
        remote_addr: key.addr,
        rkey: key.rkey,
    }];
    let mut lat = Vec::new();
    for _ in 0..2000 {
        let t = Instant::now();
        qp.run(&ops, Instant::now() + Duration::from_secs(5))?;
        lat.push(t.elapsed());
    }
    println!(
        "omnirig rdma WRITE 8 B via verbs QueuePair::run (busy-poll): median {:.2} us, p99 {:.2} us",
        pct(&mut lat, 50),
        pct(&mut lat, 99)
    );
    Ok(())
}

/// User + system CPU time of this process so far (from /proc/self/stat, in USER_HZ = 100 ticks).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // fields after the ")" that ends the command name: state is field 3, utime 14, stime 15
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        f.get(i - 3)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(14) + ticks(15)) / 100.0
}

fn pct(v: &mut [Duration], p: usize) -> f64 {
    v.sort();
    v[(v.len() * p / 100).min(v.len() - 1)].as_secs_f64() * 1e6
}
