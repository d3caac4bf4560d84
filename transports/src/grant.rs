//! Grants: the only way a peer can touch another engine's memory.
//!
//! A receiver reserves a range of one of its buffers and hands the resulting [`Grant`] to the
//! sender over the control path. Every remote access names a grant (epoch + token) and is
//! checked here before a byte moves. Revoking fences the grant: once [`GrantTable::revoke`]
//! returns, no access under it is running and none can start, so a late write never lands.
//!
//! The table is plain state (no I/O): transports call [`GrantTable::admit`] and hold a
//! [`FencePin`] for exactly one bounded copy or non-blocking system call.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::idmap::IdMap;
use crate::transport::TransportKind;

/// What a grant lets the peer do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Access {
    /// The peer may write into the range (the receiver side of a push).
    Write,
    /// The peer may read the range (the source side of a pull).
    Read,
}

impl std::fmt::Display for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Access::Write => "write",
            Access::Read => "read",
        })
    }
}

/// A reserved range of a peer's registered memory: compact and serialisable for the control path.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Grant {
    /// The granting engine's segment name.
    pub segment: String,
    /// The buffer inside that segment.
    pub buffer: u32,
    /// Start of the range within the buffer.
    pub offset: u64,
    /// Length of the range.
    pub len: u64,
    /// Unique within the granting engine; identifies the grant.
    pub epoch: u64,
    /// Random; a peer must present it, so grants cannot be guessed from epochs.
    pub token: u64,
    pub access: Access,
    /// What transports of the granting engine attached for a remote initiator (an RDMA rkey
    /// and address): opaque bytes per transport kind, bounded, read with [`Grant::key`].
    #[serde(default)]
    pub keys: Vec<GrantKey>,
}

/// One transport's key material inside a grant (see [`crate::Transport::on_grant`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GrantKey {
    pub kind: TransportKind,
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
}

/// Longest key one transport may attach to a grant.
pub const MAX_KEY_BYTES: usize = 64;
/// Most keys one grant carries (one per transport kind).
pub const MAX_GRANT_KEYS: usize = 4;

/// Largest encoded grant accepted from the wire (segment names are short).
pub const MAX_ENCODED_GRANT: usize = 1024;

impl Grant {
    /// Encodes for the control path (msgpack, compact).
    pub fn to_bytes(&self) -> Vec<u8> {
        rmp_serde::to_vec(self).expect("a Grant always encodes")
    }

    /// Decodes and validates a grant from the control path.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() > MAX_ENCODED_GRANT {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!(
                    "grant encoding is {} bytes, limit {MAX_ENCODED_GRANT}",
                    bytes.len()
                ),
            ));
        }
        let g: Grant = rmp_serde::from_slice(bytes)
            .map_err(|e| Error::new(ErrorKind::Malformed, format!("grant: {e}")))?;
        g.validate()?;
        Ok(g)
    }

    /// Checks internal consistency (non-empty, no overflow, a plausible segment name).
    pub fn validate(&self) -> Result<()> {
        if self.segment.is_empty() || self.segment.len() > 255 {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!(
                    "grant segment name has {} bytes (1..=255)",
                    self.segment.len()
                ),
            ));
        }
        if self.len == 0 {
            return Err(Error::new(ErrorKind::InvalidLength, "grant length is 0"));
        }
        if self.offset.checked_add(self.len).is_none() {
            return Err(Error::new(
                ErrorKind::InvalidLength,
                "grant range overflows",
            ));
        }
        if self.keys.len() > MAX_GRANT_KEYS {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!(
                    "grant carries {} transport keys, limit {MAX_GRANT_KEYS}",
                    self.keys.len()
                ),
            ));
        }
        for (i, k) in self.keys.iter().enumerate() {
            if k.bytes.is_empty() || k.bytes.len() > MAX_KEY_BYTES {
                return Err(Error::new(
                    ErrorKind::Malformed,
                    format!(
                        "grant's {} key is {} bytes (1..={MAX_KEY_BYTES})",
                        k.kind,
                        k.bytes.len()
                    ),
                ));
            }
            if self.keys[..i].iter().any(|o| o.kind == k.kind) {
                return Err(Error::new(
                    ErrorKind::Malformed,
                    format!("grant carries two {} keys", k.kind),
                ));
            }
        }
        Ok(())
    }

    /// The key the granting engine's `kind` transport attached, if any.
    pub fn key(&self, kind: TransportKind) -> Option<&[u8]> {
        self.keys
            .iter()
            .find(|k| k.kind == kind)
            .map(|k| k.bytes.as_slice())
    }

    /// The wire reference a transport sends with each access.
    pub fn wire(&self) -> GrantRef {
        GrantRef {
            buffer: self.buffer,
            epoch: self.epoch,
            token: self.token,
        }
    }

    /// Checks `offset..offset+len` (relative to the grant) lies inside it.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Err(Error::new(ErrorKind::InvalidLength, "transfer length is 0"));
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::new(
                ErrorKind::OutOfGrant,
                format!(
                    "offset {offset} + len {len} exceeds grant length {}",
                    self.len
                ),
            )),
        }
    }
}

