//! MiniMax Serve rank-worker: executes forward steps on its shard of the model.

pub mod comm;
pub mod cpu;
pub mod inspect;
pub mod partition;
