//! `ModelConfig`: the hyper-parameters of a MiniMax-M2-family model, read from GGUF metadata
//! and checked against the tensor shapes, so that nothing about a model is hard-coded.

use crate::gguf::{GgufModel, MetaValue};
use crate::quant::GgmlType;

use super::names;

/// Why a GGUF file is not a model we can run.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("metadata key '{0}' is missing")]
    MissingKey(String),
    #[error("metadata key '{key}': {detail}")]
    BadKey { key: String, detail: String },
    #[error("architecture '{0}' is not supported (supported: minimax-m2)")]
    Architecture(String),
    #[error("tensor '{0}' is missing")]
    MissingTensor(String),
    #[error("tensor '{tensor}' has shape {found:?}, expected {expected:?} (from the metadata)")]
    Shape { tensor: String, expected: Vec<u64>, found: Vec<u64> },
    #[error("not yet supported: {ty} in {tensor}")]
    Unsupported { tensor: String, ty: GgmlType },
}

/// How the router turns logits into expert scores (llama.cpp's `expert_gating_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatingFunc {
    Softmax,
    Sigmoid,
}

/// Hyper-parameters of one model. Dimensions are element counts.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: String,
    pub name: Option<String>,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Per-head width of q and k.
    pub head_dim: usize,
    /// Per-head width of v (and of the attention output).
    pub v_head_dim: usize,
    /// Leading dims of each head that RoPE rotates (NeoX layout); the rest pass through.
    pub rotary_dim: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub n_experts: usize,
    pub n_experts_used: usize,
    pub expert_ff: usize,
    pub gating: GatingFunc,
    pub context_length: usize,
    pub vocab_size: usize,
    /// Whether `output.weight` is absent and the embedding table doubles as lm_head.
    pub tied_embeddings: bool,
}

fn key(arch: &str, suffix: &str) -> String {
    format!("{arch}.{suffix}")
}

fn req<'a>(m: &'a GgufModel, k: &str) -> Result<&'a MetaValue, ConfigError> {
    m.meta(k).ok_or_else(|| ConfigError::MissingKey(k.to_string()))
}

fn req_usize(m: &GgufModel, k: &str) -> Result<usize, ConfigError> {
    let v = req(m, k)?;
    let n = v.as_u64().ok_or_else(|| ConfigError::BadKey {
        key: k.to_string(),
        detail: format!("expected a non-negative integer, found {}", v.type_name()),
    })?;
    if n == 0 || n > (1 << 40) {
        return Err(ConfigError::BadKey { key: k.to_string(), detail: format!("{n} is out of range") });
    }
    Ok(n as usize)
}

fn req_f32(m: &GgufModel, k: &str) -> Result<f32, ConfigError> {
    let v = req(m, k)?;
    let x = v.as_f64().ok_or_else(|| ConfigError::BadKey {
        key: k.to_string(),
        detail: format!("expected a number, found {}", v.type_name()),
    })?;
    if !x.is_finite() || x <= 0.0 {
        return Err(ConfigError::BadKey { key: k.to_string(), detail: format!("{x} must be positive and finite") });
    }
    Ok(x as f32)
}

