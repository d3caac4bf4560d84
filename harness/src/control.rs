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
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

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
    Tcp(mpsc::UnboundedSender<Msg>),
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
    /// delivered): encoding, the syscall and the wake-up of a real control channel.
    pub fn pair_over_hosts(
        name: &str,
        fabric: &Arc<omnirig_transports::Fabric>,
        a: &str,
        b: &str,
        cpu: Option<&Arc<crate::host::Cpu>>,
    ) -> Result<(Link, Link)> {
        use omnirig_transports::transport::sim::Channel;
        let setup = |e: omnirig_transports::Error| HarnessError::Setup(format!("{name}: {e}"));
        let (ma, mb) = (
            Arc::new(Mailboxes::default()),
            Arc::new(Mailboxes::default()),
        );
        // (sending host, receiving host, work per message on each), when CPU is charged.
        let hosts = |from: &str, to: &str| {
            let c = cpu?;
            let w = c.message();
            (!w.is_zero()).then_some((c.host(from)?, c.host(to)?, w))
        };
        let out = |to: &Arc<Mailboxes>, ch: Channel, hosts: Option<(_, _, _)>| {
            let (tx, mut rx) = mpsc::unbounded_channel::<(tokio::time::Instant, Msg)>();
            let to = to.clone();
            tokio::spawn(async move {
                while let Some((at, msg)) = rx.recv().await {
                    match &hosts {
                        // One message at a time per direction, as the frames of one
                        // socket are: in order, the sender's work first. Its departure
                        // was reserved when it was sent, so the sender's work delays only
                        // its delivery.
                        Some((src, dst, w)) => {
                            let (src, dst): (&Arc<crate::host::Host>, &Arc<crate::host::Host>) =
                                (src, dst);
                            src.run(*w).await;
                            tokio::time::sleep_until(at).await;
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
                out: out(&mb, ab, hosts(a, b)),
                inbox: ma.clone(),
                spin: Duration::ZERO,
            },
            Link {
                name: name.into(),
                out: out(&ma, ba, hosts(b, a)),
                inbox: mb,
                spin: Duration::ZERO,
            },
        ))
    }

    /// A link over a connected TCP stream: a writer and a reader task.
    pub fn tcp(name: &str, stream: TcpStream) -> Link {
        let _ = stream.set_nodelay(true);
        let (mut rd, mut wr) = stream.into_split();
        let inbox = Arc::new(Mailboxes::default());
        let (tx, mut rx) = mpsc::unbounded_channel::<Msg>();
        let name: Arc<str> = name.into();
        let (n1, n2, ib1, ib2) = (name.clone(), name.clone(), inbox.clone(), inbox.clone());
        tokio::spawn(async move {
            while let Some(m) = rx.recv().await {
                let body = match m.encode() {
                    Ok(b) => b,
                    Err(e) => {
                        ib1.close(format!("{n1}: {e}"));
                        return;
                    }
                };
                let mut frame = Vec::with_capacity(4 + body.len());
                frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
                frame.extend_from_slice(&body);
                if let Err(e) = wr.write_all(&frame).await {
                    ib1.close(format!("{n1}: write failed: {e}"));
                    return;
                }
            }
        });
        tokio::spawn(async move {
            let reason = loop {
                let mut len = [0u8; 4];
                if let Err(e) = rd.read_exact(&mut len).await {
                    break format!("{n2}: connection closed ({e})");
                }
                let len = u32::from_be_bytes(len) as usize;
                if len > MAX_FRAME {
                    break format!("{n2}: frame of {len} bytes exceeds {MAX_FRAME}");
                }
                let mut body = vec![0u8; len];
                if let Err(e) = rd.read_exact(&mut body).await {
                    break format!("{n2}: connection closed mid-frame ({e})");
                }
                match Msg::decode(&body) {
                    Ok(m) => ib2.deliver(m),
                    Err(e) => break format!("{n2}: {e}"),
                }
            };
            tracing::debug!(%reason, "control link closed");
            ib2.close(reason);
        });
        Link {
            name,
            out: Out::Tcp(tx),
            inbox,
            spin: TCP_RECV_SPIN,
        }
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
            Out::Tcp(tx) => tx.send(msg).map_err(|_| HarnessError::Control {
                channel: self.name.to_string(),
                reason: "link closed".into(),
            }),
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
}
