//! The node agent (`omnirig agent`) and the coordinator's side of it.
//!
//! One TCP connection per stage process. The coordinator opens with a fixed-size preface:
//! [`MAGIC`], then the secret's length (one byte) and the secret, zero-padded to
//! [`crate::cluster::MAX_SECRET`]; the agent reads exactly that many bytes (within
//! [`PREFACE_TIMEOUT`]) and compares in constant time before it decodes anything. Then
//! frames: a u32 big-endian length (at most [`MAX_FRAME`]) and a JSON [`ToAgent`] or
//! [`FromAgent`]. The coordinator sends `Start`; the agent starts `omnirig stage ...`
//! (nothing else: the first argument must be `stage`, and only the run secret may be set
//! in its environment), answers `Started`, and when the process ends, `Exited`. If the
//! coordinator's connection drops, the agent kills the process; if the agent (or its node)
//! dies, the coordinator sees the connection drop and reports the node lost.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use crate::cluster::{MAX_SECRET, check_secret};
use crate::{HilError, Result};

pub const MAGIC: &[u8; 8] = b"OMNIAGT1";
const PREFACE_LEN: usize = 8 + 1 + MAX_SECRET;
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest frame the agent decodes (a coordinator's request).
pub const MAX_FRAME: usize = 64 << 10;
/// Largest frame the coordinator decodes (an agent's reply: facts carry command output).
pub const MAX_REPLY: usize = 8 << 20;
/// Most arguments a start request may carry.
const MAX_ARGS: usize = 64;
/// Most engine log lines an agent keeps (the newest).
const MAX_ENGINE_LOG: usize = 256;
/// Longest engine log line kept (characters).
const MAX_LOG_LINE: usize = 1000;
/// The only variables a coordinator may set in a stage's environment.
const ALLOWED_ENV: [&str; 2] = [omnirig_harness::process::RUN_SECRET_ENV, "RUST_LOG"];

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum ToAgent {
    Start {
        args: Vec<String>,
        env: Vec<(String, String)>,
    },
    Kill,
    /// This node's facts for the evidence report (`omnirig evidence`).
    Facts,
    /// The rdma transport's log lines (device, port, GID selection) its stage processes
    /// printed since the agent started or was last cleared; `clear` empties the buffer after.
    EngineLog {
        clear: bool,
    },
    /// One side of a perftest baseline (`ib_write_bw` / `ib_write_lat`), its command line
    /// built by the agent from these validated fields (no free-form arguments).
    Perftest {
        request: crate::evidence::PerftestRequest,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum FromAgent {
    Started { pid: u32 },
    Exited { status: String },
    Refused { reason: String },
    Facts { facts: crate::evidence::HostFacts },
    EngineLog { lines: Vec<String> },
    Perftest { probe: crate::evidence::Probe },
}

fn preface(secret: &str) -> Vec<u8> {
    let mut p = Vec::with_capacity(PREFACE_LEN);
    p.extend_from_slice(MAGIC);
    p.push(secret.len() as u8);
    p.extend_from_slice(secret.as_bytes());
    p.resize(PREFACE_LEN, 0);
    p
}

/// Equal without an early exit on the first differing byte.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn write_frame<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).expect("messages encode");
    w.write_all(&(body.len() as u32).to_be_bytes()).await?;
    w.write_all(&body).await?;
    w.flush().await
}

async fn read_frame<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(
    r: &mut R,
) -> std::io::Result<T> {
    read_bounded(r, MAX_FRAME).await
}

async fn read_reply<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<FromAgent> {
    read_bounded(r, MAX_REPLY).await
}

async fn read_bounded<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(
    r: &mut R,
    limit: usize,
) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes, limit {limit}"),
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    serde_json::from_slice(&body).map_err(|e| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, format!("bad message: {e}"))
    })
}

/// The agent: serves coordinators holding `secret` on `listener`, starting `exe`'s stages.
pub struct Agent {
    pub exe: PathBuf,
    pub secret: String,
    /// The rdma transport's lines from this agent's stage processes' stderr (the evidence
    /// that a run used the device the cluster file names).
    engine_log: std::sync::Mutex<std::collections::VecDeque<String>>,
}

