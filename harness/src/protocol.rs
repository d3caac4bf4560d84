//! The stage-packet connector (Thinker -> Talker, Talker -> Code2Wav) as two I/O-free
//! state machines, one per hop end: events in, actions out, the clock passed in.
//!
//! Neither machine touches a socket, an engine or a pool. A driver ([`crate::stage`] in
//! `omnirig run`) feeds them what happened (a message arrived, a reservation was made, a
//! write completed, the deadline passed) and carries out what they ask for (send this,
//! revoke those grants, write that tensor, verify those bytes). So the orderings the
//! network rarely produces (a grant after the timeout, a duplicate packet, a packet asked
//! for before its last write completed, a grant revoked while a write is in flight) are
//! tested here by hand, without sockets or sleeps.
//!
//! The protocol, consumer-driven:
//! 1. producer -> consumer `Offer` (its outputs exist; with a credit already granted it
//!    leaves with step 4's message instead, see [`HeldOffer`]);
//! 2. the consumer reserves a destination per tensor and grants it: `StageReserve`;
//! 3. the producer stages and writes every tensor;
//! 4. only once every write completed: producer -> consumer `Packet` (packet v1 sidecar), or
//!    `Error` naming the tensor that failed;
//! 5. the consumer revokes its grants (the fence: nothing lands after this), checks the
//!    sidecar, then verifies each tensor's landed bytes against the sidecar's digest.

pub mod ec;
pub mod kv;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use omnirig_fixtures::{Digest128, Packet, PayloadKind, TensorEntry, TensorSpec};
use omnirig_transports::Grant;

use crate::control::{Msg, NamedGrant};
use crate::error::{Cause, Classified, FailureKind, HarnessError};
use crate::inline::packet_layout;

/// The error a hop's end reports when its peer answered with `msg` instead of what the
/// protocol expects next (an ERROR keeps the producer's kind and peer).
pub fn bad_reply(kind: PayloadKind, rid: &str, msg: Msg) -> HarnessError {
    match msg {
        Msg::Error {
            failed,
            cause,
            kind: failure,
            peer,
            ..
        } => HarnessError::handoff(
            kind,
            rid,
            failed.first().map(String::as_str),
            // The producer's kind and peer: what happened, not who passed it on.
            &Classified {
                kind: failure,
                peer,
                text: format!(
                    "producer reported ERROR{}: {cause}",
                    if failed.len() > 1 {
                        format!(" ({} failed: {})", failed.len(), failed.join(", "))
                    } else {
                        String::new()
                    }
                ),
            },
        ),
        other => HarnessError::handoff(
            kind,
            rid,
            None,
            &format!("unexpected {} message", other.name()),
        ),
    }
}

/// Microseconds from `a` to `b` (zero if `b` is earlier).
pub(crate) fn micros_since(a: Instant, b: Instant) -> u64 {
    // Rounded up: a consumer that dates a handoff's start from this (an offer that came in
    // the same write as its packet) must not start it after the producer's offer.
    u64::try_from(b.saturating_duration_since(a).as_nanos().div_ceil(1000)).unwrap_or(u64::MAX)
}

/// When each step of a handoff happened, as the consumer saw it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HandoffTimes {
    pub offered: Option<Instant>,
    /// The reservation went out (pools reserved, grants made).
    pub granted: Option<Instant>,
    /// The producer's packet (or error) arrived.
    pub replied: Option<Instant>,
    /// The grants were revoked (set by the driver, which carries out the revocation).
    pub fenced: Option<Instant>,
    /// Every tensor verified.
    pub verified: Option<Instant>,
}

/// What every connector machine takes from the control link: a message, its own deadline
/// passing, or the link failing. One driver (`stage.rs`) feeds all six machines through it.
pub trait LinkEvents {
    /// When the machine next times out, if it is waiting for anything.
    fn poll_timeout(&self) -> Option<Instant>;
    /// A control message for the machine's request arrived at `now`.
    fn handle_msg(&mut self, now: Instant, msg: Msg);
    /// The deadline [`LinkEvents::poll_timeout`] named has passed.
    fn handle_timeout(&mut self, now: Instant);
    /// The control link failed before a message came.
    fn link_failed(&mut self, e: HarnessError);
}

/// Each machine's inherent methods are the trait's.
macro_rules! link_events {
    ($($t:ty),*) => {$(
        impl LinkEvents for $t {
            fn poll_timeout(&self) -> Option<Instant> {
                <$t>::poll_timeout(self)
            }
            fn handle_msg(&mut self, now: Instant, msg: Msg) {
                <$t>::handle_msg(self, now, msg)
            }
            fn handle_timeout(&mut self, now: Instant) {
                <$t>::handle_timeout(self, now)
            }
            fn link_failed(&mut self, e: HarnessError) {
                <$t>::link_failed(self, e)
            }
        }
    )*};
}

link_events!(
    PacketConsumer,
    PacketProducer,
    ec::EcConsumer,
    ec::EcProducer,
    kv::KvConsumer,
    kv::KvProducer
);

impl HandoffTimes {
    fn span(a: Option<Instant>, b: Option<Instant>) -> Duration {
        match (a, b) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        }
    }
    /// When the destination was in place for the offer's outputs: the grant, or the offer
    /// itself when a credit was granted ahead of it.
    fn ready(&self) -> Option<Instant> {
        match (self.offered, self.granted) {
            (Some(o), Some(g)) => Some(o.max(g)),
            (o, g) => g.or(o),
        }
    }
    /// Offer -> reservation sent (zero for a credit granted ahead).
    pub fn reserve(&self) -> Duration {
        Self::span(self.offered, self.ready())
    }
    /// Reservation in place -> packet arrived (the producer wrote in between).
    pub fn transfer(&self) -> Duration {
        Self::span(self.ready(), self.replied)
    }
    /// Grants revoked (or, before that is known, packet arrived) -> every tensor verified.
    pub fn verify(&self) -> Duration {
        Self::span(self.fenced.or(self.replied), self.verified)
    }
    /// Offer -> every tensor verified.
    pub fn handoff(&self) -> Duration {
        Self::span(self.offered, self.verified)
    }

    /// The handoff split into consecutive phases, ending at `end` (the consumer's
    /// bookkeeping after verification is the ack phase).
    pub fn phases(&self, end: Instant) -> crate::stage::HandoffPhases {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let fenced = self.fenced.or(self.replied);
        crate::stage::HandoffPhases {
            reserve: ms(self.reserve()),
            transfer: ms(self.transfer()),
            fence: ms(Self::span(self.replied, fenced)),
            verify: ms(Self::span(fenced, self.verified)),
            ack: ms(Self::span(self.verified, Some(end))),
        }
    }
}

/// A producer's offer, held back while it can write without waiting for its consumer: it
/// leaves once the producer has nothing to do but wait for the reservation (none came yet),
/// or else just before the reply (packet, FINISH) or the ERROR, in the same write. With a
/// credit granted ahead and already received (the driver feeds it in before the first
/// action), the writes start at once; an offer sent first would wake the consumer for nothing
/// while the bytes are on their way (on a loaded two-core host that wake-up took the
/// producer's core for 0.1-0.25 ms before its first write). The consumer dates the handoff
/// from the producer's clock either way (the reply's `writing_us`).
#[derive(Debug)]
pub(crate) struct HeldOffer(Option<Msg>);

impl HeldOffer {
    pub(crate) fn new(rid: &str) -> Self {
        Self(Some(Msg::Offer {
            request: rid.into(),
        }))
    }
    /// The offer, the first time only.
    pub(crate) fn take(&mut self) -> Option<Msg> {
        self.0.take()
    }
    pub(crate) fn sent(&self) -> bool {
        self.0.is_none()
    }
}

/// A consumer's credit: its reservation made ahead of the offer, so the producer finds its
/// destination granted when its outputs exist and the reservation is off the handoff's
/// path. The three consumers follow the same rules, kept here once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Credit {
    /// How long a granted credit waits for its offer; `None`: no credit (the consumer
    /// reserves on the offer).
    wait: Option<Duration>,
    /// When the consumer started reserving: no handoff of this request starts earlier.
    since: Option<Instant>,
}

impl Credit {
    pub fn ahead(now: Instant, wait: Duration) -> Self {
        Self {
            wait: Some(wait),
            since: Some(now),
        }
    }
    pub fn is_ahead(&self) -> bool {
        self.wait.is_some()
    }

