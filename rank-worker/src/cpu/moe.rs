//! Mixture-of-experts block: replicated router (sigmoid scores, top-k chosen on score + bias,
//! weights = chosen unbiased scores renormalised), and SiLU-gated experts whose intermediate
//! width is split across tensor-parallel ranks.

use minimax_shared::model::{GatingFunc, names};

use super::LoadCtx;
use super::attention::residual_add_reduced;
use super::error::CpuError;
use super::matrix::{Matrix, vector};
use crate::comm::Collective;

/// One layer's router and this rank's slice of every expert.
pub struct Moe {
    router: Matrix,
    bias: Vec<f32>,
    /// Per expert: gate and up rows for this rank's intermediate slice, and the matching
    /// columns of down.
    gate: Vec<Matrix>,
    up: Vec<Matrix>,
    down: Vec<Matrix>,
    ff: usize,
}

/// The experts chosen for one token and their mixing weights.
pub fn route(logits: &[f32], bias: &[f32], k: usize, gating: GatingFunc) -> Vec<(usize, f32)> {
    let scores: Vec<f32> = match gating {
        GatingFunc::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
        GatingFunc::Softmax => {
            let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = logits.iter().map(|&l| (l - m).exp()).collect();
            let s: f32 = e.iter().sum();
            e.into_iter().map(|v| v / s).collect()
        }
    };
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // Highest biased score first; ties go to the lower expert index, as torch.topk does.
    order.sort_by(|&a, &b| (scores[b] + bias[b]).total_cmp(&(scores[a] + bias[a])).then(a.cmp(&b)));
    order.truncate(k);
    let total: f32 = order.iter().map(|&e| scores[e]).sum();
    order.into_iter().map(|e| (e, scores[e] / total)).collect()
}

impl Moe {
    pub(super) fn load(ctx: &LoadCtx, layer: usize) -> Result<Self, CpuError> {
        let c = ctx.cfg;
        let n = |s| names::block(layer, s);
        let f = ctx.part.tp_range(c.expert_ff);
        let ff = c.expert_ff;
        let mut gate = Vec::with_capacity(c.n_experts);
        let mut up = Vec::with_capacity(c.n_experts);
        let mut down = Vec::with_capacity(c.n_experts);
        for e in 0..c.n_experts {
            let rows = e * ff + f.start..e * ff + f.end;
            gate.push(Matrix::rows(ctx.model, &n(names::FFN_GATE_EXPS), rows.clone())?);
            up.push(Matrix::rows(ctx.model, &n(names::FFN_UP_EXPS), rows)?);
            down.push(Matrix::cols(ctx.model, &n(names::FFN_DOWN_EXPS), e * c.hidden..(e + 1) * c.hidden, f.clone())?);
        }
        Ok(Self {
            router: Matrix::rows(ctx.model, &n(names::FFN_GATE_INP), 0..c.n_experts)?,
            bias: vector(ctx.model, &n(names::EXP_PROBS_B), None)?,
            gate,
            up,
            down,
            ff: f.len(),
        })
    }

    /// Runs the experts for every token (`x` = normed hidden states) and adds the result into
    /// `residual`.
    pub(super) fn forward(
        &self,
        ctx: &super::RunCtx,
        x: &[f32],
        residual: &mut [f32],
        comm: &dyn Collective,
    ) -> Result<(), CpuError> {
        let c = ctx.cfg;
        let hidden = c.hidden;
        let nt = x.len() / hidden;
        let mut logits = vec![0f32; c.n_experts];
        let (mut g, mut u) = (vec![0f32; self.ff], vec![0f32; self.ff]);
        let mut d = vec![0f32; hidden];
        let mut out = vec![0f32; nt * hidden];
        for t in 0..nt {
            let xt = &x[t * hidden..(t + 1) * hidden];
            self.router.matvec(xt, &mut logits)?;
            let ot = &mut out[t * hidden..(t + 1) * hidden];
            for (e, w) in route(&logits, &self.bias, c.n_experts_used, c.gating) {
                self.gate[e].matvec(xt, &mut g)?;
                self.up[e].matvec(xt, &mut u)?;
                for (gi, &ui) in g.iter_mut().zip(&u) {
                    *gi = *gi / (1.0 + (-*gi).exp()) * ui;
                }
                self.down[e].matvec(&g, &mut d)?;
                for (o, &di) in ot.iter_mut().zip(&d) {
                    *o += w * di;
                }
            }
        }
        residual_add_reduced(residual, &mut out, comm)
    }

    /// Bytes of expert and router weights this rank holds for the layer.
    pub fn n_bytes(&self) -> usize {
        self.router.n_bytes()
            + self.gate.iter().chain(&self.up).chain(&self.down).map(Matrix::n_bytes).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_changes_the_choice_but_not_the_weights() {
        let logits = [2.0, 1.0, 0.0, -1.0];
        let no_bias = route(&logits, &[0.0; 4], 2, GatingFunc::Sigmoid);
        assert_eq!(no_bias.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1]);
        let biased = route(&logits, &[0.0, 0.0, 0.0, 5.0], 2, GatingFunc::Sigmoid);
        assert_eq!(biased.iter().map(|p| p.0).collect::<Vec<_>>(), vec![3, 0]);
        let s = |l: f32| 1.0 / (1.0 + (-l).exp());
        let total = s(-1.0) + s(2.0);
        assert!((biased[0].1 - s(-1.0) / total).abs() < 1e-6);
        assert!((biased.iter().map(|p| p.1).sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
