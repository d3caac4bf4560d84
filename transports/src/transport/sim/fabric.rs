//! The fabric model behind the `sim` transport: nodes with NICs, links between nodes, a path
//! inside each node, and virtual time.
//!
//! Every resource a byte crosses (a NIC's send side, a link's direction, a NIC's receive side,
//! a node's local copy path) is one FIFO queue with a bandwidth. A slice of `n` bytes waits
//! until every queue on its path is free, holds each for `n / bandwidth` of that queue, and
//! lands after the slowest of them plus the path's latency (and seeded jitter); a write
//! completes one return latency later (its acknowledgement), a read's data leaves one request
//! latency after it was asked for. Concurrent
//! transfers that share a NIC or a link therefore queue behind each other, which is what makes
//! links saturate in the model as they do on hardware.
//!
//! Time is tokio's clock: under a paused clock (a current-thread runtime started paused) it is
//! virtual and jumps to the next event whenever every task waits, so a run takes the real time
//! of its CPU work only. The trace records each event with its virtual time in nanoseconds.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::error::{Error, ErrorKind, Result};
use crate::transport::Admission;

fn d_slice() -> u64 {
    1 << 20
}
fn d_in_flight() -> usize {
    4
}
fn d_local() -> PathModel {
    // A host memcpy: about 10 GB/s, sub-microsecond start.
    PathModel {
        gbps: 80.0,
        latency_us: 0.5,
    }
}

/// A fabric, as written in a scenario's `fabric:` section or a fabric file.
///
/// ```yaml
/// slice_bytes: 1048576           # largest slice a link moves at once
/// in_flight: 4                   # slices of one transfer in flight
/// jitter_us: 2                   # extra latency per slice / message, uniform in [0, jitter)
/// seed: 1                        # jitter's seed (`--seed` overrides)
/// nodes:
///   - { name: n0, nics: [{ name: mlx0, gbps: 400, latency_us: 1 }], local: { gbps: 400, latency_us: 2 } }
///   - { name: n1, nics: [{ name: mlx0, gbps: 400, latency_us: 1 }] }
/// links: [{ between: [n0, n1], gbps: 400, latency_us: 2 }]   # a direct link, one queue per direction
/// switch: { gbps: 400, latency_us: 3 }   # any pair without a link: a non-blocking switch
/// placement: { encoder: n0, thinker_prefill: n1, thinker_decode: n1/mlx0, talker: n1, code2wav: n0 }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FabricSpec {
    #[serde(default = "d_slice")]
    pub slice_bytes: u64,
    #[serde(default = "d_in_flight")]
    pub in_flight: usize,
    #[serde(default)]
    pub jitter_us: f64,
    #[serde(default)]
    pub seed: u64,
    pub nodes: Vec<NodeSpec>,
    #[serde(default)]
    pub links: Vec<LinkSpec>,
    /// What connects node pairs that have no link of their own; none: they cannot reach.
    #[serde(default)]
    pub switch: Option<PathModel>,
    /// Where each engine owner (a pipeline stage) runs: `node` or `node/nic`.
    #[serde(default)]
    pub placement: BTreeMap<String, String>,
}

/// Bandwidth and latency of one queue or path.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathModel {
    pub gbps: f64,
    #[serde(default)]
    pub latency_us: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    pub name: String,
    #[serde(default)]
    pub nics: Vec<NicSpec>,
    /// Engines of one node: the copy path between them (host memcpy, a pinned copy, NVLink).
    #[serde(default = "d_local")]
    pub local: PathModel,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicSpec {
    pub name: String,
    pub gbps: f64,
    /// Per message, on each side (doorbell, DMA start, completion).
    #[serde(default)]
    pub latency_us: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    pub between: [String; 2],
    pub gbps: f64,
    #[serde(default)]
    pub latency_us: f64,
}

/// Largest slice a fabric may use, and most slices in flight (beyond them the model stops
/// meaning anything and the engine's buffers balloon).
pub const MAX_SLICE_BYTES: u64 = 1 << 30;
pub const MAX_IN_FLIGHT: usize = 1024;

