//! `omnirig bench hop`: one pipeline hop with its real payloads, tensor-native (omnirig) against
//! the current path (pickle over ZMQ, `ci/baseline/pickle_hop.py`), same bytes, same run.
//!
//! The omnirig side is a focused hop driver over the engine that follows the harness
//! connectors' protocol message for message, on the harness's own control channel
//! ([`omnirig_harness::control::Link`], framed msgpack over TCP) and pools:
//!
//! 1. producer -> consumer `Offer`;
//! 2. consumer reserves pool space per tensor and grants it: `StageReserve` (one grant per
//!    tensor; a KV layer's K or V run is one grant, as the KV connector's contiguous runs);
//! 3. producer writes every tensor in one engine batch (one request per tensor);
//! 4. producer -> consumer `Packet` (packet v1 sidecar, stage hops) or `Finish` (EC, KV);
//! 5. consumer revokes the grants (the fence: the tensors are now usable), decodes the
//!    sidecar, checks names, dtypes and shapes, and acks (`Finish` back).
//!
//! With `--inline-below N`, a hop whose payload is at most N bytes skips 1-3: the producer
//! sends the sidecar and the tensor bytes in one control message and the consumer copies them
//! into its pool (the small-payload cure; one round trip like the pickle path).
//!
//! The round trip is timed at the producer from `Offer` to the ack, the way the baseline is
//! timed from `pickle.dumps` to its ack. The first round trip of every case and side is a
//! warm-up whose bytes the consumer checks against the fixtures' XXH3-128 digests (the
//! Python receiver does the same), so both sides prove they moved the right bytes.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use omnirig_fixtures::{
    Digest128, ModelCard, Packet, PayloadKind, RequestSpec, TensorEntry, TensorSpec,
    generate_tensor, packet::TransferKey, plan_request,
};
use omnirig_harness::Scenario;
use omnirig_harness::control::{Link, Msg, NamedDigest, NamedGrant};
use omnirig_harness::inline::{
    InlineHandler, InlineReceiver, InlineSender, SpanReader, packet_layout,
};
use omnirig_harness::pool::{Lease, Pool};
use omnirig_transports::{
    Access, Buffer, Engine, EngineConfig, Grant, InProcessStore, Request, TcpConfig, TransportKind,
};
use serde::{Deserialize, Serialize};

use super::{Results, Row, Samples, human_size, iterations};

pub const HOP_TIMEOUT: Duration = Duration::from_secs(120);

fn progress(msg: &str) {
    eprintln!("[bench hop] {msg}");
}

/// Parses a hop name as the CLI spells it.
pub fn parse_hop(s: &str) -> anyhow::Result<PayloadKind> {
    Ok(match s {
        "ec" | "encoder_embeddings" => PayloadKind::EncoderEmbeddings,
        "kv" | "kv_cache" => PayloadKind::KvCache,
        "thinker-talker" | "thinker_to_talker" => PayloadKind::ThinkerToTalker,
        "talker-code2wav" | "talker_to_code2wav" => PayloadKind::TalkerToCode2wav,
        other => bail!("unknown hop {other:?}: ec, kv, thinker-talker, talker-code2wav"),
    })
}

pub fn hop_label(k: PayloadKind) -> &'static str {
    match k {
        PayloadKind::EncoderEmbeddings => "ec",
        PayloadKind::KvCache => "kv",
        PayloadKind::ThinkerToTalker => "thinker-talker",
        PayloadKind::TalkerToCode2wav => "talker-code2wav",
    }
}

// ---------------------------------------------------------------- payloads

/// One hop of one request: its tensors (fixture bytes, at `offset` in the producer's source
/// buffer) and their digests.
#[derive(Debug, Clone)]
pub struct HopPayload {
    pub case: String,
    pub kind: PayloadKind,
    pub spec: RequestSpec,
    pub tensors: Vec<(TensorSpec, u64, Digest128)>,
    pub total: u64,
}

/// The distinct requests (by label) of a scenario that carry `kind`, planned.
pub fn scenario_cases(
    scenario: &Scenario,
    kind: PayloadKind,
) -> anyhow::Result<Vec<(String, RequestSpec, Vec<TensorSpec>)>> {
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for r in scenario.expand()? {
        if seen.contains(&r.label) {
            continue;
        }
        seen.push(r.label.clone());
        if let Some(h) = r.plan.hop(kind) {
            out.push((r.label.clone(), r.spec.clone(), h.tensors.clone()));
        }
    }
    Ok(out)
}

/// Generates every case's tensors into one registered source buffer (8-byte aligned
/// offsets) and returns the payloads; also writes `dir/<case>.bin` + a manifest entry for the
/// Python baseline when `dir` is given.
pub fn stage_payloads(
    engine: &Engine,
    kind: PayloadKind,
    cases: &[(String, RequestSpec, Vec<TensorSpec>)],
    dir: Option<&Path>,
) -> anyhow::Result<(Buffer, Vec<HopPayload>, Vec<serde_json::Value>)> {
    let total: u64 = cases
        .iter()
        .flat_map(|c| c.2.iter())
        .map(|t| t.byte_length.next_multiple_of(64))
        .sum();
    let src = engine.allocate(total.max(4096))?;
    let mut off = 0;
    let mut payloads = Vec::new();
    let mut manifest = Vec::new();
    for (case, spec, tensors) in cases {
        let mut p = HopPayload {
            case: case.clone(),
            kind,
            spec: spec.clone(),
            tensors: Vec::new(),
            total: 0,
        };
        let mut blob = Vec::new();
        let mut entries = Vec::new();
        for t in tensors {
            let bytes = generate_tensor(spec.seed, t);
            let d = Digest128::of_bytes(&bytes);
            src.write(off, &bytes)?;
            if dir.is_some() {
                entries.push(serde_json::json!({
                    "name": t.name, "dtype": t.dtype.as_str(), "shape": t.shape,
                    "offset": blob.len(), "len": t.byte_length, "digest": d.to_hex(),
                }));
                blob.extend_from_slice(&bytes);
            }
            p.tensors.push((t.clone(), off, d));
            p.total += t.byte_length;
            off += t.byte_length.next_multiple_of(64);
        }
        if let Some(dir) = dir {
            let path = dir.join(format!("{}-{case}.bin", hop_label(kind)));
            std::fs::write(&path, &blob).with_context(|| format!("writing {}", path.display()))?;
            manifest.push(serde_json::json!({
                "name": case, "payload": path, "tensors": entries,
            }));
        }
        payloads.push(p);
    }
    Ok((src, payloads, manifest))
}

// ---------------------------------------------------------------- the omnirig hop

