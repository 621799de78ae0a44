//! MiniMax Serve rank-worker: executes forward steps on its shard of the model.

pub mod comm;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod inspect;
pub mod partition;
