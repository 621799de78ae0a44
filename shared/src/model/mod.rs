//! Model configuration and tensor naming for the MiniMax-M2 family.

pub mod config;
pub mod names;
pub mod synthetic;
pub mod synthetic_gguf;

pub use config::{ConfigError, GatingFunc, ModelConfig};
