pub mod bench;
pub mod fixtures;
pub mod report;
pub mod run;
pub mod stage;
