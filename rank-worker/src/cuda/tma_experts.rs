//! Prefill expert products through tensor-memory copies (`mmg_t8_*` and `mmg_xg_i8` in
//! kernels/quant_matmul.cu, sm_90 and newer): the int8 grouped IQ4_XS products of the `mmg_i8`
//! kernels with each stage's weight tile, X tile and X scales brought by three TMA copies that
//! one thread issues, instead of per-thread `cp.async` copies whose address arithmetic cost as
//! many instructions as the products at ~16 tokens an expert (docs/CUDA.md, "int8 experts
//! through TMA"). X is converted once per product in grouped order (row i = pair `list[i]`), so
//! a tile's tokens are consecutive rows a 2-D box can copy.

use cudarc::driver::CudaSlice;
use cudarc::driver::sys::{self, CUtensorMapDataType as Dt};

use super::env_flag::EnvFlag;
use super::error::CudaError;
use super::gpu::{Arg, DevMat, Gpu};
use super::matmul::{ExpertGroups, INT8_PASSES};
use minimax_shared::quant::GgmlType;

/// The TMA expert kernels where they apply (`MINIMAX_I8_TMA`, on by default).
static TMA_ON: EnvFlag = EnvFlag::new("MINIMAX_I8_TMA", true);

/// The wide-warp form (`mmg_t8w`: 4 warps of 32 rows a block, each B fragment load feeding two
/// m16 tiles) instead of 8 warps of 16 rows (`MINIMAX_T8_WIDE`, on by default: 8k prefill 866 →
/// 786 ms on one H200, the same at 512 tokens; `=0` keeps `mmg_t8` for A/B).
static TMA_WIDE: EnvFlag = EnvFlag::new("MINIMAX_T8_WIDE", true);

/// Gate/up's grouped X by converting each token once and copying its row to its pairs
/// (`mmg_x_i8` + `mmg_xg_gather`) instead of converting every pair's row (`mmg_xg_i8`, 8 times a
/// token at top-8); the same bytes (`cuda_prefill` tma_grouped, H200). `MINIMAX_XG_GATHER`, off
/// by default: conversions 9.7 → 7.1 ms a 4,096-token chunk, but the whole prefill no faster.
static XG_GATHER: EnvFlag = EnvFlag::new("MINIMAX_XG_GATHER", false);

/// Forces the convert-once-and-gather grouped X on or off (`None`: back to `MINIMAX_XG_GATHER`).
pub fn set_xg_gather(on: Option<bool>) {
    XG_GATHER.set(on);
}

/// Forces the wide-warp TMA kernels on or off (`None`: back to `MINIMAX_T8_WIDE`).
pub fn set_tma_wide(on: Option<bool>) {
    TMA_WIDE.set(on);
}

/// Forces the TMA expert kernels on or off (`None`: back to `MINIMAX_I8_TMA`); for benchmarks
/// and tests.
pub fn set_tma_experts(on: Option<bool>) {
    TMA_ON.set(on);
}

/// Whether the TMA expert kernels are switched on.
pub fn tma_experts_on() -> bool {
    TMA_ON.get()
}

/// Rows of a weight block (`MQ_BR`), the weight tile's row pitch in shared memory (`MT_WP`) and
/// the X-scale tile's (`MT_SP` chunks).
const BR: usize = 128;
const WP: usize = 144;
const SP: usize = 10;

/// Dynamic shared memory of one `mmg_t8` block (`mt_smem`): `st` stages of the weight tile, the
/// X tile and the X scales, the per-warp weight scales, the Y row map and the mbarriers.
fn t8_smem(bm: usize, st: usize) -> usize {
    st * (BR * WP + bm * 256 + bm * SP * 8) + 8 * 8 * 8 * 8 + bm * 4 + st * 8
}

