//! The crate's one error type. Handoff errors name hop, request, tensor and cause.

use omnirig_fixtures::FixtureError;
use omnirig_model_stubs::StubError;

pub type Result<T, E = HarnessError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A handoff between two stages failed (transfer, verification, refusal, timeout).
    #[error("hop {hop}, request {request}{}: {cause}", tensor.as_ref().map(|t| format!(", tensor {t}")).unwrap_or_default())]
    Handoff {
        hop: String,
        request: String,
        tensor: Option<String>,
        cause: String,
    },
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

impl HarnessError {
    pub fn handoff(
        hop: impl std::fmt::Display,
        request: &str,
        tensor: Option<&str>,
        cause: impl std::fmt::Display,
    ) -> Self {
        HarnessError::Handoff {
            hop: hop.to_string(),
            request: request.into(),
            tensor: tensor.map(Into::into),
            cause: cause.to_string(),
        }
    }
}