/// The producer end of a hop.
pub struct Producer {
    pub engine: Arc<Engine>,
    pub link: Link,
    pub src: Buffer,
    /// Payloads of at most this many bytes travel inline in the packet (0: never).
    pub inline_below: u64,
    /// The peer's inline channel ([`omnirig_harness::inline`]); without it inline payloads
    /// ride the control channel.
    pub inline: Option<Arc<InlineSender>>,
    /// Stage hops: the consumer grants each handoff's destination ahead (a credit, sent when
    /// the request is announced and again with each ack), so a handoff is write -> packet ->
    /// ack, with no offer / reservation round trip.
    pub credits: bool,
    /// Credits that arrived while this side waited for something else, by request.
    pub held: std::sync::Mutex<std::collections::HashMap<String, Vec<NamedGrant>>>,
}

/// Inline bodies on the control channel start with this, which no msgpack sidecar does.
const INLINE_MAGIC: &[u8; 4] = b"INL\x01";

/// Run-key suffix asking the consumer to grant ahead.
const CREDITS_FLAG: &str = "+credits";

/// Name of the one grant a stage hop's consumer returns: it covers the whole packet.
pub const PACKET_GRANT: &str = "packet";

/// Merges writes that continue each other on both sides (same source buffer, same grant):
/// one request per contiguous run, so a packet staged contiguously travels as one transfer
/// (a few large slices instead of a round trip per small tensor).
pub fn coalesce(reqs: Vec<Request>) -> Vec<Request> {
    let mut out: Vec<Request> = Vec::with_capacity(reqs.len());
    for r in reqs {
        if let Some(last) = out.last_mut()
            && last.kind == r.kind
            && last.tag == r.tag
            && last.local == r.local
            && last.grant == r.grant
            && last.local_offset + last.len == r.local_offset
            && last.grant_offset + last.len == r.grant_offset
        {
            last.len += r.len;
            continue;
        }
        out.push(r);
    }
    out
}

fn hop_uses_packet(kind: PayloadKind) -> bool {
    matches!(
        kind,
        PayloadKind::ThinkerToTalker | PayloadKind::TalkerToCode2wav
    )
}

/// `Run` announces a request (and which hop of it) to the consumer, as the orchestrator does.
pub fn announce(link: &Link, rid: &str, p: &HopPayload, credits: bool) -> anyhow::Result<()> {
    let flag = if credits && hop_uses_packet(p.kind) {
        CREDITS_FLAG
    } else {
        ""
    };
    link.send(Msg::Run {
        request: format!("{}{flag}|{rid}", hop_label(p.kind)),
        spec: p.spec.clone(),
    })?;
    Ok(())
}

/// The consumer forgets a request.
pub fn retire(link: &Link, rid: &str) -> anyhow::Result<()> {
    link.send(Msg::Refuse {
        request: rid.into(),
        cause: "done".into(),
        kind: Default::default(),
    })?;
    link.forget(rid);
    Ok(())
}

impl Producer {
    /// Retires a request (see [`retire`]), dropping any credit held for it: the consumer
    /// revokes it when it sees the request retired.
    pub fn retire(&self, rid: &str) -> anyhow::Result<()> {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(rid);
        retire(&self.link, rid)
    }

    /// Announces a request to the consumer (see [`announce`]).
    pub fn announce(&self, rid: &str, p: &HopPayload) -> anyhow::Result<()> {
        announce(&self.link, rid, p, self.credits)
    }

    /// One hop round trip: offer, reservation, write, packet/finish, ack (with credits:
    /// write, packet, ack).
    pub async fn send(&self, rid: &str, p: &HopPayload) -> anyhow::Result<()> {
        let link = &self.link;
        if p.total <= self.inline_below
            && let Some(inline) = &self.inline
        {
            // One round trip on the busy-polled inline channel; its status is the ack.
            let sidecar = Packet::new(rid, p.kind, 0, true, self.entries(p, None)).to_msgpack()?;
            // The packet's bytes go from registered memory straight to the socket when the
            // tensors already sit in the packet layout (they do when staged contiguously).
            let (at, span) = packet_layout(p.tensors.iter().map(|(t, _, _)| &t.byte_length));
            let base = p.tensors.first().map(|t| t.1).unwrap_or(0);
            let laid_out = p
                .tensors
                .iter()
                .zip(&at)
                .all(|((_, off, _), a)| *off == base + a);
            let send = || -> anyhow::Result<()> {
                if laid_out {
                    self.src.view(base, span, |b| inline.send(&sidecar, b))??;
                } else {
                    let mut staged = vec![0u8; span as usize];
                    for ((t, off, _), a) in p.tensors.iter().zip(&at) {
                        let a = *a as usize;
                        self.src
                            .read(*off, &mut staged[a..a + t.byte_length as usize])?;
                    }
                    inline.send(&sidecar, &staged)?;
                }
                Ok(())
            };
            // Synchronous and short; on a multi-thread runtime, let other tasks move off
            // this worker while it waits for the status.
            match tokio::runtime::Handle::current().runtime_flavor() {
                tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(send)?,
                _ => send()?,
            }
            return Ok(());
        }
        if p.total <= self.inline_below {
            // Inline: sidecar + bytes in one control message.
            let mut body = Vec::with_capacity(p.total as usize + 512);
            let entries = self.entries(p, None);
            let sidecar = Packet::new(rid, p.kind, 0, true, entries).to_msgpack()?;
            body.extend_from_slice(INLINE_MAGIC);
            body.extend_from_slice(&(sidecar.len() as u32).to_be_bytes());
            body.extend_from_slice(&sidecar);
            for (t, off, _) in &p.tensors {
                self.src
                    .view(*off, t.byte_length, |b| body.extend_from_slice(b))?;
            }
            link.send(Msg::Packet {
                request: rid.into(),
                packet: body,
                writing_us: 0,
                inline: vec![],
            })?;
        } else {
            // With credits the destination was granted ahead; else ask for it now.
            if !(self.credits && hop_uses_packet(p.kind)) {
                link.send(Msg::Offer {
                    request: rid.into(),
                })?;
            }
            let held = self
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(rid);
            let grants = match held {
                Some(g) => g,
                None => match link.recv(rid, HOP_TIMEOUT).await? {
                    Msg::StageReserve { grants, .. } => grants,
                    Msg::Refuse { cause, .. } => bail!("consumer refused: {cause}"),
                    other => bail!("unexpected {} from the consumer", other.name()),
                },
            };
            let mut reqs = Vec::with_capacity(p.tensors.len());
            let mut used = Vec::with_capacity(p.tensors.len());
            if hop_uses_packet(p.kind) {
                // One grant for the packet; each tensor at its place in the packet layout.
                let g = match grants.as_slice() {
                    [g] if g.tensor == PACKET_GRANT => &g.grant,
                    _ => bail!("expected one {PACKET_GRANT:?} grant, got {}", grants.len()),
                };
                let (at, span) = packet_layout(p.tensors.iter().map(|(t, _, _)| &t.byte_length));
                if span > g.len {
                    bail!("packet grant of {} bytes for a {span}-byte packet", g.len);
                }
                for ((t, off, _), at) in p.tensors.iter().zip(at) {
                    reqs.push(Request::write(&self.src, *off, g, at, t.byte_length));
                    used.push((g.clone(), at));
                }
            } else {
                for (t, off, _) in &p.tensors {
                    let g = grants
                        .iter()
                        .find(|g| g.tensor == t.name)
                        .with_context(|| format!("no grant for {}", t.name))?;
                    reqs.push(Request::write(&self.src, *off, &g.grant, 0, t.byte_length));
                    used.push((g.grant.clone(), 0));
                }
            }
            self.engine
                .transfer(coalesce(reqs), Some(HOP_TIMEOUT))
                .await?;
            let reply = if hop_uses_packet(p.kind) {
                let sidecar =
                    Packet::new(rid, p.kind, 0, true, self.entries(p, Some(&used))).to_msgpack()?;
                Msg::Packet {
                    request: rid.into(),
                    packet: sidecar,
                    writing_us: 0,
                    inline: vec![],
                }
            } else {
                Msg::Finish {
                    request: rid.into(),
                    digests: p
                        .tensors
                        .iter()
                        .map(|(t, _, d)| NamedDigest {
                            tensor: t.name.clone(),
                            digest: d.to_hex(),
                        })
                        .collect(),
                    writing_us: 0,
                }
            };
            link.send(reply)?;
        }
        loop {
            match link.recv(rid, HOP_TIMEOUT).await? {
                Msg::Finish { .. } => return Ok(()),
                Msg::Error { cause, failed, .. } => bail!("consumer: {cause} ({failed:?})"),
                // A credit granted ahead, ahead of this ack: keep it for the next handoff.
                Msg::StageReserve { grants, .. } if self.credits => {
                    self.held
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(rid.to_string(), grants);
                }
                other => bail!("unexpected {} instead of the ack", other.name()),
            }
        }
    }

