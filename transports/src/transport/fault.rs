//! Fault injection: a decorator that wraps any transport and applies a scripted plan to the
//! slices it moves (Mooncake TENT tests its engine the same way: the real engine, a real
//! transport, and a fault decorator in between).
//!
//! A [`FaultRule`] picks slices by the request's tag (see [`crate::Request::tag`]; callers map
//! their own notions, such as request and tensor, to tags) and a point in the request (before
//! its first byte, after N bytes, at its completion), and says what goes wrong there. Rules
//! fire a fixed number of times, so a plan is a script: the same plan on the same requests
//! does the same thing every run. Bytes a fault holds back (a late write, data behind an early
//! completion) move only when the test or runner calls [`FaultInjector::release_held`], so
//! tests wait on outcomes, never on sleeps.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::engine::TransportDecorator;
use crate::error::{Error, ErrorKind, Result};
use crate::segment::SegmentDescriptor;
use crate::transport::{
    BoxFuture, Link, LinkInfo, OpKind, SliceOp, Slicing, Transport, TransportKind,
};

/// Where in a request a fault strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultPoint {
    /// Before the request's first byte moves.
    BeforeSubmit,
    /// Once this many bytes of the request have moved (clamped to the request's last byte).
    AfterBytes(u64),
    /// After the request's last byte moved, in place of its completion.
    AtCompletion,
}

/// What goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// The submission is refused: an error, nothing more moves.
    FailSubmit,
    /// The slice completes with an error (bytes before the point have landed).
    FailSlice,
    /// Nothing more happens: the request stalls until its deadline.
    Stall,
    /// A slow link: the rest of the slice waits this long.
    Delay { ms: u64 },
    /// The connection drops mid-transfer: the link's connections are closed and the slice
    /// fails as a disconnect.
    DropConnection,
    /// One byte is flipped on the wire (the source memory is untouched).
    Corrupt,
    /// The completion of the previous slice is delivered again in place of this slice's:
    /// reported done, its bytes never sent.
    DuplicateCompletion,
    /// The completion arrives before the data: reported done now, the bytes are held and
    /// sent only when released (by then the receiver has usually revoked its grant).
    EarlyCompletion,
    /// The slice stalls past its deadline and its bytes are written later, when released:
    /// after the receiver revoked the grant.
    LateWrite,
}

impl FaultKind {
    /// Every kind, for matrices.
    pub const ALL: [FaultKind; 9] = [
        FaultKind::FailSubmit,
        FaultKind::FailSlice,
        FaultKind::Stall,
        FaultKind::Delay { ms: 50 },
        FaultKind::DropConnection,
        FaultKind::Corrupt,
        FaultKind::DuplicateCompletion,
        FaultKind::EarlyCompletion,
        FaultKind::LateWrite,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::FailSubmit => "fail_submit",
            FaultKind::FailSlice => "fail_slice",
            FaultKind::Stall => "stall",
            FaultKind::Delay { .. } => "delay",
            FaultKind::DropConnection => "drop_connection",
            FaultKind::Corrupt => "corrupt",
            FaultKind::DuplicateCompletion => "duplicate_completion",
            FaultKind::EarlyCompletion => "early_completion",
            FaultKind::LateWrite => "late_write",
        }
    }
}

/// One scripted fault.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultRule {
    /// Only requests with this tag; `None` matches every request.
    #[serde(default)]
    pub tag: Option<u64>,
    pub at: FaultPoint,
    pub kind: FaultKind,
    /// How many times the rule fires (default once).
    #[serde(default = "one")]
    pub times: usize,
}

fn one() -> usize {
    1
}

impl FaultRule {
    pub fn new(tag: Option<u64>, at: FaultPoint, kind: FaultKind) -> Self {
        Self {
            tag,
            at,
            kind,
            times: 1,
        }
    }
}

