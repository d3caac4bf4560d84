//! GPU memory, staging and the cuda transport (cargo feature `cuda`), on a machine with a GPU.
//!
//! Every case first asks for a GPU: without a driver or device it prints SKIPPED (past
//! libtest's capture) and returns, which is not a pass that means anything;
//! `OMNIRIG_CUDA_REQUIRED=1` (the GPU lane, docs/gpu.md) makes that a failure instead.
//!
//! The engine's transfer cases run over device memory on every transport that can carry it:
//! loopback (device copies), tcp (staged through pinned buffers on both sides) and cuda (the
//! owner's device copy; across processes through CUDA IPC).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{CANARY, pattern, unique};
use omnirig_transports::memory::DeviceMemory;
use omnirig_transports::transport::cuda::driver::{Gpu, device_count};
use omnirig_transports::{
    Access, CudaConfig, CudaMemory, Engine, EngineConfig, ErrorKind, Grant, InProcessStore,
    LoopbackConfig, Request, TcpConfig, TransportKind, TransportPolicy,
};
use rstest::rstest;

const T: Option<Duration> = Some(Duration::from_secs(60));

/// The GPU to test on, or `None` after saying SKIPPED (a failure with OMNIRIG_CUDA_REQUIRED=1).
fn gpu() -> Option<Arc<Gpu>> {
    let why = match device_count() {
        Ok(n) if n > 0 => return Some(Gpu::open(0).expect("device 0 opens")),
        Ok(_) => "the driver reports no CUDA device".to_string(),
        Err(e) => e.to_string(),
    };
    assert!(
        std::env::var("OMNIRIG_CUDA_REQUIRED").as_deref() != Ok("1"),
        "OMNIRIG_CUDA_REQUIRED=1 but {why}"
    );
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED a GPU case: {why}. Run the test binary on a machine with a GPU (docs/gpu.md)"
    );
    None
}

/// An engine whose buffers live in `memory` on GPU 0 and that reaches peers over `transport`
/// only ("loopback", "tcp" or "cuda").
fn gpu_config(
    name: &str,
    transport: &str,
    memory: CudaMemory,
    store: &Arc<InProcessStore>,
) -> EngineConfig {
    let kind: TransportKind = transport.parse().unwrap();
    let cuda = CudaConfig {
        memory,
        slice_size: 1 << 20,
        ..CudaConfig::default()
    };
    let c = EngineConfig::for_kind(name, kind).store(store.clone());
    let c = match kind {
        TransportKind::Loopback => c.with(LoopbackConfig {
            slice_size: 1 << 20,
        }),
        TransportKind::Tcp => c.with(TcpConfig {
            slice_size: 512 << 10,
            streams: 4,
            ..TcpConfig::default()
        }),
        _ => c,
    };
    // The cuda transport provides the memory; the policy keeps the data on `transport`.
    c.with(cuda).policy(TransportPolicy::Only(kind))
}

async fn gpu_engines(transport: &str, memory: CudaMemory) -> (Engine, Engine) {
    let store = InProcessStore::new();
    let a = Engine::new(gpu_config(&unique("ga"), transport, memory, &store))
        .await
        .unwrap();
    let b = Engine::new(gpu_config(&unique("gb"), transport, memory, &store))
        .await
        .unwrap();
    (a, b)
}

async fn assert_idle(gpu: &Gpu, e: &Engine) {
    let u = e.wait_idle(Duration::from_secs(10)).await.unwrap();
    assert_eq!(u.grants, 0, "{u:?}");
    assert_eq!((u.leases, u.tasks, u.batches), (0, 0, 0), "{u:?}");
    // A canceled slice's server side lets go of its buffer once its connection closes.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    for outbound in [true, false] {
        let pool = gpu.staging_pool(outbound);
        while pool.outstanding() != 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            pool.outstanding(),
            0,
            "staging buffers not returned: {pool:?}"
        );
    }
}