    fn entries(&self, p: &HopPayload, grants: Option<&[(Grant, u64)]>) -> Vec<TensorEntry> {
        p.tensors
            .iter()
            .enumerate()
            .map(|(i, (t, _, d))| TensorEntry {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                byte_length: t.byte_length,
                digest: *d,
                transfer_key: grants.map(|g| {
                    let (g, at) = &g[i];
                    TransferKey::Text(format!("{}/{}@{}", g.segment, g.buffer, g.offset + at))
                }),
            })
            .collect()
    }
}

/// The consumer end: serves `Run` announcements on the orchestration key and each announced
/// request on its own key, until `Shutdown` or the link closes.
pub async fn serve_consumer(
    engine: Arc<Engine>,
    link: Link,
    pool: Arc<Pool>,
) -> anyhow::Result<()> {
    let card = Arc::new(ModelCard::qwen3_omni());
    let options = Scenario::default_scenario().shape_options();
    // Bytes are checked once per hop and request content (seed), like the baseline's first
    // message of a series.
    let checked: Arc<std::sync::Mutex<std::collections::HashSet<(PayloadKind, u64)>>> =
        Default::default();
    let mut tasks = Vec::new();
    let result = loop {
        match link.recv("", Duration::from_secs(3600)).await {
            Ok(Msg::Run { request, spec }) => {
                let (hop, rid) = request.split_once('|').context("run key")?;
                let (hop, credits) = match hop.strip_suffix(CREDITS_FLAG) {
                    Some(h) => (h, true),
                    None => (hop, false),
                };
                let kind = parse_hop(hop)?;
                let plan = plan_request(&card, &spec, &options)?;
                let tensors = plan.hop(kind).context("hop not in plan")?.tensors.clone();
                let (e, l, p, rid) = (engine.clone(), link.clone(), pool.clone(), rid.to_string());
                let key = (kind, spec.seed);
                let checked = checked.clone();
                tasks.push(tokio::spawn(async move {
                    let done = checked
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .contains(&key);
                    let r = consume(&e, &l, &p, &rid, kind, &tensors, done, credits).await;
                    if matches!(r, Ok(true)) {
                        checked
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(key);
                    }
                    if let Err(err) = r {
                        tracing::warn!(%rid, "hop consumer: {err:#}");
                    }
                }));
                tasks.retain(|t| !t.is_finished());
            }
            Ok(Msg::Shutdown) => break Ok(()),
            Ok(other) => tracing::warn!("hop consumer: unexpected {}", other.name()),
            Err(e) => break Err(anyhow::Error::from(e)),
        }
    };
    for t in tasks {
        t.abort();
    }
    result
}

/// A stage hop's destination granted ahead: one reservation and one write grant for the
/// packet layout. Dropped unused, it revokes its grant and frees its room.
struct Credit<'a> {
    engine: &'a Engine,
    grant: NamedGrant,
    lease: Option<Lease>,
    at: Vec<u64>,
}

impl<'a> Credit<'a> {
    async fn issue(
        engine: &'a Engine,
        pool: &Arc<Pool>,
        tensors: &[TensorSpec],
    ) -> anyhow::Result<Self> {
        let (at, span) = packet_layout(tensors.iter().map(|t| &t.byte_length));
        let lease = pool.reserve(span.max(1), HOP_TIMEOUT).await?;
        let grant = engine.grant(&pool.buffer, lease.offset, span.max(1), Access::Write)?;
        let at = at.iter().map(|a| lease.offset + a).collect();
        Ok(Self {
            engine,
            grant: NamedGrant {
                tensor: PACKET_GRANT.into(),
                grant,
            },
            lease: Some(lease),
            at,
        })
    }

    /// The handoff landed: revoke the grant (the fence: nothing lands after this) and hand
    /// over the room and where each tensor is.
    fn redeem(mut self) -> (Lease, Vec<u64>) {
        self.engine.revoke(&self.grant.grant);
        let lease = self.lease.take().expect("a credit is redeemed once");
        (lease, std::mem::take(&mut self.at))
    }
}

impl Drop for Credit<'_> {
    fn drop(&mut self) {
        self.engine.revoke(&self.grant.grant);
    }
}

