//! The rdma transport (cargo feature `rdma`): reliable-connected queue pairs per peer, one-sided
//! RDMA WRITE for pushes and RDMA READ for pulls into granted ranges that the target fenced on
//! its device (a per-grant memory window or memory region, see [`fence`]).
//!
//! - [`keys`]: the endpoint exchanged at connection setup and the key attached to a grant, with
//!   validating decoders (always compiled: they are plain bytes).
//! - [`verbs`]: the thin safe layer over libibverbs (through `sideway`; libibverbs is loaded at
//!   run time, so a binary built with `rdma` starts where verbs are absent and says so).
//! - [`fence`]: the grant fence on the device.
//!
//! Tests: `transports/tests/rdma.rs`, run in a soft-RoCE VM by `ci/softroce.sh`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
#[cfg(not(feature = "rdma"))]
use crate::error::{Error, ErrorKind};
use crate::transport::{Admission, BoxFuture, Transport, TransportKind, TransportSetup};

#[cfg(feature = "rdma")]
pub mod fence;
pub mod keys;
#[cfg(feature = "rdma")]
pub mod link;
#[cfg(feature = "rdma")]
pub mod verbs;

/// How the rdma transport uses its device.
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// Device name (`mlx5_0`, `rxe0`); `None`: the first device.
    pub device: Option<String>,
    pub port: u8,
    /// GID index to send from; `None`: the first RoCEv2 IPv4 GID (or first GID on IB).
    pub gid_index: Option<u32>,
    /// Work requests in flight per queue pair. Default 32: two chains of 16. Only a chain's
    /// last request is signaled, so its entries come back all at once; with room for one
    /// chain only, the send queue runs dry while that completion is reaped and the next chain
    /// posted (docs/rdma.md, "One completion per chain").
    pub max_outstanding: u32,
    /// Queue pairs per peer link (lanes): slices of concurrent tasks run on different queue
    /// pairs at once. Default 1: with more, a peer that died and came back costs each lane one
    /// failed slice before it reconnects (a lane only learns of it from its own queue pair), so
    /// the dead-peer recovery case does not hold yet.
    pub queue_pairs_per_peer: usize,
    /// Slices under way at once on one queue pair (their work requests share its send queue,
    /// `max_outstanding` in all): a batch's slices are posted back to back instead of one run
    /// draining before the next starts. A slice flushed because another on its queue pair
    /// failed runs once more on a fresh queue pair.
    pub runs_per_queue_pair: usize,
    /// Largest single RDMA WRITE / READ.
    pub work_request_size: u32,
    /// Slice size the engine cuts requests into for this transport.
    pub slice_size: u64,
    /// Where the control (connection setup, key resolution) server listens.
    pub listen: SocketAddr,
    /// Backstop for one slice; the engine's own deadline cancels earlier.
    pub slice_deadline: Duration,
    /// How long a completion wait spins before it parks on the completion channel (0: park at
    /// once; large: busy-poll).
    pub completion_spin: Duration,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            device: None,
            port: 1,
            gid_index: None,
            max_outstanding: 32,
            queue_pairs_per_peer: 1,
            runs_per_queue_pair: 8,
            work_request_size: 256 << 10,
            slice_size: 4 << 20,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            slice_deadline: Duration::from_secs(60),
            completion_spin: Duration::from_micros(50),
        }
    }
}

impl TransportSetup for RdmaConfig {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    /// Opens the device and starts the control server.
    fn start(&self, engine: Admission) -> BoxFuture<'static, Result<Arc<dyn Transport>>> {
        #[cfg(feature = "rdma")]
        {
            link::start(self.clone(), engine)
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = engine;
            Box::pin(async {
                Err(Error::new(
                    ErrorKind::NoTransport,
                    "this build has no rdma transport (build with `--features rdma`)",
                ))
            })
        }
    }
}
