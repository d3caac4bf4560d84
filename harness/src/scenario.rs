//! Scenarios: which requests to run, how many at once, when they arrive,
//! over which transport per hop, and the stages' modelled compute time.
//!
//! ```yaml
//! name: mixed
//! concurrency: 4                 # requests in flight at most
//! arrival: { pattern: poisson, rate_per_s: 20, seed: 1 }   # closed | interval | poisson
//! transport: loopback            # default for every hop: loopback | tcp | shm
//! hops: { kv_cache: tcp }        # per-hop override, by payload kind
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
    #[serde(default)]
    pub compute: StageCompute,
    #[serde(default = "block16")]
    pub block_tokens: u64,
    #[serde(default = "yes")]
    pub include_deepstack: bool,
    #[serde(default = "yes")]
    pub prefix_cache: bool,
    /// One hop, from the producer's offer to FINISH / packet.
    #[serde(default = "sixty")]
    pub hop_timeout_s: f64,
    /// How long a stage waits for its upstream's offer (all upstream work).
    #[serde(default = "six_hundred")]
    pub request_timeout_s: f64,
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
    pub plan: RequestPlan,
}

fn bad(source: &str, reason: impl Into<String>) -> HarnessError {
    HarnessError::Scenario {
        source_name: source.into(),
        reason: reason.into(),
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
            compute: StageCompute::default(),
            block_tokens: 16,
            include_deepstack: true,
            prefix_cache: true,
            hop_timeout_s: 60.0,
            request_timeout_s: 600.0,
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
        }
    }

    /// Every hop over `transport` (a CLI override).
    pub fn with_transport(mut self, transport: TransportKind) -> Scenario {
        self.transport = transport;
        self.hops = HopTransports::default();
        self
    }

    pub fn validate(&self, source: &str) -> Result<()> {
        if self.concurrency == 0 {
            return Err(bad(source, "concurrency must be at least 1"));
        }
        if self.requests.is_empty() {
            return Err(bad(source, "requests: at least one request"));
        }
        for (name, v) in [
            ("hop_timeout_s", self.hop_timeout_s),
            ("request_timeout_s", self.request_timeout_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(source, format!("{name} must be a positive number")));
            }
        }
        match self.arrival.pattern.as_str() {
            "closed" => {}
            "interval"
                if self.arrival.interval_ms >= 0.0 && self.arrival.interval_ms.is_finite() => {}
            "poisson" if self.arrival.rate_per_s > 0.0 && self.arrival.rate_per_s.is_finite() => {}
            p => {
                return Err(bad(
                    source,
                    format!(
                        "arrival: pattern {p:?} needs closed, interval (interval_ms >= 0) or poisson (rate_per_s > 0)"
                    ),
                ));
            }
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
        }
        let requests = self.expand().map_err(|e| bad(source, e.to_string()))?;
        self.compile_faults(&requests)
            .map_err(|e| bad(source, e.to_string()))?;
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
        for (i, r) in self.requests.iter().enumerate() {
            let (label, spec) = match (&r.case, &r.request) {
                (Some(c), _) => (c.clone(), golden_case(c)?.request),
                (None, Some(s)) => (
                    r.name.clone().unwrap_or_else(|| format!("request{i}")),
                    s.clone(),
                ),
                (None, None) => return Err(bad("requests", format!("requests[{i}] is empty"))),
            };
            let plan = plan_request(&card, &spec, &self.shape_options())?;
            for k in 0..r.repeat {
                let (spec, plan) = if r.vary_seed && k > 0 {
                    let mut spec = spec.clone();
                    spec.seed = spec.seed.wrapping_add(u64::from(k));
                    let plan = plan_request(&card, &spec, &self.shape_options())?;
                    (spec, plan)
                } else {
                    (spec.clone(), plan.clone())
                };
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
        let max = |kind: PayloadKind| {
            plans
                .iter()
                .filter_map(|p| p.hop(kind))
                .map(|h| {
                    h.tensors
                        .iter()
                        .map(|t| align_up(t.byte_length))
                        .sum::<u64>()
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
            ec_bytes: (c + 1) * max(PayloadKind::EncoderEmbeddings).max(4096),
            kv_blocks: u32::try_from(c * kv_blocks).unwrap_or(u32::MAX - 1),
            t2t_bytes: (c + 1) * max(PayloadKind::ThinkerToTalker).max(4096),
            codes_bytes: (c + 1) * max(PayloadKind::TalkerToCode2wav).max(4096),
        }
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
        ] {
            let e = Scenario::from_yaml(yaml, "t").unwrap_err().to_string();
            assert!(e.contains(needle), "{yaml}: {e}");
        }
    }
}
