//! The fast decode path (kernels/fast.cu): q8 activations with dp4a weight products for Q8_0
//! and IQ4_XS, the fused MoE (gate/up/SiLU → q8, down + weighted combine into the residual),
//! fused q/k norm + RoPE + KV store, split-K decode attention; preallocated workspaces (no
//! allocation on the hot path), one metadata upload per step, and each step size replayed from
//! a CUDA graph. Also the synthetic-weight fill. Batches of up to [`MAX_FAST_TOKENS`] tokens
//! take this path when the model's shapes and types allow it (see [`fast_plan`]); everything
//! else takes the exact path in `model.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicUsize, Ordering};

use cudarc::driver::{CudaGraph, CudaSlice};
use minimax_shared::model::ModelConfig;
use minimax_shared::model::synthetic::kquant_min_ratio;
use minimax_shared::quant::GgmlType;

use super::error::CudaError;
use super::gpu::{Arg, DevMat, Gpu, KvDtype};

/// Largest step (tokens) the fast path takes; larger batches (prefill) use the exact path.
pub const MAX_FAST_TOKENS: usize = 32;
const CH: usize = 272;
const GQA: usize = 6;

fn ceil_div(a: usize, b: usize) -> u32 {
    a.div_ceil(b) as u32
}

/// Row stride multiple (bytes) a tensor-parallel expert down slice of type `ty` is stored
/// padded to, so the fast down kernels (whole 272-byte chunks) can read it; 1 = unpadded.
pub fn down_row_multiple(ty: GgmlType) -> usize {
    if matches!(ty, GgmlType::Q8_0 | GgmlType::IQ4_XS) { CH } else { 1 }
}

/// Whether `w` can be a fast-path product: Q8_0 or IQ4_XS, rows of whole 272-byte chunks.
pub(super) fn fast_mat(w: &DevMat) -> bool {
    matches!(w.ty, GgmlType::Q8_0 | GgmlType::IQ4_XS) && w.row_bytes % CH == 0 && w.ptr % 16 == 0 && (w.n_experts == 0 || w.expert_stride % 16 == 0)
}

/// Whether `w` can go through `router_f32`: F32, whole float4 rows, 16-byte aligned.
pub(crate) fn fast_router(w: &DevMat) -> bool {
    w.ty == GgmlType::F32 && w.cols % 4 == 0 && w.row_bytes == 4 * w.cols && w.ptr % 16 == 0
}

/// Values per thread of `norm_q8` (block 1024), as in kernels/fast.cu.
const NQ_MAXV: usize = 12;
/// Widest q or k row of `qk_norm_rope_store` (8 values per thread, block 1024).
pub const QK_MAX_WIDTH: usize = 8192;

/// IQ4_XS expert gate/up kernel of the per-pair (not grouped) MoE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateUpKind {
    /// The shared-memory staged `moe_gate_up*` (`MINIMAX_GU` rows per warp; `MINIMAX_GU_REG=0`).
    Staged,
    /// The register-direct `moe_gate_up_reg{rows}{n}_iq4_xs`: rows per warp (4 or 2), and
    /// whether the next row's loads are issued first (`MINIMAX_GU_REG=4|2|4n|2n`).
    Reg(usize, bool),
    /// `moe_gate_up_pst_iq4_xs`: one wave of persistent blocks walking the (pair, 32-row)
    /// tasks with the next row always in flight (the default; inputs of at most 3072 columns,
    /// else `Reg(2, true)`). Bit-identical to `Reg(2, true)`. `MINIMAX_GU_REG=p`.
    Persist,
    /// `moe_gate_up_psx_iq4_xs` (the default): `Persist` with the activations interleaved in
    /// registers once per token and the cheaper codebook decode `iq4_lookup_il`
    /// (kernels/fast.cu); bit-identical to `Persist`, 22.6 -> 20.2 us per M2.7 layer. Same
    /// fallback.
    PersistIl,
    /// `moe_gate_up_psy_iq4_xs` (`MINIMAX_GU_REG=y`): `PersistIl` at two blocks per SM, the
    /// token's activations in shared memory and one matrix row in flight per warp;
    /// bit-identical, measured slower (23.9 us). Same fallback.
    PersistSm,
}

static GU_OVR: AtomicU8 = AtomicU8::new(0);

impl GateUpKind {
    /// The kind in force: [`set_gate_up_kind`] if set, else `MINIMAX_GU_REG` (read once).
    pub fn from_env() -> Self {
        match GU_OVR.load(Ordering::Relaxed) {
            1 => return GateUpKind::Staged,
            2 => return GateUpKind::Reg(2, true),
            3 => return GateUpKind::Reg(4, true),
            4 => return GateUpKind::Persist,
            5 => return GateUpKind::PersistIl,
            6 => return GateUpKind::PersistSm,
            _ => {}
        }
        static V: std::sync::OnceLock<GateUpKind> = std::sync::OnceLock::new();
        *V.get_or_init(|| match std::env::var("MINIMAX_GU_REG").as_deref() {
            Ok("0") => GateUpKind::Staged,
            Ok("4") => GateUpKind::Reg(4, true),
            Ok("4n") => GateUpKind::Reg(4, false),
            Ok("2") => GateUpKind::Reg(2, true),
            Ok("2n") => GateUpKind::Reg(2, false),
            Ok("p") => GateUpKind::Persist,
            Ok("y") => GateUpKind::PersistSm,
            _ => GateUpKind::PersistIl,
        })
    }
}

/// Overrides the gate/up kernel (A/B runs and tests; `None` = back to the environment;
/// `Reg(_, false)` is not an override choice). Drop captured graphs after a change.
pub fn set_gate_up_kind(kind: Option<GateUpKind>) {
    GU_OVR.store(
        match kind {
            None | Some(GateUpKind::Reg(_, false)) => 0,
            Some(GateUpKind::Staged) => 1,
            Some(GateUpKind::Reg(4, _)) => 3,
            Some(GateUpKind::Reg(..)) => 2,
            Some(GateUpKind::Persist) => 4,
            Some(GateUpKind::PersistIl) => 5,
            Some(GateUpKind::PersistSm) => 6,
        },
        Ordering::Relaxed,
    );
}

/// Most 32-value units of a persistent kernel's row per lane round (`GR_XU` x 32 for gate/up
/// inputs, 4 warps x 32 lanes x 3 for a down row's k expert rows).
const PST_GU_UNITS: usize = 96;
const PST_DN_UNITS: usize = 384;

/// Q8_0 dense product kernel of [`Gpu::matvec_q8`]: the staged `mvq_*` (software-pipelined
/// shared-memory phases of 8 chunks), the whole-row `mvqs_*` (cp.async of up to 12 / 24
/// chunks at once, conflict-free block-pair reads) or the tensor-core `mvmma_q8_0` (int8 MMA
/// with the step's tokens as M: each token's activations are read once per 8 weight rows, not
/// once per row). IQ4_XS matrices always take `mvq_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MvqKind {
    /// `mvq_*` (run-4 kernel; `MINIMAX_MVQ=0`).
    Staged,
    /// `mvqs_*`: 8 warps x 12-chunk phases for rows of up to 12 chunks, else 4 warps x 24
    /// (`MINIMAX_MVQ=w`; the default before `mvmma_q8_0`).
    Whole,
    /// `mvqs_*` with 8 warps x 12-chunk phases for every row (`MINIMAX_MVQ=s`).
    WholeShort,
    /// `mvmma_q8_0` for every step (`MINIMAX_MVQ=m`).
    Mma,
    /// `Whole` below [`MMA_MIN_TOKENS`] tokens, `Mma` from there (the default).
    Auto,
}

/// Whether the grouped IQ4_XS expert down runs on tensor cores (`MINIMAX_GRP_MMA=1`; off by
/// default: on a 16-layer M2.7, H200, graph replay, it gave batch 32 2,917 -> 3,002 tok/s but
/// batch 4 1,315 -> 1,147 and batch 16 2,422 -> 2,334, latency-bound with few pairs a slot).
pub fn grp_mma() -> bool {
    static V: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_GRP_MMA", false);
    V.get()
}

/// Tokens from which [`MvqKind::Auto`] takes the tensor-core Q8_0 kernel.
pub const MMA_MIN_TOKENS: usize = 4;
/// The tensor-core Q8_0 product kernels of 4-32-token steps (`mvmma*_q8_0`), same arguments,
/// told apart by their warps a block (each a K range) and ring buffers a warp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mvmma {
    /// `mvmma_q8_0`: 4 warps, rings of 4 chunks (70 KB: three blocks an SM).
    W4R4,
    /// `mvmma3_q8_0`: 4 warps, rings of 3 (52 KB: four blocks an SM), same bits as `W4R4`.
    W4R3,
    /// `mvmma8_q8_0`: 8 warps, rings of 3 (104 KB: two blocks an SM, twice the warps).
    W8R3,
}

impl Mvmma {
    /// (kernel stem, threads, dynamic shared memory: warps x ring x a 16-row chunk).
    fn launch(self) -> (&'static str, u32, usize) {
        let (stem, warps, ring) = match self {
            Mvmma::W4R4 => ("mvmma_q8_0", 4, 4),
            Mvmma::W4R3 => ("mvmma3_q8_0", 4, 3),
            Mvmma::W8R3 => ("mvmma8_q8_0", 8, 3),
        };
        (stem, 32 * warps as u32, warps * ring * 16 * CH)
    }
}

/// Fewest tokens for which [`Gpu::router_topk_f32`] takes `router_topk_f32t4`
/// (`MINIMAX_ROUTER_T4_MIN`, default 16; [`set_router_t4_min`]); usize::MAX = not read yet.
/// Measured (H200, M2.7, graph replay): slower at 4 and 8 tokens (9.33 / 13.72 ms a step
/// against 9.08 / 13.51), even at 16 (21.89 / 21.93), faster at 32 (34.55 / 34.91).
static ROUTER_T4_MIN: AtomicUsize = AtomicUsize::new(usize::MAX);
pub(crate) fn router_t4_min() -> usize {
    let mut v = ROUTER_T4_MIN.load(Ordering::Relaxed);
    if v == usize::MAX {
        v = std::env::var("MINIMAX_ROUTER_T4_MIN").ok().and_then(|s| s.parse().ok()).unwrap_or(16);
        ROUTER_T4_MIN.store(v, Ordering::Relaxed);
    }
    v
}
/// Sets the token count from which the router reads each weight row once for 4 tokens
/// (`Some(n)`; a value above 32 = never), or back to the environment (`None`).
pub fn set_router_t4_min(n: Option<usize>) {
    ROUTER_T4_MIN.store(n.unwrap_or(usize::MAX), Ordering::Relaxed);
}

static FAST_SYNC: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_FAST_SYNC", false);

/// Whether a fast step waits for its graph before returning its logits rows. Off (default):
/// the head's sampling kernels queue behind the graph with no host round trip between them
/// (served batch 1: ~0.03 ms a step, +0.5 %; `MINIMAX_FAST_SYNC=1` for A/B).
pub fn fast_sync() -> bool {
    FAST_SYNC.get()
}

static ROUTER_X: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_ROUTER_X", true);

/// Whether routers below [`router_t4_min`] tokens take `router_topk_f32x` (a row's loads all in
/// flight at once, the token's x in shared memory; bit-identical) instead of `router_topk_f32`
/// (`MINIMAX_ROUTER_X`, default on; `0` = `router_topk_f32`). Measured (H200, M2.7, batch 1,
/// graph replay, two runs): 4.318 / 4.317 ms a step against 4.348 / 4.346.
pub fn router_x() -> bool {
    ROUTER_X.get()
}

/// Overrides [`router_x`] (A/B runs and tests; `None` = back to the environment). Drop captured
/// graphs after a change.
pub fn set_router_x(on: Option<bool>) {
    ROUTER_X.set(on);
}

/// The gating argument of the router kernels (moe.cu's `gating`: 2 = sigmoid, 1 = softmax).
pub(crate) fn gating_code(g: minimax_shared::model::GatingFunc) -> i32 {
    match g {
        minimax_shared::model::GatingFunc::Sigmoid => 2,
        minimax_shared::model::GatingFunc::Softmax => 1,
    }
}

/// The arguments `router_topk_norm_f32` and `router_topk_f32n` share (the latter adds its
/// scratch and prefetch switch).
#[allow(clippy::too_many_arguments)]
fn norm_router_args(w: &DevMat, x: u64, xs: usize, nw: u64, eps: f32, y: u64, ys: usize, bias: u64, k: usize, g: i32, ids: u64, wts: u64, cnt: u64, xq: u64, xd: u64) -> Vec<Arg> {
    vec![
        Arg::P(w.ptr),
        Arg::I(w.rows as i32),
        Arg::I(w.cols as i32),
        Arg::P(x),
        Arg::L(xs as i64),
        Arg::P(nw),
        Arg::F(eps),
        Arg::P(y),
        Arg::L(ys as i64),
        Arg::P(bias),
        Arg::I(k as i32),
        Arg::I(g),
        Arg::P(ids),
        Arg::P(wts),
        Arg::P(cnt),
        Arg::P(xq),
        Arg::P(xd),
    ]
}

/// Widest router row `router_topk_f32x` stages in shared memory (16 KB).
pub const ROUTER_X_MAX_COLS: usize = 4096;

static ROUTER_PREFETCH: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_ROUTER_PREFETCH", true);

/// Whether `router_topk_f32n` asks L2 for its weight rows before its PDL wait (one bulk
/// prefetch a warp; default on, `MINIMAX_ROUTER_PREFETCH=0` = off). Batch 1 on an H200 (graph
/// replay, against `router_topk_f32n` without it, two calls): 4.361 / 4.354 → 4.351 / 4.342 ms
/// a step, 4.358 / 4.357 → 4.346 / 4.346.
pub fn router_prefetch() -> bool {
    ROUTER_PREFETCH.get()
}

/// Overrides [`router_prefetch`] (A/B runs; `None` = back to the environment). Drop captured
/// graphs after a change.
pub fn set_router_prefetch(on: Option<bool>) {
    ROUTER_PREFETCH.set(on);
}

static ROUTER_NORMLESS: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_ROUTER_NORMLESS", true);

