//! Errors of the CPU backend.

use minimax_shared::forward::BatchError;
use minimax_shared::quant::QuantError;

use crate::comm::CommError;
use crate::partition::PartitionError;

/// What can go wrong loading or running the CPU backend.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("tensor '{0}' is missing")]
    MissingTensor(String),
    #[error("shape: {0}")]
    Shape(String),
    #[error(transparent)]
    Quant(#[from] QuantError),
    #[error(transparent)]
    Batch(#[from] BatchError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Partition(#[from] PartitionError),
    #[error(transparent)]
    Config(#[from] minimax_shared::model::ConfigError),
}