    /// Whether `Offer` is a credit's offer (the reservation is under way or granted): it
    /// marks the handoff's start. A credit granted ahead starts with its destination in
    /// place (no reserve phase, see [`HandoffTimes::reserve`]) and its reply deadline
    /// (`timeout`) runs from the offer; returns that deadline, if the grant is in place.
    fn offered(
        &self,
        now: Instant,
        times: &mut HandoffTimes,
        granted: bool,
        timeout: Duration,
    ) -> Option<Option<Instant>> {
        if self.wait.is_none() || times.offered.is_some() {
            return None;
        }
        times.offered = Some(now);
        Some(granted.then_some(now + timeout))
    }

    /// The deadline of a reservation granted at `now`: a credit waits for its offer, else
    /// the reply's timeout runs from the grant (or from the offer, if it came first).
    fn deadline(&self, now: Instant, times: &HandoffTimes, timeout: Duration) -> Instant {
        match (self.wait, times.offered) {
            (Some(wait), None) => now + wait,
            _ => now + timeout,
        }
    }

    /// Why the deadline passed, and whether to tell upstream (a credit whose offer never
    /// came: its producer may still come and must not write into it).
    fn timed_out(&self, times: &HandoffTimes, timeout: Duration, reply: &str) -> (String, bool) {
        match (self.wait, times.offered) {
            (Some(wait), None) => (format!("no offer within {wait:?} of the credit"), true),
            (Some(_), Some(_)) => (format!("no {reply} within {timeout:?} of the offer"), false),
            (None, _) => (
                format!("no {reply} within {timeout:?} of the reservation"),
                false,
            ),
        }
    }

    /// A reply came at `now`, `writing_us` after its producer's offer on the producer's
    /// clock: a credit's handoff starts no later than that offer, however late the offer
    /// was seen here (a busy consumer sees it late; the reply wait would then miss part of
    /// the producer's writing).
    fn replied(&self, now: Instant, writing_us: u64, times: &mut HandoffTimes) {
        let Some(seen) = times.offered.filter(|_| self.wait.is_some()) else {
            return;
        };
        let Some(start) = now.checked_sub(Duration::from_micros(writing_us)) else {
            return;
        };
        // An offer made before this consumer started the request dates from that start.
        let start = self.since.map_or(start, |since| start.max(since));
        // If the grant came after that start, the producer waited for it: reserve phase.
        if start < seen {
            times.offered = Some(start);
        }
    }

    /// A reply (packet, FINISH) while a credit's offer has not come: its producer did not
    /// follow the protocol (it offers before it writes).
    fn reply_before_offer(&self, times: &HandoffTimes) -> bool {
        self.wait.is_some() && times.offered.is_none()
    }
}

// ---------------------------------------------------------------- consumer

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumerState {
    AwaitOffer,
    /// Offer seen; the driver is reserving.
    Reserving,
    /// Reservation sent; waiting for the packet (the deadline runs).
    Granted,
    /// Packet arrived; waiting for the driver to revoke the grants (the fence) before
    /// the sidecar is read.
    Fencing,
    /// Packet accepted; waiting for the driver's digests.
    Verifying,
    Done,
    Failed,
}

/// What the consumer asks its driver to do.
// Actions are queued and taken one at a time; most carry a message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum ConsumerAction {
    /// Reserve and grant a destination per tensor (in the hop's order), then call
    /// [`PacketConsumer::granted`] or [`PacketConsumer::reserve_failed`].
    Reserve,
    Send(Msg),
    /// Revoke these grants now: no byte may land after this.
    Revoke(Vec<Grant>),
    /// An inline packet: copy `bytes` (tensor `index`) to `offset` in the pool, where its
    /// grant pointed; a failure is reported through [`PacketConsumer::verified`].
    Land {
        index: usize,
        offset: u64,
        bytes: Vec<u8>,
    },
    /// Digest the landed bytes of tensor `index` and call [`PacketConsumer::verified`].
    Verify {
        index: usize,
        tensor: String,
        offset: u64,
        len: u64,
    },
    /// Every tensor landed and matched its digest: the stage may start.
    Done,
    Failed(HarnessError),
}

/// The consumer end of one request's stage-packet hop.
#[derive(Debug)]
pub struct PacketConsumer {
    kind: PayloadKind,
    rid: String,
    tensors: Vec<TensorSpec>,
    timeout: Duration,
    state: ConsumerState,
    deadline: Option<Instant>,
    /// Grants as made (what the driver revokes), and where each tensor lands.
    grants: Vec<Grant>,
    offsets: Vec<u64>,
    /// Digests the packet declared, per tensor.
    expected: Vec<Digest128>,
    verified: Vec<bool>,
    /// Messages that arrived after the handoff ended, ignored.
    stale: usize,
    credit: Credit,
    /// The packet (sidecar, inline bytes) waiting for the fence.
    fencing: Option<(Vec<u8>, Vec<u8>)>,
    times: HandoffTimes,
    actions: VecDeque<ConsumerAction>,
}

impl PacketConsumer {
    pub fn new(kind: PayloadKind, rid: &str, tensors: Vec<TensorSpec>, timeout: Duration) -> Self {
        Self {
            kind,
            rid: rid.into(),
            tensors,
            timeout,
            state: ConsumerState::AwaitOffer,
            deadline: None,
            grants: vec![],
            offsets: vec![],
            expected: vec![],
            verified: vec![],
            stale: 0,
            credit: Credit::default(),
            fencing: None,
            times: HandoffTimes::default(),
            actions: VecDeque::new(),
        }
    }

    /// Reserves and grants ahead of the offer (a [`Credit`]); the offer then marks the
    /// handoff's start. Without it within `offer_timeout` of the grant, the credit is
    /// revoked, upstream told, and the handoff fails.
    pub fn credit(&mut self, now: Instant, offer_timeout: Duration) {
        if self.state == ConsumerState::AwaitOffer {
            self.credit = Credit::ahead(now, offer_timeout);
            self.state = ConsumerState::Reserving;
            self.actions.push_back(ConsumerAction::Reserve);
        }
    }