/// What a transport sends to name a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantRef {
    pub buffer: u32,
    pub epoch: u64,
    pub token: u64,
}

const REVOKED: u64 = 1 << 63;

/// A grant's fence: a revoked bit and a count of accesses in progress.
#[derive(Debug, Default)]
pub struct Fence {
    state: AtomicU64,
}

impl Fence {
    /// Starts one access; refused once revoked.
    fn enter(&self) -> bool {
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            if cur & REVOKED != 0 {
                return false;
            }
            match self.state.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    fn leave(&self) {
        self.state.fetch_sub(1, Ordering::AcqRel);
    }

    /// Sets the revoked bit, then waits for accesses in progress. Each holds the fence for one
    /// bounded copy or non-blocking system call, so the wait is short; yielding keeps it fair
    /// on a machine with fewer cores than threads.
    fn revoke(&self) {
        self.state.fetch_or(REVOKED, Ordering::AcqRel);
        while self.state.load(Ordering::Acquire) & !REVOKED != 0 {
            std::thread::yield_now();
        }
    }

    pub fn is_revoked(&self) -> bool {
        self.state.load(Ordering::Acquire) & REVOKED != 0
    }
}

/// A live grant inside its engine.
#[derive(Debug)]
pub struct GrantEntry {
    pub grant: Grant,
    pub expires: Option<Instant>,
    /// A local lease: the owner's own access (or a local transfer's source) holding the range.
    /// Never usable by a peer.
    pub lease: bool,
    fence: Fence,
}

/// What to reserve.
#[derive(Debug, Clone, Copy)]
pub struct GrantSpec {
    pub buffer: u32,
    pub buffer_len: u64,
    pub offset: u64,
    pub len: u64,
    pub access: Access,
    pub expires: Option<Instant>,
    pub token: u64,
    pub lease: bool,
}

impl GrantEntry {
    /// Pins the grant for one access. Fails once the grant is revoked.
    pub fn pin(self: &Arc<Self>) -> Result<FencePin> {
        if self.fence.enter() {
            Ok(FencePin {
                entry: self.clone(),
            })
        } else {
            Err(Error::new(
                ErrorKind::GrantRevoked,
                "revoked while the transfer was running",
            )
            .with_grant(&self.grant.segment, self.grant.epoch))
        }
    }

    pub fn is_revoked(&self) -> bool {
        self.fence.is_revoked()
    }
}

/// Proof that one access under a grant is in progress; revoke waits for it.
#[derive(Debug)]
pub struct FencePin {
    entry: Arc<GrantEntry>,
}

impl Drop for FencePin {
    fn drop(&mut self) {
        self.entry.fence.leave();
    }
}

/// A validated remote access: which grant, and where in the buffer it lands.
#[derive(Debug)]
pub struct Admitted {
    pub entry: Arc<GrantEntry>,
    /// Absolute offset in the buffer.
    pub buffer_offset: u64,
    pub len: u64,
}

/// The live ranges of one buffer: (start, epoch) -> end, and the longest range ever held
/// while the buffer had any, so an overlap query only looks at starts in
/// `offset - longest .. end` (a busy KV pool holds tens of thousands of small grants).
#[derive(Debug, Default)]
struct Ranges {
    map: BTreeMap<(u64, u64), u64>,
    longest: u64,
}

impl Ranges {
    /// Ranges that overlap `offset..end`.
    fn overlapping(&self, offset: u64, end: u64) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let from = offset.saturating_sub(self.longest);
        self.map
            .range((from, 0)..(end, 0))
            .filter(move |&(&(start, _), &e)| start < end && e > offset)
            .map(|(&(start, epoch), &e)| (start, epoch, e))
    }
}