/// Whether the MoE norm of steps below [`router_t4_min`] tokens runs inside the router
/// (`router_topk_f32n`: each block its share of the q8 groups and sums of squares, the last
/// block the scale; no `norm_q8` launch before the router) instead of `norm_q8` +
/// `router_topk_f32x` (default on; `MINIMAX_ROUTER_NORMLESS=0` = the two launches). Batch 1 on
/// an H200 (graph replay, four runs): 4.369-4.374 → 4.354-4.363 ms a step; logits differ by f32
/// rounding (docs/CUDA.md "The MoE norm inside the router").
pub fn router_normless() -> bool {
    ROUTER_NORMLESS.get()
}

/// Overrides [`router_normless`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change.
pub fn set_router_normless(on: Option<bool>) {
    ROUTER_NORMLESS.set(on);
}

static ROUTE_INLINE: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_ROUTE_INLINE", false);

/// Whether one-token steps with the normless router and the streamed gate/up route inside the
/// gate/up (`router_f32n` + `moe_gate_up_blkr`: every gate/up block takes the MoE norm's scale
/// and the top-k itself from the router's raw logits) instead of in the router's last block
/// (`router_topk_f32n`); the same bits (`MINIMAX_ROUTE_INLINE=1`; off by default: within
/// ±0.5 % of the last block in three calls on an H200, docs/CUDA.md "Inline routing").
pub fn route_inline() -> bool {
    ROUTE_INLINE.get()
}

/// Overrides [`route_inline`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change.
pub fn set_route_inline(on: Option<bool>) {
    ROUTE_INLINE.set(on);
}

static ROUTER_F32N_WARPS: AtomicUsize = AtomicUsize::new(0);

/// Warps a block of `router_topk_f32n` and `router_f32n` (one router row each): 8 unless
/// `MINIMAX_ROUTER_WARPS` (1, 2, 4, 8 or 16: `router_topk_f32n16`; `router_f32n` takes 8 at
/// most) or [`set_router_f32n_warps`] says otherwise. The sums are the same whatever the split.
/// H200, M2.7, graph replay, 4 / 8 / 16 warps (256 experts: 64 / 32 / 16 blocks): session 22
/// batch 1 4.331 / 4.256 / 4.266 ms, batch 4 9.088 / 9.024 / 9.004, batch 8 13.669 / 13.657 /
/// 13.634 (8 the default then); session 24, with the attention's empty splits leaving: batch 1
/// 4.074 / 4.008 / 3.963-3.968, batch 4 9.066 / 8.996 / 8.981, batch 8 13.612 / 13.605 / 13.581
/// (16 the default then); session 25, with the x8 norm hand-over and the redux top-k: batch 1
/// 3.921-3.924 / **3.840-3.842** / 3.859-3.861 (8 the default again; batch 4 and 8 not measured).
pub fn router_f32n_warps() -> u32 {
    match ROUTER_F32N_WARPS.load(Ordering::Relaxed) {
        0 => {
            static V: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
            *V.get_or_init(|| std::env::var("MINIMAX_ROUTER_WARPS").ok().and_then(|v| v.parse::<u32>().ok()).filter(|w| [1, 2, 4, 8, 16].contains(w)).unwrap_or(8))
        }
        w => w as u32,
    }
}

/// Overrides [`router_f32n_warps`] (1, 2, 4, 8 or 16; `None` = back to the environment). Drop
/// captured graphs after a change.
pub fn set_router_f32n_warps(w: Option<u32>) {
    ROUTER_F32N_WARPS.store(w.filter(|w| [1, 2, 4, 8, 16].contains(w)).unwrap_or(0) as usize, Ordering::Relaxed);
}

/// Whether `router_topk_f32n` takes router `w` with MoE norm weight `nw` (F32 float4 rows of a
/// multiple of 32 columns, at most [`ROUTER_X_MAX_COLS`], the norm weight 16-byte aligned).
pub(crate) fn normless_fits(w: &DevMat, nw: u64) -> bool {
    fast_router(w) && w.cols % 32 == 0 && w.cols <= ROUTER_X_MAX_COLS && nw % 16 == 0
}

/// Floats of partial sums the K-split `mvx_q8_0` products may use (parts x tokens x rows).
pub const MVX_PART_CAP: usize = 2 * 32 * 16384;
/// Arrival counters of the K-split `mvx_q8_0` products (one per 8-row task).
pub const MVX_CNT_CAP: usize = 2048;

/// Whether 4-32-token Q8_0 products take `mvx_q8_0` where it fits (`MINIMAX_MVX`, default on;
/// 0 = the `mvmma*` kernels); [`set_mvx`] overrides (tests, A/B runs).
static MVX: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_MVX", true);
fn mvx_on() -> bool {
    MVX.get()
}
/// Forces `mvx_q8_0` on or off (`Some`), or back to `MINIMAX_MVX` (`None`). Captured graphs keep
/// the kernels they were captured with.
pub fn set_mvx(on: Option<bool>) {
    MVX.set(on);
}

/// A launch of `mvx_q8_0` (see [`Gpu::mvx_plan`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MvxPlan {
    /// Kernel name (`mvx_q8_0_{token tiles}_{ring buffers}_{warp groups}`).
    pub name: String,
    /// (blocks, K parts, 1).
    pub grid: (u32, u32, u32),
    /// K parts (grid y).
    pub ks: usize,
    /// Warp groups a block, each a column range of the block's part (block 256 kw threads).
    pub kw: usize,
    /// Dynamic shared memory of a block.
    pub smem: usize,
}

/// Shared memory of an `mvx_q8_0` block: `mt` 16-token tiles of a K part of `kcols` columns
/// (rows of kcols + 16 bytes, then their f32 scales) and 8 `kw` warps' rings of `nb` 8-row
/// chunks.
pub fn mvx_smem(mt: usize, kcols: usize, nb: usize, kw: usize) -> usize {
    16 * mt * (kcols + 16) + 16 * mt * (kcols / 8 + 16) + 8 * kw * nb * 8 * CH
}

/// Column ranges a block's warps split its K part into (`MINIMAX_MVX_KW=1|2`, [`set_mvx_kw`];
/// 0 = the default, one); u8::MAX = not read yet.
static MVX_KW: AtomicU8 = AtomicU8::new(u8::MAX);
fn mvx_kw_forced() -> u8 {
    let mut v = MVX_KW.load(Ordering::Relaxed);
    if v == u8::MAX {
        v = match std::env::var("MINIMAX_MVX_KW").as_deref() {
            Ok("1") => 1,
            Ok("2") => 2,
            _ => 0,
        };
        MVX_KW.store(v, Ordering::Relaxed);
    }
    v
}
/// Forces the `mvx_q8_0` warp split (`Some(1 | 2)`; `Some(0)` = the default), or back to the
/// environment (`None`).
pub fn set_mvx_kw(kw: Option<u8>) {
    MVX_KW.store(kw.unwrap_or(u8::MAX), Ordering::Relaxed);
}

/// Forced kernel (1 + `Mvmma as u8`; 0 = by the grid, see [`mvmma_kind`]); u8::MAX = not read
/// from `MINIMAX_MVMMA` yet.
static MVMMA_FORCED: AtomicU8 = AtomicU8::new(u8::MAX);

/// The kernel of a tensor-core Q8_0 product of `blocks` 16-row blocks over `nchunks` 256-column
/// chunks on `sms` SMs whose blocks may have `optin` bytes of shared memory. Grids that three
/// 4-warp blocks an SM would run in more than one wave but four would not (M2.7's q/k/v: 512
/// blocks on 132 SMs) take the 3-chunk rings (`W4R3`); grids of at most two blocks an SM with
/// long rows (the o-projection: 192 blocks of 24 chunks) take 8 warps a block (`W8R3`: twice the
/// warps to hide latency, 3 chunks a warp); the rest (the output head: many waves) keeps `W4R4`,
/// as does any choice whose shared memory the card does not have (sm_120: 99 KB, so no `W8R3`).
/// `MINIMAX_MVMMA=4|3|8` (or [`set_mvmma`]) forces one.
pub fn mvmma_kind(blocks: usize, nchunks: usize, sms: usize, optin: usize) -> Mvmma {
    let mut v = MVMMA_FORCED.load(Ordering::Relaxed);
    if v == u8::MAX {
        v = match std::env::var("MINIMAX_MVMMA").as_deref() {
            Ok("4") => 1,
            Ok("3") => 2,
            Ok("8") => 3,
            _ => 0,
        };
        MVMMA_FORCED.store(v, Ordering::Relaxed);
    }
    let kind = match v {
        1 => Mvmma::W4R4,
        2 => Mvmma::W4R3,
        3 => Mvmma::W8R3,
        _ if blocks <= 2 * sms && nchunks >= 16 => Mvmma::W8R3,
        _ if blocks > 3 * sms && blocks <= 4 * sms => Mvmma::W4R3,
        _ => Mvmma::W4R4,
    };
    if kind.launch().2 > optin { Mvmma::W4R4 } else { kind }
}

/// Forces the kernel (`Some(Some(k))`), `Some(None)` = by the grid, `None` = back to the
/// environment (tests, A/B runs). Captured graphs keep the kernel they were captured with.
pub fn set_mvmma(kind: Option<Option<Mvmma>>) {
    MVMMA_FORCED.store(
        match kind {
            None => u8::MAX,
            Some(None) => 0,
            Some(Some(k)) => 1 + k as u8,
        },
        Ordering::Relaxed,
    );
}

impl MvqKind {
    /// The kind in force: [`set_kernel_overrides`] if set, else `MINIMAX_MVQ` (read once).
    pub fn from_env() -> Self {
        match MVQ_OVR.load(Ordering::Relaxed) {
            1 => return MvqKind::Staged,
            2 => return MvqKind::Whole,
            3 => return MvqKind::WholeShort,
            4 => return MvqKind::Mma,
            5 => return MvqKind::Auto,
            _ => {}
        }
        static V: std::sync::OnceLock<MvqKind> = std::sync::OnceLock::new();
        *V.get_or_init(|| match std::env::var("MINIMAX_MVQ").as_deref() {
            Ok("0") => MvqKind::Staged,
            Ok("s") => MvqKind::WholeShort,
            Ok("w") => MvqKind::Whole,
            Ok("m") => MvqKind::Mma,
            _ => MvqKind::Auto,
        })
    }
}

static MVQ_OVR: AtomicU8 = AtomicU8::new(0);
static DN_OVR: AtomicU8 = AtomicU8::new(0);
static ROUTE_OVR: AtomicU8 = AtomicU8::new(0);

/// Process-wide kernel choices for A/B runs inside one process (the benchmark), overriding
/// the environment (`None` = back to the environment's choice). Captured graphs keep the
/// kernels they were captured with: drop them after a change (`CudaModel::clear_graphs`).
/// `route_fast`: Some(false) = the exact `moe_route`, Some(true) = the fused `router_topk_f32`.
pub fn set_kernel_overrides(mvq: Option<MvqKind>, down: Option<DownKind>, route_fast: Option<bool>) {
    MVQ_OVR.store(
        match mvq {
            None => 0,
            Some(MvqKind::Staged) => 1,
            Some(MvqKind::Whole) => 2,
            Some(MvqKind::WholeShort) => 3,
            Some(MvqKind::Mma) => 4,
            Some(MvqKind::Auto) => 5,
        },
        Ordering::Relaxed,
    );
    DN_OVR.store(
        match down {
            None => 0,
            Some(DownKind::Staged) => 1,
            Some(DownKind::Reg4) => 2,
            Some(DownKind::Reg2) => 3,
            Some(DownKind::Persist) => 4,
            Some(DownKind::Reg4Pre) => 5,
        },
        Ordering::Relaxed,
    );
    ROUTE_OVR.store(
        match route_fast {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        },
        Ordering::Relaxed,
    );
}

/// How the fast step routes (router product + top-k).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteMode {
    /// `router_f32` then the exact path's `moe_route` (plain launch; `MINIMAX_ROUTE=0`).
    Exact,
    /// `router_f32` then `moe_route_fast` (PDL; `MINIMAX_ROUTE=1`).
    Fast,
    /// `router_topk_f32`: both in one launch, the top-k in the last block (the default).
    Fused,
}

/// The routing in force: [`set_kernel_overrides`] (`route_fast`: false = Exact, true =
/// Fused) or [`set_route_mode`] if set, else `MINIMAX_ROUTE` (0 / 1 / 2, default 2).
pub fn route_mode() -> RouteMode {
    match ROUTE_OVR.load(Ordering::Relaxed) {
        1 => RouteMode::Exact,
        2 => RouteMode::Fused,
        3 => RouteMode::Fast,
        _ => {
            static V: std::sync::OnceLock<RouteMode> = std::sync::OnceLock::new();
            *V.get_or_init(|| match std::env::var("MINIMAX_ROUTE").as_deref() {
                Ok("0") => RouteMode::Exact,
                Ok("1") => RouteMode::Fast,
                _ => RouteMode::Fused,
            })
        }
    }
}

/// Overrides the routing (A/B runs; `None` = back to the environment's choice).
pub fn set_route_mode(m: Option<RouteMode>) {
    ROUTE_OVR.store(
        match m {
            None => 0,
            Some(RouteMode::Exact) => 1,
            Some(RouteMode::Fused) => 2,
            Some(RouteMode::Fast) => 3,
        },
        Ordering::Relaxed,
    );
}

/// Expert down kernel of [`Gpu::moe_down_q8`]: the staged `moe_down_*` or, for IQ4_XS, the
/// register-direct `moe_down_reg{4,2}_iq4_xs` (4 or 2 warps per output row) or its persistent
/// form `moe_down_pst_iq4_xs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownKind {
    /// `moe_down_*` (run-4 kernel; `MINIMAX_DN=0`).
    Staged,
    /// `moe_down_reg4_iq4_xs` (`MINIMAX_DN=4`).
    Reg4,
    /// `moe_down_rx4_iq4_xs` (the default for IQ4_XS): `Reg4` with the routing and the first
    /// weight round loaded before the PDL wait, so the down weights stream in while the gate/up
    /// kernel finishes; bit-identical to `Reg4`. Needs a gate/up kernel (wait before trigger)
    /// launched right before it, as the forward does (kernels/fast.cu says why).
    Reg4Pre,
    /// `moe_down_reg2_iq4_xs` (`MINIMAX_DN=2`).
    Reg2,
    /// `moe_down_pst_iq4_xs` (`MINIMAX_DN=p`): one wave of persistent blocks walking (token,
    /// row pair) tasks with the next task's loads in flight (rows of at most 384 units in all
    /// k experts, else `Reg4`). Bit-identical to `Reg4`; measured no faster (docs/CUDA.md).
    Persist,
}

