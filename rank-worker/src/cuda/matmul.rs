//! Prefill on tensor cores: the quantized GEMM (`mm_*` in kernels/quant_matmul.cu) behind
//! [`Gpu::matvec`] for many tokens, and the grouped expert GEMM (`mmg_*`) with its device-side
//! token→expert grouping (`moe_group_*` in kernels/moe.cu), one grouping per MoE layer shared by
//! gate, up and down.

use std::sync::atomic::{AtomicU8, Ordering};

use cudarc::driver::CudaSlice;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use minimax_shared::quant::GgmlType;

use super::error::CudaError;
use super::gpu::{Arg, DevMat, Gpu, mat_args};

/// `Gpu::matvec` uses the GEMM above this many vectors (the matvec kernels below; steps of up
/// to 32 tokens of the big models take the fast decode path anyway).
pub const GEMM_MIN_TOKENS: usize = 32;

/// Weight rows per GEMM block (kernels/quant_matmul.cu `MM_BN`).
const BN: usize = 128;
/// Shared-memory row pitch in bf16 elements (`MM_PITCH`).
const PITCH: usize = 72;
/// Largest dynamic shared memory we ask for: what sm_120 (RTX Blackwell) grants a block.
const MAX_SMEM: usize = 99 * 1024;

/// Precision of the tensor-core products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPrecision {
    /// W and X rounded to bf16 (8 significant bits, ~2e-3 relative per product): fastest.
    Bf16,
    /// W and X split into hi + lo bf16 parts, three MMAs (hi·hi + hi·lo + lo·hi): ~16
    /// significant bits, within ~1e-5 relative of the f32 matvec. The default: router
    /// near-ties of small models re-route under plain bf16.
    Bf16x3,
}

impl GemmPrecision {
    fn passes(self) -> usize {
        match self {
            GemmPrecision::Bf16 => 1,
            GemmPrecision::Bf16x3 => 3,
        }
    }
}

/// 0: not chosen yet (read `MINIMAX_GEMM` on first use), else the passes (1 or 3).
static PRECISION: AtomicU8 = AtomicU8::new(0);

/// The process-wide GEMM precision: `MINIMAX_GEMM=bf16` or `bf16x3` (default), or what
/// [`set_gemm_precision`] set.
pub fn gemm_precision() -> GemmPrecision {
    match PRECISION.load(Ordering::Relaxed) {
        1 => GemmPrecision::Bf16,
        3 => GemmPrecision::Bf16x3,
        _ => {
            let p = match std::env::var("MINIMAX_GEMM").as_deref() {
                Ok("bf16") => GemmPrecision::Bf16,
                _ => GemmPrecision::Bf16x3,
            };
            PRECISION.store(p.passes() as u8, Ordering::Relaxed);
            p
        }
    }
}

/// Sets the GEMM precision for every later product (benchmarks compare both).
pub fn set_gemm_precision(p: GemmPrecision) {
    PRECISION.store(p.passes() as u8, Ordering::Relaxed);
}

/// 0: tile choice by pairs per expert; else the grouped GEMM's token tiles of 16 (1 or 4).
static GROUP_TILE: AtomicU8 = AtomicU8::new(0);

/// Forces the grouped expert GEMM's tile (`Some(1)`: 16 pairs, `Some(4)`: 64) or restores the
/// automatic choice (`None`); for benchmarks.
pub fn set_group_tile(nt: Option<usize>) {
    GROUP_TILE.store(nt.filter(|&n| n == 1 || n == 4).unwrap_or(0) as u8, Ordering::Relaxed);
}

/// 0: dense tile by block count; else the dense GEMM's token tiles of 16 (2 or 8).
static DENSE_TILE: AtomicU8 = AtomicU8::new(0);

/// Forces the dense GEMM's tile (`Some(2)`: 32 tokens, `Some(8)`: 128) or restores the
/// automatic choice (`None`); for benchmarks.
pub fn set_dense_tile(nt: Option<usize>) {
    DENSE_TILE.store(nt.filter(|&n| n == 2 || n == 8).unwrap_or(0) as u8, Ordering::Relaxed);
}

