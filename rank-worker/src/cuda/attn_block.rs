//! The one-token attention block in one persistent launch (`ablk_*`, kernels/attn_block.cu):
//! q/k/v, q/k norm + RoPE + KV store, split-K attention + merge, o-projection into the
//! residual, MoE norm and router top-k, in one block per SM meeting at grid barriers, instead
//! of the fast path's chain of seven to nine launches. Each launch in that chain starts
//! its weight reads only when the one before lets it; here the o-projection's rows land in
//! shared memory and the router's in L2 while attention runs. Results bit-identical to the
//! chain with the SIMT attention kernels (`MINIMAX_ATTN_MMA=0`).

use super::env_flag::EnvFlag;
use super::fast::{GQA, ROUTE_FAST_MAX_E, fast_mat, fast_router};
use super::gpu::{Arg, DevMat, Gpu};
use super::error::CudaError;
use minimax_shared::quant::GgmlType;
use minimax_shared::model::ModelConfig;

static ATTN_BLOCK: EnvFlag = EnvFlag::new("MINIMAX_ATTN_BLOCK", false);

/// Whether one-token fast steps run each layer's attention block as one `ablk_*` launch
/// (`MINIMAX_ATTN_BLOCK=1`) where the model and card allow it ([`attn_block_plan`]).
pub fn attn_block() -> bool {
    ATTN_BLOCK.get()
}

/// Overrides [`attn_block`] (A/B runs and tests; `None` = back to the environment). Graphs are
/// keyed by the choice, so none needs dropping.
pub fn set_attn_block(on: Option<bool>) {
    ATTN_BLOCK.set(on);
}

/// Threads of an `ablk_*` block (AB_WARPS warps).
const AB_THREADS: u32 = 512;
/// Dynamic shared memory of an `ablk_*` block (AB_SMEM).
pub const AB_SMEM: usize = 218_880;
/// Bytes for the block's o-projection rows (AB_ORG).
const AB_ORG: usize = 156_672;
/// Static shared memory of the kernel and its callees (an upper bound; checked on the card at
/// the first launch by the driver).
const AB_STATIC: usize = 2048;
/// Split count of the SIMT decode attention at one token (`nsplit_for(1)`), which `part`,
/// the merge (AD_MAXSPLIT) and the chain being replaced use.
const AB_NSPLIT: usize = 128;

/// Whether `ablk_*` can run this model's layers on this card, with the reason if not: Q8_0
/// q/k/v/o of at most 12 / 24 chunks a row, f32 router of at most 256 experts, hidden width a
/// multiple of 256 up to 3,072, one block per SM with the o-projection's rows of a block in
/// AB_ORG bytes, sm_90 or newer (bulk copies, PDL).
pub(crate) fn attn_block_plan(g: &Gpu, c: &ModelConfig, mats: &[[&DevMat; 5]]) -> Result<(), String> {
    if g.arch < 90 {
        return Err(format!("sm_{} (needs sm_90+)", g.arch));
    }
    if g.smem_optin() < AB_SMEM + AB_STATIC {
        return Err(format!("{} bytes of shared memory a block (needs {})", g.smem_optin(), AB_SMEM + AB_STATIC));
    }
    let h = c.hidden;
    if h % 256 != 0 || h > 3072 || c.head_dim != 128 || c.v_head_dim != 128 || c.n_heads != GQA * c.n_kv_heads || c.rotary_dim > 128 {
        return Err(format!("hidden {h}, heads {}/{} x {}", c.n_heads, c.n_kv_heads, c.head_dim));
    }
    if c.n_experts > ROUTE_FAST_MAX_E || c.n_experts_used > 32 || c.n_experts_used == 0 {
        return Err(format!("top-{} of {} experts", c.n_experts_used, c.n_experts));
    }
    let sms = g.sm_count();
    for (i, [wq, wk, wv, wo, router]) in mats.iter().enumerate() {
        let q8 = |w: &DevMat| w.ty == GgmlType::Q8_0 && fast_mat(w) && w.row_bytes % 16 == 0;
        if ![wq, wk, wv, wo].iter().all(|w| q8(w)) || !fast_router(router) {
            return Err(format!("layer {i}: {:?}/{:?}/{:?}/{:?} (Q8_0 only), router {:?}", wq.ty, wk.ty, wv.ty, wo.ty, router.ty));
        }
        if [wq, wk, wv].iter().any(|w| w.cols != h || w.cols / 256 > 12) || wo.cols % 256 != 0 || wo.cols / 256 > 24 || wo.rows != h || wo.cols != c.n_heads * 128 {
            return Err(format!("layer {i}: q/k/v/o shapes"));
        }
        if h.div_ceil(sms) * wo.row_bytes > AB_ORG {
            return Err(format!("layer {i}: {} o-projection rows a block on {sms} SMs", h.div_ceil(sms)));
        }
    }
    Ok(())
}

