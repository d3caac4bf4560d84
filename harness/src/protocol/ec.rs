//! The EC connector (Encoder -> Thinker prefill) as two I/O-free state machines, in the
//! style of the stage-packet connector ([`super::PacketConsumer`]).
//!
//! The protocol, consumer (prefill) driven:
//! 1. encoder -> prefill `Offer` (its embeddings exist; with a credit already
//!    granted it leaves with step 4's message, see [`super::HeldOffer`]);
//! 2. prefill takes each mm_hash from its encoder cache: a cached one is used as is and
//!    not moved (no grant), a missing one is reserved and granted: `EcReserve`;
//! 3. the encoder stages and writes every granted entry;
//! 4. only once every write completed: encoder -> prefill `Finish` with each written
//!    entry's digest, or `Error` naming the entry that failed;
//! 5. prefill revokes its grants (the fence), verifies each moved entry against its
//!    declared digest (then caches it) and checks each cached one again.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use omnirig_fixtures::{Digest128, PayloadKind, TensorSpec};
use omnirig_transports::Grant;

use super::{Credit, HandoffTimes, HeldOffer, bad_reply, micros_since};
use crate::control::{Msg, NamedDigest};
use crate::ec::EcSlot;
use crate::error::{Cause, Classified, FailureKind, HarnessError};

/// One entry prefill uses: where it lives in the encoder cache and, when it must be
/// moved, the grant over that space (none when it was cached).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EcEntry {
    pub mm_hash: String,
    pub tensor: String,
    pub offset: u64,
    pub len: u64,
    pub grant: Option<Grant>,
}

// ---------------------------------------------------------------- consumer

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EcConsumerState {
    AwaitOffer,
    /// Offer seen; the driver takes every mm_hash from its encoder cache.
    Reserving,
    /// Reservation sent; waiting for FINISH (the deadline runs).
    Granted,
    /// FINISH accepted; waiting for the driver's digests.
    Verifying,
    Done,
    Failed,
}

/// What the EC consumer asks its driver to do.
// Actions are queued and taken one at a time; most carry a message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum EcConsumerAction {
    /// Take every mm_hash from the encoder cache (reserving and granting the missing
    /// ones), then call [`EcConsumer::granted`] or [`EcConsumer::reserve_failed`].
    Reserve,
    Send(Msg),
    /// Revoke these grants now: no byte may land after this.
    Revoke(Vec<Grant>),
    /// Digest entry `index`'s bytes and call [`EcConsumer::verified`].
    Verify {
        index: usize,
        tensor: String,
        offset: u64,
        len: u64,
    },
    /// Entry `mm_hash` arrived and matched its digest: the cache may serve it.
    Cache {
        mm_hash: String,
    },
    Done,
    Failed(HarnessError),
}

/// Prefill's end of one request's EC hop.
#[derive(Debug)]
pub struct EcConsumer {
    kind: PayloadKind,
    rid: String,
    timeout: Duration,
    state: EcConsumerState,
    deadline: Option<Instant>,
    entries: Vec<EcEntry>,
    grants: Vec<Grant>,
    /// Per entry: the digest FINISH declared (moved entries only).
    declared: Vec<Option<String>>,
    verified: Vec<bool>,
    stale: usize,
    credit: Credit,
    times: HandoffTimes,
    actions: VecDeque<EcConsumerAction>,
}

impl EcConsumer {
    pub fn new(kind: PayloadKind, rid: &str, timeout: Duration) -> Self {
        Self {
            kind,
            rid: rid.into(),
            timeout,
            state: EcConsumerState::AwaitOffer,
            deadline: None,
            entries: vec![],
            grants: vec![],
            declared: vec![],
            verified: vec![],
            stale: 0,
            credit: Credit::default(),
            times: HandoffTimes::default(),
            actions: VecDeque::new(),
        }
    }

    /// Takes the entries from the cache and grants the missing ones ahead of the offer
    /// (a [`Credit`]); the offer then marks the handoff's start. Without it within
    /// `offer_timeout` of the grant, the credit is revoked, the encoder told, and the
    /// handoff fails.
    pub fn credit(&mut self, now: Instant, offer_timeout: Duration) {
        if self.state == EcConsumerState::AwaitOffer {
            self.credit = Credit::ahead(now, offer_timeout);
            self.state = EcConsumerState::Reserving;
            self.actions.push_back(EcConsumerAction::Reserve);
        }
    }

