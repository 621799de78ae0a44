//! The engine: scheduler, KV pages and prefix cache, sampling and the ranks behind them.

pub mod types;

pub use types::*;