impl DownKind {
    /// The kind in force: [`set_kernel_overrides`] if set, else `MINIMAX_DN` (read once).
    pub fn from_env() -> Self {
        match DN_OVR.load(Ordering::Relaxed) {
            1 => return DownKind::Staged,
            2 => return DownKind::Reg4,
            3 => return DownKind::Reg2,
            4 => return DownKind::Persist,
            5 => return DownKind::Reg4Pre,
            _ => {}
        }
        static V: std::sync::OnceLock<DownKind> = std::sync::OnceLock::new();
        *V.get_or_init(|| match std::env::var("MINIMAX_DN").as_deref() {
            Ok("0") => DownKind::Staged,
            Ok("2") => DownKind::Reg2,
            Ok("4") => DownKind::Reg4,
            Ok("p") => DownKind::Persist,
            _ => DownKind::Reg4Pre,
        })
    }
}

static ATTN_FUSE: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_ATTN_FUSE", false);

/// Whether decode attention merges its splits in the last split block (`attn_dec6m_*`,
/// `MINIMAX_ATTN_FUSE=1`) instead of a separate `attn_merge6` launch (the default);
/// bit-identical. Measured (H200, M2.7 IQ4_XS, batch 1): 0.4 ms per step slower at short
/// context; at 32k 0.75 ms faster with the SIMT kernel, 0.05 ms slower with the tensor-core
/// one (docs/CUDA.md).
pub fn attn_fusion() -> bool {
    ATTN_FUSE.get()
}

/// Overrides [`attn_fusion`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change (`CudaModel::clear_graphs`).
pub fn set_attn_fusion(on: Option<bool>) {
    ATTN_FUSE.set(on);
}

static ATTN_SHORT: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_ATTN_SHORT", false);

/// Longest context (cached + new tokens of a step's longest sequence) whose decode attention
/// [`attn_short`] runs unsplit.
pub const ATTN_SHORT_MAX_CTX: usize = 256;

/// Whether fast steps whose contexts are all at most [`ATTN_SHORT_MAX_CTX`] run decode
/// attention as one block per (token, KV head) that normalizes its own output (`attn_dec6tm_*`
/// with one split: no `attn_merge6` launch, no partials) instead of one split per SM and a
/// merge (`MINIMAX_ATTN_SHORT=1`; opt-in: `minimax-bench --short-ab` measured no gain beyond
/// run-to-run spread on an H200). Such
/// steps get their own graphs (keyed by tokens and this choice).
pub fn attn_short() -> bool {
    ATTN_SHORT.get()
}

/// Overrides [`attn_short`] (A/B runs and tests; `None` = back to the environment). Graphs are
/// keyed by the choice, so no graph needs dropping.
pub fn set_attn_short(on: Option<bool>) {
    ATTN_SHORT.set(on);
}

/// Most attention splits `attn_dec6m_*` merges (`AD_MAXSPLIT`).
pub const ATTN_FUSE_MAX_SPLIT: usize = 128;

static PDL_PREFETCH: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_PDL_PREFETCH", true);
static PDL_EARLY: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_PDL_EARLY", false);
/// `u32::MAX` = no override of the parts (the environment decides).
static PDL_PARTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(u32::MAX);

/// Parts of the PDL pre-wait work (bits of [`set_pdl_parts`] / `MINIMAX_PDL_PARTS`): `mvqs_*p`
/// (dense Q8_0 products, weight copies before the wait).
pub const PDL_MVQS: u32 = 1;
/// `router_topk_f32p` (router rows in registers before the wait; not a default part: slower).
pub const PDL_ROUTER: u32 = 2;
/// `qk_norm_rope_store_p_*` (norm weights and RoPE angles before the wait).
pub const PDL_QK: u32 = 4;
/// `mvmma_q8_0p` (first ring chunks before the wait).
pub const PDL_MMA: u32 = 8;
/// `mvqs_q8_0_*s2p` (2 rows per warp of 4, the whole q/k/v grid resident) for rows of up to
/// 12 chunks and 1 to 3 vectors, instead of `mvqs_*p`.
pub const PDL_MVQS2: u32 = 16;
/// `norm_q8e` (early trigger; not a default part: slower).
pub const PDL_NORM_EARLY: u32 = 32;
/// `attn_merge6e` (early trigger; not a default part: slower).
pub const PDL_MERGE_EARLY: u32 = 64;
/// The parts [`pdl_prefetch`] turns on (the default): those measured faster (docs/CUDA.md).
pub const PDL_PREFETCH_PARTS: u32 = PDL_MVQS | PDL_QK | PDL_MMA | PDL_MVQS2;
/// Both early triggers ([`pdl_early`], `MINIMAX_PDL_EARLY=1`).
pub const PDL_EARLY_PARTS: u32 = PDL_NORM_EARLY | PDL_MERGE_EARLY;
/// Every part.
pub const PDL_ALL_PARTS: u32 = PDL_PREFETCH_PARTS | PDL_ROUTER | PDL_EARLY_PARTS;

/// Whether the fast path's weight-reading kernels start their weight loads before waiting for
/// the previous kernel ([`PDL_PREFETCH_PARTS`]: `mvqs_*p` / `mvqs_*s2p`, `mvmma_q8_0p`,
/// `qk_norm_rope_store_p_*`; `MINIMAX_PDL_PREFETCH=0` = the plain kernels). Bit-identical.
pub fn pdl_prefetch() -> bool {
    PDL_PREFETCH.get()
}

/// Overrides [`pdl_prefetch`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change (`CudaModel::clear_graphs`).
pub fn set_pdl_prefetch(on: Option<bool>) {
    PDL_PREFETCH.set(on);
}

/// Parts of a fast step that [`set_skip_mask`] can leave out (timing attribution only: the
/// outputs are garbage; `minimax-bench --skip-ab`).
pub mod skip {
    /// The attention RMSNorm (`norm_q8`, when no fused norm ran it).
    pub const ATTN_NORM: u32 = 1;
    /// The q/k/v product.
    pub const QKV: u32 = 2;
    /// q/k norm + RoPE + KV store.
    pub const QK: u32 = 4;
    /// Decode attention and its merge.
    pub const ATTN: u32 = 8;
    /// The o-projection.
    pub const O: u32 = 16;
    /// The MoE RMSNorm and the router (fused or not).
    pub const ROUTE: u32 = 32;
    /// The expert gate/up.
    pub const GATE_UP: u32 = 64;
    /// The expert down (and a norm fused into it).
    pub const DOWN: u32 = 128;
}

static SKIP: AtomicU32 = AtomicU32::new(0);

/// Leaves the [`skip`] parts out of every later fast step (benchmarks only: what a part costs
/// inside a replayed graph is the step's time with it minus without it). Drop captured graphs
/// after a change. 0 = run everything (the default).
pub fn set_skip_mask(mask: u32) {
    SKIP.store(mask, Ordering::Relaxed);
}

/// The parts [`set_skip_mask`] leaves out.
pub fn skip_mask() -> u32 {
    SKIP.load(Ordering::Relaxed)
}

static FUSE_ROUTER_NORM: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_FUSE_ROUTER_NORM", false);
static FUSE_DOWN_NORM: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_FUSE_DOWN_NORM", true);

static DOWN_TRIG_LATE: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_DOWN_TRIG_LATE", false);

/// Whether the MoE's RMSNorm runs inside the fused router (`router_topk_norm_f32`: one kernel
/// boundary fewer a layer; `MINIMAX_FUSE_ROUTER_NORM=1`; off by default: slower at batch 1 and
/// 32 on an H200, docs/CUDA.md). Bit-identical either way.
pub fn fuse_router_norm() -> bool {
    FUSE_ROUTER_NORM.get()
}

/// Whether the streamed down's last block runs the next layer's attention RMSNorm (and, after
/// the last layer, the output norm), so no `norm_q8` launch sits between the down and the
/// q/k/v product (the default: 0.8 % faster at batch 1 on an H200; `MINIMAX_FUSE_DOWN_NORM=0`
/// = separate). Bit-identical either way.
pub fn fuse_down_norm() -> bool {
    FUSE_DOWN_NORM.get()
}

static NORM_X8: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_NORM_X8", true);

/// With [`fuse_down_norm`], one-token steps: whether the streamed down hands the next layer's
/// attention norm over in groups of 8 rows with no meeting of its blocks (`dn_x8`: q8 codes, a
/// scale and a sum of squares per group) and the q/k/v product takes the norm's 1 / rms itself
/// (`mvqs_q8_0_1s2p8`), instead of the down's last block running the whole norm
/// (`MINIMAX_NORM_X8=0`). Not bit-identical to it: finer q8 scales and 1 / rms applied to the
/// sums (docs/CUDA.md "The attention norm without a meeting").
pub fn norm_x8() -> bool {
    NORM_X8.get()
}

/// Overrides [`norm_x8`] (A/B runs and tests; `None` = back to the environment). Drop captured
/// graphs after a change.
pub fn set_norm_x8(on: Option<bool>) {
    NORM_X8.set(on);
}

/// With [`fuse_down_norm`]: whether the down lets the next kernel launch only after its loops
/// (`MINIMAX_DOWN_TRIG_LATE=1`; off by default: slower) instead of at its start, so the q/k/v's
/// weight copies would overlap the norm rather than the down's own weight stream.
pub fn down_trig_late() -> bool {
    DOWN_TRIG_LATE.get()
}

/// Overrides the three switches above (A/B runs and tests; `None` = back to the environment).
/// Drop captured graphs after a change (`CudaModel::clear_graphs`).
pub fn set_norm_fusion(router: Option<bool>, down: Option<bool>, late: Option<bool>) {
    FUSE_ROUTER_NORM.set(router);
    FUSE_DOWN_NORM.set(down);
    DOWN_TRIG_LATE.set(late);
}

/// Widest row the fused norms take (`RN_MAXI` / `DN_NORM_MAXI` x 1024 in the kernels).
pub const FUSED_NORM_MAX: usize = 4096;

/// Whether `norm_q8` and `attn_merge6` let the next kernel launch before they wait for the
/// previous one (`norm_q8e`, `attn_merge6e`; `MINIMAX_PDL_EARLY=1`; off by default: slower
/// on an H200, docs/CUDA.md), so the next kernel's pre-wait loads overlap more.
pub fn pdl_early() -> bool {
    PDL_EARLY.get()
}

/// Overrides [`pdl_early`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change (`CudaModel::clear_graphs`).
pub fn set_pdl_early(on: Option<bool>) {
    PDL_EARLY.set(on);
}

/// Overrides both flags with a set of `PDL_*` parts (A/B runs and tests; `None` = back to the
/// environment: `MINIMAX_PDL_PARTS=N`, a decimal set of bits, else the two flags). Drop
/// captured graphs after a change.
pub fn set_pdl_parts(parts: Option<u32>) {
    PDL_PARTS.store(parts.map(|p| p & PDL_ALL_PARTS).unwrap_or(u32::MAX), Ordering::Relaxed);
}

/// Whether PDL part `bit` (a `PDL_*` constant) is on.
pub fn pdl_part(bit: u32) -> bool {
    static ENV: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let p = PDL_PARTS.load(Ordering::Relaxed);
    if p != u32::MAX {
        return p & bit != 0;
    }
    if let Some(e) = *ENV.get_or_init(|| std::env::var("MINIMAX_PDL_PARTS").ok().and_then(|v| v.trim().parse::<u32>().ok())) {
        return e & bit != 0;
    }
    (pdl_prefetch() && bit & PDL_PREFETCH_PARTS != 0) || (pdl_early() && bit & PDL_EARLY_PARTS != 0)
}

/// A step's raw q / k / v rows and their shapes, as `qk_norm_rope_store_*` takes them.
#[derive(Clone, Copy, Debug)]
pub struct QkRows {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub qw: usize,
    pub kw: usize,
    pub vw: usize,
    pub hd: usize,
    pub rot: usize,
}

/// Arguments of `qk_norm_rope_store_*` (q rows `qw` apart, k and v rows `kw` apart; the
/// tensor-parallel form appends its own three): one list for the model and the kernel tests.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_args(r: &QkRows, qn: u64, kn: u64, pos: u64, theta: f32, eps: f32, slots: u64, kc: u64, vc: u64) -> Vec<Arg> {
    vec![
        Arg::P(r.q),
        Arg::L(r.qw as i64),
        Arg::P(r.k),
        Arg::P(r.v),
        Arg::L(r.kw as i64),
        Arg::P(qn),
        Arg::P(kn),
        Arg::I(r.qw as i32),
        Arg::I(r.kw as i32),
        Arg::I(r.vw as i32),
        Arg::I(r.hd as i32),
        Arg::I(r.rot as i32),
        Arg::P(pos),
        Arg::F(theta),
        Arg::F(eps),
        Arg::P(slots),
        Arg::P(kc),
        Arg::P(vc),
    ]
}

/// Name of the fused q/k norm + RoPE + KV store kernel for the cache type `kvs`: the
/// tensor-parallel form (`tp`: whole-row sums of squares from an all-reduce) or, with
/// [`pdl_prefetch`], the form that loads the norm weights and RoPE angles before its wait.
pub fn qk_norm_rope_name(tp: bool, kvs: &str) -> String {
    if tp {
        format!("qk_norm_rope_store_tp_{kvs}")
    } else if pdl_part(PDL_QK) {
        format!("qk_norm_rope_store_p_{kvs}")
    } else {
        format!("qk_norm_rope_store_{kvs}")
    }
}

static QK_FUSE: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_QK_FUSE", true);

/// Whether one-token steps leave the q/k norm launch out: the tensor-core attention sums the
/// squares of the raw q / k rows and normalizes, rotates and stores them itself
/// (`attn_dec6tn_*`, with the step's `rope_table`; bit-identical; on by default,
/// `MINIMAX_QK_FUSE=0` = the q/k norm launch; docs/CUDA.md).
pub fn qk_fuse() -> bool {
    QK_FUSE.get()
}