#[test]
fn device_and_pinned_regions_are_written_read_and_copied_bit_exact() {
    let Some(gpu) = gpu() else { return };
    let n = (3 << 20) + 17;
    let data = pattern(1, n);
    let dev = gpu.allocate(n).unwrap();
    assert!(dev.is_device());
    assert_eq!(dev.addr() % 4096, 0);
    let mut zero = vec![1u8; n];
    dev.read(0, &mut zero).unwrap();
    assert!(zero.iter().all(|&b| b == 0), "device memory starts zeroed");
    dev.write(0, &data).unwrap();
    let pinned = gpu.allocate_pinned(n).unwrap();
    assert!(!pinned.is_device());
    let host = omnirig_transports::memory::Region::allocate(n, false).unwrap();
    // device -> pinned -> device -> host, at odd offsets.
    dev.copy_to(0, &pinned, 0, n as u64).unwrap();
    let dev2 = gpu.allocate(n + 4096).unwrap();
    pinned.copy_to(5, &dev2, 4099, (n - 5) as u64).unwrap();
    dev2.copy_to(4099, &host, 0, (n - 5) as u64).unwrap();
    let mut out = vec![0u8; n - 5];
    host.read(0, &mut out).unwrap();
    assert!(
        out == data[5..],
        "bytes differ after device/pinned/host copies"
    );
    // Overlapping copy inside one device region.
    dev.copy_to(0, &dev, 1, 4096).unwrap();
    let mut o = vec![0u8; 4097];
    dev.read(0, &mut o).unwrap();
    assert_eq!(o[1..], data[..4096]);
    // Bounds and host-only accesses fail with errors that say why.
    assert_eq!(
        dev.write(n as u64 - 1, &[1, 2]).unwrap_err().kind(),
        ErrorKind::OutOfBuffer
    );
    let e = dev.with_slice(0, 1, |_| ()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Resource);
    assert!(e.to_string().contains("GPU memory"), "{e}");
    assert!(dev.range_ptr(0, 1).is_err());
    assert!(gpu.describe().starts_with("cuda:0"), "{}", gpu.describe());
}