impl Default for FabricSpec {
    /// One node per pipeline stage, each with a 100 Gb/s NIC, behind a non-blocking switch.
    fn default() -> Self {
        let stages = [
            "encoder",
            "thinker_prefill",
            "thinker_decode",
            "talker",
            "code2wav",
        ];
        FabricSpec {
            slice_bytes: d_slice(),
            in_flight: d_in_flight(),
            jitter_us: 0.0,
            seed: 0,
            nodes: stages
                .iter()
                .map(|s| NodeSpec {
                    name: (*s).into(),
                    nics: vec![NicSpec {
                        name: "nic0".into(),
                        gbps: 100.0,
                        latency_us: 1.0,
                    }],
                    local: d_local(),
                })
                .collect(),
            links: vec![],
            switch: Some(PathModel {
                gbps: 100.0,
                latency_us: 2.0,
            }),
            placement: stages
                .iter()
                .map(|s| ((*s).to_string(), (*s).to_string()))
                .collect(),
        }
    }
}

fn bad(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Malformed, what.into())
}

fn check_model(what: &str, gbps: f64, latency_us: f64) -> Result<()> {
    if !(gbps.is_finite() && gbps > 0.0 && gbps <= 1e6) {
        return Err(bad(format!("{what}.gbps: {gbps} is not in (0, 1e6]")));
    }
    if !(latency_us.is_finite() && (0.0..=1e7).contains(&latency_us)) {
        return Err(bad(format!(
            "{what}.latency_us: {latency_us} is not in [0, 1e7]"
        )));
    }
    Ok(())
}

impl FabricSpec {
    /// Parses a fabric file (YAML is JSON's superset; the harness parses YAML and hands the
    /// value here validated).
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_SLICE_BYTES).contains(&self.slice_bytes) {
            return Err(bad(format!(
                "fabric.slice_bytes: {} is not in 1..={MAX_SLICE_BYTES}",
                self.slice_bytes
            )));
        }
        if !(1..=MAX_IN_FLIGHT).contains(&self.in_flight) {
            return Err(bad(format!(
                "fabric.in_flight: {} is not in 1..={MAX_IN_FLIGHT}",
                self.in_flight
            )));
        }
        if !(self.jitter_us.is_finite() && (0.0..=1e7).contains(&self.jitter_us)) {
            return Err(bad(format!(
                "fabric.jitter_us: {} is not in [0, 1e7]",
                self.jitter_us
            )));
        }
        if self.nodes.is_empty() {
            return Err(bad("fabric.nodes: at least one node"));
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, n) in self.nodes.iter().enumerate() {
            if n.name.is_empty() || n.name.contains('/') {
                return Err(bad(format!(
                    "fabric.nodes[{i}].name: {:?} must be non-empty without '/'",
                    n.name
                )));
            }
            if !names.insert(n.name.as_str()) {
                return Err(bad(format!("fabric.nodes: {:?} twice", n.name)));
            }
            check_model(
                &format!("fabric.nodes[{i}].local"),
                n.local.gbps,
                n.local.latency_us,
            )?;
            let mut nics = std::collections::BTreeSet::new();
            for (j, c) in n.nics.iter().enumerate() {
                check_model(
                    &format!("fabric.nodes[{i}].nics[{j}]"),
                    c.gbps,
                    c.latency_us,
                )?;
                if !nics.insert(c.name.as_str()) {
                    return Err(bad(format!("fabric.nodes[{i}].nics: {:?} twice", c.name)));
                }
            }
        }
        let mut pairs = std::collections::BTreeSet::new();
        for (i, l) in self.links.iter().enumerate() {
            check_model(&format!("fabric.links[{i}]"), l.gbps, l.latency_us)?;
            for end in &l.between {
                if !names.contains(end.as_str()) {
                    return Err(bad(format!(
                        "fabric.links[{i}].between: no node {end:?} (nodes: {})",
                        names.iter().copied().collect::<Vec<_>>().join(", ")
                    )));
                }
            }
            if l.between[0] == l.between[1] {
                return Err(bad(format!(
                    "fabric.links[{i}]: a link joins two different nodes"
                )));
            }
            let mut key = [l.between[0].as_str(), l.between[1].as_str()];
            key.sort();
            if !pairs.insert(key) {
                return Err(bad(format!(
                    "fabric.links[{i}]: a second link between {} and {}",
                    key[0], key[1]
                )));
            }
        }
        if let Some(s) = &self.switch {
            check_model("fabric.switch", s.gbps, s.latency_us)?;
        }
        for (owner, place) in &self.placement {
            self.place(place)
                .map_err(|e| bad(format!("fabric.placement.{owner}: {}", e.detail())))?;
        }
        Ok(())
    }

    /// `node` or `node/nic` -> (node index, nic index).
    fn place(&self, place: &str) -> Result<(usize, usize)> {
        let (node, nic) = match place.split_once('/') {
            Some((n, c)) => (n, Some(c)),
            None => (place, None),
        };
        let (i, n) = self
            .nodes
            .iter()
            .enumerate()
            .find(|(_, n)| n.name == node)
            .ok_or_else(|| bad(format!("no node {node:?}")))?;
        let j = match nic {
            None => 0,
            Some(c) => n
                .nics
                .iter()
                .position(|x| x.name == c)
                .ok_or_else(|| bad(format!("node {node:?} has no nic {c:?}")))?,
        };
        Ok((i, j))
    }
}

