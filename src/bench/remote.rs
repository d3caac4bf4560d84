//! `bench transfer --transport rdma` across two nodes: the far node runs `omnirig bench peer
//! --mode rdma-engine --listen ADDR` (an rdma engine granting a write and a read buffer, and the
//! perftest servers the baseline needs); the near one runs `bench transfer --transport rdma
//! --peer ADDR`. They talk over one TCP connection in JSON lines: the peer's [`Hello`] first,
//! then [`ToPeer`] requests, each answered by one [`FromPeer`]. The engine and perftest both
//! cross the link between the nodes, so the ratio compares like with like: a write's
//! completion and a ping-pong round trip each cross the wire twice.
//!
//! The peer listens on the network and starts programs on request, so what it accepts is
//! narrow: two perftest tools with numeric arguments it builds itself, each checked against
//! bounds, and one check of its own buffer; lines are capped in length.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use omnirig_transports::{
    Buffer, Engine, EngineConfig, InProcessStore, RdmaConfig, TcpConfig, TransportKind,
};
use serde::{Deserialize, Serialize};

use super::peer::{Hello, peer_buffers};
use super::perftest::{self, ServerRequest};

/// Longest line either side reads (a Hello with two grants is well under 4 KiB).
const MAX_LINE: u64 = 64 * 1024;
/// The byte the benchmark's writes carry (its source buffer is filled with it).
pub const WRITTEN: u8 = 0x5a;

/// A request to the peer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ToPeer {
    /// Start a perftest server for this run (the client runs on the near node).
    Perftest(ServerRequest),
    /// Revoke the write grant (so no write can land after), then count the bytes of the
    /// write buffer's first `len` that are not `byte`. The benchmark's last request.
    CheckWritten { len: u64, byte: u8 },
    /// The benchmark is done: the peer exits.
    Bye,
}

/// The peer's answer to one [`ToPeer`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum FromPeer {
    /// The server is started and listens on this port.
    Perftest {
        port: u16,
    },
    Written {
        differing: u64,
    },
    /// The request was refused, or failed; says why.
    Error {
        message: String,
    },
}

/// One JSON line, at most [`MAX_LINE`] bytes; `None` at end of stream.
fn read_line<T: serde::de::DeserializeOwned>(
    r: &mut BufReader<TcpStream>,
    what: &str,
) -> anyhow::Result<Option<T>> {
    let mut line = String::new();
    let n = r.by_ref().take(MAX_LINE).read_line(&mut line)?;
    if n == 0 {
        return Ok(None);
    }
    if !line.ends_with('\n') {
        bail!("{what}: line longer than {MAX_LINE} bytes, or cut short");
    }
    serde_json::from_str(&line)
        .map(Some)
        .with_context(|| format!("{what}: not a valid line: {:?}", line.trim_end()))
}

fn write_line<T: Serialize>(w: &mut TcpStream, v: &T) -> anyhow::Result<()> {
    let mut s = serde_json::to_vec(v)?;
    s.push(b'\n');
    w.write_all(&s)?;
    Ok(())
}

/// The rdma engine config of either side: listening on `ip` (the address the other node
/// reaches this one on) for both the engine's TCP endpoint and the rdma control server.
pub fn engine_config(name: String, ip: IpAddr, rdma: RdmaConfig) -> EngineConfig {
    EngineConfig::for_kind(name, TransportKind::Rdma)
        .store(InProcessStore::new())
        .with(TcpConfig {
            listen: Some(SocketAddr::new(ip, 0)),
            ..TcpConfig::default()
        })
        .with(RdmaConfig {
            listen: SocketAddr::new(ip, 0),
            ..rdma
        })
}

/// The near side's handle on the peer.
pub struct PeerControl {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    pub hello: Hello,
}