/// Serves one request key: every offer (or inline packet) on it, until `Refuse` ("done").
/// Checks the landed bytes against the digests on the first handoff unless `verified`;
/// returns whether they were checked.
#[allow(clippy::too_many_arguments)]
async fn consume(
    engine: &Engine,
    link: &Link,
    pool: &Arc<Pool>,
    rid: &str,
    kind: PayloadKind,
    tensors: &[TensorSpec],
    mut verified: bool,
    credits: bool,
) -> anyhow::Result<bool> {
    // The destination granted ahead for the next handoff; revoked if it is never used.
    let mut ahead: Option<Credit<'_>> = None;
    loop {
        if credits && ahead.is_none() {
            let c = Credit::issue(engine, pool, tensors).await?;
            link.send(Msg::StageReserve {
                request: rid.into(),
                grants: vec![c.grant.clone()],
            })?;
            ahead = Some(c);
        }
        let msg = link.recv(rid, Duration::from_secs(3600)).await?;
        // Pool space held for this handoff, and where each tensor landed in the pool.
        let mut leases: Vec<Lease> = Vec::with_capacity(tensors.len());
        let mut placed: Vec<u64> = Vec::with_capacity(tensors.len());
        let landed: Result<Packet, String> = match msg {
            Msg::Refuse { .. } => {
                link.forget(rid);
                return Ok(verified);
            }
            Msg::Packet { packet, .. } if !packet.starts_with(INLINE_MAGIC) => {
                // Written into the credit: fence it, then read the sidecar.
                match ahead.take() {
                    Some(c) => {
                        let (lease, at) = c.redeem();
                        placed.extend(at);
                        leases.push(lease);
                        Packet::from_msgpack(&packet).map_err(|e| e.to_string())
                    }
                    None => Err("a packet without a credit or an offer".to_string()),
                }
            }
            Msg::Packet { packet, .. } => {
                // Inline: magic, sidecar length, sidecar, then the tensors' bytes in entry
                // order.
                async {
                    let head = packet.get(4..8).ok_or("inline body short")?;
                    let n = u32::from_be_bytes(head.try_into().map_err(|_| "short")?) as usize;
                    let side = packet
                        .get(8..8usize.saturating_add(n))
                        .ok_or("inline sidecar length past the body")?;
                    let p = Packet::from_msgpack(side).map_err(|e| e.to_string())?;
                    let mut at = 8 + n;
                    for t in tensors {
                        let lease = pool
                            .reserve(t.byte_length, HOP_TIMEOUT)
                            .await
                            .map_err(|e| e.to_string())?;
                        let end = at + t.byte_length as usize;
                        let bytes = packet.get(at..end).ok_or("inline bytes short")?;
                        pool.buffer
                            .write(lease.offset, bytes)
                            .map_err(|e| e.to_string())?;
                        at = end;
                        placed.push(lease.offset);
                        leases.push(lease);
                    }
                    Ok(p)
                }
                .await
            }
            Msg::Offer { .. } => {
                let mut grants = Vec::with_capacity(tensors.len());
                if hop_uses_packet(kind) {
                    // Stage hops: one reservation and one grant for the whole packet.
                    let (at, span) = packet_layout(tensors.iter().map(|t| &t.byte_length));
                    let lease = pool.reserve(span, HOP_TIMEOUT).await?;
                    let g = engine.grant(&pool.buffer, lease.offset, span, Access::Write)?;
                    grants.push(NamedGrant {
                        tensor: PACKET_GRANT.into(),
                        grant: g,
                    });
                    placed.extend(at.iter().map(|a| lease.offset + a));
                    leases.push(lease);
                } else {
                    for t in tensors {
                        let lease = pool.reserve(t.byte_length, HOP_TIMEOUT).await?;
                        let g = engine.grant(
                            &pool.buffer,
                            lease.offset,
                            t.byte_length,
                            Access::Write,
                        )?;
                        grants.push(NamedGrant {
                            tensor: t.name.clone(),
                            grant: g,
                        });
                        placed.push(lease.offset);
                        leases.push(lease);
                    }
                }
                link.send(Msg::StageReserve {
                    request: rid.into(),
                    grants: grants.clone(),
                })?;
                let reply = link.recv(rid, HOP_TIMEOUT).await;
                // The fence: no byte may land after this.
                for g in &grants {
                    engine.revoke(&g.grant);
                }
                match reply? {
                    Msg::Packet { packet, .. } => {
                        Packet::from_msgpack(&packet).map_err(|e| e.to_string())
                    }
                    Msg::Finish { digests, .. } => {
                        // EC / KV FINISH: digests per tensor; build the same view.
                        let entries = tensors
                            .iter()
                            .map(|t| {
                                let d = digests
                                    .iter()
                                    .find(|d| d.tensor == t.name)
                                    .and_then(|d| Digest128::from_hex(&d.digest, "digest").ok())
                                    .unwrap_or(Digest128(0));
                                TensorEntry {
                                    name: t.name.clone(),
                                    dtype: t.dtype,
                                    shape: t.shape.clone(),
                                    byte_length: t.byte_length,
                                    digest: d,
                                    transfer_key: None,
                                }
                            })
                            .collect();
                        Ok(Packet::new(rid, kind, 0, true, entries))
                    }
                    other => Err(format!("unexpected {}", other.name())),
                }
            }
            other => Err(format!("unexpected {}", other.name())),
        };
        let checked = landed.and_then(|p| {
            if placed.len() != tensors.len() {
                return Err(format!(
                    "{} of {} tensors placed",
                    placed.len(),
                    tensors.len()
                ));
            }
            for (t, at) in tensors.iter().zip(&placed) {
                let e = p.entry(&t.name).ok_or(format!("{} missing", t.name))?;
                if e.dtype != t.dtype || e.shape != t.shape {
                    return Err(format!("{}: {} {:?}", t.name, e.dtype, e.shape));
                }
                // Bytes checked once per request key (the warm-up), as the baseline does.
                if !verified {
                    let d = pool
                        .buffer
                        .view(*at, t.byte_length, Digest128::of_bytes)
                        .map_err(|e| e.to_string())?;
                    if d != e.digest {
                        return Err(format!("{}: landed bytes differ from the digest", t.name));
                    }
                }
            }
            Ok(())
        });
        drop(leases);
        match checked {
            Ok(()) => {
                verified = true;
                link.send(Msg::Finish {
                    request: rid.into(),
                    digests: vec![],
                    writing_us: 0,
                })?
                // (With credits, the next credit follows at the top of the loop.)
            }
            Err(cause) => link.send(Msg::Error {
                request: rid.into(),
                failed: vec![],
                cause,
                kind: Default::default(),
                peer: None,
            })?,
        }
    }
}

// ---------------------------------------------------------------- the consumer process

#[derive(Debug, Serialize, Deserialize)]
pub struct PeerHello {
    pub engine: SocketAddr,
    pub control: SocketAddr,
    /// The inline channel for small payloads.
    pub inline: SocketAddr,
}

/// Busy-poll window of the inline channel (the engine's tcp transport uses the same).
pub const INLINE_SPIN: Duration = Duration::from_micros(50);

/// The consumer's side of the inline channel: lands every entry in the pool, checks its
/// digest (a few KiB: cheap), and frees the range (the stage would hold it for the request).
pub fn inline_handler(pool: Arc<Pool>, rt: tokio::runtime::Handle) -> InlineHandler {
    // Bytes are checked on the first handoff of each request, as on the grant path and in
    // the baseline; names, dtypes and lengths on every one.
    let checked = std::sync::Mutex::new(std::collections::HashSet::<String>::new());
    Arc::new(move |p: &Packet, span: u64, read: SpanReader<'_>| {
        let verify = !checked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&p.request_id);
        if span == 0 {
            return Ok(());
        }
        // One reservation for the packet; the payload lands in it straight from the socket.
        let lease = rt
            .block_on(pool.reserve(span, HOP_TIMEOUT))
            .map_err(|x| x.to_string())?;
        pool.buffer
            .fill(lease.offset, span, |dst| read(dst))
            .map_err(|x| x.to_string())?
            .map_err(|x| format!("reading the payload: {x}"))?;
        if verify {
            let (at, _) = packet_layout(p.entries.iter().map(|e| &e.byte_length));
            for (e, a) in p.entries.iter().zip(at) {
                let d = pool
                    .buffer
                    .view(lease.offset + a, e.byte_length, Digest128::of_bytes)
                    .map_err(|x| x.to_string())?;
                if d != e.digest {
                    return Err(format!("{}: landed bytes differ from the digest", e.name));
                }
            }
            checked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(p.request_id.clone());
        }
        Ok(())
    })
}