/// Where an engine sits: a node and one of its NICs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Place {
    pub node: usize,
    pub nic: usize,
}

/// One FIFO resource.
#[derive(Debug)]
struct Queue {
    name: String,
    /// Bytes per nanosecond.
    rate: f64,
    state: Mutex<QueueState>,
}

#[derive(Debug, Default, Clone, Copy)]
struct QueueState {
    /// Virtual ns when the queue is next free.
    free_ns: u64,
    busy_ns: u64,
    bytes: u64,
}

/// A route between two places: the queues it holds and its latency.
#[derive(Debug, Clone)]
pub struct Route {
    queues: Vec<usize>,
    latency_ns: u64,
    /// For the trace: `n0>n1`.
    pub label: Arc<str>,
}

impl Route {
    /// The route's one-way latency: what an answer (a write's acknowledgement, a read's
    /// request) takes across it.
    pub fn latency_ns(&self) -> u64 {
        self.latency_ns
    }
}

/// How busy one queue was over a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueUse {
    pub queue: String,
    pub bytes: u64,
    pub busy_ns: u64,
}

/// A fabric in use: the model, its queues, the engines on it, the clock's origin and the trace.
pub struct Fabric {
    spec: FabricSpec,
    queues: Vec<Queue>,
    /// Queue index per name, to build routes.
    index: HashMap<String, usize>,
    origin: Mutex<Option<Instant>>,
    /// Tokio nanoseconds per modelled nanosecond (see [`Fabric::with_time_scale`]).
    scale: u64,
    rng: Mutex<u64>,
    trace: Mutex<Vec<(u64, String)>>,
    pub(crate) engines: Mutex<HashMap<u64, (Admission, Place)>>,
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fabric")
            .field("nodes", &self.spec.nodes.len())
            .field("queues", &self.queues.len())
            .finish_non_exhaustive()
    }
}

fn rate(gbps: f64) -> f64 {
    gbps / 8.0
}

impl Fabric {
    /// Builds the fabric of `spec` (validated), its jitter seeded by `spec.seed`, on tokio's
    /// clock one to one.
    pub fn new(spec: FabricSpec) -> Result<Arc<Fabric>> {
        Self::with_time_scale(spec, 1)
    }

