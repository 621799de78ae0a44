//! Prefill on tensor cores: the quantized GEMM (`mm_*` in kernels/quant_matmul.cu) behind
//! [`Gpu::matvec`] for many tokens, and the grouped expert GEMM (`mmg_*`) with its device-side
//! token→expert grouping (`moe_group_*` in kernels/moe.cu), one grouping per MoE layer shared by
//! gate, up and down.

use std::sync::atomic::{AtomicU8, Ordering};

use super::env_flag::EnvFlag;

use cudarc::driver::CudaSlice;
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
    /// significant bits, within ~1e-5 relative of the f32 matvec. What the fixture
    /// comparisons pin (router near-ties of small models re-route under bf16/int8);
    /// `MINIMAX_GEMM=bf16x3`.
    Bf16x3,
    /// IQ4_XS and Q8_0 weights as int8 with X quantized to int8 per 32 columns (f32 scale, as
    /// the decode path's activations): one int8 MMA per 32 columns, ~4e-3 relative per product.
    /// Other types take the `Bf16x3` kernels. The default: at M2.7 size its logits are within
    /// ~1e-2 of `Bf16x3`'s (the decode path's own q8 error) and prefill is 1.5-1.7x faster.
    Int8,
}

/// `passes` value of the int8 kernels (`mm_i8_*`, `mmg_i8_*`) in the fast-path functions.
pub const INT8_PASSES: usize = 8;

impl GemmPrecision {
    fn passes(self) -> usize {
        match self {
            GemmPrecision::Bf16 => 1,
            GemmPrecision::Bf16x3 => 3,
            GemmPrecision::Int8 => INT8_PASSES,
        }
    }
}

/// 0: not chosen yet (read `MINIMAX_GEMM` on first use), else the passes (1, 3 or 8 = int8).
static PRECISION: AtomicU8 = AtomicU8::new(0);