/// Dynamic shared memory of one GEMM block (kernels/quant_matmul.cu `mm_smem`).
fn smem(nt: usize, passes: usize) -> usize {
    let planes = if passes == 1 { 1 } else { 2 };
    planes * (BN + 16 * nt) * PITCH * 2 + 2 * 16 * nt * 4
}

/// One MoE layer's (token, slot) pairs grouped by expert on the device: `list` holds the pair
/// indices expert by expert, `tiles` one (expert, start in list, count ≤ 16·nt) triple per GEMM
/// tile, `ntiles` how many tiles there are (at most `max_tiles`; experts without tokens have
/// none).
pub struct ExpertGroups {
    pub list: CudaSlice<i32>,
    pub tiles: CudaSlice<i32>,
    pub ntiles: CudaSlice<i32>,
    pub counts: CudaSlice<i32>,
    pub max_tiles: usize,
    /// Token tiles of 16 per GEMM tile.
    pub nt: usize,
    pub npairs: usize,
    pub n_experts: usize,
}

impl Gpu {
    /// Number of streaming multiprocessors (for tile-size choices).
    fn sm_count(&self) -> usize {
        self.ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map(|v| v as usize).unwrap_or(132)
    }

    /// Why the GEMM cannot take `w` with input `x` (`xs` apart), or `None` when it can:
    /// 16-byte aligned input rows, whole float4s per row, and the alignment the fast
    /// dequantizers of IQ4_XS (4 bytes) and Q8_0 (2 bytes) load with.
    pub fn gemm_unfit(&self, w: &DevMat, x: u64, xs: usize) -> Option<String> {
        if !w.ty.is_supported() {
            return Some(format!("type {} unsupported", w.ty.name()));
        }
        if x % 16 != 0 || xs % 4 != 0 || w.cols % 4 != 0 {
            return Some(format!("input {x:#x} stride {xs} cols {} not float4-aligned", w.cols));
        }
        let align = match w.ty {
            GgmlType::IQ4_XS | GgmlType::F32 => 4usize,
            GgmlType::Q8_0 | GgmlType::F16 | GgmlType::BF16 => 2,
            _ => 1,
        };
        let es = if w.n_experts > 0 { w.expert_stride } else { 0 };
        if w.ptr % align as u64 != 0 || w.row_bytes % align != 0 || es % align != 0 {
            return Some(format!("weights {:#x} (row {} bytes) not {align}-byte aligned", w.ptr, w.row_bytes));
        }
        None
    }

    fn gemm_passes(&self, ty: GgmlType) -> usize {
        // F32 weights (the router, f32 checkpoints) are there for precision: always 3 passes.
        if ty == GgmlType::F32 { 3 } else { gemm_precision().passes() }
    }