    /// As [`new`](Self::new), with the model's clock running `scale` times slower than
    /// tokio's. Tokio's timers fire on whole milliseconds, so at scale 1 every wake-up
    /// rounds up to a millisecond, far coarser than a NIC's microseconds; at scale 1000 one
    /// tokio millisecond is one modelled microsecond. Whoever runs on such a fabric scales
    /// its own durations (timeouts, compute) by the same factor (the harness's sim runner
    /// does).
    pub fn with_time_scale(spec: FabricSpec, scale: u64) -> Result<Arc<Fabric>> {
        if !(1..=1_000_000).contains(&scale) {
            return Err(bad(format!("time scale {scale} is not in 1..=1000000")));
        }
        spec.validate()?;
        let mut queues = Vec::new();
        let mut add = |name: String, gbps: f64| {
            queues.push(Queue {
                name,
                rate: rate(gbps),
                state: Mutex::default(),
            });
        };
        for n in &spec.nodes {
            add(format!("{}.local", n.name), n.local.gbps);
            for c in &n.nics {
                add(format!("{}/{}.tx", n.name, c.name), c.gbps);
                add(format!("{}/{}.rx", n.name, c.name), c.gbps);
            }
        }
        for l in &spec.links {
            add(format!("{}>{}", l.between[0], l.between[1]), l.gbps);
            add(format!("{}>{}", l.between[1], l.between[0]), l.gbps);
        }
        // The switch's queues: one per ordered node pair without a link of its own, made up
        // front so the queue list never changes after construction.
        if let Some(sw) = &spec.switch {
            for a in &spec.nodes {
                for b in &spec.nodes {
                    let linked = spec.links.iter().any(|l| {
                        (l.between[0] == a.name && l.between[1] == b.name)
                            || (l.between[1] == a.name && l.between[0] == b.name)
                    });
                    if a.name != b.name && !linked {
                        add(format!("switch:{}>{}", a.name, b.name), sw.gbps);
                    }
                }
            }
        }
        let index = queues
            .iter()
            .enumerate()
            .map(|(i, q)| (q.name.clone(), i))
            .collect();
        let seed = spec.seed;
        Ok(Arc::new(Fabric {
            spec,
            queues,
            index,
            origin: Mutex::new(None),
            scale,
            rng: Mutex::new(seed ^ 0x5EED_F00D_D15C_0BA1),
            trace: Mutex::default(),
            engines: Mutex::default(),
        }))
    }

    /// The process-wide fabric engines get from `SimConfig::default()`: one node, no NIC, a
    /// host-memcpy local path. Its clock starts at its first use and its queues are shared by
    /// every runtime of the process, so it suits the wall clock; a run under a paused clock
    /// makes a fabric of its own (as `omnirig_harness::sim::run` does).
    pub fn process_default() -> Arc<Fabric> {
        static F: OnceLock<Arc<Fabric>> = OnceLock::new();
        F.get_or_init(|| {
            Fabric::new(FabricSpec {
                nodes: vec![NodeSpec {
                    name: "local".into(),
                    nics: vec![],
                    local: d_local(),
                }],
                switch: None,
                placement: BTreeMap::new(),
                ..FabricSpec::default()
            })
            .expect("the built-in fabric is valid")
        })
        .clone()
    }

    pub fn spec(&self) -> &FabricSpec {
        &self.spec
    }

    /// Where `owner` (a stage) runs per the placement, else the first node's first NIC.
    pub fn place_of(&self, owner: &str) -> Result<Place> {
        match self.spec.placement.get(owner) {
            Some(p) => self.resolve(p),
            None => Ok(Place { node: 0, nic: 0 }),
        }
    }

    /// `node` or `node/nic`.
    pub fn resolve(&self, place: &str) -> Result<Place> {
        let (node, nic) = self.spec.place(place)?;
        Ok(Place { node, nic })
    }

    pub fn node_name(&self, p: Place) -> &str {
        &self.spec.nodes[p.node].name
    }

    /// Starts the clock now (virtual time 0). Called by a run at its start; otherwise the
    /// first event starts it.
    pub fn start_clock(&self) {
        *lock(&self.origin) = Some(Instant::now());
    }

    /// Modelled nanoseconds since the clock started.
    pub fn now_ns(&self) -> u64 {
        let origin = *lock(&self.origin).get_or_insert_with(Instant::now);
        (Instant::now().saturating_duration_since(origin).as_nanos() / u128::from(self.scale))
            as u64
    }

    /// The tokio instant of modelled time `ns`.
    pub fn instant(&self, ns: u64) -> Instant {
        let origin = *lock(&self.origin).get_or_insert_with(Instant::now);
        origin + Duration::from_nanos(ns.saturating_mul(self.scale))
    }

    /// Tokio nanoseconds per modelled nanosecond.
    pub fn time_scale(&self) -> u64 {
        self.scale
    }

