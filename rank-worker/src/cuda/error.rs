//! Errors of the CUDA backend.

use minimax_shared::forward::BatchError;
use minimax_shared::quant::GgmlType;

/// What can go wrong finding the GPU, building kernels, loading weights or running a step.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA shared library could not be loaded (no driver, or NVRTC not on the loader path).
    #[error("{lib} not found: {hint}")]
    LibraryMissing { lib: &'static str, hint: &'static str },
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("NVRTC {call}: {code}")]
    Nvrtc { call: &'static str, code: String },
    /// A kernel module failed to compile; `log` is NVRTC's program log.
    #[error("kernel module '{module}' does not compile for sm_{arch}:\n{log}")]
    Compile { module: String, arch: u32, log: String },
    #[error("kernel function '{0}' is missing from the compiled modules")]
    MissingKernel(String),
    #[error("no CUDA kernel for {ty} in {what}")]
    Unsupported { ty: GgmlType, what: String },
    #[error("cuBLAS {call}: {detail}")]
    Blas { call: &'static str, detail: String },
    #[error("NCCL {call}: {detail}")]
    Nccl { call: &'static str, detail: String },
    #[error("tensor '{0}' is missing")]
    MissingTensor(String),
    #[error("shape: {0}")]
    Shape(String),
    #[error(transparent)]
    Batch(#[from] BatchError),
    #[error(transparent)]
    Config(#[from] minimax_shared::model::ConfigError),
    #[error(transparent)]
    Quant(#[from] minimax_shared::quant::QuantError),
    /// Reading weights from a model file failed.
    #[error("reading weights from {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

impl From<cudarc::nvrtc::result::NvrtcError> for CudaError {
    fn from(e: cudarc::nvrtc::result::NvrtcError) -> Self {
        CudaError::Nvrtc { call: "call", code: format!("{:?}", e.0) }
    }
}