/// `omnirig bench hop-peer`: a consumer stage in its own process (engine over tcp, control
/// channel over tcp); exits when stdin closes or on `Shutdown`.
pub fn serve_peer(
    pool_bytes: u64,
    cpu: Option<usize>,
    shm: bool,
    tcp: TcpConfig,
) -> anyhow::Result<()> {
    if let Some(c) = cpu {
        super::cpus::pin(c)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let kind = if shm {
            TransportKind::Shm
        } else {
            TransportKind::Tcp
        };
        let cfg = EngineConfig::for_kind(format!("hop-consumer-{}", std::process::id()), kind)
            .store(InProcessStore::new())
            .with(tcp);
        let engine = Arc::new(Engine::new(cfg).await?);
        let pool = Pool::new(&engine, "bench.in", pool_bytes)?;
        // Touch the pool once, as registration does for RDMA: no first-touch page faults
        // land in the timed handoffs.
        pool.buffer.fill(0, pool.buffer.len(), |b| b.fill(0))?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let inline = InlineReceiver::bind(INLINE_SPIN)?;
        let hello = PeerHello {
            engine: engine.tcp_addr().context("engine has no tcp endpoint")?,
            control: listener.local_addr()?,
            inline: inline.local_addr()?,
        };
        inline.serve(inline_handler(
            pool.clone(),
            tokio::runtime::Handle::current(),
        ));
        println!("{}", serde_json::to_string(&hello)?);
        std::thread::spawn(|| {
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin().lock(), &mut sink);
            std::process::exit(0);
        });
        let (stream, _) = listener.accept().await?;
        let link = Link::tcp("hop", stream);
        serve_consumer(engine, link, pool).await
    })
}

/// A consumer process; killed when dropped.
pub struct ConsumerProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    pub hello: PeerHello,
}

impl ConsumerProcess {
    pub fn spawn(
        pool_bytes: u64,
        tcp: &TcpConfig,
        cpu: Option<usize>,
        transport: TransportKind,
    ) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating the omnirig binary")?;
        let mut cmd = Command::new(exe);
        cmd.args(["bench", "hop-peer", "--pool-bytes", &pool_bytes.to_string()]);
        if let Some(c) = cpu {
            cmd.args(["--cpu", &c.to_string()]);
        }
        if transport == TransportKind::Shm {
            cmd.arg("--shm");
        }
        let mut child = cmd
            .args(["--slice-size", &tcp.slice_size.to_string()])
            .args(["--busy-poll-us", &tcp.busy_poll.as_micros().to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the hop consumer process")?;
        let stdin = child.stdin.take();
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("peer stdout")?).read_line(&mut line)?;
        if line.is_empty() {
            bail!("the hop consumer exited before announcing itself");
        }
        let hello = serde_json::from_str(&line).with_context(|| format!("peer said {line:?}"))?;
        Ok(Self {
            child,
            stdin,
            hello,
        })
    }
}

impl Drop for ConsumerProcess {
    fn drop(&mut self) {
        drop(self.stdin.take());
        if matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

pub fn engine_config(name: &str, transport: TransportKind, tcp: &TcpConfig) -> EngineConfig {
    EngineConfig::for_kind(name, transport)
        .store(InProcessStore::new())
        .with(tcp.clone())
}

/// The hop and pipeline suites run omnirig between processes: a kind that crosses them.
pub fn process_transport(kind: TransportKind) -> anyhow::Result<TransportKind> {
    if !kind.crosses_processes() {
        bail!(
            "transport {kind} cannot cross processes (use one of {})",
            TransportKind::process_names()
        );
    }
    Ok(kind)
}

/// A producer connected to a consumer process over tcp (engine and control channel).
pub async fn connect_producer(
    peer: &PeerHello,
    src_engine: Arc<Engine>,
    src: Buffer,
    inline_below: u64,
    credits: bool,
) -> anyhow::Result<Producer> {
    src_engine.connect_addr(peer.engine).await?;
    let stream = tokio::net::TcpStream::connect(peer.control).await?;
    Ok(Producer {
        engine: src_engine,
        link: Link::tcp("hop", stream),
        src,
        inline_below,
        inline: Some(Arc::new(InlineSender::connect(peer.inline, INLINE_SPIN)?)),
        credits,
        held: Default::default(),
    })
}

// ---------------------------------------------------------------- the Python baseline

/// The current path: `ci/baseline/pickle_hop.py` driving its own receiver process.
pub struct Python {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Python {
    /// `receiver_cpu`: the CPU its receiver process pins itself to (the driver, the sending
    /// side, inherits this process's placement).
    pub fn spawn(
        python: &Path,
        script: &Path,
        receiver_cpu: Option<usize>,
    ) -> anyhow::Result<Self> {
        let mut cmd = Command::new(python);
        match receiver_cpu {
            Some(c) => cmd.env(super::cpus::BASELINE_RECEIVER_CPU, c.to_string()),
            None => cmd.env_remove(super::cpus::BASELINE_RECEIVER_CPU),
        };
        let mut child = cmd
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} {} (install the baseline with ci/baseline/setup.sh)",
                    python.display(),
                    script.display()
                )
            })?;
        Ok(Self {
            stdin: child.stdin.take().context("python stdin")?,
            stdout: BufReader::new(child.stdout.take().context("python stdout")?),
            child,
        })
    }

    pub fn call(&mut self, cmd: serde_json::Value) -> anyhow::Result<serde_json::Value> {
        writeln!(self.stdin, "{cmd}")?;
        self.stdin.flush()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        if line.is_empty() {
            bail!("the Python baseline exited (see its error above)");
        }
        let v: serde_json::Value = serde_json::from_str(&line)?;
        if v["ok"] != true {
            bail!("Python baseline: {}", v["error"]);
        }
        Ok(v)
    }

    /// `iters` timed round trips (after `warmup`) of case `case` in `mode`.
    pub fn hop(
        &mut self,
        case: usize,
        mode: &str,
        iters: usize,
        warmup: usize,
        bytes: u64,
    ) -> anyhow::Result<(Samples, bool)> {
        let v = self.call(serde_json::json!({
            "cmd": "hop", "case": case, "mode": mode, "iters": iters, "warmup": warmup,
        }))?;
        let mut s = Samples::new(bytes);
        for x in v["lat_us"].as_array().context("lat_us")? {
            s.push(super::baseline_latency(x)?);
        }
        Ok((s, v["verified"] == true))
    }
}

