//! Connectors, pipeline runner, scenarios and reports.
//!
//! - [`stage`]: a stage worker (stub, engines, pools) and its connector sides.
//! - [`ec`], [`kv`]: I/O-free connector state (encoder cache by mm_hash; paged
//!   KV blocks, prefix cache, run coalescing), unit-tested alone.
//! - [`control`]: control messages, in-process or framed msgpack over TCP.
//! - [`pool`]: registered pools carved into disjoint ranges.
//! - [`scenario`], [`runner`], [`report`]: what to run, running it, the report.
//! - [`process`]: stages as OS processes (`omnirig stage`), orchestrated over TCP.

pub mod control;
pub mod ec;
pub mod error;
pub mod kv;
pub mod pool;
pub mod process;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod stage;

pub use error::{HarnessError, Result};
pub use report::{HopResult, HopSummary, Report, RequestResult, Summary};
pub use runner::Runner;
pub use scenario::Scenario;
pub use stage::{StageOutcome, StageUsage, StageWorker};