/// Stages of the TMA expert kernels at token tile `bm`, or `MINIMAX_T8_STAGES` (2..4) when set.
/// `mmg_t8` (8 warps): as deep as two blocks an SM allow (4 at 16 tokens, 3 at 32, 2 at 64).
/// `mmg_t8w` (4 warps): 2 at every tile, so 4 / 3 / 2 blocks share an SM at 16 / 32 / 64 tokens
/// (one H200: one 512-token prompt 59.8 → 57.0 ms, 32 prompts of 16 tokens 81.6 → 78.0 ms
/// against the 8-warp depths).
fn t8_stages(bm: usize, wide: bool) -> usize {
    // Read once: this runs at every expert launch of a prefill.
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced = FORCED.get_or_init(|| std::env::var("MINIMAX_T8_STAGES").ok().and_then(|v| v.parse::<usize>().ok()).filter(|s| (2..=4).contains(s)));
    if let Some(st) = *forced {
        return st;
    }
    match (wide, bm) {
        (true, _) => 2,
        (false, 16) => 4,
        (false, 32) => 3,
        _ => 2,
    }
}

/// X of one grouped product converted for the `mmg_t8` kernels: `rows` int8 rows of `cols`
/// bytes (row i = pair `list[i]`, odd rows with their 64-byte halves swapped) and per row the
/// scales of its 32-column chunks, `(d, -1.5·2^23·d)` pairs.
pub struct GroupedX {
    xq: CudaSlice<u8>,
    s: CudaSlice<f32>,
    rows: usize,
    cols: usize,
}

impl GroupedX {
    /// The int8 rows and their scales (tests compare the two ways of building them).
    pub fn buffers(&self) -> (&CudaSlice<u8>, &CudaSlice<f32>) {
        (&self.xq, &self.s)
    }
}

/// A tiled tensor map over `dims` (innermost first) of `ty` elements at `addr`, rows `strides`
/// bytes apart (one per outer dimension), copied in boxes of `bx`.
fn tensor_map(ty: Dt, addr: u64, dims: &[u64], strides: &[u64], bx: &[u32]) -> Result<[u64; 16], CudaError> {
    let mut map: sys::CUtensorMap = unsafe { std::mem::zeroed() };
    let ones = [1u32; 5];
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            ty,
            dims.len() as u32,
            addr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            bx.as_ptr(),
            ones.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    r.result().map_err(|e| CudaError::Shape(format!("tensor map over {dims:?} (strides {strides:?}, box {bx:?}) at {addr:#x}: {e:?}")))?;
    Ok(map.opaque)
}

impl Gpu {
    /// Whether `w` (an expert tensor) can take the TMA kernels: IQ4_XS, rows of whole
    /// 512-column multiples (16-byte row strides), 16-byte aligned, on sm_90 or newer, switch on.
    pub fn tma_expert_fits(&self, w: &DevMat) -> bool {
        tma_experts_on()
            && self.arch >= 90
            && w.ty == GgmlType::IQ4_XS
            && w.n_experts > 0
            && w.cols % 512 == 0
            && w.row_bytes % 16 == 0
            && w.expert_stride % 16 == 0
            && w.ptr % 16 == 0
            && w.rows > 0
            && w.cols <= 1 << 20
            && [16, 32, 64].iter().all(|&bm| t8_smem(bm, t8_stages(bm, TMA_WIDE.get())) <= self.smem_optin())
    }

