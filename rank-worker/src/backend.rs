//! One type for "the model this rank runs", whatever the device, so the server does not care
//! whether a step runs on the CPU reference or a GPU.

use std::sync::Arc;

use minimax_shared::forward::{ForwardBatch, ForwardOutput};
use minimax_shared::gguf::GgufModel;
use minimax_shared::model::ModelConfig;

use crate::comm::{CommError, Collective, Solo};
use crate::cpu::{CpuError, CpuModel, KvSpec};
use crate::partition::Partition;
use crate::transport::TestTransport;

/// Which device a rank computes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "cpu" {
            return Ok(Device::Cpu);
        }
        match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(k)) => Ok(Device::Cuda(k)),
            _ => Err(format!("device '{s}': expected cpu or cuda:K")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(k) => write!(f, "cuda:{k}"),
        }
    }
}

/// How the world splits the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Parallelism {
    Pipeline,
    Tensor,
}

impl Parallelism {
    /// The name Describe reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Parallelism::Pipeline => "pipeline",
            Parallelism::Tensor => "tensor",
        }
    }
}

/// What can go wrong loading or running a backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Cpu(#[from] CpuError),
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error("{0}")]
    Unavailable(String),
}

impl BackendError {
    /// Whether the failure broke the world (a collective or transport failed).
    pub fn is_comm(&self) -> bool {
        matches!(self, BackendError::Comm(_) | BackendError::Cpu(CpuError::Comm(_)))
    }
}

/// The model a rank runs.
pub enum Backend {
    Cpu(CpuModel),
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::CudaModel>),
}

impl Backend {
    /// Loads this rank's share on `device`; `progress` gets the fraction loaded.
    pub fn load(
        model: Arc<GgufModel>,
        part: Partition,
        kv: KvSpec,
        device: Device,
        progress: &mut dyn FnMut(f32),
    ) -> Result<Self, BackendError> {
        match device {
            Device::Cpu => Ok(Backend::Cpu(CpuModel::load_with_progress(model, part, kv, progress)?)),
            #[cfg(feature = "cuda")]
            Device::Cuda(k) => {
                let cfg = ModelConfig::from_gguf(&model).map_err(CpuError::from)?;
                if part.layers != (0..cfg.n_layers) || !part.first_stage || !part.last_stage {
                    return Err(BackendError::Unavailable(format!(
                        "CUDA pipeline worlds are not implemented yet (this rank would hold layers {:?}); \
                         use --parallelism tensor for several GPUs",
                        part.layers
                    )));
                }
                // Tensor parallelism: this rank's slice of every layer; the NCCL communicator
                // is built at JOIN (`CudaModel::join_nccl`).
                let mut opts = crate::cuda::CudaOptions { device: k, ..Default::default() };
                // KV cache precision (tests compare worlds on an f32 cache).
                match std::env::var("MINIMAX_CUDA_KV_DTYPE").as_deref() {
                    Ok("f32") => opts.kv_dtype = crate::cuda::KvDtype::F32,
                    Ok("f16") => opts.kv_dtype = crate::cuda::KvDtype::F16,
                    Ok("bf16") => opts.kv_dtype = crate::cuda::KvDtype::BF16,
                    Ok(other) => return Err(BackendError::Unavailable(format!("MINIMAX_CUDA_KV_DTYPE={other}: expected f32, f16 or bf16"))),
                    Err(_) => {}
                }
                let m = crate::cuda::CudaModel::load_part(model, part, kv, opts)?;
                progress(1.0);
                Ok(Backend::Cuda(Box::new(m)))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(BackendError::Unavailable("CUDA backend not available in this build (feature `cuda` off)".into())),
        }
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        match self {
            Backend::Cpu(m) => m.config(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(m) => m.config(),
        }
    }

    /// Bytes of weights this rank holds in its layers (CPU) or on the device (CUDA).
    pub fn weight_bytes(&self) -> u64 {
        match self {
            Backend::Cpu(m) => m.layer_bytes() as u64,
            #[cfg(feature = "cuda")]
            Backend::Cuda(m) => m.load_stats().bytes as u64,
        }
    }

    /// Checks a batch before anything is touched.
    pub fn validate(&self, batch: &ForwardBatch) -> Result<(), String> {
        match self {
            Backend::Cpu(m) => m.validate(batch).map_err(|e| e.to_string()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(m) => m.validate(batch).map_err(|e| e.to_string()),
        }
    }

    /// Runs this rank's part of one step. Returns logits on the rank(s) that compute them
    /// (`None` on pipeline stages before the last).
    pub fn step(
        &mut self,
        batch: &ForwardBatch,
        part: &Partition,
        par: Parallelism,
        world: Option<&TestTransport>,
    ) -> Result<Option<ForwardOutput>, BackendError> {
        let m = match self {
            Backend::Cpu(m) => m,
            #[cfg(feature = "cuda")]
            Backend::Cuda(m) => return Ok(Some(m.forward(batch)?)),
        };
        let Some(world) = world.filter(|w| w.world() > 1) else {
            return Ok(Some(m.forward(batch, &Solo)?));
        };
        match par {
            Parallelism::Tensor => Ok(Some(m.forward(batch, world)?)),
            Parallelism::Pipeline => {
                let stage = world.rank();
                let mut hidden = if part.first_stage { m.embed(batch, &Solo)? } else { world.recv_activations(stage - 1)? };
                m.run_layers(batch, &mut hidden, &Solo)?;
                if part.last_stage {
                    Ok(Some(m.logits(batch, &hidden, &Solo)?))
                } else {
                    world.send_activations(stage + 1, &hidden)?;
                    Ok(None)
                }
            }
        }
    }
}
