//! Scenarios: which requests to run, how many at once, when they arrive,
//! over which transport per hop, and the stages' modelled compute time.
//!
//! ```yaml
//! name: mixed
//! concurrency: 4                 # requests in flight at most
//! arrival: { pattern: poisson, rate_per_s: 20, seed: 1 }   # closed | interval | poisson
//! transport: loopback            # default for every hop: loopback | tcp | shm
//! hops: { kv_cache: tcp }        # per-hop override, by payload kind
//! memory: host                   # stage tensors in host | gpu memory (gpu: --features cuda)
//! compute: { thinker_decode: { per_token_us: 30 } }        # per stage, see model-stubs
//! block_tokens: 16               # KV block size
//! include_deepstack: true        # vision rows carry DeepStack features
//! prefix_cache: true             # decode reuses KV blocks it already holds
//! hop_timeout_s: 60             # one hop: offer -> FINISH / packet
//! request_timeout_s: 600        # a stage waiting for its upstream's offer
//! requests:
//!   - case: image_audio          # a golden case
//!     repeat: 2
//!   - name: custom               # or a request of its own
//!     request: { seed: 9, text_tokens: 100, output_text_tokens: 10, output_audio_seconds: 1.0 }
//! ```

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use omnirig_fixtures::{
    ModelCard, PayloadKind, RequestPlan, RequestSpec, ShapeOptions, Stage, golden_case,
    plan_request,
};
use omnirig_model_stubs::ComputeTime;
use omnirig_transports::TransportKind;
use serde::{Deserialize, Serialize};

use crate::error::{HarnessError, Result};
use crate::faults::{CompiledFaults, FaultSpec, RandomFaults};
use crate::pool::align_up;
use crate::stage::{PoolSizes, StageConfig};

/// The scenario `omnirig run` uses without a file.
pub const DEFAULT_SCENARIO_YAML: &str = include_str!("../scenarios/default.yaml");

/// Bounds on what a scenario may ask for: beyond them durations overflow, semaphores panic
/// and plans outgrow memory, so they are refused up front with the field named.
pub const MAX_CONCURRENCY: usize = 100_000;
/// Requests in one run, after `repeat` (each keeps a result in the report).
pub const MAX_REQUESTS: u64 = 100_000;
/// Any timeout: a week.
pub const MAX_TIMEOUT_S: f64 = 7.0 * 86_400.0;
/// Gap between arrivals at most (`interval_ms`), and the slowest Poisson rate.
pub const MAX_INTERVAL_MS: f64 = 3_600_000.0;
pub const MIN_RATE_PER_S: f64 = 1e-3;
pub const MAX_RATE_PER_S: f64 = 1e9;
/// Tokens per KV block at most.
pub const MAX_BLOCK_TOKENS: u64 = 1 << 16;

