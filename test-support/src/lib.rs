//! Test helpers shared by omnirig's crates, written once: a per-thread allocation meter (to
//! prove decoders never allocate by what their input claims) and transport decorators that
//! run every slice through a closure (delays, failures, a gate that parks slices until the
//! test opens it). A dev-dependency only; nothing here ships.

pub mod alloc;
pub mod slices;
