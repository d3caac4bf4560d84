pub mod bench;
pub mod fixtures;
