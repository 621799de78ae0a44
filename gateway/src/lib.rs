//! MiniMax Serve gateway: the CUDA-free brain in front of the rank-workers.

pub mod api;
pub mod cli;
pub mod constrain;
pub mod engine;
pub mod kv;
pub mod ranks;
pub mod sample;
pub mod sched;
pub mod synthetic;
pub mod text;