    pub fn state(&self) -> ConsumerState {
        self.state
    }
    pub fn times(&self) -> HandoffTimes {
        self.times
    }
    /// The driver revoked the grants the packet's arrival asked it to (the fence): the
    /// packet's sidecar is read now, and its tensors verified.
    pub fn fenced(&mut self, now: Instant) {
        if self.times.replied.is_some() && self.times.fenced.is_none() {
            self.times.fenced = Some(now);
        }
        if self.state == ConsumerState::Fencing {
            self.after_fence(now);
        }
    }
    /// Messages ignored because they came after the handoff had ended.
    pub fn stale(&self) -> usize {
        self.stale
    }
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }
    /// When [`Self::handle_timeout`] is due, if a deadline runs.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadline
    }
    pub fn poll_action(&mut self) -> Option<ConsumerAction> {
        self.actions.pop_front()
    }

    fn err(&self, tensor: Option<&str>, cause: &dyn Cause) -> HarnessError {
        HarnessError::handoff(self.kind, &self.rid, tensor, cause)
    }

    fn terminal(&self) -> bool {
        matches!(self.state, ConsumerState::Done | ConsumerState::Failed)
    }

    /// Ends the handoff with `e`: grants revoked first, so nothing lands in memory the
    /// driver is about to hand back.
    fn fail(&mut self, e: HarnessError) {
        self.deadline = None;
        if !self.grants.is_empty() {
            self.actions
                .push_back(ConsumerAction::Revoke(std::mem::take(&mut self.grants)));
        }
        self.state = ConsumerState::Failed;
        self.actions.push_back(ConsumerAction::Failed(e));
    }

    /// A message for this request arrived.
    pub fn handle_msg(&mut self, now: Instant, msg: Msg) {
        if self.terminal() {
            self.stale += 1;
            return;
        }
        match (self.state, msg) {
            (ConsumerState::AwaitOffer, Msg::Offer { .. }) => {
                self.times.offered = Some(now);
                self.state = ConsumerState::Reserving;
                self.actions.push_back(ConsumerAction::Reserve);
            }
            (ConsumerState::AwaitOffer, other) => {
                // Refuse upstream, so it does not wait for us.
                let e = bad_reply(self.kind, &self.rid, other);
                self.refuse(&e);
                self.fail(e);
            }
            // The offer of a credit's producer: the reservation (if it is still being made)
            // is on the handoff's path from here on.
            (ConsumerState::Reserving | ConsumerState::Granted, Msg::Offer { .. })
                if self.credit.is_ahead() && self.times.offered.is_none() =>
            {
                let granted = self.state == ConsumerState::Granted;
                if let Some(Some(d)) =
                    self.credit
                        .offered(now, &mut self.times, granted, self.timeout)
                {
                    self.deadline = Some(d);
                }
            }
            (ConsumerState::Granted, Msg::Packet { .. })
                if self.credit.reply_before_offer(&self.times) =>
            {
                self.times.replied = Some(now);
                let e = self.err(
                    None,
                    &Classified::new(FailureKind::BadSidecar, "a packet before its offer"),
                );
                self.fail(e);
            }
            (
                ConsumerState::Granted,
                Msg::Packet {
                    packet,
                    writing_us,
                    inline,
                    ..
                },
            ) => {
                self.times.replied = Some(now);
                self.credit.replied(now, writing_us, &mut self.times);
                self.deadline = None;
                // The fence: the producer says every write completed (or, inline, that it
                // wrote none); nothing lands through the grants after this. The sidecar is
                // read once the driver has revoked them.
                self.actions
                    .push_back(ConsumerAction::Revoke(std::mem::take(&mut self.grants)));
                self.state = ConsumerState::Fencing;
                self.fencing = Some((packet, inline));
            }
            (ConsumerState::Granted, other) => {
                self.times.replied = Some(now);
                let e = bad_reply(self.kind, &self.rid, other);
                self.fail(e);
            }
            // Reserving: the producer waits for our reservation and sends nothing but an
            // ERROR (its upstream failed). Verifying: a second packet.
            (_, Msg::Error { .. })
                if self.state == ConsumerState::Reserving && !self.credit.is_ahead() =>
            {
                self.stale += 1;
            }
            (_, other) => {
                let e = bad_reply(self.kind, &self.rid, other);
                self.fail(e);
            }
        }
    }

    fn refuse(&mut self, e: &HarnessError) {
        self.actions.push_back(ConsumerAction::Send(Msg::Refuse {
            request: self.rid.clone(),
            cause: e.to_string(),
            kind: e.failure_kind(),
        }));
    }

    /// The driver reserved and granted: `made` are the grants as made (revoked at the
    /// fence), `told` what the producer is sent, `offsets` where each tensor lands.
    pub fn granted(&mut self, now: Instant, made: Vec<Grant>, told: Vec<Grant>, offsets: Vec<u64>) {
        if self.state != ConsumerState::Reserving {
            // A reservation completing after the handoff ended: hand it straight back.
            if !made.is_empty() {
                self.actions.push_back(ConsumerAction::Revoke(made));
            }
            return;
        }
        assert_eq!(told.len(), self.tensors.len(), "one grant per tensor");
        assert_eq!(offsets.len(), self.tensors.len(), "one offset per tensor");
        self.grants = made;
        self.offsets = offsets;
        self.times.granted = Some(now);
        self.deadline = Some(self.credit.deadline(now, &self.times, self.timeout));
        self.state = ConsumerState::Granted;
        let grants = self
            .tensors
            .iter()
            .zip(told)
            .map(|(t, grant)| NamedGrant {
                tensor: t.name.clone(),
                grant,
            })
            .collect();
        self.actions
            .push_back(ConsumerAction::Send(Msg::StageReserve {
                request: self.rid.clone(),
                grants,
            }));
    }

    /// The driver could not reserve (`made`: the grants it did make, to revoke): refuse
    /// upstream so it does not wait for us.
    pub fn reserve_failed(&mut self, made: Vec<Grant>, e: HarnessError) {
        self.grants.extend(made);
        if self.terminal() {
            let g = std::mem::take(&mut self.grants);
            if !g.is_empty() {
                self.actions.push_back(ConsumerAction::Revoke(g));
            }
            return;
        }
        self.refuse(&e);
        self.fail(e);
    }

    /// The control link failed (closed, or no message in time): the handoff ends with it.
    pub fn link_failed(&mut self, e: HarnessError) {
        if !self.terminal() {
            self.fail(e);
        }
    }

    /// The deadline passed without the packet (or, for a credit, without the offer).
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.deadline {
            Some(d) if now >= d && !self.terminal() => {
                let (text, tell) = self.credit.timed_out(&self.times, self.timeout, "packet");
                let e = self.err(None, &Classified::new(FailureKind::TimedOut, text));
                if tell {
                    self.refuse(&e);
                }
                self.fail(e);
            }
            _ => {}
        }
    }

    /// The driver digested tensor `index`'s landed bytes (or failed to).
    pub fn verified(
        &mut self,
        now: Instant,
        index: usize,
        found: std::result::Result<Digest128, HarnessError>,
    ) {
        if self.state != ConsumerState::Verifying || index >= self.tensors.len() {
            return;
        }
        let name = self.tensors[index].name.clone();
        match found {
            Err(e) => self.fail(e),
            Ok(d) if d != self.expected[index] => {
                let e = self.err(
                    Some(&name),
                    &Classified::new(
                        FailureKind::Corrupt,
                        "landed bytes differ from the packet's digest",
                    ),
                );
                self.fail(e);
            }
            Ok(_) => {
                self.verified[index] = true;
                self.finish_if_verified(now);
            }
        }
    }

    fn finish_if_verified(&mut self, now: Instant) {
        if self.state == ConsumerState::Verifying && self.verified.iter().all(|&v| v) {
            self.times.verified = Some(now);
            self.state = ConsumerState::Done;
            self.actions.push_back(ConsumerAction::Done);
        }
    }

    /// The grants are revoked: read the sidecar (and any inline payload), then land and
    /// verify every tensor.
    fn after_fence(&mut self, now: Instant) {
        let Some((packet, inline)) = self.fencing.take() else {
            return;
        };
        match self
            .check_packet(&packet)
            .and_then(|e| self.check_inline(&inline).map(|()| e))
        {
            Ok(expected) => {
                self.expected = expected;
                self.verified = vec![false; self.tensors.len()];
                self.state = ConsumerState::Verifying;
                if !inline.is_empty() {
                    let (at, _) = packet_layout(self.tensors.iter().map(|t| &t.byte_length));
                    for (index, (t, a)) in self.tensors.iter().zip(at).enumerate() {
                        let a = a as usize;
                        self.actions.push_back(ConsumerAction::Land {
                            index,
                            offset: self.offsets[index],
                            bytes: inline[a..a + t.byte_length as usize].to_vec(),
                        });
                    }
                }
                for (index, t) in self.tensors.iter().enumerate() {
                    self.actions.push_back(ConsumerAction::Verify {
                        index,
                        tensor: t.name.clone(),
                        offset: self.offsets[index],
                        len: t.byte_length,
                    });
                }
                self.finish_if_verified(now);
            }
            Err(e) => self.fail(e),
        }
    }

    /// An inline payload (if any) spans exactly the packet layout of this hop's tensors.
    fn check_inline(&self, inline: &[u8]) -> std::result::Result<(), HarnessError> {
        if inline.is_empty() {
            return Ok(());
        }
        let (_, span) = packet_layout(self.tensors.iter().map(|t| &t.byte_length));
        if inline.len() as u64 != span {
            return Err(self.err(
                None,
                &Classified::new(
                    FailureKind::BadSidecar,
                    format!(
                        "inline payload of {} bytes, the packet's layout spans {span}",
                        inline.len()
                    ),
                ),
            ));
        }
        Ok(())
    }

    /// Decodes and checks the sidecar: version, request, kind, one entry per tensor with the
    /// expected dtype and shape. Returns the declared digests in the hop's order.
    fn check_packet(&self, bytes: &[u8]) -> std::result::Result<Vec<Digest128>, HarnessError> {
        let sidecar = |text: String| Classified::new(FailureKind::BadSidecar, text);
        let p = Packet::from_msgpack(bytes)
            .map_err(|e| self.err(None, &sidecar(format!("packet refused: {e}"))))?;
        if p.request_id != self.rid || p.payload_kind != self.kind {
            return Err(self.err(
                None,
                &sidecar(format!(
                    "packet is for request {} / {}",
                    p.request_id, p.payload_kind
                )),
            ));
        }
        self.tensors
            .iter()
            .map(|t| {
                let e = p.entry(&t.name).ok_or_else(|| {
                    self.err(Some(&t.name), &sidecar("missing from the packet".into()))
                })?;
                if e.dtype != t.dtype || e.shape != t.shape {
                    return Err(self.err(
                        Some(&t.name),
                        &sidecar(format!(
                            "packet says {} {:?}, expected {} {:?}",
                            e.dtype, e.shape, t.dtype, t.shape
                        )),
                    ));
                }
                Ok(e.digest)
            })
            .collect()
    }
}

