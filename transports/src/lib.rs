//! omnirig's transfer engine: registered memory, grants, batches, transports and metadata.
//!
//! The engine moves bytes between registered memory of engines, in this process (loopback)
//! or elsewhere (tcp), under grants the receiving side controls. It knows nothing of models,
//! stages or tensors.
//!
//! ```text
//! receiver: buf = engine.allocate(n); grant = engine.grant(&buf, 0, n, Access::Write)
//!           -- grant travels on the control path --
//! sender:   engine.transfer(vec![Request::write(&src, 0, &grant, 0, n)], Some(timeout))
//! receiver: engine.revoke(&grant); buf.read(0, &mut out)
//! ```

pub mod batch;
pub mod engine;
pub mod error;
pub mod grant;
pub mod idmap;
pub mod memory;
pub mod metadata;
pub mod segment;
pub mod staging;
pub mod transport;

pub use batch::{Batch, TaskState};
pub use engine::{
    Buffer, Engine, EngineConfig, Request, TransportDecorator, TransportPolicy, Usage,
};
pub use error::{Error, ErrorKind, Result};
pub use grant::{Access, Grant, GrantKey};
pub use metadata::{InProcessStore, MetadataStore};
pub use segment::{Endpoint, SegmentDescriptor};
pub use transport::cuda::{CudaConfig, CudaMemory};
pub use transport::fault::{FaultInjector, FaultKind, FaultPoint, FaultRule};
pub use transport::loopback::LoopbackConfig;
pub use transport::rdma::RdmaConfig;
pub use transport::shm::ShmConfig;
pub use transport::sim::{Fabric, FabricSpec, SimConfig};
pub use transport::tcp::TcpConfig;
pub use transport::{
    Admission, Link, LinkInfo, MemoryProvider, OpKind, SliceOp, Slicing, Transport, TransportKind,
    TransportSetup, default_setup,
};