impl PeerControl {
    /// Connects to the peer at `addr`, retrying for up to `wait` (the far node may still be
    /// starting), and reads its Hello.
    pub fn connect(addr: SocketAddr, wait: Duration) -> anyhow::Result<Self> {
        let until = Instant::now() + wait;
        let stream = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
                Ok(s) => break s,
                // the far node may still be starting its peer
                Err(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(500)),
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!(
                            "no bench peer at {addr} after {} s (start `omnirig bench peer \
                             --mode rdma-engine --listen {addr}` on the far node)",
                            wait.as_secs()
                        )
                    });
                }
            }
        };
        stream.set_nodelay(true)?;
        // A peer that stops answering must not hang the benchmark: perftest's longest run is
        // well under this.
        stream.set_read_timeout(Some(Duration::from_secs(300)))?;
        let writer = stream.try_clone()?;
        let mut reader = BufReader::new(stream);
        let hello: Hello = read_line(&mut reader, "bench peer's hello")?
            .with_context(|| format!("the bench peer at {addr} closed before its hello"))?;
        Ok(Self {
            reader,
            writer,
            hello,
        })
    }

    /// The peer's address as this node reaches it (perftest's client connects there).
    pub fn peer_ip(&self) -> anyhow::Result<IpAddr> {
        Ok(self.writer.peer_addr()?.ip())
    }

    /// This node's address on the way to the peer (the local engine listens there).
    pub fn local_ip(&self) -> anyhow::Result<IpAddr> {
        Ok(self.writer.local_addr()?.ip())
    }

    fn ask(&mut self, req: &ToPeer) -> anyhow::Result<FromPeer> {
        write_line(&mut self.writer, req)?;
        match read_line(&mut self.reader, "bench peer's reply")? {
            Some(FromPeer::Error { message }) => bail!("the bench peer refused {req:?}: {message}"),
            Some(r) => Ok(r),
            None => bail!("the bench peer closed the connection (asked {req:?})"),
        }
    }

    /// Starts a perftest server on the peer; returns its port.
    pub fn start_perftest(&mut self, req: &ServerRequest) -> anyhow::Result<u16> {
        match self.ask(&ToPeer::Perftest(req.clone()))? {
            FromPeer::Perftest { port } => Ok(port),
            other => bail!("the bench peer answered {other:?} to a perftest request"),
        }
    }

    /// How many of the peer's write buffer's first `len` bytes are not `byte`.
    pub fn check_written(&mut self, len: u64, byte: u8) -> anyhow::Result<u64> {
        match self.ask(&ToPeer::CheckWritten { len, byte })? {
            FromPeer::Written { differing } => Ok(differing),
            other => bail!("the bench peer answered {other:?} to a buffer check"),
        }
    }

    /// Tells the peer to exit.
    pub fn bye(mut self) {
        let _ = write_line(&mut self.writer, &ToPeer::Bye);
    }
}

/// The far side: an rdma engine on `listen`'s address granting a write buffer and a read
/// buffer (filled with `i * 7 + 3`) of `max_size` bytes each; serves one benchmark, then
/// exits. Gives up if nobody connects within `wait`.
pub fn serve(
    listen: SocketAddr,
    max_size: u64,
    rdma: RdmaConfig,
    wait: Duration,
) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let name = format!("bench-peer-{}", std::process::id());
        let engine = Engine::new(engine_config(name, listen.ip(), rdma.clone())).await?;
        // the read buffer lives as long as the engine serves grants on it
        let (wbuf, wg, _rbuf, rg) = peer_buffers(&engine, max_size)?;
        let hello = Hello {
            addr: engine.tcp_addr().context("engine has no tcp endpoint")?,
            write_grant: Some(wg),
            read_grant: Some(rg),
        };
        let listener =
            TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
        eprintln!(
            "[bench peer] rdma engine at {} granting 2 x {max_size} bytes; waiting on {listen}",
            hello.addr
        );
        let engine = std::sync::Arc::new(engine);
        let e = engine.clone();
        tokio::task::spawn_blocking(move || {
            session(&listener, &hello, &e, &rdma, &wbuf, max_size, wait)
        })
        .await??;
        anyhow::Ok(())
    })
}

/// Accepts one benchmark and answers its requests until it says bye or hangs up.
fn session(
    listener: &TcpListener,
    hello: &Hello,
    engine: &Engine,
    rdma: &RdmaConfig,
    wbuf: &Buffer,
    max_size: u64,
    wait: Duration,
) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    let until = Instant::now() + wait;
    let (stream, from) = loop {
        match listener.accept() {
            Ok(c) => break c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > until {
                    bail!("no benchmark connected within {} s", wait.as_secs());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e.into()),
        }
    };
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    eprintln!("[bench peer] benchmark from {from}");
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    write_line(&mut writer, hello)?;
    let mut server: Option<Child> = None;
    let result = loop {
        let req: ToPeer = match read_line(&mut reader, "benchmark's request") {
            Ok(Some(r)) => r,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        let reply = match req {
            ToPeer::Bye => break Ok(()),
            ToPeer::Perftest(r) => {
                reap(&mut server);
                match perftest::start_server(&r, rdma) {
                    Ok((child, port)) => {
                        server = Some(child);
                        FromPeer::Perftest { port }
                    }
                    Err(e) => FromPeer::Error {
                        message: format!("{e:#}"),
                    },
                }
            }
            ToPeer::CheckWritten { len, .. } if len > max_size => FromPeer::Error {
                message: format!("length {len} is over the write buffer's {max_size} bytes"),
            },
            ToPeer::CheckWritten { len, byte } => {
                // the buffer is readable here only once no grant lets a write in
                if let Some(g) = &hello.write_grant {
                    engine.revoke(g);
                }
                match wbuf.view(0, len, |b| b.iter().filter(|&&x| x != byte).count() as u64) {
                    Ok(differing) => FromPeer::Written { differing },
                    Err(e) => FromPeer::Error {
                        message: e.to_string(),
                    },
                }
            }
        };
        if let Err(e) = write_line(&mut writer, &reply) {
            break Err(e);
        }
    };
    reap(&mut server);
    eprintln!("[bench peer] done");
    result
}