    fn gemm_func(&self, name: &str, bytes: usize) -> Result<(), CudaError> {
        if bytes > MAX_SMEM {
            return Err(CudaError::Shape(format!("{name}: {bytes} bytes of shared memory (max {MAX_SMEM})")));
        }
        if bytes > 48 * 1024 {
            self.func(name)?.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)?;
        }
        Ok(())
    }

    /// `Y[n × rows] = X[n × cols] · Wᵀ` (or `+=` with `accumulate`) on tensor cores: `n` f32
    /// rows of X `xs` apart, of Y `ys` apart (elements). See [`GemmPrecision`] for accuracy.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(&self, w: &DevMat, x: u64, xs: usize, y: u64, ys: usize, n: usize, accumulate: bool) -> Result<(), CudaError> {
        if let Some(why) = self.gemm_unfit(w, x, xs) {
            return Err(CudaError::Shape(format!("matmul: {why}")));
        }
        let rt = w.rows.div_ceil(BN);
        // Big products: 128-token tiles (weights reused 4x more); else 32-token tiles so that
        // e.g. a 3072→1024 projection of 512 tokens still has enough blocks.
        let nt = match DENSE_TILE.load(Ordering::Relaxed) {
            0 if rt * n.div_ceil(128) >= 2 * self.sm_count() => 8,
            0 => 2,
            n => n as usize,
        };
        self.matmul_with(w, x, xs, y, ys, n, accumulate, nt, self.gemm_passes(w.ty))
    }

    /// [`Gpu::matmul`] with the token tile (`nt` × 16 tokens, nt 2 or 8) and the bf16
    /// passes (1 or 3) chosen by the caller (tests cover every variant).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_with(&self, w: &DevMat, x: u64, xs: usize, y: u64, ys: usize, n: usize, accumulate: bool, nt: usize, passes: usize) -> Result<(), CudaError> {
        if let Some(why) = self.gemm_unfit(w, x, xs) {
            return Err(CudaError::Shape(format!("matmul: {why}")));
        }
        if !matches!(nt, 2 | 8) || !matches!(passes, 1 | 3) {
            return Err(CudaError::Shape(format!("matmul: token tile {nt} x 16, {passes} passes")));
        }
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        if n.div_ceil(16 * nt) > 65535 {
            return Err(CudaError::Shape(format!("matmul: {n} rows of X in tiles of {}", 16 * nt)));
        }
        let name = format!("mm_{}_{nt}_p{passes}", w.ty.name().to_ascii_lowercase());
        let sm = smem(nt, passes);
        self.gemm_func(&name, sm)?;
        self.launch(
            &name,
            (w.rows.div_ceil(BN) as u32, n.div_ceil(16 * nt) as u32, 1),
            256,
            sm as u32,
            &mat_args(w, x, xs, y, ys, n, accumulate),
        )
    }

    /// Groups `npairs` (token, slot) pairs by their expert `ids[p]` (i32, `< n_experts`) on the
    /// device, for [`Gpu::matmul_experts`]; tiles of 64 pairs from 8 pairs per expert on
    /// average, else 16 (or what [`set_group_tile`] forces).
    pub fn group_experts(&self, ids: u64, npairs: usize, n_experts: usize) -> Result<ExpertGroups, CudaError> {
        let nt = match GROUP_TILE.load(Ordering::Relaxed) {
            // Measured (H200, M2.7 512-token prefill, 16 pairs per expert): 64-pair tiles
            // 287 ms vs 416 ms with 16-pair tiles (the weight dequantization dominates, and
            // fewer, fuller tiles per expert dequantize each expert's weights fewer times).
            0 if npairs >= 8 * n_experts => 4,
            0 => 1,
            n => n as usize,
        };
        self.group_experts_with(ids, npairs, n_experts, nt)
    }

    /// [`Gpu::group_experts`] with tiles of `16 * nt` pairs (nt 1 or 4).
    pub fn group_experts_with(&self, ids: u64, npairs: usize, n_experts: usize, nt: usize) -> Result<ExpertGroups, CudaError> {
        if n_experts == 0 || npairs >= i32::MAX as usize || !matches!(nt, 1 | 4) {
            return Err(CudaError::Shape(format!("group_experts: {npairs} pairs over {n_experts} experts, tiles of {}", 16 * nt)));
        }
        let bm = 16 * nt;
        let max_tiles = npairs.div_ceil(bm) + n_experts.min(npairs);
        if max_tiles > 65535 {
            return Err(CudaError::Shape(format!("group_experts: {max_tiles} tiles in one launch (max 65535)")));
        }
        let mut counts = self.zeros::<i32>(n_experts)?;
        self.stream.memset_zeros(&mut counts)?;
        let list = self.zeros::<i32>(npairs)?;
        let tiles = self.zeros::<i32>(3 * max_tiles)?;
        let ntiles = self.zeros::<i32>(1)?;
        let (pc, pl, pt, pn) = (self.ptr(&counts), self.ptr(&list), self.ptr(&tiles), self.ptr(&ntiles));
        let blocks = npairs.div_ceil(256) as u32;
        self.launch("moe_group_count", (blocks, 1, 1), 256, 0, &[Arg::P(ids), Arg::I(npairs as i32), Arg::I(n_experts as i32), Arg::P(pc)])?;
        // counts become the cursors (start of each expert in the list).
        self.launch("moe_group_scan", (1, 1, 1), 1024, 0, &[Arg::P(pc), Arg::I(n_experts as i32), Arg::I(bm as i32), Arg::P(pt), Arg::P(pn)])?;
        self.launch("moe_group_fill", (blocks, 1, 1), 256, 0, &[Arg::P(ids), Arg::I(npairs as i32), Arg::I(n_experts as i32), Arg::P(pc), Arg::P(pl)])?;
        Ok(ExpertGroups { list, tiles, ntiles, counts, max_tiles, nt, npairs, n_experts })
    }

    /// For every grouped pair `p`: `y[p] = W[expert(p)] · x[p / x_div]` on tensor cores (rows
    /// of `y` `ys` apart; rows of pairs not in `groups` are not written).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_experts(&self, w: &DevMat, groups: &ExpertGroups, x: u64, xs: usize, x_div: usize, y: u64, ys: usize) -> Result<(), CudaError> {
        self.matmul_experts_with(w, groups, x, xs, x_div, y, ys, self.gemm_passes(w.ty))
    }

    /// [`Gpu::matmul_experts`] with the bf16 passes (1 or 3) chosen by the caller.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_experts_with(&self, w: &DevMat, groups: &ExpertGroups, x: u64, xs: usize, x_div: usize, y: u64, ys: usize, passes: usize) -> Result<(), CudaError> {
        if !matches!(passes, 1 | 3) {
            return Err(CudaError::Shape(format!("matmul_experts: {passes} passes")));
        }
        if let Some(why) = self.gemm_unfit(w, x, xs) {
            return Err(CudaError::Shape(format!("matmul_experts: {why}")));
        }
        if w.n_experts < groups.n_experts || x_div == 0 {
            return Err(CudaError::Shape(format!("matmul_experts: tensor of {} experts, grouping over {}, x_div {x_div}", w.n_experts, groups.n_experts)));
        }
        if groups.npairs == 0 || w.rows == 0 {
            return Ok(());
        }
        let nt = groups.nt;
        let name = format!("mmg_{}_{nt}_p{passes}", w.ty.name().to_ascii_lowercase());
        let sm = smem(nt, passes);
        self.gemm_func(&name, sm)?;
        self.launch(
            &name,
            (w.rows.div_ceil(BN) as u32, groups.max_tiles as u32, 1),
            256,
            sm as u32,
            &[
                Arg::P(w.ptr),
                Arg::L(w.row_bytes as i64),
                Arg::L(w.expert_stride as i64),
                Arg::I(w.rows as i32),
                Arg::I(w.cols as i32),
                Arg::P(x),
                Arg::L(xs as i64),
                Arg::I(x_div as i32),
                Arg::P(y),
                Arg::L(ys as i64),
                Arg::P(self.ptr(&groups.tiles)),
                Arg::P(self.ptr(&groups.ntiles)),
                Arg::P(self.ptr(&groups.list)),
            ],
        )
    }

    /// A MoE layer's expert products for `npairs` (token, slot) pairs (`k` slots a token, expert
    /// ids i32 at `ids`): `act[p] = silu(gate·x) * (up·x)` (`ff` wide, `ub` scratch of the same
    /// size) and `out[p] = down · act[p]` (`h` wide), x row `p / k`. Many tokens: one device-side
    /// grouping shared by the three grouped GEMMs; few: the per-pair matvec kernels.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_experts(
        &self,
        (gate, up, down): (&DevMat, &DevMat, &DevMat),
        ids: u64,
        npairs: usize,
        k: usize,
        x: u64,
        xs: usize,
        (act, ub, ff): (u64, u64, usize),
        (out, h): (u64, usize),
    ) -> Result<(), CudaError> {
        let grouped = npairs / k.max(1) > GEMM_MIN_TOKENS
            && self.gemm_unfit(gate, x, xs).is_none()
            && self.gemm_unfit(up, x, xs).is_none()
            && self.gemm_unfit(down, act, ff).is_none();
        if grouped {
            let grp = self.group_experts(ids, npairs, gate.n_experts)?;
            self.matmul_experts(gate, &grp, x, xs, k, act, ff)?;
            self.matmul_experts(up, &grp, x, xs, k, ub, ff)?;
            self.silu_mul(act, ub, act, npairs * ff)?;
            self.matmul_experts(down, &grp, act, ff, 1, out, h)
        } else {
            self.matvec_experts(gate, ids, x, xs, k, act, ff, npairs)?;
            self.matvec_experts(up, ids, x, xs, k, ub, ff, npairs)?;
            self.silu_mul(act, ub, act, npairs * ff)?;
            self.matvec_experts(down, ids, act, ff, 1, out, h, npairs)
        }
    }
}