/// Overrides [`qk_fuse`] (A/B runs and tests; `None` = back to the environment). Drop captured
/// graphs after a change (`CudaModel::clear_graphs`).
pub fn set_qk_fuse(on: Option<bool>) {
    QK_FUSE.set(on);
}

static QK_PRE_TILES: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_QK_PRE_TILES", true);

/// Whether `attn_dec6tn_*` issues its first K/V tiles before its PDL wait (`MINIMAX_QK_PRE_TILES`).
pub fn qk_pre_tiles() -> bool {
    QK_PRE_TILES.get()
}

/// Overrides [`qk_pre_tiles`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change.
pub fn set_qk_pre_tiles(on: Option<bool>) {
    QK_PRE_TILES.set(on);
}

static QK_MERGE_EARLY: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_QK_MERGE_EARLY", true);

/// Whether the merge after `attn_dec6tn_*` lets the o-projection launch before its own wait
/// (`attn_merge6e`), so the o-projection's weight copies start while the attention runs
/// (`MINIMAX_QK_MERGE_EARLY`, default on; other steps follow [`pdl_early`]). Same bits. One
/// H200, batch 1, graph replay: 4.102-4.109 → 3.999-4.010 ms a step (with the q/k norm launch
/// the early merge gave nothing: 4.25 either way).
pub fn qk_merge_early() -> bool {
    QK_MERGE_EARLY.get()
}

/// Overrides [`qk_merge_early`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change.
pub fn set_qk_merge_early(on: Option<bool>) {
    QK_MERGE_EARLY.set(on);
}

static ATTN_EXIT_EMPTY: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_ATTN_EXIT_EMPTY", true);

/// Whether the blocks of `attn_dec6tn_*` whose split lies past the context leave before their
/// PDL wait (`MINIMAX_ATTN_EXIT_EMPTY`, default on): at short contexts most of the
/// one-block-per-SM splits are empty, and `attn_merge6` reads only the active ones, so their SMs
/// go to the o-projection's blocks. Same bits. One H200, batch 1, graph replay: 4.086 → 4.043 ms
/// a step; through HTTP 235.4 → 239.4 tok/s.
pub fn attn_exit_empty() -> bool {
    ATTN_EXIT_EMPTY.get()
}

/// Overrides [`attn_exit_empty`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change.
pub fn set_attn_exit_empty(on: Option<bool>) {
    ATTN_EXIT_EMPTY.set(on);
}

/// Static shared memory of `attn_dec6tn_*` (5,120 bytes on sm_90: its q of G heads, the new key
/// / value, the 32 warp sums of each norm, and `attn_dec6t_*`'s 1,280), with room to spare:
/// with [`attn_tn_smem`] it must fit a block ([`Gpu::smem_optin`]; an sm_120 block of 99 KB
/// does not, so those cards keep the q/k norm launch).
pub const QK_FUSE_SMEM: usize = 6144;

/// Widest q row of `attn_dec6tn_*` and widest k row (`QK_MAXV` x 1024, as `qk_norm_rope_store`,
/// whose summation order it plays).
pub const QK_FUSE_MAX_Q: usize = 8 * 1024;
pub const QK_FUSE_MAX_K: usize = 8 * 1024;

/// What `attn_dec6tn_*` needs besides the attention's own arguments: the product's raw q / k / v
/// rows (`qw` / `kw` wide), the norm weights, RoPE and the step's cache slots.
#[derive(Clone, Copy, Debug)]
pub struct QkNormIn {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub qw: usize,
    pub kw: usize,
    pub rot: usize,
    /// The step's RoPE table ([`Gpu::rope_table`]).
    pub rope: u64,
    pub eps: f32,
    pub slots: u64,
}

static ATTN_MMA: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_ATTN_MMA", true);

/// Whether decode attention runs on tensor cores (`attn_dec6t_*`, the default) or the SIMT
/// kernel (`attn_dec6_*`, `MINIMAX_ATTN_MMA=0`); see docs/CUDA.md.
pub fn attn_mma() -> bool {
    ATTN_MMA.get()
}

/// Overrides [`attn_mma`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change (`CudaModel::clear_graphs`).
pub fn set_attn_mma(on: Option<bool>) {
    ATTN_MMA.set(on);
}

/// Dynamic shared memory of a tensor-core decode attention block whose K/V ring has `stages`
/// stages a warp (4 warps x stages x a 16-position K tile and V tile of 128 16-bit values).
const fn attn_ring_smem(stages: usize) -> usize {
    4 * stages * 2 * 16 * 128 * 2
}

/// Dynamic shared memory of `attn_dec6t_*` (`AT_SMEM`: 3 stages).
pub const ATTN_MMA_SMEM: usize = attn_ring_smem(3);

/// K/V ring stages of the one-token decode attention (`attn_dec6tn_*`, the kernels' `AT_NST1`,
/// which nvrtc.rs defines per architecture): 5 where a block may hold 166 KB of shared memory
/// (sm_90, sm_100, sm_103), else 3. Its grid is at most one block per SM, so the larger ring
/// only keeps a second block off the SM; with 3 stages two could share one while other SMs
/// had none. Session 27 (H200): batch 1 3.99 -> 3.91 ms a step, 32k 6.48 -> 6.17 ms.
pub fn attn_tn_stages(arch: u32) -> usize {
    if matches!(arch, 90 | 100 | 103) { 5 } else { 3 }
}

/// Dynamic shared memory of `attn_dec6tn_*` on `sm_{arch}` ([`attn_tn_stages`] stages).
pub fn attn_tn_smem(arch: u32) -> usize {
    attn_ring_smem(attn_tn_stages(arch))
}

static GRP_OVR: AtomicUsize = AtomicUsize::new(0);

/// Overrides the smallest step (tokens) whose MoE runs grouped by expert (`None` = back to
/// `MINIMAX_MOE_GRP`, default 2; 0 or a value above [`MAX_FAST_TOKENS`] turns grouping off).
pub fn set_group_min(min_tokens: Option<usize>) {
    GRP_OVR.store(min_tokens.map(|v| v + 1).unwrap_or(0), Ordering::Relaxed);
}

/// Whether a fast step of `nt` tokens runs its MoE grouped by expert (`moe_group` + the
/// `*_grp` kernels): IQ4_XS experts, at most [`GG_MAXC`] tokens, and `nt` at or above the
/// threshold of [`set_group_min`] / `MINIMAX_MOE_GRP`.
pub fn use_grouped(nt: usize, gate: &DevMat, down: &DevMat, n_experts: usize) -> bool {
    let min = match GRP_OVR.load(Ordering::Relaxed) {
        0 => {
            static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
            *V.get_or_init(|| std::env::var("MINIMAX_MOE_GRP").ok().and_then(|v| v.parse().ok()).unwrap_or(2))
        }
        v => v - 1,
    };
    let iq4 = nt <= GG_MAXC && gate.ty == GgmlType::IQ4_XS && down.ty == GgmlType::IQ4_XS;
    let kq = super::fast_kq::kq_fast_mat(gate) && super::fast_kq::kq_fast_mat(down);
    min > 0 && nt >= min && (iq4 || kq) && n_experts <= GRP_MAX_E
}

/// The grouped IQ4_XS expert kernels (kernels/fast.cu, "The grouped IQ4_XS kernels"): every
/// kind computes the same bits; they differ in speed. `MINIMAX_GRP_KIND` = `plain` | `pin` |
/// `pf` (the default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrpKind {
    /// `moe_*_grp_iq4_xs`: decode through `iq4_lookup` (constants re-materialized per use).
    Plain,
    /// `moe_*_grpp_iq4_xs`: codebook words pinned in registers.
    Pinned,
    /// `moe_*_grpf_iq4_xs`: pinned, the block's weight rows prefetched into L2 first, the down
    /// over 64 rows a block. H200, served-like routing, graph replay: 32 streams 605 -> 680
    /// tok/s against `Pinned` (down 289 -> 237 µs a layer; gate/up unchanged).
    Prefetch,
}

impl GrpKind {
    /// Every kind (A/B runs).
    pub const ALL: [GrpKind; 3] = [GrpKind::Plain, GrpKind::Pinned, GrpKind::Prefetch];

    /// The kind in force: [`set_grp_kind`] if set, else `MINIMAX_GRP_KIND` (read once).
    pub fn from_env() -> Self {
        match GRP_OVR_KIND.load(Ordering::Relaxed) {
            0 => {}
            v => return Self::ALL[v as usize - 1],
        }
        static V: std::sync::OnceLock<GrpKind> = std::sync::OnceLock::new();
        *V.get_or_init(|| match std::env::var("MINIMAX_GRP_KIND").as_deref() {
            Ok("plain") => GrpKind::Plain,
            Ok("pin") => GrpKind::Pinned,
            _ => GrpKind::Prefetch,
        })
    }

    /// Kernel name suffix and down rows a block (a gate/up block is 32 rows for every kind).
    fn kernels(self) -> (&'static str, usize) {
        match self {
            GrpKind::Plain => ("grp", 16),
            GrpKind::Pinned => ("grpp", 16),
            GrpKind::Prefetch => ("grpf", 64),
        }
    }
}

static GRP_OVR_KIND: AtomicU8 = AtomicU8::new(0);

/// The grouped kernels in force ([`GrpKind::from_env`]).
pub fn grp_kind() -> GrpKind {
    GrpKind::from_env()
}

/// Overrides [`grp_kind`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change.
pub fn set_grp_kind(kind: Option<GrpKind>) {
    GRP_OVR_KIND.store(kind.map(|k| GrpKind::ALL.iter().position(|&x| x == k).unwrap() as u8 + 1).unwrap_or(0), Ordering::Relaxed);
}

/// Most tokens (pairs per expert) of the grouped MoE kernels (`GG_MAXC` in kernels/fast.cu).
pub const GG_MAXC: usize = 32;
/// Most experts `moe_group` handles (its shared-memory tables).
pub const GRP_MAX_E: usize = 1024;

/// Largest expert count and top-k of `moe_route_fast` (scores in registers, one warp).
pub const ROUTE_FAST_MAX_E: usize = 256;

/// Widest router row `router_topk_f32p` holds in registers (`RT_PRE` x 32 lanes x 4 floats);
/// wider rows take `router_topk_f32`.
pub const ROUTER_PRE_MAX_COLS: usize = 24 * 32 * 4;

/// Arguments of the three-segment dense kernels (`mvq_*`, `mvqs_*`, fast_kq.cu's `kq_mv_*`):
/// (W, row bytes, rows, y, y stride) per segment (zeros past `segs`), then `nblk` (row units
/// the kernel counts in), xq, xd, ncol, nv, accumulate. Also returns the total rows.
pub(super) fn mv_args(segs: &[(&DevMat, u64, usize)], nblk: usize, xq: u64, xd: u64, ncol: usize, nv: usize, accumulate: bool) -> (Vec<Arg>, usize) {
    let mut args = Vec::with_capacity(21);
    let mut rows = 0;
    for i in 0..3 {
        match segs.get(i) {
            Some((w, y, ys)) => {
                rows += w.rows;
                args.extend([Arg::P(w.ptr), Arg::L(w.row_bytes as i64), Arg::I(w.rows as i32), Arg::P(*y), Arg::L(*ys as i64)]);
            }
            None => args.extend([Arg::P(0), Arg::L(0), Arg::I(0), Arg::P(0), Arg::L(0)]),
        }
    }
    args.extend([Arg::I(nblk as i32), Arg::P(xq), Arg::P(xd), Arg::I(ncol as i32), Arg::I(nv as i32), Arg::I(accumulate as i32)]);
    (args, rows)
}

/// Arguments of the expert gate/up kernels (`moe_gate_up*`, `kq_moe_gate_up*`): gate, up, row
/// bytes, expert stride, then `mid` (the kernel's own: block counts, ids or groups, k), then
/// xq, xd, ncol (= gate.cols), aq, ad, ld.
#[allow(clippy::too_many_arguments)]
pub(super) fn gate_up_args(gate: &DevMat, up: &DevMat, mid: &[Arg], xq: u64, xd: u64, aq: u64, ad: u64, ld: usize) -> Vec<Arg> {
    let mut args = vec![Arg::P(gate.ptr), Arg::P(up.ptr), Arg::L(gate.row_bytes as i64), Arg::L(gate.expert_stride as i64)];
    args.extend_from_slice(mid);
    args.extend([Arg::P(xq), Arg::P(xd), Arg::I(gate.cols as i32), Arg::P(aq), Arg::P(ad), Arg::I(ld as i32)]);
    args
}

/// Arguments of the expert down kernels (`moe_down*`, `kq_moe_down*`): down, row bytes, expert
/// stride, rows, then `mid` (the kernel's own: block counts, ids and weights or groups, k),
/// then aq, ad, ncol (= down.cols), then `tail` (the outputs).
pub(super) fn down_args(down: &DevMat, mid: &[Arg], aq: u64, ad: u64, tail: &[Arg]) -> Vec<Arg> {
    let mut args = vec![Arg::P(down.ptr), Arg::L(down.row_bytes as i64), Arg::L(down.expert_stride as i64), Arg::I(down.rows as i32)];
    args.extend_from_slice(mid);
    args.extend([Arg::P(aq), Arg::P(ad), Arg::I(down.cols as i32)]);
    args.extend_from_slice(tail);
    args
}

fn tn(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::Q8_0 => "q8_0",
        _ => "iq4_xs",
    }
}

/// Split count of decode attention for a step of `nt` tokens (fixed per graph).
pub fn nsplit_for(nt: usize) -> usize {
    (512 / nt.max(1)).clamp(16, 128)
}