/// The last perftest server exits once its client is done; one whose client never came is
/// killed after a grace period, so servers never pile up.
fn reap(server: &mut Option<Child>) {
    if let Some(mut c) = server.take() {
        let until = Instant::now() + Duration::from_secs(5);
        while matches!(c.try_wait(), Ok(None)) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
        if matches!(c.try_wait(), Ok(None)) {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnirig_transports::Access;

    /// What crosses the wire is checked before it is used: unknown ops, over-long lines and
    /// out-of-range perftest arguments are refused with what was wrong.
    #[test]
    fn the_peer_protocol_refuses_what_it_does_not_know() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut w = TcpStream::connect(addr).unwrap();
        let (s, _) = l.accept().unwrap();
        let mut r = BufReader::new(s);
        w.write_all(b"{\"op\":\"rm_rf\"}\n").unwrap();
        let e = read_line::<ToPeer>(&mut r, "request").unwrap_err();
        assert!(format!("{e:#}").contains("rm_rf"), "{e:#}");
        w.write_all(&vec![b' '; MAX_LINE as usize + 10]).unwrap();
        let e = read_line::<ToPeer>(&mut r, "request").unwrap_err();
        assert!(e.to_string().contains("longer than"), "{e}");
        // a request round-trips as itself
        let req = ToPeer::CheckWritten { len: 7, byte: 1 };
        let json = serde_json::to_string(&req).unwrap();
        assert_eq!(json, r#"{"op":"check_written","len":7,"byte":1}"#);
    }

    /// The peer's session, driven by the near side's client: the hello carries the grants,
    /// the buffer check revokes the write grant and counts exactly the bytes that differ,
    /// and a check past the buffer or a perftest request out of bounds is refused by name
    /// (the session goes on after a refusal, and ends at bye).
    #[tokio::test]
    async fn a_peer_session_checks_its_buffer_and_refuses_out_of_bounds() {
        let engine = Engine::new(
            EngineConfig::for_kind("peer-session", TransportKind::Loopback)
                .store(InProcessStore::new()),
        )
        .await
        .unwrap();
        let wbuf = engine.allocate(4096).unwrap();
        wbuf.write(0, &[WRITTEN; 1000]).unwrap();
        let hello = Hello {
            addr: "127.0.0.1:1".parse().unwrap(),
            write_grant: Some(engine.grant(&wbuf, 0, 4096, Access::Write).unwrap()),
            read_grant: None,
        };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let engine = std::sync::Arc::new(engine);
        let (e, h, b) = (engine.clone(), hello.clone(), wbuf.clone());
        let peer = std::thread::spawn(move || {
            session(
                &listener,
                &h,
                &e,
                &RdmaConfig::default(),
                &b,
                4096,
                Duration::from_secs(30),
            )
        });
        let mut c = tokio::task::spawn_blocking(move || {
            PeerControl::connect(addr, Duration::from_secs(10))
        })
        .await
        .unwrap()
        .unwrap();
        assert_eq!(c.hello.write_grant, hello.write_grant);
        assert_eq!(c.check_written(1000, WRITTEN).unwrap(), 0);
        assert_eq!(c.check_written(1500, WRITTEN).unwrap(), 500);
        assert_eq!(c.check_written(4096, 0).unwrap(), 1000);
        let e = c.check_written(4097, WRITTEN).unwrap_err();
        assert!(
            format!("{e:#}").contains("over the write buffer's 4096"),
            "{e:#}"
        );
        let e = c
            .start_perftest(&ServerRequest {
                tool: perftest::Tool::IbWriteBw,
                size: 65536,
                seconds: Some(3600),
                iters: None,
            })
            .unwrap_err();
        assert!(format!("{e:#}").contains("seconds 1..=60"), "{e:#}");
        // the write grant is gone: nothing can land after the check
        assert!(!engine.revoke(hello.write_grant.as_ref().unwrap()));
        c.bye();
        peer.join().unwrap().unwrap();
    }
}