fn default_name() -> String {
    "scenario".into()
}
fn one() -> usize {
    1
}
fn one_u32() -> u32 {
    1
}
fn default_transport() -> TransportKind {
    TransportKind::Loopback
}
fn yes() -> bool {
    true
}
fn block16() -> u64 {
    16
}
fn sixty() -> f64 {
    60.0
}
fn six_hundred() -> f64 {
    600.0
}
fn closed() -> String {
    "closed".into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    #[serde(default = "default_name")]
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "one")]
    pub concurrency: usize,
    #[serde(default)]
    pub arrival: Arrival,
    /// Every hop's transport unless `hops` overrides it (loopback: one process; shm:
    /// processes of one host; tcp: any). An unknown name is refused, listing the valid ones.
    #[serde(default = "default_transport")]
    pub transport: TransportKind,
    #[serde(default)]
    pub hops: HopTransports,
    /// Where the stages' tensors live: `host`, or `gpu` (device memory of GPU 0 through the
    /// cuda transport's allocator, as a real deployment keeps them; tcp hops stage through
    /// pinned buffers, cuda hops copy device to device). `gpu` needs `--features cuda` and a
    /// GPU: the engines refuse to start otherwise, saying why.
    #[serde(default)]
    pub memory: StageMemory,
    #[serde(default)]
    pub compute: StageCompute,
    #[serde(default = "block16")]
    pub block_tokens: u64,
    #[serde(default = "yes")]
    pub include_deepstack: bool,
    #[serde(default = "yes")]
    pub prefix_cache: bool,
    /// Identical requests in one run get distinct outputs downstream of the caches (each
    /// repeat of a spec gets the next `salt`), so one request's bytes can never pass for
    /// another's; encoder-cache and KV prefix hits are unchanged. `false`: every repeat
    /// produces the canonical bytes.
    #[serde(default = "yes")]
    pub distinct_outputs: bool,
    /// One hop, from the producer's offer to FINISH / packet.
    #[serde(default = "sixty")]
    pub hop_timeout_s: f64,
    /// How long a stage waits for its upstream's offer (all upstream work).
    #[serde(default = "six_hundred")]
    pub request_timeout_s: f64,
    /// Stage-packet hops whose packet (in the packet layout) is at most this many bytes
    /// send their tensors inline with it, on the control link, instead of writing them
    /// through the engine (see [`crate::protocol::PacketProducer::with_inline_below`]).
    /// 0 (the default): never; transport faults need the engine path to strike.
    #[serde(default)]
    pub inline_below: u64,
    pub requests: Vec<RequestEntry>,
    /// Scripted faults (see [`crate::faults`]); in-process runs only.
    #[serde(default)]
    pub faults: Vec<FaultSpec>,
    /// Faults on a seeded random fraction of the requests.
    #[serde(default)]
    pub random_faults: Option<RandomFaults>,
    /// `--processes` runs only: SIGKILL one stage's process this long after the run starts.
    #[serde(default)]
    pub kill_stage: Option<KillStage>,
    /// Benchmarks: every stage makes its outputs and its inputs' digests for the scenario's
    /// requests before the run starts (see [`crate::stage::StageWorker::pregenerate`]), so
    /// the run times the data plane, not tensor generation. Every byte is still verified.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pregenerate: bool,
    /// The simulated fabric hops over the `sim` transport run on: nodes, NICs, links and
    /// where each stage sits (see `docs/sim.md`); default: one node per stage behind a
    /// 100 Gb/s switch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric: Option<omnirig_transports::FabricSpec>,
    /// The host model of simulated runs: what the stages' CPU work costs and how many cores
    /// share it (see [`crate::host::CpuSpec`]); a fabric file's `cpu:` section lands here.
    /// None: CPU work takes no simulated time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<crate::host::CpuSpec>,
}

/// Where stage tensors (pools, KV cache, encoder cache) are allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageMemory {
    /// The engine's host allocator.
    #[default]
    Host,
    /// Device memory of GPU 0: fixtures are generated on the host and copied in once, and
    /// each landed tensor is copied back once to be checked.
    Gpu,
}

impl std::str::FromStr for StageMemory {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "host" => Ok(StageMemory::Host),
            "gpu" => Ok(StageMemory::Gpu),
            other => Err(format!("memory {other:?} is not one of host, gpu")),
        }
    }
}

impl StageMemory {
    pub fn as_str(self) -> &'static str {
        match self {
            StageMemory::Host => "host",
            StageMemory::Gpu => "gpu",
        }
    }

    /// The engine config for this memory: `Gpu` adds the cuda transport as the engine's
    /// allocator; the policy still keeps every hop's data on its own transport.
    pub fn configure(
        self,
        c: omnirig_transports::EngineConfig,
    ) -> omnirig_transports::EngineConfig {
        match self {
            StageMemory::Host => c,
            StageMemory::Gpu => c.with(omnirig_transports::CudaConfig {
                memory: omnirig_transports::CudaMemory::Device,
                ..Default::default()
            }),
        }
    }
}

/// A stage process to kill mid-run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KillStage {
    pub stage: String,
    pub after_ms: u64,
}

/// When requests start. `closed`: as soon as fewer than `concurrency` are in
/// flight; `interval`: every `interval_ms`; `poisson`: exponential gaps at
/// `rate_per_s` from `seed`. `concurrency` caps all three.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Arrival {
    #[serde(default = "closed")]
    pub pattern: String,
    #[serde(default)]
    pub interval_ms: f64,
    #[serde(default)]
    pub rate_per_s: f64,
    #[serde(default)]
    pub seed: u64,
}

impl Default for Arrival {
    fn default() -> Self {
        Self {
            pattern: closed(),
            interval_ms: 0.0,
            rate_per_s: 0.0,
            seed: 0,
        }
    }
}