impl Gpu {
    /// Random valid quant blocks (see `shared::model::synthetic::fill_random_blocks`), or
    /// uniform f32 in [lo, hi) for F32; f16/bf16 uniform for those.
    pub fn fill_synthetic(&self, p: u64, ty: GgmlType, n_elems: usize, seed: u64, lo: f32, hi: f32) -> Result<(), CudaError> {
        let g = |n: usize| (ceil_div(n, 256), 1, 1);
        match ty {
            GgmlType::F32 => self.launch("fill_f32", g(n_elems), 256, 0, &[Arg::P(p), Arg::L(n_elems as i64), Arg::L(seed as i64), Arg::F(lo), Arg::F(hi)]),
            GgmlType::F16 | GgmlType::BF16 => self.launch(
                "fill_h16",
                g(n_elems),
                256,
                0,
                &[Arg::P(p), Arg::L(n_elems as i64), Arg::L(seed as i64), Arg::F(lo), Arg::F(hi), Arg::I((ty == GgmlType::BF16) as i32)],
            ),
            _ => {
                let bb = ty.block_bytes();
                if bb % 2 != 0 {
                    return Err(CudaError::Unsupported { ty, what: "synthetic fill (odd block size)".into() });
                }
                let nb = n_elems / ty.block_elems();
                // (first f16 field, second, negate second, range): as fill_random_blocks.
                let r1 = kquant_min_ratio(ty);
                let (o0, o1, neg, lo, hi) = match ty {
                    GgmlType::Q8_0 => (0, -1, 0, 1e-4, 4e-4),
                    GgmlType::Q4_0 | GgmlType::Q5_0 => (0, -1, 0, 1e-3, 3e-3),
                    GgmlType::IQ4_NL => (0, -1, 0, 1e-4, 3e-4),
                    GgmlType::IQ4_XS => (0, -1, 0, 4e-6, 1.2e-5),
                    GgmlType::Q4_1 | GgmlType::Q5_1 => (0, 2, 1, 2e-3, 6e-3),
                    GgmlType::Q2_K => (80, 82, 0, 1e-3, 3e-3),
                    GgmlType::Q3_K => (108, -1, 0, 1e-4, 4e-4),
                    GgmlType::Q4_K | GgmlType::Q5_K => (0, 2, 0, 2e-5, 8e-5),
                    GgmlType::Q6_K => (208, -1, 0, 2e-5, 6e-5),
                    _ => return Err(CudaError::Unsupported { ty, what: "synthetic fill".into() }),
                };
                self.launch(
                    "fill_quant",
                    g(nb),
                    256,
                    0,
                    &[Arg::P(p), Arg::L(nb as i64), Arg::I(bb as i32), Arg::L(seed as i64), Arg::I(o0), Arg::I(o1), Arg::I(neg), Arg::F(lo), Arg::F(hi), Arg::I(0), Arg::F(r1)],
                )
            }
        }
    }

    /// Optional RMSNorm (`w != 0`), optional f32 copy (`y != 0`), q8 quantization of `nrows`
    /// rows of width `n` (multiple of 32) into `q` ([row][n] int8) and `d` ([row][n/32] f32).
    #[allow(clippy::too_many_arguments)]
    pub fn norm_q8(&self, x: u64, xs: usize, w: u64, n: usize, eps: f32, y: u64, ys: usize, q: u64, d: u64, nrows: usize) -> Result<(), CudaError> {
        if n % 32 != 0 || n > NQ_MAXV * 1024 {
            return Err(CudaError::Shape(format!("norm_q8: width {n} is not a multiple of 32 or above {}", NQ_MAXV * 1024)));
        }
        self.launch_pdl(
            if pdl_part(PDL_NORM_EARLY) { "norm_q8e" } else { "norm_q8" },
            (nrows as u32, 1, 1),
            1024,
            0,
            &[Arg::P(x), Arg::L(xs as i64), Arg::P(w), Arg::I(n as i32), Arg::F(eps), Arg::P(y), Arg::L(ys as i64), Arg::P(q), Arg::P(d)],
        )
    }

    /// Router logits `y[t] = W x[t]` for an F32 matrix (rows of `cols % 4 == 0` floats,
    /// 16-byte aligned), `nt` tokens, `x` of stride `xs`, `y` of stride `ys` (floats).
    #[allow(clippy::too_many_arguments)]
    pub fn router_f32(&self, w: &DevMat, x: u64, xs: usize, y: u64, ys: usize, nt: usize) -> Result<(), CudaError> {
        if !fast_router(w) || xs % 4 != 0 || x % 16 != 0 {
            return Err(CudaError::Shape(format!("router_f32: {:?} {}x{}", w.ty, w.rows, w.cols)));
        }
        self.launch_pdl(
            "router_f32",
            (ceil_div(w.rows, 4), nt as u32, 1),
            128,
            0,
            &[Arg::P(w.ptr), Arg::I(w.rows as i32), Arg::I(w.cols as i32), Arg::P(x), Arg::L(xs as i64), Arg::P(y), Arg::L(ys as i64)],
        )
    }

    /// The `mvx_q8_0` launch of a Q8_0 product of `rows` rows over `nchunks` chunks for `nv`
    /// tokens, or `None` where it does not apply (off, over 32 or below 2 tokens, activations
    /// not 16-byte aligned or not a multiple of 128 wide, no K split that fits the card's
    /// shared memory and the scratch). K parts: the fewest that fit; ring: 6 buffers a warp
    /// where they fit, else 4. Blocks: one an SM over the parts, no more than the 8-row tasks
    /// need.
    pub fn mvx_plan(&self, nchunks: usize, ncol: usize, nv: usize, rows: usize, xq: u64, xd: u64) -> Option<MvxPlan> {
        if !mvx_on() || !(2..=32).contains(&nv) || ncol % 128 != 0 || xq % 16 != 0 || xd % 16 != 0 || nchunks == 0 || self.arch < 90 {
            return None;
        }
        let mt = nv.div_ceil(16);
        let optin = self.smem_optin();
        let ntask = rows.div_ceil(8);
        let scratch_ok = |parts: usize| parts == 1 || (parts * nv * rows <= MVX_PART_CAP && ntask <= MVX_CNT_CAP);
        for ks in 1..=8usize {
            if nchunks % ks != 0 || !scratch_ok(ks) {
                continue;
            }
            let kcols = nchunks / ks * 256;
            let Some(nb) = [6usize, 4].into_iter().find(|&nb| mvx_smem(mt, kcols, nb, 1) <= optin) else { continue };
            let bx = (self.sm_count() / ks).max(1);
            // Two warp groups on column halves (the partial sums then go through the scratch):
            // opt-in only, slower everywhere measured (session 14: batch 32 35.31 against 35.10
            // ms a step with one group).
            let two = (nchunks / ks) % 2 == 0 && scratch_ok(2 * ks) && mvx_smem(mt, kcols, 3, 2) <= optin;
            let kw = if mvx_kw_forced() == 2 && two { 2 } else { 1 };
            let nb = if kw == 2 { 3 } else { nb };
            let bx = bx.min(ntask.div_ceil(8));
            return Some(MvxPlan { name: format!("mvx_q8_0_{mt}_{nb}_{kw}"), grid: (bx as u32, ks as u32, 1), ks, kw, smem: mvx_smem(mt, kcols, nb, kw) });
        }
        None
    }

    /// `y_s[v] (+)= W_s x_q[v]` for up to three matrices `segs` = (W, y, y stride) sharing one
    /// q8 input of `ncol` columns, `nv` vectors.
    pub fn matvec_q8(&self, segs: &[(&DevMat, u64, usize)], xq: u64, xd: u64, ncol: usize, nv: usize, accumulate: bool) -> Result<(), CudaError> {
        self.matvec_q8_with(MvqKind::from_env(), segs, xq, xd, ncol, nv, accumulate)
    }

    /// Whether [`Gpu::matvec_q8_x8`] takes these matrices on `ncol` input columns: Q8_0 rows
    /// of at most 12 chunks (`mvqs_q8_0_1s2p8`), `ncol` a multiple of 8.
    pub fn x8_fits(segs: &[(&DevMat, u64, usize)], ncol: usize) -> bool {
        !segs.is_empty() && segs.len() <= 3 && ncol % 8 == 0 && segs.iter().all(|(w, _, _)| w.ty == GgmlType::Q8_0 && fast_mat(w) && w.cols == ncol && w.row_bytes / CH <= 12)
    }

