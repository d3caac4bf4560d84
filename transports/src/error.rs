//! The crate's one error type.
//!
//! Every error carries an [`ErrorKind`] (what went wrong, stable enough to match on and to
//! send over the wire as a code), a human detail, and the context it concerns: the peer, the
//! batch and task, and the grant. Tests match on `kind()`; people read `Display`.

use std::fmt;

/// What went wrong. Each kind has a stable wire code so a remote refusal arrives as the same kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[repr(u16)]
pub enum ErrorKind {
    /// A length or offset is zero where it must not be, overflows, or is out of range.
    #[error("invalid length")]
    InvalidLength = 1,
    /// The range falls outside the grant it names.
    #[error("range outside grant")]
    OutOfGrant = 2,
    /// The range falls outside the registered buffer.
    #[error("range outside buffer")]
    OutOfBuffer = 3,
    /// The grant was revoked (explicitly, by expiry, or because its engine shut down).
    #[error("grant revoked")]
    GrantRevoked = 4,
    /// No such grant in this engine (never issued, or already released).
    #[error("unknown grant")]
    UnknownGrant = 5,
    /// The grant's token does not match.
    #[error("grant token mismatch")]
    BadToken = 6,
    /// The grant does not permit this access (a write to a read grant or the reverse).
    #[error("access not permitted by grant")]
    AccessDenied = 7,
    /// A segment name nobody published.
    #[error("unknown segment")]
    UnknownSegment = 8,
    /// A buffer id this engine does not have registered.
    #[error("unknown buffer")]
    UnknownBuffer = 9,
    /// The buffer has live grants or transfers in flight, so it cannot be unregistered.
    #[error("buffer busy")]
    BufferBusy = 10,
    /// The range overlaps a live grant that excludes it.
    #[error("range overlaps a live grant")]
    GrantOverlap = 11,
    /// A frame or descriptor from the network failed validation.
    #[error("malformed input")]
    Malformed = 12,
    /// The peer closed the connection or its engine went away.
    #[error("peer disconnected")]
    PeerDisconnected = 13,
    /// The peer could not be reached at all.
    #[error("peer unreachable")]
    Unreachable = 14,
    /// An operating-system I/O error.
    #[error("i/o error")]
    Io = 15,
    /// The deadline passed.
    #[error("timed out")]
    TimedOut = 16,
    /// The batch was freed or dropped before the task finished.
    #[error("canceled")]
    Canceled = 17,
    /// The engine is shut down.
    #[error("engine closed")]
    EngineClosed = 18,
    /// A name is already taken (an engine name in a metadata store).
    #[error("duplicate name")]
    DuplicateName = 19,
    /// The metadata store failed or is unavailable.
    #[error("metadata store error")]
    Metadata = 20,
    /// Configuration or memory allocation failed.
    #[error("resource error")]
    Resource = 21,
    /// No transport can reach the peer under the engine's policy.
    #[error("no transport")]
    NoTransport = 22,
}

impl ErrorKind {
    /// The code sent over the wire.
    pub fn code(self) -> u16 {
        self as u16
    }

    /// Decodes a wire code; unknown codes become `None` (the caller reports them as malformed).
    pub fn from_code(code: u16) -> Option<Self> {
        use ErrorKind::*;
        const ALL: [ErrorKind; 22] = [
            InvalidLength,
            OutOfGrant,
            OutOfBuffer,
            GrantRevoked,
            UnknownGrant,
            BadToken,
            AccessDenied,
            UnknownSegment,
            UnknownBuffer,
            BufferBusy,
            GrantOverlap,
            Malformed,
            PeerDisconnected,
            Unreachable,
            Io,
            TimedOut,
            Canceled,
            EngineClosed,
            DuplicateName,
            Metadata,
            Resource,
            NoTransport,
        ];
        ALL.into_iter().find(|k| k.code() == code)
    }
}

/// The grant an error concerns, as `segment#epoch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantName {
    pub segment: String,
    pub epoch: u64,
}

