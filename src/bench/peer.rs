//! The far side of two-process benchmarks: a child `omnirig bench peer` that serves either an
//! omnirig engine or a plain TCP socket, announces itself with one JSON line on stdout, and
//! exits when its stdin closes (so it never outlives the benchmark).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, ChildStdin, Command, Stdio};

use anyhow::{Context, bail};
use omnirig_transports::{
    Access, Buffer, Engine, EngineConfig, Grant, InProcessStore, TcpConfig, TransportKind,
};
use serde::{Deserialize, Serialize};

/// What a peer announces.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    pub addr: SocketAddr,
    /// Engine mode: a write grant over one buffer and a read grant over another.
    pub write_grant: Option<Grant>,
    pub read_grant: Option<Grant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PeerMode {
    /// An omnirig engine serving grants over TCP.
    Engine,
    /// An omnirig engine serving grants over TCP and shm (same host).
    ShmEngine,
    /// A plain TCP socket: the physical baseline.
    Raw,
    /// An omnirig rdma engine on another node, for `bench transfer --transport rdma --peer`
    /// (`bench::remote`).
    RdmaEngine,
}

impl Hello {
    /// The write and read grants an engine peer announces.
    pub fn grants(&self) -> anyhow::Result<(Grant, Grant)> {
        Ok((
            self.write_grant
                .clone()
                .context("peer sent no write grant")?,
            self.read_grant.clone().context("peer sent no read grant")?,
        ))
    }
}

/// An engine peer's two buffers of `max_size` bytes, each granted whole: one to write into,
/// one to read from, filled with `i * 7 + 3` (what the benchmark checks its reads against).
pub fn peer_buffers(
    engine: &Engine,
    max_size: u64,
) -> anyhow::Result<(Buffer, Grant, Buffer, Grant)> {
    let wbuf = engine.allocate(max_size)?;
    let rbuf = engine.allocate(max_size)?;
    rbuf.fill(0, max_size, |b| {
        b.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = (i * 7 + 3) as u8)
    })?;
    let wg = engine.grant(&wbuf, 0, max_size, Access::Write)?;
    let rg = engine.grant(&rbuf, 0, max_size, Access::Read)?;
    Ok((wbuf, wg, rbuf, rg))
}

/// Raw protocol: 1 byte op ('W' or 'R'; lower case: block instead of busy-polling) + u64 LE
/// length; 'W' is followed by the payload and answered with one byte; 'R' is answered with
/// the payload.
pub const RAW_HEADER: usize = 9;

fn announce(h: &Hello) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, h)?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(())
}

fn wait_for_stdin_eof() {
    let mut sink = Vec::new();
    let _ = std::io::stdin().lock().read_to_end(&mut sink);
}

/// Runs the child side; returns when stdin closes.
pub fn serve(mode: PeerMode, max_size: u64, tcp: TcpConfig) -> anyhow::Result<()> {
    match mode {
        PeerMode::Engine | PeerMode::ShmEngine => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let name = format!("bench-peer-{}", std::process::id());
                let kind = if mode == PeerMode::ShmEngine {
                    TransportKind::Shm
                } else {
                    TransportKind::Tcp
                };
                let cfg = EngineConfig::for_kind(name, kind)
                    .store(InProcessStore::new())
                    .with(tcp);
                let engine = Engine::new(cfg).await?;
                let (_wbuf, write_grant, _rbuf, read_grant) = peer_buffers(&engine, max_size)?;
                announce(&Hello {
                    addr: engine.tcp_addr().context("engine has no tcp endpoint")?,
                    write_grant: Some(write_grant),
                    read_grant: Some(read_grant),
                })?;
                tokio::task::spawn_blocking(wait_for_stdin_eof).await?;
                anyhow::Ok(())
            })
        }
        PeerMode::RdmaEngine => {
            bail!("an rdma-engine peer runs on another node (bench::remote::serve)")
        }
        PeerMode::Raw => {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            announce(&Hello {
                addr: listener.local_addr()?,
                write_grant: None,
                read_grant: None,
            })?;
            std::thread::spawn(move || {
                wait_for_stdin_eof();
                std::process::exit(0);
            });
            let mut buf = vec![0u8; max_size as usize];
            loop {
                let (mut s, _) = listener.accept()?;
                s.set_nodelay(true)?;
                s.set_nonblocking(true)?;
                // One client at a time; a closed connection goes back to accept.
                let _ = raw_session(&mut s, &mut buf, tcp.busy_poll);
            }
        }
    }
}

