//! Where the stages' CPU-heavy work runs: generating tensors, digesting and checking what
//! arrives, poisoning reservations.
//!
//! It runs on a pool of threads of its own, niced below the runtime's workers, which run the
//! engines' data plane (the tcp transport's tasks, the control links). On a host whose
//! threads outnumber its cores, a data-plane thread that woke up waited in the run queue
//! behind these checks: on two cores at concurrency 4, talker -> code2wav's 2-3 KB writes
//! left in 4-19 us and their acknowledgements took 0.6-6.4 ms, and renicing two stage
//! processes cut its transfers over 1 ms from about 20 of 66 to about 5 (docs/sim.md).
//! Below the data plane's priority, a check yields its core to a woken transfer at once, so
//! what the rig measures is the transport, not its own verification. With cores to spare,
//! nothing changes: a nice value only matters to threads waiting for a core.
//!
//! The threads are niced once, when they start, and run nothing else: an unprivileged
//! process can raise a nice value but never lower it again, so a thread of the runtime
//! could not be lent to a check and handed back.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, Ordering};

use crate::error::{HarnessError, Result};

/// The nice value of the pool's threads unless [`set_nice`] says otherwise: far enough
/// below the data plane (weight 110 against 1024) that a woken transfer preempts a check.
pub const DEFAULT_NICE: i32 = 10;

/// The highest nice value Linux has; 0, the data plane's, is the lowest the pool takes.
pub const MAX_NICE: i32 = 19;

static NICE: AtomicI32 = AtomicI32::new(DEFAULT_NICE);
/// Built on first use, with the nice value of that moment; `None` when it could not be.
static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();

/// Verifications of at most this many bytes run in place: digesting a few KiB takes less
/// than handing the work to another thread.
pub(crate) const IN_PLACE_BYTES: u64 = 256 << 10;

/// Sets the nice value (0 to 19) of the threads that run the stages' CPU work. 0 runs it
/// on the runtime's own threads (`block_in_place`), at the data plane's priority, as before
/// the pool existed. Call it before the first stage starts: once the pool runs, asking for
/// another value is an error.
pub fn set_nice(nice: i32) -> Result<()> {
    if !(0..=MAX_NICE).contains(&nice) {
        return Err(HarnessError::Setup(format!(
            "check nice value {nice}: it must be 0 (the data plane's priority) to {MAX_NICE}"
        )));
    }
    let was = self::nice();
    if was != nice && POOL.get().is_some() {
        return Err(HarnessError::Setup(format!(
            "check nice value {nice}: the stages' CPU pool already runs at {was}"
        )));
    }
    NICE.store(nice, Ordering::Relaxed);
    Ok(())
}

/// The nice value the stages' CPU work runs at (see [`set_nice`]).
pub fn nice() -> i32 {
    NICE.load(Ordering::Relaxed)
}

fn pool() -> Option<&'static rayon::ThreadPool> {
    let nice = nice();
    if nice == 0 {
        return None;
    }
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("omnirig-cpu-{i}"))
            .start_handler(move |_| lower_priority(nice))
            .build()
            .inspect_err(|e| {
                tracing::warn!("no pool for the stages' CPU work ({e}); it runs in place")
            })
            .ok()
    })
    .as_ref()
}

/// Raises the calling thread's nice value to `nice`.
#[cfg(target_os = "linux")]
fn lower_priority(nice: i32) {
    // SAFETY: gettid has no preconditions. setpriority takes plain integers and touches no
    // memory of ours; on Linux a nice value belongs to a thread, and PRIO_PROCESS with a
    // thread id changes that one thread's.
    let r = unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::gettid() as libc::id_t,
            nice as libc::c_int,
        )
    };
    if r != 0 {
        tracing::warn!(
            "could not nice a CPU-work thread to {nice}: {}; checks run at the data plane's priority",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_priority(_nice: i32) {}

/// Whether this task runs on tokio's multi-thread runtime (not the sim's paused one, where
/// work on other threads would let virtual time run on).
pub(crate) fn multi_thread() -> bool {
    use tokio::runtime::{Handle, RuntimeFlavor};
    matches!(
        Handle::try_current().map(|h| h.runtime_flavor()),
        Ok(RuntimeFlavor::MultiThread)
    )
}

/// Runs CPU-heavy work (generating, digesting hundreds of MiB) without stalling the
/// runtime or the data plane: on the pool, while this worker's core goes on running the
/// process's other tasks (`block_in_place`). Blocks the calling task until it is done;
/// a panic in `f` comes back here.
pub(crate) fn cpu<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if !multi_thread() {
        return f();
    }
    match pool() {
        Some(p) => tokio::task::block_in_place(|| p.install(f)),
        None => tokio::task::block_in_place(f),
    }
}

/// [`cpu`] for work on `bytes` bytes: in place when they are few.
pub(crate) fn cpu_for<R: Send>(bytes: u64, f: impl FnOnce() -> R + Send) -> R {
    if bytes <= IN_PLACE_BYTES { f() } else { cpu(f) }
}

/// Runs `f` on the pool while this task waits (the worker runs other tasks meanwhile), for
/// work that owns what it touches. Where there is no pool, on tokio's blocking threads.
pub(crate) async fn spawn<R: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> R + Send + 'static,
) -> Result<R> {
    let failed = |e: &dyn std::fmt::Display| HarnessError::Pool {
        pool: what.into(),
        reason: format!("the task failed: {e}"),
    };
    match pool() {
        Some(p) => {
            let (tx, rx) = tokio::sync::oneshot::channel();
            p.spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
                let _ = tx.send(r);
            });
            match rx.await {
                Ok(Ok(r)) => Ok(r),
                Ok(Err(panic)) => std::panic::resume_unwind(panic),
                Err(e) => Err(failed(&e)),
            }
        }
        None => tokio::task::spawn_blocking(f).await.map_err(|e| failed(&e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pool's threads run below the data plane: their nice value is the one set, and
    /// the runtime's worker that waits for them keeps its own.
    #[cfg(target_os = "linux")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn work_runs_on_niced_threads_and_comes_back() {
        fn own_nice() -> i32 {
            // SAFETY: gettid has no preconditions; getpriority reads one integer.
            unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
        }
        let worker = own_nice();
        let (on, there) = cpu(|| (std::thread::current().name().map(str::to_owned), own_nice()));
        assert_eq!(there, nice());
        assert_eq!(
            on.as_deref().map(|n| n.starts_with("omnirig-cpu-")),
            Some(true)
        );
        assert_eq!(own_nice(), worker);
        let borrowed = vec![7u8; 1 << 20];
        assert_eq!(
            cpu(|| borrowed.iter().map(|&b| u64::from(b)).sum::<u64>()),
            7 << 20
        );
        assert_eq!(spawn("test", own_nice).await.unwrap(), nice());
    }

    #[test]
    fn a_nice_value_out_of_range_or_changed_under_a_running_pool_is_refused() {
        let e = set_nice(20).unwrap_err().to_string();
        assert!(e.contains("nice value 20"), "{e}");
        assert!(set_nice(-1).is_err());
        assert!(set_nice(DEFAULT_NICE).is_ok());
        let _ = pool();
        let e = set_nice(DEFAULT_NICE + 1).unwrap_err().to_string();
        assert!(e.contains("already runs at 10"), "{e}");
        assert_eq!(nice(), DEFAULT_NICE);
    }
}
