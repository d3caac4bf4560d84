//! The control channel: reservations, grants, block lists and done/error
//! replies. In one process, messages go through in-memory queues; between
//! processes, as framed msgpack over TCP (u32 big-endian length, then the
//! body; capped and validated before use). Tensors never travel here.
//!
//! Messages are routed by key (the request id; orchestration messages use the
//! empty key) into per-key mailboxes, so one link serves many requests at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use omnirig_fixtures::RequestSpec;
use omnirig_transports::Grant;
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, mpsc};

use crate::ec::EcSlot;
use crate::error::{FailureKind, HarnessError, Result};
use crate::kv::KvReservation;
use crate::stage::{StageOutcome, StageUsage};

/// Largest frame accepted (a KV reservation for a long prompt is the biggest message).
pub const MAX_FRAME: usize = 4 << 20;
/// Longest id or name in a message.
pub const MAX_ID: usize = 1024;
/// Most items in any list of a message (a KV reservation for the largest golden case has
/// about 20,000 grants).
pub const MAX_ITEMS: usize = 1 << 16;

/// Deserializes a list, refusing it as soon as it passes [`MAX_ITEMS`]: checking only after
/// decoding would let a frame of tiny items allocate tens of times its own size first.
pub fn bounded<'de, D, T>(d: D) -> std::result::Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Bounded<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Bounded<T> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a list of at most {MAX_ITEMS} items")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> std::result::Result<Vec<T>, A::Error> {
            let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
            while let Some(x) = seq.next_element()? {
                if v.len() == MAX_ITEMS {
                    return Err(serde::de::Error::custom(format!(
                        "list exceeds {MAX_ITEMS} items"
                    )));
                }
                v.push(x);
            }
            Ok(v)
        }
    }
    d.deserialize_seq(Bounded(std::marker::PhantomData))
}

/// A tensor name and its grant (stage connector reservations).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedGrant {
    pub tensor: String,
    pub grant: Grant,
}

/// A tensor name and its digest, hex (EC FINISH).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedDigest {
    pub tensor: String,
    pub digest: String,
}

// A message is built, sent and dropped; boxing the large variants (a stage's outcome) would
// cost an allocation per message for no saving.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Msg {
    // ---- hop: producer -> consumer ----
    /// The producer's outputs for the request exist: reserve for them now.
    Offer {
        request: String,
    },
    // ---- hop: consumer -> producer ----
    /// EC: per mm_hash, a grant, or none when the consumer has it cached.
    EcReserve {
        request: String,
        #[serde(deserialize_with = "bounded")]
        slots: Vec<EcSlot>,
    },
    /// KV: decode's block ids and grants for the blocks that must move.
    KvReserve {
        request: String,
        reservation: KvReservation,
    },
    /// Stage connector: a destination per tensor.
    StageReserve {
        request: String,
        #[serde(deserialize_with = "bounded")]
        grants: Vec<NamedGrant>,
    },
    /// The consumer cannot take the request (no room, failed upstream, ...).
    Refuse {
        request: String,
        cause: String,
        /// What kind of failure made the consumer refuse.
        #[serde(default)]
        kind: FailureKind,
    },
    // ---- hop: producer -> consumer ----
    /// EC / KV FINISH: every granted byte was written.
    Finish {
        request: String,
        #[serde(deserialize_with = "bounded")]
        digests: Vec<NamedDigest>,
        /// The producer's offer -> this FINISH, on its clock (µs): where a consumer that
        /// granted ahead dates the handoff's start.
        #[serde(default)]
        writing_us: u64,
    },
    /// Stage connector: the packet v1 sidecar (msgpack), sent only after its tensors landed.
    Packet {
        request: String,
        /// msgpack bin, not an array of integers (which costs microseconds per KiB).
        #[serde(with = "serde_bytes")]
        packet: Vec<u8>,
        /// The producer's offer -> this packet, on its clock (µs), as in `Finish`.
        #[serde(default)]
        writing_us: u64,
        /// A small packet's tensors, in the packet layout
        /// ([`crate::inline::packet_layout`]), instead of written into the grants; empty:
        /// they were written.
        #[serde(default, with = "serde_bytes")]
        inline: Vec<u8>,
    },
    /// ERROR: the named tensors (or blocks) failed to move, and why.
    Error {
        request: String,
        #[serde(deserialize_with = "bounded")]
        failed: Vec<String>,
        cause: String,
        /// The producer's failure: its kind and the engine peer it names.
        #[serde(default)]
        kind: FailureKind,
        #[serde(default)]
        peer: Option<String>,
    },
    // ---- orchestration (multi-process runs) ----
    /// A stage process introduces itself: its control listener and engines' TCP addresses.
    Hello {
        stage: String,
        control: String,
        engine_in: Option<String>,
        engine_out: Option<String>,
    },
    /// The orchestrator tells a stage the scenario and its downstream peer.
    Setup {
        scenario_yaml: String,
        downstream_control: Option<String>,
        downstream_engine: Option<String>,
    },
    /// First message on a stage-to-stage link: which stage is calling.
    Peer {
        stage: String,
    },
    Ready {
        stage: String,
    },
    Run {
        request: String,
        spec: RequestSpec,
    },
    StageDone {
        request: String,
        outcome: StageOutcome,
    },
    Shutdown,
    Bye {
        usage: StageUsage,
    },
}