#[rstest]
#[case::one_byte(1)]
#[case::page(4096)]
#[case::mib_plus_3((1 << 20) + 3)]
#[case::mib_64(64 << 20)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_over_gpu_memory_are_bit_exact(
    #[values("loopback", "tcp", "cuda")] transport: &'static str,
    #[values(CudaMemory::Device, CudaMemory::Pinned)] memory: CudaMemory,
    #[case] size: usize,
) {
    let Some(gpu) = gpu() else { return };
    let (a, b) = gpu_engines(transport, memory).await;
    let data = pattern(size as u64, size);
    let pad = 8192;
    let src = a.allocate((size + pad) as u64).unwrap();
    assert_eq!(src.region().is_device(), memory == CudaMemory::Device);
    src.write(5, &data).unwrap();
    let dst = b.allocate((size + pad) as u64).unwrap();
    dst.write(0, &vec![CANARY; size + pad]).unwrap();

    let g = b.grant(&dst, 4096, size as u64, Access::Write).unwrap();
    a.transfer(vec![Request::write(&src, 5, &g, 0, size as u64)], T)
        .await
        .unwrap();
    assert!(b.revoke(&g));
    let mut got = vec![0u8; size + pad];
    dst.read(0, &mut got).unwrap();
    assert!(got[4096..4096 + size] == data[..], "written bytes differ");
    assert!(
        got[..4096]
            .iter()
            .chain(&got[4096 + size..])
            .all(|&x| x == CANARY),
        "bytes outside the grant changed"
    );

    let g = b.grant(&dst, 4096, size as u64, Access::Read).unwrap();
    let back = a.allocate((size + pad) as u64).unwrap();
    a.transfer(vec![Request::read(&back, 3, &g, 0, size as u64)], T)
        .await
        .unwrap();
    b.revoke(&g);
    let mut round = vec![0u8; size];
    back.read(3, &mut round).unwrap();
    assert!(round == data, "read bytes differ");
    assert_idle(&gpu, &a).await;
    assert_idle(&gpu, &b).await;
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_grant_on_gpu_memory_refuses_writes_and_the_canary_survives(
    #[values("loopback", "tcp", "cuda")] transport: &'static str,
) {
    let Some(gpu) = gpu() else { return };
    let (a, b) = gpu_engines(transport, CudaMemory::Device).await;
    let n = 3 << 20;
    let src = a.allocate(n).unwrap();
    src.write(0, &pattern(7, n as usize)).unwrap();
    let dst = b.allocate(n).unwrap();
    dst.write(0, &vec![CANARY; n as usize]).unwrap();
    let g = b.grant(&dst, 0, n, Access::Write).unwrap();
    assert!(b.revoke(&g));
    let e = a
        .transfer(vec![Request::write(&src, 0, &g, 0, n)], T)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::GrantRevoked, "{e}");
    // Out of the grant, and a read under a write grant: refused, naming the request.
    let g = b.grant(&dst, 0, 4096, Access::Write).unwrap();
    let e = a
        .transfer(vec![Request::write(&src, 0, &g, 1, 4096)], T)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfGrant, "{e}");
    let e = a
        .transfer(vec![Request::read(&src, 0, &g, 0, 4096)], T)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AccessDenied, "{e}");
    b.revoke(&g);
    let mut got = vec![0u8; n as usize];
    dst.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == CANARY), "a refused write landed");
    assert_idle(&gpu, &a).await;
    assert_idle(&gpu, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_tcp_transfers_share_the_bounded_staging_pool() {
    let Some(gpu) = gpu() else { return };
    let (a, b) = gpu_engines("tcp", CudaMemory::Device).await;
    let n = 8 << 20;
    let mut jobs = Vec::new();
    let mut checks = Vec::new();
    for i in 0..8u64 {
        let src = a.allocate(n).unwrap();
        let data = pattern(100 + i, n as usize);
        src.write(0, &data).unwrap();
        let dst = b.allocate(n).unwrap();
        let g = b.grant(&dst, 0, n, Access::Write).unwrap();
        jobs.push(a.transfer(vec![Request::write(&src, 0, &g, 0, n)], T));
        checks.push((src, dst, g, data));
    }
    for r in futures_util::future::join_all(jobs).await {
        r.unwrap();
    }
    for outbound in [true, false] {
        let pool = gpu.staging_pool(outbound);
        assert!(pool.allocated() > 0, "tcp did not stage: {pool:?}");
        assert!(pool.allocated() <= pool.slots(), "{pool:?}");
    }
    for (_src, dst, g, data) in checks {
        b.revoke(&g);
        let mut got = vec![0u8; n as usize];
        dst.read(0, &mut got).unwrap();
        assert!(got == data, "bytes differ");
    }
    assert_idle(&gpu, &a).await;
    assert_idle(&gpu, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_transfer_that_times_out_returns_its_staging_buffers() {
    let Some(gpu) = gpu() else { return };
    let (a, b) = gpu_engines("tcp", CudaMemory::Device).await;
    let n = 256 << 20;
    let src = a.allocate(n).unwrap();
    let dst = b.allocate(n).unwrap();
    let g = b.grant(&dst, 0, n, Access::Write).unwrap();
    let e = a
        .transfer(
            vec![Request::write(&src, 0, &g, 0, n)],
            Some(Duration::from_millis(5)),
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    b.revoke(&g);
    assert_idle(&gpu, &a).await;
    assert_idle(&gpu, &b).await;
}

// ------------------------------------------------------------- across processes (CUDA IPC)

const CHILD: &str = "OMNIRIG_CUDA_CHILD";

/// The grant owner in another process: allocates device memory, grants it, prints its tcp
/// address and the grant, then on "revoke" revokes and prints the bytes' digest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipc_child() {
    let Ok(n) = std::env::var(CHILD) else { return };
    let n: u64 = n.parse().unwrap();
    eprintln!("[ipc child] start");
    let e = Engine::new(
        EngineConfig::for_kind(unique("owner"), TransportKind::Cuda).with(CudaConfig {
            memory: CudaMemory::Device,
            ..CudaConfig::default()
        }),
    )
    .await
    .unwrap();
    eprintln!("[ipc child] engine up");
    let dst = e.allocate(n + 8192).unwrap();
    dst.write(0, &vec![CANARY; (n + 8192) as usize]).unwrap();
    let g = e.grant(&dst, 4096, n, Access::Write).unwrap();
    println!(
        "READY {} {}",
        e.tcp_addr().unwrap(),
        serde_json::to_string(&g).unwrap()
    );
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert!(e.revoke(&g));
    let mut got = vec![0u8; (n + 8192) as usize];
    dst.read(0, &mut got).unwrap();
    let inside = got[4096..4096 + n as usize] == pattern(n, n as usize)[..];
    let outside = got[..4096]
        .iter()
        .chain(&got[4096 + n as usize..])
        .all(|&x| x == CANARY);
    println!("DONE inside={inside} outside={outside}");
    // The initiator now tries a late write under the revoked grant; nothing may change.
    line.clear();
    std::io::stdin().read_line(&mut line).unwrap();
    let mut again = vec![0u8; (n + 8192) as usize];
    dst.read(0, &mut again).unwrap();
    println!("AFTER unchanged={}", again == got);
}

/// The child's stdout, line by line, with a deadline per line; the child is killed on drop,
/// so a stuck child fails the test instead of hanging it.
struct ChildLines {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl ChildLines {
    fn next_with(&self, prefix: &str) -> String {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(60)) {
                // libtest prints the child's test name without a newline before its output.
                Ok(l) => {
                    if let Some((_, rest)) = l.split_once(prefix) {
                        return rest.trim().to_string();
                    }
                }
                Err(e) => panic!("the child printed no {prefix:?} line: {e}"),
            }
        }
    }
}

impl Drop for ChildLines {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn step(what: &str) {
    let _ = writeln!(std::io::stderr(), "[ipc parent] {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_transport_writes_into_another_processs_gpu_memory_and_revoke_fences_it() {
    let Some(gpu) = gpu() else { return };
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let n: u64 = (32 << 20) + 3;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "ipc_child", "--nocapture", "--test-threads=1"])
        .env(CHILD, n.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let mut stdin = child.stdin.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in out.lines().map_while(|l| l.ok()) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let child = ChildLines { child, lines: rx };
    let ready = child.next_with("READY ");
    step("child ready");
    let (addr, grant) = ready.split_once(' ').unwrap();
    let g: Grant = serde_json::from_str(grant).unwrap();
    let a = Engine::new(
        EngineConfig::for_kind(unique("initiator"), TransportKind::Cuda).with(CudaConfig {
            memory: CudaMemory::Device,
            ..CudaConfig::default()
        }),
    )
    .await
    .unwrap();
    let info = a.connect_addr(addr.parse().unwrap()).await.unwrap();
    step(&format!("connected: {info:?}"));
    assert_eq!(info.transport, TransportKind::Cuda);
    assert!(info.device.contains("CUDA IPC"), "{info:?}");
    let src = a.allocate(n + 4096).unwrap();
    src.write(100, &pattern(n, n as usize)).unwrap();
    a.transfer(
        vec![Request::write(&src, 100, &g, 0, n)],
        Some(Duration::from_secs(20)),
    )
    .await
    .unwrap();
    step("written");
    writeln!(stdin, "revoke").unwrap();
    assert_eq!(child.next_with("DONE "), "inside=true outside=true");
    // The owner revoked: a late write is refused and nothing lands.
    src.write(100, &pattern(n + 1, n as usize)).unwrap();
    let e = a
        .transfer(
            vec![Request::write(&src, 100, &g, 0, n)],
            Some(Duration::from_secs(20)),
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::GrantRevoked, "{e}");
    step("late write refused");
    writeln!(stdin, "check").unwrap();
    assert_eq!(child.next_with("AFTER "), "unchanged=true");
    assert_idle(&gpu, &a).await;
}

#[test]
fn device_memory_exports_as_a_dmabuf_for_gpudirect_rdma() {
    use omnirig_transports::transport::cuda::gpudirect::{
        Capabilities, RegistrationPath, decide, dmabuf_supported, export_dmabuf,
    };
    let Some(gpu) = gpu() else { return };
    let supported = dmabuf_supported(&gpu).unwrap();
    let _ = writeln!(
        std::io::stderr(),
        "{}: dma-buf export supported: {supported}",
        gpu.describe()
    );
    // This machine has no HCA: the engine stages, and says why.
    let path = decide(&Capabilities {
        rdma_built: cfg!(feature = "rdma"),
        rdma_device: None,
        gpu_dmabuf: Ok(supported),
    });
    assert!(matches!(path, RegistrationPath::Staged(_)), "{path:?}");
    let dev = gpu.allocate(4 << 20).unwrap();
    if supported {
        let fd = export_dmabuf(&gpu, &dev, 0, 2 << 20).unwrap();
        use std::os::fd::AsRawFd;
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
        assert!(
            link.to_string_lossy().contains("dmabuf"),
            "the exported fd is {link:?}"
        );
    }
    assert_eq!(
        export_dmabuf(&gpu, &dev, 1, 4096).unwrap_err().kind(),
        ErrorKind::InvalidLength
    );
    assert_eq!(
        export_dmabuf(&gpu, &dev, 0, 8 << 20).unwrap_err().kind(),
        ErrorKind::OutOfBuffer
    );
    let host = gpu.allocate_pinned(4096).unwrap();
    assert_eq!(
        export_dmabuf(&gpu, &host, 0, 4096).unwrap_err().kind(),
        ErrorKind::Resource
    );
    // What the rdma transport calls for a grant: any range of a device region, exported as
    // the whole pages around it, with where the range starts in the dma-buf. The region's
    // device answers the capability probe through the trait the transport sees.
    let odd = gpu.allocate((1 << 20) + 3).unwrap();
    let dev = odd.device().unwrap().clone();
    assert_eq!(dev.dmabuf_supported().unwrap(), supported);
    match odd.export_dmabuf(4096 + 100, (1 << 20) - 8192) {
        Ok((fd, at)) => {
            assert!(supported);
            // the range starts 4196 bytes into a page-aligned region: the same within a page
            assert_eq!(at % 4096, 100, "offset {at}");
            use std::os::fd::AsRawFd;
            let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
            assert!(link.to_string_lossy().contains("dmabuf"), "{link:?}");
            // the region's last byte exports too, wherever it sits in what the driver exports
            let (fd, at) = odd.export_dmabuf((1 << 20) + 2, 1).unwrap();
            assert_eq!(at % 4096, ((1 << 20) + 2) % 4096);
            let size = std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .map(|m| m.len())
                .unwrap_or(0);
            let _ = writeln!(
                std::io::stderr(),
                "dma-buf of the last byte: offset {at}, fd size {size}"
            );
        }
        Err(e) => {
            assert!(!supported, "{e}");
            assert!(e.detail().contains("cuMemGetHandleForAddressRange"), "{e}");
        }
    }
    assert_eq!(
        odd.export_dmabuf((1 << 20) + 3, 1).unwrap_err().kind(),
        ErrorKind::OutOfBuffer
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_cuda_request_is_answered_and_closes_only_its_connection() {
    use omnirig_transports::transport::cuda::CudaEndpoint;
    use std::io::Read;
    use std::os::linux::net::SocketAddrExt;
    let Some(gpu) = gpu() else { return };
    let (a, b) = gpu_engines("cuda", CudaMemory::Device).await;
    let ep = CudaEndpoint::of(&b.descriptor()).unwrap().unwrap();
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(ep.socket.as_bytes()).unwrap();
    let mut s = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut junk = [0u8; 128];
    junk[..4].copy_from_slice(b"OMCU");
    junk[4] = 9; // a version nobody speaks
    s.write_all(&junk).unwrap();
    let mut head = [0u8; 16];
    s.read_exact(&mut head).unwrap();
    let status = u16::from_le_bytes([head[8], head[9]]);
    assert_eq!(status, ErrorKind::Malformed.code());
    let mut detail = vec![0u8; u16::from_le_bytes([head[10], head[11]]) as usize];
    s.read_exact(&mut detail).unwrap();
    let detail = String::from_utf8(detail).unwrap();
    assert!(detail.contains("version 9"), "{detail}");
    let mut rest = Vec::new();
    assert_eq!(
        s.read_to_end(&mut rest).unwrap(),
        0,
        "the connection closes"
    );
    // The engine keeps serving everyone else.
    let src = a.allocate(1 << 20).unwrap();
    src.write(0, &pattern(3, 1 << 20)).unwrap();
    let dst = b.allocate(1 << 20).unwrap();
    let g = b.grant(&dst, 0, 1 << 20, Access::Write).unwrap();
    a.transfer(vec![Request::write(&src, 0, &g, 0, 1 << 20)], T)
        .await
        .unwrap();
    b.revoke(&g);
    let mut got = vec![0u8; 1 << 20];
    dst.read(0, &mut got).unwrap();
    assert!(got == pattern(3, 1 << 20));
    assert_idle(&gpu, &a).await;
    assert_idle(&gpu, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_shut_down_fails_the_transfer_promptly_naming_why() {
    let Some(gpu) = gpu() else { return };
    let (a, b) = gpu_engines("cuda", CudaMemory::Device).await;
    let src = a.allocate(4 << 20).unwrap();
    let dst = b.allocate(4 << 20).unwrap();
    let g = b.grant(&dst, 0, 4 << 20, Access::Write).unwrap();
    a.transfer(vec![Request::write(&src, 0, &g, 0, 4 << 20)], T)
        .await
        .unwrap();
    b.shutdown();
    let t = std::time::Instant::now();
    let e = a
        .transfer(vec![Request::write(&src, 0, &g, 0, 4 << 20)], T)
        .await
        .unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert!(
        matches!(
            e.kind(),
            ErrorKind::GrantRevoked
                | ErrorKind::PeerDisconnected
                | ErrorKind::Unreachable
                | ErrorKind::EngineClosed
        ),
        "{e}"
    );
    assert_idle(&gpu, &a).await;
}
