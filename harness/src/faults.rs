//! Fault plans in scenarios: which hop, request and tensor a fault strikes, compiled into the
//! engine's fault decorator rules.
//!
//! ```yaml
//! hop_timeout_s: 1
//! faults:
//!   - hop: kv_cache            # the hop whose producer's transfers the fault hits
//!     request: 0               # index into the run's requests (after `repeat`)
//!     tensor: kv.layer.3.v     # default: the hop's first tensor
//!     at: { after_bytes: 65536 }   # before_submit | at_completion | { after_bytes: N }
//!     kind: drop_connection    # fail_submit | fail_slice | stall | { delay: { ms: 50 } } |
//!                              # drop_connection | corrupt | duplicate_completion |
//!                              # early_completion | late_write
//! random_faults:               # or: a fraction of requests, picked from a seed
//!   fraction: 0.05
//!   seed: 7
//!   kinds: [fail_slice, stall, corrupt]   # default: every kind that must fail a request
//! ```
//!
//! The engine matches slices by tag; producers tag each engine request with
//! [`fault_tag`]`(request id, tensor)`. The same scenario and seed strike the same requests,
//! tensors and bytes every run.

use std::collections::BTreeMap;

use omnirig_fixtures::PayloadKind;
use std::sync::{Arc, Mutex};

use omnirig_transports::transport::BoxFuture;
use omnirig_transports::{
    ErrorKind, FaultKind, FaultPoint, FaultRule, InProcessStore, MetadataStore, SegmentDescriptor,
};
use serde::{Deserialize, Serialize};

use crate::error::{HarnessError, Result};
use crate::scenario::PlannedRequest;

/// Faults outside the transport: in the control messages and pools of the connectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HarnessFault {
    /// The producer sends half of the packet v1 sidecar (stage hops).
    TruncatedSidecar,
    /// The producer's sidecar says `packet_version: 2` (stage hops).
    UnknownVersionSidecar,
    /// The producer's sidecar gives a tensor a byte length its dtype and shape do not have
    /// (stage hops).
    InconsistentSidecar,
    /// The consumer grants one byte less than it tells the producer (stage and KV hops).
    GrantOutOfBounds,
    /// The consumer revokes its grants as soon as it has sent them (stage and KV hops).
    GrantRevoked,
    /// The consumer's destination pool has no room for the request (stage and KV hops).
    PoolExhausted,
}

impl HarnessFault {
    pub fn name(self) -> &'static str {
        match self {
            HarnessFault::TruncatedSidecar => "truncated_sidecar",
            HarnessFault::UnknownVersionSidecar => "unknown_version_sidecar",
            HarnessFault::InconsistentSidecar => "inconsistent_sidecar",
            HarnessFault::GrantOutOfBounds => "grant_out_of_bounds",
            HarnessFault::GrantRevoked => "grant_revoked",
            HarnessFault::PoolExhausted => "pool_exhausted",
        }
    }

    fn sidecar(self) -> bool {
        matches!(
            self,
            HarnessFault::TruncatedSidecar
                | HarnessFault::UnknownVersionSidecar
                | HarnessFault::InconsistentSidecar
        )
    }
}

/// A fault in the transport (the engine's decorator) or in the connectors.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(untagged)]
pub enum AnyFault {
    Transport(FaultKind),
    Harness(HarnessFault),
}

impl HarnessFault {
    pub const ALL: [HarnessFault; 6] = [
        HarnessFault::TruncatedSidecar,
        HarnessFault::UnknownVersionSidecar,
        HarnessFault::InconsistentSidecar,
        HarnessFault::GrantOutOfBounds,
        HarnessFault::GrantRevoked,
        HarnessFault::PoolExhausted,
    ];
}

/// Every fault kind a scenario may name, for error messages.
pub fn fault_kind_names() -> String {
    FaultKind::ALL
        .iter()
        .map(|k| match k {
            FaultKind::Delay { .. } => "{ delay: { ms: N } }",
            k => k.name(),
        })
        .chain(HarnessFault::ALL.iter().map(|h| h.name()))
        .collect::<Vec<_>>()
        .join(", ")
}

// By hand rather than `untagged`, whose error ("did not match any variant") names
// neither the kind given nor the valid ones.
impl<'de> Deserialize<'de> for AnyFault {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error;
        let v = serde_json::Value::deserialize(d)?;
        let transport = serde_json::from_value::<FaultKind>(v.clone());
        if let Ok(k) = transport {
            return Ok(AnyFault::Transport(k));
        }
        if let Ok(h) = serde_json::from_value::<HarnessFault>(v.clone()) {
            return Ok(AnyFault::Harness(h));
        }
        let detail = match (&v, transport) {
            // A map is meant as a transport kind with parameters: say what was wrong in it.
            (serde_json::Value::Object(_), Err(e)) => format!(" ({e})"),
            _ => String::new(),
        };
        Err(D::Error::custom(format!(
            "unknown fault kind {v}{detail}; valid kinds: {}",
            fault_kind_names()
        )))
    }
}