impl Drop for Python {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{{\"cmd\": \"quit\"}}");
        let _ = self.stdin.flush();
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the baseline script is: next to the repository's `ci/`, found from the current
/// directory or the binary's location.
pub fn default_script() -> PathBuf {
    let rel = Path::new("ci/baseline/pickle_hop.py");
    if rel.exists() {
        return rel.to_path_buf();
    }
    let exe = std::env::current_exe().unwrap_or_default();
    for dir in exe.ancestors() {
        if dir.join(rel).exists() {
            return dir.join(rel);
        }
    }
    rel.to_path_buf()
}

/// A scratch directory for the baseline's payload files, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(what: &str) -> anyhow::Result<Self> {
        let d = std::env::temp_dir().join(format!("omnirig-{what}-{}", std::process::id()));
        std::fs::create_dir_all(&d)?;
        Ok(Self(d))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------- the suite

#[derive(Debug, Clone)]
pub struct Options {
    pub hop: PayloadKind,
    pub scenario: Scenario,
    pub budget: u64,
    pub min_iters: usize,
    pub max_iters: usize,
    /// Interleaved rounds: every round times omnirig, pickle and pickle5-oob in turn.
    pub rounds: usize,
    pub inline_below: u64,
    pub loopback: bool,
    pub python: PathBuf,
    pub script: PathBuf,
    pub tcp: TcpConfig,
    /// Sender side and receiver side CPUs (both omnirig and the baseline); None: unpinned.
    pub cpus: Option<super::cpus::CpuPair>,
    /// omnirig's transport between the two processes (one that crosses processes).
    pub transport: TransportKind,
    /// Stage hops: grant each handoff's destination ahead (see [`Producer::credits`]).
    pub credits: bool,
}

pub fn run(o: &Options) -> anyhow::Result<Results> {
    match o.cpus {
        Some(c) => {
            // Before anything starts: the consumer and the baseline's driver inherit it.
            super::cpus::pin(c.sender)?;
            progress(&format!(
                "sender side on CPU {}, receiver side on CPU {} (omnirig and the baseline alike; --cpus none to let the scheduler place them)",
                c.sender, c.receiver
            ));
        }
        None => progress("processes unpinned (--cpus none, or only one CPU)"),
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let rows = rt.block_on(suite(o))?;
    Ok(Results {
        suite: "hop".into(),
        transport: o.transport.to_string(),
        rows,
        machine: Some(super::Machine::this()),
    })
}

async fn timed(
    prod: &Producer,
    rid: &str,
    p: &HopPayload,
    n: usize,
    s: &mut Samples,
) -> anyhow::Result<()> {
    for _ in 0..n {
        let t = Instant::now();
        prod.send(rid, p).await?;
        s.push(t.elapsed());
    }
    Ok(())
}

async fn suite(o: &Options) -> anyhow::Result<Vec<Row>> {
    let kind = o.hop;
    let cases = scenario_cases(&o.scenario, kind)?;
    if cases.is_empty() {
        bail!(
            "no request of scenario {} carries the {} hop",
            o.scenario.name,
            kind.as_str()
        );
    }
    let scratch = Scratch::new("bench-hop")?;
    let src_engine =
        Arc::new(Engine::new(engine_config("hop-producer", o.transport, &o.tcp)).await?);
    progress(&format!(
        "generating {} payloads of {} case(s)",
        kind.as_str(),
        cases.len()
    ));
    let (src, payloads, manifest) = stage_payloads(&src_engine, kind, &cases, Some(&scratch.0))?;
    let max = payloads.iter().map(|p| p.total).max().unwrap_or(0);
    let manifest_path = scratch.0.join("manifest.json");
    std::fs::write(
        &manifest_path,
        serde_json::json!({ "cases": manifest }).to_string(),
    )?;

    progress("starting the consumer process and the Python baseline");
    let peer = ConsumerProcess::spawn(
        2 * max + (1 << 20),
        &o.tcp,
        o.cpus.map(|c| c.receiver),
        o.transport,
    )?;
    let prod = connect_producer(
        &peer.hello,
        src_engine.clone(),
        src.clone(),
        o.inline_below,
        o.credits,
    )
    .await?;
    let mut py = Python::spawn(&o.python, &o.script, o.cpus.map(|c| c.receiver))?;
    // The floor: the same bytes through a plain socket between the same CPUs.
    let raw_peer = super::peer::PeerProcess::spawn_on(
        super::peer::PeerMode::Raw,
        max,
        &o.tcp,
        o.cpus.map(|c| c.receiver),
    )?;
    let mut raw = std::net::TcpStream::connect(raw_peer.hello.addr)?;
    raw.set_nodelay(true)?;
    raw.set_nonblocking(true)?;
    let mut raw_buf = vec![0x5au8; max as usize];
    let loaded = py.call(serde_json::json!({"cmd": "load", "manifest": manifest_path}))?;
    if loaded["xxhash"] != true {
        progress("WARNING: the Python side has no xxhash; its digest check is skipped");
    }
    // Loopback in one process: the same protocol over in-process queues and memcpy.
    let lb = if o.loopback {
        let store = InProcessStore::new();
        let cfg = |n: &str| EngineConfig::for_kind(n, TransportKind::Loopback).store(store.clone());
        let a = Arc::new(Engine::new(cfg("hop-lb-producer")).await?);
        let b = Arc::new(Engine::new(cfg("hop-lb-consumer")).await?);
        let (lsrc, lp, _) = stage_payloads(&a, kind, &cases, None)?;
        let pool = Pool::new(&b, "bench.lb", 2 * max + (1 << 20))?;
        let (pl, cl) = Link::pair("hop-lb");
        let task = tokio::spawn(serve_consumer(b, cl, pool));
        Some((
            Producer {
                engine: a,
                link: pl,
                src: lsrc,
                inline_below: o.inline_below,
                inline: None,
                credits: o.credits,
                held: Default::default(),
            },
            lp,
            task,
        ))
    } else {
        None
    };

    let mut rows = Vec::new();
    for (ci, p) in payloads.iter().enumerate() {
        let iters = iterations(p.total, o.budget, o.min_iters, o.max_iters);
        let rounds = o.rounds.clamp(1, iters);
        let per = iters.div_ceil(rounds);
        progress(&format!(
            "{} {} ({}, {} tensors) x {}",
            kind.as_str(),
            p.case,
            human_size(p.total),
            p.tensors.len(),
            per * rounds
        ));
        let rid = format!("hop-{ci}");
        prod.announce(&rid, p)?;
        let warm = 3.min(per).max(1);
        let mut ours = Samples::new(p.total);
        let mut pk = Samples::new(p.total);
        let mut p5 = Samples::new(p.total);
        let mut psh = Samples::new(p.total);
        let mut lbs = Samples::new(p.total);
        // Warm-ups, the first of which the consumer checks byte for byte.
        timed(&prod, &rid, p, warm, &mut Samples::new(0)).await?;
        if let Some((lprod, lp, _)) = &lb {
            lprod.announce(&rid, &lp[ci])?;
            timed(lprod, &rid, &lp[ci], warm, &mut Samples::new(0)).await?;
        }
        let mut verified = true;
        for r in 0..rounds {
            let w = if r == 0 { warm } else { 1 };
            let (s, v) = py.hop(ci, "pickle", per, w, p.total)?;
            pk.lat.extend(s.lat);
            verified &= v;
            timed(&prod, &rid, p, per, &mut ours).await?;
            let (s, v) = py.hop(ci, "pickle5-oob", per, w, p.total)?;
            p5.lat.extend(s.lat);
            verified &= v;
            let (s, v) = py.hop(ci, "pickle-shm", per, w, p.total)?;
            psh.lat.extend(s.lat);
            verified &= v;
            if let Some((lprod, lp, _)) = &lb {
                timed(lprod, &rid, &lp[ci], per, &mut lbs).await?;
            }
        }
        prod.retire(&rid)?;
        if let Some((lprod, _, _)) = &lb {
            lprod.retire(&rid)?;
        }
        let (floor_name, floor) = super::transfer::best_raw(
            &mut raw,
            b'W',
            &mut raw_buf[..p.total as usize],
            per * rounds,
            o.tcp.busy_poll,
        )?;
        let floor = {
            let m = floor.measured();
            super::Baseline {
                name: floor_name.into(),
                gbps: m.gbps,
                p50_us: m.p50_us,
                p99_us: Some(m.p99_us),
                samples_us: None,
            }
        };
        if !verified {
            progress("WARNING: the Python side did not verify digests");
        }
        let inline = p.total <= o.inline_below;
        let op = if inline {
            format!("hop-{}-inline", o.transport)
        } else {
            format!("hop-{}", o.transport)
        };
        for (name, b) in [("pickle", &pk), ("pickle5-oob", &p5), ("pickle-shm", &psh)] {
            let mut row = Row::new(&op, p.total, &ours, name, b);
            row.case = Some(p.case.clone());
            row.hop = Some(hop_label(kind).into());
            row.attach_samples(&ours, b);
            row.floor = Some(floor.clone());
            rows.push(row);
        }
        if lb.is_some() {
            let lop = if inline {
                "hop-loopback-inline"
            } else {
                "hop-loopback"
            };
            for (name, b) in [("pickle", &pk), ("pickle5-oob", &p5), ("pickle-shm", &psh)] {
                let mut row = Row::new(lop, p.total, &lbs, name, b);
                row.case = Some(p.case.clone());
                row.hop = Some(hop_label(kind).into());
                rows.push(row);
            }
        }
    }
    prod.link.send(Msg::Shutdown)?;
    if let Some((lprod, _, task)) = lb {
        lprod.link.send(Msg::Shutdown)?;
        let _ = task.await;
    }
    drop(py);
    drop(peer);
    drop(raw_peer);
    Ok(rows)
}

/// The issue's targets for this hop, checked against this run's ratios (printed, never asserted).
pub fn verdicts(r: &Results) -> Vec<String> {
    let mut out = Vec::new();
    let tcp = |base: &'static str| {
        r.rows.iter().filter(move |x| {
            x.op.starts_with("hop-") && !x.op.starts_with("hop-loopback") && x.baseline.name == base
        })
    };
    let hop = r
        .rows
        .first()
        .and_then(|x| x.hop.clone())
        .unwrap_or_default();
    let targets: &[(&str, f64)] = match hop.as_str() {
        "thinker-talker" => &[("pickle", 5.0)],
        "talker-code2wav" => &[("pickle", 3.0)],
        "kv" => &[("pickle", 3.0), ("pickle5-oob", 1.0)],
        _ => &[],
    };
    // Judged on the p50 round trip (the typical handoff; a shared VM's stalls land in the
    // mean and p99, which are printed too).
    let p50x = |x: &Row| x.baseline.p50_us / x.omnirig.p50_us;
    for &(base, need) in targets {
        if let Some(min) = tcp(base).min_by(|a, b| p50x(a).total_cmp(&p50x(b))) {
            out.push(format!(
                "{hop} >= {need}x {base} (p50 round trip incl. every control message, omnirig over {}, two processes): {} (lowest {:.2}x: {} {}, {:.1} us vs {:.1} us; mean-rate ratio {:.2}x)",
                r.transport,
                if p50x(min) >= need { "met" } else { "MISSED" },
                p50x(min),
                min.case.as_deref().unwrap_or("?"),
                super::human_size_approx(min.size),
                min.omnirig.p50_us,
                min.baseline.p50_us,
                min.ratio,
            ));
            for x in tcp(base) {
                let mut line = format!(
                    "  {} {}: {:.2}x p50 ({:.1} us vs {:.1} us)",
                    x.case.as_deref().unwrap_or("?"),
                    super::human_size_approx(x.size),
                    p50x(x),
                    x.omnirig.p50_us,
                    x.baseline.p50_us
                );
                if let Some(f) = &x.floor {
                    // What the target leaves, against what a plain socket needs for the bytes.
                    let budget = x.baseline.p50_us / need;
                    line += &format!(
                        "; {need}x needs <= {budget:.1} us, a plain socket alone takes {:.1} us ({}){}",
                        f.p50_us,
                        f.name,
                        if f.p50_us > budget {
                            ": below the tcp floor on this machine"
                        } else {
                            ""
                        }
                    );
                }
                out.push(line);
            }
        }
    }
    // Context, no target: the same-host pickle wire (what omnirig's shm is up against).
    if let Some(min) = tcp("pickle-shm").min_by(|a, b| p50x(a).total_cmp(&p50x(b))) {
        out.push(format!(
            "{hop} vs pickle-shm (the same-host pickle wire; no target): lowest {:.2}x p50 ({} {}, {:.1} us vs {:.1} us)",
            p50x(min),
            min.case.as_deref().unwrap_or("?"),
            super::human_size_approx(min.size),
            min.omnirig.p50_us,
            min.baseline.p50_us
        ));
    }
    if targets.is_empty() {
        for base in ["pickle", "pickle5-oob"] {
            if let Some(min) = tcp(base).min_by(|a, b| a.ratio.total_cmp(&b.ratio)) {
                out.push(format!(
                    "{hop} vs {base} (no target): lowest {:.2}x ({} {})",
                    min.ratio,
                    min.case.as_deref().unwrap_or("?"),
                    human_size(min.size)
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packet_layout_is_entry_order_at_64_byte_boundaries() {
        let (at, span) = packet_layout(&[808_960, 2048, 1, 163_840]);
        assert_eq!(at, vec![0, 808_960, 811_008, 811_072]);
        assert_eq!(span, 811_072 + 163_840);
        assert_eq!(packet_layout(&[]), (vec![], 0));
    }

    #[tokio::test]
    async fn coalesce_merges_only_runs_contiguous_on_both_sides() {
        let e = Engine::new(
            EngineConfig::for_kind("t-coalesce", TransportKind::Loopback)
                .store(InProcessStore::new()),
        )
        .await
        .unwrap();
        let src = e.allocate(1 << 16).unwrap();
        let other = e.allocate(1 << 16).unwrap();
        let dst = e.allocate(1 << 16).unwrap();
        let g = e.grant(&dst, 0, 1 << 15, Access::Write).unwrap();
        let g2 = e.grant(&dst, 1 << 15, 1 << 15, Access::Write).unwrap();
        let w = |b: &Buffer, lo, g: &Grant, go, n| Request::write(b, lo, g, go, n);
        let merged = coalesce(vec![
            w(&src, 0, &g, 0, 64),
            w(&src, 64, &g, 64, 128),    // continues both sides: merged
            w(&src, 256, &g, 192, 64),   // gap on the source side
            w(&other, 320, &g, 256, 64), // another source buffer
            w(&other, 384, &g2, 0, 64),  // another grant
            w(&other, 448, &g2, 64, 64).tagged(7), // another tag
        ]);
        let spans: Vec<_> = merged
            .iter()
            .map(|r| (r.local_offset, r.grant_offset, r.len))
            .collect();
        assert_eq!(
            spans,
            vec![
                (0, 0, 192),
                (256, 192, 64),
                (320, 256, 64),
                (384, 0, 64),
                (448, 64, 64)
            ]
        );
    }

    #[test]
    fn hop_names_parse_both_spellings() {
        for k in PayloadKind::ALL {
            assert_eq!(parse_hop(hop_label(k)).unwrap(), k);
            assert_eq!(parse_hop(k.as_str()).unwrap(), k);
        }
        assert!(parse_hop("x").is_err());
    }

    #[test]
    fn every_hop_of_the_default_scenario_has_cases() {
        let s = Scenario::default_scenario();
        for k in PayloadKind::ALL {
            let c = scenario_cases(&s, k).unwrap();
            assert!(!c.is_empty(), "{k:?}");
            // Distinct labels: the repeated image_audio request is measured once.
            let mut labels: Vec<_> = c.iter().map(|x| x.0.clone()).collect();
            labels.dedup();
            assert_eq!(labels.len(), c.len());
        }
    }

    /// The whole hop protocol in one process over loopback: offer, grants, write, packet,
    /// ack; inline below the threshold; bytes checked on the first handoff.
    #[tokio::test]
    async fn loopback_hop_round_trips_with_grants_and_inline() {
        let store = InProcessStore::new();
        let cfg = |n: &str| EngineConfig::for_kind(n, TransportKind::Loopback).store(store.clone());
        let a = Arc::new(Engine::new(cfg("t-prod")).await.unwrap());
        let b = Arc::new(Engine::new(cfg("t-cons")).await.unwrap());
        let s = Scenario::golden("text_short", TransportKind::Loopback);
        for (kind, inline, credits) in [
            (PayloadKind::ThinkerToTalker, 0, false),
            (PayloadKind::ThinkerToTalker, 0, true),
            (PayloadKind::TalkerToCode2wav, 1 << 20, false),
            (PayloadKind::TalkerToCode2wav, 1 << 20, true),
            (PayloadKind::KvCache, 0, true),
        ] {
            let cases = scenario_cases(&s, kind).unwrap();
            let (src, ps, _) = stage_payloads(&a, kind, &cases, None).unwrap();
            let pool = Pool::new(&b, "t", 2 * ps[0].total + (1 << 20)).unwrap();
            let (pl, cl) = Link::pair("t");
            let task = tokio::spawn(serve_consumer(b.clone(), cl, pool.clone()));
            let prod = Producer {
                engine: a.clone(),
                link: pl,
                src,
                inline_below: inline,
                inline: None,
                credits,
                held: Default::default(),
            };
            prod.announce("r", &ps[0]).unwrap();
            for _ in 0..3 {
                prod.send("r", &ps[0]).await.unwrap();
            }
            prod.retire("r").unwrap();
            prod.link.send(Msg::Shutdown).unwrap();
            task.await.unwrap().unwrap();
            assert_eq!(pool.usage(), (0, 0));
            // Every grant, the credit left unused at retirement included, is revoked (an
            // aborted consumer task drops its credit when the runtime reaps it).
            let mut u = b.usage();
            for _ in 0..100 {
                if u.grants == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                u = b.usage();
            }
            assert_eq!(
                (u.grants, u.granted_bytes),
                (0, 0),
                "{kind:?} credits {credits}: {u:?}"
            );
        }
    }
}

#[cfg(test)]
mod inline_tests {
    use super::*;

    /// The inline channel lands the bytes and checks them against the sidecar; a digest that
    /// does not match is refused with the cause, and every range goes back to the pool.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn inline_channel_lands_checks_and_refuses() {
        let engine = Engine::new(
            EngineConfig::for_kind("t-inline", TransportKind::Loopback)
                .store(InProcessStore::new()),
        )
        .await
        .unwrap();
        let pool = Pool::new(&engine, "t", 1 << 20).unwrap();
        let rx = InlineReceiver::bind(INLINE_SPIN).unwrap();
        let addr = rx.local_addr().unwrap();
        rx.serve(inline_handler(
            pool.clone(),
            tokio::runtime::Handle::current(),
        ));
        let tx = InlineSender::connect(addr, INLINE_SPIN).unwrap();
        let s = Scenario::golden("text_short", TransportKind::Loopback);
        let cases = scenario_cases(&s, PayloadKind::TalkerToCode2wav).unwrap();
        let t = &cases[0].2[0];
        let bytes = generate_tensor(cases[0].1.seed, t);
        let entry = |d| TensorEntry {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            byte_length: t.byte_length,
            digest: d,
            transfer_key: None,
        };
        let good = Packet::new(
            "r",
            PayloadKind::TalkerToCode2wav,
            0,
            true,
            vec![entry(Digest128::of_bytes(&bytes))],
        )
        .to_msgpack()
        .unwrap();
        let (tx, good2) = tokio::task::spawn_blocking(move || {
            let r = tx.send(&good, &bytes);
            (tx, r.map(|()| bytes))
        })
        .await
        .unwrap();
        let bytes = good2.unwrap();
        // A request's first frame is checked byte for byte: a wrong digest is refused.
        let bad = Packet::new(
            "r2",
            PayloadKind::TalkerToCode2wav,
            0,
            true,
            vec![entry(Digest128(1))],
        )
        .to_msgpack()
        .unwrap();
        let e = tokio::task::spawn_blocking(move || tx.send(&bad, &bytes))
            .await
            .unwrap()
            .unwrap_err();
        assert!(e.to_string().contains("differ"), "{e}");
        assert_eq!(pool.usage(), (0, 0));
    }
}