    /// Converts X for the grouped products of `groups`: row i from row `list[i] / x_div` of X
    /// (`xs` apart; `x = silu(x) * u` with `u`, same stride).
    pub fn grouped_x(&self, groups: &ExpertGroups, x: u64, xs: usize, u: Option<u64>, x_div: usize, cols: usize) -> Result<GroupedX, CudaError> {
        let rows = groups.npairs;
        if cols % 64 != 0 || x_div == 0 || rows == 0 || x % 16 != 0 || xs % 4 != 0 {
            return Err(CudaError::Shape(format!("grouped int8 X: {rows} pairs of {cols} columns, x_div {x_div}, X at {x:#x} stride {xs}")));
        }
        // Every byte a product reads is written here (rows × cols, every chunk's scales of
        // every row: rows of cols / 32 float2, a 16-byte multiple); the copies zero-fill what
        // lies past them.
        let xq = unsafe { self.stream.alloc::<u8>(rows * cols)? };
        let s = unsafe { self.stream.alloc::<f32>(2 * rows * (cols / 32))? };
        if u.is_none() && x_div > 1 && XG_GATHER.get() {
            // Each token's row converted once (the IQ4_XS order, no swap), then copied to its pairs.
            let xt = self.fast_x("mmg_x", x, xs, None, rows.div_ceil(x_div), cols, INT8_PASSES, false, GgmlType::IQ4_XS)?;
            self.launch(
                "mmg_xg_gather",
                (rows.div_ceil(8) as u32, 1, 1),
                256,
                0,
                &[
                    Arg::P(self.ptr(&xt.xc)),
                    Arg::P(xt.sums.as_ref().map(|b| self.ptr(b)).unwrap_or(0)),
                    Arg::I(cols as i32),
                    Arg::P(self.ptr(&groups.list)),
                    Arg::I(x_div as i32),
                    Arg::P(self.ptr(&xq)),
                    Arg::P(self.ptr(&s)),
                    Arg::I(rows as i32),
                ],
            )?;
            return Ok(GroupedX { xq, s, rows, cols });
        }
        self.launch(
            "mmg_xg_i8",
            (rows.div_ceil(8) as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(x),
                Arg::L(xs as i64),
                Arg::P(u.unwrap_or(0)),
                Arg::I(cols as i32),
                Arg::P(self.ptr(&groups.list)),
                Arg::I(x_div as i32),
                Arg::P(self.ptr(&xq)),
                Arg::L(cols as i64),
                Arg::P(self.ptr(&s)),
                Arg::I(rows as i32),
            ],
        )?;
        Ok(GroupedX { xq, s, rows, cols })
    }

    /// For every grouped pair `p`: `y[p] = W[expert(p)] · x[p]` with X from [`Gpu::grouped_x`]
    /// (rows of `y` `ys` apart). Callers check [`Gpu::tma_expert_fits`].
    pub fn matmul_experts_tma(&self, w: &DevMat, groups: &ExpertGroups, gx: &GroupedX, y: u64, ys: usize) -> Result<(), CudaError> {
        if !self.tma_expert_fits(w) || gx.cols != w.cols || gx.rows != groups.npairs || w.n_experts < groups.n_experts || ys < w.rows {
            return Err(CudaError::Shape(format!(
                "matmul_experts_tma: {} {} x {} ({} experts) over X of {} x {}, {} pairs, output stride {ys}",
                w.ty.name(),
                w.rows,
                w.cols,
                w.n_experts,
                gx.rows,
                gx.cols,
                groups.npairs
            )));
        }
        let bm = 16 * groups.nt;
        let wide = TMA_WIDE.get();
        let st = t8_stages(bm, wide);
        let sm = t8_smem(bm, st);
        let name = format!("mmg_t8{}_iq4_xs_{bm}", if wide { "w" } else { "" });
        if sm > self.smem_optin() {
            return Err(CudaError::Shape(format!("{name}: {sm} bytes of shared memory")));
        }
        let tw = tensor_map(
            Dt::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            w.ptr,
            &[w.row_bytes as u64, w.rows as u64, w.n_experts as u64],
            &[w.row_bytes as u64, w.expert_stride as u64],
            &[WP as u32, BR as u32, 1],
        )?;
        let tx = tensor_map(Dt::CU_TENSOR_MAP_DATA_TYPE_UINT8, self.ptr(&gx.xq), &[gx.cols as u64, gx.rows as u64], &[gx.cols as u64], &[256, bm as u32])?;
        let ts = tensor_map(Dt::CU_TENSOR_MAP_DATA_TYPE_UINT64, self.ptr(&gx.s), &[(gx.cols / 32) as u64, gx.rows as u64], &[(gx.cols / 32 * 8) as u64], &[SP as u32, bm as u32])?;
        self.launch(
            &name,
            (w.rows.div_ceil(BR) as u32, groups.max_tiles as u32, 1),
            if wide { 128 } else { 256 },
            sm as u32,
            &[
                Arg::M(tw),
                Arg::M(tx),
                Arg::M(ts),
                Arg::I(w.rows as i32),
                Arg::I(w.cols as i32),
                Arg::P(y),
                Arg::L(ys as i64),
                Arg::P(self.ptr(&groups.tiles)),
                Arg::P(self.ptr(&groups.ntiles)),
                Arg::P(self.ptr(&groups.list)),
                Arg::I(st as i32),
            ],
        )
    }
}