impl AnyFault {
    pub fn name(self) -> &'static str {
        match self {
            AnyFault::Transport(k) => k.name(),
            AnyFault::Harness(h) => h.name(),
        }
    }
}

/// Connector faults by (hop, request id).
pub type HarnessFaults = std::collections::HashMap<(String, String), HarnessFault>;

/// One scripted fault.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    /// The payload kind of the hop: encoder_embeddings | kv_cache | thinker_to_talker |
    /// talker_to_code2wav.
    pub hop: String,
    pub request: usize,
    #[serde(default)]
    pub tensor: Option<String>,
    /// Where a transport fault strikes (connector faults ignore it).
    #[serde(default = "before_submit")]
    pub at: FaultPoint,
    pub kind: AnyFault,
    #[serde(default = "one")]
    pub times: usize,
}

fn before_submit() -> FaultPoint {
    FaultPoint::BeforeSubmit
}

fn one() -> usize {
    1
}

/// Faults on a random fraction of the requests, reproducible from `seed`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomFaults {
    pub fraction: f64,
    pub seed: u64,
    #[serde(default = "failing_kinds")]
    pub kinds: Vec<FaultKind>,
}

/// Kinds after which a request must fail (a delay only slows it).
pub fn failing_kinds() -> Vec<FaultKind> {
    FaultKind::ALL
        .into_iter()
        .filter(|k| !matches!(k, FaultKind::Delay { .. }))
        .collect()
}

/// The tag producers put on the engine requests of one tensor of one request.
pub fn fault_tag(request: &str, tensor: &str) -> u64 {
    // FNV-1a: stable across runs and processes, and cheap.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in request.bytes().chain([0]).chain(tensor.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h | 1 // 0 means "untagged"
}

/// Where a planned fault strikes, for the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultTarget {
    pub hop: String,
    pub request: String,
    pub tensor: String,
    pub kind: String,
}

/// A scenario's faults compiled for the run: rules per hop, and who they target.
#[derive(Debug, Clone, Default)]
pub struct CompiledFaults {
    /// By hop (payload kind name).
    pub rules: BTreeMap<&'static str, Vec<FaultRule>>,
    /// Connector faults, consulted by the stage workers.
    pub harness: HarnessFaults,
    pub targets: Vec<FaultTarget>,
}