/// `line` without ANSI colour sequences (ESC `[` ... final letter).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

impl Agent {
    pub fn new(exe: PathBuf, secret: String) -> Result<Self> {
        check_secret(&secret, "the agent's configuration")?;
        Ok(Self {
            exe,
            secret,
            engine_log: Default::default(),
        })
    }

    /// Forwards a stage's stderr to the agent's own, keeping the rdma transport's lines.
    fn relay_stderr(self: &Arc<Self>, stderr: tokio::process::ChildStderr) {
        use tokio::io::AsyncBufReadExt;
        let me = self.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("{line}");
                let plain = strip_ansi(&line);
                if plain.contains("rdma:") {
                    let mut log = me.engine_log.lock().unwrap_or_else(|p| p.into_inner());
                    if log.len() == MAX_ENGINE_LOG {
                        log.pop_front();
                    }
                    log.push_back(plain.chars().take(MAX_LOG_LINE).collect());
                }
            }
        });
    }

    /// Serves until the process ends.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) -> Result<()> {
        info!(addr = ?listener.local_addr().ok(), "agent listening");
        loop {
            let (s, from) = listener.accept().await?;
            let me = self.clone();
            tokio::spawn(async move {
                if let Err(e) = me.clone().serve_one(s, from).await {
                    warn!(%from, error = %e, "agent connection ended with an error");
                }
            });
        }
    }

    async fn serve_one(self: Arc<Self>, mut s: TcpStream, from: SocketAddr) -> Result<()> {
        let mut got = [0u8; PREFACE_LEN];
        let read = tokio::time::timeout(PREFACE_TIMEOUT, async {
            let mut n = 0;
            while n < PREFACE_LEN {
                match s.read(&mut got[n..]).await {
                    Ok(0) | Err(_) => break,
                    Ok(k) => n += k,
                }
            }
            n
        })
        .await;
        match read {
            // A probe (the coordinator checking the port is up) says nothing: not an error.
            Ok(0) => return Ok(()),
            Ok(PREFACE_LEN) if same(&got, &preface(&self.secret)) => {}
            _ => {
                return Err(HilError::Serve(format!(
                    "{from}: no valid preface with the cluster's secret; dropped"
                )));
            }
        }
        let (mut r, mut w) = s.into_split();
        let (args, env) = match read_frame::<_, ToAgent>(&mut r).await? {
            ToAgent::Start { args, env } => (args, env),
            ToAgent::Kill => return Ok(()),
            ToAgent::Facts => {
                let facts = crate::evidence::collect().await;
                write_frame(&mut w, &FromAgent::Facts { facts }).await?;
                return Ok(());
            }
            ToAgent::EngineLog { clear } => {
                let lines = {
                    let mut log = self.engine_log.lock().unwrap_or_else(|p| p.into_inner());
                    let lines = log.iter().cloned().collect();
                    if clear {
                        log.clear();
                    }
                    lines
                };
                write_frame(&mut w, &FromAgent::EngineLog { lines }).await?;
                return Ok(());
            }
            ToAgent::Perftest { request } => {
                let probe = crate::evidence::perftest(&request).await;
                write_frame(&mut w, &FromAgent::Perftest { probe }).await?;
                return Ok(());
            }
        };
        if let Err(reason) = check_start(&args, &env) {
            let _ = write_frame(
                &mut w,
                &FromAgent::Refused {
                    reason: reason.clone(),
                },
            )
            .await;
            return Err(HilError::Serve(format!("{from}: refused: {reason}")));
        }
        let mut child = match tokio::process::Command::new(&self.exe)
            .args(&args)
            .env_remove(omnirig_harness::process::RUN_SECRET_ENV)
            .envs(env)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
        {
            Ok(mut c) => {
                if let Some(e) = c.stderr.take() {
                    self.relay_stderr(e);
                }
                c
            }
            Err(e) => {
                let reason = format!("starting {}: {e}", self.exe.display());
                let _ = write_frame(
                    &mut w,
                    &FromAgent::Refused {
                        reason: reason.clone(),
                    },
                )
                .await;
                return Err(HilError::Serve(reason));
            }
        };
        let pid = child.id().unwrap_or(0);
        info!(%from, pid, stage = ?args.get(2), "stage process started");
        write_frame(&mut w, &FromAgent::Started { pid }).await?;
        // Until the process ends: a Kill or a dropped coordinator kills it.
        let status = loop {
            tokio::select! {
                st = child.wait() => break st.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
                m = read_frame::<_, ToAgent>(&mut r) => {
                    let _ = child.start_kill();
                    if m.is_err() {
                        // The coordinator is gone; nobody to tell.
                        let _ = child.wait().await;
                        return Ok(());
                    }
                }
            }
        };
        info!(%from, pid, %status, "stage process exited");
        let _ = write_frame(&mut w, &FromAgent::Exited { status }).await;
        Ok(())
    }
}

