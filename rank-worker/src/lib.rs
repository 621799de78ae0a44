//! MiniMax Serve rank-worker: executes forward steps on its shard of the model.

pub mod backend;
pub mod comm;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod inspect;
pub mod partition;
pub mod replay;
pub mod server;
pub mod state;
pub mod transport;