impl CompiledFaults {
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// Requests a fault should fail (every target except delays).
    pub fn must_fail(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .targets
            .iter()
            .filter(|t| t.kind != FaultKind::Delay { ms: 0 }.name())
            .map(|t| t.request.clone())
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

fn bad(reason: String) -> HarnessError {
    HarnessError::Scenario {
        source_name: "faults".into(),
        reason,
    }
}

/// splitmix64: a small, seedable generator so plans reproduce from their seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Compiles scripted and random faults against the run's requests.
pub fn compile(
    specs: &[FaultSpec],
    random: Option<&RandomFaults>,
    requests: &[PlannedRequest],
) -> Result<CompiledFaults> {
    let mut out = CompiledFaults::default();
    let mut harness = HarnessFaults::new();
    let mut harness_targets = Vec::new();
    let mut add =
        |hop: PayloadKind, r: &PlannedRequest, tensor: &str, at, kind: FaultKind, times| {
            let rule = FaultRule {
                tag: Some(fault_tag(&r.id, tensor)),
                at,
                kind,
                times,
            };
            out.rules.entry(hop.as_str()).or_default().push(rule);
            out.targets.push(FaultTarget {
                hop: hop.as_str().into(),
                request: r.id.clone(),
                tensor: tensor.into(),
                kind: kind.name().into(),
            });
        };
    for (i, s) in specs.iter().enumerate() {
        let r = requests.get(s.request).ok_or_else(|| {
            bad(format!(
                "faults[{i}].request {} is past the run's {} requests",
                s.request,
                requests.len()
            ))
        })?;
        let kind = PayloadKind::parse(&s.hop, &format!("faults[{i}].hop"))
            .map_err(|e| bad(e.to_string()))?;
        let hop = r.plan.hop(kind).ok_or_else(|| {
            bad(format!(
                "faults[{i}]: request {} has no {} hop",
                r.id, s.hop
            ))
        })?;
        let tensor = match &s.tensor {
            Some(t) if hop.tensor(t).is_some() => t.clone(),
            Some(t) => {
                return Err(bad(format!(
                    "faults[{i}].tensor {t:?} is not carried by {} for {}",
                    s.hop, r.id
                )));
            }
            None => hop
                .tensors
                .first()
                .map(|t| t.name.clone())
                .ok_or_else(|| bad(format!("faults[{i}]: empty hop")))?,
        };
        if s.times == 0 {
            return Err(bad(format!("faults[{i}].times must be at least 1")));
        }
        match s.kind {
            AnyFault::Transport(k) => add(kind, r, &tensor, s.at, k, s.times),
            AnyFault::Harness(h) => {
                let stage_hop = matches!(
                    kind,
                    PayloadKind::ThinkerToTalker | PayloadKind::TalkerToCode2wav
                );
                if !(stage_hop || (kind == PayloadKind::KvCache && !h.sidecar())) {
                    return Err(bad(format!(
                        "faults[{i}]: {} does not apply to the {} hop",
                        h.name(),
                        s.hop
                    )));
                }
                harness.insert((kind.as_str().to_string(), r.id.clone()), h);
                harness_targets.push(FaultTarget {
                    hop: kind.as_str().into(),
                    request: r.id.clone(),
                    tensor: String::new(),
                    kind: h.name().into(),
                });
            }
        }
    }
    if let Some(rf) = random {
        if !(0.0..=1.0).contains(&rf.fraction) {
            return Err(bad(format!(
                "random_faults.fraction {} is not in 0..=1",
                rf.fraction
            )));
        }
        if rf.kinds.is_empty() {
            return Err(bad("random_faults.kinds is empty".into()));
        }
        let mut rng = Rng(rf.seed);
        let n = (rf.fraction * requests.len() as f64).round() as usize;
        // Partial Fisher-Yates: `n` distinct requests.
        let mut idx: Vec<usize> = (0..requests.len()).collect();
        for k in 0..n {
            let j = k + rng.below(idx.len() - k);
            idx.swap(k, j);
        }
        for &ri in &idx[..n] {
            let r = &requests[ri];
            let hops: Vec<_> = r
                .plan
                .hops
                .iter()
                .filter(|h| !h.tensors.is_empty())
                .collect();
            let hop = hops[rng.below(hops.len())];
            let t = &hop.tensors[rng.below(hop.tensors.len())];
            // KV tensors move as runs of blocks; a point inside the first run always strikes.
            let len = match &hop.kv {
                Some(kv) => kv.k_block_bytes,
                None => t.byte_length,
            };
            let at = match rng.below(3) {
                0 => FaultPoint::BeforeSubmit,
                1 => FaultPoint::AfterBytes(rng.next() % len.max(1)),
                _ => FaultPoint::AtCompletion,
            };
            let kind = rf.kinds[rng.below(rf.kinds.len())];
            add(hop.payload_kind, r, &t.name, at, kind, 1);
        }
    }
    out.harness = harness;
    out.targets.extend(harness_targets);
    Ok(out)
}

/// A metadata store that can go wrong after engines have started: lookups fail
/// (`Unavailable`), or return an endpoint where nobody listens (`Misdirect`: the peer is
/// unreachable at connect). Publishing always works, so engines start.
pub struct FaultyStore {
    inner: Arc<InProcessStore>,
    mode: Mutex<StoreFault>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFault {
    Healthy,
    Unavailable,
    Misdirect,
}

impl FaultyStore {
    pub fn new(mode: StoreFault) -> Arc<Self> {
        Arc::new(Self {
            inner: InProcessStore::new(),
            mode: Mutex::new(mode),
        })
    }

    pub fn set(&self, mode: StoreFault) {
        *self.mode.lock().unwrap_or_else(|p| p.into_inner()) = mode;
    }

    fn mode(&self) -> StoreFault {
        *self.mode.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl MetadataStore for FaultyStore {
    fn publish(&self, desc: SegmentDescriptor) -> BoxFuture<'_, omnirig_transports::Result<()>> {
        self.inner.publish(desc)
    }

    fn lookup(
        &self,
        name: &str,
    ) -> BoxFuture<'_, omnirig_transports::Result<Option<SegmentDescriptor>>> {
        let name = name.to_owned();
        Box::pin(async move {
            match self.mode() {
                StoreFault::Healthy => self.inner.lookup(&name).await,
                StoreFault::Unavailable => Err(omnirig_transports::Error::new(
                    ErrorKind::Metadata,
                    "fault injected: metadata store unavailable",
                )),
                StoreFault::Misdirect => {
                    // A port that was just free: nobody listens there.
                    let dead = std::net::TcpListener::bind("127.0.0.1:0")
                        .and_then(|l| l.local_addr())
                        .map_err(|e| {
                            omnirig_transports::Error::new(ErrorKind::Io, e.to_string())
                        })?;
                    Ok(self.inner.lookup(&name).await?.map(|d| {
                        let tcp = omnirig_transports::TransportKind::Tcp;
                        let mut endpoints: Vec<_> =
                            d.endpoints.into_iter().filter(|e| e.kind != tcp).collect();
                        endpoints.push(omnirig_transports::Endpoint::new(tcp, dead.to_string()));
                        SegmentDescriptor {
                            instance: d.instance ^ 0x5eed,
                            endpoints,
                            ..d
                        }
                    }))
                }
            }
        })
    }

    fn remove(&self, name: &str, instance: u64) -> BoxFuture<'_, omnirig_transports::Result<()>> {
        self.inner.remove(name, instance)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Scenario;

    fn requests(n: u32) -> Vec<PlannedRequest> {
        let mut s = Scenario::golden("image_audio", omnirig_transports::TransportKind::Loopback);
        s.requests[0].repeat = n;
        s.expand().unwrap()
    }

    #[test]
    fn tags_differ_by_request_and_tensor_and_are_never_zero() {
        let a = fault_tag("000-x", "kv.layer.0.k");
        assert_ne!(a, fault_tag("001-x", "kv.layer.0.k"));
        assert_ne!(a, fault_tag("000-x", "kv.layer.0.v"));
        assert_eq!(a, fault_tag("000-x", "kv.layer.0.k"));
        assert_ne!(fault_tag("", ""), 0);
    }

    #[test]
    fn scripted_faults_resolve_their_tensor_or_name_what_is_wrong() {
        let reqs = requests(2);
        let spec = |request, tensor: Option<&str>| FaultSpec {
            hop: "kv_cache".into(),
            request,
            tensor: tensor.map(Into::into),
            at: FaultPoint::BeforeSubmit,
            kind: AnyFault::Transport(FaultKind::Stall),
            times: 1,
        };
        let c = compile(&[spec(1, None)], None, &reqs).unwrap();
        assert_eq!(c.targets[0].tensor, "kv.layer.0.k");
        assert_eq!(
            c.rules["kv_cache"][0].tag,
            Some(fault_tag(&reqs[1].id, "kv.layer.0.k"))
        );
        let e = compile(&[spec(2, None)], None, &reqs)
            .unwrap_err()
            .to_string();
        assert!(e.contains("faults[0].request 2"), "{e}");
        let e = compile(&[spec(0, Some("nope"))], None, &reqs)
            .unwrap_err()
            .to_string();
        assert!(e.contains("faults[0].tensor \"nope\""), "{e}");
    }

    #[test]
    fn random_faults_reproduce_from_their_seed() {
        let reqs = requests(40);
        let rf = RandomFaults {
            fraction: 0.1,
            seed: 3,
            kinds: failing_kinds(),
        };
        let a = compile(&[], Some(&rf), &reqs).unwrap();
        let b = compile(&[], Some(&rf), &reqs).unwrap();
        assert_eq!(a.targets, b.targets);
        assert_eq!(a.must_fail().len(), 4, "10% of 40 distinct requests");
        let c = compile(&[], Some(&RandomFaults { seed: 4, ..rf }), &reqs).unwrap();
        assert_ne!(a.targets, c.targets);
    }

    #[test]
    fn fault_specs_parse_from_yaml() {
        let yaml = "hop: kv_cache\nrequest: 0\nat: { after_bytes: 65536 }\nkind: drop_connection\n";
        let s: FaultSpec = serde_saphyr::from_str(yaml).unwrap();
        assert_eq!(s.at, FaultPoint::AfterBytes(65536));
        assert_eq!(s.kind, AnyFault::Transport(FaultKind::DropConnection));
        let s: FaultSpec = serde_saphyr::from_str(
            "hop: thinker_to_talker\nrequest: 1\nat: before_submit\nkind: { delay: { ms: 5 } }\n",
        )
        .unwrap();
        assert_eq!(s.kind, AnyFault::Transport(FaultKind::Delay { ms: 5 }));
        let s: FaultSpec =
            serde_saphyr::from_str("hop: thinker_to_talker\nrequest: 1\nkind: truncated_sidecar\n")
                .unwrap();
        assert_eq!(s.kind, AnyFault::Harness(HarnessFault::TruncatedSidecar));
    }
}