    /// `y_s = W_s rmsnorm(h)` for one token from the x8 hand-over of the streamed down
    /// ([`super::stream::NextNorm::ss8`]): `xq` codes and `xd` scales of `u = h * weight` (one
    /// per 8 columns), `ss8` the groups' sums of `h^2`, `eps` the norm's. Errors when
    /// [`Gpu::x8_fits`] says no.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q8_x8(&self, segs: &[(&DevMat, u64, usize)], xq: u64, xd: u64, ss8: u64, eps: f32, ncol: usize) -> Result<(), CudaError> {
        if !Self::x8_fits(segs, ncol) {
            let d: Vec<String> = segs.iter().map(|(w, _, _)| format!("{:?} {}x{}", w.ty, w.rows, w.cols)).collect();
            return Err(CudaError::Shape(format!("matvec_q8_x8: {} (input {ncol}; Q8_0 rows of at most 12 chunks, 1 to 3 matrices)", d.join(", "))));
        }
        let (mut args, rows) = mv_args(segs, segs[0].0.row_bytes / CH, xq, xd, ncol, 1, false);
        args.extend([Arg::P(ss8), Arg::F(eps)]);
        self.launch_pdl("mvqs_q8_0_1s2p8", (ceil_div(rows, 8), 1, 1), 128, 0, &args)
    }

    /// [`Gpu::matvec_q8`] with an explicit kernel choice (tests and A/B runs).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q8_with(&self, kind: MvqKind, segs: &[(&DevMat, u64, usize)], xq: u64, xd: u64, ncol: usize, nv: usize, accumulate: bool) -> Result<(), CudaError> {
        if segs.is_empty() || segs.len() > 3 {
            return Err(CudaError::Shape(format!("matvec_q8: {} matrices (1 to 3)", segs.len())));
        }
        let w0 = segs[0].0;
        let ty = w0.ty;
        for (w, _, _) in segs {
            if !fast_mat(w) || w.ty != ty || w.cols != ncol {
                return Err(CudaError::Shape(format!("matvec_q8: {:?} {}x{} (input {ncol})", w.ty, w.rows, w.cols)));
            }
        }
        let nchunks = w0.row_bytes / CH;
        let nt = if nv == 1 {
            1
        } else if nv <= 4 {
            4
        } else {
            8
        };
        let (args, rows) = mv_args(segs, nchunks, xq, xd, ncol, nv, accumulate);
        let mma = ty == GgmlType::Q8_0 && (kind == MvqKind::Mma || (kind == MvqKind::Auto && nv >= MMA_MIN_TOKENS));
        if mma {
            if let Some(plan) = self.mvx_plan(nchunks, ncol, nv, rows, xq, xd) {
                let mut args = args;
                args.extend([Arg::I(plan.ks as i32), Arg::P(self.ptr(&self.mvx_scratch.0)), Arg::P(self.ptr(&self.mvx_scratch.1))]);
                return self.launch_pdl(&plan.name, plan.grid, 256 * plan.kw as u32, plan.smem as u32, &args);
            }
            let grid = (ceil_div(rows, 16), ceil_div(nv, 32), 1);
            let (stem, threads, smem) = mvmma_kind((grid.0 * grid.1) as usize, nchunks, self.sm_count(), self.smem_optin()).launch();
            let name = if pdl_part(PDL_MMA) { format!("{stem}p") } else { stem.to_string() };
            return self.launch_pdl(&name, grid, threads, smem as u32, &args);
        }
        let (name, warps) = match kind {
            _ if ty != GgmlType::Q8_0 => (format!("mvq_{}_{nt}", tn(ty)), 8),
            MvqKind::Staged => (format!("mvq_q8_0_{nt}"), 8),
            MvqKind::WholeShort => (format!("mvqs_q8_0_{nt}s"), 8),
            // Whole, and Auto below MMA_MIN_TOKENS (Mma returned above).
            _ if nchunks > 12 => (format!("mvqs_q8_0_{nt}l"), 4),
            _ => (format!("mvqs_q8_0_{nt}s"), 8),
        };
        // mvqs_*p: the weight copies start before the wait for the previous kernel; s2p: 2 rows
        // per warp of 4 (rows of up to 12 chunks, 1 to 4 vectors).
        if name.starts_with("mvqs") && nchunks <= 12 && nt <= 4 && pdl_part(PDL_MVQS2) {
            return self.launch_pdl(&format!("mvqs_q8_0_{nt}s2p"), (ceil_div(rows, 8), ceil_div(nv, nt), 1), 128, 0, &args);
        }
        let name = if name.starts_with("mvqs") && pdl_part(PDL_MVQS) { name + "p" } else { name };
        self.launch_pdl(&name, (ceil_div(rows, warps), ceil_div(nv, nt), 1), 32 * warps as u32, 0, &args)
    }

    /// The RoPE table of a step's `nt` tokens (`rope_table`: cos then sin of each token's
    /// `rot / 2` angles, 128 floats a token in `rope`), launched once a step for
    /// [`Gpu::attn_decode_normed`].
    pub fn rope_table(&self, pos: u64, nt: usize, rot: usize, theta: f32, rope: u64) -> Result<(), CudaError> {
        if rot == 0 || rot > 128 || rot % 2 != 0 {
            return Err(CudaError::Shape(format!("rope_table: {rot} rotary dims (even, at most 128)")));
        }
        self.launch_pdl("rope_table", (nt as u32, 1, 1), 64, 0, &[Arg::P(pos), Arg::I(rot as i32), Arg::F(theta), Arg::P(rope)])
    }

    /// Whether `attn_dec6tn_*` takes rows of `qw` / `kw` values with `rot` rotary dims a head
    /// on this card (its row limits, [`Gpu::rope_table`]'s angles, and its shared memory beside
    /// the K/V ring: [`QK_FUSE_SMEM`]).
    pub fn qk_fuse_fits(&self, rot: usize, qw: usize, kw: usize) -> bool {
        rot > 0 && rot <= 128 && rot % 2 == 0 && qw <= QK_FUSE_MAX_Q && kw <= QK_FUSE_MAX_K && self.smem_optin() >= attn_tn_smem(self.arch) + QK_FUSE_SMEM
    }

    /// Decode attention of a one-token step with the q / k norms, RoPE and the KV store done by
    /// its blocks (`attn_dec6tn_*`, `attn_dec6tnm_*` with `cnt`): the arguments of
    /// [`Gpu::attn_decode`] (its `q` unused) plus `qk` (the q/k/v product's raw rows).
    /// Tensor-core kernel, head dim 128, GQA 6, what [`Gpu::qk_fuse_fits`] takes; the caller
    /// checks [`attn_mma`].
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode_normed(&self, kv: &str, qk: &QkNormIn, kc: u64, vc: u64, meta: (u64, u64, u64, u64), page_size: usize, kv_heads: usize, nsplit: usize, scale: f32, part: u64, out: u64, os: usize, aq: u64, ad: u64, cnt: Option<u64>) -> Result<(), CudaError> {
        if kv != "f16" && kv != "bf16" {
            return Err(CudaError::Shape(format!("attention: KV cache type {kv} (f16 or bf16)")));
        }
        if page_size == 0 || nsplit == 0 || nsplit > u16::MAX as usize || kv_heads == 0 || qk.qw != kv_heads * GQA * 128 || qk.kw != kv_heads * 128 || !self.qk_fuse_fits(qk.rot, qk.qw, qk.kw) {
            return Err(CudaError::Shape(format!(
                "normed attention: page size {page_size}, {nsplit} splits, {kv_heads} KV heads, rot {}, q {} / k {} wide, {} bytes of shared memory a block ({} needed)",
                qk.rot,
                qk.qw,
                qk.kw,
                self.smem_optin(),
                attn_tn_smem(self.arch) + QK_FUSE_SMEM
            )));
        }
        let ns = self.attn_splits(true, kv_heads, nsplit, 1)?;
        let (pos, seq, ptoff, pts) = meta;
        let mut args = vec![
            Arg::P(qk.q),
            Arg::P(qk.k),
            Arg::P(qk.v),
            Arg::P(qk.q_norm),
            Arg::P(qk.k_norm),
            Arg::P(qk.rope),
            Arg::I(qk.qw as i32),
            Arg::I(qk.kw as i32),
            Arg::I(qk.rot as i32),
            Arg::F(qk.eps),
            Arg::P(qk.slots),
            Arg::P(kc),
            Arg::P(vc),
            Arg::P(pos),
            Arg::P(seq),
            Arg::P(ptoff),
            Arg::P(pts),
            Arg::I(page_size as i32),
            Arg::I(kv_heads as i32),
            Arg::I(ns as i32),
            Arg::F(scale),
            Arg::P(part),
            Arg::I(qk_pre_tiles() as i32),
            Arg::I(attn_exit_empty() as i32),
        ];
        let grid = (kv_heads as u32, ns as u32, 1);
        match cnt {
            Some(c) => {
                if ns > ATTN_FUSE_MAX_SPLIT {
                    return Err(CudaError::Shape(format!("attn_dec6tnm_{kv}: {ns} splits (at most {ATTN_FUSE_MAX_SPLIT})")));
                }
                args.extend([Arg::P(c), Arg::P(out), Arg::L(os as i64), Arg::P(aq), Arg::P(ad)]);
                self.launch_pdl(&format!("attn_dec6tnm_{kv}"), grid, 128, attn_tn_smem(self.arch) as u32, &args)
            }
            None => {
                self.launch_pdl(&format!("attn_dec6tn_{kv}"), grid, 128, attn_tn_smem(self.arch) as u32, &args)?;
                let merge = if pdl_part(PDL_MERGE_EARLY) || qk_merge_early() { "attn_merge6e" } else { "attn_merge6" };
                self.launch_pdl(merge, ((kv_heads * GQA) as u32, 1, 1), 128, 0, &[Arg::P(part), Arg::I(kv_heads as i32), Arg::I(ns as i32), Arg::P(out), Arg::L(os as i64), Arg::P(aq), Arg::P(ad), Arg::P(pos)])
            }
        }
    }

    /// Router product and top-k in one launch (`router_topk_f32`): the logits of
    /// [`Gpu::router_f32`] into `y`, and ids / weights bit-identical to [`Gpu::route`] on
    /// them. `cnt`: `nt` u32 arrival counters, zero before the first launch (left zero).
    #[allow(clippy::too_many_arguments)]
    pub fn router_topk_f32(&self, w: &DevMat, x: u64, xs: usize, y: u64, ys: usize, bias: u64, k: usize, gating: minimax_shared::model::GatingFunc, ids: u64, wts: u64, cnt: u64, nt: usize) -> Result<(), CudaError> {
        if !fast_router(w) || xs % 4 != 0 || x % 16 != 0 || w.rows > ROUTE_FAST_MAX_E || k > 32 || k > w.rows || k == 0 {
            return Err(CudaError::Shape(format!("router_topk_f32: {:?} {}x{}, top-{k}", w.ty, w.rows, w.cols)));
        }
        let g = gating_code(gating);
        // Several tokens: router_topk_f32t4 (a weight row's round read once for 4 tokens; its
        // arguments: router_topk_f32's with the token count after x's stride).
        let t4 = nt >= router_t4_min();
        let mut args = vec![Arg::P(w.ptr), Arg::I(w.rows as i32), Arg::I(w.cols as i32), Arg::P(x), Arg::L(xs as i64)];
        if t4 {
            args.push(Arg::I(nt as i32));
        }
        args.extend([Arg::P(y), Arg::L(ys as i64), Arg::P(bias), Arg::I(k as i32), Arg::I(g), Arg::P(ids), Arg::P(wts), Arg::P(cnt)]);
        if t4 {
            return self.launch_pdl("router_topk_f32t4", (ceil_div(w.rows, 4), ceil_div(nt, 4), 1), 128, 0, &args);
        }
        // router_topk_f32x: the whole row in flight at once, x staged in shared memory.
        if router_x() && w.cols <= ROUTER_X_MAX_COLS {
            return self.launch_pdl("router_topk_f32x", (ceil_div(w.rows, 4), nt as u32, 1), 128, (4 * w.cols) as u32, &args);
        }
        // router_topk_f32p: the weight row in registers before the wait (rows of <= 3072).
        let pre = pdl_part(PDL_ROUTER) && w.cols <= ROUTER_PRE_MAX_COLS;
        self.launch_pdl(if pre { "router_topk_f32p" } else { "router_topk_f32" }, (ceil_div(w.rows, 4), nt as u32, 1), 128, 0, &args)
    }

    /// `norm_q8` of `x` (weight `nw`, into `xq` / `xd`) and [`Gpu::router_topk_f32`] on its
    /// output without a norm launch (`router_topk_f32n`, [`router_normless`]): the same ids and
    /// weights up to f32 rounding of the logits. `ss`: `nt * cols / 32` floats of scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn router_topk_f32n(&self, w: &DevMat, x: u64, xs: usize, nw: u64, eps: f32, y: u64, ys: usize, bias: u64, k: usize, gating: minimax_shared::model::GatingFunc, ids: u64, wts: u64, cnt: u64, xq: u64, xd: u64, ss: u64, nt: usize) -> Result<(), CudaError> {
        self.router_f32n_any(true, w, x, xs, nw, eps, y, ys, bias, k, gating, ids, wts, cnt, xq, xd, ss, nt)
    }

    /// [`Gpu::router_topk_f32n`] without its arrival, scale and top-k (`router_f32n`): `y` keeps
    /// the raw logits, `xd` the unscaled q8 scales, `ss` the group sums of squares, for a
    /// streamed gate/up that routes itself ([`Gpu::moe_gate_up_stream_routed`], which must come
    /// next). One token.
    #[allow(clippy::too_many_arguments)]
    pub fn router_f32n(&self, w: &DevMat, x: u64, nw: u64, eps: f32, y: u64, bias: u64, k: usize, gating: minimax_shared::model::GatingFunc, xq: u64, xd: u64, ss: u64) -> Result<(), CudaError> {
        self.router_f32n_any(false, w, x, w.cols, nw, eps, y, w.rows, bias, k, gating, 0, 0, 0, xq, xd, ss, 1)
    }

    /// `tail`: with the arrival and top-k (`router_topk_f32n`, in blocks of 16 warps
    /// `router_topk_f32n16`), or without (`router_f32n`, 8 warps a block at most).
    #[allow(clippy::too_many_arguments)]
    fn router_f32n_any(&self, tail: bool, w: &DevMat, x: u64, xs: usize, nw: u64, eps: f32, y: u64, ys: usize, bias: u64, k: usize, gating: minimax_shared::model::GatingFunc, ids: u64, wts: u64, cnt: u64, xq: u64, xd: u64, ss: u64, nt: usize) -> Result<(), CudaError> {
        let (name, wpb) = match (tail, router_f32n_warps()) {
            (false, wp) => ("router_f32n", wp.min(8)),
            (true, 16) => ("router_topk_f32n16", 16),
            (true, wp) => ("router_topk_f32n", wp),
        };
        if !normless_fits(w, nw) || xs % 4 != 0 || x % 16 != 0 || w.rows > ROUTE_FAST_MAX_E || k > 32 || k > w.rows || k == 0 {
            return Err(CudaError::Shape(format!("{name}: {:?} {}x{}, top-{k}", w.ty, w.rows, w.cols)));
        }
        let g = gating_code(gating);
        let mut args = norm_router_args(w, x, xs, nw, eps, y, ys, bias, k, g, ids, wts, cnt, xq, xd);
        args.extend([Arg::P(ss), Arg::I(router_prefetch() as i32)]);
        self.launch_pdl(name, (ceil_div(w.rows, wpb as usize), nt as u32, 1), 32 * wpb, (4 * w.cols) as u32, &args)
    }

    /// `norm_q8` of `x` (weight `nw`, into `xq` / `xd`) and [`Gpu::router_topk_f32`] on its
    /// output in one launch (`router_topk_norm_f32`): the same q8, logits, ids and weights, bit
    /// for bit, one kernel boundary fewer. Rows of `w.cols` % 128 == 0 and at most
    /// [`FUSED_NORM_MAX`]; `x` rows `xs` apart.
    #[allow(clippy::too_many_arguments)]
    pub fn router_topk_norm_f32(&self, w: &DevMat, x: u64, xs: usize, nw: u64, eps: f32, y: u64, ys: usize, bias: u64, k: usize, gating: minimax_shared::model::GatingFunc, ids: u64, wts: u64, cnt: u64, xq: u64, xd: u64, nt: usize) -> Result<(), CudaError> {
        if !fast_router(w) || w.cols % 128 != 0 || w.cols > FUSED_NORM_MAX || w.rows > ROUTE_FAST_MAX_E || k > 32 || k > w.rows || k == 0 {
            return Err(CudaError::Shape(format!("router_topk_norm_f32: {:?} {}x{}, top-{k}", w.ty, w.rows, w.cols)));
        }
        let g = gating_code(gating);
        let args = norm_router_args(w, x, xs, nw, eps, y, ys, bias, k, g, ids, wts, cnt, xq, xd);
        self.launch_pdl("router_topk_norm_f32", (ceil_div(w.rows, 4), nt as u32, 1), 128, (4 * w.cols) as u32, &args)
    }

    /// Router top-k with PDL (`moe_route_fast`, bit-identical to [`Gpu::route`]): up to
    /// [`ROUTE_FAST_MAX_E`] experts, top-k of at most 32.
    #[allow(clippy::too_many_arguments)]
    pub fn route_fast(&self, logits: u64, bias: u64, e: usize, k: usize, gating: minimax_shared::model::GatingFunc, ids: u64, w: u64, nt: usize) -> Result<(), CudaError> {
        if e > ROUTE_FAST_MAX_E || k > 32 || k > e || k == 0 {
            return Err(CudaError::Shape(format!("moe_route_fast: top-{k} of {e} experts (at most {ROUTE_FAST_MAX_E} experts, k <= 32)")));
        }
        let g = gating_code(gating);
        self.launch_pdl(
            "moe_route_fast",
            (nt as u32, 1, 1),
            32,
            0,
            &[Arg::P(logits), Arg::P(bias), Arg::I(e as i32), Arg::I(k as i32), Arg::I(g), Arg::P(ids), Arg::P(w)],
        )
    }

    /// Fused expert gate/up: for each of `npairs` (token p / k, expert ids[p]) pairs, the
    /// `silu(gate x) * (up x)` activations quantized to q8 (`aq` [p][ff], `ad` [p][ff/32]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_q8(&self, gate: &DevMat, up: &DevMat, ids: u64, k: usize, xq: u64, xd: u64, aq: u64, ad: u64, npairs: usize) -> Result<(), CudaError> {
        self.moe_gate_up_q8_ld(gate, up, ids, k, xq, xd, aq, ad, npairs, gate.rows)
    }

    /// [`Gpu::moe_gate_up_q8`] with the activations `ld` apart per pair (`ld >= gate.rows`,
    /// multiple of 32): tensor parallelism pads a rank's expert slice to whole down-kernel
    /// chunks; the pad columns are never written and stay zero.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_q8_ld(&self, gate: &DevMat, up: &DevMat, ids: u64, k: usize, xq: u64, xd: u64, aq: u64, ad: u64, npairs: usize, ld: usize) -> Result<(), CudaError> {
        if ld < gate.rows || ld % 32 != 0 {
            return Err(CudaError::Shape(format!("moe_gate_up_q8: activation stride {ld} for {} rows", gate.rows)));
        }
        if !fast_mat(gate) || !fast_mat(up) || gate.ty != up.ty || gate.row_bytes != up.row_bytes || gate.rows % 32 != 0 {
            return Err(CudaError::Shape("moe_gate_up_q8: expert tensors".into()));
        }
        if super::stream::stream_on() && self.try_gate_up_stream(gate, up, ids, k, npairs, xq, xd, aq, ad, ld)? {
            return Ok(());
        }
        self.moe_gate_up_q8_with(GateUpKind::from_env(), gate, up, ids, k, xq, xd, aq, ad, npairs, ld)
    }

    /// [`Gpu::moe_gate_up_q8_ld`] with an explicit kernel choice (tests and A/B runs); the
    /// register-direct and persistent kinds apply to IQ4_XS (else the staged kernel runs), the
    /// persistent one to inputs of at most 3072 columns (else `Reg(2, true)`).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_q8_with(&self, kind: GateUpKind, gate: &DevMat, up: &DevMat, ids: u64, k: usize, xq: u64, xd: u64, aq: u64, ad: u64, npairs: usize, ld: usize) -> Result<(), CudaError> {
        if ld < gate.rows || ld % 32 != 0 {
            return Err(CudaError::Shape(format!("moe_gate_up_q8: activation stride {ld} for {} rows", gate.rows)));
        }
        if !fast_mat(gate) || !fast_mat(up) || gate.ty != up.ty || gate.row_bytes != up.row_bytes || gate.rows % 32 != 0 {
            return Err(CudaError::Shape("moe_gate_up_q8: expert tensors".into()));
        }
        let iq4 = gate.ty == GgmlType::IQ4_XS;
        let kind = match kind {
            GateUpKind::Persist | GateUpKind::PersistIl | GateUpKind::PersistSm if iq4 && gate.cols / 32 > PST_GU_UNITS => GateUpKind::Reg(2, true),
            _ if !iq4 => GateUpKind::Staged,
            kd => kd,
        };
        let mut args = gate_up_args(gate, up, &[Arg::I((gate.row_bytes / CH) as i32), Arg::P(ids), Arg::I(k as i32)], xq, xd, aq, ad, ld);
        let (name, threads, grid) = match kind {
            GateUpKind::Persist | GateUpKind::PersistIl | GateUpKind::PersistSm => {
                let name = match kind {
                    GateUpKind::Persist => "moe_gate_up_pst_iq4_xs",
                    GateUpKind::PersistIl => "moe_gate_up_psx_iq4_xs",
                    _ => "moe_gate_up_psy_iq4_xs",
                }
                .to_string();
                let tasks = npairs * (gate.rows / 32);
                args.extend([Arg::I(npairs as i32), Arg::I(gate.rows as i32)]);
                let g = self.resident_blocks(&name, 512)?.min(tasks);
                (name, 512, (g as u32, 1, 1))
            }
            GateUpKind::Reg(rows, pf) => (format!("moe_gate_up_reg{}{}_iq4_xs", if rows == 4 { 4 } else { 2 }, if pf { "" } else { "n" }), 32 * 32 / if rows == 4 { 4 } else { 2 }, ((gate.rows / 32) as u32, npairs as u32, 1)),
            GateUpKind::Staged => (format!("moe_gate_up{}_{}", match self.gu_rows { 1 => "1", 2 => "2", _ => "" }, tn(gate.ty)), 32 * 32 / self.gu_rows, ((gate.rows / 32) as u32, npairs as u32, 1)),
        };
        self.launch_pdl(&name, grid, threads as u32, 0, &args)
    }

    /// Blocks of kernel `name` (block `threads`) the whole device holds at once: SMs x the
    /// occupancy calculator's blocks per SM (at least 1). Cached per device and kernel.
    pub fn resident_blocks(&self, name: &str, threads: u32) -> Result<usize, CudaError> {
        static CACHE: std::sync::Mutex<Option<HashMap<(usize, String), usize>>> = std::sync::Mutex::new(None);
        let key = (self.ctx.ordinal(), name.to_string());
        if let Some(&v) = CACHE.lock().unwrap().get_or_insert_with(HashMap::new).get(&key) {
            return Ok(v);
        }
        let sms = self.sm_count();
        let per_sm = self.func(name)?.occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)?.max(1) as usize;
        let v = sms * per_sm;
        CACHE.lock().unwrap().get_or_insert_with(HashMap::new).insert(key, v);
        Ok(v)
    }

    /// Groups the `npairs` (token, expert) pairs of `ids` by expert into `grp` (i32, at least
    /// `1 + 3 e + npairs`; layout in kernels/fast.cu `moe_group`).
    pub fn moe_group(&self, ids: u64, npairs: usize, e: usize, grp: u64) -> Result<(), CudaError> {
        if e > GRP_MAX_E || npairs == 0 {
            return Err(CudaError::Shape(format!("moe_group: {npairs} pairs over {e} experts (at most {GRP_MAX_E})")));
        }
        self.launch_pdl("moe_group", (1, 1, 1), 256, 0, &[Arg::P(ids), Arg::I(npairs as i32), Arg::I(e as i32), Arg::P(grp)])
    }

    /// Grouped gate/up/SiLU → q8 over the slots of `grp` (see [`Gpu::moe_group`]): same
    /// outputs as [`Gpu::moe_gate_up_q8_ld`], each chosen expert read once for all its tokens.
    /// `nslots` = the grid's slots (`min(npairs, experts)`; unused slots exit).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_grp(&self, gate: &DevMat, up: &DevMat, grp: u64, e: usize, nslots: usize, k: usize, xq: u64, xd: u64, aq: u64, ad: u64, ld: usize) -> Result<(), CudaError> {
        if ld < gate.rows || ld % 32 != 0 || gate.ty != GgmlType::IQ4_XS || !fast_mat(gate) || !fast_mat(up) || gate.ty != up.ty || gate.row_bytes != up.row_bytes || gate.rows % 32 != 0 || gate.cols % 256 != 0 {
            return Err(CudaError::Shape(format!("moe_gate_up_grp: {:?} {}x{} (ld {ld})", gate.ty, gate.rows, gate.cols)));
        }
        if super::gstream::gstream_on() && self.try_gate_up_gstream(gate, up, grp, e, k, xq, xd, aq, ad, ld)? {
            return Ok(());
        }
        let (sfx, _) = grp_kind().kernels();
        self.launch_pdl(
            &format!("moe_gate_up_{sfx}_iq4_xs"),
            ((gate.rows / 32) as u32, nslots as u32, 1),
            256,
            0,
            &gate_up_args(gate, up, &[Arg::P(grp), Arg::I(e as i32), Arg::I(k as i32)], xq, xd, aq, ad, ld),
        )
    }

    /// Grouped down products: `dpart[p][r] = down[expert of p] row r . act[p]` for every pair
    /// of `grp` (f32 `[npairs][down.rows]`); [`Gpu::moe_combine_grp`] adds them to the residual.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_grp(&self, down: &DevMat, grp: u64, e: usize, nslots: usize, aq: u64, ad: u64, dpart: u64) -> Result<(), CudaError> {
        self.moe_down_grp_with(grp_mma(), down, grp, e, nslots, aq, ad, dpart)
    }

    /// [`Gpu::moe_down_grp`] with the kernel given: `mma` = `moe_down_grpm_iq4_xs` (tensor
    /// cores, opt-in), else the grouped streamed kernel where it fits and is on
    /// ([`super::gstream::gstream_on`]), else the dp4a kernel of [`grp_kind`] (tests and A/B runs).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_grp_with(&self, mma: bool, down: &DevMat, grp: u64, e: usize, nslots: usize, aq: u64, ad: u64, dpart: u64) -> Result<(), CudaError> {
        self.moe_down_grp_at(mma, false, down, grp, e, nslots, aq, ad, dpart)
    }

    /// [`Gpu::moe_down_grp_with`]; `after_gate_up`: the kernel launched right before this one
    /// is the step's grouped gate/up (the forward), so the streamed down may start its weight
    /// stream before the PDL wait ([`Gpu::moe_down_gstream`]'s `early`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_down_grp_at(&self, mma: bool, after_gate_up: bool, down: &DevMat, grp: u64, e: usize, nslots: usize, aq: u64, ad: u64, dpart: u64) -> Result<(), CudaError> {
        if down.ty != GgmlType::IQ4_XS || !fast_mat(down) || down.cols % 256 != 0 {
            return Err(CudaError::Shape(format!("moe_down_grp: {:?} {}x{}", down.ty, down.rows, down.cols)));
        }
        if !mma && super::gstream::gstream_on() && self.try_down_gstream(down, grp, e, aq, ad, dpart, after_gate_up)? {
            return Ok(());
        }
        let (name, rows_per_block, threads) = if mma {
            ("moe_down_grpm_iq4_xs".to_string(), 32, 128)
        } else {
            let (sfx, rows) = grp_kind().kernels();
            (format!("moe_down_{sfx}_iq4_xs"), rows, 256)
        };
        self.launch_pdl(
            &name,
            (ceil_div(down.rows, rows_per_block), nslots as u32, 1),
            threads,
            0,
            &down_args(down, &[Arg::P(grp), Arg::I(e as i32)], aq, ad, &[Arg::P(dpart)]),
        )
    }

    /// `hidden[t][r] += sum_j wts[t k + j] dpart[t k + j][r]` for `nt` tokens of `rows` values.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine_grp(&self, dpart: u64, wts: u64, k: usize, rows: usize, hidden: u64, hs: usize, nt: usize) -> Result<(), CudaError> {
        self.launch_pdl("moe_combine_grp", (ceil_div(rows, 256), nt as u32, 1), 256, 0, &[Arg::P(dpart), Arg::P(wts), Arg::I(k as i32), Arg::I(rows as i32), Arg::P(hidden), Arg::L(hs as i64)])
    }

    /// Split-K decode attention of `nt` tokens over the paged 16-bit cache (`kv` = "f16" or
    /// "bf16"), GQA 6, heads of 128: partials into `part`, merged into `out` (f32, stride `os`)
    /// and its q8 `aq` / `ad` either by `attn_merge6` (`cnt` = None) or by the last split block
    /// of each (token, KV head) (`cnt` = `nt x kv_heads` zero u32, left zero; bit-identical).
    /// `meta` = (pos, seq, page-table offsets, pages). `nsplit` is the most splits `part` holds
    /// per (token, KV head); the kernel ([`attn_mma`]) and the split count actually used are
    /// chosen by [`Gpu::attn_splits`].
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode(&self, kv: &str, q: u64, qs: usize, kc: u64, vc: u64, meta: (u64, u64, u64, u64), page_size: usize, kv_heads: usize, nsplit: usize, scale: f32, part: u64, out: u64, os: usize, aq: u64, ad: u64, cnt: Option<u64>, nt: usize) -> Result<(), CudaError> {
        let mma = attn_mma();
        let ns = self.attn_splits(mma, kv_heads, nsplit, nt)?;
        self.attn_decode_with(mma, kv, q, qs, kc, vc, meta, page_size, kv_heads, ns, scale, part, out, os, aq, ad, cnt, nt)
    }

    /// Split count of decode attention for `nt` tokens, at most `nsplit` (the caller's
    /// [`nsplit_for`], what `part` holds). SIMT kernel: `nsplit`. Tensor-core kernel: one block
    /// per SM (SMs / (KV heads x tokens), at least 1; `MINIMAX_ATTN_SPLITS=N` fixes it): each
    /// block streams a long run of positions through its cp.async ring, and the merge reads
    /// few partials. Measured at 32k (H200, 8 KV heads, one token): 16 splits 2.62 ms of
    /// attention per token, 24: 2.70, 33 (two blocks per SM): 2.76, 8: 3.75, 128: 5.20; at 8k
    /// 12-17 best. Fixed per step size (graphs); short contexts leave the later splits empty.
    pub fn attn_splits(&self, mma: bool, kv_heads: usize, nsplit: usize, nt: usize) -> Result<usize, CudaError> {
        if nsplit == 0 || kv_heads == 0 || nt == 0 {
            return Err(CudaError::Shape(format!("attention: {nsplit} splits, {kv_heads} KV heads, {nt} tokens")));
        }
        if !mma {
            return Ok(nsplit);
        }
        static FIXED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
        if let Some(n) = *FIXED.get_or_init(|| std::env::var("MINIMAX_ATTN_SPLITS").ok().and_then(|v| v.parse().ok()).filter(|&n: &usize| n > 0)) {
            return Ok(n.min(nsplit));
        }
        Ok((self.sm_count() / (kv_heads * nt)).clamp(1, nsplit))
    }

    /// [`Gpu::attn_decode`] with the kernel (`mma`: `attn_dec6t_*` / `attn_dec6tm_*`, else
    /// `attn_dec6_*` / `attn_dec6m_*`) and the split count `nsplit` given (tests and A/B runs;
    /// `part` must hold `nt x kv_heads x nsplit` partials). Both kernels chunk the positions
    /// alike, so `attn_merge6` serves both.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode_with(&self, mma: bool, kv: &str, q: u64, qs: usize, kc: u64, vc: u64, meta: (u64, u64, u64, u64), page_size: usize, kv_heads: usize, nsplit: usize, scale: f32, part: u64, out: u64, os: usize, aq: u64, ad: u64, cnt: Option<u64>, nt: usize) -> Result<(), CudaError> {
        if kv != "f16" && kv != "bf16" {
            return Err(CudaError::Shape(format!("attention: KV cache type {kv} (f16 or bf16)")));
        }
        if page_size == 0 || nsplit == 0 || nsplit > u16::MAX as usize || kv_heads == 0 {
            return Err(CudaError::Shape(format!("attention: page size {page_size}, {nsplit} splits, {kv_heads} KV heads")));
        }
        let (pos, seq, ptoff, pts) = meta;
        let mut args = vec![
            Arg::P(q),
            Arg::L(qs as i64),
            Arg::P(kc),
            Arg::P(vc),
            Arg::P(pos),
            Arg::P(seq),
            Arg::P(ptoff),
            Arg::P(pts),
            Arg::I(page_size as i32),
            Arg::I(kv_heads as i32),
            Arg::I(nsplit as i32),
            Arg::F(scale),
            Arg::P(part),
        ];
        let grid = (kv_heads as u32, nsplit as u32, nt as u32);
        let (name, smem) = match (mma, cnt.is_some()) {
            (true, false) => (format!("attn_dec6t_{kv}"), ATTN_MMA_SMEM as u32),
            (true, true) => (format!("attn_dec6tm_{kv}"), ATTN_MMA_SMEM as u32),
            (false, false) => (format!("attn_dec6_{kv}"), 0),
            (false, true) => (format!("attn_dec6m_{kv}"), 0),
        };
        match cnt {
            Some(c) => {
                if nsplit > ATTN_FUSE_MAX_SPLIT {
                    return Err(CudaError::Shape(format!("{name}: {nsplit} splits (at most {ATTN_FUSE_MAX_SPLIT})")));
                }
                args.extend([Arg::P(c), Arg::P(out), Arg::L(os as i64), Arg::P(aq), Arg::P(ad)]);
                self.launch_pdl(&name, grid, 128, smem, &args)
            }
            None => {
                self.launch_pdl(&name, grid, 128, smem, &args)?;
                let merge = if pdl_part(PDL_MERGE_EARLY) { "attn_merge6e" } else { "attn_merge6" };
                self.launch_pdl(merge, ((kv_heads * GQA) as u32, nt as u32, 1), 128, 0, &[Arg::P(part), Arg::I(kv_heads as i32), Arg::I(nsplit as i32), Arg::P(out), Arg::L(os as i64), Arg::P(aq), Arg::P(ad), Arg::P(pos)])
            }
        }
    }

    /// Fused expert down + weighted combine: `hidden[t] += sum_j w[t,j] down[ids[t,j]] act[t,j]`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_q8(&self, down: &DevMat, ids: u64, wts: u64, k: usize, aq: u64, ad: u64, hidden: u64, hs: usize, nt: usize) -> Result<(), CudaError> {
        if super::stream::stream_on() && self.try_down_stream(down, ids, wts, k, nt, aq, ad, hidden, hs)? {
            return Ok(());
        }
        self.moe_down_q8_with(DownKind::from_env(), down, ids, wts, k, aq, ad, hidden, hs, nt)
    }

    /// [`Gpu::moe_down_q8`] with an explicit kernel choice (tests and A/B runs); the
    /// register-direct kinds apply to IQ4_XS with k <= 32 (else the staged kernel runs).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_q8_with(&self, kind: DownKind, down: &DevMat, ids: u64, wts: u64, k: usize, aq: u64, ad: u64, hidden: u64, hs: usize, nt: usize) -> Result<(), CudaError> {
        if !fast_mat(down) || down.row_bytes / CH > 12 {
            return Err(CudaError::Shape("moe_down_q8: expert tensor".into()));
        }
        let reg = down.ty == GgmlType::IQ4_XS && k <= 32;
        let mut args = down_args(down, &[Arg::I((down.row_bytes / CH) as i32), Arg::P(ids), Arg::P(wts), Arg::I(k as i32)], aq, ad, &[Arg::P(hidden), Arg::L(hs as i64)]);
        let (name, grid) = match Self::down_kind(kind, down, k) {
            DownKind::Persist => {
                args.push(Arg::I(nt as i32));
                let name = "moe_down_pst_iq4_xs";
                let g = self.resident_blocks(name, 256)?.min(nt * down.rows.div_ceil(2));
                (name.to_string(), (g as u32, 1, 1))
            }
            DownKind::Reg4 if reg => ("moe_down_reg4_iq4_xs".to_string(), (ceil_div(down.rows, 2), nt as u32, 1)),
            DownKind::Reg4Pre if reg => ("moe_down_rx4_iq4_xs".to_string(), (ceil_div(down.rows, 2), nt as u32, 1)),
            DownKind::Reg2 if reg => ("moe_down_reg2_iq4_xs".to_string(), (ceil_div(down.rows, 4), nt as u32, 1)),
            _ => (format!("moe_down_{}", tn(down.ty)), (ceil_div(down.rows, 8), nt as u32, 1)),
        };
        self.launch_pdl(&name, grid, 256, 0, &args)
    }

    /// The down kernel that runs for `kind`: `Persist` falls back to `Reg4` when a row's units
    /// (k expert rows of `cols / 32`) exceed one round of the persistent kernel or the type
    /// is not IQ4_XS.
    fn down_kind(kind: DownKind, down: &DevMat, k: usize) -> DownKind {
        match kind {
            DownKind::Persist if down.ty != GgmlType::IQ4_XS || k > 32 || k * (down.cols / 32) > PST_DN_UNITS => DownKind::Reg4,
            kd => kd,
        }
    }
}