impl ModelConfig {
    /// Reads and checks the config of a `minimax-m2` GGUF model.
    pub fn from_gguf(m: &GgufModel) -> Result<Self, ConfigError> {
        let arch_v = req(m, "general.architecture")?;
        let arch = arch_v
            .as_str()
            .ok_or_else(|| ConfigError::BadKey { key: "general.architecture".into(), detail: "not a string".into() })?
            .to_string();
        if arch != "minimax-m2" {
            return Err(ConfigError::Architecture(arch));
        }
        let a = arch.as_str();
        let n_heads = req_usize(m, &key(a, "attention.head_count"))?;
        let n_kv_heads = req_usize(m, &key(a, "attention.head_count_kv"))?;
        let head_dim = req_usize(m, &key(a, "attention.key_length"))?;
        let v_head_dim = req_usize(m, &key(a, "attention.value_length"))?;
        let rotary_dim = req_usize(m, &key(a, "rope.dimension_count"))?;
        let n_experts = req_usize(m, &key(a, "expert_count"))?;
        let n_experts_used = req_usize(m, &key(a, "expert_used_count"))?;
        let gating = match req_usize(m, &key(a, "expert_gating_func"))? {
            1 => GatingFunc::Softmax,
            2 => GatingFunc::Sigmoid,
            g => {
                return Err(ConfigError::BadKey {
                    key: key(a, "expert_gating_func"),
                    detail: format!("unknown gating function {g} (1 = softmax, 2 = sigmoid)"),
                });
            }
        };
        let bad = |k: &str, detail: String| ConfigError::BadKey { key: key(a, k), detail };
        if n_heads % n_kv_heads != 0 {
            return Err(bad("attention.head_count_kv", format!("{n_kv_heads} does not divide head_count {n_heads}")));
        }
        if rotary_dim > head_dim || rotary_dim % 2 != 0 {
            return Err(bad("rope.dimension_count", format!("{rotary_dim} must be even and at most key_length {head_dim}")));
        }
        if n_experts_used > n_experts {
            return Err(bad("expert_used_count", format!("{n_experts_used} exceeds expert_count {n_experts}")));
        }
        let tied = m.tensor(names::OUTPUT).is_none();
        let embd = m.tensor(names::TOKEN_EMBD).ok_or_else(|| ConfigError::MissingTensor(names::TOKEN_EMBD.into()))?;
        let vocab_size = *embd.info.dims.get(1).unwrap_or(&0) as usize;
        let cfg = Self {
            name: m.meta("general.name").and_then(MetaValue::as_str).map(str::to_string),
            n_layers: req_usize(m, &key(a, "block_count"))?,
            hidden: req_usize(m, &key(a, "embedding_length"))?,
            n_heads,
            n_kv_heads,
            head_dim,
            v_head_dim,
            rotary_dim,
            rope_theta: req_f32(m, &key(a, "rope.freq_base"))?,
            rms_eps: req_f32(m, &key(a, "attention.layer_norm_rms_epsilon"))?,
            n_experts,
            n_experts_used,
            expert_ff: req_usize(m, &key(a, "expert_feed_forward_length"))?,
            gating,
            context_length: req_usize(m, &key(a, "context_length"))?,
            vocab_size,
            tied_embeddings: tied,
            arch,
        };
        cfg.check_tensors(m)?;
        Ok(cfg)
    }

    /// The expected ggml-order shape of every tensor the forward pass reads.
    pub fn expected_shapes(&self) -> Vec<(String, Vec<u64>)> {
        let (h, v) = (self.hidden as u64, self.vocab_size as u64);
        let q = (self.n_heads * self.head_dim) as u64;
        let k = (self.n_kv_heads * self.head_dim) as u64;
        let vv = (self.n_kv_heads * self.v_head_dim) as u64;
        let o = (self.n_heads * self.v_head_dim) as u64;
        let (e, ff) = (self.n_experts as u64, self.expert_ff as u64);
        let mut out = vec![(names::TOKEN_EMBD.to_string(), vec![h, v]), (names::OUTPUT_NORM.to_string(), vec![h])];
        if !self.tied_embeddings {
            out.push((names::OUTPUT.to_string(), vec![h, v]));
        }
        for l in 0..self.n_layers {
            let b = |n: &str| names::block(l, n);
            out.extend([
                (b(names::ATTN_NORM), vec![h]),
                (b(names::ATTN_Q), vec![h, q]),
                (b(names::ATTN_K), vec![h, k]),
                (b(names::ATTN_V), vec![h, vv]),
                (b(names::ATTN_OUTPUT), vec![o, h]),
                (b(names::ATTN_Q_NORM), vec![q]),
                (b(names::ATTN_K_NORM), vec![k]),
                (b(names::FFN_NORM), vec![h]),
                (b(names::FFN_GATE_INP), vec![h, e]),
                (b(names::EXP_PROBS_B), vec![e]),
                (b(names::FFN_GATE_EXPS), vec![h, ff, e]),
                (b(names::FFN_UP_EXPS), vec![h, ff, e]),
                (b(names::FFN_DOWN_EXPS), vec![ff, h, e]),
            ]);
        }
        out
    }

    fn check_tensors(&self, m: &GgufModel) -> Result<(), ConfigError> {
        if self.vocab_size == 0 {
            return Err(ConfigError::Shape {
                tensor: names::TOKEN_EMBD.into(),
                expected: vec![self.hidden as u64, 0],
                found: m.tensor(names::TOKEN_EMBD).map(|t| t.info.dims.clone()).unwrap_or_default(),
            });
        }
        for (name, shape) in self.expected_shapes() {
            let t = m.tensor(&name).ok_or_else(|| ConfigError::MissingTensor(name.clone()))?;
            if t.info.dims != shape {
                return Err(ConfigError::Shape { tensor: name, expected: shape, found: t.info.dims.clone() });
            }
            if !t.info.ty.is_supported() {
                return Err(ConfigError::Unsupported { tensor: name, ty: t.info.ty });
            }
        }
        Ok(())
    }

    /// Query heads that share one KV head (GQA group size).
    pub fn gqa_group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}
