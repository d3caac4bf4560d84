//! Connectors, pipeline runner, scenarios and reports.
//!
//! ```no_run
//! # async fn demo() -> omnirig_harness::Result<()> {
//! use omnirig_harness::{Runner, Scenario};
//! let report = Runner::new(Scenario::default_scenario()).progress(true).run().await?;
//! report.write(std::path::Path::new("out"))?;
//! assert!(report.passed(), "{}", report.summary_text());
//! # Ok(()) }
//! ```
//!
//! - [`stage`]: a stage worker (stub, one engine per hop end, registered
//!   pools) and its side of each connector. Every hop is consumer-driven:
//!   reserve + grant, the producer writes, then FINISH / packet v1 / ERROR.
//! - [`ec`], [`kv`]: I/O-free connector state (encoder cache by mm_hash; paged
//!   KV blocks with a prefix cache, block lists, run coalescing).
//! - [`protocol`]: the stage-packet connector as I/O-free state machines (events in,
//!   actions out, the clock passed in), driven by [`stage`].
//! - [`control`]: control messages, in-process or framed msgpack over TCP,
//!   routed per request.
//! - [`pool`]: registered pools carved into disjoint ranges.
//! - [`scenario`]: YAML scenarios; [`runner`]: runs one (in process, or as OS
//!   processes via [`process`]); [`report`]: `report.json`.

pub mod control;
pub mod cpu;
pub mod ec;
pub mod error;
pub mod faults;
pub mod host;
pub mod inline;
pub mod kv;
pub mod pool;
pub mod pregen;
pub mod process;
pub mod protocol;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod sim;
pub mod stage;

pub use error::{HarnessError, Result};
pub use report::{HopResult, HopSummary, Report, RequestResult, Summary};
pub use runner::Runner;
pub use scenario::{Scenario, StageMemory};
pub use stage::{StageOutcome, StageUsage, StageWorker};
