//! Attention block: q/k/v projections, full-width q/k RMSNorm (a cross-rank reduction under
//! tensor parallelism), partial NeoX RoPE, causal GQA attention over the paged cache, o-proj.

use minimax_shared::model::names;

use super::error::CpuError;
use super::kv::PagedKv;
use super::matrix::{Matrix, vector};
use super::norm_rope::{apply_rope, rms_scale, sum_sq};
use super::{LoadCtx, TokenMeta};
use crate::comm::Collective;

/// One layer's attention weights for this rank's heads.
pub struct Attention {
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    /// Columns of o-proj that read this rank's heads.
    wo: Matrix,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    /// Local head counts.
    heads: usize,
    kv_heads: usize,
}

impl Attention {
    pub(super) fn load(ctx: &LoadCtx, layer: usize) -> Result<Self, CpuError> {
        let c = ctx.cfg;
        let n = |s| names::block(layer, s);
        let heads = ctx.part.tp_range(c.n_heads);
        let kv = ctx.part.tp_range(c.n_kv_heads);
        let (hd, vd) = (c.head_dim, c.v_head_dim);
        let q_rows = heads.start * hd..heads.end * hd;
        let k_rows = kv.start * hd..kv.end * hd;
        Ok(Self {
            wq: Matrix::rows(ctx.model, &n(names::ATTN_Q), q_rows.clone())?,
            wk: Matrix::rows(ctx.model, &n(names::ATTN_K), k_rows.clone())?,
            wv: Matrix::rows(ctx.model, &n(names::ATTN_V), kv.start * vd..kv.end * vd)?,
            wo: Matrix::cols(ctx.model, &n(names::ATTN_OUTPUT), 0..c.hidden, heads.start * vd..heads.end * vd)?,
            q_norm: vector(ctx.model, &n(names::ATTN_Q_NORM), Some(q_rows))?,
            k_norm: vector(ctx.model, &n(names::ATTN_K_NORM), Some(k_rows))?,
            heads: heads.len(),
            kv_heads: kv.len(),
        })
    }

    /// Runs attention for all tokens of the batch: `x` holds their normed hidden states
    /// (`n_tokens * hidden`); the o-proj output (this rank's partial sum, all-reduced) is
    /// added into `residual`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        ctx: &super::RunCtx,
        layer: usize,
        x: &[f32],
        tokens: &[TokenMeta],
        kv: &mut PagedKv,
        residual: &mut [f32],
        comm: &dyn Collective,
    ) -> Result<(), CpuError> {
        let c = ctx.cfg;
        let (hd, vd, hidden) = (c.head_dim, c.v_head_dim, c.hidden);
        let nt = tokens.len();
        let (qw, kw, vw) = (self.heads * hd, self.kv_heads * hd, self.kv_heads * vd);
        let mut q = vec![0f32; nt * qw];
        let mut k = vec![0f32; nt * kw];
        let mut v = vec![0f32; nt * vw];
        // Per token: local sums of squares of q and k, reduced across ranks in one call.
        let mut ss = vec![0f32; nt * 2];
        let mut ss64 = vec![0f64; nt * 2];
        for t in 0..nt {
            let xt = &x[t * hidden..(t + 1) * hidden];
            self.wq.matvec(xt, &mut q[t * qw..(t + 1) * qw])?;
            self.wk.matvec(xt, &mut k[t * kw..(t + 1) * kw])?;
            self.wv.matvec(xt, &mut v[t * vw..(t + 1) * vw])?;
            ss64[2 * t] = sum_sq(&q[t * qw..(t + 1) * qw]);
            ss64[2 * t + 1] = sum_sq(&k[t * kw..(t + 1) * kw]);
        }
        if comm.world() > 1 {
            for (d, s) in ss.iter_mut().zip(&ss64) {
                *d = *s as f32;
            }
            comm.all_reduce_sum(&mut ss)?;
            for (d, s) in ss64.iter_mut().zip(&ss) {
                *d = *s as f64;
            }
        }
        for (t, tm) in tokens.iter().enumerate() {
            let qt = &mut q[t * qw..(t + 1) * qw];
            rms_scale(qt, &self.q_norm, ss64[2 * t], c.n_heads * hd, c.rms_eps);
            let kt = &mut k[t * kw..(t + 1) * kw];
            rms_scale(kt, &self.k_norm, ss64[2 * t + 1], c.n_kv_heads * hd, c.rms_eps);
            let table = ctx.rope(tm.pos);
            apply_rope(qt, hd, table);
            apply_rope(kt, hd, table);
            kv.write(layer, tm.slot, kt, &v[t * vw..(t + 1) * vw]);
        }

        let group = self.heads / self.kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; self.heads * vd];
        let mut o = vec![0f32; nt * hidden];
        let mut scores = Vec::new();
        for (t, tm) in tokens.iter().enumerate() {
            let page_table = &ctx.batch.seqs[tm.seq].page_table;
            let n_ctx = tm.pos + 1;
            out.fill(0.0);
            for h in 0..self.heads {
                let kvh = h / group;
                let qh = &q[t * qw + h * hd..t * qw + (h + 1) * hd];
                scores.clear();
                let mut max = f32::NEG_INFINITY;
                for p in 0..n_ctx {
                    let kp = kv.k(layer, kv.slot(page_table, p), kvh);
                    let s = qh.iter().zip(kp).map(|(a, b)| a * b).sum::<f32>() * scale;
                    max = max.max(s);
                    scores.push(s);
                }
                let mut denom = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    denom += *s;
                }
                let oh = &mut out[h * vd..(h + 1) * vd];
                for (p, &s) in scores.iter().enumerate() {
                    let w = s / denom;
                    let vp = kv.v(layer, kv.slot(page_table, p), kvh);
                    for (a, &b) in oh.iter_mut().zip(vp) {
                        *a += w * b;
                    }
                }
            }
            self.wo.matvec(&out, &mut o[t * hidden..(t + 1) * hidden])?;
        }
        residual_add_reduced(residual, &mut o, comm)
    }

    /// Bytes of weights this rank holds for the layer's attention.
    pub fn n_bytes(&self) -> usize {
        self.wq.n_bytes() + self.wk.n_bytes() + self.wv.n_bytes() + self.wo.n_bytes()
    }
}

/// Adds a partial (per-rank) projection into the replicated residual after summing it across
/// ranks.
pub(super) fn residual_add_reduced(residual: &mut [f32], partial: &mut [f32], comm: &dyn Collective) -> Result<(), CpuError> {
    comm.all_reduce_sum(partial)?;
    for (r, p) in residual.iter_mut().zip(partial.iter()) {
        *r += p;
    }
    Ok(())
}