    /// The route from `a` to `b`: a node's local path, or NIC -> link (or switch) -> NIC.
    pub fn route(&self, a: Place, b: Place) -> Result<Route> {
        let na = &self.spec.nodes[a.node];
        let nb = &self.spec.nodes[b.node];
        if a.node == b.node {
            return Ok(Route {
                queues: vec![self.index[&format!("{}.local", na.name)]],
                latency_ns: us_ns(na.local.latency_us),
                label: format!("{}.local", na.name).into(),
            });
        }
        fn nic(n: &NodeSpec, i: usize) -> Result<&NicSpec> {
            n.nics.get(i).ok_or_else(|| {
                Error::new(
                    ErrorKind::Unreachable,
                    format!("node {} has no NIC to reach other nodes", n.name),
                )
            })
        }
        let (ca, cb) = (nic(na, a.nic)?, nic(nb, b.nic)?);
        let mut queues = vec![
            self.index[&format!("{}/{}.tx", na.name, ca.name)],
            self.index[&format!("{}/{}.rx", nb.name, cb.name)],
        ];
        let mut latency_ns = us_ns(ca.latency_us) + us_ns(cb.latency_us);
        let direct = format!("{}>{}", na.name, nb.name);
        if let Some(&q) = self.index.get(&direct) {
            queues.push(q);
            let l = self
                .spec
                .links
                .iter()
                .find(|l| {
                    (l.between[0] == na.name && l.between[1] == nb.name)
                        || (l.between[1] == na.name && l.between[0] == nb.name)
                })
                .expect("indexed links exist");
            latency_ns += us_ns(l.latency_us);
        } else if let Some(s) = &self.spec.switch {
            // Non-blocking: the switch adds latency and caps the rate, but has no shared
            // queue of its own; NICs are where pairs contend.
            latency_ns += us_ns(s.latency_us);
            queues.push(self.index[&format!("switch:{}>{}", na.name, nb.name)]);
        } else {
            return Err(Error::new(
                ErrorKind::Unreachable,
                format!(
                    "no link between {} and {} and no switch in the fabric",
                    na.name, nb.name
                ),
            ));
        }
        Ok(Route {
            queues,
            latency_ns,
            label: direct.into(),
        })
    }

    /// Reserves `bytes` on `route` at virtual time `now`; returns when they land.
    pub fn reserve(&self, route: &Route, bytes: u64, now: u64) -> u64 {
        let mut states: Vec<_> = route
            .queues
            .iter()
            .map(|&q| lock(&self.queues[q].state))
            .collect();
        let start = states.iter().map(|s| s.free_ns).fold(now, u64::max);
        let mut hold = 0;
        for (s, &q) in states.iter_mut().zip(&route.queues) {
            let ns = (bytes as f64 / self.queues[q].rate).ceil() as u64;
            s.free_ns = start + ns;
            s.busy_ns += ns;
            s.bytes += bytes;
            hold = hold.max(ns);
        }
        drop(states);
        start + hold + route.latency_ns + self.jitter()
    }

    /// Seeded extra latency in [0, jitter_us).
    fn jitter(&self) -> u64 {
        if self.spec.jitter_us <= 0.0 {
            return 0;
        }
        let mut s = lock(&self.rng);
        *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 / (1u64 << 53) as f64 * self.spec.jitter_us * 1e3) as u64
    }

    /// Records an event at virtual time `ns`.
    pub fn event(&self, ns: u64, what: String) {
        lock(&self.trace).push((ns, what));
    }

    /// The trace so far, in a canonical order: by time, then by text (events of one instant
    /// may be recorded in any order by tasks woken together).
    pub fn trace(&self) -> Vec<String> {
        let mut t = lock(&self.trace).clone();
        t.sort();
        t.into_iter()
            .map(|(ns, what)| format!("{ns:>15} {what}"))
            .collect()
    }

    /// Each queue's bytes and busy time so far, queues that carried nothing left out.
    pub fn usage(&self) -> Vec<QueueUse> {
        self.queues
            .iter()
            .filter_map(|q| {
                let s = *lock(&q.state);
                (s.bytes > 0).then(|| QueueUse {
                    queue: q.name.clone(),
                    bytes: s.bytes,
                    busy_ns: s.busy_ns,
                })
            })
            .collect()
    }
}

fn us_ns(us: f64) -> u64 {
    (us * 1e3).round() as u64
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