/// Per-layer pointers the fast step needs, and the model-level ones.
#[allow(dead_code)]
pub(crate) struct FastLayer {
    pub attn_norm: u64,
    pub wq: DevMat,
    pub wk: DevMat,
    pub wv: DevMat,
    pub wo: DevMat,
    pub q_norm: u64,
    pub k_norm: u64,
    pub ffn_norm: u64,
    pub router: DevMat,
    pub bias: u64,
    pub gate: DevMat,
    pub up: DevMat,
    pub down: DevMat,
    pub kc: u64,
    pub vc: u64,
}

/// Whether the fast path applies to this model (shapes and types), with the reason if not.
pub(crate) fn fast_plan(cfg: &ModelConfig, kv: KvDtype, layers: &[FastLayer], head: &DevMat) -> Result<(), String> {
    if kv == KvDtype::F32 {
        return Err("f32 KV cache".into());
    }
    if cfg.head_dim != 128 || cfg.v_head_dim != 128 || cfg.n_kv_heads == 0 || cfg.n_heads != GQA * cfg.n_kv_heads {
        return Err(format!("attention shape {}x{} heads {}/{} (fast path: 128-dim heads, GQA 6)", cfg.head_dim, cfg.v_head_dim, cfg.n_heads, cfg.n_kv_heads));
    }
    if cfg.hidden % 32 != 0 || cfg.expert_ff % 32 != 0 || cfg.rotary_dim > cfg.head_dim || cfg.rotary_dim > 256 {
        return Err("hidden/expert width".into());
    }
    if cfg.n_heads * cfg.head_dim > QK_MAX_WIDTH || cfg.n_kv_heads * cfg.head_dim > QK_MAX_WIDTH || cfg.hidden > NQ_MAXV * 1024 {
        return Err("q/k or hidden width above the fast kernels' limits".into());
    }
    // K-quant matrices (Q4_K/Q6_K, kernels/fast_kq.cu) unless MINIMAX_FAST_KQ=0.
    let kq = super::fast_kq::kq_enabled();
    let ok = |w: &DevMat| fast_mat(w) || (kq && super::fast_kq::kq_fast_mat(w));
    // A pipeline stage before the last holds no head (rows 0).
    if head.rows > 0 && !ok(head) {
        return Err(format!("output {:?}", head.ty));
    }
    for (i, l) in layers.iter().enumerate() {
        let dense = [&l.wq, &l.wk, &l.wv, &l.wo];
        // q/k/v go through matvec_q8_any: K-quants per type, the others in one launch (one type).
        let qkv_rest: Vec<GgmlType> = [&l.wq, &l.wk, &l.wv].iter().filter(|w| fast_mat(w)).map(|w| w.ty).collect();
        if dense.iter().any(|w| !ok(w)) || qkv_rest.windows(2).any(|p| p[0] != p[1]) {
            return Err(format!("layer {i}: attention types {:?}/{:?}/{:?}/{:?} or shapes", l.wq.ty, l.wk.ty, l.wv.ty, l.wo.ty));
        }
        if !ok(&l.gate) || !ok(&l.up) || !ok(&l.down) || l.gate.ty != l.up.ty || (fast_mat(&l.down) && l.down.row_bytes / CH > 12) {
            return Err(format!("layer {i}: expert types {:?}/{:?}/{:?} or shapes", l.gate.ty, l.up.ty, l.down.ty));
        }
    }
    Ok(())
}

