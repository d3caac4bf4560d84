pub mod bench;
pub mod fixtures;
pub mod run;
pub mod stage;