fn check_id(field: &str, s: &str) -> Result<()> {
    if s.len() > MAX_ID {
        return Err(HarnessError::Control {
            channel: "decode".into(),
            reason: format!("{field}: {} bytes exceeds {MAX_ID}", s.len()),
        });
    }
    Ok(())
}

fn check_len(field: &str, n: usize) -> Result<()> {
    if n > MAX_ITEMS {
        return Err(HarnessError::Control {
            channel: "decode".into(),
            reason: format!("{field}: {n} items exceeds {MAX_ITEMS}"),
        });
    }
    Ok(())
}

impl Msg {
    /// The mailbox a message goes to.
    pub fn key(&self) -> &str {
        match self {
            Msg::Offer { request }
            | Msg::EcReserve { request, .. }
            | Msg::KvReserve { request, .. }
            | Msg::StageReserve { request, .. }
            | Msg::Refuse { request, .. }
            | Msg::Finish { request, .. }
            | Msg::Packet { request, .. }
            | Msg::Error { request, .. }
            | Msg::StageDone { request, .. } => request,
            _ => "",
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Msg::Offer { .. } => "offer",
            Msg::EcReserve { .. } => "ec_reserve",
            Msg::KvReserve { .. } => "kv_reserve",
            Msg::StageReserve { .. } => "stage_reserve",
            Msg::Refuse { .. } => "refuse",
            Msg::Finish { .. } => "finish",
            Msg::Packet { .. } => "packet",
            Msg::Error { .. } => "error",
            Msg::Hello { .. } => "hello",
            Msg::Setup { .. } => "setup",
            Msg::Peer { .. } => "peer",
            Msg::Ready { .. } => "ready",
            Msg::Run { .. } => "run",
            Msg::StageDone { .. } => "stage_done",
            Msg::Shutdown => "shutdown",
            Msg::Bye { .. } => "bye",
        }
    }

    /// Bounds and grant checks, applied to everything decoded from the wire.
    pub fn validate(&self) -> Result<()> {
        check_id("request", self.key())?;
        let grant = |g: &Grant| {
            g.validate().map_err(|e| HarnessError::Control {
                channel: "decode".into(),
                reason: format!("bad grant: {e}"),
            })
        };
        match self {
            Msg::EcReserve { slots, .. } => {
                check_len("slots", slots.len())?;
                for s in slots {
                    check_id("mm_hash", &s.mm_hash)?;
                    check_id("tensor", &s.tensor)?;
                    if let Some(g) = &s.grant {
                        grant(g)?;
                    }
                }
            }
            Msg::KvReserve { reservation, .. } => {
                check_len("dst_blocks", reservation.dst_blocks.len())?;
                check_len("grants", reservation.grants.len())?;
                for g in &reservation.grants {
                    grant(&g.grant)?;
                }
            }
            Msg::StageReserve { grants, .. } => {
                check_len("grants", grants.len())?;
                for g in grants {
                    check_id("tensor", &g.tensor)?;
                    grant(&g.grant)?;
                }
            }
            Msg::Finish { digests, .. } => check_len("digests", digests.len())?,
            Msg::Error { failed, .. } => check_len("failed", failed.len())?,
            Msg::Packet { packet, .. }
                if packet.len() > omnirig_fixtures::packet::MAX_PACKET_BYTES =>
            {
                return Err(HarnessError::Control {
                    channel: "decode".into(),
                    reason: format!("packet of {} bytes is too large", packet.len()),
                });
            }
            Msg::Packet { inline, .. } if inline.len() > crate::inline::MAX_INLINE => {
                return Err(HarnessError::Control {
                    channel: "decode".into(),
                    reason: format!(
                        "inline payload of {} bytes exceeds {}",
                        inline.len(),
                        crate::inline::MAX_INLINE
                    ),
                });
            }
            _ => {}
        }
        Ok(())
    }

    /// Frame body (msgpack with named fields).
    pub fn encode(&self) -> Result<Vec<u8>> {
        rmp_serde::to_vec_named(self).map_err(|e| HarnessError::Control {
            channel: "encode".into(),
            reason: e.to_string(),
        })
    }

    /// Decodes and validates a frame body.
    pub fn decode(body: &[u8]) -> Result<Msg> {
        if body.len() > MAX_FRAME {
            return Err(HarnessError::Control {
                channel: "decode".into(),
                reason: format!("frame of {} bytes exceeds {MAX_FRAME}", body.len()),
            });
        }
        let m: Msg = rmp_serde::from_slice(body).map_err(|e| HarnessError::Control {
            channel: "decode".into(),
            reason: format!("malformed message: {e}"),
        })?;
        m.validate()?;
        Ok(m)
    }
}

type Queue = (
    mpsc::UnboundedSender<Msg>,
    Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Msg>>>,
);

