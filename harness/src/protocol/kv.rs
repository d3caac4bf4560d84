//! The KV connector (Thinker prefill -> Thinker decode) as two I/O-free state machines,
//! in the style of the stage-packet connector ([`super::PacketConsumer`]).
//!
//! The protocol, consumer (decode) driven:
//! 1. prefill -> decode `Offer` (its KV blocks are filled; with a credit already
//!    granted it leaves with step 4's message, see [`super::HeldOffer`]);
//! 2. decode looks up its prefix cache and allocates the missing tail; it grants each
//!    contiguous run of tail blocks per layer and K/V: `KvReserve` (blocks before
//!    `first_block` were a prefix hit and do not move);
//! 3. prefill writes every run contiguous on both sides as one request;
//! 4. only once every write completed: prefill -> decode `Finish`, or `Error` naming the
//!    blocks whose write failed;
//! 5. decode revokes its grants (the fence), then verifies every block the stage will use.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use omnirig_fixtures::{KvLayout, PayloadKind};
use omnirig_transports::Grant;

use super::{Credit, HandoffTimes, HeldOffer, bad_reply, micros_since};
use crate::control::Msg;
use crate::error::{Cause, Classified, FailureKind, HarnessError};
use crate::kv::{KvGrant, KvReservation, KvWrite, contiguous_runs, plan_kv_writes};

/// The tensor name of layer `layer`'s K (`v == false`) or V.
pub fn kv_tensor(layer: u32, v: bool) -> String {
    if v {
        KvLayout::v_name(layer)
    } else {
        KvLayout::k_name(layer)
    }
}

/// One grant decode makes: `len` blocks from block id `block` of layer `layer`'s K/V,
/// covering tail blocks `start..start+len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantRun {
    pub layer: u32,
    pub v: bool,
    pub start: u32,
    pub block: u32,
    pub len: u32,
}

// ---------------------------------------------------------------- consumer

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvConsumerState {
    AwaitOffer,
    /// Offer seen; the driver looks up the prefix and allocates the tail.
    Reserving,
    /// Blocks known; the driver grants the runs.
    Granting,
    /// Reservation sent; waiting for FINISH (the deadline runs).
    Granted,
    /// FINISH accepted; waiting for the driver's verification of every block.
    Verifying,
    Done,
    Failed,
}

/// What the KV consumer asks its driver to do.
// Actions are queued and taken one at a time; most carry a message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum KvConsumerAction {
    /// Look up the prefix cache and allocate the rest, then call
    /// [`KvConsumer::blocks`] or [`KvConsumer::reserve_failed`].
    Reserve,
    /// Grant each run (in order), then call [`KvConsumer::granted`].
    Grant(Vec<GrantRun>),
    Send(Msg),
    /// Revoke these grants now: no byte may land after this.
    Revoke(Vec<Grant>),
    /// Verify every block the stage will use (reused ones included), then call
    /// [`KvConsumer::verified`].
    Verify,
    Done,
    Failed(HarnessError),
}

/// Decode's end of one request's KV hop.
#[derive(Debug)]
pub struct KvConsumer {
    kind: PayloadKind,
    rid: String,
    num_layers: u32,
    num_blocks: u64,
    timeout: Duration,
    state: KvConsumerState,
    deadline: Option<Instant>,
    first_block: u32,
    tail: Vec<u32>,
    runs: Vec<GrantRun>,
    grants: Vec<Grant>,
    stale: usize,
    credit: Credit,
    times: HandoffTimes,
    actions: VecDeque<KvConsumerAction>,
}

impl KvConsumer {
    pub fn new(
        kind: PayloadKind,
        rid: &str,
        num_layers: u32,
        num_blocks: u64,
        timeout: Duration,
    ) -> Self {
        Self {
            kind,
            rid: rid.into(),
            num_layers,
            num_blocks,
            timeout,
            state: KvConsumerState::AwaitOffer,
            deadline: None,
            first_block: 0,
            tail: vec![],
            runs: vec![],
            grants: vec![],
            stale: 0,
            credit: Credit::default(),
            times: HandoffTimes::default(),
            actions: VecDeque::new(),
        }
    }

    /// Reserves and grants ahead of the offer (a [`Credit`]); the offer then marks the
    /// handoff's start. Without it within `offer_timeout` of the grant, the credit is
    /// revoked, prefill told, and the handoff fails.
    pub fn credit(&mut self, now: Instant, offer_timeout: Duration) {
        if self.state == KvConsumerState::AwaitOffer {
            self.credit = Credit::ahead(now, offer_timeout);
            self.state = KvConsumerState::Reserving;
            self.actions.push_back(KvConsumerAction::Reserve);
        }
    }

