//! The CPU backend: the numerical reference for the CUDA kernels and the backend CI runs the
//! whole multi-process system on. Plain Rust, f32 activations, weights kept quantized and
//! multiplied block by block.

mod attention;
mod error;
mod kv;
mod matrix;
mod moe;
mod norm_rope;

use std::collections::HashMap;
use std::sync::Arc;

use minimax_shared::forward::{ForwardBatch, ForwardOutput, LogitsRow};
use minimax_shared::gguf::GgufModel;
use minimax_shared::model::{ModelConfig, names};

pub use error::CpuError;
pub use moe::route;

use crate::comm::Collective;
use crate::partition::Partition;
use attention::Attention;
use kv::PagedKv;
use matrix::{Matrix, vector};
use moe::Moe;
use norm_rope::{rms_norm, rope_table};

/// Size of the paged KV cache a rank allocates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSpec {
    pub page_size: usize,
    pub n_pages: usize,
}

pub(crate) struct LoadCtx<'a> {
    model: &'a Arc<GgufModel>,
    cfg: &'a ModelConfig,
    part: &'a Partition,
}

/// Per-step context shared by the layers.
pub(crate) struct RunCtx<'a> {
    cfg: &'a ModelConfig,
    batch: &'a ForwardBatch,
    rope: HashMap<usize, Vec<(f32, f32)>>,
}

impl RunCtx<'_> {
    fn rope(&self, pos: usize) -> &[(f32, f32)] {
        &self.rope[&pos]
    }
}

/// Where one new token of the batch sits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenMeta {
    seq: usize,
    pos: usize,
    slot: usize,
}

struct Layer {
    attn_norm: Vec<f32>,
    attn: Attention,
    ffn_norm: Vec<f32>,
    moe: Moe,
}

/// This rank's part of the model plus its KV cache.
pub struct CpuModel {
    cfg: ModelConfig,
    part: Partition,
    /// Rows of the embedding table this rank holds (a vocab slice under tensor parallelism).
    embd: Option<(Matrix, std::ops::Range<usize>)>,
    head: Option<(Vec<f32>, Matrix, std::ops::Range<usize>)>,
    layers: Vec<Layer>,
    kv: PagedKv,
}

