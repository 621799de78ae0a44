//! Which part of the model one rank holds: a contiguous layer range (pipeline parallelism)
//! and a slice of every layer's heads and expert columns (tensor parallelism).

use std::ops::Range;

use minimax_shared::model::{ModelConfig, names};

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
    /// This rank's pipeline stage and the number of stages (0 and 1 without pipelining); the
    /// stage is also its rank in the world's communicator, so activations go to `pp_rank + 1`.
    pub pp_rank: usize,
    pub pp_world: usize,
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

/// Bytes a pipeline stage holds: its layers' tensors, plus the token embedding on the first
/// stage and the final norm and lm_head on the last (what the CPU and CUDA backends load).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StageBytes {
    /// Bytes of each layer's `blk.{l}.*` tensors.
    pub layers: Vec<u64>,
    /// Extra bytes of the first stage (token embedding).
    pub first: u64,
    /// Extra bytes of the last stage (output norm and lm_head; the embedding again when tied).
    pub last: u64,
}

impl StageBytes {
    /// Uniform cost per layer and no extras (balances by layer count).
    pub fn uniform(n_layers: usize) -> Self {
        Self { layers: vec![1; n_layers], first: 0, last: 0 }
    }

    /// Bytes of stage `s` of `stages` when it holds `layers`.
    pub fn stage(&self, layers: Range<usize>, s: usize, stages: usize) -> u64 {
        self.layers[layers].iter().sum::<u64>() + if s == 0 { self.first } else { 0 } + if s + 1 == stages { self.last } else { 0 }
    }
}

impl Partition {
    /// The whole model in one process.
    pub fn whole(cfg: &ModelConfig) -> Self {
        Self { layers: 0..cfg.n_layers, first_stage: true, last_stage: true, tp_rank: 0, tp_world: 1, pp_rank: 0, pp_world: 1 }
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
        Ok(Self { layers: 0..cfg.n_layers, first_stage: true, last_stage: true, tp_rank: rank, tp_world: world, pp_rank: 0, pp_world: 1 })
    }

    /// Pipeline parallelism: stage `rank` of `world` runs a contiguous range of layers,
    /// balanced by count, or by `weights` (per-layer costs, e.g. bytes) when given.
    pub fn pipeline(cfg: &ModelConfig, rank: usize, world: usize, weights: Option<&[u64]>) -> Result<Self, PartitionError> {
        let costs = match weights {
            Some(w) if w.len() == cfg.n_layers => StageBytes { layers: w.to_vec(), first: 0, last: 0 },
            _ => StageBytes::uniform(cfg.n_layers),
        };
        Self::pipeline_by_bytes(cfg, rank, world, &costs)
    }

    /// Pipeline parallelism balanced by what each stage holds ([`StageBytes`]): the largest
    /// stage is as small as possible (then the stages as even as possible), so a model that
    /// mixes quant types across layers still fits devices of equal memory.
    pub fn pipeline_by_bytes(cfg: &ModelConfig, rank: usize, world: usize, costs: &StageBytes) -> Result<Self, PartitionError> {
        if rank >= world {
            return Err(PartitionError::BadRank { rank, world });
        }
        if world > cfg.n_layers {
            return Err(PartitionError::TooManyStages { stages: world, layers: cfg.n_layers });
        }
        let costs = if costs.layers.len() == cfg.n_layers { costs.clone() } else { StageBytes::uniform(cfg.n_layers) };
        let bounds = balanced_bounds(&costs, world);
        Ok(Self {
            layers: bounds[rank]..bounds[rank + 1],
            first_stage: rank == 0,
            last_stage: rank + 1 == world,
            tp_rank: 0,
            tp_world: 1,
            pp_rank: rank,
            pp_world: world,
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
    stage_bytes(model.tensors().map(|t| (t.name.as_str(), t.n_bytes)), n_layers, false).layers
}

/// [`StageBytes`] of a GGUF model.
pub fn gguf_stage_bytes(model: &minimax_shared::gguf::GgufModel, cfg: &ModelConfig) -> StageBytes {
    stage_bytes(model.tensors().map(|t| (t.name.as_str(), t.n_bytes)), cfg.n_layers, cfg.tied_embeddings)
}

/// [`StageBytes`] of a synthetic model (the same tensors a `write-synthetic` GGUF holds).
pub fn synthetic_stage_bytes(spec: &minimax_shared::model::synthetic::SyntheticSpec) -> StageBytes {
    let cfg = spec.config();
    let tensors = spec.tensors();
    stage_bytes(tensors.iter().map(|t| (t.name.as_str(), t.n_bytes())), cfg.n_layers, cfg.tied_embeddings)
}

/// [`StageBytes`] from `(tensor name, bytes)` pairs (a GGUF file or a synthetic spec).
pub fn stage_bytes<'a>(tensors: impl IntoIterator<Item = (&'a str, u64)>, n_layers: usize, tied_embeddings: bool) -> StageBytes {
    let mut out = StageBytes { layers: vec![0; n_layers], first: 0, last: 0 };
    for (name, bytes) in tensors {
        let layer = name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|l| l.parse::<usize>().ok());
        match layer {
            Some(l) if l < n_layers => out.layers[l] += bytes,
            Some(_) => {}
            None if name == names::TOKEN_EMBD => {
                out.first += bytes;
                if tied_embeddings {
                    out.last += bytes;
                }
            }
            None if name == names::OUTPUT || name == names::OUTPUT_NORM => out.last += bytes,
            None => {}
        }
    }
    out
}