/// Preallocated buffers of the fast path, sized for [`MAX_FAST_TOKENS`] tokens, and the
/// captured graphs (one per step size).
pub(crate) struct FastWs {
    pub hidden: CudaSlice<f32>,
    pub normed: CudaSlice<f32>,
    pub xq: CudaSlice<i8>,
    pub xd: CudaSlice<f32>,
    pub q: CudaSlice<f32>,
    pub k: CudaSlice<f32>,
    pub v: CudaSlice<f32>,
    pub att: CudaSlice<f32>,
    pub rl: CudaSlice<f32>,
    pub ids: CudaSlice<i32>,
    pub wts: CudaSlice<f32>,
    pub aq: CudaSlice<i8>,
    pub ad: CudaSlice<f32>,
    pub part: CudaSlice<f32>,
    /// Tensor parallelism: per-token partial sums of squares of q and k ([t][2]), all-reduced.
    pub ss: CudaSlice<f32>,
    /// The step's RoPE table ([`Gpu::rope_table`]), 128 floats a token.
    pub rope: CudaSlice<f32>,
    /// Arrival counters of `router_topk_f32`, one per token (kept zero between launches).
    pub rcnt: CudaSlice<u32>,
    /// `router_topk_f32n`: per token, each 32-column group's sum of squares.
    pub rss: CudaSlice<f32>,
    /// Arrival counters of `attn_dec6m_*`, one per (token, KV head) (kept zero).
    pub acnt: CudaSlice<u32>,
    /// Arrival counter of the streamed down's fused norm (kept zero).
    pub ncnt: CudaSlice<u32>,
    /// The down's x8 hand-over ([`norm_x8`]): each 8-row group's sum of squares (one token).
    pub ss8: CudaSlice<f32>,
    /// Pairs grouped by expert (`moe_group`): `1 + 3 E + MAX_FAST_TOKENS k` i32.
    pub grp: CudaSlice<i32>,
    /// Grouped down products per pair, `[MAX_FAST_TOKENS k][hidden]` f32.
    pub dpart: CudaSlice<f32>,
    /// Two logits buffers, steps alternating between them: overlapped decode launches step N+1
    /// before step N's rows are read back, and a row the host must reduce itself is read from
    /// N's buffer after that.
    pub logits: [CudaSlice<f32>; 2],
    /// The buffer the last step wrote (`logits[par]`).
    pub par: usize,
    /// The greedy draws of the last step's rows on the device (the sampling merge writes them,
    /// `MAX_FAST_TOKENS` i32), which the next step's embedding reads for device-fed tokens.
    pub picks: CudaSlice<i32>,
    /// [tokens | pos | seq | slots | pt_off] (MAX_FAST_TOKENS each) then page tables.
    pub meta: CudaSlice<i32>,
    pub pts_cap: usize,
    /// Captured steps by (tokens, unsplit short-context attention: [`attn_short`], logits buffer).
    pub graphs: HashMap<(usize, bool, usize), Graph>,
    /// The attention form of the last step run (what [`crate::cuda::CudaModel::replay_fast_step`] replays).
    pub last_short: bool,
}

/// A captured step. CUDA graph objects are not internally synchronized; the model owning them
/// is used by one thread at a time (`&mut self` for capture and replay), so moving it between
/// threads is sound.
pub(crate) struct Graph(pub CudaGraph);
unsafe impl Send for Graph {}
unsafe impl Sync for Graph {}

impl FastWs {
    pub fn new(g: &Gpu, c: &ModelConfig, pts_cap: usize) -> Result<Self, CudaError> {
        let t = MAX_FAST_TOKENS;
        let (qw, kw, vw, ow) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.v_head_dim, c.n_heads * c.v_head_dim);
        let xw = c.hidden.max(ow);
        let max_split_tokens = (1..=t).map(|n| n * nsplit_for(n)).max().unwrap();
        Ok(Self {
            hidden: g.zeros(t * c.hidden)?,
            normed: g.zeros(t * c.hidden)?,
            xq: g.zeros(t * xw)?,
            xd: g.zeros(t * xw / 32)?,
            q: g.zeros(t * qw)?,
            k: g.zeros(t * kw)?,
            v: g.zeros(t * vw)?,
            att: g.zeros(t * ow)?,
            rl: g.zeros(t * c.n_experts)?,
            ids: g.zeros(t * c.n_experts_used)?,
            wts: g.zeros(t * c.n_experts_used)?,
            aq: g.zeros(t * c.n_experts_used * c.expert_ff)?,
            ad: g.zeros(t * c.n_experts_used * c.expert_ff / 32)?,
            part: g.zeros(max_split_tokens * c.n_kv_heads * GQA * (128 + 2))?,
            ss: g.zeros(2 * t)?,
            rope: g.zeros(t * 128)?,
            rcnt: g.zeros(t)?,
            rss: g.zeros(t * c.hidden.div_ceil(32))?,
            acnt: g.zeros(t * c.n_kv_heads.max(1))?,
            ncnt: g.zeros(1)?,
            ss8: g.zeros(c.hidden.div_ceil(8))?,
            grp: g.zeros(1 + 3 * c.n_experts + t * c.n_experts_used)?,
            dpart: g.zeros(t * c.n_experts_used * c.hidden)?,
            logits: [g.zeros(t * c.vocab_size)?, g.zeros(t * c.vocab_size)?],
            par: 0,
            picks: g.zeros(t)?,
            meta: g.zeros(5 * t + pts_cap)?,
            pts_cap,
            graphs: HashMap::new(),
            last_short: false,
        })
    }
}

#[cfg(test)]
mod mvmma_tests {
    use super::*;

    #[test]
    fn mvmma_kind_follows_the_grid() {
        // H200: 132 SMs, 227 KB a block; RTX PRO 6000 Blackwell (sm_120): 99 KB a block.
        let (h200, sm120) = (227 * 1024, 99 * 1024);
        set_mvmma(Some(None));
        assert_eq!(mvmma_kind(512, 12, 132, h200), Mvmma::W4R3, "q/k/v at M2.7 size: 512 blocks fit 4 x 132, not 3 x 132");
        assert_eq!(mvmma_kind(192, 24, 132, h200), Mvmma::W8R3, "the o-projection: few blocks, long rows");
        assert_eq!(mvmma_kind(192, 24, 188, sm120), Mvmma::W4R4, "104 KB does not fit a 99 KB block");
        assert_eq!(mvmma_kind(192, 12, 132, h200), Mvmma::W4R4, "few blocks but short rows");
        assert_eq!(mvmma_kind(12_504, 12, 132, h200), Mvmma::W4R4, "the output head takes many waves either way");
        assert_eq!(mvmma_kind(529, 12, 132, h200), Mvmma::W4R4);
        set_mvmma(Some(Some(Mvmma::W4R3)));
        assert_eq!(mvmma_kind(192, 24, 132, h200), Mvmma::W4R3, "forced");
        set_mvmma(Some(Some(Mvmma::W4R4)));
        assert_eq!(mvmma_kind(512, 12, 132, h200), Mvmma::W4R4, "forced");
        set_mvmma(Some(Some(Mvmma::W8R3)));
        assert_eq!(mvmma_kind(192, 24, 188, sm120), Mvmma::W4R4, "forced but too large for the card");
        set_mvmma(Some(None));
        assert_eq!(Mvmma::W8R3.launch(), ("mvmma8_q8_0", 256, 8 * 3 * 16 * CH));
    }
}