    pub fn state(&self) -> EcConsumerState {
        self.state
    }
    pub fn times(&self) -> HandoffTimes {
        self.times
    }
    pub fn stale(&self) -> usize {
        self.stale
    }
    pub fn entries(&self) -> &[EcEntry] {
        &self.entries
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
    pub fn poll_action(&mut self) -> Option<EcConsumerAction> {
        self.actions.pop_front()
    }

    fn err(&self, tensor: Option<&str>, cause: &dyn Cause) -> HarnessError {
        HarnessError::handoff(self.kind, &self.rid, tensor, cause)
    }

    fn terminal(&self) -> bool {
        matches!(self.state, EcConsumerState::Done | EcConsumerState::Failed)
    }

    fn fail(&mut self, e: HarnessError) {
        self.deadline = None;
        if !self.grants.is_empty() {
            self.actions
                .push_back(EcConsumerAction::Revoke(std::mem::take(&mut self.grants)));
        }
        self.state = EcConsumerState::Failed;
        self.actions.push_back(EcConsumerAction::Failed(e));
    }

    fn refuse(&mut self, e: &HarnessError) {
        self.actions.push_back(EcConsumerAction::Send(Msg::Refuse {
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
            (EcConsumerState::AwaitOffer, Msg::Offer { .. }) => {
                self.times.offered = Some(now);
                self.state = EcConsumerState::Reserving;
                self.actions.push_back(EcConsumerAction::Reserve);
            }
            (EcConsumerState::AwaitOffer, other) => {
                let e = bad_reply(self.kind, &self.rid, other);
                self.refuse(&e);
                self.fail(e);
            }
            (EcConsumerState::Reserving | EcConsumerState::Granted, Msg::Offer { .. })
                if self.credit.is_ahead() && self.times.offered.is_none() =>
            {
                let granted = self.state == EcConsumerState::Granted;
                if let Some(Some(d)) =
                    self.credit
                        .offered(now, &mut self.times, granted, self.timeout)
                {
                    self.deadline = Some(d);
                }
            }
            (EcConsumerState::Granted, Msg::Finish { .. })
                if self.credit.reply_before_offer(&self.times) =>
            {
                self.times.replied = Some(now);
                let e = self.err(None, &"a FINISH before its offer");
                self.fail(e);
            }
            (
                EcConsumerState::Granted,
                Msg::Finish {
                    digests,
                    writing_us,
                    ..
                },
            ) => {
                self.times.replied = Some(now);
                self.credit.replied(now, writing_us, &mut self.times);
                self.deadline = None;
                // The fence: the encoder says every write completed; nothing lands after this.
                self.actions
                    .push_back(EcConsumerAction::Revoke(std::mem::take(&mut self.grants)));
                self.declared = self
                    .entries
                    .iter()
                    .map(|e| {
                        e.grant.as_ref()?;
                        digests
                            .iter()
                            .find(|d| d.tensor == e.tensor)
                            .map(|d| d.digest.clone())
                    })
                    .collect();
                self.verified = vec![false; self.entries.len()];
                self.state = EcConsumerState::Verifying;
                // Moved entries first, then cached ones: the stage's inputs too, so the
                // fence covers them.
                let order = (0..self.entries.len())
                    .filter(|&i| self.entries[i].grant.is_some())
                    .chain((0..self.entries.len()).filter(|&i| self.entries[i].grant.is_none()));
                for index in order {
                    let e = &self.entries[index];
                    self.actions.push_back(EcConsumerAction::Verify {
                        index,
                        tensor: e.tensor.clone(),
                        offset: e.offset,
                        len: e.len,
                    });
                }
                self.finish_if_verified(now);
            }
            (EcConsumerState::Granted, other) => {
                self.times.replied = Some(now);
                let e = bad_reply(self.kind, &self.rid, other);
                self.fail(e);
            }
            (_, other) => {
                let e = bad_reply(self.kind, &self.rid, other);
                self.fail(e);
            }
        }
    }

    /// The driver took every entry: `made` the grants it made (revoked at the fence),
    /// `entries` one per mm_hash, granted or cached.
    pub fn granted(&mut self, now: Instant, made: Vec<Grant>, entries: Vec<EcEntry>) {
        if self.state != EcConsumerState::Reserving {
            if !made.is_empty() {
                self.actions.push_back(EcConsumerAction::Revoke(made));
            }
            return;
        }
        self.grants = made;
        self.times.granted = Some(now);
        self.deadline = Some(self.credit.deadline(now, &self.times, self.timeout));
        self.state = EcConsumerState::Granted;
        let slots = entries
            .iter()
            .map(|e| EcSlot {
                mm_hash: e.mm_hash.clone(),
                tensor: e.tensor.clone(),
                grant: e.grant.clone(),
            })
            .collect();
        self.entries = entries;
        self.actions
            .push_back(EcConsumerAction::Send(Msg::EcReserve {
                request: self.rid.clone(),
                slots,
            }));
    }

    /// The driver could not take an entry (`made`: grants it did make, to revoke):
    /// refuse upstream so it does not wait for us.
    pub fn reserve_failed(&mut self, made: Vec<Grant>, e: HarnessError) {
        self.grants.extend(made);
        if self.terminal() {
            let g = std::mem::take(&mut self.grants);
            if !g.is_empty() {
                self.actions.push_back(EcConsumerAction::Revoke(g));
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
                let e = self.err(None, &Classified::new(FailureKind::TimedOut, text));
                if tell {
                    self.refuse(&e);
                }
                self.fail(e);
            }
            _ => {}
        }
    }

    /// The driver digested entry `index` (or failed to).
    pub fn verified(
        &mut self,
        now: Instant,
        index: usize,
        found: std::result::Result<Digest128, HarnessError>,
    ) {
        if self.state != EcConsumerState::Verifying || index >= self.entries.len() {
            return;
        }
        let entry = self.entries[index].clone();
        match found {
            Err(e) => self.fail(e),
            Ok(d)
                if entry.grant.is_some()
                    && self.declared[index].as_deref() != Some(d.to_hex().as_str()) =>
            {
                let e = self.err(
                    Some(&entry.tensor),
                    &Classified::new(
                        FailureKind::Corrupt,
                        "producer's FINISH digest missing or different",
                    ),
                );
                self.fail(e);
            }
            Ok(_) => {
                self.verified[index] = true;
                if entry.grant.is_some() {
                    self.actions.push_back(EcConsumerAction::Cache {
                        mm_hash: entry.mm_hash,
                    });
                }
                self.finish_if_verified(now);
            }
        }
    }

    fn finish_if_verified(&mut self, now: Instant) {
        if self.state == EcConsumerState::Verifying && self.verified.iter().all(|&v| v) {
            self.times.verified = Some(now);
            self.state = EcConsumerState::Done;
            self.actions.push_back(EcConsumerAction::Done);
        }
    }
}

// ---------------------------------------------------------------- producer

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EcProducerState {
    Offered,
    Writing,
    Announced,
    Failed,
}

/// What the EC producer asks its driver to do.
// Actions are queued and taken one at a time; most carry a message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum EcProducerAction {
    Send(Msg),
    /// Stage entry `index` (tensor `tensor`) and write it into `grant`; report with
    /// [`EcProducer::staged`] and then [`EcProducer::write_completed`] or
    /// [`EcProducer::write_failed`]. Writes may be submitted together.
    Write {
        index: usize,
        tensor: String,
        grant: Grant,
    },
    Done,
    Failed(HarnessError),
}

/// The encoder's end of one request's EC hop.
#[derive(Debug)]
pub struct EcProducer {
    kind: PayloadKind,
    rid: String,
    tensors: Vec<TensorSpec>,
    timeout: Duration,
    state: EcProducerState,
    deadline: Option<Instant>,
    /// When the outputs existed (the offer's time): replies say how long after it they come.
    offered_at: Instant,
    offer: HeldOffer,
    /// The entries to move, in the reservation's order.
    names: Vec<String>,
    digests: Vec<Option<Digest128>>,
    in_flight: Vec<bool>,
    written: Vec<bool>,
    withdrawn: Option<HarnessError>,
    stale: usize,
    actions: VecDeque<EcProducerAction>,
}

impl EcProducer {
    /// An encoder whose outputs (the hop's `tensors`) exist: it offers them at once.
    pub fn new(
        now: Instant,
        kind: PayloadKind,
        rid: &str,
        tensors: Vec<TensorSpec>,
        timeout: Duration,
    ) -> Self {
        Self {
            kind,
            rid: rid.into(),
            tensors,
            timeout,
            state: EcProducerState::Offered,
            deadline: Some(now + timeout),
            offered_at: now,
            offer: HeldOffer::new(rid),
            names: vec![],
            digests: vec![],
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
            self.actions.push_back(EcProducerAction::Send(m));
        }
    }

    /// Whether the offer has left (see [`HeldOffer`]).
    pub fn offer_sent(&self) -> bool {
        self.offer.sent()
    }

    pub fn state(&self) -> EcProducerState {
        self.state
    }
    pub fn stale(&self) -> usize {
        self.stale
    }
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadline
    }
    /// The next action; the offer once nothing is left to do but wait for the reservation.
    pub fn poll_action(&mut self) -> Option<EcProducerAction> {
        if self.actions.is_empty() && self.state == EcProducerState::Offered {
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
            EcProducerState::Announced | EcProducerState::Failed
        )
    }

    fn fail(&mut self, failed: Vec<String>, e: HarnessError, tell: bool) {
        self.deadline = None;
        self.state = EcProducerState::Failed;
        if tell {
            self.release_offer();
            self.actions.push_back(EcProducerAction::Send(Msg::Error {
                request: self.rid.clone(),
                failed,
                cause: e.to_string(),
                kind: e.failure_kind(),
                peer: e.failure_peer(),
            }));
        }
        self.actions.push_back(EcProducerAction::Failed(e));
    }

    /// A message for this request arrived.
    pub fn handle_msg(&mut self, now: Instant, msg: Msg) {
        if self.terminal() {
            self.stale += 1;
            return;
        }
        match (self.state, msg) {
            (EcProducerState::Offered, Msg::EcReserve { slots, .. }) => {
                self.deadline = None;
                let mut writes = Vec::new();
                // Cached entries (no grant) are not moved.
                for s in slots {
                    let Some(grant) = s.grant else { continue };
                    let Some(spec) = self.tensors.iter().find(|t| t.name == s.tensor) else {
                        let e = self.err(Some(&s.tensor), &"not a tensor of this hop");
                        return self.fail(vec![s.tensor], e, true);
                    };
                    if grant.len < spec.byte_length {
                        let e = self.err(
                            Some(&s.tensor),
                            &format!(
                                "grant of {} bytes for {} bytes",
                                grant.len, spec.byte_length
                            ),
                        );
                        return self.fail(vec![s.tensor], e, true);
                    }
                    writes.push((s.tensor, grant));
                }
                self.state = EcProducerState::Writing;
                let n = writes.len();
                self.digests = vec![None; n];
                self.in_flight = vec![true; n];
                self.written = vec![false; n];
                for (index, (tensor, grant)) in writes.into_iter().enumerate() {
                    self.names.push(tensor.clone());
                    self.actions.push_back(EcProducerAction::Write {
                        index,
                        tensor,
                        grant,
                    });
                }
                self.settle(now);
            }
            (EcProducerState::Offered, Msg::Refuse { cause, kind, .. }) => {
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
            (EcProducerState::Writing, m @ (Msg::Refuse { .. } | Msg::Error { .. })) => {
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
            Some(d) if now >= d && self.state == EcProducerState::Offered => {
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

    /// Entry `index` is staged: its bytes' digest (FINISH declares it).
    pub fn staged(&mut self, index: usize, digest: Digest128) {
        if let Some(d) = self.digests.get_mut(index) {
            *d = Some(digest);
        }
    }

    /// Staging entry `index` failed before its write was issued.
    pub fn stage_failed(&mut self, index: usize, e: HarnessError) {
        self.write_failed(Some(index), e);
    }

    /// The write of entry `index` completed.
    pub fn write_completed(&mut self, now: Instant, index: usize) {
        if self.state != EcProducerState::Writing
            || !self.in_flight.get(index).copied().unwrap_or(false)
        {
            self.stale += 1;
            return;
        }
        self.in_flight[index] = false;
        self.written[index] = true;
        self.settle(now);
    }

    /// A write failed: `index`, the entry the failure names, if it names one.
    pub fn write_failed(&mut self, index: Option<usize>, e: HarnessError) {
        if self.state != EcProducerState::Writing {
            self.stale += 1;
            return;
        }
        let name = index.and_then(|i| self.names.get(i)).cloned();
        self.in_flight.iter_mut().for_each(|f| *f = false);
        self.fail(name.into_iter().collect(), e, true);
    }

    /// Announces FINISH once no write is in flight and every entry landed.
    fn settle(&mut self, now: Instant) {
        if self.state != EcProducerState::Writing || self.in_flight.iter().any(|&f| f) {
            return;
        }
        if let Some(e) = self.withdrawn.take() {
            return self.fail(vec![], e, false);
        }
        if !self.written.iter().all(|&w| w) {
            return;
        }
        let mut digests = Vec::with_capacity(self.names.len());
        for (name, d) in self.names.iter().zip(&self.digests) {
            let Some(d) = d else {
                let e = self.err(Some(name), &"written but never staged (no digest)");
                return self.fail(vec![name.clone()], e, true);
            };
            digests.push(NamedDigest {
                tensor: name.clone(),
                digest: d.to_hex(),
            });
        }
        self.state = EcProducerState::Announced;
        self.release_offer();
        self.actions.push_back(EcProducerAction::Send(Msg::Finish {
            request: self.rid.clone(),
            writing_us: micros_since(self.offered_at, now),
            digests,
        }));
        self.actions.push_back(EcProducerAction::Done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnirig_fixtures::{DType, ValueRange};
    use omnirig_transports::Access;

    const TIMEOUT: Duration = Duration::from_secs(5);
    const KIND: PayloadKind = PayloadKind::EncoderEmbeddings;

    fn tensors() -> Vec<TensorSpec> {
        ["embed.image.0", "embed.image.1", "embed.audio.0"]
            .iter()
            .map(|&n| TensorSpec::new(n, DType::BF16, vec![4, 8], ValueRange::Any).expect("spec"))
            .collect()
    }

    fn grant(offset: u64, len: u64) -> Grant {
        Grant {
            segment: "prefill".into(),
            buffer: 2,
            offset,
            len,
            epoch: 1,
            token: 50 + offset,
            access: Access::Write,
            keys: vec![],
        }
    }

    fn digest_of(tensor: &str) -> Digest128 {
        Digest128::of_bytes(tensor.as_bytes())
    }

    /// Both ends of one EC hop; `cached` names the entries prefill's cache already holds.
    struct Pair {
        now: Instant,
        consumer: EcConsumer,
        producer: EcProducer,
        cached: Vec<&'static str>,
        to_producer: Vec<Msg>,
        to_consumer: Vec<Msg>,
        revoked: Vec<Grant>,
        verify: Vec<(usize, String)>,
        cache: Vec<String>,
        writes: Vec<(usize, String)>,
        consumer_end: Option<std::result::Result<(), HarnessError>>,
        producer_end: Option<std::result::Result<(), HarnessError>>,
    }

    impl Pair {
        fn new(cached: Vec<&'static str>) -> Self {
            let now = Instant::now();
            Self {
                now,
                consumer: EcConsumer::new(KIND, "r1", TIMEOUT),
                producer: EcProducer::new(now, KIND, "r1", tensors(), TIMEOUT),
                cached,
                to_producer: vec![],
                to_consumer: vec![],
                revoked: vec![],
                verify: vec![],
                cache: vec![],
                writes: vec![],
                consumer_end: None,
                producer_end: None,
            }
        }

        fn pump(&mut self) {
            while self.pump_consumer() | self.pump_producer() {}
        }

        fn pump_consumer(&mut self) -> bool {
            let mut any = false;
            while let Some(a) = self.consumer.poll_action() {
                any = true;
                match a {
                    EcConsumerAction::Reserve => {
                        let entries: Vec<EcEntry> = tensors()
                            .iter()
                            .enumerate()
                            .map(|(i, t)| {
                                let offset = i as u64 * 4096;
                                EcEntry {
                                    mm_hash: format!("h{i}"),
                                    tensor: t.name.clone(),
                                    offset,
                                    len: t.byte_length,
                                    grant: (!self.cached.contains(&t.name.as_str()))
                                        .then(|| grant(offset, t.byte_length)),
                                }
                            })
                            .collect();
                        let made = entries.iter().filter_map(|e| e.grant.clone()).collect();
                        self.consumer.granted(self.now, made, entries);
                    }
                    EcConsumerAction::Send(m) => self.to_producer.push(m),
                    EcConsumerAction::Revoke(g) => {
                        self.revoked.extend(g);
                        self.consumer.fenced(self.now);
                    }
                    EcConsumerAction::Verify { index, tensor, .. } => {
                        self.verify.push((index, tensor))
                    }
                    EcConsumerAction::Cache { mm_hash } => self.cache.push(mm_hash),
                    EcConsumerAction::Done => self.consumer_end = Some(Ok(())),
                    EcConsumerAction::Failed(e) => self.consumer_end = Some(Err(e)),
                }
            }
            any
        }

        fn pump_producer(&mut self) -> bool {
            let mut any = false;
            while let Some(a) = self.producer.poll_action() {
                any = true;
                match a {
                    EcProducerAction::Send(m) => self.to_consumer.push(m),
                    EcProducerAction::Write { index, tensor, .. } => {
                        self.producer.staged(index, digest_of(&tensor));
                        self.writes.push((index, tensor));
                    }
                    EcProducerAction::Done => self.producer_end = Some(Ok(())),
                    EcProducerAction::Failed(e) => self.producer_end = Some(Err(e)),
                }
            }
            any
        }

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
            self.deliver();
            self.deliver();
            assert_eq!(self.producer.state(), EcProducerState::Writing);
        }

        fn complete_writes(&mut self) {
            for (i, _) in self.writes.clone() {
                self.producer.write_completed(self.now, i);
            }
            self.pump();
        }

        /// Answers every Verify with the digest the landed (or cached) bytes have.
        fn verify_all(&mut self, wrong: Option<&str>) {
            for (i, t) in std::mem::take(&mut self.verify) {
                let d = if Some(t.as_str()) == wrong {
                    Digest128(0)
                } else {
                    digest_of(&t)
                };
                self.consumer.verified(self.now, i, Ok(d));
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

    #[test]
    fn a_credit_already_there_starts_the_writes_and_the_offer_leaves_with_the_finish() {
        let mut p = Pair::new(vec!["embed.image.1"]);
        // The credit reaches the encoder before it looks at its link.
        p.consumer.credit(p.now, Duration::from_secs(30));
        p.pump_consumer();
        for m in std::mem::take(&mut p.to_producer) {
            p.producer.handle_msg(p.now, m);
        }
        p.pump();
        assert_eq!(p.producer.state(), EcProducerState::Writing);
        assert_eq!(p.writes.len(), 2, "the uncached entries, written at once");
        assert!(p.to_consumer.is_empty(), "nothing wakes prefill mid-write");
        assert!(!p.producer.offer_sent());
        p.now += Duration::from_millis(2);
        p.complete_writes();
        assert!(
            matches!(
                p.to_consumer.as_slice(),
                [
                    Msg::Offer { .. },
                    Msg::Finish {
                        writing_us: 2000,
                        ..
                    }
                ]
            ),
            "{:?}",
            p.to_consumer
        );
        p.deliver();
        assert_eq!(p.revoked.len(), 2, "the fence revokes the credit's grants");
        p.verify_all(None);
        assert!(matches!(p.consumer_end, Some(Ok(()))));
        assert_eq!(p.cache, ["h0", "h2"]);
        assert_eq!(p.consumer.times().transfer(), Duration::from_millis(2));
    }

    #[test]
    fn a_cached_mm_hash_is_not_moved_but_still_checked() {
        let mut p = Pair::new(vec!["embed.image.1"]);
        p.run_until_writing();
        let moved: Vec<&str> = p.writes.iter().map(|(_, t)| t.as_str()).collect();
        assert_eq!(moved, ["embed.image.0", "embed.audio.0"]);
        p.complete_writes();
        p.deliver();
        // Moved entries are verified first, then the cached one (the fence covers it too).
        let order: Vec<&str> = p.verify.iter().map(|(_, t)| t.as_str()).collect();
        assert_eq!(order, ["embed.image.0", "embed.audio.0", "embed.image.1"]);
        p.verify_all(None);
        assert!(matches!(p.consumer_end, Some(Ok(()))));
        assert!(matches!(p.producer_end, Some(Ok(()))));
        // Only moved entries become cache entries; every grant was revoked at the fence.
        assert_eq!(p.cache, ["h0", "h2"]);
        assert_eq!(p.revoked.len(), 2);
    }

    #[test]
    fn everything_cached_moves_nothing_and_finishes_at_once() {
        let mut p = Pair::new(vec!["embed.image.0", "embed.image.1", "embed.audio.0"]);
        p.pump();
        p.deliver();
        p.deliver();
        assert!(p.writes.is_empty());
        assert!(matches!(p.producer_end, Some(Ok(()))));
        p.deliver();
        p.verify_all(None);
        assert!(matches!(p.consumer_end, Some(Ok(()))));
        assert!(p.cache.is_empty());
    }

    #[test]
    fn a_landed_entry_that_differs_from_its_finish_digest_is_corrupt_and_not_cached() {
        let mut p = Pair::new(vec![]);
        p.run_until_writing();
        p.complete_writes();
        p.deliver();
        p.verify_all(Some("embed.image.1"));
        let e = p.consumer_error();
        assert_eq!(e.failure_kind(), FailureKind::Corrupt);
        assert!(e.to_string().contains("embed.image.1"), "{e}");
        assert_eq!(
            p.cache,
            ["h0"],
            "the bad entry must not be served from the cache"
        );
    }

    #[test]
    fn a_grant_after_the_timeout_is_never_written() {
        let mut p = Pair::new(vec![]);
        p.pump();
        p.deliver();
        p.now += TIMEOUT;
        p.producer.handle_timeout(p.now);
        p.pump();
        p.deliver();
        assert!(p.writes.is_empty());
        assert_eq!(p.producer.stale(), 1);
        assert_eq!(p.consumer_error().failure_kind(), FailureKind::TimedOut);
        assert_eq!(p.revoked.len(), 3);
    }

    #[test]
    fn a_duplicate_finish_is_stale_after_the_handoff() {
        let mut p = Pair::new(vec![]);
        p.run_until_writing();
        p.complete_writes();
        let finish = p.to_consumer[0].clone();
        p.deliver();
        p.verify_all(None);
        p.consumer.handle_msg(p.now, finish.clone());
        p.pump();
        assert!(matches!(p.consumer_end, Some(Ok(()))));
        assert_eq!(p.consumer.stale(), 1);
        // While verifying, a second FINISH fails the handoff.
        let mut q = Pair::new(vec![]);
        q.run_until_writing();
        q.complete_writes();
        q.deliver();
        q.consumer.handle_msg(q.now, finish);
        q.pump();
        assert!(
            q.consumer_error()
                .to_string()
                .contains("unexpected finish message")
        );
    }

    #[test]
    fn no_finish_before_the_last_write_completes_and_an_error_names_the_entry() {
        let mut p = Pair::new(vec![]);
        p.run_until_writing();
        p.producer.write_completed(p.now, 0);
        p.pump();
        assert!(
            p.to_consumer.is_empty(),
            "FINISH before every write completed"
        );
        let e = HarnessError::handoff(
            KIND,
            "r1",
            Some("embed.image.1"),
            &Classified::new(FailureKind::GrantRefused, "write failed"),
        );
        p.producer.write_failed(Some(1), e);
        p.pump();
        match p.to_consumer.as_slice() {
            [Msg::Error { failed, .. }] => assert_eq!(failed, &vec!["embed.image.1".to_string()]),
            other => panic!("{other:?}"),
        }
        p.deliver();
        assert_eq!(p.consumer_error().failure_kind(), FailureKind::GrantRefused);
        assert!(p.verify.is_empty() && p.cache.is_empty());
        assert_eq!(p.revoked.len(), 3);
    }

    #[test]
    fn a_credit_takes_entries_before_the_offer_and_caches_what_moved() {
        const WAIT: Duration = Duration::from_secs(30);
        let mut p = Pair::new(vec!["embed.audio.0"]);
        p.consumer.credit(p.now, WAIT);
        p.pump(); // the encoder's offer and the credit cross
        assert_eq!(p.consumer.state(), EcConsumerState::Granted);
        p.deliver();
        assert_eq!(p.producer.state(), EcProducerState::Writing);
        p.now += Duration::from_millis(4);
        p.complete_writes();
        p.deliver();
        p.verify_all(None);
        assert_eq!(p.consumer_end.as_ref().map(|r| r.is_ok()), Some(true));
        let t = p.consumer.times();
        assert_eq!(
            (t.reserve(), t.transfer()),
            (Duration::ZERO, Duration::from_millis(4))
        );
    }
}
