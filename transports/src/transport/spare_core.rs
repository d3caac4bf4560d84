//! Whether a busy-poll would only use a core nobody else is waiting for.
//!
//! The tcp and shm transports busy-poll for a reply before parking, because waking a parked
//! thread costs far more than a short spin (a 4 KiB tcp write: 9-10 us back to back with the
//! spin, 20 us without). That holds while the machine has a core to spare. When every core
//! is taken and threads wait for one, the spinner takes a core from the very thread it is
//! waiting for, or from the work of another stage: on two cores with the five-stage pipeline
//! at concurrency 4, the encoder's 5 MiB transfer took 7.5-11 ms spinning and 2.4-4.8 ms
//! gated (docs/benchmarks.md, "Polling only with a core to spare").
//!
//! So a spin goes on only while the kernel's count of runnable threads (`/proc/loadavg`'s
//! fourth field, running ones included, so the spinner itself too) is at most the cores this
//! process may use. The count is system-wide, so on a machine shared with other work, or
//! with this process pinned to fewer cores than the machine has, it spins less: the safe
//! side. Where the count cannot be read (not Linux), it spins as before.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long one reading of the count stands. A reading is one `pread` of a few dozen bytes;
/// a spin lasts 50 us to 1 ms and checks on every attempt, so most checks are an atomic load.
const FRESH: Duration = Duration::from_micros(200);

struct Gauge {
    loadavg: File,
    cores: usize,
    epoch: Instant,
    /// Nanoseconds after `epoch` of the last reading (0: none yet).
    read_at: AtomicU64,
    spare: AtomicBool,
}

fn gauge() -> Option<&'static Gauge> {
    static GAUGE: OnceLock<Option<Gauge>> = OnceLock::new();
    GAUGE
        .get_or_init(|| {
            let loadavg = File::open("/proc/loadavg").ok()?;
            let cores = std::thread::available_parallelism().ok()?.get();
            // Only a file that reads as a count is used.
            runnable_now(&loadavg)?;
            Some(Gauge {
                loadavg,
                cores,
                epoch: Instant::now(),
                read_at: AtomicU64::new(0),
                spare: AtomicBool::new(true),
            })
        })
        .as_ref()
}

/// The runnable count in `f` (`/proc/loadavg`) now: one `pread`, parsed in place.
fn runnable_now(f: &File) -> Option<usize> {
    let mut b = [0u8; 128];
    let n = f.read_at(&mut b, 0).ok()?;
    runnable(std::str::from_utf8(&b[..n]).ok()?)
}

/// Runnable threads in a `/proc/loadavg` line (`0.52 0.58 0.59 3/1234 5678`: 3).
fn runnable(loadavg: &str) -> Option<usize> {
    let field = loadavg.split_ascii_whitespace().nth(3)?;
    let (running, total) = field.split_once('/')?;
    let running: usize = running.parse().ok()?;
    let _: usize = total.parse().ok()?;
    Some(running)
}

/// A spin takes no core from anyone when the runnable threads, the spinner among them, fit
/// the cores.
fn spare(runnable: usize, cores: usize) -> bool {
    runnable <= cores
}

/// Whether busy-polling now takes no core another thread is waiting for (see the module).
/// Always true where the runnable count cannot be read.
pub(crate) fn spare_core() -> bool {
    let Some(g) = gauge() else {
        return true;
    };
    let now = (g.epoch.elapsed().as_nanos() as u64).max(1);
    let at = g.read_at.load(Ordering::Relaxed);
    if at != 0 && now.saturating_sub(at) < FRESH.as_nanos() as u64 {
        return g.spare.load(Ordering::Relaxed);
    }
    // One caller reads; the others use the last verdict meanwhile.
    if g.read_at
        .compare_exchange(at, now, Ordering::Relaxed, Ordering::Relaxed)
        .is_err()
    {
        return g.spare.load(Ordering::Relaxed);
    }
    let verdict = runnable_now(&g.loadavg).is_none_or(|r| spare(r, g.cores));
    g.spare.store(verdict, Ordering::Relaxed);
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runnable_count_is_the_fourth_fields_numerator() {
        assert_eq!(runnable("0.52 0.58 0.59 3/1234 5678\n"), Some(3));
        assert_eq!(runnable("0.00 0.01 0.05 1/97 12"), Some(1));
    }

    #[test]
    fn a_line_that_is_not_a_count_reads_as_none() {
        assert_eq!(runnable(""), None);
        assert_eq!(runnable("0.52 0.58 0.59"), None);
        assert_eq!(runnable("0.52 0.58 0.59 3 5678"), None);
        assert_eq!(runnable("0.52 0.58 0.59 x/1234 5678"), None);
        assert_eq!(runnable("0.52 0.58 0.59 3/y 5678"), None);
    }

    #[test]
    fn a_spin_is_spared_only_while_the_runnable_threads_fit_the_cores() {
        assert!(spare(1, 2));
        assert!(spare(2, 2));
        assert!(!spare(3, 2));
        assert!(spare(16, 16));
        assert!(!spare(17, 16));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn linux_gives_a_count() {
        assert!(gauge().is_some(), "/proc/loadavg did not read as a count");
    }
}
