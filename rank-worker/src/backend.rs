//! One type for "the model this rank runs", whatever the device, so the server does not care
//! whether a step runs on the CPU reference or a GPU.

use std::sync::Arc;

use minimax_shared::forward::{ForwardBatch, ForwardOutput};
use minimax_shared::gguf::GgufModel;
use minimax_shared::model::ModelConfig;
use minimax_shared::model::synthetic::SyntheticSpec;

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
        #[cfg(feature = "cuda")]
        if matches!(self, BackendError::Cuda(crate::cuda::CudaError::Nccl { .. })) {
            // A failed NCCL call (all-reduce, or a pipeline send/receive): the world is broken.
            return true;
        }
        matches!(self, BackendError::Comm(_) | BackendError::Cpu(CpuError::Comm(_)))
    }
}

/// CUDA options for device `k`: defaults, with the KV cache precision from
/// `MINIMAX_CUDA_KV_DTYPE` (tests compare worlds on an f32 cache).
#[cfg(feature = "cuda")]
fn cuda_options(k: usize) -> Result<crate::cuda::CudaOptions, BackendError> {
    let mut opts = crate::cuda::CudaOptions { device: k, ..Default::default() };
    match std::env::var("MINIMAX_CUDA_KV_DTYPE").as_deref() {
        Ok("f32") => opts.kv_dtype = crate::cuda::KvDtype::F32,
        Ok("f16") => opts.kv_dtype = crate::cuda::KvDtype::F16,
        Ok("bf16") => opts.kv_dtype = crate::cuda::KvDtype::BF16,
        Ok(other) => return Err(BackendError::Unavailable(format!("MINIMAX_CUDA_KV_DTYPE={other}: expected f32, f16 or bf16"))),
        Err(_) => {}
    }
    Ok(opts)
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
                // Tensor parallelism: this rank's slice of every layer; pipeline: its layer
                // range (+ embedding on the first stage, norm + lm_head on the last). The NCCL
                // communicator is built at JOIN (`CudaModel::join_nccl`).
                let m = crate::cuda::CudaModel::load_part(model, part, kv, cuda_options(k)?)?;
                progress(1.0);
                Ok(Backend::Cuda(Box::new(m)))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(BackendError::Unavailable("CUDA backend not available in this build (feature `cuda` off)".into())),
        }
    }

    /// BENCHMARK ONLY: `part`'s share of a synthetic model with `spec`'s shapes and random
    /// weights (the same whole model on every rank). CUDA fills the weights on the device
    /// (`CudaModel::synthetic_part`); the CPU writes the whole model as a temporary GGUF file
    /// (removed once mapped) and loads its share, so only small layer counts fit there.
    pub fn synthetic(spec: &SyntheticSpec, part: Partition, kv: KvSpec, device: Device, progress: &mut dyn FnMut(f32)) -> Result<Self, BackendError> {
        const SEED: u64 = 42;
        match device {
            Device::Cpu => {
                let path = std::env::temp_dir().join(format!("minimax-synthetic-{}.gguf", std::process::id()));
                let io = |e: std::io::Error| BackendError::Unavailable(format!("writing the synthetic model to {}: {e}", path.display()));
                let mut w = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&path).map_err(io)?);
                let written = minimax_shared::model::synthetic_gguf::write_gguf(spec, SEED, &[], &mut w).and_then(|_| w.into_inner().map_err(|e| e.into_error()).map(drop));
                let model = written.map_err(io).and_then(|()| GgufModel::open(&path).map_err(|e| BackendError::Unavailable(e.to_string())));
                let _ = std::fs::remove_file(&path);
                let model = Arc::new(model?);
                Ok(Backend::Cpu(CpuModel::load_with_progress(model, part, kv, progress)?))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(k) => {
                let m = crate::cuda::CudaModel::synthetic_part(spec, part, kv, cuda_options(k)?, SEED)?;
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
            // Every CUDA share runs through `forward_stage`: a tensor-parallel rank (or the
            // whole model) returns logits; a pipeline stage receives/sends its hidden states
            // over NCCL on the device and only the last stage returns logits.
            #[cfg(feature = "cuda")]
            Backend::Cuda(m) => return Ok(m.forward_stage(batch)?),
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