/// `read_exact` on a non-blocking socket that busy-polls for up to `spin` per read, then sleeps
/// in `poll(2)` until the socket is readable: the same policy as the engine's
/// `TcpConfig::busy_poll`, so the baseline is not slowed by parked (virtual) CPUs waking up
/// while the engine is not.
pub fn read_exact_polled(
    s: &mut TcpStream,
    buf: &mut [u8],
    spin: std::time::Duration,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut got = 0;
    let mut until = std::time::Instant::now() + spin;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                got += n;
                until = std::time::Instant::now() + spin;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if std::time::Instant::now() < until {
                    // Yield rather than spin: if the peer shares this CPU it runs now.
                    std::thread::yield_now();
                    continue;
                }
                let mut fd = libc::pollfd {
                    fd: s.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd for a socket we own, for the duration of the call.
                if unsafe { libc::poll(&mut fd, 1, -1) } < 0 {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf` to a non-blocking socket, waiting in `poll(2)` when it is full.
pub fn write_all_polled(s: &mut TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let mut fd = libc::pollfd {
                    fd: s.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one valid pollfd for a socket we own, for the duration of the call.
                unsafe { libc::poll(&mut fd, 1, -1) };
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn raw_session(
    s: &mut TcpStream,
    buf: &mut [u8],
    spin: std::time::Duration,
) -> std::io::Result<()> {
    let mut h = [0u8; RAW_HEADER];
    // Upper-case ops busy-poll, lower-case ops block: the client picks the mode per series,
    // and the next header is awaited the way the last op was.
    let mut wait = spin;
    loop {
        read_exact_polled(s, &mut h, wait)?;
        wait = if h[0].is_ascii_lowercase() {
            std::time::Duration::ZERO
        } else {
            spin
        };
        let len = u64::from_le_bytes(h[1..9].try_into().expect("8 bytes")) as usize;
        if len > buf.len() {
            return Err(std::io::Error::other("length over the peer's buffer"));
        }
        match h[0].to_ascii_uppercase() {
            b'W' => {
                read_exact_polled(s, &mut buf[..len], wait)?;
                write_all_polled(s, &[1])?;
            }
            b'R' => write_all_polled(s, &buf[..len])?,
            _ => return Err(std::io::Error::other("unknown op")),
        }
    }
}

/// A running peer process; killed when dropped.
pub struct PeerProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    pub hello: Hello,
}

impl PeerProcess {
    /// The child's process id (its CPU time is read from /proc).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn spawn(mode: PeerMode, max_size: u64, tcp: &TcpConfig) -> anyhow::Result<Self> {
        Self::spawn_on(mode, max_size, tcp, None)
    }

    /// As [`spawn`](Self::spawn), pinned to `cpu` when given.
    pub fn spawn_on(
        mode: PeerMode,
        max_size: u64,
        tcp: &TcpConfig,
        cpu: Option<usize>,
    ) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating the omnirig binary")?;
        let mode = match mode {
            PeerMode::Engine => "engine",
            PeerMode::ShmEngine => "shm-engine",
            PeerMode::Raw => "raw",
            PeerMode::RdmaEngine => bail!("an rdma-engine peer runs on another node"),
        };
        let mut cmd = Command::new(exe);
        if let Some(c) = cpu {
            cmd.args(["bench", "peer", "--cpu", &c.to_string()]);
        } else {
            cmd.args(["bench", "peer"]);
        }
        let mut child = cmd
            .args(["--mode", mode, "--max-size", &max_size.to_string()])
            .args([
                "--slice-size",
                &tcp.slice_size.to_string(),
                "--max-payload",
                &tcp.max_payload.to_string(),
                "--busy-poll-us",
                &tcp.busy_poll.as_micros().to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the peer process")?;
        let stdin = child.stdin.take();
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("peer stdout")?).read_line(&mut line)?;
        if line.is_empty() {
            let status = child.wait()?;
            bail!("the {mode} peer exited before announcing itself ({status})");
        }
        let hello: Hello =
            serde_json::from_str(&line).with_context(|| format!("peer announced {line:?}"))?;
        Ok(Self {
            child,
            stdin,
            hello,
        })
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        drop(self.stdin.take());
        // Closing stdin asks it to exit; make sure it does.
        if matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}