// ---------------------------------------------------------------- producer

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProducerState {
    /// Offer sent; waiting for the reservation (the deadline runs).
    Offered,
    /// A small packet: waiting for the driver to lay its tensors out inline.
    Inlining,
    /// Writes issued; waiting for every one to complete.
    Writing,
    /// Packet sent: the handoff is the consumer's now.
    Announced,
    Failed,
}

/// What the producer asks its driver to do.
// Actions are queued and taken one at a time; most carry a message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum ProducerAction {
    Send(Msg),
    /// Stage tensor `index` and write it into `grant`; report with
    /// [`PacketProducer::staged`] and then [`PacketProducer::write_completed`] or
    /// [`PacketProducer::write_failed`]. Writes may be submitted together.
    Write {
        index: usize,
        tensor: String,
        grant: Grant,
    },
    /// Lay every staged tensor out in the packet layout ([`packet_layout`]) and call
    /// [`PacketProducer::inlined`]: the packet carries them, no write is made.
    Inline,
    /// The packet is out: the handoff ended well on this side.
    Done,
    Failed(HarnessError),
}

/// The producer end of one request's stage-packet hop.
#[derive(Debug)]
pub struct PacketProducer {
    kind: PayloadKind,
    rid: String,
    tensors: Vec<TensorSpec>,
    timeout: Duration,
    state: ProducerState,
    deadline: Option<Instant>,
    /// When the outputs existed (the offer's time): replies say how long after it they come.
    offered_at: Instant,
    offer: HeldOffer,
    grants: Vec<Option<Grant>>,
    digests: Vec<Option<Digest128>>,
    /// Per tensor: a write issued and not yet completed.
    in_flight: Vec<bool>,
    written: Vec<bool>,
    /// The consumer withdrew while writes were in flight (its ERROR / REFUSE): the first
    /// failure seen, reported once the writes settle.
    withdrawn: Option<HarnessError>,
    stale: usize,
    /// The sidecar a fault scripts instead of the real one.
    sidecar_override: Option<SidecarOverride>,
    actions: VecDeque<ProducerAction>,
}

/// What a faulty producer sends instead of the real sidecar.
pub struct SidecarOverride(Box<dyn Fn(Packet) -> Vec<u8> + Send + Sync>);

impl std::fmt::Debug for SidecarOverride {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SidecarOverride")
    }
}

impl PacketProducer {
    /// A producer whose outputs exist: it offers them at once.
    pub fn new(
        now: Instant,
        kind: PayloadKind,
        rid: &str,
        tensors: Vec<TensorSpec>,
        timeout: Duration,
    ) -> Self {
        let n = tensors.len();
        Self {
            kind,
            rid: rid.into(),
            tensors,
            timeout,
            state: ProducerState::Offered,
            deadline: Some(now + timeout),
            offered_at: now,
            offer: HeldOffer::new(rid),
            grants: vec![None; n],
            digests: vec![None; n],
            in_flight: vec![false; n],
            written: vec![false; n],
            withdrawn: None,
            stale: 0,
            sidecar_override: None,
            actions: VecDeque::new(),
        }
    }

    /// Queues the offer if it has not left yet (see [`HeldOffer`]).
    fn release_offer(&mut self) {
        if let Some(m) = self.offer.take() {
            self.actions.push_back(ProducerAction::Send(m));
        }
    }

    /// Packets of at most `bytes` (in the packet layout) carry their tensors inline: one
    /// message after the offer, no reservation waited for, no write (the consumer copies
    /// them where it reserved). For payloads of a few KiB, where the round trips cost more
    /// than the bytes. Zero: never.
    pub fn with_inline_below(mut self, bytes: u64) -> Self {
        let (_, span) = packet_layout(self.tensors.iter().map(|t| &t.byte_length));
        if self.state == ProducerState::Offered && span > 0 && span <= bytes {
            // The offer and the inline packet leave together.
            self.release_offer();
            self.state = ProducerState::Inlining;
            self.deadline = None;
            self.actions.push_back(ProducerAction::Inline);
        }
        self
    }

    /// The driver laid the staged tensors out (`bytes`, the packet layout): the packet
    /// goes with them.
    pub fn inlined(&mut self, now: Instant, bytes: Vec<u8>) {
        if self.state != ProducerState::Inlining {
            self.stale += 1;
            return;
        }
        let (_, span) = packet_layout(self.tensors.iter().map(|t| &t.byte_length));
        if bytes.len() as u64 != span {
            let e = self.err(
                None,
                &format!(
                    "inline payload of {} bytes for a {span}-byte layout",
                    bytes.len()
                ),
            );
            return self.fail(vec![], e, true);
        }
        self.announce(now, None, bytes);
    }

    /// The driver could not lay the tensors out for an inline packet.
    pub fn inline_failed(&mut self, e: HarnessError) {
        if self.state == ProducerState::Inlining {
            self.fail(vec![], e, true);
        } else {
            self.stale += 1;
        }
    }

    /// Sends `f(packet)` instead of the packet (fault injection: a malformed sidecar).
    pub fn with_sidecar(mut self, f: impl Fn(Packet) -> Vec<u8> + Send + Sync + 'static) -> Self {
        self.sidecar_override = Some(SidecarOverride(Box::new(f)));
        self
    }

