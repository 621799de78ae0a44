//! Which part of the model one rank holds: a contiguous layer range (pipeline parallelism)
//! and a slice of every layer's heads and expert columns (tensor parallelism).

use std::ops::Range;

use minimax_shared::model::ModelConfig;

/// One rank's share of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    /// Layers this rank runs.
    pub layers: Range<usize>,
    /// Whether this rank embeds the input tokens (first pipeline stage).
    pub first_stage: bool,
    /// Whether this rank computes the final norm and logits (last pipeline stage).
    pub last_stage: bool,
    /// This rank's index in its tensor-parallel group and the group's size.
    pub tp_rank: usize,
    pub tp_world: usize,
}

/// A partition that cannot be built for this model.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PartitionError {
    #[error("tensor parallelism {world}: {what} ({n}) is not divisible by {world}")]
    Indivisible { what: &'static str, n: usize, world: usize },
    #[error("pipeline: {stages} stages for {layers} layers")]
    TooManyStages { stages: usize, layers: usize },
    #[error("rank {rank} is outside a world of {world}")]
    BadRank { rank: usize, world: usize },
}

impl Partition {
    /// The whole model in one process.
    pub fn whole(cfg: &ModelConfig) -> Self {
        Self { layers: 0..cfg.n_layers, first_stage: true, last_stage: true, tp_rank: 0, tp_world: 1 }
    }

    /// Tensor parallelism over `world` ranks: every rank runs every layer on a slice of the
    /// heads and of each expert's intermediate width.
    pub fn tensor(cfg: &ModelConfig, rank: usize, world: usize) -> Result<Self, PartitionError> {
        if rank >= world {
            return Err(PartitionError::BadRank { rank, world });
        }
        for (what, n) in [
            ("attention.head_count", cfg.n_heads),
            ("attention.head_count_kv", cfg.n_kv_heads),
            ("expert_feed_forward_length", cfg.expert_ff),
        ] {
            if n % world != 0 {
                return Err(PartitionError::Indivisible { what, n, world });
            }
        }
        Ok(Self { layers: 0..cfg.n_layers, first_stage: true, last_stage: true, tp_rank: rank, tp_world: world })
    }

    /// Pipeline parallelism: stage `rank` of `world` runs a contiguous range of layers,
    /// balanced by count (`weights` may give per-layer costs, e.g. bytes, to balance by).
    pub fn pipeline(cfg: &ModelConfig, rank: usize, world: usize, weights: Option<&[u64]>) -> Result<Self, PartitionError> {
        if rank >= world {
            return Err(PartitionError::BadRank { rank, world });
        }
        if world > cfg.n_layers {
            return Err(PartitionError::TooManyStages { stages: world, layers: cfg.n_layers });
        }
        let bounds = balanced_bounds(cfg.n_layers, world, weights);
        Ok(Self {
            layers: bounds[rank]..bounds[rank + 1],
            first_stage: rank == 0,
            last_stage: rank + 1 == world,
            tp_rank: 0,
            tp_world: 1,
        })
    }

    /// Range of a dimension of size `n` held by this rank under tensor parallelism.
    pub fn tp_range(&self, n: usize) -> Range<usize> {
        let per = n / self.tp_world;
        self.tp_rank * per..(self.tp_rank + 1) * per
    }
}

/// Bytes of each layer's tensors (`blk.{l}.*`), for balancing pipeline stages by memory.
pub fn layer_bytes(model: &minimax_shared::gguf::GgufModel, n_layers: usize) -> Vec<u64> {
    let mut out = vec![0u64; n_layers];
    for t in model.tensors() {
        let layer = t.name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|l| l.parse::<usize>().ok());
        if let Some(l) = layer.filter(|&l| l < n_layers) {
            out[l] += t.n_bytes;
        }
    }
    out
}

/// Splits `n` layers into `stages` contiguous non-empty ranges with costs as even as possible.
fn balanced_bounds(n: usize, stages: usize, weights: Option<&[u64]>) -> Vec<usize> {
    let w: Vec<u64> = match weights {
        Some(w) if w.len() == n => w.to_vec(),
        _ => vec![1; n],
    };
    let total: u64 = w.iter().sum::<u64>().max(1);
    let mut bounds = vec![0usize];
    let mut acc = 0u64;
    let mut l = 0usize;
    for s in 1..stages {
        let target = total * s as u64 / stages as u64;
        // Take layers while the running cost stays at or below the target, leaving at least
        // one layer for each remaining stage.
        while l < n - (stages - s) && (acc + w[l] <= target || l < *bounds.last().unwrap() + 1) {
            acc += w[l];
            l += 1;
        }
        bounds.push(l);
    }
    bounds.push(n);
    bounds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_bounds_are_contiguous_non_empty_and_balanced() {
        assert_eq!(balanced_bounds(62, 2, None), vec![0, 31, 62]);
        assert_eq!(balanced_bounds(4, 3, None), vec![0, 1, 2, 4]);
        assert_eq!(balanced_bounds(5, 5, None), vec![0, 1, 2, 3, 4, 5]);
        // A heavy first layer pushes the split forward.
        assert_eq!(balanced_bounds(4, 2, Some(&[10, 1, 1, 1])), vec![0, 1, 4]);
        for stages in 1..=8 {
            let b = balanced_bounds(8, stages, None);
            assert_eq!(b.len(), stages + 1);
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
        }
    }
}