/// Per-hop transport overrides, by payload kind.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HopTransports {
    pub encoder_embeddings: Option<TransportKind>,
    pub kv_cache: Option<TransportKind>,
    pub thinker_to_talker: Option<TransportKind>,
    pub talker_to_code2wav: Option<TransportKind>,
}

/// Modelled compute time per stage (zero by default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageCompute {
    #[serde(default)]
    pub encoder: ComputeTime,
    #[serde(default)]
    pub thinker_prefill: ComputeTime,
    #[serde(default)]
    pub thinker_decode: ComputeTime,
    #[serde(default)]
    pub talker: ComputeTime,
    #[serde(default)]
    pub code2wav: ComputeTime,
}

impl StageCompute {
    pub fn of(&self, stage: Stage) -> ComputeTime {
        match stage {
            Stage::Encoder => self.encoder,
            Stage::ThinkerPrefill => self.thinker_prefill,
            Stage::ThinkerDecode => self.thinker_decode,
            Stage::Talker => self.talker,
            Stage::Code2wav => self.code2wav,
        }
    }
}

/// A golden case by name, or a request of its own; `repeat` runs it again
/// with the same seed (same content, so caches hit).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestEntry {
    #[serde(default)]
    pub case: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub request: Option<RequestSpec>,
    #[serde(default = "one_u32")]
    pub repeat: u32,
    /// Give repeat k the seed `seed + k`: new content each time (no cache hits), the way a
    /// load of distinct small requests looks.
    #[serde(default)]
    pub vary_seed: bool,
}

/// One request of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedRequest {
    /// Unique in the run: `NNN-label`.
    pub id: String,
    /// The golden case or entry name.
    pub label: String,
    pub spec: RequestSpec,
    /// Shapes and hops, shared by the repeats of one entry (so a long run plans each entry
    /// once); the salt that varies a repeat's outputs is in `spec`.
    pub plan: Arc<RequestPlan>,
}

fn bad(source: &str, reason: impl Into<String>) -> HarnessError {
    HarnessError::Scenario {
        source_name: source.into(),
        reason: reason.into(),
    }
}