/// One engine's grants.
#[derive(Debug, Default)]
pub struct GrantTable {
    next_epoch: u64,
    by_epoch: IdMap<u64, Arc<GrantEntry>>,
    /// Per buffer: (start, epoch) -> end, for overlap checks and accounting.
    by_buffer: IdMap<u32, Ranges>,
    granted_bytes: u64,
    leases: usize,
    /// Live grants with an expiry; sweeping is skipped while there are none.
    expiring: usize,
    /// Peer grants removed since the engine last took them: it tells its transports
    /// ([`crate::Transport::on_revoke`]) once the table is unlocked.
    revoked: Vec<GrantRef>,
}

impl GrantTable {
    /// Reserves a range of a buffer. A write grant (or lease) excludes every other grant on
    /// its range; read grants may overlap each other.
    pub fn issue(&mut self, segment: &str, spec: GrantSpec) -> Result<Grant> {
        self.insert(segment, spec).map(|e| e.grant.clone())
    }

    /// As [`issue`](Self::issue), returning only the epoch: an engine's lease on its own
    /// buffer for one transfer, which is on every transfer's path, needs nothing else (and
    /// no copy of the grant).
    pub fn issue_lease(&mut self, segment: &str, spec: GrantSpec) -> Result<u64> {
        self.insert(segment, spec).map(|e| e.grant.epoch)
    }

    fn insert(&mut self, segment: &str, spec: GrantSpec) -> Result<Arc<GrantEntry>> {
        let GrantSpec {
            buffer,
            buffer_len,
            offset,
            len,
            access,
            expires,
            token,
            lease,
        } = spec;
        if self.expiring > 0 {
            self.sweep(Instant::now());
        }
        if len == 0 {
            return Err(Error::new(ErrorKind::InvalidLength, "grant length is 0"));
        }
        let end = match offset.checked_add(len) {
            Some(end) if end <= buffer_len => end,
            _ => {
                return Err(Error::new(
                    ErrorKind::OutOfBuffer,
                    format!("grant {offset}+{len} exceeds buffer {buffer} length {buffer_len}"),
                ));
            }
        };
        if let Some(ranges) = self.by_buffer.get(&buffer) {
            for (start, epoch, e) in ranges.overlapping(offset, end) {
                let other = &self.by_epoch[&epoch].grant;
                if access == Access::Write || other.access == Access::Write {
                    return Err(Error::new(
                        ErrorKind::GrantOverlap,
                        format!("{offset}..{end} of buffer {buffer} overlaps {start}..{e}"),
                    )
                    .with_grant(segment, epoch));
                }
            }
        }
        self.next_epoch += 1;
        let grant = Grant {
            segment: segment.to_owned(),
            buffer,
            offset,
            len,
            epoch: self.next_epoch,
            token,
            access,
            keys: Vec::new(),
        };
        let epoch = grant.epoch;
        let entry = Arc::new(GrantEntry {
            grant,
            expires,
            lease,
            fence: Fence::default(),
        });
        self.by_epoch.insert(epoch, entry.clone());
        let ranges = self.by_buffer.entry(buffer).or_default();
        ranges.map.insert((offset, epoch), end);
        ranges.longest = ranges.longest.max(len);
        if expires.is_some() {
            self.expiring += 1;
        }
        if lease {
            self.leases += 1;
        } else {
            self.granted_bytes += len;
        }
        Ok(entry)
    }