/// Splits `n` into `world` nearly equal contiguous ranges and returns the `rank`-th.
fn even_range(n: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
    let (base, extra) = (n / world, n % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

impl CpuModel {
    /// Loads this rank's share of `model` (weights stay in the memory map where possible).
    pub fn load(model: Arc<GgufModel>, part: Partition, kv: KvSpec) -> Result<Self, CpuError> {
        Self::load_with_progress(model, part, kv, &mut |_| {})
    }

    /// [`CpuModel::load`], calling `progress` with the fraction of layers loaded (0..=1) so a
    /// serving rank can report load progress.
    pub fn load_with_progress(model: Arc<GgufModel>, part: Partition, kv: KvSpec, progress: &mut dyn FnMut(f32)) -> Result<Self, CpuError> {
        let cfg = ModelConfig::from_gguf(&model)?;
        if part.layers.end > cfg.n_layers {
            return Err(CpuError::Shape(format!("layers {:?} of a {}-layer model", part.layers, cfg.n_layers)));
        }
        let ctx = LoadCtx { model: &model, cfg: &cfg, part: &part };
        let vocab = even_range(cfg.vocab_size, part.tp_rank, part.tp_world);
        let embd = if part.first_stage {
            Some((Matrix::rows(&model, names::TOKEN_EMBD, vocab.clone())?, vocab.clone()))
        } else {
            None
        };
        let head = if part.last_stage {
            let name = if cfg.tied_embeddings { names::TOKEN_EMBD } else { names::OUTPUT };
            Some((vector(&model, names::OUTPUT_NORM, None)?, Matrix::rows(&model, name, vocab.clone())?, vocab))
        } else {
            None
        };
        let mut layers = Vec::with_capacity(part.layers.len());
        for l in part.layers.clone() {
            layers.push(Layer {
                attn_norm: vector(&model, &names::block(l, names::ATTN_NORM), None)?,
                attn: Attention::load(&ctx, l)?,
                ffn_norm: vector(&model, &names::block(l, names::FFN_NORM), None)?,
                moe: Moe::load(&ctx, l)?,
            });
            progress(layers.len() as f32 / part.layers.len().max(1) as f32);
        }
        let kv_heads = part.tp_range(cfg.n_kv_heads).len();
        let kv = PagedKv::new(layers.len(), kv.page_size, kv.n_pages, kv_heads, cfg.head_dim, cfg.v_head_dim);
        Ok(Self { cfg, part, embd, head, layers, kv })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// This rank's share.
    pub fn partition(&self) -> &Partition {
        &self.part
    }

    /// Bytes of weights this rank holds in its layers.
    pub fn layer_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.attn.n_bytes() + l.moe.n_bytes()).sum()
    }

    /// Checks a batch against this rank's cache before anything is touched.
    pub fn validate(&self, batch: &ForwardBatch) -> Result<(), CpuError> {
        batch.validate(self.kv.page_size, self.kv.n_pages, self.cfg.vocab_size, self.cfg.context_length)?;
        Ok(())
    }

    /// The whole forward for a single-stage rank (no pipeline): embed, all layers, logits.
    pub fn forward(&mut self, batch: &ForwardBatch, comm: &dyn Collective) -> Result<ForwardOutput, CpuError> {
        let mut hidden = self.embed(batch, comm)?;
        self.run_layers(batch, &mut hidden, comm)?;
        self.logits(batch, &hidden, comm)
    }

    /// First pipeline stage: the hidden states (`n_tokens * hidden`) of the batch's new tokens.
    pub fn embed(&self, batch: &ForwardBatch, comm: &dyn Collective) -> Result<Vec<f32>, CpuError> {
        self.validate(batch)?;
        let (m, vocab) = self.embd.as_ref().ok_or_else(|| CpuError::Shape("this rank does not embed".into()))?;
        let h = self.cfg.hidden;
        let mut out = vec![0f32; batch.n_tokens() * h];
        for (i, &tok) in batch.seqs.iter().flat_map(|s| &s.tokens).enumerate() {
            let tok = tok as usize;
            if vocab.contains(&tok) {
                m.row_f32(tok - vocab.start, &mut out[i * h..(i + 1) * h])?;
            }
        }
        if comm.world() > 1 {
            comm.all_reduce_sum(&mut out)?;
        }
        Ok(out)
    }

    /// Runs this rank's layers over `hidden` in place, writing K/V of the new tokens.
    pub fn run_layers(&mut self, batch: &ForwardBatch, hidden: &mut [f32], comm: &dyn Collective) -> Result<(), CpuError> {
        self.validate(batch)?;
        let h = self.cfg.hidden;
        if hidden.len() != batch.n_tokens() * h {
            return Err(CpuError::Shape(format!("hidden has {} values for {} tokens", hidden.len(), batch.n_tokens())));
        }
        let mut tokens = Vec::with_capacity(batch.n_tokens());
        for (si, s) in batch.seqs.iter().enumerate() {
            for i in 0..s.tokens.len() {
                let pos = s.cached_len + i;
                tokens.push(TokenMeta { seq: si, pos, slot: self.kv.slot(&s.page_table, pos) });
            }
        }
        let mut rope = HashMap::new();
        for t in &tokens {
            rope.entry(t.pos).or_insert_with(|| rope_table(t.pos, self.cfg.rotary_dim, self.cfg.rope_theta));
        }
        let ctx = RunCtx { cfg: &self.cfg, batch, rope };
        let mut normed = vec![0f32; hidden.len()];
        for (li, layer) in self.layers.iter().enumerate() {
            for t in 0..tokens.len() {
                rms_norm(&hidden[t * h..(t + 1) * h], &layer.attn_norm, self.cfg.rms_eps, &mut normed[t * h..(t + 1) * h]);
            }
            layer.attn.forward(&ctx, li, &normed, &tokens, &mut self.kv, hidden, comm)?;
            for t in 0..tokens.len() {
                rms_norm(&hidden[t * h..(t + 1) * h], &layer.ffn_norm, self.cfg.rms_eps, &mut normed[t * h..(t + 1) * h]);
            }
            layer.moe.forward(&ctx, &normed, hidden, comm)?;
        }
        Ok(())
    }

    /// Last pipeline stage: final norm and lm_head for the rows the batch asks for.
    pub fn logits(&self, batch: &ForwardBatch, hidden: &[f32], comm: &dyn Collective) -> Result<ForwardOutput, CpuError> {
        let (norm, m, vocab) = self.head.as_ref().ok_or_else(|| CpuError::Shape("this rank has no lm_head".into()))?;
        let (h, v) = (self.cfg.hidden, self.cfg.vocab_size);
        let (rows, token_idx): (Vec<LogitsRow>, Vec<usize>) = batch.logits_rows().into_iter().unzip();
        let mut logits = vec![0f32; rows.len() * v];
        let mut normed = vec![0f32; h];
        for (r, &t) in token_idx.iter().enumerate() {
            rms_norm(&hidden[t * h..(t + 1) * h], norm, self.cfg.rms_eps, &mut normed);
            m.matvec(&normed, &mut logits[r * v + vocab.start..r * v + vocab.end])?;
        }
        if comm.world() > 1 {
            comm.all_reduce_sum(&mut logits)?;
        }
        Ok(ForwardOutput { rows, logits, vocab_size: v })
    }
}

#[cfg(test)]
mod tests {
    use super::even_range;

    #[test]
    fn even_ranges_cover_everything_once() {
        for n in [1usize, 7, 100, 1001] {
            for w in 1..=5 {
                let rs: Vec<_> = (0..w).map(|r| even_range(n, r, w)).collect();
                assert_eq!(rs[0].start, 0);
                assert_eq!(rs[w - 1].end, n);
                assert!(rs.windows(2).all(|p| p[0].end == p[1].start));
            }
        }
    }
}
