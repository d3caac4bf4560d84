//! The host model of simulated runs: what the stages' CPU work costs, and how many cores
//! share it.
//!
//! A simulated run does the stages' real CPU work (generating outputs, digesting what
//! arrives) but on a paused clock, where that work takes no time. Measured runs spend most
//! of their time there, so the scale model charges it: each piece of work is a job of
//! `bytes x ns_per_byte` on the host its stage sits on, and a host runs its jobs under
//! processor sharing (n jobs on c cores each progress at min(1, c/n), a job on several
//! threads getting a share per thread), so stages placed on one machine slow each other down
//! as they do for real.
//!
//! The costs live here, not in the engine: which work a stage does is the harness's
//! business (`transports/` knows nothing of stages).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio::time::{Duration, Instant};

/// The `cpu:` section of a fabric file (or of a scenario, beside `fabric:`).
///
/// ```yaml
/// cpu:
///   generate_ns_per_byte: 1.1   # the stub producing an output (fixture generator)
///   digest_ns_per_byte: 0.12    # XXH3-128 over bytes (verification, staging)
///   copy_ns_per_byte: 0.35      # a transport copying a byte, on each side (tcp send / recv)
///   message_us: 12              # per control message, on each side (encode, syscall, wake-up)
///   write_us: 25                # per write of a transfer beyond its first, on each side
///   cold_write_us: 50           # and more, as latency, to an owner parked cold_after_us (2 ms)
///   transfer_threads: 2         # a transfer's copies on this many threads a side (default 1)
///   packet_us: 15               # a packet handoff's sidecar decoded at the fence ...
///   packet_entry_us: 5          # ... and each of its entries
///   wake_us: 130                # a parked stage process resuming for traffic (latency, no work)
///   wake_after:                 # optional: the wake by how long the process was parked
///     - { idle_us: 1000, wake_us: 20 }
///     - { idle_us: 10000, wake_us: 90 }
///     - { idle_us: 100000, wake_us: 160 }
///   park_us: 50                 # traffic within this of a process's last stays hot
///   cores: 0                    # cores of a node no host names; 0: as many as it needs
///   hosts:                      # nodes sharing one machine's cores
///     - { name: localhost, cores: 2, nodes: [encoder, thinker_prefill, thinker_decode, talker, code2wav] }
/// ```
///
/// Every cost defaults to zero: a fabric without this section charges no CPU time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuSpec {
    #[serde(default)]
    pub generate_ns_per_byte: f64,
    #[serde(default)]
    pub digest_ns_per_byte: f64,
    #[serde(default)]
    pub copy_ns_per_byte: f64,
    #[serde(default)]
    pub message_us: f64,
    /// What each write request of a transfer beyond its first costs, on each side, in the
    /// same job as the transfer's copy (so a transfer's writes are handled one after
    /// another): its frame, its syscalls, its acknowledgement. `--calibrate-cpu` measures it
    /// from a batch of 4 KiB engine writes against one; the KV hop moves 96 to 672 writes per
    /// request, where it comes to milliseconds (docs/sim.md).
    #[serde(default)]
    pub write_us: f64,
    /// What each write of a transfer beyond its first costs more, as latency, when the
    /// owner's process had been parked for at least `cold_after_us` (or saw no traffic yet)
    /// and a core of its host is idle:
    /// on a virtual machine whose CPUs halt when idle, every handoff of such a transfer wakes
    /// a halted CPU, not only its first. `--calibrate-cpu` measures it from an engine's batch
    /// of 4 KiB writes after a 10 ms pause against one write after the same pause, each less
    /// its back-to-back time (docs/sim.md). 0 (the default): no such cost.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cold_write_us: f64,
    /// How long the owner must have been parked for its writes to pay `cold_write_us`.
    #[serde(
        default = "default_cold_after_us",
        skip_serializing_if = "is_default_cold_after_us"
    )]
    pub cold_after_us: f64,
    /// Threads a transfer's copies run on, on each side, when it has that many writes: the
    /// engine's streams, which run on the process's runtime workers. When the cores are
    /// contended a transfer gets this many shares of them, as Linux shares cores by thread
    /// (docs/sim.md). 1 (the default): a transfer's copy weighs as much as any other job.
    #[serde(
        default = "default_transfer_threads",
        skip_serializing_if = "is_default_transfer_threads"
    )]
    pub transfer_threads: u32,
    /// The packet connector's consumer decoding and checking the packet when the grants are
    /// fenced (msgpack, its version, request and entries' dtypes, shapes and digests), before
    /// any tensor's check: per handoff, plus `packet_entry_us` per entry. A consumer that
    /// parked for the bytes decodes it cold; `--calibrate-cpu` times that after a pause.
    /// Measured in place: 18 to 90 us, a third to a half of talker -> code2wav's verify
    /// phase (docs/sim.md).
    #[serde(default)]
    pub packet_us: f64,
    #[serde(default)]
    pub packet_entry_us: f64,
    /// The decode stage's KV check (blocks that arrived digested in its pool, expected blocks
    /// generated and digested), per byte, as `--calibrate-cpu` measures it in a pool; unset,
    /// it is charged as generate + 2 x digest. Under TCG it costs 1.7x that (docs/sim.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_check_ns_per_byte: Option<f64>,
    /// A whole inbound tensor's check when it is byte-compared (at most
    /// `BYTE_COMPARE_MAX`: digest, the expected digest, a fresh generation, the compare), per
    /// byte, as `--calibrate-cpu` measures the stubs' check; unset, it is charged as
    /// 2 x generate + 2 x digest, as much as 40% below the check timed here (docs/sim.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check_ns_per_byte: Option<f64>,
    /// What each whole inbound tensor's check costs beyond its bytes (the generator's setup,
    /// a cold cache after the consumer parked), microseconds; charged where the expected
    /// digest is made, not where it was remembered.
    #[serde(default)]
    pub check_us: f64,
    /// Scheduling delay, in microseconds, before a stage process that has been parked
    /// resumes: a control message or a transfer reaching it, or a transfer's completion
    /// reaching the process that waited for it. Latency, not work: no core is busy.
    #[serde(default)]
    pub wake_us: f64,
    /// The wake by how long the process was parked, where measured: a wake after `idle`
    /// costs the value interpolated linearly in log(idle) between the points, from nothing at
    /// `park_us` up to the first, and the last point's beyond it (and for a process that saw
    /// no traffic yet). Empty: every wake costs `wake_us`. A thread parked for 0.1 ms
    /// resumes far sooner than one parked for 100 ms (docs/sim.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub wake_after: Vec<WakePoint>,
    /// How long a process's threads stay hot (busy-polling) after its last traffic; traffic
    /// within this pays no wake. Defaults to the engine's tcp busy-poll window.
    #[serde(default = "default_park_us")]
    pub park_us: f64,
    /// The nice value the stages' CPU work runs at (`omnirig run --check-nice`, 10 by
    /// default): generating and checking tensors, but not a check of at most 256 KiB (done in
    /// place), a packet's decode or a transfer's copies, which run on the data plane's
    /// threads at nice 0. While the cores are contended, a job's threads weigh as Linux weighs
    /// their nice values (1024 at 0, 110 at 10), so a woken transfer takes a core from a
    /// check. Each stage process runs its checks on a pool of as many threads as its host
    /// has cores; the rest wait their turn. 0: every job weighs the same and each check has
    /// a thread of its own, as before the checks had a pool (windows measured before
    /// 2026-12-07; docs/sim.md).
    #[serde(default = "default_check_nice")]
    pub check_nice: i32,
    #[serde(default)]
    pub cores: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<HostSpec>,
}

fn default_check_nice() -> i32 {
    crate::cpu::DEFAULT_NICE
}

/// Linux's weight of a thread at nice 0 to 19 (the scheduler's `sched_prio_to_weight`).
const NICE_WEIGHT: [f64; crate::cpu::MAX_NICE as usize + 1] = [
    1024.0, 820.0, 655.0, 526.0, 423.0, 335.0, 272.0, 215.0, 172.0, 137.0, 110.0, 87.0, 70.0, 56.0,
    45.0, 36.0, 29.0, 23.0, 18.0, 15.0,
];

fn default_park_us() -> f64 {
    50.0
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// Measured on a 2-core virtual machine: a batch of 32 writes after 1 ms of idle ran as fast
/// as back to back, after 2 ms and more (up to 30) 2.6-3.0x slower (docs/sim.md).
fn default_cold_after_us() -> f64 {
    2000.0
}

fn is_default_cold_after_us(v: &f64) -> bool {
    *v == default_cold_after_us()
}

fn default_transfer_threads() -> u32 {
    1
}

fn is_default_transfer_threads(n: &u32) -> bool {
    *n == default_transfer_threads()
}

/// Most threads a transfer's copy may be modelled on.
pub const MAX_TRANSFER_THREADS: u32 = 64;

/// One point of [`CpuSpec::wake_after`]: the wake of a process parked for `idle_us`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WakePoint {
    pub idle_us: f64,
    pub wake_us: f64,
}