    /// Validates a remote access under `wire` at `offset..offset+len` relative to the grant.
    pub fn admit(
        &mut self,
        access: Access,
        wire: GrantRef,
        offset: u64,
        len: u64,
    ) -> Result<Admitted> {
        let now = Instant::now();
        let Some(entry) = self.by_epoch.get(&wire.epoch).cloned() else {
            // Epochs only grow, so an absent one at or below the last issued was revoked.
            return Err(if wire.epoch != 0 && wire.epoch <= self.next_epoch {
                Error::new(
                    ErrorKind::GrantRevoked,
                    format!("grant epoch {} was revoked or expired", wire.epoch),
                )
            } else {
                Error::new(
                    ErrorKind::UnknownGrant,
                    format!("no grant with epoch {} was ever issued", wire.epoch),
                )
            });
        };
        if entry.lease {
            return Err(Error::new(
                ErrorKind::UnknownGrant,
                format!("epoch {} is not a peer grant", wire.epoch),
            ));
        }
        let g = &entry.grant;
        let err =
            |kind, detail: String| Err(Error::new(kind, detail).with_grant(&g.segment, g.epoch));
        if g.token != wire.token {
            return err(ErrorKind::BadToken, "token does not match".into());
        }
        if g.buffer != wire.buffer {
            return err(
                ErrorKind::BadToken,
                format!("grant is for buffer {}, not {}", g.buffer, wire.buffer),
            );
        }
        if entry.expires.is_some_and(|t| t <= now) {
            self.remove(wire.epoch);
            return err(ErrorKind::GrantRevoked, "grant expired".into());
        }
        if g.access != access {
            return err(
                ErrorKind::AccessDenied,
                format!("a {} grant does not permit {access}", g.access),
            );
        }
        if let Err(e) = g.check_range(offset, len) {
            return Err(e.with_grant(&g.segment, g.epoch));
        }
        Ok(Admitted {
            buffer_offset: g.offset + offset,
            len,
            entry,
        })
    }

    /// Removes the grant from the table; the caller fences it (see [`revoke`](Self::revoke)).
    fn remove(&mut self, epoch: u64) -> Option<Arc<GrantEntry>> {
        let entry = self.by_epoch.remove(&epoch)?;
        let g = &entry.grant;
        if let Some(ranges) = self.by_buffer.get_mut(&g.buffer) {
            ranges.map.remove(&(g.offset, epoch));
            if ranges.map.is_empty() {
                self.by_buffer.remove(&g.buffer);
            }
        }
        if entry.expires.is_some() {
            self.expiring -= 1;
        }
        if entry.lease {
            self.leases -= 1;
        } else {
            self.granted_bytes -= g.len;
        }
        entry.fence.revoke();
        if !entry.lease {
            self.revoked.push(g.wire());
        }
        Some(entry)
    }

    /// Peer grants revoked (by any path) since the last call.
    pub fn take_revoked(&mut self) -> Vec<GrantRef> {
        std::mem::take(&mut self.revoked)
    }

    /// Revokes a grant: removed from the table, then fenced (waits for accesses in progress).
    /// Returns `false` if it was not live.
    pub fn revoke(&mut self, epoch: u64) -> bool {
        self.remove(epoch).is_some()
    }

    /// Revokes a peer grant only if the token matches too (a holder revoking what it was given).
    pub fn revoke_matching(&mut self, epoch: u64, token: u64) -> bool {
        let matches = self
            .by_epoch
            .get(&epoch)
            .is_some_and(|e| !e.lease && e.grant.token == token);
        matches && self.remove(epoch).is_some()
    }

    /// Revokes every grant (engine shutdown).
    pub fn revoke_all(&mut self) {
        let epochs: Vec<u64> = self.by_epoch.keys().copied().collect();
        for e in epochs {
            self.remove(e);
        }
    }

    /// Revokes grants whose expiry has passed.
    pub fn sweep(&mut self, now: Instant) {
        if self.expiring == 0 {
            return;
        }
        let expired: Vec<u64> = self
            .by_epoch
            .values()
            .filter(|e| e.expires.is_some_and(|t| t <= now))
            .map(|e| e.grant.epoch)
            .collect();
        for e in expired {
            self.remove(e);
        }
    }

    /// Live grants on `buffer`.
    pub fn count_on(&self, buffer: u32) -> usize {
        self.by_buffer.get(&buffer).map_or(0, |r| r.map.len())
    }

    /// Whether `offset..offset+len` of `buffer` overlaps a live grant (of the given access, or any).
    pub fn overlapping(
        &self,
        buffer: u32,
        offset: u64,
        len: u64,
        access: Option<Access>,
    ) -> Option<u64> {
        let end = offset.saturating_add(len);
        let ranges = self.by_buffer.get(&buffer)?;
        ranges
            .overlapping(offset, end)
            .find(|&(_, epoch, _)| access.is_none_or(|a| self.by_epoch[&epoch].grant.access == a))
            .map(|(_, epoch, _)| epoch)
    }

    /// Live grants handed to peers (leases not counted).
    pub fn live(&self) -> usize {
        self.by_epoch.len() - self.leases
    }

    pub fn leases(&self) -> usize {
        self.leases
    }

