//! The cuda transport and GPU memory (cargo feature `cuda`; docs/gpu.md).
//!
//! - [`driver`]: the CUDA driver layer (libcuda loaded at run time): [`driver::Gpu`] opens a
//!   device, allocates device and pinned host regions, copies on streams with events, and
//!   exports / maps CUDA IPC handles.
//! - [`link`]: the transport for engines of one host. Like shm, the grant owner does the one
//!   copy itself, under the grant's fence: the initiator sends a small request over a Unix
//!   socket naming the grant and its own memory (a CUDA IPC handle and offset, or, inside one
//!   process, the address), the owner admits it, maps the initiator's allocation once (closed
//!   when the connection closes) and copies device to device (a peer copy when the two
//!   buffers are on different GPUs with peer access). A revoked grant is refused before any
//!   byte moves, and a copy in progress holds the fence, so `revoke` waits for it.
//! - [`gpudirect`]: GPUDirect RDMA registration planning (dmabuf export of device memory for
//!   the rdma transport), with the decision "register or stage" made once per engine.
//!
//! Without the feature, starting the transport is refused with an error naming the feature,
//! and GPU memory cannot be allocated.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::segment::{Endpoint, SegmentDescriptor};
use crate::transport::{Admission, BoxFuture, Transport, TransportKind, TransportSetup};

#[cfg(feature = "cuda")]
pub mod driver;
pub mod gpudirect;
#[cfg(feature = "cuda")]
pub mod link;

/// Where an engine's buffers live when the cuda transport provides its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaMemory {
    /// Plain host memory (the engine's default allocator): the transport only moves bytes.
    #[default]
    Host,
    /// Pinned host memory allocated through CUDA on the configured device.
    Pinned,
    /// Device memory of the configured GPU.
    Device,
}

/// How the cuda transport uses its GPU.
#[derive(Debug, Clone)]
pub struct CudaConfig {
    /// The device the engine's buffers live on and its copies run on.
    pub device: u32,
    /// What [`crate::Engine::allocate`] returns.
    pub memory: CudaMemory,
    /// Bytes per slice: one request, one device copy by the owner.
    pub slice_size: u64,
    /// Connections per peer (slices in flight per transfer).
    pub streams: usize,
    /// Backstop for one slice's reply; the engine's own deadline cancels earlier.
    pub slice_deadline: Duration,
    /// How long the owner's connection thread polls for the next request before it blocks:
    /// longer saves a thread wakeup per request that arrives within it, at a core's time.
    pub server_spin: Duration,
}

impl Default for CudaConfig {
    fn default() -> Self {
        Self {
            device: 0,
            memory: CudaMemory::Device,
            // Measured on one H200 (docs/gpu.md): 64 MiB x 4 moves device memory fastest;
            // 8 MiB x 8 helps 16 MiB device<->host copies a little and costs d2d a lot.
            slice_size: 64 << 20,
            streams: 4,
            slice_deadline: Duration::from_secs(60),
            // Measured on one H200 (docs/gpu.md): 200 us brings device<->host transfers of
            // 16-64 MiB to 0.93-0.96x of cuMemcpy (50 us: 0.85-0.90x; 1 ms: no better).
            server_spin: Duration::from_micros(200),
        }
    }
}

impl TransportSetup for CudaConfig {
    fn kind(&self) -> TransportKind {
        TransportKind::Cuda
    }

    /// Opens the device (an error without a driver or GPU) and starts the socket server.
    fn start(&self, engine: Admission) -> BoxFuture<'static, Result<Arc<dyn Transport>>> {
        #[cfg(feature = "cuda")]
        {
            link::start(self.clone(), engine)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = engine;
            Box::pin(async {
                Err(Error::new(
                    ErrorKind::NoTransport,
                    "this build has no cuda transport (build with `--features cuda`)",
                ))
            })
        }
    }
}

/// Where an engine's cuda endpoint is: an abstract socket name, the host it lives on (boot id
/// and pid namespace, as for shm), the UUID of its GPU and its process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaEndpoint {
    pub socket: String,
    pub host: String,
    #[serde(with = "serde_bytes")]
    pub gpu: Vec<u8>,
    /// A random id of the engine's process: an initiator in the same process sends addresses
    /// instead of IPC handles (a process cannot map its own IPC handles).
    pub process: u64,
}

const MAX_SOCKET_NAME: usize = 100;
const MAX_HOST: usize = 160;

impl CudaEndpoint {
    /// Checks an endpoint read from the network before anything uses it.
    pub fn validate(&self) -> Result<()> {
        if self.socket.is_empty()
            || self.socket.len() > MAX_SOCKET_NAME
            || self.host.len() > MAX_HOST
            || self.gpu.len() != 16
            || !self.socket.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(Error::new(
                ErrorKind::Malformed,
                format!(
                    "cuda endpoint must name a socket of 1..={MAX_SOCKET_NAME} printable bytes, a host of at most {MAX_HOST} bytes and a 16-byte GPU UUID"
                ),
            ));
        }
        Ok(())
    }

    pub fn to_endpoint(&self) -> Endpoint {
        Endpoint::new(
            TransportKind::Cuda,
            rmp_serde::to_vec(self).expect("a cuda endpoint always encodes"),
        )
    }

    /// The peer's cuda endpoint, decoded and validated, if it publishes one.
    pub fn of(peer: &SegmentDescriptor) -> Result<Option<CudaEndpoint>> {
        let Some(bytes) = peer.endpoint(TransportKind::Cuda) else {
            return Ok(None);
        };
        let e: CudaEndpoint = rmp_serde::from_slice(bytes)
            .map_err(|e| Error::new(ErrorKind::Malformed, format!("cuda endpoint: {e}")))?;
        e.validate()?;
        Ok(Some(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_round_trip_and_bad_ones_are_refused() {
        let e = CudaEndpoint {
            socket: "omnirig-cuda-1-2".into(),
            host: "boot/pidns".into(),
            gpu: vec![7; 16],
            process: 42,
        };
        let wire = e.to_endpoint();
        let back: CudaEndpoint = rmp_serde::from_slice(&wire.address).unwrap();
        assert_eq!(back, e);
        for bad in [
            CudaEndpoint {
                gpu: vec![1; 15],
                ..e.clone()
            },
            CudaEndpoint {
                socket: String::new(),
                ..e.clone()
            },
            CudaEndpoint {
                socket: "a b".into(),
                ..e.clone()
            },
            CudaEndpoint {
                host: "h".repeat(MAX_HOST + 1),
                ..e.clone()
            },
        ] {
            assert_eq!(bad.validate().unwrap_err().kind(), ErrorKind::Malformed);
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_feature_the_transport_refuses_to_start_naming_it() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let e = rt
            .block_on(crate::Engine::new(crate::EngineConfig::for_kind(
                "no-cuda",
                TransportKind::Cuda,
            )))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoTransport);
        assert!(e.to_string().contains("--features cuda"), "{e}");
    }
}
