//! The crate's one error type. Handoff errors name hop, request, tensor and cause, and keep
//! what kind of failure the cause was ([`FailureKind`], from the engine's
//! [`omnirig_transports::ErrorKind`] or the check that failed) and the engine peer involved,
//! so reports classify from those, never from the wording of a message.

use omnirig_fixtures::FixtureError;
use omnirig_model_stubs::StubError;
use omnirig_transports::ErrorKind;
use serde::{Deserialize, Serialize};

pub type Result<T, E = HarnessError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A handoff between two stages failed (transfer, verification, refusal, timeout).
    #[error("{0}")]
    Handoff(Box<Handoff>),
    /// A scenario did not parse or is inconsistent.
    #[error("scenario {source_name}: {reason}")]
    Scenario { source_name: String, reason: String },
    /// A stage could not finish a request in the time anyone would wait for it (a modelled
    /// compute past the request timeout, a stage process that stopped answering).
    #[error("{stage}, request {request}: timed out: {reason}")]
    Deadline {
        stage: String,
        request: String,
        reason: String,
    },
    /// A control channel failed or delivered a malformed message.
    #[error("control channel {channel}: {reason}")]
    Control { channel: String, reason: String },
    /// A control channel delivered no message for a request within the wait's deadline.
    #[error("control channel {channel}: no message for {key:?} within {waited:?}")]
    ControlTimeout {
        channel: String,
        key: String,
        waited: std::time::Duration,
    },
    /// A stage's registered pool cannot hold a reservation.
    #[error("pool {pool}: {reason}")]
    Pool { pool: String, reason: String },
    /// Setting up or tearing down engines and processes.
    #[error("setup: {0}")]
    Setup(String),
    #[error("engine: {0}")]
    Engine(#[from] omnirig_transports::Error),
    #[error(transparent)]
    Fixture(#[from] FixtureError),
    #[error(transparent)]
    Stub(#[from] StubError),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// A failed handoff: which hop, request and tensor, the cause, and what kind of failure it was.
#[derive(Debug)]
pub struct Handoff {
    pub hop: String,
    pub request: String,
    pub tensor: Option<String>,
    pub cause: String,
    /// What kind of failure the cause was.
    pub kind: FailureKind,
    /// The engine peer the failing transfer talked to, when the engine named one.
    pub peer: Option<String>,
}

impl std::fmt::Display for Handoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "hop {}, request {}", self.hop, self.request)?;
        if let Some(t) = &self.tensor {
            write!(f, ", tensor {t}")?;
        }
        write!(f, ": {}", self.cause)
    }
}

/// What kind of failure ended a handoff, as reports and fault verdicts name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    TimedOut,
    PeerDisconnected,
    Unreachable,
    Io,
    /// Bytes or digests differ from what the producer made.
    Corrupt,
    /// A grant was revoked, unknown, or too small for the access.
    GrantRefused,
    PoolExhausted,
    /// A packet sidecar was malformed, for another request, or inconsistent.
    BadSidecar,
    /// The consumer refused the handoff.
    Refused,
    Metadata,
    #[default]
    Other,
}

impl FailureKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::TimedOut => "timed_out",
            FailureKind::PeerDisconnected => "peer_disconnected",
            FailureKind::Unreachable => "unreachable",
            FailureKind::Io => "io",
            FailureKind::Corrupt => "corrupt",
            FailureKind::GrantRefused => "grant_refused",
            FailureKind::PoolExhausted => "pool_exhausted",
            FailureKind::BadSidecar => "bad_sidecar",
            FailureKind::Refused => "refused",
            FailureKind::Metadata => "metadata",
            FailureKind::Other => "other",
        }
    }

    /// The kind of an engine error.
    pub fn of_engine(kind: ErrorKind) -> FailureKind {
        use ErrorKind as E;
        match kind {
            E::TimedOut => FailureKind::TimedOut,
            E::PeerDisconnected | E::EngineClosed => FailureKind::PeerDisconnected,
            E::Unreachable | E::UnknownSegment | E::NoTransport => FailureKind::Unreachable,
            E::Io => FailureKind::Io,
            E::GrantRevoked | E::UnknownGrant | E::OutOfGrant | E::BadToken | E::AccessDenied => {
                FailureKind::GrantRefused
            }
            E::Metadata => FailureKind::Metadata,
            _ => FailureKind::Other,
        }
    }
}

