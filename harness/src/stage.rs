//! A stage worker: its stub, its engines and registered pools, and its side of
//! each hop's connector.
//!
//! Each hop end has its own engine (a stage touching two hops has two): an
//! engine's transport policy is per engine, and a scenario picks the
//! transport per hop. Every hop is consumer-driven: the consumer reserves and
//! grants, the producer writes, then reports FINISH (EC, KV), the packet v1
//! sidecar (stage connector), or ERROR naming what failed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use omnirig_fixtures::{
    Digest128, Hop, KvLayout, ModelCard, Packet, PayloadKind, RequestPlan, RequestSpec,
    ShapeOptions, Stage, plan_request,
};
use omnirig_model_stubs::{ComputeTime, Stub, StubError};
use omnirig_transports::{Access, Buffer, Engine, Grant, Request, Usage};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::control::{Link, Msg};
use crate::cpu::{cpu, cpu_for};
use crate::ec::{EcAcquire, EncoderCache};
use crate::error::{Cause, Classified, FailureKind, HarnessError, Result};
use crate::faults::{HarnessFault, HarnessFaults, fault_tag};
use crate::host::StageCpu;
use crate::inline::packet_layout;
use crate::kv::{BlockPool, KvGeometry, block_hash, contiguous_runs};
use crate::pool::{Lease, Pool};
use crate::pregen::Pregenerated;
use crate::protocol::ec::{
    EcConsumer, EcConsumerAction, EcEntry, EcProducer, EcProducerAction, EcProducerState,
};
use crate::protocol::kv::{
    KvConsumer, KvConsumerAction, KvProducer, KvProducerAction, KvProducerState, kv_tensor,
};
use crate::protocol::{
    ConsumerAction, ConsumerState, HandoffTimes, LinkEvents, PacketConsumer, PacketProducer,
    ProducerAction, ProducerState, bad_reply,
};
use crate::report::Failure;

/// Registered memory per stage, sized by the runner for the scenario's
/// concurrency and largest request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSizes {
    /// Encoder staging and prefill's encoder cache.
    pub ec_bytes: u64,
    /// Paged KV capacity, per side (decode adds its null block).
    pub kv_blocks: u32,
    /// Decode staging and talker's receive pool.
    pub t2t_bytes: u64,
    /// Talker staging and code2wav's receive pool.
    pub codes_bytes: u64,
}

/// Everything a stage needs besides its engines and links.
#[derive(Debug, Clone)]
pub struct StageConfig {
    pub stage: Stage,
    pub card: Arc<ModelCard>,
    pub options: ShapeOptions,
    pub compute: ComputeTime,
    /// Offer -> FINISH / packet of one hop.
    pub hop_timeout: Duration,
    /// How long a consumer waits for its producer's offer (upstream stages' work).
    pub request_timeout: Duration,
    pub prefix_cache: bool,
    /// Consumers reserve and grant at the request's start, ahead of the offer (see
    /// [`crate::protocol::Credit`]); `false`: on the offer.
    pub credits: bool,
    /// Stage-packet hops carry packets of at most this many bytes inline (0: never).
    pub inline_below: u64,
    pub sizes: PoolSizes,
    /// Connector faults this run injects (see [`crate::faults::HarnessFault`]).
    pub faults: Arc<HarnessFaults>,
}

/// The hop a stage receives, if any.
pub fn inbound_kind(stage: Stage) -> Option<PayloadKind> {
    PayloadKind::ALL.into_iter().find(|k| k.target() == stage)
}

/// The hop a stage sends, if any.
pub fn outbound_kind(stage: Stage) -> Option<PayloadKind> {
    PayloadKind::ALL.into_iter().find(|k| k.source() == stage)
}

/// One end of a hop: the engine for it and the control link to the peer stage.
#[derive(Debug, Clone)]
pub struct HopEnd {
    pub engine: Arc<Engine>,
    pub link: Link,
}

/// What a stage did for one request. Field names are stable (report.json).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageOutcome {
    pub stage: String,
    /// False when the request has no work for this stage (no encoder for text only).
    pub participated: bool,
    pub error: Option<String>,
    /// `error`, classified from the error itself (its kind and peer), for the report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Failure>,
    pub received: Option<Received>,
    pub sent: Option<Sent>,
    pub compute_ms: f64,
    /// When compute started, ms after this stage started the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_start_ms: Option<f64>,
    pub total_ms: f64,
}

/// The consumer's view of a hop.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Received {
    pub hop: String,
    /// Tensors verified (digest, and bytes where cheap) before the stage started.
    pub tensors: usize,
    /// Bytes that arrived for this request.
    pub landed_bytes: u64,
    /// Bytes not transferred because they were cached (EC dedupe, KV prefix hit).
    pub reused_bytes: u64,
    /// Offer received -> every tensor verified.
    pub handoff_ms: f64,
    pub verify_ms: f64,
    /// When the offer arrived, ms after this stage started the request (stages start a
    /// request together, so this places the handoff on the request's timeline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_ms: Option<f64>,
    /// `handoff_ms` split into consecutive phases.
    #[serde(default)]
    pub phases_ms: HandoffPhases,
}

/// Where a handoff's time goes, as its consumer saw it, in ms; the phases are consecutive
/// and add up to the handoff.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct HandoffPhases {
    /// Offer -> reservation sent: pools reserved, destinations granted.
    pub reserve: f64,
    /// Reservation sent -> the producer's FINISH / packet arrived: the producer's staging
    /// (`Sent::stage_ms`), its engine transfer (`Sent::transfer_ms`) and two control messages.
    pub transfer: f64,
    /// Reply -> every grant revoked (nothing lands after this).
    pub fence: f64,
    /// Fence -> every tensor's landed bytes checked against its digest.
    pub verify: f64,
    /// Verified -> handoff done: the consumer's bookkeeping (cache commits, entries ready).
    pub ack: f64,
}

impl HandoffPhases {
    pub fn total(&self) -> f64 {
        self.reserve + self.transfer + self.fence + self.verify + self.ack
    }

    /// Each phase's nearest-rank percentile over `v`.
    pub fn percentile(v: &[HandoffPhases], p: f64) -> HandoffPhases {
        let of = |f: fn(&HandoffPhases) -> f64| {
            crate::report::percentile(&v.iter().map(f).collect::<Vec<_>>(), p)
        };
        HandoffPhases {
            reserve: of(|x| x.reserve),
            transfer: of(|x| x.transfer),
            fence: of(|x| x.fence),
            verify: of(|x| x.verify),
            ack: of(|x| x.ack),
        }
    }
}

/// The producer's view of a hop.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sent {
    pub hop: String,
    pub tensors: usize,
    /// Engine requests (a KV run contiguous on both sides is one).
    pub requests: usize,
    pub bytes: u64,
    /// The engine transfer alone.
    pub transfer_ms: f64,
    /// When the engine transfer started, ms after this stage started the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_start_ms: Option<f64>,
    /// Producing and digesting staged outputs before the transfer (a real stage's outputs
    /// already sit in its memory; the stub makes them here).
    #[serde(default)]
    pub stage_ms: f64,
}

/// Pool and engine usage of a stage; all zero after a clean run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageUsage {
    pub stage: String,
    pub pools: Vec<PoolUsage>,
    /// KV blocks held by requests (cached prefix blocks are dropped before counting).
    pub kv_blocks_in_use: usize,
    /// Encoder-cache entries held by requests or half-received.
    pub ec_entries_in_use: usize,
    pub engines: Vec<EngineUsage>,
    /// Control-link mailboxes of requests not yet forgotten.
    pub open_mailboxes: usize,
    /// The stage's process had exited before it could report (killed, crashed), e.g.
    /// "signal: 9 (SIGKILL)": its memory went with it, so there is nothing to count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exited: Option<String>,
    /// The stage's process was still running but did not report its usage: not clean.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unanswered: bool,
}

/// A registered pool's reserved ranges.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PoolUsage {
    pub name: String,
    pub bytes: u64,
    pub ranges: usize,
}

/// What an engine still holds (from [`omnirig_transports::Usage`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineUsage {
    pub name: String,
    pub grants: usize,
    pub batches: usize,
    pub tasks: usize,
    pub leases: usize,
}

impl PoolUsage {
    fn new(name: &str, (bytes, ranges): (u64, usize)) -> Self {
        Self {
            name: name.into(),
            bytes,
            ranges,
        }
    }
}

impl StageUsage {
    pub fn is_clean(&self) -> bool {
        self.pools.iter().all(|p| p.bytes == 0 && p.ranges == 0)
            && self.kv_blocks_in_use == 0
            && self.ec_entries_in_use == 0
            && self
                .engines
                .iter()
                .all(|e| (e.grants, e.batches, e.tasks, e.leases) == (0, 0, 0, 0))
            && self.open_mailboxes == 0
            && !self.unanswered
    }
}

/// Feeds a connector machine its next control-link event: the message for `rid`, its own
/// deadline passing, or the link failing. Waits until the machine's deadline, or `idle` when
/// it has none.
async fn next_event(link: &Link, rid: &str, m: &mut impl LinkEvents, idle: Duration) {
    let until = m
        .poll_timeout()
        .map(|d| d.saturating_duration_since(now()))
        .unwrap_or(idle);
    match link.recv(rid, until).await {
        Ok(msg) => m.handle_msg(now(), msg),
        Err(e) => match m.poll_timeout() {
            Some(d) if now() >= d => m.handle_timeout(now()),
            _ => m.link_failed(e),
        },
    }
}

