//! Batches: many transfer tasks submitted together, polled or awaited as one.
//!
//! [`BatchState`] is the state machine alone (no I/O, no clock reads): tasks go
//! Waiting -> Pending -> exactly one terminal state, and a terminal state never changes.
//! [`Batch`] is the handle users hold; dropping or freeing it cancels whatever still runs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, ErrorKind, Result};

/// One task's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskState {
    /// Accepted, not started.
    Waiting,
    /// Bytes are moving.
    Pending,
    Completed,
    Failed(Error),
    /// The batch's deadline passed first. Terminal: bytes the transport still had in flight
    /// may land later, unless the receiver revokes its grant (which fences them).
    TimedOut,
    /// The batch was freed or dropped first.
    Canceled,
}

impl TaskState {
    pub fn is_terminal(&self) -> bool {
        !matches!(self, TaskState::Waiting | TaskState::Pending)
    }
}

#[derive(Debug)]
struct TaskRecord {
    state: TaskState,
    len: u64,
    bytes_done: u64,
}

/// The batch state machine.
#[derive(Debug)]
pub struct BatchState {
    tasks: Vec<TaskRecord>,
    terminal: usize,
    /// The first task to end in anything but Completed, in time order.
    first_failure: Option<usize>,
}

impl BatchState {
    pub fn new(lens: impl IntoIterator<Item = u64>) -> Self {
        Self {
            tasks: lens
                .into_iter()
                .map(|len| TaskRecord {
                    state: TaskState::Waiting,
                    len,
                    bytes_done: 0,
                })
                .collect(),
            terminal: 0,
            first_failure: None,
        }
    }

    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    pub fn state(&self, task: usize) -> Option<&TaskState> {
        self.tasks.get(task).map(|t| &t.state)
    }

    pub fn bytes_done(&self, task: usize) -> u64 {
        self.tasks.get(task).map_or(0, |t| t.bytes_done)
    }

    /// Waiting -> Pending. Returns false if the task already ended (it must not start).
    pub fn start(&mut self, task: usize) -> bool {
        let t = &mut self.tasks[task];
        match t.state {
            TaskState::Waiting => {
                t.state = TaskState::Pending;
                true
            }
            TaskState::Pending => true,
            _ => false,
        }
    }

    pub fn progress(&mut self, task: usize, bytes: u64) {
        let t = &mut self.tasks[task];
        if !t.state.is_terminal() {
            t.bytes_done = (t.bytes_done + bytes).min(t.len);
        }
    }

    /// Moves a task to a terminal state. The first terminal state wins; later ones are ignored
    /// and `false` is returned.
    pub fn finish(&mut self, task: usize, outcome: TaskState) -> bool {
        debug_assert!(outcome.is_terminal());
        let t = &mut self.tasks[task];
        if t.state.is_terminal() {
            return false;
        }
        if outcome == TaskState::Completed {
            t.bytes_done = t.len;
        } else if self.first_failure.is_none() {
            self.first_failure = Some(task);
        }
        t.state = outcome;
        self.terminal += 1;
        true
    }

    /// Every task still running becomes TimedOut.
    pub fn expire(&mut self) {
        for i in 0..self.tasks.len() {
            self.finish(i, TaskState::TimedOut);
        }
    }

    pub fn all_terminal(&self) -> bool {
        self.terminal == self.tasks.len()
    }

    pub fn first_failure(&self) -> Option<usize> {
        self.first_failure
    }
}

/// Engine-wide counts of what is alive, for leak checks.
#[derive(Debug, Default)]
pub(crate) struct Liveness {
    pub batches: AtomicUsize,
    pub tasks: AtomicUsize,
    pub connections: AtomicUsize,
    pub changed: Notify,
}

impl Liveness {
    pub fn dec(&self, counter: &AtomicUsize) {
        counter.fetch_sub(1, Ordering::AcqRel);
        self.changed.notify_waiters();
    }
}

pub(crate) struct BatchShared {
    pub id: u64,
    pub deadline: Option<Instant>,
    pub state: Mutex<BatchState>,
    pub changed: Notify,
    pub cancel: CancellationToken,
    live: Arc<Liveness>,
}

impl BatchShared {
    pub fn new(
        id: u64,
        deadline: Option<Instant>,
        lens: Vec<u64>,
        live: Arc<Liveness>,
    ) -> Arc<Self> {
        live.batches.fetch_add(1, Ordering::AcqRel);
        Arc::new(Self {
            id,
            deadline,
            state: Mutex::new(BatchState::new(lens)),
            changed: Notify::new(),
            cancel: CancellationToken::new(),
            live,
        })
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, BatchState> {
        // A panic while holding this lock is a bug elsewhere; the state stays consistent
        // because every mutation is a single assignment, so keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn finish(&self, task: usize, outcome: TaskState) {
        if self.lock().finish(task, outcome) {
            self.changed.notify_waiters();
        }
    }

    pub fn progress(&self, task: usize, bytes: u64) {
        self.lock().progress(task, bytes);
        self.changed.notify_waiters();
    }

    fn expire_if_due(&self) {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            let mut s = self.lock();
            if !s.all_terminal() {
                s.expire();
                drop(s);
                self.changed.notify_waiters();
            }
        }
    }
}

impl Drop for BatchShared {
    fn drop(&mut self) {
        self.live.dec(&self.live.batches);
    }
}

/// A submitted batch. Dropping it (or [`free`](Batch::free)) cancels every task still running
/// and releases everything it holds; that always succeeds.
pub struct Batch {
    pub(crate) shared: Arc<BatchShared>,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("id", &self.shared.id)
            .field("tasks", &self.len())
            .finish()
    }
}

