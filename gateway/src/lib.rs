//! MiniMax Serve gateway: the CUDA-free brain in front of the rank-workers.

pub mod engine;
pub mod text;
