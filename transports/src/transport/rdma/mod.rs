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

#[cfg(feature = "rdma")]
pub mod fence;
pub mod keys;
#[cfg(feature = "rdma")]
pub mod link;
#[cfg(feature = "rdma")]
pub mod verbs;