/// Splits the layers into `stages` contiguous non-empty ranges: the costliest stage is as
/// cheap as possible; among those splits the sum of squared stage costs is the smallest
/// (stages as even as possible); remaining ties go to the earliest boundaries.
fn balanced_bounds(c: &StageBytes, stages: usize) -> Vec<usize> {
    let n = c.layers.len();
    assert!(stages >= 1 && stages <= n.max(1), "{stages} stages for {n} layers");
    let mut prefix = vec![0u64; n + 1];
    for (i, &w) in c.layers.iter().enumerate() {
        prefix[i + 1] = prefix[i] + w;
    }
    let cost = |s: usize, a: usize, b: usize| prefix[b] - prefix[a] + if s == 0 { c.first } else { 0 } + if s + 1 == stages { c.last } else { 0 };
    // 1. The smallest possible maximum: best[s][i] = min over splits of layers i.. into
    //    stages s.. of the costliest stage.
    const NONE: u64 = u64::MAX;
    let mut best = vec![vec![NONE; n + 1]; stages + 1];
    best[stages][n] = 0;
    for s in (0..stages).rev() {
        // Stage s starts at i, leaves at least one layer for each later stage.
        for i in s..=n - (stages - s) {
            for j in i + 1..=n - (stages - s - 1) {
                if best[s + 1][j] != NONE {
                    best[s][i] = best[s][i].min(cost(s, i, j).max(best[s + 1][j]));
                }
            }
        }
    }
    let limit = best[0][0];
    // 2. Under that maximum, the smallest sum of squares (suffix DP, u128: bytes² overflow u64).
    const NO: u128 = u128::MAX;
    let mut sq = vec![vec![NO; n + 1]; stages + 1];
    sq[stages][n] = 0;
    for s in (0..stages).rev() {
        for i in s..=n - (stages - s) {
            for j in i + 1..=n - (stages - s - 1) {
                let cs = cost(s, i, j);
                if cs <= limit && sq[s + 1][j] != NO {
                    sq[s][i] = sq[s][i].min(cs as u128 * cs as u128 + sq[s + 1][j]);
                }
            }
        }
    }
    // 3. Earliest boundaries that achieve both.
    let mut bounds = vec![0usize];
    let mut i = 0;
    for s in 0..stages {
        let j = (i + 1..=n - (stages - s - 1))
            .find(|&j| {
                let cs = cost(s, i, j);
                cs <= limit && sq[s + 1][j] != NO && cs as u128 * cs as u128 + sq[s + 1][j] == sq[s][i]
            })
            .expect("a split achieving the optimum exists");
        bounds.push(j);
        i = j;
    }
    bounds
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(w: &[u64]) -> StageBytes {
        StageBytes { layers: w.to_vec(), first: 0, last: 0 }
    }

    #[test]
    fn synthetic_stage_bytes_count_every_tensor_once_and_split_served_pipelines() {
        use minimax_shared::model::synthetic::SyntheticSpec;
        let spec = SyntheticSpec::parse("m2.7:q4km:3").unwrap();
        let b = synthetic_stage_bytes(&spec);
        let tensors = spec.tensors();
        let total: u64 = tensors.iter().map(|t| t.n_bytes()).sum();
        assert_eq!(b.layers.len(), 3);
        assert_eq!(b.first + b.last + b.layers.iter().sum::<u64>(), total, "every tensor counted once");
        let embd = tensors.iter().find(|t| t.name == names::TOKEN_EMBD).unwrap().n_bytes();
        assert_eq!(b.first, embd, "the first stage carries the embedding");
        assert!(b.layers.iter().all(|&l| l == b.layers[0] && l > 0), "identical layers: {:?}", b.layers);
        // A served pipeline of two synthetic stages: contiguous ranges covering every layer.
        let cfg = spec.config();
        let p0 = Partition::pipeline_by_bytes(&cfg, 0, 2, &b).unwrap();
        let p1 = Partition::pipeline_by_bytes(&cfg, 1, 2, &b).unwrap();
        assert_eq!(p0.layers.start, 0);
        assert_eq!(p0.layers.end, p1.layers.start);
        assert_eq!(p1.layers.end, 3);
        assert!(p0.first_stage && !p0.last_stage && p1.last_stage);
    }

    /// Every split of `c` into `stages` non-empty ranges, brute force: the smallest maximum.
    fn brute_min_max(c: &StageBytes, stages: usize) -> u64 {
        fn go(c: &StageBytes, stages: usize, s: usize, start: usize, worst: u64) -> u64 {
            let n = c.layers.len();
            if s + 1 == stages {
                return worst.max(c.stage(start..n, s, stages));
            }
            (start + 1..=n - (stages - s - 1)).map(|j| go(c, stages, s + 1, j, worst.max(c.stage(start..j, s, stages)))).min().unwrap()
        }
        go(c, stages, 0, 0, 0)
    }

    fn check(c: &StageBytes, stages: usize) -> Vec<usize> {
        let b = balanced_bounds(c, stages);
        assert_eq!(b.len(), stages + 1);
        assert_eq!((b[0], b[stages]), (0, c.layers.len()));
        assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
        let worst = (0..stages).map(|s| c.stage(b[s]..b[s + 1], s, stages)).max().unwrap();
        assert_eq!(worst, brute_min_max(c, stages), "{c:?} in {stages}: bounds {b:?}");
        b
    }

    #[test]
    fn pipeline_bounds_are_contiguous_non_empty_and_balanced() {
        assert_eq!(balanced_bounds(&StageBytes::uniform(62), 2), vec![0, 31, 62]);
        assert_eq!(balanced_bounds(&StageBytes::uniform(4), 3), vec![0, 1, 2, 4]);
        assert_eq!(balanced_bounds(&StageBytes::uniform(5), 5), vec![0, 1, 2, 3, 4, 5]);
        // A heavy first layer pushes the split forward.
        assert_eq!(balanced_bounds(&costs(&[10, 1, 1, 1]), 2), vec![0, 1, 4]);
        // A greedy "fill up to the average" split gives 10 | 16 here; the best is 15 | 11.
        assert_eq!(balanced_bounds(&costs(&[5, 5, 5, 5, 6]), 2), vec![0, 3, 5]);
        // The lm_head on the last stage moves layers to the first.
        assert_eq!(balanced_bounds(&StageBytes { layers: vec![4; 8], first: 1, last: 9 }, 2), vec![0, 5, 8]);
        for stages in 1..=8 {
            check(&StageBytes::uniform(8), stages);
        }
    }

    #[test]
    fn pipeline_bounds_minimise_the_largest_stage_on_random_costs() {
        // Random layer sizes (mixed quant types), random embedding/head extras: the split's
        // largest stage equals the brute-force optimum for every stage count.
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for case in 0..200 {
            let n = 1 + rnd(10) as usize;
            let layers: Vec<u64> = (0..n).map(|_| 1 + rnd(1000)).collect();
            let c = StageBytes { layers, first: if case % 2 == 0 { rnd(500) } else { 0 }, last: rnd(2000) };
            for stages in 1..=n.min(5) {
                check(&c, stages);
            }
        }
    }

    #[test]
    fn pipeline_4_on_mixed_quant_fixtures_is_balanced_by_bytes() {
        // The kmix fixtures mix Q4_K/Q5_K/Q6_K/IQ4_* per layer: layers differ in bytes. Four
        // stages must minimise the largest stage's bytes (embedding and lm_head included) and
        // together hold every byte of the file exactly once (plus the tied head).
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
        for model in ["m2-small", "m2-odd"] {
            for variant in ["kmix", "q8_0", "f32"] {
                let g = minimax_shared::gguf::GgufModel::open(root.join(model).join(format!("{variant}.gguf"))).unwrap();
                let cfg = ModelConfig::from_gguf(&g).unwrap();
                let c = gguf_stage_bytes(&g, &cfg);
                let total: u64 = g.tensors().map(|t| t.n_bytes).sum();
                let in_stages = c.layers.iter().sum::<u64>() + c.first + c.last - if cfg.tied_embeddings { c.first } else { 0 };
                assert_eq!(in_stages, total, "{model}/{variant}: every tensor belongs to a stage");
                for world in 1..=cfg.n_layers.min(4) {
                    let b = check(&c, world);
                    let parts: Vec<Partition> = (0..world).map(|r| Partition::pipeline_by_bytes(&cfg, r, world, &c).unwrap()).collect();
                    for (r, p) in parts.iter().enumerate() {
                        assert_eq!(p.layers, b[r]..b[r + 1]);
                        assert_eq!((p.first_stage, p.last_stage, p.pp_rank, p.pp_world), (r == 0, r + 1 == world, r, world));
                    }
                    let sum: u64 = parts.iter().enumerate().map(|(r, p)| c.stage(p.layers.clone(), r, world)).sum();
                    assert_eq!(sum, c.layers.iter().sum::<u64>() + c.first + c.last, "{model}/{variant} x{world}");
                }
            }
        }
    }
}