/// Pointers and widths of one `ablk_*` launch (one token, one layer).
pub struct AttnBlockArgs<'a> {
    pub wq: &'a DevMat,
    pub wk: &'a DevMat,
    pub wv: &'a DevMat,
    pub wo: &'a DevMat,
    pub router: &'a DevMat,
    pub q_norm: u64,
    pub k_norm: u64,
    pub ffn_norm: u64,
    pub bias: u64,
    /// q8 input (the attention norm's output) and, on return, the experts' q8 input.
    pub xq: u64,
    pub xd: u64,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    /// Step metadata: positions, slots, sequence ids, page-table offsets, page tables.
    pub pos: u64,
    pub slots: u64,
    pub seq: u64,
    pub pt_off: u64,
    pub pts: u64,
    pub kc: u64,
    pub vc: u64,
    pub page_size: usize,
    pub part: u64,
    /// Per-KV-head arrival counters (zero, left zero).
    pub acnt: u64,
    pub att: u64,
    /// q8 of the attention output (scratch: `hidden`-wide i8 and f32 groups).
    pub mq: u64,
    pub md: u64,
    pub hid: u64,
    pub rl: u64,
    pub ids: u64,
    pub wts: u64,
    /// Router arrival counter and grid barrier counter (zero, left zero).
    pub rcnt: u64,
    pub bcnt: u64,
}

impl Gpu {
    /// One `ablk_*` launch (see the module docs); `kv` = "f16" or "bf16". The caller has
    /// checked [`attn_block_plan`].
    pub fn attn_block_launch(&self, c: &ModelConfig, kv: &str, a: &AttnBlockArgs) -> Result<(), CudaError> {
        if kv != "f16" && kv != "bf16" {
            return Err(CudaError::Shape(format!("ablk: KV cache type {kv}")));
        }
        let (qw, kw, vw) = (a.wq.rows, a.wk.rows, a.wv.rows);
        let args = [
            Arg::P(a.wq.ptr),
            Arg::L(a.wq.row_bytes as i64),
            Arg::P(a.wk.ptr),
            Arg::L(a.wk.row_bytes as i64),
            Arg::P(a.wv.ptr),
            Arg::L(a.wv.row_bytes as i64),
            Arg::I((a.wq.cols / 256) as i32),
            Arg::P(a.xq),
            Arg::P(a.xd),
            Arg::P(a.q),
            Arg::P(a.k),
            Arg::P(a.v),
            Arg::I(qw as i32),
            Arg::I(kw as i32),
            Arg::I(vw as i32),
            Arg::P(a.q_norm),
            Arg::P(a.k_norm),
            Arg::I(c.rotary_dim as i32),
            Arg::P(a.pos),
            Arg::F(c.rope_theta),
            Arg::F(c.rms_eps),
            Arg::P(a.slots),
            Arg::P(a.kc),
            Arg::P(a.vc),
            Arg::P(a.seq),
            Arg::P(a.pt_off),
            Arg::P(a.pts),
            Arg::I(a.page_size as i32),
            Arg::I(c.n_kv_heads as i32),
            Arg::I(AB_NSPLIT as i32),
            Arg::F(1.0 / (c.head_dim as f32).sqrt()),
            Arg::P(a.part),
            Arg::P(a.acnt),
            Arg::P(a.att),
            Arg::P(a.mq),
            Arg::P(a.md),
            Arg::P(a.wo.ptr),
            Arg::L(a.wo.row_bytes as i64),
            Arg::I((a.wo.cols / 256) as i32),
            Arg::P(a.hid),
            Arg::I(c.hidden as i32),
            Arg::P(a.ffn_norm),
            Arg::P(a.router.ptr),
            Arg::I(a.router.rows as i32),
            Arg::P(a.bias),
            Arg::I(c.n_experts_used as i32),
            Arg::I(match c.gating {
                minimax_shared::model::GatingFunc::Sigmoid => 2,
                minimax_shared::model::GatingFunc::Softmax => 1,
            }),
            Arg::P(a.rl),
            Arg::P(a.ids),
            Arg::P(a.wts),
            Arg::P(a.rcnt),
            Arg::P(a.bcnt),
        ];
        self.launch_pdl(&format!("ablk_{kv}"), (self.sm_count() as u32, 1, 1), AB_THREADS, AB_SMEM as u32, &args)
    }
}