/// A fault that fired, for reports and assertions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fired {
    pub rule: usize,
    pub kind: FaultKind,
    pub tag: u64,
    /// The request byte where it struck.
    pub at_byte: u64,
}

struct Held {
    link: Arc<dyn Link>,
    op: SliceOp,
}

/// Applies a plan; hand [`FaultInjector::decorator`] to an engine's config.
pub struct FaultInjector {
    rules: Mutex<Vec<(FaultRule, usize)>>,
    fired: Mutex<Vec<Fired>>,
    held: Mutex<Vec<Held>>,
    held_changed: Notify,
    outcomes: Mutex<Vec<(u64, Result<()>)>>,
}

impl FaultInjector {
    pub fn new(rules: Vec<FaultRule>) -> Arc<Self> {
        Arc::new(Self {
            rules: Mutex::new(rules.into_iter().map(|r| (r.clone(), r.times)).collect()),
            fired: Mutex::default(),
            held: Mutex::default(),
            held_changed: Notify::new(),
            outcomes: Mutex::default(),
        })
    }

    /// Wraps every transport of an engine.
    pub fn decorator(self: &Arc<Self>) -> TransportDecorator {
        let me = self.clone();
        Arc::new(move |inner: Arc<dyn Transport>| {
            Arc::new(Faulty {
                inner,
                faults: me.clone(),
            }) as Arc<dyn Transport>
        })
    }

    /// Faults that fired so far.
    pub fn fired(&self) -> Vec<Fired> {
        lock(&self.fired).clone()
    }

    /// Slices held back (late writes, data behind early completions) not yet released.
    pub fn held(&self) -> usize {
        lock(&self.held).len()
    }

    /// Waits until at least `n` slices are held back.
    pub async fn wait_held(&self, n: usize) {
        loop {
            let notified = self.held_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if lock(&self.held).len() >= n {
                return;
            }
            notified.await;
        }
    }

    /// Sends every held slice now and returns how each ended, with its request's tag. A late
    /// write must end refused: its grant was revoked.
    pub async fn release_held(&self) -> Vec<(u64, Result<()>)> {
        let held: Vec<Held> = std::mem::take(&mut *lock(&self.held));
        let mut out = Vec::new();
        for h in held {
            let tag = h.op.tag;
            let r = h.link.execute(h.op).await;
            lock(&self.outcomes).push((tag, r.clone()));
            out.push((tag, r));
        }
        out
    }

    /// How every released slice ended, in release order, with its request's tag.
    pub fn released(&self) -> Vec<(u64, Result<()>)> {
        lock(&self.outcomes).clone()
    }

    /// Picks the rule (if any) that strikes inside `op`, and where (bytes into the slice).
    fn strike(&self, op: &SliceOp) -> Option<(FaultKind, u64)> {
        let mut rules = lock(&self.rules);
        let (i, k) = rules.iter().enumerate().find_map(|(i, (r, left))| {
            if *left == 0 || r.tag.is_some_and(|t| t != op.tag) {
                return None;
            }
            let end = op.request_offset + op.len;
            let k = match r.at {
                FaultPoint::BeforeSubmit => (op.request_offset == 0).then_some(0),
                FaultPoint::AfterBytes(n) => {
                    let n = n.min(op.request_len.saturating_sub(1));
                    (op.request_offset <= n && n < end).then(|| n - op.request_offset)
                }
                FaultPoint::AtCompletion => (end == op.request_len).then_some(op.len),
            }?;
            Some((i, k))
        })?;
        rules[i].1 -= 1;
        let kind = rules[i].0.kind;
        // Faults that withhold bytes withhold the whole last slice "at completion" (its
        // completion is the one duplicated, early or late), so there is always data missing.
        let k = match (kind, rules[i].0.at) {
            (
                FaultKind::DuplicateCompletion | FaultKind::EarlyCompletion | FaultKind::LateWrite,
                FaultPoint::AtCompletion,
            ) => 0,
            _ => k,
        };
        lock(&self.fired).push(Fired {
            rule: i,
            kind,
            tag: op.tag,
            at_byte: op.request_offset + k,
        });
        Some((kind, k))
    }