/// What an error concerns. Filled in as the error travels up: the transport knows the peer,
/// the batch driver adds the batch and task.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ErrorContext {
    pub peer: Option<String>,
    pub batch: Option<u64>,
    pub task: Option<usize>,
    pub grant: Option<GrantName>,
}

/// The engine's error: a kind, a detail and the context it concerns.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct Error {
    kind: ErrorKind,
    detail: String,
    context: ErrorContext,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            context: ErrorContext::default(),
        }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn detail(&self) -> &str {
        &self.detail
    }

    pub fn context(&self) -> &ErrorContext {
        &self.context
    }

    pub fn peer(&self) -> Option<&str> {
        self.context.peer.as_deref()
    }

    pub fn batch(&self) -> Option<u64> {
        self.context.batch
    }

    pub fn task(&self) -> Option<usize> {
        self.context.task
    }

    pub fn grant(&self) -> Option<&GrantName> {
        self.context.grant.as_ref()
    }

    /// Names the peer, unless a more specific one is already set.
    pub fn with_peer(mut self, peer: impl Into<String>) -> Self {
        self.context.peer.get_or_insert_with(|| peer.into());
        self
    }

    pub fn with_task(mut self, batch: u64, task: usize) -> Self {
        self.context.batch.get_or_insert(batch);
        self.context.task.get_or_insert(task);
        self
    }

    pub fn with_grant(mut self, segment: &str, epoch: u64) -> Self {
        self.context.grant.get_or_insert_with(|| GrantName {
            segment: segment.to_owned(),
            epoch,
        });
        self
    }

    pub(crate) fn io(err: std::io::Error, what: &str) -> Self {
        use std::io::ErrorKind as K;
        let kind = match err.kind() {
            K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::UnexpectedEof => {
                ErrorKind::PeerDisconnected
            }
            K::ConnectionRefused
            | K::AddrNotAvailable
            | K::HostUnreachable
            | K::NetworkUnreachable => ErrorKind::Unreachable,
            K::TimedOut => ErrorKind::TimedOut,
            _ => ErrorKind::Io,
        };
        Self::new(kind, format!("{what}: {err}"))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind)?;
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        let c = &self.context;
        let mut sep = " (";
        if let Some(p) = &c.peer {
            write!(f, "{sep}peer {p}")?;
            sep = ", ";
        }
        if let Some(b) = c.batch {
            write!(f, "{sep}batch {b}")?;
            sep = ", ";
        }
        if let Some(t) = c.task {
            write!(f, "{sep}task {t}")?;
            sep = ", ";
        }
        if let Some(g) = &c.grant {
            write!(f, "{sep}grant {}#{}", g.segment, g.epoch)?;
            sep = ", ";
        }
        if sep == ", " {
            write!(f, ")")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_codes_are_none() {
        for code in 0..64u16 {
            if let Some(kind) = ErrorKind::from_code(code) {
                assert_eq!(kind.code(), code);
            }
        }
        assert_eq!(ErrorKind::from_code(4), Some(ErrorKind::GrantRevoked));
        assert_eq!(ErrorKind::from_code(0), None);
        assert_eq!(ErrorKind::from_code(999), None);
    }

    #[test]
    fn display_names_everything_it_concerns() {
        let e = Error::new(ErrorKind::OutOfGrant, "offset 10 + len 8 > grant len 12")
            .with_peer("decode-0")
            .with_task(7, 3)
            .with_grant("decode-0", 42);
        assert_eq!(
            e.to_string(),
            "range outside grant: offset 10 + len 8 > grant len 12 \
             (peer decode-0, batch 7, task 3, grant decode-0#42)"
        );
        // Context already set is not overwritten by outer layers.
        let e = e.with_peer("other").with_task(1, 1);
        assert_eq!(e.peer(), Some("decode-0"));
        assert_eq!(e.task(), Some(3));
    }
}
