//! Transport decorators for tests: every slice of every link goes through a closure, which
//! may delay it, fail it, or park it; everything else passes through to the real transport.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use omnirig_transports::transport::BoxFuture;
use omnirig_transports::{
    Link, LinkInfo, Result, SegmentDescriptor, SliceOp, Slicing, Transport, TransportDecorator,
    TransportKind,
};
use tokio::sync::{Notify, watch};

type RunSlice = dyn Fn(Arc<dyn Link>, SliceOp) -> BoxFuture<'static, Result<()>> + Send + Sync;
type Reslice = dyn Fn(Slicing) -> Slicing + Send + Sync;

/// A decorator (for `EngineConfig::decorator` or a runner's hop) whose links hand every slice
/// to `run` along with the real link, which `run` calls (or not) to move it.
pub fn on_slices(
    run: impl Fn(Arc<dyn Link>, SliceOp) -> BoxFuture<'static, Result<()>> + Send + Sync + 'static,
) -> TransportDecorator {
    on_slices_with(|s| s, run)
}

/// As [`on_slices`], with the link's slicing changed by `reslice` (one slice in flight, ...).
pub fn on_slices_with(
    reslice: impl Fn(Slicing) -> Slicing + Send + Sync + 'static,
    run: impl Fn(Arc<dyn Link>, SliceOp) -> BoxFuture<'static, Result<()>> + Send + Sync + 'static,
) -> TransportDecorator {
    let run: Arc<RunSlice> = Arc::new(run);
    let reslice: Arc<Reslice> = Arc::new(reslice);
    Arc::new(move |inner: Arc<dyn Transport>| {
        Arc::new(Decorated {
            inner,
            run: run.clone(),
            reslice: reslice.clone(),
        }) as Arc<dyn Transport>
    })
}

struct Decorated {
    inner: Arc<dyn Transport>,
    run: Arc<RunSlice>,
    reslice: Arc<Reslice>,
}

impl Transport for Decorated {
    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn reaches(&self, peer: &SegmentDescriptor) -> bool {
        self.inner.reaches(peer)
    }

    fn connect(&self, peer: SegmentDescriptor) -> BoxFuture<'static, Result<Arc<dyn Link>>> {
        let inner = self.inner.connect(peer);
        let (run, reslice) = (self.run.clone(), self.reslice.clone());
        Box::pin(async move {
            Ok(Arc::new(DecoratedLink {
                inner: inner.await?,
                run,
                reslice,
            }) as Arc<dyn Link>)
        })
    }
}

struct DecoratedLink {
    inner: Arc<dyn Link>,
    run: Arc<RunSlice>,
    reslice: Arc<Reslice>,
}

impl Link for DecoratedLink {
    fn info(&self) -> LinkInfo {
        self.inner.info()
    }

    fn slicing(&self) -> Slicing {
        (self.reslice)(self.inner.slicing())
    }

    fn execute(&self, op: SliceOp) -> BoxFuture<'static, Result<()>> {
        (self.run)(self.inner.clone(), op)
    }
}

/// Scripted gate: the first `free` slices pass; later ones park until [`Gate::open`].
/// Faults are scripts, not sleeps: tests wait on [`Gate::wait_parked`] and
/// [`Gate::wait_ran`].
pub struct Gate {
    free: usize,
    seen: AtomicUsize,
    parked: AtomicUsize,
    parked_changed: Notify,
    open: watch::Sender<bool>,
    late: std::sync::Mutex<Vec<Result<()>>>,
    late_changed: Notify,
}

impl Gate {
    pub fn new(free: usize) -> Arc<Self> {
        Arc::new(Self {
            free,
            seen: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
            parked_changed: Notify::new(),
            open: watch::channel(false).0,
            late: Default::default(),
            late_changed: Notify::new(),
        })
    }

    pub fn open(&self) {
        self.open.send_replace(true);
    }

    /// Waits until `n` slices are parked at the gate.
    pub async fn wait_parked(&self, n: usize) {
        loop {
            let notified = self.parked_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.parked.load(Ordering::Acquire) >= n {
                return;
            }
            notified.await;
        }
    }

    /// Waits until `n` parked slices have run, and returns their outcomes.
    pub async fn wait_ran(&self, n: usize) -> Vec<Result<()>> {
        loop {
            let notified = self.late_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let late = self.late.lock().unwrap_or_else(|p| p.into_inner());
                if late.len() >= n {
                    return late.clone();
                }
            }
            notified.await;
        }
    }

    /// A decorator whose links take one slice at a time (so "the first N pass" is well
    /// defined) through this gate.
    pub fn decorator(self: &Arc<Self>) -> TransportDecorator {
        let gate = self.clone();
        on_slices_with(
            |s| Slicing { in_flight: 1, ..s },
            move |inner, op| gate.clone().run(inner, op),
        )
    }

    fn run(self: Arc<Self>, inner: Arc<dyn Link>, op: SliceOp) -> BoxFuture<'static, Result<()>> {
        if self.seen.fetch_add(1, Ordering::AcqRel) < self.free {
            return inner.execute(op);
        }
        // A parked slice runs in its own task, so it goes on once the gate opens even if its
        // batch gave up on it (like a work request already posted to a NIC): exactly the late
        // write a revoked grant must stop. Its outcome is recorded for the test.
        let mut rx = self.open.subscribe();
        self.parked.fetch_add(1, Ordering::AcqRel);
        self.parked_changed.notify_waiters();
        let task = tokio::spawn(async move {
            let _ = rx.wait_for(|open| *open).await;
            let r = inner.execute(op).await;
            self.late
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(r.clone());
            self.late_changed.notify_waiters();
            r
        });
        Box::pin(async move { task.await.expect("gated slice panicked") })
    }
}
