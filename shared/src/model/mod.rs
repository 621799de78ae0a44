//! Model configuration and tensor naming for the MiniMax-M2 family.

pub mod config;
pub mod names;

pub use config::{ConfigError, GatingFunc, ModelConfig};
