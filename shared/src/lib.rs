//! What the gateway and the ranks must agree on: GGUF files, quant formats, model config and
//! the batch-shaped forward contract.

pub mod forward;
pub mod gguf;
pub mod model;
pub mod quant;
pub mod sampling;