    pub fn granted_bytes(&self) -> u64 {
        self.granted_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn spec(
        buffer: u32,
        buffer_len: u64,
        offset: u64,
        len: u64,
        access: Access,
        expires: Option<Instant>,
        token: u64,
    ) -> GrantSpec {
        GrantSpec {
            buffer,
            buffer_len,
            offset,
            len,
            access,
            expires,
            token,
            lease: false,
        }
    }

    fn table_with_write(len: u64) -> (GrantTable, Grant) {
        let mut t = GrantTable::default();
        let g = t
            .issue(
                "seg",
                spec(1, 1 << 20, 4096, len, Access::Write, None, 0xfeed),
            )
            .unwrap();
        (t, g)
    }

    #[test]
    fn admit_checks_token_buffer_access_and_range() {
        let (mut t, g) = table_with_write(100);
        let ok = t.admit(Access::Write, g.wire(), 90, 10).unwrap();
        assert_eq!(ok.buffer_offset, 4096 + 90);
        let kind = |r: Result<Admitted>| r.unwrap_err().kind();
        assert_eq!(
            kind(t.admit(Access::Write, g.wire(), 91, 10)),
            ErrorKind::OutOfGrant
        );
        assert_eq!(
            kind(t.admit(Access::Write, g.wire(), u64::MAX, 2)),
            ErrorKind::OutOfGrant
        );
        assert_eq!(
            kind(t.admit(Access::Write, g.wire(), 0, 0)),
            ErrorKind::InvalidLength
        );
        assert_eq!(
            kind(t.admit(Access::Read, g.wire(), 0, 1)),
            ErrorKind::AccessDenied
        );
        let bad_token = GrantRef {
            token: 1,
            ..g.wire()
        };
        assert_eq!(
            kind(t.admit(Access::Write, bad_token, 0, 1)),
            ErrorKind::BadToken
        );
        let bad_buffer = GrantRef {
            buffer: 2,
            ..g.wire()
        };
        assert_eq!(
            kind(t.admit(Access::Write, bad_buffer, 0, 1)),
            ErrorKind::BadToken
        );
        let unknown = GrantRef {
            epoch: 99,
            ..g.wire()
        };
        assert_eq!(
            kind(t.admit(Access::Write, unknown, 0, 1)),
            ErrorKind::UnknownGrant
        );
        let e = t.admit(Access::Write, g.wire(), 91, 10).unwrap_err();
        assert_eq!(e.grant().unwrap().epoch, g.epoch);
    }

    #[test]
    fn revoke_fences_pins_and_forgets_the_grant() {
        let (mut t, g) = table_with_write(100);
        let adm = t.admit(Access::Write, g.wire(), 0, 10).unwrap();
        let pin = adm.entry.pin().unwrap();
        drop(pin);
        assert!(t.revoke(g.epoch));
        assert!(!t.revoke(g.epoch));
        assert_eq!(adm.entry.pin().unwrap_err().kind(), ErrorKind::GrantRevoked);
        assert_eq!(
            t.admit(Access::Write, g.wire(), 0, 1).unwrap_err().kind(),
            ErrorKind::GrantRevoked
        );
        assert_eq!(t.live(), 0);
        assert_eq!(t.granted_bytes(), 0);
    }

    #[test]
    fn revoke_waits_for_an_access_in_progress() {
        let (mut t, g) = table_with_write(100);
        let adm = t.admit(Access::Write, g.wire(), 0, 10).unwrap();
        let pin = adm.entry.pin().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || {
            t.revoke(g.epoch);
            tx.send(()).unwrap();
        });
        // The revoking thread cannot finish while the pin is held.
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
        drop(pin);
        rx.recv().unwrap();
        h.join().unwrap();
    }

