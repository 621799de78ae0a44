//! The CUDA backend: kernels in `kernels/` compiled at start-up with NVRTC for the card's
//! architecture (cached on disk), thin typed launch wrappers, and [`CudaModel`], the same
//! batch-shaped forward as the CPU reference. Built on cudarc with dynamic loading, so this
//! compiles and links on machines without CUDA; using it there gives
//! [`CudaError::LibraryMissing`].

pub mod blas;
pub mod env_flag;
pub mod error;
pub mod fast;
pub mod fast_kq;
pub mod flash;
pub mod gpu;
pub mod gstream;
pub mod matmul;
pub mod mem_pool;
pub mod model;
pub mod nccl;
pub mod nvrtc;
pub mod peer_allreduce;
pub mod pipeline;
pub mod stream;
pub mod tma_experts;
pub mod upload;

pub use error::CudaError;
pub use gpu::{Arg, AttnArgs, DevMat, Gpu, KvDtype};
pub use matmul::{ExpertGroups, GEMM_MIN_TOKENS, GemmPrecision, gemm_fast, gemm_precision, set_dense_tile, set_gemm_compact, set_gemm_fast, set_gemm_precision, set_group_tile};
pub use model::{CudaModel, CudaOptions, LoadStats};
pub use model::sampling;
pub use nccl::{NCCL_ID_BYTES, NcclAbort, NcclComm};