/// Most points a wake curve may have.
pub const MAX_WAKE_POINTS: usize = 16;

impl Default for CpuSpec {
    fn default() -> Self {
        CpuSpec {
            generate_ns_per_byte: 0.0,
            digest_ns_per_byte: 0.0,
            copy_ns_per_byte: 0.0,
            message_us: 0.0,
            write_us: 0.0,
            cold_write_us: 0.0,
            cold_after_us: default_cold_after_us(),
            transfer_threads: default_transfer_threads(),
            packet_us: 0.0,
            packet_entry_us: 0.0,
            kv_check_ns_per_byte: None,
            check_ns_per_byte: None,
            check_us: 0.0,
            wake_us: 0.0,
            wake_after: Vec::new(),
            park_us: default_park_us(),
            check_nice: default_check_nice(),
            cores: 0,
            hosts: Vec::new(),
        }
    }
}

/// Fabric nodes that are one machine: their CPU work shares `cores`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    pub name: String,
    pub cores: u32,
    pub nodes: Vec<String>,
}

/// Most cores a host may have (beyond it, the model is a typo).
pub const MAX_CORES: u32 = 1 << 16;

impl CpuSpec {
    /// Checks every field; an error names the field (`cpu.hosts[0].cores: ...`). `nodes`:
    /// the fabric's node names, which hosts must name.
    pub fn validate(&self, nodes: &[&str]) -> std::result::Result<(), String> {
        for (field, v, max) in [
            ("generate_ns_per_byte", self.generate_ns_per_byte, 1e6),
            ("digest_ns_per_byte", self.digest_ns_per_byte, 1e6),
            ("copy_ns_per_byte", self.copy_ns_per_byte, 1e6),
            ("message_us", self.message_us, 1e7),
            ("write_us", self.write_us, 1e7),
            ("cold_write_us", self.cold_write_us, 1e7),
            ("cold_after_us", self.cold_after_us, 1e9),
            ("packet_us", self.packet_us, 1e7),
            ("packet_entry_us", self.packet_entry_us, 1e7),
            ("check_us", self.check_us, 1e7),
            ("wake_us", self.wake_us, 1e7),
            ("park_us", self.park_us, 1e7),
        ] {
            if !(v.is_finite() && (0.0..=max).contains(&v)) {
                return Err(format!("cpu.{field}: {v} is not in [0, {max:e}]"));
            }
        }
        if !(1..=MAX_TRANSFER_THREADS).contains(&self.transfer_threads) {
            return Err(format!(
                "cpu.transfer_threads: {} is not in 1..={MAX_TRANSFER_THREADS}",
                self.transfer_threads
            ));
        }
        if self.wake_after.len() > MAX_WAKE_POINTS {
            return Err(format!(
                "cpu.wake_after: {} points, at most {MAX_WAKE_POINTS}",
                self.wake_after.len()
            ));
        }
        let mut after = self.park_us;
        for (i, p) in self.wake_after.iter().enumerate() {
            if !(p.idle_us.is_finite() && p.idle_us > after && p.idle_us <= 1e9) {
                return Err(format!(
                    "cpu.wake_after[{i}].idle_us: {} must be above {after} (park_us, then each \
                     point's) and at most 1e9",
                    p.idle_us
                ));
            }
            if !(p.wake_us.is_finite() && (0.0..=1e7).contains(&p.wake_us)) {
                return Err(format!(
                    "cpu.wake_after[{i}].wake_us: {} is not in [0, 1e7]",
                    p.wake_us
                ));
            }
            after = p.idle_us;
        }
        if let Some(v) = self.kv_check_ns_per_byte
            && !(v.is_finite() && v > 0.0 && v <= 1e6)
        {
            return Err(format!("cpu.kv_check_ns_per_byte: {v} is not in (0, 1e6]"));
        }
        if let Some(v) = self.check_ns_per_byte
            && !(v.is_finite() && v > 0.0 && v <= 1e6)
        {
            return Err(format!("cpu.check_ns_per_byte: {v} is not in (0, 1e6]"));
        }
        if !(0..=crate::cpu::MAX_NICE).contains(&self.check_nice) {
            return Err(format!(
                "cpu.check_nice: {} is not in 0..={}",
                self.check_nice,
                crate::cpu::MAX_NICE
            ));
        }
        if self.cores > MAX_CORES {
            return Err(format!(
                "cpu.cores: {} is not in 0..={MAX_CORES}",
                self.cores
            ));
        }
        let mut hosts = std::collections::BTreeSet::new();
        let mut placed: BTreeMap<&str, &str> = BTreeMap::new();
        for (i, h) in self.hosts.iter().enumerate() {
            if h.name.is_empty() || !hosts.insert(h.name.as_str()) {
                return Err(format!(
                    "cpu.hosts[{i}].name: {:?} must be non-empty and unique",
                    h.name
                ));
            }
            if !(1..=MAX_CORES).contains(&h.cores) {
                return Err(format!(
                    "cpu.hosts[{i}].cores: {} is not in 1..={MAX_CORES}",
                    h.cores
                ));
            }
            if h.nodes.is_empty() {
                return Err(format!("cpu.hosts[{i}].nodes: at least one node"));
            }
            for n in &h.nodes {
                if !nodes.contains(&n.as_str()) {
                    return Err(format!(
                        "cpu.hosts[{i}].nodes: no node {n:?} in the fabric (nodes: {})",
                        nodes.join(", ")
                    ));
                }
                if let Some(other) = placed.insert(n.as_str(), h.name.as_str()) {
                    return Err(format!(
                        "cpu.hosts[{i}].nodes: node {n:?} is already on host {other:?}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// True when no work costs anything (the model is off).
    pub fn is_free(&self) -> bool {
        self.generate_ns_per_byte == 0.0
            && self.digest_ns_per_byte == 0.0
            && self.copy_ns_per_byte == 0.0
            && self.message_us == 0.0
            && self.write_us == 0.0
            && self.cold_write_us == 0.0
            && self.packet_us == 0.0
            && self.packet_entry_us == 0.0
            && self.check_us == 0.0
            && self.wake_us == 0.0
            && self.wake_after.iter().all(|p| p.wake_us == 0.0)
    }

    /// What a transfer of `writes` writes pays beyond its wakes, in microseconds, when its
    /// owner was parked for `idle_us` (None: it saw no traffic yet): `cold_write_us` for each
    /// write beyond the first once the owner was parked for `cold_after_us`, else nothing.
    pub fn cold_writes_us(&self, idle_us: Option<f64>, writes: usize) -> f64 {
        if idle_us.is_some_and(|t| t < self.cold_after_us) {
            return 0.0;
        }
        writes.saturating_sub(1) as f64 * self.cold_write_us
    }

    /// The wake, in microseconds, of a process parked for `idle_us` (None: it saw no
    /// traffic yet); 0 while it is still hot (see [`wake_after`](Self::wake_after)).
    pub fn wake_for(&self, idle_us: Option<f64>) -> f64 {
        if idle_us.is_some_and(|t| t <= self.park_us) {
            return 0.0;
        }
        let Some(last) = self.wake_after.last() else {
            return self.wake_us;
        };
        let t = match idle_us {
            Some(t) if t < last.idle_us => t,
            _ => return last.wake_us,
        };
        let mut from = WakePoint {
            idle_us: self.park_us.max(1e-3),
            wake_us: 0.0,
        };
        for p in &self.wake_after {
            if t <= p.idle_us {
                let f = (t.ln() - from.idle_us.ln()) / (p.idle_us.ln() - from.idle_us.ln());
                return from.wake_us + f.clamp(0.0, 1.0) * (p.wake_us - from.wake_us);
            }
            from = *p;
        }
        last.wake_us
    }
}

/// One machine's cores, shared by the jobs running on it (processor sharing).
///
/// A job runs on one thread unless it says more ([`run_on`](Self::run_on)). Linux shares
/// the cores by thread, not by job, so a job gets a share per thread: each job progresses
/// at min(1, threads x s), where the share `s` is the one that hands out every core (or 1
/// when there are cores to spare). A job never runs faster than alone (rate 1): its work
/// is what it took alone. With every job on one thread this is min(1, cores / jobs).
///
/// The stages' CPU work ([`Priority::Checks`]) runs below the data plane: its threads weigh
/// `check_weight` against a data-plane thread's 1, so the share is by weight, not by thread
/// (weighted max-min fairness, as Linux's scheduler shares cores by nice value).
/// Times are tokio's (the sim runner's clock, scaled), so the model needs no clock of its
/// own.
#[derive(Debug)]
pub struct Host {
    name: String,
    /// 0: every job runs at full speed.
    cores: u32,
    /// What a thread of the stages' CPU work weighs against a data-plane thread.
    check_weight: f64,
    state: Mutex<HostState>,
    changed: Notify,
}

#[derive(Debug)]
struct Job {
    id: u64,
    /// Work (tokio ns) still to do.
    left: f64,
    threads: u32,
    /// What each of its threads weighs (1: the data plane's).
    weight: f64,
    /// Its progress per tokio ns, as of the last change of the job set.
    rate: f64,
}

#[derive(Debug)]
struct HostState {
    at: Option<Instant>,
    /// Running jobs, in arrival order.
    jobs: Vec<Job>,
    next_id: u64,
    /// Work charged (tokio ns), for reports.
    busy: f64,
}

impl HostState {
    /// Sets every job's rate for the current job set (weighted max-min fairness, each job
    /// capped at 1): the jobs of the heaviest claim (threads x weight) are capped first, the
    /// rest share what is left of the cores by their claims.
    fn share(&mut self, cores: u32) {
        let threads: f64 = self.jobs.iter().map(|j| f64::from(j.threads)).sum();
        if cores == 0 || threads <= f64::from(cores) {
            for j in &mut self.jobs {
                j.rate = 1.0;
            }
            return;
        }
        let claim = |j: &Job| f64::from(j.threads) * j.weight;
        let mut order: Vec<usize> = (0..self.jobs.len()).collect();
        // Heaviest first; ties in arrival order, so the outcome is a function of the jobs.
        order.sort_by(|&a, &b| {
            claim(&self.jobs[b])
                .total_cmp(&claim(&self.jobs[a]))
                .then(a.cmp(&b))
        });
        let mut cores_left = f64::from(cores);
        let mut claims_left: f64 = self.jobs.iter().map(claim).sum();
        let mut i = 0;
        while i < order.len() {
            let c = claim(&self.jobs[order[i]]);
            if c * cores_left / claims_left < 1.0 {
                break;
            }
            cores_left -= 1.0;
            claims_left -= c;
            i += 1;
        }
        let per_claim = if claims_left > 0.0 {
            cores_left / claims_left
        } else {
            0.0
        };
        for (k, &idx) in order.iter().enumerate() {
            let j = &mut self.jobs[idx];
            j.rate = if k < i { 1.0 } else { claim(j) * per_claim };
        }
    }

    /// Runs every job on at its rate up to `now`.
    fn advance(&mut self, now: Instant) {
        if let Some(at) = self.at {
            let dt = now.saturating_duration_since(at).as_nanos() as f64;
            for j in &mut self.jobs {
                j.left -= dt * j.rate;
            }
        }
        self.at = Some(now);
    }
}

/// Removes a job when its future ends or is dropped (a deadline or cancel drops it).
struct JobGuard<'a> {
    host: &'a Host,
    id: u64,
}

impl Drop for JobGuard<'_> {
    fn drop(&mut self) {
        let mut s = self.host.lock();
        s.advance(Instant::now());
        s.jobs.retain(|j| j.id != self.id);
        s.share(self.host.cores);
        drop(s);
        // The others' rates went up.
        self.host.changed.notify_waiters();
    }
}

/// Whose work a job is: it sets what the job's threads weigh while the cores are contended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// The runtime's threads: transfers' copies, control messages, small checks done in place.
    DataPlane,
    /// The stages' CPU pool ([`crate::cpu`]), niced to `cpu.check_nice`.
    Checks,
}

impl Host {
    /// A host of `cores` cores (0: as many as it needs) whose checks run at the data plane's
    /// priority.
    pub fn new(name: &str, cores: u32) -> Self {
        Self::with_check_nice(name, cores, 0)
    }

    /// A host of `cores` cores whose stages' CPU work runs at nice `check_nice` (0 to 19).
    pub fn with_check_nice(name: &str, cores: u32, check_nice: i32) -> Self {
        let nice = check_nice.clamp(0, crate::cpu::MAX_NICE) as usize;
        Host {
            name: name.into(),
            cores,
            check_weight: NICE_WEIGHT[nice] / NICE_WEIGHT[0],
            state: Mutex::new(HostState {
                at: None,
                jobs: Vec::new(),
                next_id: 0,
                busy: 0.0,
            }),
            changed: Notify::new(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HostState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `work` of one core's time on this host: returns when it is done, sharing the
    /// cores with every other job running meanwhile. Zero work returns at once, without
    /// yielding (so a free model leaves a run's schedule exactly as it was).
    pub async fn run(&self, work: Duration) {
        self.run_on(work, 1).await
    }

    /// As [`run`](Self::run), for a job whose work is spread over `threads` threads (at
    /// least 1): it gets that many shares of the cores while they are contended, and still
    /// runs no faster than alone.
    pub async fn run_on(&self, work: Duration, threads: u32) {
        self.run_as(work, threads, Priority::DataPlane).await
    }

    /// As [`run_on`](Self::run_on), for a job of `priority`.
    pub async fn run_as(&self, work: Duration, threads: u32, priority: Priority) {
        if work.is_zero() {
            return;
        }
        let weight = match priority {
            Priority::DataPlane => 1.0,
            Priority::Checks => self.check_weight,
        };
        let w = work.as_nanos() as f64;
        let id = {
            let mut s = self.lock();
            s.advance(Instant::now());
            let id = s.next_id;
            s.next_id += 1;
            s.jobs.push(Job {
                id,
                left: w,
                threads: threads.max(1),
                weight,
                rate: 1.0,
            });
            s.share(self.cores);
            s.busy += w;
            id
        };
        let _guard = JobGuard { host: self, id };
        // The others' rates went down.
        self.changed.notify_waiters();
        loop {
            // Made before the state is read, so a change after it is not missed.
            let changed = self.changed.notified();
            let wait = {
                let mut s = self.lock();
                s.advance(Instant::now());
                let Some(j) = s.jobs.iter().find(|j| j.id == id) else {
                    return;
                };
                // A tokio timer fires on a whole tick at or after its deadline, so a job
                // is done once it is within a nanosecond of its work.
                if j.left <= 1.0 {
                    return;
                }
                Duration::from_nanos((j.left / j.rate).ceil() as u64)
            };
            tokio::select! {
                biased;
                _ = changed => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Whether a core of this host is idle now: its running jobs' threads fewer than its
    /// cores (always, with cores unbounded).
    pub fn has_idle_core(&self) -> bool {
        let threads: u64 = self.lock().jobs.iter().map(|j| u64::from(j.threads)).sum();
        self.cores == 0 || threads < u64::from(self.cores)
    }

    /// Work charged so far, in tokio time.
    pub fn busy(&self) -> Duration {
        Duration::from_nanos(self.lock().busy as u64)
    }
}

/// The host model of one run: the costs, and the host of each fabric node.
#[derive(Debug)]
pub struct Cpu {
    spec: CpuSpec,
    hosts: Vec<Arc<Host>>,
    /// Fabric node -> index in `hosts`.
    of_node: BTreeMap<String, usize>,
    /// Tokio ns per modelled ns (the sim runner's time scale).
    scale: u64,
    /// Each stage process's last traffic (tokio time), for the wake model.
    last: std::sync::Mutex<BTreeMap<String, Instant>>,
}

impl Cpu {
    /// The model for a fabric of `nodes`, on a clock `scale` times slower than the model.
    /// Nodes no host names are hosts of their own, with `spec.cores` cores.
    pub fn new(spec: CpuSpec, nodes: &[&str], scale: u64) -> std::result::Result<Self, String> {
        spec.validate(nodes)?;
        let mut hosts = Vec::new();
        let mut of_node = BTreeMap::new();
        for h in &spec.hosts {
            hosts.push(Arc::new(Host::with_check_nice(
                &h.name,
                h.cores,
                spec.check_nice,
            )));
            for n in &h.nodes {
                of_node.insert(n.clone(), hosts.len() - 1);
            }
        }
        for n in nodes {
            if !of_node.contains_key(*n) {
                hosts.push(Arc::new(Host::with_check_nice(
                    n,
                    spec.cores,
                    spec.check_nice,
                )));
                of_node.insert((*n).to_string(), hosts.len() - 1);
            }
        }
        Ok(Cpu {
            spec,
            hosts,
            of_node,
            scale: scale.max(1),
            last: Default::default(),
        })
    }

    pub fn spec(&self) -> &CpuSpec {
        &self.spec
    }

    /// A stage process's pool for its checks on `host`: as many threads as the host has
    /// cores, as `omnirig run` builds it (`harness/src/cpu.rs`). None where the checks have
    /// no pool (`check_nice: 0`, each on its runtime thread) or the host's cores are unbounded.
    pub fn check_pool(&self, host: &Host) -> Option<Arc<tokio::sync::Semaphore>> {
        (self.spec.check_nice > 0 && host.cores > 0)
            .then(|| Arc::new(tokio::sync::Semaphore::new(host.cores as usize)))
    }

    /// The host of fabric node `node` (`node/nic` allowed).
    pub fn host(&self, node: &str) -> Option<Arc<Host>> {
        let node = node.split_once('/').map_or(node, |(n, _)| n);
        self.of_node.get(node).map(|&i| self.hosts[i].clone())
    }

    /// `bytes` at `ns_per_byte` as tokio time.
    pub fn work(&self, bytes: u64, ns_per_byte: f64) -> Duration {
        let ns = bytes as f64 * ns_per_byte * self.scale as f64;
        Duration::from_nanos(ns.round() as u64)
    }

    /// One control message's cost on one side, as tokio time.
    pub fn message(&self) -> Duration {
        self.us(self.spec.message_us)
    }

    pub(crate) fn us(&self, us: f64) -> Duration {
        Duration::from_nanos((us * 1e3 * self.scale as f64).round() as u64)
    }

    /// How long stage process `process` has seen no traffic, in modelled microseconds (None:
    /// none yet).
    pub fn idle_us(&self, process: &str) -> Option<f64> {
        let l = self.last.lock().unwrap_or_else(|p| p.into_inner());
        l.get(process).map(|&t| {
            let idle = Instant::now().saturating_duration_since(t);
            idle.as_nanos() as f64 / 1e3 / self.scale as f64
        })
    }

    /// Traffic at stage process `process` now: it stays hot for `park_us`.
    pub fn touch(&self, process: &str) {
        let mut l = self.last.lock().unwrap_or_else(|p| p.into_inner());
        l.insert(process.to_string(), Instant::now());
    }

    /// Traffic reaching stage process `process`: if it saw none for `park_us` (or ever), it
    /// was parked and resumes later by [`CpuSpec::wake_for`] its time parked (`wake_us`
    /// without a `wake_after` curve). A wake is latency, not work: it takes no core. Returns
    /// when the process handles the traffic.
    pub async fn wake(&self, process: &str) {
        if self.spec.wake_us == 0.0 && self.spec.wake_after.is_empty() {
            return;
        }
        let wake = self.spec.wake_for(self.idle_us(process));
        if wake > 0.0 {
            tokio::time::sleep(self.us(wake)).await;
        }
        self.touch(process);
    }

    /// Each host's charged work, in modelled seconds.
    pub fn busy_s(&self) -> Vec<(String, f64)> {
        self.hosts
            .iter()
            .map(|h| {
                (
                    h.name().to_string(),
                    h.busy().as_secs_f64() / self.scale as f64,
                )
            })
            .collect()
    }
}

/// The wake model's name for the engine threads of stage process `process` (transfers land
/// there; control messages reach its stage worker, [`control_thread`]): each parks on its
/// own, so a hot engine does not make the worker hot.
pub fn engine_thread(process: &str) -> String {
    format!("{process}/engine")
}

/// The wake model's name for the stage worker of `process`, which control messages reach.
pub fn control_thread(process: &str) -> String {
    format!("{process}/control")
}

/// A whole tensor's check per byte: a digest of what arrived, and unless the expected digest
/// was remembered, the expected bytes generated and digested, and generated afresh and
/// compared when `regenerate` (small tensors), at the measured check's rate where known.
fn verify_ns_per_byte(s: &CpuSpec, remembered: bool, regenerate: bool) -> f64 {
    match (remembered, regenerate, s.check_ns_per_byte) {
        (true, _, _) => s.digest_ns_per_byte,
        (false, true, Some(per)) => per,
        (false, true, None) => 2.0 * (s.generate_ns_per_byte + s.digest_ns_per_byte),
        (false, false, _) => s.generate_ns_per_byte + 2.0 * s.digest_ns_per_byte,
    }
}

/// A stage's view of the model: its own host, its peers' hosts, the costs.
#[derive(Debug, Clone)]
pub struct StageCpu {
    pub cpu: Arc<Cpu>,
    pub host: Arc<Host>,
    /// The host of the stage this one sends to, if any (a copy's receiving side).
    pub peer: Option<Arc<Host>>,
    /// This stage's process, and the one it sends to (the wake model's names).
    pub process: String,
    pub peer_process: Option<String>,
    /// The process's pool for its checks ([`Cpu::check_pool`]): at most that many of its
    /// checks run at once, the rest wait their turn. `None`: each runs on a thread of its own.
    pub pool: Option<Arc<tokio::sync::Semaphore>>,
}

impl StageCpu {
    /// Producing `bytes` of outputs, and digesting them when `digested`.
    pub async fn produce(&self, bytes: u64, digested: bool) {
        let s = self.cpu.spec();
        let per = s.generate_ns_per_byte + if digested { s.digest_ns_per_byte } else { 0.0 };
        self.checks(self.cpu.work(bytes, per)).await;
    }

    /// Verifying `bytes` that arrived: digesting them, and making the expected digest
    /// (generating the expected bytes and digesting them) unless it was remembered;
    /// `regenerate` adds the byte compare's fresh copy (small tensors).
    /// Where measured, a byte-compared check costs `check_ns_per_byte`, and every check
    /// that makes its expected digest `check_us` more.
    pub async fn verify(&self, bytes: u64, remembered: bool, regenerate: bool) {
        let s = self.cpu.spec();
        let mut w = self
            .cpu
            .work(bytes, verify_ns_per_byte(s, remembered, regenerate));
        if !remembered {
            w += self.cpu.us(s.check_us);
        }
        // A check of a few KiB runs in place, on the data plane's thread (crate::cpu).
        if bytes <= crate::cpu::IN_PLACE_BYTES {
            self.host.run(w).await;
        } else {
            self.checks(w).await;
        }
    }

    /// The packet connector's consumer decoding a packet of `entries` entries at the fence
    /// ([`CpuSpec::packet_us`]).
    pub async fn packet(&self, entries: usize) {
        let s = self.cpu.spec();
        let w = self
            .cpu
            .us(s.packet_us + entries as f64 * s.packet_entry_us);
        self.host.run(w).await;
    }

    /// Verifying `bytes` of KV blocks that arrived in the decode stage's pool: against the
    /// remembered digests, a digest of what arrived; otherwise the KV check at its own
    /// measured rate where the host model has one.
    pub async fn verify_kv(&self, bytes: u64, remembered: bool) {
        match self.cpu.spec().kv_check_ns_per_byte {
            Some(per) if !remembered => self.checks(self.cpu.work(bytes, per)).await,
            _ => {
                let per = verify_ns_per_byte(self.cpu.spec(), remembered, false);
                self.checks(self.cpu.work(bytes, per)).await
            }
        }
    }

    /// A transfer's copies: `bytes` in `writes` write requests on this host (send) and on
    /// the peer's (receive), both running beside the transfer itself.
    pub async fn copy(&self, bytes: u64, writes: usize) {
        let s = self.cpu.spec();
        let extra = writes.saturating_sub(1) as f64;
        let w = self.cpu.work(bytes, s.copy_ns_per_byte) + self.cpu.us(extra * s.write_us);
        let threads = s
            .transfer_threads
            .min(writes.try_into().unwrap_or(u32::MAX));
        match &self.peer {
            Some(p) => {
                tokio::join!(self.host.run_on(w, threads), p.run_on(w, threads));
            }
            None => self.host.run_on(w, threads).await,
        }
    }

    /// A transfer `t` of `bytes` in `writes` requests to the peer: the owner's process wakes
    /// for it if parked (and, parked for `cold_after_us` while a core of its host is idle,
    /// its writes beyond the first pay `cold_write_us` each, [`CpuSpec::cold_writes_us`]),
    /// the copies run beside it ([`copy`](Self::copy)), and this process,
    /// which waited, wakes for its completion if the wait outlasted its busy-poll.
    pub async fn transfer<F: std::future::Future>(
        &self,
        bytes: u64,
        writes: usize,
        t: F,
    ) -> F::Output {
        let me = engine_thread(&self.process);
        let owner = self.peer_process.as_deref().map(engine_thread);
        self.cpu.touch(&me);
        if let Some(p) = &owner {
            // Read before the wake touches it: how long the owner was parked. Its writes pay
            // for waking a halted core only where one of its host's cores is idle.
            let cold = if self.peer.as_ref().is_none_or(|h| h.has_idle_core()) {
                self.cpu.spec().cold_writes_us(self.cpu.idle_us(p), writes)
            } else {
                0.0
            };
            self.cpu.wake(p).await;
            if cold > 0.0 {
                tokio::time::sleep(self.cpu.us(cold)).await;
            }
        }
        let r = tokio::join!(t, self.copy(bytes, writes)).0;
        if let Some(p) = &owner {
            self.cpu.touch(p);
        }
        self.cpu.wake(&me).await;
        r
    }

    /// A copy of `bytes` within this host (pre-generated outputs copied into place).
    pub async fn copy_here(&self, bytes: u64) {
        let w = self.cpu.work(bytes, self.cpu.spec().copy_ns_per_byte);
        self.checks(w).await;
    }

    /// Work of the stages' CPU pool, below the data plane ([`Priority::Checks`]), on one of
    /// the pool's threads once one is free.
    async fn checks(&self, work: Duration) {
        if work.is_zero() {
            return;
        }
        // The pool is never closed, so acquiring fails only if it were.
        let _thread = match &self.pool {
            Some(p) => p.acquire().await.ok(),
            None => None,
        };
        self.host.run_as(work, 1, Priority::Checks).await
    }
}

/// This machine's costs, measured by [`calibrate`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Calibration {
    pub generate_ns_per_byte: f64,
    pub digest_ns_per_byte: f64,
    /// A bulk copy over one socket on 127.0.0.1 in 1 MiB writes, a writer and a reader
    /// thread, wall time per byte: the `cpu:` section's `copy_ns_per_byte`.
    pub copy_ns_per_byte: f64,
    /// The same bytes on the tcp engine's default streams in its default slices, a writer
    /// and a reader thread a socket, for the record. It is not charged: on two cores it
    /// matched the pipeline's bulk KV rate, but on 16 it is 3x the engine's own, whose
    /// streams do not get a thread each (docs/sim.md, session 27).
    pub copy_streams_ns_per_byte: f64,
    /// Streams and slice size `copy_streams_ns_per_byte` was measured with.
    pub copy_streams: usize,
    pub copy_slice_bytes: u64,
    /// The engine's own bulk transfer to a peer process ([`EngineCopySample`]): a side's CPU
    /// time per byte (half of both processes'), and the threads a side kept busy while the
    /// bytes moved; 0 until measured ([`Calibration::with_engine_copy`]). Printed in the
    /// `cpu:` section's comments, not charged: `ci/sim-validate-tcp.sh`'s fabric G charges it.
    pub engine_copy_ns_per_byte: f64,
    pub engine_copy_threads: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_copy_from: Option<EngineCopySample>,
    /// What each copying thread itself spent on a CPU per byte (Linux), over one stream, for
    /// the record.
    pub copy_thread_cpu_ns_per_byte: Option<f64>,
    /// The decode stage's KV check over one plain buffer, block by block (each block that
    /// arrived digested, each expected block generated and digested), and the block size: a
    /// record beside the bulk rates (a charge of generate + 2 x digest).
    pub kv_verify_ns_per_byte: f64,
    /// The same check over the same number of bytes landed in an engine's registered buffer
    /// in the decode stage's pool layout (per layer K then V, each block read through
    /// `Buffer::view`, as the stage reads it): memory, layout and leases included. Printed
    /// as the `cpu:` section's `kv_check_ns_per_byte`, the KV hop's charge.
    pub kv_verify_pool_ns_per_byte: f64,
    pub kv_block_bytes: u64,
    pub message_us: f64,
    /// A cold transfer's cost per write beyond its first ([`CpuSpec::cold_write_us`]),
    /// fitted by [`Calibration::with_writes`]; 0 until measured.
    pub cold_write_us: f64,
    /// A write's own cost in a batch ([`CpuSpec::write_us`]), fitted by
    /// [`Calibration::with_writes`] from `writes_from`; 0 until measured.
    pub write_us: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub writes_from: Option<BatchSample>,
    /// Control round trip over TCP on 127.0.0.1, median, microseconds.
    pub round_trip_us: f64,
    /// A parked process's wake-up (see [`CpuSpec::wake_us`]); 0 until measured
    /// ([`Calibration::with_wake`]).
    pub wake_us: f64,
    /// What it was measured from: an engine's 4 KiB write to a peer process back to back and
    /// after a pause, p50s (microseconds), and the pause.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wake_from: Option<WakeSample>,
    /// The wake by time parked ([`CpuSpec::wake_after`]), one point per pause measured
    /// ([`Calibration::with_wake_after`]); empty until measured.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub wake_after: Vec<WakePoint>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub wake_after_from: Vec<WakeSample>,
    /// The whole-tensor check's rate and its cost beyond its bytes
    /// ([`CpuSpec::check_ns_per_byte`], [`CpuSpec::check_us`]), fitted by
    /// [`Calibration::with_checks`] from `checks`; unset until measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub check_ns_per_byte: Option<f64>,
    pub check_us: f64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub checks: Vec<CheckSample>,
    /// The packet's decode at the fence ([`CpuSpec::packet_us`],
    /// [`CpuSpec::packet_entry_us`]), fitted by [`Calibration::with_packets`] from
    /// `packets`; 0 until measured.
    pub packet_us: f64,
    pub packet_entry_us: f64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub packets: Vec<PacketSample>,
    /// Cores this process may use.
    pub cores: u32,
    /// Bytes each throughput was measured over, and the round trips timed.
    pub bytes: u64,
    pub round_trips: u32,
}

/// Time on a CPU so far, ns, from a Linux schedstat file (its first field); None where
/// there is none.
fn schedstat_ns(path: impl AsRef<std::path::Path>) -> Option<u64> {
    let t = std::fs::read_to_string(path).ok()?;
    t.split_whitespace().next()?.parse().ok()
}

/// This thread's time on a CPU so far (Linux's schedstat), ns; None elsewhere.
fn thread_cpu_ns() -> Option<f64> {
    schedstat_ns("/proc/thread-self/schedstat").map(|ns| ns as f64)
}

/// CPU time every thread of process `pid` has run so far, in ns: the sum of its threads'
/// schedstat (nanosecond resolution, where /proc/PID/stat counts 10 ms ticks). None where
/// there is no schedstat (not Linux, or the process is gone). A thread that exits between
/// two readings takes its time with it, so callers read around work done by long-lived
/// threads (an engine's runtime and streams).
pub fn process_cpu_ns(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    // a thread that exited since the listing has nothing left to read: skipped
    Some(
        tasks
            .flatten()
            .filter_map(|t| schedstat_ns(t.path().join("schedstat")))
            .sum(),
    )
}

/// The median of three runs of `f`, in ns (one run is at the mercy of a busy machine).
fn timed(mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..3)
        .map(|_| {
            let t0 = std::time::Instant::now();
            f();
            t0.elapsed().as_nanos() as f64
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[1]
}

/// Measures, on this machine, what the host model charges: generating fixture bytes (the
/// stubs' generator), XXH3-128 over bytes, a TCP copy over 127.0.0.1 (one socket, wall time
/// per byte a side's cost; on the tcp engine's streams and slices kept for the record) and
/// a small control frame's round trip (a round trip is two messages, each costing its
/// sender and its receiver: `message_us` = round trip / 4). `bytes` per throughput.
pub fn calibrate(bytes: u64, round_trips: u32) -> std::io::Result<Calibration> {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    let bytes = bytes.max(1 << 16) & !1;
    let spec = omnirig_fixtures::TensorSpec::new(
        "calibrate",
        omnirig_fixtures::DType::BF16,
        vec![bytes / 2],
        omnirig_fixtures::ValueRange::Any,
    )
    .map_err(io)?;
    let generator = omnirig_fixtures::TensorGenerator::new(1, &spec);
    let mut buf = vec![0u8; bytes as usize];
    let mut failed = None;
    let generate = timed(|| {
        if let Err(e) = generator.fill_bytes(0, &mut buf) {
            failed = Some(e);
        }
    });
    if let Some(e) = failed {
        return Err(io(e));
    }
    let mut sink = 0u8;
    let digest = timed(|| {
        sink ^= omnirig_fixtures::Digest128::of_bytes(std::hint::black_box(&buf))
            .to_hex()
            .as_bytes()[0];
    });
    // The decode stage's KV check, as it runs it: the blocks that arrived digested one by one,
    // the expected blocks generated and digested one by one (Qwen3-Omni's thinker block).
    let t = omnirig_fixtures::ModelCard::qwen3_omni().thinker;
    let kv_block_bytes = omnirig_fixtures::ShapeOptions::default().block_tokens
        * u64::from(t.num_kv_heads)
        * t.head_dim
        * t.kv_dtype.size_bytes() as u64;
    // the expected blocks in the generator's elements, so both sides cut the same bytes
    let kv_block_elements = kv_block_bytes / generator.dtype().size_bytes() as u64;
    let mut matched = true;
    let kv_verify = timed(|| {
        let got = omnirig_fixtures::digest::block_digests_of_bytes(
            std::hint::black_box(&buf),
            kv_block_bytes as usize,
        );
        match omnirig_fixtures::block_digests(&generator, kv_block_elements) {
            Ok(want) => matched &= want == got,
            Err(e) => failed = Some(e),
        }
    });
    if let Some(e) = failed {
        return Err(io(e));
    }
    let kv_verify_pool = kv_check_in_pool(bytes, kv_block_bytes, generator.dtype())?;
    // the same generator made `buf`: a check that finds a difference is not the stage's check
    if !matched {
        return Err(std::io::Error::other(
            "calibration: the KV check found blocks that differ from what was generated",
        ));
    }
    std::hint::black_box(sink);

    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut chunk = vec![0u8; 1 << 20];
        // Three bulk copies (answering each with the CPU time it took this side), then echo
        // frames back.
        for _ in 0..3 {
            let c0 = thread_cpu_ns();
            let mut left = bytes;
            while left > 0 {
                let n = s.read(&mut chunk[..(left.min(1 << 20)) as usize])?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                left -= n as u64;
            }
            let spent = c0.zip(thread_cpu_ns()).map_or(-1.0, |(a, b)| b - a);
            s.write_all(&spent.to_le_bytes())?;
        }
        let mut frame = [0u8; 68];
        loop {
            match s.read_exact(&mut frame) {
                Ok(()) => s.write_all(&frame)?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    // A copy's cost per side is its wall time per byte: the two threads' own CPU time
    // (kept for the record) misses the loopback's receive processing, which the kernel does
    // in softirq context, charged to neither; predictions made with it came out 30-70% low
    // (docs/sim.md).
    let mut copies = Vec::new();
    let mut threads = Vec::new();
    for _ in 0..3 {
        let t0 = std::time::Instant::now();
        let c0 = thread_cpu_ns();
        for c in buf.chunks(1 << 20) {
            s.write_all(c)?;
        }
        let sent = c0.zip(thread_cpu_ns()).map(|(a, b)| b - a);
        let mut ack = [0u8; 8];
        s.read_exact(&mut ack)?;
        let received = f64::from_le_bytes(ack);
        let wall = t0.elapsed().as_nanos() as f64;
        if let Some(x) = sent.filter(|_| received >= 0.0) {
            threads.push((x + received) / 2.0);
        }
        copies.push(wall);
    }
    threads.sort_by(f64::total_cmp);
    copies.sort_by(f64::total_cmp);
    let mut rtts = Vec::with_capacity(round_trips as usize);
    let mut frame = [7u8; 68];
    for _ in 0..round_trips.max(1) {
        let t0 = std::time::Instant::now();
        s.write_all(&frame)?;
        s.read_exact(&mut frame)?;
        rtts.push(t0.elapsed().as_nanos() as f64);
    }
    drop(s);
    reader
        .join()
        .map_err(|_| std::io::Error::other("calibration reader panicked"))??;
    rtts.sort_by(f64::total_cmp);
    let rtt_us = rtts[rtts.len() / 2] / 1e3;
    let per = |ns: f64| ns / bytes as f64;
    let tcp = omnirig_transports::TcpConfig::default();
    Ok(Calibration {
        generate_ns_per_byte: per(generate),
        digest_ns_per_byte: per(digest),
        copy_ns_per_byte: per(copies[1]),
        copy_streams_ns_per_byte: per(copy_on_streams(&buf, tcp.streams, tcp.slice_size)?),
        copy_streams: tcp.streams,
        copy_slice_bytes: tcp.slice_size,
        copy_thread_cpu_ns_per_byte: threads.get(threads.len() / 2).map(|&x| per(x)),
        kv_verify_ns_per_byte: per(kv_verify),
        kv_verify_pool_ns_per_byte: kv_verify_pool,
        kv_block_bytes,
        message_us: rtt_us / 4.0,
        round_trip_us: rtt_us,
        wake_us: 0.0,
        wake_from: None,
        wake_after: Vec::new(),
        wake_after_from: Vec::new(),
        check_ns_per_byte: None,
        check_us: 0.0,
        checks: Vec::new(),
        packet_us: 0.0,
        packet_entry_us: 0.0,
        packets: Vec::new(),
        write_us: 0.0,
        cold_write_us: 0.0,
        writes_from: None,
        engine_copy_ns_per_byte: 0.0,
        engine_copy_threads: 0.0,
        engine_copy_from: None,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        bytes,
        round_trips: round_trips.max(1),
    })
}

/// `buf` copied over 127.0.0.1 on `streams` sockets at once in writes of `slice` bytes,
/// each socket's share by a writer thread into a reader thread, as the tcp engine spreads a
/// transfer's slices over its streams: wall time from the first write to the last byte read,
/// the median of three, in ns.
fn copy_on_streams(buf: &[u8], streams: usize, slice: u64) -> std::io::Result<f64> {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    let streams = streams.max(1);
    let slice = (slice.max(1) as usize).min(buf.len().max(1));
    let share = buf.len().div_ceil(streams);
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut pairs = Vec::with_capacity(streams);
    for _ in 0..streams {
        let out = TcpStream::connect(addr)?;
        let (inbound, _) = listener.accept()?;
        out.set_nodelay(true)?;
        inbound.set_nodelay(true)?;
        pairs.push((out, inbound));
    }
    let mut failed = None;
    let copy = timed(|| {
        let r = std::thread::scope(|scope| -> std::io::Result<()> {
            let mut joins = Vec::with_capacity(2 * streams);
            for ((out, inbound), part) in pairs.iter_mut().zip(buf.chunks(share)) {
                let want = part.len();
                joins.push(scope.spawn(move || -> std::io::Result<()> {
                    part.chunks(slice).try_for_each(|c| out.write_all(c))
                }));
                joins.push(scope.spawn(move || -> std::io::Result<()> {
                    let mut chunk = vec![0u8; slice];
                    let mut left = want;
                    while left > 0 {
                        let n = inbound.read(&mut chunk[..left.min(slice)])?;
                        if n == 0 {
                            return Err(std::io::ErrorKind::UnexpectedEof.into());
                        }
                        left -= n;
                    }
                    Ok(())
                }));
            }
            joins.into_iter().try_for_each(|j| {
                j.join()
                    .map_err(|_| std::io::Error::other("calibration copy thread panicked"))?
            })
        });
        if let Err(e) = r {
            failed = Some(e);
        }
    });
    match failed {
        Some(e) => Err(e),
        None => Ok(copy),
    }
}

/// The decode stage's KV check as the stage runs it, in ns per byte: about `bytes` of KV
/// blocks landed in an engine buffer laid out as the stage's pool (per layer, K then V, each
/// a run of blocks in a pool twice the size), each block read through `Buffer::view` and
/// digested, each tensor's expected blocks generated and digested; the median of three.
fn kv_check_in_pool(
    bytes: u64,
    block_bytes: u64,
    dtype: omnirig_fixtures::DType,
) -> std::io::Result<f64> {
    use omnirig_transports::{Engine, EngineConfig, InProcessStore, TransportKind};
    let layers = omnirig_fixtures::ModelCard::qwen3_omni().thinker.num_layers;
    let blocks = (bytes / (u64::from(layers) * 2 * block_bytes)).max(1);
    let geo = crate::kv::KvGeometry {
        num_layers: layers,
        capacity: (blocks * 2) as u32,
        block_bytes,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let engine = rt
        .block_on(Engine::new(
            EngineConfig::for_kind("calibrate-kv", TransportKind::Loopback)
                .store(InProcessStore::new()),
        ))
        .map_err(io)?;
    let pool = engine.allocate(geo.buffer_bytes()).map_err(io)?;
    let elements = blocks * block_bytes / dtype.size_bytes() as u64;
    let generators: Vec<_> = (0..layers * 2)
        .map(|t| {
            omnirig_fixtures::TensorSpec::new(
                "calibrate-kv",
                dtype,
                vec![elements],
                omnirig_fixtures::ValueRange::Any,
            )
            .map(|spec| omnirig_fixtures::TensorGenerator::new(u64::from(t) + 7, &spec))
            .map_err(io)
        })
        .collect::<std::io::Result<_>>()?;
    // what landed: each tensor's blocks where the stage's pool keeps them
    for (t, g) in generators.iter().enumerate() {
        let bytes = g.generate();
        for b in 0..blocks {
            let at = (b * block_bytes) as usize;
            let off = geo.offset(t as u32 / 2, t % 2 == 1, b as u32);
            pool.write(off, &bytes[at..at + block_bytes as usize])
                .map_err(io)?;
        }
    }
    let block_elements = block_bytes / dtype.size_bytes() as u64;
    let mut runs = Vec::new();
    for _ in 0..3 {
        let t0 = std::time::Instant::now();
        for (t, g) in generators.iter().enumerate() {
            let got = (0..blocks)
                .map(|b| {
                    let off = geo.offset(t as u32 / 2, t % 2 == 1, b as u32);
                    pool.view(off, block_bytes, omnirig_fixtures::Digest128::of_bytes)
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(io)?;
            let want = omnirig_fixtures::block_digests(g, block_elements).map_err(io)?;
            if want != got {
                return Err(std::io::Error::other(
                    "calibration: the KV check in the pool found blocks that differ",
                ));
            }
        }
        runs.push(t0.elapsed().as_nanos() as f64);
    }
    runs.sort_by(f64::total_cmp);
    Ok(runs[1] / (u64::from(layers) * 2 * blocks * block_bytes) as f64)
}

/// A whole inbound tensor's check as the stage runs it ([`omnirig_model_stubs::Stub::check_input`]:
/// length, digest against the expected one generated, byte compare against a fresh
/// generation), timed on every golden case's byte-compared inputs (at most
/// [`omnirig_model_stubs::BYTE_COMPARE_MAX`], KV excluded), produced by the upstream stub.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckSample {
    pub tensor: String,
    pub bytes: u64,
    /// Back to back, median of the repeats, microseconds.
    pub hot_us: f64,
    /// Each check after a pause of `gap_us` (the consumer parked while the bytes came),
    /// median of the repeats, microseconds.
    pub cold_us: f64,
    pub gap_us: u64,
}

/// Tensors whose checks give the check's rate ([`Calibration::with_checks`]).
pub const CHECK_RATE_MIN_BYTES: u64 = 64 << 10;
/// Tensors whose checks give its fixed cost.
pub const CHECK_FIXED_MAX_BYTES: u64 = 16 << 10;

/// Times the stubs' whole-tensor check (see [`CheckSample`]), `repeats` times each way.
pub fn measure_checks(
    repeats: usize,
    gap: std::time::Duration,
) -> std::io::Result<Vec<CheckSample>> {
    use omnirig_model_stubs::{BYTE_COMPARE_MAX, ComputeTime, Stub};
    let repeats = repeats.max(1);
    let mut out = Vec::new();
    for (case, plan) in golden_plans()? {
        for hop in hops_but_kv(&plan) {
            let up = Stub::new(hop.source, ComputeTime::default());
            let down = Stub::new(hop.target, ComputeTime::default());
            for t in hop
                .tensors
                .iter()
                .filter(|t| t.byte_length <= BYTE_COMPARE_MAX)
            {
                let mut bytes = vec![0u8; t.byte_length as usize];
                up.produce(&plan, t, 0, &mut bytes).map_err(io)?;
                let once = || -> std::io::Result<f64> {
                    let t0 = std::time::Instant::now();
                    down.check_input(&plan, &t.name, std::hint::black_box(&bytes))
                        .map_err(io)?;
                    Ok(t0.elapsed().as_nanos() as f64 / 1e3)
                };
                let (hot_us, cold_us) = hot_and_cold(repeats, gap, once)?;
                out.push(CheckSample {
                    tensor: format!("{case}/{}/{}", hop.payload_kind, t.name),
                    bytes: t.byte_length,
                    hot_us,
                    cold_us,
                    gap_us: gap.as_micros() as u64,
                });
            }
        }
    }
    Ok(out)
}

/// The packet connector's consumer decoding a golden case's packet for one hop (see
/// [`measure_packets`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PacketSample {
    /// `case/hop`.
    pub packet: String,
    pub entries: usize,
    pub bytes: usize,
    /// Back to back, median of the repeats, microseconds.
    pub hot_us: f64,
    /// Each after a pause of `gap_us`, median of the repeats, microseconds.
    pub cold_us: f64,
    pub gap_us: u64,
}

/// Times the packet connector consumer's decode of the packet (`Packet::from_msgpack`, then
/// each of the hop's tensors looked up in it, as the consumer checks it) for every golden
/// case's hops but KV, `repeats` times back to back and after `gap` each.
pub fn measure_packets(
    repeats: usize,
    gap: std::time::Duration,
) -> std::io::Result<Vec<PacketSample>> {
    use omnirig_fixtures::{Digest128, Packet, TensorEntry};
    let repeats = repeats.max(1);
    let mut out = Vec::new();
    for (case, plan) in golden_plans()? {
        for hop in hops_but_kv(&plan) {
            let entries = hop
                .tensors
                .iter()
                .map(|t| TensorEntry {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    byte_length: t.byte_length,
                    digest: Digest128::of_bytes(t.name.as_bytes()),
                    transfer_key: None,
                })
                .collect();
            let rid = format!("000-{case}");
            let bytes = Packet::new(rid, hop.payload_kind, 0, true, entries)
                .to_msgpack()
                .map_err(io)?;
            let once = || -> std::io::Result<f64> {
                let t0 = std::time::Instant::now();
                let p = Packet::from_msgpack(std::hint::black_box(&bytes)).map_err(io)?;
                for t in &hop.tensors {
                    std::hint::black_box(p.entry(&t.name).map(|e| e.digest));
                }
                Ok(t0.elapsed().as_nanos() as f64 / 1e3)
            };
            let (hot_us, cold_us) = hot_and_cold(repeats, gap, once)?;
            out.push(PacketSample {
                packet: format!("{case}/{}", hop.payload_kind),
                entries: hop.tensors.len(),
                bytes: bytes.len(),
                hot_us,
                cold_us,
                gap_us: gap.as_micros() as u64,
            });
        }
    }
    Ok(out)
}

/// Every golden case's plan (default shapes), by case name: what the calibrations time.
fn golden_plans() -> std::io::Result<Vec<(String, omnirig_fixtures::RequestPlan)>> {
    use omnirig_fixtures::{ModelCard, ShapeOptions, golden_cases, plan_request};
    let card = ModelCard::qwen3_omni();
    golden_cases()
        .into_iter()
        .map(|case| {
            let plan = plan_request(&card, &case.request, &ShapeOptions::default()).map_err(io)?;
            Ok((case.name, plan))
        })
        .collect()
}

/// A plan's hops but KV (whose check and messages are of their own).
fn hops_but_kv(
    plan: &omnirig_fixtures::RequestPlan,
) -> impl Iterator<Item = &omnirig_fixtures::Hop> {
    plan.hops
        .iter()
        .filter(|h| h.payload_kind != omnirig_fixtures::PayloadKind::KvCache)
}

/// A calibration's error as an I/O error (what `--calibrate-cpu` reports).
fn io(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// `once` (which times itself, in us) once to warm up, then `repeats` times back to back
/// and `repeats` times each after a pause of `gap`: the two medians.
fn hot_and_cold(
    repeats: usize,
    gap: std::time::Duration,
    once: impl Fn() -> std::io::Result<f64>,
) -> std::io::Result<(f64, f64)> {
    once()?;
    let mut hot = (0..repeats)
        .map(|_| once())
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut cold = (0..repeats)
        .map(|_| {
            std::thread::sleep(gap);
            once()
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    Ok((median_of(&mut hot), median_of(&mut cold)))
}

/// The median of `v` (the upper one of an even count); 0 for none.
fn median_of(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// An engine write's round trip to a peer process, hot and cold (the wake's measurement).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WakeSample {
    /// Back to back: both sides busy-polling, p50 us (median of the repeats).
    pub hot_us: f64,
    /// After `gap_us` of nothing: both sides parked, p50 us (median of the repeats).
    pub cold_us: f64,
    pub gap_us: u64,
    pub repeats: usize,
}

/// An engine's transfer of `batch` writes of `size` bytes to a peer process against one
/// write of the same size, back to back (the per-write cost's measurement).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchSample {
    pub size: u64,
    pub batch: usize,
    /// One write, p50 us (median of the repeats).
    pub single_us: f64,
    /// The batch, p50 us (median of the repeats).
    pub batch_us: f64,
    /// One write and the batch after `cold_gap_us` of pause, p50 us (medians of the
    /// repeats), where measured: what [`CpuSpec::cold_write_us`] is read from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cold_single_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cold_batch_us: Option<f64>,
    pub cold_gap_us: u64,
    pub repeats: usize,
}

/// An engine's bulk transfer of `batch` writes of `size` bytes to a peer process, back to
/// back (`bench transfer`'s tcp write): its wall time and the CPU time both processes spent
/// on it, per byte moved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineCopySample {
    pub size: u64,
    pub batch: usize,
    /// The transfer, p50 us (median of the repeats).
    pub wall_us: f64,
    /// Both processes' CPU time per byte, sender and receiver together, and the cores they
    /// kept busy over the whole timing (medians of the repeats).
    pub cpu_ns_per_byte: f64,
    pub cpu_cores: f64,
    pub repeats: usize,
}

impl Calibration {
    /// Sets the engine's copy from its bulk transfer: each side (sender, receiver) spends
    /// half the CPU time and keeps half the busy cores. The batch's per-write costs
    /// (`write_us` each) are left in: for 8 writes of 16 MiB they are under 1% of it.
    pub fn with_engine_copy(mut self, e: EngineCopySample) -> Self {
        self.engine_copy_ns_per_byte = (e.cpu_ns_per_byte / 2.0).max(0.0);
        self.engine_copy_threads = (e.cpu_cores / 2.0).max(0.0);
        self.engine_copy_from = Some(e);
        self
    }

    /// Sets a write's own cost from a batch against one write: each write beyond the first
    /// adds (batch - single) / (batch size - 1).
    /// Where the batch and one write were also timed after a pause, each write beyond the
    /// first pays what the pause added to the batch beyond what it added to one write (the
    /// wakes), spread over those writes: `cold_write_us`.
    pub fn with_writes(mut self, b: BatchSample) -> Self {
        let beyond = b.batch.saturating_sub(1) as f64;
        (self.write_us, self.cold_write_us) = if beyond > 0.0 {
            let cold = match (b.cold_single_us, b.cold_batch_us) {
                (Some(one), Some(all)) => {
                    (((all - b.batch_us) - (one - b.single_us)) / beyond).max(0.0)
                }
                _ => 0.0,
            };
            (((b.batch_us - b.single_us) / beyond).max(0.0), cold)
        } else {
            (0.0, 0.0)
        };
        self.writes_from = Some(b);
        self
    }

    /// Sets the wake from a hot and a cold round trip: a cold one wakes two parked processes
    /// (the owner for the write, the initiator for its acknowledgement), so each wake is
    /// half the difference.
    pub fn with_wake(mut self, w: WakeSample) -> Self {
        self.wake_us = ((w.cold_us - w.hot_us) / 2.0).max(0.0);
        self.wake_from = Some(w);
        self
    }

    /// Sets the wake by time parked from cold round trips after several pauses (each
    /// against its back-to-back figure), one point per pause, in the order of the pauses;
    /// a point below the one before it is raised to it (a deeper park does not wake sooner;
    /// the difference is noise).
    pub fn with_wake_after(mut self, mut samples: Vec<WakeSample>) -> Self {
        samples.sort_by_key(|w| w.gap_us);
        let mut floor = 0.0f64;
        self.wake_after = samples
            .iter()
            .map(|w| {
                floor = floor.max(((w.cold_us - w.hot_us) / 2.0).max(0.0));
                WakePoint {
                    idle_us: w.gap_us as f64,
                    wake_us: floor,
                }
            })
            .collect();
        self.wake_after_from = samples;
        self
    }

    /// Sets the whole-tensor check from [`measure_checks`]' samples: its rate is the median
    /// over tensors of at least [`CHECK_RATE_MIN_BYTES`] of the back-to-back time per byte
    /// (where the fixed part is lost in the bytes), its fixed cost the median over tensors
    /// of at most [`CHECK_FIXED_MAX_BYTES`] of the time after a pause less their bytes at
    /// that rate (a pipeline's consumer checks what arrived after parking for it).
    pub fn with_checks(mut self, samples: Vec<CheckSample>) -> Self {
        let median = |mut v: Vec<f64>| -> Option<f64> {
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied()
        };
        let rate = median(
            samples
                .iter()
                .filter(|c| c.bytes >= CHECK_RATE_MIN_BYTES)
                .map(|c| c.hot_us * 1e3 / c.bytes as f64)
                .collect(),
        );
        self.check_ns_per_byte = rate;
        self.check_us = rate
            .and_then(|r| {
                median(
                    samples
                        .iter()
                        .filter(|c| c.bytes <= CHECK_FIXED_MAX_BYTES)
                        .map(|c| (c.cold_us - c.bytes as f64 * r / 1e3).max(0.0))
                        .collect(),
                )
            })
            .unwrap_or(0.0);
        self.checks = samples;
        self
    }

    /// Sets the packet's decode from [`measure_packets`]' samples, after the pause (the
    /// consumer parked for the bytes): the median of the packets with the fewest entries and
    /// of those with the most give a line, its slope per entry and the rest per packet (both
    /// at least 0); all of one size, the median is per packet.
    pub fn with_packets(mut self, samples: Vec<PacketSample>) -> Self {
        let at = |n: usize| {
            let mut v: Vec<f64> = samples
                .iter()
                .filter(|p| p.entries == n)
                .map(|p| p.cold_us)
                .collect();
            median_of(&mut v)
        };
        let (few, most) = (
            samples.iter().map(|p| p.entries).min(),
            samples.iter().map(|p| p.entries).max(),
        );
        (self.packet_us, self.packet_entry_us) = match (few, most) {
            (Some(a), Some(b)) if b > a => {
                let per = ((at(b) - at(a)) / (b - a) as f64).max(0.0);
                ((at(a) - per * a as f64).max(0.0), per)
            }
            (Some(a), _) => (at(a), 0.0),
            _ => (0.0, 0.0),
        };
        self.packets = samples;
        self
    }

    /// The `cpu:` section of a fabric file, every fabric node in `nodes` on one host with
    /// this machine's cores (as `omnirig run --processes` places its stage processes).
    pub fn cpu_yaml(&self, nodes: &[&str]) -> String {
        let gbs = |ns: f64| if ns > 0.0 { 1.0 / ns } else { 0.0 };
        let mut y = format!(
            "# Measured by `omnirig simulate --calibrate-cpu` over {} MiB and {} round trips:\n\
             # generate {:.2} GB/s, XXH3-128 {:.2} GB/s, tcp copy {:.2} GB/s (on {} streams of {} KiB\n\
             # writes: {:.2} GB/s), round trip {:.1} us.\n\
             cpu:\n  generate_ns_per_byte: {:.4}\n  digest_ns_per_byte: {:.4}\n  copy_ns_per_byte: {:.4}\n  message_us: {:.2}\n\
             \x20 # the KV check ({} KiB blocks): {:.4} ns/B over one buffer, as the stage runs it in its pool:\n  kv_check_ns_per_byte: {:.4}\n",
            self.bytes >> 20,
            self.round_trips,
            gbs(self.generate_ns_per_byte),
            gbs(self.digest_ns_per_byte),
            gbs(self.copy_ns_per_byte),
            self.copy_streams,
            self.copy_slice_bytes >> 10,
            gbs(self.copy_streams_ns_per_byte),
            self.round_trip_us,
            self.generate_ns_per_byte,
            self.digest_ns_per_byte,
            self.copy_ns_per_byte,
            self.message_us,
            self.kv_block_bytes >> 10,
            self.kv_verify_ns_per_byte,
            self.kv_verify_pool_ns_per_byte,
        );
        if let Some(r) = self.check_ns_per_byte {
            let pause = self.checks.first().map_or(0, |c| c.gap_us / 1000);
            y += &format!(
                "  # the stubs' check of a whole tensor up to 4 MiB, {} tensors: per byte back to back,\n\
                 \x20 # and beyond its bytes after {pause} ms idle:\n  check_ns_per_byte: {r:.4}\n  check_us: {:.1}\n",
                self.checks.len(),
                self.check_us,
            );
        }
        if !self.packets.is_empty() {
            let pause = self.packets[0].gap_us / 1000;
            y += &format!(
                "  # a packet's decode at the fence, {} packets of 1 to {} entries after {pause} ms idle:\n  packet_us: {:.1}\n  packet_entry_us: {:.2}\n",
                self.packets.len(),
                self.packets.iter().map(|p| p.entries).max().unwrap_or(0),
                self.packet_us,
                self.packet_entry_us,
            );
        }
        if let Some(b) = &self.writes_from {
            y += &format!(
                "  # an engine's {} writes of {} KiB in one transfer: {:.1} us, one: {:.1} us\n  write_us: {:.2}\n",
                b.batch,
                b.size >> 10,
                b.batch_us,
                b.single_us,
                self.write_us,
            );
            if let (Some(one), Some(all)) = (b.cold_single_us, b.cold_batch_us) {
                y += &format!(
                    "  # the same batch and one write after {} ms idle: {:.1} us, {:.1} us
  cold_write_us: {:.2}
",
                    b.cold_gap_us / 1000,
                    all,
                    one,
                    self.cold_write_us,
                );
            }
        }
        if let Some(e) = &self.engine_copy_from {
            y += &format!(
                "  # an engine's {} writes of {} MiB in one transfer: {:.2} ms, both processes' CPU\n\
                 \x20 # {:.4} ns a byte: a side's copy {:.4} ns/B on {:.2} threads (not charged)\n",
                e.batch,
                e.size >> 20,
                e.wall_us / 1e3,
                e.cpu_ns_per_byte,
                self.engine_copy_ns_per_byte,
                self.engine_copy_threads,
            );
        }
        if let Some(w) = &self.wake_from {
            y += &format!(
                "  # an engine's 4 KiB write to a peer process: {:.1} us back to back, {:.1} us after {} ms idle\n  wake_us: {:.1}\n",
                w.hot_us,
                w.cold_us,
                w.gap_us / 1000,
                self.wake_us,
            );
        }
        if !self.wake_after.is_empty() {
            y += "  # the same write after longer and shorter pauses (back to back, cold, us):\n";
            for w in &self.wake_after_from {
                y += &format!(
                    "  #   {} ms: {:.1}, {:.1}\n",
                    w.gap_us as f64 / 1000.0,
                    w.hot_us,
                    w.cold_us
                );
            }
            y += "  wake_after:\n";
            for p in &self.wake_after {
                y += &format!(
                    "    - {{ idle_us: {}, wake_us: {:.1} }}\n",
                    p.idle_us, p.wake_us
                );
            }
        }
        if !nodes.is_empty() {
            y += &format!(
                "  hosts:\n    - {{ name: localhost, cores: {}, nodes: [{}] }}\n",
                self.cores,
                nodes.join(", ")
            );
        }
        y
    }
}