impl Batch {
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    pub fn len(&self) -> usize {
        self.shared.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One task's state (TimedOut as soon as the deadline has passed).
    pub fn status(&self, task: usize) -> Option<TaskState> {
        self.shared.expire_if_due();
        self.shared.lock().state(task).cloned()
    }

    pub fn statuses(&self) -> Vec<TaskState> {
        self.shared.expire_if_due();
        let s = self.shared.lock();
        (0..s.len()).filter_map(|i| s.state(i).cloned()).collect()
    }

    /// Bytes a task has moved so far.
    pub fn bytes_done(&self, task: usize) -> u64 {
        self.shared.lock().bytes_done(task)
    }

    /// Waits until `ready` holds for the state, or the deadline passes (then every running
    /// task is TimedOut, so `ready` is checked once more).
    async fn wait_until(&self, ready: impl Fn(&BatchState) -> bool) {
        loop {
            let notified = self.shared.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            self.shared.expire_if_due();
            if ready(&self.shared.lock()) {
                return;
            }
            match self.shared.deadline {
                Some(d) => {
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep_until(d) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Waits for every task to reach a terminal state and returns the states.
    pub async fn wait(&self) -> Vec<TaskState> {
        self.wait_until(|s| s.all_terminal()).await;
        self.statuses()
    }

    /// Waits until a task has moved at least `bytes` (or ended).
    pub async fn wait_progress(&self, task: usize, bytes: u64) {
        self.wait_until(|s| {
            s.bytes_done(task) >= bytes || s.state(task).is_none_or(|t| t.is_terminal())
        })
        .await
    }

    /// Every task Completed, or the first failure (in time order) naming its batch and task.
    /// Returns as soon as a task fails; the others keep running until the batch is dropped.
    pub async fn wait_all(&self) -> Result<()> {
        self.wait_until(|s| s.all_terminal() || s.first_failure().is_some())
            .await;
        self.outcome().expect("every task ended or one failed")
    }

    /// [`wait_all`](Self::wait_all)'s answer if it is known now: `None` while tasks still run
    /// and none has failed.
    pub fn outcome(&self) -> Option<Result<()>> {
        let s = self.shared.lock();
        let Some(task) = s.first_failure() else {
            return s.all_terminal().then_some(Ok(()));
        };
        let err = match s.state(task) {
            Some(TaskState::Failed(e)) => e.clone(),
            Some(TaskState::TimedOut) => Error::new(ErrorKind::TimedOut, "batch deadline passed"),
            _ => Error::new(ErrorKind::Canceled, "batch canceled"),
        };
        Some(Err(err.with_task(self.shared.id, task)))
    }

    /// Cancels every task still running; they end Canceled.
    pub fn cancel(&self) {
        self.shared.cancel.cancel();
    }

    /// Frees the batch: cancels what still runs and releases everything. Never fails.
    pub fn free(self) {}
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
    }
}

/// Splits `len` bytes into slices of at most `slice` bytes: (offset, len) pairs.
pub fn slices(len: u64, slice: u64) -> impl Iterator<Item = (u64, u64)> {
    let slice = slice.max(1);
    (0..len.div_ceil(slice)).map(move |i| {
        let off = i * slice;
        (off, slice.min(len - off))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_one_terminal_state() {
        let mut s = BatchState::new([10, 20, 30]);
        assert!(s.start(0));
        s.progress(0, 4);
        assert_eq!(s.bytes_done(0), 4);
        assert!(s.finish(0, TaskState::Completed));
        assert!(!s.finish(0, TaskState::Failed(Error::new(ErrorKind::Io, "late"))));
        assert_eq!(s.state(0), Some(&TaskState::Completed));
        assert_eq!(s.bytes_done(0), 10);
        assert!(s.finish(1, TaskState::TimedOut));
        assert!(!s.start(1), "a timed-out task never starts");
        assert!(!s.finish(1, TaskState::Completed), "TimedOut is terminal");
        assert_eq!(s.first_failure(), Some(1));
        assert!(!s.all_terminal());
        s.expire();
        assert!(s.all_terminal());
        assert_eq!(s.state(2), Some(&TaskState::TimedOut));
        assert_eq!(s.first_failure(), Some(1), "first failure in time order");
    }

    #[test]
    fn slicing_covers_every_byte_once() {
        let v: Vec<_> = slices(10, 4).collect();
        assert_eq!(v, vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(slices(8, 4).count(), 2);
        assert_eq!(slices(1, 1 << 20).collect::<Vec<_>>(), vec![(0, 1)]);
        assert_eq!(slices(0, 4).count(), 0);
        let total: u64 = slices((1 << 20) + 3, 65536).map(|(_, l)| l).sum();
        assert_eq!(total, (1 << 20) + 3);
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_makes_running_tasks_timed_out_and_wait_all_names_the_task() {
        let live = Arc::new(Liveness::default());
        let deadline = Instant::now() + std::time::Duration::from_millis(50);
        let shared = BatchShared::new(9, Some(deadline), vec![1, 1], live.clone());
        shared.finish(0, TaskState::Completed);
        let batch = Batch { shared };
        // Nothing else finishes task 1: the deadline does (paused clock, so no real sleep).
        tokio::time::advance(std::time::Duration::from_millis(60)).await;
        let err = batch.wait_all().await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::TimedOut);
        assert_eq!((err.batch(), err.task()), (Some(9), Some(1)));
        assert_eq!(
            batch.statuses(),
            vec![TaskState::Completed, TaskState::TimedOut]
        );
        assert_eq!(live.batches.load(Ordering::Acquire), 1);
        batch.free();
        assert_eq!(live.batches.load(Ordering::Acquire), 0);
    }
}
