//! Where the two ends of a measured hop run. On a small machine the scheduler sometimes puts
//! the sender and the receiver on one core, and a hop then costs twice as much (both ends
//! busy-poll); which placement a run gets decides its numbers more than any code change. As
//! perftest users do with `taskset`, the hop suite pins the sender side to one CPU and the
//! receiver side to another, the same for omnirig and for the Python baseline.

use anyhow::{Context, bail};

/// The sender side's CPU and the receiver side's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuPair {
    pub sender: usize,
    pub receiver: usize,
}

/// Environment variable through which the baseline's receiver process learns its CPU.
pub const BASELINE_RECEIVER_CPU: &str = "OMNIRIG_BASELINE_RECEIVER_CPU";

/// `auto` (the first two CPUs this process may use; none when it may use only one),
/// `none`, or `A,B`.
pub fn parse(s: &str) -> anyhow::Result<Option<CpuPair>> {
    match s.trim() {
        "none" | "off" => Ok(None),
        "auto" => {
            let mine = allowed()?;
            Ok(match mine.as_slice() {
                [a, b, ..] => Some(CpuPair {
                    sender: *a,
                    receiver: *b,
                }),
                _ => None,
            })
        }
        pair => {
            let (a, b) = pair
                .split_once(',')
                .context("--cpus: expected auto, none or SENDER,RECEIVER (e.g. 0,1)")?;
            let p = CpuPair {
                sender: a.trim().parse().context("--cpus: sender CPU")?,
                receiver: b.trim().parse().context("--cpus: receiver CPU")?,
            };
            let mine = allowed()?;
            for c in [p.sender, p.receiver] {
                if !mine.contains(&c) {
                    bail!("--cpus: CPU {c} is not one this process may use ({mine:?})");
                }
            }
            Ok(Some(p))
        }
    }
}

/// The CPUs this process may run on.
pub fn allowed() -> anyhow::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain bits, so all-zero is a valid empty set; the kernel writes at
    // most size_of::<cpu_set_t>() bytes into it, the size we pass.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(std::io::Error::last_os_error()).context("sched_getaffinity");
        }
        set
    };
    // SAFETY: CPU_ISSET only reads the set, for indices below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Pins the calling thread (and the processes and threads it starts afterwards) to `cpu`.
pub fn pin(cpu: usize) -> anyhow::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        bail!("CPU {cpu} is beyond CPU_SETSIZE");
    }
    // SAFETY: as in `allowed`; CPU_SET writes one bit of the local set, index checked above,
    // and the kernel only reads size_of::<cpu_set_t>() bytes of it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("pinning to CPU {cpu}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pairs_and_refuses_nonsense() {
        assert_eq!(parse("none").unwrap(), None);
        let mine = allowed().unwrap();
        assert!(!mine.is_empty());
        let auto = parse("auto").unwrap();
        assert_eq!(auto.is_some(), mine.len() >= 2);
        let c = mine[0];
        assert_eq!(
            parse(&format!("{c},{c}")).unwrap(),
            Some(CpuPair {
                sender: c,
                receiver: c
            })
        );
        assert!(
            parse("0")
                .unwrap_err()
                .to_string()
                .contains("SENDER,RECEIVER")
        );
        assert!(parse("a,1").is_err());
        assert!(
            parse("0,100000")
                .unwrap_err()
                .to_string()
                .contains("100000")
        );
    }
}
