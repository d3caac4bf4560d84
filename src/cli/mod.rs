#[cfg(feature = "hil")]
pub mod agent;
pub mod bench;
pub mod fixtures;
pub mod metadata;
pub mod report;
pub mod run;
pub mod stage;