/// A number as people write it in a scenario: `1e300`, not three hundred digits.
fn num(v: f64) -> String {
    if v != 0.0 && v.is_finite() && !(1e-3..1e6).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// An error found inside the scenario from `source`, re-labelled with that file.
fn within(source: &str, e: HarnessError) -> HarnessError {
    match e {
        HarnessError::Scenario {
            source_name,
            reason,
        } => bad(source, format!("{source_name}: {reason}")),
        e => bad(source, e.to_string()),
    }
}

impl Scenario {
    pub fn from_yaml(yaml: &str, source_name: &str) -> Result<Scenario> {
        let s: Scenario =
            serde_saphyr::from_str(yaml).map_err(|e| bad(source_name, e.to_string()))?;
        s.validate(source_name)?;
        Ok(s)
    }

    pub fn from_path(path: &Path) -> Result<Scenario> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad(&path.display().to_string(), e.to_string()))?;
        Scenario::from_yaml(&text, &path.display().to_string())
    }

    /// The embedded default scenario.
    pub fn default_scenario() -> Scenario {
        Scenario::from_yaml(DEFAULT_SCENARIO_YAML, "scenarios/default.yaml")
            .expect("the embedded default scenario is valid")
    }

    /// One golden case, once, over `transport` on every hop.
    pub fn golden(case: &str, transport: TransportKind) -> Scenario {
        Scenario {
            name: case.into(),
            description: String::new(),
            concurrency: 1,
            arrival: Arrival::default(),
            transport,
            hops: HopTransports::default(),
            memory: StageMemory::Host,
            compute: StageCompute::default(),
            block_tokens: 16,
            include_deepstack: true,
            prefix_cache: true,
            distinct_outputs: true,
            hop_timeout_s: 60.0,
            request_timeout_s: 600.0,
            inline_below: 0,
            requests: vec![RequestEntry {
                case: Some(case.into()),
                name: None,
                request: None,
                repeat: 1,
                vary_seed: false,
            }],
            faults: vec![],
            random_faults: None,
            kill_stage: None,
            pregenerate: false,
            fabric: None,
            cpu: None,
        }
    }

    /// Every hop over `transport` (a CLI override).
    pub fn with_transport(mut self, transport: TransportKind) -> Scenario {
        self.transport = transport;
        self.hops = HopTransports::default();
        self
    }

    pub fn validate(&self, source: &str) -> Result<()> {
        if !(1..=MAX_CONCURRENCY).contains(&self.concurrency) {
            return Err(bad(
                source,
                format!(
                    "concurrency: {} is not in 1..={MAX_CONCURRENCY}",
                    self.concurrency
                ),
            ));
        }
        if self.requests.is_empty() {
            return Err(bad(source, "requests: at least one request"));
        }
        for (name, v) in [
            ("hop_timeout_s", self.hop_timeout_s),
            ("request_timeout_s", self.request_timeout_s),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= MAX_TIMEOUT_S) {
                return Err(bad(
                    source,
                    format!(
                        "{name}: {} is not a number of seconds in (0, {MAX_TIMEOUT_S}]",
                        num(v)
                    ),
                ));
            }
        }
        let a = &self.arrival;
        match a.pattern.as_str() {
            "closed" => {}
            "interval" => {
                if !(a.interval_ms.is_finite() && (0.0..=MAX_INTERVAL_MS).contains(&a.interval_ms))
                {
                    return Err(bad(
                        source,
                        format!(
                            "arrival.interval_ms: {} is not in 0..={MAX_INTERVAL_MS}",
                            num(a.interval_ms)
                        ),
                    ));
                }
            }
            "poisson" => {
                if !(a.rate_per_s.is_finite()
                    && (MIN_RATE_PER_S..=MAX_RATE_PER_S).contains(&a.rate_per_s))
                {
                    return Err(bad(
                        source,
                        format!(
                            "arrival.rate_per_s: {} is not in {MIN_RATE_PER_S}..={MAX_RATE_PER_S}",
                            num(a.rate_per_s)
                        ),
                    ));
                }
            }
            p => {
                return Err(bad(
                    source,
                    format!(
                        "arrival.pattern: {p:?} is not closed, interval (with interval_ms) or poisson (with rate_per_s)"
                    ),
                ));
            }
        }
        if !(1..=MAX_BLOCK_TOKENS).contains(&self.block_tokens) {
            return Err(bad(
                source,
                format!(
                    "block_tokens: {} is not in 1..={MAX_BLOCK_TOKENS}",
                    self.block_tokens
                ),
            ));
        }
        let total: u64 = self.requests.iter().map(|r| u64::from(r.repeat)).sum();
        if total > MAX_REQUESTS {
            return Err(bad(
                source,
                format!(
                    "requests: {total} requests after repeat; a run takes at most {MAX_REQUESTS}"
                ),
            ));
        }
        for (i, r) in self.requests.iter().enumerate() {
            if r.case.is_some() == r.request.is_some() {
                return Err(bad(
                    source,
                    format!("requests[{i}]: give exactly one of case or request"),
                ));
            }
            if r.repeat == 0 {
                return Err(bad(
                    source,
                    format!("requests[{i}].repeat must be at least 1"),
                ));
            }
        }
        if let Some(k) = &self.kill_stage {
            Stage::parse(&k.stage, "kill_stage.stage").map_err(|e| bad(source, e.to_string()))?;
            if k.after_ms as f64 > MAX_TIMEOUT_S * 1e3 {
                return Err(bad(
                    source,
                    format!(
                        "kill_stage.after_ms: {} is past {} ms",
                        k.after_ms,
                        MAX_TIMEOUT_S * 1e3
                    ),
                ));
            }
        }
        if let Some(f) = &self.fabric {
            f.validate()
                .map_err(|e| bad(source, e.detail().to_string()))?;
            for stage in f.placement.keys() {
                Stage::parse(stage, "fabric.placement").map_err(|e| bad(source, e.to_string()))?;
            }
        }
        if let Some(c) = &self.cpu {
            let fabric = self.fabric.clone().unwrap_or_default();
            let nodes: Vec<&str> = fabric.nodes.iter().map(|n| n.name.as_str()).collect();
            c.validate(&nodes).map_err(|e| bad(source, e))?;
        }
        let requests = self.expand().map_err(|e| within(source, e))?;
        self.compile_faults(&requests)
            .map_err(|e| within(source, e))?;
        Ok(())
    }

    /// The scenario's faults, compiled against its requests.
    pub fn compile_faults(&self, requests: &[PlannedRequest]) -> Result<CompiledFaults> {
        crate::faults::compile(&self.faults, self.random_faults.as_ref(), requests)
    }

    /// The hop's transport: its override, or the scenario's.
    pub fn transport_for(&self, kind: PayloadKind) -> TransportKind {
        let o = match kind {
            PayloadKind::EncoderEmbeddings => self.hops.encoder_embeddings,
            PayloadKind::KvCache => self.hops.kv_cache,
            PayloadKind::ThinkerToTalker => self.hops.thinker_to_talker,
            PayloadKind::TalkerToCode2wav => self.hops.talker_to_code2wav,
        };
        o.unwrap_or(self.transport)
    }

    pub fn shape_options(&self) -> ShapeOptions {
        ShapeOptions {
            block_tokens: self.block_tokens,
            include_deepstack: self.include_deepstack,
        }
    }

    pub fn hop_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.hop_timeout_s)
    }

    /// Every request of the run, in order, with its plan.
    pub fn expand(&self) -> Result<Vec<PlannedRequest>> {
        let card = ModelCard::qwen3_omni();
        let mut out = Vec::new();
        // Requests seen so far with the same spec: the salt of the next one.
        let mut seen: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
        for (i, r) in self.requests.iter().enumerate() {
            let (label, spec) = match (&r.case, &r.request) {
                (Some(c), _) => (c.clone(), golden_case(c)?.request),
                (None, Some(s)) => (
                    r.name.clone().unwrap_or_else(|| format!("request{i}")),
                    s.clone(),
                ),
                (None, None) => return Err(bad("requests", format!("requests[{i}] is empty"))),
            };
            let plan = Arc::new(plan_request(&card, &spec, &self.shape_options())?);
            for k in 0..r.repeat {
                let (mut spec, plan) = if r.vary_seed && k > 0 {
                    let mut spec = spec.clone();
                    spec.seed = spec.seed.wrapping_add(u64::from(k));
                    let plan = plan_request(&card, &spec, &self.shape_options())?;
                    (spec, Arc::new(plan))
                } else {
                    (spec.clone(), plan.clone())
                };
                if self.distinct_outputs {
                    let n = seen.entry(format!("{spec:?}")).or_insert(0);
                    spec.salt = spec.salt.wrapping_add(*n);
                    *n += 1;
                }
                out.push(PlannedRequest {
                    id: format!("{:03}-{label}", out.len()),
                    label: label.clone(),
                    spec,
                    plan,
                });
            }
        }
        Ok(out)
    }

    /// Pools for `concurrency` of the largest requests, plus one more of room
    /// for fragmentation (paged KV needs none).
    pub fn pool_sizes(&self, plans: &[&RequestPlan]) -> PoolSizes {
        // Saturating throughout: sizes from huge token counts end at u64::MAX and are refused
        // by the memory check, never wrapped into something small.
        let max = |kind: PayloadKind| {
            plans
                .iter()
                .filter_map(|p| p.hop(kind))
                .map(|h| {
                    h.tensors
                        .iter()
                        .map(|t| align_up(t.byte_length))
                        .fold(0u64, u64::saturating_add)
                })
                .max()
                .unwrap_or(0)
        };
        let c = self.concurrency.min(plans.len().max(1)) as u64;
        let kv_blocks = plans
            .iter()
            .filter_map(|p| {
                p.hop(PayloadKind::KvCache)?
                    .kv
                    .as_ref()
                    .map(|k| k.num_blocks)
            })
            .max()
            .unwrap_or(1);
        PoolSizes {
            ec_bytes: (c + 1).saturating_mul(max(PayloadKind::EncoderEmbeddings).max(4096)),
            kv_blocks: u32::try_from(c.saturating_mul(kv_blocks)).unwrap_or(u32::MAX - 1),
            t2t_bytes: (c + 1).saturating_mul(max(PayloadKind::ThinkerToTalker).max(4096)),
            codes_bytes: (c + 1).saturating_mul(max(PayloadKind::TalkerToCode2wav).max(4096)),
        }
    }

    /// Bytes the five stages register for `sizes`, together (each pool on both ends of its
    /// hop, KV on both sides); saturating.
    pub fn registered_bytes(&self, sizes: PoolSizes) -> u64 {
        let card = ModelCard::qwen3_omni();
        let t = &card.thinker;
        let per_block = (self.block_tokens * u64::from(t.num_kv_heads))
            .saturating_mul(t.head_dim)
            .saturating_mul(t.kv_dtype.size_bytes() as u64)
            .saturating_mul(2 * u64::from(t.num_layers));
        let kv = per_block.saturating_mul(2 * u64::from(sizes.kv_blocks) + 1);
        [sizes.ec_bytes, sizes.t2t_bytes, sizes.codes_bytes]
            .into_iter()
            .map(|b| align_up(b).saturating_mul(2))
            .fold(kv, u64::saturating_add)
    }

    /// Refuses a run whose pools cannot fit in the memory this machine has available
    /// (`MemAvailable`), naming what asks for it, before anything is registered.
    pub fn check_memory(&self, plans: &[&RequestPlan], source: &str) -> Result<()> {
        let need = self.registered_bytes(self.pool_sizes(plans));
        let Some(avail) = omnirig_transports::memory::mem_available() else {
            return Ok(());
        };
        if need > avail {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            let largest = plans.iter().map(|p| p.total_bytes()).max().unwrap_or(0);
            return Err(bad(
                source,
                format!(
                    "the stages' pools need {:.1} GiB ({} requests in flight, the largest moving {:.1} GiB), \
                     more than the {:.1} GiB this machine has available (MemAvailable); \
                     lower concurrency or the requests' token counts",
                    gib(need),
                    self.concurrency.min(plans.len().max(1)),
                    gib(largest),
                    gib(avail)
                ),
            ));
        }
        Ok(())
    }

    pub fn stage_config(&self, stage: Stage, sizes: PoolSizes) -> StageConfig {
        StageConfig {
            stage,
            card: Arc::new(ModelCard::qwen3_omni()),
            options: self.shape_options(),
            compute: self.compute.of(stage),
            hop_timeout: self.hop_timeout(),
            request_timeout: Duration::from_secs_f64(self.request_timeout_s),
            prefix_cache: self.prefix_cache,
            credits: true,
            inline_below: self.inline_below,
            sizes,
            // Validated with the scenario; a scenario built in code without faults has none.
            faults: Arc::new(
                self.expand()
                    .and_then(|r| self.compile_faults(&r))
                    .map(|c| c.harness)
                    .unwrap_or_default(),
            ),
        }
    }

    /// The distinct request specs of the run, in order of first appearance.
    pub fn distinct_specs(&self) -> Result<Vec<RequestSpec>> {
        let mut out: Vec<RequestSpec> = Vec::new();
        for r in self.expand()? {
            if !out.contains(&r.spec) {
                out.push(r.spec);
            }
        }
        Ok(out)
    }

    /// Start offsets of each request from the run's start (`None`: closed loop).
    pub fn arrival_offsets(&self, n: usize) -> Vec<Option<Duration>> {
        match self.arrival.pattern.as_str() {
            "interval" => (0..n)
                .map(|i| {
                    Some(Duration::from_secs_f64(
                        i as f64 * self.arrival.interval_ms / 1e3,
                    ))
                })
                .collect(),
            "poisson" => {
                let mut x = self.arrival.seed ^ 0x9E37_79B9_7F4A_7C15;
                let mut t = 0.0;
                (0..n)
                    .map(|i| {
                        if i > 0 {
                            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
                            let mut z = x;
                            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                            z ^= z >> 31;
                            let u = ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                            t += -u.ln() / self.arrival.rate_per_s;
                        }
                        Some(Duration::from_secs_f64(t))
                    })
                    .collect()
            }
            _ => vec![None; n],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_scenario_parses_and_expands() {
        let s = Scenario::default_scenario();
        let r = s.expand().unwrap();
        assert_eq!(r.len(), 5);
        assert_eq!(r[4].id, "004-image_audio");
        // The repeat has the same content (caches hit) and its own outputs downstream.
        assert_eq!((r[1].spec.salt, r[4].spec.salt), (0, 1));
        assert_eq!(r[1].spec.seed, r[4].spec.seed);
        let s = Scenario {
            distinct_outputs: false,
            ..s
        };
        let r = s.expand().unwrap();
        assert_eq!(r[1].spec, r[4].spec);
    }

    #[test]
    fn shipped_scenarios_parse() {
        let s = Scenario::from_yaml(include_str!("../scenarios/mixed.yaml"), "mixed.yaml").unwrap();
        assert_eq!(s.expand().unwrap().len(), 9);
    }

    #[test]
    fn scenario_yaml_with_everything() {
        let yaml = r#"
name: mixed
concurrency: 3
arrival: { pattern: poisson, rate_per_s: 50, seed: 3 }
transport: loopback
hops: { kv_cache: tcp }
compute: { thinker_decode: { per_token_us: 30 }, encoder: { per_item_us: 100 } }
requests:
  - case: text_short
    repeat: 2
  - name: custom
    request: { seed: 9, text_tokens: 100, images: [{ width: 320, height: 240 }], output_text_tokens: 10, output_audio_seconds: 1.0 }
"#;
        let s = Scenario::from_yaml(yaml, "t").unwrap();
        assert_eq!(s.transport_for(PayloadKind::KvCache), TransportKind::Tcp);
        assert_eq!(
            s.transport_for(PayloadKind::ThinkerToTalker),
            TransportKind::Loopback
        );
        assert_eq!(s.compute.of(Stage::ThinkerDecode).per_token_us, 30);
        let r = s.expand().unwrap();
        assert_eq!(
            r.iter().map(|r| r.label.as_str()).collect::<Vec<_>>(),
            ["text_short", "text_short", "custom"]
        );
        let offs = s.arrival_offsets(3);
        assert!(offs[0] == Some(Duration::ZERO) && offs[2] > offs[1]);
    }

    #[test]
    fn bad_scenarios_are_named() {
        for (yaml, needle) in [
            ("requests: []", "at least one"),
            ("requests: [{ case: nope }]", "nope"),
            (
                "transport: carrier_pigeon\nrequests: [{ case: text_short }]",
                "carrier_pigeon",
            ),
            // An unknown name lists the valid ones.
            (
                "transport: carrier_pigeon\nrequests: [{ case: text_short }]",
                "loopback, shm, rdma, tcp",
            ),
            (
                "hops: { kv_cache: udp }\nrequests: [{ case: text_short }]",
                "udp",
            ),
            (
                "requests: [{ case: text_short, request: { text_tokens: 1 } }]",
                "exactly one",
            ),
            ("bogus: 1\nrequests: [{ case: text_short }]", "bogus"),
            (
                "concurrency: 0\nrequests: [{ case: text_short }]",
                "concurrency",
            ),
            // Issue 10: values that passed validation and then panicked or overflowed.
            (
                "concurrency: 18446744073709551615\nrequests: [{ case: text_short }]",
                "concurrency: 18446744073709551615 is not in 1..=100000",
            ),
            (
                "hop_timeout_s: 1e300\nrequests: [{ case: text_short }]",
                "hop_timeout_s: 1e300",
            ),
            (
                "request_timeout_s: 1e19\nrequests: [{ case: text_short }]",
                "request_timeout_s: 1e19",
            ),
            (
                "arrival: { pattern: interval, interval_ms: 1e19 }\nrequests: [{ case: text_short }]",
                "arrival.interval_ms",
            ),
            (
                "arrival: { pattern: poisson, rate_per_s: 1e-300 }\nrequests: [{ case: text_short }]",
                "arrival.rate_per_s",
            ),
            (
                "block_tokens: 18446744073709551615\nrequests: [{ case: text_short }]",
                "block_tokens",
            ),
            (
                "requests: [{ case: text_short, repeat: 1000000 }]",
                "1000000 requests after repeat",
            ),
            (
                "kill_stage: { stage: talker, after_ms: 18446744073709551615 }\nrequests: [{ case: text_short }]",
                "kill_stage.after_ms",
            ),
            (
                "faults: [{ hop: kv_cache, request: 0, kind: explode }]\nrequests: [{ case: text_short }]",
                "unknown fault kind \"explode\"; valid kinds: fail_submit, fail_slice, stall, { delay: { ms: N } }",
            ),
            (
                "faults: [{ hop: kv_cache, request: 0, kind: { delay: { ms: -1 } } }]\nrequests: [{ case: text_short }]",
                "valid kinds",
            ),
        ] {
            let e = Scenario::from_yaml(yaml, "dir/s.yaml")
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{yaml}: {e}");
            assert!(e.contains("dir/s.yaml"), "{yaml}: names no file: {e}");
        }
    }
}