    pub fn state(&self) -> ProducerState {
        self.state
    }
    pub fn stale(&self) -> usize {
        self.stale
    }
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadline
    }
    /// The next action; the offer once nothing is left to do but wait for the reservation.
    pub fn poll_action(&mut self) -> Option<ProducerAction> {
        if self.actions.is_empty() && self.state == ProducerState::Offered {
            self.release_offer();
        }
        self.actions.pop_front()
    }

    /// Whether the offer has left (see [`HeldOffer`]).
    pub fn offer_sent(&self) -> bool {
        self.offer.sent()
    }

    fn err(&self, tensor: Option<&str>, cause: &dyn Cause) -> HarnessError {
        HarnessError::handoff(self.kind, &self.rid, tensor, cause)
    }

    fn terminal(&self) -> bool {
        matches!(self.state, ProducerState::Announced | ProducerState::Failed)
    }

    /// Ends the handoff: the consumer waits for a packet or an ERROR, so always answer
    /// (`tell`), naming what failed.
    fn fail(&mut self, failed: Vec<String>, e: HarnessError, tell: bool) {
        self.deadline = None;
        self.state = ProducerState::Failed;
        if tell {
            self.release_offer();
            self.actions.push_back(ProducerAction::Send(Msg::Error {
                request: self.rid.clone(),
                failed,
                cause: e.to_string(),
                kind: e.failure_kind(),
                peer: e.failure_peer(),
            }));
        }
        self.actions.push_back(ProducerAction::Failed(e));
    }

    /// A message for this request arrived.
    pub fn handle_msg(&mut self, now: Instant, msg: Msg) {
        if self.terminal() {
            self.stale += 1;
            return;
        }
        match (self.state, msg) {
            (ProducerState::Offered, Msg::StageReserve { grants, .. }) => {
                self.deadline = None;
                for (index, t) in self.tensors.iter().enumerate() {
                    let Some(g) = grants.iter().find(|g| g.tensor == t.name) else {
                        let e = self.err(Some(&t.name), &"no grant for it in the reservation");
                        return self.fail(vec![t.name.clone()], e, true);
                    };
                    if g.grant.len < t.byte_length {
                        let e = self.err(
                            Some(&t.name),
                            &format!("grant of {} bytes for {} bytes", g.grant.len, t.byte_length),
                        );
                        return self.fail(vec![t.name.clone()], e, true);
                    }
                    self.grants[index] = Some(g.grant.clone());
                }
                self.state = ProducerState::Writing;
                for (index, t) in self.tensors.iter().enumerate() {
                    self.in_flight[index] = true;
                    self.actions.push_back(ProducerAction::Write {
                        index,
                        tensor: t.name.clone(),
                        grant: self.grants[index].clone().expect("granted above"),
                    });
                }
            }
            (ProducerState::Offered, Msg::Refuse { cause, kind, .. }) => {
                // What made the consumer refuse (a full pool, ...), else a plain refusal.
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
            (ProducerState::Writing, m @ (Msg::Refuse { .. } | Msg::Error { .. })) => {
                // The consumer withdrew (its grants are revoked or about to be): the writes
                // in flight may land or fail, but no packet may announce them.
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
            Some(d) if now >= d && self.state == ProducerState::Offered => {
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

    /// Tensor `index` is staged: its bytes' digest (the packet declares it).
    pub fn staged(&mut self, index: usize, digest: Digest128) {
        if let Some(d) = self.digests.get_mut(index) {
            *d = Some(digest);
        }
    }

    /// Staging tensor `index` failed before its write was issued.
    pub fn stage_failed(&mut self, index: usize, e: HarnessError) {
        self.write_failed(Some(index), e);
    }

    /// The write of tensor `index` completed.
    pub fn write_completed(&mut self, now: Instant, index: usize) {
        if self.state != ProducerState::Writing
            || !self.in_flight.get(index).copied().unwrap_or(false)
        {
            self.stale += 1;
            return;
        }
        self.in_flight[index] = false;
        self.written[index] = true;
        self.settle(now);
    }

    /// A write failed (a revoked grant, a dead peer, ...): `index`, the tensor it names,
    /// if the failure names one.
    pub fn write_failed(&mut self, index: Option<usize>, e: HarnessError) {
        if self.state != ProducerState::Writing {
            self.stale += 1;
            return;
        }
        let name = index
            .and_then(|i| self.tensors.get(i))
            .map(|t| t.name.clone());
        // The consumer must hear now; the rest of the batch is the driver's to cancel.
        self.in_flight.iter_mut().for_each(|f| *f = false);
        self.fail(name.into_iter().collect(), e, true);
    }

    /// Announces the packet once no write is in flight and every tensor landed.
    fn settle(&mut self, now: Instant) {
        if self.state != ProducerState::Writing || self.in_flight.iter().any(|&f| f) {
            return;
        }
        if let Some(e) = self.withdrawn.take() {
            return self.fail(vec![], e, false);
        }
        if !self.written.iter().all(|&w| w) {
            return;
        }
        self.announce(now, Some(()), vec![]);
    }

    /// Sends the packet: entries with their digests and, when written (`written`), where
    /// each went; `inline`: the tensors themselves.
    fn announce(&mut self, now: Instant, written: Option<()>, inline: Vec<u8>) {
        let mut entries = Vec::with_capacity(self.tensors.len());
        for (i, t) in self.tensors.iter().enumerate() {
            let Some(digest) = self.digests[i] else {
                let e = self.err(Some(&t.name), &"written but never staged (no digest)");
                return self.fail(vec![t.name.clone()], e, true);
            };
            let transfer_key = match (written, &self.grants[i]) {
                (Some(()), Some(g)) => Some(omnirig_fixtures::packet::TransferKey::Text(format!(
                    "{}/{}@{}",
                    g.segment, g.buffer, g.offset
                ))),
                _ => None,
            };
            entries.push(TensorEntry {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                byte_length: t.byte_length,
                digest,
                transfer_key,
            });
        }
        let packet = Packet::new(&self.rid, self.kind, 0, true, entries);
        let bytes = match &self.sidecar_override {
            Some(f) => (f.0)(packet),
            None => match packet.to_msgpack() {
                Ok(b) => b,
                Err(e) => {
                    let e = self.err(None, &e);
                    return self.fail(vec![], e, true);
                }
            },
        };
        self.state = ProducerState::Announced;
        self.release_offer();
        self.actions.push_back(ProducerAction::Send(Msg::Packet {
            request: self.rid.clone(),
            writing_us: micros_since(self.offered_at, now),
            packet: bytes,
            inline,
        }));
        self.actions.push_back(ProducerAction::Done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnirig_fixtures::{DType, ValueRange};

    const TIMEOUT: Duration = Duration::from_secs(5);

    fn tensors() -> Vec<TensorSpec> {
        vec![
            TensorSpec::new(
                "codes.audio",
                DType::I64,
                vec![4, 16],
                ValueRange::Below(2048),
            )
            .expect("valid spec"),
            TensorSpec::new("embed.tts_pad", DType::BF16, vec![1, 8], ValueRange::Any)
                .expect("valid spec"),
        ]
    }

    fn grant(offset: u64, len: u64) -> Grant {
        Grant {
            segment: "code2wav".into(),
            buffer: 1,
            offset,
            len,
            epoch: 1,
            token: 7 + offset,
            access: omnirig_transports::Access::Write,
            keys: vec![],
        }
    }

    /// Both ends of one hop and a clock that moves only when told.
    struct Pair {
        now: Instant,
        consumer: PacketConsumer,
        producer: PacketProducer,
        /// Consumer -> producer messages, not yet delivered.
        to_producer: Vec<Msg>,
        to_consumer: Vec<Msg>,
        revoked: Vec<Grant>,
        verify: Vec<(usize, String)>,
        writes: Vec<(usize, Grant)>,
        /// Inline tensors the consumer copied into its pool: (index, offset, bytes).
        landed: Vec<(usize, u64, Vec<u8>)>,
        consumer_end: Option<std::result::Result<(), HarnessError>>,
        producer_end: Option<std::result::Result<(), HarnessError>>,
    }

    fn digest_of(i: usize) -> Digest128 {
        Digest128(0x1000 + i as u128)
    }

    impl Pair {
        fn new() -> Self {
            let now = Instant::now();
            let rid = "r1";
            let kind = PayloadKind::TalkerToCode2wav;
            Self {
                now,
                consumer: PacketConsumer::new(kind, rid, tensors(), TIMEOUT),
                producer: PacketProducer::new(now, kind, rid, tensors(), TIMEOUT),
                to_producer: vec![],
                to_consumer: vec![],
                revoked: vec![],
                verify: vec![],
                writes: vec![],
                landed: vec![],
                consumer_end: None,
                producer_end: None,
            }
        }

        /// Carries out what both machines asked for, except delivering messages and
        /// completing writes (the tests order those by hand).
        fn pump(&mut self) {
            self.pump_producer();
            self.pump_consumer();
        }

        fn pump_producer(&mut self) {
            while let Some(a) = self.producer.poll_action() {
                match a {
                    ProducerAction::Send(m) => self.to_consumer.push(m),
                    ProducerAction::Write { index, grant, .. } => {
                        self.producer.staged(index, digest_of(index));
                        self.writes.push((index, grant));
                    }
                    ProducerAction::Inline => {
                        let (at, span) = packet_layout(tensors().iter().map(|t| &t.byte_length));
                        let mut bytes = vec![0u8; span as usize];
                        for (i, (t, a)) in tensors().iter().zip(at).enumerate() {
                            self.producer.staged(i, digest_of(i));
                            let a = a as usize;
                            bytes[a..a + t.byte_length as usize].fill(0x10 + i as u8);
                        }
                        self.producer.inlined(self.now, bytes);
                    }
                    ProducerAction::Done => self.producer_end = Some(Ok(())),
                    ProducerAction::Failed(e) => self.producer_end = Some(Err(e)),
                }
            }
        }

        fn pump_consumer(&mut self) {
            while let Some(a) = self.consumer.poll_action() {
                match a {
                    ConsumerAction::Reserve => {
                        let made: Vec<Grant> = tensors()
                            .iter()
                            .enumerate()
                            .map(|(i, t)| grant(i as u64 * 4096, t.byte_length))
                            .collect();
                        let offsets = made.iter().map(|g| g.offset).collect();
                        self.consumer.granted(self.now, made.clone(), made, offsets);
                    }
                    ConsumerAction::Send(m) => self.to_producer.push(m),
                    ConsumerAction::Revoke(g) => {
                        self.revoked.extend(g);
                        self.consumer.fenced(self.now);
                    }
                    ConsumerAction::Land {
                        index,
                        offset,
                        bytes,
                    } => self.landed.push((index, offset, bytes)),
                    ConsumerAction::Verify { index, tensor, .. } => {
                        self.verify.push((index, tensor))
                    }
                    ConsumerAction::Done => self.consumer_end = Some(Ok(())),
                    ConsumerAction::Failed(e) => self.consumer_end = Some(Err(e)),
                }
            }
        }

        /// Delivers every queued message, both ways, once.
        fn deliver(&mut self) {
            for m in std::mem::take(&mut self.to_consumer) {
                self.consumer.handle_msg(self.now, m);
            }
            for m in std::mem::take(&mut self.to_producer) {
                self.producer.handle_msg(self.now, m);
            }
            self.pump();
        }

        /// Offer -> reservation -> writes issued (not completed).
        fn run_until_writing(&mut self) {
            self.pump();
            self.deliver(); // offer -> consumer reserves and grants
            self.deliver(); // reservation -> producer writes
            assert_eq!(self.producer.state(), ProducerState::Writing);
            assert_eq!(self.writes.len(), 2);
        }

        fn complete_writes(&mut self) {
            for (i, _) in std::mem::take(&mut self.writes) {
                self.producer.write_completed(self.now, i);
            }
            self.pump();
        }

        fn verify_all(&mut self) {
            for (i, _) in std::mem::take(&mut self.verify) {
                self.consumer.verified(self.now, i, Ok(digest_of(i)));
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
    fn a_clean_handoff_fences_then_verifies_every_tensor() {
        let mut p = Pair::new();
        p.run_until_writing();
        assert!(
            p.revoked.is_empty(),
            "nothing revoked while writes may land"
        );
        p.complete_writes();
        assert_eq!(p.producer_end.as_ref().map(|r| r.is_ok()), Some(true));
        p.deliver();
        // The fence comes with the packet: both grants revoked before any verification.
        assert_eq!(p.revoked.len(), 2);
        let names: Vec<_> = p.verify.iter().map(|v| v.1.as_str()).collect();
        assert_eq!(names, ["codes.audio", "embed.tts_pad"]);
        assert_eq!(p.consumer.state(), ConsumerState::Verifying);
        p.verify_all();
        assert_eq!(p.consumer_end.as_ref().map(|r| r.is_ok()), Some(true));
        assert!(p.consumer.times().handoff() >= p.consumer.times().transfer());
    }

    #[test]
    fn landed_bytes_that_differ_from_the_packet_fail_corrupt_naming_the_tensor() {
        let mut p = Pair::new();
        p.run_until_writing();
        p.complete_writes();
        p.deliver();
        p.consumer.verified(p.now, 1, Ok(Digest128(1)));
        p.pump();
        let e = p.consumer_error();
        assert_eq!(e.failure_kind(), FailureKind::Corrupt);
        let text = e.to_string();
        assert!(
            text.contains("embed.tts_pad") && text.contains("r1"),
            "{text}"
        );
    }

    #[test]
    fn a_grant_after_the_timeout_is_never_written() {
        let mut p = Pair::new();
        p.pump();
        p.deliver(); // offer reaches the consumer, which reserves and grants ...
        assert_eq!(p.to_producer.len(), 1);
        // ... but the reservation reaches the producer only after its deadline.
        p.now += TIMEOUT + Duration::from_millis(1);
        let due = p
            .producer
            .poll_timeout()
            .expect("the offer's deadline runs");
        assert!(p.now >= due);
        p.producer.handle_timeout(p.now);
        p.pump();
        let e = match &p.producer_end {
            Some(Err(e)) => e,
            other => panic!("{other:?}"),
        };
        assert_eq!(e.failure_kind(), FailureKind::TimedOut);
        // The producer said so (ERROR), so the consumer need not wait out its own deadline.
        let producer_error_sent = p.to_consumer.iter().any(|m| matches!(m, Msg::Error { .. }));
        assert!(producer_error_sent);
        p.deliver();
        assert!(
            p.writes.is_empty(),
            "a grant that came too late was written into"
        );
        assert_eq!(
            p.producer.stale(),
            1,
            "the late reservation is counted as stale"
        );
        // The consumer ends with the producer's error and revokes what it granted.
        assert_eq!(p.consumer_error().failure_kind(), FailureKind::TimedOut);
        assert_eq!(p.revoked.len(), 2);
    }

    #[test]
    fn the_consumer_times_out_revokes_and_ignores_a_late_packet() {
        let mut p = Pair::new();
        p.run_until_writing();
        p.now += TIMEOUT;
        p.consumer.handle_timeout(p.now);
        p.pump();
        assert_eq!(p.consumer_error().failure_kind(), FailureKind::TimedOut);
        assert_eq!(p.revoked.len(), 2, "both grants revoked at the timeout");
        p.complete_writes();
        p.deliver(); // the packet arrives late
        assert!(p.verify.is_empty(), "a late packet must not be verified");
        assert_eq!(p.consumer.stale(), 1);
        assert_eq!(p.consumer.state(), ConsumerState::Failed);
    }

    #[test]
    fn a_duplicate_packet_is_ignored_after_the_handoff() {
        let mut p = Pair::new();
        p.run_until_writing();
        p.complete_writes();
        let dup = p.to_consumer.clone();
        p.deliver();
        p.verify_all();
        assert_eq!(p.consumer_end.as_ref().map(|r| r.is_ok()), Some(true));
        let revoked = p.revoked.len();
        p.to_consumer = dup;
        p.deliver();
        assert_eq!(p.consumer.stale(), 1);
        assert!(
            p.verify.is_empty(),
            "a duplicate packet started a second verification"
        );
        assert_eq!(p.revoked.len(), revoked);
        assert_eq!(p.consumer.state(), ConsumerState::Done);
    }

    #[test]
    fn a_duplicate_packet_while_verifying_fails_the_handoff() {
        let mut p = Pair::new();
        p.run_until_writing();
        p.complete_writes();
        let dup = p.to_consumer.clone();
        p.deliver();
        p.to_consumer = dup;
        p.deliver();
        let text = p.consumer_error().to_string();
        assert!(text.contains("unexpected packet"), "{text}");
    }

    #[test]
    fn no_packet_is_announced_before_the_last_write_completes() {
        let mut p = Pair::new();
        p.run_until_writing();
        let (first, _) = p.writes.remove(0);
        p.producer.write_completed(p.now, first);
        p.pump();
        assert!(
            p.to_consumer.is_empty(),
            "packet announced with a write in flight"
        );
        assert_eq!(p.producer.state(), ProducerState::Writing);
        // A completion reported twice is not the other write's.
        p.producer.write_completed(p.now, first);
        p.pump();
        assert!(p.to_consumer.is_empty());
        assert_eq!(p.producer.stale(), 1);
        p.complete_writes();
        assert!(matches!(p.to_consumer.as_slice(), [Msg::Packet { .. }]));
    }

    #[test]
    fn a_grant_revoked_while_a_write_is_in_flight_ends_in_error_not_packet() {
        let mut p = Pair::new();
        p.run_until_writing();
        // The consumer times out with both writes in flight and revokes its grants.
        p.now += TIMEOUT;
        p.consumer.handle_timeout(p.now);
        p.pump();
        assert_eq!(p.revoked.len(), 2);
        // The engine refuses the second write into the revoked grant; the first landed.
        let (a, _) = p.writes.remove(0);
        let (b, _) = p.writes.remove(0);
        p.producer.write_completed(p.now, a);
        let revoked = omnirig_transports::Error::new(
            omnirig_transports::ErrorKind::GrantRevoked,
            "grant revoked",
        );
        let e = HarnessError::handoff(
            PayloadKind::TalkerToCode2wav,
            "r1",
            Some("embed.tts_pad"),
            &revoked,
        );
        p.producer.write_failed(Some(b), e);
        p.pump();
        match p.to_consumer.as_slice() {
            [Msg::Error { failed, kind, .. }] => {
                assert_eq!(failed, &["embed.tts_pad".to_string()]);
                assert_eq!(*kind, FailureKind::GrantRefused);
            }
            other => panic!("expected one ERROR, got {other:?}"),
        }
        assert!(
            matches!(&p.producer_end, Some(Err(e)) if e.failure_kind() == FailureKind::GrantRefused)
        );
    }

    #[test]
    fn a_consumer_that_withdraws_mid_write_gets_no_packet() {
        let mut p = Pair::new();
        p.run_until_writing();
        p.producer.handle_msg(
            p.now,
            Msg::Refuse {
                request: "r1".into(),
                cause: "shutting down".into(),
                kind: FailureKind::Refused,
            },
        );
        p.pump();
        assert!(
            p.producer_end.is_none(),
            "ended with writes still in flight"
        );
        p.complete_writes();
        assert!(
            p.to_consumer.is_empty(),
            "a packet announced writes the consumer withdrew from"
        );
        assert!(
            matches!(&p.producer_end, Some(Err(e)) if e.failure_kind() == FailureKind::Refused)
        );
    }

    #[test]
    fn a_packet_for_another_request_is_a_bad_sidecar_and_still_fences() {
        let mut p = Pair::new();
        p.run_until_writing();
        p.producer = PacketProducer::new(
            p.now,
            PayloadKind::TalkerToCode2wav,
            "other",
            tensors(),
            TIMEOUT,
        );
        p.pump();
        p.to_consumer.clear();
        let grants = tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| NamedGrant {
                tensor: t.name.clone(),
                grant: grant(i as u64 * 4096, t.byte_length),
            })
            .collect();
        p.producer.handle_msg(
            p.now,
            Msg::StageReserve {
                request: "other".into(),
                grants,
            },
        );
        p.pump();
        p.complete_writes();
        p.deliver();
        assert_eq!(p.consumer_error().failure_kind(), FailureKind::BadSidecar);
        assert_eq!(p.revoked.len(), 2);
    }

    #[test]
    fn a_short_grant_is_refused_before_any_write() {
        let mut p = Pair::new();
        p.pump();
        p.to_consumer.clear();
        let grants = vec![
            NamedGrant {
                tensor: "codes.audio".into(),
                grant: grant(0, 1),
            },
            NamedGrant {
                tensor: "embed.tts_pad".into(),
                grant: grant(4096, 16),
            },
        ];
        p.producer.handle_msg(
            p.now,
            Msg::StageReserve {
                request: "r1".into(),
                grants,
            },
        );
        p.pump();
        assert!(p.writes.is_empty());
        assert!(
            matches!(p.to_consumer.as_slice(), [Msg::Error { failed, .. }] if failed == &["codes.audio".to_string()])
        );
    }

    // ---- credits: the consumer grants ahead of the offer

    const WAIT: Duration = Duration::from_secs(30);

    impl Pair {
        /// The consumer grants ahead (a credit) while the producer offers: both cross.
        fn run_with_credit_until_writing(&mut self) {
            self.consumer.credit(self.now, WAIT);
            self.pump(); // producer: offer; consumer: reserve + grant (the credit)
            assert_eq!(self.consumer.state(), ConsumerState::Granted);
            self.deliver(); // the offer and the credit cross
            assert_eq!(self.producer.state(), ProducerState::Writing);
            assert_eq!(self.writes.len(), 2);
        }
    }

    #[test]
    fn a_credit_takes_the_reservation_off_the_handoff() {
        let mut p = Pair::new();
        p.run_with_credit_until_writing();
        let t = p.consumer.times();
        assert_eq!(
            t.reserve(),
            Duration::ZERO,
            "granted ahead: no reserve phase"
        );
        p.now += Duration::from_millis(3);
        p.complete_writes();
        p.deliver();
        assert_eq!(p.revoked.len(), 2, "the fence revokes the credit's grants");
        p.verify_all();
        assert_eq!(p.consumer_end.as_ref().map(|r| r.is_ok()), Some(true));
        let t = p.consumer.times();
        assert_eq!(t.reserve(), Duration::ZERO);
        assert_eq!(t.transfer(), Duration::from_millis(3));
    }

    impl Pair {
        /// The credit reached the producer before it looked at its link: the reservation is
        /// fed in before its first action.
        fn credit_before_the_first_poll(&mut self) {
            self.consumer.credit(self.now, WAIT);
            self.pump_consumer();
            for m in std::mem::take(&mut self.to_producer) {
                self.producer.handle_msg(self.now, m);
            }
            self.pump();
        }
    }

    #[test]
    fn a_credit_already_there_starts_the_writes_and_the_offer_leaves_with_the_packet() {
        let mut p = Pair::new();
        p.credit_before_the_first_poll();
        assert_eq!(p.producer.state(), ProducerState::Writing);
        assert_eq!(p.writes.len(), 2, "both writes issued at once");
        assert!(
            p.to_consumer.is_empty(),
            "nothing wakes the consumer mid-write"
        );
        assert!(!p.producer.offer_sent());
        p.now += Duration::from_millis(4);
        p.complete_writes();
        assert!(
            matches!(
                p.to_consumer.as_slice(),
                [
                    Msg::Offer { .. },
                    Msg::Packet {
                        writing_us: 4000,
                        ..
                    }
                ]
            ),
            "{:?}",
            p.to_consumer
        );
        assert_eq!(p.producer_end.as_ref().map(|r| r.is_ok()), Some(true));
        p.deliver();
        assert_eq!(p.revoked.len(), 2, "the fence revokes the credit's grants");
        p.verify_all();
        assert_eq!(p.consumer_end.as_ref().map(|r| r.is_ok()), Some(true));
        // Dated from the producer's offer, though the consumer saw it with the packet.
        let t = p.consumer.times();
        assert_eq!(t.transfer(), Duration::from_millis(4));
        assert_eq!(t.reserve(), Duration::ZERO);
        assert_eq!(t.handoff(), Duration::from_millis(4));
    }

    #[test]
    fn a_held_offer_leaves_before_the_error_of_a_failed_write() {
        let mut p = Pair::new();
        p.credit_before_the_first_poll();
        let (_, _) = p.writes.remove(0);
        let (b, _) = p.writes.remove(0);
        let dead = omnirig_transports::Error::new(
            omnirig_transports::ErrorKind::PeerDisconnected,
            "peer gone",
        );
        let e = HarnessError::handoff(
            PayloadKind::TalkerToCode2wav,
            "r1",
            Some("embed.tts_pad"),
            &dead,
        );
        p.producer.write_failed(Some(b), e);
        p.pump();
        assert!(
            matches!(
                p.to_consumer.as_slice(),
                [Msg::Offer { .. }, Msg::Error { failed, .. }] if failed == &["embed.tts_pad".to_string()]
            ),
            "{:?}",
            p.to_consumer
        );
        p.deliver();
        let f = crate::report::Failure::of(p.consumer_error());
        assert_eq!(f.kind, FailureKind::PeerDisconnected, "the producer's kind");
        assert_eq!(f.tensor.as_deref(), Some("embed.tts_pad"));
        assert_eq!(p.revoked.len(), 2, "the credit's grants are revoked");
        assert!(p.verify.is_empty(), "nothing verified after an ERROR");
    }

    #[test]
    fn an_offer_seen_late_dates_the_handoff_from_the_producers_offer() {
        let mut p = Pair::new();
        p.consumer.credit(p.now, WAIT);
        p.pump();
        // The credit reaches the producer, which writes for 5 ms; the consumer, busy, sees
        // the offer only with the packet.
        let offer = std::mem::take(&mut p.to_consumer);
        p.deliver();
        p.now += Duration::from_millis(5);
        p.complete_writes();
        let packet = std::mem::take(&mut p.to_consumer);
        p.to_consumer = offer.into_iter().chain(packet).collect();
        p.deliver();
        p.verify_all();
        assert_eq!(p.consumer_end.as_ref().map(|r| r.is_ok()), Some(true));
        // The reply wait covers the producer's 5 ms of writing, not the 0 ms it saw.
        assert_eq!(p.consumer.times().transfer(), Duration::from_millis(5));
        assert_eq!(p.consumer.times().reserve(), Duration::ZERO);
    }

    #[test]
    fn a_credit_revoked_while_a_write_is_in_flight_ends_in_error_not_packet() {
        let mut p = Pair::new();
        p.run_with_credit_until_writing();
        // The hop's deadline runs from the offer: the consumer gives up with both writes in
        // flight and revokes the credit.
        let due = p
            .consumer
            .poll_timeout()
            .expect("the offer started the deadline");
        assert_eq!(due, p.now + TIMEOUT);
        p.now = due;
        p.consumer.handle_timeout(p.now);
        p.pump();
        assert_eq!(p.consumer_error().failure_kind(), FailureKind::TimedOut);
        assert_eq!(p.revoked.len(), 2);
        // One write had landed; the engine refuses the other (its grant is gone).
        let (a, _) = p.writes.remove(0);
        let (b, _) = p.writes.remove(0);
        p.producer.write_completed(p.now, a);
        let revoked = omnirig_transports::Error::new(
            omnirig_transports::ErrorKind::GrantRevoked,
            "grant revoked",
        );
        let e = HarnessError::handoff(
            PayloadKind::TalkerToCode2wav,
            "r1",
            Some("embed.tts_pad"),
            &revoked,
        );
        p.producer.write_failed(Some(b), e);
        p.pump();
        assert!(
            !p.to_consumer
                .iter()
                .any(|m| matches!(m, Msg::Packet { .. })),
            "a packet announced a write into a revoked credit"
        );
        assert!(
            matches!(&p.producer_end, Some(Err(e)) if e.failure_kind() == FailureKind::GrantRefused)
        );
        p.deliver();
        assert!(p.verify.is_empty());
        assert_eq!(
            p.consumer.stale(),
            1,
            "the producer's ERROR came after the end"
        );
    }

    #[test]
    fn a_credit_whose_offer_never_comes_is_revoked_and_upstream_told() {
        let mut p = Pair::new();
        p.producer.poll_action(); // the producer's offer is lost upstream of it
        p.consumer.credit(p.now, WAIT);
        p.pump();
        assert_eq!(p.consumer.poll_timeout(), Some(p.now + WAIT));
        // Not yet: the hop's (shorter) timeout does not apply before the offer.
        p.now += TIMEOUT;
        p.consumer.handle_timeout(p.now);
        p.pump();
        assert!(p.consumer_end.is_none());
        p.now += WAIT;
        p.consumer.handle_timeout(p.now);
        p.pump();
        let e = p.consumer_error();
        assert_eq!(e.failure_kind(), FailureKind::TimedOut);
        assert!(e.to_string().contains("no offer"), "{e}");
        assert_eq!(p.revoked.len(), 2, "the credit's grants are revoked");
        // Upstream hears it after the credit: a producer that comes late is refused.
        assert!(matches!(
            p.to_producer.as_slice(),
            [Msg::StageReserve { .. }, Msg::Refuse { .. }]
        ));
    }

    #[test]
    fn a_credit_whose_upstream_failed_is_revoked_with_upstreams_kind() {
        let mut p = Pair::new();
        p.producer.poll_action();
        p.consumer.credit(p.now, WAIT);
        p.pump();
        p.consumer.handle_msg(
            p.now,
            Msg::Error {
                request: "r1".into(),
                failed: vec![],
                cause: "talker did not run".into(),
                kind: FailureKind::Corrupt,
                peer: None,
            },
        );
        p.pump();
        assert_eq!(p.consumer_error().failure_kind(), FailureKind::Corrupt);
        assert_eq!(p.revoked.len(), 2);
    }

    #[test]
    fn a_packet_before_a_credits_offer_is_refused_and_fenced() {
        let mut p = Pair::new();
        p.run_with_credit_until_writing();
        // A second consumer, granted ahead, gets that packet without its offer.
        let mut c = PacketConsumer::new(PayloadKind::TalkerToCode2wav, "r1", tensors(), TIMEOUT);
        c.credit(p.now, WAIT);
        assert!(matches!(c.poll_action(), Some(ConsumerAction::Reserve)));
        let made = vec![grant(0, 512), grant(4096, 16)];
        c.granted(p.now, made.clone(), made, vec![0, 4096]);
        p.complete_writes();
        let packet = p
            .to_consumer
            .iter()
            .find(|m| matches!(m, Msg::Packet { .. }))
            .cloned()
            .expect("the real producer's packet");
        c.handle_msg(p.now, packet);
        let mut revoked = 0;
        let mut failed = None;
        while let Some(a) = c.poll_action() {
            match a {
                ConsumerAction::Revoke(g) => revoked += g.len(),
                ConsumerAction::Failed(e) => failed = Some(e),
                ConsumerAction::Verify { .. } => panic!("verified a packet without its offer"),
                _ => {}
            }
        }
        assert_eq!(revoked, 2);
        let e = failed.expect("the handoff failed");
        assert_eq!(e.failure_kind(), FailureKind::BadSidecar);
        assert!(e.to_string().contains("before its offer"), "{e}");
    }

    #[test]
    fn a_producer_that_offers_before_the_credit_is_granted_waits_in_the_reserve_phase() {
        let mut p = Pair::new(); // the producer offers at 0 ms
        p.consumer.credit(p.now, WAIT);
        p.now += Duration::from_millis(2);
        p.pump(); // the consumer grants at 2 ms
        p.deliver(); // and sees the offer then
        p.now += Duration::from_millis(3);
        p.complete_writes(); // the packet leaves 5 ms after the offer
        p.deliver();
        p.verify_all();
        let t = p.consumer.times();
        assert_eq!(
            (t.reserve(), t.transfer()),
            (Duration::from_millis(2), Duration::from_millis(3))
        );
    }

    // ---- inline: a small packet carries its tensors

    fn inline_producer(now: Instant) -> PacketProducer {
        PacketProducer::new(now, PayloadKind::TalkerToCode2wav, "r1", tensors(), TIMEOUT)
            .with_inline_below(1 << 20)
    }

    #[test]
    fn a_small_packet_travels_inline_and_lands_where_the_credit_points() {
        let mut p = Pair::new();
        p.producer = inline_producer(p.now);
        p.consumer.credit(p.now, WAIT);
        p.pump();
        // Offer and packet left back to back, without waiting for the credit.
        assert!(matches!(
            p.to_consumer.as_slice(),
            [Msg::Offer { .. }, Msg::Packet { inline, .. }] if !inline.is_empty()
        ));
        assert_eq!(p.producer_end.as_ref().map(|r| r.is_ok()), Some(true));
        p.deliver();
        assert!(p.writes.is_empty(), "an inline packet writes nothing");
        assert_eq!(
            p.producer.stale(),
            1,
            "the credit reached a producer that was done"
        );
        assert_eq!(p.revoked.len(), 2, "the unused credit is revoked");
        // Each tensor lands at its grant's offset, with its own bytes.
        let landed: Vec<_> = p
            .landed
            .iter()
            .map(|(i, off, b)| (*i, *off, b.len(), b.iter().all(|&x| x == 0x10 + *i as u8)))
            .collect();
        assert_eq!(landed, [(0, 0, 512, true), (1, 4096, 16, true)]);
        p.verify_all();
        assert_eq!(p.consumer_end.as_ref().map(|r| r.is_ok()), Some(true));
    }

    #[test]
    fn an_inline_packet_after_a_reservation_on_the_offer_lands_too() {
        let mut p = Pair::new();
        p.producer = inline_producer(p.now);
        p.pump();
        let mut msgs = std::mem::take(&mut p.to_consumer);
        let packet = msgs.pop().expect("offer and packet");
        p.to_consumer = msgs;
        p.deliver(); // the offer: the consumer reserves and grants
        assert_eq!(p.consumer.state(), ConsumerState::Granted);
        p.to_consumer = vec![packet];
        p.deliver();
        assert_eq!(p.landed.len(), 2);
        p.verify_all();
        assert_eq!(p.consumer_end.as_ref().map(|r| r.is_ok()), Some(true));
    }

    #[test]
    fn an_inline_payload_that_does_not_span_the_layout_is_refused_before_landing() {
        let mut p = Pair::new();
        p.producer = inline_producer(p.now);
        p.consumer.credit(p.now, WAIT);
        p.pump();
        for m in &mut p.to_consumer {
            if let Msg::Packet { inline, .. } = m {
                inline.truncate(100);
            }
        }
        p.deliver();
        assert!(
            p.landed.is_empty(),
            "bytes landed from a short inline payload"
        );
        let e = p.consumer_error();
        assert_eq!(e.failure_kind(), FailureKind::BadSidecar);
        assert!(e.to_string().contains("inline payload of 100 bytes"), "{e}");
        assert_eq!(p.revoked.len(), 2);
    }

    #[test]
    fn a_packet_larger_than_the_inline_threshold_is_written() {
        let mut p = Pair::new();
        p.producer = PacketProducer::new(
            p.now,
            PayloadKind::TalkerToCode2wav,
            "r1",
            tensors(),
            TIMEOUT,
        )
        .with_inline_below(64);
        p.run_until_writing();
        p.complete_writes();
        assert!(matches!(
            p.to_consumer.as_slice(),
            [Msg::Packet { inline, .. }] if inline.is_empty()
        ));
    }

    #[test]
    fn the_sidecar_is_read_only_once_the_grants_are_revoked() {
        let mut p = Pair::new();
        p.run_until_writing();
        p.complete_writes();
        let packet = p.to_consumer.pop().expect("the packet");
        p.consumer.handle_msg(p.now, packet);
        assert!(matches!(
            p.consumer.poll_action(),
            Some(ConsumerAction::Revoke(g)) if g.len() == 2
        ));
        assert_eq!(p.consumer.state(), ConsumerState::Fencing);
        assert!(
            p.consumer.poll_action().is_none(),
            "verification asked for before the fence"
        );
        p.now += Duration::from_micros(10);
        p.consumer.fenced(p.now);
        p.pump();
        assert_eq!(p.verify.len(), 2);
        p.verify_all();
        let t = p.consumer.times();
        assert_eq!(t.phases(p.now).fence, 0.01);
    }
}