    fn hold(&self, link: Arc<dyn Link>, op: SliceOp) {
        if op.len > 0 {
            lock(&self.held).push(Held { link, op });
            self.held_changed.notify_waiters();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Splits a slice after `k` bytes.
fn split(op: &SliceOp, k: u64) -> (SliceOp, SliceOp) {
    let k = k.min(op.len);
    let head = SliceOp {
        len: k,
        ..op.clone()
    };
    let tail = SliceOp {
        local_offset: op.local_offset + k,
        grant_offset: op.grant_offset + k,
        request_offset: op.request_offset + k,
        len: op.len - k,
        ..op.clone()
    };
    (head, tail)
}

fn injected(kind: ErrorKind, what: &str, op: &SliceOp, k: u64) -> Error {
    Error::new(
        kind,
        format!(
            "fault injected: {what} at byte {} of the request",
            op.request_offset + k
        ),
    )
}

struct Faulty {
    inner: Arc<dyn Transport>,
    faults: Arc<FaultInjector>,
}

impl Transport for Faulty {
    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn reaches(&self, peer: &SegmentDescriptor) -> bool {
        self.inner.reaches(peer)
    }

    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>> {
        let inner = self.inner.connect(peer);
        let faults = self.faults.clone();
        Box::pin(async move {
            Ok(Arc::new(FaultyLink {
                inner: inner.await?,
                faults,
            }) as Arc<dyn Link>)
        })
    }
}

struct FaultyLink {
    inner: Arc<dyn Link>,
    faults: Arc<FaultInjector>,
}

impl Link for FaultyLink {
    fn info(&self) -> LinkInfo {
        self.inner.info()
    }

    fn slicing(&self) -> Slicing {
        self.inner.slicing()
    }

    fn drop_connections(&self) {
        self.inner.drop_connections()
    }

    fn execute(&self, op: SliceOp) -> BoxFuture<'static, Result<()>> {
        let Some((kind, k)) = self.faults.strike(&op) else {
            return self.inner.execute(op);
        };
        let link = self.inner.clone();
        let faults = self.faults.clone();
        Box::pin(async move {
            let (head, tail) = split(&op, k);
            let send_head = |link: &Arc<dyn Link>| {
                let f = (head.len > 0).then(|| link.execute(head.clone()));
                async move {
                    match f {
                        Some(f) => f.await,
                        None => Ok(()),
                    }
                }
            };
            match kind {
                FaultKind::FailSubmit => {
                    send_head(&link).await?;
                    Err(injected(ErrorKind::Io, "submission refused", &op, k))
                }
                FaultKind::FailSlice => {
                    send_head(&link).await?;
                    Err(injected(ErrorKind::Io, "error completion", &op, k))
                }
                FaultKind::Stall => {
                    send_head(&link).await?;
                    std::future::pending().await
                }
                FaultKind::Delay { ms } => {
                    send_head(&link).await?;
                    // The delay is the fault itself (a slow link), not a synchronisation.
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    if tail.len > 0 {
                        link.execute(tail).await?;
                    }
                    Ok(())
                }
                FaultKind::DropConnection => {
                    send_head(&link).await?;
                    link.drop_connections();
                    Err(injected(
                        ErrorKind::PeerDisconnected,
                        "connection dropped",
                        &op,
                        k,
                    ))
                }
                FaultKind::Corrupt => {
                    let at = k.min(op.len.saturating_sub(1));
                    match op.kind {
                        OpKind::Write => {
                            // Send a copy with one byte flipped; the source stays intact.
                            // Of the same kind as the source, so shm can still share it.
                            let copy = op.local.allocate_like(op.len as usize)?;
                            op.local.copy_to(op.local_offset, &copy, 0, op.len)?;
                            flip(&copy, at)?;
                            link.execute(SliceOp {
                                local: Arc::new(copy),
                                local_offset: 0,
                                ..op
                            })
                            .await
                        }
                        OpKind::Read => {
                            link.execute(op.clone()).await?;
                            flip(&op.local, op.local_offset + at)?;
                            Ok(())
                        }
                    }
                }
                FaultKind::DuplicateCompletion => {
                    send_head(&link).await?;
                    Ok(())
                }
                FaultKind::EarlyCompletion => {
                    send_head(&link).await?;
                    faults.hold(link, tail);
                    Ok(())
                }
                FaultKind::LateWrite => {
                    send_head(&link).await?;
                    faults.hold(link, tail);
                    std::future::pending().await
                }
            }
        })
    }
}

/// Flips one byte of `region` at `offset` (a read and a write, so GPU memory works too).
fn flip(region: &crate::memory::Region, offset: u64) -> crate::error::Result<()> {
    let mut b = [0u8];
    region.read(offset, &mut b)?;
    b[0] ^= 0x5a;
    region.write(offset, &b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Region;

    #[test]
    fn split_keeps_offsets_consistent() {
        let op = SliceOp {
            kind: OpKind::Write,
            local: Arc::new(Region::allocate(4096, false).unwrap()),
            local_offset: 100,
            grant: crate::grant::GrantRef {
                buffer: 1,
                epoch: 1,
                token: 1,
            },
            key: None,
            grant_offset: 10,
            len: 1000,
            tag: 7,
            request_offset: 2000,
            request_len: 5000,
            alone: true,
        };
        let (h, t) = split(&op, 300);
        assert_eq!(
            (h.local_offset, h.grant_offset, h.request_offset, h.len),
            (100, 10, 2000, 300)
        );
        assert_eq!(
            (t.local_offset, t.grant_offset, t.request_offset, t.len),
            (400, 310, 2300, 700)
        );
        let (h, t) = split(&op, 5000);
        assert_eq!((h.len, t.len), (1000, 0));
    }

    #[test]
    fn rules_fire_where_and_as_often_as_scripted() {
        let f = FaultInjector::new(vec![
            FaultRule::new(Some(7), FaultPoint::AfterBytes(2500), FaultKind::Corrupt),
            FaultRule {
                times: 2,
                ..FaultRule::new(None, FaultPoint::AtCompletion, FaultKind::FailSlice)
            },
        ]);
        let op = |tag, request_offset, len| SliceOp {
            kind: OpKind::Write,
            local: Arc::new(Region::allocate(1, false).unwrap()),
            local_offset: 0,
            grant: crate::grant::GrantRef {
                buffer: 1,
                epoch: 1,
                token: 1,
            },
            key: None,
            grant_offset: request_offset,
            len,
            tag,
            request_offset,
            request_len: 5000,
            alone: true,
        };
        assert_eq!(f.strike(&op(7, 0, 1000)), None);
        assert_eq!(
            f.strike(&op(8, 2000, 1000)),
            None,
            "tag 8 is not the corrupt rule's"
        );
        assert_eq!(
            f.strike(&op(7, 2000, 1000)),
            Some((FaultKind::Corrupt, 500))
        );
        assert_eq!(f.strike(&op(7, 2000, 1000)), None, "fired its one time");
        assert_eq!(
            f.strike(&op(8, 4000, 1000)),
            Some((FaultKind::FailSlice, 1000))
        );
        assert_eq!(
            f.strike(&op(9, 4000, 1000)),
            Some((FaultKind::FailSlice, 1000))
        );
        assert_eq!(f.strike(&op(9, 4000, 1000)), None);
        let fired = f.fired();
        assert_eq!(fired.len(), 3);
        assert_eq!((fired[0].tag, fired[0].at_byte), (7, 2500));
    }
}