/// Per-key queues of received messages.
#[derive(Default)]
struct Mailboxes {
    map: Mutex<HashMap<String, Queue>>,
    /// Recently finished keys: late messages for them are dropped, not queued forever.
    done: Mutex<(
        std::collections::HashSet<String>,
        std::collections::VecDeque<String>,
    )>,
    /// Set when the link broke; waiters then fail with this reason.
    closed: Mutex<Option<String>>,
}

impl Mailboxes {
    fn queue(&self, key: &str) -> Queue {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let q = map.entry(key.to_string()).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            (tx, Arc::new(tokio::sync::Mutex::new(rx)))
        });
        (q.0.clone(), q.1.clone())
    }

    fn deliver(&self, msg: Msg) {
        if self
            .done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .contains(msg.key())
        {
            tracing::debug!(key = msg.key(), msg = msg.name(), "late message dropped");
            return;
        }
        let (tx, _) = self.queue(msg.key());
        let _ = tx.send(msg);
    }

    fn close(&self, reason: String) {
        let mut c = self.closed.lock().unwrap_or_else(|p| p.into_inner());
        if c.is_none() {
            *c = Some(reason);
        }
        drop(c);
        // Waking every waiter: a sentinel-free way is to drop the senders.
        self.map.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    fn closed(&self) -> Option<String> {
        self.closed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

#[derive(Clone)]
enum Out {
    Mem(Arc<Mailboxes>),
    Tcp(Arc<TcpSender>, Arc<TcpRx>),
    /// Across a simulated fabric: each message reserves its route like a slice and a
    /// delivery task hands it over when it lands, in sending order.
    Sim(
        omnirig_transports::transport::sim::Channel,
        mpsc::UnboundedSender<(tokio::time::Instant, Msg)>,
    ),
}

/// How long a TCP link's `recv` keeps polling before it parks. A reply on 127.0.0.1 comes
/// back within tens of microseconds, and waking a parked thread on a VM costs about as much
/// again per message (the engine's tcp transport polls for the same reason). The poll
/// yields to the runtime between checks, so the I/O driver and other tasks keep running,
/// and it only happens while a `recv` is waiting.
pub const TCP_RECV_SPIN: Duration = Duration::from_micros(50);

/// Bytes asked of the socket per read, beyond what the frame being read still needs.
const READ_CHUNK: usize = 64 << 10;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The sending half of a TCP link, shared by the link's clones and its writer task.
struct TcpTx {
    name: Arc<str>,
    wr: OwnedWriteHalf,
    state: Mutex<TxState>,
    /// Wakes the writer task: frames were queued, or the links are gone.
    wake: Notify,
    inbox: Arc<Mailboxes>,
}

#[derive(Default)]
struct TxState {
    /// Frames the socket would not take yet, in sending order. While any are queued, later
    /// frames queue behind them (never written directly), so the wire keeps the order.
    backlog: std::collections::VecDeque<Vec<u8>>,
    /// How much of the first queued frame is already on the socket.
    written: usize,
    /// Why writing failed: nothing more is sent.
    failed: Option<String>,
    /// Every link is gone: the writer task ends once the backlog is written.
    ended: bool,
    /// Sends written whole by the caller, and sends that went (at least partly) through
    /// the writer task.
    direct: u64,
    queued: u64,
}

/// Held by the link's clones only: when the last one drops, the writer task finishes the
/// backlog and ends, and with it the write half, which shuts the socket's sending side so
/// the peer sees the link close (as when the link is dropped today).
struct TcpSender(Arc<TcpTx>);

impl Drop for TcpSender {
    fn drop(&mut self) {
        lock(&self.0.state).ended = true;
        self.0.wake.notify_one();
    }
}

impl TcpTx {
    fn closed_err(&self, reason: &str) -> HarnessError {
        HarnessError::Control {
            channel: self.name.to_string(),
            reason: format!("link closed ({reason})"),
        }
    }

    /// Writing failed: the link closes with `reason`.
    fn fail(&self, st: &mut TxState, reason: String) -> HarnessError {
        tracing::debug!(%reason, "control link closed");
        st.backlog.clear();
        st.failed = Some(reason.clone());
        self.inbox.close(reason.clone());
        self.closed_err(&reason)
    }

    /// Appends `msg`'s frame (u32 BE length, msgpack body) to `out`. A message that does
    /// not encode closes the link, as a failed write does.
    fn encode_into(&self, out: &mut Vec<u8>, msg: &Msg) -> Result<()> {
        let at = out.len();
        out.extend_from_slice(&[0; 4]);
        if let Err(e) = rmp_serde::encode::write_named(out, msg) {
            let reason = format!("{}: encode: {e}", self.name);
            return Err(self.fail(&mut lock(&self.state), reason));
        }
        let len = (out.len() - at - 4) as u32;
        out[at..at + 4].copy_from_slice(&len.to_be_bytes());
        Ok(())
    }

    /// Writes `frames` on the socket from the caller when nothing is queued; what the
    /// socket would not take (all of it, while frames are queued) goes to the writer task.
    fn send_frames(&self, frames: Vec<u8>) -> Result<()> {
        let mut st = lock(&self.state);
        if let Some(r) = &st.failed {
            return Err(self.closed_err(r));
        }
        if st.backlog.is_empty() {
            let mut at = 0;
            while at < frames.len() {
                match self.wr.try_write(&frames[at..]) {
                    Ok(0) => {
                        let reason = format!("{}: write failed: socket took no bytes", self.name);
                        return Err(self.fail(&mut st, reason));
                    }
                    Ok(n) => at += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        let reason = format!("{}: write failed: {e}", self.name);
                        return Err(self.fail(&mut st, reason));
                    }
                }
            }
            if at == frames.len() {
                st.direct += 1;
                return Ok(());
            }
            st.written = at;
        }
        st.queued += 1;
        st.backlog.push_back(frames);
        drop(st);
        self.wake.notify_one();
        Ok(())
    }

    /// Writes the backlog until it is empty or the socket pushes back.
    fn drain(&self) -> Drain {
        let mut st = lock(&self.state);
        if st.failed.is_some() {
            return Drain::Stop;
        }
        let st = &mut *st;
        while let Some(front) = st.backlog.front() {
            match self.wr.try_write(&front[st.written..]) {
                Ok(0) => {
                    let reason = format!("{}: write failed: socket took no bytes", self.name);
                    self.fail(st, reason);
                    return Drain::Stop;
                }
                Ok(n) => {
                    let whole = st.written + n == front.len();
                    st.written += n;
                    if whole {
                        st.backlog.pop_front();
                        st.written = 0;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Drain::Blocked,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let reason = format!("{}: write failed: {e}", self.name);
                    self.fail(st, reason);
                    return Drain::Stop;
                }
            }
        }
        if st.ended { Drain::Stop } else { Drain::Empty }
    }
}

enum Drain {
    Empty,
    Blocked,
    Stop,
}

/// Writes what the callers' direct writes left, in order, whenever the socket takes it.
async fn write_task(tx: Arc<TcpTx>) {
    loop {
        match tx.drain() {
            Drain::Stop => return,
            // A wake-up sent since the backlog was checked is kept as a permit, not lost.
            Drain::Empty => tx.wake.notified().await,
            Drain::Blocked => {
                if let Err(e) = tx.wr.writable().await {
                    let reason = format!("{}: write failed: {e}", tx.name);
                    tx.fail(&mut lock(&tx.state), reason);
                    return;
                }
            }
        }
    }
}

/// The receiving half of a TCP link. Its reader task and any spinning `recv` both read the
/// socket, non-blocking and one at a time under `state`'s lock: whoever reads next
/// continues a frame the other left half-read, and frames are delivered in wire order.
struct TcpRx {
    name: Arc<str>,
    rd: OwnedReadHalf,
    state: Mutex<RxState>,
    inbox: Arc<Mailboxes>,
}

#[derive(Default)]
struct RxState {
    /// Bytes read and not yet delivered: at most the start of one frame between reads.
    buf: Vec<u8>,
    /// The link closed: nobody reads the socket again.
    dead: bool,
}

impl TcpRx {
    /// Reads what the socket holds now, if no other reader is at it (a spinning `recv`).
    fn poll(&self) {
        if let Ok(mut st) = self.state.try_lock() {
            self.pump(&mut st);
        }
    }

    /// Reads until the socket would block, delivering every complete frame; on an error,
    /// a frame over the cap or one that fails to decode, the link closes with the reason.
    /// False once the link is closed.
    fn pump(&self, st: &mut RxState) -> bool {
        if st.dead {
            return false;
        }
        match self.read_available(st) {
            Ok(()) => true,
            Err(reason) => {
                st.dead = true;
                st.buf = Vec::new();
                tracing::debug!(%reason, "control link closed");
                self.inbox.close(reason);
                false
            }
        }
    }

    fn read_available(&self, st: &mut RxState) -> std::result::Result<(), String> {
        loop {
            let need = self.deliver_frames(st)?;
            st.buf.reserve(need.max(READ_CHUNK));
            match self.rd.try_read_buf(&mut st.buf) {
                Ok(0) if st.buf.is_empty() => {
                    return Err(format!("{}: connection closed (end of stream)", self.name));
                }
                Ok(0) => {
                    return Err(format!(
                        "{}: connection closed mid-frame (end of stream)",
                        self.name
                    ));
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("{}: connection closed ({e})", self.name)),
            }
        }
    }

    /// Delivers the complete frames at the front of the buffer; returns how many bytes the
    /// next frame still lacks. The length is checked against the cap before its body is
    /// waited for.
    fn deliver_frames(&self, st: &mut RxState) -> std::result::Result<usize, String> {
        let mut at = 0;
        let need = loop {
            let rest = &st.buf[at..];
            let Some(head) = rest.first_chunk::<4>() else {
                break 4 - rest.len();
            };
            let len = u32::from_be_bytes(*head) as usize;
            if len > MAX_FRAME {
                return Err(format!(
                    "{}: frame of {len} bytes exceeds {MAX_FRAME}",
                    self.name
                ));
            }
            if rest.len() < 4 + len {
                break 4 + len - rest.len();
            }
            match Msg::decode(&rest[4..4 + len]) {
                Ok(m) => self.inbox.deliver(m),
                Err(e) => return Err(format!("{}: {e}", self.name)),
            }
            at += 4 + len;
        };
        st.buf.drain(..at);
        Ok(need)
    }
}

/// Reads frames whenever the socket has some and no spinning `recv` took them first.
async fn read_task(rx: Arc<TcpRx>) {
    loop {
        if !rx.pump(&mut lock(&rx.state)) {
            return;
        }
        if let Err(e) = rx.rd.readable().await {
            let mut st = lock(&rx.state);
            st.dead = true;
            rx.inbox
                .close(format!("{}: connection closed ({e})", rx.name));
            return;
        }
    }
}

/// One end of a control channel.
#[derive(Clone)]
pub struct Link {
    name: Arc<str>,
    out: Out,
    inbox: Arc<Mailboxes>,
    spin: Duration,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("name", &self.name).finish()
    }
}

impl Link {
    /// Two connected in-process ends.
    pub fn pair(name: &str) -> (Link, Link) {
        let (a, b) = (
            Arc::new(Mailboxes::default()),
            Arc::new(Mailboxes::default()),
        );
        (
            Link {
                name: name.into(),
                out: Out::Mem(b.clone()),
                inbox: a.clone(),
                spin: Duration::ZERO,
            },
            Link {
                name: name.into(),
                out: Out::Mem(a),
                inbox: b,
                spin: Duration::ZERO,
            },
        )
    }

    /// Two in-process ends whose messages cross `fabric` from `a` to `b` and back (`node` or
    /// `node/nic` each), paying its latency and queueing on its NICs and links like the
    /// tensor bytes do. Must be called inside a tokio runtime (it starts the delivery tasks).
    pub fn pair_over(
        name: &str,
        fabric: &Arc<omnirig_transports::Fabric>,
        a: &str,
        b: &str,
    ) -> Result<(Link, Link)> {
        Self::pair_over_hosts(name, fabric, a, b, None)
    }

    /// As [`pair_over`](Self::pair_over), each message also costing `cpu`'s per-message
    /// work on the sending host (before it leaves) and on the receiving one (before it is
    /// delivered): encoding, the syscall and the wake-up of a real control channel. `cpu`
    /// names the stage processes at `a` and `b`: a message reaching one that is parked
    /// waits for it to wake ([`Cpu::wake`](crate::host::Cpu::wake)).
    pub fn pair_over_hosts(
        name: &str,
        fabric: &Arc<omnirig_transports::Fabric>,
        a: &str,
        b: &str,
        cpu: Option<(&Arc<crate::host::Cpu>, (&str, &str))>,
    ) -> Result<(Link, Link)> {
        use omnirig_transports::transport::sim::Channel;
        let setup = |e: omnirig_transports::Error| HarnessError::Setup(format!("{name}: {e}"));
        let (ma, mb) = (
            Arc::new(Mailboxes::default()),
            Arc::new(Mailboxes::default()),
        );
        type Charged = (
            Arc<crate::host::Cpu>,
            Arc<crate::host::Host>,
            Arc<crate::host::Host>,
            Duration,
            (String, String),
        );
        // (model, sending host, receiving host, work per message on each, sending and
        // receiving stage worker), when CPU is charged; each end is (node, process).
        let charged = |(from, pfrom): (&str, &str), (to, pto): (&str, &str)| -> Option<Charged> {
            let (c, _) = cpu?;
            (!c.spec().is_free()).then_some((
                c.clone(),
                c.host(from)?,
                c.host(to)?,
                c.message(),
                (
                    crate::host::control_thread(pfrom),
                    crate::host::control_thread(pto),
                ),
            ))
        };
        let (pa, pb) = cpu.map_or(("", ""), |(_, p)| p);
        let out = |to: &Arc<Mailboxes>, ch: Channel, hosts: Option<Charged>| {
            let (tx, mut rx) = mpsc::unbounded_channel::<(tokio::time::Instant, Msg)>();
            let to = to.clone();
            tokio::spawn(async move {
                while let Some((at, msg)) = rx.recv().await {
                    match &hosts {
                        // One message at a time per direction, as the frames of one
                        // socket are: in order, the sender's work first. Its departure
                        // was reserved when it was sent, so the sender's work delays only
                        // its delivery. A parked receiver wakes before it reads it.
                        Some((cpu, src, dst, w, (from, to))) => {
                            cpu.touch(from);
                            src.run(*w).await;
                            tokio::time::sleep_until(at).await;
                            cpu.wake(to).await;
                            dst.run(*w).await;
                        }
                        None => tokio::time::sleep_until(at).await,
                    }
                    to.deliver(msg);
                }
            });
            Out::Sim(ch, tx)
        };
        let ab = Channel::new(fabric, a, b, &format!("{name}>")).map_err(setup)?;
        let ba = Channel::new(fabric, b, a, &format!("{name}<")).map_err(setup)?;
        Ok((
            Link {
                name: name.into(),
                out: out(&mb, ab, charged((a, pa), (b, pb))),
                inbox: ma.clone(),
                spin: Duration::ZERO,
            },
            Link {
                name: name.into(),
                out: out(&ma, ba, charged((b, pb), (a, pa))),
                inbox: mb,
                spin: Duration::ZERO,
            },
        ))
    }

    /// A link over a connected TCP stream. `send` writes on the socket itself and leaves
    /// only what the socket would not take to a writer task; a reader task reads frames, and
    /// so does a spinning `recv` (see [`TcpRx`]).
    pub fn tcp(name: &str, stream: TcpStream) -> Link {
        let (link, rx) = Link::tcp_unread(name, stream);
        tokio::spawn(read_task(rx));
        link
    }

    /// A TCP link whose reader task the caller starts ([`read_task`] on the returned half):
    /// tests use it to make a spinning `recv` the only reader for a while.
    fn tcp_unread(name: &str, stream: TcpStream) -> (Link, Arc<TcpRx>) {
        let _ = stream.set_nodelay(true);
        let (rd, wr) = stream.into_split();
        let inbox = Arc::new(Mailboxes::default());
        let name: Arc<str> = name.into();
        let tx = Arc::new(TcpTx {
            name: name.clone(),
            wr,
            state: Mutex::new(TxState::default()),
            wake: Notify::new(),
            inbox: inbox.clone(),
        });
        tokio::spawn(write_task(tx.clone()));
        let rx = Arc::new(TcpRx {
            name: name.clone(),
            rd,
            state: Mutex::new(RxState::default()),
            inbox: inbox.clone(),
        });
        let link = Link {
            name,
            out: Out::Tcp(Arc::new(TcpSender(tx)), rx.clone()),
            inbox,
            spin: TCP_RECV_SPIN,
        };
        (link, rx)
    }

    /// Sets how long `recv` polls before parking (zero: park at once).
    pub fn with_spin(mut self, spin: Duration) -> Link {
        self.spin = spin;
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn send(&self, msg: Msg) -> Result<()> {
        match &self.out {
            Out::Mem(peer) => {
                peer.deliver(msg);
                Ok(())
            }
            Out::Tcp(tx, _) => {
                let mut frames = Vec::new();
                tx.0.encode_into(&mut frames, &msg)?;
                tx.0.send_frames(frames)
            }
            Out::Sim(ch, tx) => {
                // Its size on the wire is its TCP frame's: length prefix and msgpack body.
                let bytes = 4 + msg.encode().map_or(0, |b| b.len() as u64);
                let at = ch.send(bytes, &format!("{} {}", msg.name(), msg.key()));
                tx.send((at, msg)).map_err(|_| HarnessError::Control {
                    channel: self.name.to_string(),
                    reason: "link closed".into(),
                })
            }
        }
    }

    /// Sends `msgs` in order; over TCP, in one write (an offer and the inline packet that
    /// follows it cost one system call and, on the far side, one read).
    pub fn send_all(&self, msgs: Vec<Msg>) -> Result<()> {
        match &self.out {
            Out::Tcp(tx, _) => {
                let mut frames = Vec::new();
                for m in &msgs {
                    tx.0.encode_into(&mut frames, m)?;
                }
                tx.0.send_frames(frames)
            }
            _ => msgs.into_iter().try_for_each(|m| self.send(m)),
        }
    }

    /// The message for `key` that has already arrived, if any; never waits (and yields
    /// nothing while another task is receiving for `key`).
    pub fn try_recv(&self, key: &str) -> Option<Msg> {
        let (tx, rx) = self.inbox.queue(key);
        drop(tx);
        let mut rx = rx.try_lock().ok()?;
        rx.try_recv().ok()
    }

    /// The next message for `key`, waiting up to `timeout`.
    pub async fn recv(&self, key: &str, timeout: Duration) -> Result<Msg> {
        let err = |reason: String| HarnessError::Control {
            channel: self.name.to_string(),
            reason,
        };
        if let Some(r) = self.inbox.closed() {
            // Drain what arrived before the close.
            let (_, rx) = self.inbox.queue(key);
            if let Ok(m) = rx.lock().await.try_recv() {
                return Ok(m);
            }
            return Err(err(r));
        }
        let (tx, rx) = self.inbox.queue(key);
        drop(tx);
        let mut rx = rx.lock().await;
        if !self.spin.is_zero() {
            let until = std::time::Instant::now() + self.spin.min(timeout);
            loop {
                match rx.try_recv() {
                    Ok(m) => return Ok(m),
                    Err(mpsc::error::TryRecvError::Empty) if std::time::Instant::now() < until => {
                        // Read the socket here rather than wait for the reader task to be
                        // woken and scheduled.
                        if let Out::Tcp(_, tcp) = &self.out {
                            tcp.poll();
                            if let Ok(m) = rx.try_recv() {
                                return Ok(m);
                            }
                        }
                        tokio::task::yield_now().await
                    }
                    Err(_) => break,
                }
            }
        }
        match tokio::time::timeout(timeout, rx.recv()).await {
            Ok(Some(m)) => Ok(m),
            Ok(None) => Err(err(self
                .inbox
                .closed()
                .unwrap_or_else(|| "link closed".into()))),
            Err(_) => Err(HarnessError::ControlTimeout {
                channel: self.name.to_string(),
                key: key.to_string(),
                timeout,
            }),
        }
    }

    /// Drops `key`'s mailbox (the request is over on this side).
    pub fn forget(&self, key: &str) {
        const REMEMBER: usize = 65536;
        if !key.is_empty() {
            let mut d = self.inbox.done.lock().unwrap_or_else(|p| p.into_inner());
            if d.0.insert(key.to_string()) {
                d.1.push_back(key.to_string());
            }
            while d.1.len() > REMEMBER {
                if let Some(k) = d.1.pop_front() {
                    d.0.remove(&k);
                }
            }
        }
        self.inbox
            .map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }

    /// Keys with a mailbox still open (leak checks).
    pub fn open_keys(&self) -> usize {
        self.inbox
            .map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnirig_transports::Access;
    use tokio::io::AsyncWriteExt;

    fn grant() -> Grant {
        Grant {
            segment: "s".into(),
            buffer: 1,
            offset: 0,
            len: 8,
            epoch: 1,
            token: 2,
            access: Access::Write,
            keys: Vec::new(),
        }
    }

    #[test]
    fn messages_round_trip_and_bad_frames_are_refused() {
        let m = Msg::StageReserve {
            request: "r1".into(),
            grants: vec![NamedGrant {
                tensor: "codes.audio".into(),
                grant: grant(),
            }],
        };
        assert_eq!(Msg::decode(&m.encode().unwrap()).unwrap(), m);
        assert!(Msg::decode(b"\xc1garbage").is_err());
        let long = Msg::Refuse {
            request: "x".repeat(MAX_ID + 1),
            cause: String::new(),
            kind: Default::default(),
        };
        assert!(Msg::decode(&long.encode().unwrap()).is_err());
        let mut g = grant();
        g.len = 0;
        let zero = Msg::StageReserve {
            request: "r".into(),
            grants: vec![NamedGrant {
                tensor: "t".into(),
                grant: g,
            }],
        };
        assert!(Msg::decode(&zero.encode().unwrap()).is_err());
    }

    #[tokio::test]
    async fn late_messages_for_a_forgotten_request_are_dropped() {
        let (a, b) = Link::pair("t");
        b.forget("r1");
        a.send(Msg::Refuse {
            request: "r1".into(),
            cause: "late".into(),
            kind: Default::default(),
        })
        .unwrap();
        assert_eq!(b.open_keys(), 0);
        a.send(Msg::Refuse {
            request: "r2".into(),
            cause: String::new(),
            kind: Default::default(),
        })
        .unwrap();
        assert_eq!(b.open_keys(), 1);
        b.recv("r2", Duration::from_secs(1)).await.unwrap();
        b.forget("r2");
        assert_eq!(b.open_keys(), 0);
    }

    #[tokio::test]
    async fn a_wait_that_runs_out_is_a_timeout_naming_the_key() {
        use crate::error::{Cause, FailureKind};
        let (_a, b) = Link::pair("t");
        // A deadline already spent (0 ns) and a short one: both are timeouts, not `other`.
        for wait in [Duration::ZERO, Duration::from_millis(20)] {
            let e = b.recv("r9", wait).await.unwrap_err();
            assert_eq!(e.failure_kind(), FailureKind::TimedOut, "{e}");
            match &e {
                HarnessError::ControlTimeout { key, timeout, .. } => {
                    assert_eq!(key, "r9");
                    assert_eq!(*timeout, wait);
                }
                other => panic!("expected a control timeout, got {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn routes_by_request_over_tcp() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (c, s) = tokio::join!(TcpStream::connect(addr), l.accept());
        let (a, b) = (Link::tcp("a", c.unwrap()), Link::tcp("b", s.unwrap().0));
        for r in ["r1", "r2"] {
            a.send(Msg::Refuse {
                request: r.into(),
                cause: r.into(),
                kind: Default::default(),
            })
            .unwrap();
        }
        let t = Duration::from_secs(5);
        assert!(
            matches!(b.recv("r2", t).await.unwrap(), Msg::Refuse { cause, .. } if cause == "r2")
        );
        assert!(
            matches!(b.recv("r1", t).await.unwrap(), Msg::Refuse { cause, .. } if cause == "r1")
        );
        // A frame over the cap closes the link, and waiters get the reason.
        let (c, s) = tokio::join!(TcpStream::connect(addr), l.accept());
        let mut raw = c.unwrap();
        let victim = Link::tcp("victim", s.unwrap().0);
        raw.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        let err = victim.recv("r3", t).await.unwrap_err();
        // A closed link is a channel failure, not a timeout.
        assert!(matches!(err, HarnessError::Control { .. }), "{err:?}");
        let err = err.to_string();
        assert!(err.contains("exceeds"), "{err}");
    }

    fn refuse(request: &str, cause: String) -> Msg {
        Msg::Refuse {
            request: request.into(),
            cause,
            kind: Default::default(),
        }
    }

    async fn connected() -> (TcpStream, TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (c, s) = tokio::join!(TcpStream::connect(addr), l.accept());
        (c.unwrap(), s.unwrap().0)
    }

    fn counts(l: &Link) -> (u64, u64) {
        match &l.out {
            Out::Tcp(tx, _) => {
                let st = lock(&tx.0.state);
                (st.direct, st.queued)
            }
            _ => unreachable!(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn direct_and_queued_frames_arrive_in_order() {
        let (c, s) = connected().await;
        let a = Link::tcp("a", c);
        let t = Duration::from_secs(10);
        let mut sent = 0;
        let mut small = |a: &Link, n: usize| {
            for _ in 0..n {
                a.send(refuse("r", sent.to_string())).unwrap();
                sent += 1;
            }
        };
        // The peer does not read yet: large frames fill both socket buffers until a write
        // would block, and the small frames after them must queue behind.
        small(&a, 3);
        let big = |i: usize| Msg::Packet {
            request: "big".into(),
            packet: Vec::new(),
            writing_us: i as u64,
            inline: vec![i as u8; 3 << 20],
        };
        for i in 0..8 {
            a.send(big(i)).unwrap();
        }
        small(&a, 50);
        let (direct, queued) = counts(&a);
        assert!(direct >= 3, "{direct} direct");
        assert!(queued >= 51, "{queued} queued");
        let b = Link::tcp("b", s);
        for i in 0..8 {
            match b.recv("big", t).await.unwrap() {
                Msg::Packet { writing_us, .. } => assert_eq!(writing_us, i),
                other => panic!("{other:?}"),
            }
        }
        // Once the backlog is written, sends go direct again, still after it.
        let until = std::time::Instant::now() + t;
        while !lock(
            &match &a.out {
                Out::Tcp(tx, _) => tx.0.clone(),
                _ => unreachable!(),
            }
            .state,
        )
        .backlog
        .is_empty()
        {
            assert!(std::time::Instant::now() < until);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let before = counts(&a).0;
        small(&a, 3);
        assert_eq!(counts(&a).0, before + 3);
        for i in 0..sent {
            match b.recv("r", t).await.unwrap() {
                Msg::Refuse { cause, .. } => assert_eq!(cause, i.to_string()),
                other => panic!("{other:?}"),
            }
        }
        // One write for several messages, in order.
        a.send_all(vec![refuse("q", "x".into()), refuse("q", "y".into())])
            .unwrap();
        for c in ["x", "y"] {
            assert!(
                matches!(b.recv("q", t).await.unwrap(), Msg::Refuse { cause, .. } if cause == c)
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_spinning_recv_reads_a_frame_split_across_reads() {
        let (mut raw, s) = connected().await;
        // No reader task yet: only the spinning recv reads the socket.
        let (victim, rx) = Link::tcp_unread("victim", s);
        let victim = victim.with_spin(Duration::from_secs(5));
        let mut frame = Vec::new();
        for i in 0..2 {
            let body = refuse("r", format!("m{i}")).encode().unwrap();
            frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
            frame.extend_from_slice(&body);
        }
        let one = frame.len() / 2;
        let (first, rest) = frame.split_at(one / 2);
        let writer = tokio::spawn({
            let (first, rest) = (first.to_vec(), rest.to_vec());
            async move {
                raw.write_all(&first).await.unwrap();
                tokio::time::sleep(Duration::from_millis(30)).await;
                raw.write_all(&rest[..rest.len() - 3]).await.unwrap();
                (raw, rest[rest.len() - 3..].to_vec())
            }
        });
        let t = Duration::from_secs(5);
        assert!(
            matches!(victim.recv("r", t).await.unwrap(), Msg::Refuse { cause, .. } if cause == "m0")
        );
        let (mut raw, tail) = writer.await.unwrap();
        // The second frame is short of its last 3 bytes; a spin that times out leaves them
        // pending, and the reader task, started now, finishes the frame.
        let short = victim.clone().with_spin(Duration::from_millis(20));
        let e = short
            .recv("r", Duration::from_millis(20))
            .await
            .unwrap_err();
        assert!(matches!(e, HarnessError::ControlTimeout { .. }), "{e:?}");
        tokio::spawn(read_task(rx));
        raw.write_all(&tail).await.unwrap();
        let parked = victim.with_spin(Duration::ZERO);
        assert!(
            matches!(parked.recv("r", t).await.unwrap(), Msg::Refuse { cause, .. } if cause == "m1")
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_spinning_recv_closes_the_link_on_a_frame_over_the_cap() {
        let (mut raw, s) = connected().await;
        let (victim, _rx) = Link::tcp_unread("victim", s);
        let victim = victim.with_spin(Duration::from_secs(5));
        raw.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        let err = victim.recv("r", Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(err, HarnessError::Control { .. }), "{err:?}");
        assert!(err.to_string().contains("exceeds"), "{err}");
        // Sends still fail cleanly once the peer is gone.
        drop(raw);
    }
}