impl std::fmt::Display for FailureKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for FailureKind {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// A handoff's cause: its text, what kind of failure it is, and the engine peer it names.
pub trait Cause: std::fmt::Display {
    fn failure_kind(&self) -> FailureKind;
    fn failure_peer(&self) -> Option<String> {
        None
    }
}

impl Cause for omnirig_transports::Error {
    fn failure_kind(&self) -> FailureKind {
        FailureKind::of_engine(self.kind())
    }
    fn failure_peer(&self) -> Option<String> {
        self.peer().map(str::to_owned)
    }
}

impl Cause for HarnessError {
    fn failure_kind(&self) -> FailureKind {
        match self {
            HarnessError::Handoff(h) => h.kind,
            HarnessError::Pool { .. } => FailureKind::PoolExhausted,
            HarnessError::Engine(e) => e.failure_kind(),
            HarnessError::Stub(e) => e.failure_kind(),
            HarnessError::Fixture(e) => e.failure_kind(),
            HarnessError::Io(_) => FailureKind::Io,
            HarnessError::Deadline { .. } | HarnessError::ControlTimeout { .. } => {
                FailureKind::TimedOut
            }
            _ => FailureKind::Other,
        }
    }
    fn failure_peer(&self) -> Option<String> {
        match self {
            HarnessError::Handoff(h) => h.peer.clone(),
            HarnessError::Engine(e) => e.failure_peer(),
            _ => None,
        }
    }
}

impl Cause for StubError {
    fn failure_kind(&self) -> FailureKind {
        match self {
            StubError::Length { .. } | StubError::Digest { .. } | StubError::Bytes { .. } => {
                FailureKind::Corrupt
            }
            StubError::Fixture { source, .. } => source.failure_kind(),
            StubError::NotAnInput { .. } => FailureKind::Other,
        }
    }
}

impl Cause for FixtureError {
    fn failure_kind(&self) -> FailureKind {
        match self {
            FixtureError::DigestMismatch { .. } => FailureKind::Corrupt,
            _ => FailureKind::Other,
        }
    }
}

/// Plain text says nothing about its kind: `other`. Give a kind with [`Classified`].
impl Cause for String {
    fn failure_kind(&self) -> FailureKind {
        FailureKind::Other
    }
}

impl Cause for &str {
    fn failure_kind(&self) -> FailureKind {
        FailureKind::Other
    }
}

/// A cause worded here, with its kind (and peer) said explicitly.
#[derive(Debug, Clone)]
pub struct Classified {
    pub kind: FailureKind,
    pub peer: Option<String>,
    pub text: String,
}

impl Classified {
    pub fn new(kind: FailureKind, text: impl Into<String>) -> Self {
        Self {
            kind,
            peer: None,
            text: text.into(),
        }
    }

    /// New wording for `cause`, keeping its kind and peer.
    pub fn reworded(cause: &dyn Cause, text: impl Into<String>) -> Self {
        Self {
            kind: cause.failure_kind(),
            peer: cause.failure_peer(),
            text: text.into(),
        }
    }
}

impl std::fmt::Display for Classified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl Cause for Classified {
    fn failure_kind(&self) -> FailureKind {
        self.kind
    }
    fn failure_peer(&self) -> Option<String> {
        self.peer.clone()
    }
}

impl HarnessError {
    pub fn handoff(
        hop: impl std::fmt::Display,
        request: &str,
        tensor: Option<&str>,
        cause: &dyn Cause,
    ) -> Self {
        HarnessError::Handoff(Box::new(Handoff {
            hop: hop.to_string(),
            request: request.into(),
            tensor: tensor.map(Into::into),
            cause: cause.to_string(),
            kind: cause.failure_kind(),
            peer: cause.failure_peer(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Failure;

    /// The kind comes from the error, not its wording: an engine error whose text says
    /// nothing recognisable still classifies, and plain text never pretends to a kind.
    #[test]
    fn handoffs_keep_the_engine_kind_and_peer_whatever_the_wording() {
        let engine =
            omnirig_transports::Error::new(ErrorKind::GrantRevoked, "zzz").with_peer("decode-rx");
        let e = HarnessError::handoff("kv_cache", "r1", Some("kv.layer.0.k"), &engine);
        let f = Failure::of(&e);
        assert_eq!(f.kind, FailureKind::GrantRefused);
        assert_eq!(f.peer.as_deref(), Some("decode-rx"));
        assert_eq!(f.hop.as_deref(), Some("kv_cache"));
        assert_eq!(f.tensor.as_deref(), Some("kv.layer.0.k"));
        // Passed on by another handoff (the consumer's "producer reported ERROR"): kept.
        let passed = HarnessError::handoff(
            "kv_cache",
            "r1",
            None,
            &Classified::reworded(&e, format!("producer reported ERROR: {e}")),
        );
        assert_eq!(Failure::of(&passed).kind, FailureKind::GrantRefused);
        // Text that reads like a timeout is not one unless someone said so.
        let text = HarnessError::handoff("kv_cache", "r1", None, &"timed out, pool refused");
        let f = Failure::of(&text);
        assert_eq!(f.kind, FailureKind::Other);
        // No engine peer: the hop's producing stage.
        assert_eq!(f.peer.as_deref(), Some("thinker_prefill"));
        let pool = HarnessError::Pool {
            pool: "p".into(),
            reason: "full".into(),
        };
        assert_eq!(Failure::of(&pool).kind, FailureKind::PoolExhausted);
    }

    /// The report's vocabulary is the serde form of the kind.
    #[test]
    fn failure_kinds_serialise_as_their_names() {
        for k in [
            FailureKind::TimedOut,
            FailureKind::GrantRefused,
            FailureKind::BadSidecar,
            FailureKind::Other,
        ] {
            assert_eq!(
                serde_json::to_value(k).unwrap(),
                serde_json::json!(k.as_str())
            );
        }
    }
}