/// The process-wide GEMM precision: `MINIMAX_GEMM=bf16`, `bf16x3` or `int8` (the default:
/// 1.5-1.7x faster prefill, logits within the decode path's own q8 error at M2.7 size; see
/// docs/CUDA.md "int8 path"), or what [`set_gemm_precision`] set.
pub fn gemm_precision() -> GemmPrecision {
    match PRECISION.load(Ordering::Relaxed) {
        1 => GemmPrecision::Bf16,
        3 => GemmPrecision::Bf16x3,
        8 => GemmPrecision::Int8,
        _ => {
            let p = match std::env::var("MINIMAX_GEMM").as_deref() {
                Ok("bf16") => GemmPrecision::Bf16,
                Ok("bf16x3") => GemmPrecision::Bf16x3,
                _ => GemmPrecision::Int8,
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

/// Forces the grouped expert GEMM's tile (`Some(1)`: 16 pairs, `Some(2)`: 32, fast path only,
/// `Some(4)`: 64) or restores the automatic choice (`None`); for benchmarks.
pub fn set_group_tile(nt: Option<usize>) {
    GROUP_TILE.store(nt.filter(|&n| matches!(n, 1 | 2 | 4)).unwrap_or(0) as u8, Ordering::Relaxed);
}

/// 0: dense tile by block count; else the dense GEMM's token tiles of 16 (2 or 8).
static DENSE_TILE: AtomicU8 = AtomicU8::new(0);

/// Forces the dense GEMM's tile (`Some(2)`: 32 tokens, `Some(8)`: 128; the fast path takes
/// 1, 2 and 4 as 16, 32 and 64 tokens and 8 as 64) or restores the automatic choice (`None`);
/// for benchmarks.
pub fn set_dense_tile(nt: Option<usize>) {
    DENSE_TILE.store(nt.filter(|&n| matches!(n, 1 | 2 | 4 | 8)).unwrap_or(0) as u8, Ordering::Relaxed);
}

/// The integer fast path (`mm_f_*` / `mmg_f_*`: IQ4_XS, Q4_K, Q6_K, Q8_0), on unless
/// `MINIMAX_GEMM_FAST=0`.
static FAST: EnvFlag = EnvFlag::new("MINIMAX_GEMM_FAST", true);

/// Whether the integer fast path is used where it fits ([`FAST`], or what [`set_gemm_fast`] set).
pub fn gemm_fast() -> bool {
    FAST.get()
}

/// Turns the integer fast path on or off for every later product (benchmark A/B).
pub fn set_gemm_fast(on: bool) {
    FAST.set(Some(on));
}

/// The compact 32-token variant, on unless `MINIMAX_GEMM_COMPACT=0` (measured: 512-token M2.7
/// prefill 174 ms vs 198 ms with the 3-stage tile).
static COMPACT: EnvFlag = EnvFlag::new("MINIMAX_GEMM_COMPACT", true);

/// Whether 32-token fast-path tiles take the compact variant (`mm_f_*_32c`: 2 stages, unpadded
/// raw pitch, two blocks an SM where shared memory allows).
pub fn gemm_compact() -> bool {
    COMPACT.get()
}

/// Turns the compact 32-token variant on or off for every later product (benchmark A/B).
pub fn set_gemm_compact(on: bool) {
    COMPACT.set(Some(on));
}

/// Geometry of a fast-path type (kernels/quant_matmul.cu `MQT`): columns per stage, block
/// elements and bytes, scales per row per stage, whether it has mins, load alignment in bytes.
#[derive(Clone, Copy)]
struct FastGeom {
    ks: usize,
    be: usize,
    bb: usize,
    nsc: usize,
    min: bool,
    align: usize,
}

fn fast_geom(ty: GgmlType) -> Option<FastGeom> {
    match ty {
        GgmlType::IQ4_XS => Some(FastGeom { ks: 256, be: 256, bb: 136, nsc: 8, min: false, align: 4 }),
        GgmlType::Q4_K => Some(FastGeom { ks: 256, be: 256, bb: 144, nsc: 8, min: true, align: 4 }),
        GgmlType::Q6_K => Some(FastGeom { ks: 256, be: 256, bb: 210, nsc: 16, min: false, align: 2 }),
        GgmlType::Q8_0 => Some(FastGeom { ks: 128, be: 32, bb: 34, nsc: 4, min: false, align: 2 }),
        _ => None,
    }
}

/// Token tiles of the fast path and their (m16 tiles per warp, stages) (`MQ_INST`).
const FAST_TILES: [(usize, usize, usize); 3] = [(16, 1, 2), (32, 1, 3), (64, 2, 2)];

/// Stage count of the int8 kernels forced by `MINIMAX_I8_STAGES` (2..4; 0: the default choice).
static I8_STAGES: AtomicU8 = AtomicU8::new(u8::MAX);

/// Forces the int8 kernels' stage count (`Some(2..=4)`) or restores the default (`None`); for
/// benchmarks. `MINIMAX_I8_STAGES` sets it at start.
pub fn set_int8_stages(st: Option<usize>) {
    I8_STAGES.store(st.filter(|s| (2..=4).contains(s)).unwrap_or(0) as u8, Ordering::Relaxed);
}

/// Stages of the int8 kernels (`mm_i8_*`, a kernel argument) at token tile `bm`: IQ4_XS at 64
/// tokens 2 (two blocks an SM), else 3, unless forced; `None`: no such tile or type.
fn int8_stages(ty: GgmlType, bm: usize) -> Option<usize> {
    let forced = match I8_STAGES.load(Ordering::Relaxed) {
        u8::MAX => {
            let v = std::env::var("MINIMAX_I8_STAGES").ok().and_then(|v| v.parse::<usize>().ok()).filter(|s| (2..=4).contains(s)).unwrap_or(0);
            I8_STAGES.store(v as u8, Ordering::Relaxed);
            v
        }
        v => v as usize,
    };
    match (ty, bm) {
        (GgmlType::IQ4_XS | GgmlType::Q8_0, 16 | 32 | 64) if forced > 0 => Some(forced),
        (GgmlType::IQ4_XS, 64) => Some(2),
        (GgmlType::IQ4_XS | GgmlType::Q8_0, 16 | 32 | 64) => Some(3),
        _ => None,
    }
}

/// Warp layout of the int8 kernels forced by `MINIMAX_I8_MI` (1, 2 or 4; 0: the default).
static I8_MI: AtomicU8 = AtomicU8::new(u8::MAX);

/// Forces the int8 kernels' warp layout (`Some(1 | 2 | 4)`: m16 tiles a warp, see [`int8_mi`])
/// or restores the default (`None`: `MINIMAX_I8_MI` if set, else 1); for benchmarks and tests.
pub fn set_int8_mi(mi: Option<usize>) {
    I8_MI.store(mi.filter(|m| matches!(m, 1 | 2 | 4)).map(|m| m as u8).unwrap_or(u8::MAX), Ordering::Relaxed);
}

/// m16 tiles a warp of the int8 kernels at token tile `bm`: 1 (the default; `mm_i8_*`: 8 warps
/// of 16 rows, each all tokens), 2 (`mm_i8m2_*`: 4 x 2 warps of 32 rows x bm/2 tokens) or 4 (`mm_i8m4_*`,
/// 32 and 64 tokens: 2 x 4 warps of 64 rows x bm/4 tokens). Larger warp tiles reuse each
/// shared-memory fragment and X scale over more MMAs.
pub fn int8_mi(bm: usize) -> usize {
    let forced = match I8_MI.load(Ordering::Relaxed) {
        u8::MAX => {
            let v = std::env::var("MINIMAX_I8_MI").ok().and_then(|v| v.parse::<usize>().ok()).filter(|m| matches!(m, 1 | 2 | 4)).unwrap_or(0);
            I8_MI.store(v as u8, Ordering::Relaxed);
            v
        }
        v => v as usize,
    };
    match forced {
        4 if bm == 16 => 2,
        // Measured (H200, synthetic M2.7): 1 is fastest at 512 tokens and in 4096-token chunks
        // (2 and 4 run more dequantization and scale decoding per MMA).
        0 => 1,
        m => m,
    }
}

/// Linear weight copies in the int8 kernels (the default: consecutive threads take consecutive
/// 16-byte pieces of the tile) or, with `MINIMAX_I8_WLOAD_LINEAR=0`, two threads a row (fewer
/// instructions a copy, but measured 1.5-2% slower at M2.7 size: docs/CUDA.md "int8 path").
static I8_WLIN: EnvFlag = EnvFlag::new("MINIMAX_I8_WLOAD_LINEAR", true);

/// Forces the int8 kernels' weight-copy scheme (`Some(true)`: linear, `Some(false)`: two
/// threads a row) or restores the default (`None`); for benchmarks and tests.
pub fn set_int8_linear_copies(on: Option<bool>) {
    I8_WLIN.set(on);
}

/// Dynamic shared memory of one int8 block (`mi_smem`): stages of raw rows, int8 X tile and
/// X scales, per-warp weight scales (`mi` m16 tiles a warp), row maps.
fn int8_smem(g: FastGeom, bm: usize, st: usize, mi: usize) -> usize {
    let sb = g.ks / g.be * g.bb;
    let sp = 16 * (((sb + 15) / 16 + 1) | 1);
    let stage = BN * sp + bm * g.ks + bm * (g.ks / 32) * 8;
    st * stage + 8 * mi * (g.ks / 32) * 8 * 8 + 2 * bm * 4
}

/// Dynamic shared memory of one fast-path block for `passes` (1 / 3: `mq_smem` with X in 1 or
/// 2 bf16 planes; [`INT8_PASSES`]: `mi_smem`).
fn fast_smem_for(ty: GgmlType, g: FastGeom, bm: usize, passes: usize) -> Option<usize> {
    if passes == INT8_PASSES {
        int8_stages(ty, bm).map(|st| int8_smem(g, bm, st, int8_mi(bm)))
    } else {
        Some(fast_smem(g, bm, if passes == 1 { 1 } else { 2 }))
    }
}

/// Dynamic shared memory of one fast-path block (`mq_smem`), X in `planes` bf16 planes.
fn fast_smem(g: FastGeom, bm: usize, planes: usize) -> usize {
    let compact = bm == 32 && gemm_compact();
    let (_, mi, st) = FAST_TILES.iter().copied().find(|t| t.0 == bm).unwrap_or((bm, 2, 3));
    let st = if compact { 2 } else { st };
    let sb = g.ks / g.be * g.bb;
    let sp = if compact { 16 * (sb.div_ceil(16) + 1) } else { 16 * (((sb + 15) / 16 + 1) | 1) };
    let xp = g.ks * 2 * planes + 32 * planes;
    let stage = BN * sp + bm * xp + if g.min { bm * (g.ks / 32) * 4 } else { 0 };
    st * stage + if g.min { 2 } else { 1 } * 8 * g.nsc * mi * 8 * 8 + 2 * bm * 4
}

/// X converted for the fast path (`mm_x_pP`): `rows` rows of bf16 planes `pitch` bytes apart,
/// and (types with mins) f32 sums of every 32 columns, `spitch` floats apart; for the int8
/// kernels (`mm_x_i8`, `passes` = [`INT8_PASSES`]) rows of int8 in MMA fragment order and
/// `sums` = (scale, -1.5·2^23·scale) per 32 columns; `perm`: int8 rows in the k order of the
/// IQ4_XS kernels (`iq4_lookup_il`), which only IQ4_XS weights may multiply.
pub struct FastX {
    perm: bool,
    pub(super) xc: CudaSlice<u8>,
    pitch: usize,
    pub(super) sums: Option<CudaSlice<f32>>,
    spitch: usize,
    rows: usize,
    cols: usize,
    passes: usize,
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
    pub fn sm_count(&self) -> usize {
        self.n_sms
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
        // int8 exists for IQ4_XS and Q8_0 only; other types keep the 3-pass kernels.
        match (ty, gemm_precision()) {
            (GgmlType::F32, _) => 3,
            (GgmlType::IQ4_XS | GgmlType::Q8_0, GemmPrecision::Int8) => INT8_PASSES,
            (_, GemmPrecision::Int8) => 3,
            (_, p) => p.passes(),
        }
    }

    /// Refuses a generic GEMM tile that needs more shared memory than any card here allows
    /// (the launch itself raises the kernel's limit, [`Gpu::launch`]).
    fn gemm_smem_check(&self, name: &str, bytes: usize) -> Result<(), CudaError> {
        if bytes > MAX_SMEM {
            return Err(CudaError::Shape(format!("{name}: {bytes} bytes of shared memory (max {MAX_SMEM})")));
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
        if self.blas_takes(w, n) {
            return self.matmul_blas(w, x, xs, y, ys, n, accumulate);
        }
        let rt = w.rows.div_ceil(BN);
        let mut passes = self.gemm_passes(w.ty);
        if passes == INT8_PASSES {
            // 64-token tiles (two blocks an SM), K split in up to 4 parts of at least 4 stages
            // where that fills the last wave better (measured at 512 tokens: 64-token tiles for q
            // and o and 16 for k and v, unsplit: dense GEMMs 37.6 ms).
            let bm = match DENSE_TILE.load(Ordering::Relaxed) {
                1 => 16,
                2 => 32,
                _ => 64,
            };
            if self.gemm_fast_unfit(w, x, xs, bm, passes).is_none() {
                let slots = 2 * self.sm_count();
                let blocks = rt * n.div_ceil(bm);
                let stages = fast_geom(w.ty).map(|g| w.cols.div_ceil(g.ks)).unwrap_or(1);
                let mut best = (f64::MAX, 1usize);
                for s in 1..=4usize {
                    if s > 1 && stages < 4 * s {
                        break;
                    }
                    // Waves of full-K block times; a split pays ~0.1 of one for its reduction.
                    let cost = (blocks * s).div_ceil(slots) as f64 / s as f64 + if s > 1 { 0.1 } else { 0.0 };
                    if cost < best.0 - 1e-9 {
                        best = (cost, s);
                    }
                }
                return self.matmul_fast_split_with(w, x, xs, y, ys, n, accumulate, bm, passes, best.1);
            }
            passes = 3;
        }
        if self.gemm_fast_unfit(w, x, xs, 64, passes).is_none() {
            // Fast path: the largest token tile that still gives every SM a block (16-token
            // tiles run two blocks an SM).
            let sms = self.sm_count();
            let bm = match DENSE_TILE.load(Ordering::Relaxed) {
                // Measured (H200, M2.7 512-token prefill): every dense product on the compact
                // 32-token tile 168 ms vs 174 ms with 64-token tiles for q and o; 4k chunks keep
                // 64 (not measured with 32).
                0 if n <= 1024 && gemm_compact() && rt * n.div_ceil(32) >= sms / 2 => 32,
                0 if rt * n.div_ceil(64) >= sms => 64,
                0 if rt * n.div_ceil(32) >= sms => 32,
                0 => 16,
                1 => 16,
                2 => 32,
                _ => 64,
            };
            return self.matmul_fast_with(w, x, xs, y, ys, n, accumulate, bm, passes);
        }
        // Big products: 128-token tiles (weights reused 4x more); else 32-token tiles so that
        // e.g. a 3072→1024 projection of 512 tokens still has enough blocks.
        let sms = self.sm_count();
        let nt = match DENSE_TILE.load(Ordering::Relaxed) {
            0 if rt * n.div_ceil(128) >= 2 * sms => 8,
            8 => 8,
            _ => 2,
        };
        // Fewer blocks than SMs (the F32 router: 256 rows): split K so that about two blocks
        // an SM run (measured: M2.7's router at 512 tokens took 296 µs a layer on 32 blocks).
        let blocks = rt * n.div_ceil(16 * nt);
        let unit = if w.ty.block_elems() == 256 { 256 } else { 64 };
        let splits = if blocks < sms { (2 * sms).div_ceil(blocks).min(16).min(w.cols / unit) } else { 1 };
        self.matmul_split_with(w, x, xs, y, ys, n, accumulate, nt, passes, splits.max(1))
    }

    /// [`Gpu::matmul`] with the token tile (`nt` × 16 tokens, nt 2 or 8) and the bf16
    /// passes (1 or 3) chosen by the caller (tests cover every variant).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_with(&self, w: &DevMat, x: u64, xs: usize, y: u64, ys: usize, n: usize, accumulate: bool, nt: usize, passes: usize) -> Result<(), CudaError> {
        self.matmul_split_with(w, x, xs, y, ys, n, accumulate, nt, passes, 1)
    }

    /// [`Gpu::matmul_with`] with K split in up to `splits` parts of whole 64-column steps (and
    /// whole blocks of the type), run side by side (grid z) into a scratch buffer and added in
    /// order by `mm_sum_parts`: for products with fewer row × token tiles than SMs.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_split_with(&self, w: &DevMat, x: u64, xs: usize, y: u64, ys: usize, n: usize, accumulate: bool, nt: usize, passes: usize, splits: usize) -> Result<(), CudaError> {
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
        if splits == 0 || splits > 64 {
            return Err(CudaError::Shape(format!("matmul: K in {splits} parts")));
        }
        let name = format!("mm_{}_{nt}_p{passes}", w.ty.name().to_ascii_lowercase());
        let sm = smem(nt, passes);
        self.gemm_smem_check(&name, sm)?;
        let grid = (w.rows.div_ceil(BN) as u32, n.div_ceil(16 * nt) as u32);
        // Columns a part: whole 64-column steps and whole blocks (256 for the K-quants).
        let unit = if w.ty.block_elems() == 256 { 256 } else { 64 };
        let kz = w.cols.div_ceil(unit).div_ceil(splits) * unit;
        let parts = w.cols.div_ceil(kz.max(1));
        if parts <= 1 {
            let mut args = mat_args(w, x, xs, y, ys, n, accumulate).to_vec();
            args.extend([Arg::I(w.cols as i32), Arg::L(0)]);
            return self.launch(&name, (grid.0, grid.1, 1), 256, sm as u32, &args);
        }
        let part = n * w.rows;
        // Every element of every part is written by its blocks before the sum reads it.
        let p = unsafe { self.stream.alloc::<f32>(parts * part)? };
        let mut args = mat_args(w, x, xs, self.ptr(&p), w.rows, n, false).to_vec();
        args.extend([Arg::I(kz as i32), Arg::L(part as i64)]);
        self.launch(&name, (grid.0, grid.1, parts as u32), 256, sm as u32, &args)?;
        self.launch(
            "mm_sum_parts",
            (part.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[Arg::P(self.ptr(&p)), Arg::L(part as i64), Arg::I(parts as i32), Arg::P(y), Arg::L(ys as i64), Arg::I(w.rows as i32), Arg::I(n as i32), Arg::I(accumulate as i32)],
        )
    }

    /// Largest dynamic shared memory a block may opt in to on this device.
    pub fn smem_optin(&self) -> usize {
        self.optin_smem
    }

    /// Why the integer fast path cannot take `w` with input `x` (`xs` apart) at token tile
    /// `bm` and `passes` (1, 3, or [`INT8_PASSES`] for the int8 kernels of IQ4_XS / Q8_0), or
    /// `None` when it can (and [`gemm_fast`] is on).
    pub fn gemm_fast_unfit(&self, w: &DevMat, x: u64, xs: usize, bm: usize, passes: usize) -> Option<String> {
        if !gemm_fast() {
            return Some("fast path off".into());
        }
        if let Some(why) = self.gemm_unfit(w, x, xs) {
            return Some(why);
        }
        let Some(g) = fast_geom(w.ty) else { return Some(format!("type {} has no fast path", w.ty.name())) };
        let es = if w.n_experts > 0 { w.expert_stride } else { 0 };
        if w.ptr % g.align as u64 != 0 || w.row_bytes % g.align != 0 || es % g.align != 0 || w.cols % g.be != 0 {
            return Some(format!("weights {:#x} (row {} bytes) not {}-byte aligned", w.ptr, w.row_bytes, g.align));
        }
        if !FAST_TILES.iter().any(|t| t.0 == bm) || !matches!(passes, 1 | 3 | INT8_PASSES) {
            return Some(format!("token tile {bm}, {passes} passes"));
        }
        let Some(sm) = fast_smem_for(w.ty, g, bm, passes) else { return Some(format!("type {} has no int8 kernels", w.ty.name())) };
        if sm > self.smem_optin() {
            return Some(format!("{sm} bytes of shared memory (device max {})", self.smem_optin()));
        }
        None
    }

    /// Converts `rows` rows of X (`xs` apart; `x = silu(x) * u` with `u`, same stride) into the
    /// fast path's bf16 planes for `passes`, with 32-column sums when `sums`. `kernel`: "mm_x"
    /// or "mmg_x" (the same kernel, named for the benchmark's dense / MoE split).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fast_x(&self, kernel: &str, x: u64, xs: usize, u: Option<u64>, rows: usize, cols: usize, passes: usize, sums: bool, for_ty: GgmlType) -> Result<FastX, CudaError> {
        if passes == INT8_PASSES {
            let perm = for_ty == GgmlType::IQ4_XS;
            // int8 in 64-column groups (the last one padded), (scale, correction) per 32 columns.
            if cols % 32 != 0 {
                return Err(CudaError::Shape(format!("int8 X conversion: {cols} columns")));
            }
            let pitch = cols.next_multiple_of(64);
            let spitch = 2 * (cols / 32);
            // Every byte the products use is written first (the padding's products are skipped).
            let xc = unsafe { self.stream.alloc::<u8>((rows * pitch).max(16))? };
            let s = unsafe { self.stream.alloc::<f32>((rows * spitch).max(4))? };
            if rows > 0 && cols > 0 {
                self.launch(
                    &format!("{kernel}_i8"),
                    (rows as u32, cols.div_ceil(128) as u32, 1),
                    32,
                    0,
                    &[
                        Arg::P(x),
                        Arg::L(xs as i64),
                        Arg::P(u.unwrap_or(0)),
                        Arg::I(cols as i32),
                        Arg::P(self.ptr(&xc)),
                        Arg::L(pitch as i64),
                        Arg::P(self.ptr(&s)),
                        Arg::L(spitch as i64),
                        Arg::I(perm as i32),
                    ],
                )?;
            }
            return Ok(FastX { perm, xc, pitch, sums: Some(s), spitch, rows, cols, passes });
        }
        let planes = if passes == 1 { 1 } else { 2 };
        let pitch = (cols * 2 * planes).next_multiple_of(16);
        let spitch = (cols / 32).next_multiple_of(4);
        // Every byte the products read is written first: no zeroing needed.
        let xc = unsafe { self.stream.alloc::<u8>((rows * pitch).max(16))? };
        let s = if sums { Some(self.zeros::<f32>(rows * spitch)?) } else { None };
        let sp = s.as_ref().map(|b| self.ptr(b)).unwrap_or(0);
        if rows > 0 && cols > 0 {
            self.launch(
                &format!("{kernel}_p{passes}"),
                (rows as u32, cols.div_ceil(128) as u32, 1),
                32,
                0,
                &[Arg::P(x), Arg::L(xs as i64), Arg::P(u.unwrap_or(0)), Arg::I(cols as i32), Arg::P(self.ptr(&xc)), Arg::L(pitch as i64), Arg::P(sp), Arg::L(spitch as i64)],
            )?;
        }
        Ok(FastX { perm: false, xc, pitch, sums: s, spitch, rows, cols, passes })
    }

    /// The fast path's dense product `Y[n × rows] (+)= X[n × cols] · Wᵀ` with token tile `bm`
    /// (16, 32 or 64) and `passes` (1: X's bf16 hi part, 3: hi + lo; W exact either way;
    /// [`INT8_PASSES`]: X as int8 per 32 columns, IQ4_XS / Q8_0 only).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_fast_with(&self, w: &DevMat, x: u64, xs: usize, y: u64, ys: usize, n: usize, accumulate: bool, bm: usize, passes: usize) -> Result<(), CudaError> {
        self.matmul_fast_split_with(w, x, xs, y, ys, n, accumulate, bm, passes, 1)
    }

    /// [`Gpu::matmul_fast_with`] with K split in up to `splits` parts of whole stages (int8
    /// kernels only; grid z into a scratch buffer, `mm_sum_parts` adds the parts in order).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_fast_split_with(&self, w: &DevMat, x: u64, xs: usize, y: u64, ys: usize, n: usize, accumulate: bool, bm: usize, passes: usize, splits: usize) -> Result<(), CudaError> {
        if splits == 0 || splits > 64 || (splits > 1 && passes != INT8_PASSES) {
            return Err(CudaError::Shape(format!("matmul_fast: K in {splits} parts with {passes} passes")));
        }
        if let Some(why) = self.gemm_fast_unfit(w, x, xs, bm, passes) {
            return Err(CudaError::Shape(format!("matmul_fast: {why}")));
        }
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        if n.div_ceil(bm) > 65535 {
            return Err(CudaError::Shape(format!("matmul_fast: {n} rows of X in tiles of {bm}")));
        }
        let g = fast_geom(w.ty).expect("checked");
        let fx = self.fast_x("mm_x", x, xs, None, n, w.cols, passes, g.min, w.ty)?;
        // Columns a part: whole stages.
        let kz = w.cols.div_ceil(g.ks).div_ceil(splits) * g.ks;
        let parts = w.cols.div_ceil(kz);
        if parts <= 1 {
            return self.launch_fast(w, &fx, y, ys, bm, None, n, accumulate, None);
        }
        let part = n * w.rows;
        // Every element of every part is written by its blocks before the sum reads it.
        let p = unsafe { self.stream.alloc::<f32>(parts * part)? };
        self.launch_fast(w, &fx, self.ptr(&p), w.rows, bm, None, n, false, Some((kz, parts)))?;
        self.launch(
            "mm_sum_parts",
            (part.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[Arg::P(self.ptr(&p)), Arg::L(part as i64), Arg::I(parts as i32), Arg::P(y), Arg::L(ys as i64), Arg::I(w.rows as i32), Arg::I(n as i32), Arg::I(accumulate as i32)],
        )
    }

    /// One fast-path launch over converted X: dense (`groups` None: `n` tokens) or grouped;
    /// `split` = (columns a part, parts): int8 dense split K, parts `n · rows` floats apart in `y`.
    #[allow(clippy::too_many_arguments)]
    fn launch_fast(&self, w: &DevMat, fx: &FastX, y: u64, ys: usize, bm: usize, groups: Option<(&ExpertGroups, usize)>, n: usize, accumulate: bool, split: Option<(usize, usize)>) -> Result<(), CudaError> {
        let g = fast_geom(w.ty).ok_or_else(|| CudaError::Shape(format!("type {} has no fast path", w.ty.name())))?;
        if fx.passes == INT8_PASSES && fx.perm != (w.ty == GgmlType::IQ4_XS) {
            return Err(CudaError::Shape(format!("int8 X converted for {} weights, product with {}", if fx.perm { "IQ4_XS" } else { "other" }, w.ty.name())));
        }
        if fx.cols != w.cols || (g.min && fx.sums.is_none()) {
            return Err(CudaError::Shape(format!("fast product: X of {} columns (sums {}) for {} x {} {}", fx.cols, fx.sums.is_some(), w.rows, w.cols, w.ty.name())));
        }
        let passes = fx.passes;
        let kind = if groups.is_some() { "mmg" } else { "mm" };
        let ty = w.ty.name().to_ascii_lowercase();
        let Some(sm) = fast_smem_for(w.ty, g, bm, passes) else { return Err(CudaError::Shape(format!("{kind}: no int8 kernel for {ty} at {bm} tokens"))) };
        let name = if passes == INT8_PASSES {
            let tag = match int8_mi(bm) {
                4 => "m4",
                2 => "m2",
                _ => "",
            };
            format!("{kind}_i8{tag}_{ty}_{bm}")
        } else {
            let suffix = if bm == 32 && gemm_compact() { "c" } else { "" };
            format!("{kind}_f_{ty}_{bm}{suffix}_p{passes}")
        };
        if sm > self.smem_optin() {
            return Err(CudaError::Shape(format!("{name}: {sm} bytes of shared memory")));
        }
        let sums = fx.sums.as_ref().map(|b| self.ptr(b)).unwrap_or(0);
        let rt = w.rows.div_ceil(BN) as u32;
        // The int8 kernels take their stage count as an argument (dense ones then the split).
        let (kz, parts) = split.unwrap_or((w.cols, 1));
        if parts > 1 && (passes != INT8_PASSES || groups.is_some()) {
            return Err(CudaError::Shape(format!("{name}: no split K")));
        }
        let mut st: Vec<Arg> = if passes == INT8_PASSES {
            // Stage count, + 16 for linear weight copies (kernel argument `st`).
            vec![Arg::I(int8_stages(w.ty, bm).unwrap_or(3) as i32 + if I8_WLIN.get() { 16 } else { 0 })]
        } else {
            Vec::new()
        };
        if passes == INT8_PASSES && groups.is_none() {
            st.extend([Arg::I(kz as i32), Arg::L((n * w.rows) as i64)]);
        }
        match groups {
            None => self.launch(
                &name,
                (rt, n.div_ceil(bm) as u32, parts as u32),
                256,
                sm as u32,
                &[
                    Arg::P(w.ptr),
                    Arg::L(w.row_bytes as i64),
                    Arg::I(w.rows as i32),
                    Arg::I(w.cols as i32),
                    Arg::P(self.ptr(&fx.xc)),
                    Arg::L(fx.pitch as i64),
                    Arg::P(sums),
                    Arg::L(fx.spitch as i64),
                    Arg::P(y),
                    Arg::L(ys as i64),
                    Arg::I(n as i32),
                    Arg::I(accumulate as i32),
                ]
                .into_iter()
                .chain(st)
                .collect::<Vec<_>>(),
            ),
            Some((grp, x_div)) => {
                if grp.npairs.div_ceil(x_div) > fx.rows || 16 * grp.nt != bm {
                    return Err(CudaError::Shape(format!("{name}: {} pairs / {x_div} over {} X rows, tiles of {}", grp.npairs, fx.rows, 16 * grp.nt)));
                }
                self.launch(
                    &name,
                    (rt, grp.max_tiles as u32, 1),
                    256,
                    sm as u32,
                    &[
                        Arg::P(w.ptr),
                        Arg::L(w.row_bytes as i64),
                        Arg::L(w.expert_stride as i64),
                        Arg::I(w.rows as i32),
                        Arg::I(w.cols as i32),
                        Arg::P(self.ptr(&fx.xc)),
                        Arg::L(fx.pitch as i64),
                        Arg::P(sums),
                        Arg::L(fx.spitch as i64),
                        Arg::I(x_div as i32),
                        Arg::P(y),
                        Arg::L(ys as i64),
                        Arg::P(self.ptr(&grp.tiles)),
                        Arg::P(self.ptr(&grp.ntiles)),
                        Arg::P(self.ptr(&grp.list)),
                    ]
                    .into_iter()
                    .chain(st)
                    .collect::<Vec<_>>(),
                )
            }
        }
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
            2 => 4,
            n => n as usize,
        };
        self.group_experts_with(ids, npairs, n_experts, nt)
    }

    /// The fast path's grouping: tiles of 16 pairs below 8 pairs per expert on average, 32
    /// below 24 (one tile for nearly every expert of a 512-token M2.7 prefill), else 64.
    pub fn group_experts_fast(&self, ids: u64, npairs: usize, n_experts: usize) -> Result<ExpertGroups, CudaError> {
        self.group_experts_fast_for(ids, npairs, n_experts, false)
    }

    /// [`Gpu::group_experts_fast`] for the int8 kernels when `int8`: tiles of 64 pairs from 12
    /// pairs per expert on average (tiles at most half or a quarter full run half or a quarter
    /// of the MMAs), else 32. Measured (H200, M2.7, forward + greedy reduction), session 12,
    /// below 12 pairs an expert (16 / 32 / 64-pair tiles): 32 distinct 5-token prompts 81.3 /
    /// 81.4 / 92.5 ms, one 160-token prompt 49.0 / 42.1 / 43.0 ms (session 10, before the
    /// kernels' copy and decode savings, 16 won at 5-8 pairs). At 16 pairs an expert 32-pair
    /// tiles win for 32 distinct 16-token prompts (112.7 against 118.8 ms) and lose for one
    /// synthetic 512-token prompt, which concentrates its routing on fewer experts (81.8 against
    /// 75.8); how much a real prompt concentrates is not known here, so 64 stays there. Tiles
    /// sized per expert were tried and lost in both cases (docs/CUDA.md).
    pub fn group_experts_fast_for(&self, ids: u64, npairs: usize, n_experts: usize, int8: bool) -> Result<ExpertGroups, CudaError> {
        let nt = match GROUP_TILE.load(Ordering::Relaxed) {
            0 if int8 && npairs >= 12 * n_experts => 4,
            0 if int8 => 2,
            0 if npairs < 8 * n_experts => 1,
            0 if npairs < 24 * n_experts => 2,
            0 => 4,
            n => n as usize,
        };
        self.group_experts_with(ids, npairs, n_experts, nt)
    }

    /// The grouping for the TMA expert kernels (tma_experts.rs): tiles of 64 pairs from 32
    /// pairs per expert on average, else 32. Measured (H200, M2.7, forward + greedy reduction,
    /// session 16; 32-pair / 64-pair tiles): 32 distinct 16-token prompts 87.4 / 96.4 ms, 32
    /// of 5 tokens 61.9 / 71.5, one 512-token prompt 67.9 / 68.1, 16 prompts of 256 tokens
    /// 421.3 / 410.1, one 4,096-token chunk 446.7 / 428.3.
    pub fn group_experts_tma(&self, ids: u64, npairs: usize, n_experts: usize) -> Result<ExpertGroups, CudaError> {
        let nt = match GROUP_TILE.load(Ordering::Relaxed) {
            0 if npairs >= 32 * n_experts => 4,
            0 => 2,
            n => n as usize,
        };
        self.group_experts_with(ids, npairs, n_experts, nt)
    }

    /// [`Gpu::group_experts`] with tiles of `16 * nt` pairs (nt 1 or 4; 2 for the fast path).
    pub fn group_experts_with(&self, ids: u64, npairs: usize, n_experts: usize, nt: usize) -> Result<ExpertGroups, CudaError> {
        if n_experts == 0 || npairs >= i32::MAX as usize || !matches!(nt, 1 | 2 | 4) {
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

    /// [`Gpu::matmul_experts`] with the bf16 passes (1 or 3, or [`INT8_PASSES`]: the int8
    /// kernels where they fit, else 3) chosen by the caller.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_experts_with(&self, w: &DevMat, groups: &ExpertGroups, x: u64, xs: usize, x_div: usize, y: u64, ys: usize, passes: usize) -> Result<(), CudaError> {
        if !matches!(passes, 1 | 3 | INT8_PASSES) {
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
        if self.gemm_fast_unfit(w, x, xs, 16 * groups.nt, passes).is_none() {
            let g = fast_geom(w.ty).expect("checked");
            let fx = self.fast_x("mmg_x", x, xs, None, groups.npairs.div_ceil(x_div), w.cols, passes, g.min, w.ty)?;
            return self.launch_fast(w, &fx, y, ys, 16 * groups.nt, Some((groups, x_div)), 0, false, None);
        }
        let passes = if passes == INT8_PASSES { 3 } else { passes };
        if passes == 3 && self.gemm_fast_unfit(w, x, xs, 16 * groups.nt, 3).is_none() {
            let g = fast_geom(w.ty).expect("checked");
            let fx = self.fast_x("mmg_x", x, xs, None, groups.npairs.div_ceil(x_div), w.cols, 3, g.min, w.ty)?;
            return self.launch_fast(w, &fx, y, ys, 16 * groups.nt, Some((groups, x_div)), 0, false, None);
        }
        let nt = groups.nt;
        if !matches!(nt, 1 | 4) {
            return Err(CudaError::Shape(format!("matmul_experts: tiles of {} pairs need the fast path ({})", 16 * nt, w.ty.name())));
        }
        let name = format!("mmg_{}_{nt}_p{passes}", w.ty.name().to_ascii_lowercase());
        let sm = smem(nt, passes);
        self.gemm_smem_check(&name, sm)?;
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
        // gate and up share one conversion (same passes); down has its own (int8 or not). An
        // int8 product that does not fit takes the 3-pass kernels.
        let fits = |w: &DevMat, xp: u64, xsp: usize, p: usize| [16, 32, 64].iter().all(|&bm| self.gemm_fast_unfit(w, xp, xsp, bm, p).is_none());
        let pick = |w: &DevMat, xp: u64, xsp: usize| {
            let p = self.gemm_passes(w.ty);
            if p == INT8_PASSES && !fits(w, xp, xsp, p) { 3 } else { p }
        };
        let (mut pg, pu, pd) = (pick(gate, x, xs), pick(up, x, xs), pick(down, act, ff));
        if pg != pu {
            pg = 3;
        }
        let fast = grouped && fits(gate, x, xs, pg) && fits(up, x, xs, pg) && fits(down, act, ff, pd);
        if fast {
            // One conversion of x for gate and up; SiLU(gate)·up fused into the conversion of
            // down's input.
            // IQ4_XS experts through TMA copies where they fit (tma_experts.rs: X in grouped
            // order), gate/up and down each on their own (a tensor-parallel slice's down may not).
            let gu_tma = pg == INT8_PASSES && self.tma_expert_fits(gate) && self.tma_expert_fits(up);
            let dn_tma = pd == INT8_PASSES && self.tma_expert_fits(down);
            let grp_t = if gu_tma || dn_tma { Some(self.group_experts_tma(ids, npairs, gate.n_experts)?) } else { None };
            let grp = if gu_tma && dn_tma { None } else { Some(self.group_experts_fast_for(ids, npairs, gate.n_experts, pg == INT8_PASSES && pd == INT8_PASSES)?) };
            let mins = |w: &DevMat| fast_geom(w.ty).map(|g| g.min).unwrap_or(false);
            match (&grp_t, &grp) {
                (Some(gt), _) if gu_tma => {
                    let xa = self.grouped_x(gt, x, xs, None, k, gate.cols)?;
                    self.matmul_experts_tma(gate, gt, &xa, act, ff)?;
                    self.matmul_experts_tma(up, gt, &xa, ub, ff)?;
                }
                (_, Some(g)) => {
                    let bm = 16 * g.nt;
                    let xa = self.fast_x("mmg_x", x, xs, None, npairs.div_ceil(k), gate.cols, pg, mins(gate) || mins(up), gate.ty)?;
                    self.launch_fast(gate, &xa, act, ff, bm, Some((g, k)), 0, false, None)?;
                    // int8 X is laid out for IQ4_XS weights or for the others: a mixed pair converts twice.
                    let xu = if pg == INT8_PASSES && (up.ty == GgmlType::IQ4_XS) != xa.perm {
                        Some(self.fast_x("mmg_x", x, xs, None, npairs.div_ceil(k), up.cols, pg, mins(up), up.ty)?)
                    } else {
                        None
                    };
                    self.launch_fast(up, xu.as_ref().unwrap_or(&xa), ub, ff, bm, Some((g, k)), 0, false, None)?;
                }
                _ => return Err(CudaError::Shape("moe_experts: no grouping for gate/up".into())),
            }
            return match (&grp_t, &grp) {
                (Some(gt), _) if dn_tma => {
                    let xd = self.grouped_x(gt, act, ff, Some(ub), 1, ff)?;
                    self.matmul_experts_tma(down, gt, &xd, out, h)
                }
                (_, Some(g)) => {
                    let xd = self.fast_x("mmg_x", act, ff, Some(ub), npairs, ff, pd, mins(down), down.ty)?;
                    self.launch_fast(down, &xd, out, h, 16 * g.nt, Some((g, 1)), 0, false, None)
                }
                _ => Err(CudaError::Shape("moe_experts: no grouping for down".into())),
            };
        }
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