/// What an agent agrees to start: `stage` and its flags, with only the run's variables set.
fn check_start(args: &[String], env: &[(String, String)]) -> std::result::Result<(), String> {
    if args.first().map(String::as_str) != Some("stage") {
        return Err("an agent starts only `omnirig stage` processes".into());
    }
    if args.len() > MAX_ARGS {
        return Err(format!("{} arguments, limit {MAX_ARGS}", args.len()));
    }
    if let Some((k, _)) = env.iter().find(|(k, _)| !ALLOWED_ENV.contains(&k.as_str())) {
        return Err(format!(
            "environment variable {k} may not be set through the agent"
        ));
    }
    Ok(())
}

/// Asks the agent of `node` at `addr` for its host's facts.
pub async fn collect_facts(
    node: &str,
    addr: SocketAddr,
    secret: &str,
) -> Result<crate::evidence::HostFacts> {
    match ask(
        node,
        addr,
        secret,
        &ToAgent::Facts,
        Duration::from_secs(120),
    )
    .await?
    {
        FromAgent::Facts { facts } => Ok(facts),
        other => Err(unexpected(node, addr, "facts", other)),
    }
}

/// The rdma transport's lines the stage processes of `node` logged (see
/// [`ToAgent::EngineLog`]).
pub async fn engine_log(
    node: &str,
    addr: SocketAddr,
    secret: &str,
    clear: bool,
) -> Result<Vec<String>> {
    match ask(
        node,
        addr,
        secret,
        &ToAgent::EngineLog { clear },
        Duration::from_secs(10),
    )
    .await?
    {
        FromAgent::EngineLog { lines } => Ok(lines),
        other => Err(unexpected(node, addr, "engine log", other)),
    }
}

/// Runs one side of a perftest baseline on `node` (the server side returns once its client
/// finished, or the agent's time limit passed).
pub async fn perftest(
    node: &str,
    addr: SocketAddr,
    secret: &str,
    request: crate::evidence::PerftestRequest,
) -> Result<crate::evidence::Probe> {
    let limit = crate::evidence::PERFTEST_TIMEOUT + Duration::from_secs(10);
    match ask(node, addr, secret, &ToAgent::Perftest { request }, limit).await? {
        FromAgent::Perftest { probe } => Ok(probe),
        other => Err(unexpected(node, addr, "perftest", other)),
    }
}

fn unexpected(node: &str, addr: SocketAddr, want: &str, got: FromAgent) -> HilError {
    let got = match got {
        FromAgent::Refused { reason } => format!("refused: {reason}"),
        other => format!("{other:?}").chars().take(200).collect(),
    };
    HilError::Agent {
        node: node.into(),
        addr: addr.to_string(),
        reason: format!("expected {want}, got {got}"),
    }
}