/// Now on tokio's clock, as the protocol machines' std instant: the wall clock normally,
/// virtual time under a paused runtime (the sim transport's runs), so deadlines and timings
/// follow the simulated fabric.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Paged KV cache in one registered buffer.
#[derive(Debug)]
pub struct PagedKv {
    pub buffer: Buffer,
    pub geo: KvGeometry,
    blocks: Mutex<BlockPool>,
    freed: Notify,
}

impl PagedKv {
    fn new(engine: &Engine, geo: KvGeometry, reserved: u32) -> Result<Arc<Self>> {
        Ok(Arc::new(Self {
            buffer: engine.allocate(geo.buffer_bytes())?,
            geo,
            blocks: Mutex::new(BlockPool::new(geo.capacity, reserved)),
            freed: Notify::new(),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BlockPool> {
        self.blocks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every layer's K and V ranges of `blocks`.
    fn block_ranges(&self, blocks: &[u32]) -> Vec<(u64, u64)> {
        let mut ranges = Vec::new();
        for (_, id, len) in contiguous_runs(blocks) {
            for layer in 0..self.geo.num_layers {
                for v in [false, true] {
                    ranges.push((
                        self.geo.offset(layer, v, id),
                        u64::from(len) * self.geo.block_bytes,
                    ));
                }
            }
        }
        ranges
    }

    async fn alloc(self: &Arc<Self>, n: usize, timeout: Duration) -> Result<Vec<u32>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if n > self.geo.capacity as usize {
                break;
            }
            let got = self.lock().alloc(n);
            if let Some(b) = got {
                // Blocks come back poisoned, every layer's K and V: a block a transfer does
                // not fill cannot pass for the request's (evicted prefix blocks included).
                // On an error, or if this future is dropped, the blocks go back once the
                // memset is done.
                let ranges = self.block_ranges(&b);
                let held = AllocatedBlocks {
                    kv: self.clone(),
                    blocks: b,
                };
                let held = crate::pool::poison_held(&self.buffer, ranges, held).await?;
                return Ok(held.keep());
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                break;
            }
        }
        Err(HarnessError::Pool {
            pool: "kv_cache".into(),
            reason: format!("no room for {n} blocks of {}", self.geo.capacity),
        })
    }
}

/// Blocks just allocated, handed back on drop unless [`kept`](AllocatedBlocks::keep).
struct AllocatedBlocks {
    kv: Arc<PagedKv>,
    blocks: Vec<u32>,
}

impl AllocatedBlocks {
    fn keep(mut self) -> Vec<u32> {
        std::mem::take(&mut self.blocks)
    }
}

impl Drop for AllocatedBlocks {
    fn drop(&mut self) {
        if !self.blocks.is_empty() {
            self.kv.lock().release(&self.blocks);
            self.kv.freed.notify_waiters();
        }
    }
}

/// Blocks a request holds (and grants over them); released on drop.
struct KvHeld {
    kv: Arc<PagedKv>,
    engine: Arc<Engine>,
    blocks: Vec<u32>,
    grants: Vec<Grant>,
}

impl Drop for KvHeld {
    fn drop(&mut self) {
        // Revoke first: no byte may land in blocks handed back.
        for g in self.grants.drain(..) {
            self.engine.revoke(&g);
        }
        self.kv.lock().release(&self.blocks);
        self.kv.freed.notify_waiters();
    }
}

/// Prefill's encoder cache in one registered buffer.
#[derive(Debug)]
pub struct EcStore {
    pub buffer: Buffer,
    cache: Mutex<EncoderCache>,
    changed: Notify,
}

impl EcStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, EncoderCache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A request's uses of encoder-cache entries; released (or failed) on drop.
struct EcHeld {
    store: Arc<EcStore>,
    engine: Arc<Engine>,
    ready: Vec<String>,
    /// (mm_hash, offset, tensor) reserved and not yet verified.
    reserved: Vec<(String, u64, String)>,
    grants: Vec<Grant>,
}

impl EcHeld {
    fn revoke(&mut self) {
        for g in self.grants.drain(..) {
            self.engine.revoke(&g);
        }
    }
}

impl Drop for EcHeld {
    fn drop(&mut self) {
        self.revoke();
        let mut c = self.store.lock();
        for (h, _, _) in &self.reserved {
            c.fail(h);
        }
        for h in &self.ready {
            c.release(h);
        }
        drop(c);
        self.store.changed.notify_waiters();
    }
}

/// Stage-connector destinations a request holds; grants revoked, then ranges freed.
struct LeasesHeld {
    engine: Arc<Engine>,
    grants: Vec<Grant>,
    _leases: Vec<Lease>,
}

impl Drop for LeasesHeld {
    fn drop(&mut self) {
        for g in self.grants.drain(..) {
            self.engine.revoke(&g);
        }
    }
}

/// Whatever a stage holds for a request between receiving and finishing.
type Held = Box<dyn Send>;

#[derive(Debug)]
enum InMem {
    Ec(Arc<EcStore>),
    Kv(Arc<PagedKv>),
    Pool(Arc<Pool>),
}

#[derive(Debug)]
enum OutMem {
    Staging(Arc<Pool>),
    Kv(Arc<PagedKv>),
}

#[derive(Debug)]
struct Side<M> {
    end: HopEnd,
    mem: M,
}

/// An output produced in staging memory, waiting for its write.
#[derive(Debug)]
struct Staged {
    /// The staging space it was produced in; None for a pre-generated output.
    _lease: Option<Lease>,
    /// Where its bytes lie: the staging pool's buffer, or the pre-generated table's.
    buffer: Buffer,
    offset: u64,
    len: u64,
    digest: Digest128,
}

/// How a consumer's handoff starts: the offer already received (at `offered`), or a
/// credit granted ahead that waits up to `offer_timeout` for it.
#[derive(Debug, Clone, Copy)]
struct Wait {
    offered: Option<Instant>,
    offer_timeout: Duration,
}

impl Wait {
    /// How long a reservation may wait for room (pool space, KV blocks, an encoder-cache
    /// entry another request is receiving): a hop timeout once the outputs exist; a credit,
    /// made while upstream computes, as long as it would wait for the offer.
    fn reserve_timeout(&self, hop_timeout: Duration) -> Duration {
        match self.offered {
            Some(_) => hop_timeout,
            None => self.offer_timeout.max(hop_timeout),
        }
    }
}

/// One stage: stub, hop ends, pools.
#[derive(Debug)]
pub struct StageWorker {
    cfg: StageConfig,
    stub: Stub,
    inbound: Option<Side<InMem>>,
    outbound: Option<Side<OutMem>>,
    /// Outputs and input digests made ahead (benchmarks; see [`StageWorker::pregenerate`]).
    pregen: Option<Pregenerated>,
    /// Simulated runs with a host model: where this stage's CPU work is charged.
    host: Option<StageCpu>,
}

/// Bytes of `blocks` KV blocks of `block_bytes` each, K and V, over `layers` layers.
fn kv_bytes(blocks: usize, block_bytes: u64, layers: u32) -> u64 {
    blocks as u64 * block_bytes * 2 * u64::from(layers)
}

fn kv_geometry(card: &ModelCard, options: &ShapeOptions, capacity: u32) -> KvGeometry {
    let t = &card.thinker;
    KvGeometry {
        num_layers: t.num_layers,
        capacity,
        block_bytes: options.block_tokens
            * u64::from(t.num_kv_heads)
            * t.head_dim
            * t.kv_dtype.size_bytes() as u64,
    }
}

impl StageWorker {
    /// Builds the stage's memory on its hop ends' engines. `inbound` / `outbound`
    /// must be given exactly for the hops the stage has.
    pub fn new(
        cfg: StageConfig,
        inbound: Option<HopEnd>,
        outbound: Option<HopEnd>,
    ) -> Result<Self> {
        let stage = cfg.stage;
        let s = cfg.sizes;
        let setup = |what: &str| HarnessError::Setup(format!("{stage}: {what}"));
        let inbound = match (inbound_kind(stage), inbound) {
            (Some(kind), Some(end)) => {
                let e = &end.engine;
                let mem = match kind {
                    PayloadKind::EncoderEmbeddings => {
                        let buf = e.allocate(crate::pool::align_up(s.ec_bytes))?;
                        InMem::Ec(Arc::new(EcStore {
                            cache: Mutex::new(EncoderCache::new(buf.len())),
                            buffer: buf,
                            changed: Notify::new(),
                        }))
                    }
                    // Decode keeps block 0 as its null block, as vLLM does, so its ids differ from prefill's.
                    PayloadKind::KvCache => InMem::Kv(PagedKv::new(
                        e,
                        kv_geometry(&cfg.card, &cfg.options, s.kv_blocks + 1),
                        1,
                    )?),
                    PayloadKind::ThinkerToTalker => {
                        InMem::Pool(Pool::new_poisoned(e, "talker.in", s.t2t_bytes)?)
                    }
                    PayloadKind::TalkerToCode2wav => {
                        InMem::Pool(Pool::new_poisoned(e, "code2wav.in", s.codes_bytes)?)
                    }
                };
                Some(Side { end, mem })
            }
            (None, None) => None,
            _ => {
                return Err(setup(
                    "inbound hop end given where none belongs, or missing",
                ));
            }
        };
        let outbound = match (outbound_kind(stage), outbound) {
            (Some(kind), Some(end)) => {
                let e = &end.engine;
                let mem = match kind {
                    PayloadKind::EncoderEmbeddings => {
                        OutMem::Staging(Pool::new_poisoned(e, "encoder.out", s.ec_bytes)?)
                    }
                    PayloadKind::KvCache => OutMem::Kv(PagedKv::new(
                        e,
                        kv_geometry(&cfg.card, &cfg.options, s.kv_blocks),
                        0,
                    )?),
                    PayloadKind::ThinkerToTalker => {
                        OutMem::Staging(Pool::new_poisoned(e, "thinker_decode.out", s.t2t_bytes)?)
                    }
                    PayloadKind::TalkerToCode2wav => {
                        OutMem::Staging(Pool::new_poisoned(e, "talker.out", s.codes_bytes)?)
                    }
                };
                Some(Side { end, mem })
            }
            (None, None) => None,
            _ => {
                return Err(setup(
                    "outbound hop end given where none belongs, or missing",
                ));
            }
        };
        // Touch every page now, as registering memory with a NIC pins it: requests then
        // measure the data plane, not first-touch page faults.
        let mut bufs: Vec<&Buffer> = Vec::new();
        for side in inbound.iter() {
            bufs.push(match &side.mem {
                InMem::Ec(s) => &s.buffer,
                InMem::Kv(k) => &k.buffer,
                InMem::Pool(p) => &p.buffer,
            });
        }
        for side in outbound.iter() {
            bufs.push(match &side.mem {
                OutMem::Staging(p) => &p.buffer,
                OutMem::Kv(k) => &k.buffer,
            });
        }
        for b in bufs {
            cpu(|| b.fill(0, b.len(), |m| m.fill(0)))?;
        }
        Ok(Self {
            stub: Stub::new(stage, cfg.compute),
            cfg,
            inbound,
            outbound,
            pregen: None,
            host: None,
        })
    }

    /// Charges this stage's CPU work (generating, digesting, copying, control messages) on
    /// the host model of a simulated run; without it that work takes no virtual time.
    pub fn charge_cpu(&mut self, host: StageCpu) {
        self.host = Some(host);
    }

    /// Charges verifying `bytes` of the inbound tensor `tensor` (see [`StageCpu::verify`]).
    async fn charge_verify(&self, plan: &RequestPlan, tensor: &str, bytes: u64) {
        let Some(h) = &self.host else { return };
        let small = self
            .stub
            .inbound(plan)
            .filter(|hop| hop.payload_kind != PayloadKind::KvCache)
            .and_then(|hop| hop.tensor(tensor))
            .is_some_and(|t| t.byte_length <= omnirig_model_stubs::BYTE_COMPARE_MAX);
        h.verify(bytes, self.pregen.is_some(), small).await;
    }

    /// `engine.transfer`, with the copies' CPU work beside it when a host model is on.
    async fn transfer(
        &self,
        engine: &Engine,
        requests: Vec<Request>,
    ) -> omnirig_transports::Result<()> {
        let bytes = requests.iter().map(|r| r.len).sum();
        let writes = requests.len();
        let t = engine.transfer(requests, Some(self.timeout()));
        match &self.host {
            Some(h) => h.transfer(bytes, writes, t).await,
            None => t.await,
        }
    }

    /// Makes this stage's outputs for `specs` now, into a registered buffer of its outbound
    /// engine, and the digests its inputs must have: requests of these specs then write
    /// their outputs from there (KV: copy them into the blocks) and check what arrives
    /// against the remembered digests, so a benchmark times the data plane rather than
    /// tensor generation. Every byte that arrives is still digested. Other requests are
    /// generated and checked as ever. Returns the bytes of outputs held.
    pub fn pregenerate(&mut self, specs: &[RequestSpec]) -> Result<u64> {
        let plans = specs
            .iter()
            .map(|s| plan_request(&self.cfg.card, s, &self.cfg.options))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let engine = self.outbound.as_ref().map(|s| &*s.end.engine);
        let t = cpu(|| Pregenerated::build(&self.stub, engine, &plans))?;
        let bytes = t.bytes();
        self.pregen = Some(t);
        Ok(bytes)
    }

    pub fn stage(&self) -> Stage {
        self.cfg.stage
    }

    /// Runs this stage's part of one request. Never panics on bad input: every
    /// failure ends up in the outcome's `error`, and what the request held is released.
    pub async fn process(&self, request: &str, spec: &RequestSpec) -> StageOutcome {
        let t0 = now();
        let mut out = StageOutcome {
            stage: self.cfg.stage.as_str().into(),
            ..Default::default()
        };
        let plan = match plan_request(&self.cfg.card, spec, &self.cfg.options) {
            Ok(p) => p,
            Err(e) => {
                out.error = Some(format!("request {request}: {e}"));
                out.failure = Some(Failure::of(&HarnessError::from(e)));
                return out;
            }
        };
        if self.stub.participates(&plan) {
            out.participated = true;
            let span = tracing::debug_span!("stage", stage = %self.cfg.stage, request);
            let r =
                tracing::Instrument::instrument(self.run(request, &plan, &mut out, t0), span).await;
            match r {
                Ok(()) => {
                    tracing::debug!(stage = %self.cfg.stage, request, received = ?out.received, sent = ?out.sent, "done")
                }
                Err(e) => {
                    tracing::warn!(stage = %self.cfg.stage, request, error = %e, "request failed");
                    out.error = Some(e.to_string());
                    out.failure = Some(Failure::of(&e));
                }
            }
        }
        for side in [
            self.inbound.as_ref().map(|s| &s.end),
            self.outbound.as_ref().map(|s| &s.end),
        ]
        .into_iter()
        .flatten()
        {
            side.link.forget(request);
        }
        out.total_ms = ms(now().saturating_duration_since(t0));
        out
    }

    async fn run(
        &self,
        rid: &str,
        plan: &RequestPlan,
        out: &mut StageOutcome,
        started: Instant,
    ) -> Result<()> {
        let held = match (&self.inbound, self.stub.inbound(plan)) {
            (Some(side), Some(hop)) => match self.receive(side, plan, hop, rid, started).await {
                Ok((held, rec)) => {
                    out.received = Some(rec);
                    Some(held)
                }
                Err(e) => {
                    self.abort_outbound(rid, plan, &e).await;
                    return Err(e);
                }
            },
            (None, Some(hop)) => {
                return Err(HarnessError::Setup(format!(
                    "{} has no connector for {}",
                    self.cfg.stage, hop.payload_kind
                )));
            }
            _ => None,
        };
        // Fence passed: every inbound tensor completed and matched. Now "compute".
        let c = self.stub.compute_time(plan);
        // Nobody waits past the request timeout (downstream stages for this stage's offer,
        // counted from when they started the request as this one did): a modelled compute
        // that would end later fails now, instead of keeping the run alive for nothing.
        let budget = self
            .cfg
            .request_timeout
            .saturating_sub(now().saturating_duration_since(started));
        if c > budget {
            let e = HarnessError::Deadline {
                stage: self.cfg.stage.as_str().into(),
                request: rid.into(),
                reason: format!(
                    "modelled compute of {:.3} s would end past the request timeout ({:.3} s left of {:.3} s){}",
                    c.as_secs_f64(),
                    budget.as_secs_f64(),
                    self.cfg.request_timeout.as_secs_f64(),
                    self.stub
                        .outbound(plan)
                        .map(|h| format!(": its {} offer would come too late", h.payload_kind))
                        .unwrap_or_default()
                ),
            };
            self.abort_outbound(rid, plan, &e).await;
            return Err(e);
        }
        let t = now();
        out.compute_start_ms = Some(ms(t.duration_since(started)));
        if !c.is_zero() {
            tokio::time::sleep(c).await;
        }
        out.compute_ms = ms(now().saturating_duration_since(t));
        if let (Some(side), Some(hop)) = (&self.outbound, self.stub.outbound(plan)) {
            out.sent = Some(self.send(side, plan, hop, rid, started).await?);
        }
        drop(held);
        Ok(())
    }

    /// Checks an inbound tensor that arrived whole (see [`Stub::check_input`]); against the
    /// remembered digest when the input was pre-generated.
    fn check_input(
        &self,
        plan: &RequestPlan,
        tensor: &str,
        bytes: &[u8],
    ) -> std::result::Result<Digest128, StubError> {
        let remembered = self.pregen.as_ref().and_then(|t| {
            let hop = self.stub.inbound(plan)?;
            let spec = hop.tensor(tensor)?;
            let d = t.input_digest(plan.content_seed(hop.payload_kind), spec)?;
            Some((spec.byte_length, d))
        });
        let Some((expected_len, expected)) = remembered else {
            return self.stub.check_input(plan, tensor, bytes);
        };
        let stage = self.cfg.stage;
        if bytes.len() as u64 != expected_len {
            return Err(StubError::Length {
                stage,
                tensor: tensor.into(),
                expected: expected_len,
                found: bytes.len() as u64,
            });
        }
        let found = Digest128::of_bytes(bytes);
        if found != expected {
            return Err(StubError::Digest {
                stage,
                tensor: tensor.into(),
                expected: expected.to_hex(),
                found: found.to_hex(),
            });
        }
        Ok(found)
    }

    /// Checks one KV tensor's block digests (see [`Stub::check_kv_blocks`]); against the
    /// remembered digests when the input was pre-generated.
    fn check_kv_blocks(
        &self,
        plan: &RequestPlan,
        tensor: &str,
        received: &[Digest128],
    ) -> std::result::Result<(), StubError> {
        let remembered = self.pregen.as_ref().and_then(|t| {
            let spec = self.stub.inbound(plan)?.tensor(tensor)?;
            t.kv_digests(plan.seed, spec)
        });
        match remembered {
            Some(expected) => {
                omnirig_fixtures::check_blocks(tensor, expected, received).map_err(|source| {
                    StubError::Fixture {
                        stage: self.cfg.stage,
                        source,
                    }
                })
            }
            None => self.stub.check_kv_blocks(plan, tensor, received),
        }
    }

    /// The connector fault scripted for this hop and request, if any.
    fn fault(&self, hop: &Hop, rid: &str) -> Option<HarnessFault> {
        self.cfg
            .faults
            .get(&(hop.payload_kind.as_str().to_string(), rid.to_string()))
            .copied()
    }

    fn timeout(&self) -> Duration {
        self.cfg.hop_timeout
    }

    // ---------------------------------------------------------------- consumer

    async fn receive(
        &self,
        side: &Side<InMem>,
        plan: &RequestPlan,
        hop: &Hop,
        rid: &str,
        started: Instant,
    ) -> Result<(Held, Received)> {
        let link = &side.end.link;
        let engine = &side.end.engine;
        let hop_err = |tensor: Option<&str>, cause: &dyn Cause| {
            HarnessError::handoff(hop.payload_kind, rid, tensor, cause)
        };
        // Refuse upstream if we cannot even reserve, so it does not wait for us.
        let refuse = |e: HarnessError| {
            let _ = link.send(Msg::Refuse {
                request: rid.into(),
                cause: e.to_string(),
                kind: e.failure_kind(),
            });
            e
        };
        // With credits (the default), the consumer reserves and grants at once, while
        // upstream computes, and the producer's offer marks the handoff's start; without,
        // it reserves only once the producer has its outputs, holding its pools for the
        // handoff alone. A consumer that gives up waiting for the offer says so, or its
        // producer would wait a hop timeout.
        let offered = if self.cfg.credits {
            None
        } else {
            match link.recv(rid, self.cfg.request_timeout).await {
                Ok(Msg::Offer { .. }) => {}
                Ok(other) => return Err(refuse(bad_reply(hop.payload_kind, rid, other))),
                Err(e) => {
                    let e = Classified::new(FailureKind::TimedOut, format!("no offer: {e}"));
                    return Err(refuse(hop_err(None, &e)));
                }
            }
            Some(now())
        };
        let wait = Wait {
            offered,
            // A credit waits for the offer as long as the request may take.
            offer_timeout: self
                .cfg
                .request_timeout
                .saturating_sub(now().saturating_duration_since(started)),
        };
        let mut rec = Received {
            hop: hop.payload_kind.as_str().into(),
            ..Default::default()
        };
        let times: HandoffTimes;
        let held: Held = match &side.mem {
            InMem::Ec(store) => {
                let (held, t) = self
                    .receive_ec(store, engine, link, plan, hop, rid, wait, &mut rec)
                    .await?;
                times = t;
                rec.verify_ms = ms(times.verify());
                Box::new(held)
            }
            InMem::Kv(kv) => {
                let layout = hop
                    .kv
                    .as_ref()
                    .ok_or_else(|| hop_err(None, &"no KV layout"))?;
                let (held, t, first_block, moved) = self
                    .receive_kv(kv, engine, link, plan, hop, layout, rid, wait)
                    .await?;
                times = t;
                rec.verify_ms = ms(times.verify());
                let per_block = 2 * u64::from(layout.num_layers) * kv.geo.block_bytes;
                rec.tensors = hop.tensors.len();
                rec.landed_bytes = moved as u64 * per_block;
                rec.reused_bytes = u64::from(first_block) * per_block;
                Box::new(held)
            }
            InMem::Pool(pool) => {
                let (held, t) = self
                    .receive_packet(pool, engine, link, plan, hop, rid, wait)
                    .await?;
                times = t;
                rec.tensors = hop.tensors.len();
                rec.landed_bytes = hop.tensors.iter().map(|t| t.byte_length).sum();
                rec.verify_ms = ms(times.verify());
                Box::new(held)
            }
        };
        let end = now();
        // A handoff that ended well had its offer.
        let t0 = times.offered.unwrap_or(end);
        rec.start_ms = Some(ms(t0.duration_since(started)));
        rec.handoff_ms = ms(end.duration_since(t0));
        rec.phases_ms = times.phases(end);
        Ok((held, rec))
    }

    /// The stage-packet connector's consumer end: drives a [`PacketConsumer`] from the
    /// offer (already received at `offered`) to every tensor verified.
    #[allow(clippy::too_many_arguments)]
    async fn receive_packet(
        &self,
        pool: &Arc<Pool>,
        engine: &Arc<Engine>,
        link: &Link,
        plan: &RequestPlan,
        hop: &Hop,
        rid: &str,
        wait: Wait,
    ) -> Result<(LeasesHeld, HandoffTimes)> {
        let plan_err = |tensor: &str, cause: &dyn Cause| {
            HarnessError::handoff(hop.payload_kind, rid, Some(tensor), cause)
        };
        let mut held = LeasesHeld {
            engine: engine.clone(),
            grants: vec![],
            _leases: vec![],
        };
        let fault = self.fault(hop, rid);
        let within = wait.reserve_timeout(self.timeout());
        let mut m = PacketConsumer::new(hop.payload_kind, rid, hop.tensors.clone(), self.timeout());
        match wait.offered {
            Some(at) => m.handle_msg(
                at,
                Msg::Offer {
                    request: rid.into(),
                },
            ),
            None => m.credit(now(), wait.offer_timeout),
        }
        loop {
            while let Some(action) = m.poll_action() {
                match action {
                    ConsumerAction::Reserve => {
                        match self
                            .reserve_packet(pool, engine, hop, rid, fault, within, &mut held)
                            .await
                        {
                            Ok((told, offsets)) => {
                                m.granted(now(), held.grants.clone(), told, offsets)
                            }
                            Err(e) => m.reserve_failed(vec![], e),
                        }
                    }
                    ConsumerAction::Send(msg) => {
                        consumer_send(link, engine, msg, fault, &held.grants)?
                    }
                    ConsumerAction::Revoke(grants) => {
                        revoke_all(engine, &grants);
                        let decodes = m.state() == ConsumerState::Fencing;
                        m.fenced(now());
                        if decodes && let Some(h) = &self.host {
                            // fenced() decoded the packet, in no virtual time: charge it.
                            h.packet(hop.tensors.len()).await;
                        }
                    }
                    ConsumerAction::Land {
                        index,
                        offset,
                        bytes,
                    } => {
                        if let Err(e) = pool.buffer.write(offset, &bytes) {
                            let e = plan_err(&hop.tensors[index].name, &e);
                            m.verified(now(), index, Err(e));
                        }
                    }
                    ConsumerAction::Verify {
                        index,
                        tensor,
                        offset,
                        len,
                    } => {
                        let found = cpu_for(len, || {
                            pool.buffer
                                .view(offset, len, |b| self.check_input(plan, &tensor, b))
                        });
                        self.charge_verify(plan, &tensor, len).await;
                        let found = match found {
                            Ok(Ok(d)) => Ok(d),
                            Ok(Err(e)) => Err(plan_err(&tensor, &e)),
                            Err(e) => Err(plan_err(&tensor, &e)),
                        };
                        m.verified(now(), index, found);
                    }
                    ConsumerAction::Done => return Ok((held, m.times())),
                    ConsumerAction::Failed(e) => return Err(e),
                }
            }
            next_event(link, rid, &mut m, self.timeout()).await;
        }
    }

    /// The KV connector's consumer end (decode): drives a [`KvConsumer`] from the offer
    /// (already received at `offered`) to every block verified. Returns what the request
    /// holds, the handoff's times, the prefix-hit block count and how many blocks moved.
    #[allow(clippy::too_many_arguments)]
    async fn receive_kv(
        &self,
        kv: &Arc<PagedKv>,
        engine: &Arc<Engine>,
        link: &Link,
        plan: &RequestPlan,
        hop: &Hop,
        layout: &KvLayout,
        rid: &str,
        wait: Wait,
    ) -> Result<(KvHeld, HandoffTimes, u32, usize)> {
        let hop_err = |tensor: Option<&str>, cause: &dyn Cause| {
            HarnessError::handoff(hop.payload_kind, rid, tensor, cause)
        };
        let n = layout.num_blocks as usize;
        let full = (layout.tokens / layout.block_tokens) as usize;
        let bb = kv.geo.block_bytes;
        let fault = self.fault(hop, rid);
        let mut held = KvHeld {
            kv: kv.clone(),
            engine: engine.clone(),
            blocks: vec![],
            grants: vec![],
        };
        let mut m = KvConsumer::new(
            hop.payload_kind,
            rid,
            layout.num_layers,
            layout.num_blocks,
            self.timeout(),
        );
        match wait.offered {
            Some(at) => m.handle_msg(
                at,
                Msg::Offer {
                    request: rid.into(),
                },
            ),
            None => m.credit(now(), wait.offer_timeout),
        }
        loop {
            while let Some(action) = m.poll_action() {
                match action {
                    KvConsumerAction::Reserve => {
                        // At least one block always moves (the last token is recomputed).
                        let hashes: Vec<_> = (0..full.min(n.saturating_sub(1)) as u64)
                            .map(|i| block_hash(plan.seed, i))
                            .collect();
                        if self.cfg.prefix_cache {
                            held.blocks = kv.lock().lookup_prefix(&hashes);
                        }
                        let first_block = held.blocks.len() as u32;
                        // An exhausted pool: ask for more blocks than it will ever have.
                        let want = match fault {
                            Some(HarnessFault::PoolExhausted) => kv.geo.capacity as usize + 1,
                            _ => n - held.blocks.len(),
                        };
                        match kv.alloc(want, wait.reserve_timeout(self.timeout())).await {
                            Ok(tail) => {
                                held.blocks.extend_from_slice(&tail);
                                m.blocks(first_block, tail, vec![]);
                            }
                            Err(e) => m.reserve_failed(vec![], hop_err(None, &e)),
                        }
                    }
                    KvConsumerAction::Grant(runs) => {
                        let mut told = Vec::with_capacity(runs.len());
                        let mut failed = None;
                        for r in &runs {
                            let bytes = u64::from(r.len) * bb;
                            let short = fault == Some(HarnessFault::GrantOutOfBounds);
                            match engine.grant(
                                &kv.buffer,
                                kv.geo.offset(r.layer, r.v, r.block),
                                if short { bytes - 1 } else { bytes },
                                Access::Write,
                            ) {
                                Ok(g) => {
                                    held.grants.push(g.clone());
                                    // Out of bounds: prefill is told one byte more than granted.
                                    told.push(Grant { len: bytes, ..g });
                                }
                                Err(e) => {
                                    failed = Some(hop_err(None, &e));
                                    break;
                                }
                            }
                        }
                        match failed {
                            None => m.granted(now(), held.grants.clone(), told),
                            Some(e) => m.reserve_failed(vec![], e),
                        }
                    }
                    KvConsumerAction::Send(msg) => {
                        consumer_send(link, engine, msg, fault, &held.grants)?
                    }
                    KvConsumerAction::Revoke(grants) => {
                        revoke_all(engine, &grants);
                        m.fenced(now());
                    }
                    KvConsumerAction::Verify => {
                        // Every block the stage will use, reused ones included.
                        let found = cpu(|| -> Result<()> {
                            for layer in 0..layout.num_layers {
                                for v in [false, true] {
                                    let name = kv_tensor(layer, v);
                                    let digests = held
                                        .blocks
                                        .iter()
                                        .map(|&b| {
                                            kv.buffer.view(
                                                kv.geo.offset(layer, v, b),
                                                bb,
                                                Digest128::of_bytes,
                                            )
                                        })
                                        .collect::<std::result::Result<Vec<_>, _>>()
                                        .map_err(|e| hop_err(Some(&name), &e))?;
                                    self.check_kv_blocks(plan, &name, &digests)
                                        .map_err(|e| hop_err(Some(&name), &e))?;
                                }
                            }
                            Ok(())
                        });
                        if found.is_ok() && self.cfg.prefix_cache {
                            let mut pool = kv.lock();
                            for (i, &b) in held.blocks.iter().enumerate().take(full) {
                                pool.commit(b, block_hash(plan.seed, i as u64));
                            }
                        }
                        if let Some(h) = &self.host {
                            let bytes = kv_bytes(held.blocks.len(), bb, layout.num_layers);
                            h.verify_kv(bytes, self.pregen.is_some()).await;
                        }
                        m.verified(now(), found);
                    }
                    KvConsumerAction::Done => {
                        let (first, moved) = (m.first_block(), m.tail().len());
                        return Ok((held, m.times(), first, moved));
                    }
                    KvConsumerAction::Failed(e) => return Err(e),
                }
            }
            next_event(link, rid, &mut m, self.timeout()).await;
        }
    }

    /// Reserves and grants a destination per tensor of a stage-packet hop (held in
    /// `held`); returns the grants to tell the producer and where each tensor lands.
    #[allow(clippy::too_many_arguments)]
    async fn reserve_packet(
        &self,
        pool: &Arc<Pool>,
        engine: &Engine,
        hop: &Hop,
        rid: &str,
        fault: Option<HarnessFault>,
        within: Duration,
        held: &mut LeasesHeld,
    ) -> Result<(Vec<Grant>, Vec<u64>)> {
        let mut told = Vec::with_capacity(hop.tensors.len());
        let mut offsets = Vec::with_capacity(hop.tensors.len());
        for t in &hop.tensors {
            let err =
                |e: &dyn Cause| HarnessError::handoff(hop.payload_kind, rid, Some(&t.name), e);
            // An exhausted pool: a reservation larger than the pool will ever have.
            let want = match fault {
                Some(HarnessFault::PoolExhausted) => pool.capacity() + 1,
                _ => t.byte_length,
            };
            let lease = pool.reserve(want, within).await.map_err(|e| err(&e))?;
            let short = fault == Some(HarnessFault::GrantOutOfBounds) && t.byte_length > 1;
            let g = engine
                .grant(
                    &pool.buffer,
                    lease.offset,
                    if short {
                        t.byte_length - 1
                    } else {
                        t.byte_length
                    },
                    Access::Write,
                )
                .map_err(|e| err(&e))?;
            held.grants.push(g.clone());
            offsets.push(lease.offset);
            held._leases.push(lease);
            // Out of bounds: the producer is told one byte more than granted.
            told.push(Grant {
                len: t.byte_length,
                ..g
            });
        }
        Ok((told, offsets))
    }

    /// The EC connector's consumer end (prefill): drives an [`EcConsumer`] from the offer
    /// (already received at `offered`) to every entry verified, moved or cached.
    #[allow(clippy::too_many_arguments)]
    async fn receive_ec(
        &self,
        store: &Arc<EcStore>,
        engine: &Arc<Engine>,
        link: &Link,
        plan: &RequestPlan,
        hop: &Hop,
        rid: &str,
        wait: Wait,
        rec: &mut Received,
    ) -> Result<(EcHeld, HandoffTimes)> {
        let hop_err = |tensor: &str, cause: &dyn Cause| {
            HarnessError::handoff(hop.payload_kind, rid, Some(tensor), cause)
        };
        // Entries leave `reserved` only once verified: on any error, the drop of `held`
        // fails the rest, so nobody caches a bad entry.
        let mut held = EcHeld {
            store: store.clone(),
            engine: engine.clone(),
            ready: vec![],
            reserved: vec![],
            grants: vec![],
        };
        let within = wait.reserve_timeout(self.timeout());
        let mut m = EcConsumer::new(hop.payload_kind, rid, self.timeout());
        match wait.offered {
            Some(at) => m.handle_msg(
                at,
                Msg::Offer {
                    request: rid.into(),
                },
            ),
            None => m.credit(now(), wait.offer_timeout),
        }
        loop {
            while let Some(action) = m.poll_action() {
                match action {
                    EcConsumerAction::Reserve => {
                        match self
                            .reserve_ec(store, engine, plan, hop, rid, within, &mut held)
                            .await
                        {
                            Ok(entries) => m.granted(now(), held.grants.clone(), entries),
                            Err(e) => m.reserve_failed(vec![], e),
                        }
                    }
                    // EC's grant faults strike where its grants are made, not here.
                    EcConsumerAction::Send(msg) => consumer_send(link, engine, msg, None, &[])?,
                    EcConsumerAction::Revoke(grants) => {
                        revoke_all(engine, &grants);
                        m.fenced(now());
                    }
                    EcConsumerAction::Verify {
                        index,
                        tensor,
                        offset,
                        len,
                    } => {
                        let found = cpu_for(len, || {
                            store
                                .buffer
                                .view(offset, len, |b| self.check_input(plan, &tensor, b))
                        });
                        self.charge_verify(plan, &tensor, len).await;
                        let found = match found {
                            Ok(Ok(d)) => Ok(d),
                            Ok(Err(e)) => Err(hop_err(&tensor, &e)),
                            Err(e) => Err(hop_err(&tensor, &e)),
                        };
                        m.verified(now(), index, found);
                    }
                    EcConsumerAction::Cache { mm_hash } => {
                        held.reserved.retain(|r| r.0 != mm_hash);
                        store.lock().ready(&mm_hash);
                        store.changed.notify_waiters();
                        held.ready.push(mm_hash);
                    }
                    EcConsumerAction::Done => {
                        for e in m.entries() {
                            rec.tensors += 1;
                            if e.grant.is_some() {
                                rec.landed_bytes += e.len;
                            } else {
                                rec.reused_bytes += e.len;
                            }
                        }
                        return Ok((held, m.times()));
                    }
                    EcConsumerAction::Failed(e) => return Err(e),
                }
            }
            next_event(link, rid, &mut m, self.timeout()).await;
        }
    }

    /// Takes every mm_hash of the request from the encoder cache: a cached entry is used
    /// as is (no grant), a missing one reserved, poisoned and granted (held in `held`).
    #[allow(clippy::too_many_arguments)]
    async fn reserve_ec(
        &self,
        store: &Arc<EcStore>,
        engine: &Engine,
        plan: &RequestPlan,
        hop: &Hop,
        rid: &str,
        within: Duration,
        held: &mut EcHeld,
    ) -> Result<Vec<EcEntry>> {
        let deadline = tokio::time::Instant::now() + within;
        let mut slots: Vec<EcEntry> = Vec::new();
        let mut seen = HashSet::new();
        for item in &plan.mm_items {
            if !seen.insert(item.mm_hash.clone()) {
                continue;
            }
            let spec = hop.tensor(&item.tensor_name).ok_or_else(|| {
                HarnessError::handoff(
                    hop.payload_kind,
                    rid,
                    Some(&item.tensor_name),
                    &"not in the hop",
                )
            })?;
            loop {
                let notified = store.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let got = store.lock().acquire(&item.mm_hash, spec.byte_length);
                match got {
                    EcAcquire::Hit { offset, .. } => {
                        held.ready.push(item.mm_hash.clone());
                        slots.push(EcEntry {
                            mm_hash: item.mm_hash.clone(),
                            tensor: spec.name.clone(),
                            offset,
                            len: spec.byte_length,
                            grant: None,
                        });
                        break;
                    }
                    EcAcquire::Reserve { offset, len } => {
                        held.reserved
                            .push((item.mm_hash.clone(), offset, spec.name.clone()));
                        // Evicted entries leave their bytes behind: poison before granting.
                        crate::pool::poison(&store.buffer, offset, len)?;
                        let g =
                            engine.grant(&store.buffer, offset, spec.byte_length, Access::Write)?;
                        held.grants.push(g.clone());
                        slots.push(EcEntry {
                            mm_hash: item.mm_hash.clone(),
                            tensor: spec.name.clone(),
                            offset,
                            len: spec.byte_length,
                            grant: Some(g),
                        });
                        break;
                    }
                    // Another request is receiving it, or no room yet: wait for a change.
                    EcAcquire::Pending | EcAcquire::NoRoom => {
                        if tokio::time::timeout_at(deadline, notified).await.is_err() {
                            return Err(HarnessError::handoff(
                                hop.payload_kind,
                                rid,
                                Some(&spec.name),
                                &format!("encoder cache: {got:?} for {within:?}"),
                            ));
                        }
                    }
                }
            }
        }
        Ok(slots)
    }

    // ---------------------------------------------------------------- producer

    /// Upstream of this stage failed: answer the downstream reservation with an
    /// ERROR so it releases what it reserved.
    async fn abort_outbound(&self, rid: &str, plan: &RequestPlan, cause: &HarnessError) {
        let (Some(side), Some(_)) = (&self.outbound, self.stub.outbound(plan)) else {
            return;
        };
        // The consumer is waiting for our offer (or, past it, for FINISH): either
        // way an ERROR ends its wait and releases what it reserved.
        let _ = side.end.link.send(Msg::Error {
            request: rid.into(),
            failed: vec![],
            cause: format!("{} did not run: {cause}", self.cfg.stage),
            kind: cause.failure_kind(),
            peer: cause.failure_peer(),
        });
    }

    async fn send(
        &self,
        side: &Side<OutMem>,
        plan: &RequestPlan,
        hop: &Hop,
        rid: &str,
        started: Instant,
    ) -> Result<Sent> {
        if let (
            OutMem::Staging(pool),
            PayloadKind::ThinkerToTalker | PayloadKind::TalkerToCode2wav,
        ) = (&side.mem, hop.payload_kind)
        {
            return self.send_packet(side, pool, plan, hop, rid, started).await;
        }
        match &side.mem {
            OutMem::Kv(kv) => self.send_kv(side, kv, plan, hop, rid, started).await,
            OutMem::Staging(pool) => self.send_ec(side, pool, plan, hop, rid, started).await,
        }
    }

    /// The EC connector's producer end (the encoder): drives an [`EcProducer`] from the
    /// offer to FINISH (or the ERROR naming the entry that failed). Entries the consumer
    /// has cached get no grant and are not moved.
    async fn send_ec(
        &self,
        side: &Side<OutMem>,
        pool: &Arc<Pool>,
        plan: &RequestPlan,
        hop: &Hop,
        rid: &str,
        started: Instant,
    ) -> Result<Sent> {
        let link = &side.end.link;
        let engine = &side.end.engine;
        let mut sent = Sent {
            hop: hop.payload_kind.as_str().into(),
            ..Default::default()
        };
        // The embeddings exist before the offer (see `send_packet`); entries the consumer
        // has cached are produced too, as the encoder ran for them, but not moved.
        let (staged, stage_ms) = match self.stage_outputs(pool, plan, hop, rid).await {
            Ok(s) => s,
            Err(e) => return Err(self.abort_staging(link, rid, e)),
        };
        sent.stage_ms = stage_ms;
        let mut m = EcProducer::new(
            now(),
            hop.payload_kind,
            rid,
            hop.tensors.clone(),
            self.timeout(),
        );
        let mut writes: Vec<(usize, String, Grant)> = Vec::new();
        let waiting = m.state() == EcProducerState::Offered;
        take_credit(link, rid, &mut m, waiting);
        // Messages held until the machine has no more actions: the offer and the FINISH
        // behind it leave in one write.
        let mut out: Vec<Msg> = Vec::new();
        loop {
            while let Some(action) = m.poll_action() {
                match action {
                    EcProducerAction::Send(msg) => out.push(msg),
                    EcProducerAction::Write {
                        index,
                        tensor,
                        grant,
                    } => writes.push((index, tensor, grant)),
                    EcProducerAction::Done => {
                        send_held(link, &mut out)?;
                        // Everything was cached downstream: an empty transfer, now.
                        if sent.transfer_start_ms.is_none() {
                            sent.transfer_start_ms =
                                Some(ms(now().saturating_duration_since(started)));
                        }
                        return Ok(sent);
                    }
                    EcProducerAction::Failed(e) => {
                        // Best effort: the handoff failed, and says why.
                        let _ = send_held(link, &mut out);
                        return Err(e);
                    }
                }
            }
            send_held(link, &mut out)?;
            if !writes.is_empty() {
                // Every granted entry in one engine batch.
                let mut requests = Vec::with_capacity(writes.len());
                let mut indices = Vec::with_capacity(writes.len());
                let mut names = Vec::with_capacity(writes.len());
                for (index, name, grant) in writes.drain(..) {
                    let Some(s) = hop
                        .tensors
                        .iter()
                        .position(|t| t.name == name)
                        .map(|i| &staged[i])
                    else {
                        let e = HarnessError::handoff(
                            hop.payload_kind,
                            rid,
                            Some(&name),
                            &"not a tensor of this hop",
                        );
                        m.stage_failed(index, e);
                        break;
                    };
                    m.staged(index, s.digest);
                    requests.push(
                        Request::write(&s.buffer, s.offset, &grant, 0, s.len)
                            .tagged(fault_tag(rid, &name)),
                    );
                    indices.push(index);
                    names.push(name);
                    sent.bytes += s.len;
                }
                if m.state() == EcProducerState::Writing {
                    sent.requests = requests.len();
                    sent.tensors = indices.len();
                    let t = now();
                    sent.transfer_start_ms = Some(ms(t.duration_since(started)));
                    let r = self.transfer(engine, requests).await;
                    sent.transfer_ms = ms(now().saturating_duration_since(t));
                    match r {
                        Ok(_) => {
                            let now = now();
                            indices.iter().for_each(|&i| m.write_completed(now, i))
                        }
                        Err(e) => {
                            let k = e.task();
                            let name = k.and_then(|k| names.get(k)).map(String::as_str);
                            let err = HarnessError::handoff(hop.payload_kind, rid, name, &e);
                            m.write_failed(k.and_then(|k| indices.get(k).copied()), err);
                        }
                    }
                }
                continue;
            }
            next_event(link, rid, &mut m, self.timeout()).await;
        }
    }

    /// The KV connector's producer end (prefill): fills its blocks (its compute's output,
    /// there before decode asks for it), then drives a [`KvProducer`] from the offer to
    /// FINISH (or the ERROR naming the blocks whose write failed).
    async fn send_kv(
        &self,
        side: &Side<OutMem>,
        kv: &Arc<PagedKv>,
        plan: &RequestPlan,
        hop: &Hop,
        rid: &str,
        started: Instant,
    ) -> Result<Sent> {
        let link = &side.end.link;
        let engine = &side.end.engine;
        let hop_err = |tensor: Option<&str>, cause: &dyn Cause| {
            HarnessError::handoff(hop.payload_kind, rid, tensor, cause)
        };
        let layout = hop
            .kv
            .as_ref()
            .ok_or_else(|| hop_err(None, &"no KV layout"))?;
        let blocks = kv
            .alloc(layout.num_blocks as usize, self.timeout())
            .await
            .map_err(|e| hop_err(None, &e));
        let blocks = match blocks {
            Ok(b) => b,
            Err(e) => {
                self.abort_outbound(rid, plan, &e).await;
                return Err(e);
            }
        };
        let held = KvHeld {
            kv: kv.clone(),
            engine: engine.clone(),
            blocks,
            grants: vec![],
        };
        let bb = kv.geo.block_bytes;
        let fill = || -> Result<()> {
            for layer in 0..layout.num_layers {
                for v in [false, true] {
                    let name = if v {
                        KvLayout::v_name(layer)
                    } else {
                        KvLayout::k_name(layer)
                    };
                    let spec = hop
                        .tensor(&name)
                        .ok_or_else(|| hop_err(Some(&name), &"not in the hop"))?;
                    let made = self.pregen.as_ref().and_then(|t| {
                        let o = t.output(plan.content_seed(hop.payload_kind), spec)?;
                        Some((t.buffer()?, o.offset))
                    });
                    for (i, &b) in held.blocks.iter().enumerate() {
                        let at = kv.geo.offset(layer, v, b);
                        match made {
                            // Copied from the pre-generated tensor, block by block.
                            Some((src, offset)) => src
                                .view(offset + i as u64 * bb, bb, |from| kv.buffer.write(at, from))
                                .and_then(|r| r)
                                .map_err(|e| hop_err(Some(&name), &e))?,
                            None => kv
                                .buffer
                                .fill(at, bb, |out| {
                                    self.stub.produce(plan, spec, i as u64 * bb, out)
                                })
                                .map_err(|e| hop_err(Some(&name), &e))?
                                .map_err(|e| hop_err(Some(&name), &e))?,
                        }
                    }
                }
            }
            Ok(())
        };
        if let Err(e) = cpu(fill) {
            self.abort_outbound(rid, plan, &e).await;
            return Err(e);
        }
        if let Some(h) = &self.host {
            // Generated block by block (copied instead when pre-generated: a copy's cost).
            let bytes = kv_bytes(held.blocks.len(), bb, layout.num_layers);
            if self.pregen.is_some() {
                h.copy_here(bytes).await;
            } else {
                h.produce(bytes, false).await;
            }
        }
        let mut m = KvProducer::new(
            now(),
            hop.payload_kind,
            rid,
            held.blocks.clone(),
            kv.geo.num_layers,
            bb,
            self.timeout(),
        );
        let mut sent = Sent {
            hop: hop.payload_kind.as_str().into(),
            tensors: hop.tensors.len(),
            ..Default::default()
        };
        let mut writes = Vec::new();
        let waiting = m.state() == KvProducerState::Offered;
        take_credit(link, rid, &mut m, waiting);
        // Messages held until the machine has no more actions: the offer and the FINISH
        // behind it leave in one write.
        let mut out: Vec<Msg> = Vec::new();
        loop {
            while let Some(action) = m.poll_action() {
                match action {
                    KvProducerAction::Send(msg) => out.push(msg),
                    KvProducerAction::Write {
                        index,
                        write,
                        grant,
                        len,
                        name,
                    } => writes.push((index, write, grant, len, name)),
                    KvProducerAction::Done => {
                        send_held(link, &mut out)?;
                        return Ok(sent);
                    }
                    KvProducerAction::Failed(e) => {
                        // Best effort: the handoff failed, and says why.
                        let _ = send_held(link, &mut out);
                        return Err(e);
                    }
                }
            }
            send_held(link, &mut out)?;
            if !writes.is_empty() {
                // Every run contiguous on both sides is one request, all in one batch.
                let ts = now();
                let mut requests = Vec::with_capacity(writes.len());
                let mut indices = Vec::with_capacity(writes.len());
                let mut names = Vec::with_capacity(writes.len());
                for (index, w, grant, len, name) in writes.drain(..) {
                    requests.push(
                        Request::write(
                            &kv.buffer,
                            kv.geo.offset(w.layer, w.v, w.run.src),
                            &grant,
                            w.grant_offset,
                            len,
                        )
                        .tagged(fault_tag(rid, &kv_tensor(w.layer, w.v))),
                    );
                    indices.push(index);
                    names.push(name);
                    sent.bytes += len;
                }
                sent.stage_ms = ms(now().saturating_duration_since(ts));
                sent.requests = requests.len();
                let t = now();
                sent.transfer_start_ms = Some(ms(t.duration_since(started)));
                let r = self.transfer(engine, requests).await;
                sent.transfer_ms = ms(now().saturating_duration_since(t));
                match r {
                    Ok(_) => {
                        let now = now();
                        indices.iter().for_each(|&i| m.write_completed(now, i))
                    }
                    Err(e) => {
                        let k = e.task();
                        let name = k.and_then(|k| names.get(k)).map(String::as_str);
                        let err = hop_err(name, &e);
                        m.write_failed(k.and_then(|k| indices.get(k).copied()), err);
                    }
                }
                continue;
            }
            next_event(link, rid, &mut m, self.timeout()).await;
        }
    }

    /// The stage-packet connector's producer end: drives a [`PacketProducer`] from the
    /// offer to the packet (or the ERROR naming what failed).
    async fn send_packet(
        &self,
        side: &Side<OutMem>,
        pool: &Arc<Pool>,
        plan: &RequestPlan,
        hop: &Hop,
        rid: &str,
        started: Instant,
    ) -> Result<Sent> {
        let link = &side.end.link;
        let engine = &side.end.engine;
        let mut sent = Sent {
            hop: hop.payload_kind.as_str().into(),
            ..Default::default()
        };
        // The outputs exist before the offer, as a real stage's do when it finishes: the
        // stub produces and digests them here, outside the handoff.
        let (staged, stage_ms) = match self.stage_outputs(pool, plan, hop, rid).await {
            Ok(s) => s,
            Err(e) => return Err(self.abort_staging(link, rid, e)),
        };
        sent.stage_ms = stage_ms;
        let mut m = PacketProducer::new(
            now(),
            hop.payload_kind,
            rid,
            hop.tensors.clone(),
            self.timeout(),
        );
        for (index, s) in staged.iter().enumerate() {
            m.staged(index, s.digest);
        }
        m = m.with_inline_below(self.cfg.inline_below);
        if let Some(
            f @ (HarnessFault::TruncatedSidecar
            | HarnessFault::UnknownVersionSidecar
            | HarnessFault::InconsistentSidecar),
        ) = self.fault(hop, rid)
        {
            m = m.with_sidecar(move |p| faulty_sidecar(f, p));
        }
        let waiting = m.state() == ProducerState::Offered;
        take_credit(link, rid, &mut m, waiting);
        let mut writes: Vec<(usize, Grant)> = Vec::new();
        // Messages held until the machine has no more actions, so an offer and the inline
        // packet right behind it leave in one write.
        let mut out: Vec<Msg> = Vec::new();
        loop {
            while let Some(action) = m.poll_action() {
                match action {
                    ProducerAction::Send(msg) => out.push(msg),
                    ProducerAction::Write { index, grant, .. } => writes.push((index, grant)),
                    ProducerAction::Inline => {
                        // The packet carries the tensors, in its layout.
                        let t = now();
                        sent.transfer_start_ms = Some(ms(t.duration_since(started)));
                        let (at, span) = packet_layout(hop.tensors.iter().map(|t| &t.byte_length));
                        let mut bytes = vec![0u8; span as usize];
                        let read = staged.iter().zip(&at).try_for_each(|(s, &a)| {
                            let a = a as usize;
                            s.buffer.read(s.offset, &mut bytes[a..a + s.len as usize])
                        });
                        // One instant ends the copy for both clocks: the packet's
                        // `writing_us` (the consumer's transfer phase) may not end before
                        // the `transfer_ms` reported beside it.
                        let done = now();
                        sent.transfer_ms = ms(done.saturating_duration_since(t));
                        match read {
                            Ok(()) => {
                                sent.tensors = staged.len();
                                sent.bytes = staged.iter().map(|s| s.len).sum();
                                m.inlined(done, bytes);
                            }
                            Err(e) => m.inline_failed(HarnessError::handoff(
                                hop.payload_kind,
                                rid,
                                None,
                                &e,
                            )),
                        }
                    }
                    ProducerAction::Done => {
                        send_held(link, &mut out)?;
                        return Ok(sent);
                    }
                    ProducerAction::Failed(e) => {
                        // Best effort: the handoff failed, and says why.
                        let _ = send_held(link, &mut out);
                        return Err(e);
                    }
                }
            }
            send_held(link, &mut out)?;
            if !writes.is_empty() {
                // Every tensor in one engine batch.
                let mut requests = Vec::with_capacity(writes.len());
                let mut indices = Vec::with_capacity(writes.len());
                for (index, grant) in writes.drain(..) {
                    let (name, s) = (&hop.tensors[index].name, &staged[index]);
                    requests.push(
                        Request::write(&s.buffer, s.offset, &grant, 0, s.len)
                            .tagged(fault_tag(rid, name)),
                    );
                    indices.push(index);
                    sent.bytes += s.len;
                }
                sent.requests = requests.len();
                sent.tensors = indices.len();
                let t = now();
                sent.transfer_start_ms = Some(ms(t.duration_since(started)));
                let r = self.transfer(engine, requests).await;
                sent.transfer_ms = ms(now().saturating_duration_since(t));
                match r {
                    Ok(_) => {
                        let now = now();
                        indices.iter().for_each(|&i| m.write_completed(now, i))
                    }
                    Err(e) => {
                        let index = e.task().and_then(|k| indices.get(k).copied());
                        let name = index.map(|i| hop.tensors[i].name.as_str());
                        let err = HarnessError::handoff(hop.payload_kind, rid, name, &e);
                        m.write_failed(index, err);
                    }
                }
                continue;
            }
            next_event(link, rid, &mut m, self.timeout()).await;
        }
    }

    /// Produces and digests every output of `hop` in staging memory (one lease each),
    /// before the offer; returns them in the hop's order and how long that took.
    async fn stage_outputs(
        &self,
        pool: &Arc<Pool>,
        plan: &RequestPlan,
        hop: &Hop,
        rid: &str,
    ) -> std::result::Result<(Vec<Staged>, f64), (Vec<String>, HarnessError)> {
        let ts = now();
        let mut staged = Vec::with_capacity(hop.tensors.len());
        for t in &hop.tensors {
            staged.push(self.stage_tensor(pool, plan, hop, rid, &t.name).await?);
        }
        Ok((staged, ms(now().saturating_duration_since(ts))))
    }

    /// Staging an output failed before its offer: tell the consumer (waiting for the
    /// offer, perhaps with a credit granted), naming the output.
    fn abort_staging(
        &self,
        link: &Link,
        rid: &str,
        (failed, e): (Vec<String>, HarnessError),
    ) -> HarnessError {
        let _ = link.send(Msg::Error {
            request: rid.into(),
            failed,
            cause: e.to_string(),
            kind: e.failure_kind(),
            peer: e.failure_peer(),
        });
        e
    }

    /// Reserves staging space for output `name`, produces it there, and digests it.
    async fn stage_tensor(
        &self,
        pool: &Arc<Pool>,
        plan: &RequestPlan,
        hop: &Hop,
        rid: &str,
        name: &str,
    ) -> std::result::Result<Staged, (Vec<String>, HarnessError)> {
        let fail = |cause: &dyn Cause| {
            (
                vec![name.to_string()],
                HarnessError::handoff(hop.payload_kind, rid, Some(name), cause),
            )
        };
        let spec = hop
            .tensor(name)
            .ok_or_else(|| fail(&"not a tensor of this hop"))?;
        let len = spec.byte_length;
        if let Some(t) = &self.pregen {
            let seed = plan.content_seed(hop.payload_kind);
            if let (Some(o), Some(buffer)) = (t.output(seed, spec), t.buffer()) {
                return Ok(Staged {
                    _lease: None,
                    buffer: buffer.clone(),
                    offset: o.offset,
                    len,
                    digest: o.digest,
                });
            }
        }
        let lease = pool
            .reserve(len, self.timeout())
            .await
            .map_err(|e| fail(&e))?;
        let digest = cpu(|| {
            pool.buffer.fill(lease.offset, len, |b| {
                self.stub.produce(plan, spec, 0, b)?;
                Ok::<_, omnirig_model_stubs::StubError>(Digest128::of_bytes(b))
            })
        })
        .map_err(|e| fail(&e))?
        .map_err(|e| fail(&e))?;
        if let Some(h) = &self.host {
            h.produce(len, true).await;
        }
        Ok(Staged {
            offset: lease.offset,
            _lease: Some(lease),
            buffer: pool.buffer.clone(),
            len,
            digest,
        })
    }

    // ---------------------------------------------------------------- teardown

    /// Forgets caches (EC entries, KV prefix blocks), waits for the engines to
    /// go idle, and reports what is still held: all zero after a clean run.
    pub async fn drain(&self) -> StageUsage {
        let mut u = StageUsage {
            stage: self.cfg.stage.as_str().into(),
            ..Default::default()
        };
        let mut engines: Vec<&Arc<Engine>> = Vec::new();
        if let Some(s) = &self.inbound {
            engines.push(&s.end.engine);
            u.open_mailboxes += s.end.link.open_keys();
            match &s.mem {
                InMem::Ec(store) => {
                    let mut c = store.lock();
                    c.clear();
                    u.ec_entries_in_use = c.in_use();
                    u.pools
                        .push(PoolUsage::new("thinker_prefill.encoder_cache", c.held()));
                }
                InMem::Kv(kv) => {
                    let mut p = kv.lock();
                    p.clear_cache();
                    u.kv_blocks_in_use += p.in_use();
                }
                InMem::Pool(p) => {
                    u.pools.push(PoolUsage::new(&p.name, p.usage()));
                }
            }
        }
        if let Some(s) = &self.outbound {
            engines.push(&s.end.engine);
            u.open_mailboxes += s.end.link.open_keys();
            match &s.mem {
                OutMem::Kv(kv) => u.kv_blocks_in_use += kv.lock().in_use(),
                OutMem::Staging(p) => {
                    u.pools.push(PoolUsage::new(&p.name, p.usage()));
                }
            }
        }
        for e in engines {
            let us: Usage = match e.wait_idle(Duration::from_secs(10)).await {
                Ok(us) => us,
                Err(_) => e.usage(),
            };
            u.engines.push(EngineUsage {
                name: e.name().to_string(),
                grants: us.grants,
                batches: us.batches,
                tasks: us.tasks,
                leases: us.leases,
            });
        }
        u
    }
}

/// Feeds a producer that waits for its reservation (`waiting`) the credit's reservation if it
/// is already here: its writes then start at once, and its offer leaves with the reply
/// (see [`crate::protocol::HeldOffer`]).
fn take_credit(link: &Link, rid: &str, m: &mut impl LinkEvents, waiting: bool) {
    if waiting && let Some(msg) = link.try_recv(rid) {
        m.handle_msg(now(), msg);
    }
}

/// Sends a producer's held messages in one write. The offer and the packet must reach the
/// consumer; an ERROR is best effort (the handoff already failed and says why).
fn send_held(link: &Link, out: &mut Vec<Msg>) -> Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    let must = out.iter().any(|m| !matches!(m, Msg::Error { .. }));
    match link.send_all(std::mem::take(out)) {
        Err(e) if must => Err(e),
        _ => Ok(()),
    }
}

/// The sidecar a faulty producer sends instead of the real one.
/// Sends a consumer connector's message. A reservation must reach the producer (a failed
/// send fails the handoff); any other message answers a producer that may be gone, so it is
/// best effort. With the `grant_revoked` fault, the reservation's `grants` are revoked right
/// after it is sent, before the producer can use them.
fn consumer_send(
    link: &Link,
    engine: &Engine,
    msg: Msg,
    fault: Option<HarnessFault>,
    grants: &[Grant],
) -> Result<()> {
    let reserve = matches!(
        msg,
        Msg::StageReserve { .. } | Msg::KvReserve { .. } | Msg::EcReserve { .. }
    );
    if !reserve {
        let _ = link.send(msg);
        return Ok(());
    }
    link.send(msg)?;
    if fault == Some(HarnessFault::GrantRevoked) {
        revoke_all(engine, grants);
    }
    Ok(())
}

/// Revokes (fences) every grant of a handoff.
fn revoke_all(engine: &Engine, grants: &[Grant]) {
    for g in grants {
        engine.revoke(g);
    }
}

fn faulty_sidecar(fault: HarnessFault, mut packet: Packet) -> Vec<u8> {
    let encode = |p: &Packet| rmp_serde::to_vec_named(p).expect("a packet always encodes");
    match fault {
        HarnessFault::TruncatedSidecar => {
            let mut b = encode(&packet);
            b.truncate(b.len() / 2);
            b
        }
        HarnessFault::UnknownVersionSidecar => {
            packet.packet_version = 2;
            encode(&packet)
        }
        HarnessFault::InconsistentSidecar => {
            if let Some(e) = packet.entries.first_mut() {
                e.byte_length += 2;
            }
            encode(&packet)
        }
        _ => encode(&packet),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnirig_transports::{EngineConfig, TransportKind};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kv_blocks_dropped_while_poisoning_go_back_only_once_the_memset_ends() {
        let engine = Engine::new(EngineConfig::for_kind("kv-test", TransportKind::Loopback))
            .await
            .unwrap();
        let geo = KvGeometry {
            num_layers: 4,
            capacity: 32,
            block_bytes: 64 << 10,
        };
        let kv = PagedKv::new(&engine, geo, 1).unwrap();
        let free = geo.capacity as usize - 1;
        let all_are = |blocks: &[u32], byte: u8| {
            kv.block_ranges(blocks).into_iter().all(|(offset, len)| {
                kv.buffer
                    .view(offset, len, |b| b.iter().all(|&x| x == byte))
                    .unwrap()
            })
        };
        for round in 0..8 {
            // Gives up at once: mostly while the memset runs on the blocking pool.
            let r = tokio::time::timeout(
                Duration::from_micros(1),
                kv.alloc(free, Duration::from_secs(5)),
            )
            .await;
            if let Ok(Ok(done)) = r {
                // Finished before the timer fired: the caller owns them and gives them back.
                kv.lock().release(&done);
            }
            let blocks = kv.alloc(free, Duration::from_secs(10)).await.unwrap();
            assert!(
                all_are(&blocks, omnirig_fixtures::POISON_BYTE),
                "round {round}: blocks handed out unpoisoned"
            );
            for (offset, len) in kv.block_ranges(&blocks) {
                kv.buffer.fill(offset, len, |m| m.fill(0x5a)).unwrap();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(
                all_are(&blocks, 0x5a),
                "round {round}: a dropped allocation's poison landed on the next owner's bytes"
            );
            kv.lock().release(&blocks);
        }
    }
}