    pub fn state(&self) -> KvConsumerState {
        self.state
    }
    pub fn times(&self) -> HandoffTimes {
        self.times
    }
    pub fn stale(&self) -> usize {
        self.stale
    }
    /// Logical blocks reused from the prefix cache (they do not move).
    pub fn first_block(&self) -> u32 {
        self.first_block
    }
    /// Decode's block ids for the blocks that move.
    pub fn tail(&self) -> &[u32] {
        &self.tail
    }
    /// The driver revoked the grants the reply asked it to (the fence).
    pub fn fenced(&mut self, now: Instant) {
        if self.times.replied.is_some() && self.times.fenced.is_none() {
            self.times.fenced = Some(now);
        }
    }
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadline
    }
    pub fn poll_action(&mut self) -> Option<KvConsumerAction> {
        self.actions.pop_front()
    }

    fn terminal(&self) -> bool {
        matches!(self.state, KvConsumerState::Done | KvConsumerState::Failed)
    }

    fn fail(&mut self, e: HarnessError) {
        self.deadline = None;
        if !self.grants.is_empty() {
            self.actions
                .push_back(KvConsumerAction::Revoke(std::mem::take(&mut self.grants)));
        }
        self.state = KvConsumerState::Failed;
        self.actions.push_back(KvConsumerAction::Failed(e));
    }

    fn refuse(&mut self, e: &HarnessError) {
        self.actions.push_back(KvConsumerAction::Send(Msg::Refuse {
            request: self.rid.clone(),
            cause: e.to_string(),
            kind: e.failure_kind(),
        }));
    }

    /// A message for this request arrived.
    pub fn handle_msg(&mut self, now: Instant, msg: Msg) {
        if self.terminal() {
            self.stale += 1;
            return;
        }
        match (self.state, msg) {
            (KvConsumerState::AwaitOffer, Msg::Offer { .. }) => {
                self.times.offered = Some(now);
                self.state = KvConsumerState::Reserving;
                self.actions.push_back(KvConsumerAction::Reserve);
            }
            (KvConsumerState::AwaitOffer, other) => {
                let e = bad_reply(self.kind, &self.rid, other);
                self.refuse(&e);
                self.fail(e);
            }
            (
                KvConsumerState::Reserving | KvConsumerState::Granting | KvConsumerState::Granted,
                Msg::Offer { .. },
            ) if self.credit.is_ahead() && self.times.offered.is_none() => {
                let granted = self.state == KvConsumerState::Granted;
                if let Some(Some(d)) =
                    self.credit
                        .offered(now, &mut self.times, granted, self.timeout)
                {
                    self.deadline = Some(d);
                }
            }
            (KvConsumerState::Granted, Msg::Finish { .. })
                if self.credit.reply_before_offer(&self.times) =>
            {
                self.times.replied = Some(now);
                let e =
                    HarnessError::handoff(self.kind, &self.rid, None, &"a FINISH before its offer");
                self.fail(e);
            }
            (KvConsumerState::Granted, Msg::Finish { writing_us, .. }) => {
                self.times.replied = Some(now);
                self.credit.replied(now, writing_us, &mut self.times);
                self.deadline = None;
                // The fence: prefill says every write completed; nothing lands after this.
                self.actions
                    .push_back(KvConsumerAction::Revoke(std::mem::take(&mut self.grants)));
                self.state = KvConsumerState::Verifying;
                self.actions.push_back(KvConsumerAction::Verify);
            }
            (KvConsumerState::Granted, other) => {
                self.times.replied = Some(now);
                let e = bad_reply(self.kind, &self.rid, other);
                self.fail(e);
            }
            // Reserving / granting: nothing is expected; verifying: a second FINISH.
            (_, other) => {
                let e = bad_reply(self.kind, &self.rid, other);
                self.fail(e);
            }
        }
    }

    /// The driver found `first_block` blocks in its prefix cache and allocated `tail` for
    /// the rest; the machine asks for one grant per contiguous run, per layer and K/V.
    pub fn blocks(&mut self, first_block: u32, tail: Vec<u32>, held: Vec<Grant>) {
        if self.state != KvConsumerState::Reserving {
            if !held.is_empty() {
                self.actions.push_back(KvConsumerAction::Revoke(held));
            }
            return;
        }
        if u64::from(first_block) + tail.len() as u64 != self.num_blocks {
            let e = HarnessError::handoff(
                self.kind,
                &self.rid,
                None,
                &format!(
                    "reserved blocks {first_block}+{} for a request of {} blocks",
                    tail.len(),
                    self.num_blocks
                ),
            );
            self.refuse(&e);
            return self.fail(e);
        }
        self.first_block = first_block;
        let mut runs = Vec::new();
        for layer in 0..self.num_layers {
            for v in [false, true] {
                for (start, block, len) in contiguous_runs(&tail) {
                    runs.push(GrantRun {
                        layer,
                        v,
                        start,
                        block,
                        len,
                    });
                }
            }
        }
        self.tail = tail;
        self.runs = runs.clone();
        self.state = KvConsumerState::Granting;
        self.actions.push_back(KvConsumerAction::Grant(runs));
    }

    /// The driver granted every run: `made` as made (revoked at the fence), `told` what
    /// prefill is sent, one per run.
    pub fn granted(&mut self, now: Instant, made: Vec<Grant>, told: Vec<Grant>) {
        if self.state != KvConsumerState::Granting {
            if !made.is_empty() {
                self.actions.push_back(KvConsumerAction::Revoke(made));
            }
            return;
        }
        assert_eq!(told.len(), self.runs.len(), "one grant per run");
        self.grants = made;
        self.times.granted = Some(now);
        self.deadline = Some(self.credit.deadline(now, &self.times, self.timeout));
        self.state = KvConsumerState::Granted;
        let grants = self
            .runs
            .iter()
            .zip(told)
            .map(|(r, grant)| KvGrant {
                layer: r.layer,
                v: r.v,
                start: r.start,
                len: r.len,
                grant,
            })
            .collect();
        self.actions
            .push_back(KvConsumerAction::Send(Msg::KvReserve {
                request: self.rid.clone(),
                reservation: KvReservation {
                    first_block: self.first_block,
                    dst_blocks: self.tail.clone(),
                    grants,
                },
            }));
    }

    /// The driver could not reserve or grant (`made`: grants it did make, to revoke):
    /// refuse upstream so it does not wait for us.
    pub fn reserve_failed(&mut self, made: Vec<Grant>, e: HarnessError) {
        self.grants.extend(made);
        if self.terminal() {
            let g = std::mem::take(&mut self.grants);
            if !g.is_empty() {
                self.actions.push_back(KvConsumerAction::Revoke(g));
            }
            return;
        }
        self.refuse(&e);
        self.fail(e);
    }

    /// The control link failed (closed, or no message in time).
    pub fn link_failed(&mut self, e: HarnessError) {
        if !self.terminal() {
            self.fail(e);
        }
    }

    /// The deadline passed without FINISH (or, for a credit, without the offer).
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.deadline {
            Some(d) if now >= d && !self.terminal() => {
                let (text, tell) = self.credit.timed_out(&self.times, self.timeout, "FINISH");
                let e = HarnessError::handoff(
                    self.kind,
                    &self.rid,
                    None,
                    &Classified::new(FailureKind::TimedOut, text),
                );
                if tell {
                    self.refuse(&e);
                }
                self.fail(e);
            }
            _ => {}
        }
    }

    /// The driver verified every block (or found one that differs).
    pub fn verified(&mut self, now: Instant, found: std::result::Result<(), HarnessError>) {
        if self.state != KvConsumerState::Verifying {
            return;
        }
        match found {
            Ok(()) => {
                self.times.verified = Some(now);
                self.state = KvConsumerState::Done;
                self.actions.push_back(KvConsumerAction::Done);
            }
            Err(e) => self.fail(e),
        }
    }
}