    #[test]
    fn write_grants_exclude_overlap_reads_share() {
        let mut t = GrantTable::default();
        let w = t
            .issue("s", spec(0, 1000, 100, 100, Access::Write, None, 1))
            .unwrap();
        let e = t
            .issue("s", spec(0, 1000, 150, 10, Access::Read, None, 2))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::GrantOverlap);
        assert_eq!(e.grant().unwrap().epoch, w.epoch);
        assert_eq!(
            t.issue("s", spec(0, 1000, 0, 101, Access::Write, None, 3))
                .unwrap_err()
                .kind(),
            ErrorKind::GrantOverlap
        );
        t.issue("s", spec(0, 1000, 200, 50, Access::Write, None, 4))
            .unwrap(); // adjacent is fine
        t.issue("s", spec(0, 1000, 0, 100, Access::Write, None, 5))
            .unwrap(); // adjacent below too
        t.issue("s", spec(0, 1000, 300, 100, Access::Read, None, 6))
            .unwrap();
        t.issue("s", spec(0, 1000, 350, 100, Access::Read, None, 7))
            .unwrap();
        assert_eq!(
            t.issue("s", spec(0, 1000, 999, 2, Access::Read, None, 8))
                .unwrap_err()
                .kind(),
            ErrorKind::OutOfBuffer
        );
        assert_eq!(t.count_on(0), 5);
        assert_eq!(t.granted_bytes(), 100 + 50 + 100 + 100 + 100);
        assert_eq!(t.overlapping(0, 120, 1, Some(Access::Write)), Some(w.epoch));
        assert_eq!(t.overlapping(0, 320, 1, Some(Access::Write)), None);
    }

    #[test]
    fn expired_grants_are_refused_and_swept() {
        let mut t = GrantTable::default();
        let past = Instant::now() - Duration::from_millis(1);
        let g = t
            .issue("s", spec(0, 1000, 0, 10, Access::Write, Some(past), 1))
            .unwrap();
        assert_eq!(
            t.admit(Access::Write, g.wire(), 0, 1).unwrap_err().kind(),
            ErrorKind::GrantRevoked
        );
        assert_eq!(t.live(), 0);
        t.issue("s", spec(0, 1000, 0, 10, Access::Write, Some(past), 1))
            .unwrap();
        t.sweep(Instant::now());
        assert_eq!(t.live(), 0);
        assert_eq!(t.granted_bytes(), 0);
    }

    #[test]
    fn grant_round_trips_and_refuses_bad_encodings() {
        let (_, g) = table_with_write(100);
        assert_eq!(Grant::from_bytes(&g.to_bytes()).unwrap(), g);
        assert_eq!(
            Grant::from_bytes(&[0xc1]).unwrap_err().kind(),
            ErrorKind::Malformed
        );
        assert_eq!(
            Grant::from_bytes(&vec![0; 4096]).unwrap_err().kind(),
            ErrorKind::Malformed
        );
        let zero = Grant {
            len: 0,
            ..g.clone()
        };
        assert_eq!(
            Grant::from_bytes(&zero.to_bytes()).unwrap_err().kind(),
            ErrorKind::InvalidLength
        );
        let overflow = Grant {
            offset: u64::MAX,
            ..g.clone()
        };
        assert_eq!(
            Grant::from_bytes(&overflow.to_bytes()).unwrap_err().kind(),
            ErrorKind::InvalidLength
        );
        // Transport keys: carried and read back; bounded in size, count and kind.
        let key = |kind, n: usize| GrantKey {
            kind,
            bytes: vec![7; n],
        };
        let keyed = Grant {
            keys: vec![key(TransportKind::Shm, MAX_KEY_BYTES)],
            ..g.clone()
        };
        let back = Grant::from_bytes(&keyed.to_bytes()).unwrap();
        assert_eq!(
            back.key(TransportKind::Shm),
            Some(&[7u8; MAX_KEY_BYTES][..])
        );
        assert_eq!(back.key(TransportKind::Tcp), None);
        for keys in [
            vec![key(TransportKind::Shm, MAX_KEY_BYTES + 1)],
            vec![key(TransportKind::Shm, 0)],
            vec![key(TransportKind::Shm, 1), key(TransportKind::Shm, 1)],
            vec![key(TransportKind::Tcp, 1); MAX_GRANT_KEYS + 1],
        ] {
            let bad = Grant { keys, ..g.clone() };
            assert_eq!(
                Grant::from_bytes(&bad.to_bytes()).unwrap_err().kind(),
                ErrorKind::Malformed
            );
        }
    }

    #[test]
    fn revoked_peer_grants_are_reported_once_leases_never() {
        let mut t = GrantTable::default();
        let g = t
            .issue("s", spec(0, 1000, 0, 10, Access::Write, None, 1))
            .unwrap();
        let mut lease = spec(0, 1000, 100, 10, Access::Write, None, 0);
        lease.lease = true;
        let l = t.issue("s", lease).unwrap();
        assert!(t.revoke(l.epoch));
        assert!(t.take_revoked().is_empty());
        assert!(t.revoke(g.epoch));
        assert_eq!(t.take_revoked(), vec![g.wire()]);
        assert!(t.take_revoked().is_empty());
    }
}