/// One request, one reply, on a connection of its own.
async fn ask(
    node: &str,
    addr: SocketAddr,
    secret: &str,
    msg: &ToAgent,
    limit: Duration,
) -> Result<FromAgent> {
    let fail = |reason: String| HilError::Agent {
        node: node.into(),
        addr: addr.to_string(),
        reason,
    };
    let mut s = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(addr))
        .await
        .map_err(|_| fail("no connection within 10 s".into()))?
        .map_err(|e| {
            fail(format!(
                "cannot connect (is `omnirig agent` running there?): {e}"
            ))
        })?;
    s.write_all(&preface(secret))
        .await
        .map_err(|e| fail(e.to_string()))?;
    write_frame(&mut s, msg).await.map_err(|e| {
        fail(format!(
            "the agent dropped the connection (wrong secret?): {e}"
        ))
    })?;
    match tokio::time::timeout(limit, read_reply(&mut s)).await {
        Ok(Ok(reply)) => Ok(reply),
        Ok(Err(e)) => Err(fail(format!("no answer (wrong secret?): {e}"))),
        Err(_) => Err(fail(format!("no answer within {limit:?}"))),
    }
}

/// The coordinator's handle on one stage process an agent started.
pub struct AgentChild {
    node: String,
    pid: u32,
    kill: mpsc::UnboundedSender<ToAgent>,
    status: watch::Receiver<Option<String>>,
}

impl AgentChild {
    /// Asks the agent of `node` at `addr` to start `omnirig ARGS` with `env`.
    pub async fn start(
        node: &str,
        addr: SocketAddr,
        secret: &str,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> Result<AgentChild> {
        let fail = |reason: String| HilError::Agent {
            node: node.into(),
            addr: addr.to_string(),
            reason,
        };
        let mut s = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(addr))
            .await
            .map_err(|_| fail("no connection within 10 s".into()))?
            .map_err(|e| {
                fail(format!(
                    "cannot connect (is `omnirig agent` running there?): {e}"
                ))
            })?;
        s.write_all(&preface(secret))
            .await
            .map_err(|e| fail(e.to_string()))?;
        let (mut r, mut w) = s.into_split();
        write_frame(&mut w, &ToAgent::Start { args, env })
            .await
            .map_err(|e| {
                fail(format!(
                    "the agent dropped the connection (wrong secret?): {e}"
                ))
            })?;
        let pid = match tokio::time::timeout(Duration::from_secs(30), read_reply(&mut r)).await {
            Ok(Ok(FromAgent::Started { pid })) => pid,
            Ok(Ok(FromAgent::Refused { reason })) => {
                return Err(fail(format!("refused: {reason}")));
            }
            Ok(Ok(other)) => return Err(fail(format!("expected started, got {other:?}"))),
            Ok(Err(e)) => {
                return Err(fail(format!(
                    "closed without starting the stage (wrong secret?): {e}"
                )));
            }
            Err(_) => return Err(fail("no answer within 30 s".into())),
        };
        let (status_tx, status) = watch::channel(None);
        let (kill, mut kills) = mpsc::unbounded_channel::<ToAgent>();
        let node_name = node.to_owned();
        tokio::spawn(async move {
            let ended = loop {
                tokio::select! {
                    m = read_reply(&mut r) => break match m {
                        Ok(FromAgent::Exited { status }) => status,
                        Ok(other) => format!("agent of node {node_name} sent {other:?}"),
                        Err(e) => format!("lost node {node_name}: its agent's connection ended ({e})"),
                    },
                    k = kills.recv() => match k {
                        Some(k) => { let _ = write_frame(&mut w, &k).await; }
                        None => {
                            // The handle was dropped: ask the agent to kill the process.
                            let _ = write_frame(&mut w, &ToAgent::Kill).await;
                            std::future::pending::<()>().await;
                        }
                    },
                }
            };
            let _ = status_tx.send(Some(ended));
        });
        Ok(AgentChild {
            node: node.into(),
            pid,
            kill,
            status,
        })
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// The process id on its node.
    pub fn remote_pid(&self) -> u32 {
        self.pid
    }
}

impl omnirig_harness::process::StageChild for AgentChild {
    fn local_pid(&self) -> Option<u32> {
        None
    }

    fn try_wait(&mut self) -> Option<String> {
        self.status.borrow().clone()
    }

    fn start_kill(&mut self) {
        let _ = self.kill.send(ToAgent::Kill);
    }

    fn wait(&mut self) -> std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send + '_>> {
        Box::pin(async move {
            match self.status.wait_for(|s| s.is_some()).await {
                Ok(s) => s.clone().unwrap_or_default(),
                Err(_) => format!("lost node {}", self.node),
            }
        })
    }
}