// ---------------------------------------------------------------- producer

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvProducerState {
    /// Offer sent; waiting for the reservation (the deadline runs).
    Offered,
    /// Writes issued; waiting for every one to complete.
    Writing,
    /// FINISH sent.
    Announced,
    Failed,
}

/// What the KV producer asks its driver to do.
// Actions are queued and taken one at a time; most carry a message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum KvProducerAction {
    Send(Msg),
    /// Write `write.run` of `write.layer`'s K/V into `grant` at `write.grant_offset`
    /// (`len` bytes); report with [`KvProducer::write_completed`] or
    /// [`KvProducer::write_failed`]. Writes may be submitted together.
    Write {
        index: usize,
        write: KvWrite,
        grant: Grant,
        len: u64,
        /// What an ERROR names if this write fails: the tensor and its blocks.
        name: String,
    },
    Done,
    Failed(HarnessError),
}

/// Prefill's end of one request's KV hop.
#[derive(Debug)]
pub struct KvProducer {
    kind: PayloadKind,
    rid: String,
    src_blocks: Vec<u32>,
    num_layers: u32,
    block_bytes: u64,
    timeout: Duration,
    state: KvProducerState,
    deadline: Option<Instant>,
    /// When the outputs existed (the offer's time): replies say how long after it they come.
    offered_at: Instant,
    offer: HeldOffer,
    names: Vec<String>,
    in_flight: Vec<bool>,
    written: Vec<bool>,
    withdrawn: Option<HarnessError>,
    stale: usize,
    actions: VecDeque<KvProducerAction>,
}

impl KvProducer {
    /// A producer whose blocks `src_blocks` are filled: it offers them at once.
    pub fn new(
        now: Instant,
        kind: PayloadKind,
        rid: &str,
        src_blocks: Vec<u32>,
        num_layers: u32,
        block_bytes: u64,
        timeout: Duration,
    ) -> Self {
        Self {
            kind,
            rid: rid.into(),
            src_blocks,
            num_layers,
            block_bytes,
            timeout,
            state: KvProducerState::Offered,
            deadline: Some(now + timeout),
            offered_at: now,
            offer: HeldOffer::new(rid),
            names: vec![],
            in_flight: vec![],
            written: vec![],
            withdrawn: None,
            stale: 0,
            actions: VecDeque::new(),
        }
    }

    /// Queues the offer if it has not left yet (see [`HeldOffer`]).
    fn release_offer(&mut self) {
        if let Some(m) = self.offer.take() {
            self.actions.push_back(KvProducerAction::Send(m));
        }
    }

    /// Whether the offer has left (see [`HeldOffer`]).
    pub fn offer_sent(&self) -> bool {
        self.offer.sent()
    }

    pub fn state(&self) -> KvProducerState {
        self.state
    }
    pub fn stale(&self) -> usize {
        self.stale
    }
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadline
    }
    /// The next action; the offer once nothing is left to do but wait for the reservation.
    pub fn poll_action(&mut self) -> Option<KvProducerAction> {
        if self.actions.is_empty() && self.state == KvProducerState::Offered {
            self.release_offer();
        }
        self.actions.pop_front()
    }

    fn err(&self, tensor: Option<&str>, cause: &dyn Cause) -> HarnessError {
        HarnessError::handoff(self.kind, &self.rid, tensor, cause)
    }

    fn terminal(&self) -> bool {
        matches!(
            self.state,
            KvProducerState::Announced | KvProducerState::Failed
        )
    }

    /// Ends the handoff; decode waits for FINISH or ERROR, so answer (`tell`).
    fn fail(&mut self, failed: Vec<String>, e: HarnessError, tell: bool) {
        self.deadline = None;
        self.state = KvProducerState::Failed;
        if tell {
            self.release_offer();
            self.actions.push_back(KvProducerAction::Send(Msg::Error {
                request: self.rid.clone(),
                failed,
                cause: e.to_string(),
                kind: e.failure_kind(),
                peer: e.failure_peer(),
            }));
        }
        self.actions.push_back(KvProducerAction::Failed(e));
    }

    /// A message for this request arrived.
    pub fn handle_msg(&mut self, now: Instant, msg: Msg) {
        if self.terminal() {
            self.stale += 1;
            return;
        }
        match (self.state, msg) {
            (KvProducerState::Offered, Msg::KvReserve { reservation, .. }) => {
                self.deadline = None;
                let writes = match plan_kv_writes(
                    &self.src_blocks,
                    &reservation,
                    self.num_layers,
                    self.block_bytes,
                ) {
                    Ok(w) => w,
                    Err(e) => {
                        let e = self.err(None, &format!("bad reservation: {e}"));
                        return self.fail(vec![], e, true);
                    }
                };
                self.state = KvProducerState::Writing;
                self.in_flight = vec![true; writes.len()];
                self.written = vec![false; writes.len()];
                for (index, w) in writes.into_iter().enumerate() {
                    let name = format!(
                        "{} blocks {}..{}",
                        kv_tensor(w.layer, w.v),
                        w.run.logical,
                        w.run.logical + w.run.len
                    );
                    self.names.push(name.clone());
                    self.actions.push_back(KvProducerAction::Write {
                        index,
                        grant: reservation.grants[w.grant].grant.clone(),
                        len: u64::from(w.run.len) * self.block_bytes,
                        write: w,
                        name,
                    });
                }
                self.settle(now);
            }
            (KvProducerState::Offered, Msg::Refuse { cause, kind, .. }) => {
                let kind = match kind {
                    FailureKind::Other => FailureKind::Refused,
                    k => k,
                };
                let e = self.err(
                    None,
                    &Classified::new(kind, format!("consumer refused: {cause}")),
                );
                self.fail(vec![], e, false);
            }
            (KvProducerState::Writing, m @ (Msg::Refuse { .. } | Msg::Error { .. })) => {
                if self.withdrawn.is_none() {
                    let e = match m {
                        Msg::Refuse { cause, kind, .. } => self.err(
                            None,
                            &Classified::new(kind, format!("consumer withdrew: {cause}")),
                        ),
                        other => bad_reply(self.kind, &self.rid, other),
                    };
                    self.withdrawn = Some(e);
                }
                self.settle(now);
            }
            (_, other) => {
                let e = self.err(None, &format!("unexpected {} message", other.name()));
                self.fail(vec![], e, true);
            }
        }
    }

    /// The deadline passed without a reservation.
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.deadline {
            Some(d) if now >= d && self.state == KvProducerState::Offered => {
                let e = self.err(
                    None,
                    &Classified::new(
                        FailureKind::TimedOut,
                        format!("no reservation within {:?} of the offer", self.timeout),
                    ),
                );
                self.fail(vec![], e, true);
            }
            _ => {}
        }
    }

    /// The control link failed while waiting for the reservation.
    pub fn link_failed(&mut self, e: HarnessError) {
        if !self.terminal() {
            self.fail(vec![], e, false);
        }
    }

    /// Write `index` completed.
    pub fn write_completed(&mut self, now: Instant, index: usize) {
        if self.state != KvProducerState::Writing
            || !self.in_flight.get(index).copied().unwrap_or(false)
        {
            self.stale += 1;
            return;
        }
        self.in_flight[index] = false;
        self.written[index] = true;
        self.settle(now);
    }

    /// A write failed: `index`, the write the failure names, if it names one. The ERROR
    /// names its tensor and blocks.
    pub fn write_failed(&mut self, index: Option<usize>, e: HarnessError) {
        if self.state != KvProducerState::Writing {
            self.stale += 1;
            return;
        }
        let name = index.and_then(|i| self.names.get(i)).cloned();
        self.in_flight.iter_mut().for_each(|f| *f = false);
        self.fail(name.into_iter().collect(), e, true);
    }

    /// Announces FINISH once no write is in flight and every run landed.
    fn settle(&mut self, now: Instant) {
        if self.state != KvProducerState::Writing || self.in_flight.iter().any(|&f| f) {
            return;
        }
        if let Some(e) = self.withdrawn.take() {
            return self.fail(vec![], e, false);
        }
        if !self.written.iter().all(|&w| w) {
            return;
        }
        self.state = KvProducerState::Announced;
        self.release_offer();
        self.actions.push_back(KvProducerAction::Send(Msg::Finish {
            request: self.rid.clone(),
            writing_us: micros_since(self.offered_at, now),
            digests: vec![],
        }));
        self.actions.push_back(KvProducerAction::Done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnirig_transports::Access;

    const TIMEOUT: Duration = Duration::from_secs(5);
    const KIND: PayloadKind = PayloadKind::KvCache;
    const LAYERS: u32 = 2;
    const BLOCKS: u32 = 5;
    const BB: u64 = 64;

    fn grant(run: &GrantRun) -> Grant {
        Grant {
            segment: "decode".into(),
            buffer: 1,
            offset: u64::from(run.block) * BB,
            len: u64::from(run.len) * BB,
            epoch: 1,
            token: 100 + u64::from(run.layer) * 10 + u64::from(run.v) * 5 + u64::from(run.start),
            access: Access::Write,
            keys: vec![],
        }
    }

    /// Both ends of one KV hop, a scripted decode pool and a clock that moves only when told.
    struct Pair {
        now: Instant,
        consumer: KvConsumer,
        producer: KvProducer,
        /// (first_block, tail) decode's pool answers with.
        blocks: (u32, Vec<u32>),
        to_producer: Vec<Msg>,
        to_consumer: Vec<Msg>,
        revoked: Vec<Grant>,
        verifies: usize,
        writes: Vec<(usize, KvWrite, String)>,
        consumer_end: Option<std::result::Result<(), HarnessError>>,
        producer_end: Option<std::result::Result<(), HarnessError>>,
    }

    impl Pair {
        fn new(first_block: u32, tail: Vec<u32>) -> Self {
            let now = Instant::now();
            Self {
                now,
                consumer: KvConsumer::new(KIND, "r1", LAYERS, u64::from(BLOCKS), TIMEOUT),
                producer: KvProducer::new(
                    now,
                    KIND,
                    "r1",
                    (0..BLOCKS).collect(),
                    LAYERS,
                    BB,
                    TIMEOUT,
                ),
                blocks: (first_block, tail),
                to_producer: vec![],
                to_consumer: vec![],
                revoked: vec![],
                verifies: 0,
                writes: vec![],
                consumer_end: None,
                producer_end: None,
            }
        }

        /// Carries out every queued action (writes are recorded, not completed).
        fn pump(&mut self) {
            while self.pump_consumer() | self.pump_producer() {}
        }

        fn pump_consumer(&mut self) -> bool {
            let mut any = false;
            while let Some(a) = self.consumer.poll_action() {
                any = true;
                match a {
                    KvConsumerAction::Reserve => {
                        let (f, t) = self.blocks.clone();
                        self.consumer.blocks(f, t, vec![]);
                    }
                    KvConsumerAction::Grant(runs) => {
                        let g: Vec<Grant> = runs.iter().map(grant).collect();
                        self.consumer.granted(self.now, g.clone(), g);
                    }
                    KvConsumerAction::Send(m) => self.to_producer.push(m),
                    KvConsumerAction::Revoke(g) => {
                        self.revoked.extend(g);
                        self.consumer.fenced(self.now);
                    }
                    KvConsumerAction::Verify => self.verifies += 1,
                    KvConsumerAction::Done => self.consumer_end = Some(Ok(())),
                    KvConsumerAction::Failed(e) => self.consumer_end = Some(Err(e)),
                }
            }
            any
        }

        fn pump_producer(&mut self) -> bool {
            let mut any = false;
            while let Some(a) = self.producer.poll_action() {
                any = true;
                match a {
                    KvProducerAction::Send(m) => self.to_consumer.push(m),
                    KvProducerAction::Write {
                        index, write, name, ..
                    } => self.writes.push((index, write, name)),
                    KvProducerAction::Done => self.producer_end = Some(Ok(())),
                    KvProducerAction::Failed(e) => self.producer_end = Some(Err(e)),
                }
            }
            any
        }

        /// Delivers every message in flight, both ways.
        fn deliver(&mut self) {
            for m in std::mem::take(&mut self.to_producer) {
                self.producer.handle_msg(self.now, m);
            }
            for m in std::mem::take(&mut self.to_consumer) {
                self.consumer.handle_msg(self.now, m);
            }
            self.pump();
        }

        fn run_until_writing(&mut self) {
            self.pump();
            self.deliver(); // offer
            self.deliver(); // reservation
            assert_eq!(self.producer.state(), KvProducerState::Writing);
        }

        fn complete_writes(&mut self) {
            for (i, _, _) in self.writes.clone() {
                self.producer.write_completed(self.now, i);
            }
            self.pump();
        }

        fn consumer_error(&self) -> &HarnessError {
            match &self.consumer_end {
                Some(Err(e)) => e,
                other => panic!("consumer did not fail: {other:?}"),
            }
        }
    }

    fn clean(p: &mut Pair) {
        p.run_until_writing();
        p.complete_writes();
        p.deliver();
        assert_eq!(p.verifies, 1);
        p.consumer.verified(p.now, Ok(()));
        p.pump();
    }

    #[test]
    fn a_clean_handoff_writes_coalesced_runs_then_fences_and_verifies() {
        // Decode's tail is two runs: blocks 1..4 and 8..10.
        let mut p = Pair::new(0, vec![1, 2, 3, 8, 9]);
        clean(&mut p);
        assert!(matches!(p.consumer_end, Some(Ok(()))));
        assert!(matches!(p.producer_end, Some(Ok(()))));
        // One write per run contiguous on both sides, per layer and K/V.
        assert_eq!(p.writes.len(), 2 * 2 * LAYERS as usize);
        let lens: Vec<u32> = p.writes.iter().map(|(_, w, _)| w.run.len).collect();
        assert_eq!(lens.iter().sum::<u32>(), 2 * LAYERS * BLOCKS);
        assert!(lens.iter().all(|&l| l == 3 || l == 2), "{lens:?}");
        // Every grant made was revoked at the fence.
        assert_eq!(p.revoked.len(), 2 * 2 * LAYERS as usize);
    }

    #[test]
    fn a_credit_already_there_starts_the_writes_and_the_offer_leaves_with_the_finish() {
        let mut p = Pair::new(0, vec![1, 2, 3, 8, 9]);
        // Decode's credit reaches prefill before prefill looks at its link.
        p.consumer.credit(p.now, Duration::from_secs(30));
        p.pump_consumer();
        for m in std::mem::take(&mut p.to_producer) {
            p.producer.handle_msg(p.now, m);
        }
        p.pump();
        assert_eq!(p.producer.state(), KvProducerState::Writing);
        assert_eq!(p.writes.len(), 2 * 2 * LAYERS as usize);
        assert!(p.to_consumer.is_empty(), "nothing wakes decode mid-write");
        assert!(!p.producer.offer_sent());
        p.now += Duration::from_millis(7);
        p.complete_writes();
        assert!(
            matches!(
                p.to_consumer.as_slice(),
                [
                    Msg::Offer { .. },
                    Msg::Finish {
                        writing_us: 7000,
                        ..
                    }
                ]
            ),
            "{:?}",
            p.to_consumer
        );
        p.deliver();
        assert_eq!(p.revoked.len(), 2 * 2 * LAYERS as usize);
        assert_eq!(p.verifies, 1);
        p.consumer.verified(p.now, Ok(()));
        p.pump();
        assert!(matches!(p.consumer_end, Some(Ok(()))));
        assert_eq!(p.consumer.times().transfer(), Duration::from_millis(7));
    }

    #[test]
    fn a_prefix_hit_moves_only_the_missing_tail() {
        // Decode holds logical blocks 0..3 from its prefix cache; blocks 3..5 move.
        let mut p = Pair::new(3, vec![6, 7]);
        clean(&mut p);
        assert!(matches!(p.consumer_end, Some(Ok(()))));
        assert_eq!(
            p.writes.len(),
            2 * LAYERS as usize,
            "one tail run per tensor"
        );
        for (_, w, name) in &p.writes {
            assert_eq!(
                (w.run.logical, w.run.src, w.run.dst, w.run.len),
                (3, 3, 6, 2)
            );
            assert!(name.ends_with("blocks 3..5"), "{name}");
        }
    }

    #[test]
    fn a_grant_after_the_timeout_is_never_written() {
        let mut p = Pair::new(0, vec![1, 2, 3, 4, 5]);
        p.pump();
        p.deliver(); // offer reaches decode, which reserves and grants ...
        assert_eq!(p.to_producer.len(), 1);
        // ... but the reservation reaches prefill only after its deadline.
        p.now += TIMEOUT + Duration::from_millis(1);
        p.producer.handle_timeout(p.now);
        p.pump();
        match &p.producer_end {
            Some(Err(e)) => assert_eq!(e.failure_kind(), FailureKind::TimedOut),
            other => panic!("{other:?}"),
        }
        p.deliver();
        assert!(
            p.writes.is_empty(),
            "a grant that came too late was written into"
        );
        assert_eq!(p.producer.stale(), 1);
        // Decode ends with prefill's ERROR and revokes every grant it made.
        assert_eq!(p.consumer_error().failure_kind(), FailureKind::TimedOut);
        assert_eq!(p.revoked.len(), 2 * LAYERS as usize);
        // A reservation completing after decode failed is handed straight back.
        let late = grant(&GrantRun {
            layer: 0,
            v: false,
            start: 0,
            block: 9,
            len: 1,
        });
        p.consumer
            .granted(p.now, vec![late.clone()], vec![late.clone()]);
        p.pump();
        assert_eq!(p.revoked.last(), Some(&late));
    }

    #[test]
    fn a_duplicate_finish_is_ignored_after_the_handoff_and_fails_it_while_verifying() {
        let mut p = Pair::new(0, vec![1, 2, 3, 4, 5]);
        p.run_until_writing();
        p.complete_writes();
        let finish = p.to_consumer[0].clone();
        assert!(matches!(finish, Msg::Finish { .. }));
        p.deliver();
        assert_eq!(p.consumer.state(), KvConsumerState::Verifying);
        // A second FINISH while the blocks are being verified is a protocol error.
        let mut q = Pair::new(0, vec![1, 2, 3, 4, 5]);
        q.run_until_writing();
        q.complete_writes();
        q.deliver();
        q.consumer.handle_msg(q.now, finish.clone());
        q.pump();
        assert!(
            q.consumer_error()
                .to_string()
                .contains("unexpected finish message")
        );
        // After the handoff it is stale and changes nothing.
        p.consumer.verified(p.now, Ok(()));
        p.pump();
        p.consumer.handle_msg(p.now, finish);
        p.pump();
        assert!(matches!(p.consumer_end, Some(Ok(()))));
        assert_eq!(p.consumer.stale(), 1);
        assert_eq!(p.verifies, 1);
    }

    #[test]
    fn no_finish_is_announced_before_the_last_write_completes() {
        let mut p = Pair::new(0, vec![1, 2, 3, 7, 8]);
        p.run_until_writing();
        let n = p.writes.len();
        assert!(n > 1);
        for (i, _, _) in p.writes.clone().into_iter().take(n - 1) {
            p.producer.write_completed(p.now, i);
            p.pump();
            assert!(
                p.to_consumer.is_empty(),
                "FINISH before write {} completed",
                n - 1
            );
        }
        // A completion reported twice does not count as another write.
        p.producer.write_completed(p.now, 0);
        p.pump();
        assert!(p.to_consumer.is_empty());
        assert_eq!(p.producer.stale(), 1);
        p.producer.write_completed(p.now, p.writes[n - 1].0);
        p.pump();
        assert!(matches!(p.to_consumer.as_slice(), [Msg::Finish { .. }]));
    }

    #[test]
    fn an_error_names_the_blocks_whose_write_failed() {
        let mut p = Pair::new(0, vec![1, 2, 3, 7, 8]);
        p.run_until_writing();
        let (i, w, name) = p
            .writes
            .iter()
            .find(|(_, w, _)| w.layer == 1 && w.v && w.run.logical == 3)
            .cloned()
            .expect("a write of layer 1's V, blocks 3..5");
        assert_eq!(name, "kv.layer.1.v blocks 3..5");
        let e = HarnessError::handoff(
            KIND,
            "r1",
            Some(&kv_tensor(w.layer, w.v)),
            &Classified::new(FailureKind::GrantRefused, "write failed"),
        );
        p.producer.write_failed(Some(i), e);
        p.pump();
        match p.to_consumer.as_slice() {
            [Msg::Error { failed, .. }] => assert_eq!(failed, &vec![name.clone()]),
            other => panic!("{other:?}"),
        }
        p.deliver();
        let e = p.consumer_error();
        assert_eq!(e.failure_kind(), FailureKind::GrantRefused);
        assert!(e.to_string().contains(&name), "{e}");
        assert!(e.to_string().contains("r1"), "{e}");
        // Decode revoked every grant, and verified nothing.
        assert_eq!(p.revoked.len(), p.writes.len());
        assert_eq!(p.verifies, 0);
    }

    #[test]
    fn a_reservation_for_the_wrong_blocks_is_refused_naming_it() {
        let mut p = Pair::new(0, vec![1, 2]);
        p.pump();
        p.deliver();
        // Decode's own check: 2 blocks for a 5-block request.
        assert!(p.consumer_error().to_string().contains("5 blocks"));
        assert!(matches!(p.to_producer.as_slice(), [Msg::Refuse { .. }]));
        p.deliver();
        match &p.producer_end {
            Some(Err(e)) => assert!(e.to_string().contains("consumer refused"), "{e}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_decode_that_withdraws_mid_write_gets_no_finish() {
        let mut p = Pair::new(0, vec![1, 2, 3, 4, 5]);
        p.run_until_writing();
        // Decode gives up (its grants revoked) while prefill's writes are in flight.
        p.consumer.link_failed(HarnessError::handoff(
            KIND,
            "r1",
            None,
            &Classified::new(FailureKind::TimedOut, "gave up"),
        ));
        p.pump();
        assert_eq!(p.revoked.len(), 2 * LAYERS as usize);
        p.producer.handle_msg(
            p.now,
            Msg::Refuse {
                request: "r1".into(),
                cause: "gave up".into(),
                kind: FailureKind::TimedOut,
            },
        );
        p.pump();
        assert!(
            p.producer_end.is_none(),
            "ended with writes still in flight"
        );
        // The writes settle (landing or failing against revoked grants): no FINISH.
        p.complete_writes();
        assert!(
            p.to_consumer.is_empty(),
            "FINISH announced writes into revoked grants"
        );
        match &p.producer_end {
            Some(Err(e)) => {
                assert_eq!(e.failure_kind(), FailureKind::TimedOut);
                assert!(e.to_string().contains("consumer withdrew"), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_credit_grants_the_tail_before_the_offer_and_a_finish_without_offer_is_refused() {
        const WAIT: Duration = Duration::from_secs(30);
        let mut p = Pair::new(2, vec![5, 6, 7]);
        let offer = p.producer.poll_action();
        p.consumer.credit(p.now, WAIT);
        p.pump();
        // Reserved and granted with no offer seen: the reservation waits for prefill.
        assert_eq!(p.consumer.state(), KvConsumerState::Granted);
        assert!(matches!(p.to_producer.as_slice(), [Msg::KvReserve { .. }]));
        assert_eq!(p.consumer.poll_timeout(), Some(p.now + WAIT));
        let Some(KvProducerAction::Send(offer)) = offer else {
            panic!("the producer offers first")
        };
        // The offer arrives after 2 ms; the reservation crosses it.
        p.now += Duration::from_millis(2);
        p.consumer.handle_msg(p.now, offer);
        assert_eq!(p.consumer.poll_timeout(), Some(p.now + TIMEOUT));
        p.deliver();
        assert_eq!(p.producer.state(), KvProducerState::Writing);
        p.complete_writes();
        p.deliver();
        p.consumer.verified(p.now, Ok(()));
        p.pump();
        assert_eq!(p.consumer_end.as_ref().map(|r| r.is_ok()), Some(true));
        assert_eq!(p.consumer.times().reserve(), Duration::ZERO);
        assert_eq!(
            p.revoked.len(),
            2 * LAYERS as usize,
            "one run per layer and K/V"
        );

        // A FINISH with no offer before it is not prefill's: refused, the credit revoked.
        let mut q = Pair::new(0, vec![1, 2, 3, 4, 5]);
        q.producer.poll_action();
        q.consumer.credit(q.now, WAIT);
        q.pump();
        q.consumer.handle_msg(
            q.now,
            Msg::Finish {
                request: "r1".into(),
                digests: vec![],
                writing_us: 0,
            },
        );
        q.pump();
        assert!(q.consumer_error().to_string().contains("before its offer"));
        assert_eq!(q.revoked.len(), 2 * LAYERS as usize);
        assert_eq!(q.verifies, 0);
    }
}
